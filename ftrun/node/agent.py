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

import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable

import zmq

from ftrun.common import procs
from ftrun.common.clocks import RunningClock
from ftrun.common.contract import STANDBY_LINE, STANDBY_NODE_INDEX
from ftrun.common.events import Event, EventKind
from ftrun.common.protocol import (CONTROL, MAX_FRAME_BYTES, Message, MsgType, Receiver, Sender, encode, endpoint_refuses, events_for,
                       receive, standby_line, to_peer)
from ftrun.node.spawner import ExitReport, RankProcesses, StopReport, rank_argv, shared_dir_marker

log = logging.getLogger("ftrun.node.agent")


# --------------------------------------------------------------------------- the agent process
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
        link_grace: seconds this agent keeps trying after ``coordinator_timeout`` of silence (a link
            flap is weather, not loss; the job's ``--node_wait_timeout``, as long as the coordinator
            awaits the node) before it ends its part of the job. Its ranks keep running meanwhile;
            when the link returns after the coordinator declared the node lost, the agent is told to
            rejoin (:meth:`_on_shutdown`) and comes back as the node's replacement.
    """

    def __init__(self, node: int, control_addr: str, token: str, processes: RankProcesses, heartbeat_interval: float,
                 coordinator_timeout: float, events_addr: str | None, standby: Any = None, link_grace: float = 0.0) -> None:
        self.node = node
        self._events_node = node  # this node's launcher knows it by this index (a standby's keeps it)
        self._events_audience = events_for(node)
        self._token = token
        self.spec: Any = None  # the job (ftrun.config.JobSpec), to stand by when asked
        self._sender = Sender(token)  # frames to the coordinator
        self._event_sender = Sender(self._sender.auth)  # frames to this node's launcher
        self.processes = processes
        self.heartbeat_interval = heartbeat_interval
        self.coordinator_timeout = coordinator_timeout
        self.link_grace = link_grace
        self._waiting_since: float | None = None  # silence past the timeout, said on the console once
        self._rejoin = False  # told by the coordinator: fenced, but the node is still awaited
        # Silence is judged on the time this agent ran: stopped for longer than the timeout, it
        # gives the coordinator a fresh window rather than leaving the job (ftrun.common.clocks).
        self.clock = RunningClock.for_loop(min(heartbeat_interval, 0.5))
        self.events_addr = events_addr
        self.standby = standby  # this node's ftrun.coordinator.seat.StandbySeat, if it stands by
        # The standby coordinators in line, first first: (control endpoint, node), as the last
        # coordinator that spoke announced them; one is taken off as this agent moves there.
        self.line: list[tuple[str, int]] = []
        self._coordinator_node = 0  # the node of the coordinator (or standby) this agent is connected to
        self._at_seat = False  # connected to a standby that has not taken over (said nothing) yet
        self._proven = False  # ... after the coordinator's connection closed (not only silence)
        self._dead: list[int] = []  # nodes whose coordinator or standby died since the last one that spoke
        self._seat: list[Any] | None = None  # a standby seat being set up on a thread (stand_by), once asked
        self.ctx = zmq.Context()
        self._connect(control_addr)
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

    def _connect(self, control_addr: str) -> None:
        """A DEALER to the coordinator's endpoint, with a monitor that sees it close."""
        self.sock = self.ctx.socket(zmq.DEALER)
        identity = b"a" + os.urandom(15)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self._receiver = Receiver(self._sender.auth, to_peer(identity))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.closed = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self.sock.connect(control_addr)
        self._endpoint = control_addr

    def close_connection(self) -> None:
        """Close the connection to the coordinator (and its monitor)."""
        self.sock.disable_monitor()
        self.closed.close(0)
        self.sock.close(0)

    def _hello(self) -> None:
        standby = {} if self.standby is None else {"standby_control": self.standby.control.address,
                                                    "standby_store": self.standby.store_addr}
        self.send(MsgType.AGENT_HELLO, node=self.node, pid=os.getpid(), host=socket.gethostname(), **standby,
                  **({} if self.checkpoint_marker is None else {"sees_checkpoint_dir": self.checkpoint_marker.exists()}))

    def send(self, msg_type: MsgType, **fields: Any) -> None:
        self.sock.send(encode(msg_type, self._sender, CONTROL, **fields))

    def event(self, kind: EventKind, message: str, **detail: Any) -> None:
        """An event for this node's console (the job's events.jsonl is the coordinator's)."""
        log.info("%s %s", kind.value, message)
        if self.push is not None:
            event = Event(kind=kind, message=message, rank=detail.pop("rank", None), node=self.node, detail=detail)
            self.push.send(encode(MsgType.EVENT, self._event_sender, self._events_audience, event=event.to_json()))

    def run(self) -> int:
        """Serve the coordinator until it shuts the job down or is lost; returns the exit code."""
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
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.closed, zmq.POLLIN)
        poller.register(self._wakeup.fd, zmq.POLLIN)
        last_heard = self.clock()
        fled = False  # moved to the standby on silence (a vote for its takeover)
        next_beat = 0.0
        while self.exit_code is None:
            now = self.clock()
            if now >= next_beat:
                self.send(MsgType.AGENT_BEAT, node=self.node)
                next_beat = now + self.heartbeat_interval
            if self._seat:
                self.offer_standby()
            events = dict(poller.poll(timeout=int(min(self.heartbeat_interval, 0.5) * 1000)))
            if self._wakeup.fd in events:
                self._wakeup.drain()
            self.report_exits()
            if self.sock in events:
                for msg in receive(self.sock, self._receiver, 1000, lambda err: log.warning("dropped a frame: %s", err)):
                    last_heard = self.heard_again(last_heard)
                    if self._at_seat:  # the standby took the job over: it is the coordinator now
                        self._at_seat, self._dead = False, []
                    self.handle(msg)
                    if self._rejoin:
                        break
            if self._rejoin:
                self.rejoin(poller, self._endpoint, self._coordinator_node, "the coordinator fenced this node's old "
                            "connection and awaits the node: rejoining as its replacement")
                fled, last_heard = False, self.clock()
                continue
            if self.closed in events and self.exit_code is None and self.stop_signal is None and self._gone():
                # What the coordinator sent before it closed comes first (a shutdown at the job's end).
                for msg in receive(self.sock, self._receiver, 1000, lambda err: log.warning("dropped a frame: %s", err)):
                    self.handle(msg)
                if self.exit_code is not None:
                    continue
                self._dead.append(self._coordinator_node)
                if self._at_seat and not self._proven:
                    message = (f"lost the job coordinator (nothing heard from it) and its standby on node "
                               f"{self._coordinator_node} died; stopping this node's ranks")
                    self.stop_all(message)
                    self.event(EventKind.JOB_FINISHED, f"job failed: {message}", exit_code=1)
                    self.exit_code = 1
                    continue
                # Its processes are gone (a killed process's or host's kernel closes its
                # connections): the next standby in line takes the job over; say hello there (its
                # endpoint queues it until then), or take over here if this node is next.
                hop = self._hop(poller, proven=True)
                if hop is not None:
                    return hop
                last_heard = self.clock()
            if self.stop_signal is not None and self.exit_code is None:
                # This node's launcher was stopped (or died: its death signal is SIGTERM). Tell the
                # coordinator first, so that it takes the node as gone rather than respawning its
                # ranks here, then stop them.
                reason = f"its launcher was stopped by {signal.Signals(self.stop_signal).name} or died"
                self.send(MsgType.AGENT_BEAT, node=self.node, leaving=reason)
                self.stop_all(reason)
                self.event(EventKind.JOB_FINISHED, f"node {self.node} left the job: {reason}", exit_code=128 + self.stop_signal)
                self.exit_code = 128 + self.stop_signal
            elif self.exit_code is None and self.clock() - last_heard > self.coordinator_timeout:
                silence = self.clock() - last_heard
                if self._first_in_line() and not self._at_seat:
                    # Silence, not a closed connection: a partition or a hung host. Take over only
                    # with a majority (the others' agents come here when they hear nothing either);
                    # the coordinator steps down when it hears half or less.
                    agree, electorate = self.standby.votes()
                    if self.standby.elected():
                        return self.take_over(f"nothing heard from it for {silence:.1f} s, and {agree} of the job's "
                                              f"{electorate} nodes agree (a majority; the other side steps down)")
                    if electorate >= 3 and silence <= 2 * self.coordinator_timeout:
                        continue  # the other agents' votes may still come
                elif self.line and not fled and not self._at_seat:
                    # Silence: the coordinator may be cut off from this node. Go to the first
                    # standby (this hello is a vote for its takeover); if it never takes over, end below.
                    log.warning("nothing heard from the coordinator for %.1f s; moving to the standby at %s",
                                silence, self.line[0][0])
                    fled, last_heard = True, self.clock()
                    if self._hop(poller, proven=False) is None and self.exit_code is None:
                        continue
                    if self.exit_code is not None:
                        continue
                if silence <= self.coordinator_timeout + self.link_grace:
                    if fled and self._at_seat:
                        # The standby never took over: the link to the coordinator may come back.
                        self.rejoin(poller, *self._home, "nothing heard from the coordinator nor from its standby: "
                                    "going back to the coordinator")
                        fled = False
                    self.say_waiting(silence)
                    continue
                message = (f"lost the job coordinator on node {self._coordinator_node} (nothing heard for {silence:.1f} s"
                           f"{'; nor from its standby' if fled else ''}"
                           f"{f', tried for --node_wait_timeout {self.link_grace:g} s' if self.link_grace else ''}); "
                           "stopping this node's ranks")
                self.stop_all(message)
                self.event(EventKind.JOB_FINISHED, f"job failed: {message}", exit_code=1)
                self.exit_code = 1
        self.processes.stop_spares()
        self.sock.disable_monitor()
        self.closed.close(0)
        self.sock.close(2000)
        if self.push is not None:
            self.push.close(2000)
        self.ctx.term()
        return self.exit_code

    def heard_again(self, last_heard: float) -> float:
        """A frame came from the coordinator: the silence (if one was said) is over. Returns the new
        time last heard."""
        now = self.clock()
        if self._waiting_since is not None:
            self.event(EventKind.WARNING, f"node {self.node} hears the job coordinator again after "
                                          f"{now - last_heard:.1f} s of silence")
            self._waiting_since = None
        return now

    def say_waiting(self, silence: float) -> None:
        """Say once per silence that this node keeps trying (a link flap is weather, not loss)."""
        if self._waiting_since is None:
            self._waiting_since = self.clock()
            self.event(EventKind.WARNING, f"node {self.node} hears nothing from the job coordinator on node "
                                          f"{self._coordinator_node} for {silence:.1f} s (this node's link, or node "
                                          f"{self._coordinator_node}'s, may be down): keeping this node's ranks and "
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
        self._reconnect(poller, endpoint, node, at_seat=False, proven=False)

    def _reconnect(self, poller: zmq.Poller, endpoint: str, node: int, at_seat: bool, proven: bool) -> None:
        """Drop the connection in ``poller``, connect to ``endpoint`` (the coordinator or a standby
        on ``node``; ``at_seat``: a standby that has not taken over; ``proven``: its predecessor's
        processes died) and say hello there."""
        for sock in (self.closed, self.sock):
            poller.unregister(sock)
        self.close_connection()
        self._connect(endpoint)
        self._coordinator_node, self._at_seat, self._proven = node, at_seat, proven
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.closed, zmq.POLLIN)
        self._hello()

    def _gone(self) -> bool:
        """Read the connection's monitor: True when the coordinator (or standby) this agent is
        connected to is gone: its connection closed, or, for a standby that has not taken over,
        connecting to it was refused (nothing listens there any more: its process died before this
        agent reached it)."""
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(self.closed.recv_multipart())["event"]
        if event == zmq.EVENT_DISCONNECTED:
            return True
        return self._at_seat and endpoint_refuses(self._endpoint)

    def _first_in_line(self) -> bool:
        """This agent stands by, holds the job's state, and is the first standby in line."""
        if self.standby is None or self.standby.state is None:
            return False
        return not self.line or self.line[0][0] == self.standby.control.address

    def _hop(self, poller: zmq.Poller, proven: bool) -> int | None:
        """The coordinator this agent is connected to is gone (``proven``: its processes died, not
        only silent): go to the next standby in line that is alive and say hello there, or, when
        this agent's own seat is next and every one before it died, take the job over and return
        its exit code. With nobody left, end this node's part of the job (exit code 1)."""
        while self.line:
            control, node = self.line.pop(0)
            if self.standby is not None and control == self.standby.control.address:
                if proven and self.standby.state is not None:
                    return self.take_over(_takeover_cause(self._dead), lost=self._dead)
                break  # only silence: nothing proves the coordinator dead, so no takeover here
            if endpoint_refuses(control):
                self._dead.append(node)  # its process died before this agent reached it
                continue
            log.warning("the coordinator on node %d is gone; moving to the standby on node %d at %s",
                        self._coordinator_node, node, control)
            self._reconnect(poller, control, node, at_seat=True, proven=proven)
            return None
        message = (f"lost the job coordinator on node {self._coordinator_node} and every standby coordinator "
                   f"(nodes {sorted(set(self._dead))} died or nothing proves the coordinator dead); stopping this node's ranks")
        self.stop_all(message)
        self.event(EventKind.JOB_FINISHED, f"job failed: {message}", exit_code=1)
        self.exit_code = 1
        return None

    def take_over(self, cause: str, lost: list[int] | None = None) -> int:
        """This node stands by and the coordinator is gone (``cause``: its connection closed, or
        a majority hears nothing from it): run the job's coordinator here
        (:class:`ftrun.coordinator.seat.StandbySeat`) and return the job's exit code."""
        log.warning("taking the job over (standby): the coordinator is gone: %s", cause)
        self.close_connection()
        if self.push is not None:
            self.push.close(0)
            self.push = None
        self.ctx.term()
        return self.standby.take_over(self.processes, self.events_addr, self.node, self._events_node,
                                      lost=list(dict.fromkeys(lost if lost is not None else [self._coordinator_node])),
                                      cause=cause)

    def stop_all(self, reason: str) -> None:
        log.warning("%s", reason)
        for report in self.processes.stop(0.0 if self.exit_code is not None else 2.0):
            if isinstance(report, ExitReport):
                self._send_exit(report)

    def report_exits(self) -> None:
        for report in self.processes.reap():
            if isinstance(report, StopReport):
                self.send(MsgType.STOPPED, node=self.node, rank=report.rank, incarnation=report.incarnation,
                          pid=report.pid, signal=report.signal, at=report.at)
            else:
                self._send_exit(report)

    def _send_exit(self, r: ExitReport) -> None:
        self.send(MsgType.EXITED, node=self.node, rank=r.rank, incarnation=r.incarnation, pid=r.pid,
                  returncode=r.returncode, at=r.at, error=r.error, log_tail=list(r.log_tail))

    def handle(self, msg: Message) -> None:
        """Carry out one command of the coordinator (a dispatch table, one handler a type)."""
        handler = self._handlers.get(msg.type)
        if handler is not None:
            handler(self, msg)

    def _on_spawn(self, msg: Message) -> None:
        rank_vars = {str(k): str(v) for k, v in msg["vars"].items()}
        rank_vars[STANDBY_LINE] = ",".join(control for control, _ in self.line)  # see ftrun.rank.client.open_channel
        try:
            pid, spare = self.processes.spawn(msg["rank"], msg["incarnation"], rank_vars, msg["header"], msg["use_spare"])
        except OSError as err:
            log.error("cannot start rank %d: %s", msg["rank"], err)
            self.send(MsgType.EXITED, node=self.node, rank=msg["rank"], incarnation=msg["incarnation"], pid=0,
                      returncode=127, at=time.time())
            return
        self.send(MsgType.SPAWNED, node=self.node, rank=msg["rank"], incarnation=msg["incarnation"], pid=pid,
                  spare=bool(spare), spare_kind=spare)
        self.event(EventKind.RANK_STARTED, f"rank {msg['rank']} started (pid {pid}, incarnation {msg['incarnation']}"
                                           f"{f', in a {spare} spare' if spare else ''})", rank=msg["rank"])

    def _on_signal(self, msg: Message) -> None:
        self.processes.signal(msg["rank"], msg["incarnation"], msg["signal"])

    def _on_kill_hung(self, msg: Message) -> None:
        lines, note, gone = self.processes.kill_hung(msg["rank"], msg["incarnation"], msg["line"], bool(msg.get("dump", True)))
        self.send(MsgType.STACKS, node=self.node, rank=msg["rank"], incarnation=msg["incarnation"], lines=lines[-200:],
                  note=note)
        if gone is not None:  # this node never ran it (RankProcesses.kill_hung)
            self._send_exit(gone)

    def _on_stop_ranks(self, msg: Message) -> None:
        for report in self.processes.stop(float(msg["grace"])):
            if isinstance(report, ExitReport):
                self._send_exit(report)

    def _on_spares(self, msg: Message) -> None:
        note = self.processes.keep_spares(msg["warm"], msg["hot"], {str(k): str(v) for k, v in msg["vars"].items()})
        if note is not None:
            self.send(MsgType.SPARE_NOTE, node=self.node, message=note)

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
        self.line = standby_line(msg)

    def _on_stand_by(self, _msg: Message) -> None:
        """Stand by as the job coordinator (the coordinator lost the one it had). The seat is set
        up on a thread (hosting a store can take seconds: a reverse name lookup of its first
        client), so that this loop keeps beating; :meth:`offer_standby` answers once it is ready."""
        if self.standby is not None:
            self.offer_standby()
        elif self.spec is not None and self._seat is None:
            self._seat = []
            spec, token, made = self.spec, self._token, self._seat
            threading.Thread(target=lambda: made.append(_standby_seat(spec, token, asked=True)),
                             name="ftrun-standby-seat", daemon=True).start()

    def offer_standby(self) -> None:
        """Tell the coordinator this agent stands by (its endpoint and store), once its seat is ready."""
        if self.standby is None and self._seat:
            self.standby, self._seat = self._seat[0], None
        if self.standby is not None:
            self.send(MsgType.AGENT_BEAT, node=self.node, standby_control=self.standby.control.address,
                      standby_store=self.standby.store_addr)

    def _on_state(self, msg: Message) -> None:
        if self.standby is not None:
            self.standby.state = msg["state"]

    def _on_shutdown(self, msg: Message) -> None:
        if msg.get("rejoin") is True and self.stop_signal is None:
            self._rejoin = True  # fenced, but still awaited: come back as the node's replacement (run)
            return
        for report in self.processes.stop(2.0):
            if isinstance(report, ExitReport):
                self._send_exit(report)
        self.event(EventKind.JOB_FINISHED, msg["message"], exit_code=msg["code"])
        self.exit_code = msg["code"]

    _handlers: dict[MsgType, Callable[["NodeAgent", Message], None]] = {
        MsgType.SPAWN: _on_spawn,
        MsgType.SIGNAL: _on_signal,
        MsgType.KILL_HUNG: _on_kill_hung,
        MsgType.STOP_RANKS: _on_stop_ranks,
        MsgType.SPARES: _on_spares,
        MsgType.SHUTDOWN: _on_shutdown,
        MsgType.TAKE_NODE: _on_take_node,
        MsgType.STANDBY: _on_standby,
        MsgType.STATE: _on_state,
        MsgType.STAND_BY: _on_stand_by,
    }


def _takeover_cause(dead: list[int]) -> str:
    """Why a standby takes the job over after closed connections, in words."""
    if len(set(dead)) <= 1:
        return "its connection to this standby closed (its processes or its host died)"
    return (f"the coordinator's and the standby coordinators' processes on nodes {sorted(set(dead))} died (their "
            "connections closed or were refused)")


def agent_log_name(node: int) -> str:
    """The log file of node ``node``'s agent in ``--log_dir`` (a standby node's until it takes a node, too)."""
    return "agent_standby.log" if node == STANDBY_NODE_INDEX else f"agent_{node}.log"


def _standby_seat(spec: Any, token: str, asked: bool = False) -> Any:
    """Node 1's agent stands by as the job coordinator (:mod:`ftrun.coordinator.failover`) when
    ARF can use it, and any agent the coordinator ``asked`` (its standby was lost); None
    elsewhere, or when its endpoint or store cannot be set up (logged: the job runs, without a
    standby)."""
    from ftrun.coordinator.failover import STANDBY_NODE
    from ftrun.coordinator.seat import StandbySeat

    if (spec.node_rank != STANDBY_NODE and not asked) or not spec.tft.arf or spec.join or spec.nnodes < 2:
        return None
    try:
        return StandbySeat(spec, token)
    except Exception as err:  # noqa: BLE001  no standby is today's behaviour, not a failure
        log.warning("cannot stand by as the job coordinator: %s", err)
        return None


def main() -> None:
    """Entry point of ``python -m ftrun.node.agent`` (started by a launcher on a node other than 0)."""
    from ftrun.config import JobSpec

    spec = JobSpec.from_json(json.loads(os.environ["FTRUN_AGENT_SPEC"]))
    procs.dump_stacks_on_sigusr1()  # into its log, its stderr
    log_dir = Path(spec.log_dir)
    logging.basicConfig(filename=log_dir / agent_log_name(spec.node_rank), level=logging.INFO,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    processes = RankProcesses(
        rank_argv(spec.no_python, spec.module, spec.script, list(spec.script_args)),
        [spec.script, *spec.script_args], spec.module, log_dir, spec.local_worker_num, spec.master_addr,
        multi_node=spec.nnodes > 1, token=os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
    )
    agent = NodeAgent(spec.node_rank, os.environ["FTRUN_CONTROL_FOR_AGENT"], os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"],
                      processes, spec.heartbeat_interval, max(spec.heartbeat_timeout, 3 * spec.heartbeat_interval),
                      os.environ.get("FTRUN_EVENTS_ADDR"),
                      standby=_standby_seat(spec, os.environ["FTRUN_TOKEN_FOR_SUPERVISOR"]),
                      link_grace=spec.node_wait_timeout if spec.tft.arf else 0.0)
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
