"""The epoch loop over a ``DataLoader`` (``ft.epochs`` / ``ft.batches``, split out of
:class:`ftrun.rank.worker.Worker`): where each epoch and pass start, what a respawned rank does at an
epoch's edge, and what a recovery that brings a later epoch puts back. The state it works on is
:mod:`ftrun.rank.data`'s (:class:`ftrun.rank.data.EpochProgress`, :class:`ftrun.rank.data.LoaderCursor`); the
steps themselves run in the worker's step loop.
"""

from __future__ import annotations

from typing import Any, Callable, Generator, Iterator

import torch

from ftrun.rank.data import EpochProgress, LoaderCursor
from ftrun.rank.exactlyonce import ExactlyOnceChecks
from ftrun.common.protocol import MsgType
from ftrun.rank.recovery import Recovery
from ftrun.rank.registry import StateRegistry
from ftrun.rank.trace import RunTrace

#: ``step_loop(first step, total or None, cursor)``: yields ``(step, batch)``, returns the step after the last one run.
StepLoopFn = Callable[[int, "int | None", Any], Generator[tuple[Any, Any], None, int]]


class EpochLoop:
    """One rank's epoch loop.

    Args:
        registry: the registered state (``"epochs"`` and each pass's cursor are registered here).
        recovery: the rank's recovery (a respawned rank's pending rank record).
        checks: the exactly-once checks (rank records, divergence reports).
        trace: ``ftrun check``'s trace, or None.
        send: sends a message to the coordinator.
        enter_loop: ``enter_loop(first step)``: what precedes the first step (resume, join,
            recover); returns the first step to run.
        step_loop: the worker's step loop (:data:`StepLoopFn`).
    """

    def __init__(self, registry: StateRegistry, recovery: Recovery, checks: ExactlyOnceChecks, trace: RunTrace | None,
                 send: Callable[..., None], enter_loop: Callable[[int], int], step_loop: StepLoopFn) -> None:
        self.registry = registry
        self.recovery = recovery
        self.checks = checks
        self.trace = trace
        self.send = send
        self.enter_loop = enter_loop
        self.step_loop = step_loop
        self.progress: EpochProgress | None = None  # once an epoch loop runs
        self.stop: int | None = None  # ft.epochs' stop
        self.resume_step: int | None = None  # where a pass starts after a resume or a join
        self.stash: dict[str, Any] | None = None  # the donor's state, as received, put back after the epoch's end
        self.pass_end_rng: dict[str, Any] | None = None  # the RNG streams when the epoch's pass ended

    def _start(self) -> EpochProgress:
        if self.progress is None:
            self.progress = EpochProgress()
            self.registry.register("epochs", self.progress, "replica")
            self.recovery.control.rollback_ok = False  # ftrun.coordinator.policy.plan_rollback: passes are not rewound
        return self.progress

    def epochs(self, first: int, stop: int) -> Iterator[int]:
        """:meth:`ftrun.rank.worker.Worker.epochs`."""
        progress = self._start()
        self.stop = stop
        self.resume_step = self.enter_loop(progress.step)
        record = self.recovery.pending_rank_record()
        if record is not None and (record.provisional or record.epoch_boundary) and self.resume_step == progress.step:
            # A respawned rank starting at an epoch's first step with its predecessor's state from
            # the previous epoch's last all-reduce or end: apply it before the epoch's prologue (the
            # code between ft.epochs and ft.batches: resetting a hidden state, set_epoch, a draw),
            # which this rank now runs as its predecessor did. Applied after it, it would undo it.
            self.checks.apply_rank_record()
            if record.provisional and progress.end_moved_rng:
                # Its predecessor died before the end of the previous epoch was over (or before it
                # recorded it); that end moved the random streams on its replicas, so it would have
                # moved this rank's too, by draws no one recorded.
                self.checks.report_divergence(
                    max(progress.step - 1, 0), "epoch_end_rng",
                    f"rank {self.checks.rank} replaces a process that died after step {progress.step - 1}, an epoch's last, "
                    "before that epoch's end was over; the epoch's end draws from the global random generators "
                    "(an evaluation DataLoader's iter() draws a seed from torch's even with num_workers=0; dropout "
                    "left in train mode; a random sample), so its random streams cannot be its predecessor's. Give "
                    "what the epoch's end draws with its own generator (DataLoader(..., generator=torch.Generator()))",
                    hold=False)
        if progress.epoch is None:
            progress.epoch = first
        try:
            while progress.epoch < stop:
                epoch = progress.epoch
                if self.trace is not None:
                    self.trace.epochs.append({"epoch": epoch, "first_step": progress.step})
                self.pass_end_rng = None
                yield epoch
                if self.pass_end_rng is not None:  # the epoch's end has run: did it draw?
                    progress.end_moved_rng = not same_state(self.pass_end_rng, self.registry["rng"].state_dict())
                    self.pass_end_rng = None
                if self.stash is not None:  # see above: the donor's state, as received
                    stash, self.stash = self.stash, None
                    self.registry.load(stash)
                elif progress.epoch == epoch:
                    progress.epoch = epoch + 1
                    self.checks.record_epoch_boundary()
        except GeneratorExit:
            self.send(MsgType.STEPS_END)
            raise
        self.send(MsgType.STEPS_END)

    def batches(self, loader: Any, name: str) -> Iterator[tuple[Any, Any]]:
        """:meth:`ftrun.rank.worker.Worker.batches`."""
        if self.progress is None:
            self._start()
            self.resume_step = self.enter_loop(0)
        progress = self._start()
        epoch = -1 if progress.epoch is None else progress.epoch
        cursor = LoaderCursor(loader, epoch)
        self.registry.register(name, cursor, "rank", replace=True)  # each pass its own cursor
        start = progress.step
        step = start
        if self.resume_step is not None:
            step, self.resume_step = max(start, self.resume_step), None
            cursor.position = step - start
        next_step = yield from self.step_loop(step, None, cursor)
        if progress.epoch == epoch or epoch < 0:  # else a recovery brought the donor's later epoch
            progress.step = next_step
            from ftrun.common.checkpoint import snapshot

            self.pass_end_rng = snapshot(self.registry["rng"].state_dict())

    def total(self, cursor: LoaderCursor) -> int | None:
        """The run's last step + 1 as far as it is known (shown on the console): the end of the
        epoch loop if every epoch is as long as this one, else the end of this pass."""
        try:
            length = len(cursor.loader)
        except TypeError:
            return None
        progress = self.progress
        epochs_left = 1
        if progress is not None and progress.epoch is not None and self.stop is not None:
            epochs_left = max(1, self.stop - progress.epoch)
        return (progress.step if progress is not None else 0) + length * epochs_left

    def epoch_moved(self, cursor: LoaderCursor) -> bool:
        """After a recovery inside a pass: whether the donor's epoch is past this pass's (then the
        pass ends here, and :meth:`epochs` puts the received replica state back after the
        epoch's end ran)."""
        progress = self.progress
        if progress is None or progress.epoch is None or cursor.epoch < 0 or progress.epoch == cursor.epoch:
            return False
        from ftrun.common.checkpoint import snapshot

        # Everything but this rank's own state: the epoch's end may change the optimizer too
        # (``scheduler.step()`` sets its learning rates), not only registered replica objects.
        self.stash = snapshot(self.registry.state_dict(exclude=("rank",)))
        return True


def same_state(a: Any, b: Any) -> bool:
    """Whether two state_dicts (nested dicts, lists, tensors, arrays, numbers) are equal, bitwise."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays
        import numpy as np

        return bool(np.array_equal(a, b))
    return bool(a == b)
