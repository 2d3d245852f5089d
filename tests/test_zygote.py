"""Rank processes forked from the zygote (real processes): each is the zygote's child in a session
of its own, its exit code reaches the controller as it was, nothing outlives the launcher, and a
zygote that dies costs one recovery - the ranks are then started directly."""

from __future__ import annotations

import os
import signal
import time
from pathlib import Path

import pytest

from conftest import TRAIN, bitwise_equal, finish, start, train, wait_for_event

pytestmark = pytest.mark.integration

ARGS = ("--steps", "40", "--sleep-ms", "10")


def _status(pid: int) -> dict[str, str]:
    """The process's /proc status fields (none for a process that is gone)."""
    out: dict[str, str] = {}
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return out
    for line in text.splitlines():
        key, _, value = line.partition(":")
        out[key] = value.strip()
    return out


def _gone(pids: list[int], timeout: float = 10.0) -> bool:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not any(Path(f"/proc/{p}").exists() and _status(p).get("State", "Z")[0] != "Z"
                   for p in pids):
            return True
        time.sleep(0.05)
    return False


@pytest.mark.parametrize("origin", ["own", "template", "refused"])
def test_ranks_are_the_zygotes_children_in_sessions_of_their_own_and_die_with_the_launcher(
        tmp_path, monkeypatch, origin):
    """``own``: the launcher started its zygote; ``template``: the zygote was forked for the
    launcher by the session's template (``NONSTOP_ZYGOTE_TEMPLATE``), its parent, in the
    launcher's namespaces, and watches the launcher through their socket; ``refused``: the
    launcher's environment differs from every template's in what torch reads at import, so it
    starts its own zygote and says why. The node's checkpoint writer alike: forked by the
    template (DCP imported: the first checkpoint is written at once) in the keeper's
    namespaces, or the keeper's own child; either way it ends with the keeper."""
    from conftest import TEMPLATE

    from nonstop.agent.zygote import WRITER_NAME
    from nonstop.zygote_client import TEMPLATE_ENV

    if origin == "own":
        monkeypatch.delenv(TEMPLATE_ENV, raising=False)
    elif TEMPLATE_ENV not in os.environ:
        pytest.skip("no zygote template in this session (NONSTOP_TEST_TEMPLATE=0)")
    if origin == "refused":
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
    run_dir = tmp_path / "run"
    proc = start(run_dir, "--nproc=2", "--spares=1", f"--checkpoint-dir={tmp_path / 'ck'}",
                 "--checkpoint-every=5", str(TRAIN), "--steps", "100000", "--sleep-ms", "20")
    try:
        wait_for_event(run_dir, lambda e: e["type"] == "checkpoint", timeout=90)
        spawned = [e["pid"] for e in _events(run_dir) if e["type"] == "spawn"]
        zygote = {int(_status(p)["PPid"]) for p in spawned}
        assert len(zygote) == 1 and zygote != {proc.pid}, zygote
        (zpid,) = zygote
        parents = set(TEMPLATE.values()) if origin == "template" else {proc.pid}
        assert int(_status(zpid)["PPid"]) in parents  # the launcher's child, or a template's
        for ns in ("net", "mnt"):
            assert os.readlink(f"/proc/{zpid}/ns/{ns}") == os.readlink(f"/proc/{proc.pid}/ns/{ns}")
        log = (run_dir / "logs" / "zygote.log").read_text()
        keeper_log = (run_dir / "logs" / "keeper-n0.log").read_text()
        if origin == "refused":  # every template said why
            assert log.count("the environment read at import differs: OMP_NUM_THREADS") == 2, log
            assert keeper_log.count("the environment read at import differs") == 2, keeper_log
        else:
            assert "zygote template" not in log + keeper_log, log + keeper_log
        (keepers,) = [e for e in _events(run_dir) if e["type"] == "keepers"]
        keeper = keepers["nodes"]["0"]["pid"]
        if origin == "template":
            (writer,) = [int(p) for p in os.listdir("/proc") if p.isdigit()
                         and _status(int(p)).get("Name") == WRITER_NAME
                         and int(_status(int(p)).get("PPid", 0)) in TEMPLATE.values()
                         and os.readlink(f"/proc/{p}/ns/net") ==
                         os.readlink(f"/proc/{keeper}/ns/net")]
        else:
            (writer,) = [int(p) for p in os.listdir("/proc") if p.isdigit()
                         and int(_status(int(p)).get("PPid", 0)) == keeper]
        assert all(os.getsid(p) == p for p in spawned)  # each its own session: signalled alone
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher dies without a word
        ours = spawned + [zpid, keeper, writer]
        assert _gone(ours), [p for p in ours if Path(f"/proc/{p}").exists()]
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.communicate(timeout=30)


def test_exit_codes_are_reported_as_they_were(tmp_path, reference):
    run, out = train(tmp_path, "--spares=1", "--inject=crash:rank=1,step=10;exit:rank=2,step=20,code=7",
                     args=ARGS)
    codes = [(e["rank"], e["code"]) for e in run.of("exit") if e["rank"] in (1, 2) and e["code"]]
    assert codes[:2] == [(1, -9), (2, 7)], codes
    assert bitwise_equal(out, reference(3, *ARGS))


def test_a_killed_zygote_costs_one_recovery_then_ranks_start_directly(tmp_path, reference):
    run_dir = tmp_path / "run"
    out = tmp_path / "final.pt"
    t0 = time.time()
    # (steps of 20 ms while the file is there: once the zygote is killed, the rest at full speed)
    pace = tmp_path / "pace"
    pace.touch()
    proc = start(run_dir, "--nproc=2", "--spares=1", str(TRAIN), "--steps", "150", "--slow-ms", "20",
                 "--slow-file", str(pace), "--save", str(out))
    try:
        wait_for_event(run_dir, lambda e: e["type"] == "rank_first_step", timeout=90)
        spawned = [e["pid"] for e in _events(run_dir) if e["type"] == "spawn"]
        (zpid,) = {int(_status(p)["PPid"]) for p in spawned}
        os.kill(zpid, signal.SIGKILL)  # its children die with it
    finally:
        pace.unlink()
        run = finish(proc, run_dir, t0)
    assert run.code == 0, run.stdout[-3000:] + run.stderr[-3000:]
    assert run.of("incident") and all(i["outcome"] == "recovered" for i in run.of("incident"))
    later = [e["pid"] for e in run.of("spawn") if e["pid"] not in spawned]
    assert later  # the ranks and spares started again, directly (the zygote is gone)
    assert bitwise_equal(out, reference(2, "--steps", "150"))


def test_without_the_zygote_ranks_start_directly(tmp_path, reference, monkeypatch):
    # two ranks and a spare, each importing torch itself (3-4 s of CPU a process); the fault-free
    # run is made first, with the zygote, if no test has made it yet
    ref = reference(2, *ARGS)
    monkeypatch.setenv("NONSTOP_ZYGOTE", "0")
    run, out = train(tmp_path, "--spares=1", "--inject=crash:rank=1,step=10", args=ARGS, world=2)
    assert not (tmp_path / "run" / "logs" / "zygote.log").exists()
    assert [d["level"] for d in run.of("decision")] == ["rank replacement"]
    assert bitwise_equal(out, ref)


def _events(run_dir: Path) -> list[dict]:
    import json

    path = run_dir / "events.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
