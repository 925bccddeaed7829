"""Fault injection at named points, for tests and demos (TorchFT's ``fail_at(rank, step)`` idea).

``FTRUN_FAULT`` holds one or more faults separated by ``;``, each a comma-separated list of
``key=value``::

    FTRUN_FAULT='rank=2,step=50,point=allreduce,kind=kill'
    FTRUN_FAULT='rank=0,step=20,kind=kill; rank=3,step=40,point=optimizer,kind=exit,code=7'

Keys:
    rank: the global rank that faults (required).
    step: the step at which it faults (default: any step; required for step points).
    point: where: ``before_forward``, ``allreduce`` (inside the gradient all-reduce),
        ``optimizer`` (inside the optimizer update, after the all-reduce), ``between_steps``
        (after a committed step), ``init`` (in ``wrap_model``, before the initial broadcast),
        ``recover`` (any rank entering a recovery, before it rebuilds the group), ``rejoin`` (a
        rank receiving state, after the new group is built and before it receives), ``transfer``
        (a donor, after part of the state was sent). Default ``before_forward``.
    kind: ``kill`` (SIGKILL itself), ``exit`` (``os._exit(code)``), ``exception`` (raise
        :class:`InjectedFault`, uncaught), ``segv`` (SIGSEGV). Default ``kill``.
    code: exit code for ``kind=exit`` (default 1).
    incarnation: which process serving the rank faults (default 0, so a respawned rank does not
        repeat its predecessor's fault).
    attempt: which whole-job attempt (default 0).

Raises:
    ValueError: from :func:`parse_faults` on a malformed specification.
"""

from __future__ import annotations

import os
import signal
from dataclasses import dataclass

POINTS = ("before_forward", "allreduce", "optimizer", "between_steps", "init", "recover", "rejoin", "transfer")
KINDS = ("kill", "exit", "exception", "segv")


class InjectedFault(RuntimeError):
    """The exception raised by ``kind=exception``."""


@dataclass(frozen=True)
class Fault:
    """One injected fault (see the module docstring)."""

    rank: int
    step: int | None = None
    point: str = "before_forward"
    kind: str = "kill"
    code: int = 1
    incarnation: int = 0
    attempt: int = 0

    def matches(self, rank: int, incarnation: int, attempt: int, point: str, step: int | None) -> bool:
        return (
            self.rank == rank
            and self.point == point
            and self.incarnation == incarnation
            and self.attempt == attempt
            and (self.step is None or self.step == step)
        )

    def fire(self) -> None:
        """Carry the fault out in this process (does not return, except for nothing)."""
        print(f"ftrun: injecting fault {self}", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif self.kind == "exit":
            os._exit(self.code)
        raise InjectedFault(f"injected fault at {self.point}, step {self.step}")


def parse_faults(text: str) -> list[Fault]:
    """Parse an ``FTRUN_FAULT`` value.

    Raises:
        ValueError: unknown key, point or kind, a non-integer number, or no rank.
    """
    faults: list[Fault] = []
    for chunk in filter(None, (c.strip() for c in text.split(";"))):
        values: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in chunk.split(","))):
            key, sep, value = item.partition("=")
            if not sep:
                raise ValueError(f"FTRUN_FAULT item {item!r} is not key=value")
            values[key.strip()] = value.strip()
        unknown = set(values) - {"rank", "step", "point", "kind", "code", "incarnation", "attempt"}
        if unknown:
            raise ValueError(f"FTRUN_FAULT: unknown key(s) {sorted(unknown)}")
        if "rank" not in values:
            raise ValueError(f"FTRUN_FAULT {chunk!r} names no rank")
        point = values.get("point", "before_forward")
        kind = values.get("kind", "kill")
        if point not in POINTS:
            raise ValueError(f"FTRUN_FAULT: unknown point {point!r}; known: {', '.join(POINTS)}")
        if kind not in KINDS:
            raise ValueError(f"FTRUN_FAULT: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        try:
            faults.append(
                Fault(
                    rank=int(values["rank"]),
                    step=int(values["step"]) if "step" in values else None,
                    point=point,
                    kind=kind,
                    code=int(values.get("code", 1)),
                    incarnation=int(values.get("incarnation", 0)),
                    attempt=int(values.get("attempt", 0)),
                )
            )
        except ValueError:
            raise ValueError(f"FTRUN_FAULT {chunk!r}: rank, step, code, incarnation and attempt are integers") from None
    return faults


class FaultInjector:
    """Fires the faults of ``FTRUN_FAULT`` that match this process at the named points."""

    def __init__(self, faults: list[Fault], rank: int, incarnation: int, attempt: int) -> None:
        self.faults = faults
        self.rank = rank
        self.incarnation = incarnation
        self.attempt = attempt

    @classmethod
    def from_env(cls, rank: int, incarnation: int, attempt: int) -> "FaultInjector":
        return cls(parse_faults(os.environ.get("FTRUN_FAULT", "")), rank, incarnation, attempt)

    def point(self, name: str, step: int | None) -> None:
        """Called by the worker library at each named point; fires a matching fault."""
        for fault in self.faults:
            if fault.matches(self.rank, self.incarnation, self.attempt, name, step):
                fault.fire()
