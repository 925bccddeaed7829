"""The restart policy (ftrun/coordinator/policy.py): pure functions, tested with no processes at all.

What to do when ranks fail (respawn them, restart the job, fail it: the restart budget), and the
plan of a recovery (the step every rank resumes from, and which replica gives its state to whom).
"""

import pytest

from ftrun.coordinator.policy import (
    INITIAL,
    NO_STATE,
    TEARDOWN_CRASH_CODES,
    Action,
    FailedRank,
    FailureFacts,
    NoLiveReplica,
    RecoveryPlan,
    StartupFailures,
    Transfer,
    decide_failed_ranks,
    decide_failure,
    decide_on_failure,
    decide_restart,
    default_replica_groups,
    plan_recovery,
    plan_rollback,
    redone_steps,
    replica_groups_from_hello,
    respawn_restarts,
    restart_fits,
    teardown_crash,
)


def test_the_budget_counts_every_restart_and_allows_exactly_max_restarts() -> None:
    assert restart_fits(0, 3, 3) and restart_fits(2, 1, 3) and not restart_fits(3, 1, 3) and not restart_fits(1, 3, 3)
    assert restart_fits(0, 0, 0) and not restart_fits(0, 1, 0)


# --------------------------------------------------------------------------- policy: decide_on_failure


def decide(failed, *, world=4, arf=True, library=None, used=0, max_restarts=3):
    return decide_on_failure(
        failed,
        world_size=world,
        arf=arf,
        library_ranks=range(world) if library is None else library,
        restarts_used=used,
        max_restarts=max_restarts,
    )


def test_arf_when_all_ranks_use_library_on_one_node():
    d = decide([2, 1, 2])
    assert d.action == Action.RESPAWN_RANKS and d.ranks == (1, 2)


def test_restart_job_when_a_rank_lacks_the_library():
    d = decide([1], library=[0, 1, 2])
    assert d.action == Action.RESTART_JOB and d.ranks == (1,)
    assert "3" in d.reason and "library" in d.reason


def test_restart_job_when_no_rank_uses_the_library():
    d = decide([0], library=[])
    assert d.action == Action.RESTART_JOB and "0-3" in d.reason


def test_arf_whatever_node_the_rank_runs_on():
    # The policy no longer knows nodes: ARF respawns a rank on its own node, wherever that is.
    assert decide([3], world=8).action == Action.RESPAWN_RANKS


def test_restart_job_when_arf_off():
    d = decide([1], arf=False)
    assert d.action == Action.RESTART_JOB and "ARF is off" in d.reason


def test_budget_exhausted_whole_job():
    assert decide([1], arf=False, used=2, max_restarts=3).action == Action.RESTART_JOB
    d = decide([1], arf=False, used=3, max_restarts=3)
    assert d.action == Action.FAIL_JOB and "max_restarts=3" in d.reason
    assert decide([0], arf=False, max_restarts=0).action == Action.FAIL_JOB


def test_a_node_loss_is_one_event_for_the_budget():
    assert respawn_restarts([4, 5, 6, 7], one_event=True) == 1 and respawn_restarts([4, 5], one_event=False) == 2
    lost_node = decide_on_failure([2, 3], world_size=4, arf=True, library_ranks=range(4), restarts_used=2,
                                  max_restarts=3, one_event=True)
    assert lost_node.action == Action.RESPAWN_RANKS  # 2 + 1 <= 3, where two rank deaths would not fit
    assert decide([2, 3], used=2, max_restarts=3).action == Action.RESTART_JOB


def test_arf_cost_is_number_of_failed_ranks():
    assert decide([0, 1], used=1, max_restarts=3).action == Action.RESPAWN_RANKS  # 1 + 2 <= 3
    # 2 + 2 > 3, but one whole-job restart fits: restart the job rather than fail it
    d = decide([0, 1], used=2, max_restarts=3)
    assert d.action == Action.RESTART_JOB and d.ranks == (0, 1) and "one whole-job restart fits" in d.reason
    assert decide([0, 1], used=2, max_restarts=3, library=[]).action == Action.RESTART_JOB
    assert decide([0, 1, 2], max_restarts=2).action == Action.RESTART_JOB
    d = decide([0, 1], used=3, max_restarts=3)
    assert d.action == Action.FAIL_JOB and "2 more needed" in d.reason


def test_decide_needs_a_failed_rank():
    with pytest.raises(ValueError):
        decide([])


# --------------------------------------------------------------------------- policy: plan_recovery


def pairs(plan: RecoveryPlan) -> list[tuple[int, int]]:
    return sorted((t.donor, t.recipient) for t in plan.transfers)


def test_plan_single_respawned_rank():
    plan = plan_recovery({0: 10, 1: NO_STATE, 2: 10, 3: 10}, default_replica_groups(4))
    assert plan.step == 10
    assert plan.recipients == {1}
    assert plan.donors <= {0, 2, 3}
    assert pairs(plan) == [(0, 1)]


def test_plan_step_is_newest_committed_and_laggards_receive():
    # The newest step committed by a live replica is S; a survivor whose update for S did not run (9)
    # and a respawned rank (-1) receive it.
    plan = plan_recovery({0: 10, 1: 9, 2: NO_STATE, 3: 10}, [[0, 1, 2, 3]])
    assert plan.step == 10 and plan.recipients == {1, 2} and plan.donors <= {0, 3}


def test_plan_donors_round_robin():
    plan = plan_recovery({0: 5, 1: 5, 2: NO_STATE, 3: NO_STATE, 4: NO_STATE, 5: 4}, [[0, 1, 2, 3, 4, 5]])
    assert plan.step == 5
    assert pairs(plan) == [(0, 2), (0, 4), (1, 3), (1, 5)]


def test_plan_nothing_to_do():
    plan = plan_recovery({0: 3, 1: 3}, [[0, 1]])
    assert plan == RecoveryPlan(step=3, transfers=())


def test_plan_dead_ranks_are_neither_donors_nor_recipients():
    plan = plan_recovery({0: 7, 2: NO_STATE}, [[0, 1, 2, 3]])
    assert plan.step == 7 and pairs(plan) == [(0, 2)]


def test_plan_dp_x_tp_groups():
    # DP=2 x TP=2: replica groups are the ranks with the same TP coordinate.
    groups = [[0, 2], [1, 3]]
    plan = plan_recovery({0: 8, 1: 8, 2: NO_STATE, 3: 8}, groups)
    assert plan.step == 8 and pairs(plan) == [(0, 2)]
    plan = plan_recovery({0: NO_STATE, 1: 8, 2: 8, 3: NO_STATE}, groups)
    assert plan.step == 8 and pairs(plan) == [(1, 3), (2, 0)]
    assert all(
        any(t.donor in g and t.recipient in g for g in groups) for t in plan.transfers
    ), "a transfer crossed replica groups"


def test_plan_step_is_oldest_newest_across_groups():
    # Group [0,2] reached step 9 on rank 0, rank 2 holds 8; group [1,3] only 8: all shards resume at 8.
    plan = plan_recovery({0: 9, 1: 8, 2: 8, 3: NO_STATE}, [[0, 2], [1, 3]])
    assert plan.step == 8
    assert pairs(plan) == [(1, 3), (2, 0)]


def test_plan_no_live_replica():
    with pytest.raises(NoLiveReplica, match="0,2"):
        plan_recovery({0: NO_STATE, 1: 5, 2: NO_STATE, 3: 5}, [[0, 2], [1, 3]])
    with pytest.raises(NoLiveReplica):
        plan_recovery({1: 5, 3: 5}, [[0, 2], [1, 3]])  # group [0,2] entirely dead
    with pytest.raises(NoLiveReplica):
        plan_recovery({0: NO_STATE, 1: NO_STATE}, [[0, 1]])


def test_no_replica_rolls_back_to_the_newest_checkpoint_or_restarts():
    # Pure FSDP: each rank alone. Rank 2 respawned (no state), the others at 7 and 8: back to step 5.
    committed = {0: 7, 1: 8, 2: NO_STATE, 3: 7}
    with pytest.raises(NoLiveReplica):
        plan_recovery(committed, [[0], [1], [2], [3]])
    plan = plan_rollback(committed, 5)
    assert plan == RecoveryPlan(step=5, rollback=True) and not plan.transfers
    assert redone_steps(committed, plan) == 3  # steps 6, 7 and 8 are computed again
    assert plan_rollback(committed, None) is None  # no checkpoint: the whole job restarts
    assert redone_steps(committed, plan_recovery({0: 4, 1: 4}, [[0, 1]])) == 0  # a replica's plan loses nothing


def test_plan_before_the_first_step():
    # Nothing committed yet: ranks holding the broadcast initial state give it to those without.
    plan = plan_recovery({0: INITIAL, 1: NO_STATE, 2: INITIAL, 3: NO_STATE}, [[0, 1, 2, 3]])
    assert plan.step == INITIAL and pairs(plan) == [(0, 1), (2, 3)]
    with pytest.raises(NoLiveReplica):
        plan_recovery({0: NO_STATE, 1: NO_STATE}, [[0, 1]])  # rank 0 died before its broadcast


def test_plan_shards_diverged():
    # Group [0,2] only has step 9, group [1,3] only step 8: no step every group can provide.
    with pytest.raises(NoLiveReplica, match="diverged"):
        plan_recovery({0: 9, 1: 8, 2: 9, 3: 8}, [[0, 2], [1, 3]])


def test_transfer_and_plan_properties():
    plan = RecoveryPlan(step=1, transfers=(Transfer(0, 1), Transfer(0, 2)))
    assert plan.recipients == {1, 2} and plan.donors == {0}


# --------------------------------------------------------------------------- policy: replica groups


def test_replica_groups_default_and_undeclared():
    assert default_replica_groups(3) == [[0, 1, 2]]
    assert replica_groups_from_hello(3, {}) == [[0, 1, 2]]


def test_replica_groups_dp_x_tp():
    declared = {0: [2, 0], 1: [1, 3], 2: [0, 2], 3: [3, 1]}
    assert replica_groups_from_hello(4, declared) == [[0, 2], [1, 3]]


@pytest.mark.parametrize(
    "world, declared, hint",
    [
        (3, {0: [1, 2], 1: [1, 2], 2: [1, 2]}, "without itself"),
        (3, {0: [0, 1], 1: [1, 2], 2: [1, 2]}, "overlap"),
        (4, {0: [0, 1], 1: [0, 1]}, "overlap"),  # ranks 2, 3 undeclared: their default group overlaps
        (4, {0: [0, 5], 1: [1], 2: [2], 3: [3]}, "cover"),  # a rank outside the job
    ],
)
def test_replica_groups_invalid(world, declared, hint):
    with pytest.raises(ValueError, match=hint):
        replica_groups_from_hello(world, declared)


def test_a_usage_error_in_every_rank_ends_the_job_at_once() -> None:
    startup = StartupFailures(world_size=3, hold=10.0)
    assert startup.hold({1: 2}, now=0.0, hello=False) is None and startup.held
    assert startup.settle(1.0, hello=False, alive=2) is None  # the others may still end alike
    assert startup.hold({0: 2, 2: 2}, now=1.5, hello=False) is None
    ranks, end = startup.settle(1.6, hello=False, alive=0)
    assert ranks == [0, 1, 2] and "code 2 before ftrun.init, a usage error" in end and not startup.held


def test_the_same_start_up_failure_twice_in_a_row_ends_the_job() -> None:
    startup = StartupFailures(world_size=2, hold=10.0)
    startup.hold({0: 1, 1: 1}, now=0.0, hello=False)
    assert startup.settle(0.1, hello=False, alive=0) == ([0, 1], None)  # first time: restart
    startup.new_attempt()
    startup.hold({0: 1, 1: 1}, now=20.0, hello=False)
    ranks, end = startup.settle(20.1, hello=False, alive=0)
    assert "code 1 before ftrun.init in two attempts in a row" in end
    # different codes, or an attempt between that ended otherwise: restarted as usual
    startup = StartupFailures(world_size=2, hold=10.0)
    startup.hold({0: 1, 1: 3}, now=0.0, hello=False)
    assert startup.settle(0.1, hello=False, alive=0) == ([0, 1], None)
    startup.new_attempt()
    startup.hold({0: 3, 1: 3}, now=9.0, hello=False)
    assert startup.settle(9.1, hello=False, alive=0) == ([0, 1], None)
    startup.new_attempt()
    startup.hold({1: 7}, now=30.0, hello=False)
    assert startup.settle(30.1, hello=True, alive=1) == ([1], None)  # a rank said hello: not all alike
    startup.new_attempt()
    assert startup.previous is None


def test_a_held_start_up_failure_is_decided_when_its_hold_ends_or_a_rank_says_hello() -> None:
    startup = StartupFailures(world_size=4, hold=10.0)
    startup.hold({3: 137}, now=5.0, hello=False)
    assert startup.settle(14.9, hello=False, alive=3) is None
    assert startup.settle(15.0, hello=False, alive=3) == ([3], None)
    startup = StartupFailures(world_size=4, hold=10.0)
    startup.hold({3: 1}, now=5.0, hello=False)
    assert startup.hold({2: 1}, now=6.0, hello=True) == [2, 3]  # a failure after a hello: decided now
    assert not startup.held


def test_ranks_that_exited_before_init_are_named_so() -> None:
    decision = decide_on_failure([0, 1], world_size=2, arf=True, library_ranks=[], restarts_used=0, max_restarts=3)
    assert decision.reason == "whole-job restart (rank(s) 0-1 exited before ftrun.init)"
    decision = decide_on_failure([0], world_size=2, arf=True, library_ranks=[], restarts_used=0, max_restarts=3)
    assert "rank(s) 0-1 have not said hello through the ftrun worker library" in decision.reason


# --------------------------------------------------------------------------- policy: decide_failure (the facts first)


def facts(*failed: FailedRank, world: int = 4, used: int = 0, max_restarts: int = 3, **kw) -> FailureFacts:
    return FailureFacts(failed=failed or (FailedRank(1),), world_size=world, arf=True, library_ranks=tuple(range(world)),
                        restarts_used=used, max_restarts=max_restarts, **kw)


@pytest.mark.parametrize("given, why", [({"join": True}, "--join"), ({"active": False}, "restarting or ending")])
def test_a_failure_under_join_or_while_the_job_ends_is_only_recorded(given, why) -> None:
    d = decide_failure(facts(moving_home=True, unusable_checkpoint=True, **given))
    assert d.action == Action.RECORD and d.ranks == (1,) and why in d.reason


def test_ranks_moving_back_to_their_node_are_respawned_there_before_any_other_rule() -> None:
    d = decide_failure(facts(FailedRank(3), FailedRank(2), moving_home=True, unusable_checkpoint=True))
    assert d.action == Action.MOVE_HOME and d.ranks == (3, 2) and d.reason == "rank(s) [2, 3] move back to their node"


def test_an_unusable_checkpoint_restarts_the_job_whatever_the_budget() -> None:
    d = decide_failure(facts(FailedRank(2, started_up=False), used=3, max_restarts=3, unusable_checkpoint=True))
    assert d.action == Action.RESTART_JOB and d.reason == "rank(s) [2] failed"


def test_a_failure_before_ftrun_init_is_held_with_what_the_hold_needs() -> None:
    f = facts(FailedRank(0, exit_code=2, started_up=False), FailedRank(1, exit_code=None, started_up=False))
    d = decide_failure(f)
    assert d.action == Action.HOLD and d.ranks == (0, 1)
    assert f.early_exits() == {0: 2, 1: 0} and not f.hello()
    assert facts(FailedRank(0, started_up=False), others_started_up=True).hello()
    assert facts(FailedRank(0, started_up=False), FailedRank(1)).hello()  # a failed rank had started up
    assert decide_failure(facts(FailedRank(1), startup_held=True)).action == Action.HOLD  # a hold in progress takes it


def test_a_failure_after_start_up_goes_to_the_budget() -> None:
    assert decide_failure(facts(FailedRank(1))).action == Action.RESPAWN_RANKS
    assert decide_failure(facts(FailedRank(1), used=3)).action == Action.FAIL_JOB
    assert decide_failure(facts(FailedRank(1), one_event=True, used=2)).action == Action.RESPAWN_RANKS


@pytest.mark.parametrize("code", sorted(TEARDOWN_CRASH_CODES))
def test_a_teardown_crash_after_every_other_rank_finished_fails_the_job_without_a_restart(code: int) -> None:
    plain = FailedRank(1, exit_code=code, exit_desc="killed by SIGABRT", library=False)
    said_done = FailedRank(2, exit_code=code, exit_desc="killed by SIGSEGV", library=True, finished=True)
    d = decide_failed_ranks(facts(plain, said_done, others_succeeded=True))
    assert d.action == Action.FAIL_JOB and d.ranks == (1, 2)
    assert d.reason == teardown_crash([1, 2], "killed by SIGABRT") and "not restarted" in d.reason


@pytest.mark.parametrize("failed, others_succeeded", [
    (FailedRank(1, exit_code=134, library=True, finished=False), True),  # a library rank still training: recovered
    (FailedRank(1, exit_code=1, library=False), True),  # not a teardown crash's code
    (FailedRank(1, exit_code=134, library=False), False),  # the other ranks are still running
])
def test_other_crashes_are_no_teardown_crash(failed: FailedRank, others_succeeded: bool) -> None:
    d = decide_failed_ranks(facts(failed, others_succeeded=others_succeeded))
    assert d.action == Action.RESPAWN_RANKS


def test_a_whole_job_restart_spends_one_restart_or_fails_past_the_budget() -> None:
    d = decide_restart("hang", restarts_used=1, max_restarts=2)
    assert d.action == Action.RESTART_JOB and d.counts_restart and d.reason == "hang"
    d = decide_restart("hang", restarts_used=2, max_restarts=2)
    assert d.action == Action.FAIL_JOB and d.reason == "hang; restart budget exhausted (max_restarts=2)"


def test_a_restart_for_an_unusable_checkpoint_spends_nothing_even_past_the_budget() -> None:
    d = decide_restart("rank(s) [0] failed", restarts_used=2, max_restarts=2, unusable="checkpoint /c is unusable: f bad")
    assert d.action == Action.RESTART_JOB and not d.counts_restart
    assert d.reason == "rank(s) [0] failed; checkpoint /c is unusable: f bad"


def test_a_rank_state_moves_by_its_table_and_an_exit_is_final(caplog: pytest.LogCaptureFixture) -> None:
    from ftrun.coordinator.policy import RANK_TRANSITIONS, RankState
    from ftrun.coordinator.ranks import Incarnation

    assert set(RANK_TRANSITIONS) == set(RankState)
    assert all(RankState.STARTING not in moves for moves in RANK_TRANSITIONS.values())  # a respawn is a new incarnation
    p = Incarnation(number=1, pid=41)
    assert p.move(RankState.HEALTHY) and p.move(RankState.RECOVERING) and p.move(RankState.HEALTHY)
    assert p.move(RankState.STOPPED) and not p.move(RankState.HEALTHY)  # its hello, read while it is stopped
    assert p.state == RankState.STOPPED and p.move(RankState.FAILED)  # it may still exit on its own
    with caplog.at_level("WARNING", logger="ftrun.coordinator"):
        assert not p.move(RankState.HEALTHY)  # a late "recovered" of a process that died
    assert p.state == RankState.FAILED and "no move from failed to healthy" in caplog.text
    done = Incarnation(number=2)
    assert done.move(RankState.SUCCEEDED) and not done.move(RankState.RECOVERING) and done.state == RankState.SUCCEEDED
    # A round's start moves survivors from these two without Incarnation.move (ftrun.coordinator.rounds)
    assert all(RankState.RECOVERING in RANK_TRANSITIONS[s] for s in (RankState.HEALTHY, RankState.RECOVERING))
