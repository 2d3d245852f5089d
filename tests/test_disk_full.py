"""Checkpoints on a file system that refuses them (full, read-only): nothing left behind, one line
per failed attempt, retries with back-off, the newest complete checkpoint kept, a short end, the
failures in the summary, and the policy's choice between going on and giving up. On a real small
file system (a tmpfs of 2 MB, mounted for the test), with real keepers, writers and ranks."""

from __future__ import annotations

import errno
import os
import re
import subprocess
import time
from pathlib import Path

import pytest
import torch

from conftest import (TRAIN, bitwise_equal, finish, nonstop_cmd, policy_file, run_nonstop, start,
                      wait_for_event)
from nonstop.protocol import keeper_messages as km
from nonstop.state import checkpoint as ck
from nonstop.state import disk_failure
from nonstop.state import wire
from nonstop.state.memory import own
from nonstop.controller.checkpoints import END_RETRY_S, MANIFEST_PART, Failures
from test_keeper import keepers, snapshot  # noqa: F401 - the fixture, and a snapshot helper


# -- a small file system ---------------------------------------------------------------------------
@pytest.fixture
def small_fs(tmp_path):
    """A 2 MB tmpfs, always unmounted at the end (lazily if something still holds it)."""
    d = tmp_path / "small"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m,mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)


def fill(fs: Path) -> Path:
    """Take every free byte of the file system; returns the file that holds them."""
    path = fs / "filler"
    with open(path, "wb", buffering=0) as fh:
        chunk = b"\0" * 65536
        try:
            while True:
                fh.write(chunk)
        except OSError as e:
            assert e.errno == errno.ENOSPC
        try:
            while True:  # the last partial chunk
                fh.write(b"\0" * 512)
        except OSError:
            pass
    return path


def remount(fs: Path, mode: str) -> None:
    subprocess.run(["mount", "-o", f"remount,{mode}", str(fs)], check=True, timeout=30)


def temps(root: Path) -> list[str]:
    return sorted(p.name for p in root.iterdir() if p.name.startswith(".tmp"))


# -- the retry schedule, without processes ---------------------------------------------------------
def test_back_off_doubles_then_the_step_is_given_up():
    f = Failures(retries=2, backoff_s=2.0)
    v = f.failed(40, 0, "No space left on device", now=100.0)
    assert (v.attempt, v.retry_in, v.dropped) == (1, 2.0, [])
    assert f.due(101.9) is None and f.due(102.0) == (40, {0})
    assert f.due(103.0) is None  # sent once
    assert f.failed(40, 0, "No space left on device", now=103.0).retry_in == 4.0
    assert f.due(107.0) == (40, {0})
    v = f.failed(40, 0, "No space left on device", now=108.0)
    assert (v.attempt, v.retry_in) == (3, None)
    assert f.settled(40) and not f.settled(50) and f.fatal is None  # warn: go on
    # given up once: the next checkpoint is tried, but not retried until one is written
    assert f.failed(50, 0, "No space left on device", now=120.0).retry_in is None
    assert f.summary() == {"failed": 2, "failed_attempts": 4, "given_up": 2,
                           "causes": {"No space left on device": 4},
                           "last_error": "No space left on device"}
    assert f.written_step(60) == []
    assert f.failed(70, 0, "x", now=130.0).retry_in == 2.0  # written again: retries are back


def test_a_newer_step_takes_over_and_a_written_one_ends_the_failures():
    f = Failures(retries=3, backoff_s=1.0)
    f.failed(40, 0, "e", now=0.0)
    v = f.failed(50, 0, "e", now=0.25)  # the next one fails too, before 40's retry
    assert (v.attempt, v.retry_in, v.dropped) == (1, 0.75, [40])  # in its place, same time
    assert f.failed(40, 1, "e", now=0.6) is None and f.settled(40)  # late part of the dropped one
    assert f.due(1.0) == (50, {0})
    v = f.failed(60, 0, "e", now=1.5)  # after a retry was made: a new attempt
    assert (v.attempt, v.retry_in, v.dropped) == (2, 2.0, [50])
    assert f.summary()["failed_attempts"] == 3  # the late part is not an attempt of its own
    # 50's retry got through after all: a complete checkpoint; 60 is still to be written again
    assert f.written_step(50) == [] and f.target == 60 and f.attempts == 0 and f.settled(50)
    assert f.written_step(70) == [60] and f.settled(60)  # 70 written: 60 is not worth it
    assert f.target is None and f.summary()["failed"] == 2  # 40 and 60


def test_the_parts_of_one_attempt_count_once():
    f = Failures(retries=1, backoff_s=1.0)
    assert f.failed(40, 0, "e", now=0.0).attempt == 1
    assert f.failed(40, 1, "e", now=0.1) is None  # the other shard, same attempt
    assert f.due(1.0) == (40, {0, 1})
    assert f.failed(40, MANIFEST_PART, "e", now=2.0).retry_in is None  # the second attempt


def test_at_the_end_one_quick_retry_per_step():
    f = Failures(retries=5, backoff_s=30.0)
    f.failed(40, 0, "e", now=0.0)  # due at 30 s
    f.finish(now=1.0)
    assert f.due(1.0 + END_RETRY_S) == (40, {0})  # not 30 s: training is over
    assert f.failed(40, 0, "e", now=3.0).retry_in is None  # and only once
    assert f.failed(60, 0, "e", now=3.1).retry_in is None  # given up once: no more retries
    g = Failures(retries=5, backoff_s=30.0)
    g.finish(now=0.0)
    assert g.failed(60, 0, "e", now=1.0).retry_in == END_RETRY_S
    assert g.due(2.0) == (60, {0})
    assert g.failed(60, 0, "e", now=2.5).retry_in is None and g.settled(60)


def test_on_failure_fail_after_consecutive_failures():
    f = Failures(retries=0, backoff_s=1.0, on_failure="fail", max_consecutive=2)
    f.failed(10, 0, "No space left on device (/ck)", now=0.0)
    assert f.fatal is None
    f.failed(20, 0, "No space left on device (/ck)", now=1.0)
    assert f.fatal == ("checkpoints cannot be written: No space left on device (/ck); 2 "
                       "checkpoints in a row failed, the last of step 20 "
                       "(state.checkpoint.on_failure: fail)")
    g = Failures(retries=0, backoff_s=1.0, on_failure="fail", max_consecutive=2)
    g.failed(10, 0, "e", now=0.0)
    g.written_step(20)
    g.failed(30, 0, "e", now=1.0)
    assert g.fatal is None  # not in a row


# -- the cause, the clean-up ----------------------------------------------------------------------
class _Wrapped(BaseException):
    """Like DCP's CheckpointException: the real error in ``failures``, as (exception, stack)."""

    def __init__(self, inner: BaseException):
        super().__init__("ranks: [0]")
        self.failures = {0: (inner, None)}


@pytest.mark.integration
def test_the_cause_is_found_behind_wrappers_or_asked_of_the_file_system(small_fs, tmp_path):
    inner = OSError(errno.EDQUOT, os.strerror(errno.EDQUOT), "/ck/x")
    assert disk_failure.failure_cause(_Wrapped(inner), tmp_path) == {
        "errno": "EDQUOT", "message": "Disk quota exceeded", "path": "/ck/x"}
    try:
        try:
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        except OSError:
            raise RuntimeError("unexpected pos 704 vs 598")  # what torch's writer says
    except RuntimeError as e:
        assert disk_failure.failure_cause(e, tmp_path)["errno"] == "EIO"
    opaque = RuntimeError("unexpected pos 704 vs 598")
    assert disk_failure.failure_cause(opaque, tmp_path) == {
        "errno": None, "message": "RuntimeError: unexpected pos 704 vs 598", "path": str(tmp_path)}
    assert disk_failure.space_error(small_fs, need=4 << 20).errno == errno.ENOSPC  # more than it holds
    assert disk_failure.space_error(small_fs / "not" / "yet", need=1024) is None
    fill(small_fs)
    assert disk_failure.failure_cause(opaque, small_fs)["errno"] == "ENOSPC"  # no errno: the fs says
    (small_fs / "filler").unlink()
    remount(small_fs, "ro")
    assert disk_failure.failure_cause(opaque, small_fs) == {
        "errno": "EROFS", "message": "Read-only file system", "path": str(small_fs)}


@pytest.mark.integration
def test_failed_writes_leave_nothing_and_later_ones_succeed(small_fs):
    root = small_fs / "ckpt"
    state = {"w": torch.randn(100_000)}  # 400 kB
    tmp = ck.temp_dir(root, 10)
    filler = fill(small_fs)
    with pytest.raises(BaseException) as caught:
        ck.write_part(state, tmp, 0, {})
    assert disk_failure.failure_cause(caught.value, root, 400_000)["errno"] == "ENOSPC"
    assert list(tmp.iterdir()) == []  # no partial file takes space from the next attempt
    filler.unlink()
    part = ck.write_part(state, tmp, 0, {})
    filler = fill(small_fs)
    with pytest.raises(OSError):  # the manifest itself does not fit
        ck.finalize(root, 10, {0: part}, world=1, sharded=False)
    assert sorted(p.name for p in tmp.iterdir()) == ["rank-0"]  # no half manifest
    filler.unlink()
    ck.finalize(root, 10, {0: part}, world=1, sharded=False)  # only the manifest, again
    assert ck.complete_steps(root) == [10]
    ck.temp_dir(root, 20)
    ck.temp_dir(root, 30)
    assert [p.name for p in ck.clean_temp(root, step=20)] == [".tmp-step-0000000020"]
    assert temps(root) == [".tmp-step-0000000030"]


@pytest.mark.integration
def test_the_keeper_keeps_a_failed_part_and_writes_it_again(keepers, small_fs):  # noqa: F811
    mem = keepers(0, writer=True)
    events = wire.Client(mem.name)
    events.call(km.Subscribe())
    events.sock.settimeout(60)
    root = small_fs / "ckpt"
    root.mkdir()
    persist = km.DiskPart(holder="r0", step=10, root=str(root), rank=0, world=1, sharded=False,
                          reason="periodic")
    sd = {"w": torch.randn(50_000)}
    filler = fill(small_fs)
    snapshot(mem, 0, sd, 10, persist)

    def next_part() -> km.PartDone | km.PartFailed:
        while True:
            msg = km.decode_report(wire.recv(events.sock)[0])
            if isinstance(msg, (km.PartDone, km.PartFailed)):
                return msg

    failed = next_part()
    assert isinstance(failed, km.PartFailed) and failed.job.step == 10
    assert (failed.errno, failed.message) == ("ENOSPC", "No space left on device")
    assert "Traceback" in failed.traceback and temps(root) in ([], [".tmp-step-0000000010"])
    snapshot(mem, 0, sd, 11)
    snapshot(mem, 0, sd, 12)  # step 10 is no longer in the node's memory, only kept for disk
    filler.unlink()
    reply, _ = mem.client.call(km.Persist(part=failed.job, again=True))
    assert reply.kept
    done = next_part()
    assert isinstance(done, km.PartDone), done  # the same writer, from the kept copy
    ck.finalize(root, 10, {0: km.encode(done.part)}, world=1, sharded=False)
    assert torch.equal(ck.read_part(root, 10, 0)[0]["w"], sd["w"])


# -- whole runs ------------------------------------------------------------------------------------
ARGS = ("--steps", "60", "--hidden", "64")


def ddp_run(tmp_path: Path, name: str, root: Path, *flags: str, args=ARGS, timeout=120):
    out = tmp_path / f"{name}.pt"
    r = run_nonstop(tmp_path / name, "--nproc=2", f"--checkpoint-dir={root}",
                    "--checkpoint-every=10", *flags, str(TRAIN), *args, "--save", str(out),
                    timeout=timeout)
    return r, out


def assert_quiet(r) -> None:
    text = r.stdout + r.stderr
    assert "Traceback" not in text and "writer died" not in text, text[-3000:]


def steps_on_disk(root: Path) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in root.glob("step-*"))


@pytest.mark.integration
def test_a_full_disk_is_said_once_and_the_end_does_not_wait(small_fs, tmp_path, reference):
    root = small_fs / "ckpt"
    r, _ = ddp_run(tmp_path, "first", root, args=("--steps", "20", "--hidden", "64"))
    assert r.code == 0 and steps_on_disk(root) == [10, 20]
    stale = ck.temp_dir(root, 25) / "rank-0.partial-0123"  # a run killed while writing
    stale.mkdir()
    fill(small_fs)

    r, out = ddp_run(tmp_path, "full", root)  # resumes at 20; 30..60 cannot be written
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_quiet(r)
    lines = [x for x in r.stdout.splitlines() if "not written" in x]
    assert lines and all(x.startswith("nonstop: checkpoint of step ") for x in lines)
    assert f"not written: No space left on device ({root}); " in lines[0]
    assert steps_on_disk(root) == [10, 20] and temps(root) == []  # nothing deleted, nothing left
    failed = r.of("checkpoint_failed")
    assert failed and {e["errno"] for e in failed} == {"ENOSPC"}
    # the same cause again and again is one line (and one more at the 10th attempt), not one
    # per attempt; a give-up is always said
    retrying = [e for e in failed if e["outcome"] == "retrying"]
    said = [x for x in lines if "retrying in" in x]
    assert len(said) == (1 if len(retrying) < 10 else 2 if len(retrying) < 100 else 3), (said,
                                                                                         len(retrying))
    assert all(e["attempt"] >= 1 and e["outcome"] in ("retrying", "given up", "reported")
               for e in failed)
    ck_sum = r.summary["state"]["checkpoint"]
    assert ck_sum["written"] == 0 and ck_sum["failed"] >= 1 and ck_sum["newest_complete"] == 20
    assert ck_sum["causes"] == {"No space left on device": ck_sum["failed_attempts"]}
    shown = f"checkpoints: 0 written, {ck_sum['failed']} failed (No space left on device), " \
        "newest complete: step 20"
    assert shown in r.stdout
    report = subprocess.run(nonstop_cmd("report", str(r.run_dir)), capture_output=True,
                            text=True, timeout=60)
    assert shown in report.stdout  # the same, later, from summary.json
    # the end: one quick retry at most, and the summary's wall time includes it
    (done,) = r.of("training_complete")
    (end,) = r.of("run_end")
    assert end["t"] - done["t"] < 10.0  # the back-off alone would be 2 + 4 + 8 s
    assert r.summary["finish_s"] >= end["t"] - done["t"] - 0.5
    (begin,) = r.of("run_start")
    assert abs(r.summary["wall_s"] - (end["t"] - begin["t"])) < 1.0
    # it went on from the newest complete checkpoint, to the weights of a run without a disk
    (rest,) = r.of("restore")
    assert rest["step"] == 20 and set(rest["sources"].values()) == {"disk"}
    assert bitwise_equal(out, reference(2, *ARGS))


@pytest.mark.integration
def test_space_freed_during_the_run_lets_later_checkpoints_through(small_fs, tmp_path):
    root = small_fs / "ckpt"
    args = ("--steps", "150", "--hidden", "64", "--sleep-ms", "30")
    out = tmp_path / "run.pt"
    # patient enough for a loaded machine, where several queued checkpoints may fail at once
    pol = policy_file(tmp_path, "state:\n  checkpoint:\n    retries: 8\n    retry_backoff_s: 0.5\n")
    proc = start(tmp_path / "run", "--nproc=2", f"--checkpoint-dir={root}", f"--policy={pol}",
                 "--checkpoint-every=10", str(TRAIN), *args, "--save", str(out))
    t0 = time.time()
    try:
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "checkpoint")
        time.sleep(0.5)  # what queued up while the writer started has gone out
        filler = fill(small_fs)
        failed = wait_for_event(tmp_path / "run", lambda e: e["type"] == "checkpoint_failed")
        filler.unlink()
    finally:
        r = finish(proc, tmp_path / "run", t0)
    assert r.code == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert_quiet(r)
    assert failed["errno"] == "ENOSPC"
    # written once the space is back: later steps', or the failed step's own retry (under load
    # the writer can be behind enough that the disk fills only at the last step)
    later = [e["step"] for e in r.of("checkpoint") if e["step"] >= failed["step"]]
    assert later and later[-1] == 150
    assert steps_on_disk(root)[-1] == 150 and temps(root) == []
    ck_sum = r.summary["state"]["checkpoint"]
    assert ck_sum["failed_attempts"] >= 1 and ck_sum["newest_complete"] == 150
    final = torch.load(out)  # what the run ended with is what its last checkpoint holds
    on_disk = ck.read_part(root, 150, 0)[0]["model"]
    assert final.keys() == on_disk.keys() and all(torch.equal(final[k], on_disk[k]) for k in final)


@pytest.mark.integration
def test_on_failure_fail_gives_up_with_the_cause(small_fs, tmp_path):
    root = small_fs / "ckpt"
    root.mkdir()
    remount(small_fs, "ro")
    pol = policy_file(tmp_path, "state:\n  checkpoint:\n    on_failure: fail\n    retries: 1\n"
                                "    retry_backoff_s: 0.2\n")
    r, _ = ddp_run(tmp_path, "ro", root, f"--policy={pol}",
                   args=("--steps", "400", "--hidden", "64", "--sleep-ms", "20"))
    assert r.code == 1
    assert_quiet(r)
    assert not r.of("training_complete")  # it gave up during training
    assert re.fullmatch(
        re.escape(f"nonstop: error: checkpoints cannot be written: Read-only file system ({root}); "
                  "2 attempt(s) in a row failed, the last for step ") + r"\d+ "
        + re.escape("(state.checkpoint.on_failure: fail)"), r.stderr.strip().splitlines()[-1])
    # a retry, then the give-up; a newer step's checkpoint may supersede one waiting for its retry
    # (2 attempts in a row count across steps): then more say "retrying" first; one already
    # queued when it gave up fails too, "given up" as well; a part of a step (or of an older
    # step), already settled, says nothing new ("reported")
    outcomes = [e["outcome"] for e in r.of("checkpoint_failed")]
    first = outcomes.index("given up") if "given up" in outcomes else 0
    assert first >= 1 and outcomes[0] == "retrying", outcomes
    assert set(outcomes[:first]) <= {"retrying", "reported"}, outcomes
    assert set(outcomes[first:]) <= {"given up", "reported"}, outcomes
    assert r.summary["diagnosis"].startswith("checkpoints cannot be written: Read-only")
    assert r.of("emergency_checkpoint")[0]["skipped"] == "checkpoints cannot be written"
