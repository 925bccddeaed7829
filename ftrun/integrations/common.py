"""What ftrun's framework integrations share, without importing any framework.

- :func:`is_fault`: whether an exception a framework's collective raised is a fault ftrun recovers
  (every integration: Hugging Face ``Trainer``, Lightning, Accelerate, Fabric).
- :class:`RecoverableWork`: for the integrations of loops written by hand (Accelerate, Fabric),
  the step source their ``train_batches`` draws from and the work after a step that makes
  collectives (an evaluation) run through ``recoverable(fn)``: a fault inside it is recovered, the
  state rolled back to the work's start, and the work run again with the new rank, which runs it
  first (a :class:`WorkMarker` in the replica state says so).

This module imports only ftrun and torch, so each integration's framework stays its own extra.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Iterator

from ftrun.errors import describe
from ftrun.rank.group import GroupDown
from ftrun.rank.worker import Worker

#: How long a rank whose collective raised waits for the coordinator's abort before it takes the
#: error for a bug of its own (seconds).
ABORT_WAIT_S = 5.0
#: What an integration that refuses FSDP names instead, in its refusal's one line.
FSDP_INSTEAD = ("for an FSDP2/HSDP model use Lightning Fabric's ModelParallelStrategy with "
                "ftrun.integrations.fabric.FTFabric, or ftrun's own port (ftrun.init(mesh_shape=...), docs/sharded.md)")
#: What a loop's pass holds as its next step when the pass ended during a recovery.
END = object()


def is_fault(ft: Worker, err: BaseException) -> bool:
    """Whether ``err``, raised by a collective the framework or the loop made, comes from a fault
    ftrun recovers: the group is down, or the coordinator's abort arrives within
    :data:`ABORT_WAIT_S` seconds (a peer died; gloo and NCCL raise ``RuntimeError`` subclasses)."""
    if isinstance(err, GroupDown):
        return True
    if not isinstance(err, RuntimeError):
        return False
    deadline = time.monotonic() + ABORT_WAIT_S
    while time.monotonic() < deadline:
        if ft.control.poll_abort(timeout=0.05):
            return True
    return False


def until_done(ft: Worker, run: Callable[[], Any], what: str, recover: Callable[[], None]) -> Any:
    """``run()``'s result once it ends without a fault of the job's collectives (:func:`is_fault`):
    after each fault, the failure (``what``, then the error) is recorded and ``recover()``
    recovers before ``run()`` is tried again. Any other exception propagates.

    The failure is recorded outside the ``except`` block: the exception's traceback holds the
    broken group, which would keep a survivor waiting for the full gloo timeout."""
    while True:
        failure = None
        try:
            return run()
        except Exception as err:
            if not is_fault(ft, err):
                raise
            failure = f"{what}: {describe(err)}"
        ft.record_failure(failure)
        recover()


def keep_grads(params: list[Any]) -> list[Any]:
    """A copy of each parameter's gradient (None where it has none), for :func:`put_grads`."""
    return [None if p.grad is None else p.grad.detach().clone() for p in params]


def put_grads(params: list[Any], grads: list[Any]) -> None:
    """Give each parameter the gradient :func:`keep_grads` copied (in place where it has one)."""
    for p, g in zip(params, grads):
        if g is None:
            p.grad = None
        elif p.grad is None:
            p.grad = g.clone()
        else:
            p.grad.copy_(g)


def plain(value: Any) -> bool:
    """Whether ``value`` may be an argument of recoverable work (kept in the replica state)."""
    return value is None or isinstance(value, (bool, int, float, str))


class WorkMarker:
    """A loop integration's replica state: the recoverable work under way, if any
    (``{"work": its index, "args": [...], "step": the committed step it followed}``)."""

    def __init__(self) -> None:
        self.pending: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"pending": dict(self.pending) if self.pending is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.pending = dict(state["pending"]) if state["pending"] is not None else None


class RecoverableWork:
    """Mixin of :class:`ftrun.integrations.accelerate.FTAccelerator` and
    :class:`ftrun.integrations.fabric.FTFabric`: the pass's steps and recoverable work.

    The class sets :attr:`_ft_label` (``"accelerate"``: error messages say
    ``ftrun.integrations.<label>``), :attr:`_ft_loop` (``"Accelerate loop"``) and
    :attr:`_ft_pass_name` (the pass position's name in the registered rank state); the instance
    sets ``_ft`` (the worker, None outside ftrun), ``_ft_pass`` (the generator of (step,
    micro-batches) from ftrun's step loop, None outside a pass), ``_ft_ahead`` (a step a recovery
    already began, or :data:`END`), ``_ft_marker`` (a :class:`WorkMarker`, registered as replica
    state) and ``_ft_work`` (the recoverable functions, in the order made).
    """

    _ft_label = ""
    _ft_loop = ""
    _ft_pass_name = ""
    _ft: Worker | None
    _ft_pass: Iterator[Any] | None
    _ft_ahead: Any
    _ft_marker: WorkMarker
    _ft_work: list[Callable[..., Any]]

    def _next_step(self) -> tuple[Any, list[Any]] | None:
        """The next step and its micro-batches from ftrun's step loop (which recovers first when a
        fault was recorded), or None when the pass is over."""
        ahead, self._ft_ahead = self._ft_ahead, None
        if ahead is not None:
            return None if ahead is END else ahead
        assert self._ft_pass is not None
        try:
            return next(self._ft_pass)
        except StopIteration:
            return None

    def recoverable(self, fn: Callable[..., Any], name: str = "eval") -> Callable[..., Any]:
        """Make ``fn`` (work after a step that makes collectives: an evaluation) recoverable: a fault
        inside is recovered and ``fn`` runs again with the new rank, in an ``ft.section(name)``
        (bounded by no step timeout). Call it before the training loop, on every rank in the same
        order. Under torchrun or as one process, returns ``fn``.

        Args:
            fn: called with plain arguments only (None, bool, int, float, str): a respawned rank
                calls it with the arguments its replicas used, kept in the replica state.
            name: the section's name.

        Returns:
            A function with ``fn``'s arguments and result; it raises ValueError for an argument
            that is not plain.
        """
        if self._ft is None:
            return fn
        key = len(self._ft_work)

        @functools.wraps(fn)
        def run(*args: Any) -> Any:
            return self._run_work(key, fn, name, args)

        self._ft_work.append(run)
        return run

    def _work_begins(self) -> Any:
        """Called as recoverable work begins; what it returns goes to :meth:`_work_failed`."""
        return None

    def _work_failed(self, begun: Any) -> None:
        """Called after a fault in recoverable work, before the recovery (undo what the framework
        kept of the work cut short)."""

    def _run_work(self, key: int, fn: Callable[..., Any], name: str, args: tuple[Any, ...]) -> Any:
        ft = self._ft
        assert ft is not None
        if not all(plain(a) for a in args):
            raise ValueError(f"ftrun.integrations.{self._ft_label}: {name}: recoverable work takes plain arguments "
                             "(None, bool, int, float, str)")
        if self._ft_pass is None:
            return fn(*args)  # outside the training pass (a final evaluation): a fault restarts the job
        self._ft_marker.pending = {"work": key, "args": list(args), "step": ft.committed}
        self._snapshot()  # what a fault in the work rolls back to, and this rank's record in the store
        begun = self._work_begins()
        with ft.section(name):
            while True:
                failure = None
                try:
                    result = fn(*args)
                    break
                except Exception as err:
                    if not is_fault(ft, err):
                        raise
                    failure = f"a collective of the {self._ft_loop} failed in {name}: {describe(err)}"
                self._work_failed(begun)
                ft.record_failure(failure)  # outside the except block: its traceback holds the group
                self._recover_in_work()
        self._ft_marker.pending = None
        # Its end: a rank that dies after it is replaced by one that starts here (the work's
        # draws made): its record, sent before the loop goes on.
        self._snapshot()
        return result

    def _recover_in_work(self) -> None:
        """Recover from a fault in recoverable work: ftrun's step loop recovers (the state rolled
        back to the work's start), then begins the next step, which is kept for the loop."""
        ft = self._ft
        assert ft is not None and self._ft_pass is not None
        pending = self._ft_marker.pending
        if self._ft_ahead is END:
            raise RuntimeError(f"ftrun.integrations.{self._ft_label}: a second fault in work after a pass's last "
                               "step is not recovered in place")
        self._ft_ahead = None
        try:
            self._ft_ahead = next(self._ft_pass)
        except StopIteration:
            self._ft_ahead = END
        if pending is None or ft.committed != int(pending["step"]):
            raise RuntimeError(f"ftrun.integrations.{self._ft_label}: recovered at step {ft.committed}, not at the "
                               "step the work followed")

    def _snapshot(self) -> None:
        """ftrun's step-start snapshot (and record) of this rank's state now. When the next step
        was already begun (its micro-batches fetched by a recovery), the pass's position is taken
        as it was before that fetch, so a retry of that step gets them again."""
        ft = self._ft
        assert ft is not None
        cursor = ft.registry[self._ft_pass_name] if self._ft_ahead not in (None, END) else None
        if cursor is not None:
            cursor.position -= 1
        try:
            ft.checks.snapshot_step_start()
        finally:
            if cursor is not None:
                cursor.position += 1
