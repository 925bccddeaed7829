"""The worker's phases: one named phase with a transition table, not flags; an illegal
transition raises."""

from __future__ import annotations

import pytest

from ftrun.rank.workerstate import ERROR_PHASES, TRANSITIONS, IllegalTransition, Phase, WorkerState


def test_every_phase_has_its_row() -> None:
    assert set(TRANSITIONS) == set(Phase)
    assert TRANSITIONS[Phase.ORPHANED] == frozenset()  # the dying gasp ends the process


@pytest.mark.parametrize("path, bad", [
    ([], Phase.FAILED),                                      # no error before the rank is bound
    ([Phase.HEALTHY], Phase.JOINING),                        # a rank that trains never joins again
    ([Phase.HEALTHY], Phase.SPARE),
    ([Phase.SPARE], Phase.RECOVERING),                       # a spare has no rank to recover
    ([Phase.HEALTHY, Phase.ORPHANED], Phase.HEALTHY),        # nothing after the gasp
    ([Phase.HEALTHY, Phase.FAILED, Phase.RECOVERING], Phase.FAILED),
    ([Phase.HEALTHY, Phase.PENDING_REPAIR], Phase.FAILED),   # a pending repair supersedes it
])
def test_an_illegal_transition_raises(path: list[Phase], bad: Phase) -> None:
    state = WorkerState()
    for phase in path:
        state.to(phase)
    before = state.phase
    with pytest.raises(IllegalTransition, match=f"from {before.name} to {bad.name}"):
        state.to(bad, "why")
    assert state.phase is before  # unchanged


def test_a_failed_step_recovers_and_trains_again() -> None:
    state = WorkerState(managed=True)
    state.to(Phase.HEALTHY)
    assert not state.failed and state.error is None
    state.to(Phase.FAILED, "gradient all-reduce failed: Connection closed by peer")
    assert state.failed and state.error.startswith("gradient all-reduce")
    assert state.recover() == "comm" and state.phase is Phase.RECOVERING and state.error is None
    state.recovered()
    assert state.phase is Phase.HEALTHY


def test_a_recoverable_error_is_reported_as_such() -> None:
    state = WorkerState(managed=True)
    state.to(Phase.HEALTHY)
    state.to(Phase.PENDING_REPAIR, "RecoverableError: bit flip")
    assert state.failed and state.error is None  # pending: repaired outside autograd first
    state.to(Phase.REPAIRING, "recoverable error at step 3: RecoverableError: bit flip")
    assert state.error is not None and state.fault_kind == "recoverable"
    assert state.recover() == "recoverable"


def test_a_rank_at_the_finish_barrier_returns_there_after_a_recovery() -> None:
    state = WorkerState(managed=True)
    state.to(Phase.HEALTHY)
    state.to(Phase.FINISHED)
    state.recover()
    state.recovered()
    assert state.phase is Phase.FINISHED


def test_a_respawned_rank_joins_through_a_recovery() -> None:
    state = WorkerState(managed=True)
    state.to(Phase.SPARE)
    state.to(Phase.JOINING)
    with pytest.raises(IllegalTransition):
        state.to(Phase.FAILED)
    state.recover()
    state.recovered()
    assert state.phase is Phase.HEALTHY


def test_error_phases_are_what_skips_a_steps_collectives() -> None:
    assert ERROR_PHASES == {Phase.FAILED, Phase.REPAIRING, Phase.PENDING_REPAIR}


def test_a_hot_spare_worker_is_in_the_spare_phase(monkeypatch) -> None:
    from ftrun.rank.worker import Worker

    monkeypatch.setenv("FTRUN_HOT_SPARE", "1")  # a worker without a process group or a channel
    worker = Worker("gloo", None, None)
    assert worker.state.phase is Phase.SPARE and worker.managed and worker.joining
    with pytest.raises(IllegalTransition):
        worker.state.to(Phase.RECOVERING)


def test_a_rank_freezes_the_collector_at_exit() -> None:
    """``ftrun.init`` registers ``gc.freeze`` with atexit: it has run by the time the handlers
    registered before ``init`` run (last-registered first), and not before the exit: the
    interpreter's final collections then skip every object alive (1.3 to 2 s of a rank's exit)."""
    import subprocess
    import sys
    from pathlib import Path

    import digits_job as dj

    script = Path(__file__).resolve().parent / "scripts" / "exit_freeze.py"
    done = subprocess.run([sys.executable, str(script)], env=dj.env(), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    lines = dict(line.split(": ") for line in done.stdout.splitlines() if line.startswith("frozen"))
    assert lines["frozen before exit"] == "0" and lines["frozen after init"] == "0", done.stdout
    assert int(lines["frozen at exit"]) > 10_000, done.stdout  # torch's objects, at least
