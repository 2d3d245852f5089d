"""etcd fails for good while a job trains: its data directory on a small file system (a real
tmpfs) that fills mid-run, so that etcd stops on "no space left on device" as it would on a full
disk. Training needs no etcd: it goes on, the ranks that finished run their script's end (its
final save) without an order from the store, the failure is said once, and the exit code and the
summary say what happened. One host (an agent on loopback) and one etcd member."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import TRAIN, bitwise_equal

from nonstop.store.etcd import Etcd, StoreError
from nonstop.store.etcd_server import EtcdCluster

pytestmark = pytest.mark.integration

SECRET = "store-failure-secret-0123456789abcdef"
# the job of tests/test_recovery.py (its reference serves here too: the sleep changes no number),
# slowed so that training outlives etcd by seconds
WORLD, STEPS, SLEEP_MS = 3, 40, 300


@pytest.fixture
def small_fs(tmp_path):
    """A tmpfs a little bigger than etcd needs (its first WAL segment takes 61 MiB at once; at
    72 MiB, and at 96 in a soak, its database met the end as it started on a loaded machine),
    always unmounted at the end (lazily if something still holds it)."""
    d = tmp_path / "etcd-disk"
    d.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=160m,mode=0700", "tmpfs", str(d)],
                       capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs (needs root): {r.stderr.strip()}")
    try:
        yield d
    finally:
        if subprocess.run(["umount", str(d)], capture_output=True, timeout=30).returncode:
            subprocess.run(["umount", "-l", str(d)], capture_output=True, timeout=30)


def _fill(fs: Path) -> None:
    """Take every free byte of the file system."""
    with open(fs / "filler", "wb", buffering=0) as fh:
        for size in (1 << 20, 4096, 1):
            try:
                while True:
                    fh.write(b"\0" * size)
            except OSError as e:
                assert e.errno == errno.ENOSPC


def _step(text: str) -> int:
    """The newest step the status lines show."""
    best = 0
    for line in text.splitlines():
        if "| step " in line:
            word = line.split("| step ", 1)[1].split()[0]
            if word.isdigit():
                best = max(best, int(word))
    return best


def test_etcd_whose_disk_fills_ends_a_finished_job_with_its_final_save(tmp_path, small_fs,
                                                                        reference):
    """etcd stops mid-run (its disk full): training goes on and completes; the ranks return and
    the script saves its weights (the fault-free ones) with no word from etcd; the job ends at
    once with exit 0, not at the store's outage limit (60 s); the console says etcd's failure
    once, naming it and the error its client met; the summary says it was not back at the end."""
    (tmp_path / "etcd").mkdir()
    etcd = EtcdCluster([("e0", "127.0.0.1", [])], tmp_path / "etcd")
    etcd.members[0].data_dir = small_fs / "e0"  # (its log stays on the test's disk)
    etcd.start()
    run_dir, out = tmp_path / "run", tmp_path / "out.txt"
    saved = tmp_path / "final.pt"
    cmd = [sys.executable, "-m", "nonstop", "run", "--no-live", "--node-addr", "127.0.0.1",
           "--node-id", "h0", f"--run-dir={run_dir}", "--rdzv-endpoint", etcd.url,
           "--rdzv-id", "full-disk", "--nnodes", "1", "--nproc-per-node", str(WORLD), str(TRAIN),
           "--steps", str(STEPS), "--sleep-ms", str(SLEEP_MS), "--save", str(saved)]
    with open(out, "wb") as fh:
        proc = subprocess.Popen(cmd, env=dict(os.environ, NONSTOP_JOB_SECRET=SECRET),
                                stdout=fh, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while _step(out.read_text(errors="replace")) < 3:
            assert proc.poll() is None and time.monotonic() < deadline, out.read_text()[-3000:]
            time.sleep(0.05)
        before = len(out.read_bytes())  # (a loaded machine may delay a lease before)
        _fill(small_fs)
        with Etcd([("127.0.0.1", etcd.members[0].client_port)], "filler", timeout_s=1.0) as e:
            for i in range(4):  # a write of its own to commit: etcd meets the full disk now
                try:
                    e.put(f"x{i}", b"\0" * 65536)
                except StoreError:
                    break
        deadline = time.monotonic() + 30  # etcd stops at its next commit to the full disk
        while etcd.members[0].running:
            assert time.monotonic() < deadline, "etcd did not stop on its full disk"
            time.sleep(0.05)
        t_stopped = time.time()
        assert "no space left on device" in (tmp_path / "etcd" / "e0.log").read_text()
        proc.wait(45)  # within hosts.store_outage_s (60 s): nothing waits for etcd
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait(30)
        etcd.stop()
    text = out.read_text(errors="replace")
    assert proc.returncode == 0, text[-4000:]
    events = [json.loads(x) for x in (run_dir / "events.jsonl").read_text().splitlines()]
    (done,) = [e for e in events if e["type"] == "training_complete"]
    assert done["t"] > t_stopped, "training completed before etcd stopped: nothing was tested"
    assert saved.exists() and bitwise_equal(saved, reference(WORLD, "--steps", str(STEPS),
                                                             "--sleep-ms", str(SLEEP_MS)))
    endpoint = etcd.members[0].endpoint
    after = out.read_bytes()[before:].decode(errors="replace")
    said = [x for x in after.splitlines() if endpoint in x and not x.startswith("nonstop summary")]
    assert len(said) == 1 and "etcd out of reach" in said[0] and \
        ("connection refused" in said[0] or "timed out" in said[0]), said
    assert "lease is confirmed" not in text and "Traceback" not in text
    summary = json.loads((run_dir / "summary.json").read_text())
    assert summary["exit_code"] == 0 and summary["diagnosis"] is None
    store = summary["store"]
    assert store["store"] == "etcd" and store["outages"] == 1 and not store["back"], store
    assert "not back at the end" in text
