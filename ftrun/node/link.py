"""A node agent's connection to the job coordinator, or to a standby coordinator in line.

One DEALER socket to the coordinator's ROUTER endpoint, with a monitor that sees the connection
close (a killed process's or host's kernel closes its connections: proof that it is gone, where
silence is only silence), and the signing and checking of the frames on it
(:class:`~ftrun.common.protocol.Sender`, :class:`~ftrun.common.protocol.Receiver`). The agent moves
the link along the line of standby coordinators (:mod:`ftrun.node.succession`) as each one is gone.
"""

from __future__ import annotations

import logging
import os
from typing import Any, Iterator

import zmq

from ftrun.common.protocol import CONTROL, MAX_FRAME_BYTES, Message, MsgType, Receiver, Sender, encode, endpoint_refuses, receive, to_peer

log = logging.getLogger("ftrun.node.agent")  # the agent's log: this connection is part of the agent process

FRAMES_PER_READ = 1000  # frames read from the coordinator at a time (then the agent's loop goes on)


class CoordinatorLink:
    """The agent's connection to the coordinator (or standby) it serves.

    Args:
        ctx: the agent's ZeroMQ context.
        sender: the agent's session of frames to the coordinator (kept across reconnections).
        endpoint: the coordinator's ROUTER endpoint (``tcp://host:port``).

    Attributes:
        node: the node of the coordinator (or standby) connected to; 0 at first.
        at_seat: connected to a standby that has not taken the job over (said nothing) yet.
        proven: connected there after the previous one's connection closed (not only its silence).
        endpoint: the endpoint connected to.
        sock: the DEALER socket; ``closed``: its monitor (readable when the connection closes).
    """

    def __init__(self, ctx: zmq.Context, sender: Sender, endpoint: str) -> None:
        self.ctx = ctx
        self.sender = sender
        self.node, self.at_seat, self.proven = 0, False, False
        self.connect(endpoint)

    def connect(self, endpoint: str) -> None:
        """A DEALER to ``endpoint``, with a monitor that sees it close."""
        self.sock = self.ctx.socket(zmq.DEALER)
        identity = b"a" + os.urandom(15)
        self.sock.setsockopt(zmq.IDENTITY, identity)
        self.receiver = Receiver(self.sender.auth, to_peer(identity))
        self.sock.setsockopt(zmq.LINGER, 2000)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.closed = self.sock.get_monitor_socket(zmq.EVENT_DISCONNECTED | zmq.EVENT_CONNECT_RETRIED)
        self.sock.connect(endpoint)
        self.endpoint = endpoint

    def close(self, linger_ms: int = 0) -> None:
        """Close the connection (and its monitor); what is still queued gets ``linger_ms`` to leave."""
        self.sock.disable_monitor()
        self.closed.close(0)
        self.sock.close(linger_ms)

    def move(self, poller: zmq.Poller, endpoint: str, node: int, at_seat: bool, proven: bool) -> None:
        """Drop this connection from ``poller`` and connect to ``endpoint`` instead (the coordinator
        or a standby on ``node``; ``at_seat``: a standby that has not taken over; ``proven``: its
        predecessor's processes died), watched by ``poller``."""
        for sock in (self.closed, self.sock):
            poller.unregister(sock)
        self.close()
        self.connect(endpoint)
        self.node, self.at_seat, self.proven = node, at_seat, proven
        self.watch(poller)

    def watch(self, poller: zmq.Poller) -> None:
        """Have ``poller`` wake up on a frame and on the connection's closing."""
        poller.register(self.sock, zmq.POLLIN)
        poller.register(self.closed, zmq.POLLIN)

    def send(self, msg_type: MsgType, **fields: Any) -> None:
        self.sock.send(encode(msg_type, self.sender, CONTROL, **fields))

    def frames(self) -> Iterator[Message]:
        """The authentic, fresh messages waiting (a frame that does not verify is logged and dropped)."""
        return receive(self.sock, self.receiver, FRAMES_PER_READ, lambda err: log.warning("dropped a frame: %s", err))

    def gone(self) -> bool:
        """Read the connection's monitor: True when the coordinator (or standby) connected to is
        gone: its connection closed, or, for a standby that has not taken over, connecting to it was
        refused (nothing listens there any more: its process died before this agent reached it)."""
        from zmq.utils.monitor import parse_monitor_message

        event = parse_monitor_message(self.closed.recv_multipart())["event"]
        if event == zmq.EVENT_DISCONNECTED:
            return True
        return self.at_seat and endpoint_refuses(self.endpoint)
