"""The worker library: what a training script uses so ftrun can repair it in place.

A complete loop::

    import ftrun

    ft = ftrun.init()                            # process group (gloo on CPU, NCCL on CUDA)
    model = ft.wrap_model(Net())                 # registered; identical on every replica
    opt = ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=0.1))
    ft.register("scheduler", sched)              # anything with state_dict/load_state_dict
    for step in ft.steps(1000):                  # retries and recovers transparently
        loss = loss_fn(model(x_of(step)), y_of(step))
        opt.zero_grad(); loss.backward(); opt.step()
        ft.report(step, loss=loss.item())
    ft.finish()

How a fault is absorbed (ARF; docs/recovery.md): the optimizer wrapper all-reduces gradients
over ftrun's process group and applies the update only when that succeeded (TorchFT's
``should_commit`` idea), so a collective broken by a dead peer becomes a recorded error, not an
exception through autograd. A step whose update finished is *committed*. At the end of a failed
step, :meth:`Worker.steps` drops the group, reports its committed step to the supervisor, builds the
next generation's group when the supervisor sends the plan, sends or receives state point-to-point
(:mod:`ftrun.rank.transfer`), and resumes at the first uncommitted step. A respawned rank does the same
from its first call to :meth:`Worker.steps`, after the script built its model and optimizer.

Determinism: each rank's random streams and data position are its own state (kind ``rank``),
rolled back when a step is retried and kept in the job's store for a respawned rank
(:mod:`ftrun.rank.rankstate`), so a run with faults draws what a run without draws and ends bitwise
equal to it. Data comes from an epoch loop over a ``DataLoader`` (:meth:`Worker.epochs`,
:meth:`Worker.batches`, :mod:`ftrun.rank.data`) or is a function of the step (:meth:`Worker.steps`;
``init(seed=...)`` then reseeds every step from ``(seed, step, rank)``).

Outside ftrun (plain ``torchrun``, or no launcher at all) the same script runs: the library builds
the group from the ``env://`` variables and simply trains, without recovery.

Roles (each its own class, used through its public members only, which
``tests/test_structure.py`` checks): :class:`Worker` is the script's handle; it holds its
identity as a rank and the first group's build (:class:`ftrun.rank.binding.RankBinding`, which binds a
hot spare at its promotion), the step loop and the finish barrier (:class:`ftrun.rank.steploop.StepLoop`),
the process group's lifecycle (:class:`ftrun.rank.group.TrainingGroup`), the control
client (:class:`ftrun.rank.client.ControlClient`), the state registry
(:class:`ftrun.rank.registry.StateRegistry`), the recovery (:class:`ftrun.rank.recovery.Recovery`, sharing
the loop's :class:`ftrun.rank.recovery.RankProgress`), this rank's checkpoints
(:class:`ftrun.rank.shards.RankCheckpoints`), the collectives and their faults
(:class:`ftrun.rank.gradsync.GradientSync`, over the gradient reducers of :mod:`ftrun.rank.reducer`), the
exactly-once checks (:class:`ftrun.rank.exactlyonce.ExactlyOnceChecks`), the epoch loop
(:class:`ftrun.rank.epochs.EpochLoop`), the supervisor's death (:class:`ftrun.rank.orphan.ParentWatch`) and
``ftrun check``'s trace (:class:`ftrun.rank.trace.RunTrace`). Where the process stands is one phase
(:class:`ftrun.rank.workerstate.WorkerState`); its environment is :class:`ftrun.common.contract.RankEnv`.
"""

from __future__ import annotations

import atexit
import contextlib
import gc
import os
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch

from ftrun.common import procs
from ftrun.common.contract import CONTROL_ADDR, NO_STATE, RankEnv
from ftrun.common.protocol import MsgType
from ftrun.errors import RecoverableError, describe
from ftrun.rank.binding import DUMP_SIGNAL, RankBinding, replica_group_of  # noqa: F401  (ftrun.rank.worker's names)
from ftrun.rank.client import ControlClient, open_channel
from ftrun.rank.cuda import spare_device
from ftrun.rank.epochs import EpochLoop
from ftrun.rank.exactlyonce import ExactlyOnceChecks
from ftrun.rank.group import GroupDown, TrainingGroup, retire  # noqa: F401  (GroupDown: ftrun.rank.worker.GroupDown, documented)
from ftrun.rank.optim import FTOptimizer
from ftrun.rank.orphan import ORPHAN_SIGNAL, ParentWatch  # noqa: F401  (ORPHAN_SIGNAL: ftrun.rank.worker.ORPHAN_SIGNAL)
from ftrun.rank.recovery import RankProgress, Recovery
from ftrun.rank.gradsync import UCE_REPORT_WAIT_S, GradientSync  # noqa: F401  (UCE_REPORT_WAIT_S: ftrun.rank.worker's, documented)
from ftrun.rank.reducer import BUCKET_CAP_BYTES
from ftrun.rank.registry import StateRegistry
from ftrun.rank.shards import RankCheckpoints
from ftrun.rank.sharding import ShardedModels, is_collective_failure, is_sharded
from ftrun.rank.steploop import GroupFailure, Step, StepLoop, seed_everything, step_seed  # noqa: F401  (ftrun.rank.worker's names)
from ftrun.rank.trace import RunTrace
from ftrun.rank.transaction import ModuleBuffers
from ftrun.rank.transfer import RNGState
from ftrun.rank.workerstate import Phase, WorkerState

BUCKET_BYTES = BUCKET_CAP_BYTES  # gradient all-reduce bucket (DDP's default cap)


_worker: "Worker | None" = None
_report_channel: Any = None  # ftrun.rank.channel.Channel of a script that only reports


def report(step: int, **metrics: Any) -> None:
    """Report the step just finished and metrics to the console (no-op outside ftrun)."""
    global _report_channel
    if _worker is not None:
        _worker.report(step, **metrics)
        return
    if _report_channel is None:
        env = RankEnv.from_environ(os.environ)
        _report_channel = open_channel(False, list(range(env.world_size)), env.generation or 0, env=env)
        if _report_channel is None:
            return
    _report_channel.send(MsgType.PROGRESS, step=int(step), metrics=_clean_metrics(metrics))


def _clean_metrics(metrics: dict[str, Any]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for key, value in metrics.items():
        if isinstance(value, torch.Tensor):
            value = value.item()
        out[str(key)] = value if isinstance(value, (int, float, str)) else str(value)
    return out


class Worker:
    """One rank's handle on ftrun. Create it with :func:`init`.

    Attributes:
        rank, world_size, local_rank: as in torch.distributed.
        incarnation: which process serving this rank (0 = first).
        generation: the process group's generation (bumped at every reconfiguration).
        committed: the last step whose optimizer update finished here (-1: the initial state,
            before any update; -2: no usable state yet, e.g. a respawned rank before its transfer).
        device: the device tensors should live on (``cuda:LOCAL_RANK`` with NCCL, else CPU, or a shared
            GPU: ``init(device=...)``). memory_wait: a respawned rank's wait for its GPU's memory.
        state: where the process stands (:class:`ftrun.rank.workerstate.WorkerState`: a phase, its
            error, and whether it runs under ftrun).
        env: its environment (:class:`ftrun.common.contract.RankEnv`).
    """

    def __init__(self, backend: str | None, replica_groups: Sequence[Sequence[int]] | None, seed: int | None,
                 device: str | None = None, mesh: tuple[Sequence[int], Sequence[str]] | None = None) -> None:
        env = self.env = RankEnv.from_environ(os.environ)
        self.state = WorkerState()
        self.progress = RankProgress()  # committed step, generation, current step (ftrun.rank.recovery)
        self.world_size = env.world_size
        self.seed = seed
        self.pg_timeout, self.cluster_timeout = env.pg_timeout, env.cluster_time_out
        self.backend, self.device_request = backend or ("nccl" if torch.cuda.is_available() else "gloo"), device
        self.registry = StateRegistry()  # the registered state, by kind (ftrun.rank.registry)
        self.group = TrainingGroup(self.backend, self.world_size, self.pg_timeout, self.cluster_timeout)
        # A DeviceMesh and the models sharded on it, rebuilt on every generation (ftrun.rank.sharding).
        self.sharding = ShardedModels(mesh, self.backend, device, self.group.record_connections, retire)
        self.group.after_build.append(self.sharding.rebuild)
        replica_groups = self.sharding.replica_groups(self.world_size) or replica_groups
        self.replica_groups = [list(g) for g in replica_groups] if replica_groups else [list(range(self.world_size))]
        # This process's identity as a rank (ftrun.rank.binding). A hot spare (docs/hot_spares.md)
        # runs this set-up without a rank: it is bound at its promotion, when the script reaches its
        # loop or first asks for it.
        self.binding = RankBinding(self, replica_groups)
        self.uce, self.ttp, self.save_steps = env.uce, env.ttp, env.save_steps
        self.checkpoints = RankCheckpoints(env.checkpoint_dir, self.replica_groups, self._send, self.registry)
        # The supervisor (this process's parent) dying: a dying gasp (ftrun.rank.orphan).
        self.parent = ParentWatch(self.state, self.progress, self.registry, self.checkpoints, self.ttp, self.world_size)
        # What this rank says to its supervisor and hears back (ftrun.rank.client).
        self.control = ControlClient(self.progress)
        self.control.on_abort = self.control.report_abort
        # The step loop: its entry, its steps, their recovery and retry, the finish barrier (ftrun.rank.steploop).
        self.loop = StepLoop(self)
        # Its part in recoveries (ftrun.rank.recovery), over the roles above.
        self.recovery = Recovery(self.progress, self.group, self.control, self.registry,
                                 build_group=self.binding.build_group, safe_point=self.loop.safe_point, seed=seed,
                                 check_replicas=lambda step: self.checks.compare_replicas(step),
                                 read_checkpoint=lambda directory: self.checkpoints.resume(Path(directory)))
        self.recoverable_names = set(env.recoverable_errors)
        # Exactly-once checks and this rank's records in the job's store (ftrun.rank.exactlyonce).
        self.checks = ExactlyOnceChecks(self.progress, self.registry, self.recovery, self.group, self.state, self._send,
                                        self.control.poll_abort, self.world_size, seed, env.on_divergence)
        # The collectives (initial broadcast, gradient all-reduce) and their faults (ftrun.rank.gradsync).
        self.sync = GradientSync(self.world_size, self.pg_timeout, self.state, self.progress, self.group, self.control,
                                 self.checks, self._send, self._record_error,
                                 lambda error, drop: self._repair_in_place(error, drop), self.is_recoverable,
                                 self.registry.transaction)
        self.control.on_io_abort = self.sync.on_io_abort
        # ftrun check (ftrun.tools.check): a trace of this process's run, written at finish().
        self.trace = RunTrace(env.check_trace, self.registry) if env.check_trace else None
        # Epoch loops over data loaders (ft.epochs / ft.batches: ftrun.rank.epochs).
        self.epoch_loop = EpochLoop(self.registry, self.recovery, self.checks, self.trace, self._send,
                                    self.loop.enter, self.loop.run)
        # Per-rank RNG streams are this rank's own (rank state); with a seed they are reseeded every
        # step from (seed, step, rank) anyway.
        self.register("rng", RNGState(), kind="rank")
        self.binding.start(env.hot_spare)

    @property
    def committed(self) -> int:
        return self.progress.committed

    @committed.setter
    def committed(self, step: int) -> None:
        self.progress.committed = step

    @property
    def generation(self) -> int:
        return self.progress.generation

    @generation.setter
    def generation(self, generation: int) -> None:
        self.progress.generation = generation

    @property
    def managed(self) -> bool:
        """Whether the rank runs under ftrun with ARF (it recovers); else a failure ends it."""
        return self.state.managed

    @managed.setter
    def managed(self, managed: bool) -> None:
        self.state.managed = managed

    @property
    def joining(self) -> bool:
        """A respawned rank (or a hot spare, before or after its promotion) that has no state yet."""
        return self.state.phase in (Phase.JOINING, Phase.SPARE)

    @property
    def rank(self) -> int:
        """This process's rank (a hot spare waits here for its promotion)."""
        self.binding.identity("ft.rank")
        return self.binding.rank  # type: ignore[return-value]

    @property
    def local_rank(self) -> int:
        """Its index on its node (a hot spare waits here for its promotion)."""
        self.binding.identity("ft.local_rank")
        return self.binding.local_rank

    @property
    def incarnation(self) -> int:
        """Which process serving this rank (0 = first; a hot spare waits here for its promotion)."""
        self.binding.identity("ft.incarnation")
        return self.binding.incarnation

    @property
    def replica_group(self) -> list[int]:
        """The ranks holding the same state as this one (a hot spare waits here for its promotion)."""
        self.binding.identity("ft.replica_group")
        return self.binding.replica_group

    @property
    def device(self) -> torch.device:
        """Where tensors live (:func:`ftrun.rank.cuda.choose_device`): CPU with gloo, ``cuda:LOCAL_RANK`` with
        NCCL, a shared GPU with gloo and ``device="cuda"``. A hot spare waits here for its promotion
        unless every rank of its node shares one device (:func:`ftrun.rank.cuda.spare_device`)."""
        if self.state.phase is Phase.SPARE and (early := spare_device(self.backend, self.device_request, torch.cuda.device_count())):
            return torch.device(early)
        self.binding.identity("ft.device")
        return self.binding.device

    def _drop_group(self, broken: bool = True) -> None:
        """Drop the current group (:meth:`ftrun.rank.group.TrainingGroup.drop`): its connections are cut
        and, when ``broken``, the placeholder group stands until the next generation."""
        self.group.drop(self.generation, broken)

    # ------------------------------------------------------------------ registration
    def register(self, name: str, obj: Any, kind: str = "replica", replace: bool = False) -> Any:
        """Register an object whose ``state_dict``/``load_state_dict`` is part of the training state.

        Args:
            name: its name in the state (unique: another object under a taken name is refused).
            obj: anything with ``state_dict()``/``load_state_dict()``.
            kind: ``"replica"`` (default: a scheduler, a counter: identical on every replica, sent by a
                donor, rolled back with a retried step), ``"rank"`` (this rank's own: a data position,
                RNG; rolled back too, kept in the job's store for a respawned successor) or
                ``"committed"`` (changed by the updates: models, optimizers); see :mod:`ftrun.rank.registry`.
            replace: put ``obj`` where another object stood under ``name`` (a placeholder).

        Returns:
            ``obj``.

        Raises:
            TypeError: ``obj`` has no ``state_dict``/``load_state_dict``.
            ValueError: an unknown ``kind``, or ``name`` taken by another object (one line naming both).
        """
        return self.registry.register(name, obj, kind, replace=replace)

    def wrap_model(self, model: torch.nn.Module, name: str | None = None, ddp: bool = False, **ddp_kwargs: Any) -> torch.nn.Module:
        """Register ``model``, make every replica start from rank 0's weights (as DDP does), and
        average its gradients during ``backward()`` over the group ftrun rebuilds after a fault.

        After ``loss.backward()`` each ``.grad`` holds the average over the world, as under DDP; a
        failed all-reduce is recorded (never raised through autograd) and the optimizer wrapper
        then skips the update. Use :meth:`no_sync` (or DDP's, with ``ddp=True``) to accumulate
        gradients over micro-batches. If the initial broadcast fails (a rank died before the first
        step), the error is recorded and :meth:`steps` recovers before step 0: ranks that hold rank
        0's weights give them to those that do not.

        Args:
            model: the module; moved to :attr:`device`.
            name: its name in the state (default ``"model"``, then ``"model2"``...); its buffers are
                rank state ``"<name>.buffers"`` (:class:`ftrun.rank.transaction.ModuleBuffers`).
            ddp: return ``DistributedDataParallel(model)`` so code relying on DDP (``no_sync()``,
                ``model.module``, DDP's forward hooks) keeps working. That DDP is built over a
                private one-rank process group that survives every regeneration, with a comm hook
                that all-reduces each bucket over ftrun's group (:mod:`ftrun.rank.reducer`); without
                it, hooks on the parameters do the same with DDP's bucket layout, so both paths
                give the same bits. The registered state is the inner module's, so its keys carry
                no ``module.``.
            **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).

        Returns:
            ``model``, or the DDP wrapping it.

        Raises:
            ValueError: ``name`` is taken by another registered object, or a DDP keyword is refused.
        """
        name = self.registry.name_for(name, "model", model)
        if is_sharded(model):  # FSDP2/TP: its groups reduce the gradients; ftrun moves its local shards
            return self.sharding.wrap(model, name, self.registry, self.sync, lambda p: self.faults.point(p, self.progress.current_step))
        model.to(self.device)
        self.register(name, model, kind="committed")
        if self.world_size > 1 and not self.joining and self.group.live():
            failure = self.sync.broadcast_initial(model)
            if failure is not None:
                if self.rank != 0:
                    self.committed = NO_STATE  # maybe half received: not rank 0's weights
                self._record_error(failure)
        if next(model.buffers(), None) is not None:  # after the broadcast: rank 0's are the initial ones
            self.register(f"{name}.buffers", ModuleBuffers(model), kind="rank")
        return self.sync.wrap(model, self.device, ddp, ddp_kwargs, check_gradients=self.managed or self.state.phase is Phase.SPARE,
                              is_first_step=lambda: self.progress.current_step == self.loop.first_step)

    def device_mesh(self, shape: Sequence[int] | None = None, names: Sequence[str] | None = None) -> Any:
        """The ``DeviceMesh`` declared at :func:`init`, kept across generations (:mod:`ftrun.rank.sharding`;
        ValueError when none was declared or ``shape``/``names`` differ from it)."""
        return self.sharding.device_mesh(shape, names)

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, name: str | None = None) -> FTOptimizer:
        """Register ``optimizer`` and return a :class:`ftrun.rank.optim.FTOptimizer`: a
        ``torch.optim.Optimizer`` (schedulers, ``GradScaler`` take it) whose ``step()`` applies the
        update only when the step's collectives succeeded. ``name``: its name in the state
        (default ``"optimizer"``, then ``"optimizer2"``...); several may be stepped in one step
        (:mod:`ftrun.rank.transaction`). Raises ValueError when ``name`` is taken by another object."""
        name = self.registry.name_for(name, "optimizer", optimizer)
        wrapped = FTOptimizer(optimizer, self)
        self.register(name, self.sharding.optimizer_state(optimizer), kind="committed")
        return wrapped

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes inside (DDP's ``no_sync``); the next
        backward outside averages the accumulated gradients."""
        with self.sync.no_sync():
            yield

    def apply_update(self, update: Callable[[], Any], optimizer: torch.optim.Optimizer | None = None,
                     closure: bool = False) -> tuple[bool, Any]:
        """Run ``update`` if the step's collectives succeeded; it commits the step when it is the
        step's last change, else the step commits when its body ends. ``optimizer``: the one it
        steps (None: a hand-written update); ``closure``: it runs passes of its own (LBFGS).
        Returns (applied, its result) (:meth:`ftrun.rank.gradsync.GradientSync.apply`)."""
        return self.sync.apply(update, lambda: [p for obj in self.registry.optimizers() for g in obj.param_groups
                                                for p in g["params"]], self.commit, optimizer, closure)

    def state_dict(self) -> dict[str, Any]:
        """The registered state: ``{name: obj.state_dict()}``."""
        return self.registry.state_dict()

    def replica_state_dict(self) -> dict[str, Any]:
        """What a donor sends: every registered object but this rank's own (kind ``"rank"``)."""
        return self.registry.state_dict(exclude=("rank",))

    # ------------------------------------------------------------------ reporting
    def report(self, step: int, **metrics: Any) -> None:
        """Show ``step`` and ``metrics`` on the console (queued; never blocks)."""
        self.control.report(step, _clean_metrics(metrics))

    def ping(self) -> None:
        """Tell the watchdog this rank is making progress in long work outside the step loop's
        rhythm (a long evaluation, a large save): the step bound counts from now (NVRx's ``ping``)."""
        self.control.ping()

    @contextlib.contextmanager
    def section(self, name: str, timeout: float | None = None) -> Iterator[None]:
        """A named stretch of work (evaluation, checkpoint writing) bounded by its own ``timeout``
        (seconds; None: unbounded) instead of the step watchdog (NVRx's sections).

        While it is open the rank sends a ``progress`` with ``section``/``section_timeout`` at each
        heartbeat, so the watchdog sees it busy and not stuck; the supervisor kills it as hung
        only after ``timeout`` in the section. Step intervals spanning a section do not feed the
        automatic step bound. Sections do not nest (an inner one replaces the outer's bound).
        """
        previous = self.control.open_section(name, timeout)
        if self.trace is not None:
            self.trace.sections.append({"name": str(name), "committed": self.committed})
        self.faults.point("section", self.committed)
        try:
            yield
        finally:
            self.control.close_section(previous)

    def _send(self, msg_type: MsgType, **fields: Any) -> None:
        self.control.send(msg_type, **fields)

    # ------------------------------------------------------------------ faults in a step
    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Average the gradients of ``params`` over the world (for a model not given to
        :meth:`wrap_model`): DDP's buckets of up to :data:`BUCKET_BYTES`, in parameter order, so
        every generation reduces in the same order and results stay bitwise reproducible. False
        (error recorded) on failure."""
        return self.sync.all_reduce(params)

    def is_recoverable(self, err: BaseException) -> bool:
        """Whether ``err`` is repaired in place (UCE): a :class:`RecoverableError`, or a type named in
        ``--recoverable_errors`` (``module.Class`` or ``Class``, matched along its MRO)."""
        if not (self.managed and self.uce):
            return False
        if isinstance(err, RecoverableError):
            return True
        return any(
            f"{cls.__module__}.{cls.__qualname__}" in self.recoverable_names or cls.__qualname__ in self.recoverable_names
            for cls in type(err).__mro__
        )

    def repair_step_error(self, err: BaseException) -> bool:
        """An exception leaving a step's ``with`` block (:class:`Step`): if it is recoverable
        (:meth:`is_recoverable`), repair the rank in place (UCE) and return True, so the block
        suppresses it; else False (it propagates). The group is dropped by the step loop right
        after, once the traceback is gone."""
        if isinstance(err, Exception) and self.managed and self.sharding.models and is_collective_failure(err):
            self.state.to(Phase.FAILED, f"collective failed: {describe(err)}")  # FSDP's, inside forward or backward
            return True
        if not isinstance(err, Exception) or not self.is_recoverable(err):
            return False
        self._repair_in_place(describe(err), drop=False)
        return True

    def _repair_in_place(self, error: str, drop: bool) -> None:
        """Record a recoverable error (UCE: :meth:`ftrun.rank.gradsync.GradientSync.repair`)."""
        self.sync.repair(error, drop)

    def record_failure(self, reason: str) -> None:
        """Record that a collective the script or its framework made on ftrun's group failed (a
        Hugging Face Trainer's gather of its logged loss, an evaluation's): the step loop recovers
        at its next turn, as after a failed gradient all-reduce. Call it outside the ``except``
        block that caught the error (see :meth:`_record_error`)."""
        self._record_error(reason)

    def _record_error(self, reason: str) -> None:
        """Record a failed collective and tear the group down at once.

        Must be called outside any ``except`` block: the exception's traceback keeps the group
        alive, and peers blocked on us then wait for the full timeout instead of the few
        milliseconds it takes once our sockets close (gloo closes a group's sockets only when
        the last reference to it goes).
        """
        if self.state.phase is Phase.REPAIRING:
            self.state.to(Phase.REPAIRING, reason)  # the round is the repair's
        elif self.state.phase is not Phase.PENDING_REPAIR:  # a pending repair supersedes it
            self.state.to(Phase.FAILED, reason)
        self._drop_group()

    # ------------------------------------------------------------------ the step loop
    def steps(self, num_steps: int, start: int = 0) -> Iterator[int]:
        """Yield step numbers ``start .. num_steps-1``; failed steps are recovered and retried.

        A respawned rank first recovers (receives its state) and starts at the recovery step + 1.
        Each step is a :class:`Step`: an ``int`` that is also a context manager; ``with step:``
        around the step's body lets a :class:`RecoverableError` raised there be repaired in place.
        Leaving the loop early (``break``) ends it cleanly, as its end does.
        """
        step = self.loop.enter(start)
        try:
            for step_, _ in self.loop.run(step, num_steps, None):
                yield step_
        except GeneratorExit:
            self._send(MsgType.STEPS_END)
            raise
        self._send(MsgType.STEPS_END)

    def epochs(self, first: int, stop: int) -> Iterator[int]:
        """Yield epoch numbers ``first .. stop-1`` for an epoch loop over :meth:`batches`. The epoch
        is replica state: a respawned rank recovers here and starts in its donor's epoch, so work
        after an epoch's last step (evaluation, ``scheduler.step()``) is not repeated
        (:class:`ftrun.rank.epochs.EpochLoop`)."""
        return self.epoch_loop.epochs(first, stop)

    def batches(self, loader: Any, name: str = "data") -> Iterator[tuple["Step", Any]]:
        """Yield ``(step, batch)`` for one pass over ``loader`` (a ``DataLoader``, torchdata's
        ``StatefulDataLoader``, any iterable); a failed step is recovered and retried with the same
        batch. ``step`` is the global step (a :class:`Step`); the pass's position is rank state
        ``name`` (:class:`ftrun.rank.data.LoaderCursor`). Outside :meth:`epochs`, one call is one pass."""
        return self.epoch_loop.batches(loader, name)

    def commit(self, step: int) -> None:
        """Mark ``step`` committed (called by the optimizer wrapper after its update)."""
        self.committed = step
        if self.trace is not None:
            self.trace.committed(step, self.faults.counts(step))

    def finish(self) -> None:
        """Say the rank is done, wait for every other rank to be done too, then tear the group
        down and close the channel.

        The wait is a finish barrier: until every rank has called ``finish()``, this rank keeps its
        final state and answers recoveries, so a rank that dies after its last step (in its
        epilogue: evaluation, saving) is respawned, takes the final state from a replica waiting
        here, and runs its epilogue, instead of the job training again from scratch.
        """
        global _worker
        self.faults.point("finish", self.committed)
        if self.trace is not None:
            self.trace.write(self.rank, self.incarnation, self.committed, self.checks.divergences)
        self.checkpoints.close()  # the last periodic checkpoint is written before we leave
        self._send(MsgType.DONE, committed=self.committed)
        self.state.to(Phase.FINISHED)
        self._drop_group(broken=False)
        if self.control.channel is not None and self.managed:
            self.loop.finish_barrier()
        self.control.close()
        _worker = None


def current() -> Worker | None:
    """This process's :class:`Worker` if :func:`init` was called, else None (for integrations
    that must know whether the script joined ftrun before its framework built a process group)."""
    return _worker


def init(backend: str | None = None, replica_groups: Sequence[Sequence[int]] | None = None, seed: int | None = None,
         device: str | None = None, mesh_shape: Sequence[int] | None = None,
         mesh_dim_names: Sequence[str] | None = None) -> Worker:
    """Join the job: connect to the supervisor and build the process group.

    Args:
        backend: ``"gloo"`` or ``"nccl"`` (default: NCCL when CUDA is available, else gloo).
        replica_groups: the partition of ranks into groups of identical state (MindSpore's
            ``group_info``); default pure data parallel: all ranks are replicas of each other.
        seed: if given, torch, numpy and ``random`` are reseeded at every step start from
            (seed, step, rank) (the examples' batches-as-a-function-of-the-step style). Default
            None: the random streams are left alone, as in a plain script; they are each rank's
            own state, rolled back with a retried step and carried to a respawned rank through
            the job's store, so a run with faults still draws what a run without draws.
        device: where tensors live (:func:`ftrun.rank.cuda.choose_device`): default ``cuda:LOCAL_RANK``
            with NCCL, the CPU with gloo; ``"cuda"`` with gloo shares the node's GPUs between its
            ranks (4 ranks on one GPU), ``"cuda:N"`` names one.
        mesh_shape: the DeviceMesh the script shards its model on (``(2, 2)``), built later by
            :meth:`Worker.device_mesh`; ranks with the same coordinate on every dimension but
            ``replicate`` are replicas (:func:`ftrun.rank.sharding.mesh_replica_groups`), in place of
            ``replica_groups``.
        mesh_dim_names: its dimensions' names (``("replicate", "shard")``: HSDP).

    Returns:
        The :class:`Worker` (one per process; later calls return the same one).

    Raises:
        ValueError: ``replica_groups`` does not contain this rank; a mesh whose size is not the
            world size, or given with ``replica_groups``.
    """
    global _worker
    if _worker is None:
        # A quick exit: at exit Python's finalization runs full garbage collections over every
        # object still alive, and a rank holds millions (torch, and torch._dynamo with sympy, which
        # the first torch.optim call imports): 1.3 to 2 s of CPU per rank after its last line on
        # 2 cores, 75% of it in gc_collect_main (perf), which every job waits for at its end.
        # gc.freeze() puts the objects alive then out of the collector's reach. Registered here,
        # it runs after the exit handlers registered later (the script's, most libraries'), and
        # changes nothing else: objects are still freed as their modules are cleared; only cyclic
        # garbage left at exit is not collected (Python does not promise to finalize it either).
        # Before the Worker is built: a process that ends while building it exits quickly too.
        atexit.register(gc.freeze)
        if os.environ.get(CONTROL_ADDR):  # under ftrun: output to worker_<rank>.log, whose trouble must not end the rank
            procs.guard_log_output()
        if mesh_shape is not None and replica_groups is not None:
            raise ValueError("ftrun.init: give mesh_shape (its replica groups follow) or replica_groups, not both")
        mesh = (mesh_shape, mesh_dim_names or [f"dim{i}" for i in range(len(mesh_shape))]) if mesh_shape is not None else None
        _worker = Worker(backend, replica_groups, seed, device, mesh)
    return _worker
