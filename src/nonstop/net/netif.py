"""The host's network interfaces: which one holds an address, and which address reaches etcd."""

from __future__ import annotations

from typing import Any

import fcntl
import socket
import struct

_SIOCGIFADDR = 0x8915


def interface_of(addr: str) -> str | None:
    """The name of the interface that holds ``addr`` (gloo and NCCL listen on an interface)."""
    try:
        names = [name for _, name in socket.if_nameindex()]
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for name in names:
            try:
                raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == addr:
                return name
    return None


def route_to(host: str, port: int) -> str:
    """This host's address on the route to ``host`` (no packet is sent): the address other hosts
    reach it at, unless the user names one."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((host, port))
        return s.getsockname()[0]


def bound_socket(addr: str) -> Any:
    """A listening socket on ``addr`` only, on a port from the OS."""
    import socket

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        sock.bind((addr, 0))
        sock.listen(1024)
    except OSError:
        sock.close()
        raise
    return sock


# torch's own (C++) TCPStore server from this many ranks in a job: below it nonstop's server of
# the same protocol (``store.tcpstore``), which spares a host agent torch's import (3.5 s of CPU
# on an idle core, more on a busy host, before the host can start). A Python server's
# interpreter lock doubled the rendezvous of 16,384 ranks in ``bench control-plane`` (0.68 s
# against 0.36 s); at a thousand ranks it costs milliseconds.
TORCH_STORE_RANKS = 1024


def job_store(sock: Any, ranks: int) -> Any:
    """A server of torch's TCPStore protocol on ``sock`` (which it takes over), for up to
    ``ranks`` ranks meeting on it: torch's own from ``TORCH_STORE_RANKS``, nonstop's below. Either
    is closed with ``close_store``."""
    if ranks >= TORCH_STORE_RANKS:
        return torch_store(sock)
    from ..store.tcpstore import StoreServer

    return StoreServer(sock)


def close_store(store: Any) -> None:
    """Stop a server of ``job_store`` (torch's stops when its object goes)."""
    from ..store.tcpstore import StoreServer

    if isinstance(store, StoreServer):
        store.close()


def torch_store(sock: Any) -> Any:
    """torch's own TCPStore server (C++, libuv) on ``sock``: where the generations whose rank 0 is
    on a host meet, in a job of thousands of ranks (``job_store``)."""
    from torch.distributed import TCPStore

    addr, port = sock.getsockname()[:2]
    return TCPStore(addr, port, is_master=True, wait_for_workers=False,
                    master_listen_fd=sock.detach())
