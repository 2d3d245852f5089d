"""Whether a process is alive, by its pid (for a launcher, a drain, a zygote's children)."""

from __future__ import annotations

import os


def pid_alive(pid: int) -> bool:
    """Whether a process of that pid exists (a zombie too)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    except OverflowError:
        return False
    return True


PF_EXITING = 0x4  # the kernel's flag of a process inside its exit (include/linux/sched.h)


def dying(pid: int) -> bool:
    """Whether the process is gone or on its way out: a zombie, or killed and still releasing
    its memory (which can take a while on a loaded machine, its sockets open until then). Read
    from ``/proc/PID/stat``; False where that cannot be read for another reason."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            stat = fh.read()
    except (FileNotFoundError, ProcessLookupError):
        return True
    except OSError:
        return False
    fields = stat[stat.rfind(b")") + 2:].split()  # after the name, which may hold spaces
    try:
        return fields[0] in (b"Z", b"X", b"x") or bool(int(fields[6]) & PF_EXITING)
    except (IndexError, ValueError):
        return False


def die_with(parent: int) -> None:
    """Ask the kernel to end this process when its parent ``parent`` ends (a keeper with the
    node's agent, a checkpoint writer with its keeper); ended at once if that is gone already."""
    import ctypes
    import signal

    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        return
    if os.getppid() != parent:
        os._exit(1)
