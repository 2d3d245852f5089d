"""On one host a job listens on loopback only: the launcher's stores, the keepers, and every rank's
gloo listener."""

from __future__ import annotations

import pytest

import ipaddress
import json
import os
import signal
import time
from pathlib import Path

from conftest import TRAIN, finish, start, wait_for_event

pytestmark = pytest.mark.integration  # starts processes

LISTEN = "0A"  # the TCP state in /proc/net/tcp


def _address(hex_addr: str) -> ipaddress.IPv4Address | ipaddress.IPv6Address:
    """An address as /proc/net/tcp{,6} writes it: 32-bit words in host (little-endian) order."""
    raw = bytes.fromhex(hex_addr)
    return ipaddress.ip_address(b"".join(raw[i:i + 4][::-1] for i in range(0, len(raw), 4)))


def listening_sockets(pid: int) -> dict[int, tuple[str, int]]:
    """inode -> (address, port) of every listening TCP socket in the network namespace of pid."""
    found = {}
    for name in ("tcp", "tcp6"):
        path = Path(f"/proc/{pid}/net/{name}")
        if not path.exists():
            continue
        for line in path.read_text().splitlines()[1:]:
            fields = line.split()
            if fields[3] != LISTEN:
                continue
            addr, port = fields[1].split(":")
            found[int(fields[9])] = (str(_address(addr)), int(port, 16))
    return found


def descendants(pid: int) -> set[int]:
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            ppid = _ppid(int(entry))
            if ppid is not None:
                children.setdefault(ppid, []).append(int(entry))
    out, todo = set(), [pid]
    while todo:
        p = todo.pop()
        out.add(p)
        todo.extend(children.get(p, []))
    return out


def socket_inodes(pid: int) -> set[int]:
    inodes = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return inodes
    for fd in fds:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if link.startswith("socket:["):
            inodes.add(int(link[8:-1]))
    return inodes


def is_loopback(addr: str) -> bool:
    ip = ipaddress.ip_address(addr)
    mapped = getattr(ip, "ipv4_mapped", None)
    return ip.is_loopback or (mapped is not None and mapped.is_loopback)


def test_every_listener_of_a_job_is_on_loopback(tmp_path):
    t0 = time.time()
    proc = start(tmp_path / "run", "--nproc=2", "--spares=1", "--inject=crash:rank=1,step=5",
                 str(TRAIN), "--steps", "100000")
    try:
        # a recovered generation: the store of a later generation and a group formed again
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "incident", timeout=90)
        ranks = wait_for_event(tmp_path / "run", lambda e: e["type"] == "generation" and e["gen"] == 1)
        wait_for_event(tmp_path / "run", lambda e: e["type"] == "rank_ready")  # the refilled spare
        sockets = listening_sockets(proc.pid)
        wids = set(ranks["ranks"].values())
        spawned = [e for e in _events(tmp_path / "run") if e["type"] == "spawn"]
        rank_pids = {e["pid"] for e in spawned if e["wid"] in wids}
        # the job's processes: the launcher's, and its zygote's (forked by a template, the
        # zygote is not the launcher's child)
        zygotes = {_ppid(e["pid"]) for e in spawned} - {None}
        listeners: dict[int, list[tuple[str, int]]] = {}
        for pid in set().union(descendants(proc.pid), *map(descendants, zygotes)):
            mine = [sockets[i] for i in socket_inodes(pid) if i in sockets]
            if mine:
                listeners[pid] = mine
    finally:
        os.kill(proc.pid, signal.SIGTERM)
        finish(proc, tmp_path / "run", t0, timeout=60)
    everything = [a for found in listeners.values() for a in found]
    assert everything and all(is_loopback(addr) for addr, _ in everything), listeners
    assert len(listeners.get(proc.pid, [])) >= 2  # the launcher's store and a generation's store
    assert rank_pids and all(pid in listeners for pid in rank_pids)  # each rank's gloo listener


def _ppid(pid: int) -> int | None:
    """The process's parent (None: it is gone)."""
    try:
        return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return None


def _events(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "events.jsonl").read_text().splitlines()
            if line.strip()]
