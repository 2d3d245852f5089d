"""A job across test hosts: network namespaces on a bridge (``nonstop_bench.netns``), etcd on a host of
its own, and ``nonstop run`` started on every other host, as a user starts it on real machines.
Used by the tests and by ``nonstop bench hosts``; every process is ended by its pid afterwards."""

from __future__ import annotations

import errno
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Sequence

from . import netns
from .common import JsonlTail
from nonstop.store.etcd_server import EtcdCluster

SECRET = "nonstop-test-secret-0123456789abcdef"


class HostJob:
    """``hosts`` test hosts for the job, plus ``etcd_members`` hosts running etcd."""

    def __init__(self, base: Path, hosts: int, etcd_members: int = 1, tag: str = "nsj",
                 etcd_disk_mb: int | None = None):
        """``etcd_disk_mb``: each etcd member's data on a file system of its own of that size (a
        tmpfs), so that a test can fill it (``fill_etcd_disk``): etcd then stops on "no space
        left on device", as on a full disk."""
        self.etcd_disk_mb = etcd_disk_mb
        self.disks: dict[str, Path] = {}  # etcd member -> the mount its data is on
        self.base = Path(base)
        self.base.mkdir(parents=True, exist_ok=True)
        self.net = netns.TestHosts(hosts + etcd_members, tag)
        self.n_hosts, self.n_etcd = hosts, etcd_members
        self.procs: dict[int, subprocess.Popen] = {}  # host -> its newest nonstop run
        self.outs: dict[int, Path] = {}
        self.names: dict[int, str] = {}  # host -> the node id (and run dir) of its newest run
        self.used: list[str] = []  # every node id started, in order (their run dirs)
        self.replaced: list[subprocess.Popen] = []  # runs a newer one on their host replaced
        self.etcd: EtcdCluster | None = None
        self._tails: dict[str, JsonlTail] = {}  # run dir -> its event log, read as it grows
        self.job_id = f"job-{os.getpid()}-{int(time.time() * 1000) % 100000}"

    def __enter__(self) -> "HostJob":
        self.net.create()
        try:
            members = [(f"e{i}", h.addr, h.prefix) for i, h in enumerate(self.etcd_hosts)]
            self.etcd = EtcdCluster(members, self.base / "etcd", ports=lambda a: (2379, 2380))
            if self.etcd_disk_mb is not None:
                for m in self.etcd.members:
                    d = self.base / "etcd-disk" / m.name
                    _mount_tmpfs(d, self.etcd_disk_mb)
                    self.disks[m.name] = d
                    m.data_dir = d / "data"  # (its log stays on the job's disk)
            self.etcd.start()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def hosts(self) -> list[netns.Host]:
        return self.net.hosts[: self.n_hosts]

    @property
    def etcd_hosts(self) -> list[netns.Host]:
        return self.net.hosts[self.n_hosts:]

    def run_dir(self, i: int) -> Path:
        return self.base / self.names.get(i, f"host{i}")

    def start(self, i: int, *flags: str, script: str, script_args: Sequence[str] = (),
              env: dict[str, str] | None = None, endpoint: str | None = None,
              job_id: str | None = None, name: str | None = None) -> subprocess.Popen:
        """``nonstop run`` on host ``i`` (its output goes to ``out<i>.txt``). ``name``: its node
        id and run directory (default ``host<i>``), a new one for a host started again as a new
        machine after it was lost."""
        h = self.hosts[i]
        name = name or f"host{i}"
        if i in self.procs:
            self.replaced.append(self.procs[i])
        self.names[i] = name
        if name not in self.used:
            self.used.append(name)
        e = dict(os.environ, NONSTOP_JOB_SECRET=SECRET)
        e.update(env or {})
        cmd = [sys.executable, "-m", "nonstop", "run", "--no-live",
               "--rdzv-endpoint", endpoint or self.etcd.url, "--rdzv-id", job_id or self.job_id,
               f"--run-dir={self.run_dir(i)}", f"--node-id={name}", *flags, script,
               *script_args]
        out = self.base / f"out{i}.txt"
        self.outs[i] = out
        with open(out, "ab") as f:
            self.procs[i] = h.popen(cmd, env=e, stdout=f, stderr=subprocess.STDOUT)
        return self.procs[i]

    def wait(self, timeout: float) -> dict[int, int | None]:
        """Every ``nonstop run`` ended (or the deadline): their exit codes."""
        deadline = time.monotonic() + timeout
        for p in self.procs.values():
            try:
                p.wait(max(0.1, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return {i: p.poll() for i, p in self.procs.items()}

    def output(self, i: int) -> str:
        p = self.outs.get(i)
        return p.read_text(errors="replace") if p and p.exists() else ""

    def wait_output(self, text: str, timeout: float, hosts: Sequence[int] | None = None) -> int:
        """The first host whose output shows ``text``."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for i in hosts if hosts is not None else self.outs:
                if text in self.output(i):
                    return i
            time.sleep(0.05)
        raise TimeoutError(f"no host printed {text!r} within {timeout} s")

    def events(self) -> list[dict[str, Any]]:
        """The event log of every controller that was in office, in order."""
        out: list[dict[str, Any]] = []
        for name in self.used or [f"host{i}" for i in range(self.n_hosts)]:
            tail = self._tails.get(name)
            if tail is None:
                tail = self._tails[name] = JsonlTail(self.base / name / "events.jsonl")
            out += tail.records()
        return sorted(out, key=lambda e: e.get("t", 0))

    def of(self, kind: str) -> list[dict[str, Any]]:
        return [e for e in self.events() if e.get("type") == kind]

    def host_of_rank(self, rank: int) -> int:
        """The test host whose output shows this rank's lines."""
        for i in self.outs:
            if "] " in self.output(i) and f" rank {rank}]" in self.output(i):
                return i
        raise LookupError(rank)

    def kill_host(self, i: int) -> None:
        """The whole host at once: its agent, its ranks, its spares, its standby controller."""
        self.hosts[i].kill_all(signal.SIGKILL)

    def close(self) -> None:
        for p in [*self.replaced, *self.procs.values()]:
            if p.poll() is None:
                try:
                    os.killpg(p.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        if self.etcd is not None:
            self.etcd.stop()
        for d in self.disks.values():
            _umount(d)
        self.disks.clear()
        self.net.destroy()

    def fill_etcd_disk(self, member: str) -> None:
        """Take every free byte of ``member``'s file system (its data directory's)."""
        with open(self.disks[member] / "filler", "wb", buffering=0) as fh:
            for size in (1 << 20, 4096, 1):
                try:
                    while True:
                        fh.write(b"\0" * size)
                except OSError as e:
                    if e.errno != errno.ENOSPC:
                        raise

    def free_etcd_disk(self, member: str) -> None:
        (self.disks[member] / "filler").unlink(missing_ok=True)

    def clean(self) -> None:
        shutil.rmtree(self.base, ignore_errors=True)


def _mount_tmpfs(path: Path, mb: int) -> None:
    """A tmpfs of ``mb`` MB at ``path`` (root only): raises with mount's error."""
    path.mkdir(parents=True, exist_ok=True)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={mb}m,mode=0700", "nonstop-etcd",
                        str(path)], capture_output=True, text=True, timeout=30)
    if r.returncode != 0:
        raise RuntimeError(f"cannot mount a tmpfs at {path}: {r.stderr.strip()}")


def _umount(path: Path) -> None:
    if subprocess.run(["umount", str(path)], capture_output=True, timeout=30).returncode:
        subprocess.run(["umount", "-l", str(path)], capture_output=True, timeout=30)
