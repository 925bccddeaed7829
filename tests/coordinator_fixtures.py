"""The job coordinator driven without processes: fake node agents, fake rank messages, an
injected clock (shared by the coordinator's process-free tests).

As torchelastic's agent tests feed ``_monitor_workers`` a sequence of results and NVRx's timeout
tests feed timestamps, these helpers drive :class:`~ftrun.coordinator.Coordinator` directly: the
agents are :class:`FakeAgent` objects that record what they are told and report what the test
says happened; rank messages are handed to ``handle()``; time is a number the test moves. A test
module that uses :func:`make` imports :func:`close_coordinators` too (an autouse fixture).
"""

from __future__ import annotations

import json
import signal
from pathlib import Path
from typing import Any, Mapping

import pytest

from ftrun.config import JobSpec
from ftrun.rank.client import StepBoard
from ftrun.coordinator import Coordinator
from ftrun.coordinator.agents import AgentHandle, Spawned, Stacks
from ftrun.common.protocol import Message, MsgType
from ftrun.rank.recovery import RankProgress
from ftrun.node.spawner import ExitReport

TOKEN = "t" * 64


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class FakeAgent(AgentHandle):
    """Records the coordinator's orders; spawns and stops "processes" at once."""

    def __init__(self, node: int) -> None:
        self.node = node
        self.spawned: list[tuple[int, int, bool, dict[str, str]]] = []
        self.hung: list[tuple[int, bool]] = []
        self.stops = 0
        self.running: dict[int, tuple[int, int]] = {}  # rank -> (incarnation, pid)
        self.reports: list[Any] = []
        self.next_pid = 1000 * (node + 1)

    def spawn(self, rank: int, incarnation: int, rank_vars: Mapping[str, str], header: str, use_spare: bool) -> None:
        self.next_pid += 1
        self.spawned.append((rank, incarnation, use_spare, dict(rank_vars)))
        self.running[rank] = (incarnation, self.next_pid)
        self.reports.append(Spawned(rank, incarnation, self.next_pid, "warm" if use_spare else ""))

    def signal(self, rank: int, incarnation: int, sig: int) -> None:
        pass

    def kill_hung(self, rank: int, incarnation: int, line: str, dump: bool) -> None:
        self.hung.append((rank, dump))
        self.reports.append(Stacks(rank, incarnation, [], "no stack dump (test)"))
        self.exit(rank, -signal.SIGKILL)

    def stop_ranks(self, grace_period: float) -> None:
        self.stops += 1
        for rank in list(self.running):
            self.exit(rank, -signal.SIGTERM)

    def keep_spares(self, warm: int, hot: int, model_vars: Mapping[str, str]) -> None:
        self.spares = (warm, hot)

    def shutdown(self, code: int, message: str) -> None:
        pass

    def take_reports(self) -> list[Any]:
        out, self.reports = self.reports, []
        return out

    def exit(self, rank: int, returncode: int, at: float = 0.0) -> None:
        incarnation, pid = self.running.pop(rank)
        self.reports.append(ExitReport(rank, incarnation, pid, returncode, at))


MADE: list[Coordinator] = []


@pytest.fixture(autouse=True)
def close_coordinators():
    yield
    while MADE:
        MADE.pop().close()  # its ZeroMQ context would block the interpreter's exit


def make(tmp_path: Path, world: int = 4, local: int | None = None, **kw: Any) -> tuple[Coordinator, FakeAgent, Clock]:
    local = local or world
    spec = JobSpec(script="train.py", worker_num=world, local_worker_num=local, log_dir=str(tmp_path),
                   checkpoint_dir=str(tmp_path / "ckpt"), master_port=29500, **kw)
    clock = Clock()
    agent = FakeAgent(0)
    coord = Coordinator(spec, TOKEN, None, 29500, local_agent=agent, clock=clock)
    coord.spawning.run_id = "test"
    MADE.append(coord)
    coord.start_attempt()
    assert coord.check_processes() is None
    return coord, agent, clock


def msg(mtype: MsgType, /, **fields: Any) -> Message:
    return Message(mtype, fields)


def ident(rank: int, incarnation: int = 0) -> bytes:
    return f"conn-{rank}-{incarnation}".encode()


def hello_all(coord: Coordinator, ranks: list[int] | None = None) -> None:
    for rank in ranks if ranks is not None else list(coord.ranks):
        r = coord.ranks[rank]
        coord.handle(ident(rank, r.incarnation), msg(MsgType.HELLO, rank=rank, incarnation=r.incarnation, pid=r.proc.pid,
                                                     generation=coord.generation, replica_group=list(coord.ranks), library=True))


def send(coord: Coordinator, rank: int, mtype: MsgType, /, **fields: Any) -> None:
    r = coord.ranks[rank]
    coord.handle(ident(rank, r.incarnation), msg(mtype, rank=rank, incarnation=r.incarnation, **fields))


BOARDS: dict[tuple[int, int, int], StepBoard] = {}


def recover(coord: Coordinator, respawned: int, generation: int = 1) -> None:
    """Carry a round through in a job of 4 ranks: the others answer its abort with step 0
    committed, the respawned rank says hello, and every rank carries out the plan."""
    for rank in range(4):
        if rank != respawned:
            send(coord, rank, MsgType.FAULT, generation=generation, step=1, committed=0, reason="abort")
    hello_all(coord, [respawned])
    for rank in range(4):
        send(coord, rank, MsgType.RECOVERED, generation=generation, role="recipient" if rank == respawned else "none",
             bytes=10, seconds=0.1)


def board(coord: Coordinator, rank: int) -> StepBoard:
    """The step board of rank ``rank``'s current process, on the coordinator's clock (what the
    rank's training thread writes and its heartbeats carry)."""
    key = (id(coord), rank, coord.ranks[rank].incarnation)
    if key not in BOARDS:
        BOARDS[key] = StepBoard(RankProgress(), clock=coord.clock)
    return BOARDS[key]


def beat(coord: Coordinator, rank: int, **probe: Any) -> None:
    """A heartbeat of ``rank`` with its step board."""
    send(coord, rank, MsgType.HEARTBEAT, **board(coord, rank).fields(), **probe)


def begin(coord: Coordinator, rank: int, n: int, collective: bool = False) -> None:
    """``rank`` begins step n (and, with ``collective``, enters its all-reduce), said by a beat."""
    b = board(coord, rank)
    b.progress.current_step = n
    b.begin(n, None)
    if collective:
        b.collective()
    beat(coord, rank)


def step(coord: Coordinator, n: int, ranks: list[int] | None = None) -> None:
    """Every rank begins step n, enters the collective and commits it (a beat at each)."""
    for rank in ranks if ranks is not None else list(coord.ranks):
        begin(coord, rank, n)
        board(coord, rank).collective()
        beat(coord, rank)
        board(coord, rank).progress.committed = n
        board(coord, rank).enter("compute")
        beat(coord, rank)


def kinds(tmp_path: Path) -> list[str]:
    return [json.loads(line)["kind"] for line in (tmp_path / "events.jsonl").read_text().splitlines()]


def events(tmp_path: Path, kind: str) -> list[dict]:
    return [e for e in map(json.loads, (tmp_path / "events.jsonl").read_text().splitlines()) if e["kind"] == kind]


def beat_all(coord: Coordinator, **probe: Any) -> None:
    for rank, r in coord.ranks.items():
        if r.alive() and r.proc.identity is not None:
            send(coord, rank, MsgType.HEARTBEAT, **probe)
