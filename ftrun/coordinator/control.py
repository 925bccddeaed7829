"""The coordinator's side of the control plane: one ZeroMQ ROUTER that ranks and agents talk to.

Every frame is authenticated and fresh or it is dropped before decoding (:mod:`ftrun.common.protocol`:
HMAC-SHA256 over the frame and its audience, a per-session counter); rejects are counted, only the
first few are logged, and a connection that keeps sending bad frames is not read any more. The
ROUTER's monitor reports connections that close (an agent's closing is its node's loss at once).
Decoded messages go to the two handlers the coordinator gives: one for agents' messages, one for
ranks'.
"""

from __future__ import annotations

import logging
from typing import Any, Callable

import zmq

from ftrun.common.protocol import (CONTROL, MAX_FRAME_BYTES, Message, MsgType, ProtocolError, Receiver, Sender, decode, encode,
                        to_peer)

log = logging.getLogger("ftrun.coordinator")

AGENT_MESSAGES = frozenset({MsgType.AGENT_HELLO, MsgType.AGENT_BEAT, MsgType.SPAWNED, MsgType.EXITED, MsgType.STOPPED,
                            MsgType.STACKS, MsgType.SPARE_NOTE, MsgType.RANK_REPORTS})
# Agents' messages applied as they are read (the others are reports that wait for the main loop's checks).
APPLIED_AT_ONCE = frozenset({MsgType.AGENT_BEAT, MsgType.RANK_REPORTS})
MAX_REJECT_EVENTS = 20  # rejected frames after this many are counted in the log only
OFFENDER_REJECTS = 8  # a connection that sent this many rejected frames is not read any more
READ_BUDGET = 2000  # frames handled per pass of the main loop (then deaths and hangs are checked)


class ControlPlane:
    """The ROUTER socket, its authentication and its dispatch.

    Args:
        ctx: the ZeroMQ context.
        token: the job secret (keys the frames' HMAC; never sent).
        bind: the address to bind on (a random port is taken).
        advertised: the host the others connect to (``control_addr``).

    :meth:`serve` names the coordinator's handlers.
    """

    def __init__(self, ctx: zmq.Context, token: str, bind: str, advertised: str) -> None:
        self.sender = Sender(token)  # frames to ranks and agents
        self.receiver = Receiver(self.sender.auth, CONTROL)  # their frames: authentic and fresh
        self.router = ctx.socket(zmq.ROUTER)
        self.router.setsockopt(zmq.LINGER, 0)
        # No ROUTER_HANDOVER: a second connection presenting a connected rank's identity is
        # refused, never given that rank's traffic. Oversized frames are dropped by ZeroMQ before
        # they are buffered (the connection that sent one is closed).
        self.router.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        # A connection that closes is seen at once (a killed host's kernel resets its connections):
        # an agent's connection closing is its node's loss, with no heartbeat timeout to wait for.
        self.disconnects = self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        self._agent_fds: dict[int, bytes] = {}  # descriptor of an agent's connection -> its routing identity
        self._closed_agents: set[bytes] = set()  # agents whose connection closed, not yet taken
        port = self.router.bind_to_random_port(f"tcp://{bind}")
        self.address = f"tcp://{advertised}:{port}"
        self.on_agent: Callable[[bytes, Message, int | None], None] = lambda _i, _m, _fd: None
        self.on_rank: Callable[[bytes, Message], None] = lambda _i, _m: None
        self.on_reject: Callable[[str, int], None] = lambda _why, _total: None
        self.protected: Callable[[], set[bytes]] = set
        self.rejected = 0
        self.drained = True  # the last read() left no frame waiting (else the coordinator is behind)
        self._held: list[tuple[bytes, Message, int | None]] = []  # read by a standby before its takeover (hold)
        self._reject_counts: dict[bytes, int] = {}
        self._offenders: set[bytes] = set()

    def serve(self, on_agent: Callable[[bytes, Message, int | None], None], on_rank: Callable[[bytes, Message], None],
              on_reject: Callable[[str, int], None], protected: Callable[[], set[bytes]]) -> None:
        """Hand what arrives to a coordinator: ``on_agent`` (identity, message, connection
        descriptor or None) for an agent's message, ``on_rank`` (identity, message) for a rank's,
        ``on_reject`` (reason, total so far) for the first rejected frames; ``protected`` returns
        the identities never taken for offenders (live ranks'). Until then nothing is read (a
        standby's endpoint queues what arrives)."""
        self.on_agent, self.on_rank, self.on_reject, self.protected = on_agent, on_rank, on_reject, protected

    def send(self, identity: bytes, msg_type: MsgType, fields: dict[str, Any]) -> None:
        """Send one message to the connection ``identity`` (a rank's or an agent's)."""
        self.router.send_multipart([identity, encode(msg_type, self.sender, to_peer(identity), **fields)])

    def watch_agent_connection(self, fd: int | None, identity: bytes) -> None:
        """Remember which descriptor an agent's connection has (from its hello's ``SRCFD``).

        The closes the monitor reported so far are read first: a connection that closed before
        this one was accepted may have had the same descriptor (the kernel reuses the lowest free
        one; an agent's or a rank's probe of this endpoint, :func:`ftrun.common.protocol.endpoint_refuses`,
        connects and closes at once), and its close must not be taken for this agent's."""
        if fd is not None:
            self._drain_closes()
            self._agent_fds[fd] = identity

    def _drain_closes(self) -> None:
        from zmq.utils.monitor import recv_monitor_message

        while True:
            try:
                event = recv_monitor_message(self.disconnects, zmq.NOBLOCK)
            except zmq.Again:
                return
            identity = self._agent_fds.pop(event["value"], None)
            if identity is not None:
                self._closed_agents.add(identity)

    def closed_agent_connections(self) -> set[bytes]:
        """The agent connections (routing identities) that have closed since the last call (the
        ROUTER's monitor: each connection's descriptor was recorded from its agent's hello,
        ``SRCFD``). A lost node's old agent, fenced, or a replaced one is not its node's agent any
        more: the caller checks the identity against the node's current agent."""
        self._drain_closes()
        identities, self._closed_agents = self._closed_agents, set()
        return identities

    def read(self, budget: int | None = None, agents_only: bool = False,
             stop: Callable[[], bool] = lambda: False) -> int:
        """Handle up to ``budget`` frames waiting on the ROUTER (with ``agents_only``, ranks'
        messages are dropped: while every rank is being stopped), until ``stop()`` is true.
        Returns how many agents' reports were handled (messages other than beats: they wait to be
        applied; a beat, which every agent sends each interval, is news for no check but the ones
        each ``--monitor_interval`` runs anyway).

        The budget bounds the time one call takes whatever arrives (a flood of forged frames), so
        the loop gets back to reaping deaths (SIGCHLD) and to the watchdog between batches.
        """
        agents, self.drained = 0, False
        while self._held:  # what a standby read before its takeover comes first, in order
            identity, msg, fd = self._held.pop(0)
            agents += self._dispatch(identity, msg, fd, agents_only)
        for _ in range(READ_BUDGET if budget is None else budget):
            got = self._next()
            if got is None:
                self.drained = True
                break
            if got is not False:
                agents += self._dispatch(*got, agents_only)
            if stop():
                break
        return agents

    def _next(self) -> tuple[bytes, Message, int | None] | None | bool:
        """The next authentic message waiting (identity, message, an agent hello's connection
        descriptor), None when nothing waits, False for a frame dropped or rejected."""
        try:
            parts = self.router.recv_multipart(zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return None
        frames = [part.bytes for part in parts]
        identity = frames[0]
        if identity in self._offenders:
            return False  # dropped unread: no MAC, no decode, no log
        if len(frames) != 2:
            self.reject(identity, "wrong number of frames")
            return False
        try:
            msg = decode(frames[1], self.receiver)
        except ProtocolError as err:
            self.reject(identity, str(err))
            return False
        return identity, msg, parts[1].get(zmq.SRCFD) if msg.type == MsgType.AGENT_HELLO else None

    def _dispatch(self, identity: bytes, msg: Message, fd: int | None, agents_only: bool) -> bool:
        """Hand one message to its handler; whether it was an agent's report (not a beat)."""
        if msg.type in AGENT_MESSAGES:
            self.on_agent(identity, msg, fd)
            return msg.type not in APPLIED_AT_ONCE
        if not agents_only:
            self.on_rank(identity, msg)
        return False

    def hold(self, budget: int = READ_BUDGET) -> set[bytes]:
        """A standby before its takeover: read what waits on its endpoint and keep it, decoded
        once, for the coordinator it may become (:meth:`read` hands it over first, in order).
        Returns the connections of the agents that said hello here so far: an agent comes only
        when it lost touch with the coordinator, so each is a vote for the takeover
        (:meth:`ftrun.coordinator.seat.StandbySeat.votes`)."""
        for _ in range(budget):
            got = self._next()
            if got is None:
                break
            if got is not False:
                self._held.append(got)
        return {identity for identity, msg, _fd in self._held if msg.type == MsgType.AGENT_HELLO}

    def reject(self, identity: bytes, why: str) -> None:
        """Count a rejected frame; report only the first few, and drop a connection's frames
        unread once it has sent :data:`OFFENDER_REJECTS` bad ones (a flood costs almost nothing)."""
        self.rejected += 1
        per_peer = self._reject_counts[identity] = self._reject_counts.get(identity, 0) + 1
        if per_peer >= OFFENDER_REJECTS and identity not in self.protected():
            self._offenders.add(identity)
            self._reject_counts.pop(identity, None)
            if len(self._offenders) <= MAX_REJECT_EVENTS:
                log.warning("dropping every further frame from connection %r (%d rejected)", identity[:16], per_peer)
        if len(self._reject_counts) > 10_000:
            self._reject_counts.clear()
        if self.rejected <= MAX_REJECT_EVENTS:
            log.warning("rejected message from %r: %s", identity[:32], why)
            self.on_reject(why, self.rejected)
        elif self.rejected in (MAX_REJECT_EVENTS + 1, 1000, 100_000) or self.rejected % 1_000_000 == 0:
            log.warning("%d control messages rejected so far (only the first %d are logged one by one)",
                        self.rejected, MAX_REJECT_EVENTS)

    def close(self) -> None:
        self.router.disable_monitor()
        self.disconnects.close(0)
        self.router.close(0)
