"""Writes disk checkpoints for a node's keeper: a snapshot slot becomes one part of a DCP
checkpoint, in a process of its own, so neither the keeper nor the ranks ever wait on the disk.

It writes from a copy the keeper made for it (the slot itself is free for the next snapshot at
once), after checking it against its checksum: a corrupted snapshot is never written to disk.

A write that fails (a full disk, a quota, a read-only or failing file system) leaves nothing
behind and is answered with its cause; this process lives on for the next one. It prints
nothing: whatever it has to say goes to the keeper, and from there to the launcher.
"""

from __future__ import annotations

import os
import socket
import sys
import traceback
from pathlib import Path
from typing import Any

from . import checkpoint, packing, shm, wire
from .keeper import die_with

_TRACEBACK_CHARS = 16_000  # the keeper's messages must stay well under wire.MAX_MESSAGE


def serve(sock: socket.socket) -> None:
    while True:
        msg, fds = wire.recv(sock)
        if msg is None:
            return
        job, info = msg["job"], shm.SlotInfo(**msg["info"])
        try:
            wire.send(sock, {"op": "done", "part": _write(job, info, fds)})
        except BaseException as exc:  # DCP's CheckpointException is one; report it, live on
            if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                raise
            wire.send(sock, _failed(exc, job, info))


def _write(job: dict[str, Any], info: shm.SlotInfo, fds: list[int]) -> dict[str, Any]:
    slot = shm.Slot(fds[0])  # the keeper's private copy of the snapshot: ours to read
    for fd in fds:
        os.close(fd)
    if not slot.verify(info):
        raise ValueError(f"the snapshot of step {info.step} in {job['holder']} fails its "
                         "checksum: not written")
    root = Path(job["root"])
    refused = checkpoint.space_error(root, info.data_len)  # the tensors alone need that much
    if refused is not None:
        raise refused
    meta, data = slot.read(info)
    sd, _ = packing.unpack_with_info(meta, data)
    part_info = {"step": info.step, "rank": job["rank"], "world": job.get("world"),
                 "sharded": job.get("sharded"), "source": job["holder"],
                 "node": job.get("node"), "reason": job.get("reason", "periodic"),
                 "gen": info.gen}
    tmp = checkpoint.temp_dir(root, info.step)
    return checkpoint.write_part(sd, tmp, job["rank"], part_info)


def _failed(exc: BaseException, job: dict[str, Any], info: shm.SlotInfo) -> dict[str, Any]:
    cause = checkpoint.failure_cause(exc, Path(job["root"]), info.data_len)
    return {"op": "failed", **cause, "need": info.data_len,
            "error": f"{type(exc).__name__}: {exc}"[:2000],
            "traceback": traceback.format_exc()[-_TRACEBACK_CHARS:]}


def main() -> None:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with(parent)
    serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main()
