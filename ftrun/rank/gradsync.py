"""The rank's collectives over ftrun's group (split out of :class:`ftrun.rank.worker.Worker`): the
initial broadcast, the gradient all-reduce (during ``backward`` through :mod:`ftrun.rank.reducer`, or
after it for a model not given to ``wrap_model``), and their faults turned into recorded state.

A collective broken by a dead or hung peer never raises through autograd or the script: the
failure is recorded (the worker's ``record_error``: the phase becomes FAILED, the group is
dropped) and the step loop recovers; a recoverable error raised at the all-reduce is repaired in
place (UCE). While the training thread is in a collective (:attr:`GradientSync.in_collective`),
an abort for a newer generation that reaches the channel's I/O thread cuts the group's
connections, so the collective fails at once instead of after the process group's timeout.
"""

from __future__ import annotations

import contextlib
import os
import sys
import threading
import time
from typing import Any, Callable, Iterator, Sequence

import torch

from ftrun.errors import describe
from ftrun.rank.exactlyonce import ExactlyOnceChecks
from ftrun.common.faults import FaultInjector
from ftrun.rank.group import TrainingGroup
from ftrun.common.contract import NO_STATE
from ftrun.common.protocol import MsgType
from ftrun.rank.recovery import RankProgress
from ftrun.rank.reducer import (BUCKET_CAP_BYTES, BucketLayout, GradientReducer, all_reduce_in_buckets, broadcast_buffers,
                      broadcast_module, local_gradients_hook, one_rank_group)
from ftrun.rank.transaction import StepTransaction
from ftrun.rank.workerstate import Phase, WorkerState


SETTLE_S = 5.0  # how long an abandoned in-place all-reduce gets to finish before the rank is replaced
UCE_REPORT_WAIT_S = 2.0  # how long a rank repairing in place waits for the supervisor's abort

class GradientSync:
    """One rank's collectives and what their faults do.

    Args:
        world_size: ranks in the job. pg_timeout: seconds (DDP's private group's timeout).
        state: the rank's :class:`ftrun.rank.workerstate.WorkerState` (read, and set to PENDING_REPAIR).
        progress: the step loop's progress (current step, generation, stage).
        group: the training group (cut when an abort arrives mid-collective).
        control: the control client (its ``abandon`` event, its I/O thread's aborts).
        checks: the exactly-once checks (the local gradient's fingerprint, the rank records).
        send: sends a message to the coordinator.
        record_error: records a failed collective (outside any ``except`` block) and drops the group.
        repair_in_place: ``repair_in_place(error, drop)``: repairs a recoverable error (UCE).
        is_recoverable: whether an exception is repaired in place.
        transaction: the step as a transaction over its updates (:class:`ftrun.rank.transaction.StepTransaction`).

    Attributes:
        faults: the fault injector (set when the rank is bound).
        in_collective: the training thread is in a collective now (or about to enter it).
        waiting: set while the training thread waits for an asynchronous all-reduce.
    """

    def __init__(self, world_size: int, pg_timeout: float, state: WorkerState, progress: RankProgress,
                 group: TrainingGroup, control: Any, checks: ExactlyOnceChecks, send: Callable[..., None],
                 record_error: Callable[[str], None], repair_in_place: Callable[[str, bool], None],
                 is_recoverable: Callable[[BaseException], bool], transaction: StepTransaction) -> None:
        self.world_size = world_size
        self.pg_timeout = pg_timeout
        self.state = state
        self.progress = progress
        self.group = group
        self.control = control
        self.checks = checks
        self.send = send
        self.record_error = record_error
        self.repair_in_place = repair_in_place
        self.is_recoverable = is_recoverable
        self.transaction = transaction
        self.faults = FaultInjector([], -1, -1, -1)
        self.in_collective = False
        self.waiting = threading.Event()
        self.reducers: list[GradientReducer] = []
        self.sharded = False  # a sharded model (FSDP2/TP) reduces its own gradients: none are averaged here
        self._private_group: Any = None

    def wrap(self, model: torch.nn.Module, device: torch.device, ddp: bool, ddp_kwargs: dict[str, Any],
             check_gradients: bool, is_first_step: Callable[[], bool]) -> torch.nn.Module:
        """Average ``model``'s gradients during ``backward`` (:class:`ftrun.rank.reducer.GradientReducer`);
        with ``ddp``, return it wrapped in ``DistributedDataParallel`` over a private one-rank
        group whose comm hook communicates nothing (see :mod:`ftrun.rank.reducer`).
        ``check_gradients``: fingerprint each local gradient (exactly-once checks).

        DDP's keywords are honoured bit for bit or refused: ``find_unused_parameters``,
        ``bucket_cap_mb`` and ``bucket_cap_mb_list`` shape the buckets (:class:`ftrun.rank.reducer.BucketLayout`);
        ``broadcast_buffers``/``forward_sync_buffers`` (on by default, as in DDP) broadcast rank 0's
        buffers over ftrun's group before a forward exactly when DDP would.

        Raises:
            ValueError: ``ddp`` with ``gradient_as_bucket_view=False``, or a keyword ftrun cannot
                honour (:meth:`ftrun.rank.reducer.BucketLayout.from_ddp_kwargs`).
        """
        layout = BucketLayout.from_ddp_kwargs(ddp_kwargs)
        reducer = GradientReducer(
            list(model.parameters()),
            self.world_size,
            before_first_bucket=self._before_first_bucket,
            is_failed=lambda: self.state.failed,
            on_hook_error=self._on_hook_error,
            on_failure=self._on_reduce_failure,
            waiting=self.waiting,
            is_first_step=is_first_step,
            abandon=self.control.abandon,
            on_local_gradient=self.checks.check_local_gradient if check_gradients else None,
            hold_for_check=self.checks.holds_for_check,
            layout=layout,
            at_pass_start=self._at_pass_start,
            after_last_bucket=self.checks.record_gradient,
        )
        self.reducers.append(reducer)
        if not ddp:
            reducer.attach()
            model.register_forward_pre_hook(lambda _module, _args: reducer.schedule.on_forward() if torch.is_grad_enabled() else None)
            return model
        return self._wrap_in_ddp(model, reducer, device, ddp_kwargs)

    def _wrap_in_ddp(self, model: torch.nn.Module, reducer: GradientReducer, device: torch.device,
                     ddp_kwargs: dict[str, Any]) -> torch.nn.Module:
        """``model`` in ``DistributedDataParallel`` over this rank's private one-rank group, its
        bucket views averaged by ``reducer`` (:meth:`wrap` with ``ddp``)."""
        from torch.nn.parallel import DistributedDataParallel

        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        if not ddp_kwargs["gradient_as_bucket_view"]:
            raise ValueError("ft.wrap_model(ddp=True) needs gradient_as_bucket_view=True (ftrun averages DDP's bucket views in place)")
        if self._private_group is None:  # this rank alone, independent of ftrun's generations
            self._private_group = one_rank_group(device, self.pg_timeout)
        wrapped = DistributedDataParallel(model, process_group=self._private_group, **ddp_kwargs)
        wrapped.register_comm_hook(None, local_gradients_hook)
        reducer.attach(after_ddp=True)

        def before_forward(module: Any, _args: Any) -> None:
            # DDP's no_sync() (not only ft.no_sync()) keeps the next backward local, as under DDP.
            reducer.forward_sync = bool(module.require_backward_grad_sync)
            if torch.is_grad_enabled():
                reducer.schedule.on_forward()  # where DDP rebuilds its buckets
            # DDP syncs its buffers over its own (one-rank) group here: do it over ftrun's, when
            # DDP would (its predicate reads the previous forward's state, as DDP's own check does).
            if self.world_size > 1 and module.will_sync_module_buffers():
                self.sync_buffers(module.module)

        wrapped.register_forward_pre_hook(before_forward)
        return wrapped

    def begin_step(self) -> None:
        """A step (or a retry of one) starts (:meth:`ftrun.rank.reducer.LayoutSchedule.begin_step`)."""
        for reducer in self.reducers:
            reducer.schedule.begin_step()

    def settle(self) -> None:
        """Before a step's forward: make sure no all-reduce given up on in an earlier pass (an
        abort) can still write into this rank's gradients (:meth:`ftrun.rank.reducer.GradientReducer.settle`:
        in-place buckets are DDP's bucket views, which the next backward fills again). Such a work
        normally failed within milliseconds of the abort's connection cut; one still in flight
        after :data:`SETTLE_S` seconds leaves the memory unsafe, and the process exits (code 1) to
        be replaced by a respawned rank, which takes its state from a replica: slower, never wrong.
        """
        for reducer in self.reducers:
            if reducer.unsettled and not reducer.settle(SETTLE_S):
                print(f"ftrun: rank {self.group.rank}: an all-reduce abandoned in an aborted step is still in flight "
                      f"after {SETTLE_S:.0f} s and may yet write into this rank's gradients; the rank exits to be "
                      "replaced (its state comes back from a replica)", file=sys.stderr, flush=True)
                os._exit(1)

    def sync_buffers(self, module: torch.nn.Module) -> None:
        """Broadcast rank 0's buffers of ``module`` before a forward (DDP's ``broadcast_buffers``);
        a failed broadcast is recorded (the step fails and is recovered), never raised."""
        if self.state.failed:
            return
        failure: str | None = None
        self.in_collective = True
        self.release_if_aborted()
        try:
            broadcast_buffers(module, src=0)
        except Exception as err:  # a dead or hung peer
            failure = f"buffer broadcast failed: {describe(err)}"
        finally:
            self.in_collective = False
        if failure is not None:
            self.record_error(failure)

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Keep the gradients of the backward passes inside local (DDP's ``no_sync``)."""
        with contextlib.ExitStack() as stack:
            for reducer in self.reducers:
                stack.enter_context(reducer.no_sync())
            yield

    def broadcast_initial(self, model: torch.nn.Module) -> str | None:
        """Broadcast rank 0's parameters and buffers; returns the failure (one line), or None."""
        failure: str | None = None
        self.progress.stage = "init"
        try:
            self.faults.point("init", None)
            self.in_collective = True  # an abort (a peer died) releases it at once
            self.release_if_aborted()
            broadcast_module(model, src=0)
        except Exception as err:  # a peer died: recorded, recovered by steps()
            failure = f"initial broadcast failed: {describe(err)}"
        finally:
            self.in_collective = False
            self.progress.stage = "setup"
        return failure

    def all_reduce(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Average the gradients of ``params`` over the world after ``backward``
        (:func:`ftrun.rank.reducer.all_reduce_in_buckets`). False (error recorded or repaired) on failure."""
        if self.world_size == 1:
            return True
        if self.state.error is not None:
            return False
        grads = [p.grad for p in params if p.grad is not None]
        failure: str | None = None
        recoverable: str | None = None
        self._at_pass_start()  # before anything leaves: see ExactlyOnceChecks.record_provisional
        self.control.board.collective()
        self.in_collective = True
        self.release_if_aborted()
        try:
            self.faults.point("allreduce", self.progress.current_step)
            all_reduce_in_buckets(grads, self.world_size, BUCKET_CAP_BYTES)
        except Exception as err:  # gloo/NCCL raise RuntimeError subclasses; any of them breaks the step
            failure = f"gradient all-reduce failed: {describe(err)}"
            recoverable = describe(err) if self.is_recoverable(err) else None  # no reference kept
        finally:
            self.in_collective = False
        if recoverable is not None:
            self.repair_in_place(recoverable, True)
            return False
        if failure is not None:
            self.record_error(failure)  # outside the except block: its traceback keeps the group alive
            return False
        return True

    def apply(self, update: Callable[[], Any], optimizer_params: Callable[[], list[Any]],
              commit: Callable[[int], None], optimizer: Any = None, closure: bool = False) -> tuple[bool, Any]:
        """The optimizer wrapper's step (``Worker.apply_update``): run ``update`` if the step's
        collectives succeeded (the step board in its ``update`` phase meanwhile), keeping an undo
        copy of what it changes unless it is the step's last change, and ``commit`` the step when it
        is (:class:`ftrun.rank.transaction.StepTransaction`; otherwise the step loop commits at the
        body's end). A pending recoverable error is repaired first (the update is skipped); without
        a wrapped model, the gradients of ``optimizer_params()`` are averaged here. A recoverable
        error raised by ``update`` is repaired in place; any other propagates. In an NCCL group,
        once an abort for a newer generation has arrived, nothing is applied (the step failed).
        ``optimizer``: the registered optimizer ``update`` steps (None: a hand-written update);
        ``closure``: it runs forward and backward passes of its own (LBFGS), whose failure makes it
        not applied.
        Returns (applied, its result)."""
        if self.state.phase is Phase.PENDING_REPAIR:
            self.repair_in_place(self.state.reason or "", True)
            return False, None
        if self.state.failed:
            return False, None
        if self.state.managed and self.group.backend == "nccl" and self.control.abandon.is_set():
            # An abort for a newer generation came before the update (it is set before the group is
            # released): a collective of this step may have been aborted under it and returned
            # without raising (docs/gpu.md), whoever called it (ftrun's reducer, FSDP, the script).
            # Not applied. (A gloo collective cut by the abort raises; one that completed before it
            # holds a true sum, and its update keeps the survivors' sharded state at one step.)
            self.record_error("abandoned before the update: the job's coordinator aborted this generation")
            return False, None
        if not self.reducers and not self.sharded and self.world_size > 1 and not self.all_reduce(optimizer_params()):
            return False, None
        progress = self.progress
        step = progress.current_step if progress.current_step is not None else progress.committed + 1
        self.control.board.enter("update")
        self.transaction.before_update(optimizer, closure)
        failed = None
        result = None
        try:
            self.faults.point("optimizer", step)
            result = update()
        except Exception as err:
            if not self.is_recoverable(err):
                raise
            failed = describe(err)
        if failed is not None:  # outside the except block (see Worker._record_error)
            self.repair_in_place(failed, True)
            return False, None
        applied = not self.state.failed  # a closure's collective may have failed inside the update
        if self.transaction.after_update(applied):
            commit(step)
        self.control.board.enter("compute")
        return applied, result

    def repair(self, error: str, drop: bool) -> None:
        """Record a recoverable error (``"Type: message"``): this rank's state is suspect, so it
        takes a replica's (UCE). ``drop``: tear the group down now (never inside an ``except``)."""
        progress = self.progress
        reason = f"recoverable error at step {progress.current_step}: {error}"
        self.state.to(Phase.REPAIRING, reason)
        progress.committed = NO_STATE
        print(f"ftrun: rank {self.group.rank}: {reason}; repairing in place", file=sys.stderr, flush=True)
        # Report before anything breaks the peers' collectives, and give the supervisor a moment to
        # answer: otherwise a peer's "collective failed" can reach it first and the round is taken
        # for a communication error. (Once the abort is here, the recovery sends no second report.)
        self.send(MsgType.FAULT, generation=progress.generation, step=progress.current_step or -1,
                  committed=progress.committed, reason=reason, kind="recoverable")
        deadline = time.monotonic() + UCE_REPORT_WAIT_S
        while not self.control.poll_abort(timeout=0.01) and time.monotonic() < deadline:
            pass
        if drop:
            self.group.drop(progress.generation)

    # Callbacks of the gradient reducer (called on the training thread, inside backward).
    def _at_pass_start(self) -> None:
        self.transaction.backward_pass()
        self.checks.record_provisional()

    def _before_first_bucket(self) -> None:
        self.control.board.collective()
        self.in_collective = True
        self.release_if_aborted()
        try:
            self.faults.point("allreduce", self.progress.current_step)
        except BaseException:
            self.in_collective = False  # raised before this rank communicated: it is in no collective
            raise

    def _on_hook_error(self, err: BaseException) -> bool:
        if isinstance(err, Exception) and self.is_recoverable(err):
            self.state.to(Phase.PENDING_REPAIR, describe(err))  # repaired outside autograd
            return True
        return False

    def _on_reduce_failure(self, reason: str) -> None:
        self.in_collective = False
        self.record_error(reason)

    # Aborts against collectives in flight.
    def on_io_abort(self, generation: int) -> None:
        """On the channel's I/O thread, for each abort: one for a newer generation makes every wait
        of the training thread give up, and releases it from a collective it is blocked in (a hung
        peer, a communication stall) by cutting the group's connections; the collective then
        fails at once and the step loop recovers."""
        if self.state.managed and generation > self.progress.generation:
            self.control.abandon.set()
            if self.in_collective:
                self.group.cut(wait=False)

    def release_if_aborted(self) -> None:
        """Entering a collective after an abort already arrived (the peer died while this rank was
        still computing): nobody will release it later, so its connections are cut now and the
        collective fails at once (set ``in_collective`` first: the I/O thread checks it after it
        records the abort, so one of the two always sees the other)."""
        if self.state.managed and self.control.io_aborted_beyond(self.progress.generation):
            self.group.cut()
