"""Fault injection at named points, for tests and demos (TorchFT's ``fail_at(rank, step)`` idea).

``FTRUN_FAULT`` holds one or more faults separated by ``;``, each a comma-separated list of
``key=value``::

    FTRUN_FAULT='rank=2,step=50,point=allreduce,kind=kill'
    FTRUN_FAULT='rank=0,step=20,kind=kill; rank=3,step=40,point=optimizer,kind=exit,code=7'
    FTRUN_FAULT='rank=1,step=8,point=allreduce,nth=3,kind=kill'   # the step's third all-reduce

Keys:
    rank: the global rank that faults (required).
    step: the step at which it faults (default: any step; required for step points).
    point: where: ``before_forward``, ``allreduce`` (inside the gradient all-reduce),
        ``optimizer`` (inside the optimizer update, after the all-reduce), ``between_steps``
        (after a committed step), ``init`` (in ``wrap_model``, before the initial broadcast),
        ``recover`` (any rank entering a recovery, before it rebuilds the group), ``rejoin`` (a
        rank receiving state, after the new group is built and before it receives), ``transfer``
        (a donor, after part of the state was sent), ``finish`` (entering ``ft.finish()``, after the
        script's epilogue; ``step`` is then the committed step), ``section`` (entering an
        ``ft.section()``; ``step`` is then the committed step); with a sharded model
        (:mod:`ftrun.rank.sharding`), ``allgather`` (in forward, between FSDP's all-gathers) and
        ``reduce_scatter`` (in backward, between its reduce-scatters). Default ``before_forward``.
    kind: what happens. Deaths: ``kill`` (SIGKILL itself), ``exit`` (``os._exit(code)``),
        ``exception`` (raise :class:`InjectedFault`, uncaught), ``segv`` (SIGSEGV). Hangs:
        ``stop`` (SIGSTOP itself: frozen, no heartbeat), ``hang`` (an endless Python loop),
        ``deadlock`` (block forever on a Python lock). Soft faults: ``comm`` (cut the connections of this
        rank's process group, as a connection reset would; the collective then fails on every
        rank), ``recoverable`` (raise :class:`InjectedRecoverableError`, a
        :class:`~ftrun.errors.RecoverableError`). Default ``kill``.
    code: exit code for ``kind=exit`` (default 1).
    nth: the K-th time (1-based) this process reaches the point at that step; needs ``step``.
        Default: the first time the fault matches. Some points are reached several times a step:
        ``allreduce`` once per backward pass per wrapped model whose backward is synced (a
        backward through two wrapped models reaches it twice; without a wrapped model, once per
        optimizer update, where the gradients are averaged), ``optimizer`` once per optimizer
        update, ``section`` once per section opened after that committed step. The count is this
        process's, over its life: a retried step counts on from its first try (the fault has
        fired by then anyway: a fault fires at most once per process).
        :meth:`FaultInjector.counts` tells how many times each point was reached at a step.
    incarnation: which process serving the rank faults (default 0, so a respawned rank does not
        repeat its predecessor's fault). A fault fires at most once per process, so a process
        that survives it (``comm``, ``recoverable``) does not fault again when the step is retried.
    attempt: which whole-job attempt (default 0).
    when: a file path: the fault fires only once that file exists (a test triggers a fault at a
        point, at a moment it chooses, e.g. once a hot spare is ready).

Raises:
    ValueError: from :func:`parse_faults` on a malformed specification (the CLI checks the variable
    with it before any rank starts).
"""

from __future__ import annotations

import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from typing import Callable

from ftrun.errors import RecoverableError

POINTS = ("before_forward", "allreduce", "optimizer", "between_steps", "init", "recover", "rejoin", "transfer", "finish",
          "section", "allgather", "reduce_scatter")
KINDS = ("kill", "exit", "exception", "segv", "stop", "hang", "deadlock", "comm", "recoverable")


class InjectedFault(RuntimeError):
    """The exception raised by ``kind=exception``."""


class InjectedRecoverableError(RecoverableError):
    """The exception raised by ``kind=recoverable``."""


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
    when: str | None = None
    nth: int | None = None

    def matches(self, rank: int, incarnation: int, attempt: int, point: str, step: int | None, reached: int = 1) -> bool:
        """Whether this fault fires for this process at ``point`` of ``step``, reached there for the
        ``reached``-th time (1-based; compared with ``nth`` when the fault has one)."""
        return (
            self.rank == rank
            and self.point == point
            and self.incarnation == incarnation
            and self.attempt == attempt
            and (self.step is None or self.step == step)
            and (self.nth is None or self.nth == reached)
            and (self.when is None or os.path.exists(self.when))
        )

    def fire(self, cut_connections: Callable[[], None] | None = None) -> None:
        """Carry the fault out in this process.

        Returns only for ``comm`` (after calling ``cut_connections``) and for a ``stop`` that was
        continued; raises for ``exception`` and ``recoverable``; never returns otherwise.
        """
        print(f"ftrun: injecting fault {self}", flush=True)
        if self.kind == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        elif self.kind == "segv":
            os.kill(os.getpid(), signal.SIGSEGV)
        elif self.kind == "exit":
            os._exit(self.code)
        elif self.kind == "stop":
            os.kill(os.getpid(), signal.SIGSTOP)
            return
        elif self.kind == "hang":
            deadline = float("inf")
            while time.monotonic() < deadline:  # an endless loop that still lets other threads run
                pass
        elif self.kind == "deadlock":
            lock = threading.Lock()
            lock.acquire()
            lock.acquire()  # never returns
        elif self.kind == "comm":
            if cut_connections is not None:
                cut_connections()
            return
        elif self.kind == "recoverable":
            raise InjectedRecoverableError(f"injected recoverable error at {self.point}, step {self.step}")
        raise InjectedFault(f"injected fault at {self.point}, step {self.step}")


_KEYS = ("rank", "step", "point", "kind", "code", "incarnation", "attempt", "when", "nth")
# Integer keys and their smallest value; an exit code is a byte (os._exit(256) would exit with 0).
_INT_KEYS: dict[str, tuple[int, int | None]] = {
    "rank": (0, None),
    "step": (-1, None),
    "code": (0, 255),
    "incarnation": (0, None),
    "attempt": (0, None),
    "nth": (1, None),
}


def _int_value(chunk: str, key: str, text: str) -> int:
    low, high = _INT_KEYS[key]
    if not re.fullmatch(r"[+-]?[0-9]+", text):
        raise ValueError(f"FTRUN_FAULT {chunk!r}: {key}={text!r} is not an integer")
    value = int(text)
    if value < low or (high is not None and value > high):
        bound = f"{low}..{high}" if high is not None else f"at least {low}"
        raise ValueError(f"FTRUN_FAULT {chunk!r}: {key}={value} is out of range ({bound})")
    return value


def parse_faults(text: str) -> list[Fault]:
    """Parse an ``FTRUN_FAULT`` value.

    Raises:
        ValueError: an item that is not ``key=value``, an unknown or repeated key, an unknown point
            or kind, a value that is not an integer (rank, step, code, incarnation, attempt, nth) or
            is out of range (negative; an exit code outside 0..255; ``nth`` below 1), ``code`` with
            a kind other than ``exit``, ``nth`` without ``step``, or no rank. The message is one
            line naming the fault and the item.
    """
    faults: list[Fault] = []
    for chunk in filter(None, (c.strip() for c in text.split(";"))):
        values: dict[str, str] = {}
        for item in filter(None, (i.strip() for i in chunk.split(","))):
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep:
                raise ValueError(f"FTRUN_FAULT item {item!r} is not key=value")
            if key not in _KEYS:
                raise ValueError(f"FTRUN_FAULT {chunk!r}: unknown key {key!r}; known keys: {', '.join(_KEYS)}")
            if key in values:
                raise ValueError(f"FTRUN_FAULT {chunk!r}: {key} is given twice")
            values[key] = value
        if "rank" not in values:
            raise ValueError(f"FTRUN_FAULT {chunk!r} names no rank")
        point = values.get("point", "before_forward")
        kind = values.get("kind", "kill")
        if point not in POINTS:
            raise ValueError(f"FTRUN_FAULT: unknown point {point!r}; known: {', '.join(POINTS)}")
        if kind not in KINDS:
            raise ValueError(f"FTRUN_FAULT: unknown kind {kind!r}; known: {', '.join(KINDS)}")
        if "code" in values and kind != "exit":
            raise ValueError(f"FTRUN_FAULT {chunk!r}: code= applies to kind=exit only")
        if "nth" in values and "step" not in values:
            raise ValueError(f"FTRUN_FAULT {chunk!r}: nth= needs step= (it counts the times the point is reached at that step)")
        numbers = {key: _int_value(chunk, key, values[key]) for key in _INT_KEYS if key in values}
        faults.append(
            Fault(
                rank=numbers["rank"],
                step=numbers.get("step"),
                point=point,
                kind=kind,
                code=numbers.get("code", 1),
                incarnation=numbers.get("incarnation", 0),
                attempt=numbers.get("attempt", 0),
                when=values.get("when") or None,
                nth=numbers.get("nth"),
            )
        )
    return faults


class FaultInjector:
    """Fires the faults of ``FTRUN_FAULT`` that match this process at the named points, and counts
    how many times each point is reached at each step (``nth``, :meth:`counts`).

    Args:
        faults: from :func:`parse_faults`.
        rank, incarnation, attempt: this process's (what a fault's keys are matched against).
    """

    #: How many steps' counts are kept (the newest): memory does not grow with the run's length.
    KEEP_STEPS = 8

    def __init__(self, faults: list[Fault], rank: int, incarnation: int, attempt: int) -> None:
        self.faults = faults
        self.rank = rank
        self.incarnation = incarnation
        self.attempt = attempt
        self.cut_connections: Callable[[], None] | None = None  # what ``kind=comm`` calls
        self.fired: set[Fault] = set()
        self._reached: dict[int, dict[str, int]] = {}  # step -> point -> times reached

    @classmethod
    def from_env(cls, rank: int, incarnation: int, attempt: int) -> "FaultInjector":
        return cls(parse_faults(os.environ.get("FTRUN_FAULT", "")), rank, incarnation, attempt)

    def point(self, name: str, step: int | None) -> None:
        """Called by the worker library at each named point (``step``: the step it belongs to,
        None where none does); counts the visit and fires a matching fault."""
        reached = self._count(name, step)
        for fault in self.faults:
            if fault not in self.fired and fault.matches(self.rank, self.incarnation, self.attempt, name, step, reached):
                self.fired.add(fault)  # once per process: a retried step must not fault again
                fault.fire(self.cut_connections)

    def counts(self, step: int) -> dict[str, int]:
        """``{point: times reached}`` at ``step`` by this process so far (a retried step's tries
        added up); empty for a step no point was reached at, or one older than the newest
        :attr:`KEEP_STEPS` steps seen."""
        return dict(self._reached.get(step, {}))

    def _count(self, name: str, step: int | None) -> int:
        """Count a visit of ``name`` at ``step``; returns how many times it was reached there (1-based)."""
        if step is None:
            return 1
        points = self._reached.get(step)
        if points is None:
            points = self._reached[step] = {}
            while len(self._reached) > self.KEEP_STEPS:
                del self._reached[min(self._reached)]
        points[name] = points.get(name, 0) + 1
        return points[name]
