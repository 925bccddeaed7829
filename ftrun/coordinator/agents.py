"""The coordinator's view of the nodes' agents: one interface, two kinds, and what they report.

The coordinator sees every node's agent through :class:`AgentHandle` (cf. torchelastic's
``ElasticAgent``: what a supervisor of a node's workers can be asked):

- :class:`LocalAgent`: node 0's agent, in the coordinator's own process (a single-node job is the
  coordinator and one local agent; no extra hop on the path from a death to its recovery);
- :class:`RemoteAgent`: the coordinator's proxy of another node's agent process
  (:class:`ftrun.node.agent.NodeAgent`, ``python -m ftrun.node.agent``), which talks to the coordinator over
  the authenticated control plane (:mod:`ftrun.common.protocol`).

Results come back the same way from both: :meth:`AgentHandle.take_reports` returns what happened
since the last call (:class:`Spawned`, :class:`~ftrun.node.spawner.ExitReport`, :class:`Stacks`,
:class:`~ftrun.node.spawner.StopReport`, :class:`SpareNote`, :class:`StandbyOffer`).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from ftrun.common.protocol import Message, MsgType
from ftrun.node.forks import StartReport
from ftrun.node.relay import ROWS_PER_FRAME
from ftrun.node.spawner import EXIT_TAIL_LINES, ExitReport, RankProcesses, StopReport

log = logging.getLogger("ftrun.coordinator")


@dataclass(frozen=True)
class Spawned:
    """A rank process started on a node (``spare``: "hot" or "warm" if a spare took it, else "")."""

    rank: int
    incarnation: int
    pid: int
    spare: str


@dataclass(frozen=True)
class Stacks:
    """The stacks a hung rank wrote before it was killed (``lines`` may be empty; ``note`` says why)."""

    rank: int
    incarnation: int
    lines: list[str]
    note: str


@dataclass(frozen=True)
class SpareNote:
    """What a node's spares showed the coordinator should know (a script that breaks the
    hot-spare contract, :meth:`ftrun.node.spawner.RankProcesses.keep_spares`)."""

    message: str


@dataclass(frozen=True)
class StandbyOffer:
    """A node's agent stands by as the job coordinator (asked with ``stand_by``): its endpoint
    and store (:mod:`ftrun.coordinator.failover`)."""

    control: str
    store: str


Report = Spawned | ExitReport | Stacks | StopReport | SpareNote | StandbyOffer


def _as_report(seen: ExitReport | StopReport | StartReport) -> Report:
    """What node 0's own processes did, as an agent reports it (a fork server's start: spawned)."""
    return Spawned(seen.rank, seen.incarnation, seen.pid, seen.spare) if isinstance(seen, StartReport) else seen


class AgentHandle:
    """What the coordinator can ask of a node's agent. Calls never block on the network; what
    they cause comes back through :meth:`take_reports`."""

    node: int
    leaving: str | None = None  # the reason a node's launcher gave for leaving the job (a remote agent's)

    def spawn(self, rank: int, incarnation: int, rank_vars: Mapping[str, str], header: str, use_spare: bool) -> None:
        raise NotImplementedError

    def signal(self, rank: int, incarnation: int, sig: int) -> None:
        raise NotImplementedError

    def kill_hung(self, rank: int, incarnation: int, line: str, dump: bool) -> None:
        """Dump the rank's stacks into its log (if ``dump``: only the worker library answers the
        request), write ``line`` there (``{note}`` replaced by how the dump went), then SIGKILL it."""
        raise NotImplementedError

    def stop_ranks(self, grace_period: float) -> None:
        """SIGTERM every rank of the node, SIGKILL after ``grace_period`` seconds; exits are reported."""
        raise NotImplementedError

    def keep_spares(self, warm: int, hot: int, model_vars: Mapping[str, str]) -> None:
        """Keep ``warm`` warm and ``hot`` hot spares on the node (:meth:`RankProcesses.keep_spares`)."""
        raise NotImplementedError

    def shutdown(self, code: int, message: str) -> None:
        raise NotImplementedError

    def announce_standby(self, control: str, store: str, epoch: int, seats: list[list[Any]] | None = None) -> None:
        """Tell the agent where the standby coordinator is (it moves there if this one dies):
        the first's ``control`` and ``store``, and the whole line (``seats``: [control, node],
        first first)."""

    def replicate(self, state: dict[str, Any]) -> None:
        """Send the coordinator's hard state to this node's agent, the standby coordinator."""

    def relay_orders(self, order: MsgType, common: dict[str, Any], rows: list[list[Any]]) -> bool:
        """Have the agent relay a round's ``order`` to its ranks (rows ``[rank, incarnation, own
        fields]``; :mod:`ftrun.node.relay`); False when it cannot (node 0's agent relays nothing:
        send them straight)."""
        return False

    def ask_to_stand_by(self) -> None:
        """Ask the agent to stand by as the job coordinator (it answers with a
        :class:`StandbyOffer`); node 0's own agent cannot."""

    def take_reports(self) -> list[Report]:
        raise NotImplementedError

    def connected(self) -> bool:
        return True

    def note_child_signal(self, at: float) -> None:
        """A ``SIGCHLD`` reached the coordinator's process at Unix time ``at`` (seconds): it dates
        the death of a child of this agent, if the agent runs in that process (node 0's)."""

    def start_note(self) -> str | None:
        """What the job's start should warn of about this node (e.g. the network interface
        chosen for gloo), or None."""
        return None


class LocalAgent(AgentHandle):
    """Node 0's agent, in the coordinator's process: direct calls on :class:`RankProcesses`."""

    def __init__(self, node: int, processes: RankProcesses) -> None:
        self.node = node
        self.processes = processes
        self._reports: list[Report] = []

    def spawn(self, rank: int, incarnation: int, rank_vars: Mapping[str, str], header: str, use_spare: bool) -> None:
        try:
            pid, spare = self.processes.spawn(rank, incarnation, rank_vars, header, use_spare)
        except OSError as err:
            log.error("cannot start rank %d: %s", rank, err)
            self._reports.append(ExitReport(rank, incarnation, 0, 127, time.time()))
            return
        if pid is not None:  # else the fork server answers later (take_reports)
            self._reports.append(Spawned(rank, incarnation, pid, spare))

    def signal(self, rank: int, incarnation: int, sig: int) -> None:
        self.processes.signal(rank, incarnation, sig)

    def kill_hung(self, rank: int, incarnation: int, line: str, dump: bool) -> None:
        lines, note, gone = self.processes.kill_hung(rank, incarnation, line, dump)
        self._reports.append(Stacks(rank, incarnation, lines, note))
        if gone is not None:  # this node never ran it (RankProcesses.kill_hung)
            self._reports.append(gone)

    def stop_ranks(self, grace_period: float) -> None:
        self._reports.extend(map(_as_report, self.processes.stop(grace_period)))

    def keep_spares(self, warm: int, hot: int, model_vars: Mapping[str, str]) -> None:
        note = self.processes.keep_spares(warm, hot, model_vars)
        if note is not None:
            self._reports.append(SpareNote(note))

    def shutdown(self, code: int, message: str) -> None:
        self.processes.stop_spares()

    def take_reports(self) -> list[Report]:
        reports, self._reports = self._reports + list(map(_as_report, self.processes.reap())), []
        return reports

    def note_child_signal(self, at: float) -> None:
        if self.processes.sigchld_at is None:
            self.processes.sigchld_at = at

    def start_note(self) -> str | None:
        return self.processes.interface_note


@dataclass
class RemoteAgent(AgentHandle):
    """The coordinator's view of another node's agent process: commands go out as frames on the
    coordinator's ROUTER; the agent's reports are queued by :meth:`on_message`.

    Attributes:
        node: the node index.
        identity: the ZeroMQ routing identity of its connection (the one whose hello verified).
        send_frame: sends one frame to that identity.
        last_seen: monotonic time of its last message, seconds.
    """

    node: int
    identity: bytes
    send_frame: Callable[[bytes, MsgType, dict[str, Any]], None]
    last_seen: float
    host: str = ""
    pid: int = 0
    record_store: str = ""  # where its node's record store listens, host:port (ftrun.rank.rankstate; "": none)
    lost: bool = False
    leaving: str | None = None  # the reason it gave for leaving (its launcher was stopped or killed)
    sent: int = 0  # frames sent to it (any frame proves the coordinator alive to it)
    sent_at_beat: int = 0  # ... as counted at the coordinator's last look at its beats
    _reports: list[Report] = field(default_factory=list)

    def _send(self, msg_type: MsgType, **fields: Any) -> None:
        if not self.lost:
            self.send_frame(self.identity, msg_type, fields)
            self.sent += 1

    def spawn(self, rank: int, incarnation: int, rank_vars: Mapping[str, str], header: str, use_spare: bool) -> None:
        self._send(MsgType.SPAWN, rank=rank, incarnation=incarnation, vars=dict(rank_vars), header=header, use_spare=use_spare)

    def signal(self, rank: int, incarnation: int, sig: int) -> None:
        self._send(MsgType.SIGNAL, rank=rank, incarnation=incarnation, signal=int(sig))

    def kill_hung(self, rank: int, incarnation: int, line: str, dump: bool) -> None:
        self._send(MsgType.KILL_HUNG, rank=rank, incarnation=incarnation, line=line, dump=dump)

    def stop_ranks(self, grace_period: float) -> None:
        self._send(MsgType.STOP_RANKS, grace=grace_period)

    def keep_spares(self, warm: int, hot: int, model_vars: Mapping[str, str]) -> None:
        self._send(MsgType.SPARES, warm=warm, hot=hot, vars=dict(model_vars))

    def shutdown(self, code: int, message: str) -> None:
        self._send(MsgType.SHUTDOWN, code=code, message=message)

    def beat(self) -> None:
        self._send(MsgType.AGENT_BEAT, node=0)

    def announce_standby(self, control: str, store: str, epoch: int, seats: list[list[Any]] | None = None) -> None:
        self._send(MsgType.STANDBY, control=control, store=store, epoch=epoch, seats=seats or [])

    def replicate(self, state: dict[str, Any]) -> None:
        self._send(MsgType.STATE, state=state)

    def relay_orders(self, order: MsgType, common: dict[str, Any], rows: list[list[Any]]) -> bool:
        if self.lost:
            return False
        for i in range(0, len(rows), ROWS_PER_FRAME):
            self._send(MsgType.RANK_ORDERS, node=self.node, order=order.value, common=common, ranks=rows[i:i + ROWS_PER_FRAME])
        return True

    def ask_to_stand_by(self) -> None:
        self._send(MsgType.STAND_BY)

    def connected(self) -> bool:
        return not self.lost

    def on_message(self, msg: Message, now: float) -> None:
        """Queue a report from the agent (spawned, exited, stacks); any message proves it alive."""
        self.last_seen = now
        if msg.type == MsgType.AGENT_BEAT and isinstance(msg.get("leaving"), str):
            self.leaving = msg["leaving"][:500]
        elif (msg.type == MsgType.AGENT_BEAT and isinstance(msg.get("standby_control"), str)
              and isinstance(msg.get("standby_store"), str)):
            self._reports.append(StandbyOffer(msg["standby_control"][:200], msg["standby_store"][:200]))
        elif msg.type == MsgType.SPAWNED:
            kind = msg.get("spare_kind")
            self._reports.append(Spawned(msg["rank"], msg["incarnation"], msg["pid"],
                                         (kind if kind in ("hot", "warm") else "warm") if msg["spare"] else ""))
        elif msg.type == MsgType.EXITED:
            error = msg.get("error")
            tail = msg.get("log_tail")
            tail = tuple(str(line)[:300] for line in tail[-EXIT_TAIL_LINES:]) if isinstance(tail, list) else ()
            self._reports.append(ExitReport(msg["rank"], msg["incarnation"], msg["pid"], msg["returncode"], float(msg["at"]),
                                            error[:500] if isinstance(error, str) else None, tail))
        elif msg.type == MsgType.STOPPED:
            self._reports.append(StopReport(msg["rank"], msg["incarnation"], msg["pid"], msg["signal"], float(msg["at"])))
        elif msg.type == MsgType.STACKS:
            lines = [str(x) for x in msg["lines"]][-200:]
            self._reports.append(Stacks(msg["rank"], msg["incarnation"], lines, msg["note"]))
        elif msg.type == MsgType.SPARE_NOTE:
            self._reports.append(SpareNote(msg["message"][:1000]))

    def take_reports(self) -> list[Report]:
        reports, self._reports = self._reports, []
        return reports
