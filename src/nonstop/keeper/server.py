"""The node's memory: a small process that holds every snapshot slot of the node, so a snapshot
outlives the rank that wrote it, and that copies snapshots to buddy nodes and to disk, off the
ranks' training path.

    python -m nonstop.keeper NAME --node N [--host HOST] [--writer]

A rank asks for a slot (``alloc``), fills it, and says so (``commit``): every request, answer
and report is a record of ``protocol/keeper_messages.py``, and a request that is not one is
answered with an error (or logged, if it would not have been answered) and passed over. Each
holder (``r3``: rank 3's own snapshots; ``rep3``: a replica of them from another node) has two
slots; a write goes to the older one, and waits while a reader holds it or while the newer one
has not reached every buddy yet, so own memory and the replicas always share a step. The slots
are memfds: only processes they are handed to can read them, and they are freed when the keeper
and the ranks are gone - the keeper's death is the node's memory lost.

The slots and their lock are a ``slots.Slots``; the keeper owns the two parts that work on them
besides its requests, each handed the slots and what else it uses: ``replicas.Replication`` (to
and from the buddy nodes, in threads of its own) and ``disk.DiskWrites`` (the stager thread and
the writer process). It calls them from its loop and its request handlers; what they report
reaches the subscribers through its ``emit``.
"""

from __future__ import annotations

import argparse
import itertools
import logging
import os
import selectors
import socket
import sys
import threading
import time
from typing import Any

from ..pids import die_with
from ..protocol import keeper_messages as km
from ..state import shm, wire
from .disk import DiskWrites
from .replicas import Replication, job_secret
from .slots import DEFER_LIMIT_S, Slots

# Replicas arrive over TCP, where anyone who can reach the port could connect. Across hosts
# (``$NONSTOP_JOB_SECRET`` set) they travel over the authenticated channel: every frame MACed with
# the job's secret. On one host, every frame carries this token instead (from the environment,
# which only the job's user can read), or it is refused.
ENV_TOKEN = "NONSTOP_KEEPER_TOKEN"

log = logging.getLogger(__name__)
Out = tuple[km.Answer | None, list[int]]  # an answer (None: none) and the descriptors with it


class Keeper:
    """The node's slots (``slots.Slots``), its replication (``replicas.Replication``) and its
    disk writes (``disk.DiskWrites``), each given the slots; and the loop that serves the ranks'
    requests and sends the events all three emit to the subscribers."""

    def __init__(self, name: str, node: int, host: str, writer: bool):
        self.name, self.node = name, node
        secret = job_secret()  # None: one host, the token path
        if secret is None and not os.environ.get(ENV_TOKEN, "").strip():
            # fail closed: without a token any local process could write into this job's memory
            raise ValueError(f"no keeper token: set {ENV_TOKEN} (one host) or the job's secret")
        self.slots = Slots()
        self.sel = selectors.DefaultSelector()
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        self.listener.bind(wire.address(name))
        self.listener.listen(128)
        self.replication = Replication(
            self.slots, self.emit, self.wake, name=name, node=node, host=host,
            token=os.environ.get(ENV_TOKEN, ""), secret=secret)
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_w.setblocking(False)
        self.conns: dict[int, socket.socket] = {}
        self._ids = itertools.count(1)
        self.subscribers: set[int] = set()
        self.deferred: list[tuple[int, km.Request, float]] = []
        self.events: list[km.Report] = []
        self.want_writer = writer
        self.disk = DiskWrites(self.slots, self.emit, self.wake, self.sel)
        for sock, tag in ((self.listener, "listen"), (self.replication.tcp, "tcp"),
                          (self._wake_r, "wake")):
            self.sel.register(sock, selectors.EVENT_READ, tag)

    # == plumbing ================================================================================
    def wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass

    def emit(self, report: km.Report) -> None:
        """A report for the subscribers (the controller); sent by the main thread."""
        with self.slots.lock:
            self.events.append(report)
        self.wake()

    def _flush_events(self) -> None:
        with self.slots.lock:
            events, self.events = self.events, []
        for report in events:
            ev = km.encode(report)
            for cid in list(self.subscribers):
                sock = self.conns.get(cid)
                try:
                    if sock is not None:
                        wire.send(sock, ev)
                except OSError:
                    self._drop(cid)

    def run(self) -> None:
        threading.Thread(target=self.disk.stager, name="stager", daemon=True).start()
        if self.want_writer:
            self.disk.start_writer()
        while True:
            for key, _ in self.sel.select(timeout=0.05 if self.deferred else 0.5):
                tag = key.data
                if tag == "listen":
                    self._accept()
                elif tag == "tcp":
                    self.replication.accept()
                elif tag == "wake":
                    try:
                        self._wake_r.recv(4096)
                    except OSError:
                        pass
                elif tag == "writer":
                    self.disk.from_writer()
                else:
                    self._serve(tag)
            self.replication.tend()
            self._retry_deferred()
            self.disk.dispatch()
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
        with self.slots.lock:
            self.deferred = [d for d in self.deferred if d[0] != cid]
            self.slots.give_back(cid)  # a client that died gives back what it held

    def _serve(self, cid: int) -> None:
        sock = self.conns.get(cid)
        if sock is None:
            return
        try:
            msg, fds = wire.recv(sock)
        except OSError:
            msg, fds = None, []
        except ValueError as exc:  # not JSON
            self._reply(cid, km.Refused(error=f"a malformed request: {exc}"), [])
            return
        if msg is None:
            self._drop(cid)
            return
        for fd in fds:  # clients send no descriptors
            os.close(fd)
        out, request = self.serve(cid, msg)
        if out is None:
            self.deferred.append((cid, request, time.time()))  # type: ignore[arg-type]
            return
        self._reply(cid, *out)

    def serve(self, cid: int, raw: Any) -> tuple[Out | None, km.Request | None]:
        """One request as it came (JSON) from client ``cid``: what to answer (None: later) and
        the request. A request that is not one, or that fails, is answered with why (a bad
        request must not take the node's memory down), unless its sender waits for no answer:
        then it is logged."""
        try:
            request = km.decode_request(raw)
        except km.BadKeeperMessage as exc:
            told = km.told(raw)
            return self._refuse(f"a malformed request: {exc}", told), None
        try:
            with self.slots.lock:
                out = self._handle(cid, request)
        except Exception as exc:  # noqa: BLE001 - a bad request must not take the node's memory down
            return self._refuse(f"{request.op}: {type(exc).__name__}: {exc}",
                                request.answer is None), request
        return out, request

    def _refuse(self, why: str, told: bool) -> Out:
        if told:  # an answer would be taken for the one to the sender's next request
            log.warning("%s (passed over)", why)
            return None, []
        return km.Refused(error=why), []

    def _reply(self, cid: int, reply: km.Answer | None, fds: list[int]) -> None:
        if reply is None:
            return
        sock = self.conns.get(cid)
        if sock is None:
            return
        try:
            wire.send(sock, km.encode(reply), fds)
        except OSError:
            self._drop(cid)

    def _retry_deferred(self) -> None:
        if not self.deferred:
            return
        now = time.time()
        with self.slots.lock:
            waiting, self.deferred = self.deferred, []
            for cid, request, t0 in waiting:
                if now - t0 > DEFER_LIMIT_S:
                    holder = getattr(request, "holder", None)
                    self._reply(cid, km.Refused(error=f"{request.op} {holder}: no free slot after "
                                                      f"{DEFER_LIMIT_S:g} s"), [])
                    continue
                try:
                    out = self._handle(cid, request)
                except Exception as exc:  # noqa: BLE001 - as in ``serve``
                    out = self._refuse(f"{request.op}: {type(exc).__name__}: {exc}",
                                       request.answer is None)
                if out is None:
                    self.deferred.append((cid, request, t0))
                else:
                    self._reply(cid, *out)

    # == requests ================================================================================
    def _handle(self, cid: int, request: km.Request) -> Out | None:
        """Answer one request: (answer, descriptors), or None to answer it later."""
        match request:
            case km.Alloc():
                return self._alloc(cid, request)
            case km.Commit():
                self._commit(cid, request)
                return None, []
            case km.Lease():
                return self._lease(cid, request)
            case km.Release(holder=holder, slot=slot):
                self.slots.holder(holder).unlease(slot, cid)
                self.slots.changed.notify_all()
                return None, []
            case km.ListHolders():
                return km.Listing(holders=self._listing(), node=self.node,
                                  tcp=self.replication.tcp_addr), []
            case km.Configure():
                return self._configure(request)
            case km.Persist() | km.Forget():
                return self.disk.request(request), []
            case km.Corrupt():
                return self._corrupt(request)
            case km.Subscribe():
                self.subscribers.add(cid)
                return km.Subscribed(tcp=self.replication.tcp_addr, node=self.node,
                                     pid=os.getpid()), []
            case km.Ping():
                return km.Pong(pid=os.getpid(), tcp=self.replication.tcp_addr), []
        return km.Refused(error=f"{request.op!r} is not served by a keeper"), []

    def _listing(self) -> dict[str, km.HolderEntry]:
        out = {}
        for name, h in self.slots.holders.items():
            out[name] = km.HolderEntry(
                slots=[None if info is None or h.writing[i] is not None else info
                       for i, info in enumerate(h.infos())],
                replicated_step=self.replication.caught_up(h), repl_s=h.repl_s,
                repl_error=self.replication.error(h), buddies=self.replication.targets(name))
        return out

    def _alloc(self, cid: int, request: km.Alloc) -> Out | None:
        h = self.slots.holder(request.holder)
        i = h.older()
        if not h.free(i):
            return None  # a reader (replication, a disk write, a restore) holds it
        if self.replication.holds_back(h, h.infos()[1 - i]):
            return None  # the newer snapshot has not reached every buddy: keep the older one
        fd, fresh = h.ensure(i, request.size)
        h.writing[i] = cid
        seq = 1 + max((info.seq for info in h.infos() if info is not None), default=0)
        return km.Allocated(slot=i, seq=seq, size=os.fstat(fd).st_size,
                            repl_s=self.replication.expected_s(h), fresh=fresh), [fd]

    def _commit(self, cid: int, request: km.Commit) -> None:
        h = self.slots.holder(request.holder)
        i = request.slot
        if h.writing[i] == cid:
            h.writing[i] = None
        info = h.infos()[i]
        if info is not None:
            self.replication.committed(h.name)
            if request.persist is not None:
                self.disk.stage(h, i, info, request.persist)
        self.slots.changed.notify_all()

    def _lease(self, cid: int, request: km.Lease) -> Out:
        h = self.slots.holders.get(request.holder)
        found = h.newest(request.step) if h is not None else None
        if found is None:
            return km.Leased(slot=None, info=None), []
        i, info = found
        h.leases[i][cid] += 1
        return km.Leased(slot=i, info=info), [h.fds[i]]

    def _configure(self, request: km.Configure) -> Out:
        if request.replicate is not None:
            self.replication.configure(dict(request.replicate))
        if request.free_within_s is not None:  # a replica's wait for a slot leased to a reader
            self.replication.free_within_s = max(0.0, request.free_within_s)
        if request.writer and self.disk.writer is None:
            self.disk.start_writer()
        self.slots.changed.notify_all()
        return km.Configured(tcp=self.replication.tcp_addr), []

    def _corrupt(self, request: km.Corrupt) -> Out | None:
        """Fault injection: a bit flips in the holder's newest snapshot, once its replicas (if it
        has buddies) are safe on the other nodes."""
        h = self.slots.holders.get(request.holder)
        found = h.newest() if h is not None else None
        if found is None:
            return km.Refused(error=f"{request.holder}: no snapshot to corrupt"), []
        i, info = found
        if self.replication.pending(h, info.seq):
            return None
        offset = shm.Slot(h.fds[i]).flip_bit(info)
        return km.Corrupted(step=info.step, offset=offset), []


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m nonstop.keeper")
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
    except ValueError as exc:  # no token, an empty job secret: no unauthenticated listener
        sys.exit(f"keeper {args.name}: {exc}")
    keeper.run()


if __name__ == "__main__":
    main()
