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


def torch_store(sock: Any) -> Any:
    """torch's own TCPStore server (C++, libuv) on ``sock``: where a host's ranks, and the
    generations whose rank 0 is on this host, meet. Across hosts thousands of ranks may meet on
    one: a Python server's interpreter lock made the control plane's rendezvous of 16,384 ranks
    twice as slow (``bench control-plane``), so the host agents import torch for it."""
    from torch.distributed import TCPStore

    addr, port = sock.getsockname()[:2]
    return TCPStore(addr, port, is_master=True, wait_for_workers=False,
                    master_listen_fd=sock.detach())
