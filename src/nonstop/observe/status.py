"""A running job's status, for ``nonstop status`` in another terminal.

The controller writes ``<run-dir>/status.json`` twice a second (replaced whole, never torn) and,
across hosts, puts the same record in etcd (``keys.status``): its generation, ranks, hosts,
spares, the step and the rate, the open incident and its phase, the budgets left. ``nonstop
status RUN_DIR`` (or ``--rdzv-endpoint ... --rdzv-id JOB``) shows it, refreshed live, or once as
JSON with ``--json``.
"""

from __future__ import annotations

import collections
import json
import os
import time
from pathlib import Path
from typing import Any

from .incidents import PHASES

FILENAME = "status.json"
EVERY_S = 0.5
EVERY_PER_RANK_S = 0.25e-3  # ...a big job's less often: 16,384 ranks every 4 s (a status of 1.5 MB)
RATE_WINDOW_S = 10.0  # the step rate is measured over this much of rank 0's recent progress
STALE_S = 5.0  # a status older than this (while not over) says the controller is not writing


def open_phase(inc: Any) -> str:
    """The phase an open incident is in: the first whose end it has not reached."""
    ends = [inc.t_detect, inc.t_decide, inc.t_torn, inc.t_assigned, inc.t_pg, inc.t_restored,
            inc.t_first_step]
    for name, end in zip(PHASES, ends):
        if end is None:
            return name
    return PHASES[-1]


def rate(samples: list[dict[str, Any]], now: float) -> float | None:
    """Rank 0's steps per second over the recent window (its current process)."""
    recent = [s for s in samples[-400:] if s["t"] >= now - RATE_WINDOW_S]
    if len(recent) < 2:
        return None
    same = [s for s in recent if s["wid"] == recent[-1]["wid"] and s["gen"] == recent[-1]["gen"]]
    if len(same) < 2 or same[-1]["t"] <= same[0]["t"]:
        return None
    return round((same[-1]["step"] - same[0]["step"]) / (same[-1]["t"] - same[0]["t"]), 3)


def snapshot(controller: Any, now: float | None = None) -> dict[str, Any]:
    """The controller's job as ``nonstop status`` shows it."""
    from ..decide.ladder import _FIELD, LADDER

    now = time.time() if now is None else now
    table = controller.table.status(controller.plan)
    nodes = controller.gens.node_of()
    gen = controller.gen
    for r in table["ranks"]:
        w = controller.workers[r["wid"]]
        r["node"] = nodes.get(r["rank"])
        # how far it is in the current generation: a long rendezvous or restore shows progress
        r["state"] = ("dead" if w.dead else "stepping" if w.first_gen == gen else
                      "entered" if w.entered == gen else "joining" if w.joining == gen else
                      "assigned")
    inc = controller.incident
    levels = controller.policy.levels
    budgets = {lv.value: max(0, getattr(levels, _FIELD[lv]).budget - controller.counters.used(lv))
               for lv in LADDER}
    spares = [w for w in controller.workers.values() if w.spare and not w.dead]
    used = set(nodes.values())
    isolated = set(controller.counters.isolated)
    return {
        "t": now, "t_start": controller.job_account.t_start, "pid": os.getpid(),
        "gen": controller.gen, "phase": str(controller.phase), "world": len(controller.plan),
        "gen_age_s": round(now - controller.state.t_gen, 3) if controller.state.t_gen else None,
        "ranks": table["ranks"],
        "nodes": {"total": controller.total_nodes, "with_ranks": len(used),
                  "spare": max(0, controller.total_nodes - len(used | isolated)),
                  "isolated": sorted(isolated)},
        "spares": {"total": table["spares"], "ready": table["spares_ready"],
                   "by_node": {str(n): k for n, k in
                               sorted(collections.Counter(w.node for w in spares).items())}},
        "step": controller.max_step, "rate_steps_per_s": rate(controller.progress.rank0, now),
        "incidents": controller.book.count,
        "incident": None if inc is None else {
            "id": inc.id, "faults": inc.faults or inc.symptoms[:1], "phase": open_phase(inc),
            "since_s": round(now - inc.t_fault, 3), "levels": inc.levels},
        "budgets": budgets,
        "over": controller.outcome.exit_code is not None,
        "exit_code": controller.outcome.exit_code,
    }


class StatusWriter:
    """``status.json`` in the run directory, at most every ``EVERY_S`` (a job of more than 2,000
    ranks less often: ``EVERY_PER_RANK_S`` a rank) and once at the end."""

    def __init__(self, run_dir: Any, publish: Any = None):
        self.path = None if run_dir is None else Path(run_dir) / FILENAME
        self.publish = publish  # across hosts: also to etcd (a callable taking the JSON text)
        self._next = 0.0

    def maybe(self, controller: Any, now: float, force: bool = False) -> None:
        if now < self._next and not force:
            return
        self._next = now + max(EVERY_S, EVERY_PER_RANK_S * len(controller.plan))
        try:
            text = json.dumps(snapshot(controller, now), default=str)
        except Exception:  # noqa: BLE001 - the status must never stop the job
            return
        if self.path is not None:
            tmp = self.path.with_suffix(".tmp")
            try:
                tmp.write_text(text)
                os.replace(tmp, self.path)
            except OSError:
                pass
        if self.publish is not None:
            try:
                self.publish(text)
            except Exception:  # noqa: BLE001 - etcd away: the next one will do
                pass


# == nonstop status ==============================================================================
def read_file(run_dir: str) -> dict[str, Any]:
    from ..errors import UsageError

    p = Path(run_dir)
    path = p / FILENAME if p.is_dir() else p
    if not p.exists():
        raise UsageError(f"no run at {run_dir}")
    if not path.is_file():
        raise UsageError(f"no status at {run_dir}: the job has not started, or its run directory "
                         "is from a version of nonstop that wrote none")
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise UsageError(f"cannot read {path}: {exc}") from None


def render(st: dict[str, Any], now: float | None = None) -> Any:
    """The status as a rich renderable: a header and a table of ranks."""
    from rich.console import Group
    from rich.table import Table
    from rich.text import Text

    now = time.time() if now is None else now
    age = now - st.get("t", now)
    phase = st["phase"]
    if phase in ("rendezvous", "starting") and st.get("gen_age_s") is not None:
        inside = sum(r.get("state") in ("entered", "stepping") for r in st["ranks"])
        phase += f" {st['gen_age_s']:.1f} s ({inside}/{len(st['ranks'])} ranks in)"
    head = [f"generation {st['gen']}", phase, f"step {st['step']}"]
    if st.get("rate_steps_per_s"):
        head.append(f"{st['rate_steps_per_s']:.2f} steps/s")
    alive = sum(r["alive"] for r in st["ranks"])
    head.append(f"ranks {alive}/{st['world']}")
    nodes = st.get("nodes") or {}
    if (nodes.get("total") or 1) > 1:
        head.append(f"hosts {nodes['with_ranks']} with ranks, {nodes['spare']} spare"
                    + (f", {len(nodes['isolated'])} isolated" if nodes.get("isolated") else ""))
    sp = st.get("spares") or {}
    head.append(f"spares {sp.get('ready', 0)}/{sp.get('total', 0)} ready")
    head.append(f"incidents {st['incidents']}")
    if st.get("hosts_wanted"):  # across hosts, before the job starts
        head = [f"waiting for hosts: {st['hosts_joined']}/{st['hosts_wanted']} joined "
                f"({st['waited_s']:.0f} s of {st['limit_s']:.0f} s)"]
    lines = [Text(" | ".join(head), style="bold")]
    inc = st.get("incident")
    if inc:
        lines.append(Text(f"incident {inc['id']} open for {inc['since_s']:.1f} s, in {inc['phase']}"
                          f": {'; '.join(inc['faults'])[:80]}", style="yellow"))
    if st.get("over"):
        lines.append(Text(f"the job has ended (exit code {st.get('exit_code')})"))
    elif age > STALE_S:
        lines.append(Text(f"no news from the controller for {age:.0f} s", style="red"))
    budgets = st.get("budgets") or {}
    if budgets:
        lines.append(Text("budgets left: " + ", ".join(f"{k} {v}" for k, v in budgets.items())))
    if not st["ranks"]:
        return Group(*lines)
    table = Table(show_edge=False, pad_edge=False)
    for col in ("rank", "node", "worker", "state", "step", "loss"):
        table.add_column(col, justify="right")
    for r in st["ranks"]:
        loss = r.get("loss")
        table.add_row(str(r["rank"]), "-" if r.get("node") is None else str(r["node"]),
                      str(r["wid"]), r.get("state") or ("alive" if r["alive"] else "dead"),
                      "-" if r.get("step") is None else str(r["step"]),
                      "-" if loss is None else f"{loss:.4g}")
    return Group(*lines, table)


def show(fetch: Any, as_json: bool, watch: bool, interval_s: float = 1.0,
         limit_s: float | None = None) -> int:
    """Print the status ``fetch()`` returns: once (``--json`` or not watching), or live until
    the job is over, Ctrl-C, or ``limit_s``."""
    st = fetch()
    if as_json:
        print(json.dumps(st, default=str))
        return 0
    from rich.console import Console
    from rich.live import Live

    console = Console()
    if not watch or st.get("over"):
        console.print(render(st))
        return 0
    t_end = None if limit_s is None else time.monotonic() + limit_s
    try:
        with Live(render(st), console=console, refresh_per_second=4) as live:
            while not st.get("over") and (t_end is None or time.monotonic() < t_end):
                time.sleep(interval_s)
                st = fetch()
                live.update(render(st))
    except KeyboardInterrupt:
        pass
    return 0
