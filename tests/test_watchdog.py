"""Hangs and soft faults end to end on the 4-rank digits job: watchdog, stack dumps, HCCE and UCE.

Each faulted run must end with the fault-free run's ``params_sha256``. A hung rank is replaced (its
Python stacks first land in its log); a communication error or a recoverable error is repaired with
no process replaced at all.
"""

from __future__ import annotations

import signal
from pathlib import Path

import digits_job as dj
import pytest

from ftrun.errors import RecoverableError
from ftrun.rank.worker import Step

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _kinds(events: list[dict], kind: str) -> list[dict]:
    return [e for e in events if e["kind"] == kind]


def _assert_nobody_replaced(events: list[dict]) -> None:
    assert all(len(pids) == 1 for pids in dj.started(events).values()), dj.story(events)
    assert not _kinds(events, "rank_failed") and not _kinds(events, "rank_respawned"), dj.story(events)
    assert not _kinds(events, "job_restarting"), dj.story(events)


def _assert_hang_replaced(events: list[dict], rank: int, fault: str | None) -> dict:
    hung = _kinds(events, "rank_hung")
    assert [e["rank"] for e in hung] == [rank], hung
    assert fault is None or hung[0]["detail"]["fault"] == fault
    dj.assert_survivors_kept_pids(events, {rank})
    failed = _kinds(events, "rank_failed")
    assert [e["rank"] for e in failed] == [rank] and "hung" in failed[0]["detail"]["cause"]
    return hung[0]


@pytest.mark.parametrize("kind, frame", [("hang", "in fire"), ("deadlock", "in fire")])
def test_stuck_step_is_detected_dumped_and_replaced(reference: str, tmp_path: Path, kind: str, frame: str) -> None:
    # An endless loop inside a step, or a deadlock on a Python lock after a committed step: the
    # rank keeps sending heartbeats, but the job's steps stop; its peers wait in the collective.
    point = "before_forward" if kind == "hang" else "between_steps"
    digest, events, _ = dj.run(tmp_path, f"rank=1,step=9,point={point},kind={kind}")
    assert digest == reference
    hung = _assert_hang_replaced(events, 1, "no_progress")
    log = (tmp_path / "logs" / "worker_1.log").read_text()
    assert hung["detail"]["stack_dump"] and "Thread 0x" in log and "faults.py" in log and frame in log
    assert any("faults.py" in line for line in hung["detail"]["stacks"])


@pytest.mark.parametrize("rank, kind, ddp", [(3, "hang", False), (0, "deadlock", False), (3, "hang", True)])
def test_rank_stuck_inside_the_allreduce_is_not_taken_for_a_communication_hang(
        reference: str, tmp_path: Path, rank: int, kind: str, ddp: bool) -> None:
    # The stuck rank had announced the collective, so it was taken for a communication
    # hang and the HCCE round waited for it forever. Its heartbeat thread now says it is not in
    # torch.distributed while its peers are: it alone is replaced, and the job ends exactly once.
    # With DDP the survivors' all-reduces run in place on DDP's bucket views: the ones
    # the abort gives up on must have ended before the retried step (no survivor replaced for it).
    digest, events, _ = dj.run(tmp_path, f"rank={rank},step=9,point=allreduce,kind={kind}",
                               extra=("--ddp",) if ddp else ())
    assert digest == reference
    _assert_hang_replaced(events, rank, "no_progress")
    dj.assert_survivors_kept_pids(events, {rank})
    assert not [e for e in _kinds(events, "recovery_started") if e["detail"]["fault"] == "comm_error"]


def test_setup_hang_blames_only_the_hung_rank(reference: str, tmp_path: Path) -> None:
    # Rank 0 hangs before its initial broadcast; ranks 1-3 wait in it. Before, all four
    # were declared hung one after another and the restart budget ran out.
    digest, events, _ = dj.run(tmp_path, "rank=0,point=init,kind=hang", extra_env={"FTRUN_SETUP_TIMEOUT": "40"})
    assert digest == reference
    hung = _kinds(events, "rank_hung")
    # Its peers waiting in the broadcast name it within seconds, before --setup_timeout.
    assert [e["rank"] for e in hung] == [0] and hung[0]["detail"]["fault"] == "stalled"


def test_frozen_rank_is_replaced(long_reference: str, tmp_path: Path) -> None:
    # SIGSTOP from outside: its parent (node 0's agent) gets a SIGCHLD for the stop and reports it
    # at once; no heartbeat timeout to wait for, no stack dump possible.
    out, log_dir = dj.signal_rank_and_finish(tmp_path, 2, signal.SIGSTOP)
    assert dj.digest(out, dj.LONG_STEPS) == long_reference
    hung = _assert_hang_replaced(dj.events(log_dir), 2, "stopped")
    assert "SIGSTOP" in hung["message"] and not hung["detail"]["stack_dump"]
    failed = _kinds(dj.events(log_dir), "rank_failed")[0]
    assert failed["detail"]["detection_seconds"] < 2.0, "a stopped rank waited for the heartbeat timeout"


def test_communication_error_rebuilds_the_group_without_respawn(reference: str, tmp_path: Path) -> None:
    # HCCE: rank 1's connections are cut inside the all-reduce of step 9; every rank is alive.
    digest, events, _ = dj.run(tmp_path, "rank=1,step=9,point=allreduce,kind=comm")
    assert digest == reference
    _assert_nobody_replaced(events)
    started = _kinds(events, "recovery_started")
    assert started and started[0]["detail"]["fault"] == "comm_error"
    plan = _kinds(events, "recovery_planned")[0]["detail"]
    committed = {int(r): s for r, s in plan["committed"].items()}
    assert plan["step"] == 8 and max(committed.values()) == 8, plan  # nobody committed step 9
    # Usually nothing moves. A rank the abort reached before it committed step 8 (a loaded machine
    # let rank 1 run a whole step ahead of it; CI saw ranks 2 and 3 so) takes step 8 from one that has it.
    assert sorted(r for _, r in plan["transfers"]) == sorted(r for r, s in committed.items() if s != 8), plan
    assert (_kinds(events, "recovery_finished")[0]["detail"]["bytes"] == 0) == (plan["transfers"] == [])


@pytest.mark.parametrize("point", ["optimizer", "allreduce"])
def test_recoverable_error_is_repaired_in_place(reference: str, tmp_path: Path, point: str) -> None:
    # UCE: the rank stays alive, drops its state, takes a replica's; all retry the step.
    digest, events, _ = dj.run(tmp_path, f"rank=3,step=9,point={point},kind=recoverable")
    assert digest == reference
    _assert_nobody_replaced(events)
    started = _kinds(events, "recovery_started")
    assert started and started[0]["detail"]["fault"] == "recoverable_error"
    assert len(started) == 1, dj.story(events)  # the rank's late answer to the abort is not a failed plan
    plan = _kinds(events, "recovery_planned")[0]["detail"]
    # The rank with the error drops its state and takes a replica's; a survivor that the abort
    # reached before its update of the step takes it too (rank 2 may commit the step first).
    assert 3 in [t[1] for t in plan["transfers"]] and 3 not in [t[0] for t in plan["transfers"]], plan
    assert _kinds(events, "recovery_finished")[0]["detail"]["bytes"] > 0


def test_recoverable_error_with_uce_off_replaces_the_rank(reference: str, tmp_path: Path) -> None:
    # Without UCE the error is an ordinary exception: the process dies and ARF replaces it.
    digest, events, _ = dj.run(tmp_path, "rank=3,step=9,point=optimizer,kind=recoverable",
                               extra_env={"FTRUN_TFT": "{ARF:1,UCE:0}"})
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {3})
    assert [e["rank"] for e in _kinds(events, "rank_failed")] == [3]


def test_step_guard_suppresses_only_recoverable_errors(monkeypatch) -> None:
    from ftrun.rank.worker import Worker

    monkeypatch.setenv("FTRUN_HOT_SPARE", "1")  # a worker without a process group or a channel
    worker = Worker("gloo", None, None)
    worker.managed, worker.uce = True, True
    repaired: list[str] = []

    def repair(error: str, drop: bool) -> None:
        assert drop is False  # inside __exit__ the traceback still holds the frames
        repaired.append(error)

    worker._repair_in_place = repair  # type: ignore[method-assign]
    step = Step(7, worker)
    assert step == 7 and step + 1 == 8 and f"{step}" == "7"
    with step:
        raise RecoverableError("bit flip")
    assert repaired == ["RecoverableError: bit flip"]
    with pytest.raises(ValueError):
        with Step(7, worker):
            raise ValueError("a bug")
    worker.uce = False  # UCE off: a RecoverableError is an ordinary exception
    with pytest.raises(RecoverableError):
        with Step(8, worker):
            raise RecoverableError("bit flip")
    assert repaired == ["RecoverableError: bit flip"]


@pytest.mark.parametrize("fault, hung", [
    # the last rank hangs before the initial broadcast; later a respawned rank hangs before it receives
    ("rank=3,point=init,kind=hang; rank=2,step=8,kind=kill; rank=2,point=rejoin,kind=hang,incarnation=1",
     {3: "stalled", 2: "stalled"}),
    # rank 0 hangs as a donor mid-transfer while the last rank hangs before answering the abort
    ("rank=2,step=8,kind=kill; rank=0,point=transfer,kind=hang; rank=3,point=recover,kind=hang",
     {0: "stalled", 3: "recovery"}),
], ids=["init-and-rejoin", "transfer-and-recover"])
def test_a_hang_inside_a_recovery_is_replaced_within_seconds(reference: str, tmp_path: Path, fault: str,
                                                             hung: dict[int, str]) -> None:
    # A rank hung at `rejoin` or `init` held the job until the 300 s set-up timeout
    # (exit 137 at `rejoin`); at `transfer` and `recover`, 60-150 s. Its peers waiting for it in
    # torch.distributed, or the round's report deadline, now name it within seconds (closing note:
    # 5 s for a stall, 10 s for an unanswered abort), and the job ends exactly once.
    digest, events, _ = dj.run(tmp_path, fault)
    assert digest == reference
    found = {e["rank"]: e["detail"]["fault"] for e in _kinds(events, "rank_hung")}
    assert found == hung, dj.story(events)
    assert not _kinds(events, "job_restarting"), dj.story(events)
