"""``nonstop demo``: the included model on 4 ranks and 1 warm spare, with a crash and a hang,
checked bit for bit against a fault-free run with the same seed."""

from __future__ import annotations

import datetime
import sys
from pathlib import Path

from .launch.one_host import RunConfig, run

EXAMPLE = Path(__file__).resolve().parent / "examples" / "train_ddp.py"


def params_equal(a_path: Path, b_path: Path) -> tuple[bool, str]:
    """Compare two saved state dicts bit for bit; say where they differ."""
    import torch

    a, b = torch.load(a_path), torch.load(b_path)
    if a.keys() != b.keys():
        return False, "different parameter names"
    for k in a:
        if a[k].dtype != b[k].dtype or a[k].shape != b[k].shape:
            return False, f"{k}: different dtype or shape"
        if not torch.equal(a[k].view(-1).view(torch.uint8), b[k].view(-1).view(torch.uint8)):
            diff = (a[k].double() - b[k].double()).abs().max().item()
            return False, f"{k} differs (max abs difference {diff:.3g})"
    return True, f"{len(a)} tensors, {sum(v.numel() for v in a.values())} values"


def run_demo(steps: int = 150, run_dir: str | None = None, ranks: int = 4) -> int:
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path(run_dir or f"nonstop-runs/demo-{stamp}")
    base.mkdir(parents=True, exist_ok=True)
    crash_at, hang_at = steps // 3, 2 * steps // 3
    args = ["--steps", str(steps), "--sleep-ms", "20"]
    print(f"nonstop demo: {ranks} ranks, 1 warm spare, {steps} steps; a crash of rank 2 at step "
          f"{crash_at} and a hang of rank 1 at step {hang_at}; outputs in {base}")
    print("1/2 the fault-free reference run (same seed, same world size)...")
    ref = base / "reference.pt"
    code = run(RunConfig(script=str(EXAMPLE), script_args=args + ["--save", str(ref)], nproc=ranks,
                         run_dir=str(base / "reference"), quiet=True))
    if code != 0:
        print(f"nonstop demo: the reference run failed (exit code {code})", file=sys.stderr)
        return 1
    print("2/2 the same job with faults injected:")
    out = base / "faulty.pt"
    code = run(RunConfig(script=str(EXAMPLE), script_args=args + ["--save", str(out)], nproc=ranks,
                         spares=1, run_dir=str(base / "faulty"), hang_timeout=2.0,
                         inject=[f"crash:rank=2,step={crash_at}", f"hang:rank=1,step={hang_at}"]))
    if code != 0:
        print(f"nonstop demo: the run with faults failed (exit code {code})", file=sys.stderr)
        return 1
    same, detail = params_equal(ref, out)
    if same:
        print(f"nonstop demo: OK - final parameters are bitwise-equal to the fault-free run ({detail})")
        return 0
    print(f"nonstop demo: FAILED - final parameters differ from the fault-free run: {detail}",
          file=sys.stderr)
    return 1
