"""The TCP connections of ftrun's own process group, so a blocked collective can be released
without touching anything else the process holds.

gloo offers no way to interrupt a collective blocked on a silent peer: ``ProcessGroupGloo.abort()``
returns at once and leaves the collective waiting (measured on torch 2.13: an all-reduce whose
peer stopped answering returned only when that peer exited, 8 s later, with abort called after
1.5 s). What does release it is shutting down the group's sockets: the blocked read fails within
milliseconds, the collective raises, and the step is recovered.

Which sockets are the group's is recorded when the group is built: gloo connects its full mesh
inside ``init_process_group`` (every pair once, one side accepting on a listener gloo opens, the
other connecting to a peer's listener), so the connections this process gained during that call,
less those to the store and the control channel, are the group's. A connection is identified by
its descriptor *and* both addresses, so a descriptor gloo closed and the user's code reused later
is never touched. A user's own connections (a metrics stream, a dataset over HTTP, a database)
survive every recovery (no side effects beyond ftrun's own groups).

Limits: a connection a user's thread opens during the few milliseconds of a group's build would be
counted as the group's; gloo's lazy connection mode (``TORCH_GLOO_LAZY_INIT=1``) connects after the
build, so only connections accepted on the group's own listeners are recognised then.
"""

from __future__ import annotations

import os
import socket
from typing import Iterable, NamedTuple

import psutil


class Conn(NamedTuple):
    """One TCP connection of this process: descriptor, local and remote ``(ip, port)``."""

    fd: int
    laddr: tuple[str, int]
    raddr: tuple[str, int]


def _tcp() -> tuple[set[Conn], set[int]]:
    """This process's established TCP connections and its listening ports."""
    established: set[Conn] = set()
    listening: set[int] = set()
    for c in psutil.Process().net_connections(kind="tcp"):
        if c.status == psutil.CONN_LISTEN and c.laddr:
            listening.add(c.laddr.port)
        elif c.status == psutil.CONN_ESTABLISHED and c.raddr and c.fd >= 0:
            established.add(Conn(c.fd, (c.laddr.ip, c.laddr.port), (c.raddr.ip, c.raddr.port)))
    return established, listening


class GroupConnections:
    """Records the connections a process group opens while it is built, and shuts them down.

    Usage: :meth:`begin` just before ``init_process_group``, :meth:`end` just after it, :meth:`cut`
    to release a collective blocked on them (any thread), :meth:`forget` once the group is gone.
    ``keep_ports``: remote ports never recorded (the store's, the control channel's).
    """

    def __init__(self, keep_ports: Iterable[int] = ()) -> None:
        self.keep_ports = {int(p) for p in keep_ports if p}
        self._before: tuple[set[Conn], set[int]] | None = None
        self._conns: frozenset[Conn] = frozenset()
        self._listen_ports: frozenset[int] = frozenset()

    def begin(self) -> None:
        """Snapshot this process's connections before the group is built."""
        self._before = _tcp()

    def end(self, extend: bool = False) -> None:
        """Record the connections and listeners that appeared since :meth:`begin` as the group's
        (``extend``: in addition to those recorded already, e.g. a DeviceMesh's groups built on the
        group after it stood)."""
        if self._before is None:
            raise RuntimeError("GroupConnections.end() without begin()")
        old_conns, old_listen = self._before
        self._before = None
        conns, listening = _tcp()
        new_conns = frozenset(c for c in conns - old_conns if not self._kept(c))
        new_listen = frozenset(listening - old_listen)
        self._conns = self._conns | new_conns if extend else new_conns
        self._listen_ports = self._listen_ports | new_listen if extend else new_listen

    def _kept(self, c: Conn) -> bool:
        return c.raddr[1] in self.keep_ports or c.laddr[1] in self.keep_ports

    @property
    def recorded(self) -> frozenset[Conn]:
        """The connections recorded as the group's (empty when no group is recorded)."""
        return self._conns

    def forget(self) -> None:
        """The group is gone: nothing is the group's any more."""
        self._conns = frozenset()
        self._listen_ports = frozenset()

    def cut(self) -> int:
        """``shutdown(SHUT_RDWR)`` each of the group's connections still open (the descriptors stay
        owned by the backend, which closes them when it lets go). Returns how many were shut down.

        A connection counts as the group's if it was recorded by :meth:`end` with the same
        descriptor and addresses, or if it was accepted later on one of the group's listeners.
        """
        conns, listen_ports = self._conns, self._listen_ports  # one consistent view (any thread)
        if not conns and not listen_ports:
            return 0
        current, _ = _tcp()
        done = 0
        for c in current:
            if c in conns or (c.laddr[1] in listen_ports and not self._kept(c)):
                done += _shutdown(c)
        return done


def _shutdown(c: Conn) -> int:
    """Shut down the socket behind ``c.fd`` through a duplicate descriptor, if it still connects
    ``c``'s addresses (the descriptor may have been closed and reused since it was listed).
    Returns 1 if done, else 0."""
    try:
        dup = os.dup(c.fd)
    except OSError:  # closed since it was listed
        return 0
    try:
        sock = socket.socket(fileno=dup)
    except OSError:  # the number was reused by something that is not a socket
        os.close(dup)
        return 0
    try:
        if tuple(sock.getpeername()[:2]) != c.raddr or tuple(sock.getsockname()[:2]) != c.laddr:
            return 0
        sock.shutdown(socket.SHUT_RDWR)
        return 1
    except OSError:
        return 0
    finally:
        sock.close()
