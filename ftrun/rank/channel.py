"""The worker's side of the control plane: one ZeroMQ DEALER owned by a background thread.

ZeroMQ sockets must not be shared between threads, so a single I/O thread owns the DEALER. Other
threads hand it frames through a queue and wake it through a pipe that its poller watches; it sends
them, sends a heartbeat every ``heartbeat_interval`` seconds, and queues what the supervisor sends
(``abort``, ``reconfigure``, ``stop``) for the training thread to take with :meth:`Channel.receive`.
Heartbeats come from this thread, so a rank whose training thread is busy in a long step still
proves it is alive; a frozen process (SIGSTOP) stops sending them.

With a relay (:mod:`ftrun.node.relay`) the thread also owns a DEALER to its node agent: the beats
go there, and so do a recovery round's answers (``fault`` for an abort, ``recovered``) when the
round's order came that way; the orders the agent relays are read there.
"""

from __future__ import annotations

import os
import queue
import secrets
import sys
import threading
import time
import traceback
from typing import Any, Callable

import zmq

from ftrun.common.protocol import (CONTROL, MAX_FRAME_BYTES, RELAY, RELAYED_ORDERS, Message, MsgType, Receiver, Sender, endpoint_refuses, pack,
                                  receive, standby_line, to_peer)

RECEIVE_BUDGET = 1000  # frames read per wake-up of the I/O thread (then it beats and sends again)


class Channel:
    """A rank's connection to its supervisor.

    Args:
        addr: the supervisor's ROUTER endpoint (``FTRUN_CONTROL_ADDR``).
        token: the job secret (``FTRUN_TOKEN``).
        rank, incarnation: this process's identity.
        heartbeat_interval: seconds between heartbeats.
        relay: its node agent's heartbeat relay (``FTRUN_RELAY_ADDR``, :mod:`ftrun.node.relay`), or
            None: the heartbeats then go to the supervisor with everything else.
    """

    def __init__(self, addr: str, token: str, rank: int, incarnation: int, heartbeat_interval: float,
                 relay: str | None = None) -> None:
        # One session per process (a respawned rank's frames can never pass as its predecessor's),
        # sealed on the I/O thread as they leave, so counters arrive in increasing order.
        self._sender = Sender(token)
        self.rank = rank
        self.incarnation = incarnation
        self.heartbeat_interval = heartbeat_interval
        self._outbox: queue.SimpleQueue[tuple[bytes, bool] | None] = queue.SimpleQueue()  # (frame, a round's answer)
        self._inbox: queue.SimpleQueue[Message] = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        self._wake_lock = threading.Lock()
        self._wake_pending = False
        self._ctx = zmq.Context.instance()
        self._direct_sent = 0  # frames sent to the coordinator (a relayed beat carries the count: its order)
        self._connect(addr)
        self._relay: zmq.Socket | None = None
        self._relay_sender: Sender | None = None
        self._relay_receiver: Receiver | None = None
        self._answer_via_relay = False  # the last round order came through the relay: answer there
        if relay:
            self._relay = self._ctx.socket(zmq.DEALER)
            relay_identity = b"q" + secrets.token_bytes(15)  # the agent seals this rank's orders for it alone
            self._relay.setsockopt(zmq.IDENTITY, relay_identity)
            self._relay.setsockopt(zmq.LINGER, 0)
            self._relay.setsockopt(zmq.SNDHWM, 16)  # an agent not reading gets the newest beats, never a backlog
            self._relay.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
            self._relay.connect(relay)
            self._relay_sender = Sender(self._sender.auth)
            self._relay_receiver = Receiver(self._sender.auth, to_peer(relay_identity))
        # The standby coordinators' endpoints, first first (a ``standby`` message): when this
        # connection closes (the coordinator's process died), the channel moves to the first and says
        # hello again; when that one's closes or refuses before it spoke, to the next.
        self.line: list[str] = []
        self._at_seat = False  # connected to a standby that has said nothing yet
        # ... and when nothing is heard from the coordinator for this many seconds (its beats, the
        # ``standby`` message told again once a heartbeat interval): a partition between them.
        self.silence_timeout: float | None = None
        self._hello: dict[str, Any] | None = None
        self._closed = False
        # Called on the I/O thread with each message from the supervisor, before it is queued: the
        # one way to act while the training thread is blocked (e.g. inside a collective).
        self.on_receive: Callable[[Message], None] | None = None
        # Called on the I/O thread at each heartbeat: extra fields that describe what the training
        # thread is doing (the watchdog's evidence), e.g. {"in_dist": True} while it waits in a
        # torch.distributed call.
        self.probe: Callable[[], dict[str, Any]] | None = None
        # Called on the I/O thread at each heartbeat: the fields of a ``progress`` message to send
        # with it, or None (an open ft.section() says so at every beat).
        self.beat_extra: Callable[[], dict[str, Any] | None] | None = None
        # Called on the I/O thread when it says hello again to a standby coordinator: extra fields
        # (the newest generation this rank has seen, which the new coordinator must go beyond).
        self.rejoin_fields: Callable[[], dict[str, Any]] = dict
        self._thread = threading.Thread(target=self._run, name="ftrun-channel", daemon=True)
        self._thread.start()

    def _connect(self, addr: str) -> None:
        """A DEALER to ``addr``, with a monitor that sees the connection close (I/O thread, or
        before it starts)."""
        self._sock = self._ctx.socket(zmq.DEALER)
        # An unguessable routing identity: the supervisor binds this rank's messages to the
        # connection whose hello verified, and its ROUTER never hands an identity over to another
        # connection, so no local process can take this rank's place on the control plane.
        identity = b"r" + secrets.token_bytes(15)
        self._sock.setsockopt(zmq.IDENTITY, identity)
        self._receiver = Receiver(self._sender.auth, to_peer(identity))
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._sock.setsockopt(zmq.LINGER, 1000)
        self._closes = self._sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self._sock.connect(addr)
        self._endpoint = addr

    def _gone(self) -> bool:
        """Read the connection's monitor: its connection closed, or connecting to a standby that
        has said nothing yet was refused (its process died before this rank reached it)."""
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(self._closes.recv_multipart())["event"]
        return event == zmq.EVENT_DISCONNECTED or (self._at_seat and endpoint_refuses(self._endpoint))

    def _move(self, poller: zmq.Poller) -> None:
        """The coordinator's connection closed, or it fell silent, and a standby is known: connect
        to the first in line that does not refuse and say hello again (same process, same
        incarnation; ``rejoin``), before anything else is sent."""
        target = self.line.pop(0)
        while self.line and endpoint_refuses(target):
            target = self.line.pop(0)
        for sock in (self._sock, self._closes):
            poller.unregister(sock)
        self._sock.disable_monitor()
        self._closes.close(0)
        self._sock.close(0)
        self._connect(target)
        self._at_seat = True
        if self._relay is not None:
            # The new coordinator may run in this node's agent's process (its standby seat), which
            # relays nothing then: from here on the heartbeats go to the coordinator itself.
            poller.unregister(self._relay)
            self._relay.close(0)
            self._relay = None
            self._answer_via_relay = False
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._closes, zmq.POLLIN)
        if self._hello is not None:
            hello = {k: v for k, v in self._hello.items() if k != "hot"}
            try:
                hello.update(self.rejoin_fields())
            except Exception:  # noqa: BLE001  the hello must go out
                _log_io_error("describing this rank for its new coordinator")
            self._send_direct(pack(MsgType.HELLO, rank=self.rank, incarnation=self.incarnation, rejoin=True, **hello))

    def send(self, msg_type: MsgType, **fields: Any) -> None:
        """Queue a message (rank and incarnation are added). Never blocks on the network."""
        if self._closed:
            return
        if msg_type == MsgType.HELLO:
            self._hello = dict(fields)  # said again to a standby coordinator after a takeover
        frame = pack(msg_type, rank=self.rank, incarnation=self.incarnation, **fields)
        answer = msg_type == MsgType.RECOVERED or (msg_type == MsgType.FAULT and fields.get("kind") == "abort")
        # Wake the I/O thread once per burst: until it has taken the wake-up, it will drain
        # everything queued meanwhile (a step sends several messages; a system call each was
        # measurable on small steps).
        with self._wake_lock:
            self._outbox.put((frame, answer))
            if not self._wake_pending:
                self._wake_pending = True
                try:
                    os.write(self._wake_w, b"x")
                except OSError:
                    pass  # the I/O thread has ended: nothing is sent any more

    def receive(self, timeout: float | None = 0.0) -> Message | None:
        """Take the next message from the supervisor, waiting up to ``timeout`` seconds (None: forever)."""
        try:
            if timeout == 0.0:
                return self._inbox.get_nowait()
            return self._inbox.get(timeout=timeout)
        except queue.Empty:
            return None

    def close(self) -> None:
        """Flush queued messages (up to about a second) and stop the I/O thread."""
        if self._closed:
            return
        self._closed = True
        self._outbox.put(None)
        try:
            os.write(self._wake_w, b"x")
        except OSError:
            pass  # the I/O thread has already ended (and closed its pipe): nothing to wake
        self._thread.join(timeout=2.0)

    def _run(self) -> None:
        """The I/O thread: beat, send what is queued, read what arrives, and move to a standby
        coordinator when the connection closes or falls silent, until :meth:`close`."""
        poller = zmq.Poller()
        for watched in (self._sock, self._closes, self._wake_r):
            poller.register(watched, zmq.POLLIN)
        if self._relay is not None:
            poller.register(self._relay, zmq.POLLIN)
        heartbeat = pack(MsgType.HEARTBEAT, rank=self.rank, incarnation=self.incarnation)
        next_beat = time.monotonic() + self._interval()  # the hello goes first
        last_heard = time.monotonic()
        running = True
        while running:
            now = time.monotonic()
            if self._fell_silent(now - last_heard):
                print(f"ftrun: control channel: nothing heard from the coordinator for {now - last_heard:.1f} s; "
                      "moving to the standby coordinator", file=sys.stderr, flush=True)
                self._move(poller)
                last_heard = now
            if now >= next_beat:
                self._beat(heartbeat)
                next_beat = now + self._interval()
            events = dict(poller.poll(timeout=max(0, int((next_beat - now) * 1000))))
            if self._wake_r in events:
                self._take_wake_up()
            running = self._send_queued()
            if self._closes in events and self._gone() and self.line and running:
                self._move(poller)
                last_heard = time.monotonic()
                continue
            if self._sock in events and self._take_incoming():
                last_heard = time.monotonic()
            if self._relay is not None and self._relay in events and self._take_relayed():
                last_heard = time.monotonic()
        self._close_sockets()

    def _interval(self) -> float:
        """Seconds to the next heartbeat: through a relay, half the interval (its hop adds up to one;
        :mod:`ftrun.node.relay`)."""
        return self.heartbeat_interval / (2 if self._relay is not None else 1)

    def _fell_silent(self, silence: float) -> bool:
        """Nothing heard from the coordinator for longer than the ``standby`` message allows, and a
        standby is known to move to (a standby that was connected to is silent until it takes over)."""
        return (bool(self.line) and not self._at_seat and self.silence_timeout is not None
                and silence > self.silence_timeout)

    def _beat(self, heartbeat: bytes) -> None:
        """Send a heartbeat (with the probe's fields) and the progress message the beat carries, if
        any. Nothing here stops the heartbeats: a failing probe sends the plain ``heartbeat``, and a
        full queue (the supervisor is not reading) drops the beat, the next one saying the same.
        With a relay the heartbeat goes to it, with the count of frames sent to the coordinator so
        far (``sent``: the coordinator's check of their order); the progress message goes direct."""
        relayed = {"sent": self._direct_sent} if self._relay is not None else {}
        beat = heartbeat
        if self.probe is not None or relayed:
            try:
                beat = pack(MsgType.HEARTBEAT, rank=self.rank, incarnation=self.incarnation,
                            **(self.probe() if self.probe is not None else {}), **relayed)
            except Exception:  # a probe must never stop the heartbeats
                beat = pack(MsgType.HEARTBEAT, rank=self.rank, incarnation=self.incarnation, **relayed)
        try:
            if self._relay is not None and self._relay_sender is not None:
                self._relay.send(self._relay_sender.seal(beat, RELAY), zmq.NOBLOCK)
            else:
                self._send_direct(beat, zmq.NOBLOCK)
        except zmq.Again:
            pass  # the supervisor is not reading (a full queue): the next beat says the same
        if self.beat_extra is not None:
            try:
                extra = self.beat_extra()
                if extra is not None:
                    self._send_direct(pack(MsgType.PROGRESS, rank=self.rank, incarnation=self.incarnation, **extra),
                                      zmq.NOBLOCK)
            except Exception:  # like the probe (zmq.Again included): never stop the heartbeats
                pass

    def _send_direct(self, frame: bytes, flags: int = 0) -> None:
        """Seal ``frame`` and send it to the coordinator, counting it once it is sent.

        Raises:
            zmq.Again: with ``zmq.NOBLOCK``, the queue is full (nothing was sent or counted)."""
        self._sock.send(self._sender.seal(frame, CONTROL), flags)
        self._direct_sent += 1

    def _take_wake_up(self) -> None:
        """Empty the wake-up pipe; messages queued from now on wake the I/O thread again."""
        with self._wake_lock:
            self._wake_pending = False
            try:
                os.read(self._wake_r, 65536)
            except BlockingIOError:
                pass

    def _send_queued(self) -> bool:
        """Send every frame queued by :meth:`send`, sealed in order; False once :meth:`close` queued
        its end mark (the frames queued before it are sent)."""
        while True:
            try:
                frame = self._outbox.get_nowait()
            except queue.Empty:
                return True
            if frame is None:
                return False
            payload, answer = frame
            if answer and self._answer_via_relay and self._relay is not None and self._relay_sender is not None:
                try:
                    self._relay.send(self._relay_sender.seal(payload, RELAY), zmq.NOBLOCK)
                    continue
                except zmq.Again:
                    pass  # the agent is not reading: straight to the coordinator
            self._send_direct(payload)

    def _take_incoming(self) -> bool:
        """Read what the coordinator sent (up to :data:`RECEIVE_BUDGET` frames): keep a ``standby``
        message's line and silence timeout, hand every other message to :attr:`on_receive` and queue
        it for the training thread. Only the supervisor knows the job's secret: a frame that does not
        verify is dropped. Returns whether any message arrived."""
        heard = False
        for msg in receive(self._sock, self._receiver, RECEIVE_BUDGET, lambda _err: None):
            heard = True
            self._at_seat = False  # whoever this is connected to speaks: it is the coordinator
            if msg.type == MsgType.STANDBY:
                self._take_standby(msg)
                continue
            if msg.type in RELAYED_ORDERS:  # a round's order came straight: its answer goes straight
                self._answer_via_relay = False
            self._deliver(msg)
        return heard

    def _take_relayed(self) -> bool:
        """Read what the node agent relayed (sealed for this rank's relay connection alone): the
        coordinator's beat (``standby``), and a round's ``abort`` and ``reconfigure``, whose answers
        then go through the relay too. Returns whether any arrived."""
        assert self._relay is not None and self._relay_receiver is not None
        heard = False
        for msg in receive(self._relay, self._relay_receiver, RECEIVE_BUDGET, lambda _err: None):
            if msg.type not in RELAYED_ORDERS:
                continue
            heard = True
            if msg.type == MsgType.STANDBY:
                self._take_standby(msg)
                continue
            self._answer_via_relay = True
            self._deliver(msg)
        return heard

    def _take_standby(self, msg: Message) -> None:
        """The coordinator's beat: its standbys in line and its silence timeout."""
        self.line = [control for control, _ in standby_line(msg)]  # []: the standby was lost, none yet
        timeout = msg.get("timeout")
        self.silence_timeout = float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else None

    def _deliver(self, msg: Message) -> None:
        """Hand a message of the coordinator to :attr:`on_receive`, then queue it for the training thread."""
        if self.on_receive is not None:
            try:
                self.on_receive(msg)
            except Exception:  # noqa: BLE001  the message must still reach the training thread
                _log_io_error(f"acting on {msg.type.value} on the I/O thread")
        self._inbox.put(msg)

    def _close_sockets(self) -> None:
        """Close the DEALER (queued frames get up to a second to leave), its monitor and the wake-up pipe."""
        self._sock.disable_monitor()
        self._closes.close(0)
        self._sock.close(linger=1000)
        if self._relay is not None:
            self._relay.close(0)
        os.close(self._wake_r)
        os.close(self._wake_w)


def _log_io_error(what: str) -> None:
    """Write an error of the I/O thread to the rank's log (stderr) and go on: this thread carries the
    heartbeats and the supervisor's aborts, so an exception that ended it would leave the rank deaf
    and silent (replaced as hung at the next abort or heartbeat timeout)."""
    print(f"ftrun: control channel: {what} failed (ignored):\n{traceback.format_exc()}", file=sys.stderr, flush=True)
