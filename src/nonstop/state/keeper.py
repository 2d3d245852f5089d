"""The node's memory: a small process that holds every snapshot slot of the node, so a snapshot
outlives the rank that wrote it, and that copies snapshots to a buddy node and to disk, off the
ranks' training path.

    python -m nonstop.state.keeper NAME --node N [--host HOST] [--writer]

A rank asks for a slot (``alloc``), fills it, and says so (``commit``). Each holder (``r3``: rank
3's own snapshots; ``rep3``: a replica of them from another node) has two slots; a write goes to
the older one, and waits while a reader holds it or while the newer one has not reached the
buddy yet, so own memory and the replica always share a step. The slots are memfds: only
processes they are handed to can read them, and they are freed when the keeper and the ranks are
gone - the keeper's death is the node's memory lost.
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import itertools
import logging
import os
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

from . import shm, wire
from .disk import DiskWrites
from .replicas import DEFER_LIMIT_S, REPL_WAIT_S, Replication, _forget, job_secret

SLOTS = 2
# Replicas arrive over TCP, where anyone who can reach the port could connect. Across hosts
# (``$NONSTOP_JOB_SECRET`` set) they travel over the authenticated channel: every frame MACed with
# the job's secret. On one host, every frame carries this token instead (from the environment,
# which only the job's user can read), or it is refused.
ENV_TOKEN = "NONSTOP_KEEPER_TOKEN"


class Holder:
    """The slots of one holder and who is using them."""

    def __init__(self, name: str):
        self.name = name
        self.fds: list[int | None] = [None] * SLOTS
        self.writing: list[Any] = [None] * SLOTS  # who is writing the slot
        self.leases: list[collections.Counter] = [collections.Counter() for _ in range(SLOTS)]
        self.replicated = -1  # seq of the newest snapshot the buddy node holds
        self.replicated_step: int | None = None
        self.repl_error: str | None = None  # replication failed: writes no longer wait for it
        self.repl_s: float | None = None  # how long the last replication took (into memory in place)
        self.repl_first_s: float | None = None  # ...into new memory: an upper bound until then
        self.repl_wait_since: float | None = None  # a write waits for the buddy since then

    def infos(self) -> list[shm.SlotInfo | None]:
        return [shm.read_header(fd) if fd is not None else None for fd in self.fds]

    def free(self, i: int) -> bool:
        return self.writing[i] is None and sum(self.leases[i].values()) == 0

    def older(self) -> int:
        """The slot a new snapshot goes to: the invalid one, else the one with the older seq."""
        seqs = [i.seq if i is not None else -1 for i in self.infos()]
        return min(range(SLOTS), key=lambda i: (seqs[i], i))

    def newest(self, step: int | None = None) -> tuple[int, shm.SlotInfo] | None:
        found = [(info.seq, i, info) for i, info in enumerate(self.infos())
                 if info is not None and self.writing[i] is None
                 and (step is None or info.step == step)]
        if not found:
            return None
        _, i, info = max(found)
        return i, info

    def ensure(self, i: int, size: int) -> tuple[int, bool]:
        """The slot's descriptor, at least ``size`` bytes; and whether it was just made or grown.
        New memory is allocated here, at once (``fallocate``), rather than page by page under
        the first copy into it: a fresh gigabyte costs ~1.3 s faulted in, ~0.3 s allocated."""
        fd = self.fds[i]
        if fd is not None and os.fstat(fd).st_size >= size:
            return fd, False
        if fd is None:
            fd = self.fds[i] = shm.create(f"{self.name}.{i}", size)
        else:
            os.ftruncate(fd, size)  # grows in place; readers re-map when they see a new size
        try:
            os.posix_fallocate(fd, 0, size)
        except OSError:
            pass  # not enough memory now: the pages come one by one, or the copy fails loudly
        return fd, True


class Keeper(Replication, DiskWrites):
    def __init__(self, name: str, node: int, host: str, writer: bool):
        self.name, self.node = name, node
        self.token = os.environ.get(ENV_TOKEN, "")
        self.secret = job_secret()  # None: one host, the token path
        self.lock = threading.RLock()
        self.changed = threading.Condition(self.lock)
        self.holders: dict[str, Holder] = {}
        self.replicate_to: dict[str, str] = {}  # holder -> "host:port" of the buddy node's keeper
        self.repl_conns: dict[str, Any] = {}  # buddy address -> its open connection
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.listener.bind(wire.address(name))
        self.listener.listen(128)
        self._listen_for_replicas(host)  # self.tcp, self.tcp_addr
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.conns: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)
        self.subscribers: set[int] = set()
        self.deferred: list[tuple[int, dict[str, Any], float]] = []
        self.events: list[dict[str, Any]] = []
        self.repl_queue: collections.deque[str] = collections.deque()
        self.stage_queue: collections.deque[dict[str, Any]] = collections.deque()
        self.write_queue: collections.deque[tuple[dict[str, Any], shm.SlotInfo, int]] = \
            collections.deque()
        self.want_writer = writer
        self.writer: subprocess.Popen | None = None
        self.writer_sock: socket.socket | None = None
        self.writer_job: tuple[dict[str, Any], shm.SlotInfo, int] | None = None
        # holder -> the staged copy of its newest part that failed to be written (disk.py)
        self.kept: dict[str, tuple[dict[str, Any], shm.SlotInfo, int]] = {}
        for sock, tag in ((self.listener, "listen"), (self.tcp, "tcp"), (self._wake_r, "wake")):
            self.sel.register(sock, selectors.EVENT_READ, tag)
        threading.Thread(target=self._replicator, name="replicator", daemon=True).start()
        threading.Thread(target=self._stager, name="stager", daemon=True).start()

    # == plumbing ================================================================================
    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass

    def emit(self, ev: dict[str, Any]) -> None:
        """An event for the subscribers (the controller); sent by the main thread."""
        ev.setdefault("t", time.time())
        ev["node"] = self.node
        with self.lock:
            self.events.append(ev)
        self.wake()

    def _flush_events(self) -> None:
        with self.lock:
            events, self.events = self.events, []
        for ev in events:
            for cid in list(self.subscribers):
                sock = self.conns.get(cid)
                try:
                    if sock is not None:
                        wire.send(sock, ev)
                except OSError:
                    self._drop(cid)

    def holder(self, name: str) -> Holder:
        h = self.holders.get(name)
        if h is None:
            h = self.holders[name] = Holder(name)
        return h

    def run(self) -> None:
        if self.want_writer:
            self._start_writer()
        while True:
            for key, _ in self.sel.select(timeout=0.05 if self.deferred else 0.5):
                tag = key.data
                if tag == "listen":
                    self._accept()
                elif tag == "tcp":
                    self._accept_replicas()
                elif tag == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                elif tag == "writer":
                    self._from_writer()
                else:
                    self._serve(tag)
            self._tend_replicas()
            self._retry_deferred()
            self._dispatch_persist()
            self._flush_events()

    def _accept(self) -> None:
        conn, _ = self.listener.accept()
        _, uid = wire.peer_pid_uid(conn)
        if uid != os.getuid():  # the snapshots are the job's user's alone
            conn.close()
            return
        cid = next(self._ids)
        self.conns[cid] = conn
        self.sel.register(conn, selectors.EVENT_READ, cid)

    def _drop(self, cid: int) -> None:
        sock = self.conns.pop(cid, None)
        if sock is None:
            return
        try:
            self.sel.unregister(sock)
        except (KeyError, ValueError):
            pass
        sock.close()
        self.subscribers.discard(cid)
        with self.lock:
            self.deferred = [d for d in self.deferred if d[0] != cid]
            for h in self.holders.values():  # a client that died gives back what it held
                for i in range(SLOTS):
                    if h.writing[i] == cid:
                        h.writing[i] = None
                    h.leases[i].pop(cid, None)
            self.changed.notify_all()

    def _serve(self, cid: int) -> None:
        sock = self.conns.get(cid)
        if sock is None:
            return
        try:
            msg, fds = wire.recv(sock)
        except OSError:
            msg, fds = None, []
        if msg is None:
            self._drop(cid)
            return
        for fd in fds:  # clients send no descriptors
            os.close(fd)
        try:
            with self.lock:
                out = self._handle(cid, msg)
        except Exception as exc:  # noqa: BLE001 - a bad request must not take the node's memory down
            out = ({"error": f"{type(exc).__name__}: {exc}"}, [])
        if out is None:
            self.deferred.append((cid, msg, time.time()))
            return
        self._reply(cid, *out)

    def _reply(self, cid: int, reply: dict[str, Any] | None, fds: list[int]) -> None:
        if reply is None:
            return
        sock = self.conns.get(cid)
        if sock is None:
            return
        try:
            wire.send(sock, reply, fds)
        except OSError:
            self._drop(cid)

    def _retry_deferred(self) -> None:
        if not self.deferred:
            return
        now = time.time()
        with self.lock:
            waiting, self.deferred = self.deferred, []
            for cid, msg, t0 in waiting:
                if now - t0 > DEFER_LIMIT_S:
                    self._reply(cid, {"error": f"{msg['op']} {msg.get('holder')}: no free slot "
                                               f"after {DEFER_LIMIT_S:g} s"}, [])
                    continue
                out = self._handle(cid, msg)
                if out is None:
                    self.deferred.append((cid, msg, t0))
                else:
                    self._reply(cid, *out)

    # == requests ================================================================================
    def _handle(self, cid: int, msg: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]] | None:
        """Answer one request: (reply, descriptors), or None to answer it later."""
        op = msg.get("op")
        if op == "alloc":
            return self._alloc(cid, msg)
        if op == "commit":
            return self._commit(cid, msg)
        if op == "lease":
            return self._lease(cid, msg)
        if op == "release":
            h = self.holder(msg["holder"])
            h.leases[msg["slot"]][cid] -= 1
            if h.leases[msg["slot"]][cid] <= 0:
                del h.leases[msg["slot"]][cid]
            self.changed.notify_all()
            return ({"ok": True} if msg.get("reply") else None), []
        if op == "list":
            return {"holders": self._listing(), "node": self.node, "tcp": self.tcp_addr}, []
        if op == "configure":
            return self._configure(msg)
        if op in ("persist", "forget"):
            return self._disk_request(msg)
        if op == "corrupt":
            return self._corrupt(msg)
        if op == "subscribe":
            self.subscribers.add(cid)
            return {"ok": True, "tcp": self.tcp_addr, "node": self.node, "pid": os.getpid()}, []
        if op == "ping":
            return {"ok": True, "pid": os.getpid(), "tcp": self.tcp_addr}, []
        return {"error": f"unknown request {op!r}"}, []

    def _listing(self) -> dict[str, Any]:
        out = {}
        for name, h in self.holders.items():
            out[name] = {"slots": [None if info is None or h.writing[i] is not None else info.to_wire()
                                   for i, info in enumerate(h.infos())],
                         "replicated_step": h.replicated_step, "repl_s": h.repl_s,
                         "repl_error": h.repl_error, "buddy": self.replicate_to.get(name)}
        return out

    def _alloc(self, cid: int, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]] | None:
        h = self.holder(msg["holder"])
        i = h.older()
        if not h.free(i):
            return None  # a reader (replication, a disk write, a restore) holds it
        other = h.infos()[1 - i]
        if (other is not None and h.name in self.replicate_to and h.repl_error is None
                and other.seq > h.replicated):
            # the newer snapshot has not reached the buddy: keep the older one, for a while
            now = time.time()
            h.repl_wait_since = h.repl_wait_since or now
            limit = max(REPL_WAIT_S, 3 * (h.repl_s or 0.0))
            if now - h.repl_wait_since < limit:
                return None
            h.repl_error = (f"the buddy did not take step {other.step} within {limit:.2f} s: "
                            "snapshots go on without waiting for it")
            self.emit({"ev": "replication_behind", "holder": h.name, "step": other.step,
                       "to": self.replicate_to.get(h.name), "waited_s": round(limit, 3)})
        h.repl_wait_since = None
        fd, fresh = h.ensure(i, int(msg["size"]))
        h.writing[i] = cid
        seq = 1 + max((info.seq for info in h.infos() if info is not None), default=0)
        repl_s = h.repl_s if h.repl_s is not None else h.repl_first_s
        buddy = self.replicate_to.get(h.name, "")
        if repl_s is not None and buddy.rpartition(":")[0] == self.tcp_addr.rpartition(":")[0]:
            repl_s *= 2  # a buddy on this very machine: its CPUs pay for both ends of the copy
        return {"slot": i, "seq": seq, "size": os.fstat(fd).st_size, "repl_s": repl_s,
                "fresh": fresh}, [fd]

    def _commit(self, cid: int, msg: dict[str, Any]) -> tuple[dict[str, Any] | None, list[int]]:
        h = self.holder(msg["holder"])
        i = msg["slot"]
        if h.writing[i] == cid:
            h.writing[i] = None
        info = h.infos()[i]
        if info is not None:
            if h.name in self.replicate_to and h.name not in self.repl_queue:
                self.repl_queue.append(h.name)
                self.changed.notify_all()
            if msg.get("persist"):
                # the stager's lease is taken now: by the time it runs, two more snapshots may
                # have come, and the slot must not be written over before it is copied
                h.leases[i]["stager"] += 1
                self.stage_queue.append(dict(msg["persist"], holder=h.name, step=info.step,
                                             slot=i))
        self.changed.notify_all()
        return ({"ok": info is not None} if msg.get("reply") else None), []

    def _lease(self, cid: int, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        h = self.holders.get(msg["holder"])
        found = h.newest(msg.get("step")) if h is not None else None
        if found is None:
            return {"slot": None}, []
        i, info = found
        h.leases[i][cid] += 1
        return {"slot": i, "info": info.to_wire()}, [h.fds[i]]

    def _configure(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]]:
        new = dict(msg.get("replicate") or {})
        for name, addr in new.items():
            h = self.holder(name)
            if self.replicate_to.get(name) != addr:  # a new buddy holds nothing yet
                h.replicated, h.replicated_step, h.repl_error = -1, None, None
                if name not in self.repl_queue:
                    self.repl_queue.append(name)
        for name in set(self.replicate_to) - set(new):
            self.holder(name).repl_error = None
        for addr in set(self.replicate_to.values()) - set(new.values()):
            _forget(self.repl_conns, addr)  # a send stuck on a buddy given up ends now
        self.replicate_to = new
        if msg.get("writer") and self.writer is None:
            self.want_writer = True
            self._start_writer()
        self.changed.notify_all()
        return {"ok": True, "tcp": self.tcp_addr}, []

    def _corrupt(self, msg: dict[str, Any]) -> tuple[dict[str, Any], list[int]] | None:
        """Fault injection: a bit flips in the holder's newest snapshot, once its replica (if it
        has a buddy) is safe on the other node."""
        h = self.holders.get(msg["holder"])
        found = h.newest() if h is not None else None
        if found is None:
            return {"error": f"{msg['holder']}: no snapshot to corrupt"}, []
        i, info = found
        if h.name in self.replicate_to and h.repl_error is None and h.replicated < info.seq:
            return None
        offset = shm.Slot(h.fds[i]).flip_bit(info)
        return {"ok": True, "step": info.step, "offset": offset}, []

def die_with(parent: int) -> None:
    """Ask the kernel to end this process when its parent ends (the node's agent)."""
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nonstop.state.keeper")
    p.add_argument("name", help="abstract socket name")
    p.add_argument("--node", type=int, default=0)
    p.add_argument("--host", default="127.0.0.1", help="address replicas from other nodes arrive at")
    p.add_argument("--writer", action="store_true", help="start the checkpoint writer now")
    p.add_argument("--parent", type=int, default=0, help="end with this process")
    args = p.parse_args(argv)
    if args.parent:
        die_with(args.parent)
    # what the channel's listener logs (a refused peer) is one line on stderr, in the keeper's log
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format=f"keeper {args.name}: %(message)s")
    try:
        keeper = Keeper(args.name, args.node, args.host, args.writer)
    except ValueError as exc:  # an empty job secret: no unauthenticated listener instead
        sys.exit(f"keeper {args.name}: {exc}")
    keeper.run()


if __name__ == "__main__":
    main()
