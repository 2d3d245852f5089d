"""What every benchmark needs: run a job as a child process, read its step log, compare weights."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

from nonstop.agent import loopback

JOB = Path(__file__).resolve().parent / "job.py"


def run_child(cmd: list[str], log: Path, timeout_s: float, env: dict[str, str] | None = None,
              until: Callable[[subprocess.Popen], bool] | None = None,
              started: list[subprocess.Popen] | None = None) -> int:
    """Run a command in its own session, output to ``log``; end it (and its children) on timeout.
    ``until``: asked every 20 ms while the command runs, until it says True (a moment to note).
    ``started``: the process is put there, for a caller in another thread to end (``end``)."""
    # torchrun's ranks as nonstop's: gloo listens on loopback (torchrun's own store, the baseline's,
    # listens on every interface whatever it is told)
    env = loopback.pin(dict(os.environ if env is None else env))
    deadline = time.monotonic() + timeout_s
    with open(log, "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True, env=env)
        if started is not None:
            started.append(proc)
        try:
            while until is not None and proc.poll() is None and time.monotonic() < deadline \
                    and not until(proc):
                time.sleep(0.02)
            return proc.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
            return -9
        finally:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(timeout=30)


def end(procs: list[subprocess.Popen]) -> None:
    """End each process ``run_child`` started (its session whole), by its pid, if it still runs."""
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def cpu_s_below(root: int, with_root: bool = False) -> float:
    """CPU seconds (user and system, with those of their ended children) of every process below
    ``root`` now (and of ``root``'s own with ``with_root``), etcd's aside (Linux: /proc)."""
    tick = os.sysconf("SC_CLK_TCK")
    parent: dict[int, int] = {}
    cpu: dict[int, float] = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                stat = f.read()
        except OSError:
            continue
        comm = stat[stat.index("(") + 1:stat.rindex(")")]
        fields = stat[stat.rindex(")") + 2:].split()
        parent[int(name)] = -1 if comm == "etcd" else int(fields[1])  # its subtree left out
        cpu[int(name)] = sum(int(x) for x in fields[11:15]) / tick
    below, frontier = {root} if with_root else set(), {root}
    while frontier:
        frontier = {p for p, pp in parent.items() if pp in frontier} - below
        below |= frontier
    return round(sum(cpu[p] for p in below), 2)


def read_steps(out: Path) -> dict[int, list[tuple[int, float, int]]]:
    """rank -> [(steps done, time, generation)] in file order (attempts append to one file)."""
    result: dict[int, list[tuple[int, float, int]]] = {}
    for f in sorted(out.glob("steps-r*.txt")):
        rank = int(f.stem.split("-r")[1])
        rows = []
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 3:
                rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        result[rank] = rows
    return result


def recovery(steps: dict[int, list[tuple[int, float, int]]], t_kill: float) -> dict[str, Any]:
    """MTTR (kill -> a step completed by every rank in a later generation than the one killed)
    and steps lost (steps done before the kill minus the step the job resumed from)."""
    killed_gen = max((g for rows in steps.values() for _, t, g in rows if t < t_kill), default=0)
    done_before = max((s for rows in steps.values() for s, t, g in rows if g <= killed_gen),
                      default=0)
    firsts, resumed = [], []
    for rows in steps.values():
        after = [(s, t) for s, t, g in rows if g > killed_gen]
        if not after:
            return {"mttr_s": None, "lost_steps": None}
        s, t = min(after, key=lambda x: x[1])
        firsts.append(t)
        resumed.append(s - 1)  # that step started from s-1 steps done
    return {"mttr_s": max(firsts) - t_kill, "lost_steps": max(0, done_before - min(resumed)),
            "done_before": done_before, "resumed_at": min(resumed)}


def params_equal(a: Path, b: Path) -> bool:
    import torch

    if not a.exists() or not b.exists():
        return False
    x, y = torch.load(a), torch.load(b)
    return x.keys() == y.keys() and all(
        x[k].dtype == y[k].dtype and x[k].shape == y[k].shape
        and torch.equal(x[k].reshape(-1).view(torch.uint8), y[k].reshape(-1).view(torch.uint8))
        for k in x)


def stats(values: list[float]) -> dict[str, float | None]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None}
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4),
            "max": round(max(vals), 4)}


def setup(args: Any, known: tuple[str, ...]) -> tuple[list[str], Path, Any]:
    """Check a bench's common arguments; returns (systems, base directory, say)."""
    from nonstop.errors import UsageError

    systems = [s.strip() for s in args.systems.split(",") if s.strip()]
    unknown = [s for s in systems if s not in known]
    if unknown:
        raise UsageError(f"unknown system(s) {', '.join(unknown)} (known: {', '.join(known)})")
    if args.ranks < 2 or args.repeat < 1:
        raise UsageError("--ranks must be at least 2 and --repeat at least 1")
    if not 0 < args.kill_step < args.steps:
        raise UsageError("--kill-step must lie inside the run (0 < kill-step < steps)")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-bench-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    return systems, base, say


def reference_weights(ref: dict[str, Any], out: Path, say: Any) -> Path | None:
    """The final weights of the fault-free reference run that wrote ``out``; None (and said why)
    when that run failed, since nothing can be compared with it then."""
    if ref["exit_code"] != 0:
        say(f"the fault-free reference run failed; see {out / 'output.log'}")
        return None
    return out / "final.pt"


def fresh(out: Path) -> None:
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)


def torchrun_cmd(ranks: int, *job: str, restarts: int = 3) -> list[str]:
    """torchrun as well as it can: 3 restarts, its fastest monitor interval (the default)."""
    return [sys.executable, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={ranks}", f"--max-restarts={restarts}", "--monitor-interval=0.1",
            *job]


def nonstop_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "nonstop", "run", "--quiet", *args]


class JsonlTail:
    """A JSON-lines file that grows (an event log), read as it grows: each call parses only what
    was appended since (a test polling a log of thousands of events every 50 ms re-parsed all of
    them each time: a tenth of the suite's CPU). A line not yet complete waits for its end; a file
    that shrank (written anew) is read from its start."""

    def __init__(self, path: Path):
        self.path = Path(path)
        self._offset = 0
        self._records: list[dict[str, Any]] = []

    def records(self) -> list[dict[str, Any]]:
        """Every complete record so far, in order (the same list, grown)."""
        try:
            size = self.path.stat().st_size
        except FileNotFoundError:
            return self._records
        if size < self._offset:
            self._offset, self._records = 0, []
        if size == self._offset:
            return self._records
        with open(self.path, "rb") as f:
            f.seek(self._offset)
            data = f.read()
        end = data.rfind(b"\n") + 1
        for line in data[:end].splitlines():
            if line.strip():
                try:
                    self._records.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
        self._offset += end
        return self._records


def events(run_dir: Path) -> Iterator[dict[str, Any]]:
    path = run_dir / "events.jsonl"
    if path.exists():
        for line in path.read_text().splitlines():
            if line.strip():
                yield json.loads(line)


def inject_time(run_dir: Path) -> float | None:
    for ev in events(run_dir):
        if ev.get("type") == "rank_inject":
            return ev["t"]
    return None


def restore_source(run_dir: Path, rank: int) -> str | None:
    """Where ``rank``'s state came from in the first restore after generation 0 (live: a peer's
    or a twin's memory, memory: its node's snapshot, buddy, disk)."""
    for ev in events(run_dir):
        if ev.get("type") == "restore" and ev.get("gen", 0) > 0:
            source = (ev.get("sources") or {}).get(str(rank))
            return source if isinstance(source, str) else None
    return None


def spare_refill_s(run_dir: Path, t_fault: float) -> float | None:
    """Seconds from the fault to the first warm spare started after it being ready: the pool
    refilled (None: no spare was started after the fault, or none became ready)."""
    new: set[int] = set()
    for ev in events(run_dir):
        if ev.get("type") == "spawn" and ev.get("spare") and ev["t"] >= t_fault:
            new.add(ev.get("wid"))
        elif ev.get("type") == "rank_ready" and ev.get("wid") in new:
            return round(ev["t"] - t_fault, 4)
    return None


def measure(system: str, cmd: list[str], out: Path, timeout_s: float) -> dict[str, Any]:
    """Run one job and measure its recovery from the step logs. The fault's moment comes from
    the job itself (torchrun: ``kill.txt``) or from nonstop's event log (the injection)."""
    code = run_child(cmd, out / "output.log", timeout_s)
    result: dict[str, Any] = {"system": system, "exit_code": code}
    if system == "reference":
        return result
    if system == "torchrun":
        kill_file = out / "kill.txt"
        t_fault = float(kill_file.read_text()) if kill_file.exists() else None
    else:
        t_fault = inject_time(out / "run")
    if t_fault is None:
        result.update(mttr_s=None, lost_steps=None)
    else:
        result.update(recovery(read_steps(out), t_fault))
        if system != "torchrun":
            result["spare_refill_s"] = spare_refill_s(out / "run", t_fault)
    return result


def aggregate(system: str, runs: list[dict[str, Any]], extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """One system's repeats -> the JSON shape every benchmark shares."""
    lost = [r["lost_steps"] for r in runs if r["lost_steps"] is not None]
    out: dict[str, Any] = {
        "system": system,
        "mttr_s": stats([r["mttr_s"] for r in runs]),
        "lost_steps": {"max": max(lost) if len(lost) == len(runs) else None},
        "params_match_reference": all(r["params_match_reference"] for r in runs),
    }
    for key in extra:
        vals = [r.get(key) for r in runs if r.get(key) is not None]
        out[key] = stats(vals) if vals else None
    out["runs"] = runs
    return out


def table(summary: dict[str, Any], extra: tuple[str, ...] = ()) -> str:
    layouts = any("parallel" in r for r in summary["results"])
    head = ("| layout " if layouts else "") + \
        "| system | MTTR median s | min | max | steps lost (max) | weights match |"
    rule = ("|---" if layouts else "") + "|---|---|---|---|---|---|"
    for key in extra:
        head += f" {key} (median) |"
        rule += "---|"
    if any("restore_source" in r for r in summary["results"]):
        head += " restored from |"
        rule += "---|"
    lines = [head, rule]
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    for r in summary["results"]:
        m = r["mttr_s"]
        row = (f"| {r['parallel']} " if layouts else "") + (
            f"| {r['system']} | {fmt(m['median'])} | {fmt(m['min'])} | {fmt(m['max'])} | "
            f"{r['lost_steps']['max']} | {r['params_match_reference']} |")
        for key in extra:
            row += f" {fmt((r.get(key) or {}).get('median'))} |"
        if "restore_source" in r:
            row += f" {r['restore_source'] or '-'} |"
        lines.append(row)
    return "\n".join(lines)


def mttr_ratio(results: list[dict[str, Any]], slower: str, faster: str) -> float | None:
    """``slower``'s median MTTR over ``faster``'s, when both ran and recovered."""
    by = {r["system"]: r for r in results}
    if slower not in by or faster not in by:
        return None
    a, b = by[slower]["mttr_s"]["median"], by[faster]["mttr_s"]["median"]
    return round(a / b, 1) if a and b else None


def conclude(summary: dict[str, Any], text: str, base: Path, args: Any, say: Any) -> int:
    """A bench's end: its table said, its runs removed unless kept (``--out``), its JSON last."""
    say(text)
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    emit(summary, args.json)
    return 0


def emit(result: dict[str, Any], as_json: bool) -> None:
    if as_json:
        sys.stdout.write(json.dumps(result) + "\n")
    sys.stdout.flush()


def now_stamp() -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S")
