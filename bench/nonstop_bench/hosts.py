"""``nonstop bench hosts``: faults of ranks, hosts, links, the controller and etcd in a job across
test hosts (network namespaces with their own addresses on one machine, ``nonstop_bench.netns``), etcd on
a host of its own, ``nonstop run --nnodes ... --rdzv-endpoint etcd://...`` started on every host.

Default set-up: 3 hosts x 2 ranks + 1 spare host (``HostJob(base, hosts=4, etcd_members=1)``).
The job is train_ddp.py's (``examples/train_timed.py``: the same math, and rank 0 logs the wall
time of every completed step); its final weights are compared bit for bit with a fault-free run of
the same world size on one host (``nonstop run --nproc W``, once per bench run).

Cases (nonstop): ``rank_crash`` (``--spares 1``, an injected crash of a rank on a host other than
the controller's), ``host_loss`` (a whole host that holds ranks SIGKILLed), ``partition`` (a
host's link cut, healed once it fenced itself), ``controller_kill`` (the elected controller
SIGKILLed), ``etcd_restart`` (the etcd member stopped for 5 s), ``startup`` (no fault: every host
started at once, as a user would, and the time to the first step split into its phases, beside the
same job's start on one host). torchrun runs ``host_loss`` only: its c10d rendezvous across the
same hosts, a checkpoint every 20 steps.

In the fault cases the first host is started alone and the others once it holds the controller's
office, so the controller is on node 0 and every fault strikes elsewhere (checked in the events).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

from . import common

SYSTEMS = ("nonstop", "torchrun")
CASES = ("rank_crash", "host_loss", "partition", "controller_kill", "etcd_restart", "startup")
TORCHRUN_CASES = ("host_loss",)
SCRIPT = Path(__file__).resolve().parents[2] / "examples" / "train_timed.py"

STEPS = 200  # ≈ 2-3 s of training before the fault and 7-8 s after it (etcd is away for 5 s)
FAULT_STEP = 50
SLEEP_MS = 15.0
CKPT_EVERY = 20  # torchrun's checkpoint interval
ETCD_DOWN_S = 5.0
START_TIMEOUT_S = 120.0  # start-up: hosts, etcd, the ranks' imports, on 2 loaded cores
RUN_TIMEOUT_S = 180.0  # a job after its fault
START_RETRIES = 2  # a nonstop job that fails before its first step is started again
REFERENCE_TIMEOUT_S = 300.0
TORCHRUN_PORT = 29400
# torchrun's liveness of a node: a keep-alive every second, dead after 5 missed (its defaults: 5 s
# and 3, 15 s). 2 missed (nonstop's lease TTL, 2 s) declared live nodes dead on 2 cores while the
# workers started, and the rendezvous went round in restarts for minutes
TORCHRUN_KEEPALIVE = "keep_alive_interval=1,keep_alive_max_attempt=5"


# == the step log (rank 0 of the job, whichever process holds it) ================================
def read_times(path: Path) -> list[tuple[int, float, int, int]]:
    """(steps done, time, generation, pid) per completed step, in file order; a line cut short by
    a killed process is skipped."""
    rows = []
    if path.exists():
        for line in path.read_text(errors="replace").splitlines():
            parts = line.split()
            if len(parts) == 4:
                try:
                    rows.append((int(parts[0]), float(parts[1]), int(parts[2]), int(parts[3])))
                except ValueError:
                    continue
    return rows


def max_gap(rows: list[tuple[int, float, int, int]]) -> float | None:
    """The longest time between two consecutive completed steps of the job."""
    ts = sorted(t for _, t, _, _ in rows)
    if len(ts) < 2:
        return None
    return round(max(b - a for a, b in zip(ts, ts[1:])), 4)


def wait_step(path: Path, step: int, timeout_s: float, alive: Callable[[], bool]) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if any(s >= step for s, _, _, _ in read_times(path)):
            return
        if not alive():
            raise RuntimeError(f"the job ended before step {step}")
        time.sleep(0.02)
    raise TimeoutError(f"step {step} not reached within {timeout_s:g} s")


# == nonstop ======================================================================================
def _etcd(j: Any) -> Any:
    from nonstop.store.etcd import Etcd

    return Etcd.from_url(j.etcd.url, j.job_id, timeout_s=2.0)


def _wait_etcd(j: Any, what: str, pred: Callable[[Any], bool], timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    with _etcd(j) as etcd:
        while time.monotonic() < deadline:
            try:
                if pred(etcd):
                    return
            except Exception:  # noqa: BLE001 - etcd busy: asked again
                pass
            if any(p.poll() is not None for p in j.procs.values()):
                raise RuntimeError(f"a host's nonstop run ended while waiting for {what}")
            time.sleep(0.05)
    raise TimeoutError(f"{what} not seen in etcd within {timeout_s:g} s")


def start_nonstop(j: Any, flags: list[str], script_args: list[str], n: int) -> None:
    """Host 0 alone until it holds the controller's office, then the others in order."""
    from nonstop.protocol import hosts as keys

    j.start(0, *flags, script=str(SCRIPT), script_args=[*script_args, "--save",
                                                         str(j.base / "final.pt")])
    _wait_etcd(j, "a controller in office", lambda e: e.leader(keys.LEADER) is not None,
               START_TIMEOUT_S)
    for i in range(1, n):
        j.start(i, *flags, script=str(SCRIPT),
                script_args=[*script_args, "--save", str(j.base / "final.pt")])


# == start-up ====================================================================================
STARTUP_PHASES = ("registered", "elected", "in_office", "spawned", "entered", "first_step")
# and cpu_s: the CPU seconds the job's processes had used at its first step (etcd's aside)


class StartWatch:
    """When each host's registration and the controller's election first appear in etcd (polled
    every 20 ms from the bench's side, on a thread of its own, until stopped)."""

    def __init__(self, j: Any, hosts: int) -> None:
        import threading

        self.j, self.hosts = j, hosts
        self.registered: dict[str, float] = {}
        self.elected: float | None = None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(10)

    def _run(self) -> None:
        from nonstop.protocol import hosts as keys

        with _etcd(self.j) as etcd:
            while not self._stop.is_set():
                try:
                    for key, _, _, _ in etcd.get_prefix(keys.HOSTS):
                        self.registered.setdefault(key, time.time())
                    if self.elected is None and etcd.leader(keys.LEADER) is not None:
                        self.elected = time.time()
                except Exception:  # noqa: BLE001 - etcd busy: asked again
                    pass
                if self.elected is not None and len(self.registered) >= self.hosts:
                    return
                self._stop.wait(0.02)


def startup_phases(events: list[dict[str, Any]], t_launch: float,
                   registered: float | None = None,
                   elected: float | None = None) -> dict[str, float | None]:
    """Seconds from the launch to the end of each start-up phase: every host registered in etcd
    and the controller elected (across hosts only), the controller in office with its hosts
    (``leader``; one host: ``run_start``), the first generation's ranks forked, entered (their
    process group formed) and through their first step (the last rank of each)."""
    gens = [e for e in events if e.get("type") == "generation"]
    wids = set(gens[0]["ranks"].values()) if gens else set()

    def last(kind: str) -> float | None:
        ts = {e["wid"]: e["t"] for e in events if e.get("type") == kind and e.get("wid") in wids
              and e.get("gen", 0) == 0}
        return max(ts.values()) if wids and len(ts) == len(wids) else None

    office = [e["t"] for e in events if e.get("type") in ("leader", "run_start")]
    at = {"registered": registered, "elected": elected,
          "in_office": min(office) if office else None, "spawned": last("spawn"),
          "entered": last("rank_entered"), "first_step": last("rank_first_step")}
    return {k: None if v is None else round(v - t_launch, 3) for k, v in at.items()}


def _host_index(host_id: str) -> int:
    return int(host_id.removeprefix("host"))


def with_retries(run: Callable[..., dict[str, Any]], case: str, a: argparse.Namespace, out: Path,
                 ref: Path) -> dict[str, Any]:
    """One run of a system; a job that failed before its fault was applied is started again, at
    most START_RETRIES times, and counted in ``start_retries`` (the failed runs are kept beside
    it, ``run<i>-failed<k>``): what is measured is the fault, not the start."""
    failed: list[str] = []
    while True:
        r = run(case, a, out, ref)
        if r["faulted"] or len(failed) >= START_RETRIES:
            break
        keep = out.with_name(f"{out.name}-failed{len(failed)}")
        shutil.rmtree(keep, ignore_errors=True)
        out.rename(keep)
        failed.append(f"{keep}: {r['error']}")
    r["start_retries"] = len(failed)
    if failed:
        r["start_failures"] = failed
    return r


def nonstop_once(case: str, a: argparse.Namespace, out: Path, ref: Path) -> dict[str, Any]:
    from nonstop.policy import Policy
    from .hostjob import HostJob

    common.fresh(out)
    h, p, s = a.hosts, a.ranks_per_host, a.spare_hosts
    times = out / "steps.txt"
    flags = ["--nnodes", str(h), "--nproc-per-node", str(p), "--spare-nodes", str(s)]
    victim_rank = (h - 1) * p  # the first rank of the last node that holds ranks (not node 0)
    if case == "rank_crash":
        flags += ["--spares", "1", "--inject", f"crash:rank={victim_rank},step={a.kill_step}"]
    script_args = ["--steps", str(a.steps), "--sleep-ms", str(a.sleep_ms), "--step-times",
                   str(times)]
    r: dict[str, Any] = {"case": case, "system": "nonstop", "mttr_s": None, "lost_steps": None,
                         "max_step_gap_s": None, "split_brain": False,
                         "params_match_reference": False, "error": None, "faulted": False}
    ttl = Policy().hosts.lease_ttl_s
    order: list[str] = []
    victim_node = h - 1  # the last node that holds ranks (node 0 holds the controller)
    t_fault = t_launch = time.time()
    watch: StartWatch | None = None
    cpu_s: float | None = None
    with HostJob(out / "job", hosts=h + s, etcd_members=1, tag="nsb") as j:
        try:
            alive = lambda: all(q.poll() is None for q in j.procs.values())  # noqa: E731
            if case == "startup":  # every host at once, the documented command on each
                watch = StartWatch(j, h + s)
                watch.start()
                t_launch = time.time()
                for i in range(h + s):
                    j.start(i, *flags, script=str(SCRIPT),
                            script_args=[*script_args, "--save", str(j.base / "final.pt")])
                wait_step(times, 1, START_TIMEOUT_S, alive)
                cpu_s = common.cpu_s_below(os.getpid())
                watch.stop()
            else:
                start_nonstop(j, flags, script_args, h + s)
            wait_step(times, a.kill_step, START_TIMEOUT_S, alive)
            leader = j.of("leader")[0]
            order = list(leader["hosts"])  # node -> host id, in the order the hosts joined
            victim = _host_index(order[victim_node])
            r["controller_host"] = leader["host"]
            t_fault = time.time()
            r["faulted"] = True
            if case == "rank_crash":
                pass  # injected: the job does it at its step
            elif case == "host_loss":
                r["victim_host"] = order[victim_node]
                j.kill_host(victim)
            elif case == "partition":
                r["victim_host"] = order[victim_node]
                j.hosts[victim].cut()
                j.wait_output("fenced", 30 + 3 * ttl, hosts=[victim])
                r["fenced_after_s"] = round(time.time() - t_fault, 3)
                j.hosts[victim].heal()
            elif case == "controller_kill":
                os.kill(leader["pid"], signal.SIGKILL)
            elif case == "startup":
                pass  # measured above
            elif case == "etcd_restart":
                j.etcd.stop_member("e0")
                time.sleep(ETCD_DOWN_S)
                j.etcd.start_member("e0")
                r["etcd_down_s"] = round(time.time() - t_fault, 3)
            codes = j.wait(RUN_TIMEOUT_S)
            r["exit_codes"] = {f"host{i}": c for i, c in codes.items()}
            events = j.events()
        except Exception as exc:  # noqa: BLE001 - one run failed: say why, go on with the next
            r["error"] = f"{type(exc).__name__}: {exc}"
            codes, events = {}, j.events()
    of = lambda kind: [e for e in events if e.get("type") == kind]  # noqa: E731
    rows = read_times(times)
    r["max_step_gap_s"] = max_gap(rows)
    r["steps_done"] = max((st for st, *_ in rows), default=0)
    incidents = of("incident")
    r["incidents"] = len(incidents)
    if incidents:
        inc = incidents[0]
        r["levels"] = inc.get("levels")
        r["phases_s"] = inc.get("phases_s")
    if case in ("rank_crash", "host_loss", "partition"):
        if len(incidents) == 1:
            r["mttr_s"], r["lost_steps"] = incidents[0]["mttr_s"], incidents[0]["steps_lost"]
    elif case == "controller_kill":
        leaders = of("leader")
        if len(leaders) >= 2:
            r["mttr_s"] = round(leaders[1]["t"] - t_fault, 4)  # the takeover
        r["lost_steps"] = sum(i.get("steps_lost") or 0 for i in incidents)
    else:
        r["lost_steps"] = sum(i.get("steps_lost") or 0 for i in incidents)
    spawns = {e["wid"]: e["node"] for e in of("spawn")}
    gens = of("generation")
    if gens:
        first = {int(k): w for k, w in gens[0]["ranks"].items()}
        node_of = {rank: spawns.get(w) for rank, w in first.items()}
        if case == "rank_crash" and node_of.get(victim_rank) is not None \
                and node_of[victim_rank] < len(order):
            r["victim_host"] = order[node_of[victim_rank]]
    if case == "partition" and gens:
        cut_gen = max((g["gen"] for g in gens if g["t"] <= t_fault), default=0)
        r["split_brain"] = any(e["gen"] > cut_gen and spawns.get(e["wid"]) == victim_node
                               for e in of("rank_joining"))
        r["node_joined"] = [e["node"] for e in of("node_joined")]
    if r.get("victim_host") is not None:
        r["victim_is_controller_host"] = r["victim_host"] == r.get("controller_host")
    if watch is not None:
        watch.stop()
        r["startup_s"] = startup_phases(
            events, t_launch, max(watch.registered.values()) if len(watch.registered) >= h + s
            else None, watch.elected)
        r["startup_s"]["cpu_s"] = cpu_s
    saved = [q for q in [j.base / "final.pt"] if q.exists()]
    survivors_ok = all(c == 0 for i, c in codes.items()
                       if not (case == "host_loss" and f"host{i}" == r.get("victim_host")))
    r["completed"] = bool(codes) and survivors_ok and len(saved) == 1 and r["error"] is None
    r["params_match_reference"] = r["completed"] and common.params_equal(ref, saved[0])
    if not r["completed"] and r["error"] is None:
        r["error"] = f"exit codes {codes}, {len(saved)} final weight file(s)"
    return r


# == torchrun =====================================================================================
_GLOG = re.compile(r"^[IWEF](\d\d)(\d\d) (\d\d):(\d\d):(\d\d\.\d+) ")


def _log_times(text: str, pattern: str) -> list[float]:
    """Epoch times of the lines of a torchrun agent's log (glog format: local time, no year)
    that contain ``pattern``."""
    year = time.localtime().tm_year
    out = []
    for line in text.splitlines():
        m = _GLOG.match(line)
        if m and pattern in line:
            mo, d, hh, mm, ss = m.groups()
            base = time.mktime((year, int(mo), int(d), int(hh), int(mm), 0, 0, 0, -1))
            out.append(base + float(ss))
    return out


def torchrun_phases(logs: list[str], t_kill: float, t_first: float | None) -> dict[str, Any]:
    """Where torchrun's recovery went, from its agents' INFO lines: until a surviving agent
    stopped its workers (it saw them fail, or a node waiting: the spare, once the dead node's
    keep-alive expired), until every agent's new round was formed, until the first step."""
    stop = [t for text in logs for t in _log_times(text, "closing signal") if t >= t_kill]
    rounds = [t for text in logs for t in _log_times(text, "restart_count=") if t >= t_kill]
    if not stop or not rounds:
        return {}
    out = {"detect": round(min(stop) - t_kill, 3),
           "rendezvous": round(max(rounds) - min(stop), 3)}
    if t_first is not None:
        out["workers_start_to_first_step"] = round(t_first - max(rounds), 3)
    return out


def torchrun_once(case: str, a: argparse.Namespace, out: Path, ref: Path) -> dict[str, Any]:
    """torchrun's c10d rendezvous on the same test hosts: host 0 holds the rendezvous store (it is
    never the one killed), the spare host's torchrun starts once the job trains (it waits in the
    rendezvous's redundancy list), a checkpoint every CKPT_EVERY steps in a shared directory."""
    from .hostjob import HostJob

    common.fresh(out)
    h, p, s = a.hosts, a.ranks_per_host, a.spare_hosts
    times, ckpt = out / "steps.txt", out / "ckpt"
    ckpt.mkdir()
    r: dict[str, Any] = {"case": case, "system": "torchrun", "mttr_s": None, "lost_steps": None,
                         "max_step_gap_s": None, "split_brain": False,
                         "params_match_reference": False, "error": None, "faulted": False}
    procs: dict[int, subprocess.Popen] = {}
    with HostJob(out / "job", hosts=h + s, etcd_members=1, tag="nsb") as j:
        rdzv = f"{j.hosts[0].addr}:{TORCHRUN_PORT}"

        def start(i: int) -> None:
            host = j.hosts[i]
            env = {k: v for k, v in os.environ.items() if not k.startswith("NONSTOP_")
                   or k == "NONSTOP_TEST_SESSION"}
            # gloo on the test host's interface (the host name resolves to no address of it);
            # a new store per rendezvous round, hosted by that round's rank 0 (torch 2.13's
            # shared store stays on the first round's rank 0 node, which may be the one lost)
            env.update(GLOO_SOCKET_IFNAME="eth0", TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1",
                       TORCH_CPP_LOG_LEVEL="ERROR", LOGLEVEL="INFO")  # INFO: the agents' rounds
            cmd = [sys.executable, "-m", "torch.distributed.run",
                   f"--nnodes={max(1, h - 1)}:{h}", f"--nproc-per-node={p}",
                   "--rdzv-backend=c10d", f"--rdzv-endpoint={rdzv}", f"--rdzv-id={j.job_id}",
                   f"--rdzv-conf=is_host={1 if i == 0 else 0},{TORCHRUN_KEEPALIVE}",
                   f"--local-addr={host.addr}", "--max-restarts=3", "--monitor-interval=0.1",
                   str(SCRIPT), "--mode", "torchrun", "--steps", str(a.steps), "--sleep-ms",
                   str(a.sleep_ms), "--step-times", str(times), "--ckpt-dir", str(ckpt),
                   "--ckpt-every", str(CKPT_EVERY), "--save", str(j.base / "final.pt")]
            with open(j.base / f"out{i}.txt", "ab") as f:
                procs[i] = host.popen(cmd, env=env, stdout=f, stderr=subprocess.STDOUT)

        alive = lambda: all(q.poll() is None for q in procs.values())  # noqa: E731
        victim = h - 1
        t_fault = None
        try:
            for i in range(h):
                start(i)
            wait_step(times, 1, START_TIMEOUT_S, alive)
            for i in range(h, h + s):
                start(i)  # after the first round: the spare waits in the redundancy list
            wait_step(times, a.kill_step, START_TIMEOUT_S, alive)
            r["victim_host"] = f"host{victim}"
            t_fault = time.time()
            r["faulted"] = True
            j.kill_host(victim)
            deadline = time.monotonic() + RUN_TIMEOUT_S
            for i, q in procs.items():
                try:
                    q.wait(max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    r["error"] = f"torchrun did not end within {RUN_TIMEOUT_S:g} s of the kill"
                    break
        except Exception as exc:  # noqa: BLE001
            r["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            for q in procs.values():
                if q.poll() is None:
                    try:
                        os.killpg(q.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    try:
                        q.wait(10)
                    except subprocess.TimeoutExpired:
                        pass
        codes = {i: q.poll() for i, q in procs.items()}
    r["exit_codes"] = {f"host{i}": c for i, c in codes.items()}
    rows = read_times(times)
    r["max_step_gap_s"] = max_gap(rows)
    r["steps_done"] = max((st for st, *_ in rows), default=0)
    if t_fault is not None:
        before = [row for row in rows if row[1] < t_fault]
        old_pids = {row[3] for row in before}
        after = [row for row in rows if row[1] >= t_fault and row[3] not in old_pids]
        done_before = max((st for st, *_ in before), default=0)
        if after:
            first = min(after, key=lambda row: row[1])
            r["mttr_s"] = round(first[1] - t_fault, 4)
            r["resumed_at"] = first[0] - 1
            r["lost_steps"] = max(0, done_before - (first[0] - 1))
        r["done_before"] = done_before
        r["restart_counts"] = sorted({g for _, t, g, _ in rows if t >= t_fault})
        logs = [(j.base / f"out{i}.txt").read_text(errors="replace") for i in procs
                if i != victim and (j.base / f"out{i}.txt").exists()]
        r["phases_s"] = torchrun_phases(logs, t_fault, first[1] if after else None)
    saved = [q for q in [j.base / "final.pt"] if q.exists()]
    survivors_ok = all(c == 0 for i, c in codes.items() if i != victim)
    r["completed"] = survivors_ok and len(saved) == 1 and r["error"] is None
    r["params_match_reference"] = r["completed"] and common.params_equal(ref, saved[0])
    if not r["completed"] and r["error"] is None:
        r["error"] = f"exit codes {codes}, {len(saved)} final weight file(s)"
    return r


# == the bench ====================================================================================
def reference(a: argparse.Namespace, out: Path) -> dict[str, Any]:
    """The fault-free run on one host, same world size and steps (no sleep: it changes no
    number)."""
    common.fresh(out)
    world = a.hosts * a.ranks_per_host
    times = out / "steps.txt"
    cmd = common.nonstop_cmd(f"--nproc={world}", f"--run-dir={out / 'run'}", str(SCRIPT),
                             "--steps", str(a.steps), "--save", str(out / "final.pt"),
                             "--step-times", str(times))
    cpu: list[float] = []

    def first_step(proc: subprocess.Popen) -> bool:
        if read_times(times):
            cpu.append(common.cpu_s_below(proc.pid, with_root=True))
            return True
        return False

    t_launch = time.time()
    code = common.run_child(cmd, out / "output.log", REFERENCE_TIMEOUT_S, until=first_step)
    path = out / "run" / "events.jsonl"
    events = [json.loads(x) for x in path.read_text().splitlines() if x.strip()] \
        if path.exists() else []
    phases = startup_phases(events, t_launch)
    phases["cpu_s"] = cpu[0] if cpu else None
    return {"exit_code": code, "startup_s": phases}


def _stats(values: list[Any]) -> dict[str, Any]:
    vals = [v for v in values if v is not None]
    if not vals:
        return {"median": None, "min": None, "max": None, "n": 0}
    return {"median": round(statistics.median(vals), 4), "min": round(min(vals), 4),
            "max": round(max(vals), 4), "n": len(vals)}


def aggregate(case: str, system: str, runs: list[dict[str, Any]]) -> dict[str, Any]:
    lost = [r["lost_steps"] for r in runs]
    gaps = [r["max_step_gap_s"] for r in runs if r["max_step_gap_s"] is not None]
    return {
        "case": case, "system": system, "repeats": len(runs),
        "mttr_s": _stats([r["mttr_s"] for r in runs]),
        "lost_steps": {"max": max(lost) if lost and None not in lost else None},
        "max_step_gap_s": max(gaps) if len(gaps) == len(runs) else None,
        "split_brain": any(r["split_brain"] for r in runs),
        **({"startup_s": {p: _stats([r["startup_s"].get(p) for r in runs])["median"]
                          for p in (*STARTUP_PHASES, "cpu_s")}}
           if any(r.get("startup_s") for r in runs) else {}),
        "params_match_reference": all(r["params_match_reference"] for r in runs),
        "completed": all(r["completed"] for r in runs),
        "runs": runs,
    }


def targets(results: list[dict[str, Any]], ttl: int,
            one_host: dict[str, Any] | None = None) -> dict[str, Any]:
    """Each target with what was measured and whether it is met (None: not measured)."""
    by = {(r["case"], r["system"]): r for r in results}
    out: dict[str, Any] = {}

    def med(case: str, system: str = "nonstop") -> float | None:
        r = by.get((case, system))
        return r["mttr_s"]["median"] if r else None

    if ("rank_crash", "nonstop") in by:
        r = by[("rank_crash", "nonstop")]
        m = med("rank_crash")
        out["rank_crash_mttr_le_0.5s_0_lost"] = m is not None and m <= 0.5 \
            and r["lost_steps"]["max"] == 0
    if ("host_loss", "nonstop") in by:
        m = med("host_loss")
        out["host_loss_mttr_le_ttl_plus_1s"] = m is not None and m <= ttl + 1
        t = med("host_loss", "torchrun")
        if ("host_loss", "torchrun") in by:
            out["torchrun_over_nonstop_host_loss"] = round(t / m, 1) if t and m else None
            out["host_loss_5x_faster_than_torchrun"] = bool(t and m and t / m >= 5) \
                if t is not None else None
    for case in ("controller_kill", "etcd_restart"):
        if (case, "nonstop") in by:
            g = by[(case, "nonstop")]["max_step_gap_s"]
            out[f"{case}_max_step_gap_le_1s"] = g is not None and g <= 1.0
    if ("startup", "nonstop") in by and one_host:
        across = by[("startup", "nonstop")].get("startup_s", {}).get("first_step")
        alone = one_host.get("first_step")
        out["startup_across_hosts_minus_one_host_s"] = \
            round(across - alone, 3) if across is not None and alone is not None else None
        out["startup_within_2s_of_one_host"] = across is not None and alone is not None \
            and across - alone <= 2.0
    if ("partition", "nonstop") in by:
        out["partition_no_split_brain"] = not by[("partition", "nonstop")]["split_brain"]
    nonstop = [r for r in results if r["system"] == "nonstop"]
    if nonstop:
        out["bitwise_every_nonstop_case"] = all(r["params_match_reference"] for r in nonstop)
    return out


def table(summary: dict[str, Any]) -> str:
    fmt = lambda v: "-" if v is None else f"{v:.3f}"  # noqa: E731
    lines = ["| case | system | MTTR median s | min | max | steps lost (max) | max step gap s | "
             "split brain | weights match |", "|---|---|---|---|---|---|---|---|---|"]
    for r in summary["results"]:
        m = r["mttr_s"]
        lines.append(f"| {r['case']} | {r['system']} | {fmt(m['median'])} | {fmt(m['min'])} | "
                     f"{fmt(m['max'])} | {r['lost_steps']['max']} | {fmt(r['max_step_gap_s'])} | "
                     f"{r['split_brain']} | {r['params_match_reference']} |")
    starts = [("one host (the reference)", summary.get("startup_one_host_s"))] + [
        (f"{summary['hosts']} hosts + {summary['spare_hosts']} spare", r["startup_s"])
        for r in summary["results"] if r.get("startup_s")]
    if len(starts) > 1:
        cols = (*STARTUP_PHASES, "cpu_s")
        lines += ["", "| start-up, s from launch | " + " | ".join(cols) + " |",
                  "|---|" + "---|" * len(cols)]
        lines += [f"| {name} | " + " | ".join(fmt((st or {}).get(p)) for p in cols)
                  + " |" for name, st in starts]
    return "\n".join(lines)


NOTES = {
    ("rank_crash", "nonstop"): "MTTR: the incident's (injected crash -> a step completed by every "
                               "rank), from nonstop's events",
    ("host_loss", "nonstop"): "MTTR: the incident's, from the kill of the whole host",
    ("partition", "nonstop"): "MTTR: the incident's, from the cut; split_brain: a process of the "
                              "cut host joined a generation after the cut (rank_joining events)",
    ("controller_kill", "nonstop"): "mttr_s: the takeover (the new controller's leader event - the "
                                    "SIGKILL); no incident: training goes on meanwhile",
    ("startup", "nonstop"): "no fault; startup_s: seconds from launching every host at once to the "
                            "end of each phase (medians): every host registered in etcd, the "
                            "controller elected, in office with its hosts, the first "
                            "generation's ranks forked, entered, through their first step",
    ("etcd_restart", "nonstop"): "no incident expected: mttr_s is null; what counts is the largest "
                                 "gap between two steps while etcd is away",
    ("host_loss", "torchrun"): (
        "torchrun --nnodes=H-1:H --rdzv-backend=c10d on every host (host 0 holds the rendezvous "
        "store, is_host=1, and is never the one killed); to work across the test hosts it needed "
        "--local-addr=<host address> and GLOO_SOCKET_IFNAME=eth0 (the machine's host name is no "
        "address of a test host), TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 (else every round's workers "
        "use the store of the first round's rank 0 node, dead if that host is lost), the spare "
        "host started after the first round (it waits in the redundancy list), and "
        f"--rdzv-conf {TORCHRUN_KEEPALIVE} (a dead node is dropped from the rendezvous after 5 s "
        "instead of 15 s; after 2 s, live nodes whose agents were slow while their workers "
        "started were dropped too and the rendezvous churned); a checkpoint every 20 steps; "
        "MTTR: kill -> the first step completed by a worker started after the kill"),
}


def main(args: argparse.Namespace) -> int:
    from nonstop.errors import UsageError
    from .netns import available
    from nonstop.policy import Policy

    if args.steps is None:
        args.steps = STEPS
    if args.kill_step is None:
        args.kill_step = FAULT_STEP
    if args.sleep_ms is None:
        args.sleep_ms = SLEEP_MS
    systems = [x.strip() for x in args.systems.split(",") if x.strip()]
    cases = [x.strip() for x in (args.cases or ",".join(CASES)).split(",") if x.strip()]
    bad = [x for x in systems if x not in SYSTEMS]
    if bad:
        raise UsageError(f"unknown system(s) {', '.join(bad)} (known: {', '.join(SYSTEMS)})")
    bad = [x for x in cases if x not in CASES]
    if bad:
        raise UsageError(f"unknown case(s) {', '.join(bad)} (known: {', '.join(CASES)})")
    if args.hosts < 2 or args.ranks_per_host < 1 or args.spare_hosts < 0 or args.repeat < 1:
        raise UsageError("--hosts must be at least 2, --ranks-per-host at least 1, --spare-hosts "
                         "at least 0 and --repeat at least 1")
    if args.spare_hosts < 1 and {"host_loss", "partition"} & set(cases):
        raise UsageError("host_loss and partition need --spare-hosts 1 or more (the lost host's "
                         "ranks go to a spare host)")
    if not 0 < args.kill_step < args.steps:
        raise UsageError("--kill-step must lie inside the run (0 < kill-step < steps)")
    ok, why = available()
    if not ok:
        raise UsageError(f"bench hosts needs test hosts (network namespaces): {why}")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-bench-hosts-"))
    base.mkdir(parents=True, exist_ok=True)
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    ttl = Policy().hosts.lease_ttl_s
    world = args.hosts * args.ranks_per_host
    say(f"bench hosts: {args.hosts} hosts x {args.ranks_per_host} ranks + {args.spare_hosts} "
        f"spare host(s), etcd on a host of its own, lease TTL {ttl} s; {args.steps} steps "
        f"(+{args.sleep_ms:g} ms sleep), fault at step {args.kill_step}; cases {','.join(cases)}; "
        f"{args.repeat} repeats; runs in {base}")
    t0 = time.time()
    ref = reference(args, base / "reference")
    ref_params = common.reference_weights(ref, base / "reference", say)
    if ref_params is None:
        return 1
    results = []
    for case in cases:
        for system in systems:
            if system == "torchrun" and case not in TORCHRUN_CASES:
                continue
            once = nonstop_once if system == "nonstop" else torchrun_once
            runs = []
            for i in range(args.repeat):
                r = with_retries(once, case, args, base / case / system / f"run{i}", ref_params)
                runs.append(r)
                mttr = "-" if r["mttr_s"] is None else f"{r['mttr_s']:.3f} s"
                gap = "-" if r["max_step_gap_s"] is None else f"{r['max_step_gap_s']:.3f} s"
                say(f"  {case:15s} {system:8s} run {i + 1}/{args.repeat}: MTTR {mttr}, steps "
                    f"lost {r['lost_steps']}, max step gap {gap}, split brain {r['split_brain']}, "
                    f"weights match: {r['params_match_reference']}"
                    + (f" ({r['error']})" if r["error"] else ""))
            agg = aggregate(case, system, runs)
            agg["notes"] = NOTES.get((case, system))
            results.append(agg)
    summary: dict[str, Any] = {
        "scenario": "hosts", "hosts": args.hosts, "ranks_per_host": args.ranks_per_host,
        "spare_hosts": args.spare_hosts, "world": world, "lease_ttl_s": ttl,
        "steps": args.steps, "fault_step": args.kill_step, "sleep_ms": args.sleep_ms,
        "repeat": args.repeat, "date": common.now_stamp(), "wall_s": None, "results": results}
    summary["startup_one_host_s"] = ref.get("startup_s")
    summary["targets"] = targets(results, ttl, ref.get("startup_s"))
    retries = {f"{res['case']}/{res['system']}": sum(r["start_retries"] for r in res["runs"])
               for res in results}
    summary["notes"] = [
        "host 0 is started alone and the other hosts once it holds the controller's office: the "
        "controller is on node 0 and the faults strike another host (victim_is_controller_host "
        "in each run)",
        f"start_retries {retries}: jobs that failed before their fault and were started again "
        "(START_RETRIES). nonstop: a host that misses the new controller's first hello "
        "(controller/elected.py, cluster.add_host(node, rec, timeout_s=...)), slow on a loaded machine, "
        "is dropped without the controller being told; the ranks placed on it are reported dead "
        "at once and replaced there until the job gives up ('1 node(s) isolated') when no spare "
        "host is placed yet",
    ]
    summary["wall_s"] = round(time.time() - t0, 1)
    say(table(summary))
    say(json.dumps(summary["targets"]))
    if not args.out:
        shutil.rmtree(base, ignore_errors=True)
    common.emit(summary, args.json)
    return 0
