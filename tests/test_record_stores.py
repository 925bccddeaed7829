"""Where a multi-node job's rank-state records go (ftrun.rank.rankstate): the rank's own node's
record store and a copy at its buddy's, never node 0's job store; and the coordinator's table of
where each node's record store listens (ftrun.coordinator.membership). Without processes."""

from __future__ import annotations

import pytest
import torch.distributed as dist
from coordinator_fixtures import close_coordinators  # noqa: F401  (closes the coordinators a test made)

from ftrun.common import contract
from ftrun.rank.rankstate import RankStateStore, buddy_node, record_stores


class Refusing:
    """A store whose host is gone: every call raises, as a torch client does."""

    def set(self, key: str, value: bytes) -> None:
        raise RuntimeError("Connection reset by peer")

    def check(self, keys: list[str]) -> bool:
        raise RuntimeError("Connection reset by peer")

    def get(self, key: str) -> bytes:
        raise RuntimeError("Connection reset by peer")


def _env(node: int, nnodes: int, own: str | None = "10.0.0.1:4001") -> dict[str, str]:
    env = {"GROUP_RANK": str(node), "GROUP_WORLD_SIZE": str(nnodes)}
    if own is not None:
        env[contract.RECORD_STORE] = own
    return env


class Stores:
    """Record stores by address, for ``record_stores``' ``connect``; an address in ``down`` refuses."""

    def __init__(self, down: tuple[str, ...] = ()) -> None:
        self.by_addr: dict[str, dist.HashStore] = {}
        self.down = set(down)
        self.asked: list[tuple[str, float]] = []

    def connect(self, addr: str, timeout_s: float) -> dist.HashStore:
        self.asked.append((addr, timeout_s))
        if addr in self.down:
            raise RuntimeError(f"connect to {addr} timed out")
        return self.by_addr.setdefault(addr, dist.HashStore())


def test_the_buddy_is_the_next_node_round_the_ring() -> None:
    assert [buddy_node(n, 4) for n in range(4)] == [1, 2, 3, 0]
    assert buddy_node(0, 1) is None


def test_a_single_node_job_writes_to_the_jobs_store() -> None:
    job, stores = dist.HashStore(), Stores()
    store, copies, ports = record_stores(job, 60.0, _env(0, 1, own=None), stores.connect)
    assert store is job and copies == [] and ports == [] and stores.asked == []


def test_records_go_to_the_own_node_and_a_copy_to_the_published_buddy_never_to_the_jobs_store() -> None:
    job, stores = dist.HashStore(), Stores()
    job.set(contract.record_store_key(3), "10.0.0.4:4004")
    store, copies, ports = record_stores(job, 60.0, _env(2, 4, own="10.0.0.3:4003"), stores.connect)
    assert store is stores.by_addr["10.0.0.3:4003"] and copies == [stores.by_addr["10.0.0.4:4004"]]
    assert ports == [4003, 4004]  # the process group's release leaves these connections alone
    records = RankStateStore(store, 0, 5, copies)
    records.put(7, {"data": {"position": 3}}, provisional=True)
    records.put_gradient_digest(8, "d8")
    for held in (store, copies[0]):
        assert RankStateStore(held, 0, 5).get(7).state == {"data": {"position": 3}}
        assert RankStateStore(held, 0, 5).get_gradient_digest(8) == "d8"
    assert not job.check([f"{records.prefix}/1"]) and job.num_keys() == 1  # the buddy's address alone


@pytest.mark.parametrize("why", ["lost", "own", "unreachable"])
def test_no_copy_while_the_buddy_is_lost_is_this_node_or_cannot_be_reached(why: str, capsys) -> None:
    job, stores = dist.HashStore(), Stores(down=("10.0.0.2:4002",) if why == "unreachable" else ())
    if why != "lost":
        job.set(contract.record_store_key(1), "10.0.0.1:4001" if why == "own" else "10.0.0.2:4002")
    store, copies, ports = record_stores(job, 60.0, _env(0, 2), stores.connect)
    assert store is stores.by_addr["10.0.0.1:4001"] and copies == [] and ports == [4001]
    if why == "unreachable":
        assert stores.asked[-1][1] <= 10.0, "a silent buddy must not hold the rank for the cluster timeout"
        assert "no copy there for now" in capsys.readouterr().err


def test_an_unreachable_own_store_sends_the_records_to_the_jobs_store(capsys) -> None:
    job, stores = dist.HashStore(), Stores(down=("10.0.0.1:4001",))
    store, copies, _ = record_stores(job, 60.0, _env(0, 2), stores.connect)
    assert store is job and copies == []
    assert "go to the job's store" in capsys.readouterr().err


def test_a_respawned_rank_reads_its_own_node_first_then_the_copy() -> None:
    """Its own node's store is written first, so it is never older than the copy; a replaced
    node's store is empty (the copy serves), and a store whose host is gone counts as empty when
    the copy holds the record."""
    own, copy = dist.HashStore(), dist.HashStore()
    writer = RankStateStore(own, 0, 1, [copy])
    writer.put(4, {"data": {"position": 4}})
    assert RankStateStore(own, 0, 1, [copy]).get(4).state == {"data": {"position": 4}}
    reader = RankStateStore(own, 0, 1, [copy])
    assert reader.get(4) is not None and reader.source is own
    # Its node was replaced: the new node's store is empty.
    reader = RankStateStore(dist.HashStore(), 0, 1, [copy])
    assert reader.get(4).state == {"data": {"position": 4}} and reader.source is copy
    assert RankStateStore(Refusing(), 0, 1, [copy]).get(4) is not None
    # The copy holds an older label in that slot: not taken for the wanted step.
    stale = dist.HashStore()
    RankStateStore(stale, 0, 1).put(2, {"data": {"position": 2}})
    assert RankStateStore(dist.HashStore(), 0, 1, [stale]).get(4) is None
    # Nowhere to read from at all: the reason is raised (the recovery says it).
    with pytest.raises(RuntimeError, match="reset"):
        RankStateStore(Refusing(), 0, 1, [dist.HashStore()]).get(4)


def test_a_copy_whose_host_is_gone_gets_no_more_writes_and_the_own_store_all(capsys) -> None:
    own = dist.HashStore()
    gone = Refusing()
    writer = RankStateStore(own, 0, 1, [gone])
    writer.put(4, {"data": {"position": 4}})
    writer.put(5, {"data": {"position": 5}})
    assert writer.stores == [own]
    assert capsys.readouterr().err.count("without one") == 1
    assert RankStateStore(own, 0, 1).get(5).state == {"data": {"position": 5}}


def test_the_coordinator_publishes_each_nodes_record_store_and_withdraws_a_lost_ones(tmp_path) -> None:
    from coordinator_fixtures import make

    from ftrun.common.protocol import Message, MsgType

    job, _, _ = make(tmp_path, 8, 2)
    store = dist.HashStore()
    job.members.main_store = store
    for node in (1, 2):
        job.members.on_hello(f"agent{node}".encode(), Message(MsgType.AGENT_HELLO, {
            "node": node, "pid": 100 + node, "host": f"h{node}", "record_store": f"10.0.0.{node}:40{node}"}), None, 0.0)
    assert store.get(contract.record_store_key(1)) == b"10.0.0.1:401"
    assert store.get(contract.record_store_key(2)) == b"10.0.0.2:402"
    job.members.lose(2, "its host died")
    assert not store.check([contract.record_store_key(2)]) and store.check([contract.record_store_key(1)])


def test_a_multi_node_launcher_binds_its_nodes_record_store_and_names_it_to_its_child() -> None:
    from types import SimpleNamespace

    from ftrun.node.launcher import record_store_socket

    env: dict[str, str] = {}
    assert record_store_socket(SimpleNamespace(nnodes=1, master_addr="127.0.0.1"), env) is None and env == {}
    for local_addr in (None, "127.0.0.1"):  # --local_addr, else the address towards node 0
        sock = record_store_socket(SimpleNamespace(nnodes=2, master_addr="127.0.0.1", local_addr=local_addr), env)
        try:
            host, port = sock.getsockname()[:2]
            assert env[contract.RECORD_STORE] == f"{host}:{port}" and host == "127.0.0.1" and port > 0
        finally:
            sock.close()
