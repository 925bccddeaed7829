"""A node agent's commands about its node's ranks, and its reports of them to the coordinator.

The coordinator's ``spawn``, ``signal``, ``kill_hung``, ``stop_ranks`` and ``spares`` are carried out
on the node's :class:`~ftrun.node.spawner.RankProcesses`; what they did (a rank spawned, its stacks,
its exit, a spare's note) and every exit or stop the agent reaps go back as frames. Node 0's agent
does the same with direct calls in the coordinator's process
(:class:`ftrun.coordinator.agents.LocalAgent`).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

from ftrun.common.contract import RELAY_ADDR, STANDBY_LINE
from ftrun.common.events import EventKind
from ftrun.common.protocol import Message, MsgType
from ftrun.node.forks import StartReport
from ftrun.node.spawner import ExitReport, RankProcesses, StopReport
from ftrun.node.succession import Succession

log = logging.getLogger("ftrun.node.agent")  # the agent's log: these commands are the agent's

STACK_LINES_SENT = 200  # the last lines of a hung rank's stacks sent to the coordinator


class RankCommands:
    """Carries out the coordinator's commands about this node's ranks and reports what they did.

    Args:
        processes: this node's rank processes.
        report: sends one frame to the coordinator with this node's index
            (``report(msg_type, **fields)``).
        event: an event for this node's console (``event(kind, message, **detail)``).
        succession: the line of standby coordinators, which a spawned rank is told
            (:data:`ftrun.common.contract.STANDBY_LINE`).

    Attributes:
        relay: the agent's heartbeat relay endpoint, which a spawned rank is told
            (:data:`ftrun.common.contract.RELAY_ADDR`), or None: its ranks beat the coordinator.
    """

    def __init__(self, processes: RankProcesses, report: Callable[..., None], event: Callable[..., None],
                 succession: Succession) -> None:
        self.processes = processes
        self.report = report
        self.event = event
        self.succession = succession
        self.relay: str | None = None

    def spawn(self, msg: Message) -> None:
        """Start rank ``rank``'s incarnation (in a spare when ``use_spare`` and one is kept)."""
        rank_vars = {str(k): str(v) for k, v in msg["vars"].items()}
        rank_vars[STANDBY_LINE] = ",".join(control for control, _ in self.succession.line)  # see ftrun.rank.client.open_channel
        if self.relay is not None:
            rank_vars[RELAY_ADDR] = self.relay
        try:
            pid, spare = self.processes.spawn(msg["rank"], msg["incarnation"], rank_vars, msg["header"], msg["use_spare"])
        except OSError as err:
            log.error("cannot start rank %d: %s", msg["rank"], err)
            self.report(MsgType.EXITED, rank=msg["rank"], incarnation=msg["incarnation"], pid=0, returncode=127,
                        at=time.time())
            return
        if pid is not None:  # else the fork server answers later (report_exits)
            self.report_start(StartReport(msg["rank"], msg["incarnation"], pid, spare))

    def report_start(self, r: StartReport) -> None:
        self.report(MsgType.SPAWNED, rank=r.rank, incarnation=r.incarnation, pid=r.pid, spare=bool(r.spare),
                    spare_kind=r.spare)
        self.event(EventKind.RANK_STARTED, f"rank {r.rank} started (pid {r.pid}, incarnation {r.incarnation}"
                                           f"{f', in a {r.spare} spare' if r.spare else ''})", rank=r.rank)

    def signal(self, msg: Message) -> None:
        self.processes.signal(msg["rank"], msg["incarnation"], msg["signal"])

    def kill_hung(self, msg: Message) -> None:
        """Dump a hung rank's stacks (``dump``), kill it, and send the stacks' last lines."""
        lines, note, gone = self.processes.kill_hung(msg["rank"], msg["incarnation"], msg["line"], bool(msg.get("dump", True)))
        self.report(MsgType.STACKS, rank=msg["rank"], incarnation=msg["incarnation"], lines=lines[-STACK_LINES_SENT:],
                    note=note)
        if gone is not None:  # this node never ran it (RankProcesses.kill_hung)
            self.report_exit(gone)

    def stop_ranks(self, msg: Message) -> None:
        self.stop(float(msg["grace"]))

    def keep_spares(self, msg: Message) -> None:
        note = self.processes.keep_spares(msg["warm"], msg["hot"], {str(k): str(v) for k, v in msg["vars"].items()})
        if note is not None:
            self.report(MsgType.SPARE_NOTE, message=note)

    def stop(self, grace: float) -> None:
        """Stop this node's ranks (``grace`` seconds between SIGTERM and SIGKILL) and report their exits."""
        self.report_all(self.processes.stop(grace))

    def report_exits(self) -> None:
        """Report the starts (the fork server's), exits and stops (SIGSTOP) seen since the last look."""
        self.report_all(self.processes.reap())

    def report_all(self, reports: list[ExitReport | StopReport | StartReport]) -> None:
        for report in reports:
            if isinstance(report, StartReport):
                self.report_start(report)
            elif isinstance(report, StopReport):
                self.report(MsgType.STOPPED, rank=report.rank, incarnation=report.incarnation, pid=report.pid,
                            signal=report.signal, at=report.at)
            else:
                self.report_exit(report)

    def report_exit(self, r: ExitReport) -> None:
        self.report(MsgType.EXITED, rank=r.rank, incarnation=r.incarnation, pid=r.pid, returncode=r.returncode, at=r.at,
                    error=r.error, log_tail=list(r.log_tail))

