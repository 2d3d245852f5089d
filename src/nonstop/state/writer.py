"""Writes disk checkpoints for a node's keeper: a snapshot slot becomes one part of a DCP
checkpoint, in a process of its own, so neither the keeper nor the ranks ever wait on the disk.

It writes from a copy the keeper made for it (the slot itself is free for the next snapshot at
once), after checking it against its checksum: a corrupted snapshot is never written to disk.
"""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

from . import checkpoint, packing, shm, wire
from .keeper import die_with


def serve(sock: socket.socket) -> None:
    while True:
        msg, fds = wire.recv(sock)
        if msg is None:
            return
        job, info = msg["job"], shm.SlotInfo(**msg["info"])
        try:
            slot = shm.Slot(fds[0])  # the keeper's private copy of the snapshot: ours to read
            for fd in fds:
                os.close(fd)
            if not slot.verify(info):
                raise ValueError(f"the snapshot of step {info.step} in {job['holder']} fails its "
                                 "checksum: not written")
            meta, data = slot.read(info)
            sd, _ = packing.unpack_with_info(meta, data)
            part_info = {"step": info.step, "rank": job["rank"], "world": job.get("world"),
                         "sharded": job.get("sharded"), "source": job["holder"],
                         "node": job.get("node"), "reason": job.get("reason", "periodic"),
                         "gen": info.gen}
            tmp = checkpoint.temp_dir(Path(job["root"]), info.step)
            part = checkpoint.write_part(sd, tmp, job["rank"], part_info)
            del sd, meta, data, slot
            wire.send(sock, {"op": "done", "part": part})
        except Exception as exc:  # noqa: BLE001 - report it; the keeper and the controller decide
            wire.send(sock, {"op": "failed", "error": f"{type(exc).__name__}: {exc}"[:2000]})


def main() -> None:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with(parent)
    serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main()
