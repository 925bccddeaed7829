"""A node agent's relay: its ranks beat the agent, and the agent's one beat a heartbeat interval
carries all of them to the coordinator; a recovery round's orders and answers go the same way.

Without it every rank sends node 0's coordinator a frame each ``--heartbeat_interval``: at 16,384
ranks, 16,384 authenticated frames a second into one Python process, each costing it 100 to 200 µs
(docs/scale.md). With it the coordinator gets one frame per node: the agent's ``agent_beat``, whose
``ranks`` rows hold each rank's newest heartbeat (its step board and the watchdog's evidence) and
how long ago the agent received it. A rank's death is still reported at once (``exited``, from
``SIGCHLD``), and its ``hello``, ``progress``, failure reports and the rest go straight to the
coordinator.

**Rounds.** A recovery round sends every live rank an ``abort`` and then a ``reconfigure``, and
each answers (``fault``, ``recovered``): four frames a rank through node 0, 65,536 at 16,384 ranks,
seconds of the coordinator's time. To a rank whose relayed beats it has read, the coordinator sends
its node's agent one ``rank_orders`` frame for all of them (the fields they share, and each rank's
own: its transfers); the agent seals one frame for each rank, for that rank's relay connection
alone, and the rank answers through the relay too. The agent sends the answers it read, as they
come, in one ``rank_reports`` frame a turn of its loop, before any exit it reports (a rank that
answered and died is seen in that order), and drops the rank's beat read before the answer (it
would be older). The coordinator checks each answer as it checks a frame (its type, its fields) and
takes it only for a live rank of the agent's node, in its current incarnation. The coordinator's
beat to the ranks (``standby``: where its standby is, once a heartbeat interval) is relayed the same
way; the rank's I/O thread keeps it, as it keeps one that comes straight.

What the relay keeps (docs/scale.md, "What the relay keeps, and what it does not do"):

- **Ages measured where the beat arrives.** A row's age is the time since the agent received the
  beat; the coordinator dates the beat ``age`` seconds before it read the agent's frame. Ranks beat
  the relay twice a heartbeat interval, so a live rank's beat is at most about 1.5 intervals old
  when the coordinator reads it (the watchdog's quiet rule is 2.5 intervals; with the relay on,
  ``--heartbeat_timeout`` must be above two intervals).
- **Step times.** A rank lists each step time in one beat; the newer beat that replaces an older
  one before the agent's beat takes the older's step times (:func:`carry_samples`).
- **Order.** A relayed beat travels another way than the rank's direct messages and can arrive
  after a ``fault`` it preceded. Each beat carries ``sent``, the frames the rank had sent the
  coordinator before it; the coordinator takes a beat's step board only if it has not read more of
  that rank's frames than that (liveness is taken from it either way).
- **Fencing.** The rows come inside the agent's frame: a fenced or replaced agent's frames are
  refused, its rows with them; a row is taken only for a live rank of the agent's own node, in the
  incarnation the coordinator knows, that said hello.

The relay listens on a Unix socket of the abstract namespace (``ipc://@...``: no file to leave behind
when the agent is killed, and seen only inside the node's network namespace). Any local process
may connect to it, so every frame must be authenticated with the job's secret for the audience
:data:`~ftrun.common.protocol.RELAY` (so it verifies nowhere else) and be fresh; anything else is
dropped and counted, and a drain reads a bounded number of frames. Nothing is unpickled.
"""

from __future__ import annotations

import logging
import secrets
from typing import Any

import zmq

from ftrun.common.protocol import (MAX_FRAME_BYTES, RELAY, RELAYED_ANSWERS, RELAYED_ORDERS, FrameAuth, Message, MsgType,
                                   ProtocolError, Receiver, Sender, decode, encode, to_peer)
from ftrun.config import relay_fits
from ftrun.rank.client import SAMPLES_LISTED

log = logging.getLogger("ftrun.node.agent")  # the agent's log: the relay is part of the agent process

#: ``--heartbeat_relay auto`` relays the beats of a job of this many ranks or more.
RELAY_AUTO_RANKS = 256
#: A rank beats its relay this many times a heartbeat interval (the relay's hop adds up to one).
RELAY_BEATS_PER_INTERVAL = 2
#: Frames a drain reads at most (then the agent's loop goes on).
DRAIN_BUDGET = 1000
#: The fields a row carries in its own places, not in its board.
_ROW_FIELDS = frozenset({"rank", "incarnation", "sent"})
#: Rows a ``rank_orders`` or ``rank_reports`` frame carries at most (its size stays far below
#: :data:`~ftrun.common.protocol.MAX_FRAME_BYTES`).
ROWS_PER_FRAME = 256


def relays_beats(setting: str, ranks: int, heartbeat_interval: float, heartbeat_timeout: float) -> bool:
    """Whether a job's ranks on nodes other than node 0 beat through their agent.

    Args:
        setting: ``--heartbeat_relay``: ``on``, ``off`` or ``auto`` (on from :data:`RELAY_AUTO_RANKS`
            ranks, when ``--heartbeat_timeout`` leaves room for the relay's hop).
        ranks: the job's world size.
        heartbeat_interval, heartbeat_timeout: seconds.
    """
    if setting == "on":
        return True
    return setting == "auto" and ranks >= RELAY_AUTO_RANKS and relay_fits(heartbeat_timeout, heartbeat_interval)


def carry_samples(older: dict[str, Any], newer: dict[str, Any]) -> dict[str, Any]:
    """``newer``, a rank's heartbeat, with the step-time samples of ``older``, the same rank's
    beat that it replaces before the agent's beat carried it.

    A rank lists each step time once, in its next beat (:meth:`ftrun.rank.client.StepBoard.fields`:
    ``samples``, the number of the newest; ``step_times``, the newest listed, at most
    :data:`~ftrun.rank.client.SAMPLES_LISTED`; ``step_max`` and ``step_max_from``, the largest and
    the first number of those not listed). Keeping only the newer of a rank's two beats an interval
    lost the older one's samples, which the coordinator's automatic step timeout learns from. Here
    they are merged in number order: the newest listed, the rest as ``step_max`` from the oldest
    number. A beat whose samples are malformed keeps its own, unchanged."""
    old_n, old_times = older.get("samples"), older.get("step_times")
    if type(old_n) is not int or type(old_times) is not list:
        return newer
    new_n, new_times = newer.get("samples"), newer.get("step_times")
    if new_n is None:
        return {**newer, **{k: older[k] for k in ("samples", "step_times", "step_max", "step_max_from") if k in older}}
    if type(new_n) is not int or type(new_times) is not list:
        return newer
    # The newer's first number must follow the older's last: else they are not consecutive beats.
    if newer.get("step_max_from", new_n - len(new_times) + 1) != old_n + 1:
        return newer
    unlisted = [older.get("step_max"), newer.get("step_max")]  # the older's, then the newer's below its list
    if "step_max" in newer:  # the newer's unlisted numbers lie between the two lists
        listed = new_times
        unlisted.extend(old_times)
    else:
        listed = old_times + new_times
        listed, dropped = listed[-SAMPLES_LISTED:], listed[:-SAMPLES_LISTED]
        unlisted.extend(dropped)
    first = older.get("step_max_from", old_n - len(old_times) + 1)
    out = {**newer, "samples": new_n, "step_times": listed}
    maxima = [t for t in unlisted if isinstance(t, (int, float)) and not isinstance(t, bool)]
    if maxima:
        out.update(step_max=max(maxima), step_max_from=first)
    return out


class RelayedBeats:
    """The newest heartbeat of each rank since the last :meth:`rows` (what an agent's beat carries),
    and the ranks' answers since the last :meth:`reports` (what its ``rank_reports`` carries)."""

    def __init__(self) -> None:
        self._latest: dict[int, tuple[float, dict[str, Any]]] = {}
        self._answers: list[list[Any]] = []

    def note(self, fields: dict[str, Any], now: float) -> None:
        """One rank's heartbeat (its decoded fields), received at ``now``: the newest is kept, with
        the step-time samples of the one it replaces (:func:`carry_samples`) if that one was the
        same incarnation's (a respawned rank numbers its step times from 1 again)."""
        kept = self._latest.get(fields["rank"])
        if kept is not None and "samples" in kept[1] and kept[1].get("incarnation") == fields.get("incarnation"):
            fields = carry_samples(kept[1], fields)
        self._latest[fields["rank"]] = (now, fields)

    def note_answer(self, msg_type: MsgType, fields: dict[str, Any]) -> None:
        """One rank's answer to a relayed order: kept in order; the rank's beat read before it is
        dropped (the coordinator would take its older step board after the answer)."""
        self._latest.pop(fields["rank"], None)
        self._answers.append([msg_type.value, fields])

    def reports(self) -> list[list[list[Any]]]:
        """The answers since the last call, in order, as the rows of ``rank_reports`` frames
        (:data:`ROWS_PER_FRAME` a frame at most)."""
        answers, self._answers = self._answers, []
        return [answers[i:i + ROWS_PER_FRAME] for i in range(0, len(answers), ROWS_PER_FRAME)]

    def rows(self, now: float) -> list[list[Any]]:
        """The rows of the agent's next beat, one per rank heard since the last call:
        ``[rank, incarnation, age, sent, board]``, age in seconds at ``now``."""
        rows = [[f["rank"], f["incarnation"], round(max(0.0, now - at), 3), f.get("sent"),
                 {k: v for k, v in f.items() if k not in _ROW_FIELDS}] for at, f in self._latest.values()]
        self._latest.clear()
        return rows


class BeatRelay(RelayedBeats):
    """The relay's socket, which the node's ranks beat and answer relayed orders on, their newest
    beats and their answers.

    Args:
        ctx: the agent's ZeroMQ context.
        auth: the job's frame authentication (its secret).

    Attributes:
        address: the ``ipc://`` endpoint the node's ranks beat (``FTRUN_RELAY_ADDR``).
        rejected: frames dropped (not authentic, not fresh, not a heartbeat or an answer).
        unrelayed: orders that could not be relayed (a rank not heard here in that incarnation).
    """

    def __init__(self, ctx: zmq.Context, auth: FrameAuth) -> None:
        super().__init__()
        self.address = f"ipc://@ftrun-relay-{secrets.token_hex(8)}"
        self.sock = ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self.sock.bind(self.address)
        self._receiver = Receiver(auth, RELAY)
        self._sender = Sender(auth)  # the orders to the ranks
        self._identities: dict[int, tuple[int, bytes]] = {}  # rank -> (incarnation, its relay connection)
        self.rejected = 0
        self.unrelayed = 0

    def drain(self, now: float, budget: int = DRAIN_BUDGET) -> None:
        """Read the beats waiting (up to ``budget``), received at ``now`` (seconds, monotonic)."""
        for _ in range(budget):
            try:
                parts = self.sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                msg = decode(parts[-1], self._receiver) if len(parts) == 2 else None
            except ProtocolError:
                msg = None
            if msg is None or (msg.type != MsgType.HEARTBEAT and msg.type not in RELAYED_ANSWERS):
                self.rejected += 1
                continue
            self._identities[msg["rank"]] = (msg["incarnation"], parts[0])
            if msg.type == MsgType.HEARTBEAT:
                self.note(msg.fields, now)
            else:
                self.note_answer(msg.type, msg.fields)

    def forward(self, msg: Message) -> int:
        """Send each rank named in a ``rank_orders`` message the order it carries, sealed for that
        rank's relay connection alone; returns how many were sent. A row for a rank or an
        incarnation this relay has not heard from is dropped and counted (the coordinator relays
        only to ranks whose relayed beats it read: the rank died meanwhile, and its exit is
        reported)."""
        try:
            order = MsgType(msg["order"])
        except ValueError:
            order = None
        if order not in RELAYED_ORDERS:
            self.rejected += 1
            return 0
        sent = 0
        for row in msg["ranks"]:
            known = self._identities.get(row[0]) if isinstance(row, list) and len(row) == 3 else None
            if known is None or known[0] != row[1] or not isinstance(row[2], dict):
                self.unrelayed += 1
                continue
            identity = known[1]
            try:
                frame = encode(order, self._sender, to_peer(identity), **{**msg["common"], **row[2]})
                self.sock.send_multipart([identity, frame], zmq.NOBLOCK)
                sent += 1
            except (ProtocolError, zmq.ZMQError):
                self.unrelayed += 1
        if order != MsgType.STANDBY:  # the coordinator's beat comes every heartbeat interval: not logged
            log.info("relayed %s (generation %s) to %d rank(s) of this node%s", order.value, msg["common"].get("generation"),
                     sent, f"; {self.unrelayed} order(s) not relayed so far" if self.unrelayed else "")
        return sent

    def close(self) -> None:
        self.sock.close(0)
