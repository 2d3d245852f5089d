"""``nonstop chaos --hosts H`` / ``nonstop bench chaos --hosts H``: the seeded fault soak across
test hosts (network namespaces on a bridge, etcd on a host of its own, ``nonstop run`` on each
host as a user starts it on real machines).

Besides the rank faults the job injects into itself (``--inject``: crashes, hangs, NaN, silent
corruption, a warm spare killed at its promotion...), this harness throws what only the outside
world can: a host killed whole, a host partitioned then healed, the controller in office killed,
a host's launcher (``nonstop run``) SIGKILLed, a host preempted (SIGTERM: drained to the spare
host, then released), etcd restarted, etcd paused (SIGSTOP: every lease expired when it wakes),
a host started with other script arguments (it must be refused), a host's keeper (its node
memory) killed, a rank frozen with SIGSTOP and woken with SIGCONT once the job has replaced it
(the zombie must never join again), and the shared checkpoint file system filled while
checkpoints are written. A host that was lost comes back as a new machine (a new node id on the same address):
the job must take it in as a spare host before the next host fault, so the world never shrinks
and the final weights must equal the fault-free run's bit for bit.

The schedule (kinds, steps, victims) is drawn from the seed alone. A fault of the outside world
fires when the job reaches its step and the hosts are all back from the fault before it; its
actual step is recorded beside the scheduled one.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import shutil
import signal
import subprocess
import sys
import threading
import time
import traceback
import uuid
from pathlib import Path
from typing import Any, Callable

from . import chaos, common
from .hostjob import SECRET
from .hosts import SCRIPT, read_times, wait_step

FIRST = 40  # no fault before: the hang timeout is tuned from the steps seen by then
RANK_GAP = 25  # steps after a rank fault before the next fault
HOST_GAP = 120  # after a fault of the outside world (a lost host comes back as a new one)
SLEEP_MS = 10.0
START_TIMEOUT_S = 180.0
SETTLE_TIMEOUT_S = 120.0  # the hosts back after a fault
RUN_TIMEOUT_S = 1800.0  # the least the job, and its fault-free reference, may take
# ...and more for a long schedule: a step of 10 ms and its share of the recoveries took 0.26 s
# on a 2-core machine in a 100-fault soak (7,150 steps in 1,890 s); twice that, to be sure
RUN_S_PER_STEP = 0.5
ETCD_DOWN_S = 3.0
ETCD_PAUSE_S = 5.0  # etcd frozen (SIGSTOP) this long: every lease has expired when it wakes
DEAF_S = 8.0  # the controller's host hears nothing this long (what it sends still leaves)
CONTROLLER_PAUSE_S = 10.0  # every process of the controller's host frozen this long
SLOW_LINK_S = 4.0  # a host's data link this slow this long: its steps outlast the hang timeout
SLOW_KBIT = 128  # a step takes seconds (the test of a slow link uses the same)
# each etcd member's data on a file system this small (its WAL takes 61 MiB; at 96 a member of
# a loaded 3-member cluster met the end as it started)
ETCD_DISK_MB = 160
DISK_MB = 16  # the checkpoint file system (tmpfs): filled by disk_full
CKPT_EVERY = 10

#: faults the job injects into itself (chaos.KINDS' templates; a keeper is killed from outside
#: here, keeper_kill)
RANK_KINDS: dict[str, str] = {
    k: chaos.KINDS[k] for k in ("crash", "crash_two", "crash_dirty", "crash_torn_snapshot",
                                "crash_in_restore", "exception", "hang", "nan", "bitflip",
                                "corrupt_snapshot", "spare_killed_at_promotion")
}
#: faults of the outside world, thrown by this harness
HOST_KINDS = ("host_kill", "partition", "controller_kill", "launcher_kill", "etcd_restart",
              "keeper_kill", "stop_cont", "disk_full", "preempt", "etcd_pause", "mismatched_host",
              "controller_deaf", "controller_pause", "slow_link", "buddy_pair", "etcd_disk_full")
KILLS_HOST = ("host_kill", "partition", "launcher_kill", "preempt", "buddy_pair")  # the host goes
#: two hosts lost at once: only where each rank's snapshots have two replicas and two spare
#: hosts can take the lost hosts' ranks (``spare_hosts``)
NEEDS_TWO_SPARES = ("buddy_pair",)
ONCE = chaos.ONCE
#: the hosts always come back (a lost one as a new machine): the world never shrinks - a job
#: short of hosts waits for one (hosts.capacity_wait_s) - so the weights stay the fault-free run's
ORPHAN_GRACE_S = chaos.ORPHAN_GRACE_S

POLICY = chaos.POLICY + """    node_replacement: {budget: 1000000}
    scale_in: {enabled: false}
"""


def spare_hosts(only: list[str] | None) -> int:
    """Spare hosts the soak runs with: two when two hosts may be lost at once, else one."""
    return 2 if any(k in NEEDS_TWO_SPARES for k in (only or HOST_KINDS)) else 1


def gap(kind: str) -> int:
    quick = ("keeper_kill", "stop_cont", "mismatched_host", "slow_link")  # no host goes
    return HOST_GAP if kind in HOST_KINDS and kind not in quick else RANK_GAP


TAIL = 2 * HOST_GAP  # after the last fault: faults of the outside world wait for the hosts


def needed(plan: list[dict[str, Any]]) -> int:
    """Steps for the job: the schedule's, and a tail, since a fault of the outside world fires
    only once the hosts are all back from the one before (later than its step, at times)."""
    return (plan[-1]["step"] + gap(plan[-1]["kind"]) + TAIL) if plan else FIRST


def schedule(seed: int, faults: int, world: int, slots: int,
             only: list[str] | None = None) -> list[dict[str, Any]]:
    """``faults`` faults drawn with ``seed`` (of the kinds ``only``, default all): every kind in
    turn before any repeats; each at its step (the one before it plus its gap); a rank (``r``,
    ``r2``) or a host slot to strike."""
    rng = random.Random(seed)
    kinds: list[str] = []
    every = [k for k in (*RANK_KINDS, *HOST_KINDS) if not only or k in only]
    while len(kinds) < faults:
        batch = [k for k in every if k not in ONCE or k not in kinds]
        rng.shuffle(batch)
        kinds += batch
    out, step, spared = [], FIRST, []  # spared: a rank flipped lately is not killed before its check
    for kind in kinds[:faults]:
        choices = [r for r in range(world) if r not in spared[-1:]] if spared else list(range(world))
        r = rng.choice(choices)
        others = [x for x in choices if x != r]
        r2 = rng.choice(others) if others else (r + 1) % world
        f: dict[str, Any] = {"kind": kind, "step": step, "rank": r, "slot": rng.randrange(slots),
                             "spare_rank": spared[-1] if spared else None}
        if kind in RANK_KINDS:
            f["spec"] = RANK_KINDS[kind].format(r=r, r2=r2, s=step)
        out.append(f)
        if kind == "bitflip":
            spared += [r, r]
        elif spared:
            spared.pop()
        step += gap(kind)
    return out


class NotRejoined(Exception):
    """A host of the job was not back in it (a lost one as a new host) before the job ended or
    within the wait: the harness fires no more faults and lets the job finish."""

    def __init__(self, hosts: list[str], why: str):
        super().__init__(f"host(s) {', '.join(hosts) or '?'} not back in the job: {why}")
        self.hosts = hosts


def judge(error: str | None, codes: dict[int, int | None], saved: list[Path],
          outside: list[int], ref_code: int | None, reference: Path) -> tuple[bool, bool]:
    """(completed, the weights match): the job completed when nothing went wrong in the harness,
    one final save exists and every host still in the job ended with 0 - a host that was not
    (``outside``: its slot; one that could not rejoin, turned away or left waiting, or a new
    machine started after the job had ended) is a finding of its own, not a failed job. The
    weights are compared whenever the job saved them."""
    completed = error is None and bool(codes) and len(saved) == 1 and \
        all(c == 0 for i, c in codes.items() if i not in outside)
    match = len(saved) == 1 and ref_code == 0 and common.params_equal(reference, saved[0])
    return completed, match


class Harness:
    """One job across test hosts and the faults of the outside world thrown at it."""

    def __init__(self, j: Any, flags: list[str], script_args: list[str], times: Path,
                 env: dict[str, str], slots: int, say: Callable[[str], None]):
        self.j, self.flags, self.script_args, self.times = j, flags, script_args, times
        self.env, self.slots, self.say = env, slots, say
        self.restarts = 0
        self.seen_released: dict[int, int] = {}  # slot -> its releases replaced so far
        self._read_at_end: dict[int, Any] = {}  # slot -> its ended host, whose output was read
        self.zombies: list[dict[str, Any]] = []  # stopped ranks: (wid, the generation that left them)

    # -- the job -------------------------------------------------------------------------------
    def start_host(self, i: int, name: str | None = None) -> None:
        self.j.start(i, *self.flags, script=str(SCRIPT), env=self.env, name=name,
                     script_args=[*self.script_args, "--save",
                                  str(self.j.base / "final-job.pt")])  # the same on every host

    def alive(self) -> bool:
        return any(p.poll() is None for p in self.j.procs.values())

    def step(self) -> int:
        return max((s for s, *_ in read_times(self.times)), default=0)

    def hosts_registered(self) -> int:
        from nonstop.protocol import hosts as keys
        from .hosts import _etcd

        with _etcd(self.j) as etcd:
            return etcd.count(keys.HOSTS)

    def hosts_in_job(self) -> int:
        """Hosts alive in etcd that the controller in office has taken in as nodes, not isolated
        (as its journal says: written whenever a host joins or is lost)."""
        from nonstop.protocol import hosts as keys
        from .hosts import _etcd

        with _etcd(self.j) as etcd:
            raw, _ = etcd.get(keys.JOURNAL)
            rows = etcd.get_prefix(keys.HOSTS)
        if raw is None:
            return 0
        journal = keys.JournalRecord.loads(raw)
        alive = {(r.host_id, r.incarnation) for r in (keys.HostRecord.loads(x[1]) for x in rows)}
        return sum(1 for n, h in journal.nodes.items()
                   if n not in journal.isolated and (h.host, h.incarnation) in alive)

    def wait(self, what: str, pred: Callable[[], bool], timeout_s: float = SETTLE_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            with contextlib.suppress(Exception):  # etcd away, a file half-written: asked again
                if pred():
                    return
            if not self.alive():
                raise RuntimeError(f"the job ended while waiting for {what}")
            time.sleep(0.1)
        raise TimeoutError(f"{what} not within {timeout_s:g} s")

    def released(self) -> list[int]:
        """Slots whose host the job released (isolated, drained) and which has ended: a
        scheduler gives such a slot a new machine, and so does the harness. An ended host's
        output is read once (it writes no more), not at every look."""
        found = []
        for i, p in self.j.procs.items():
            if p.poll() is None or self._read_at_end.get(i) is p:
                continue
            self._read_at_end[i] = p
            count = self.j.output(i).count("released by the job")
            if count > self.seen_released.get(i, 0):
                self.seen_released[i] = count
                found.append(i)
        return found

    def replace_released(self) -> None:
        for i in self.released():
            self.restarts += 1
            self.start_host(i, name=f"host{i}r{self.restarts}")
            self.say(f"chaos: host slot {i} was released by the job: a new machine there")

    def settled(self) -> None:
        """Every host of the job back (a lost one as a new host, a released one replaced) and
        taken in by the controller; ``NotRejoined`` otherwise."""
        def back() -> bool:
            if self.alive():
                self.replace_released()
            return self.hosts_in_job() == self.slots

        try:
            self.wait("every host in the job", back)
        except (RuntimeError, TimeoutError) as exc:
            raise NotRejoined([self.j.names.get(i, f"host{i}") for i in self.outside()],
                              str(exc)) from None

    def outside(self) -> list[int]:
        """The slots whose newest host is not in the job (as the journal says)."""
        from nonstop.protocol import hosts as keys
        from .hosts import _etcd

        try:
            with _etcd(self.j) as etcd:
                raw, _ = etcd.get(keys.JOURNAL)
            journal = keys.JournalRecord.loads(raw) if raw is not None else None
        except Exception:  # noqa: BLE001 - etcd gone: none is known to be in
            journal = None
        inside = set() if journal is None else \
            {h.host for n, h in journal.nodes.items() if n not in journal.isolated}
        return [i for i in range(self.slots) if self.j.names.get(i, f"host{i}") not in inside]

    def events(self, kind: str) -> list[dict[str, Any]]:
        return self.j.of(kind)

    def rank_pid(self, rank: int) -> tuple[int, int] | None:
        """(wid, pid) of the process that holds ``rank`` in the newest generation."""
        gens = self.events("generation")
        if not gens:
            return None
        wid = {int(k): w for k, w in gens[-1]["ranks"].items()}.get(rank)
        pids = {e.get("wid"): e.get("pid") for e in self.events("rank_wrapped")}
        return (wid, pids[wid]) if pids.get(wid) else None

    def slot_of_pid(self, pid: int) -> int | None:
        for i in range(self.slots):
            if pid in self.j.hosts[i].pids():
                return i
        return None

    def victim_slot(self, f: dict[str, Any]) -> int:
        """The scheduled slot, unless it holds the rank a recent bit flip spares (its check
        must see it): then the next one."""
        slot = f["slot"]
        if f.get("spare_rank") is not None and f["kind"] in KILLS_HOST:
            held = self.rank_pid(f["spare_rank"])
            if held is not None and self.slot_of_pid(held[1]) == slot:
                slot = (slot + 1) % self.slots
        return slot

    def controller_slot(self) -> int:
        """The slot of the host whose controller is in office."""
        host = self.events("leader")[-1]["host"]
        return next(i for i in range(self.slots) if self.j.names.get(i, f"host{i}") == host)

    def buddy_slot(self, i: int) -> int:
        """The slot of the host that holds the first replica of host ``i``'s ranks' snapshots
        (the newest placement), else the next slot."""
        from nonstop.protocol import hosts as keys
        from .hosts import _etcd

        with contextlib.suppress(Exception):  # no placement known: the next slot
            with _etcd(self.j) as etcd:
                raw, _ = etcd.get(keys.JOURNAL)
            nodes = keys.JournalRecord.loads(raw).nodes
            node_of = {h.host: n for n, h in nodes.items()}
            name_of = {n: h.host for n, h in nodes.items()}
            node = node_of[self.j.names.get(i, f"host{i}")]
            spawns = {e["wid"]: e["node"] for e in self.events("spawn")}
            ranks = {int(r): w for r, w in self.events("generation")[-1]["ranks"].items()}
            placed = self.events("replication")[-1]["buddies"]
            rank = min(r for r, w in ranks.items() if spawns.get(w) == node)
            buddy = name_of[placed[str(rank)][0]]
            return next(s for s in range(self.slots) if self.j.names.get(s, f"host{s}") == buddy)
        return (i + 1) % self.slots

    def new_host(self, i: int) -> None:
        """Host ``i`` lost: once etcd has let it go, a new machine (a new node id) starts there."""
        self.wait("the lost host's record gone", lambda: self.hosts_registered() < self.slots, 60)
        self.restarts += 1
        self.start_host(i, name=f"host{i}r{self.restarts}")

    # -- the faults ----------------------------------------------------------------------------
    def fire(self, f: dict[str, Any], ckpt: Path | None) -> None:
        kind, j = f["kind"], self.j
        if kind in KILLS_HOST:
            i = self.victim_slot(f)
            f["victim"] = j.names.get(i, f"host{i}")
            if kind == "host_kill":
                j.kill_host(i)
                self.new_host(i)
            elif kind == "buddy_pair":  # a host and the one its snapshots are copied to first
                b = self.buddy_slot(i)
                f["victim"] += f" and its buddy {j.names.get(b, f'host{b}')}"
                j.kill_host(i)
                j.kill_host(b)
                self.new_host(i)
                self.new_host(b)
            elif kind == "launcher_kill":
                os.kill(j.procs[i].pid, signal.SIGKILL)
                j.procs[i].wait(10)
                self.new_host(i)
            elif kind == "preempt":  # its ranks drained to the spare host, then it leaves
                os.kill(j.procs[i].pid, signal.SIGTERM)
                f["exit_code"] = j.procs[i].wait(60)
                self.new_host(i)
            else:  # partition: cut until it fences itself, then healed; it offers itself again
                before = j.output(i).count("fenced")
                j.hosts[i].cut()
                try:
                    self.wait("the cut host fenced", lambda: j.output(i).count("fenced") > before, 60)
                except TimeoutError:  # what it did instead: every thread's stack, in its output
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(j.procs[i].pid, signal.SIGUSR1)
                    time.sleep(1.0)
                    raise
                finally:
                    j.hosts[i].heal()
        elif kind == "controller_kill":
            leaders = self.events("leader")
            f["victim"] = leaders[-1]["host"]
            os.kill(leaders[-1]["pid"], signal.SIGKILL)
            self.wait("a new controller in office", lambda: len(self.events("leader")) > len(leaders))
        elif kind == "etcd_restart":
            j.etcd.stop_member("e0")
            time.sleep(ETCD_DOWN_S)
            j.etcd.start_member("e0")
        elif kind == "etcd_pause":  # a paused VM, a stalled disk: no host may be given up for it
            j.etcd.pause_member("e0")
            try:
                time.sleep(ETCD_PAUSE_S)
            finally:
                j.etcd.resume_member("e0")
        elif kind == "mismatched_host":  # started with other script arguments: refused at once
            i = f["slot"]
            name = f"odd{uuid.uuid4().hex[:6]}"
            f["victim"] = f"{name} on slot {i}"
            args = [*self.script_args, "--save", str(j.base / f"{name}.pt")]  # differs
            cmd = [sys.executable, "-m", "nonstop", "run", "--no-live", "--rdzv-endpoint",
                   j.etcd.url, "--rdzv-id", j.job_id, f"--run-dir={j.base / name}",
                   f"--node-id={name}", *self.flags, str(SCRIPT), *args]
            env = dict(os.environ, NONSTOP_JOB_SECRET=SECRET, **self.env)
            out = j.base / f"{name}.txt"
            with open(out, "wb") as fh:
                proc = j.hosts[i].popen(cmd, env=env, stdout=fh, stderr=subprocess.STDOUT)
            try:
                f["exit_code"] = proc.wait(60)
            except subprocess.TimeoutExpired:
                proc.kill()
                f["exit_code"] = None
            text = out.read_text(errors="replace")
            f["refused"] = f["exit_code"] == 2 and "the script or its arguments differ" in text
        elif kind == "controller_deaf":  # it hears nothing, but what it says still arrives
            i = self.controller_slot()
            f["victim"] = j.names.get(i, f"host{i}")
            before = j.output(i).count("fenced")
            j.hosts[i].deafen()
            try:  # its lease lapses, a standby takes office; reaching no peer, it fences itself
                self.wait("the deaf host fenced", lambda: j.output(i).count("fenced") > before,
                          DEAF_S + 60)
            finally:
                j.hosts[i].hear()
        elif kind == "controller_pause":  # a paused VM: its kernel still accepts connections
            i = self.controller_slot()
            f["victim"] = j.names.get(i, f"host{i}")
            leaders = len(self.events("leader"))
            j.hosts[i].freeze()
            try:
                time.sleep(CONTROLLER_PAUSE_S)
            finally:
                j.hosts[i].thaw()
            self.wait("a new controller in office", lambda: len(self.events("leader")) > leaders)
        elif kind == "slow_link":  # no fault: the steps slow, the job waits, nothing is replaced
            i = f["slot"]
            f["victim"] = j.names.get(i, f"host{i}")
            j.hosts[i].throttle(SLOW_KBIT)
            try:
                time.sleep(SLOW_LINK_S)
            finally:
                j.hosts[i].unthrottle()
        elif kind == "etcd_disk_full":  # the member stops on its full disk; quorum, if any, holds
            name = f"e{f['slot'] % len(j.etcd.members)}"
            f["victim"] = f"etcd member {name}"
            j.fill_etcd_disk(name)
            try:
                member = j.etcd.member(name)
                deadline = time.monotonic() + 30  # stopped at its next commit to the full disk
                while member.running and time.monotonic() < deadline:
                    time.sleep(0.1)
                f["etcd_stopped"] = not member.running
            finally:
                j.free_etcd_disk(name)
            if not j.etcd.member(name).running:  # its operator frees the disk, starts it again
                j.etcd.start_member(name)
        elif kind == "keeper_kill":
            i = f["slot"]
            f["victim"] = j.names.get(i, f"host{i}")
            for pid in j.hosts[i].pids():
                with contextlib.suppress(OSError):
                    if b"nonstop.keeper" in Path(f"/proc/{pid}/cmdline").read_bytes():
                        os.kill(pid, signal.SIGKILL)
        elif kind == "stop_cont":
            held = self.rank_pid(f["rank"])
            if held is None:
                return
            wid, pid = held
            f["victim"] = f"rank {f['rank']} (wid {wid}, pid {pid})"
            n = len(self.events("generation"))
            try:
                os.kill(pid, signal.SIGSTOP)
            except ProcessLookupError:  # it ended meanwhile (the job, or a fault of its own)
                f["victim"] += ": gone before the signal"
                return
            try:
                self.wait("a generation without the stopped rank", lambda: any(
                    wid not in g["ranks"].values() for g in self.events("generation")[n:]))
            finally:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGCONT)
            self.zombies.append({"wid": wid, "gen": self.events("generation")[-1]["gen"]})
        elif kind == "disk_full" and ckpt is not None:
            filler = ckpt / "filler"
            with contextlib.suppress(OSError), open(filler, "wb") as fh:
                while True:
                    fh.write(b"\0" * (1 << 20))
            start = self.step()
            try:
                self.wait("checkpoints failing on the full disk",
                          lambda: self.step() >= start + 2 * CKPT_EVERY)
            finally:
                filler.unlink(missing_ok=True)

    def zombie_joined(self) -> list[int]:
        """Stopped ranks seen joining a generation after the one that replaced them."""
        joins = self.events("rank_joining")
        return [z["wid"] for z in self.zombies
                if any(e.get("wid") == z["wid"] and e.get("gen", 0) >= z["gen"] for e in joins)]


def _mount_tmpfs(path: Path, mb: int) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m", "nonstop-chaos", str(path)],
                       capture_output=True, timeout=10)
    return r.returncode == 0


def _umount(path: Path) -> None:
    subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=10)


def _shm() -> set[str]:
    try:
        return set(os.listdir("/dev/shm"))
    except OSError:
        return set()


def soak(seed: int, faults: int, hosts: int, per_host: int, spares: int, base: Path,
         say: Callable[[str], None], steps: int | None = None,
         only: list[str] | None = None, etcd_members: int = 1) -> dict[str, Any]:
    from .hostjob import HostJob
    from .hosts import _wait_etcd
    from nonstop.protocol import hosts as keys

    spare = spare_hosts(only)
    world, slots = hosts * per_host, hosts + spare
    plan = schedule(seed, faults, world, slots, only)
    steps = max(steps or 0, needed(plan))
    run_timeout_s = max(RUN_TIMEOUT_S, RUN_S_PER_STEP * steps)
    marker = uuid.uuid4().hex
    kinds = {f["kind"] for f in plan}
    say(f"chaos: seed {seed}, {faults} faults over {steps} steps, {hosts} hosts x {per_host} "
        f"ranks + {spare} spare host(s) ({spares} warm spare(s) per host), etcd on "
        f"{etcd_members} host(s) of its own; runs in {base}")
    for f in plan:
        say(f"  step {f['step']:5d}  {f['kind']:26s} "
            + (f["spec"] if "spec" in f else f"host slot {f['slot']}, rank {f['rank']}"))
    common.fresh(base)
    slow = base / "slow"  # while it exists, the job's steps are slower (train_timed.py)
    script_args = ["--steps", str(steps), "--sleep-ms", str(SLEEP_MS), "--slow-file", str(slow)]
    # the fault-free run on one host, beside the job (its sleep changes no number: none here)
    ref_cmd = common.nonstop_cmd(f"--nproc={world}", f"--run-dir={base / 'reference' / 'run'}",
                                 str(SCRIPT), "--steps", str(steps), "--save",
                                 str(base / "reference.pt"))
    (base / "reference").mkdir()
    ref: list[int] = []
    ref_procs: list[subprocess.Popen] = []  # ended by its pid if the soak is (SIGTERM, ^C)
    ref_thread = threading.Thread(target=lambda: ref.append(common.run_child(
        ref_cmd, base / "reference" / "output.log", run_timeout_s, started=ref_procs)),
        daemon=True)
    # two hosts lost at once leave a copy of every snapshot only with two replicas of each
    (base / "policy.yaml").write_text(POLICY + ("state:\n  snapshot: {replicas: 2}\n"
                                                if kinds & set(NEEDS_TWO_SPARES) else ""))
    ckpt = base / "ckpt"
    mounted = False  # (inside the try: a soak ended at any moment unmounts it)
    times = base / "steps.txt"
    spec = ";".join(f["spec"] for f in plan if "spec" in f)
    flags = ["--nnodes", str(hosts), "--nproc-per-node", str(per_host), "--spare-nodes", str(spare),
             "--spares", str(spares), f"--policy={base / 'policy.yaml'}",
             f"--checkpoint-dir={ckpt}", f"--checkpoint-every={CKPT_EVERY}"]
    if spec:
        flags.append(f"--inject={spec}")
    shm_before = _shm()
    t0, error, codes, wall = time.time(), None, {}, 0.0
    events: list[dict[str, Any]] = []
    outside: list[int] = []  # slots whose host could not rejoin the job
    rejoin_failed: list[dict[str, Any]] = []
    late_hosts: list[str] = []  # started after the job had ended (a fault fired near its end)
    left_in_hosts: list[int] = []
    zombies: list[int] = []
    names: dict[int, str] = {}
    h: Harness | None = None
    try:
        ref_thread.start()
        mounted = _mount_tmpfs(ckpt, DISK_MB)
        with HostJob(base / "job", hosts=slots, etcd_members=etcd_members, tag="nsc",
                     etcd_disk_mb=ETCD_DISK_MB if "etcd_disk_full" in kinds else None) as j:
            h = Harness(j, flags, [*script_args, "--step-times", str(times)], times,
                        {"NONSTOP_CHAOS_RUN": marker}, slots, say)
            try:
                h.start_host(0)
                _wait_etcd(j, "a controller in office", lambda e: e.leader(keys.LEADER) is not None,
                           START_TIMEOUT_S)
                for i in range(1, slots):  # one at a time: host i is node i (a spare: the last)
                    h.start_host(i)
                    h.wait(f"host {i} registered", lambda i=i: h.hosts_registered() > i,
                           START_TIMEOUT_S)
                for f in plan:
                    if f["kind"] not in HOST_KINDS:
                        continue
                    wait_step(times, f["step"], run_timeout_s, h.alive)
                    slow.touch()  # the job slows while the hosts come back: it must not end first
                    try:
                        h.settled()
                    except NotRejoined as exc:  # the job goes on (or ended) without it
                        outside = h.outside()
                        if not outside:  # every host is in, as the journal says: not this
                            raise
                        say(f"chaos: {exc}: no more faults")
                        break
                    finally:
                        slow.unlink(missing_ok=True)
                    f["fired_step"] = h.step()
                    f["t_abs"] = time.time()
                    f["t"] = round(f["t_abs"] - t0, 3)
                    h.fire(f, ckpt if mounted else None)
                    say(f"  {f['t']:8.1f} s  step {f['fired_step']:5d}  {f['kind']}"
                        + (f" ({f['victim']})" if f.get("victim") else ""))
                codes = j.wait(run_timeout_s)
            except Exception as exc:  # noqa: BLE001 - said in the result, the job ended below
                error = f"{type(exc).__name__}: {exc}"
                say(f"chaos: {error}\n{traceback.format_exc()}")
            wall = time.time() - t0
            events = j.events()
            for i in outside:
                text = j.output(i)
                rejoin_failed.append({
                    "host": j.names.get(i, f"host{i}"), "exit_code": codes.get(i),
                    "why": "turned away: the job was full" if "the most it takes" in text
                    else "not taken in before the job ended"})
            # a lost host's new machine that started as the job ended was refused for that
            late = [i for i, c in codes.items() if c == 2 and i not in outside
                    and "has already ended" in j.output(i)]
            late_hosts = [j.names.get(i, f"host{i}") for i in late]
            outside += late
            if error is None:  # what the job left behind (after an error the hosts are ended):
                # given the moments a process of an ended launcher takes to follow it (its
                # children die with it), as the one-host soak gives them
                left_in_hosts = _still_in(j, slots, ORPHAN_GRACE_S)
            zombies = h.zombie_joined()
            names = dict(j.names)
    except Exception as exc:  # noqa: BLE001 - the test hosts or etcd could not be made
        error = error or f"{type(exc).__name__}: {exc}"
    except BaseException:  # the soak itself ended (SIGTERM, ^C): its reference run with it
        common.end(ref_procs)
        raise
    finally:
        if mounted:
            _umount(ckpt)
    ref_thread.join(run_timeout_s)
    ref_code = ref[0] if ref else None
    left = chaos.orphans_after(marker, ORPHAN_GRACE_S)
    of = lambda kind: [e for e in events if e.get("type") == kind]  # noqa: E731
    fired = chaos.fired_at(events)
    incidents = of("incident")
    by_kind: dict[str, dict[str, Any]] = {}
    index = 0
    moments = []
    for f in plan:
        entry = by_kind.setdefault(f["kind"], {"scheduled": 0, "fired": 0})
        entry["scheduled"] += 1
        if "spec" in f:
            n = len(f["spec"].split(";"))
            if all(i in fired for i in range(index, index + n)):
                entry["fired"] += 1
                moments.append((f["kind"], fired[index]))
            index += n
        elif "t_abs" in f:
            entry["fired"] += 1
            moments.append((f["kind"], f["t_abs"]))
    chaos.add_costs(by_kind, moments, incidents)
    levels: dict[str, int] = {}
    for inc in incidents:
        for lvl in inc.get("levels") or []:
            levels[lvl] = levels.get(lvl, 0) + 1
    saved = sorted((base / "job").glob("final-*.pt"))
    final_codes = {names.get(i, f"host{i}"): c for i, c in codes.items()}
    completed, match = judge(error, codes, saved, outside, ref_code, base / "reference.pt")
    # a host that differs must be refused, never let in (nor blamed on the hardware)
    let_in = [f.get("victim") for f in plan if f["kind"] == "mismatched_host" and "t_abs" in f
              and not f.get("refused")]
    shm_left = sorted(_shm() - shm_before)
    # the summary of the controller in office at the end counts the job's incidents
    summaries = sorted((base / "job").glob("*/summary.json"), key=lambda p: p.stat().st_mtime)
    last = json.loads(summaries[-1].read_text()) if summaries else {}
    return {
        "scenario": "chaos", "seed": seed, "faults": faults, "hosts": hosts,
        "spare_hosts": spare, "etcd_members": etcd_members,
        "ranks_per_host": per_host, "completed": completed, "params_match_reference": match,
        "rejoin_failed": rejoin_failed, "late_hosts": late_hosts,
        "incidents_closed": sum(1 for i in incidents if i.get("outcome") == "recovered"),
        "incidents": len(incidents), "summary_incidents": last.get("incidents"),
        "incidents_with_phases": sum(1 for i in incidents if i.get("phases_s")),
        "orphans": len(left) + len(left_in_hosts), "shm_left": shm_left,
        "zombies_joined": zombies, "mismatched_let_in": let_in, "by_kind": by_kind,
        "levels": levels,
        "takeovers": max(0, len(of("leader")) - 1), "hosts_restarted": h.restarts if h else 0,
        "scaled_in": len([e for e in of("generation") if len(e.get("ranks") or {}) < world]),
        "steps_lost": sum(i.get("steps_lost") or 0 for i in incidents),
        "steps_lost_bound": chaos.steps_lost_bound(events),
        "unfired": {k: e["scheduled"] - e["fired"] for k, e in by_kind.items()
                    if e["fired"] < e["scheduled"]},
        "wall_s": round(wall, 2) if codes else None, "error": error,
        "exit_codes": final_codes, "reference_exit_code": ref_code, "disk_full_tested": mounted,
        "steps": steps, "date": common.now_stamp(), "schedule": plan,
    }


def keep_or_clean(result: dict[str, Any], base: Path, keep: bool, say: Callable[[str], None]) -> bool:
    ok = result["completed"] and result["params_match_reference"] and not result["orphans"] \
        and not result["zombies_joined"] and not result.get("mismatched_let_in") \
        and not result["rejoin_failed"] and result["steps_lost_bound"]["held"] \
        and not result["unfired"]
    if ok and not keep:
        shutil.rmtree(base, ignore_errors=True)
    elif not ok:
        say(f"chaos: the runs are kept in {base}")
    return ok


def describe(result: dict[str, Any]) -> str:
    return (f"chaos across hosts: completed {result['completed']}, weights match "
            f"{result['params_match_reference']}, hosts that could not rejoin "
            f"{[f['host'] + ' (' + f['why'] + ')' for f in result['rejoin_failed']] or 'none'}, "
            f"incidents {result['incidents_closed']}/"
            f"{result['incidents']} closed, takeovers {result['takeovers']}, hosts restarted "
            f"{result['hosts_restarted']}, orphans {result['orphans']}, zombies joined "
            f"{result['zombies_joined']}, mismatched hosts let in "
            f"{result.get('mismatched_let_in') or 'none'}, unfired {result['unfired'] or 'none'}, "
            f"levels {result['levels']}, steps lost "
            f"{result['steps_lost']} (bound "
            + ("held" if result["steps_lost_bound"]["held"] else "BROKEN by incident(s) " + ", ".join(
                f"{b['id']} ({b['steps_lost']} > {b['bound']})"
                for b in result["steps_lost_bound"]["broken"])) + ")"
            + (f", error {result['error']}" if result["error"] else "")
            + f"\n{json.dumps(result['by_kind'])}")


def main(args: argparse.Namespace) -> int:
    """``nonstop chaos --hosts H``: the soak across test hosts."""
    import tempfile

    from nonstop.errors import UsageError
    from .netns import available

    hosts, per_host = args.hosts, args.ranks_per_host
    spares = 1 if args.spares_chaos is None else args.spares_chaos
    if args.faults < 1 or hosts < 2 or per_host < 1:
        raise UsageError("--faults must be at least 1, --hosts at least 2 and --ranks-per-host "
                         "at least 1")
    ok, why = available()
    if not ok:
        raise UsageError(f"chaos --hosts needs test hosts (network namespaces): {why}")
    base = Path(args.out) if args.out else Path(tempfile.mkdtemp(prefix="nonstop-chaos-hosts-"))
    base.mkdir(parents=True, exist_ok=True)
    only = [k.strip() for k in (args.kinds or "").split(",") if k.strip()]
    known = [*RANK_KINDS, *HOST_KINDS]
    bad = [k for k in only if k not in known]
    if bad:
        raise UsageError(f"unknown fault kind(s) {', '.join(bad)} (known: {', '.join(known)})")
    say = (lambda m: print(m, file=sys.stderr, flush=True)) if args.json else print
    members = args.etcd_members
    if members < 1 or members % 2 == 0:
        raise UsageError(f"--etcd-members must be an odd number of 1 or more, not {members}")
    result = soak(args.seed, args.faults, hosts, per_host, spares, base, say,
                  steps=args.steps, only=only or None, etcd_members=members)
    say(describe(result))
    ok = keep_or_clean(result, base, bool(args.out), say)
    common.emit(result, args.json)
    return 0 if ok else 1


def _still_in(j: Any, slots: int, grace_s: float) -> list[int]:
    """The processes still in the job's test hosts once ``grace_s`` has passed with some there."""
    deadline = time.time() + grace_s
    while True:
        left = sorted({p for i in range(slots) for p in j.hosts[i].pids()})
        if not left or time.time() >= deadline:
            return left
        time.sleep(0.2)
