"""Silent data corruption: the data-parallel replicas' parameters compared at each snapshot, and
between snapshots at an interval of their own.

Each rank digests its parameters' bits: a tensor in host memory by xxh3 over its bytes (at memory
speed: 400 MB in about 0.03 s here), one on a device by a sum of its bits as integers (a tensor
viewed as words of its own width, summed in 64 bits, on the device: exact, so equal whatever the
reduction order). Either way bitwise-equal parameters give equal digests on every rank, and a
single flipped bit always changes it. The ranks gather their digests (with each, what it took
and the rank's time in the previous gather: the check's own cost) and find the odd ones out -
in a sharded or pipelined job, each among its twins. Every agreeing check extends a chain
(SHA-256 over the steps and digests), which the run's summary reports: a certificate that every
snapshot step's weights agreed across replicas - and a difference, once it exists, persists to
the next check, so no step in between can have disagreed unseen.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import math
import statistics
import time
from typing import Any

from ..decide.sdc import POINTS
from ..protocol.events import DigestChecks, ReplayEvidence
from ..protocol.rank_policy import RankSdc

_MIX = 1_000_003  # digests of the tensors combined in order: a swap of two changes the result
_MOD = 2**64  # a sum of 64-bit words wraps: every bit of it counts, the top one too


class SilentCorruption(BaseException):
    """Raised at a comparison when the replicas' parameters differ. A BaseException, like
    ``Regroup``, so that the script's ``except Exception`` lets it through."""

    def __init__(self, step: int, suspects: list[int], digests: list[int],
                 twins: tuple[int, ...] | None = None, replay: list[Any] | None = None,
                 scheduled: bool = False):
        super().__init__(
            f"the replicas' parameters differ at step {step}: rank(s) "
            f"{', '.join(map(str, suspects))} disagree with "
            + ("the others" if twins is None else "their twins") if not scheduled else
            f"step {step - 1} does not replay bit for bit: three passes over it, no two alike "
            f"on every rank (rank(s) {', '.join(map(str, suspects))} named)")
        self.step, self.suspects, self.digests = step, suspects, digests
        self.twins = twins  # the part each rank holds (None: every rank the same)
        # found at a replay of the steps: where each rank's passes first differ (ReplayEvidence)
        self.replay = replay
        self.scheduled = scheduled  # ...a replay check of the policy's (no twin compared)


@dataclasses.dataclass(frozen=True)
class Replayed:
    """A replay that agreed, for rank 0 to report (``SdcReplayed``): the comparison at
    ``step``, every rank's evidence and digest; ``scheduled``: a replay check of the policy's,
    where ``struck`` is the pass the other two outvoted."""

    step: int
    evidence: list[ReplayEvidence]
    digests: list[int]
    scheduled: bool = False
    struck: int | None = None


SHARDED = ("sharded parameters (FSDP2, tensor parallel, pipeline stages): each rank holds its own "
           "part, which no other rank holds to compare it with (HSDP's replica groups, and a "
           "pipeline's data-parallel groups, have twins to compare)")


def sharded(modules: list[Any]) -> bool:
    """Whether some parameter of ``modules`` is a DTensor split across ranks (FSDP2, tensor
    parallel): each rank holds a part of its own, so the ranks' digests are not comparable."""
    for m in modules:
        for p in m.parameters():
            placements = getattr(p, "placements", None)
            if placements is not None and any(pl.is_shard() for pl in placements):
                return True
    return False


def digest(modules: list[Any]) -> int:
    """An integer digest of the parameters of ``modules``: equal on two ranks when their bits
    are, and changed by any single flipped bit (a sum of words: values moved around within one
    tensor are not seen - not what a bit flip does - but two tensors swapped are)."""
    import torch

    parts: list[Any] = []  # per tensor, in order: an int (hashed here) or a 0-d tensor (a sum)
    with torch.no_grad():
        for m in modules:
            for p in m.parameters():
                # a DTensor (FSDP2, tensor parallel): this rank's shard. Its local tensor taken
                # first, with no autograd: a DTensor's detach() is dispatched as a DTensor op -
                # 24 small FSDP2 parameters spent 15-22 ms there, 0.6-0.9 ms so (a loaded host)
                t = p.to_local() if hasattr(p, "to_local") else p.detach()
                part = _word(t)
                if part is not None:
                    parts.append(part)
    return _combined(parts)


_WORDS: dict[int, Any] = {}


def _word(t: Any) -> Any:
    """One tensor's part of a digest: an int (xxh3 of its bytes, in host memory), a 0-d tensor
    (the sum of its words as 64-bit integers, on its device: read later, with the others), or
    None (nothing to digest)."""
    import torch
    import xxhash

    if not _WORDS:
        _WORDS.update({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64})
    word = _WORDS.get(t.element_size())
    if word is None or t.numel() == 0:
        return None
    if t.device.type == "cpu" and t.is_contiguous():
        # the sum of a 100M-element tensor in 64 bits ran at 0.6 GB/s: a restore of a 400 MB
        # model waited 0.7 s for it (nonstop bench state)
        return xxhash.xxh3_64_intdigest(memoryview(t.reshape(-1).view(torch.uint8).numpy()))
    return torch.sum(t.contiguous().view(word), dtype=torch.int64)


def _combined(parts: list[Any]) -> int:
    """The parts of a digest in order, as one signed 64-bit integer (a device's sums read in
    one transfer)."""
    if not parts:
        return 0
    import torch

    sums = [x for x in parts if not isinstance(x, int)]
    summed = iter(torch.stack(sums).cpu().tolist() if sums else [])  # one transfer from the device
    out = 0
    for x in parts:
        v = x if isinstance(x, int) else next(summed)
        out = (out * _MIX + v) % _MOD
    return out - _MOD if out >= _MOD // 2 else out  # all 64 bits, as a signed 64-bit integer


START, OUTPUT, END = 0, 1, 2  # the points of a step (decide/sdc.py, POINTS)


class StepTrace:
    """What this rank's steps computed, point by point, since its newest snapshot whose
    comparison agreed: each step's forward outputs (a digest per forward of the registered
    modules, in order) and, where a replay check asks for them, the parameters it started from
    and ended with. After a corruption's rollback the same steps are run again from the same
    state and inputs, and each rank's two passes are compared point by point: the faulty rank's
    part first (decide/sdc.py). A forward's output is digested as it comes - in host memory by
    xxh3 over its bytes, on a device by a sum of its words there, read only when a replay
    asks."""

    LIMIT = 4096  # points kept at most (snapshots far apart: the oldest go first)

    def __init__(self) -> None:
        self._points: dict[tuple[int, int], Any] = {}  # (step, point) -> an int, or [parts]

    def begin(self, step: int) -> None:
        """Step ``step`` starts (again, in a replay): its outputs are counted afresh."""
        self._points.pop((step, OUTPUT), None)

    def output(self, step: int, out: Any) -> None:
        """A forward output of step ``step`` (a tensor: a DTensor's local part)."""
        if out is None:
            return
        local = out.to_local() if hasattr(out, "to_local") else out
        part = _word(local)
        if part is None:
            return
        parts = self._points.get((step, OUTPUT))
        if parts is None:
            if len(self._points) >= self.LIMIT:
                del self._points[min(self._points)]
            parts = self._points[(step, OUTPUT)] = []
        parts.append(part)

    def note(self, step: int, point: int, value: int) -> None:
        self._points[(step, point)] = value

    def value(self, step: int, point: int) -> Any:
        """A point's digest: an int, or for the forward outputs a tuple (one per forward)."""
        return _read(self._points.get((step, point)))

    def points(self) -> dict[tuple[int, int], Any]:
        """Every point recorded, read (a device's sums now)."""
        return {k: _read(v) for k, v in self._points.items()}

    def keep_from(self, step: int) -> None:
        """A snapshot of ``step`` agreed: no rollback goes back before it."""
        for k in [k for k in self._points if k[0] < step]:
            del self._points[k]

    def redo_from(self, step: int) -> None:
        """The rank resumes at ``step``: what it recorded from there on is run again."""
        for k in [k for k in self._points if k[0] >= step]:
            del self._points[k]


def _read(v: Any) -> Any:
    if not isinstance(v, list):
        return v
    import torch

    sums = [x for x in v if not isinstance(x, int)]
    summed = iter(torch.stack(sums).cpu().tolist() if sums else [])  # one transfer
    return tuple(x if isinstance(x, int) else _signed(next(summed)) for x in v)


def _signed(v: int) -> int:
    v %= _MOD
    return v - _MOD if v >= _MOD // 2 else v


def alike(a: Any, b: Any) -> bool:
    """Two passes' digests of one point alike. Forward outputs (a digest per forward) are
    compared over the forwards both passes made last: a pass may make forwards at a step's
    start that are not the step's own - a pipeline stage made anew in each generation infers
    its shapes with a forward over empty tensors at its first step, which a replay's first step
    always is."""
    if isinstance(a, tuple) and isinstance(b, tuple):
        n = min(len(a), len(b))
        return a[len(a) - n:] == b[len(b) - n:]
    return a == b


def word(v: Any, other: Any = None) -> int:
    """A point's digest as one 64-bit word (forward outputs: of the forwards it shares with
    ``other``'s, as ``alike`` compares them)."""
    if not isinstance(v, tuple):
        return int(v or 0)
    n = min(len(v), len(other)) if isinstance(other, tuple) else len(v)
    out = 0
    for x in v[len(v) - n:]:
        out = (out * _MIX + x) % _MOD
    return _signed(out)


def parted(first: dict[tuple[int, int], Any], second: dict[tuple[int, int], Any]
           ) -> tuple[int, tuple[int, int] | None]:
    """Where two passes first differ, over the points both recorded: (points compared, the
    first (step, point) that differs, or None)."""
    common = sorted(set(first) & set(second))
    return len(common), next((k for k in common if not alike(first[k], second[k])), None)


def evidence_of(gathered: list[list[int]]) -> list[ReplayEvidence]:
    """Every rank's evidence from its gathered words: [points compared, step, point, first
    pass's digest, replay's] (step -1: its passes agree throughout)."""
    return [ReplayEvidence(rank=r, compared=w[0]) if w[1] < 0 else
            ReplayEvidence(rank=r, compared=w[0], step=w[1], point=POINTS[w[2]],
                           first=w[3], second=w[4]) for r, w in enumerate(gathered)]


def odd_ones(digests: list[int]) -> list[int]:
    """The ranks whose digest differs from the majority's; with no strict majority (two ranks,
    a tie), every rank outside the largest group that is not itself a majority is suspect - all
    of them: which side is right cannot be told."""
    counts = collections.Counter(digests)
    if len(counts) <= 1:
        return []
    value, n = counts.most_common(1)[0]
    if n * 2 > len(digests):
        return [r for r, d in enumerate(digests) if d != value]
    return list(range(len(digests)))


def _odd_twins(digests: list[int], twins: tuple[int, ...]) -> list[int]:
    """The ranks whose digest differs from their twins' (the ranks holding the same shard)."""
    out: list[int] = []
    for shard in set(twins):
        ranks = [r for r, t in enumerate(twins) if t == shard]
        out += [ranks[i] for i in odd_ones([digests[r] for r in ranks])]
    return sorted(out)


def gather_words(words: list[int], world: int) -> list[list[int]]:
    """Every rank's ``words`` (64-bit integers, as many on every rank), in rank order: one
    all-gather into one tensor. (``all_gather_single`` is the name torch 2.13 asks for; the one
    before it, ``all_gather_into_tensor``, printed a FutureWarning in every rank's log. Both the
    digest check and a mesh's check of its twins gather here.)"""
    import torch
    import torch.distributed as dist

    mine = torch.tensor(words, dtype=torch.int64)
    every = torch.zeros(world * len(words), dtype=torch.int64)
    gather = dist.all_gather_single if hasattr(dist, "all_gather_single") \
        else dist.all_gather_into_tensor  # (torch before 2.13)
    gather(every, mine)
    flat, n = every.tolist(), len(words)
    return [flat[r * n:(r + 1) * n] for r in range(world)]


def check_cost(digest_s: list[float], gather_s: list[float | None]) -> float | None:
    """What one check costs the job's steps: the slowest rank's digest, and the all-gather as
    the last rank to reach it measured it - the shortest of the ranks' times in the previous
    check's gather (``gather_s``). A rank that reached the gather early waited there for a peer
    still finishing its step (its optimizer step, its snapshot's copy, the host's other work),
    and would have waited as long at the next collective without any check: on one loaded
    host that wait was a median of 70-110 ms, in a pipeline and in HSDP alike, three times
    the gather itself, and counted as the check's cost it spaced the snapshots out by as much.
    None (not counted) where some rank made no gather yet: the first check of a generation,
    whose gather holds every wait of the restore before it and whose digest a new process
    makes first - counted, its cost set every rank's interval (the largest wins) far apart
    after each replacement."""
    if not gather_s or any(g is None for g in gather_s):
        return None
    return max(digest_s, default=0.0) + min(g for g in gather_s if g is not None)


def _all_know() -> None:
    """The replicas differ: wait until every rank holds the digests before any acts on it. A
    rank's all-gather may return while a peer's is still reading what it sent; a rank that then
    left (and died leaving: a crash in the teardown) reset its connections, the peer's gather
    failed, and the only ranks that knew of the mismatch were gone - the controller never heard
    of it, and the corrupted rank's live state, the only one left, went to the new ranks. A
    second collective ends only once every rank is past the first. Its own failure (a peer gone
    meanwhile) changes nothing: this rank knows."""
    import torch
    import torch.distributed as dist

    try:
        dist.all_reduce(torch.zeros(1))
    except Exception:  # noqa: BLE001 - the mismatch is known here: raised by the caller
        pass


class Digests:
    """One rank process's checks: their cost (which spaces the snapshots out when needed), and
    the chain of the agreeing ones."""

    def __init__(self, policy: RankSdc):
        self.enabled = policy.enabled
        self.report_only = policy.action == "report"
        self.max_share = policy.max_overhead_pct / 100
        self._costs: collections.deque[float] = collections.deque(maxlen=9)
        self._gather_s: float | None = None  # this rank's time in the last check's all-gather
        self.checks = 0
        self.first_step: int | None = None
        self.last_step: int | None = None
        self.chain = ""
        self.mismatch: SilentCorruption | None = None  # the last one found (report mode)
        # the newest snapshot this process committed of a step its check agreed on, and when
        # (wall clock): what a corruption found later rolls back to at worst (kept across
        # generations; a snapshot written without a check - a reshard's - is not certified)
        self.certified: int | None = None
        self.certified_t: float | None = None
        self.uncompared: str | None = None  # why the parameters are not compared (sharded)
        self.trace = StepTrace()  # what the steps since the newest agreeing snapshot computed
        # the trace of the pass that found the replicas differing (and the step): what a replay
        # of the same steps after the rollback is compared with (kept across generations)
        self.first_pass: tuple[int, dict[tuple[int, int], Any]] | None = None
        self.replayed: Replayed | None = None  # a replay that agreed, for rank 0 to report
        # the policy's replay checks in this generation (state/replay.py): how many, the seconds
        # they added, the seconds of the steps among which they were made
        self.replays, self.replay_s, self.stepped_s = 0, 0.0, 0.0

    @property
    def cost_s(self) -> float | None:
        return statistics.median(self._costs) if self._costs else None

    def check(self, modules: list[Any], step: int, world: int,
              twins: tuple[int, ...] | None = None, meshed: bool = False,
              recheck: int | None = None) -> float:
        """Compare this step's parameters with every other rank's (a collective: every rank
        calls it at the same steps); sharded parameters - or any state built over a mesh
        (``meshed``: a pipeline's stages are plain tensors) - with their twins' only
        (``twins[r]``: the part rank r holds). Returns the seconds it took; raises
        ``SilentCorruption`` when they differ (unless the policy only reports: then ``mismatch``
        says so). ``recheck``: the comparison where the replicas were found to differ (every
        rank's alike), to be reached again after the rollback: there - or at a mismatch on the
        way to it, a fault that recurs - each rank's two passes are compared too, and every
        rank's evidence gathered (``replayed``, or the ``SilentCorruption``'s)."""
        if not self.enabled or world < 2 or not modules:
            return 0.0
        own = meshed or sharded(modules)  # each rank may hold a part of its own
        if own and (twins is None or len(set(twins)) == len(twins)):
            # no two ranks of this generation hold the same part: nothing to compare - decided
            # for each world (every rank alike), not once: an HSDP job shrunk to one replica
            # group has no twins until it grows back, and a survivor that skipped the check
            # from then on left its new twins alone in its collective
            self.uncompared = SHARDED
            return 0.0
        self.uncompared = None
        classes = twins if own else None
        t0 = time.perf_counter()
        mine = digest(modules)
        t1 = time.perf_counter()
        # with the digest, what this rank's digest took and its previous gather (ns; -1: none)
        every = gather_words([mine, round((t1 - t0) * 1e9),
                              -1 if self._gather_s is None else round(self._gather_s * 1e9)],
                             world)
        t2 = time.perf_counter()
        self._gather_s = t2 - t1
        spent = t2 - t0
        digests = [w[0] for w in every]
        cost = check_cost([w[1] / 1e9 for w in every],
                          [None if w[2] < 0 else w[2] / 1e9 for w in every])
        if cost is not None:
            self._costs.append(cost)
        suspects = odd_ones(digests) if classes is None else _odd_twins(digests, classes)
        replaying = recheck is not None and (step == recheck or (suspects and step < recheck))
        evidence = self._evidence(step, mine, world) if replaying else None
        if suspects:
            found = SilentCorruption(step, suspects, digests, classes, replay=evidence)
            _all_know()
            if not self.report_only:
                self.first_pass = (step, {**self.trace.points(), (step - 1, END): mine})
                raise found
            self.mismatch = found
            return spent
        if evidence is not None and any(e.compared for e in evidence):
            self.replayed = Replayed(step, evidence, digests)
        self.checks += 1
        self.first_step = step if self.first_step is None else self.first_step
        self.last_step = step
        agreed = digests[0] if classes is None else ",".join(
            str(digests[classes.index(c)]) for c in sorted(set(classes)))  # each shard's
        self.chain = hashlib.sha256(f"{self.chain}:{step}:{agreed}".encode()).hexdigest()
        return spent

    def _evidence(self, step: int, mine: int, world: int) -> list[ReplayEvidence]:
        """Where this rank's passes over the steps to ``step`` first differ - its first pass
        (``first_pass``) and the replay now - gathered from every rank (a collective)."""
        first = self.first_pass
        if first is not None and first[0] == step:
            self.first_pass = None  # (compared: the replay reached it)
        now = {**self.trace.points(), (step - 1, END): mine}
        n, at = parted(first[1], now) if first is not None and first[0] >= step else (0, None)
        words = [n, -1, -1, 0, 0] if at is None else \
            [n, at[0], at[1], word(first[1][at], now[at]), word(now[at], first[1][at])]
        return evidence_of(gather_words(words, world))

    def committed(self, step: int) -> None:
        """A snapshot of ``step`` was committed to the node's memory: certified if a check of
        this generation agreed at that step or later (a difference, once there, persists)."""
        if self.last_step is not None and step <= self.last_step:
            self.certified, self.certified_t = step, time.time()

    def interval(self, step_s: float | None, cost_s: float | None = None) -> int:
        """The fewest steps between checks that keeps them under their share of step time
        (``cost_s``: one check's, agreed by every rank; else this rank's own)."""
        cost = cost_s if cost_s is not None else self.cost_s
        if not self.enabled or not cost or not step_s:
            return 1
        return max(1, math.ceil(cost / (self.max_share * step_s)))

    def entered(self, step: int) -> None:
        """A generation begins at ``step``: its checks are counted from here (the chain goes
        on), and the steps from there on are run again."""
        self.checks, self.first_step, self.last_step = 0, None, None
        self._gather_s = None  # (another world, other peers: measured again)
        self.replays, self.replay_s, self.stepped_s = 0, 0.0, 0.0
        self.trace.redo_from(step)

    def stats(self) -> DigestChecks:
        return DigestChecks(checks=self.checks, first_step=self.first_step,
                            last_step=self.last_step, chain=self.chain, cost_s=self.cost_s,
                            certified=self.certified, certified_t=self.certified_t,
                            uncompared=self.uncompared, replays=self.replays,
                            replay_s=round(self.replay_s, 6), stepped_s=round(self.stepped_s, 6))
