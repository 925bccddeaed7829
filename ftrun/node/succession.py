"""A node agent's part in the job coordinator's succession (:mod:`ftrun.coordinator.failover`).

The coordinator names the standby coordinators in line (its ``standby`` message). When the
coordinator an agent is connected to is gone, the agent moves along that line: to the next standby
that is alive, or, when its own node's seat is next and every one before it died, it takes the job
over there. :class:`Succession` holds the line, the nodes found dead on the way and this node's own
standby seat (:class:`ftrun.coordinator.seat.StandbySeat`), and decides where to go next as a typed
result (:class:`MoveTo`, :class:`TakeOver`, :class:`NobodyLeft`); the agent carries it out.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any

from ftrun.common.messages import held_state
from ftrun.common.protocol import endpoint_refuses

log = logging.getLogger("ftrun.node.agent")  # the agent's log: its seat is part of the agent process


@dataclass(frozen=True)
class MoveTo:
    """Say hello to the standby coordinator at ``control`` (ZeroMQ endpoint) on node ``node``."""

    control: str
    node: int


@dataclass(frozen=True)
class TakeOver:
    """This node's own seat is next: run the job's coordinator here. ``cause``: why, in words;
    ``lost``: the nodes whose coordinator or standby died."""

    cause: str
    lost: list[int]


@dataclass(frozen=True)
class NobodyLeft:
    """Every standby in line died, or nothing proves the coordinator dead (only silence) and this
    node's seat is next: this node's part of the job ends."""


class Succession:
    """The line of standby coordinators as this node's agent knows it, and this node's seat.

    Args:
        seat: this node's standby seat (:class:`ftrun.coordinator.seat.StandbySeat`), or None.

    Attributes:
        line: the standby coordinators in line, first first: (control endpoint, node), as the last
            coordinator that spoke announced them; one is taken off as the agent moves there.
        dead: nodes whose coordinator or standby died since the last one that spoke.
    """

    def __init__(self, seat: Any = None) -> None:
        self.seat = seat
        self.line: list[tuple[str, int]] = []
        self.dead: list[int] = []
        self._setting_up: list[Any] | None = None  # a seat being set up on a thread, once asked

    def seat_fields(self) -> dict[str, str]:
        """What an agent's hello or beat says of this node's seat: its endpoint and store ({}: none)."""
        if self.seat is None:
            return {}
        return {"standby_control": self.seat.control.address, "standby_store": self.seat.store_addr}

    def hold_state(self, state: Any) -> None:
        """Keep the job's state the coordinator replicated here (when this node has a seat): a
        whole one, or a head that updates it (:func:`ftrun.common.messages.held_state`)."""
        if self.seat is not None and isinstance(state, dict):
            self.seat.state = held_state(self.seat.state, state)

    def ask_for_seat(self, spec: Any, token: str) -> None:
        """Set up a seat for this node (the coordinator lost its standby) on a thread, once: hosting
        a store can take seconds (a reverse name lookup of its first client), so that the agent's
        loop keeps beating; :meth:`seat_set_up` says when it is done. Nothing without the job's
        ``spec`` (:class:`ftrun.config.JobSpec`)."""
        if spec is None or self._setting_up is not None:
            return
        self._setting_up = []
        made = self._setting_up
        threading.Thread(target=lambda: made.append(standby_seat(spec, token, asked=True)),
                         name="ftrun-standby-seat", daemon=True).start()

    def seat_set_up(self) -> bool:
        """Whether the seat asked for is done being set up (it is this node's seat now: None when it
        could not be; asked again, it is tried again)."""
        if not self._setting_up:
            return False
        if self.seat is None:
            self.seat = self._setting_up[0]
        self._setting_up = None
        return True

    def first_in_line(self) -> bool:
        """This node stands by, holds the job's state, and is the first standby in line."""
        if self.seat is None or self.seat.state is None:
            return False
        return not self.line or self.line[0][0] == self.seat.control.address

    def next_coordinator(self, proven: bool) -> MoveTo | TakeOver | NobodyLeft:
        """The coordinator connected to is gone (``proven``: its processes died, not only silent):
        the next standby in line that is alive, or this node's own seat when it is next and every
        one before it died. Standbys taken off the line whose endpoints refuse are added to
        :attr:`dead`."""
        while self.line:
            control, node = self.line.pop(0)
            if self.seat is not None and control == self.seat.control.address:
                if proven and self.seat.state is not None:
                    return TakeOver(takeover_cause(self.dead), self.dead)
                break  # only silence: nothing proves the coordinator dead, so no takeover here
            if endpoint_refuses(control):
                self.dead.append(node)  # its process died before this agent reached it
                continue
            return MoveTo(control, node)
        return NobodyLeft()


def takeover_cause(dead: list[int]) -> str:
    """Why a standby takes the job over after closed connections, in words."""
    if len(set(dead)) <= 1:
        return "its connection to this standby closed (its processes or its host died)"
    return (f"the coordinator's and the standby coordinators' processes on nodes {sorted(set(dead))} died (their "
            "connections closed or were refused)")


def standby_seat(spec: Any, token: str, asked: bool = False) -> Any:
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
