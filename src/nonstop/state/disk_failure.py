"""Why a write to disk failed, or would: a read-only file system, a full disk or no inode left,
judged before writing (``space_error``), and after a failure the cause behind what the writer
raised (``failure_cause``) - torch's own writer reports a full disk with no errno. The checkpoint
writers (the keeper's, the controller's) say it in their events."""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
from pathlib import Path
from typing import Any

from ..errors import exception_line

def space_error(root: Path, need: int = 0) -> OSError | None:
    """Why ``need`` more bytes cannot go under ``root`` now, judged without writing anything: a
    read-only file system, or less free space (or no free inode) than that. None: no reason seen.
    A write that cannot succeed then fails at once, not after writing what fits."""
    where = Path(root)
    while not where.exists() and where != where.parent:  # root is created on the first write
        where = where.parent
    try:
        st = os.statvfs(where)
    except OSError as e:
        return e
    if st.f_flag & os.ST_RDONLY:
        return OSError(errno.EROFS, os.strerror(errno.EROFS), str(root))
    # Some file systems (FUSE, object stores) report no sizes at all: nothing to judge by then.
    if (st.f_blocks and st.f_bavail * st.f_frsize < need) or (st.f_files and not st.f_favail):
        return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(root))
    return None


def failure_cause(exc: BaseException, root: Path, need: int = 0) -> dict[str, Any]:
    """What stopped a write under ``root``, as ``{"errno", "message", "path"}``: the OSError behind
    ``exc`` if there is one, else what the file system says now (torch's own writer reports a
    full disk as ``unexpected pos``, with no errno). ``errno`` is a name (``"ENOSPC"``), or None
    when the cause is not the file system's."""
    err = _os_error(exc) or space_error(root, need) or _probe(Path(root))
    if err is not None and err.errno:
        return {"errno": errno.errorcode.get(err.errno, str(err.errno)),
                "message": err.strerror or os.strerror(err.errno),
                "path": str(err.filename or root)}
    return {"errno": None, "message": exception_line(exc), "path": str(root)}


def _os_error(exc: BaseException) -> OSError | None:
    # DCP keeps each rank's failure in `failures` as (exception, stack); Python chains the rest.
    seen: set[int] = set()
    todo: list[Any] = [exc]
    while todo:
        e = todo.pop()
        if isinstance(e, tuple) and e and isinstance(e[0], BaseException):
            e = e[0]
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno:
            return e
        failures = getattr(e, "failures", None)
        todo += [e.__cause__, e.__context__,
                 *(failures.values() if isinstance(failures, dict) else ())]
    return None


def _probe(root: Path) -> OSError | None:
    # A write of one byte, made durable, tells what the file system refuses now (a quota
    # exhausted, a permission, an I/O error).
    if not root.is_dir():
        return None
    path = root / f".probe-{secrets.token_hex(6)}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as e:
        return e
    try:
        os.write(fd, b"\0")
        os.fsync(fd)
    except OSError as e:
        return e
    finally:
        os.close(fd)
        with contextlib.suppress(OSError):
            os.unlink(path)
    return None
