"""Every socket a job listens on is bound to loopback: on one host, nothing of it is reachable from
another machine.

torch's ``TCPStore`` binds every interface whatever host it is given, so the store's socket is
bound here and handed over (``master_listen_fd``). The collective libraries pick an interface of
their own (gloo: the address the host name resolves to): the ranks' environment pins them to
loopback unless the user chose an interface.
"""

from __future__ import annotations

import socket
import threading
from typing import Any

HOST = "127.0.0.1"
# gloo's and NCCL's listeners (NCCL's bootstrap; its data moves over NVLink/PCIe on one host)
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def listen(backlog: int = 1024) -> socket.socket:
    """A listening TCP socket on loopback, on a port from the OS."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((HOST, 0))
        sock.listen(backlog)
    except OSError:
        sock.close()
        raise
    return sock


def preimport() -> threading.Thread:
    """Import torch.distributed (for ``master_store``) in a thread of its own, now: while the
    zygote imports it too and the caller waits for that, not after."""
    def run() -> None:
        try:
            import torch.distributed  # noqa: F401
        except Exception:  # noqa: BLE001 - said again, with its cause, where the store is made
            pass

    t = threading.Thread(target=run, name="nonstop-import-torch", daemon=True)
    t.start()
    return t


def master_store(sock: socket.socket | None = None, **kwargs: Any) -> Any:
    """A ``TCPStore`` server listening on loopback only (on ``sock`` when given: the store takes
    it over and closes it)."""
    from torch.distributed import TCPStore

    sock = sock if sock is not None else listen()
    port = sock.getsockname()[1]
    kwargs.setdefault("wait_for_workers", False)
    return TCPStore(HOST, port, is_master=True, master_listen_fd=sock.detach(), **kwargs)


def interface() -> str | None:
    """The loopback interface's name, if this system has the usual one."""
    try:
        names = {name for _, name in socket.if_nameindex()}
    except OSError:
        return None
    return "lo" if "lo" in names else None


def pin(env: dict[str, str]) -> dict[str, str]:
    """Pin the collective libraries' listeners in a rank's environment to loopback, unless the
    user set them."""
    lo = interface()
    if lo is not None:
        for var in IFNAME_VARS:
            env.setdefault(var, lo)
    return env
