"""Coordinator failover without processes (issue 24 item 1): the hard state a standby is sent
restores a coordinator as it was (the epoch moved on); a takeover makes the dead coordinator's node
a lost node whose ranks are respawned from replicas; a rank that heard of a newer generation from
the dead coordinator than the standby was told moves the round beyond it; the standby is announced
to ranks and sent the state when a decision changes it, not when only committed steps move.
(The real thing, on namespace hosts: test_multinode.py::test_node0_lost_the_standby_coordinator_takes_over.)"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from test_coordinator import TOKEN, Clock, FakeAgent, _close_coordinators, _made, events, hello_all, ident, make, msg, send, step  # noqa: F401

from ftrun.config import JobSpec
from ftrun.coordinator import Coordinator
from ftrun.coordinator.failover import hard_state, restore
from ftrun.policy import RankState
from ftrun.protocol import MsgType


class StandbyAgent(FakeAgent):
    """A fake remote agent that records what the coordinator sends its standby."""

    def __init__(self, node: int) -> None:
        super().__init__(node)
        self.states: list[dict[str, Any]] = []
        self.announced: list[tuple[str, str, int]] = []

    def replicate(self, state: dict[str, Any]) -> None:
        self.states.append(state)

    def announce_standby(self, control: str, store: str, epoch: int) -> None:
        self.announced.append((control, store, epoch))


@pytest.fixture()
def store() -> Any:
    from ftrun.stores import serve_store

    served, port = serve_store("127.0.0.1", 0, 10)
    yield port
    del served


def _standby_of(tmp_path: Path, port: int, clock: Clock) -> Coordinator:
    """Node 1's coordinator as a takeover builds it (its own agent local, the store its own)."""
    (tmp_path / "new").mkdir()
    spec = JobSpec(script="train.py", worker_num=4, local_worker_num=2, node_rank=1, master_addr="127.0.0.1",
                   master_port=port, log_dir=str(tmp_path / "new"), checkpoint_dir=str(tmp_path / "ckpt"))
    coord = Coordinator(spec, TOKEN, None, port, local_agent=FakeAgent(1), clock=clock)
    _made.append(coord)  # closed after the test (its ZeroMQ context would block the interpreter's exit)
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


def test_a_takeover_recovers_the_dead_coordinators_node_from_replicas(tmp_path: Path, store: int) -> None:
    clock = Clock()
    new = _standby_of(tmp_path, store, clock)
    state = {"epoch": 0, "attempt": 0, "generation": 2, "restarts_used": 1, "run_id": "job", "lost_nodes": {},
             "ranks": [[r, 0, 100 + r, True, [0, 1, 2, 3], 0, "healthy", 40 + r % 2, True] for r in range(4)]}
    new.take_over(state, lost=0)
    assert new.epoch == 1 and new.generation == 3  # the round after the dead coordinator's generation
    takeover = events(tmp_path / "new", "coordinator_takeover")
    assert takeover and takeover[0]["detail"]["lost"] == 0
    lost = events(tmp_path / "new", "node_lost")
    assert lost[0]["detail"]["node_lost"] == 0 and lost[0]["detail"]["cause"] == "coordinator_lost"
    assert [new.ranks[r].incarnation for r in range(4)] == [1, 1, 0, 0]  # node 0's ranks respawned, node 1's kept
    assert [o[0] for o in new.members.pending_spawns[0]] == [0, 1]  # started once a launcher takes index 0
    assert new.members.waiting_for and 0 in new.members.waiting_for
    assert new.restarts_used == 3
    # node 1's ranks say hello again on the new endpoint (same pid and incarnation) and are told
    # the round's generation; their answers with the committed step make the plan once the new
    # ranks joined
    for rank in (2, 3):
        new.handle(ident(rank, 0), msg(MsgType.HELLO, rank=rank, incarnation=0, pid=100 + rank, generation=2,
                                       replica_group=[0, 1, 2, 3], library=True, rejoin=True, seen=2))
        assert new.ranks[rank].proc.state == RankState.RECOVERING
        send(new, rank, MsgType.FAULT, generation=3, step=41, committed=40, reason="abort", kind="abort")
    assert new.rounds.current is not None and new.rounds.current.reports == {2: 40, 3: 40}


def test_a_rank_that_heard_of_a_newer_generation_moves_the_round_beyond_it(tmp_path: Path, store: int) -> None:
    """The dead coordinator sent an abort for generation 3 that the standby was not told of: the
    rank that saw it says so (``seen``), and the round goes to generation 4 (an abort at or below
    what a rank has seen would be ignored by it)."""
    new = _standby_of(tmp_path, store, Clock())
    state = {"epoch": 0, "attempt": 0, "generation": 2, "restarts_used": 0, "run_id": "job", "lost_nodes": {},
             "ranks": [[r, 0, 100 + r, True, [0, 1, 2, 3], 0, "healthy", 40, True] for r in range(4)]}
    new.take_over(state, lost=0)
    assert new.generation == 3
    new.handle(ident(2, 0), msg(MsgType.HELLO, rank=2, incarnation=0, pid=102, generation=2, replica_group=[0, 1, 2, 3],
                                library=True, rejoin=True, seen=3))
    assert new.generation == 4 and new.rounds.current is not None and new.rounds.current.generation == 4


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
    from ftrun.agent import RemoteAgent

    coord, _agent, clock = make(tmp_path, world=6, local=2)
    sent: list[tuple[bytes, MsgType]] = []
    for node in (1, 2):
        coord.members.agents[node] = RemoteAgent(node=node, identity=f"agent-{node}".encode(),
                                                 send_frame=lambda i, t, f: sent.append((i, t)), last_seen=clock())
    coord.failover.on_standby(1, "tcp://10.0.0.2:5555", "10.0.0.2:6666")
    coord.members.lose(1, "node 1 lost")
    coord.failover.replicate(clock())
    assert coord.failover.node is None and (b"agent-2", MsgType.STAND_BY) in sent
    coord.failover.replicate(clock())  # asked once per heartbeat timeout, not every turn
    assert sent.count((b"agent-2", MsgType.STAND_BY)) == 1
    coord.agents[2].on_message(msg(MsgType.AGENT_BEAT, node=2, standby_control="tcp://10.0.0.3:7777",
                                   standby_store="10.0.0.3:8888"), clock())
    coord.collect_reports()
    assert (coord.failover.node, coord.failover.store) == (2, "10.0.0.3:8888")
    coord.failover.replicate(clock())
    assert (b"agent-2", MsgType.STATE) in sent
