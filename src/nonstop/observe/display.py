"""What ``nonstop run`` shows: rank output with a prefix, recovery notices, live progress, summary."""

from __future__ import annotations

import sys
import time
from typing import Any

from rich.console import Console
from rich.live import Live
from rich.table import Table
from rich.text import Text

from ..errors import one_line
from .incidents import PHASES


class Display:
    def __init__(self, quiet: bool = False, live: bool | None = None, status_every_s: float = 2.0):
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True,
                               width=None if sys.stdout.isatty() else 160)
        self.quiet = quiet
        self.live_enabled = self.console.is_terminal if live is None else live
        self.status_every_s = status_every_s
        self._live: Live | None = None
        self._last_status = 0.0
        self._last_line = ""

    def start(self) -> None:
        if self.live_enabled and not self.quiet:
            self._live = Live(Text(""), console=self.console, refresh_per_second=4, transient=True)
            self._live.start()

    def stop(self) -> None:
        if self._live is not None:
            self._live.stop()
            self._live = None

    def worker_line(self, label: str, text: str) -> None:
        if not self.quiet:
            self.console.print(Text(f"[{label}] ", style="dim") + Text(text))

    def info(self, text: str) -> None:
        if not self.quiet:
            self.console.print(Text("nonstop: ", style="bold cyan") + Text(text))

    def warning(self, text: str) -> None:
        """One line on stderr, shown even with --quiet: something the user must change."""
        Console(file=sys.stderr, highlight=False, soft_wrap=True).print(
            Text("nonstop: warning: ", style="bold yellow") + Text(one_line(text)))

    def error(self, text: str) -> None:
        Console(file=sys.stderr, highlight=False, soft_wrap=True).print(
            Text("nonstop: error: ", style="bold red") + Text(one_line(text)))

    def wants_status(self, now: float) -> bool:
        """Whether a status line would be shown now (its snapshot walks every rank: a job of
        16,384 ranks builds it only when it is shown)."""
        return self._live is not None or not (self.quiet or
                                              now - self._last_status < self.status_every_s)

    def status(self, snap: dict[str, Any]) -> None:
        line = format_status(snap)
        if self._live is not None:
            self._live.update(Text(line, style="bold"))
            return
        now = time.time()
        if not self.wants_status(now) or line == self._last_line:
            return
        self._last_status, self._last_line = now, line
        self.console.print(Text("nonstop: ", style="bold cyan") + Text(line, style="dim"))

    def summary(self, summary: dict[str, Any]) -> None:
        print_summary(self.console, summary)


def format_status(snap: dict[str, Any]) -> str:
    steps = [r["step"] for r in snap["ranks"] if r["step"] is not None]
    losses = [r["loss"] for r in snap["ranks"] if r.get("loss") is not None]
    alive = sum(r["alive"] for r in snap["ranks"])
    parts = [f"generation {snap['gen']}", snap["phase"],
             f"step {min(steps) if steps else '-'}",
             f"ranks {alive}/{len(snap['ranks'])}",
             f"spares {snap['spares_ready']}/{snap['spares']} ready",
             f"incidents {snap['incidents']}"]
    if losses:
        parts.insert(3, f"loss {losses[0]:.4g}")
    return " | ".join(parts)


def print_summary(console: Console, summary: dict[str, Any]) -> None:
    incidents = summary.get("incident_list", [])
    if incidents:
        table = Table(title="incidents", title_justify="left")
        for col in ("#", "fault", "recovery", "MTTR s", *PHASES, "lost"):
            table.add_column(col, justify="right" if col not in ("fault", "recovery") else "left")
        for inc in incidents:
            phases = inc.get("phases_s", {})
            mttr = inc.get("mttr_s")
            table.add_row(str(inc["id"]), "; ".join(inc["faults"])[:60], ", ".join(inc["levels"]),
                          "-" if mttr is None else f"{mttr:.3f}",
                          *[f"{phases.get(p, 0):.3f}" for p in PHASES],
                          _lost(inc))
        console.print(table)
    mttr = summary.get("mttr_s")
    goodput = summary.get("goodput")
    earlier = summary.get("incidents_earlier") or 0
    whole = summary.get("in_office_s") is not None  # the controllers before this one counted too
    lines = [f"incidents: {summary['incidents']}" + (
        f" ({earlier} before this controller took office)" if earlier and whole else
        f" ({earlier} before this controller took office: in the event logs of their controllers' "
        "hosts; the figures below are this controller's)" if earlier else "")]
    if mttr:
        lines.append(f"MTTR median {mttr['median']:.3f} s (min {mttr['min']:.3f}, max {mttr['max']:.3f})")
    lost = summary.get("steps_lost")
    cont = summary.get("continues")
    lines.append(f"steps lost: {'unknown' if lost is None else lost}"
                 + (f" ({cont['steps_lost']} on resuming)" if cont and cont.get("steps_lost") else ""))
    lines.append(f"goodput: {'unknown' if goodput is None else f'{goodput:.1%}'}")
    checkpoints = (summary.get("state") or {}).get("checkpoint")
    if checkpoints:
        lines.append(format_checkpoints(checkpoints))
    replicas = (summary.get("state") or {}).get("replicas")
    if replicas and replicas.get("held_bytes"):
        lines.append(format_replicas(replicas))
    if summary.get("sdc"):
        lines.append(sdc_text(summary["sdc"]))
    if summary.get("store"):
        lines.append(store_text(summary["store"]))
    wall = f"wall: {summary['wall_s']:.1f} s"
    if (summary.get("finish_s") or 0) >= 1:  # waiting at the end (for checkpoints, ranks)
        wall += f" ({summary['finish_s']:.1f} s after training)"
    lines.append(wall)
    if cont:
        lines.append(continuation_text(cont))
    console.print(Text("nonstop summary: ", style="bold") + Text(" | ".join(lines)))
    if summary.get("time_s"):
        console.print(Text("time: ", style="bold") + Text(account_text(summary["time_s"])))


def account_text(cats: dict[str, Any]) -> str:
    """The goodput account in one line: each category's seconds, largest first (recovery as
    one, its phases after it)."""
    rec = cats.get("recovery") or {}
    flat = {k: v for k, v in cats.items() if not isinstance(v, dict)}
    flat["recovery"] = sum(rec.values())
    parts = []
    for name, secs in sorted(flat.items(), key=lambda kv: -kv[1]):
        if secs < 0.0005:
            continue
        part = f"{name} {secs:.3f} s"
        if name == "recovery":
            part += " (" + ", ".join(f"{p} {v:.3f}" for p, v in rec.items() if v >= 0.0005) + ")"
        parts.append(part)
    return ", ".join(parts) or "-"


def store_text(store: dict[str, Any]) -> str:
    """etcd's outages in the summary: how long, and whether it was back at the end."""
    times = f"{store['outages']} times, " if store["outages"] > 1 else ""
    away = f"store: etcd out of reach ({times}{store['out_of_reach_s']:.1f} s"
    return away + ("), back" if store["back"] else f"; {store['error']}), not back at the end")


def sdc_text(sdc: dict[str, Any]) -> str:
    """The replicas' comparisons in one phrase: the certificate, or what was found."""
    replays = _replays_text(sdc)
    if not sdc.get("checks") and not sdc.get("mismatches"):
        why = sdc.get("uncompared")
        text = f"replicas: not compared ({why})" if why else "replicas: not compared"
        return text + replays
    found = sdc.get("found") or []
    diverged = [f for f in found if f.get("verdict") == "divergence"]
    if diverged:
        return ("the replicas diverged at step " + ", ".join(str(f["step"]) for f in diverged)
                + " (they do not compute the same thing: the weights are not certified)")
    kept = [f for f in found if not f.get("repaired", True)]
    if kept:
        return ("replicas differed at step(s) " + ", ".join(str(f["step"]) for f in kept)
                + " (reported only: the weights are not certified)")
    if sdc.get("checks"):
        text = (f"every step's weights agreed across replicas ({sdc['checks']} checks to step "
                f"{sdc['last_step']}, chain {(sdc.get('chain') or '')[:12]})")
    else:
        text = f"replicas: not compared ({sdc.get('uncompared') or 'no twin'})"
    if found:
        named = sorted({f["attributed"] for f in found if f.get("attributed") is not None})
        text += (f"; {len(found)} corruption(s) found and repaired ("
                 + (f"the replay named rank(s) {', '.join(map(str, named))}" if named
                    else "no rank named") + ")")
    return text + replays


def _replays_text(sdc: dict[str, Any]) -> str:
    if not sdc.get("replays"):
        return ""
    pct = sdc.get("replay_pct")
    return (f"; {sdc['replays']} replay check(s), {sdc['replay_s']:.2f} s"
            + (f" ({pct:.1f}% of step time)" if pct is not None else ""))


def _lost(inc: dict[str, Any]) -> str:
    if inc.get("steps_lost") is not None:
        return str(inc["steps_lost"])
    return "unknown" if inc.get("outcome", "recovered") == "recovered" else "-"


def continuation_text(cont: dict[str, Any]) -> str:
    """An attempt after the first, in words: where the earlier ones got, where this one began."""
    def step(value: Any) -> str:
        return "an unknown step" if value is None else f"step {value}"

    if cont["attempt"] == 1:
        return (f"resumed at {step(cont.get('resumed_step'))} from a run this directory has no "
                "record of: steps redone unknown")
    text = (f"attempt {cont['attempt']}: the earlier attempt(s) reached "
            f"{step(cont.get('previous_step'))}, this one resumed at {step(cont.get('resumed_step'))}")
    lost = cont.get("steps_lost")
    return text + (f" ({lost} steps redone)" if lost else "")


def print_history(console: Console, attempts: list[dict[str, Any]]) -> None:
    """One line per attempt of a run directory (``events.attempts``)."""
    for a in attempts:
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(a["t_start"])) \
            if a.get("t_start") else "?"
        steps = "unknown" if a.get("steps") is None else a["steps"]
        if a.get("ended"):
            s = a.get("summary") or {}
            lost = s.get("steps_lost")
            goodput = s.get("goodput")
            end = (f"exit {a['exit_code']}, reached step {steps}, {s.get('incidents', 0)} "
                   f"incident(s), steps lost {'unknown' if lost is None else lost}, goodput "
                   f"{'unknown' if goodput is None else f'{goodput:.1%}'}")
            if a.get("diagnosis"):
                end += f": {a['diagnosis']}"
        elif a.get("stepped_down"):
            end = (f"its controller stepped down ({a['stepped_down']}): the job went on with a "
                   f"successor; reached at least step {steps} here")
        else:
            end = f"no summary (its launcher was killed), reached at least step {steps}"
        console.print(Text(f"attempt {a['attempt']} ({started}): ", style="bold") + Text(end))


def format_replicas(reps: dict[str, Any]) -> str:
    """``replicas: 2 per snapshot, 12.5 MiB held per node at most (6.2 MiB a copy)``: the memory
    the copies of other nodes' snapshots take, on the node that holds the most."""
    held = reps["held_bytes"]
    most = max(held.values())
    copies = reps.get("copies") or 1
    return (f"replicas: {copies} per snapshot, {_mib(most)} held per node at most "
            f"({_mib(most / copies)} a copy)")


def _mib(n: float) -> str:
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB"


def format_checkpoints(ck: dict[str, Any]) -> str:
    """``checkpoints: 3 written, 5 failed (No space left on device), newest complete: step 30``"""
    text = f"checkpoints: {ck.get('written', 0)} written"
    if ck.get("failed"):
        causes = ", ".join(sorted(ck.get("causes") or {}, key=lambda c: -ck["causes"][c]))
        text += f", {ck['failed']} failed" + (f" ({causes})" if causes else "")
    newest = ck.get("newest_complete")
    return text + (f", newest complete: step {newest}" if newest is not None else
                   ", none complete")
