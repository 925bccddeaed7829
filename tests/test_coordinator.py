"""The job coordinator without processes (:mod:`coordinator_fixtures`: fake node agents, fake
rank messages, an injected clock)."""

from __future__ import annotations

import json
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from ftrun.coordinator import OFFENDER_REJECTS, PLAN_DEADLINE_S, REPORT_DEADLINE_S, Coordinator
from ftrun.coordinator.policy import STARTUP_HOLD_S, STARTUP_WINDOW_S
from ftrun.common.protocol import MsgType
from ftrun.coordinator.agents import RemoteAgent
from ftrun.node.spawner import ExitReport

from coordinator_fixtures import (TOKEN, Clock, FakeAgent, beat, beat_all, begin, board, close_coordinators,  # noqa: F401
                                  events, hello_all, ident, kinds, make, msg, recover, send, step)

def test_every_rank_is_spawned_through_its_nodes_agent(tmp_path: Path) -> None:
    coord, agent, _ = make(tmp_path)
    assert [s[:3] for s in agent.spawned] == [(0, 0, False), (1, 0, False), (2, 0, False), (3, 0, False)]
    env = agent.spawned[2][3]
    assert env["RANK"] == "2" and env["WORLD_SIZE"] == "4"
    # The secret never travels: the node's agent adds it (RankProcesses.environment).
    assert all(TOKEN not in value for spawned in agent.spawned for value in spawned[3].values())
    assert kinds(tmp_path).count("rank_started") == 4


def test_death_is_recovered_by_respawning_only_that_rank(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    step(coord, 0)
    agent.exit(2, -signal.SIGKILL, at=clock.now)
    assert coord.check_processes() is None
    assert agent.spawned[-1][:3] == (2, 1, True)  # incarnation 1, in a warm spare
    assert coord.check_processes() is None  # the spawn report
    for rank in (0, 1, 3):
        send(coord, rank, MsgType.FAULT, generation=1, step=1, committed=0, reason="abort")
    hello_all(coord, [2])  # the new rank's hello is its report: it holds no state
    plan = events(tmp_path, "recovery_planned")[-1]["detail"]
    assert plan["step"] == 0 and plan["transfers"][0][1] == 2
    for rank in range(4):
        send(coord, rank, MsgType.RECOVERED, generation=1, role="recipient" if rank == 2 else "none", bytes=10, seconds=0.1)
    assert events(tmp_path, "recovery_finished")[-1]["detail"]["resume_step"] == 1
    assert coord.recovery is None and coord.restarts_used == 1


def test_the_garbage_collector_waits_in_a_rounds_first_seconds_and_runs_again_after(tmp_path: Path) -> None:
    import gc

    from ftrun.coordinator.collector import ROUND_GC_HOLD_S

    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    with coord.collector.armed():  # as in run()'s loop
        agent.exit(2, -signal.SIGKILL, at=clock.now)
        assert coord.check_processes() is None and coord.recovery is not None
        assert not gc.isenabled()  # from the round's start
        clock.now += ROUND_GC_HOLD_S - 0.1
        coord.collector.hold()
        assert not gc.isenabled()
        clock.now += 0.2  # the round goes on past its first seconds: the collector runs again
        coord.collector.hold()
        assert gc.isenabled() and coord.recovery is not None
    assert gc.isenabled()


def test_the_garbage_collector_runs_again_when_the_loop_ends_in_a_round(tmp_path: Path) -> None:
    import gc

    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    agent.exit(2, -signal.SIGKILL, at=clock.now)
    assert coord.check_processes() is None and coord.recovery is not None
    assert gc.isenabled()  # a coordinator driven without its main loop leaves the collector be
    with coord.collector.armed():
        coord.collector.hold()
        assert not gc.isenabled()
    assert gc.isenabled()  # the job ended in the round's first seconds


def test_the_garbage_collector_runs_again_when_the_round_ends(tmp_path: Path) -> None:
    import gc

    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    with coord.collector.armed():
        agent.exit(2, -signal.SIGKILL, at=clock.now)
        assert coord.check_processes() is None and not gc.isenabled()
        assert coord.check_processes() is None
        recover(coord, 2)
        assert coord.recovery is None
        coord.collector.hold()  # the loop's next turn
        assert gc.isenabled()


def test_late_answer_to_the_abort_is_not_a_failed_plan(tmp_path: Path) -> None:
    # UCE: the rank's own report counts as its answer, so the plan can be made before its answer
    # to the abort arrives; that answer must not be taken for "the plan failed" (a second round
    # was started in CI, and the recipient, mid-transfer, was later replaced as hung).
    coord, _, _ = make(tmp_path)
    hello_all(coord)
    step(coord, 0)
    send(coord, 3, MsgType.FAULT, generation=0, step=1, committed=-1, reason="recoverable error at step 1: X", kind="recoverable")
    assert coord.recovery is not None and coord.recovery.generation == 1
    for rank in (0, 1, 2):
        send(coord, rank, MsgType.FAULT, generation=1, step=1, committed=0, reason="abort", kind="abort")
    assert events(tmp_path, "recovery_planned")[-1]["detail"]["transfers"][0][1] == 3
    send(coord, 3, MsgType.FAULT, generation=1, step=1, committed=-1, reason="abort", kind="abort")
    assert len(events(tmp_path, "recovery_started")) == 1 and coord.recovery.generation == 1
    for rank in range(4):
        send(coord, rank, MsgType.RECOVERED, generation=1, role="recipient" if rank == 3 else "none", bytes=10, seconds=0.1)
    assert coord.recovery is None and events(tmp_path, "recovery_finished")[-1]["detail"]["resume_step"] == 1
    # A failure carrying out the plan still starts the next round.
    send(coord, 3, MsgType.FAULT, generation=1, step=1, committed=0, reason="recoverable error at step 2: X", kind="recoverable")
    send(coord, 0, MsgType.FAULT, generation=2, step=2, committed=1, reason="abort", kind="abort")
    for rank in (1, 2):
        send(coord, rank, MsgType.FAULT, generation=2, step=2, committed=1, reason="abort", kind="abort")
    assert coord.recovery.plan is not None
    send(coord, 0, MsgType.FAULT, generation=2, step=2, committed=1, reason="state transfer failed", kind="comm")
    assert coord.recovery.generation == 3


def test_a_collective_that_fails_on_a_rank_being_killed_as_hung_waits_for_its_death(tmp_path: Path) -> None:
    # CI: the watchdog killed a hung rank 3; rank 0's all-reduce failed on its closed connection and
    # that report came before rank 3's exit, so an HCCE round started, then was restarted by the
    # death. The death alone starts the round; rank 0 answers its abort.
    from ftrun.coordinator.watchdog import Hung

    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    step(coord, 0)
    coord.declare_hung(coord.ranks[3], Hung(3, "no_progress", "no step progress (test)", clock.now))
    send(coord, 0, MsgType.FAULT, generation=0, step=1, committed=0, reason="gradient all-reduce failed: closed", kind="comm")
    assert coord.recovery is None and not events(tmp_path, "recovery_started")
    assert coord.check_processes() is None  # rank 3's exit: the round for its death
    started = events(tmp_path, "recovery_started")
    assert len(started) == 1 and started[0]["detail"]["fault"] != "comm_error", started
    assert [e["rank"] for e in events(tmp_path, "rank_failed")] == [3]
    # Without a rank being killed, the same report is a communication error repaired in place.
    (tmp_path / "b").mkdir()
    coord2, _, _ = make(tmp_path / "b")
    hello_all(coord2)
    send(coord2, 0, MsgType.FAULT, generation=0, step=1, committed=0, reason="gradient all-reduce failed: closed", kind="comm")
    assert events(tmp_path / "b", "recovery_started")[0]["detail"]["fault"] == "comm_error"


def test_done_is_a_claim_the_job_ends_when_processes_exit(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    for rank in range(4):
        send(coord, rank, MsgType.DONE, committed=99)
    assert coord.check_processes() is None, "a 'done' message ended the job"
    clock.now += 60  # code after ft.finish() runs without heartbeats: not a hang
    coord.check_hangs()
    assert agent.hung == []
    for rank in range(4):
        agent.exit(rank, 0)
    assert coord.check_processes() == 0


def test_diverged_done_claims_are_reported(tmp_path: Path) -> None:
    coord, _, _ = make(tmp_path)
    hello_all(coord)
    send(coord, 0, MsgType.DONE, committed=99)
    send(coord, 1, MsgType.DONE, committed=250)
    assert any("different committed steps" in e["message"] for e in events(tmp_path, "warning"))


def test_frozen_rank_is_found_by_its_missing_heartbeats(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, heartbeat_timeout=5.0)
    hello_all(coord)
    clock.now += 4.0
    beat_all(coord)
    clock.now += 4.0
    for rank in (0, 1, 3):
        send(coord, rank, MsgType.HEARTBEAT)
    coord.check_hangs()
    assert agent.hung == []
    clock.now += 1.5
    coord.check_hangs()
    assert agent.hung == [(2, True)]
    coord.check_processes()
    hung = events(tmp_path, "rank_hung")
    assert hung[0]["rank"] == 2 and hung[0]["detail"]["fault"] == "no_heartbeat"


def test_the_watchdog_walks_a_large_job_once_per_its_period(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Above WATCHDOG_RANKS_PER_S ranks (lowered here to 2: the 4 ranks are "large"), a walk over
    the rank table is taken at most once per ranks / WATCHDOG_RANKS_PER_S seconds (here 2 s); a
    frozen rank is found at the first walk after that."""
    from ftrun.coordinator import failures

    monkeypatch.setattr(failures, "WATCHDOG_RANKS_PER_S", 2)
    coord, agent, clock = make(tmp_path, heartbeat_timeout=5.0)
    hello_all(coord)
    coord.check_hangs()  # the first walk: nothing late
    for _ in range(3):
        clock.now += 1.9
        for rank in (0, 1, 3):
            send(coord, rank, MsgType.HEARTBEAT)
        coord.check_hangs()
    # rank 2 has been silent for 5.7 s, past its 5 s timeout: the walk at 3.8 s was too early, the next is due at 5.8 s
    assert agent.hung == []
    clock.now += 0.2
    coord.check_hangs()
    assert agent.hung == [(2, True)]


def test_rank_stuck_inside_the_collective_it_announced_is_the_culprit(tmp_path: Path) -> None:
    """Every rank said 'collective'; the heartbeat thread of rank 3 sees it outside torch.distributed
    (an endless loop in its own code): rank 3 is hung, not the communication."""
    coord, agent, clock = make(tmp_path, step_timeout=10.0)
    hello_all(coord)
    step(coord, 0)
    for rank in range(4):
        begin(coord, rank, 1, collective=True)
    for t in range(12):
        clock.now += 1.0
        for rank in range(4):
            send(coord, rank, MsgType.HEARTBEAT, in_dist=rank != 3)
        coord.check_hangs()
    assert agent.hung == [(3, True)]
    assert not events(tmp_path, "recovery_started"), "taken for a communication hang"


@pytest.mark.parametrize("how", ["behind", "silent"])
def test_a_rank_whose_step_board_is_stale_is_the_culprit_not_the_communication(tmp_path: Path, how: str) -> None:
    """A rank's step transitions ride its heartbeats. A rank that dies or sticks
    holding the GIL stops beating, and its last board may say "collective" of an earlier step:
    it is the culprit (a respawn), never taken for a communication hang (a whole-job restart
    without HCCE). Seen in CI: a rank raising in its update while it unwound."""
    coord, agent, clock = make(tmp_path, step_timeout=10.0, heartbeat_timeout=30.0)
    hello_all(coord)
    step(coord, 0)
    for rank in range(4):
        begin(coord, rank, 1, collective=True)
    if how == "behind":
        for rank in range(3):
            step(coord, 1, [rank])
            begin(coord, rank, 2, collective=True)
    for _ in range(12):
        clock.now += 1.0
        for rank in range(4 if how == "behind" else 3):
            beat(coord, rank, in_dist=True)
        coord.check_hangs()
        if agent.hung:
            break
    assert agent.hung == [(3, True)]
    assert not events(tmp_path, "recovery_started"), "taken for a communication hang"
    coord.check_processes()
    assert ("behind its peers' step 2" if how == "behind" else "its heartbeats stopped") in events(tmp_path, "rank_hung")[0]["message"]


def test_every_rank_waiting_in_the_collective_is_a_communication_hang(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, step_timeout=10.0)
    hello_all(coord)
    step(coord, 0)
    for rank in range(4):
        begin(coord, rank, 1, collective=True)
    for _ in range(12):
        clock.now += 1.0
        beat_all(coord, in_dist=True)
        coord.check_hangs()
    assert agent.hung == []
    assert events(tmp_path, "recovery_started")[0]["detail"]["fault"] == "comm_error"


def test_setup_hang_blames_only_the_rank_the_others_wait_for(tmp_path: Path) -> None:
    """Rank 0 hangs before its initial broadcast; ranks 1-3 wait in it. Only rank 0 is hung
    (round 2 found all four killed one after another, and the restart budget spent)."""
    coord, agent, clock = make(tmp_path, setup_timeout=40.0)
    hello_all(coord)
    for _ in range(45):
        clock.now += 1.0
        for rank in range(4):
            send(coord, rank, MsgType.HEARTBEAT, in_dist=rank != 0)
        coord.check_hangs()
        coord.check_processes()
    assert [rank for rank, _ in agent.hung] == [0]


def test_recovery_round_has_a_deadline(tmp_path: Path) -> None:
    """A survivor that never answers the abort (hung in its own code) is replaced, not waited for."""
    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    step(coord, 0)
    agent.exit(1, -signal.SIGKILL, at=clock.now)
    coord.check_processes()
    coord.check_processes()
    for rank in (0, 2):
        send(coord, rank, MsgType.FAULT, generation=1, step=1, committed=0, reason="abort")
    hello_all(coord, [1])
    coord.check_processes()
    agent.exit(2, -signal.SIGKILL, at=clock.now)  # a second death: round 2; the new rank 1 is still setting up
    coord.check_processes()
    coord.check_processes()
    send(coord, 0, MsgType.FAULT, generation=coord.generation, step=1, committed=0, reason="abort")
    clock.now += REPORT_DEADLINE_S - 1
    beat_all(coord)
    coord.check_hangs()
    assert agent.hung == []
    clock.now += 2
    beat_all(coord)
    coord.check_hangs()
    assert [rank for rank, _ in agent.hung] == [3], "only the survivor that did not answer; not the new rank in set-up"


def planned_recovery_of_rank_1(tmp_path: Path) -> tuple[Coordinator, FakeAgent, Clock, int]:
    """Rank 1 died after step 0, the survivors answered the abort, its new incarnation said hello:
    the plan is out. Returns the coordinator, its agent, the clock and the plan's donor."""
    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    step(coord, 0)
    agent.exit(1, -signal.SIGKILL, at=clock.now)
    coord.check_processes()
    coord.check_processes()
    for rank in (0, 2, 3):
        send(coord, rank, MsgType.FAULT, generation=1, step=1, committed=0, reason="abort")
    hello_all(coord, [1])
    assert coord.recovery is not None and coord.recovery.plan is not None
    return coord, agent, clock, coord.recovery.plan.transfers[0].donor


def test_plan_deadline_spares_ranks_waiting_in_torch_distributed(tmp_path: Path) -> None:
    coord, agent, clock, donor = planned_recovery_of_rank_1(tmp_path)
    clock.now += PLAN_DEADLINE_S + 1
    for rank in range(4):  # the donor is stuck mid-transfer in its own code; the others wait
        send(coord, rank, MsgType.HEARTBEAT, in_dist=rank != donor)
    coord.check_hangs()
    assert [rank for rank, _ in agent.hung] == [donor]


@pytest.mark.parametrize("stuck", ["recipient", "donor"])
def test_a_rank_stuck_in_its_own_code_during_the_transfer_is_replaced_within_seconds(tmp_path: Path, stuck: str) -> None:
    """Round 3: the new rank hung before receiving (``rejoin``) held the job until the 300 s set-up
    timeout (it had not begun a step, so the round's deadlines skipped it); a donor hung mid-transfer
    until the 60 s plan deadline. Its peers waiting in torch.distributed name it within seconds,
    with a bound that grows with the bytes moved; a rank waiting for its plan is never blamed."""
    from ftrun.coordinator import STALL_BASE_S, STALL_MIN_BYTES_PER_S

    coord, agent, clock, donor = planned_recovery_of_rank_1(tmp_path)
    culprit = 1 if stuck == "recipient" else donor
    nbytes = 200_000_000
    bound = STALL_BASE_S + nbytes / STALL_MIN_BYTES_PER_S

    def beat() -> None:
        for rank in range(4):
            if rank == culprit:
                send(coord, rank, MsgType.HEARTBEAT, in_dist=False, stage="transfer", stage_bytes=nbytes)
            elif rank in (1, donor):
                send(coord, rank, MsgType.HEARTBEAT, in_dist=True, stage="transfer", stage_bytes=nbytes)
            else:  # outside the transfer: waits for the others' in its own code, never blamed
                send(coord, rank, MsgType.HEARTBEAT, in_dist=False, stage="wait_plan")

    beat()
    clock.now += bound - 0.5
    beat()
    coord.check_hangs()
    assert agent.hung == []
    clock.now += 1.0
    beat()
    coord.check_hangs()
    assert [rank for rank, _ in agent.hung] == [culprit]
    assert "during the state transfer" in coord.ranks[culprit].proc.kill_reason


def test_a_rank_stuck_before_the_initial_broadcast_is_named_by_its_waiting_peers(tmp_path: Path) -> None:
    """The ``init`` case: every peer waits in the broadcast, one rank is in its own code; before,
    only the 300 s set-up timeout ended it. Nobody is blamed while nobody waits for it."""
    coord, agent, clock = make(tmp_path)
    hello_all(coord)
    for rank in range(4):
        send(coord, rank, MsgType.HEARTBEAT, in_dist=False, stage="init")
    clock.now += 30
    for rank in range(4):
        send(coord, rank, MsgType.HEARTBEAT, in_dist=False, stage="init")
    coord.check_hangs()
    assert agent.hung == []
    for rank in range(4):
        send(coord, rank, MsgType.HEARTBEAT, in_dist=rank != 3, stage="init")
    clock.now += 30
    for rank in range(4):
        send(coord, rank, MsgType.HEARTBEAT, in_dist=rank != 3, stage="init")
    coord.check_hangs()
    assert [rank for rank, _ in agent.hung] == [3]


def test_the_failure_summary_shows_the_first_incarnations_traceback(tmp_path: Path) -> None:
    """A rank that crashes the same way in every incarnation; the summary showed
    the last incarnation's log (a warning), not the first one's traceback, and never said that
    every incarnation had failed alike."""
    coord, agent, clock = make(tmp_path, max_restarts=1)
    first = ("Traceback (most recent call last):", '  File "train.py", line 9', "KeyError: 'labels'")
    later = ("UserWarning: something unrelated", "KeyError: 'labels'")
    for tail in (first, later):
        clock.now += STARTUP_WINDOW_S + 1  # past the start-up: failures of a training rank
        incarnation, pid = agent.running.pop(1)
        agent.reports.append(ExitReport(1, incarnation, pid, 1, clock.now, None, tail))
        code = coord.check_processes()
    assert code == 1
    final = events(tmp_path, "job_finished")[-1]
    assert final["detail"]["log_tail"] == list(first)
    assert "each of its 2 incarnations failed the same way (KeyError: 'labels')" in final["message"]


def test_a_plain_rank_failing_after_every_other_rank_finished_is_not_restarted(tmp_path: Path) -> None:
    """A plain script's rank aborting at its exit, the others already done with
    code 0; a whole-job restart would train again from the start (twice, with the budget)."""
    coord, agent, clock = make(tmp_path, max_restarts=3)
    for rank in (0, 1, 3):
        agent.exit(rank, 0, at=clock.now)
    assert coord.check_processes() is None
    agent.exit(2, -signal.SIGABRT, at=clock.now)
    assert coord.check_processes() == 128 + signal.SIGABRT
    assert not events(tmp_path, "job_restarting")
    assert "after every other rank had finished successfully" in events(tmp_path, "job_finished")[-1]["message"]


def test_a_library_rank_crashing_at_its_exit_after_every_other_rank_finished_is_not_respawned(tmp_path: Path) -> None:
    """torch's gloo abort at a rank's exit, after ``ft.finish()`` on every rank and the others'
    exits with code 0: a respawned rank had no peer to recover from, waited for the collective
    timeout (300 s), and the whole job ran again (seen once in an interleaved bench series)."""
    coord, agent, clock = make(tmp_path, max_restarts=3)
    hello_all(coord)
    for rank in range(4):
        send(coord, rank, MsgType.DONE, committed=99)
    for rank in (0, 1, 3):
        agent.exit(rank, 0, at=clock.now)
    assert coord.check_processes() is None
    agent.exit(2, -signal.SIGABRT, at=clock.now)
    assert coord.check_processes() == 128 + signal.SIGABRT
    assert not events(tmp_path, "recovery_started") and not events(tmp_path, "job_restarting")
    assert "after every other rank had finished successfully" in events(tmp_path, "job_finished")[-1]["message"]


def test_a_library_rank_crashing_before_it_finished_is_respawned(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, max_restarts=3)
    hello_all(coord)
    for rank in (0, 1, 3):
        send(coord, rank, MsgType.DONE, committed=99)
    agent.exit(2, -signal.SIGABRT, at=clock.now)  # in its last step: the others hold the state
    assert coord.check_processes() is None
    assert events(tmp_path, "recovery_started")


@pytest.mark.parametrize("others_done, code", [(False, -signal.SIGABRT), (True, -signal.SIGKILL), (True, 1)])
def test_a_plain_rank_failing_otherwise_restarts_the_job(tmp_path: Path, others_done: bool, code: int) -> None:
    """While others still run, or killed (an OOM kill mid-work), or with an error code: a restart."""
    coord, agent, clock = make(tmp_path, max_restarts=3)
    for rank in (0, 1, 3) if others_done else (0,):
        agent.exit(rank, 0, at=clock.now)
    assert coord.check_processes() is None
    agent.exit(2, code, at=clock.now)
    assert coord.check_processes() is None
    assert len(events(tmp_path, "job_restarting")) == 1


def join_node1(coord: Coordinator, identity: bytes = b"agent-1") -> None:
    coord.on_agent_message(identity, msg(MsgType.AGENT_HELLO, node=1, pid=77, host="h1"))


def test_agent_messages_are_bound_to_the_connection_of_its_hello(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, world=4, local=2)
    assert [s[0] for s in agent.spawned] == [0, 1]  # node 1's ranks wait for its agent
    assert coord.check_agents() is None
    join_node1(coord)
    assert events(tmp_path, "node_joined")
    coord.on_agent_message(b"agent-1", msg(MsgType.SPAWNED, node=1, rank=2, incarnation=0, pid=5002, spare=False))
    coord.on_agent_message(b"intruder", msg(MsgType.EXITED, node=1, rank=2, incarnation=0, pid=5002, returncode=0, at=0.0))
    coord.check_processes()
    assert coord.ranks[2].proc.pid == 5002 and coord.ranks[2].alive(), "an exit from another connection was believed"
    join_node1(coord, b"agent-1-again")
    assert any("already connected" in e["message"] for e in events(tmp_path, "message_rejected"))


def test_lost_node_is_replaced_and_its_old_agent_fenced(tmp_path: Path) -> None:
    """Pod-level rescheduling: node 1 falls silent; its ranks are respawned when a replacement
    launcher with --node_rank 1 joins (from another host); the old agent, back after a partition,
    is told to shut down."""
    coord, agent, clock = make(tmp_path, world=4, local=2, node_wait_timeout=60.0)
    join_node1(coord)
    hello_all(coord)
    step(coord, 0)
    clock.now += 30.0  # node 1's agent falls silent; node 0's ranks keep beating
    beat_all(coord)
    assert coord.check_agents() is None, "the job ended instead of waiting for a replacement"
    lost = events(tmp_path, "node_lost")[0]
    assert lost["detail"]["ranks"] == [2, 3] and lost["detail"]["waiting"]
    assert lost["detail"]["cause"] == "silent" and lost["detail"]["detection_seconds"] == 30.0  # the silence
    assert coord.recovery is not None and coord.recovery.failed == {2, 3}
    assert events(tmp_path, "recovery_started")[-1]["detail"]["fault"] == "node_loss"
    for rank in (0, 1):
        send(coord, rank, MsgType.FAULT, generation=coord.generation, step=1, committed=0, reason="abort")
    assert coord.recovery.plan is None  # the plan waits for the replacement's ranks
    remote = [c for c in coord.agents.values() if c.node == 1]
    assert remote == []
    clock.now += 4.0  # the replacement launcher joins 4 s after the loss
    join_node1(coord, b"agent-1-replacement")
    replacement = coord.agents[1]
    sent: list[tuple[bytes, MsgType]] = []
    coord.control.send = lambda identity, kind, fields: sent.append((identity, kind))  # type: ignore[method-assign]
    coord.on_agent_message(b"agent-1", msg(MsgType.AGENT_BEAT, node=1))  # the old agent is back
    assert sent == [(b"agent-1", MsgType.SHUTDOWN)]
    assert any("fenced" in e["message"] for e in events(tmp_path, "message_rejected"))
    for rank, pid in ((2, 7002), (3, 7003)):
        coord.on_agent_message(b"agent-1-replacement", msg(MsgType.SPAWNED, node=1, rank=rank, incarnation=1, pid=pid, spare=False))
    coord.check_processes()
    hello_all(coord, [2, 3])
    plan = events(tmp_path, "recovery_planned")[-1]["detail"]
    assert sorted(t[1] for t in plan["transfers"]) == [2, 3] and all(t[0] in (0, 1) for t in plan["transfers"])
    assert replacement.node == 1 and coord.restarts_used == 1  # a node's loss is one event: one restart
    for rank in range(4):
        send(coord, rank, MsgType.RECOVERED, generation=coord.generation, role="recipient" if rank >= 2 else "none",
             bytes=10, seconds=0.1)
    finished = events(tmp_path, "recovery_finished")[-1]["detail"]
    # the recovery's cost split: the node's silence, then the wait for its replacement, apart from the respawn
    assert finished["detection_seconds"] == 30.0 and finished["node_wait_seconds"] == {"2": 4.0, "3": 4.0}
    assert all(v <= 0.0 for v in finished["respawn_seconds"].values())  # the fake clock stood still after the join
    from ftrun.coordinator.metrics import JobMetrics

    metrics = JobMetrics(tmp_path, status_source=lambda: None)
    for line in (tmp_path / "events.jsonl").read_text().splitlines():
        metrics.observe(json.loads(line))
    text = metrics.render().decode()
    assert 'ftrun_node_losses_total{cause="silent"} 1.0' in text
    assert 'ftrun_recoveries_total{fault="node_loss"} 1.0' in text
    assert 'ftrun_recovery_phase_seconds_count{phase="node_wait"} 1.0' in text


def test_a_flapping_node_rejoins_as_its_own_replacement(tmp_path: Path) -> None:
    """Node 1's link fails for longer than the heartbeat timeout, then comes back before any
    replacement: its old agent is fenced but told it may rejoin; its hello on a fresh connection
    is accepted as the node's replacement and its ranks are respawned there, for one restart. The
    loss names what the coordinator still hears."""
    coord, agent, clock = make(tmp_path, world=4, local=2, node_wait_timeout=60.0)
    join_node1(coord)
    hello_all(coord)
    step(coord, 0)
    clock.now += 8.0
    beat_all(coord)
    assert coord.check_agents() is None
    lost = events(tmp_path, "node_lost")[0]
    assert "no other node's agent is heard either" in lost["message"], lost["message"]
    sent: list[tuple[bytes, MsgType, dict]] = []
    real_send = coord.control.send
    coord.control.send = lambda identity, kind, fields: sent.append((identity, kind, fields))  # type: ignore[method-assign]
    coord.on_agent_message(b"agent-1", msg(MsgType.AGENT_BEAT, node=1))  # the link is back
    assert [(i, k) for i, k, _ in sent] == [(b"agent-1", MsgType.SHUTDOWN)]
    assert sent[0][2]["rejoin"] is True and "rejoin" in sent[0][2]["message"]
    coord.control.send = real_send  # type: ignore[method-assign]
    join_node1(coord, b"agent-1-fresh-connection")
    joined = events(tmp_path, "node_joined")[-1]
    assert joined["detail"]["replacement"] and coord.agents[1].identity == b"agent-1-fresh-connection"
    assert coord.restarts_used == 1 and coord.recovery is not None and coord.recovery.failed == {2, 3}
    sent.clear()
    coord.control.send = lambda identity, kind, fields: sent.append((identity, kind, fields))  # type: ignore[method-assign]
    coord.on_agent_message(b"agent-1", msg(MsgType.AGENT_BEAT, node=1))  # the old connection, once more
    assert sent[0][1] == MsgType.SHUTDOWN and sent[0][2]["rejoin"] is False  # the node has its agent now


def test_an_elastic_job_runs_an_absent_nodes_ranks_elsewhere_then_moves_them_back(tmp_path: Path) -> None:
    """--nnodes 1:2: node 1 lost, no replacement within --replace_timeout: its ranks start on node 0
    (local ranks 2 and 3 there) and recover from replicas; no failure of the job at
    --node_wait_timeout. When a launcher takes index 1 again, the moved ranks are stopped and
    respawned there, for no restart."""
    from ftrun.coordinator.elastic import place

    assert place([4, 5, 6], {0: 2, 1: 3}) == {4: 0, 5: 0, 6: 1} and place([], {0: 1}) == {}
    with pytest.raises(ValueError):
        place([1], {})
    coord, agent, clock = make(tmp_path, world=4, local=2, node_wait_timeout=60.0, min_nodes=1, replace_timeout=3.0)
    join_node1(coord)
    hello_all(coord)
    step(coord, 0)
    clock.now += 8.0
    beat_all(coord)
    assert coord.check_agents() is None and coord.members.pending_spawns[1]
    clock.now += 2.0
    assert coord.check_agents() is None and not events(tmp_path, "job_shrunk")  # within --replace_timeout
    clock.now += 2.0
    assert coord.check_agents() is None
    shrunk = events(tmp_path, "job_shrunk")[0]["detail"]
    assert shrunk["ranks"] == [2, 3] and shrunk["placed"] == {"2": 0, "3": 0} and shrunk["nodes"] == 1
    moved = {rank: env for rank, _inc, _spare, env in agent.spawned if rank in (2, 3)}
    assert moved[2]["LOCAL_RANK"] == "2" and moved[3]["LOCAL_RANK"] == "3" and moved[2]["RANK"] == "2"
    assert (coord.ranks[2].node, coord.ranks[3].node) == (0, 0) and coord.restarts_used == 1
    snapshot = coord.status_snapshot()
    assert snapshot["moved_ranks"] == {"1": [2, 3]} and snapshot["nodes_present"] == 1
    assert [row["node"] for row in snapshot["ranks"]] == [0, 0, 0, 0]
    coord.check_processes()
    hello_all(coord, [2, 3])
    clock.now += 120.0  # past --node_wait_timeout: an elastic job with MIN nodes present does not fail
    beat_all(coord)
    assert coord.check_agents() is None and coord.exit_code is None
    join_node1(coord, b"agent-1-back")  # a launcher takes index 1 again
    grown = events(tmp_path, "job_grown")[0]["detail"]
    assert grown["ranks"] == [2, 3] and grown["nodes"] == 2
    for rank in (2, 3):
        agent.exit(rank, -signal.SIGKILL)
    assert coord.check_processes() is None
    assert (coord.ranks[2].node, coord.ranks[2].local_rank, coord.ranks[3].local_rank) == (1, 0, 1)
    assert coord.recovery is not None and coord.recovery.failed >= {2, 3} and coord.restarts_used == 1
    assert events(tmp_path, "recovery_started")[-1]["detail"]["fault"] == "grow"


def test_an_elastic_job_starts_with_min_nodes_after_the_settle_time(tmp_path: Path) -> None:
    """--nnodes 1:2, node 1 never joins: after 30 s (torchrun's last call) its ranks start on node
    0; when it joins later they move back there."""
    coord, agent, clock = make(tmp_path, world=4, local=2, min_nodes=1, replace_timeout=3.0)
    assert [s[0] for s in agent.spawned] == [0, 1]
    clock.now += 10.0
    assert coord.check_agents() is None and not events(tmp_path, "job_shrunk")  # launchers start seconds apart
    clock.now += 21.0
    assert coord.check_agents() is None
    shrunk = events(tmp_path, "job_shrunk")[0]
    assert "node 1 has not joined 30 s after the start" in shrunk["message"] and shrunk["detail"]["ranks"] == [2, 3]
    assert [s[0] for s in agent.spawned] == [0, 1, 2, 3] and coord.restarts_used == 0
    coord.check_processes()
    hello_all(coord)
    join_node1(coord)
    assert events(tmp_path, "job_grown")[0]["detail"]["ranks"] == [2, 3]


def test_an_elastic_job_below_its_minimum_ends_after_the_replace_timeout(tmp_path: Path) -> None:
    """--nnodes 2:3 and nodes 1 and 2 lost: one node left, below MIN: the job ends once
    --replace_timeout has passed (a dying gasp), naming the node and the minimum."""
    coord, agent, clock = make(tmp_path, world=6, local=2, node_wait_timeout=60.0, min_nodes=2, replace_timeout=3.0)
    coord.ttp.report_wait = 0.0  # the fake ranks never answer the dying gasp's abort
    join_node1(coord)
    coord.on_agent_message(b"agent-2", msg(MsgType.AGENT_HELLO, node=2, pid=78, host="h2"))
    hello_all(coord)
    step(coord, 0)
    clock.now += 8.0
    beat_all(coord)
    assert coord.check_agents() is None and coord.check_agents() is None  # nodes 1 and 2 lost, awaited
    assert sorted(coord.members.waiting_for) == [1, 2]
    clock.now += 4.0
    assert coord.check_agents() == 1
    finished = events(tmp_path, "job_finished")[-1]["message"]
    assert "node 1" in finished and "below the --nnodes minimum of 2" in finished, finished
    assert not events(tmp_path, "job_shrunk")


def test_no_replacement_in_time_fails_naming_the_node(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, world=4, local=2, node_wait_timeout=60.0)
    coord.ttp.report_wait = 0.0  # the fake ranks never answer the dying gasp's abort
    join_node1(coord)
    hello_all(coord)
    clock.now += 30.0
    assert coord.check_agents() is None
    clock.now += 61.0
    assert coord.check_agents() == 1
    message = events(tmp_path, "job_finished")[-1]["message"]
    assert "node 1" in message and "no replacement joined" in message


def test_node_that_never_joins_ends_the_job(tmp_path: Path) -> None:
    coord, _, clock = make(tmp_path, world=4, local=2, cluster_time_out=30.0)
    clock.now += 31.0
    assert coord.check_agents() == 1
    assert "did not join" in events(tmp_path, "job_finished")[-1]["message"]


@pytest.mark.parametrize("frame_identity", [ident(2), b"someone-else"])
def test_messages_are_bound_to_the_connection_that_said_hello(tmp_path: Path, frame_identity: bytes) -> None:
    coord, agent, _ = make(tmp_path)
    hello_all(coord)
    r = coord.ranks[2]
    coord.handle(frame_identity, msg(MsgType.HEARTBEAT, rank=2, incarnation=0, step=5, phase="compute", phase_age=0.0))
    assert (r.proc.step == 5) == (frame_identity == ident(2))


def test_a_section_has_its_own_bound_and_does_not_poison_step_times(tmp_path: Path) -> None:
    """An evaluation in ft.section("eval", timeout=100): no hang while it runs within its bound,
    its length is not a step-time sample, and past its bound the rank is hung."""
    coord, agent, clock = make(tmp_path, warmup_steps=0)
    hello_all(coord)
    for n in range(3):
        step(coord, n)
        clock.now += 0.1
    bound = coord.step_timeout()
    for rank in range(4):
        send(coord, rank, MsgType.PROGRESS, step=3, metrics={}, section="eval", section_timeout=100.0)
    for _ in range(50):  # 50 s of evaluation: the I/O thread keeps sending progress with the section
        clock.now += 1.0
        for rank in range(4):
            send(coord, rank, MsgType.PROGRESS, step=3, metrics={}, section="eval", section_timeout=100.0)
        coord.check_hangs()
    assert agent.hung == []
    for rank in range(4):
        send(coord, rank, MsgType.PROGRESS, step=3, metrics={}, section=None)
        board(coord, rank).section_closed()
    step(coord, 3)
    clock.now += 0.1
    step(coord, 4)
    assert coord.step_timeout() == bound, "the evaluation's length became a step-time sample"
    send(coord, 2, MsgType.PROGRESS, step=5, metrics={}, section="save", section_timeout=10.0)
    clock.now += 11.0
    beat_all(coord)
    coord.check_hangs()
    assert agent.hung == [(2, True)]
    coord.check_processes()
    assert "section 'save'" in events(tmp_path, "rank_hung")[0]["message"]


def test_early_replacement_of_a_silent_node_is_taken(tmp_path: Path) -> None:
    """A restarted pod can say hello before the old agent's silence reaches the heartbeat timeout:
    if the old agent is already quiet, the node is taken as lost and the newcomer replaces it; a
    second launcher for a node whose agent is alive is refused."""
    coord, agent, clock = make(tmp_path, world=4, local=2)
    join_node1(coord)
    hello_all(coord)
    step(coord, 0)
    join_node1(coord, b"agent-1-dup")  # the agent beats: a duplicate, refused
    assert coord.agents[1].identity == b"agent-1"
    clock.now += 3.0  # quiet for 3 beats, still within --heartbeat_timeout
    beat_all(coord)
    join_node1(coord, b"agent-1-new")
    assert coord.agents[1].identity == b"agent-1-new"
    assert events(tmp_path, "node_lost") and coord.recovery is not None and coord.recovery.failed == {2, 3}


def test_standby_nodes_take_lost_nodes_first_joined_first(tmp_path: Path) -> None:
    """Standby nodes: each keeps one hot spare per local rank; a lost node goes to
    the standby that joined first, never to two; its ranks are respawned there in spares; a standby
    that dies is dropped with no fault; ``ftrun status`` lists them; a launcher that comes later is
    the next standby, and takes the same node when it is lost again."""
    coord, agent, clock = make(tmp_path, world=4, local=2, node_wait_timeout=60.0, max_restarts=8)
    sent: list[tuple[bytes, MsgType, dict]] = []
    coord.control.send = lambda identity, kind, fields: sent.append((identity, kind, fields))  # type: ignore[method-assign]
    join_node1(coord)
    for name in (b"standby-a", b"standby-b"):
        coord.on_agent_message(name, msg(MsgType.AGENT_HELLO, node=-1, pid=len(name), host=name.decode()))
    assert [e["detail"]["standby_nodes"] for e in events(tmp_path, "standby_node_joined")] == [1, 2]
    assert [row["host"] for row in coord.status_snapshot()["standby_nodes"]] == ["standby-a", "standby-b"]
    hello_all(coord)
    step(coord, 0)
    coord.spawning.keep_spares()
    spares = {i: f for i, kind, f in sent if kind == MsgType.SPARES}
    assert {i: (f["warm"], f["hot"]) for i, f in spares.items() if i.startswith(b"standby")} == {
        b"standby-a": (0, 2), b"standby-b": (0, 2)}
    assert "RANK" not in spares[b"standby-a"]["vars"] and spares[b"standby-a"]["vars"]["GROUP_RANK"] == "1"
    coord.on_agent_message(b"standby-a", msg(MsgType.AGENT_BEAT, node=-1))
    sent.clear()
    clock.now += 30.0  # node 1's agent falls silent
    beat_all(coord)
    coord.on_agent_message(b"standby-a", msg(MsgType.AGENT_BEAT, node=-1))
    coord.on_agent_message(b"standby-b", msg(MsgType.AGENT_BEAT, node=-1))
    assert coord.check_agents() is None
    assert [(i, f["node"]) for i, kind, f in sent if kind == MsgType.TAKE_NODE] == [(b"standby-a", 1)]
    spawns = [(i, f["rank"], f["use_spare"]) for i, kind, f in sent if kind == MsgType.SPAWN]
    assert spawns == [(b"standby-a", 2, True), (b"standby-a", 3, True)]
    joined = events(tmp_path, "node_joined")[-1]["detail"]
    assert joined["node_joined"] == 1 and joined["standby"] and joined["replacement"]
    assert "a standby node takes it" in events(tmp_path, "node_lost")[0]["message"]
    coord.on_agent_message(b"standby-a", msg(MsgType.AGENT_BEAT, node=-1))  # sent before it read take_node
    assert not events(tmp_path, "message_rejected")
    assert [row["host"] for row in coord.status_snapshot()["standby_nodes"]] == ["standby-b"]
    coord.control.closed_agent_connections = lambda: {b"standby-b"}  # type: ignore[method-assign]
    assert coord.check_agents() is None and coord.exit_code is None
    assert "connection closed" in events(tmp_path, "standby_node_left")[0]["message"]
    assert coord.status_snapshot()["standby_nodes"] == []
    coord.on_agent_message(b"standby-c", msg(MsgType.AGENT_HELLO, node=-1, pid=9, host="standby-c"))
    sent.clear()
    coord.control.closed_agent_connections = lambda: {b"standby-a"}  # type: ignore[method-assign]
    assert coord.check_agents() is None  # node 1 (the first standby) lost in its turn
    assert [(i, f["node"]) for i, kind, f in sent if kind == MsgType.TAKE_NODE] == [(b"standby-c", 1)]
    assert [(i, f["rank"]) for i, kind, f in sent if kind == MsgType.SPAWN] == [(b"standby-c", 2), (b"standby-c", 3)]
    assert coord.restarts_used == 2 and coord.exit_code is None  # two node losses, one restart each


# ----------------------------------------------------------------- replayed frames
class Tap:
    """A ROUTER standing in for the coordinator: what a capture of the link shows, frame by frame."""

    def __init__(self) -> None:
        import zmq

        self.ctx = zmq.Context()
        self.router = self.ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        self.addr = f"tcp://127.0.0.1:{self.router.bind_to_random_port('tcp://127.0.0.1')}"

    def capture(self, until: Any, deadline_s: float = 30.0) -> list[bytes]:
        import time

        frames: list[bytes] = []
        deadline = time.monotonic() + deadline_s
        while not until(frames):
            assert time.monotonic() < deadline, f"captured only {len(frames)} frames"
            if self.router.poll(100):
                frames.append(self.router.recv_multipart()[1])
        return frames

    def connection(self, control_addr: str) -> Any:
        import zmq

        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(control_addr)
        return sock

    def close(self) -> None:
        self.ctx.destroy(linger=0)


def pump(coord: Coordinator, until: Any, deadline_s: float = 30.0) -> None:
    import time

    deadline = time.monotonic() + deadline_s
    while not until():
        assert time.monotonic() < deadline, "the coordinator did not get the frames"
        coord.control.router.poll(50)
        coord.read_messages()


def replay_everything(coord: Coordinator, tap: Tap, wire: Any, frames: list[bytes], rejected_before: int) -> None:
    """Replay every captured frame on the original connection and on a new one: each is rejected
    (the new connection is dropped unread after OFFENDER_REJECTS rejected frames: a flood costs nothing)."""
    attacker = tap.connection(coord.control_addr)
    for sock in (attacker, wire):
        for frame in frames:
            sock.send(frame)
    expected = rejected_before + len(frames) + min(len(frames), OFFENDER_REJECTS)
    pump(coord, lambda: coord.rejected >= expected)
    assert coord.rejected == expected


def test_every_kind_of_captured_rank_frame_replayed_is_rejected_and_changes_nothing(tmp_path: Path) -> None:
    """A real rank channel's frames, captured on the link and delivered once, are accepted; each
    replayed, on the original connection or a new one, is rejected (message_rejected) and changes
    nothing: the rank keeps its connection, its step and its liveness (round 3 found a replayed
    ``hello`` taking over rank 2's place, which then got it replaced as hung)."""
    from ftrun.rank.channel import Channel

    coord, agent, clock = make(tmp_path)
    hello_all(coord, [0, 1, 3])
    pid = agent.running[2][1]
    tap = Tap()
    channel = Channel(tap.addr, TOKEN, rank=2, incarnation=0, heartbeat_interval=0.05)
    try:
        channel.send(MsgType.HELLO, pid=pid, generation=0, replica_group=[0, 1, 2, 3], library=True)
        for phase in ("compute", "collective", "update"):
            channel.send(MsgType.HEARTBEAT, step=0, phase=phase, phase_age=0.0, committed=-1)
        channel.send(MsgType.HEARTBEAT, step=0, phase="compute", phase_age=0.0, committed=0)
        channel.send(MsgType.PROGRESS, step=0, metrics={"loss": 1.0})
        kinds_seen = lambda frames: {f[56:] for f in frames}  # noqa: E731
        frames = tap.capture(lambda fs: len(fs) >= 9 and len(kinds_seen(fs)) >= 7)
        wire = tap.connection(coord.control_addr)
        for frame in frames:
            wire.send(frame)
        r = coord.ranks[2]
        pump(coord, lambda: r.proc.identity is not None and r.proc.committed == 0)
        bound, rejected_before = r.proc.identity, coord.rejected
        replay_everything(coord, tap, wire, frames, rejected_before)
        assert r.proc.identity == bound and r.proc.committed == 0 and r.proc.state.value == "healthy"
        assert len([e for e in events(tmp_path, "rank_joined") if e["rank"] == 2]) == 1
        reasons = [e["detail"]["reason"] for e in events(tmp_path, "message_rejected")]
        assert reasons and all("stale frame" in why for why in reasons), reasons
    finally:
        channel.close()
        tap.close()


def test_every_kind_of_captured_agent_frame_replayed_is_rejected(tmp_path: Path) -> None:
    """The same for a node agent's frames (hello, beat, spawned, exited, stopped, stacks, spare note):
    replayed, none is accepted, and node 1 stays bound to its agent's connection."""
    from ftrun.node.agent import NodeAgent
    from ftrun.coordinator.agents import RemoteAgent

    coord, _agent, _clock = make(tmp_path, world=4, local=2)
    tap = Tap()
    node_agent = NodeAgent(1, tap.addr, TOKEN, processes=None, heartbeat_interval=1.0, coordinator_timeout=30.0,
                           events_addr=None)
    try:
        node_agent.send(MsgType.AGENT_HELLO, node=1, pid=4242, host="host1")
        node_agent.send(MsgType.AGENT_BEAT, node=1)
        node_agent.send(MsgType.SPAWNED, node=1, rank=2, incarnation=0, pid=5000, spare=False)
        node_agent.send(MsgType.STOPPED, node=1, rank=2, incarnation=0, pid=5000, signal=19, at=1.0)
        node_agent.send(MsgType.STACKS, node=1, rank=2, incarnation=0, lines=[], note="none")
        node_agent.send(MsgType.SPARE_NOTE, node=1, message="note")
        node_agent.send(MsgType.EXITED, node=1, rank=3, incarnation=0, pid=5001, returncode=0, at=1.0)
        frames = tap.capture(lambda fs: len(fs) >= 7)
        wire = tap.connection(coord.control_addr)
        for frame in frames:
            wire.send(frame)
        taken: list[Any] = []

        def all_reported() -> bool:
            # The frames arrive in order, and the exit report was sent last: once it is taken, every
            # report the agent sent is (taking them one pass at a time would leave some for later).
            if isinstance(coord.agents.get(1), RemoteAgent):
                taken.extend(coord.agents[1].take_reports())
            return any(type(report).__name__ == "ExitReport" for report in taken)

        pump(coord, all_reported)
        assert len(taken) == 5, taken
        bound, rejected_before = coord.agents[1].identity, coord.rejected
        replay_everything(coord, tap, wire, frames, rejected_before)
        assert coord.agents[1].identity == bound and coord.agents[1].take_reports() == []
        assert len(events(tmp_path, "node_joined")) == 1
    finally:
        node_agent.close_connection()
        node_agent.ctx.term()
        tap.close()


def test_an_agent_connection_that_closes_is_its_nodes_loss_at_once(tmp_path: Path) -> None:
    """A killed host's kernel resets its agent's connection; the coordinator takes
    that as the node's loss at once, with no heartbeat timeout (the test's clock never moves)."""
    import time

    from ftrun.node.agent import NodeAgent
    from ftrun.coordinator.agents import RemoteAgent

    coord, _agent, clock = make(tmp_path, world=4, local=2)
    node_agent = NodeAgent(1, coord.control_addr, TOKEN, processes=None, heartbeat_interval=1.0, coordinator_timeout=30.0,
                           events_addr=None)
    node_agent.send(MsgType.AGENT_HELLO, node=1, pid=4242, host="host1")
    pump(coord, lambda: isinstance(coord.agents.get(1), RemoteAgent))
    assert coord.check_agents() is None and not coord.lost_nodes
    node_agent.close_connection()
    node_agent.ctx.term()
    deadline = time.monotonic() + 30
    while not coord.lost_nodes:
        assert time.monotonic() < deadline, "the closed connection was not noticed"
        coord.control.disconnects.poll(100)
        coord.check_agents()
    assert "connection closed" in coord.lost_nodes[1]
    assert clock.now == 1000.0  # no time passed: not the heartbeat timeout


@pytest.mark.parametrize("kind, expected", [("warm", (2, 0)), ("none", None)])
def test_standby_spares_option_chooses_a_standby_nodes_spares(tmp_path: Path, kind: str, expected: Any) -> None:
    """``--standby_spares warm``: one warm spare per local rank on a standby node; ``none``: none."""
    coord, agent, clock = make(tmp_path, world=4, local=2, standby_spares=kind)
    sent: list[tuple[bytes, MsgType, dict]] = []
    coord.control.send = lambda identity, kind, fields: sent.append((identity, kind, fields))  # type: ignore[method-assign]
    join_node1(coord)
    coord.on_agent_message(b"standby-a", msg(MsgType.AGENT_HELLO, node=-1, pid=5, host="standby-a"))
    hello_all(coord)
    coord.spawning.keep_spares()
    orders = [(f["warm"], f["hot"]) for i, k, f in sent if k == MsgType.SPARES and i == b"standby-a"]
    assert orders == ([expected] if expected else [])


def test_a_usage_error_in_every_rank_ends_the_job_with_its_code_without_a_restart(tmp_path: Path) -> None:
    """Every rank exits with code 2 (argparse) before ftrun.init: the first exit is held while the
    others end alike; then the job ends with code 2, no restart spent."""
    coord, agent, clock = make(tmp_path, max_restarts=3)
    tail = ("usage: train.py [-h] [--lr LR]", "train.py: error: unrecognized arguments: --lrr 0.1")
    for rank in range(4):
        incarnation, pid = agent.running.pop(rank)
        agent.reports.append(ExitReport(rank, incarnation, pid, 2, clock.now, None, tail))
        assert coord.check_processes() is None or rank == 3
        clock.now += 0.5
    assert coord.exit_code is None and coord.check_processes() == 2
    assert not events(tmp_path, "job_restarting")
    final = events(tmp_path, "job_finished")[-1]
    assert "every rank exited with code 2 before ftrun.init, a usage error" in final["message"]
    assert final["detail"]["log_tail"] == list(tail)


def test_a_start_up_failure_of_one_rank_restarts_after_its_hold(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, max_restarts=3)
    incarnation, pid = agent.running.pop(2)
    agent.reports.append(ExitReport(2, incarnation, pid, 1, clock.now, None, ("ImportError: no module named x",)))
    assert coord.check_processes() is None and not events(tmp_path, "job_restarting")
    clock.now += STARTUP_HOLD_S
    assert coord.check_processes() is None
    restarting = events(tmp_path, "job_restarting")
    assert len(restarting) == 1 and "rank(s) 0-3 have not said hello" in restarting[0]["message"]


def _alone_with_a_checkpoint(tmp_path: Path) -> tuple[Coordinator, FakeAgent, Clock, Path]:
    """4 ranks with no replica (pure FSDP: each rank its own replica group), a periodic checkpoint
    of step 3 completed, rank 2 killed at step 5."""
    import torch

    from ftrun.common import checkpoint as ckpt

    coord, agent, clock = make(tmp_path, max_restarts=3)
    for rank in range(4):
        coord.handle(ident(rank), msg(MsgType.HELLO, rank=rank, incarnation=0, pid=coord.ranks[rank].proc.pid,
                                      generation=0, replica_group=[rank], library=True))
    directory = ckpt.step_dir(tmp_path / "ckpt", 3)
    for rank in range(4):
        info = ckpt.save_shard(directory, rank, {"model": {"w": torch.full((2,), float(rank))}})
        send(coord, rank, MsgType.SAVED, step=3, shard=rank, info=info.to_json(), seconds=0.01,
             torch_version=torch.__version__, reason="periodic")
    assert events(tmp_path, "checkpoint_saved")
    step(coord, 0)
    agent.exit(2, -signal.SIGKILL, at=clock.now)
    assert coord.check_processes() is None
    return coord, agent, clock, directory


def test_no_replica_rolls_every_rank_back_in_place_to_the_newest_checkpoint(tmp_path: Path) -> None:
    """No live rank holds rank 2's slice: instead of a whole-job restart, every rank keeps its
    process and loads its own part of the checkpoint of step 3; the steps after it are counted."""
    coord, agent, _, directory = _alone_with_a_checkpoint(tmp_path)
    for rank in (0, 1, 3):
        send(coord, rank, MsgType.FAULT, generation=1, step=6, committed=5, reason="abort", kind="abort", rollback=True)
    coord.handle(ident(2, 1), msg(MsgType.HELLO, rank=2, incarnation=1, pid=coord.ranks[2].proc.pid, generation=1,
                                  replica_group=[2], library=True))
    fallback = events(tmp_path, "recovery_fallback")[-1]
    assert fallback["detail"]["rollback"] == str(directory) and fallback["detail"]["redone_steps"] == 2
    plan = events(tmp_path, "recovery_planned")[-1]["detail"]
    assert plan["step"] == 3 and plan["transfers"] == [] and plan["rollback"] == str(directory)
    for rank in range(4):
        send(coord, rank, MsgType.RECOVERED, generation=1, role="rollback", bytes=8, seconds=0.01)
    done = events(tmp_path, "recovery_finished")[-1]["detail"]
    assert done["resume_step"] == 4 and done["redone_steps"] == 2 and done["bytes"] == 32
    assert not events(tmp_path, "job_restarting") and coord.restarts_used == 1
    assert sorted(s[0] for s in agent.spawned) == [0, 1, 2, 2, 3]  # the survivors kept their processes


def test_no_replica_and_an_epoch_loop_restarts_the_job(tmp_path: Path) -> None:
    """A rank whose loop is ft.epochs/ft.batches says it cannot be rolled back in place (its passes
    are not rewound): the job restarts as a whole from the checkpoint, as before."""
    coord, _, _, _ = _alone_with_a_checkpoint(tmp_path)
    for rank in (0, 1, 3):
        send(coord, rank, MsgType.FAULT, generation=1, step=6, committed=5, reason="abort", kind="abort", rollback=False)
    coord.handle(ident(2, 1), msg(MsgType.HELLO, rank=2, incarnation=1, pid=coord.ranks[2].proc.pid, generation=1,
                                  replica_group=[2], library=True))
    assert "epoch loop" in events(tmp_path, "recovery_fallback")[-1]["message"]
    assert len(events(tmp_path, "job_restarting")) == 1 and not events(tmp_path, "recovery_planned")


def test_a_hung_rank_its_node_never_ran_is_reported_gone(tmp_path: Path) -> None:
    """A coordinator that took the job over restores a spawn whose order died with its predecessor:
    the node runs no such process. Killing it as hung must end in an exit report (killed), or the
    recovery would wait for an exit that never comes (seen in CI: a standby coordinator stalled)."""
    import sys

    from ftrun.coordinator.agents import LocalAgent
    from ftrun.node.spawner import ExitReport, RankProcesses

    processes = RankProcesses([sys.executable], ["x.py"], False, tmp_path, 1, "127.0.0.1", False, "secret")
    assert not processes.holds(0, 1)
    agent = LocalAgent(0, processes)
    agent.kill_hung(0, 1, "===== hung: {note} =====", dump=True)
    stacks, gone = agent.take_reports()
    assert "the process is gone" in stacks.note
    assert isinstance(gone, ExitReport) and (gone.rank, gone.incarnation, gone.returncode) == (0, 1, -signal.SIGKILL)
    assert "runs no incarnation 1 of rank 0" in gone.log_tail[0]


def test_a_plain_rank_crashing_in_its_teardown_after_the_others_finished_is_not_restarted(tmp_path: Path) -> None:
    """Every other rank exited 0; a plain script's rank ends with SIGABRT (a destructor's abort): the
    job fails with that code and no restart is spent (policy.decide_failed_ranks)."""
    coord, agent, clock = make(tmp_path, max_restarts=3)
    for rank in range(3):
        agent.exit(rank, 0, clock.now)
        assert coord.check_processes() is None
    agent.exit(3, -6, clock.now)
    assert coord.check_processes() == 134 and coord.restarts_used == 0
    assert not events(tmp_path, "job_restarting")
    assert "after every other rank had finished successfully" in events(tmp_path, "job_finished")[-1]["message"]


def test_with_join_a_failure_restarts_nothing_and_the_job_fails_once_every_rank_ended(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, max_restarts=3, join=True)
    hello_all(coord)
    agent.exit(1, 1, clock.now)
    assert coord.check_processes() is None and coord.restarts_used == 0 and not events(tmp_path, "recovery_started")
    for rank in (0, 2, 3):
        agent.exit(rank, 0, clock.now)
    assert coord.check_processes() == 1
    assert "a rank failed and --join let the others finish" in events(tmp_path, "job_finished")[-1]["message"]


def test_passes_over_every_rank_are_paced_by_the_monitor_interval(tmp_path: Path) -> None:
    """The main loop's passes over every rank (watchdog, spares, replication) are due once per
    --monitor_interval on the job's clock, however many times frames wake it in between."""
    coord, _agent, clock = make(tmp_path, monitor_interval=0.5)
    assert coord._scan_due()
    assert not coord._scan_due() and not coord._scan_due()  # woken again at once: not due
    clock.now += 0.49
    assert not coord._scan_due()
    clock.now += 0.01
    assert coord._scan_due() and not coord._scan_due()


def test_a_round_begun_puts_the_passes_over_every_rank_off_a_period(tmp_path: Path) -> None:
    """A round's start sent every rank its order and replicated its state: the passes are put off
    a whole period from then, also the pass the main loop had found due before the round began."""
    coord, agent, clock = make(tmp_path, monitor_interval=0.5)
    hello_all(coord)
    clock.now += 1.0
    assert coord._scan_due()
    scans = coord._scans
    agent.exit(3, 9)
    coord.check_processes()
    assert coord.rounds.current is not None and coord._scans != scans  # the loop's pass is dropped
    clock.now += 0.49
    assert not coord._scan_due()
    clock.now += 0.01
    assert coord._scan_due()


def test_the_wakeup_pipe_tells_whether_a_signal_arrived() -> None:
    from ftrun.common.procs import WakeupPipe

    pipe = WakeupPipe()
    assert pipe.drain() is False
    os.write(pipe._write_fd, b"\x11")  # what the C signal handler writes (signal.set_wakeup_fd)
    assert pipe.drain() is True and pipe.drain() is False


def test_a_restart_whose_store_cannot_listen_ends_the_job_with_one_line(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A whole-job restart hosts a fresh store for the new attempt; with no port left to bind
    (EADDRINUSE: every ephemeral port in use, as at 16,384 simulated ranks) the job ends failed,
    saying so, rather than the coordinator dying of the exception."""
    import errno

    from ftrun.common import stores

    def no_port(*_args: Any, **_kw: Any) -> Any:
        raise stores.StoreBindError(errno.EADDRINUSE, "Address already in use")

    monkeypatch.setattr(stores, "serve_store", no_port)
    coord, agent, clock = make(tmp_path, max_restarts=3)
    agent.exit(0, 0, at=clock.now)
    assert coord.check_processes() is None
    agent.exit(2, 1, at=clock.now)  # a plain rank's failure: a whole-job restart
    code = coord.check_processes()
    assert code == 1
    assert len(events(tmp_path, "job_restarting")) == 1
    finished = events(tmp_path, "job_finished")[-1]["message"]
    assert "rendezvous store cannot listen" in finished and "Address already in use" in finished, finished


def test_a_spares_order_carries_the_environment_of_a_spare_on_its_own_node(tmp_path: Path) -> None:
    """The spares' environment is made once a look and given each node's index: what each agent
    is sent is what its node's first rank's environment, without its identity, says."""
    coord, _agent, clock = make(tmp_path, world=8, local=2, warm_spares=1)
    sent: dict[int, dict[str, str]] = {}
    for node in range(1, 4):
        agent = RemoteAgent(node=node, identity=f"a{node}".encode(), send_frame=lambda *a: None, last_seen=clock.now)
        agent.keep_spares = (lambda n: lambda warm, hot, env: sent.__setitem__(n, env))(node)  # type: ignore[method-assign]
        coord.members.agents[node] = agent
    hello_all(coord)
    coord.spawning.keep_spares()
    assert sorted(sent) == [1, 2, 3]
    for node, env in sent.items():
        model = next(r for r in coord.ranks.values() if r.node == node)
        assert env == coord.spawning.rank_env(model).without_identity().to_environ(), node
        assert env["GROUP_RANK"] == str(node)


def test_replica_groups_are_built_again_only_when_a_declaration_changed(tmp_path: Path, monkeypatch: Any) -> None:
    """The plan's replica groups are built once per set of declarations (compared by object:
    a hello keeps one object per group), and a partition that does not hold is refused each time."""
    import ftrun.coordinator.rounds as rounds

    coord, _agent, _clock = make(tmp_path, world=4)
    for rank in range(4):
        r = coord.ranks[rank]
        coord.handle(ident(rank), msg(MsgType.HELLO, rank=rank, incarnation=r.incarnation, pid=r.proc.pid, generation=0,
                                      replica_group=[0, 1] if rank < 2 else [2, 3], library=True))
    built: list[int] = []
    build = rounds.replica_groups_from_hello
    monkeypatch.setattr(rounds, "replica_groups_from_hello", lambda *args: built.append(1) or build(*args))
    assert coord.rounds.replica_groups() == coord.rounds.replica_groups() == [[0, 1], [2, 3]]
    assert len(built) == 1
    coord.ranks[2].replica_group, coord.ranks[3].replica_group = (2,), (3,)
    assert coord.rounds.replica_groups() == [[0, 1], [2], [3]] and len(built) == 2
    coord.ranks[3].replica_group = (2, 3)  # overlaps rank 2's
    for _ in range(2):
        with pytest.raises(ValueError, match="overlap"):
            coord.rounds.replica_groups()


def test_a_large_rounds_plan_event_names_the_ranks_at_each_committed_step() -> None:
    """Up to RANK_EVENTS_MAX ranks, each rank's committed step; above, the ranks at each step as
    ranges (a map of 16,384 ranks was a 300 KB line)."""
    from ftrun.coordinator.rounds import RANK_EVENTS_MAX, committed_detail

    assert committed_detail({1: 7, 0: 6}) == {"committed": {"0": 6, "1": 7}}
    many = {rank: 812 for rank in range(RANK_EVENTS_MAX + 10)} | {4: 811, 9: 811}
    assert committed_detail(many) == {"committed_ranks": {"811": "4,9", "812": f"0-3,5-8,10-{RANK_EVENTS_MAX + 9}"}}
