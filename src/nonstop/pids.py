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
