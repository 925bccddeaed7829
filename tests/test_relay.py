"""The node agents' heartbeat relay (ftrun.node.relay): a rank's beats reach the coordinator inside
its agent's beat, dated where they arrived, in order with the rank's direct messages, and only for
the agent's own live ranks. Driven without processes: a real rank channel and relay on ZeroMQ, and
the coordinator of coordinator_fixtures on an injected clock."""

from __future__ import annotations

import contextlib
import time
from pathlib import Path
from typing import Iterator

import pytest
import zmq

from ftrun.common.protocol import CONTROL, RELAY, FrameAuth, MsgType, Sender, pack
from ftrun.config import ConfigError
from ftrun.coordinator.ranks import RankPhase
from ftrun.node.relay import RELAY_AUTO_RANKS, BeatRelay, relays_beats
from ftrun.rank.channel import Channel

from config_fixtures import res
from coordinator_fixtures import TOKEN, begin, board, close_coordinators, hello_all, make, send  # noqa: F401


@contextlib.contextmanager
def _rank_on_a_relay() -> Iterator[tuple[zmq.Context, BeatRelay, zmq.Socket, Channel]]:
    """A real rank channel (rank 3, incarnation 2, beating every 0.1 s) on a real relay, and a bare
    ROUTER as its coordinator; all closed on the way out."""
    ctx = zmq.Context()
    relay = BeatRelay(ctx, FrameAuth(TOKEN))
    coordinator = ctx.socket(zmq.ROUTER)
    coordinator.setsockopt(zmq.LINGER, 0)
    port = coordinator.bind_to_random_port("tcp://127.0.0.1")
    channel = Channel(f"tcp://127.0.0.1:{port}", TOKEN, rank=3, incarnation=2, heartbeat_interval=0.1, relay=relay.address)
    try:
        yield ctx, relay, coordinator, channel
    finally:
        channel.close()
        relay.close()
        coordinator.close(0)
        ctx.term()


def _rows_within(relay: BeatRelay, until, deadline_s: float = 20.0) -> list[list]:
    rows: list[list] = []
    deadline = time.monotonic() + deadline_s
    while not until(rows):
        assert time.monotonic() < deadline, f"the relay got only {rows}"
        relay.sock.poll(100)
        relay.drain(time.monotonic())
        rows += relay.rows(time.monotonic())
    return rows


def test_a_ranks_beats_go_to_its_relay_with_the_count_of_its_direct_frames_and_forged_ones_are_dropped() -> None:
    with _rank_on_a_relay() as (ctx, relay, coordinator, channel):
        channel.probe = lambda: {"in_dist": True, "stage": "loop"}
        assert relay.address.startswith("ipc://@")
        channel.send(MsgType.HELLO, pid=1, generation=0, replica_group=[3], library=True)
        channel.send(MsgType.STEPS_END)
        rows = _rows_within(relay, lambda rows: any(row[3] == 2 for row in rows))
        rank, incarnation, age, sent, fields = rows[-1]
        assert (rank, incarnation, sent) == (3, 2, 2) and 0 <= age < 1.0
        assert fields == {"in_dist": True, "stage": "loop"}
        # the coordinator got the two direct frames and no heartbeat
        got = []
        while coordinator.poll(100):
            got.append(coordinator.recv_multipart()[1])
        assert len(got) == 2
        # a frame for the coordinator, one keyed with another secret, and a message that is no heartbeat:
        # none counts, each is dropped
        forger = ctx.socket(zmq.DEALER)
        forger.setsockopt(zmq.LINGER, 0)
        forger.connect(relay.address)
        beat = pack(MsgType.HEARTBEAT, rank=5, incarnation=0)
        forger.send(Sender(TOKEN).seal(beat, CONTROL))
        forger.send(Sender("x" * 64).seal(beat, RELAY))
        forger.send(Sender(TOKEN).seal(pack(MsgType.STEPS_END, rank=5, incarnation=0), RELAY))
        deadline = time.monotonic() + 20
        while relay.rejected < 3:
            assert time.monotonic() < deadline, relay.rejected
            relay.sock.poll(100)
            relay.drain(time.monotonic())
        assert all(row[0] == 3 for row in relay.rows(time.monotonic()))
        forger.close(0)


def test_a_relayed_beat_keeps_a_rank_alive_dated_where_it_arrived(tmp_path: Path) -> None:
    coord, _agent, clock = make(tmp_path)
    hello_all(coord)
    timeout = coord.spec.heartbeat_timeout
    clock.now += timeout - 1.0
    rows = [[rank, coord.ranks[rank].incarnation, 0.5, 1, {}] for rank in coord.ranks]
    coord.messages.on_relayed(0, rows)
    assert all(r.proc.last_heartbeat == clock.now - 0.5 for r in coord.ranks.values())
    clock.now += timeout - 0.5 - 0.01  # just within the timeout, counted from the beat's arrival at the relay
    assert coord.watchdog.heartbeats(list(coord.ranks.values()), clock.now) == []
    clock.now += 0.02
    assert len(coord.watchdog.heartbeats(list(coord.ranks.values()), clock.now)) == 4


def test_a_relayed_board_older_than_a_direct_message_is_not_taken(tmp_path: Path) -> None:
    """The beat left before the rank's fault but arrived after it: its board would put back the
    phase the fault ended. Its liveness still counts; a later beat's board is taken."""
    coord, _agent, clock = make(tmp_path)
    hello_all(coord)  # one direct frame each
    begin(coord, 1, 5, collective=True)  # a direct heartbeat: two
    r = coord.ranks[1]
    stale = board(coord, 1).fields()
    assert r.proc.phase == RankPhase.COLLECTIVE and r.proc.direct == 2
    send(coord, 1, MsgType.FAULT, generation=coord.generation, step=5, committed=4, reason="gloo", kind="comm")
    assert r.proc.phase == RankPhase.RECOVERING and r.proc.direct == 3
    clock.now += 1.0
    coord.messages.on_relayed(0, [[1, r.incarnation, 0.2, 2, stale]])
    assert r.proc.phase == RankPhase.RECOVERING and r.proc.last_heartbeat == clock.now - 0.2
    coord.messages.on_relayed(0, [[1, r.incarnation, 0.1, 3, stale]])
    assert r.proc.phase == RankPhase.COLLECTIVE and r.proc.step == 5


@pytest.mark.parametrize("row", [
    [1, 0, 0.1, 5, {"phase": "update"}, "extra"],  # not five fields
    ["1", 0, 0.1, 5, {"phase": "update"}],  # a rank that is no number
    [1, 7, 0.1, 5, {"phase": "update"}],  # another incarnation
    [1, 0, -1.0, 5, {"phase": "update"}],  # a negative age
    [1, 0, True, 5, {"phase": "update"}],  # an age that is a bool
    [1, 0, 0.1, 5, ["phase", "update"]],  # a board that is no map
    [9, 0, 0.1, 5, {"phase": "update"}],  # no such rank
])
def test_a_malformed_or_foreign_row_changes_nothing(tmp_path: Path, row: list) -> None:
    coord, _agent, clock = make(tmp_path)
    hello_all(coord)
    before = coord.ranks[1].proc.last_heartbeat
    clock.now += 1.0
    coord.messages.on_relayed(0, [row])
    assert coord.ranks[1].proc.last_heartbeat == before and coord.ranks[1].proc.phase == RankPhase.SETUP


def test_rows_count_only_for_the_agents_own_node_and_ranks_that_said_hello(tmp_path: Path) -> None:
    coord, _agent, clock = make(tmp_path, world=4, local=2)  # ranks 2 and 3 on node 1 (not started)
    hello_all(coord, [0, 1])
    clock.now += 1.0
    coord.messages.on_relayed(1, [[0, coord.ranks[0].incarnation, 0.0, 5, {}]])  # node 1's agent speaks for node 0's rank
    coord.messages.on_relayed(0, [[2, coord.ranks[2].incarnation, 0.0, 5, {}]])  # a rank not started, not said hello
    assert coord.ranks[0].proc.last_heartbeat == clock.now - 1.0
    assert coord.ranks[2].proc.last_heartbeat == 0.0


def test_when_the_relay_is_on() -> None:
    assert relays_beats("on", 2, 1.0, 5.0) and not relays_beats("off", 100_000, 1.0, 5.0)
    assert relays_beats("auto", RELAY_AUTO_RANKS, 1.0, 5.0) and not relays_beats("auto", RELAY_AUTO_RANKS - 1, 1.0, 5.0)
    assert not relays_beats("auto", 10_000, 1.0, 2.0)  # no room for the relay's hop


def test_the_relay_on_with_too_short_a_heartbeat_timeout_is_refused(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    with pytest.raises(ConfigError, match="--heartbeat_relay on needs --heartbeat_timeout above two heartbeat intervals"):
        res(tmp_path, str(script), {"heartbeat_relay": "on", "heartbeat_timeout": 2.0, "heartbeat_interval": 1.0})
    with pytest.raises(ConfigError, match="must be 'auto', 'on' or 'off'"):
        res(tmp_path, str(script), {"heartbeat_relay": "sometimes"})
    assert res(tmp_path, str(script), {"heartbeat_relay": " ON "}).heartbeat_relay == "on"
    assert res(tmp_path, str(script)).heartbeat_relay == "auto"


def test_silence_and_hangs_are_judged_up_to_what_the_coordinator_has_read(tmp_path: Path, monkeypatch) -> None:
    """While frames wait unread (a read left some), a rank's heartbeat may be among them: no rank
    is taken for hung past its timeout until the coordinator has read everything that arrived."""
    import ftrun.coordinator.control as control

    coord, _agent, clock = make(tmp_path)
    hello_all(coord)
    monkeypatch.setattr(control, "READ_BUDGET", 1)
    ctx = zmq.Context()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(coord.control_addr)
    try:
        for _ in range(2):
            sock.send(b"not a frame")
        assert coord.control.router.poll(20_000)
        coord.read_messages()  # one of them: the coordinator is behind from now on
        assert coord.behind_since == clock.now
        clock.now += coord.spec.heartbeat_timeout + 1.0
        coord.check_hangs()
        assert not [r for r in coord.ranks.values() if r.proc.kill_reason is not None]
        deadline = time.monotonic() + 20
        while coord.behind_since is not None:
            assert time.monotonic() < deadline
            coord.control.router.poll(100)
            coord.read_messages()
        coord.check_hangs()
        assert [r.rank for r in coord.ranks.values() if r.proc.kill_reason is not None] == [0]  # one a pass
    finally:
        sock.close(0)
        ctx.term()


def test_each_rank_is_sent_only_the_transfers_it_takes_part_in(tmp_path: Path, monkeypatch) -> None:
    """The plan's reconfigure carries a rank's own [donor, recipient] pairs (all a rank acts on):
    the whole list to every rank would be O(ranks x transfers) bytes in a large job."""
    import signal

    from coordinator_fixtures import events

    coord, agent, clock = make(tmp_path, world=6, local=6)
    hello_all(coord)
    sent: dict[int, list] = {}
    monkeypatch.setattr(coord, "send", lambda r, msg_type, **f: sent.__setitem__(r.rank, f["transfers"])
                        if msg_type == MsgType.RECONFIGURE else None)
    agent.exit(4, -signal.SIGKILL, at=clock.now)
    coord.check_processes()
    coord.check_processes()
    for rank in (0, 1, 2, 3, 5):  # rank 1 is a step behind its replicas: a laggard, a recipient too
        send(coord, rank, MsgType.FAULT, generation=1, step=3, committed=1 if rank == 1 else 2, reason="abort")
    hello_all(coord, [4])
    plan = events(tmp_path, "recovery_planned")[-1]["detail"]["transfers"]
    assert {tuple(p)[1] for p in plan} == {1, 4}
    for rank in range(6):
        assert sent[rank] == [p for p in plan if rank in p], (rank, sent[rank], plan)


# ---------------------------------------------------------------- a round's orders and answers, relayed
def _relayed_job(tmp_path: Path):
    """A 4-rank job whose ranks 2 and 3 run on node 1, whose agent relayed a beat of each; the
    frames to node 1's agent and to each rank are recorded."""
    from ftrun.coordinator.agents import RemoteAgent

    coord, agent, clock = make(tmp_path, world=4, local=4)
    hello_all(coord)
    to_agent: list[tuple[MsgType, dict]] = []
    coord.members.agents[1] = RemoteAgent(node=1, identity=b"agent-1", last_seen=clock.now,
                                          send_frame=lambda _i, t, f: to_agent.append((t, f)) if t == MsgType.RANK_ORDERS else None)
    for rank in (2, 3):
        coord.ranks[rank].node = 1
    coord.messages.on_relayed(1, [[rank, coord.ranks[rank].incarnation, 0.1, 1, {}] for rank in (2, 3)])
    direct: list[tuple[int, MsgType, dict]] = []
    coord.send = lambda r, t, **f: direct.append((r.rank, t, f))
    return coord, agent, clock, to_agent, direct


def _answer(rank: int, msg_type: str, **fields) -> list:
    return [msg_type, {"rank": rank, "incarnation": 0, **fields}]


def test_a_rounds_orders_and_answers_go_through_the_agent_of_ranks_whose_relayed_beats_were_read(tmp_path: Path) -> None:
    """Rank 0 dies: rank 1 (no relayed beat) is aborted straight, ranks 2 and 3 in one frame to
    node 1's agent; their answers come back in one frame; the plan goes the same ways, each rank's
    transfers in its own row; the round ends on the relayed ``recovered``."""
    import signal

    from coordinator_fixtures import events

    coord, agent, clock, to_agent, direct = _relayed_job(tmp_path)
    assert [coord.ranks[rank].proc.relayed for rank in range(4)] == [False, False, True, True]
    agent.exit(0, -signal.SIGKILL, at=clock.now)
    coord.check_processes()
    coord.check_processes()
    assert [(rank, t) for rank, t, _f in direct] == [(1, MsgType.ABORT)]
    assert [t for t, _f in to_agent] == [MsgType.RANK_ORDERS]
    orders = to_agent[0][1]
    assert orders["order"] == "abort" and orders["common"]["generation"] == 1 and orders["node"] == 1
    assert orders["ranks"] == [[2, 0, {}], [3, 0, {}]]
    send(coord, 1, MsgType.FAULT, generation=1, step=3, committed=2, reason="abort", kind="abort")
    coord.messages.on_relayed_answers(1, [_answer(rank, "fault", generation=1, step=3, committed=2, reason="abort",
                                                  kind="abort") for rank in (2, 3)])
    assert coord.rounds.current.reports == {1: 2, 2: 2, 3: 2}
    hello_all(coord, [0])  # the respawned rank 0: its hello is its report
    plan = events(tmp_path, "recovery_planned")[-1]["detail"]
    assert plan["transfers"] == [[1, 0]]
    assert sorted((rank, t) for rank, t, _f in direct[1:]) == [(0, MsgType.RECONFIGURE), (1, MsgType.RECONFIGURE)]
    assert [f["transfers"] for rank, _t, f in direct[1:] if rank == 1] == [[[1, 0]]]
    reconfigure = to_agent[1][1]
    assert reconfigure["order"] == "reconfigure" and reconfigure["common"]["step"] == 2
    assert reconfigure["common"]["transfers"] == [] and reconfigure["ranks"] == [[2, 0, {}], [3, 0, {}]]
    for rank in (0, 1):
        send(coord, rank, MsgType.RECOVERED, generation=1, role="recipient" if rank == 0 else "donor", bytes=0, seconds=0.0)
    coord.messages.on_relayed_answers(1, [_answer(2, "recovered", generation=1, role="none", bytes=0, seconds=0.0)])
    assert coord.rounds.current is not None  # rank 3 has not answered
    coord.messages.on_relayed_answers(1, [_answer(3, "recovered", generation=1, role="none", bytes=0, seconds=0.0)])
    assert coord.rounds.current is None and events(tmp_path, "recovery_finished")


@pytest.mark.parametrize("node, row", [
    (0, _answer(2, "fault", generation=1, step=3, committed=2, reason="abort", kind="abort")),  # another node's agent
    (1, ["fault", {"rank": 2, "incarnation": 7, "generation": 1, "step": 3, "committed": 2, "reason": "abort"}]),
    (1, _answer(2, "fault", generation=1, step=3, committed=2, reason="abort", bogus=1)),  # a field faults do not have
    (1, _answer(2, "fault", generation=1, step=3, reason="abort")),  # no committed step
    (1, _answer(2, "done", committed=2)),  # a message that is no answer
    (1, _answer(2, "fault", generation=1, step=3, committed=2, reason="abort")[1]),  # no type
    (1, ["no such type", {}]),
])
def test_a_relayed_answer_that_is_not_a_live_ranks_of_the_agents_node_changes_nothing(tmp_path: Path, node: int,
                                                                                        row: list) -> None:
    import signal

    coord, agent, clock, _to_agent, _direct = _relayed_job(tmp_path)
    agent.exit(0, -signal.SIGKILL, at=clock.now)
    coord.check_processes()
    coord.check_processes()
    coord.messages.on_relayed_answers(node, [row])
    assert coord.rounds.current.reports == {}


def test_an_order_relayed_to_a_rank_comes_sealed_for_it_and_its_answer_goes_back_through_the_relay() -> None:
    """A real channel and relay: the relay knows the rank from its beat, forwards an abort sealed
    for that rank's relay connection, and the rank's answer comes back to the relay (its beat read
    before the answer is dropped: it is older); an order sealed for another connection is dropped,
    and a direct abort is answered straight."""
    from ftrun.common.protocol import Message, decode, Receiver, to_peer

    with _rank_on_a_relay() as (ctx, relay, coordinator, channel):
        _rows_within(relay, lambda rows: rows)  # the rank beat the relay: it is known there
        relay.note({"rank": 3, "incarnation": 2, "phase": "compute"}, time.monotonic())  # a beat before the answer
        orders = Message(MsgType.RANK_ORDERS, {"node": 1, "order": "abort", "common": {"generation": 4, "reason": "rank 0 died"},
                                               "ranks": [[3, 2, {}], [3, 1, {}], [5, 0, {}]]})
        assert relay.forward(orders) == 1 and relay.unrelayed == 2  # another incarnation, a rank never heard
        got = channel.receive(timeout=20)
        assert got is not None and got.type == MsgType.ABORT and got["generation"] == 4
        channel.send(MsgType.FAULT, generation=4, step=9, committed=8, reason="abort", kind="abort")
        deadline = time.monotonic() + 20
        answers: list = []
        while not answers:
            assert time.monotonic() < deadline
            relay.sock.poll(100)
            relay.drain(time.monotonic())
            answers = [row for rows in relay.reports() for row in rows]
        assert answers == [["fault", {"rank": 3, "incarnation": 2, "generation": 4, "step": 9, "committed": 8,
                                      "reason": "abort", "kind": "abort"}]]
        assert all(row[2] != {"phase": "compute"} for row in relay.rows(time.monotonic()))
        # an order sealed for another connection does not verify at the rank
        identity = relay._identities[3][1]
        relay.sock.send_multipart([identity, Sender(TOKEN).seal(pack(MsgType.ABORT, generation=5, reason="x"),
                                                                to_peer(b"q-someone-else"))])
        assert channel.receive(timeout=0.5) is None
        # a direct abort is answered straight to the coordinator
        hello = coordinator.recv_multipart() if coordinator.poll(100) else None  # nothing sent yet but the beats' relay
        assert hello is None
        channel.send(MsgType.HELLO, pid=1, generation=0, replica_group=[3], library=True)
        peer = coordinator.recv_multipart()[0]
        coordinator.send_multipart([peer, Sender(TOKEN).seal(pack(MsgType.ABORT, generation=6, reason="y"), to_peer(peer))])
        assert channel.receive(timeout=20)["generation"] == 6
        channel.send(MsgType.FAULT, generation=6, step=9, committed=8, reason="abort", kind="abort")
        assert coordinator.poll(20_000)
        frame = coordinator.recv_multipart()[1]
        assert decode(frame, Receiver(TOKEN, CONTROL))["generation"] == 6


def test_the_coordinators_beat_to_relayed_ranks_goes_through_their_agent_one_frame_a_node(tmp_path: Path) -> None:
    """Once a standby is announced, every rank hears the coordinator's ``standby`` once a heartbeat
    interval: a rank whose beats node 1's agent relays, in that agent's one ``rank_orders``; the
    others straight. Node 1's agent, sent that frame, gets no beat of its own in that period."""
    from ftrun.coordinator.agents import RemoteAgent
    from ftrun.coordinator.failover import AGENT_BEATS_PER_S, agent_beat_period

    coord, _agent, clock, to_agent, direct = _relayed_job(tmp_path)
    frames: list[MsgType] = []
    coord.members.agents[1].send_frame = lambda _i, t, f: (frames.append(t), to_agent.append((t, f)) if t == MsgType.RANK_ORDERS
                                                          else None)
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    direct.clear(), to_agent.clear()
    clock.now += coord.spec.heartbeat_interval
    coord.failover.beat_ranks(clock.now)
    assert sorted(rank for rank, t, _f in direct if t == MsgType.STANDBY) == [0, 1]
    assert [(f["order"], f["ranks"]) for _t, f in to_agent] == [("standby", [[2, 0, {}], [3, 0, {}]])]
    assert to_agent[0][1]["common"]["control"] == "tcp://10.0.0.2:5555"
    frames.clear()
    coord.members._next_beat = 0.0
    coord.members.check(set(), clock.now)
    assert MsgType.AGENT_BEAT not in frames  # the relayed beat proved the coordinator alive to it
    coord.members._next_beat = 0.0
    coord.members.check(set(), clock.now)
    assert frames == [MsgType.AGENT_BEAT]  # nothing else sent since: a beat
    spec = coord.spec
    assert agent_beat_period(spec, 64) == spec.heartbeat_interval
    assert agent_beat_period(spec, 2 * AGENT_BEATS_PER_S) == min(2.0, max(spec.heartbeat_timeout, 3 * spec.heartbeat_interval) / 2.5)
    assert isinstance(coord.members.agents[1], RemoteAgent)


def test_a_relayed_standby_sets_the_ranks_line_and_silence_timeout() -> None:
    from ftrun.common.protocol import Message

    with _rank_on_a_relay() as (ctx, relay, coordinator, channel):
        _rows_within(relay, lambda rows: rows)
        orders = Message(MsgType.RANK_ORDERS, {"node": 1, "order": "standby", "ranks": [[3, 2, {}]], "common": {
            "control": "tcp://10.0.0.2:5555", "store": "10.0.0.2:6666", "epoch": 0, "timeout": 7.5,
            "seats": [["tcp://10.0.0.2:5555", 1]]}})
        assert relay.forward(orders) == 1
        deadline = time.monotonic() + 20
        while channel.silence_timeout is None:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert channel.line == ["tcp://10.0.0.2:5555"] and channel.silence_timeout == 7.5
        assert channel.receive(timeout=0.2) is None  # the beat is the I/O thread's, not the training thread's


@pytest.mark.parametrize("first, second", [(3, 0), (3, 4), (0, 5), (40, 40), (10, 100), (100, 10), (100, 100)])
def test_a_replaced_beat_hands_its_step_times_to_the_newer(first: int, second: int) -> None:
    """Of a rank's two beats an interval the agent keeps the newer; the step times only the older
    listed are carried into it: the row says what one beat after all those steps would
    (numbers, listed times, the largest unlisted and its first number), for few and for more steps
    than a beat lists."""
    from ftrun.node.relay import RelayedBeats
    from ftrun.rank.client import StepBoard
    from ftrun.rank.recovery import RankProgress

    def boards() -> tuple[StepBoard, list[float]]:
        clock = [100.0]
        return StepBoard(RankProgress(committed=-1), clock=lambda: clock[0]), clock

    twice, t2 = boards()
    once, t1 = boards()
    relay = RelayedBeats()
    step = 0
    for count, beat in ((first, True), (second, True)):
        for _ in range(count):
            for board, clock in ((twice, t2), (once, t1)):
                clock[0] += 0.01 * (1 + step % 7)  # step times that differ
                board.begin(step, None)
            step += 1
        if beat:
            relay.note({"rank": 5, "incarnation": 0, "sent": 0, **twice.fields()}, 0.0)
    (row,) = relay.rows(0.0)
    keys = ("samples", "step_times", "step_max", "step_max_from")
    expected = {k: v for k, v in once.fields().items() if k in keys}
    assert {k: v for k, v in row[4].items() if k in keys} == expected


def test_a_new_incarnations_beat_does_not_take_its_predecessors_step_times() -> None:
    from ftrun.node.relay import RelayedBeats

    relay = RelayedBeats()
    relay.note({"rank": 5, "incarnation": 0, "sent": 0, "phase": "compute", "samples": 40, "step_times": [0.5]}, 0.0)
    relay.note({"rank": 5, "incarnation": 1, "sent": 0, "phase": "setup"}, 0.1)
    (row,) = relay.rows(0.2)
    assert row[1] == 1 and "samples" not in row[4] and "step_times" not in row[4]


def _round_state(coord, tmp_path: Path) -> dict:
    """What a round's answers leave: the reports, the plan, each rank's state, and the events."""
    import json

    rec = coord.rounds.current
    kinds = [(e["kind"], e["detail"].get("rank"), e["detail"].get("step"))
             for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines())]
    return {"reports": dict(rec.reports) if rec else None, "planned": rec is not None and rec.plan is not None,
            "generation": coord.generation, "events": kinds,
            "ranks": [(r.proc.state, r.proc.committed, r.proc.phase, r.rollback_ok) for r in coord.ranks.values()]}


_FAULT = dict(step=5, committed=4, reason="abort", kind="abort")


@pytest.mark.parametrize("frames, outcome", [
    # every survivor's answer to the abort in one frame (one cannot roll back): the plan is made after the last
    ([[("fault", rank, dict(generation=1, rollback=rank != 2, **_FAULT)) for rank in (0, 1, 2, 3, 4, 6, 7)]], "planned"),
    # a collective's failure (no abort answer) among them, one of an older generation, one that cannot roll back
    ([[("fault", 0, dict(generation=1, **_FAULT)), ("fault", 1, dict(generation=0, **_FAULT)),
       ("fault", 2, dict(generation=1, step=5, committed=3, reason="gloo: connection closed", kind="comm")),
       ("fault", 3, dict(generation=1, rollback=False, **_FAULT)), ("fault", 4, dict(generation=1, **_FAULT))],
      [("fault", rank, dict(generation=1, **_FAULT)) for rank in (1, 6, 7)]], "planned"),
    # the plan, then the answers to it in one frame, a late answer to the abort among them
    ([[("fault", rank, dict(generation=1, **_FAULT)) for rank in (0, 1, 2, 3, 4, 6, 7)],
      [("recovered", 0, dict(generation=1, role="donor", bytes=10, seconds=0.5)), ("fault", 1, dict(generation=1, **_FAULT)),
       *[("recovered", rank, dict(generation=1, role="none", bytes=0, seconds=0.0, rebuild_seconds=0.1))
         for rank in (1, 2, 3, 4, 6, 7)], ("recovered", 5, dict(generation=1, role="recipient", bytes=10, seconds=0.5))]],
     "finished"),
    # an answer to the plan that failed (a transfer broke) in the frame: the next round
    ([[("fault", rank, dict(generation=1, **_FAULT)) for rank in (0, 1, 2, 3, 4, 6, 7)],
      [("recovered", 1, dict(generation=1, role="none", bytes=0, seconds=0.0)),
       ("fault", 0, dict(generation=1, step=4, committed=4, reason="state transfer failed", kind="comm")),
       ("recovered", 2, dict(generation=1, role="none", bytes=0, seconds=0.0))]], "next round"),
    # the last answer to the abort makes the plan; a failure of the plan after it, in the same frame: the next round
    ([[("fault", rank, dict(generation=1, **_FAULT)) for rank in (0, 1, 2, 3, 4, 6)],
      [("fault", 7, dict(generation=1, **_FAULT)),
       ("fault", 0, dict(generation=1, step=4, committed=4, reason="building generation 1's group failed", kind="comm"))]],
     "next round"),
])
def test_a_frame_of_relayed_answers_does_what_the_same_answers_sent_one_by_one_do(tmp_path: Path, frames: list,
                                                                                   outcome: str) -> None:
    """A node's relayed answers are handled a frame at a time (the leading answers to the abort
    together, the rest one by one): the reports, the plan, the ranks' states and the events are
    those of the same answers sent straight, in the same order."""
    import signal

    from coordinator_fixtures import send

    states = []
    for relayed in (False, True):
        where = tmp_path / ("relayed" if relayed else "straight")
        where.mkdir()
        coord, agent, clock = make(where, world=8)
        hello_all(coord)
        agent.exit(5, -signal.SIGKILL, at=clock.now)
        coord.check_processes()
        coord.check_processes()
        hello_all(coord, [5])  # the respawned rank's report
        for frame in frames:
            if relayed:
                coord.messages.on_relayed_answers(0, [[kind, {"rank": rank, "incarnation": coord.ranks[rank].incarnation,
                                                              **fields}] for kind, rank, fields in frame])
            else:
                for kind, rank, fields in frame:
                    send(coord, rank, MsgType(kind), **fields)
        states.append(_round_state(coord, where))
    assert states[0] == states[1]
    last = [kind for kind, _rank, _step in states[1]["events"] if kind.startswith("recovery_")][-1]
    assert {"planned": "recovery_planned", "finished": "recovery_finished", "next round": "recovery_started"}[outcome] == last
    assert states[1]["planned"] == (outcome == "planned")
    if outcome == "planned":  # the reports it was made from (the new rank holds no state), who cannot roll back
        from ftrun.coordinator.policy import NO_STATE

        failed_collective = len(frames) == 2  # rank 2's collective failed with step 3 committed; rank 3 cannot roll back
        assert states[1]["reports"] == {0: 4, 1: 4, 2: 3 if failed_collective else 4, 3: 4, 4: 4, 5: NO_STATE, 6: 4, 7: 4}
        assert [rank for rank, r in enumerate(states[1]["ranks"]) if not r[3]] == [3 if failed_collective else 2]
