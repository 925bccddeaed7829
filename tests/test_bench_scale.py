"""scripts/bench_scale.py: its parts without processes (beat pacing, the split over processes, the
replica layout, the report), and one tiny run of the real coordinator checked for its fields."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_scale as bs  # noqa: E402

from ftrun.coordinator.agents import AgentHandle, Spawned  # noqa: E402
from ftrun.common.contract import STANDBY_NODE_INDEX  # noqa: E402
from ftrun.coordinator.policy import replica_groups_from_hello  # noqa: E402


def test_beats_are_spread_over_the_interval_and_a_late_sender_does_not_burst() -> None:
    beats = bs.Beats(interval=1.0, start=0.0)
    sent = [beats.due(100, t / 10) for t in range(1, 11)]
    assert sent == [10] * 10  # 100 senders, one beat each a second, a tenth of them every 0.1 s
    assert beats.due(100, 5.0) == 100  # four seconds late: each sender beats once, not four times
    assert beats.due(100, 5.05) == 5
    assert bs.Beats(1.0, 0.0).due(0, 3.0) == 0


def test_readiness_names_the_sockets_with_frames_waiting() -> None:
    """The simulation's epoll over each socket's ZMQ_FD: a frame waiting before the socket was
    watched, one arriving later, and none once read (within a deadline: frames cross a thread)."""
    import time

    import zmq

    ctx = zmq.Context()
    router, dealers = ctx.socket(zmq.ROUTER), [ctx.socket(zmq.DEALER) for _ in range(3)]
    try:
        port = router.bind_to_random_port("tcp://127.0.0.1")
        for i, d in enumerate(dealers):
            d.setsockopt(zmq.IDENTITY, b"d%d" % i)
            d.connect(f"tcp://127.0.0.1:{port}")
            d.send(b"hello")
        for _ in dealers:
            router.recv_multipart()
        router.send_multipart([b"d0", b"early"])
        time.sleep(0.05)
        ready = bs.Readiness(zmq)
        for d in dealers:
            ready.add(d)

        def read(deadline: float = 5.0) -> dict[bytes, list[bytes]]:
            got: dict[bytes, list[bytes]] = {}
            end = time.monotonic() + deadline
            while not got and time.monotonic() < end:
                for sock in ready.wait(50):
                    while True:
                        try:
                            frame = sock.recv(zmq.NOBLOCK)
                        except zmq.Again:
                            break
                        got.setdefault(sock.getsockopt(zmq.IDENTITY), []).append(frame)
            return got

        assert read() == {b"d0": [b"early"]}
        router.send_multipart([b"d2", b"later"])
        assert read() == {b"d2": [b"later"]}
        assert read(0.2) == {}
        ready.remove(dealers[2])
        router.send_multipart([b"d2", b"unwatched"])
        assert read(0.2) == {}
    finally:
        for d in dealers:
            d.close(0)
        router.close(0)
        ctx.term()


def test_nodes_are_split_over_processes_within_the_socket_limit() -> None:
    layout = bs.plan_processes(nodes=2048, per_node=8, limit=4000)
    flat = [n for part in layout for n in part]
    assert sorted(flat) == sorted([*range(2048), STANDBY_NODE_INDEX])  # every node once, and the standby
    assert all(len(part) * 9 <= 4000 for part in layout)
    assert len(layout) == 5 and max(map(len, layout)) - min(map(len, layout)) <= 1  # evenly
    assert bs.plan_processes(nodes=8, per_node=8) == [[*range(8), STANDBY_NODE_INDEX]]
    # the sockets a process may open, from the descriptors it may: two a socket, 2,000 kept back
    assert bs.sockets_per_process(20_000) == 8000 and bs.sockets_per_process(12_000) == 5000
    assert bs.sockets_per_process(1024) == 500


def test_replica_groups_are_the_same_local_rank_on_every_node() -> None:
    world, per_node = 64, 8
    declared = {rank: bs.replica_group(rank, world, per_node) for rank in range(world)}
    groups = replica_groups_from_hello(world, declared)  # the coordinator accepts them: a partition
    assert len(groups) == per_node and groups[3] == list(range(3, 64, 8))


def test_simulated_pids_are_unique_per_process_of_a_rank() -> None:
    pids = {bs.sim_pid(rank, inc) for rank in range(1000) for inc in range(16)}
    assert len(pids) == 16_000 and min(pids) > 4_194_304  # above any real pid


def test_node_zeros_agent_reports_each_spawn_at_once_without_a_process() -> None:
    agent = bs._as_agent_handle()()
    assert isinstance(agent, AgentHandle)
    agent.spawn(3, 1, {}, "", use_spare=True)
    assert agent.take_reports() == [Spawned(3, 1, bs.sim_pid(3, 1), "warm")]
    assert agent.take_reports() == []


def test_the_table_marks_what_was_not_measured() -> None:
    full = {"ranks": 256, "steady": {"coordinator_cpu_pct": 12.5, "msgs_in_per_s": 288.0, "bytes_in_per_s": 60_000,
                                     "msgs_handled_per_s": 288.0, "cpu_us_per_msg_handled": 400.0, "cpu_pct_needed": 11.5},
            "store": {"ops_per_step": 512, "bytes_per_step": 4_900_000},
            "rank_death": {"to_plan_received_by_all_s": 0.1, "round_s": 0.2},
            "node_silence": {"to_verdict_s": 5.1, "round_s": 0.3}, "coordinator_rss_bytes": 200e6}
    partial = {"ranks": 16384, "steady": {"coordinator_cpu_pct": 99.0}, "incomplete": "one rank's recovery: not finished"}
    text = bs.table([full, partial])
    lines = text.splitlines()
    assert lines[0].split()[0] == "ranks" and len(lines) == 4
    assert "12.5" in lines[1] and "4.9" in lines[1] and lines[2].split()[-1] == "-"
    assert lines[3] == "16384 ranks: one rank's recovery: not finished"


def test_arguments() -> None:
    args = bs.parse_args(["--ranks", "256,1024", "--json", "x.json"])
    assert args.sizes == [256, 1024] and args.per_node == 8 and args.heartbeat_interval == 1.0
    with pytest.raises(SystemExit):
        bs.parse_args(["--ranks", "100"])  # not a multiple of 8
    with pytest.raises(SystemExit):
        bs.parse_args(["--ranks", "8"])  # one node: no node to lose
    assert bs.default_window(16384) <= 12 and bs.default_cap(16384) <= 330


@pytest.mark.parametrize("relay", [True, False], ids=["relay", "direct"])
def test_a_tiny_run_reports_every_figure(tmp_path: Path, relay: bool) -> None:
    """64 simulated ranks against the real coordinator and store, heartbeats at 0.2 s, relayed
    through the agents or not, the records in the nodes' record stores (relayed) or in node 0's
    job store (the design before: direct): every figure is there and consistent with what was
    simulated (no timing is asserted), and no live rank was taken for hung."""
    lines: list[str] = []
    res = bs.measure_size(64, 8, window=1.5, cap=120.0, store_steps=1, record_bytes=1000, interval=0.2, step_s=0.2,
                          heartbeat_timeout=1.0, say=lines.append, relay=relay, record_stores="node" if relay else "job")
    assert "incomplete" not in res, (res, lines)
    steady = res["steady"]
    assert steady["coordinator_cpu_pct"] > 0 and steady["coordinator_rss_bytes"] > 0
    assert steady["msgs_in_per_s"] > 0 and steady["bytes_in_per_s"] > 0 and steady["msgs_handled_per_s"] > 0
    assert steady["cpu_us_per_msg_handled"] > 0 and steady["cpu_pct_needed"] > 0
    # 64 ranks and 8 agents (7 nodes and the standby); relayed, node 0's 8 ranks and the agents
    assert steady["frames_due_per_s"] == ((8 if relay else 64) + 8) / 0.2
    assert (steady["heartbeats_per_s"] < 8 / 0.2 * 1.5) if relay else (steady["heartbeats_per_s"] > 8 / 0.2 * 2)
    death = res["rank_death"]
    assert 0 < death["to_plan_decided_s"] <= death["to_plan_received_by_all_s"] <= death["round_s"]
    silence = res["node_silence"]
    assert silence["silence_timeout_s"] == 1.0 and silence["to_verdict_s"] > 0 and silence["round_s"] > 0
    store = res["store"]
    if relay:  # nothing into node 0's job store; each node's record store: its 8 ranks' and its predecessor's copies
        assert store["ops_per_step"] == store["bytes_per_step"] == 0
        assert store["lookup_ops"] == 2 * 64  # a look-up of the buddy's address per rank: check and get
        for per_node in ("node0_record_store_bytes_per_step", "node_record_store_bytes_per_step_median",
                         "node_record_store_bytes_per_step_max"):
            assert 2 * 8 * 1000 < store[per_node] < 2 * 8 * 1400, (per_node, store)
    else:
        assert store["ops_per_step"] == 2 * 64  # a record and a gradient digest per rank (the step start's equals the record)
        assert 64 * 1000 < store["bytes_per_step"] < 64 * 1400
        assert store["node0_record_store_bytes_per_step"] == 0
    assert res["coordinator_rss_bytes"] > 0 and res["simulation_processes"] == 1
    assert res["hung_orders"] == 0, res
    assert bs.table([res]).splitlines()[1].split()[0] == "64"


def _scheduling_seen(policy: str, conn) -> None:
    import threading

    bs.simulation_scheduling(policy)
    seen = []
    thread = threading.Thread(target=lambda: seen.append(os.sched_getscheduler(0)))  # as ZeroMQ's I/O thread, started after
    thread.start()
    thread.join()
    conn.send((os.sched_getscheduler(0), seen[0]))


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="SCHED_BATCH is Linux's")
@pytest.mark.parametrize("policy", ["batch", "other"])
def test_the_simulation_processes_and_their_threads_take_the_scheduling_policy_asked_for(policy: str) -> None:
    import multiprocessing

    ctx = multiprocessing.get_context("fork")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=_scheduling_seen, args=(policy, child))
    proc.start()
    try:
        assert parent.poll(60), "the child did not answer"
        expected = os.SCHED_BATCH if policy == "batch" else os.SCHED_OTHER
        assert parent.recv() == (expected, expected)
    finally:
        proc.join(10)
    assert os.sched_getscheduler(0) == os.SCHED_OTHER  # the driver's own is left as it was
    assert bs.parse_args(["--ranks", "16"]).sim_sched == "batch"
