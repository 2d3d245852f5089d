"""The run's summary, as its controller ends it: incidents, goodput, where the time went - into
the event log, ``summary.json`` and the console."""

from __future__ import annotations

import json
import sys
import time
from pathlib import Path
from typing import Any

from ..observe import incidents


def time_account(controller: Any, records: list[dict[str, Any]], t_end: float) -> dict[str, Any]:
    """The goodput account of the controller's time (``observe.goodput``): ``time_s`` by
    category, ``goodput``, and each incident's ``recomputed_s`` added to its record."""
    from ..observe import goodput

    controller.progress.close()
    controller.status.maybe(controller, t_end, force=True)  # the job is over
    # across hosts, the whole job's: what the controllers before this one counted too
    acct, cats = controller.job_account.count(
        t_end, records, controller.incident, controller.outcome.t_train_end,
        final_checkpoint=controller.reports.final_persist is not None)
    costs = {x["id"]: x for x in acct["by_incident"]}
    for rec in records:
        if rec["id"] in costs:
            rec["recomputed_s"] = costs[rec["id"]]["recomputed_s"]
    known = controller.ledger.steps_known()
    wall = goodput.total(cats)
    productive = cats.get("productive", 0.0)
    return {"time_s": cats,
            "goodput": (round(productive / wall, 4) if wall > 0 else None) if known else None}


def report(controller: Any, log: Any, run_dir: Path, code: int, display: Any) -> dict[str, Any]:
    """The run's summary: into the event log, summary.json and the console."""
    t_exit = time.time()
    train_end = controller.outcome.t_train_end or t_exit
    ledger = controller.ledger
    records = ledger.incident_records(controller.incidents)
    account = controller.job_account  # across hosts: with the controllers before this one
    earlier_records = account.earlier_incidents()
    t_start = account.job_start
    summary = incidents.summarize(earlier_records + records, train_end - t_start,
                                  ledger.productive_s(controller.workers.values()),
                                  ledger.steps_reached(controller.max_step), code,
                                  continues=incidents.continuation(log.previous, ledger.resumed_step))
    summary["wall_s"] = round(t_exit - t_start, 3)
    summary.update(time_account(controller, records, t_exit))
    if account.before:  # the job's, from its first controller's start (this one's: below)
        summary["in_office_s"] = round(t_exit - account.t_start, 3)
        summary["incident_list"] = earlier_records + records
    summary["finish_s"] = round(t_exit - train_end, 3)
    summary["run_dir"] = str(run_dir)
    summary["diagnosis"] = controller.outcome.diagnosis
    summary["state"] = dict(controller.memory.summary(), snapshot=controller.reports.snap_stats)
    summary["sdc"] = controller.sdc.summary()
    if controller.outcome.store is not None:  # across hosts: etcd was out of reach
        summary["store"] = controller.outcome.store
    earlier = controller.book.base  # across hosts: incidents of the controllers before this one
    if earlier:
        summary["incidents"] = earlier + len(records)  # (a record each, when the journal held them)
        summary["incidents_earlier"] = earlier
    log.write("run_end", **{k: v for k, v in summary.items() if k != "incident_list"})
    log.close()
    (run_dir / "summary.json").write_text(json.dumps(summary, indent=2, default=str))
    if not controller.outcome.usage_error:
        display.summary(summary)
    tb = controller.outcome.traceback
    if tb:
        sys.stderr.write(tb if tb.endswith("\n") else tb + "\n")
    if code != 0 and controller.outcome.diagnosis:
        display.error(controller.outcome.diagnosis)
    return summary
