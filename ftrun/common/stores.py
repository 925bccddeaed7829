"""The c10d ``TCPStore`` that a job's process groups rendezvous on, bound where it must be.

torch's ``TCPStore(is_master=True)`` listens on every interface, unauthenticated. ftrun binds the
listening socket itself and hands it to the store (``master_listen_fd``): on loopback for a
single-node job whose master address is a loopback one (nothing off this machine can reach it), on
the master address otherwise. torch is imported only when a store is made.
"""

from __future__ import annotations

import errno
import ipaddress
import socket
from datetime import timedelta
from typing import Any


class StoreBindError(OSError):
    """The store's address and port cannot be bound here."""


def bind_host(master_addr: str, nnodes: int) -> str:
    """The address the store listens on: ``127.0.0.1`` for one node with a loopback master
    address, the master address's own (resolved) address when it is one of this host's, else every
    interface (``0.0.0.0``: a host name that resolves to another address, as behind NAT)."""
    try:
        infos = socket.getaddrinfo(master_addr, None, socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return "0.0.0.0"
    addrs = [info[4][0] for info in infos]
    if nnodes == 1 and all(ipaddress.ip_address(a).is_loopback for a in addrs):
        return "127.0.0.1"
    if nnodes == 1:
        return addrs[0] if _is_local(addrs[0]) else "0.0.0.0"
    for addr in addrs:
        if not ipaddress.ip_address(addr).is_loopback and _is_local(addr):
            return addr
    return "0.0.0.0"


def _is_local(addr: str) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind((addr, 0))
        except OSError:
            return False
    return True


def serve_store(host: str, port: int, timeout_s: float) -> tuple[Any, int]:
    """Host a ``TCPStore`` listening only on ``host:port`` (port 0: a free one).

    Args:
        host: the address to listen on (from :func:`bind_host`).
        port: the port, 0 for any free one.
        timeout_s: the store's operation timeout, seconds.

    Returns:
        (the store, its port).

    Raises:
        StoreBindError: the address or port cannot be bound (``errno`` tells which).
    """
    sock = listen_socket(host, port)
    return store_on_socket(sock, timeout_s), sock.getsockname()[1]


def listen_socket(host: str, port: int) -> socket.socket:
    """A TCP socket bound to ``host:port`` (port 0: a free one) and listening: the store's, before
    the store exists. Clients that connect meanwhile wait in its backlog. torch is not imported.

    Raises:
        StoreBindError: the address or port cannot be bound (``errno`` tells which).
    """
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((host, port))
        sock.listen(1024)
    except OSError as err:
        sock.close()
        raise StoreBindError(err.errno or errno.EINVAL, err.strerror or str(err)) from None
    return sock


def store_on_socket(sock: socket.socket, timeout_s: float) -> Any:
    """The ``TCPStore`` server on ``sock``, a socket from :func:`listen_socket` (this process may
    have inherited it). ``sock`` is kept open as long as the store lives.

    Raises:
        StoreBindError: torch refused the socket.
    """
    from torch.distributed import TCPStore

    host, port = sock.getsockname()[:2]
    client_host = "127.0.0.1" if host == "0.0.0.0" else host
    try:
        store = TCPStore(client_host, port, is_master=True, wait_for_workers=False,
                         timeout=timedelta(seconds=timeout_s), master_listen_fd=sock.fileno())
    except (RuntimeError, OSError) as err:
        sock.close()
        raise StoreBindError(errno.EINVAL, str(err).splitlines()[0]) from None
    # The store owns a duplicate of the socket now (libuv takes the descriptor); keep ours open
    # for the store's lifetime by attaching it to the store object.
    try:
        store._ftrun_listen_socket = sock  # type: ignore[attr-defined]
    except AttributeError:
        _KEEP.append(sock)
    return store


_KEEP: list[socket.socket] = []
