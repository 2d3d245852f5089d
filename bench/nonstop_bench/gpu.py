"""``nonstop bench gpu``: the device check. On a machine with one GPU it proves, in one run of a few
minutes, that nonstop's NCCL and CUDA paths recover bit for bit; its last line is one JSON object.

Rank processes share the one GPU (``NONSTOP_SHARE_GPU=1``: each is its own host to NCCL, whose
communicators then run over its socket transport; NCCL refuses two ranks of one host on one
device). Every job trains with ``--device cuda --backend nccl``; each fault case runs beside a
fault-free reference of the same job and layout, and must end with its weights bit for bit:

- crash: rank 1 of the sharded-optimizer (DDP) example killed (SIGKILL); a warm spare takes its
  place, rank 0 restarts in place;
- frozen: rank 1 frozen (SIGSTOP) inside NCCL collectives; rank 0, blocked on it, is released by
  the abort of its communicators (the release is timed from the controller's abort);
- assert: a device-side assert on rank 1's GPU; its process is replaced, never restarted in place;
- oom: rank 0 asks for more GPU memory than there is; it is retried in the same process;
- fsdp: rank 1 of an FSDP2 job (2 ranks, ``examples/train_fsdp.py``) killed: the mesh's NCCL
  groups formed again for the next generation, the spare's shard from its snapshot;
- hsdp: rank 1 of an HSDP job (2 replica groups x 2 shards) killed at step 33, snapshots every 10
  steps: the spare's shard comes from its twin in the other replica group, nothing lost;
- 2d, 3d, pp, llama: rank 1 killed in a model-parallel job: FSDP2 with tensor parallelism (2 x 2,
  a snapshot every step), HSDP with tensor parallelism (2 x 2 x 2, its part live from its twin),
  two pipeline stages in two data-parallel groups (the stage from its twin), and Hugging Face's
  Llama with FSDP2 and tensor parallelism (2 x 2).

Then ``nonstop bench state --device cuda``: snapshot and restore bandwidth against the device's own
memcpy, snapshots bitwise, their overhead per step.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from nonstop.errors import UsageError
from nonstop.runtime.nccl import ENV_SHARE_GPU
from . import common

SYSTEMS = ("nonstop",)
EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
STEPS = 60
FAULT_STEP = 30
JOB_TIMEOUT_S = 240.0
STATE_TIMEOUT_S = 240.0

#: layout -> (the example, its ranks, its own flags, nonstop's snapshot flag)
LAYOUTS: dict[str, tuple[str, int, tuple[str, ...], str]] = {
    "ddp": ("train_sharded.py", 2, (), "--snapshot-every=1"),
    "fsdp": ("train_fsdp.py", 2, (), "--snapshot-every=1"),
    "hsdp": ("train_fsdp.py", 4, ("--replicas", "2"), "--snapshot-every=10"),
    "2d": ("train_2d.py", 4, (), "--snapshot-every=1"),
    "3d": ("train_3d.py", 8, (), "--snapshot-every=10"),
    "pp": ("train_pp.py", 4, (), "--snapshot-every=10"),
    "llama": ("train_hf_llama.py", 4, (), "--snapshot-every=1"),
}

#: case -> (the fault, what must happen: "replaced" (the faulted rank's process replaced, the
#: others restarted in place) or "in_place" (no process replaced), the level expected, layout)
CASES: dict[str, tuple[str, str, str, str]] = {
    "crash": ("crash:rank=1,step=30", "replaced", "rank replacement", "ddp"),
    "frozen": ("stop:rank=1,step=30", "replaced", "rank replacement", "ddp"),
    "assert": ("cuda_assert:rank=1,step=30", "replaced", "rank replacement", "ddp"),
    "oom": ("cuda_oom:rank=0,step=30", "in_place", "in-process restart", "ddp"),
    "fsdp": ("crash:rank=1,step=30", "replaced", "rank replacement", "fsdp"),
    "hsdp": ("crash:rank=1,step=33", "replaced", "rank replacement", "hsdp"),
    "2d": ("crash:rank=1,step=30", "replaced", "rank replacement", "2d"),
    "3d": ("crash:rank=1,step=33", "replaced", "rank replacement", "3d"),
    "pp": ("crash:rank=1,step=33", "replaced", "rank replacement", "pp"),
    "llama": ("crash:rank=1,step=30", "replaced", "rank replacement", "llama"),
}


def _job(layout: str, run_dir: Path, out: Path, *flags: str) -> list[str]:
    script, nproc, own, snapshots = LAYOUTS[layout]
    return [sys.executable, "-m", "nonstop", "run", "--quiet", "--no-live", f"--nproc={nproc}",
            snapshots, f"--run-dir={run_dir}", *flags, str(EXAMPLES / script), *own,
            "--steps", str(STEPS), "--device", "cuda", "--backend", "nccl", "--save", str(out)]


def _run(name: str, layout: str, base: Path, *flags: str) -> dict[str, Any]:
    run_dir, out = base / name, base / f"{name}.pt"
    env = dict(os.environ, **{ENV_SHARE_GPU: "1"})
    t0 = time.monotonic()
    code = common.run_child(_job(layout, run_dir, out, *flags), base / f"{name}.log",
                            JOB_TIMEOUT_S, env)
    return {"name": name, "exit_code": code, "seconds": round(time.monotonic() - t0, 2),
            "run_dir": run_dir, "out": out}


def _holders(events: list[dict[str, Any]]) -> dict[int, list[int]]:
    """rank -> the workers that held it, generation by generation."""
    out: dict[int, list[int]] = {}
    for ev in events:
        if ev["type"] == "generation":
            for rank, wid in ev["ranks"].items():
                held = out.setdefault(int(rank), [])
                if not held or held[-1] != wid:
                    held.append(wid)
    return out


def judge(case: str, run: dict[str, Any], reference: Path,
          events: list[dict[str, Any]], summary: dict[str, Any] | None) -> dict[str, Any]:
    """What one fault case showed, and whether it is what nonstop promises (pure but for the
    weights' comparison)."""
    fault, expect, level, layout = CASES[case]
    faulted = 1 if "rank=1" in fault else 0
    holders = _holders(events)
    incidents = (summary or {}).get("incident_list") or []
    levels = [lv for inc in incidents for lv in inc.get("levels", [])]
    bitwise = common.params_equal(run["out"], reference)
    replaced = len(holders.get(faulted, [])) > 1
    survivor_kept = all(len(held) == 1 for r, held in holders.items() if r != faulted)
    shape_ok = (replaced and survivor_kept) if expect == "replaced" else (
        not replaced and survivor_kept)
    restores = [ev for ev in events if ev["type"] == "restore" and ev.get("gen", 0) > 0]
    result: dict[str, Any] = {
        "fault": fault, "layout": layout, "ranks": LAYOUTS[layout][1],
        "exit_code": run["exit_code"], "seconds": run["seconds"],
        "bitwise": bitwise, "levels": levels, "holders": {str(r): w for r, w in holders.items()},
        "mttr_s": incidents[0].get("mttr_s") if incidents else None,
        "phases_s": incidents[0].get("phases_s") if incidents else None,
        "steps_lost": (summary or {}).get("steps_lost"),
        "restore_sources": restores[0].get("sources") if restores else None,
        "faults": [f for inc in incidents for f in inc.get("faults", [])],
    }
    if case == "frozen":
        result["release_s"] = _release_after_abort(events, survivor=1 - faulted)
    result["ok"] = bool(run["exit_code"] == 0 and bitwise and shape_ok and level in levels)
    return result


def _release_after_abort(events: list[dict[str, Any]], survivor: int) -> float | None:
    """Seconds from the controller's first abort to the survivor leaving its generation."""
    t_abort = next((ev["t"] for ev in events if ev["type"] == "abort"), None)
    left = next((ev for ev in events if ev["type"] == "rank_left" and ev.get("rank") == survivor),
                None)
    if t_abort is None or left is None or left.get("t_caught") is None:
        return None
    return round(left["t_caught"] - t_abort, 4)


def _state(base: Path) -> dict[str, Any]:
    """``nonstop bench state --device cuda``'s JSON (its own process: a GPU of its own use)."""
    log = base / "state.log"
    cmd = [sys.executable, "-m", "nonstop", "bench", "state", "--device", "cuda", "--json",
           "--out", str(base / "state")]
    code = common.run_child(cmd, log, STATE_TIMEOUT_S)
    lines = [ln for ln in log.read_text(errors="replace").splitlines() if ln.startswith("{")]
    if code != 0 or not lines:
        return {"ok": False, "exit_code": code, "tail": log.read_text(errors="replace")[-1500:]}
    found = json.loads(lines[-1])
    device = found.get("device") or {}
    targets = device.get("targets") or {}
    # what this check proves is the copies' correctness and speed; the overhead is reported
    # (``targets``) but depends on the model and the step, not on the device alone
    proven = ("bitwise", "snapshot_ge_80pct_of_memcpy", "restore_ge_80pct_of_memcpy")
    return {**device, "ok": all(bool(targets.get(t)) for t in proven), "exit_code": code}


def _versions() -> dict[str, Any]:
    import torch

    nccl = None
    try:
        nccl = ".".join(map(str, torch.cuda.nccl.version()))
    except Exception:  # noqa: BLE001 - a torch built without NCCL
        pass
    return {"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
            "cuda": torch.version.cuda, "nccl": nccl}


def check(args: argparse.Namespace) -> list[str]:
    import torch

    if not torch.cuda.is_available():
        raise UsageError("bench gpu needs a CUDA GPU, and PyTorch sees none here")
    cases = [c.strip() for c in (args.cases or ",".join(CASES)).split(",") if c.strip()]
    unknown = [c for c in cases if c not in CASES and c != "state"]
    if unknown or not cases:
        raise UsageError(f"--cases takes {', '.join(CASES)}, state (comma-separated), got "
                         f"{args.cases!r}")
    return cases


def main(args: argparse.Namespace) -> int:
    if args.cases is None:
        args.cases = ",".join((*CASES, "state"))
    cases = check(args)
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-bench-gpu-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda text: print(text, file=sys.stderr, flush=True))  # noqa: E731
    info = _versions()
    say(f"bench gpu: {info['device']}, torch {info['torch']}, NCCL {info['nccl']}; runs in {base}")
    t0 = time.monotonic()
    jobs = [c for c in cases if c in CASES]
    results: dict[str, Any] = {}
    with concurrent.futures.ThreadPoolExecutor(max_workers=len(jobs) + 1) as pool:
        layouts = sorted({CASES[c][3] for c in jobs})
        refs = {lay: pool.submit(_run, f"reference-{lay}", lay, base) for lay in layouts}
        runs = {c: pool.submit(_run, c, CASES[c][3], base, "--spares=1",
                               f"--inject={CASES[c][0]}") for c in jobs}
        references = {lay: fut.result() for lay, fut in refs.items()}
        for lay, reference in references.items():
            say(f"  reference ({lay}): exit {reference['exit_code']} in "
                f"{reference['seconds']} s")
        for case, fut in runs.items():
            run = fut.result()
            reference = references[CASES[case][3]]
            events = list(common.events(run["run_dir"]))
            summary_path = run["run_dir"] / "summary.json"
            summary = json.loads(summary_path.read_text()) if summary_path.is_file() else None
            results[case] = r = judge(case, run, reference["out"], events, summary)
            say(f"  {case:7s}: exit {r['exit_code']}, {r['levels']}, MTTR {r['mttr_s']}, "
                f"lost {r['steps_lost']}, from {r['restore_sources']}, "
                f"bitwise {r['bitwise']}, workers {r['holders']}"
                + (f", released {r['release_s']} s after the abort" if "release_s" in r else "")
                + f" -> {'ok' if r['ok'] else 'FAILED'}")
            if not r["ok"]:
                log = base / f"{case}.log"
                say(log.read_text(errors="replace")[-2000:] if log.is_file() else "(no log)")
    for lay, reference in references.items():
        if reference["exit_code"] != 0:
            say((base / f"reference-{lay}.log").read_text(errors="replace")[-2000:])
    if "state" in cases:
        results["state"] = s = _state(base)
        say(f"  state  : {json.dumps(s)[:600]}")
    reference_exit = {lay: r["exit_code"] for lay, r in references.items()}
    summary = {"scenario": "gpu", **info, "reference_exit": reference_exit,
               "cases": results, "seconds": round(time.monotonic() - t0, 1),
               "ok": not any(reference_exit.values()) and all(r["ok"] for r in results.values()),
               "date": common.now_stamp()}
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    common.emit(summary, True)
    return 0 if summary["ok"] else 1
