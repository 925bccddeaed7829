"""Tests of the multi-node test hosts (``tests/nethosts.py``): namespaces on a bridge.

The integration tests need root and ``ip netns``; they skip with the reason where that is missing.
They synchronise on process exits and connection attempts, each bounded by a generous deadline.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from typing import Callable

import psutil
import pytest

import nethosts
from nethosts import HostNetwork, NetHost, net_hosts  # noqa: F401 - net_hosts is a fixture

NetHostsFactory = Callable[..., list[NetHost]]

ECHO_SERVER = """
import socket, sys
addr, port = sys.argv[1], int(sys.argv[2])
with socket.create_server((addr, port)) as srv:
    srv.settimeout(30)
    conn, peer = srv.accept()
    with conn:
        data = conn.recv(1024)
        conn.sendall(b"echo:" + data)
print(peer[0])
"""

ECHO_CLIENT = """
import socket, sys, time
addr, port = sys.argv[1], int(sys.argv[2])
deadline = time.monotonic() + 30
while True:  # the server may not listen yet
    try:
        conn = socket.create_connection((addr, port), timeout=5)
        break
    except ConnectionRefusedError:
        if time.monotonic() > deadline:
            raise
        time.sleep(0.02)
with conn:
    conn.sendall(b"hello")
    print(conn.recv(1024).decode())
"""

GLOO_RANK = """
import datetime, json, sys
import torch
import torch.distributed as dist
master, rank = sys.argv[1], int(sys.argv[2])
dist.init_process_group("gloo", init_method=f"tcp://{master}:29500", rank=rank, world_size=2,
                        timeout=datetime.timedelta(seconds=30))
tensor = torch.tensor([rank + 1.0, 10.0 * (rank + 1)])
dist.all_reduce(tensor)
dist.destroy_process_group()
print(json.dumps(tensor.tolist()))
"""


@pytest.fixture
def netns_ok() -> None:
    """Skip unless network namespaces can be made here."""
    reason = nethosts.unavailable_reason()
    if reason is not None:
        pytest.skip(reason)


def wait_for(predicate: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            pytest.fail(f"{what} not within {timeout} s")
        time.sleep(0.02)


def gone(pid: int) -> bool:
    """True if ``pid`` no longer runs (a zombie awaiting its reaper counts as gone)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def communicate(proc: subprocess.Popen[str], timeout: float = 60.0) -> tuple[str, str]:
    try:
        return proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        pytest.fail(f"{proc.args} did not exit within {timeout} s")


# --------------------------------------------------------------------------- no root needed


def test_names_fit_interface_limit() -> None:
    pid_max = 4194304  # the largest kernel.pid_max
    bridge, namespaces, veths = nethosts.resource_names(pid_max, 36**3 - 1, 100)
    assert max(len(name) for name in [bridge, *veths]) <= nethosts.IFNAME_MAX
    assert len(set([bridge, *namespaces, *veths])) == 1 + 2 * 100
    assert {nethosts.creator_pid(name) for name in [bridge, *namespaces, *veths]} == {pid_max}
    assert nethosts.creator_pid("eth0") is None
    assert nethosts.creator_pid("ftnfoo") is None
    with pytest.raises(ValueError):
        nethosts.resource_names(pid_max, 36**4, 1)


def test_unavailable_reason_is_one_line() -> None:
    reason = nethosts.unavailable_reason()
    assert reason is None or (reason and "\n" not in reason)
    assert nethosts.unavailable_reason() is reason  # computed once


# --------------------------------------------------------------------------- real namespaces


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_two_hosts_talk_over_tcp(net_hosts: NetHostsFactory) -> None:
    host0, host1 = net_hosts(2)
    assert (host0.index, host1.index) == (0, 1)
    assert host0.addr != host1.addr and host0.ifname == host1.ifname == "eth0"
    assert host0.network is host1.network and host0.network.bridge in nethosts.list_links()

    base = {"PATH": os.environ.get("PATH", ""), "KEEP": "1"}
    env = host1.env(base)
    assert env["GLOO_SOCKET_IFNAME"] == env["TP_SOCKET_IFNAME"] == host1.ifname and env["KEEP"] == "1"
    assert "GLOO_SOCKET_IFNAME" not in base

    server = host0.popen([sys.executable, "-c", ECHO_SERVER, host0.addr, "5000"],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    client = host1.run([sys.executable, "-c", ECHO_CLIENT, host0.addr, "5000"], timeout=60)
    assert client.returncode == 0, client.stderr
    assert client.stdout.strip() == "echo:hello"
    out, err = communicate(server)
    assert server.returncode == 0, err
    assert out.strip() == host1.addr  # the peer address the server saw


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_hosts_have_no_way_out(net_hosts: NetHostsFactory) -> None:
    (host,) = net_hosts(1)
    routes = host.run(["ip", "-4", "route", "show", "table", "main"], timeout=10, check=True).stdout
    assert routes.split() and not [line for line in routes.splitlines() if line.startswith("default")]
    assert all(line.startswith(str(host.network.subnet)) for line in routes.splitlines() if line.strip())
    # IPv4 only: no IPv6 link-local address on the host's interface nor on the bridge side
    assert host.run(["ip", "-6", "addr", "show", "dev", host.ifname], timeout=10, check=True).stdout == ""
    assert nethosts._ip("-6", "addr", "show", "dev", host.network.bridge).stdout == ""
    assert nethosts._ip("-6", "addr", "show", "dev", host.veth).stdout == ""


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_close_kills_everything_and_removes_everything(netns_ok: None) -> None:
    network = HostNetwork(2)
    names = [host.name for host in network.hosts]
    links = [network.bridge, *(host.veth for host in network.hosts)]
    started: dict[str, int] = {}
    sleeper: subprocess.Popen[bytes] | None = None
    with pytest.raises(RuntimeError, match="the test body failed"):
        try:
            sleeper = network.hosts[0].popen(["sleep", "600"])
            started["sleeper"] = sleeper.pid
            # a daemon in a session of its own, not a child of anything popen started
            spawn = network.hosts[1].run(
                ["sh", "-c", "setsid sleep 600 </dev/null >/dev/null 2>&1 & echo $!"], timeout=10, check=True)
            started["daemon"] = int(spawn.stdout)
            wait_for(lambda: started["sleeper"] in network.hosts[0].pids(), 10, "sleep in host 0")
            wait_for(lambda: started["daemon"] in network.hosts[1].pids(), 10, "daemon in host 1")
            raise RuntimeError("the test body failed")
        finally:
            network.close()
    assert network.closed
    assert sleeper is not None and sleeper.returncode == -9
    assert [name for name, pid in started.items() if not gone(pid)] == []
    assert set(names).isdisjoint(nethosts.list_namespaces())
    assert set(links).isdisjoint(nethosts.list_links())
    network.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        network.hosts[0].popen(["true"])


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_context_manager_and_run_timeout(netns_ok: None) -> None:
    with HostNetwork(1) as network:
        with pytest.raises(subprocess.TimeoutExpired):
            network.hosts[0].run(["sleep", "600"], timeout=0.5)
        assert network.hosts[0].run(["cat"], timeout=10, input="in").stdout == "in"
    assert network.closed and network.hosts[0].name not in nethosts.list_namespaces()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_stale_leftovers_of_dead_processes_are_removed(netns_ok: None) -> None:
    dead_pid = 36**5 - 1  # above any kernel's pid_max (at most 2**22): never alive
    bridge, (namespace,), (veth,) = nethosts.resource_names(dead_pid, 0, 1)
    live_bridge, _, _ = nethosts.resource_names(os.getpid(), 36**3 - 1, 1)  # alive: must stay
    sleeper: subprocess.Popen[bytes] | None = None
    try:
        nethosts._ip("netns", "add", namespace)
        nethosts._ip("link", "add", bridge, "type", "bridge")
        nethosts._ip("link", "add", veth, "type", "veth", "peer", "name", "eth0", "netns", namespace)
        nethosts._ip("link", "set", veth, "master", bridge)
        nethosts._ip("link", "add", live_bridge, "type", "bridge")
        sleeper = subprocess.Popen(["ip", "netns", "exec", namespace, "sleep", "600"], start_new_session=True)
        wait_for(lambda: sleeper.pid in nethosts.namespace_pids(namespace), 10, "sleep in the stale namespace")

        removed = nethosts.cleanup_stale()
        assert namespace in removed
        assert sleeper.wait(timeout=10) == -9
        assert namespace not in nethosts.list_namespaces()
        assert {bridge, veth}.isdisjoint(nethosts.list_links())
        assert live_bridge in nethosts.list_links()
    finally:
        if sleeper is not None and sleeper.poll() is None:
            sleeper.kill()
            sleeper.wait()
        nethosts._ip("netns", "del", namespace, check=False)
        for link in (veth, bridge, live_bridge):
            nethosts._ip("link", "del", link, check=False)


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_gloo_all_reduce_across_two_hosts(net_hosts: NetHostsFactory) -> None:
    hosts = net_hosts(2)
    master = hosts[0].addr
    ranks = [
        host.popen([sys.executable, "-c", GLOO_RANK, master, str(host.index)], env=host.env(),
                   stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for host in hosts
    ]
    results = [communicate(proc, timeout=90) for proc in ranks]
    for proc, (out, err) in zip(ranks, results):
        assert proc.returncode == 0, err
        assert json.loads(out.strip().splitlines()[-1]) == [3.0, 30.0]
