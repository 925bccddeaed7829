"""Coordinator failover without processes: the hard state a standby is sent
restores a coordinator as it was (the epoch moved on); a takeover makes the dead coordinator's node
a lost node whose ranks are respawned from replicas; a rank that heard of a newer generation from
the dead coordinator than the standby was told moves the round beyond it; the standby is announced
to ranks and sent the state when a decision changes it, not when only committed steps move.
(The real thing, on namespace hosts: test_multinode.py::test_node0_lost_the_standby_coordinator_takes_over.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from coordinator_fixtures import MADE, TOKEN, Clock, FakeAgent, close_coordinators, events, hello_all, ident, make, msg, send, step  # noqa: F401

from ftrun.config import JobSpec
from ftrun.coordinator import Coordinator
from ftrun.coordinator.failover import RankRow, hard_state, restore, silence_timeout
from ftrun.coordinator.policy import RankState
from ftrun.common.protocol import MsgType


class StandbyAgent(FakeAgent):
    """A fake remote agent that records what the coordinator sends its standby."""

    def __init__(self, node: int) -> None:
        super().__init__(node)
        self.states: list[dict[str, Any]] = []
        self.announced: list[tuple[str, str, int]] = []

    def replicate(self, state: dict[str, Any]) -> None:
        self.states.append(state)

    def announce_standby(self, control: str, store: str, epoch: int, seats: Any = None) -> None:
        self.announced.append((control, store, epoch))


@pytest.fixture()
def store() -> Any:
    from ftrun.common.stores import serve_store

    served, port = serve_store("127.0.0.1", 0, 10)
    yield port
    del served


def _standby_of(tmp_path: Path, port: int, clock: Clock) -> Coordinator:
    """Node 1's coordinator as a takeover builds it (its own agent local, the store its own)."""
    (tmp_path / "new").mkdir()
    spec = JobSpec(script="train.py", worker_num=4, local_worker_num=2, node_rank=1, master_addr="127.0.0.1",
                   master_port=port, log_dir=str(tmp_path / "new"), checkpoint_dir=str(tmp_path / "ckpt"))
    coord = Coordinator(spec, TOKEN, None, port, local_agent=FakeAgent(1), clock=clock)
    MADE.append(coord)  # closed after the test (its ZeroMQ context would block the interpreter's exit)
    return coord


def test_the_hard_state_restores_a_coordinator_with_the_epoch_moved_on(tmp_path: Path) -> None:
    for sub in ("a", "b"):
        (tmp_path / sub).mkdir()
    old, agent, _clock = make(tmp_path / "a", world=4)
    hello_all(old)
    step(old, 3)
    agent.exit(2, 9)  # rank 2 dies: a round, a respawn, a generation
    old.check_processes()
    state = hard_state(old)
    again, _agent, _ = make(tmp_path / "b", world=4)
    restore(again, state)
    assert again.epoch == old.epoch + 1
    assert {**hard_state(again), "epoch": old.epoch} == state
    assert again.generation == old.generation == 1 and again.restarts_used == 1
    assert again.ranks[2].incarnation == 1 and again.ranks[2].proc.state == old.ranks[2].proc.state


def test_a_rank_row_is_named_and_travels_as_a_list_of_nine_values(tmp_path: Path) -> None:
    coord, _agent, _clock = make(tmp_path, world=4)
    hello_all(coord)
    step(coord, 3)
    rows = hard_state(coord)["ranks"]
    assert all(type(row) is list and len(row) == len(RankRow._fields) == 9 for row in rows)
    row = RankRow.from_wire(rows[2])
    assert (row.rank, row.incarnation, row.library, row.state, row.committed, row.running) == (2, 0, True, "healthy", 3, True)
    assert hard_state(coord)["groups"][row.replica_group] == [0, 1, 2, 3] and row.to_wire() == rows[2]
    assert RankRow.decision(rows[2]) == [v for name, v in zip(RankRow._fields, rows[2]) if name != "committed"]
    with pytest.raises(TypeError):
        RankRow.from_wire(rows[2][:8])
    # The state builds its rows as lists, for speed: each is the named row's.
    assert rows == [RankRow.of(r, row.replica_group).to_wire() for r in coord.ranks.values()]


def test_only_a_decision_makes_the_hard_state_differ_from_the_one_sent(tmp_path: Path) -> None:
    from ftrun.coordinator.failover import _same_decisions

    coord, _agent, _clock = make(tmp_path, world=4)
    hello_all(coord)
    step(coord, 3)
    sent = hard_state(coord)
    step(coord, 4)
    moved = hard_state(coord)
    assert moved != sent and _same_decisions(moved, sent)  # committed steps alone moved
    assert not _same_decisions(moved, None)
    for changed in ({"generation": 7}, {"ranks": [*moved["ranks"][:3], [*moved["ranks"][3][:6], "failed", *moved["ranks"][3][7:]]]},
                    {"ranks": moved["ranks"][:3]}, {"seats": [[1, "tcp://h1:2", "h1:3"]]}):
        assert not _same_decisions({**moved, **changed}, sent), changed


@pytest.mark.parametrize("groups", ["pairs", "data_parallel"])
def test_the_hard_state_of_16384_ranks_fits_one_frame(groups: str) -> None:
    """Rows travel as lists, not maps, and name their replica group by its place in the state's
    groups: a job of 16,384 ranks (high pids and steps; replica pairs, or one data-parallel group of
    every rank, whose list in each row was 268 million numbers) replicates its whole hard state in
    one ``state`` frame."""
    from ftrun.common.protocol import CONTROL, MAX_FRAME_BYTES, Receiver, Sender, decode, encode

    world = 16384
    table = [[r, r + 1] for r in range(0, world, 2)] if groups == "pairs" else [list(range(world))]
    rows = [RankRow(r, 3, 4_000_000 + r, True, r // 2 if groups == "pairs" else 0, 3, "healthy", 1_000_000, True).to_wire()
            for r in range(world)]
    state = {"epoch": 0, "attempt": 0, "generation": 9, "restarts_used": 3, "run_id": "job", "lost_nodes": {},
             "members": list(range(world // 8)), "awaited": {}, "electorate": world // 8, "seats": [], "groups": table,
             "ranks": rows}
    frame = encode(MsgType.STATE, Sender(TOKEN), CONTROL, state=state)
    assert len(frame) < MAX_FRAME_BYTES
    assert RankRow.from_wire(decode(frame, Receiver(TOKEN, CONTROL)).body.state["ranks"][-1]).pid == 4_000_000 + world - 1


def test_a_takeover_recovers_the_dead_coordinators_node_from_replicas(tmp_path: Path, store: int) -> None:
    clock = Clock()
    new = _standby_of(tmp_path, store, clock)
    state = {"epoch": 0, "attempt": 0, "generation": 2, "restarts_used": 1, "run_id": "job", "lost_nodes": {},
             "groups": [[0, 1, 2, 3]], "ranks": [[r, 0, 100 + r, True, 0, 0, "healthy", 40 + r % 2, True] for r in range(4)]}
    new.take_over(state, lost=[0])
    assert new.epoch == 1 and new.generation == 3  # the round after the dead coordinator's generation
    takeover = events(tmp_path / "new", "coordinator_takeover")
    assert takeover and takeover[0]["detail"]["lost"] == 0
    lost = events(tmp_path / "new", "node_lost")
    assert lost[0]["detail"]["node_lost"] == 0 and lost[0]["detail"]["cause"] == "coordinator_lost"
    assert [new.ranks[r].incarnation for r in range(4)] == [1, 1, 0, 0]  # node 0's ranks respawned, node 1's kept
    assert [o[0] for o in new.members.pending_spawns[0]] == [0, 1]  # started once a launcher takes index 0
    assert new.members.waiting_for and 0 in new.members.waiting_for
    assert new.restarts_used == 2  # node 0 lost with the coordinator: one event, one restart
    # node 1's ranks say hello again on the new endpoint (same pid and incarnation) and are told
    # the round's generation; their answers with the committed step make the plan once the new
    # ranks joined
    for rank in (2, 3):
        new.handle(ident(rank, 0), msg(MsgType.HELLO, rank=rank, incarnation=0, pid=100 + rank, generation=2,
                                       replica_group=[0, 1, 2, 3], library=True, rejoin=True, seen=2))
        assert new.ranks[rank].proc.state == RankState.RECOVERING
        send(new, rank, MsgType.FAULT, generation=3, step=41, committed=40, reason="abort", kind="abort")
    assert new.rounds.current is not None and new.rounds.current.reports == {2: 40, 3: 40}


def test_a_rank_that_never_says_hello_after_a_takeover_is_replaced(tmp_path: Path, store: int) -> None:
    """A rank whose channel stayed on a dead coordinator (nobody told it where to go) would hold
    every round of the new one: after two silence timeouts it is killed and respawned."""
    clock = Clock()
    new = _standby_of(tmp_path, store, clock)
    state = {"epoch": 0, "attempt": 0, "generation": 2, "restarts_used": 0, "run_id": "job", "lost_nodes": {},
             "groups": [[0, 1, 2, 3]], "ranks": [[r, 0, 100 + r, True, 0, 0, "healthy", 40, True] for r in range(4)]}
    new.take_over(state, lost=[0])
    new.agents[1].running.update({2: (0, 102), 3: (0, 103)})  # node 1's ranks, this process's children
    new.handle(ident(2, 0), msg(MsgType.HELLO, rank=2, incarnation=0, pid=102, generation=2,
                                replica_group=[0, 1, 2, 3], library=True, rejoin=True, seen=2))
    send(new, 2, MsgType.FAULT, generation=3, step=41, committed=40, reason="abort", kind="abort")
    deadline = 1000.0 + 2 * silence_timeout(new.spec)
    while clock.now + 1.0 < deadline:
        clock.now += 1.0
        send(new, 2, MsgType.HEARTBEAT)  # rank 2 beats; rank 3 (node 1's, this process's child) never came
        new.check_hangs()
        assert new.agents[1].hung == [], clock.now
    clock.now = deadline + 0.5
    send(new, 2, MsgType.HEARTBEAT)
    new.check_hangs()
    assert new.agents[1].hung == [(3, True)]


def test_a_newer_incarnation_than_the_state_names_is_adopted_after_a_takeover(tmp_path: Path, store: int) -> None:
    """The first standby took over, respawned a rank (incarnation 1) and died before it sent the
    second its state: the second's state names incarnation 0. The rank's hello after it moved is
    taken as the rank's (not rejected), and it joins the round."""
    clock = Clock()
    new = _standby_of(tmp_path, store, clock)
    state = {"epoch": 0, "attempt": 0, "generation": 2, "restarts_used": 0, "run_id": "job", "lost_nodes": {},
             "members": [0, 1], "groups": [[0, 1, 2, 3]], "ranks": [[r, 0, 100 + r, True, 0, 0, "healthy", 40, True] for r in range(4)]}
    new.take_over(state, lost=[0])
    new.handle(ident(2, 1), msg(MsgType.HELLO, rank=2, incarnation=1, pid=555, generation=3,
                                replica_group=[0, 1, 2, 3], library=True, rejoin=True, seen=3))
    assert new.ranks[2].incarnation == 1 and new.ranks[2].proc.pid == 555 and new.ranks[2].proc.identity == ident(2, 1)
    assert any("is the rank now" in e["message"] for e in events(tmp_path / "new", "warning"))
    # A hello that is not a move after a takeover is still refused.
    new.handle(ident(3, 2), msg(MsgType.HELLO, rank=3, incarnation=2, pid=556, generation=3,
                                replica_group=[0, 1, 2, 3], library=True))
    assert new.ranks[3].incarnation == 0 and new.ranks[3].proc.identity is None


def test_a_rank_that_heard_of_a_newer_generation_moves_the_round_beyond_it(tmp_path: Path, store: int) -> None:
    """The dead coordinator sent an abort for generation 3 that the standby was not told of: the
    rank that saw it says so (``seen``), and the round goes to generation 4 (an abort at or below
    what a rank has seen would be ignored by it)."""
    new = _standby_of(tmp_path, store, Clock())
    state = {"epoch": 0, "attempt": 0, "generation": 2, "restarts_used": 0, "run_id": "job", "lost_nodes": {},
             "groups": [[0, 1, 2, 3]], "ranks": [[r, 0, 100 + r, True, 0, 0, "healthy", 40, True] for r in range(4)]}
    new.take_over(state, lost=[0])
    assert new.generation == 3
    new.handle(ident(2, 0), msg(MsgType.HELLO, rank=2, incarnation=0, pid=102, generation=2, replica_group=[0, 1, 2, 3],
                                library=True, rejoin=True, seen=3))
    assert new.generation == 4 and new.rounds.current is not None and new.rounds.current.generation == 4
    # The restarted round names why (no rank failed in it).
    restarted = [e["message"] for e in events(tmp_path / "new", "recovery_started") if "restarted" in e["message"]]
    assert restarted and "had heard of generation 3" in restarted[-1] and "rank(s) []" not in restarted[-1]


def test_the_standby_is_sent_decisions_at_once_and_committed_steps_with_the_beat(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, world=4)
    standby = StandbyAgent(1)
    coord.members.agents[1] = standby
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    hello_all(coord)  # each rank is told where the standby is
    coord.failover.replicate(clock())
    assert len(standby.states) == 1
    step(coord, 2)
    coord.failover.replicate(clock())  # only committed steps moved: they wait for the beat
    assert len(standby.states) == 1
    clock.now += coord.spec.heartbeat_interval
    coord.failover.replicate(clock())
    assert len(standby.states) == 2
    agent.exit(3, 9)
    coord.check_processes()  # a round: the state goes before any rank is told the generation
    assert standby.states[-1]["generation"] == 1 and len(standby.states) == 3


def test_a_lost_standby_is_replaced_by_another_nodes_agent(tmp_path: Path) -> None:
    """The standby's node is lost: the coordinator asks the agent of the lowest other node to
    stand by (``stand_by``), and takes its offer (an ``agent_beat`` with its endpoint and store)."""
    coord, clock, sent = _three_nodes(tmp_path)
    coord.members.lose(1, "node 1 lost")
    coord.failover.replicate(clock())
    assert coord.failover.node is None and (b"agent-2", MsgType.STAND_BY) in sent
    coord.failover.replicate(clock())  # asked once per heartbeat timeout, not every turn
    assert sent.count((b"agent-2", MsgType.STAND_BY)) == 1
    coord.agents[2].on_message(msg(MsgType.AGENT_BEAT, node=2, standby_control="tcp://10.0.0.3:7777",
                                   standby_store="10.0.0.3:8888"), clock())
    coord.collect_reports()
    assert (coord.failover.node, coord.failover.seats[0].store) == (2, "10.0.0.3:8888")
    coord.failover.replicate(clock())
    assert (b"agent-2", MsgType.STATE) in sent


def test_two_standbys_stand_in_line_and_each_is_sent_the_state(tmp_path: Path) -> None:
    """Node 1 may be lost while it takes over from node 0, so a second standby stands
    in line: the coordinator asks node 2's agent too, announces the line (first first) to ranks and
    agents, sends both the state (the line in it), and when node 1 is lost node 2 is first."""
    coord, clock, sent = _three_nodes(tmp_path)
    hello_all(coord)
    coord.failover.replicate(clock())
    assert (b"agent-2", MsgType.STAND_BY) in sent and [s.node for s in coord.failover.seats] == [1]
    coord.agents[2].on_message(msg(MsgType.AGENT_BEAT, node=2, standby_control="tcp://10.0.0.3:7777",
                                   standby_store="10.0.0.3:8888"), clock())
    coord.collect_reports()
    assert [s.node for s in coord.failover.seats] == [1, 2]
    line = [["tcp://10.0.0.2:5555", 1], ["tcp://10.0.0.3:7777", 2]]

    class Told:
        node = 3

        def announce_standby(self, control: str, store: str, epoch: int, seats: Any = None) -> None:
            self.args = (control, store, epoch, seats)

    told = Told()
    coord.failover.tell(told)  # type: ignore[arg-type]
    assert told.args == ("tcp://10.0.0.2:5555", "10.0.0.2:6666", 0, line)
    sent.clear()
    coord.failover.replicate(clock(), force=True)
    assert (b"agent-1", MsgType.STATE) in sent and (b"agent-2", MsgType.STATE) in sent
    assert hard_state(coord)["seats"] == [[1, "tcp://10.0.0.2:5555", "10.0.0.2:6666"], [2, "tcp://10.0.0.3:7777", "10.0.0.3:8888"]]
    assert [[s.control, s.node] for s in coord.failover.seats] == line
    coord.members.lose(1, "node 1 lost")
    coord.failover.replicate(clock())
    assert [s.node for s in coord.failover.seats] == [2]


def _three_nodes(tmp_path: Path) -> tuple[Coordinator, Clock, list[tuple[bytes, MsgType]]]:
    """Node 0's coordinator of a 3-node job (2 ranks a node), node 1's agent standing by."""
    from ftrun.coordinator.agents import RemoteAgent

    coord, _agent, clock = make(tmp_path, world=6, local=2)
    sent: list[tuple[bytes, MsgType]] = []
    for node in (1, 2):
        coord.members.agents[node] = RemoteAgent(node=node, identity=f"agent-{node}".encode(),
                                                 send_frame=lambda i, t, f: sent.append((i, t)), last_seen=clock())
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    return coord, clock, sent


def test_a_coordinator_that_hears_half_its_agents_or_less_steps_down(tmp_path: Path) -> None:
    """A partition cuts node 0 off: nothing from nodes 1 and 2. Before either is found lost the
    coordinator sees it hears 1 of 3 agents and steps down (no node loss, no dying gasp, exit 1),
    since node 1's standby may win a majority on the other side."""
    coord, clock, _sent = _three_nodes(tmp_path)
    assert coord.check_agents() is None and coord.members.electorate == 3
    window = silence_timeout(coord.spec) - coord.spec.heartbeat_interval
    clock.now += window - 0.1  # inside the window: heard
    assert coord.check_agents() is None
    clock.now += 0.2  # past the window, not yet past the loss timeout
    assert coord.check_agents() == 1
    assert events(tmp_path, "coordinator_stepped_down") and not events(tmp_path, "node_lost")
    assert "stepped down" in events(tmp_path, "job_finished")[-1]["message"]


def test_a_coordinator_that_hears_a_majority_finds_the_silent_node_lost(tmp_path: Path) -> None:
    """Only node 2 falls silent: 2 of 3 agents heard is a majority; node 2 is lost as before, and
    the electorate (counted with everyone heard) does not shrink while it is silent."""
    coord, clock, _sent = _three_nodes(tmp_path)
    hello_all(coord)
    coord.check_agents()
    clock.now += coord.spec.heartbeat_timeout + 0.1
    coord.members.agents[1].last_seen = clock()
    coord.check_agents()
    assert not events(tmp_path, "coordinator_stepped_down")
    assert events(tmp_path, "node_lost")[0]["detail"]["node_lost"] == 2
    assert coord.members.electorate == 3 and hard_state(coord)["electorate"] == 3


def test_without_a_standby_elsewhere_a_coordinator_never_steps_down(tmp_path: Path) -> None:
    """Two nodes (no majority without node 0 is possible) or no standby: node 1's silence is its
    loss, as before."""
    from ftrun.coordinator.agents import RemoteAgent

    coord, _agent, clock = make(tmp_path, world=4, local=2)
    coord.members.agents[1] = RemoteAgent(node=1, identity=b"agent-1", send_frame=lambda i, t, f: None, last_seen=clock())
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    coord.check_agents()
    clock.now += coord.spec.heartbeat_timeout + 0.1
    coord.check_agents()
    assert not events(tmp_path, "coordinator_stepped_down") and events(tmp_path, "node_lost")


@pytest.fixture()
def seat(tmp_path: Path) -> Any:
    """Node 1's standby seat on the loopback address, with a 3-node job's hard state."""
    from ftrun.coordinator.seat import StandbySeat

    spec = JobSpec(script="train.py", worker_num=6, local_worker_num=2, node_rank=1, master_addr="127.0.0.1",
                   master_port=1, log_dir=str(tmp_path), checkpoint_dir=str(tmp_path / "ckpt"))
    seat = StandbySeat(spec, TOKEN)
    seat.state = {"electorate": 3}
    yield seat
    seat.control.close()
    seat.ctx.term()


def _dealer_to(seat: Any, identity: bytes) -> Any:
    import zmq

    sock = seat.ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.IDENTITY, identity)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(seat.control.address)
    return sock


def test_a_standby_takes_over_a_silent_coordinator_only_with_a_majority(seat: Any) -> None:
    """Alone it is 1 of 3: no takeover. An agent that lost the coordinator too says hello on its
    endpoint: 2 of 3, a majority. What it read to count is handed, in order, to the coordinator
    it becomes, before anything that arrives later."""
    import time

    from ftrun.common.protocol import CONTROL, Sender, encode

    assert seat.votes() == (1, 3) and not seat.elected()
    rank = _dealer_to(seat, b"r-rank2")
    rank.send(encode(MsgType.HELLO, Sender(TOKEN), CONTROL, rank=2, incarnation=0, pid=12, generation=1,
                     replica_group=[0, 1, 2], library=True, rejoin=True))
    agent = _dealer_to(seat, b"a-node2")
    agent.send(encode(MsgType.AGENT_HELLO, Sender(TOKEN), CONTROL, node=-1, pid=7, host="h2"))
    deadline = time.monotonic() + 10
    while not seat.elected() and time.monotonic() < deadline:
        time.sleep(0.02)
    assert seat.votes() == (2, 3) and seat.elected()
    got: list[tuple[bytes, str]] = []
    seat.control.serve(on_agent=lambda i, m, fd: got.append((i, m.type.value)),
                       on_rank=lambda i, m: got.append((i, m.type.value)), on_reject=lambda *_: None, protected=set)
    seat.control.read()
    assert got == [(b"r-rank2", "hello"), (b"a-node2", "agent_hello")]
    rank.close(0)
    agent.close(0)


def test_a_rank_moves_to_the_standby_when_its_coordinator_falls_silent(tmp_path: Path) -> None:
    """The coordinator told the rank where the standby is, with a silence timeout, then said
    nothing more (a partition: no closed connection). The rank's channel moves to the standby and
    says hello again there, as the same process and incarnation (``rejoin``)."""
    import time

    import zmq

    from ftrun.rank.channel import Channel
    from ftrun.coordinator.control import ControlPlane

    ctx = zmq.Context()
    old, new = (ControlPlane(ctx, TOKEN, "127.0.0.1", "127.0.0.1") for _ in range(2))
    heard: dict[str, list[tuple[bytes, Any]]] = {"old": [], "new": []}
    for name, plane in (("old", old), ("new", new)):
        plane.serve(on_agent=lambda i, m, fd: None, on_rank=lambda i, m, name=name: heard[name].append((i, m)),
                    on_reject=lambda *_: None, protected=set)
    channel = Channel(old.address, TOKEN, rank=3, incarnation=2, heartbeat_interval=0.05)
    try:
        channel.send(MsgType.HELLO, pid=42, generation=0, replica_group=[3], library=True)
        deadline = time.monotonic() + 10
        while not any(m.type == MsgType.HELLO for _i, m in heard["old"]) and time.monotonic() < deadline:
            old.read()
            time.sleep(0.01)
        identity = next(i for i, m in heard["old"] if m.type == MsgType.HELLO)
        old.send(identity, MsgType.STANDBY, {"control": new.address, "store": "127.0.0.1:1", "epoch": 0, "timeout": 0.5})
        while not any(m.type == MsgType.HELLO for _i, m in heard["new"]) and time.monotonic() < deadline:
            new.read()
            time.sleep(0.01)
        hello = next(m for _i, m in heard["new"] if m.type == MsgType.HELLO)
        assert (hello["rank"], hello["incarnation"], hello["pid"], hello.get("rejoin")) == (3, 2, 42, True)
    finally:
        channel.close()
        old.close()
        new.close()
        ctx.term()


def test_a_standby_whose_index_another_agent_took_at_once_is_replaced(tmp_path: Path) -> None:
    """Node 1 (the standby) is lost and a standby node takes its index in the same turn: the
    new node 1 holds no seat, so the coordinator asks it (the lowest index) to stand by instead of
    sending its state to an agent that cannot take over."""
    from ftrun.coordinator.agents import RemoteAgent

    coord, clock, sent = _three_nodes(tmp_path)
    coord.members.agents[1] = RemoteAgent(node=1, identity=b"agent-1b", send_frame=lambda i, t, f: sent.append((i, t)),
                                          last_seen=clock())
    coord.failover.replicate(clock())
    assert coord.failover.node is None and (b"agent-1b", MsgType.STAND_BY) in sent
    assert (b"agent-1b", MsgType.STATE) not in sent


@pytest.mark.parametrize("silent_for, takes_over", [(2.0, True), (14.0, False)])
def test_a_standby_cut_off_longer_than_a_nodes_timeout_takes_no_job_over_on_a_closed_connection(
        silent_for: float, takes_over: bool) -> None:
    """The first standby in line sees its coordinator's connection close. Heard from within the
    node timeout, it takes the job over (the coordinator's processes died). Cut off for longer, its
    node may have been taken for lost and replaced, and the job may even have ended (the
    coordinator's normal exit closes the connection too): it stops its ranks instead, and never
    runs a second coordinator."""
    from types import SimpleNamespace

    from ftrun.node.agent import NodeAgent, Turn

    agent = NodeAgent.__new__(NodeAgent)
    moved: list[bool] = []
    failed: list[str] = []
    agent.link = SimpleNamespace(closed="closed", gone=lambda: True, frames=lambda: [], node=0, at_seat=False, proven=True)
    agent.exit_code, agent.stop_signal, agent.coordinator_timeout = None, None, 5.0
    agent.succession = SimpleNamespace(first_in_line=lambda: True, dead=[])
    agent.clock = lambda: 1000.0
    agent._last_heard = 1000.0 - silent_for
    agent._move_along_line = lambda _poller, proven: moved.append(proven) or Turn.HANDED_OVER  # type: ignore[method-assign]
    agent._fail = failed.append  # type: ignore[method-assign]
    turn = agent._follow_closed_connection(None, {"closed": 1})  # type: ignore[arg-type]
    if takes_over:
        assert (turn, moved, failed) == (Turn.HANDED_OVER, [True], [])
    else:
        assert turn is Turn.NEXT and moved == [] and "does not take the job over" in failed[0]


def test_a_large_jobs_hard_state_is_built_once_per_period_whatever_seat_has_no_agent_yet(tmp_path: Path,
                                                                                         monkeypatch) -> None:
    """Above REPLICA_RANKS_PER_S ranks the hard state is built and sent once per ranks /
    REPLICA_RANKS_PER_S seconds unless forced; a seat kept from the line before a takeover (no agent
    has offered it here yet, so it is sent nothing) does not make every pass build it."""
    import ftrun.coordinator.failover as failover
    from ftrun.coordinator.agents import RemoteAgent
    from ftrun.coordinator.failover import Seat

    monkeypatch.setattr(failover, "REPLICA_RANKS_PER_S", 2)  # 4 ranks: a period of 2 s
    built: list[int] = []
    real = failover.hard_state
    monkeypatch.setattr(failover, "hard_state", lambda job, rows=True: built.append(1) or real(job, rows))
    coord, _agent, clock = make(tmp_path, world=4)
    hello_all(coord)
    sent: list[MsgType] = []
    coord.members.agents[1] = RemoteAgent(node=1, identity=b"agent-1", last_seen=clock.now,
                                          send_frame=lambda _i, t, _f: sent.append(t))
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    coord.failover.seats.append(Seat(2, None, "tcp://10.0.0.3:7777", "10.0.0.3:8888"))
    coord.failover.replicate(clock.now, force=True)
    assert sent.count(MsgType.STATE) == 1 and len(built) == 1
    for _ in range(3):  # passes within the period: nothing built, nothing sent
        clock.now += 0.5
        coord.failover.replicate(clock.now)
    assert sent.count(MsgType.STATE) == 1 and len(built) == 1
    clock.now += 0.6  # past the period
    coord.failover.replicate(clock.now)
    assert sent.count(MsgType.STATE) == 2 and len(built) == 2


def test_a_large_jobs_round_start_sends_a_standby_the_head_of_its_state_which_it_merges(tmp_path: Path,
                                                                                      monkeypatch) -> None:
    """Above REPLICA_RANKS_PER_S ranks a forced replica (a round's start) is the state's head alone,
    once the standby holds a whole state: the standby keeps its rows and takes the new generation,
    and a takeover from it restores that generation. The first forced one is whole."""
    from types import SimpleNamespace

    import ftrun.coordinator.failover as failover
    from ftrun.coordinator.agents import RemoteAgent
    from ftrun.node.succession import Succession

    monkeypatch.setattr(failover, "REPLICA_RANKS_PER_S", 2)  # 4 ranks: a large job
    coord, _agent, clock = make(tmp_path, world=4)
    hello_all(coord)
    seat = Succession(SimpleNamespace(state=None))
    sent: list[dict[str, Any]] = []

    def to_standby(_identity: bytes, msg_type: MsgType, fields: dict[str, Any]) -> None:
        if msg_type == MsgType.STATE:
            sent.append(fields["state"])
            seat.hold_state(fields["state"])

    coord.members.agents[1] = RemoteAgent(node=1, identity=b"agent-1", last_seen=clock.now, send_frame=to_standby)
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    seat.hold_state({"generation": 7})  # a head with no whole state held: dropped
    assert seat.seat.state is None
    coord.failover.replicate(clock.now, force=True)
    assert len(sent) == 1 and len(sent[0]["ranks"]) == 4 and seat.seat.state == sent[0]
    rows = sent[0]["ranks"]
    coord.state.next_generation()
    coord.failover.replicate(clock.now, force=True)
    assert len(sent) == 2 and "ranks" not in sent[1] and "groups" not in sent[1]
    assert sent[1]["generation"] == coord.generation == 1
    assert seat.seat.state["ranks"] == rows and seat.seat.state["generation"] == 1
    assert seat.seat.state == {**hard_state(coord), "ranks": rows}
    again, _, _ = make(tmp_path / "again", world=4)
    restore(again, seat.seat.state)
    assert again.generation == 1 and again.epoch == coord.epoch + 1


@pytest.mark.parametrize("nodes, beats", [(4, 4), (2048, 2)])
def test_the_beat_to_the_ranks_of_a_large_job_is_paced_as_the_agents_beats_are(nodes: int, beats: int) -> None:
    """Once a heartbeat interval, and in a job of more than 1,000 nodes as seldom as the agents'
    own beats (2 s at 2,048 nodes, 2.5 beats a silence timeout): its frames to the agents are
    their beats then."""
    from types import SimpleNamespace

    from ftrun.coordinator.failover import Replication

    sent: list[Any] = []
    spec = JobSpec(script="train.py", worker_num=2 * nodes, local_worker_num=2, heartbeat_interval=1.0)
    job = SimpleNamespace(spec=spec, epoch=0, ranks={}, members=SimpleNamespace(agents=dict.fromkeys(range(nodes))),
                          rounds=SimpleNamespace(send_order=lambda ranks, order, fields: sent.append((order, fields))))
    replication = Replication(job)  # type: ignore[arg-type]
    replication._announced = True
    for now in (10.0, 11.0, 11.5, 12.0, 13.0):
        replication.beat_ranks(now)
    assert len(sent) == beats and all(order == MsgType.STANDBY for order, _ in sent)
    assert silence_timeout(spec) / 2.5 >= 2.0


def test_a_rounds_orders_are_the_ranks_beat(tmp_path: Path) -> None:
    """Any frame is a beat to a rank: the beat due at a round's start is not sent beside its
    abort, and the next one comes a whole period after the round's last order to every rank."""
    coord, agent, clock = make(tmp_path, world=4)
    standby = StandbyAgent(1)
    coord.members.agents[1] = standby
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    hello_all(coord)
    orders: list[MsgType] = []
    send_order = coord.rounds.send_order
    coord.rounds.send_order = lambda ranks, order, common, own=None: (orders.append(order), send_order(ranks, order, common, own))
    clock.now += 5.0
    coord.failover.replicate(clock())
    assert orders == [MsgType.STANDBY]
    clock.now += 5.0  # a beat is due, and rank 3 dies
    agent.exit(3, 9)
    coord.check_processes()
    assert orders == [MsgType.STANDBY, MsgType.ABORT]
    coord.failover.replicate(clock())
    clock.now += 0.5
    coord.failover.replicate(clock())
    assert orders == [MsgType.STANDBY, MsgType.ABORT]
    clock.now += coord.spec.heartbeat_interval
    coord.failover.replicate(clock())
    assert orders == [MsgType.STANDBY, MsgType.ABORT, MsgType.STANDBY]
