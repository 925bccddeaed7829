"""Rank-level recovery (ARF) end to end: real ranks, real faults, bitwise exactly-once.

Every faulted run of the 4-rank digits job must end with the same ``params_sha256`` as the fault-free
run, and ranks that did not fault must keep their first process (same PID) throughout.
"""

from __future__ import annotations

import itertools
import os
import signal
import socketserver
import threading
from pathlib import Path

import digits_job as dj
import msgpack
import pytest
import zmq

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


POINTS = ("before_forward", "allreduce", "optimizer", "between_steps")


@pytest.mark.parametrize("rank", [0, 3])
def test_kill_at_each_point_is_exactly_once(reference: str, tmp_path: Path, rank: int) -> None:
    """One job per rank (the work of four in one): a kill at each of the step's injection points in
    turn, at steps 4, 9, 14 and 19 (each new incarnation dies at the next point); every fault is
    recovered from a replica, the step retried exactly once."""
    steps = [4 + 5 * i for i in range(len(POINTS))]
    fault = "; ".join(f"rank={rank},step={s},point={p},kind=kill,incarnation={i}" for i, (s, p) in enumerate(zip(steps, POINTS)))
    digest, events, _ = dj.run(tmp_path, fault)
    assert digest == reference, dj.story(events)
    dj.assert_survivors_kept_pids(events, {rank})
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [rank] * len(POINTS), dj.story(events)
    finished = [e["detail"] for e in events if e["kind"] == "recovery_finished"]
    planned = [e["detail"] for e in events if e["kind"] == "recovery_planned"]
    for step in steps:
        # Resumed at the killed step or the next. One step earlier only when no survivor had
        # committed the step before it: the killed rank had finished that step's all-reduce and
        # committed it, and its death cut the connections before its peers finished theirs (seen
        # in CI28 under load: rank 0 killed before step 4's forward, every survivor at step 2).
        behind = any(p["step"] == step - 2 and all(c <= step - 2 for r, c in p["committed"].items() if int(r) != rank)
                     for p in planned)
        allowed = (step - 1, step, step + 1) if behind else (step, step + 1)
        assert [d for d in finished if d["resume_step"] in allowed and d["bytes"] > 0], dj.story(events)


def test_rank_killed_after_its_last_step_recovers_from_ranks_that_finished(reference: str, tmp_path: Path) -> None:
    """Rank 0 dies in ft.finish(), after its epilogue: the others wait in the finish
    barrier with their final state, the respawned rank 0 takes it and runs its epilogue again,
    and nothing is trained twice (no whole-job restart)."""
    digest, events, out = dj.run(tmp_path, "rank=0,point=finish,kind=kill")
    assert digest == reference, dj.story(events)
    dj.assert_survivors_kept_pids(events, {0})
    assert [m.group(3) for m in dj.FINAL.finditer(out)] == [reference, reference]  # both incarnations' epilogues
    finished = [e["detail"] for e in events if e["kind"] == "recovery_finished"]
    assert [d["resume_step"] for d in finished] == [int(dj.STEPS)] and finished[0]["bytes"] > 0, dj.story(events)


def test_a_hand_written_update_under_apply_update_is_exactly_once(tmp_path: Path) -> None:
    """A script without a torch optimizer (``p.add_(p.grad, alpha=-lr)``) guards
    its update with ``ft.apply_update``: a kill in the all-reduce and one inside the update leave
    it bitwise equal to the same training with ``torch.optim.SGD`` and no fault."""
    (tmp_path / "sgd").mkdir()
    (tmp_path / "hand").mkdir()
    ref, _, _ = dj.run(tmp_path / "sgd", extra=("--momentum", "0"))
    digest, events, _ = dj.run(tmp_path / "hand", "rank=1,step=6,point=allreduce,kind=kill; rank=2,step=14,point=optimizer,kind=kill",
                               extra=("--momentum", "0", "--hand_update"))
    assert digest == ref, dj.story(events)
    dj.assert_survivors_kept_pids(events, {1, 2})
    assert len([e for e in events if e["kind"] == "recovery_finished"]) == 2, dj.story(events)


def test_two_faults_on_different_ranks(reference: str, tmp_path: Path) -> None:
    digest, events, _ = dj.run(tmp_path, "rank=1,step=6,point=allreduce,kind=kill; rank=2,step=15,point=optimizer,kind=exit,code=3")
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {1, 2})
    assert len([e for e in events if e["kind"] == "recovery_finished"]) == 2


def test_new_rank_killed_while_rejoining(reference: str, tmp_path: Path) -> None:
    digest, events, _ = dj.run(tmp_path, "rank=1,step=8,kind=kill; rank=1,point=rejoin,incarnation=1,kind=kill")
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {1})
    assert len(dj.started(events)[1]) == 3  # first process, the one killed while rejoining, the one that made it


def test_donor_killed_during_transfer(reference: str, tmp_path: Path) -> None:
    # Rank 3 dies; rank 0 is the donor and dies after sending part of the state; rank 1 takes over.
    digest, events, _ = dj.run(tmp_path, "rank=3,step=8,kind=kill; rank=0,point=transfer,kind=kill")
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {0, 3})
    plans = [e for e in events if e["kind"] == "recovery_planned"]
    assert plans[0]["detail"]["transfers"] == [[0, 3]]
    assert any(1 in t[:1] for p in plans[1:] for t in p["detail"]["transfers"])


def test_second_rank_dies_during_recovery(reference: str, tmp_path: Path) -> None:
    # Rank 1 dies; rank 2, a survivor, dies as it enters that recovery: one recovery, two rounds.
    digest, events, _ = dj.run(tmp_path, "rank=1,step=8,kind=kill; rank=2,point=recover,kind=kill")
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {1, 2})
    finished = [e for e in events if e["kind"] == "recovery_finished"]
    assert len(finished) == 1
    # One round a death. A survivor's all-reduce with the killed rank fails ("Connection reset by
    # peer"), and its report can reach the coordinator before the agent's SIGCHLD does (seen once in
    # CI, reproduced 1 in 6 under load): that starts a round for a communication error first, which
    # the death restarts at once. It respawns nothing and delays no respawn, so it is accepted, and
    # only as the first round. Rank 2's own all-reduce with rank 1 can also fail at once, so that
    # it enters recovery and dies within the millisecond of rank 1's death: when both deaths are
    # reaped before the first round starts, that round takes both, and it is the only one.
    started = [e for e in events if e["kind"] == "recovery_started"]
    early = int(bool(started) and started[0]["detail"]["fault"] == "comm_error" and not started[0]["detail"]["failed"])
    first = events.index(started[early])
    together = {e["rank"] for e in events[:first] if e["kind"] == "rank_failed"} == {1, 2}
    rounds = [[1, 2]] if together else [[1], [2]]
    assert [e["detail"]["failed"] for e in started[early:]] == rounds, dj.story(events)
    assert finished[0]["detail"]["failed"] == [1, 2] and finished[0]["detail"]["rounds"] == len(rounds) + early


@pytest.mark.parametrize("fault", ["rank=2,step=0,kind=kill", "rank=2,point=init,kind=kill"])
def test_death_before_the_first_step(reference: str, tmp_path: Path, fault: str) -> None:
    # Nothing is committed yet: the ranks holding rank 0's initial weights give them to the others.
    digest, events, _ = dj.run(tmp_path, fault)
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {2})
    assert [e for e in events if e["kind"] == "recovery_finished"][-1]["detail"]["resume_step"] == 0


def test_rank0_dies_before_its_broadcast_falls_back_to_a_restart(reference: str, tmp_path: Path) -> None:
    # No live rank holds rank 0's initial weights: ARF cannot recover; the job restarts, with a reason.
    digest, events, _ = dj.run(tmp_path, "rank=0,point=init,kind=exit")
    assert digest == reference
    fallback = [e for e in events if e["kind"] == "recovery_fallback"]
    assert fallback and "holds the training state" in fallback[0]["message"]
    assert len([e for e in events if e["kind"] == "job_restarting"]) == 1


def test_ddp_model_recovers_with_the_same_result(reference: str, tmp_path: Path) -> None:
    # DDP over a private one-rank group with a pass-through hook: same bits as the plain module.
    digest, events, _ = dj.run(tmp_path, "rank=3,step=7,point=allreduce,kind=kill", extra=("--ddp",))
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {3})


def test_other_exit_kinds(reference: str, tmp_path: Path) -> None:
    digest, events, _ = dj.run(tmp_path, "rank=2,step=5,kind=segv; rank=1,step=12,kind=exception")
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {1, 2})
    causes = {e["rank"]: e["detail"]["cause"] for e in events if e["kind"] == "rank_failed"}
    assert causes == {2: "killed by SIGSEGV", 1: "exit code 1"}
    # The crash left its Python stacks (faulthandler) in the rank's log and event.
    tail = next(e for e in events if e["kind"] == "rank_failed" and e["rank"] == 2)["detail"].get("log_tail", [])
    assert any("Segmentation fault" in line for line in tail) and any("faults.py" in line for line in tail), tail


def test_kill_from_outside(long_reference: str, tmp_path: Path) -> None:
    out, log_dir = dj.signal_rank_and_finish(tmp_path, 2, signal.SIGKILL)
    assert dj.digest(out, dj.LONG_STEPS) == long_reference
    dj.assert_survivors_kept_pids(dj.events(log_dir), {2})


def test_forged_messages_change_nothing(long_reference: str, tmp_path: Path) -> None:
    proc, log_dir = dj.start(tmp_path)
    try:
        dj.wait_for(lambda: dj.training(log_dir))
        events = dj.events(log_dir)
        control = next(e for e in events if e["kind"] == "job_started")["detail"]["control"]
        pids = dj.started(events)
        ctx = zmq.Context()
        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 5000)
        sock.connect(control)
        forged = [
            b"garbage",
            msgpack.packb([1, 2, 3]),
            msgpack.packb({"v": 1, "tok": "0" * 64, "type": "fault", "rank": 1, "incarnation": 0, "generation": 0,
                           "step": 3, "committed": 2, "reason": "forged"}),
            msgpack.packb({"v": 1, "type": "hello", "rank": 2, "incarnation": 0, "pid": pids[2][0], "generation": 0,
                           "replica_group": [0, 1, 2, 3], "library": True}),
            b"\xc1" * 100,
        ]
        for frame in forged:
            sock.send(frame)
        sock.send_multipart([b"a", b"b", b"c"])
        # Keep the connection until the supervisor has seen every frame (connecting is asynchronous).
        dj.wait_for(lambda: len([e for e in dj.events(log_dir) if e["kind"] == "message_rejected"]) >= len(forged) + 1)
        sock.close()
        ctx.term()
        out, _ = proc.communicate(timeout=200)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 0, out[-3000:]
    assert dj.digest(out, dj.LONG_STEPS) == long_reference
    events = dj.events(log_dir)
    assert len([e for e in events if e["kind"] == "message_rejected"]) >= len(forged)
    assert not [e for e in events if e["kind"] in ("rank_failed", "recovery_started", "job_restarting")]
    assert all(len(p) == 1 for p in dj.started(events).values())


class _Echo(socketserver.StreamRequestHandler):
    """Echoes each line back and records it under its connection (a number of its own: ``id()``
    of a handler whose connection ended may be reused by the next one, which then wrote into the
    ended conversation: a killed rank's replacement was not found under its own hello)."""

    def handle(self) -> None:
        lines = self.server.lines.setdefault(next(self.server.connections), [])  # type: ignore[attr-defined]
        for raw in self.rfile:
            lines.append(raw.decode().strip())
            self.wfile.write(raw)
            self.wfile.flush()


@pytest.fixture
def echo_server():
    server = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Echo)
    server.daemon_threads = True
    server.lines = {}  # type: ignore[attr-defined]
    server.connections = itertools.count()  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


def test_torch_distributed_and_the_scripts_own_sockets_survive_recoveries(reference: str, tmp_path: Path, echo_server) -> None:
    # A respawned rank's set-up and a survivor's failed step can ask
    # torch.distributed for their rank (a placeholder group stands between generations), and a
    # TCP connection each rank holds to the test's echo server works across a cut of its own
    # group's connections (rank 1, kind=comm) and a recovery from a death (rank 2): releasing a
    # blocked collective shuts down only the group's connections.
    script = Path(__file__).resolve().parent / "scripts" / "dist_usable.py"
    port = echo_server.server_address[1]
    digest, events, stdout = dj.run(
        tmp_path, fault="rank=1,step=5,point=allreduce,kind=comm; rank=2,step=10,point=allreduce,kind=kill",
        script=script, extra_env={"FTRUN_TEST_ECHO": f"127.0.0.1:{port}"})
    assert digest == reference
    dj.assert_survivors_kept_pids(events, {2})
    assert len([e for e in events if e["kind"] == "recovery_finished"]) >= 2, dj.story(events)
    conversations = {lines[0]: lines for lines in echo_server.lines.values() if lines}
    for me in ("0 0", "1 0", "3 0", "2 1"):  # each survivor's one connection, the respawned rank's
        lines = conversations.get(f"hello {me}")
        assert lines is not None and lines[-1] == f"end {me}", (me, sorted(conversations))
        assert lines.count("step") >= 10, lines
    logs = {r: (tmp_path / "logs" / f"worker_{r}.log").read_text() for r in (1, 2, 3)}
    logs[0] = stdout
    assert "set-up: dist rank 2 of 4, incarnation 1" in logs[2], logs[2][-2000:]
    # A survivor that was in a failed all-reduce ran the rest of that body with the group down
    # (one that saw the abort between steps did not run it: that is timing, so not every one).
    for r in (0, 1, 3):
        lines = [line for line in logs[r].splitlines() if line.startswith("failed step:")]
        assert all(line == f"failed step: dist rank {r} of 4" for line in lines), lines
