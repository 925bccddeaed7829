"""The coordinator's roles without processes: the job's phases and their transition
table, a rank's incarnation record, and the watchdog's verdicts on a rank table and a clock."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest
from coordinator_fixtures import FakeAgent, close_coordinators, events, hello_all, make, recover, step  # noqa: F401

from ftrun.common.clocks import RunningClock
from ftrun.coordinator import environment
from ftrun.coordinator.environment import SPARES_CHECK_S
from ftrun.coordinator.phases import TRANSITIONS, IllegalPhaseTransition, JobPhase, JobPhases
from ftrun.coordinator.ranks import Rank, RankPhase
from ftrun.coordinator.watchdog import CommHang, Hung, Unrepaired, Watchdog, WatchdogBounds
from ftrun.common.protocol import Message, MsgType

ILLEGAL = [(a, b) for a in JobPhase for b in JobPhase if b not in TRANSITIONS[a]]


@pytest.mark.parametrize("start, to", ILLEGAL, ids=[f"{a.value}->{b.value}" for a, b in ILLEGAL])
def test_an_illegal_transition_raises_and_changes_nothing(start: JobPhase, to: JobPhase) -> None:
    phases = JobPhases()
    path = {JobPhase.RUNNING: [], JobPhase.RECOVERING: [JobPhase.RECOVERING], JobPhase.GASPING: [JobPhase.GASPING],
            JobPhase.RESTARTING: [JobPhase.RESTARTING], JobPhase.STOPPING: [JobPhase.STOPPING],
            JobPhase.FINISHED: [JobPhase.FINISHED]}[start]
    for phase in path:
        phases.move(phase)
    assert phases.current == start
    with pytest.raises(IllegalPhaseTransition, match=f"{start.value} -> {to.value}"):
        phases.move(to)
    assert phases.current == start and phases.history[-1] == start


def test_the_table_has_an_end_and_every_phase_reaches_it() -> None:
    assert TRANSITIONS[JobPhase.FINISHED] == frozenset()
    for phase in JobPhase:
        seen, todo = set(), [phase]
        while todo:
            p = todo.pop()
            if p not in seen:
                seen.add(p)
                todo.extend(TRANSITIONS[p])
        assert JobPhase.FINISHED in seen, phase


def test_a_recovery_a_restart_and_a_failure_walk_the_phases(tmp_path: Path) -> None:
    coord, agent, clock = make(tmp_path, max_restarts=2)
    coord.ttp.report_wait = 0.0  # the fake ranks never answer a dying gasp's abort
    hello_all(coord)
    step(coord, 0)
    agent.exit(2, -signal.SIGKILL, at=0.0)
    assert coord.check_processes() is None and coord.phase.current == JobPhase.RECOVERING
    assert coord.check_processes() is None
    recover(coord, 2)
    assert coord.phase.current == JobPhase.RUNNING and coord.recovery is None
    # the budget has one restart left: two deaths at once restart the whole job
    hello_all(coord, [2])
    agent.exit(0, 1)
    agent.exit(1, 1)
    assert coord.check_processes() is None
    assert coord.attempt == 1 and coord.phase.current == JobPhase.RUNNING
    assert JobPhase.RESTARTING in coord.phase.history
    # the budget is spent: the next death fails the job, through stopping to finished
    assert coord.check_processes() is None
    hello_all(coord)
    agent.exit(3, 1)
    assert coord.check_processes() == 1
    assert coord.phase.history[-2:] == [JobPhase.STOPPING, JobPhase.FINISHED]
    assert "restart budget exhausted" in events(tmp_path, "job_finished")[-1]["message"]
    # a death reported while the job is over is recorded, never acted on
    assert coord.on_failure([0]) is None and coord.phase.current == JobPhase.FINISHED


def test_each_spawn_starts_a_fresh_incarnation_record() -> None:
    r = Rank(rank=1, local_rank=1)
    first = r.respawned(5.0)
    first.kill_reason, first.section, first.phase, first.committed = "hung: x", "eval", RankPhase.UPDATE, 7
    r.library, r.total_steps = True, 100
    second = r.respawned(9.0)
    assert second is not first and r.incarnation == 1 and second.started_at == 9.0 and second.running
    assert (second.kill_reason, second.section, second.phase, second.committed) == (None, None, RankPhase.SETUP, -2)
    assert r.library and r.total_steps == 100  # the rank's own facts stay


BOUNDS = WatchdogBounds(heartbeat_timeout=30.0, heartbeat_interval=1.0, setup_timeout=300.0, step_timeout=0.0,
                        step_timeout_min=10.0, step_timeout_factor=5.0, warmup_steps=1)


def table(n: int, now: float) -> list[Rank]:
    ranks = [Rank(rank=i, local_rank=i) for i in range(n)]
    for r in ranks:
        r.respawned(now)
        r.library, r.proc.identity, r.proc.last_heartbeat = True, b"x%d" % r.rank, now
    return ranks


def test_watchdog_verdicts_follow_the_clock_it_is_given() -> None:
    dog = Watchdog(BOUNDS)
    ranks = table(2, 0.0)
    assert dog.inspect(ranks, None, False, {0}, 29.0) is None
    ranks[0].proc.last_heartbeat = 20.0
    found = dog.inspect(ranks, None, False, {0}, 31.0)
    assert found == [Hung(1, "no_heartbeat", "no heartbeat for 31.0 s (--heartbeat_timeout 30)", 0.0)]
    # steps begun, then every rank waits in the collective past the step timeout: the group is stuck
    ranks = table(2, 0.0)
    for r in ranks:  # beats at 2.0 and 2.5: steps 0 to 2 begun a second apart, then the collective
        # two samples, 3.0 s (warm-up: BOUNDS.warmup_steps == 1) and 1.0 s
        moved, sample = r.on_board({"phase": "compute", "phase_age": 0.0, "step": 2, "committed": 1, "samples": 2,
                                    "step_times": [3.0, 1.0]}, 2.0, BOUNDS.warmup_steps)
        assert moved and sample == 1.0
        dog.observe(sample)
        assert r.on_board({"phase": "collective", "phase_age": 0.0, "step": 2}, 2.5, BOUNDS.warmup_steps) == (False, None)
    assert dog.max_step_time == 1.0 and dog.step_timeout() == 10.0
    for r in ranks:
        r.proc.last_heartbeat = 12.0
    assert dog.inspect(ranks, None, False, {0}, 12.4) is None
    assert isinstance(dog.inspect(ranks, None, False, {0}, 12.6), CommHang)
    # one rank outside the collective it announced: it alone is the culprit
    ranks[1].on_heartbeat(False, "loop", 0, 12.6)
    ranks[0].on_heartbeat(True, "loop", 0, 12.6)
    found = dog.inspect(ranks, None, False, {0}, 12.7)
    assert [(h.rank, h.kind) for h in found] == [(1, "no_progress")] and "outside the collective" in found[0].evidence


def test_a_judge_that_did_not_run_gives_every_rank_a_fresh_window() -> None:
    """A coordinator stopped for 40 s (longer than the 30 s heartbeat timeout) wakes with the ranks'
    heartbeats still unread: on its running clock the stall counts as one gap, so no rank is hung at
    the wake; a rank that stays silent is hung once the coordinator has listened for the timeout."""
    real = [0.0]
    clock = RunningClock(max_gap=1.0, source=lambda: real[0])
    dog = Watchdog(BOUNDS)
    ranks = table(2, clock())
    real[0] = 0.5
    assert dog.inspect(ranks, None, False, {0}, clock()) is None
    real[0] = 40.5  # stopped for 40 s
    assert clock() == 1.5 and clock.last_stall == 40.0 and clock.stalled == 39.0
    assert dog.inspect(ranks, None, False, {0}, clock()) is None
    ranks[0].proc.last_heartbeat = clock()  # rank 0's queued heartbeat is read; rank 1 stays silent
    while real[0] < 69.0:  # the loop turns every half second
        real[0] += 0.5
        assert dog.inspect(ranks, None, False, {0}, clock()) is None, real[0]
    real[0] += 0.5
    found = dog.inspect(ranks, None, False, {0}, clock())
    assert [(h.rank, h.kind) for h in found] == [(1, "no_heartbeat")] and "30.5 s" in found[0].evidence


def test_the_running_clock_never_goes_back_and_counts_short_gaps() -> None:
    real = [100.0]
    clock = RunningClock.for_loop(0.1, source=lambda: real[0])
    assert clock.max_gap == 1.0 and clock() == 100.0
    seen = []
    for gap in (0.2, 0.9, 5.0, 0.1, 1.0, 3.0):
        real[0] += gap
        seen.append(clock())
    assert seen == pytest.approx([100.2, 101.1, 102.1, 102.2, 103.2, 104.2])
    assert clock.stalled == pytest.approx(6.0) and clock.last_stall == 3.0
    assert RunningClock.for_loop(2.0).max_gap == 6.0
    with pytest.raises(ValueError, match="max_gap"):
        RunningClock(0.0)


def stalled_after_a_node_loss(quiet_rank: bool) -> tuple[Watchdog, list[Rank]]:
    """Four ranks, 1 s steps: ranks 0, 2 and 3 wait in step 25's collective, rank 1 in step 24's,
    cut short by the loss of ranks 2 and 3 (CI30); with ``quiet_rank``, rank 3's heartbeats stopped."""
    dog = Watchdog(BOUNDS)
    ranks = table(4, 0.0)
    for r in ranks:
        step = 24 if r.rank == 1 else 25
        r.on_board({"phase": "compute", "phase_age": 0.0, "step": step, "committed": step - 1, "samples": 2,
                    "step_times": [3.0, 1.0]}, 2.0, BOUNDS.warmup_steps)
        r.on_board({"phase": "collective", "phase_age": 0.0, "step": step}, 2.5, BOUNDS.warmup_steps)
        r.on_heartbeat(True, "loop", 0, 12.0)
        r.proc.last_heartbeat = 9.0 if quiet_rank and r.rank == 3 else 12.0
    dog.observe(1.0)
    return dog, ranks


def test_a_stalled_step_is_blamed_on_no_rank_while_a_node_is_quiet() -> None:
    dog, ranks = stalled_after_a_node_loss(quiet_rank=False)
    found = dog.inspect(ranks, None, False, {0, 1}, 12.6)
    assert [(h.rank, h.kind) for h in found] == [(1, "no_progress")]  # with every node heard: rank 1 is behind
    assert dog.inspect(ranks, None, False, {0, 1}, 12.6, quiet_nodes={1}) is None  # node 1's loss comes first
    assert dog.inspect(ranks, None, False, {0, 1}, 12.6, quiet_nodes=()) == found  # heard again: the verdict stands


def test_a_rank_gone_quiet_is_blamed_before_one_a_step_behind() -> None:
    dog, ranks = stalled_after_a_node_loss(quiet_rank=True)
    found = dog.inspect(ranks, None, False, {0, 1}, 12.6)
    assert [(h.rank, h.kind) for h in found] == [(3, "no_progress")] and "heartbeats stopped" in found[0].evidence


def test_an_unrepaired_fault_waits_its_grace_unless_a_death_explains_it() -> None:
    dog = Watchdog(BOUNDS)
    dog.note_unrepaired(0.0, "rank 1 reported X and HCCE is off")
    assert dog.inspect([], None, False, set(), 0.5) is None
    assert dog.inspect([], None, False, set(), 1.5) == Unrepaired("rank 1 reported X and HCCE is off")
    dog.note_unrepaired(2.0, "again")
    assert dog.inspect([], None, True, set(), 9.0) is None and dog.unrepaired is None  # a death explained it


def test_warm_and_hot_spares_are_kept_together(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """Warm spares from the ranks' hello, hot ones beside them once the ranks are
    past their set-up (a fault before the hot spare is ready, or right after its promotion, still
    finds a spare); an order again when it changes, after the node used a spare, or every
    SPARES_REFRESH_S, not otherwise; none ordered during a recovery."""
    monkeypatch.setattr(environment, "SPARES_REFRESH_S", 10.0)  # refreshes apart from the other reasons
    coord, agent, clock = make(tmp_path, warm_spares=1, hot_spares=1)
    coord.spawning.keep_spares()
    assert not hasattr(agent, "spares")  # no rank has said hello through the worker library yet
    hello_all(coord)
    coord.spawning.keep_spares()
    assert agent.spares == (1, 0)  # the ranks are still in their set-up: warm ones only
    agent.spares = None
    coord.spawning.keep_spares()
    assert agent.spares is None  # the same order is not sent again
    step(coord, 0)
    coord.spawning.keep_spares()
    assert agent.spares == (1, 1)  # a new order (the ranks are past their set-up) at once
    agent.spares = None
    clock.now += SPARES_CHECK_S
    coord.spawning.keep_spares()
    assert agent.spares is None  # nothing changed
    r = coord.ranks[1]
    coord.spawning.on_spawned(r, r.proc.pid, "hot")  # node 0 used a spare: the order refills it
    coord.spawning.keep_spares()
    assert agent.spares is None  # looked at once every SPARES_CHECK_S
    clock.now += SPARES_CHECK_S
    coord.spawning.keep_spares()
    assert agent.spares == (1, 1)
    agent.spares = None
    clock.now += 10.0
    coord.spawning.keep_spares()
    assert agent.spares == (1, 1)  # unchanged, sent again (a spare that died on its own is replaced)
    agent.spares = None
    agent.exit(2, -signal.SIGKILL, at=0.0)
    coord.check_processes()
    clock.now += 10.0
    coord.spawning.keep_spares()
    assert agent.spares is None  # not while a recovery runs


def test_a_replacement_agent_gets_its_spares_order(tmp_path: Path) -> None:
    """A node's new agent (a replacement, or every agent after a takeover) is sent the order at
    the next look, though the order did not change."""
    coord, agent, clock = make(tmp_path, warm_spares=1)
    hello_all(coord)
    coord.spawning.keep_spares()
    assert agent.spares == (1, 0)
    other = FakeAgent(0)
    coord.members.agents[0] = other
    coord.spawning.keep_spares()
    assert not hasattr(other, "spares")  # looked at once every SPARES_CHECK_S
    clock.now += SPARES_CHECK_S
    coord.spawning.keep_spares()
    assert other.spares == (1, 0)


def test_a_shard_reported_right_before_a_death_still_counts(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """CI31: two ranks reported shards of periodic checkpoints and were SIGKILLed; the coordinator
    handled the deaths first and refused the reports, so four whole checkpoints never completed.
    A ``saved`` report of a dead incarnation, on the connection it said hello on, counts; one on
    another connection, or any other late message, does not."""
    coord, agent, _ = make(tmp_path)
    coord.ttp.report_wait = 0.0
    saved: list[int] = []
    monkeypatch.setattr(coord.ttp, "on_saved", lambda m: saved.append(m["step"]))
    hello_all(coord)
    step(coord, 0)
    agent.exit(2, -signal.SIGKILL, at=0.0)
    assert coord.check_processes() is None and coord.ranks[2].incarnation == 1  # respawned
    report = {"rank": 2, "incarnation": 0, "step": 9, "shard": 0, "reason": "periodic"}
    coord.handle(b"conn-2-0", Message(MsgType.SAVED, report))  # its own connection: counted
    coord.handle(b"conn-3-0", Message(MsgType.SAVED, report))  # another one: refused
    coord.handle(b"conn-2-0", Message(MsgType.PROGRESS, {"rank": 2, "incarnation": 0, "step": 9}))
    assert saved == [9]
