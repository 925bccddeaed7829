"""Node agents: the processes of each node, carried out as the job coordinator says.

One agent per node plays MindCluster's ``reset_process`` role: it spawns, reaps and kills its
node's ranks and warm spares (:class:`~ftrun.node.spawner.RankProcesses`), sees a death at once (it is
the parent: ``SIGCHLD``), dumps a hung rank's stacks, and reports every exit to the coordinator. It
decides nothing. Node 0's agent lives in the coordinator's process
(:class:`ftrun.coordinator.agents.LocalAgent`); every other node runs :class:`NodeAgent`
(``python -m ftrun.node.agent``, :func:`main`), which the coordinator sees through its proxy
:class:`ftrun.coordinator.agents.RemoteAgent`.

An agent that hears nothing from its coordinator keeps its ranks and keeps trying for
``--node_wait_timeout`` (a link flap is weather, not loss); fenced when its link returns while the
coordinator still awaits its node, it rejoins as the node's replacement; past that time it stops
its ranks and exits: no rank outlives the job's decision-maker. A coordinator that loses an agent
treats the node as lost.

A standby node's agent (its launcher came after every node had its index) starts with the node
index :data:`~ftrun.common.contract.STANDBY_NODE_INDEX`, keeps the spares the coordinator orders, and becomes
a lost node's agent when told ``take_node``; its spares then take that node's ranks.
"""

from __future__ import annotations

import enum
import json
import logging
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from ftrun.common import contract, procs
from ftrun.common.clocks import RunningClock
from ftrun.common.contract import STANDBY_NODE_INDEX
from ftrun.common.events import Event, EventKind
from ftrun.common.protocol import Message, MsgType, Sender, encode, events_for, standby_line
from ftrun.node.commands import RankCommands
from ftrun.node.link import CoordinatorLink
from ftrun.node.relay import BeatRelay, relays_beats
from ftrun.node.spawner import ExitReport, RankProcesses, rank_argv, shared_dir_marker
from ftrun.node.succession import MoveTo, Succession, TakeOver, standby_seat

log = logging.getLogger("ftrun.node.agent")


# --------------------------------------------------------------------------- the agent process
class Turn(enum.Enum):
    """What a step of the agent's loop (:meth:`NodeAgent.run`) leaves for the rest of its turn."""

    GO_ON = "go on"  # to the next step of this turn
    NEXT = "next turn"  # this turn is over: beat, then wait for a frame, a closed connection or a signal
    HANDED_OVER = "handed over"  # this node's standby seat ran the job to its end (NodeAgent.take_over)


class NodeAgent:
    """The agent process of a node other than node 0 (``python -m ftrun.node.agent``).

    Args:
        node: this node's index (:data:`~ftrun.common.contract.STANDBY_NODE_INDEX` for a standby, until ``take_node``).
        control_addr: the coordinator's ROUTER endpoint.
        token: the job secret.
        processes: this node's :class:`RankProcesses`.
        heartbeat_interval: seconds between beats to the coordinator.
        coordinator_timeout: seconds without a beat from the coordinator before it is taken as lost.
        events_addr: the launcher's PULL endpoint for console events, or None.
        standby: this node's :class:`ftrun.coordinator.seat.StandbySeat`, if it stands by.
        link_grace: seconds this agent keeps trying after ``coordinator_timeout`` of silence (a link
            flap is weather, not loss; the job's ``--node_wait_timeout``, as long as the coordinator
            awaits the node) before it ends its part of the job. Its ranks keep running meanwhile;
            when the link returns after the coordinator declared the node lost, the agent is told to
            rejoin (:meth:`_on_shutdown`) and comes back as the node's replacement.
        relay: relay this node's ranks' heartbeats in the agent's beats (``--heartbeat_relay``,
            :mod:`ftrun.node.relay`).
    """

    def __init__(self, node: int, control_addr: str, token: str, processes: RankProcesses, heartbeat_interval: float,
                 coordinator_timeout: float, events_addr: str | None, standby: Any = None, link_grace: float = 0.0,
                 relay: bool = False) -> None:
        self.node = node
        self._events_node = node  # this node's launcher knows it by this index (a standby's keeps it)
        self._events_audience = events_for(node)
        self._token = token
        self.spec: Any = None  # the job (ftrun.config.JobSpec), to stand by when asked
        self.processes = processes
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.link_grace = link_grace
        # Silence is judged on the time this agent ran: stopped for longer than the timeout, it
        # gives the coordinator a fresh window rather than leaving the job (ftrun.common.clocks).
        self.clock = RunningClock.for_loop(min(heartbeat_interval, 0.5))
        self._last_heard = 0.0  # when a frame last came from the coordinator (set as the loop starts)
        self._next_beat = 0.0
        self._waiting_since: float | None = None  # silence past the timeout, said on the console once
        self._fled = False  # moved to the standby on silence (a vote for its takeover)
        self._rejoin = False  # told by the coordinator: fenced, but the node is still awaited
        self.events_addr = events_addr
        self.succession = Succession(standby)  # the standby coordinators in line, and this node's seat
        self.ctx = zmq.Context()
        self.link = CoordinatorLink(self.ctx, Sender(token), control_addr)  # to the coordinator
        self._event_sender = Sender(self.link.sender.auth)  # frames to this node's launcher
        self._home = (control_addr, 0)  # the coordinator's endpoint and node this agent started with
        self.push: zmq.Socket | None = None
        if events_addr:
            self.push = self.ctx.socket(zmq.PUSH)
            self.push.setsockopt(zmq.LINGER, 2000)
            self.push.connect(events_addr)
        self.exit_code: int | None = None
        self.stop_signal: int | None = None
        self.checkpoint_marker: Path | None = None  # node 0's marker in the checkpoint dir, if TTP is on
        self._wakeup = procs.WakeupPipe()
        self.ranks = RankCommands(processes, self._report, self.event, self.succession)
        self.relay = BeatRelay(self.ctx, self.link.sender.auth) if relay else None
        if self.relay is not None:
            self.ranks.relay = self.relay.address
        self._handlers: dict[MsgType, Callable[[Message], None]] = {
            MsgType.SPAWN: self.ranks.spawn, MsgType.SIGNAL: self.ranks.signal, MsgType.KILL_HUNG: self.ranks.kill_hung,
            MsgType.STOP_RANKS: self.ranks.stop_ranks, MsgType.SPARES: self.ranks.keep_spares,
            MsgType.SHUTDOWN: self._on_shutdown, MsgType.TAKE_NODE: self._on_take_node, MsgType.STANDBY: self._on_standby,
            MsgType.STATE: self._on_state, MsgType.STAND_BY: self._on_stand_by,
        }
        if self.relay is not None:  # a round's orders to this node's ranks (ftrun.node.relay)
            self._handlers[MsgType.RANK_ORDERS] = self.relay.forward

    def close_connection(self) -> None:
        """Close the connection to the coordinator (and its monitor)."""
        self.link.close()

    def _hello(self) -> None:
        record_store = os.environ.get(contract.RECORD_STORE)  # this node's (ftrun.rank.rankstate)
        self.send(MsgType.AGENT_HELLO, node=self.node, pid=os.getpid(), host=socket.gethostname(),
                  **self.succession.seat_fields(), **({"record_store": record_store} if record_store else {}),
                  **({} if self.checkpoint_marker is None else {"sees_checkpoint_dir": self.checkpoint_marker.exists()}))

    def send(self, msg_type: MsgType, **fields: Any) -> None:
        self.link.send(msg_type, **fields)

    def event(self, kind: EventKind, message: str, **detail: Any) -> None:
        """An event for this node's console (the job's events.jsonl is the coordinator's)."""
        log.info("%s %s", kind.value, message)
        if self.push is not None:
            event = Event(kind=kind, message=message, rank=detail.pop("rank", None), node=self.node, detail=detail)
            self.push.send(encode(MsgType.EVENT, self._event_sender, self._events_audience, event=event.to_json()))

    # ------------------------------------------------------------------ the loop: a turn of named steps
    def run(self) -> int:
        """Serve the coordinator until it shuts the job down or is lost; returns the exit code.

        Each turn beats when due and waits for a frame, a closed connection or a signal
        (:meth:`_wait_for_news`), then takes the steps below in order until one ends the turn."""
        poller = self._start()
        steps = (self._carry_out_commands, self._rejoin_when_fenced, self._follow_closed_connection,
                 self._leave_on_stop_signal, self._wait_out_silence)
        while self.exit_code is None:
            events = self._wait_for_news(poller)
            for step in steps:
                turn = step(poller, events)
                if turn is Turn.HANDED_OVER:
                    return self.exit_code
                if turn is Turn.NEXT:
                    break
        self.processes.stop_spares()
        self.link.close(linger_ms=2000)
        if self.relay is not None:
            self.relay.close()
        if self.push is not None:
            self.push.close(2000)
        self.ctx.term()
        return self.exit_code

    def _start(self) -> zmq.Poller:
        """Catch this process's signals, say hello to the coordinator and on the console; returns
        the poller of the loop (the coordinator's connection, its monitor, the signals' wake-up)."""
        self._wakeup.install()
        signal.signal(signal.SIGCHLD, lambda *_: setattr(self.processes, "sigchld_at", self.processes.sigchld_at or time.time()))
        signal.signal(signal.SIGTERM, lambda s, _f: setattr(self, "stop_signal", s))
        signal.signal(signal.SIGINT, lambda s, _f: setattr(self, "stop_signal", s))
        self._hello()
        if self.processes.interface_note:
            self.event(EventKind.WARNING, self.processes.interface_note)
        if self.node == STANDBY_NODE_INDEX:
            self.event(EventKind.STANDBY_NODE_JOINED, "every node of the job has its index: this launcher waits as a standby "
                                                 "node and takes the next lost node's place")
        poller = zmq.Poller()
        self.link.watch(poller)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        if self.relay is not None:
            poller.register(self.relay.sock, zmq.POLLIN)
            log.info("this node's ranks beat through this agent (--heartbeat_relay) at %s", self.relay.address)
        self._last_heard = self.clock()
        return poller

    def _wait_for_news(self, poller: zmq.Poller) -> dict[Any, int]:
        """Beat when due (with the ranks' relayed heartbeats), offer this node's seat once set up,
        wait up to the next beat (0.5 s at most) for a frame, a closed connection or a signal, and
        report the ranks' exits; returns what is ready."""
        now = self.clock()
        if now >= self._next_beat:
            rows = self.relay.rows(time.monotonic()) if self.relay is not None else []
            self.send(MsgType.AGENT_BEAT, node=self.node, **({"ranks": rows} if rows else {}))
            self._next_beat = now + self.heartbeat_interval
        if self.succession.seat_set_up():
            self.offer_standby()
        wait = min(self.heartbeat_interval, 0.5, max(0.0, self._next_beat - self.clock()))
        events = dict(poller.poll(timeout=int(wait * 1000)))
        if self._wakeup.fd in events:
            self._wakeup.drain()
        if self.relay is not None and self.relay.sock in events:
            self.relay.drain(time.monotonic())
            for rows in self.relay.reports():  # before the exits: a rank that answered, then died
                self.send(MsgType.RANK_REPORTS, node=self.node, reports=rows)
        self.ranks.report_exits()
        return events

    def _carry_out_commands(self, _poller: zmq.Poller, events: dict[Any, int]) -> Turn:
        """Carry out the coordinator's commands waiting (up to a rejoin order, which comes next)."""
        if self.link.sock in events:
            for msg in self.link.frames():
                self.heard_again()
                if self.link.at_seat:  # the standby took the job over: it is the coordinator now
                    self.link.at_seat, self.succession.dead = False, []
                self.handle(msg)
                if self._rejoin:
                    break
        return Turn.GO_ON

    def _rejoin_when_fenced(self, poller: zmq.Poller, _events: dict[Any, int]) -> Turn:
        """Fenced while the coordinator still awaits this node: come back as its replacement."""
        if not self._rejoin:
            return Turn.GO_ON
        self.rejoin(poller, self.link.endpoint, self.link.node, "the coordinator fenced this node's old "
                    "connection and awaits the node: rejoining as its replacement")
        self._fled, self._last_heard = False, self.clock()
        return Turn.NEXT

    def _follow_closed_connection(self, poller: zmq.Poller, events: dict[Any, int]) -> Turn:
        """The connection to the coordinator (or standby) closed: its processes are gone (a killed
        process's or host's kernel closes its connections). The next standby in line takes the job
        over; say hello there (its endpoint queues it until then), or take over here if this node
        is next."""
        if (self.link.closed not in events or self.exit_code is not None or self.stop_signal is not None
                or not self.link.gone()):
            return Turn.GO_ON
        # What the coordinator sent before it closed comes first (a shutdown at the job's end).
        for msg in self.link.frames():
            self.handle(msg)
        if self.exit_code is not None:
            return Turn.NEXT
        silence = self.clock() - self._last_heard
        if silence > self.coordinator_timeout and self.succession.first_in_line():
            # Cut off for longer than the coordinator waits for a node: this node may have been
            # taken for lost and replaced (its seat taken off the line), and the job may even have
            # ended. A close seen now proves nothing this seat may act on: no takeover.
            self._fail(f"the job coordinator's connection closed after {silence:.1f} s in which this node heard "
                       "nothing from it (this node may have been taken for lost and replaced meanwhile): this "
                       "standby does not take the job over; stopping this node's ranks")
            return Turn.NEXT
        self.succession.dead.append(self.link.node)
        if self.link.at_seat and not self.link.proven:
            self._fail(f"lost the job coordinator (nothing heard from it) and its standby on node "
                       f"{self.link.node} died; stopping this node's ranks")
            return Turn.NEXT
        turn = self._move_along_line(poller, proven=True)
        self._last_heard = self.clock()
        return turn

    def _leave_on_stop_signal(self, _poller: zmq.Poller, _events: dict[Any, int]) -> Turn:
        """This node's launcher was stopped (or died: its death signal is SIGTERM). Tell the
        coordinator first, so that it takes the node as gone rather than respawning its ranks
        here, then stop them."""
        if self.stop_signal is None or self.exit_code is not None:
            return Turn.GO_ON
        reason = f"its launcher was stopped by {signal.Signals(self.stop_signal).name} or died"
        self.send(MsgType.AGENT_BEAT, node=self.node, leaving=reason)
        self.stop_all(reason)
        self.event(EventKind.JOB_FINISHED, f"node {self.node} left the job: {reason}", exit_code=128 + self.stop_signal)
        self.exit_code = 128 + self.stop_signal
        return Turn.NEXT

    def _wait_out_silence(self, poller: zmq.Poller, _events: dict[Any, int]) -> Turn:
        """Nothing heard from the coordinator for longer than its timeout: stand for election
        (the first standby in line), move to the first standby (a vote for its takeover), or keep
        trying for ``link_grace`` seconds; past that, end this node's part of the job."""
        if self.exit_code is not None or self.clock() - self._last_heard <= self.coordinator_timeout:
            return Turn.GO_ON
        silence = self.clock() - self._last_heard
        if self.succession.first_in_line() and not self.link.at_seat:
            turn = self._stand_for_election(silence)
            if turn is not Turn.GO_ON:
                return turn
        elif self.succession.line and not self._fled and not self.link.at_seat:
            # Silence: the coordinator may be cut off from this node. Go to the first standby (this
            # hello is a vote for its takeover); if it never takes over, end below.
            log.warning("nothing heard from the coordinator for %.1f s; moving to the standby at %s",
                        silence, self.succession.line[0][0])
            self._fled, self._last_heard = True, self.clock()
            self._move_along_line(poller, proven=False)  # only silence: never a takeover
            return Turn.NEXT
        if silence <= self.coordinator_timeout + self.link_grace:
            if self._fled and self.link.at_seat:
                # The standby never took over: the link to the coordinator may come back.
                self.rejoin(poller, *self._home, "nothing heard from the coordinator nor from its standby: "
                            "going back to the coordinator")
                self._fled = False
            self.say_waiting(silence)
            return Turn.NEXT
        self._fail(f"lost the job coordinator on node {self.link.node} (nothing heard for {silence:.1f} s"
                   f"{'; nor from its standby' if self._fled else ''}"
                   f"{f', tried for --node_wait_timeout {self.link_grace:g} s' if self.link_grace else ''}); "
                   "stopping this node's ranks")
        return Turn.NEXT

    def _stand_for_election(self, silence: float) -> Turn:
        """Silence, not a closed connection: a partition or a hung host. This node, first in line,
        takes over only with a majority (the others' agents come here when they hear nothing
        either); the coordinator steps down when it hears half or less."""
        agree, electorate = self.succession.seat.votes()
        if self.succession.seat.elected():
            self.exit_code = self.take_over(f"nothing heard from it for {silence:.1f} s, and {agree} of the job's "
                                            f"{electorate} nodes agree (a majority; the other side steps down)")
            return Turn.HANDED_OVER
        if electorate >= 3 and silence <= 2 * self.coordinator_timeout:
            return Turn.NEXT  # the other agents' votes may still come
        return Turn.GO_ON

    def _fail(self, message: str) -> None:
        """End this node's part of the job (exit code 1): stop its ranks and say why."""
        self.stop_all(message)
        self.event(EventKind.JOB_FINISHED, f"job failed: {message}", exit_code=1)
        self.exit_code = 1

    # ------------------------------------------------------------------ the coordinator's silence and succession
    def heard_again(self) -> None:
        """A frame came from the coordinator: the silence (if one was said) is over."""
        now = self.clock()
        if self._waiting_since is not None:
            self.event(EventKind.WARNING, f"node {self.node} hears the job coordinator again after "
                                          f"{now - self._last_heard:.1f} s of silence")
            self._waiting_since = None
        self._last_heard = now

    def say_waiting(self, silence: float) -> None:
        """Say once per silence that this node keeps trying (a link flap is weather, not loss)."""
        if self._waiting_since is None:
            self._waiting_since = self.clock()
            self.event(EventKind.WARNING, f"node {self.node} hears nothing from the job coordinator on node "
                                          f"{self.link.node} for {silence:.1f} s (this node's link, or node "
                                          f"{self.link.node}'s, may be down): keeping this node's ranks and "
                                          f"trying for up to {self.link_grace:g} s (--node_wait_timeout)")

    def rejoin(self, poller: zmq.Poller, endpoint: str, node: int, why: str) -> None:
        """Come back to the coordinator at ``endpoint`` (on ``node``) as this node's replacement: stop
        this node's ranks (after a loss they belong to an old generation; the coordinator respawns
        them here and they recover from replicas), then say hello on a fresh connection."""
        log.warning("%s", why)
        self.event(EventKind.WARNING, f"node {self.node}: {why}")
        self._rejoin = False
        for report in self.processes.stop(2.0):
            if isinstance(report, ExitReport):
                log.info("rank %d (incarnation %d) of the old generation stopped", report.rank, report.incarnation)
        self.link.move(poller, endpoint, node, at_seat=False, proven=False)
        self._hello()

    def _move_along_line(self, poller: zmq.Poller, proven: bool) -> Turn:
        """The coordinator this agent is connected to is gone (``proven``: its processes died, not
        only silent): go to the next standby in line that is alive and say hello there, or, when
        this agent's own seat is next and every one before it died, take the job over. With nobody
        left, end this node's part of the job (exit code 1)."""
        step = self.succession.next_coordinator(proven)
        if isinstance(step, TakeOver):
            self.exit_code = self.take_over(step.cause, lost=step.lost)
            return Turn.HANDED_OVER
        if isinstance(step, MoveTo):
            log.warning("the coordinator on node %d is gone; moving to the standby on node %d at %s",
                        self.link.node, step.node, step.control)
            self.link.move(poller, step.control, step.node, at_seat=True, proven=proven)
            self._hello()
            return Turn.GO_ON
        self._fail(f"lost the job coordinator on node {self.link.node} and every standby coordinator "
                   f"(nodes {sorted(set(self.succession.dead))} died or nothing proves the coordinator dead); "
                   "stopping this node's ranks")
        return Turn.GO_ON

    def take_over(self, cause: str, lost: list[int] | None = None) -> int:
        """This node stands by and the coordinator is gone (``cause``: its connection closed, or
        a majority hears nothing from it): run the job's coordinator here
        (:class:`ftrun.coordinator.seat.StandbySeat`) and return the job's exit code."""
        log.warning("taking the job over (standby): the coordinator is gone: %s", cause)
        self.close_connection()
        if self.push is not None:
            self.push.close(0)
            self.push = None
        if self.relay is not None:  # the ranks beat the coordinator once they move to it (ftrun.rank.channel)
            self.relay.close()
            self.relay = None
        self.ctx.term()
        return self.succession.seat.take_over(self.processes, self.events_addr, self.node, self._events_node,
                                              lost=list(dict.fromkeys(lost if lost is not None else [self.link.node])),
                                              cause=cause)

    def offer_standby(self) -> None:
        """Tell the coordinator this agent stands by (its endpoint and store), once its seat is ready."""
        if self.succession.seat is not None:
            self.send(MsgType.AGENT_BEAT, node=self.node, **self.succession.seat_fields())

    def stop_all(self, reason: str) -> None:
        log.warning("%s", reason)
        self.ranks.stop(0.0 if self.exit_code is not None else 2.0)

    # ------------------------------------------------------------------ the coordinator's commands
    def handle(self, msg: Message) -> None:
        """Carry out one command of the coordinator (a dispatch table, one handler a type)."""
        handler = self._handlers.get(msg.type)
        if handler is not None:
            handler(msg)

    def _report(self, msg_type: MsgType, **fields: Any) -> None:
        """A report to the coordinator about this node (its index first)."""
        self.send(msg_type, node=self.node, **fields)

    def _on_take_node(self, msg: Message) -> None:
        """A standby node becomes the agent of lost node ``node`` (its launcher learns it from the event)."""
        if self.node != STANDBY_NODE_INDEX or msg["node"] < 0:
            log.warning("take_node %r ignored: this agent is node %d", msg["node"], self.node)
            return
        self.node = msg["node"]
        self.event(EventKind.NODE_JOINED, f"this standby node took node {self.node}'s place", node_joined=self.node,
                   standby=True)

    def _on_standby(self, msg: Message) -> None:
        """The line of standby coordinators (``seats``: [control, node], first first; an older
        coordinator's message names only the first, ``control``; "": none, the standby was lost)."""
        self.succession.line = standby_line(msg)

    def _on_stand_by(self, _msg: Message) -> None:
        """Stand by as the job coordinator (the coordinator lost the one it had). The seat is set
        up on a thread (:meth:`Succession.ask_for_seat`), so that this loop keeps beating;
        :meth:`offer_standby` answers once it is ready."""
        if self.succession.seat is not None:
            self.offer_standby()
        else:
            self.succession.ask_for_seat(self.spec, self._token)

    def _on_state(self, msg: Message) -> None:
        self.succession.hold_state(msg["state"])

    def _on_shutdown(self, msg: Message) -> None:
        if msg.get("rejoin") is True and self.stop_signal is None:
            self._rejoin = True  # fenced, but still awaited: come back as the node's replacement (run)
            return
        self.ranks.stop(2.0)
        self.event(EventKind.JOB_FINISHED, msg["message"], exit_code=msg["code"])
        self.exit_code = msg["code"]



def agent_log_name(node: int) -> str:
    """The log file of node ``node``'s agent in ``--log_dir`` (a standby node's until it takes a node, too)."""
    return "agent_standby.log" if node == STANDBY_NODE_INDEX else f"agent_{node}.log"


def main() -> None:
    """Entry point of ``python -m ftrun.node.agent`` (started by a launcher on a node other than 0)."""
    from ftrun.config import JobSpec

    spec = JobSpec.from_json(json.loads(os.environ["FTRUN_AGENT_SPEC"]))
    procs.dump_stacks_on_sigusr1()  # into its log, its stderr
    log_dir = Path(spec.log_dir)
    logging.basicConfig(filename=log_dir / agent_log_name(spec.node_rank), level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    store_fd = os.environ.pop("FTRUN_STORE_FD", None)  # the node's record store's socket, to host (not the ranks')
    processes = RankProcesses(
        rank_argv(spec.no_python, spec.module, spec.script, list(spec.script_args)),
        [spec.script, *spec.script_args], spec.module, log_dir, spec.local_worker_num, spec.master_addr,
        multi_node=spec.nnodes > 1, token=os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
        fork_server=getattr(spec, "fork_server", "off") == "on",
        store=(int(store_fd), spec.cluster_time_out) if store_fd else None,
    )
    agent = NodeAgent(spec.node_rank, os.environ["FTRUN_CONTROL_FOR_AGENT"], os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
                      processes, spec.heartbeat_interval, max(spec.heartbeat_timeout, 3 * spec.heartbeat_interval),
                      os.environ.get("FTRUN_EVENTS_ADDR"),
                      standby=standby_seat(spec, os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"]),
                      link_grace=spec.node_wait_timeout if spec.tft.arf else 0.0,
                      relay=relays_beats(spec.heartbeat_relay, spec.worker_num, spec.heartbeat_interval, spec.heartbeat_timeout))
    agent.spec = spec
    if spec.tft.ttp:
        agent.checkpoint_marker = Path(spec.checkpoint_dir).resolve() / shared_dir_marker(
            os.environ["FTRUN_CONTROL_FOR_AGENT"], os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"])
    try:
        code = agent.run()
    except BaseException:
        log.exception("agent crashed")
        raise
    logging.shutdown()
    sys.exit(code)


if __name__ == "__main__":
    main()
