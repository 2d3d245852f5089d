"""Every socket a job listens on is bound to loopback: on one host, nothing of it is reachable from
another machine.

The store the ranks meet on speaks torch's TCPStore protocol, served from Python
(``nonstop.store.tcpstore``: the launcher never imports torch) on a socket bound here. The
collective libraries pick an interface of their own (gloo: the address the host name resolves
to): the ranks' environment pins them to loopback unless the user chose an interface.
"""

from __future__ import annotations

import socket

from ..net.netif import bound_socket
from ..store.tcpstore import StoreServer

HOST = "127.0.0.1"
# gloo's and NCCL's listeners (NCCL's bootstrap; its data moves over NVLink/PCIe on one host)
IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def listen() -> socket.socket:
    """A listening TCP socket on loopback, on a port from the OS."""
    return bound_socket(HOST)


def master_store() -> StoreServer:
    """A store server of torch's TCPStore protocol listening on loopback only."""
    return StoreServer(listen())


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
