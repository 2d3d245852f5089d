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
from ..pids import die_with
from ..protocol import keeper_messages as km
from ..state import checkpoint, disk_failure, packing, shm, wire

_TRACEBACK_CHARS = 16_000  # the keeper's messages must stay well under wire.MAX_MESSAGE


def serve(sock: socket.socket) -> None:
    while True:
        fds: list[int] = []
        try:
            raw, fds = wire.recv(sock)
            order = km.decode_writer(raw) if raw is not None else None
        except ValueError as exc:  # not JSON, or not an order (BadKeeperMessage)
            for fd in fds:
                os.close(fd)
            wire.send(sock, km.encode(_refused(f"a malformed order: {exc}")))
            continue
        match order:
            case None:
                return
            case km.Write(job=job, info=info):
                try:
                    wire.send(sock, km.encode(km.WriteDone(part=_write(job, info, fds))))
                except BaseException as exc:  # DCP's CheckpointException is one; report it, live on
                    if isinstance(exc, (KeyboardInterrupt, SystemExit)):
                        raise
                    wire.send(sock, km.encode(_failed(exc, job, info)))
            case _:
                for fd in fds:
                    os.close(fd)
                wire.send(sock, km.encode(_refused(f"{order.op!r} is no order for the writer")))


def _write(job: km.DiskPart, info: shm.SlotInfo, fds: list[int]) -> km.PartWritten:
    slot = shm.Slot(fds[0])  # the keeper's private copy of the snapshot: ours to read
    for fd in fds:
        os.close(fd)
    if not slot.verify(info):
        raise ValueError(f"the snapshot of step {info.step} in {job.holder} fails its "
                         "checksum: not written")
    root = Path(job.root)
    refused = disk_failure.space_error(root, info.data_len)  # the tensors alone need that much
    if refused is not None:
        raise refused
    meta, data = slot.read(info)
    sd, _ = packing.unpack_with_info(meta, data)
    part_info = {"step": info.step, "rank": job.rank, "world": job.world,
                 "sharded": job.sharded, "source": job.holder, "node": job.node,
                 "reason": job.reason, "gen": info.gen}
    tmp = checkpoint.temp_dir(root, info.step)
    return km.read(km.PartWritten, checkpoint.write_part(sd, tmp, job.rank, part_info))


def _failed(exc: BaseException, job: km.DiskPart, info: shm.SlotInfo) -> km.WriteFailed:
    cause = disk_failure.failure_cause(exc, Path(job.root), info.data_len)
    return km.WriteFailed(errno=cause["errno"], message=cause["message"], path=cause["path"],
                          need=info.data_len, error=f"{type(exc).__name__}: {exc}"[:2000],
                          traceback=traceback.format_exc()[-_TRACEBACK_CHARS:])


def _refused(why: str) -> km.WriteFailed:
    return km.WriteFailed(errno=None, message=why, path="", need=0, error=why, traceback="")


def main() -> None:
    fd, parent = int(sys.argv[1]), int(sys.argv[2])
    die_with(parent)
    # the writer starts with the job; torch and DCP load now, not when the first checkpoint is
    # due (on a busy machine that import alone took longer than a dozen training steps)
    checkpoint.warm()
    serve(socket.socket(fileno=fd))


if __name__ == "__main__":
    main()
