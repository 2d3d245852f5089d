"""``nonstop bench elastic``: a rank lost with no spare; the world shrinks, then grows back.

4 ranks (``--ranks``), no spare; rank ``ranks // 2`` is killed at step 50 (``--kill-step``). The
process nonstop starts for its place is taken in once ready and the job has run degraded for
``--grow-after`` seconds (the "spare made available" moment). Systems, each on the same job
(``bench/elastic_job.py``: one global batch per step from one seeded sample stream):

- ``nonstop-scale-in``: ``scale_in.when: no_warm_spare``: the survivors go on as a smaller world
  at once, in-process, and grow back at a step boundary;
- ``nonstop-job-restart``: the same loss with rank replacement and scale-in turned off: every
  rank process is started again and the state comes back from the nodes' memory;
- ``torchrun``: ``--max-restarts 3``, a checkpoint every 20 steps (on one host it cannot shrink:
  the whole node's workers restart).

``--hosts H``: the same job across H test hosts x ``--ranks-per-host`` ranks with no spare host
(``nonstop-scale-in`` only). ``--cases rank_crash`` (the default): the last rank is killed at
step 50; its host's ranks leave the world (it shrinks by whole hosts) and come back once the
process started for it is ready. ``--cases host_loss``: at step 50 a host that does not hold the
controller is killed whole and the world shrinks by its ranks; at step 100 ``nonstop run`` is
started on a new test host, which joins, and the world grows back onto it.

``--parallel ddp,fsdp,hsdp,2d,pp`` (one host): each layout is its own job (DDP; FSDP2; HSDP over
2 replica groups; FSDP2 x tensor parallel of degree 2; 2 pipeline stages x data parallel),
nonstop-scale-in only for the meshed ones. ``hsdp`` and ``pp`` shrink by a whole replica group (a
whole pipeline) whose survivors keep their shards live: the bytes a growth moves, from the twins,
are reported. ``fsdp`` and ``2d`` have no copy of a lost rank's shard: they change size by new
processes that cut their shards from the old world's snapshots in node memory; the time of that
resharding (``reshard_s``, the restore of the shrunk world) and the bytes it moved are reported
apart.

Measured: MTTR (kill -> a step completed by every process of the next generation), the scale-out
pause (the first rank leaving for the larger world -> a step completed by every rank of it), steps
lost, whether every step trained on exactly its global batch of the stream (each sample of an
epoch once, in order), and the final parameters' largest relative difference from the fault-free
run at full size.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path
from typing import Any

from . import common

SYSTEMS = ("nonstop-scale-in", "nonstop-job-restart", "torchrun")
JOB = Path(__file__).resolve().parent / "elastic_job.py"
TIMEOUT_S = 300.0
HOST_START_S = 120.0  # start-up across test hosts: etcd, the hosts, the ranks' imports
GROW_AFTER_STEPS = 50  # --hosts: the new host is started this many steps after the kill
SAMPLES, BATCH = 4096, 64


def _policy(out: Path, system: str, grow_after_s: float) -> Path:
    p = out / "policy.yaml"
    if system == "nonstop-scale-in":
        p.write_text("recover:\n  levels:\n    scale_in:\n      when: no_warm_spare\n"
                     f"      grow_after_s: {grow_after_s}\n")
    else:
        p.write_text("recover:\n  levels:\n    rank_replacement: {enabled: false}\n"
                     "    scale_in: {enabled: false}\n")
    return p


LAYOUTS = ("ddp", "fsdp", "hsdp", "2d", "pp")
NOT_YET: dict[str, str] = {}  # layout -> why it is left out


def run_once(system: str, ranks: int, steps: int, kill_step: int, grow_after_s: float,
             out: Path, parallel: str = "ddp") -> dict[str, Any]:
    common.fresh(out)
    victim = ranks // 2
    job = [str(JOB), "--steps", str(steps), "--out", str(out), "--samples", str(SAMPLES),
           "--global-batch", str(BATCH), "--parallel", parallel]
    if system == "torchrun":
        cmd = common.torchrun_cmd(ranks, *job, "--mode", "torchrun", "--ckpt-every", "20",
                                  "--kill-rank", str(victim), "--kill-step", str(kill_step))
    elif system == "reference":
        cmd = common.nonstop_cmd(f"--nproc={ranks}", f"--run-dir={out / 'run'}", *job,
                                 "--mode", "nonstop")
    else:
        cmd = common.nonstop_cmd(f"--nproc={ranks}", "--spares=0", f"--run-dir={out / 'run'}",
                                 f"--policy={_policy(out, system, grow_after_s)}",
                                 f"--inject=crash:rank={victim},step={kill_step}", *job,
                                 "--mode", "nonstop")
    code = common.run_child(cmd, out / "output.log", TIMEOUT_S)
    result: dict[str, Any] = {"system": system, "exit_code": code}
    if system == "reference":
        return result
    if system == "torchrun":
        kill = out / "kill.txt"
        t_kill = float(kill.read_text()) if kill.exists() else None
    else:
        t_kill = common.inject_time(out / "run")
    result.update(recovery(read_steps(out), t_kill))
    evs = list(common.events(out / "run"))  # (read once: the pause, the growth's bytes)
    pauses = [e["pause_s"] for e in evs if e["type"] == "scale_out_done"]
    result["scale_out_pause_s"] = pauses[0] if pauses else None
    gens = [e["gen"] for e in evs if e["type"] == "generation"]
    grown = [e for e in evs if e["type"] == "restore" and len(gens) > 2 and e["gen"] == gens[-1]]
    result["grow_bytes"] = grown[0].get("bytes") if grown else None  # the twins' copies sent
    # a layout resharded at the shrink (new processes cutting their shards from the old world's):
    # the restore of the shrunk world, and the bytes it moved
    shrunk = [e for e in evs if e["type"] == "restore" and len(gens) > 1 and e["gen"] == gens[1]
              and any("resharded" in str(v) for v in e["sources"].values())]
    result["reshard_s"] = shrunk[0]["seconds"] if shrunk else None
    result["reshard_bytes"] = shrunk[0]["bytes"] if shrunk else None
    result.update(check_samples(out, steps))
    return result


def hosts_once(a: argparse.Namespace, case: str, out: Path) -> dict[str, Any]:
    """nonstop across ``a.hosts`` test hosts with no spare host. ``rank_crash``: the last rank
    is killed (its host's ranks leave the world, and come back once a new process there is
    ready); ``host_loss``: a host is killed whole, and a new host joins later."""
    from .hostjob import HostJob
    from .hosts import _host_index, _wait_etcd
    from nonstop.protocol import hosts as keys

    common.fresh(out)
    h, p = a.hosts, a.ranks_per_host
    pol = _policy(out, "nonstop-scale-in", a.grow_after)
    flags = ["--nnodes", str(h), "--nproc-per-node", str(p), "--spares", "0", "--policy", str(pol)]
    if case == "rank_crash":
        flags += ["--inject", f"crash:rank={h * p - 1},step={a.kill_step}"]
    job = ["--mode", "nonstop", "--steps", str(a.steps), "--out", str(out), "--samples",
           str(SAMPLES), "--global-batch", str(BATCH)]
    r: dict[str, Any] = {"system": "nonstop-scale-in", "case": case, "exit_code": None,
                         "mttr_s": None, "lost_steps": None, "scale_out_pause_s": None,
                         "error": None}
    with HostJob(out / "job", hosts=h + 1, etcd_members=1, tag="nse") as j:
        try:
            j.start(0, *flags, script=str(JOB), script_args=job)
            _wait_etcd(j, "a controller in office", lambda e: e.leader(keys.LEADER) is not None,
                       HOST_START_S)
            for i in range(1, h):
                j.start(i, *flags, script=str(JOB), script_args=job)
            _wait_steps(out, a.kill_step, HOST_START_S)
            victim = None
            if case == "host_loss":
                leader = j.of("leader")[0]
                order = list(leader["hosts"])  # node -> host, in the order they joined
                victim = next(x for x in reversed(order) if x != leader["host"])
                t_kill = time.time()
                j.kill_host(_host_index(victim))
                _wait_steps(out, a.kill_step + GROW_AFTER_STEPS, TIMEOUT_S)
                j.start(h, *flags, script=str(JOB), script_args=job)  # a new host joins the job
            codes = j.wait(TIMEOUT_S)
            if case == "rank_crash":
                t_kill = next(e["t"] for e in j.events() if e.get("type") == "rank_inject")
            r["exit_codes"] = {f"host{i}": c for i, c in codes.items()}
            ok = all(c == 0 for i, c in codes.items() if f"host{i}" != victim)
            r["exit_code"] = 0 if ok else 1
            r["victim_host"] = victim
            r.update(recovery(read_steps(out), t_kill))
            pauses = [e["pause_s"] for e in j.events() if e.get("type") == "scale_out_done"]
            r["scale_out_pause_s"] = pauses[0] if pauses else None
            r["levels"] = [e["level"] for e in j.events() if e.get("type") == "decision"]
        except Exception as exc:  # noqa: BLE001 - one run failed: say why, go on with the next
            r["error"] = f"{type(exc).__name__}: {exc}"
            r["exit_code"] = 1
    r.update(check_samples(out, a.steps))
    return r


def _wait_steps(out: Path, step: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s >= step for rows in read_steps(out).values() for s, _, _ in rows):
            return
        time.sleep(0.05)
    raise TimeoutError(f"step {step} not reached within {timeout_s:g} s")


def read_steps(out: Path) -> dict[str, list[tuple[int, float, int]]]:
    """process -> [(steps done, time, generation)]."""
    found: dict[str, list[tuple[int, float, int]]] = {}
    for f in sorted(out.glob("steps-p*.txt")):
        rows = []
        for line in f.read_text().splitlines():
            parts = line.split()
            if len(parts) == 4:
                rows.append((int(parts[0]), float(parts[1]), int(parts[2])))
        found[f.stem] = rows
    return found


def recovery(steps: dict[str, list[tuple[int, float, int]]], t_kill: float | None
             ) -> dict[str, Any]:
    """MTTR: the kill -> every process that trains in the next generation completed a step in
    it; steps lost: steps done before the kill minus the step the job resumed from."""
    if t_kill is None:
        return {"mttr_s": None, "lost_steps": None}
    killed = max((g for rows in steps.values() for _, t, g in rows if t < t_kill), default=0)
    done = max((s for rows in steps.values() for s, t, g in rows if g <= killed), default=0)
    after = [min((t, s) for s, t, g in rows if g == killed + 1)
             for rows in steps.values() if any(g == killed + 1 for _, _, g in rows)]
    if not after:
        return {"mttr_s": None, "lost_steps": None}
    return {"mttr_s": round(max(t for t, _ in after) - t_kill, 4),
            "lost_steps": max(0, done - min(s - 1 for _, s in after))}


def check_samples(out: Path, steps: int) -> dict[str, bool]:
    """Whether the steps that count (each step's newest generation) are exactly 0..steps-1, each
    trained on exactly its global batch of the stream (every sample of an epoch once, in order)
    and on a global batch of the same size."""
    from nonstop.runtime.sampler import GlobalBatchSampler

    by_step: dict[int, dict[int, list[dict[str, Any]]]] = {}
    for f in out.glob("samples-p*.jsonl"):
        for line in f.read_text().splitlines():
            try:
                e = json.loads(line)
            except json.JSONDecodeError:  # cut short by a killed process
                continue
            by_step.setdefault(e["step"], {}).setdefault(e["gen"], []).append(e)
    stream = GlobalBatchSampler(SAMPLES, global_batch=BATCH, seed=0)
    once = sorted(by_step) == list(range(steps))
    constant = once
    last_of = {}  # generation -> its last step (where a rank killed after it stepped may not log)
    for s, gens in by_step.items():
        for g in gens:
            last_of[g] = max(last_of.get(g, -1), s)
    newest = max(last_of, default=0)
    for s, gens in by_step.items():
        g = max(gens)
        entries = sorted(gens[g], key=lambda e: e["rank"])
        world = entries[0]["world"]
        ranks = [e["rank"] for e in entries]
        whole = ranks == list(range(world))
        # each rank's samples its share of the stream's global batch, each rank once; every rank
        # logged, except at the last step of a generation a fault ended (a host killed after
        # its ranks stepped, before they wrote)
        once = once and len(set(ranks)) == len(ranks) and all(
            e["world"] == world and e["ids"] == stream.share(s, e["rank"], world) for e in entries)
        once = once and (whole or (s == last_of[g] and g != newest))
        constant = constant and (not whole or sum(len(e["ids"]) for e in entries) == BATCH)
    return {"samples_exactly_once": once, "global_batch_constant": constant}


def max_rel_diff(a: Path, b: Path) -> float | None:
    import torch

    if not a.exists() or not b.exists():
        return None
    x, y = torch.load(a), torch.load(b)
    return max(((x[k] - y[k]).abs().max() / x[k].abs().max()).item() for k in x)


def main(args: argparse.Namespace) -> int:
    from nonstop.errors import UsageError

    across = args.hosts is not None
    case = "rank_crash"
    if across:
        from .netns import available

        ok, why = available()
        if args.hosts < 2 or args.ranks_per_host < 1:
            raise UsageError("--hosts must be at least 2 and --ranks-per-host at least 1")
        if not ok:
            raise UsageError(f"bench elastic --hosts needs test hosts (network namespaces): {why}")
        args.ranks = args.hosts * args.ranks_per_host  # the reference's world
        args.systems = "nonstop-scale-in"  # torchrun across hosts: bench hosts
        case = args.cases or "rank_crash"
        if case not in ("rank_crash", "host_loss"):
            raise UsageError(f"bench elastic --hosts: --cases is rank_crash or host_loss, not "
                             f"{case!r}")
        if args.kill_step + GROW_AFTER_STEPS >= args.steps:
            raise UsageError(f"--steps must leave room for the new host: more than kill step + "
                             f"{GROW_AFTER_STEPS}")
    chosen = [x.strip() for x in args.parallel.split(",") if x.strip()]
    unknown = [x for x in chosen if x not in LAYOUTS and x not in NOT_YET]
    if unknown or not chosen:
        raise UsageError(f"--parallel: unknown layout(s) {', '.join(unknown) or '(none)'}; "
                         f"choose from {', '.join(LAYOUTS + tuple(NOT_YET))}")
    if across and chosen != ["ddp"]:
        raise UsageError("bench elastic --hosts runs the ddp layout")
    systems, base, say = common.setup(args, SYSTEMS)
    where = (f"{args.hosts} test hosts x {args.ranks_per_host} ranks, no spare host, " + (
        f"a host killed at step {args.kill_step}, a new host at step "
        f"{args.kill_step + GROW_AFTER_STEPS}" if case == "host_loss" else
        f"rank {args.ranks - 1} killed at step {args.kill_step}") if across else
             f"{args.ranks} ranks, no spare, rank {args.ranks // 2} killed at step "
             f"{args.kill_step}")
    say(f"bench elastic: {where}, {args.steps} steps, grow back after {args.grow_after:g} s, "
        f"{args.repeat} repeats; runs in {base}")
    results = []
    for parallel in dict.fromkeys(chosen):
        if parallel in NOT_YET:
            say(f"  {parallel}: left out: {NOT_YET[parallel]}")
            results.append({"parallel": parallel, "system": "nonstop-scale-in",
                            "skipped": NOT_YET[parallel]})
            continue
        where_ = base / parallel if len(chosen) > 1 else base
        ref = common.reference_weights(
            run_once("reference", args.ranks, args.steps, args.kill_step, 0,
                     where_ / "reference", parallel), where_ / "reference", say)
        if ref is None:
            return 1
        for system in systems if parallel == "ddp" else ["nonstop-scale-in"]:
            runs = []
            for i in range(args.repeat):
                out = where_ / system / f"run{i}"
                r = (hosts_once(args, case, out) if across else
                     run_once(system, args.ranks, args.steps, args.kill_step, args.grow_after,
                              out, parallel))
                r["final_params_max_rel_diff"] = max_rel_diff(ref, out / "final.pt")
                r["params_match_reference"] = r["exit_code"] == 0 and common.params_equal(
                    ref, out / "final.pt")
                runs.append(r)
                say(f"  {parallel:4s} {system:20s} run {i + 1}/{args.repeat}: exit "
                    f"{r['exit_code']}, MTTR {r['mttr_s']} s, scale-out pause "
                    f"{r['scale_out_pause_s']} s, steps lost {r['lost_steps']}, samples once "
                    f"{r['samples_exactly_once']}, params rel diff "
                    f"{r['final_params_max_rel_diff']}")
            agg = {"parallel": parallel,
                   **common.aggregate(system, runs, extra=("scale_out_pause_s",))}
            agg["samples_exactly_once"] = all(r["samples_exactly_once"] for r in runs)
            agg["global_batch_constant"] = all(r["global_batch_constant"] for r in runs)
            diffs = [r["final_params_max_rel_diff"] for r in runs]
            agg["final_params_max_rel_diff"] = None if None in diffs else max(diffs)
            grow = [r.get("grow_bytes") for r in runs if r.get("grow_bytes") is not None]
            agg["grow_bytes"] = max(grow) if grow else None
            # fsdp, 2d: the shrunk world's restore, its shards cut from the old (hsdp, pp: None)
            reshard = sorted(r["reshard_s"] for r in runs if r.get("reshard_s") is not None)
            agg["reshard_s"] = reshard[len(reshard) // 2] if reshard else None
            moved = [r["reshard_bytes"] for r in runs if r.get("reshard_bytes") is not None]
            agg["reshard_bytes"] = max(moved) if moved else None
            results.append(agg)
    summary = {"scenario": "elastic", "ranks": args.ranks, "hosts": args.hosts,
               "case": case, "repeat": args.repeat,
               "steps": args.steps, "kill_step": args.kill_step, "grow_after_s": args.grow_after,
               "date": common.now_stamp(), "results": results}
    ratio = common.mttr_ratio([r for r in results if r["parallel"] == "ddp"], "torchrun",
                              "nonstop-scale-in")
    if ratio is not None or "torchrun" in systems and "nonstop-scale-in" in systems:
        summary["torchrun_over_scale_in"] = ratio
    return common.conclude(summary, table(summary), base, args, say)


def table(summary: dict[str, Any]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| layout | system | MTTR median s | scale-out pause median s | steps lost (max) | "
             "samples exactly once | global batch constant | params max rel diff | grow bytes | "
             "reshard s | reshard bytes |",
             "|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        if "skipped" in r:
            lines.append(f"| {r['parallel']} | {r['system']} | left out: {r['skipped']} "
                         "| | | | | | | | |")
            continue
        pause = (r.get("scale_out_pause_s") or {}).get("median")
        diff = r["final_params_max_rel_diff"]
        lines.append(f"| {r['parallel']} | {r['system']} | {fmt(r['mttr_s']['median'])} | "
                     f"{fmt(pause)} | {r['lost_steps']['max']} | {r['samples_exactly_once']} | "
                     f"{r['global_batch_constant']} | {'-' if diff is None else f'{diff:.2e}'} | "
                     f"{r.get('grow_bytes') if r.get('grow_bytes') is not None else '-'} | "
                     f"{fmt(r.get('reshard_s'))} | "
                     f"{r.get('reshard_bytes') if r.get('reshard_bytes') is not None else '-'} |")
    if summary.get("torchrun_over_scale_in"):
        lines.append(f"\ntorchrun / nonstop-scale-in MTTR ratio: {summary['torchrun_over_scale_in']}")
    return "\n".join(lines)
