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

How a fault is absorbed (ARF, DESIGN.md "Recovery"): the optimizer wrapper all-reduces gradients
over ftrun's process group and applies the update only when that succeeded (TorchFT's
``should_commit`` idea), so a collective broken by a dead peer becomes a recorded error, not an
exception through autograd. A step whose update finished is *committed*. At the end of a failed
step, :meth:`Worker.steps` drops the group, reports its committed step to the supervisor, builds the
next generation's group when the supervisor sends the plan, sends or receives state point-to-point
(:mod:`ftrun.transfer`), and resumes at the first uncommitted step. A respawned rank does the same
from its first call to :meth:`Worker.steps`, after the script built its model and optimizer.

Determinism: each rank's random streams and data position are its own state (kind ``rank``),
rolled back when a step is retried and kept in the job's store for a respawned rank
(:mod:`ftrun.rankstate`), so a run with faults draws what a run without draws and ends bitwise
equal to it. Data comes from an epoch loop over a ``DataLoader`` (:meth:`Worker.epochs`,
:meth:`Worker.batches`, :mod:`ftrun.data`) or is a function of the step (:meth:`Worker.steps`;
``init(seed=...)`` then reseeds every step from ``(seed, step, rank)``).

Outside ftrun (plain ``torchrun``, or no launcher at all) the same script runs: the library builds
the group from the ``env://`` variables and simply trains, without recovery.

Roles (issue 11: each its own class, used through its public members only, which
``tests/test_structure.py`` checks): :class:`Worker` is the script's handle and runs the step
loop; it holds the process group's lifecycle (:class:`ftrun.group.TrainingGroup`), the control
client (:class:`ftrun.control.ControlClient`), the state registry
(:class:`ftrun.registry.StateRegistry`), the recovery (:class:`ftrun.recovery.Recovery`, sharing
the loop's :class:`ftrun.recovery.RankProgress`), this rank's checkpoints
(:class:`ftrun.shards.RankCheckpoints`), and the gradient reducers (:mod:`ftrun.reducer`).
"""

from __future__ import annotations

import contextlib
import faulthandler
import hashlib
import os
import signal
import sys
import threading
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.distributed as dist

from .control import ControlClient, open_channel
from .errors import RecoverableError, describe
from .faults import FaultInjector
from .group import GroupDown, TrainingGroup  # noqa: F401  (GroupDown: ftrun.worker.GroupDown, documented)
from .policy import INITIAL, NO_STATE
from .protocol import Message, MsgType
from .optim import FTOptimizer
from .recovery import RankProgress, Recovery
from .reducer import GradientReducer
from .shards import RankCheckpoints
from .registry import StateRegistry
from .transfer import RNGState

BUCKET_BYTES = 25 << 20  # gradient all-reduce bucket (DDP's default cap)


UCE_REPORT_WAIT_S = 2.0  # how long a rank repairing in place waits for the supervisor's abort
DUMP_SIGNAL = signal.SIGUSR1  # the supervisor asks a hung rank for its Python stacks with this
ORPHAN_SIGNAL = signal.SIGUSR2  # the kernel sends it to a library rank when its supervisor dies


class GroupFailure(RuntimeError):
    """A collective on ftrun's process group failed (recorded, then recovered by :meth:`Worker.steps`)."""


_worker: "Worker | None" = None
_report_channel: Any = None  # ftrun.channel.Channel of a script that only reports


def _env_int(name: str, default: int) -> int:
    value = os.environ.get(name)
    return int(value) if value not in (None, "") else default


def report(step: int, **metrics: Any) -> None:
    """Report the step just finished and metrics to the console (no-op outside ftrun)."""
    global _report_channel
    if _worker is not None:
        _worker.report(step, **metrics)
        return
    if _report_channel is None:
        world = _env_int("WORLD_SIZE", 1)
        _report_channel = open_channel(False, list(range(world)), _env_int("FTRUN_GENERATION", 0))
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


def step_seed(seed: int, step: int, rank: int) -> int:
    """The seed of (seed, step, rank): 63 bits of a SHA-256, independent of Python's hash salt."""
    digest = hashlib.sha256(f"ftrun:{seed}:{step}:{rank}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)


def seed_everything(seed: int) -> None:
    """Seed torch (CPU and CUDA), numpy and ``random``."""
    import random

    import numpy as np

    random.seed(seed)
    np.random.seed(seed % (1 << 32))
    torch.manual_seed(seed)


class Worker:
    """One rank's handle on ftrun. Create it with :func:`init`.

    Attributes:
        rank, world_size, local_rank: as in torch.distributed.
        incarnation: which process serving this rank (0 = first).
        generation: the process group's generation (bumped at every reconfiguration).
        committed: the last step whose optimizer update finished here (-1: the initial state,
            before any update; -2: no usable state yet, e.g. a respawned rank before its transfer).
        device: the device tensors should live on (``cuda:LOCAL_RANK`` with NCCL, else CPU).
    """

    def __init__(self, backend: str | None, replica_groups: Sequence[Sequence[int]] | None, seed: int | None) -> None:
        self.progress = RankProgress()  # committed step, generation, current step (ftrun.recovery)
        self.world_size = _env_int("WORLD_SIZE", 1)
        self.seed = seed
        self.pg_timeout = float(os.environ.get("FTRUN_PG_TIMEOUT", "300"))
        self.cluster_timeout = float(os.environ.get("FTRUN_CLUSTER_TIME_OUT", "600"))
        self.backend = backend or ("nccl" if torch.cuda.is_available() else "gloo")
        self._replica_groups_arg = replica_groups
        self.replica_groups = [list(g) for g in replica_groups] if replica_groups else [list(range(self.world_size))]
        self.registry = StateRegistry()  # the registered state, by kind (ftrun.registry)
        # The default process group, generation after generation (ftrun.group).
        self.group = TrainingGroup(self.backend, self.world_size, self.pg_timeout, self.cluster_timeout)
        self._private_group: Any = None
        self.uce = os.environ.get("FTRUN_UCE", "1") == "1"
        self.ttp = os.environ.get("FTRUN_TTP", "1") == "1"
        self._orphaned = False  # the supervisor (this process's parent) died: see _watch_parent
        # Checkpoints (TTP): where, how often.
        self.save_steps = _env_int("FTRUN_SAVE_STEPS", 0)
        self.checkpoints = RankCheckpoints(os.environ.get("FTRUN_CHECKPOINT_DIR") or None, self.replica_groups, self._send)
        # What this rank says to its supervisor and hears back (ftrun.control).
        self.control = ControlClient()
        self.control.on_abort = self._report_abort
        self.control.on_io_abort = self._on_io_abort
        # Its part in recoveries (ftrun.recovery), over the roles above.
        self.recovery = Recovery(self.progress, self.group, self.control, self.registry,
                                 build_group=self._build_group, safe_point=self._recovery_safe_point, seed=seed,
                                 check_replicas=self._compare_replicas)
        self.recoverable_names = {n.strip() for n in os.environ.get("FTRUN_RECOVERABLE_ERRORS", "").split(",") if n.strip()}
        self._in_collective = False
        self._waiting = threading.Event()  # set while the training thread waits for an all-reduce
        self._reducers: list[GradientReducer] = []
        self._pending_uce: str | None = None  # a recoverable error raised inside backward
        # Exactly-once checks (ftrun.digest, issue 20): the fingerprint of this rank's local
        # gradient of the step last computed, what a detected divergence does, and those found.
        self._local_gradient: tuple[int, str] | None = None
        self.on_divergence = os.environ.get("FTRUN_ON_DIVERGENCE", "warn")
        self.divergences: list[tuple[int, str, str]] = []  # (step, check, reason)
        # ftrun check (ftrun.check): a trace of this process's run, written at finish().
        trace_dir = os.environ.get("FTRUN_CHECK_TRACE")
        self._trace: dict[str, Any] | None = None if not trace_dir else {
            "dir": trace_dir, "steps": {}, "epochs": [], "sections": []}
        # Epoch loops and data (ft.epochs / ft.batches, ftrun.data) and this rank's own state kept
        # in the job's store for its next incarnation (ftrun.rankstate).
        self._progress: Any = None  # ftrun.data.EpochProgress once an epoch loop runs
        self._epochs_stop: int | None = None
        self._resume_step: int | None = None  # where a pass starts after a resume or a join
        self._next_step = 0
        self._epoch_stash: dict[str, Any] | None = None
        self._pass_end_rng: dict[str, Any] | None = None  # the RNG streams when the epoch's pass ended
        self._rank_states: Any = None  # ftrun.rankstate.RankStateStore
        self._section: tuple[str, float | None] | None = None  # (name, timeout) of an open ft.section()
        self._last_report: tuple[int, dict[str, Any]] = (0, {})  # the last ft.report(), re-sent by sections
        self._error: str | None = None
        self._error_kind = "comm"  # what kind of fault _error is: comm, recoverable
        self._first_step = 0  # the job's first step (DDP's one-bucket iteration)
        # A hot spare (docs/hot_spares.md) runs this set-up without a rank: the rank's identity is
        # bound at its promotion, when the script reaches its loop or first asks for it.
        self._rank: int | None = None
        self.hot_spare = os.environ.get("FTRUN_HOT_SPARE") == "1"
        self.promoted_at: str | None = None  # a hot spare: what was waiting for the rank at its promotion
        # Per-rank RNG streams are this rank's own (rank state); with a seed they are reseeded every
        # step from (seed, step, rank) anyway.
        self.register("rng", RNGState(), kind="rank")
        if self.hot_spare:
            # Until its promotion it is what a respawned rank is before its transfer: no state, no
            # group, no initial broadcast; its identity is unknown.
            self.managed, self.joining, self.committed = True, True, NO_STATE
            self.resume_dir = None
            self.faults = FaultInjector([], -1, -1, -1)
            return
        self._bind_rank()
        if self.world_size > 1 and not self.joining:
            self.committed = NO_STATE  # until the group stands: an abort may overtake the build
            if self._build_group(self.generation):
                self.committed = INITIAL
            else:
                self._error = "a rank failed before the process group was built"
                self.group.install_placeholder()
        elif self.joining:
            self.group.install_placeholder()  # its set-up may ask torch.distributed for its rank

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

    def _bind_rank(self) -> None:
        """Take this process's identity from the environment (at start, or at a hot spare's
        promotion): rank, incarnation, generation, its control channel and fault injection."""
        self._rank = _env_int("RANK", 0)
        self._local_rank = _env_int("LOCAL_RANK", 0)
        self._incarnation = _env_int("FTRUN_INCARNATION", 0)
        self.attempt = _env_int("FTRUN_ATTEMPT", _env_int("TORCHELASTIC_RESTART_COUNT", 0))
        self.generation = _env_int("FTRUN_GENERATION", 0)
        self._device = torch.device("cuda", self._local_rank) if self.backend == "nccl" else torch.device("cpu")
        if self._device.type == "cuda":
            torch.cuda.set_device(self._device)
        self._replica_group = self._my_replica_group(self._replica_groups_arg)
        self.faults = FaultInjector.from_env(self._rank, self._incarnation, self.attempt)
        channel = open_channel(True, self._replica_group, self.generation,
                               **({"hot": self.promoted_at} if self.promoted_at is not None else {}))
        self.managed = channel is not None and os.environ.get("FTRUN_ARF", "1") == "1"
        self.group.bind(self._rank, self._incarnation, self.attempt, self.managed)
        self.checkpoints.bind(self._rank)
        # A rank respawned into a running job (ARF) builds no group of its own: it joins the
        # recovery's generation from its first call to steps(), and holds no state until then.
        self.joining = self.managed and (self._incarnation > 0 and self.generation > 0)
        self.committed = NO_STATE if self.joining else INITIAL
        self.recovery.bind(self._rank, self.attempt, self.faults, fresh=self.joining)
        # Checkpoints (TTP): the one to start from (not for a respawned rank, which takes a live
        # replica's newer state).
        self.resume_dir = None if self.joining else (os.environ.get("FTRUN_RESUME_DIR") or None)
        self.faults.cut_connections = self._cut_connections
        self.control.attach(channel, probe=_training_thread_probe(threading.main_thread().ident, self._waiting,
                                                                  self.progress),
                            beat_extra=self._beat_progress)
        if channel is not None:
            # Stacks of every thread into this rank's log when the supervisor suspects a hang.
            faulthandler.register(DUMP_SIGNAL, all_threads=True, chain=False)
            if self.managed:
                self._watch_parent()

    def _watch_parent(self) -> None:
        """Outlive the supervisor long enough for a dying gasp (issue 15; MindIO TTP's idea).

        A rank is spawned to die with its supervisor (``PR_SET_PDEATHSIG``, SIGKILL). A library
        rank trades that for :data:`ORPHAN_SIGNAL`, whose handler only sets a flag: at its next
        safe point (a step boundary, or its recovery loop) the rank writes its replica group's
        shard of its last committed step, if it is the group's writer, and exits
        (:meth:`_gasp_orphaned`); the launcher, which outlives the supervisor, waits for that,
        completes the checkpoint and ends whatever is left. The switch happens after the
        handler is installed, so the old signal covers the moment before; a parent already
        gone by then is noticed by its pid."""
        if threading.current_thread() is not threading.main_thread():
            return
        from .procs import set_death_signal

        parent = os.getppid()

        def on_orphaned(_signum: int, _frame: Any) -> None:
            self._orphaned = True

        signal.signal(ORPHAN_SIGNAL, on_orphaned)
        if set_death_signal(ORPHAN_SIGNAL) and os.getppid() != parent:
            self._orphaned = True

    def _check_orphaned(self, mid_step: bool) -> None:
        """At a safe point: if the supervisor died, write the dying gasp and exit (never returns
        then). ``mid_step``: called while a failed step is being recovered (its body's changes
        to rank and replica objects are undone first)."""
        if self._orphaned:
            self._gasp_orphaned(mid_step)

    def _gasp_orphaned(self, mid_step: bool) -> None:
        """Write this rank's shard of its last committed step with an orphan note
        (:func:`ftrun.checkpoint.write_orphan_note`), if TTP is on and this rank is its replica
        group's writer (the lowest rank), then exit with ``128 + ORPHAN_SIGNAL``.

        Every rank reaches the same committed step: a step commits only after an all-reduce all
        ranks entered, and a rank that leaves makes its peers' next all-reduce fail, so they
        recover and gasp with the step they hold."""
        line = f"ftrun: rank {self.rank}: the supervisor is gone"
        if mid_step and self.committed >= 0:
            self._roll_back(self.committed, ("rank", "replica"))
        if not self.ttp or self.checkpoints.directory is None:
            line += "; no dying-gasp checkpoint (TTP is off)"
        else:
            line += self.checkpoints.save_orphaned(self.committed, self.state_dict, self.world_size)
        print(line + "; exiting", file=sys.stderr, flush=True)
        sys.stdout.flush()
        os._exit(128 + ORPHAN_SIGNAL)

    def _await_promotion(self, what: str) -> None:
        """A hot spare: block until the agent gives it a rank (:func:`ftrun.spare.take_assignment`),
        then bind it. ``what`` names what needed the rank ("the training loop", or "ft.rank" when
        the script asked in its set-up: the spare then did part of its set-up after promotion,
        as a warm spare does, and the coordinator says so)."""
        from .spare import take_assignment

        self.promoted_at = what
        print(f"ftrun: hot spare (pid {os.getpid()}) waits for a rank at {what}", flush=True)  # into spares.log
        ready = os.environ.get("FTRUN_SPARE_READY")
        if ready:
            Path(ready).touch()  # its agent may now give it a rank
        take_assignment(hot=True)
        self.hot_spare = False
        self._bind_rank()
        if not self.joining:  # promoted outside a recovery (not expected): join as a respawned rank does
            raise RuntimeError("ftrun: a hot spare was promoted without a recovery to join")
        self.group.install_placeholder()

    def _identity(self, what: str) -> None:
        if self._rank is None:
            self._await_promotion(what)

    @property
    def rank(self) -> int:
        """This process's rank (a hot spare waits here for its promotion)."""
        if self._rank is None:
            self._await_promotion("ft.rank")
        return self._rank  # type: ignore[return-value]

    @property
    def local_rank(self) -> int:
        """Its index on its node (a hot spare waits here for its promotion)."""
        self._identity("ft.local_rank")
        return self._local_rank

    @property
    def incarnation(self) -> int:
        """Which process serving this rank (0 = first; a hot spare waits here for its promotion)."""
        self._identity("ft.incarnation")
        return self._incarnation

    @property
    def replica_group(self) -> list[int]:
        """The ranks holding the same state as this one (a hot spare waits here for its promotion)."""
        self._identity("ft.replica_group")
        return self._replica_group

    @property
    def device(self) -> torch.device:
        """Where tensors live: CPU with gloo; ``cuda:LOCAL_RANK`` with NCCL (a hot spare of an NCCL
        job waits here for its promotion: its GPU comes with its rank)."""
        if self._rank is None and self.backend != "nccl":
            return torch.device("cpu")
        self._identity("ft.device")
        return self._device

    # ------------------------------------------------------------------ set-up
    def _my_replica_group(self, groups: Sequence[Sequence[int]] | None) -> list[int]:
        if groups is None:
            return list(range(self.world_size))
        for group in groups:
            if self._rank in group:
                return sorted(int(r) for r in group)
        raise ValueError(f"replica_groups {groups} do not contain rank {self._rank}")

    def _build_group(self, generation: int) -> bool:
        """Build the default process group of ``generation`` (:meth:`ftrun.group.TrainingGroup.build`).
        False if an abort overtook it while this rank waited for its peers."""

        def abandon() -> bool:
            if self._poll_abort(timeout=0.005, newer_than=generation):
                return True
            self._check_orphaned(mid_step=True)
            return False

        if not self.group.build(generation, abandon):
            return False
        if self.managed:
            self.generation = generation
        return True

    def _drop_group(self, broken: bool = True) -> None:
        """Drop the current group (:meth:`ftrun.group.TrainingGroup.drop`): its connections are cut
        and, when ``broken``, the placeholder group stands until the next generation."""
        self.group.drop(self.generation, broken)

    # ------------------------------------------------------------------ registration
    def register(self, name: str, obj: Any, kind: str = "replica") -> Any:
        """Register an object whose ``state_dict``/``load_state_dict`` is part of the training state.

        Args:
            name: its name in the state (unique).
            obj: anything with ``state_dict()``/``load_state_dict()``.
            kind: ``"replica"`` (default: a scheduler, a counter, an EMA...): identical on every
                replica, sent by a donor to a recovering replica; snapshotted at the start of every
                step and rolled back when the step is retried, so work after the update
                (``scheduler.step()``, counters) never runs twice for one step. ``"rank"``: this
                rank's own (a data loader's position, per-rank RNG): rolled back the same way, never
                taken from another rank; a respawned rank gets its predecessor's from the job's
                store (:mod:`ftrun.rankstate`). ``"committed"``: changed only by the optimizer
                update (the model and optimizer, registered by :meth:`wrap_model` and
                :meth:`wrap_optimizer`): sent by donors, not snapshotted.

        Returns:
            ``obj``.

        Raises:
            TypeError: ``obj`` has no ``state_dict``/``load_state_dict``.
            ValueError: an unknown ``kind``.
        """
        return self.registry.register(name, obj, kind)

    def wrap_model(self, model: torch.nn.Module, name: str = "model", ddp: bool = False, **ddp_kwargs: Any) -> torch.nn.Module:
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
            name: its name in the registered state.
            ddp: return ``DistributedDataParallel(model)`` so code relying on DDP (``no_sync()``,
                ``model.module``, DDP's forward hooks) keeps working. That DDP is built over a
                private one-rank process group that survives every regeneration, with a comm hook
                that all-reduces each bucket over ftrun's group (:mod:`ftrun.reducer`); without
                it, hooks on the parameters do the same with DDP's bucket layout, so both paths
                give the same bits. The registered state is the inner module's, so its keys carry
                no ``module.``.
            **ddp_kwargs: passed to ``DistributedDataParallel`` (e.g. ``find_unused_parameters``).

        Returns:
            ``model``, or the DDP wrapping it.
        """
        model.to(self.device)
        self.register(name, model, kind="committed")
        if self.world_size > 1 and not self.joining and self.group.live():
            self._broadcast_initial(model)
        reducer = GradientReducer(
            list(model.parameters()),
            self.world_size,
            before_first_bucket=self._before_first_bucket,
            is_failed=lambda: self._error is not None or self._pending_uce is not None,
            on_hook_error=self._on_hook_error,
            on_failure=self._on_reduce_failure,
            waiting=self._waiting,
            is_first_step=lambda: self.progress.current_step == self._first_step,
            abandon=self.control.abandon,
            on_local_gradient=self._check_local_gradient if self.managed or self.hot_spare else None,
            hold_for_check=lambda: self.on_divergence == "fail" and self._expected_gradient() is not None,
        )
        self._reducers.append(reducer)
        reducer.attach()
        if not ddp:
            return model
        from torch.nn.parallel import DistributedDataParallel

        ddp_kwargs.setdefault("gradient_as_bucket_view", True)
        if not ddp_kwargs["gradient_as_bucket_view"]:
            raise ValueError("ft.wrap_model(ddp=True) needs gradient_as_bucket_view=True (ftrun averages DDP's bucket views in place)")
        wrapped = DistributedDataParallel(model, process_group=self._one_rank_group(), **ddp_kwargs)
        wrapped.register_comm_hook(None, _local_gradients_hook)

        def follow_no_sync(module: Any, _args: Any) -> None:
            # DDP's no_sync() (not only ft.no_sync()) keeps the next backward local, as under DDP.
            reducer.forward_sync = bool(module.require_backward_grad_sync)

        wrapped.register_forward_pre_hook(follow_no_sync)
        return wrapped

    def _broadcast_initial(self, model: torch.nn.Module) -> None:
        """Broadcast rank 0's parameters and buffers; on failure record it (rank 0 keeps INITIAL)."""
        failure: str | None = None
        self.progress.stage = "init"
        try:
            self.faults.point("init", None)
            self._in_collective = True  # an abort (a peer died) releases it at once
            self._release_if_aborted()
            with torch.no_grad():
                for tensor in list(model.parameters()) + list(model.buffers()):
                    dist.broadcast(tensor.data, src=0)
        except Exception as err:  # a peer died: recorded, recovered by steps()
            failure = f"initial broadcast failed: {describe(err)}"
        finally:
            self._in_collective = False
            self.progress.stage = "setup"
        if failure is not None:
            if self.rank != 0:
                self.committed = NO_STATE  # maybe half received: not rank 0's weights
            self._record_error(failure)

    def _one_rank_group(self) -> Any:
        """A process group of this rank alone, independent of ftrun's generations (for DDP)."""
        if self._private_group is None:
            store = dist.HashStore()
            group = dist.ProcessGroup(store, 0, 1)
            if self.device.type == "cuda":
                kind = dist.ProcessGroup.BackendType.NCCL
                backend = dist.ProcessGroupNCCL(store, 0, 1)
            else:
                kind = dist.ProcessGroup.BackendType.GLOO
                backend = dist.ProcessGroupGloo(store, 0, 1, timedelta(seconds=self.pg_timeout))
            group._set_default_backend(kind)
            group._register_backend(self.device, kind, backend)
            self._private_group = group
        return self._private_group

    def wrap_optimizer(self, optimizer: torch.optim.Optimizer, name: str = "optimizer") -> FTOptimizer:
        """Register ``optimizer`` and return a :class:`ftrun.optim.FTOptimizer`: a
        ``torch.optim.Optimizer`` (schedulers, ``GradScaler`` take it) whose ``step()`` applies the
        update only when the step's collectives succeeded."""
        wrapped = FTOptimizer(optimizer, self)
        self.register(name, optimizer, kind="committed")
        return wrapped

    @contextlib.contextmanager
    def no_sync(self) -> Iterator[None]:
        """Accumulate gradients locally in the backward passes inside (DDP's ``no_sync``); the next
        backward outside averages the accumulated gradients."""
        with contextlib.ExitStack() as stack:
            for reducer in self._reducers:
                stack.enter_context(reducer.no_sync())
            yield

    def apply_update(self, update: Callable[[], Any]) -> tuple[bool, Any]:
        """Run ``update`` (the optimizer's step) if the step's collectives succeeded, between
        ``update_begin`` and ``update_end``, and commit the step. Returns (applied, its result)."""
        if self._pending_uce is not None:
            failed, self._pending_uce = self._pending_uce, None
            self._repair_in_place(failed, drop=True)
            return False, None
        if self._error is not None:
            return False, None
        if not self._reducers and self.world_size > 1:  # a model not given to wrap_model
            params = [p for g in self._optimizer_groups() for p in g["params"]]
            if not self.all_reduce_gradients(params):
                return False, None
        step = self.progress.current_step if self.progress.current_step is not None else self.committed + 1
        self._send(MsgType.UPDATE_BEGIN, step=step)
        failed = None
        result = None
        try:
            self.faults.point("optimizer", step)
            result = update()
        except Exception as err:
            if not self.is_recoverable(err):
                raise
            failed = describe(err)
        if failed is not None:  # outside the except block (see _record_error)
            self._repair_in_place(failed, drop=True)
            return False, None
        self.commit(step)
        self._send(MsgType.UPDATE_END, step=step)
        return True, result

    def _optimizer_groups(self) -> list[dict[str, Any]]:
        return [g for name, obj in self.registry.items() if isinstance(obj, torch.optim.Optimizer) for g in obj.param_groups]

    # Callbacks of the gradient reducer (called on the training thread, inside backward).
    def _before_first_bucket(self) -> None:
        self._record_provisional()
        self._send(MsgType.COLLECTIVE, step=self.progress.current_step if self.progress.current_step is not None else -1)
        self._in_collective = True
        self._release_if_aborted()
        try:
            self.faults.point("allreduce", self.progress.current_step)
        except BaseException:
            self._in_collective = False  # raised before this rank communicated: it is in no collective
            raise

    def _on_hook_error(self, err: BaseException) -> bool:
        if isinstance(err, Exception) and self.is_recoverable(err):
            self._pending_uce = describe(err)
            return True
        return False

    def _on_reduce_failure(self, reason: str) -> None:
        self._in_collective = False
        self._record_error(reason)

    def state_dict(self) -> dict[str, Any]:
        """The registered state: ``{name: obj.state_dict()}``."""
        return self.registry.state_dict()

    def replica_state_dict(self) -> dict[str, Any]:
        """What a donor sends: every registered object but this rank's own (kind ``"rank"``)."""
        return self.registry.state_dict(exclude=("rank",))

    def _snapshot_step_start(self) -> None:
        """Copy the state that work after the update changes (kinds ``replica`` and ``rank``) at the
        start of a step, labelled with the committed step it belongs to."""
        own = self.registry.snapshot_step_start(self.committed)
        if self._keeps_rank_records():
            self._rank_states.put(self.committed, own)

    def _keeps_rank_records(self, gradient: bool = False) -> bool:
        """Whether this rank's own state is worth a copy in the store: it runs under ftrun with
        peers, and holds rank state that per-step reseeding does not make up (a data position,
        or RNG streams when no ``seed`` was given). ``gradient``: for its gradient fingerprint,
        which is always kept."""
        if not (self.managed and self.world_size > 1 and self.committed >= INITIAL):
            return False
        if not gradient and self.seed is not None and not self.registry.has_own_rank_state():
            return False
        if self._rank_states is None:
            from .rankstate import RankStateStore

            self._rank_states = RankStateStore(self.group.store(), self.attempt, self.rank)
        return True

    # ------------------------------------------------------------------ exactly-once checks
    def _expected_gradient(self) -> tuple[str, str] | None:
        """What the current step's local gradient must be, if this rank computed it before:
        (fingerprint, who computed it: "its previous try" or "its predecessor")."""
        step = self.progress.current_step
        if step is None:
            return None
        if self._local_gradient is not None and self._local_gradient[0] == step:
            return self._local_gradient[1], "its previous try"
        before = self.recovery.predecessor_gradient
        if before is not None and before[0] == step:
            return before[1], "its predecessor (the process this one replaced)"
        return None

    def _check_local_gradient(self, digest: str) -> bool:
        """At each synced backward (:class:`ftrun.reducer.GradientReducer`): keep the fingerprint of
        the local gradient of the step (in memory, and in the job's store next to the rank state,
        for a respawned successor) and, if the step was computed before, compare. A difference
        means state outside what ftrun restores; it is reported (a ``divergence`` event). Returns
        False only under ``--on_divergence fail``: the step is then held back (never
        communicated) until the coordinator's abort for the dying gasp arrives."""
        step = self.progress.current_step
        if step is None:
            return True
        expected = self._expected_gradient()
        self._local_gradient = (step, digest)
        if self.recovery.predecessor_gradient is not None and self.recovery.predecessor_gradient[0] <= step:
            self.recovery.predecessor_gradient = None
        if self._keeps_rank_records(gradient=True):
            try:
                self._rank_states.put_gradient_digest(step, digest)
            except Exception as err:  # the store is the launcher's; a failed write costs a check only
                print(f"ftrun: rank {self.rank}: could not record its gradient fingerprint: {describe(err)}",
                      file=sys.stderr, flush=True)
        if expected is None or expected[0] == digest:
            return True
        reason = (f"step {step} computed again gave another local gradient than {expected[1]} "
                  f"(fingerprint {digest[:12]} != {expected[0][:12]}): the script carries state ftrun does not restore "
                  "(an unregistered carried tensor, a module-level variable, a random generator "
                  "of its own); register it (README: Porting a script)")
        return self._report_divergence(step, "gradient", reason)

    def _report_divergence(self, step: int, check: str, reason: str, hold: bool = True) -> bool:
        """Tell the coordinator and the rank's log; under ``--on_divergence fail`` and with
        ``hold``, wait for the abort that stops the job (returns False then). Without ``hold``
        (inside a recovery) the coordinator's dying gasp aborts the rank at its next safe point."""
        self.divergences.append((step, check, reason))
        print(f"ftrun: rank {self.rank}: DIVERGENCE at step {step}: {reason}", file=sys.stderr, flush=True)
        self._send(MsgType.DIVERGENCE, step=int(step), check=check, reason=reason)
        if self.on_divergence != "fail" or not self.managed or not hold:
            return True
        deadline = time.monotonic() + 60.0
        while not self._poll_abort(timeout=0.05) and time.monotonic() < deadline:
            pass
        return False

    def _compare_replicas(self, step: int) -> bool:
        """After a recovery's transfers (:class:`ftrun.recovery.Recovery`), on every rank of the new
        generation: all-gather a fingerprint of the parameters and compare it with the lowest
        rank's of this rank's replica group; a difference (a transfer that went wrong, a replica
        that diverged) is reported as a ``divergence``. False if the collective failed (the
        recovery then goes on as after a failed transfer)."""
        if self.world_size == 1:
            return True
        from .digest import fingerprint

        params = [p for name, obj in self.registry.items()
                  if self.registry.kinds[name] == "committed" and isinstance(obj, torch.nn.Module) for p in obj.parameters()]
        raw = bytes.fromhex(fingerprint(params))
        mine = torch.tensor([int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True)],
                            dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        failure = None
        try:
            dist.all_gather(gathered, mine)
        except Exception as err:
            failure = describe(err)
        if failure is not None:
            print(f"ftrun: rank {self.rank}: comparing parameters with its replicas failed: {failure}", file=sys.stderr, flush=True)
            return False
        reference = min(self.replica_group)
        if reference != self.rank and not torch.equal(gathered[reference], mine):
            self._report_divergence(step, "replica_parameters",
                                    f"after the recovery to step {step} its parameters differ from rank {reference}'s, "
                                    "a replica's (a transfer that went wrong, or replicas that diverged before)", hold=False)
        return True

    def _record_provisional(self) -> None:
        """At the step's all-reduce: the rank state after its batch and backward, labelled with the
        step (what a respawned rank needs if its peers commit the step and this rank dies)."""
        step = self.progress.current_step
        if step is None or self.committed != step - 1 or not self._keeps_rank_records():
            return
        from .checkpoint import snapshot

        self._rank_states.put(step, snapshot(self.registry.state_dict(only=("rank",))), provisional=True)

    def _record_epoch_boundary(self) -> None:
        """After an epoch's end, before the next epoch's prologue: this rank's own state, labelled
        with its committed step, for a successor that would start the next epoch (its predecessor's
        epoch end is then in it; :class:`ftrun.rankstate.RankRecord`)."""
        if not self._keeps_rank_records():
            return
        from .checkpoint import snapshot

        self._rank_states.put(self.committed, snapshot(self.registry.state_dict(only=("rank",))), epoch_boundary=True)

    def _apply_rank_record(self) -> None:
        """Load the predecessor's record of this rank's own state, if a recovery fetched one and it
        is not applied yet (a respawned rank; :class:`ftrun.rankstate.RankRecord`)."""
        record = self.recovery.take_rank_record()
        if record is not None:
            self.registry.load(record.state, kinds=("rank",))

    def _roll_back(self, step: int, kinds: tuple[str, ...]) -> bool:
        """Restore the ``kinds`` objects to their state at committed ``step`` if the step-start
        snapshot is that step's (a retried step: its scheduler.step(), counters and data position
        are undone). True if it did."""
        return self.registry.roll_back(step, kinds)

    # ------------------------------------------------------------------ reporting
    def report(self, step: int, **metrics: Any) -> None:
        """Show ``step`` and ``metrics`` on the console (queued; never blocks)."""
        self._last_report = (int(step), _clean_metrics(metrics))
        self._send(MsgType.PROGRESS, step=int(step), metrics=self._last_report[1])

    def _progress_fields(self) -> dict[str, Any]:
        step, metrics = self._last_report
        if self.progress.current_step is not None:
            step = max(step, self.progress.current_step)
        fields: dict[str, Any] = {"step": step, "metrics": metrics}
        if self._section is not None:
            fields["section"], fields["section_timeout"] = self._section
        return fields

    def ping(self) -> None:
        """Tell the watchdog this rank is making progress in long work outside the step loop's
        rhythm (a long evaluation, a large save): the step bound counts from now (NVRx's ``ping``)."""
        self._send(MsgType.PROGRESS, **self._progress_fields())

    @contextlib.contextmanager
    def section(self, name: str, timeout: float | None = None) -> Iterator[None]:
        """A named stretch of work (evaluation, checkpoint writing) bounded by its own ``timeout``
        (seconds; None: unbounded) instead of the step watchdog (NVRx's sections).

        While it is open the rank sends a ``progress`` with ``section``/``section_timeout`` at each
        heartbeat, so the watchdog sees it busy and not stuck; the supervisor kills it as hung
        only after ``timeout`` in the section. Step intervals spanning a section do not feed the
        automatic step bound. Sections do not nest (an inner one replaces the outer's bound).
        """
        previous = self._section
        self._section = (str(name), None if timeout is None else float(timeout))
        self._send(MsgType.PROGRESS, **self._progress_fields())
        if self._trace is not None:
            self._trace["sections"].append({"name": str(name), "committed": self.committed})
        self.faults.point("section", self.committed)
        try:
            yield
        finally:
            self._section = previous
            fields = self._progress_fields()
            fields.setdefault("section", None)
            self._send(MsgType.PROGRESS, **fields)

    def _send(self, msg_type: MsgType, **fields: Any) -> None:
        self.control.send(msg_type, **fields)

    # ------------------------------------------------------------------ collectives
    def all_reduce_gradients(self, params: Sequence[torch.nn.Parameter]) -> bool:
        """Average the gradients of ``params`` over the world. False (error recorded) on failure.

        Gradients are flattened in parameter order into buckets of up to :data:`BUCKET_BYTES`,
        divided by the world size and summed, as DDP does; the layout depends only on the model, so
        every generation reduces in the same order and results stay bitwise reproducible.
        """
        if self.world_size == 1:
            return True
        if self._error is not None:
            return False
        grads = [p.grad for p in params if p.grad is not None]
        failure: str | None = None
        recoverable: str | None = None
        self._send(MsgType.COLLECTIVE, step=self.progress.current_step if self.progress.current_step is not None else -1)
        self._in_collective = True
        self._release_if_aborted()
        try:
            self.faults.point("allreduce", self.progress.current_step)
            for bucket in _buckets(grads, BUCKET_BYTES):
                flat = torch.cat([g.reshape(-1) for g in bucket]) if len(bucket) > 1 else bucket[0].reshape(-1).clone()
                flat.div_(self.world_size)
                dist.all_reduce(flat)
                offset = 0
                for g in bucket:
                    g.copy_(flat[offset : offset + g.numel()].view_as(g))
                    offset += g.numel()
        except Exception as err:  # gloo/NCCL raise RuntimeError subclasses; any of them breaks the step
            failure = f"gradient all-reduce failed: {describe(err)}"
            recoverable = describe(err) if self.is_recoverable(err) else None  # no reference kept
        finally:
            self._in_collective = False
        if recoverable is not None:
            self._repair_in_place(recoverable, drop=True)
            return False
        if failure is not None:
            # Outside the except block: its traceback would keep the group alive (DESIGN.md).
            self._record_error(failure)
            return False
        return True

    def _cut_connections(self) -> None:
        """Shut the connections of ftrun's process group down (:meth:`ftrun.group.TrainingGroup.cut`)."""
        self.group.cut()

    def _beat_progress(self) -> dict[str, Any] | None:
        """On the I/O thread, at each heartbeat: a ``progress`` while a section is open."""
        return self._progress_fields() if self._section is not None else None

    def _on_io_abort(self, generation: int) -> None:
        """On the channel's I/O thread, for each abort: one for a newer generation makes every wait
        of the training thread give up, and releases it from a collective it is blocked in (a hung
        peer, a communication stall) by cutting the group's connections; the collective then
        fails at once and the step loop recovers."""
        if self.managed and generation > self.generation:
            self.control.abandon.set()
            if self._in_collective:
                self._cut_connections()

    def _release_if_aborted(self) -> None:
        """Entering a collective after an abort already arrived (the peer died while this rank was
        still computing): nobody will release it later, so its connections are cut now and the
        collective fails at once (set ``_in_collective`` first: the I/O thread checks it after it
        records the abort, so one of the two always sees the other)."""
        if self.managed and self.control.io_aborted_beyond(self.generation):
            self._cut_connections()

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
        if not isinstance(err, Exception) or not self.is_recoverable(err):
            return False
        self._repair_in_place(describe(err), drop=False)
        return True

    def _repair_in_place(self, error: str, drop: bool) -> None:
        """Record a recoverable error (``"Type: message"``): this rank's state is suspect, so it
        takes a replica's (UCE). ``drop``: tear the group down now (never inside an ``except``)."""
        self._error = f"recoverable error at step {self.progress.current_step}: {error}"
        self._error_kind = "recoverable"
        self.committed = NO_STATE
        print(f"ftrun: rank {self.rank}: {self._error}; repairing in place", file=sys.stderr, flush=True)
        # Report before anything breaks the peers' collectives, and give the supervisor a moment to
        # answer: otherwise a peer's "collective failed" can reach it first and the round is taken
        # for a communication error. (Once the abort is here, _recover sends no second report.)
        self._send(MsgType.FAULT, generation=self.generation, step=self.progress.current_step or -1,
                   committed=self.committed, reason=self._error, kind="recoverable")
        deadline = time.monotonic() + UCE_REPORT_WAIT_S
        while not self._poll_abort(timeout=0.01) and time.monotonic() < deadline:
            pass
        if drop:
            self._drop_group()

    def _record_error(self, reason: str) -> None:
        """Record a failed collective and tear the group down at once.

        Must be called outside any ``except`` block: the exception's traceback keeps the group
        alive, and peers blocked on us then wait for the full timeout instead of the few
        milliseconds it takes once our sockets close (DESIGN.md, gloo facts).
        """
        self._error = reason
        self._drop_group()

    # ------------------------------------------------------------------ the step loop
    def steps(self, num_steps: int, start: int = 0) -> Iterator[int]:
        """Yield step numbers ``start .. num_steps-1``; failed steps are recovered and retried.

        A respawned rank first recovers (receives its state) and starts at the recovery step + 1.
        Each step is a :class:`Step`: an ``int`` that is also a context manager; ``with step:``
        around the step's body lets a :class:`RecoverableError` raised there be repaired in place.
        Leaving the loop early (``break``) ends it cleanly, as its end does.
        """
        self._first_step = start
        step = self._enter_loop(start)
        try:
            for step_, _ in self._step_loop(step, num_steps, None):
                yield step_
        except GeneratorExit:
            self._send(MsgType.STEPS_END)
            raise
        self._send(MsgType.STEPS_END)

    def epochs(self, first: int, stop: int) -> Iterator[int]:
        """Yield epoch numbers ``first .. stop-1`` for an epoch loop over :meth:`batches`.

        The epoch is replica state (:class:`ftrun.data.EpochProgress`, registered as ``"epochs"``):
        a respawned rank recovers here, before its first epoch, and starts in the epoch its donor
        is in, so work done after an epoch's last step (evaluation, ``scheduler.step()``) is not
        repeated. A recipient whose donor was already an epoch ahead (it repaired a recoverable
        error on an epoch's last step) runs that epoch's end once, and the state it received (model,
        optimizer, replica objects) is then put back, so the end's effects count once.
        """
        from .data import EpochProgress

        if self._progress is None:
            self._progress = EpochProgress()
            self.register("epochs", self._progress)
        progress = self._progress
        self._epochs_stop = stop
        self._first_step = progress.step
        self._resume_step = self._enter_loop(progress.step)
        record = self.recovery.pending_rank_record()
        if record is not None and (record.provisional or record.epoch_boundary) and self._resume_step == progress.step:
            # A respawned rank starting at an epoch's first step with its predecessor's state from
            # the previous epoch's last all-reduce or end: apply it before the epoch's prologue (the
            # code between ft.epochs and ft.batches: resetting a hidden state, set_epoch, a draw),
            # which this rank now runs as its predecessor did. Applied after it, it would undo it.
            self._apply_rank_record()
            if record.provisional and progress.end_moved_rng:
                # Its predecessor died before the end of the previous epoch was over (or before it
                # recorded it); that end moved the random streams on its replicas, so it would have
                # moved this rank's too, by draws no one recorded.
                self._report_divergence(
                    max(progress.step - 1, 0), "epoch_end_rng",
                    f"rank {self.rank} replaces a process that died after step {progress.step - 1}, an epoch's last, "
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
                if self._trace is not None:
                    self._trace["epochs"].append({"epoch": epoch, "first_step": progress.step})
                self._pass_end_rng = None
                yield epoch
                if self._pass_end_rng is not None:  # the epoch's end has run: did it draw?
                    progress.end_moved_rng = not _same_state(self._pass_end_rng, self.registry["rng"].state_dict())
                    self._pass_end_rng = None
                if self._epoch_stash is not None:  # see above: the donor's state, as received
                    stash, self._epoch_stash = self._epoch_stash, None
                    self.registry.load(stash)
                elif progress.epoch == epoch:
                    progress.epoch = epoch + 1
                    self._record_epoch_boundary()
        except GeneratorExit:
            self._send(MsgType.STEPS_END)
            raise
        self._send(MsgType.STEPS_END)

    def batches(self, loader: Any, name: str = "data") -> Iterator[tuple["Step", Any]]:
        """Yield ``(step, batch)`` for one pass over ``loader``; failed steps are recovered and
        retried with the same batch.

        Args:
            loader: a ``DataLoader`` (with a ``DistributedSampler`` and ``set_epoch`` as usual),
                torchdata's ``StatefulDataLoader``, or any iterable of batches.
            name: the name of its position in the registered rank state.

        ``step`` is the global step (a :class:`Step`), counted across epochs. The position in the
        pass is this rank's own state (:class:`ftrun.data.LoaderCursor`): rolled back with a
        retried step, restored from the job's store for a respawned rank; see :mod:`ftrun.data`.
        Outside :meth:`epochs`, one call is one pass (the loop sends no end-of-loop message).
        """
        from .data import EpochProgress, LoaderCursor

        if self._progress is None:
            self._progress = EpochProgress()
            self.register("epochs", self._progress)
            self._first_step = 0
            self._resume_step = self._enter_loop(0)
        progress = self._progress
        epoch = -1 if progress.epoch is None else progress.epoch
        cursor = LoaderCursor(loader, epoch)
        self.register(name, cursor, kind="rank")
        start = progress.step
        step = start
        if self._resume_step is not None:
            step, self._resume_step = max(start, self._resume_step), None
            cursor.position = step - start
        yield from self._step_loop(step, None, cursor)
        if progress.epoch == epoch or epoch < 0:  # else a recovery brought the donor's later epoch
            progress.step = self._next_step
            from .checkpoint import snapshot

            self._pass_end_rng = snapshot(self.registry["rng"].state_dict())

    def _enter_loop(self, step: int) -> int:
        """Before the first step: resume from a checkpoint, or join the job (a respawned rank), or
        recover from a failed initial broadcast. Returns the first step to run."""
        if self._rank is None:
            self._await_promotion("the training loop")  # a hot spare: its set-up is done
        if self.resume_dir is not None:
            step = max(step, self._resume() + 1)
        if self.joining:
            self.joining = False
            self.control.abort_generation = self.generation  # its hello was its report for this generation
            step = self._recover(None) + 1
        elif self._error is not None:  # the initial broadcast failed
            reason, self._error = self._error, None
            step = self._recover(reason) + 1
        return step

    def _step_loop(self, step: int, total: int | None, cursor: Any) -> Iterator[tuple["Step", Any]]:
        """The step loop shared by :meth:`steps` and :meth:`batches`: run steps from ``step`` up to
        ``total`` (or until ``cursor``'s loader is exhausted), recovering and retrying failed ones.
        :attr:`_next_step` is the step after the last one run, when it ends."""
        self._next_step = step
        while total is None or step < total:
            self._check_orphaned(mid_step=False)
            if self._poll_abort():
                step = self._recover(None) + 1
                if cursor is not None and self._after_recovery_epoch_moved(cursor):
                    self._next_step = step
                    return
                continue
            # A respawned rank: its predecessor's own state, where the predecessor's next step
            # began (or would have: after the pass's last step it goes on to the epoch's end).
            self._apply_rank_record()
            if cursor is not None and cursor.exhausted():
                break
            self.faults.point("before_forward", step)
            self.progress.current_step, self.progress.stage = step, "loop"
            self._send(MsgType.STEP_BEGIN, step=step, total=total if total is not None else self._loop_total(cursor))
            if self.seed is not None:
                seed_everything(step_seed(self.seed, step, self.rank))
            if self.managed:
                self._snapshot_step_start()
            batch = None
            if cursor is not None:
                try:
                    batch = cursor.next()
                except StopIteration:
                    break
            yield Step(step, self, cursor.position - 1 if cursor is not None else None), batch
            self._in_collective = False
            if self._pending_uce is not None:  # raised in backward, and no opt.step() followed
                failed, self._pending_uce = self._pending_uce, None
                self._repair_in_place(failed, drop=True)
            if self._error is None and self.committed == step - 1:
                # The body ended well without an update (GradScaler skipped it, or no step()
                # was called): the state is that of this step all the same.
                self.commit(step)
                self._send(MsgType.UPDATE_END, step=step)
            if self._error is not None or (self.managed and self.control.abort_generation is not None):
                reason, self._error = self._error, None
                step = self._recover(reason) + 1
                self._next_step = step
                if cursor is not None and self._after_recovery_epoch_moved(cursor):
                    return
                continue
            if self.save_steps and (step + 1) % self.save_steps == 0 and self.committed == step:
                self.checkpoints.save_periodic(step, self.state_dict)
            self.faults.point("between_steps", step)
            step += 1
            self._next_step = step
        self._next_step = step

    def _loop_total(self, cursor: Any) -> int | None:
        """The run's last step + 1 as far as it is known (shown on the console): the end of the
        epoch loop if every epoch is as long as this one, else the end of this pass."""
        try:
            length = len(cursor.loader)
        except TypeError:
            return None
        progress = self._progress
        epochs_left = 1
        if progress is not None and progress.epoch is not None and self._epochs_stop is not None:
            epochs_left = max(1, self._epochs_stop - progress.epoch)
        return (progress.step if progress is not None else 0) + length * epochs_left

    def _after_recovery_epoch_moved(self, cursor: Any) -> bool:
        """After a recovery inside a pass: whether the donor's epoch is past this pass's (then the
        pass ends here, and :meth:`epochs` puts the received replica state back after the
        epoch's end ran)."""
        progress = self._progress
        if progress is None or progress.epoch is None or cursor.epoch < 0 or progress.epoch == cursor.epoch:
            return False
        from .checkpoint import snapshot

        # Everything but this rank's own state: the epoch's end may change the optimizer too
        # (``scheduler.step()`` sets its learning rates), not only registered replica objects.
        self._epoch_stash = snapshot(self.registry.state_dict(exclude=("rank",)))
        return True

    def _poll_abort(self, timeout: float = 0.0, newer_than: int | None = None) -> bool:
        """Take supervisor messages; True once an abort for a generation newer than
        ``newer_than`` (default: the current one) is pending."""
        self.control.poll(timeout)
        return self.control.aborted_beyond(self.generation if newer_than is None else newer_than)

    def _report_abort(self, msg: Message) -> None:
        """An abort for a newer generation, taken on the training thread: report where this rank
        stands (its step and committed step) to the supervisor."""
        self._send(MsgType.FAULT, generation=msg["generation"], step=self.progress.current_step or -1,
                   committed=self.committed, reason=msg["reason"], kind="abort")

    def _recover(self, reason: str | None) -> int:
        """Reconfigure after a fault (:meth:`ftrun.recovery.Recovery.recover`); returns the
        recovery step S (training resumes at S + 1).

        Raises:
            GroupFailure: this rank runs without a supervisor (plain torchrun), so it cannot recover.
        """
        if not self.managed:
            raise GroupFailure(reason or "collective failed")
        kind, self._error_kind = self._error_kind, "comm"
        return self.recovery.recover(reason, kind)

    def _recovery_safe_point(self) -> None:
        """On every turn of a recovery's wait: exit with a dying gasp if the supervisor is gone,
        write a dying-gasp checkpoint the supervisor asked for."""
        self._check_orphaned(mid_step=True)
        if self.control.save_request is not None:
            self._save_dying_gasp()

    # ------------------------------------------------------------------ checkpoints (TTP)
    def _resume(self) -> int:
        """Load this rank's shard of the checkpoint the supervisor chose; returns its step."""
        started = time.monotonic()
        directory, self.resume_dir = Path(self.resume_dir or ""), None
        self.registry.load(self.checkpoints.resume(directory))
        self.committed = _env_int("FTRUN_RESUME_STEP", -1)
        print(f"ftrun: rank {self.rank} resumed from {directory} (step {self.committed}) in "
              f"{time.monotonic() - started:.2f} s", flush=True)
        return self.committed

    def _save_dying_gasp(self) -> None:
        """Write this rank's shard of the step the supervisor names (TTP), at a safe point: the
        group is down and the state is exactly that of the committed step."""
        req = self.control.take_save_request()
        assert req is not None
        self.checkpoints.save_requested(req, self.committed, self.state_dict())

    def commit(self, step: int) -> None:
        """Mark ``step`` committed (called by the optimizer wrapper after its update)."""
        self.committed = step
        if self._trace is not None:
            from .digest import fingerprint

            self._trace["steps"][str(step)] = [fingerprint([p]) for _, p in self._traced_parameters()]

    def _traced_parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter of the registered models, named
        ``<registered name>.<parameter name>`` (what ``ftrun check`` compares)."""
        return [(f"{name}.{pname}", p) for name, obj in self.registry.items()
                if self.registry.kinds[name] == "committed" and isinstance(obj, torch.nn.Module)
                for pname, p in obj.named_parameters()]

    def _write_trace(self) -> None:
        """ftrun check: write this process's trace (per committed step, a fingerprint of each
        parameter; the epochs' first steps; the sections; the divergences it found) as JSON."""
        import json

        trace = self._trace
        assert trace is not None
        doc = {"rank": self.rank, "incarnation": self.incarnation, "committed": self.committed,
               "names": [n for n, _ in self._traced_parameters()], "steps": trace["steps"],
               "epochs": trace["epochs"], "sections": trace["sections"],
               "divergences": [{"step": s, "check": c, "reason": r} for s, c, r in self.divergences]}
        directory = Path(trace["dir"])
        directory.mkdir(parents=True, exist_ok=True)
        path = directory / f"trace_rank{self.rank}_inc{self.incarnation}.json"
        path.with_suffix(".tmp").write_text(json.dumps(doc))
        path.with_suffix(".tmp").replace(path)

    def finish(self) -> None:
        """Say the rank is done, wait for every other rank to be done too, then tear the group
        down and close the channel.

        The wait is a finish barrier: until every rank has called ``finish()``, this rank keeps its
        final state and answers recoveries, so a rank that dies after its last step (in its
        epilogue: evaluation, saving) is respawned, takes the final state from a replica waiting
        here, and runs its epilogue, instead of the job training again from scratch (issue 15).
        """
        global _worker
        self.faults.point("finish", self.committed)
        if self._trace is not None:
            self._write_trace()
        self.checkpoints.close()  # the last periodic checkpoint is written before we leave
        self._send(MsgType.DONE, committed=self.committed)
        self._drop_group(broken=False)
        if self.control.channel is not None and self.managed:
            self._finish_barrier()
        self.control.close()
        _worker = None

    def _finish_barrier(self) -> None:
        """Serve aborts and plans (as a donor, usually) until the coordinator says every rank finished."""
        self.control.finished = False
        while not self.control.finished:
            self._check_orphaned(mid_step=False)
            if self.control.save_request is not None:
                self._save_dying_gasp()
            if self._poll_abort(timeout=0.5):
                self._recover(None)  # the abort already carried this rank's report
                self._drop_group(broken=False)


class Step(int):
    """A step number (an ``int``) that guards the step's body when used as ``with step:``.

    A :class:`RecoverableError` (or a type named in ``--recoverable_errors``) raised inside the
    block does not end the process: the exception is suppressed, the rank reports it, drops its
    state, takes a replica's, and every rank retries the step (MindSpore's UCE). Any other
    exception propagates, the process dies, and ARF replaces it.
    """

    _worker: Worker
    index: int | None  # the batch's place in its pass (ft.batches), counted from 0; else None

    def __new__(cls, value: int, worker: Worker, index: int | None = None) -> "Step":
        obj = super().__new__(cls, value)
        obj._worker = worker
        obj.index = index
        return obj

    def __enter__(self) -> "Step":
        return self

    def __exit__(self, exc_type: type | None, exc: BaseException | None, _tb: Any) -> bool:
        return exc is not None and self._worker.repair_step_error(exc)


def _same_state(a: Any, b: Any) -> bool:
    """Whether two state_dicts (nested dicts, lists, tensors, arrays, numbers) are equal, bitwise."""
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same_state(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b)
    if hasattr(a, "shape") and hasattr(b, "shape"):  # numpy arrays
        import numpy as np

        return bool(np.array_equal(a, b))
    return bool(a == b)


def _local_gradients_hook(_state, bucket):  # type: ignore[no-untyped-def]  # DDP checks annotations
    """DDP comm hook that communicates nothing: its bucket views are the ``.grad`` tensors that
    ftrun's reducer averages in place (see :mod:`ftrun.reducer`)."""
    fut: torch.futures.Future = torch.futures.Future()
    fut.set_result(bucket.buffer())
    return fut


def _training_thread_probe(thread_id: int | None, waiting: threading.Event | None = None,
                           progress: RankProgress | None = None) -> Callable[[], dict[str, Any]]:
    """A heartbeat probe: whether the training thread is inside a torch.distributed call now.

    The I/O thread looks at the training thread's innermost Python frames
    (``sys._current_frames``): a rank blocked in a collective sits in ``torch/distributed``; a
    rank stuck in its own code (an endless loop, a deadlock) does not, even if it had announced
    the collective. That separates the culprit of a stalled job from the peers waiting for it.
    ``waiting`` is set by the gradient reducer while it waits for its asynchronous all-reduces
    (``Work.wait()`` runs no Python frame inside torch/distributed). With ``progress``, the
    heartbeat also says which stage of ftrun's flow the training thread is in
    (:attr:`RankProgress.stage`) and the bytes that stage moves: a rank stuck in its own code during
    a recovery or the initial broadcast, while its peers wait for it in torch.distributed, is then
    found within seconds.
    """
    marker = os.sep + os.path.join("torch", "distributed") + os.sep

    def in_dist() -> bool:
        if waiting is not None and waiting.is_set():
            return True
        frame = sys._current_frames().get(thread_id) if thread_id is not None else None
        depth = 0
        while frame is not None and depth < 8:
            if marker in frame.f_code.co_filename:
                return True
            frame, depth = frame.f_back, depth + 1
        return False

    def probe() -> dict[str, Any]:
        if progress is None:
            return {"in_dist": in_dist()}
        return {"in_dist": in_dist(), "stage": progress.stage, "stage_bytes": progress.stage_bytes}

    return probe


def _buckets(tensors: Sequence[torch.Tensor], cap: int) -> Iterator[list[torch.Tensor]]:
    bucket: list[torch.Tensor] = []
    size = 0
    for t in tensors:
        nbytes = t.numel() * t.element_size()
        if bucket and (size + nbytes > cap or t.dtype != bucket[0].dtype):
            yield bucket
            bucket, size = [], 0
        bucket.append(t)
        size += nbytes
    if bucket:
        yield bucket


def init(backend: str | None = None, replica_groups: Sequence[Sequence[int]] | None = None, seed: int | None = None) -> Worker:
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

    Returns:
        The :class:`Worker` (one per process; later calls return the same one).

    Raises:
        ValueError: ``replica_groups`` does not contain this rank.
    """
    global _worker
    if _worker is None:
        _worker = Worker(backend, replica_groups, seed)
    return _worker
