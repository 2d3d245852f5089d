"""``nonstop bench state``: what keeping the training state in memory costs and buys.

Three measurements, each with bench/job.py (and, with ``--device cuda``, a fourth in this process
on the GPU: ``state_device.py``):

- snapshot cost: the big model (``--hidden``/``--layers``) on ``--ranks`` ranks over 2 nodes
  (snapshots replicated to the buddy node), snapshots off (policy) vs on (``auto``): step times
  from rank 0's step log, and the runtime's own account from summary.json;
- restore times of the sharded job (``--snapshot-every 1``) for the last rank, from its node's
  memory (a crashed rank, warm spare), from the replica on the buddy node (its whole node lost,
  no spare node: job restart) and from a disk checkpoint (launcher SIGKILLed after the first
  checkpoint, page cache dropped, the same job started again);
- a job restart (every rank restarted) of the small job: nonstop from its snapshots vs torchrun
  from a checkpoint every 20 steps, MTTR and steps lost as in ``bench crash``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from nonstop.errors import UsageError
from . import common, crash

SYSTEMS = ("nonstop", "torchrun")
PHASES = ("snapshot", "restore", "restart", "device")
DEFAULT_PHASES = "snapshot,restore,restart"  # the CLI's default: with --device cuda, "device"
WARMUP = 4  # step durations of rank 0 left out of the step time (start-up, the first snapshots)
NO_SNAPSHOTS = "state:\n  snapshot:\n    enabled: false\n"
JOB_RESTART = "recover:\n  levels:\n    rank_replacement:\n      enabled: false\n"


def param_count(inputs: int, hidden: int, layers: int) -> int:
    return inputs * hidden + hidden + layers * (hidden * hidden + hidden) + hidden + 1


def _timeout(args: argparse.Namespace, steps: int) -> float:
    """A generous limit for a run of the big model: start-up, then 1 s a step per 4M parameters
    (measured on 2 cores: ~2.5 s a step at 100M, ~10 s while snapshotting every step)."""
    return 180.0 + steps * max(1.0, param_count(32, args.hidden, args.layers) / 4e6)


def _big(args: argparse.Namespace, out: Path, steps: int, *flags: str,
         sharded: bool = False) -> list[str]:
    """nonstop running the big model; ``flags`` go to ``nonstop run``."""
    return common.nonstop_cmd(f"--nproc={args.ranks}", f"--run-dir={out / 'run'}", *flags,
                              str(common.JOB), "--mode", "nonstop", "--steps", str(steps),
                              "--out", str(out), "--hidden", str(args.hidden),
                              "--layers", str(args.layers), *(["--sharded"] if sharded else []))


def _policy(base: Path, name: str, text: str) -> str:
    path = base / f"{name}.yaml"
    path.write_text(text)
    return str(path)


def _events(run_dir: Path) -> list[dict[str, Any]]:
    """The event log so far (a line being written is skipped)."""
    path, found = run_dir / "events.jsonl", []
    for line in path.read_text().splitlines() if path.exists() else []:
        try:
            found.append(json.loads(line))
        except json.JSONDecodeError:
            pass
    return found


def _summary_state(run_dir: Path) -> dict[str, Any]:
    path = run_dir / "summary.json"
    return (json.loads(path.read_text()).get("state") or {}) if path.exists() else {}


# -- snapshot cost ------------------------------------------------------------------------------
# the snapshot cost is the steady one: measured once the interval has been tuned on steady costs
# (at step 10, then every 20) and the start-up's drift has passed (seen without snapshots too)
STEADY = 31


def step_times(out: Path, after: int = WARMUP) -> list[float]:
    """Rank 0's step durations after the warm-up."""
    rows = common.read_steps(out).get(0, [])
    return [b[1] - a[1] for a, b in zip(rows, rows[1:]) if a[0] >= after and b[0] == a[0] + 1]


def snapshot_cost(args: argparse.Namespace, base: Path, say: Any) -> dict[str, Any]:
    """The big model on 2 nodes, snapshots off, then on (auto): overhead from mean step times."""
    res: dict[str, Any] = {}
    off = f"--policy={_policy(base, 'no-snapshots', NO_SNAPSHOTS)}"
    for label, flag in (("without", off), ("with", "--snapshot-every=auto")):
        out = base / f"snapshots-{label}"
        common.fresh(out)
        code = common.run_child(_big(args, out, args.snapshot_steps, "--nodes=2", flag),
                                out / "output.log", _timeout(args, args.snapshot_steps))
        times = step_times(out, STEADY) if code == 0 else []
        res[f"exit_code_{label}"] = code
        res[f"step_s_{label}"] = round(statistics.median(times), 4) if times else None
        res[f"mean_step_s_{label}"] = round(statistics.mean(times), 4) if times else None
        say(f"  snapshots {label:7s}: exit {code}, step median {res[f'step_s_{label}']} s, "
            f"mean {res[f'mean_step_s_{label}']} s over {len(times)} steps")
    snap = _summary_state(base / "snapshots-with" / "run").get("snapshot") or {}
    every, cost, step = snap.get("every"), snap.get("cost_s"), snap.get("step_s")
    a, b = res["mean_step_s_without"], res["mean_step_s_with"]
    repl = snap.get("repl_s") or 0.0  # the buddy copy's cost to the node, as the runtime counts it
    own = round((cost + repl) / (every * step) * 100, 2) if every and cost and step else None
    wall = round((b - a) / a * 100, 2) if a and b else None
    return {"interval_steps": every, "overhead_pct": wall, "self_reported_pct": own,
            "cost_s": cost, "runtime_step_s": step, "repl_s": snap.get("repl_s"), **res}


# -- restore times ------------------------------------------------------------------------------
def _entered(run_dir: Path, gen: int) -> dict[int, dict[str, Any]]:
    """rank -> what it restored on entering generation ``gen``."""
    return {e["rank"]: {"source": e.get("source"), "restore_s": e.get("restore_s"),
                        "bytes": e.get("nbytes"),
                        "move_s": (e.get("restore_phases") or {}).get("move")}
            for e in _events(run_dir) if e.get("type") == "rank_entered" and e.get("gen") == gen}


def _restore_of(kind: str, code: int, ranks: dict[int, dict[str, Any]],
                rank: int) -> dict[str, Any]:
    """The measured rank's restore; ``source_ok``: it came from ``kind`` (disk: every rank's)."""
    mine = ranks.get(rank, {})
    ok = mine.get("source") == kind and (kind != "disk" or
                                         all(r["source"] == kind for r in ranks.values()))
    return {"exit_code": code, "rank": rank, "source": mine.get("source"),
            "restore_s": mine.get("restore_s"), "move_s": mine.get("move_s"),
            "bytes": mine.get("bytes"), "source_ok": ok,
            "ranks": ranks}


def restore_after_fault(kind: str, args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """memory: the last rank crashes, a warm spare takes it; buddy: the last rank's node (node 1
    of 2) is lost with its memory, no spare node: the job restarts from the snapshots."""
    out, victim = base / f"restore-{kind}", args.ranks - 1
    common.fresh(out)
    fault = "crash" if kind == "memory" else "node_crash"
    where = ["--spares=1"] if kind == "memory" else [
        "--nodes=2", "--policy",  # no shrinking without the node: the job restarts
        _policy(base, "no-scale-in", f"recover:\n  levels:\n    scale_in: {{min_world: {args.ranks}}}\n")]
    cmd = _big(args, out, args.state_steps, *where, "--snapshot-every=1",
               f"--inject={fault}:rank={victim},step={args.state_steps // 2}", sharded=True)
    code = common.run_child(cmd, out / "output.log", _timeout(args, args.state_steps))
    return _restore_of(kind, code, _entered(out / "run", 1), victim)


def _run_until(cmd: list[str], out: Path, done: Any,
               timeout_s: float) -> tuple[dict[str, Any] | None, list[int]]:
    """Run ``cmd`` until ``done(events)`` returns an event, then SIGKILL the launcher (its pid
    only): the rest of the job must end by itself; what has not within 30 s is killed and
    listed. Returns that event (None: the run ended or timed out first) and the list."""
    deadline = time.monotonic() + timeout_s
    with open(out / "output.log", "wb") as fh:
        proc = subprocess.Popen(cmd, stdout=fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                start_new_session=True)
    found, left = None, []
    try:
        while found is None and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
            found = done(_events(out / "run"))
        family = _descendants(proc.pid)
        proc.kill()
        proc.wait(timeout=30)
        left = _outlived(family, 30.0)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)
    return found, left


def _descendants(pid: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            ppid = int(Path(f"/proc/{d}/stat").read_text().rsplit(")", 1)[1].split()[1])
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(ppid, []).append(int(d))
    found, todo = [], [pid]
    while todo:
        kids = children.get(todo.pop(), [])
        found += kids
        todo += kids
    return found


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _outlived(pids: list[int], timeout_s: float) -> list[int]:
    """Wait for ``pids`` to end; SIGKILL those still there after ``timeout_s``; returns those."""
    deadline = time.monotonic() + timeout_s
    while any(map(_alive, pids)) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if _alive(p)]
    for pid in left:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return left


def _first(etype: str) -> Any:
    return lambda evs: next((e for e in evs if e.get("type") == etype), None)


def restore_disk(args: argparse.Namespace, base: Path) -> dict[str, Any]:
    """The launcher is killed after the first checkpoint; the job started again restores it and
    is killed once it has made a step (only its restore is of interest). ``exit_code`` 0: both
    got that far."""
    from nonstop.state.checkpoint import drop_page_cache

    out = base / "restore-disk"
    first, again, ckpt = out / "first", out / "again", out / "checkpoints"
    common.fresh(out)
    steps, timeout = 2 * args.state_steps, _timeout(args, 2 * args.state_steps)
    flags = ("--snapshot-every=1", f"--checkpoint-dir={ckpt}",
             f"--checkpoint-every={max(2, args.state_steps // 4)}")
    for d in (first, again):
        common.fresh(d)
    saved, left = _run_until(_big(args, first, steps, *flags, sharded=True), first,
                             _first("checkpoint"), timeout)
    drop_page_cache(ckpt)
    stepped, left2 = _run_until(_big(args, again, steps, *flags, sharded=True), again,
                                _first("rank_first_step"), timeout)
    result = _restore_of("disk", 0 if saved and stepped else 1, _entered(again / "run", 0),
                         args.ranks - 1)
    result.update(checkpoint_step=saved and saved["step"],
                  checkpoint_bytes=saved and saved["bytes"],
                  checkpoint_write_s=saved and saved.get("write_s"), outlived_launcher=left + left2)
    return result


# -- job restart vs torchrun ----------------------------------------------------------------------
def _nonstop_job_restart(args: argparse.Namespace, base: Path, out: Path) -> dict[str, Any]:
    common.fresh(out)
    cmd = common.nonstop_cmd(f"--nproc={args.ranks}", f"--run-dir={out / 'run'}",
                             "--snapshot-every=1",
                             f"--policy={_policy(base, 'job-restart', JOB_RESTART)}",
                             f"--inject=crash:rank={args.ranks // 2},step={args.kill_step}",
                             str(common.JOB), "--mode", "nonstop", "--steps", str(args.steps),
                             "--out", str(out))
    result = common.measure("nonstop", cmd, out, crash.TIMEOUT_S)
    evs = _events(out / "run")
    result["levels"] = [e["level"] for e in evs if e.get("type") == "decision"]
    result["restore_sources"] = [e["sources"] for e in evs
                                 if e.get("type") == "restore" and e.get("gen", 0) > 0]
    return result


def job_restart(args: argparse.Namespace, systems: list[str], base: Path,
                say: Any) -> list[dict[str, Any]] | None:
    ref_params = common.reference_weights(
        crash.run_once("reference", args.ranks, args.steps, args.kill_step, base / "reference"),
        base / "reference", say)
    if ref_params is None:
        return None
    results = []
    for system in systems:
        runs = []
        for i in range(args.repeat):
            out = base / f"restart-{system}" / f"run{i}"
            r = (_nonstop_job_restart(args, base, out) if system == "nonstop" else
                 crash.run_once(system, args.ranks, args.steps, args.kill_step, out))
            r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
                ref_params, out / "final.pt")
            runs.append(r)
            mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f} s"
            say(f"  job restart {system:8s} run {i + 1}/{args.repeat}: exit {r['exit_code']}, "
                f"MTTR {mttr}, steps lost {r['lost_steps']}, weights match: "
                f"{r['params_match_reference']}, sources {r.get('restore_sources', '-')}")
        results.append(common.aggregate(system, runs))
    return results


# -- the whole bench ----------------------------------------------------------------------------
def check(args: argparse.Namespace) -> list[str]:
    cuda = getattr(args, "device", "cpu") == "cuda"
    text = "device" if cuda and args.phases == DEFAULT_PHASES else args.phases
    phases = [p.strip() for p in text.split(",") if p.strip()]
    unknown = [p for p in phases if p not in PHASES]
    if unknown or not phases:
        raise UsageError(f"--phases takes {', '.join(PHASES)} (comma-separated), got {args.phases!r}")
    if "device" in phases:
        if not cuda:
            raise UsageError("--phases device measures state on a GPU: give --device cuda")
        if phases != ["device"]:
            raise UsageError("--phases device runs alone (the other phases train on the CPU)")
        if not _gpu_driver():  # said at once, before torch's import (seconds)
            raise UsageError("--device cuda: no CUDA device here (no GPU driver: no /dev/nvidia* "
                             "or /dev/kfd)")
        import torch

        if not torch.cuda.is_available():
            raise UsageError(f"--device cuda: no CUDA device here (torch {torch.__version__}"
                             + (", built without CUDA)" if torch.version.cuda is None else ")"))
        if args.hidden < 1 or args.layers < 0:
            raise UsageError("--hidden must be at least 1 and --layers 0 or more")
        return phases
    if cuda:
        raise UsageError(f"--device cuda runs the device phase only, not {args.phases!r}")
    if args.ranks % 2:
        raise UsageError(f"--ranks must be even for the 2-node runs, got {args.ranks}")
    if args.hidden < 1 or args.layers < 0:
        raise UsageError("--hidden must be at least 1 and --layers 0 or more")
    if args.state_steps < 2 * WARMUP + 2:
        raise UsageError(f"--state-steps must be at least {2 * WARMUP + 2}, got {args.state_steps}")
    if args.snapshot_steps < STEADY + 10:
        raise UsageError(f"--snapshot-steps must be at least {STEADY + 10}, got {args.snapshot_steps}")
    return phases


def memcpy_gbps(nbytes: int, repeats: int = 5) -> float:
    """This machine's copy bandwidth now: the best of a few copies of ``nbytes`` between two
    buffers already in memory (torch's copy, as a restore's), in GB/s."""
    import time

    import torch

    a, b = torch.ones(nbytes, dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        b.copy_(a)
        best = min(best, time.perf_counter() - t0)
    return round(nbytes / best / 1e9, 2)


def main(args: argparse.Namespace) -> int:
    phases = check(args)
    if phases == ["device"]:
        return device_main(args)
    systems, base, say = common.setup(args, SYSTEMS)
    n = param_count(32, args.hidden, args.layers)
    say(f"bench state: {n / 1e6:.1f}M parameters on {args.ranks} ranks, {args.state_steps} steps "
        f"a run; job restart: kill rank {args.ranks // 2} at step {args.kill_step} of "
        f"{args.steps}, {args.repeat} repeats; runs in {base}")
    snap = snapshot_cost(args, base, say) if "snapshot" in phases else {}
    restores = {}
    for kind in ("memory", "buddy", "disk") if "restore" in phases else ():
        restores[kind] = r = (restore_disk(args, base) if kind == "disk" else
                              restore_after_fault(kind, args, base))
        say(f"  restore from {kind:6s}: exit {r['exit_code']}, rank {r['rank']} from {r['source']} "
            f"in {r['restore_s']} s, {r['bytes']} bytes")
        if kind == "memory" and r["bytes"]:  # the limit, measured now, on the same bytes
            r["memcpy_gbps"] = memcpy_gbps(int(r["bytes"]))
            moved = r.get("move_s") or r["restore_s"]  # the bytes' own time (not the agreement)
            r["gbps"] = round(r["bytes"] / moved / 1e9, 2) if moved else None
            say(f"  memory restore {r['gbps']} GB/s (move {moved} s); this machine copies "
                f"{r['memcpy_gbps']} GB/s")
    results = job_restart(args, systems, base, say) if "restart" in phases else []
    if results is None:
        return 1
    summary = build(args, n, snap, restores, results)
    say(table(summary))
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    common.emit(summary, args.json)
    return 0


def device_main(args: argparse.Namespace) -> int:
    """The device phase: one process on the GPU, no job (``state_device.py``)."""
    from . import state_device

    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    n = param_count(state_device.INPUTS, args.hidden, args.layers)
    say(f"bench state --device cuda: {n / 1e6:.1f}M parameters (AdamW), --hidden {args.hidden} "
        f"--layers {args.layers}")
    result = state_device.run(args.hidden, args.layers, say=say)
    summary = {"scenario": "state", "params": n, "hidden": args.hidden, "layers": args.layers,
               "device": result, "date": common.now_stamp()}
    say(device_table(result))
    common.emit(summary, args.json)
    return 0


def device_table(d: dict[str, Any]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    return "\n".join([
        f"{d['name']}: {d['bytes'] / 1e9:.2f} GB of state in {d['tensors']} tensors", "",
        "| copy | GB/s | memcpy GB/s | ratio | pageable GB/s |", "|---|---|---|---|---|",
        f"| snapshot (GPU -> pinned mirror) | {fmt(d['snapshot_gbps'])} | "
        f"{fmt(d['memcpy_d2h_gbps'])} | {fmt(d['snapshot_vs_memcpy'])} | "
        f"{fmt(d['snapshot_pageable_gbps'])} |",
        f"| restore (memory -> bounce -> GPU) | {fmt(d['restore_gbps'])} | "
        f"{fmt(d['memcpy_h2d_gbps'])} | {fmt(d['restore_vs_memcpy'])} | "
        f"{fmt(d['restore_pageable_gbps'])} |", "",
        f"bitwise: {d['bitwise']}; step {fmt(d['step_s_without'])} s without, "
        f"{fmt(d['step_s_with'])} s with a snapshot every step: {fmt(d['overhead_pct'])}%; "
        f"at the chosen interval ({d['interval_steps']} steps): {fmt(d['overhead_interval_pct'])}%",
        f"targets: {d['targets']}"])


def build(args: argparse.Namespace, n: int, snap: dict[str, Any], restores: dict[str, Any],
          results: list[dict[str, Any]]) -> dict[str, Any]:
    times = {k: r["restore_s"] for k, r in restores.items()}
    ratio = (round(times["disk"] / times["memory"], 1)
             if times.get("disk") and times.get("memory") else None)
    ns = next((r for r in results if r["system"] == "nonstop"), None)
    from_memory = ns is not None and ns["lost_steps"]["max"] == 0 and all(
        r["restore_sources"] and all(set(s.values()) == {"memory"} for s in r["restore_sources"])
        for r in ns["runs"])
    return {
        "scenario": "state", "params": n, "ranks": args.ranks, "hidden": args.hidden,
        "layers": args.layers, "state_steps": args.state_steps,
        "snapshot_steps": args.snapshot_steps, "steps": args.steps,
        "kill_step": args.kill_step, "repeat": args.repeat, "step_s": snap.get("step_s_without"),
        "snapshot": snap, "restore_s": times,
        "restore_bytes": {k: r["bytes"] for k, r in restores.items()},
        "restore_sources": {k: r["source"] for k, r in restores.items()},
        "memory_vs_disk": ratio, "restore": restores, "job_restart": results,
        "targets": {"overhead_le_5pct": snap.get("overhead_pct") is not None
                    and snap["overhead_pct"] <= 5,
                    "zero_lost_from_memory": from_memory,
                    "memory_10x_faster_than_disk": ratio is not None and ratio >= 10,
                    "memory_restore_within_2x_of_memcpy": _within(restores.get("memory"), 2.0)},
        "date": common.now_stamp()}


def _within(r: dict[str, Any] | None, factor: float) -> bool | None:
    if not r or not r.get("gbps") or not r.get("memcpy_gbps"):
        return None
    return r["memcpy_gbps"] / r["gbps"] <= factor


def table(summary: dict[str, Any]) -> str:
    s, fmt = summary["snapshot"], lambda v: "-" if v is None else f"{v:.4g}"  # noqa: E731
    lines = [f"{summary['params'] / 1e6:.1f}M parameters, {summary['ranks']} ranks, 2 nodes"]
    if s:
        lines += ["", "| snapshots | step median s | step mean s | interval | overhead % | "
                  "self-reported % |", "|---|---|---|---|---|---|",
                  f"| off | {fmt(s['step_s_without'])} | {fmt(s['mean_step_s_without'])} | - | - "
                  "| - |",
                  f"| auto | {fmt(s['step_s_with'])} | {fmt(s['mean_step_s_with'])} | "
                  f"{s['interval_steps']} | {fmt(s['overhead_pct'])} | "
                  f"{fmt(s['self_reported_pct'])} |"]
    if summary["restore"]:
        lines += ["", "| restore from | seconds | bytes | source as meant |", "|---|---|---|---|"]
        for kind, r in summary["restore"].items():
            lines.append(f"| {kind} | {fmt(r['restore_s'])} | {r['bytes']} | {r['source_ok']} |")
        lines.append(f"\ndisk / memory restore time: {summary['memory_vs_disk']}")
        mem = summary["restore"].get("memory") or {}
        if mem.get("memcpy_gbps"):
            lines.append(f"memory restore {mem['gbps']} GB/s, memcpy {mem['memcpy_gbps']} GB/s")
    if summary["job_restart"]:
        lines += ["", "job restart:", common.table({"results": summary["job_restart"]})]
    lines.append(f"\ntargets: {summary['targets']}")
    return "\n".join(lines)


def _gpu_driver() -> bool:
    """Whether a GPU driver's device files are here (NVIDIA's, or ROCm's for torch.cuda on AMD)."""
    import glob

    return bool(glob.glob("/dev/nvidia[0-9]*")) or os.path.exists("/dev/kfd")
