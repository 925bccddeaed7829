"""ftrun.rank.conns: a release shuts down the process group's connections and nothing else."""

from __future__ import annotations

import socket

import pytest

from ftrun.rank.conns import GroupConnections


def _pair(listener: socket.socket) -> tuple[socket.socket, socket.socket]:
    client = socket.create_connection(listener.getsockname()[:2], timeout=5)
    server, _ = listener.accept()
    server.settimeout(5)
    return client, server


def _works(a: socket.socket, b: socket.socket) -> bool:
    try:
        a.sendall(b"ping")
        return b.recv(4) == b"ping"
    except OSError:
        return False


@pytest.fixture
def listeners():
    made = []

    def make() -> socket.socket:
        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        s.listen(8)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def test_cut_shuts_down_the_groups_connections_and_leaves_the_users(listeners) -> None:
    user_listener = listeners()
    user = _pair(user_listener)  # the script's own connection, open before the group is built
    store_listener = listeners()
    conns = GroupConnections(keep_ports={store_listener.getsockname()[1]})
    conns.begin()
    group_listener = listeners()  # gloo's listener: accepts one peer, connects to another
    accepted = _pair(group_listener)
    peer_listener = listeners()
    outgoing = _pair(peer_listener)
    store = _pair(store_listener)  # a store reconnect during the build is never the group's
    conns.end()
    mine = {c.fd for c in conns.recorded}
    assert accepted[0].fileno() in mine and accepted[1].fileno() in mine and outgoing[0].fileno() in mine
    assert user[0].fileno() not in mine and user[1].fileno() not in mine and store[0].fileno() not in mine
    late = _pair(group_listener)  # accepted on the group's listener after the build (lazy gloo)
    later_user = _pair(user_listener)

    assert conns.cut() >= 4
    assert accepted[1].recv(4) == b"" and outgoing[0].recv(4) == b"" and late[1].recv(4) == b""
    assert _works(*user) and _works(user[1], user[0]) and _works(*later_user) and _works(*store)
    for s in (*user, *accepted, *outgoing, *store, *late, *later_user):
        s.close()


def test_a_reused_descriptor_is_not_cut_and_forget_ends_the_group(listeners) -> None:
    conns = GroupConnections()
    conns.begin()
    group = _pair(listeners())
    conns.end()
    fds = {s.fileno() for s in group}
    for s in group:
        s.close()
    # The user's code opens connections that may reuse the group's descriptor numbers.
    user_listener = listeners()
    reused = [_pair(user_listener) for _ in range(2)]
    assert fds & {s.fileno() for pair in reused for s in pair}, "no descriptor was reused"
    assert conns.cut() == 0
    assert all(_works(a, b) for a, b in reused)
    conns.forget()
    assert conns.recorded == frozenset() and conns.cut() == 0
    for pair in reused:
        for s in pair:
            s.close()


def test_end_without_begin_is_a_programming_error() -> None:
    with pytest.raises(RuntimeError, match="without begin"):
        GroupConnections().end()
