"""Progress a training function shows without ctx.steps, as the controller judges it (pure: no
processes): signs of life keep a rank from being taken for hung, a hang is dated from the last
progress, and injected faults that such a function can never fire are named."""

from __future__ import annotations

import pytest

from nonstop import inject, policy
from nonstop.controller.liveness import Signals
from nonstop.controller.workers import Worker
from nonstop.protocol.progress import Progress


def _life(gen: int, t: float) -> Progress:
    """A progress record with nothing but a sign of life from the rank's collectives."""
    return Progress(hb=100.0, pid=1, where="torch", loc="", same_s=0.0, paused=None,
                    max_step_s=0.0, compute_s=None, life_gen=gen, t_life=t)


def _rank(wid: int, rank: int, t_step: float = 0.0, first_gen: int = -1) -> Worker:
    return Worker(wid=wid, spare=False, rank=rank, t_step=t_step, first_gen=first_gen, hb=100.0)


def test_signs_of_life_keep_a_rank_without_steps_from_being_hung():
    sig = Signals(policy.load(None))
    allowance = sig.hang.first_step_timeout()
    a, b = _rank(1, 0), _rank(2, 1)
    # generation 3 formed at t=0; neither rank has completed a step in it
    sig.on_progress(a, _life(3, allowance - 1.0), gen=3)
    sig.on_progress(b, _life(2, allowance - 1.0), gen=3)  # an older generation's
    fault, _ = sig.check_hang([a, b], gen=3, t_running=0.0, now=allowance + 0.5)
    assert fault is not None and sig.last_progress == 0.0  # b: nothing since the group formed
    sig.on_progress(b, _life(3, allowance - 0.5), gen=3)
    fault, _ = sig.check_hang([a, b], gen=3, t_running=0.0, now=allowance + 0.5)
    assert fault is None
    fault, _ = sig.check_hang([a, b], gen=3, t_running=0.0, now=2 * allowance)
    assert fault is not None and sig.last_progress == allowance - 0.5


def test_a_hang_is_dated_from_the_last_progress_of_the_stalled_ranks():
    sig = Signals(policy.load(None))
    steady = sig.hang.steady_timeout()
    a, b = _rank(1, 0, t_step=50.0, first_gen=1), _rank(2, 1, t_step=52.0, first_gen=1)
    fault, _ = sig.check_hang([a, b], gen=1, t_running=0.0, now=52.0 + steady - 0.1)
    assert fault is not None and sig.last_progress == 50.0  # only a had stalled
    fault, _ = sig.check_hang([a, b], gen=1, t_running=0.0, now=52.0 + steady + 0.1)
    assert sig.last_progress == 52.0 and "no step completed" in fault.message
    # a rank whose marks are its steps (no ctx.steps) is judged by its signs of life as well
    sig.on_first_step(b, 52.0, stepless=True)
    sig.on_progress(b, _life(1, 52.0 + steady), gen=1)
    fault, _ = sig.check_hang([b], gen=1, t_running=0.0, now=52.0 + steady + 0.1)
    assert fault is None
    fault, _ = sig.check_hang([b], gen=1, t_running=0.0, now=52.0 + 2 * steady + 0.1)
    assert "no progress" in fault.message


def test_a_controller_that_took_over_judges_a_rank_from_its_takeover_until_its_progress_comes():
    """Taking over a training job, the new controller knows each rank's first step from the
    replayed events (long ago) and its newer steps only once the hosts' progress arrives, host by
    host: until then a rank is judged from when the generation ran under this controller, not
    taken for hung since its first step."""
    sig = Signals(policy.load(None))
    steady = sig.hang.steady_timeout()
    a, b = _rank(1, 0, t_step=10.0, first_gen=1), _rank(2, 1, t_step=10.0, first_gen=1)
    took_over = 300.0
    fault, _ = sig.check_hang([a, b], gen=1, t_running=took_over, now=took_over + 0.5 * steady)
    assert fault is None
    b.t_step = took_over + 0.2  # b's host's progress came; a's did not, ever
    fault, _ = sig.check_hang([a, b], gen=1, t_running=took_over, now=took_over + steady + 0.1)
    assert fault is not None and sig.last_progress == took_over  # a, stalled since the takeover


def test_faults_a_function_without_ctx_steps_cannot_fire():
    specs = ("crash:rank=1,step=5;exit:rank=0,step=0;exception:rank=0,step=0,at=optimizer;"
             "slow:rank=all,ms=5;nan:rank=1,step=3;crash:rank=1,at=restore;hang:rank=0,at=first_step")
    inj = inject.Injector(inject.parse(specs), lambda i, f: True, lambda f, s: None)
    with_state = [f.describe() for f in inj.need_steps(registered=True)]
    # the step index stays at 0: step 0 in an optimizer step or a forward pass still fires, and
    # a recovery point other than the first step is keyed by generation
    assert with_state == ["crash:rank=1,step=5", "exit:rank=0,step=0", "nan:rank=1,step=3",
                          "hang:rank=0,at=first_step"]
    # nothing registered: no optimizer step or forward pass to act in either
    assert [f.describe() for f in inj.need_steps(registered=False)] == [
        "crash:rank=1,step=5", "exit:rank=0,step=0", "exception:rank=0,step=0,at=optimizer",
        "slow:rank=all,step=0,ms=5", "nan:rank=1,step=3", "hang:rank=0,at=first_step"]


def test_faults_past_the_last_step_are_named():
    inj = inject.Injector(inject.parse("crash:rank=1,step=40;crash:rank=1,step=39;"
                                       "exit:rank=0,step=90;crash:rank=1,at=restore"),
                          lambda i, f: True, lambda f, s: None)
    assert [f.describe() for f in inj.unreached(rank=1, step=40)] == ["crash:rank=1,step=40"]
    assert [f.describe() for f in inj.unreached(rank=0, step=40)] == ["exit:rank=0,step=90"]


@pytest.mark.integration
def test_the_last_step_survives_its_writer_and_a_torn_write_leaves_the_one_before(tmp_path):
    import math
    import os
    import signal
    import subprocess
    import sys

    from nonstop.protocol import last_step

    path = str(tmp_path / "w.last")
    last_step.create(path)
    assert last_step.read(path, remove=False) is None  # no step completed yet
    w = last_step.Writer(path)
    w.write(0, 1, 10.0, 0.5, 0.0)
    w.write(0, 2, 11.0, 1.0, 0.25)
    assert last_step.read(path, remove=False) == last_step.LastStep(gen=0, step=2, t=11.0,
                                                                     busy=1.0, stall=0.25)
    # the next record half written (the header not yet moved): the one before is read
    with open(path, "r+b") as f:
        f.seek(last_step._HEAD.size + (3 % 2) * last_step._REC.size)
        f.write(last_step._REC.pack(1, 99, 12.0, 2.0, 0.0)[:12])
    assert last_step.read(path, remove=False).step == 2
    # a writer that opens the file again goes on from its count; a mark has no busy time
    last_step.Writer(path).write(1, 3, 13.0, math.nan, math.nan)
    assert last_step.read(path) == last_step.LastStep(gen=1, step=3, t=13.0, busy=None, stall=None)
    assert not os.path.exists(path)  # read once, gone
    assert last_step.read(path) is None and last_step.Writer(path).write(0, 1, 0, 0, 0) is None
    # a process killed by SIGKILL right after its write: the page is the file's, not its own
    last_step.create(path)
    code = ("import os, signal, sys; from nonstop.protocol import last_step as l; "
            "w = l.Writer(sys.argv[1]); [w.write(2, s, float(s), 0.0, 0.0) for s in range(1, 5001)]; "
            "os.kill(os.getpid(), signal.SIGKILL)")
    p = subprocess.run([sys.executable, "-c", code, path], timeout=60)
    assert p.returncode == -signal.SIGKILL
    assert last_step.read(path).step == 5000


def test_a_progress_record_goes_through_json_and_a_malformed_one_is_refused():
    import json

    import pytest

    from nonstop.protocol import progress

    rec = Progress(hb=1.0, pid=7, where="torch", loc="f.py:3 in g", same_s=0.5, paused=None,
                   max_step_s=0.2, compute_s=0.1, life_gen=2, t_life=0.9,
                   snap=progress.SnapshotNumbers(every=5, cost_s=0.01, step_s=0.2, last=40,
                                                 repl_s=None),
                   gen=2, rank=0, step=41, t=0.95, loss="nan", busy=3.0, stall=0.0, step_s=0.2)
    raw = json.loads(json.dumps(progress.encode(rec)))
    assert progress.decode(raw) == rec
    bare = Progress(hb=1.0, pid=7, where="", loc="", same_s=0.0, paused=None, max_step_s=0.0,
                    compute_s=None)
    assert "step" not in progress.encode(bare)  # before its first step: no step fields
    assert progress.decode(progress.encode(bare)) == bare
    for bad in ({**raw, "where": "gpu"}, {**raw, "step": "41"}, {**raw, "extra": 1},
                {k: v for k, v in raw.items() if k != "hb"}, {**raw, "loss": "big"},
                {**raw, "snap": {"every": 5}}, [raw]):
        with pytest.raises(progress.BadProgress):
            progress.decode(bad)


def test_a_relayed_progress_record_has_every_time_moved_onto_the_controllers_clock():
    """The progress record's own shift (its time fields known) moves exactly what the generic
    one moves: every float field whose meaning is a time, and nothing else."""
    import dataclasses
    import json

    from nonstop.protocol import hosts, progress

    rec = Progress(hb=10.0, pid=7, where="torch", loc="f.py:3 in g", same_s=0.5, paused=None,
                   max_step_s=0.2, compute_s=0.1, life_gen=2, t_life=9.0, gen=2, rank=0, step=41,
                   t=9.5, loss=0.25, busy=3.0, stall=0.0, step_s=0.2)
    raw = progress.encode(rec)
    times = {f.name for f in dataclasses.fields(Progress)} & (
        set(hosts.TIME_FIELDS) | {f.name for f in dataclasses.fields(Progress)
                                  if f.name.startswith("t_")})
    assert times == set(hosts.PROGRESS_TIMES)
    moved = progress.decode(hosts.shift_progress(json.loads(json.dumps(raw)), 100.0))
    assert moved == progress.decode(hosts.shift_times(json.loads(json.dumps(raw)), 100.0))
    assert (moved.hb, moved.t, moved.t_life, moved.busy) == (110.0, 109.5, 109.0, 3.0)
    bad = {**raw, "hb": "late"}  # left for the reader to refuse
    assert hosts.shift_progress(dict(bad), 5.0)["hb"] == "late"
    assert hosts.shift_progress(["x"], 5.0) == ["x"]


def test_a_ranks_first_steps_of_a_generation_are_timed_with_the_settling_allowance():
    """A replacement's second step under load can take as long as its first (cold kernels, the
    allocator, other groups' first collectives): until ``settle_steps`` (3) steps of the
    generation are done, a rank is judged by the slowest first step seen, then by the steady
    timeout."""
    sig = Signals(policy.load(None))
    for _ in range(10):
        sig.hang.observe_step(0.05)
    steady = sig.hang.steady_timeout()
    assert steady == 1.0
    w = _rank(1, 0, t_step=100.0, first_gen=2)
    w.step, w.step_gen = 10, 2
    sig.on_first_step(w, 100.0)  # (no entered event: the first step's length is not known)
    sig.hang.observe_first_step(4.0)
    w.first_step = 10  # its first step of generation 2 completed step 10
    fault, _ = sig.check_hang([w], gen=2, t_running=90.0, now=100.0 + 3.0)
    assert fault is None  # the second step: within the slowest first step (4 s)
    w.step, w.t_step = 11, 103.0
    fault, _ = sig.check_hang([w], gen=2, t_running=90.0, now=103.0 + 3.5)
    assert fault is None  # the third
    w.step, w.t_step = 12, 106.5
    fault, _ = sig.check_hang([w], gen=2, t_running=90.0, now=106.5 + 1.5)
    assert fault is not None and "for 1.00 s" in fault.message  # settled: the steady timeout
    w.first_step = None  # a rank whose first step is not known is judged steady at once
    w.step, w.t_step = 11, 103.0
    fault, _ = sig.check_hang([w], gen=2, t_running=90.0, now=103.0 + 1.5)
    assert fault is not None


def test_a_rank_waiting_for_a_peer_still_in_its_first_step_has_the_first_steps_allowance():
    """After a restart, one new process took its first step at once and the other, on a loaded
    machine, took 2 s: the first waited in its second step's collectives for it and was taken
    for hung after the steady 1 s. Until every rank of the generation has stepped, a rank that
    has is allowed the first step's time too; once all have, the usual timeouts apply."""
    sig = Signals(policy.load(None))
    for _ in range(10):
        sig.hang.observe_step(0.05)
    steady, first = sig.hang.steady_timeout(), sig.hang.first_step_timeout()
    assert steady == 1.0 and first > 3.0
    quick, slow = _rank(1, 0, t_step=100.0, first_gen=2), _rank(2, 1)
    quick.step = quick.first_step = 11
    fault, _ = sig.check_hang([quick, slow], gen=2, t_running=99.8, now=102.0)
    assert fault is None  # the quick one waits for the slow one's first step
    fault, _ = sig.check_hang([quick, slow], gen=2, t_running=99.8, now=99.8 + first + 0.1)
    assert fault is not None and f"for {first:.2f} s" in fault.message
    slow.first_gen, slow.t_step, slow.step, slow.first_step = 2, 102.0, 11, 11
    quick.step, quick.t_step = 12, 102.1
    fault, _ = sig.check_hang([quick, slow], gen=2, t_running=99.8, now=102.1 + steady + 0.2)
    assert fault is not None  # all have stepped: the steady (settling) allowance again


def test_a_step_past_its_timeout_whose_collectives_still_move_data_is_slow_not_hung():
    """A link that slowed in the middle of a run: the ranks' steps outlast the tuned timeout,
    but their groups still deliver bytes (their signs of life). They are slow, named once, and
    judged from their last sign of life; a rank whose group moved nothing is hung."""
    import dataclasses

    from nonstop.controller.watchers import Watchers

    class _Log:
        def __init__(self):
            self.records = []

        def write(self, kind, **fields):
            self.records.append((kind, fields))

    class _Display:
        def __init__(self):
            self.lines = []

        def info(self, text):
            self.lines.append(text)

    log, shown = _Log(), _Display()
    watch = Watchers(policy.load(None), log, shown)
    sig = watch.signals
    steady = sig.hang.steady_timeout()
    a, b = _rank(1, 0, t_step=50.0, first_gen=1), _rank(2, 1, t_step=50.0, first_gen=1)
    for w in (a, b):
        w.first_step = 1
        w.step = 20  # settled
    late = 50.0 + steady + 1.0
    # both ranks' groups moved data half a second ago: slow, waited for
    sig.on_progress(a, _life(1, late - 0.5), gen=1)
    sig.on_progress(b, _life(1, late - 0.5), gen=1)
    assert watch.steps([a, b], gen=1, t_running=0.0, now=late) == []
    assert sig.slow == (1, {0: pytest.approx(late - 50.0), 1: pytest.approx(late - 50.0)})
    (said,) = [f for k, f in log.records if k == "slow_step"]
    assert said["ranks"] == [0, 1] and "not a hang" in shown.lines[-1]
    # said once, however long it lasts
    sig.on_progress(a, _life(1, late + 0.5), gen=1)
    sig.on_progress(b, _life(1, late + 0.5), gen=1)
    assert watch.steps([a, b], gen=1, t_running=0.0, now=late + 1.0) == []
    assert len([k for k, _ in log.records if k == "slow_step"]) == 1
    # rank 1's group stops moving: once its last sign of life is older than the timeout, hung
    (cmd,) = watch.steps([a, b], gen=1, t_running=0.0, now=late + 0.5 + steady + 0.1)
    assert cmd.action == "hang" and sig.last_progress == pytest.approx(late + 0.5)
    # a sign of life from before the last step is no evidence: a hang as ever
    c = dataclasses.replace(_rank(3, 2, t_step=80.0, first_gen=1), first_step=1, step=20)
    sig.on_progress(c, _life(1, 79.0), gen=1)
    fault, _ = sig.check_hang([c], gen=1, t_running=0.0, now=80.0 + steady + 0.1)
    assert fault is not None and sig.slow == (1, {})


def test_one_ranks_collective_moving_data_is_the_whole_generations_sign_of_life():
    """A slow link under a reduction gathered to one rank: only that rank's connections move
    bytes, its peers wait on it with none - they are slow too, not hung; once no rank's moves,
    the timeout runs from the last of them."""
    sig = Signals(policy.load(None))
    for _ in range(10):
        sig.hang.observe_step(0.05)
    steady = sig.hang.steady_timeout()
    a, b = _rank(1, 0, t_step=100.0, first_gen=2), _rank(2, 1, t_step=100.0, first_gen=2)
    for w in (a, b):
        w.step, w.step_gen, w.first_step = 50, 2, 10
    sig.on_progress(a, _life(2, 100.0 + steady + 1.0), gen=2)  # a's bytes move; b's none
    fault, _ = sig.check_hang([a, b], gen=2, t_running=90.0, now=100.0 + steady + 1.5)
    assert fault is None and set(sig.slow[1]) == {0, 1}
    fault, culprits = sig.check_hang([a, b], gen=2, t_running=90.0, now=100.0 + 2 * steady + 1.1)
    assert fault is not None and "no step completed" in fault.message
