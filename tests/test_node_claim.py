"""The automatic node index (``--node_rank`` given nowhere): node 0 is the launcher that can host
the store; the others take 1, 2, ... from the store's counter, and a later launcher claims the
index of a lost node from ``ftrun/vacant``. Real torch TCPStores on 127.0.0.1, no ranks."""

from __future__ import annotations

import socket
import threading
import time
from datetime import timedelta

import pytest

from ftrun.config import ConfigError, JobSpec
from ftrun.node.launcher import can_host_store, claim_node_rank, host_store

TCPStore = pytest.importorskip("torch.distributed").TCPStore

FAST = {"poll_interval": 0.02}


def spec_for(nnodes: int = 3, port: int = 29500, cluster_time_out: float = 5.0) -> JobSpec:
    return JobSpec(script="train.py", worker_num=2 * nnodes, local_worker_num=2, master_addr="127.0.0.1",
                   master_port=port, cluster_time_out=cluster_time_out, node_rank_auto=True)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    yield store
    del store


def client(master) -> TCPStore:
    return TCPStore("127.0.0.1", master.port, is_master=False, timeout=timedelta(seconds=10))


def wait_for(predicate, timeout: float = 5.0) -> None:
    end = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < end, "timed out"
        time.sleep(0.02)


def test_sequential_claims_then_nothing_free(master):
    spec = spec_for(nnodes=3, cluster_time_out=0.3)
    assert [claim_node_rank(spec, client(master), **FAST) for _ in range(2)] == [1, 2]
    start = time.monotonic()
    with pytest.raises(ConfigError) as info:
        claim_node_rank(spec, client(master), **FAST)  # all 3 nodes taken, none lost
    assert time.monotonic() - start >= 0.3
    text = str(info.value)
    assert "no node index is free" in text and "--cluster_time_out 0.3 s" in text and "\n" not in text


def test_a_later_launcher_becomes_a_standby_unless_a_node_is_vacant(master):
    spec = spec_for(nnodes=3, cluster_time_out=60.0)
    assert [claim_node_rank(spec, client(master), standby_node=True, **FAST) for _ in range(2)] == [1, 2]
    assert claim_node_rank(spec, client(master), standby_node=True, **FAST) == -1  # at once, not after 60 s
    master.set("ftrun/vacant", "1")
    assert claim_node_rank(spec, client(master), standby_node=True, **FAST) == 1


def test_replacement_claims_the_vacant_index(master):
    spec = spec_for(nnodes=3)
    for _ in range(2):
        claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "2")  # the coordinator lost node 2 and awaits a replacement
    assert claim_node_rank(spec, client(master), **FAST) == 2
    assert master.get("ftrun/claim/2/0") != b""


def test_replacement_waits_for_a_vacancy(master):
    spec = spec_for(nnodes=2)
    claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "")
    got: list[int] = []
    thread = threading.Thread(target=lambda: got.append(claim_node_rank(spec, client(master), **FAST)))
    thread.start()
    time.sleep(0.3)
    assert not got  # nothing vacant yet: it polls
    master.set("ftrun/vacant", "1")
    thread.join(5)
    assert got == [1]


def test_a_second_loss_of_the_same_node_is_claimed_again(master):
    spec = spec_for(nnodes=2)
    claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "1")
    assert claim_node_rank(spec, client(master), claimant="first", **FAST) == 1
    # While its agent has not joined, the claim is held: nobody else gets node 1.
    with pytest.raises(ConfigError):
        claim_node_rank(spec_for(nnodes=2, cluster_time_out=0.3), client(master), claimant="x", **FAST)
    master.set("ftrun/vacant", "")  # the replacement joined: the claim's epoch moves on
    wait_for(lambda: master.add("ftrun/claim_epoch/1", 0) == 1)
    master.set("ftrun/vacant", "1")  # node 1 lost again
    assert claim_node_rank(spec, client(master), claimant="second", **FAST) == 1
    assert (master.get("ftrun/claim/1/0"), master.get("ftrun/claim/1/1")) == (b"first", b"second")


def test_a_node_joined_after_its_claims_beats_stopped_still_moves_the_epoch(master):
    # CI29: under load, the replacement "joined" more than --cluster_time_out after its claim. The
    # claim's thread had stopped beating and returned without moving the epoch, so a second loss
    # of the node would have waited for the stale claim's take-over. Time is injected here.
    now = [0.0]
    spec = spec_for(nnodes=2, cluster_time_out=5.0)
    claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "1")
    assert claim_node_rank(spec, client(master), claimant="first", clock=lambda: now[0], **FAST) == 1
    wait_for(lambda: master.add("ftrun/claim/1/0/beats", 0) > 0)
    now[0] = 6.0  # past --cluster_time_out, not joined: the beats stop
    time.sleep(0.2)
    beats = master.add("ftrun/claim/1/0/beats", 0)
    time.sleep(0.2)
    assert master.add("ftrun/claim/1/0/beats", 0) == beats
    master.set("ftrun/vacant", "")  # joined late, still by this claim's launcher or one that took it over
    wait_for(lambda: master.add("ftrun/claim_epoch/1", 0) == 1)
    master.set("ftrun/vacant", "1")
    assert claim_node_rank(spec, client(master), claimant="second", **FAST) == 1
    assert master.get("ftrun/claim/1/1") == b"second"


@pytest.mark.parametrize("vacant, expected", [("1", [1]), ("1,2", [1, 2])])
def test_racing_claimants_never_share_an_index(master, vacant, expected):
    spec = spec_for(nnodes=3, cluster_time_out=0.5)
    for _ in range(2):
        claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", vacant)
    stores = [client(master) for _ in range(4)]
    barrier = threading.Barrier(len(stores))
    got: list[int] = []
    refused: list[str] = []

    def claim(store, name):
        barrier.wait()
        try:
            got.append(claim_node_rank(spec, store, claimant=name, stale_after=60, **FAST))
        except ConfigError as err:
            refused.append(str(err))

    threads = [threading.Thread(target=claim, args=(s, f"c{i}")) for i, s in enumerate(stores)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(10)
    assert sorted(got) == expected  # every vacancy taken once
    assert len(refused) == len(stores) - len(expected)


def test_a_dead_claimants_claim_is_taken_over(master):
    spec = spec_for(nnodes=2)
    claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "1")
    master.set("ftrun/claim/1/0", "dead-launcher")  # claimed, then its launcher died before joining
    start = time.monotonic()
    assert claim_node_rank(spec, client(master), claimant="next", stale_after=0.3, **FAST) == 1
    assert time.monotonic() - start >= 0.3
    assert master.get("ftrun/claim/1/0") == b"next"


def test_a_live_claim_is_not_taken_over(master):
    # The live claim's thread beats every 20 ms for its own --cluster_time_out (60 s here); the
    # other launcher would take it over after 1.5 s without beats, and looks for 2 s. (With one
    # time-out for both, the live claim's beats ended before the other launcher's look did, when
    # the other's store client took seconds to connect: CI failed so, twice.)
    claim_node_rank(spec_for(nnodes=2), client(master), **FAST)
    master.set("ftrun/vacant", "1")
    assert claim_node_rank(spec_for(nnodes=2, cluster_time_out=60.0), client(master), claimant="alive", **FAST) == 1
    with pytest.raises(ConfigError):
        claim_node_rank(spec_for(nnodes=2, cluster_time_out=2.0), client(master), claimant="other", stale_after=1.5,
                        **FAST)
    assert master.get("ftrun/claim/1/0") == b"alive"


def test_vacant_lists_only_this_jobs_nodes(master):
    spec = spec_for(nnodes=2, cluster_time_out=0.3)
    claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "5,x,")  # 5 is not a node of this job
    with pytest.raises(ConfigError):
        claim_node_rank(spec, client(master), **FAST)
    master.set("ftrun/vacant", "0")  # node 0, after a standby coordinator took the job over from it
    assert claim_node_rank(spec, client(master), **FAST) == 0


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_can_host_store():
    port = _free_port()
    assert can_host_store(spec_for(port=port))
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", port))
        sock.listen(1)
        assert not can_host_store(spec_for(port=port))  # the port is taken: node 0 runs here already
    other = JobSpec(script="t.py", worker_num=4, local_worker_num=2, master_addr="192.0.2.1", master_port=port,
                    node_rank_auto=True)
    assert not can_host_store(other)  # not an address of this host (TEST-NET-1)


def test_host_store_decides_the_index():
    spec = spec_for(nnodes=2, port=_free_port())
    store0, port0, spec0, hosting0 = host_store(spec)
    assert (spec0.node_rank, spec0.node_rank_auto, port0) == (0, False, spec.master_port)
    store1, port1, spec1, hosting1 = host_store(spec)  # the port is taken now: a client, which takes index 1
    assert (spec1.node_rank, spec1.node_rank_auto, port1, hosting0, hosting1) == (1, False, spec.master_port, True, False)
    explicit = JobSpec(script="t.py", worker_num=4, local_worker_num=2, master_addr="127.0.0.1",
                       master_port=spec.master_port, node_rank=1)
    assert host_store(explicit)[2] == explicit  # a given index is kept, and takes no number
    assert store0.add("ftrun/next_node", 0) == 1
    del store1, store0


def test_a_store_that_goes_away_is_one_line():
    master = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, timeout=timedelta(seconds=10))
    spec = spec_for(nnodes=2)
    store = client(master)
    claim_node_rank(spec, store, **FAST)
    store = client(master)
    del master  # node 0's launcher ended with its job
    with pytest.raises(ConfigError) as info:
        claim_node_rank(spec, store, **FAST)
    assert str(info.value).startswith("lost node 0's store at 127.0.0.1:29500") and "\n" not in str(info.value)


def test_indices_given_to_other_launchers_are_skipped(master):
    # A Slurm job: nodes 0 and 1 have their index from SLURM_NODEID; a spare started without one
    # must not take 1 from the counter: it waits for a vacancy.
    spec = spec_for(nnodes=3, port=master.port, cluster_time_out=0.3)
    given = JobSpec(script="t.py", worker_num=6, local_worker_num=2, master_addr="127.0.0.1", master_port=master.port,
                    node_rank=1, cluster_time_out=5)
    assert host_store(given)[2] == given  # marks ftrun/node/1
    assert claim_node_rank(spec, client(master), **FAST) == 2
    with pytest.raises(ConfigError, match="no node index is free"):
        claim_node_rank(spec, client(master), **FAST)
