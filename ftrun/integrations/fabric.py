"""Rank-level recovery for training loops written with Lightning Fabric: :class:`FTFabric`.

The port of a Fabric loop (docs/frameworks/fabric.md; ``examples/fabric_loop.py``)::

    ft = ftrun.init()                                        # before Fabric
    fabric = FTFabric(accelerator="cpu", devices=4, strategy="ddp")   # in place of Fabric
    fabric.launch()
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    train_loader, eval_loader = fabric.setup_dataloaders(train_loader, eval_loader)
    evaluate = fabric.recoverable(evaluate)                  # work with collectives after a step
    for epoch in ft.epochs(0, epochs):                       # in place of range(epochs)
        for i, batch in enumerate(fabric.train_batches(train_loader, accum)):   # in place of train_loader
            is_accumulating = (i + 1) % accum != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                ...                                          # forward, fabric.backward: unchanged
            if not is_accumulating:
                ...                                          # clip_gradients, optimizer.step(), scheduler.step(): unchanged
                completed_steps = fabric.completed_steps     # in place of += 1
                ...                                          # logging, evaluate(completed_steps)
    ft.finish()

Why a ``Fabric`` subclass and not a strategy passed as ``strategy=``: a Fabric loop is the
script's own, so what ftrun needs from it (which micro-batches make a step, which work after a step
may be run again, the step count a respawned rank resumes with) must be said in the loop; a
strategy has no door the loop sees (the script would reach into ``fabric.strategy``), and a
strategy object would make the script spell out the DDP settings ``strategy="ddp"`` gives. So
``FTFabric`` takes ``Fabric``'s arguments unchanged, as ``FTAccelerator`` takes ``Accelerator``'s,
and under ftrun makes the ``DDPStrategy`` Fabric's connector built an :class:`FTDDPStrategy` (the
strategy's doors: ``setup_module``, ``setup_optimizer``, ``optimizer_step``).

Under torchrun, or as one process, :class:`FTFabric` is ``Fabric``: its overrides do nothing,
``train_batches`` is the loader, ``recoverable`` returns the function and ``completed_steps``
counts ``optimizer.step()`` calls. Under ftrun a rank that dies is respawned alone and the loop
ends with the parameters of the run without the fault, bitwise:

- ``setup`` gives the model as ``ft.wrap_model(module, ddp=True, **the strategy's DDP keywords)``
  (its buckets averaged over ftrun's group during the last micro-batch's backward, bitwise as
  Fabric's DDP), inside Fabric's ``_FabricModule``; the optimizer as ``ft.wrap_optimizer(...)``
  inside Fabric's ``_FabricOptimizer`` (the update is applied only if the step's collectives
  succeeded); the scheduler given to ``setup(..., scheduler=...)`` registered as replica state
  (rolled back with a retried step). Each loader from ``setup_dataloaders`` keeps Fabric's
  ``DistributedSampler`` (its order is a function of the seed and the pass); its pass counter
  (what Fabric gives ``set_epoch`` at each ``iter()``) is registered as replica state.
- ``train_batches(loader, accumulate)`` drives ftrun's step loop (``ft.batches``) over the loader's
  micro-batches grouped by ``accumulate`` from the pass's start (the pass's last micro-batch closing
  a shorter group): one ftrun step per optimizer step. A respawned rank starts at its replicas'
  step and place in the pass (:mod:`ftrun.rank.data`); its micro-batch index (``enumerate``) counts from
  there, so ``(i + 1) % accumulate`` still says where a micro-batch is in its step.
- A failed step (a peer died in its gradient all-reduce) is retried inside ``optimizer.step()``:
  the loop's code after it (scheduler, logging, evaluation) runs once, after the update. Fabric's
  loop holds no closure to run the step again, so ``fabric.backward`` of a step's last micro-batch
  keeps its autograd graph (``retain_graph=True``) and, before it, the gradients the earlier
  micro-batches accumulated and the random streams. ``optimizer.step()`` then recovers (ftrun's
  step loop: the coordinator's plan, the new group, state to the new rank, which runs the step's
  micro-batches from the start), puts those gradients and streams back, runs that backward again
  (its all-reduce with the new rank's), clips again as the loop did (the norm it returned is
  updated in place) and applies the update (as ``FTStrategy`` runs Lightning's closure again).
- ``recoverable(fn)``: ``fn`` runs collectives of its own after a step (an evaluation's
  ``fabric.all_reduce``, ``fabric.barrier``). Its start is a snapshot of the step's state; a fault
  in it is recovered, the state rolled back to that snapshot, and ``fn`` run again with the new
  rank, which runs it first, before its first step (a marker in the replica state says so). As in
  :mod:`ftrun.integrations.accelerate`.

A model sharded with FSDP2 (HSDP, docs/frameworks/fabric.md "FSDP2 and HSDP") goes through Fabric's
``ModelParallelStrategy``: with the mesh declared at ``ftrun.init(mesh_shape=, mesh_dim_names=)``
the strategy becomes an :class:`FTMeshStrategy` (under torchrun too), whose ``parallelize_fn`` gets
``ft.device_mesh()``; under ftrun an :class:`FTShardedStrategy`, whose model is
``ft.wrap_model(sharded model)`` (its local shards are its state). FSDP's collectives raise inside
the forward, ``fabric.backward`` and ``clip_gradients``; ``FTFabric`` recovers there: the forward
returns its output detached (:class:`_Forward`), ``fabric.backward`` runs the loss's backward down
to it and then the model's from the gradient it got, and a retry runs the forward again before
the model's backward, so the survivors' collectives come in the order of the respawned rank's,
which runs the step from its start. One micro-batch a step.

The contract (docs/frameworks/fabric.md): ``ftrun.init()`` before ``FTFabric``; ``strategy="ddp"`` (or ``"auto"``, which
picks it for several devices) or ``ModelParallelStrategy`` on ftrun's mesh, no ``GradScaler``
(``16-mixed``), one model and one optimizer; the scheduler given to
``setup(..., scheduler=...)`` and stepped after ``optimizer.step()``; the training loader iterated
through ``train_batches`` inside ``ft.epochs``, with ``optimizer.step()`` at each step's last
micro-batch (``(i + 1) % accumulate == 0`` or the pass's end) and ``fabric.backward`` for that
micro-batch's loss; the forward is a function of its inputs, the parameters and the global RNG
streams; work after a step that makes collectives is called through ``recoverable`` with plain
arguments (numbers, strings). Cost: a step's last micro-batch's graph lives until the script drops
its loss (the next micro-batch's forward, usually): one micro-batch's activations more at peak.
"""

from __future__ import annotations

import math
import os
import sys
from typing import Any, Callable, Iterator

import torch
from lightning.fabric import Fabric
from lightning.fabric.strategies import DDPStrategy, ModelParallelStrategy, ParallelStrategy
from lightning.fabric.wrappers import _FabricModule

from ftrun.common.contract import RankEnv
from ftrun.errors import describe
from ftrun.integrations.common import END, RecoverableWork, WorkMarker, is_fault, keep_grads, put_grads, until_done
from ftrun.rank.sharding import is_sharded, mesh_coordinates
from ftrun.rank.transfer import RNGState
from ftrun.rank.worker import Worker, current

#: The name of the training pass's position in ftrun's registered rank state.
PASS_NAME = "fabric_pass"


class LoaderState:
    """A set-up loader's pass counter (kind ``replica``: the same on every rank): Fabric's
    ``_FabricDataLoader`` counts its ``iter()`` calls and gives the count to the sampler's
    ``set_epoch`` at each, so a pass's order is a function of it. ``pass_iteration`` is the count
    the training pass under way was drawn with (None outside one), so its iterator can be rebuilt
    mid-pass (a respawned rank) with the same order."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        self.pass_iteration: int | None = None
        self.drawn: int | None = None  # the count this process's live iterator of the pass was drawn with

    def state_dict(self) -> dict[str, Any]:
        return {"iteration": int(self.loader._num_iter_calls),
                "pass_iteration": -1 if self.pass_iteration is None else int(self.pass_iteration)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        iteration = int(state["iteration"])
        pass_iteration = None if int(state["pass_iteration"]) < 0 else int(state["pass_iteration"])
        if pass_iteration is None and self.drawn is not None and self.drawn == iteration:
            # A state from before this pass's first iter() (a step-start snapshot of the pass's
            # first step) while this process's iterator was drawn (a retried first step gets its
            # batches from ftrun's cache, with no new draw): the counter is where that draw left it.
            iteration, pass_iteration = iteration + 1, iteration
        self.loader._num_iter_calls = iteration
        self.pass_iteration = pass_iteration

    def iterate(self) -> Iterator[Any]:
        """``iter(loader)`` for the training pass under way: a new pass takes the current count; the
        same pass iterated again (a respawned rank) takes the count it was drawn with."""
        if self.pass_iteration is None:
            self.pass_iteration = int(self.loader._num_iter_calls)
        self.loader._num_iter_calls = self.pass_iteration
        self.drawn = self.pass_iteration
        return iter(self.loader)

    def end_pass(self) -> None:
        """The training pass is over: the count is one past the pass's, as after a plain ``for``."""
        if self.pass_iteration is not None:
            self.loader._num_iter_calls = self.pass_iteration + 1
        else:
            self.loader._num_iter_calls += 1  # a pass that gave no step
        self.pass_iteration = self.drawn = None


class OptimizerSteps:
    """A set-up training loader seen as optimizer steps: each item is the list of micro-batches of
    one step (``accum`` from the pass's start; the pass's last micro-batch closes its group). The
    seed ``iter()`` draws from torch's global generator is :class:`ftrun.rank.data.LoaderCursor`'s to
    replay; the pass counter is :class:`LoaderState`'s."""

    def __init__(self, loader: Any, state: LoaderState, accum: int) -> None:
        self.loader = loader
        self.state = state
        self.accum = accum
        self.live: Iterator[list[Any]] | None = None

    def __len__(self) -> int:
        return math.ceil(len(self.loader) / self.accum)

    def __iter__(self) -> Iterator[list[Any]]:
        self.live = self._groups()
        return self.live

    def _groups(self) -> Iterator[list[Any]]:
        total = len(self.loader)
        group: list[Any] = []
        for i, batch in enumerate(self.state.iterate()):
            group.append(batch)
            if len(group) == self.accum or i == total - 1:
                yield group
                group = []
        if group:
            yield group

    def finish(self) -> None:
        """The pass is over: let the loader's own iterator end as under a plain ``for``, and set the
        pass counter (a rank that joined after the pass's last step never iterated it)."""
        live, self.live = self.live, None
        if live is not None:
            for _ in live:
                pass
        self.state.end_pass()


class _Retained:
    """What a step's last ``fabric.backward`` kept so ``optimizer.step()`` can run it again: its
    arguments (the loss, whose graph is retained), the gradients before it and the random streams."""

    def __init__(self, args: tuple[Any, ...], kwargs: dict[str, Any], grads: list[torch.Tensor | None],
                 rng: dict[str, Any]) -> None:
        self.args, self.kwargs, self.grads, self.rng = args, kwargs, grads, rng
        self.clip: tuple[tuple[Any, ...], dict[str, Any], Any] | None = None  # the loop's clip_gradients call and result


class _Forward:
    """A sharded model's forward in the step under way: ``run`` runs it again, from the random
    streams ``rng``; ``out`` is its output (in the model's graph), ``leaf`` the detached tensor the
    loop's loss was built on, whose gradient :meth:`FTFabric.backward` carries into the model."""

    def __init__(self, run: Callable[[], Any], rng: dict[str, Any], out: torch.Tensor, leaf: torch.Tensor) -> None:
        self.run, self.rng, self.out, self.leaf = run, rng, out, leaf


class StepCounter:
    """A Fabric callback counting ``optimizer.step()`` calls (``completed_steps`` outside ftrun)."""

    def __init__(self) -> None:
        self.count = 0

    def on_after_optimizer_step(self, strategy: Any, optimizer: Any) -> None:
        self.count += 1


class FTUpdates(ParallelStrategy):
    """What both of ftrun's Fabric strategies do with the optimizer (put before Fabric's strategy in
    the bases): ``ft.wrap_optimizer`` (one optimizer only), the scheduler registered as replica
    state, the update through :class:`FTFabric` (a failed step retried). A ``ParallelStrategy``,
    as both Fabric strategies are: a strategy Fabric built becomes one of ftrun's by a change of
    class, which needs the same layout."""

    ft_worker: Worker
    ft_optimizer_step: Callable[[Callable[[], Any]], Any]  # FTFabric's: the update, a failed step retried
    ft_params: list[torch.Tensor]  # the parameters the wrapped optimizer steps

    def setup_optimizer(self, optimizer: torch.optim.Optimizer) -> Any:
        ft = self.ft_worker
        if "optimizer" in ft.registry:
            raise ValueError("ftrun.integrations.fabric: one optimizer only")
        self.ft_params = [p for group in optimizer.param_groups for p in group["params"]]
        return ft.wrap_optimizer(optimizer)

    def setup_module_and_optimizers(self, module: torch.nn.Module, optimizers: list[torch.optim.Optimizer],
                                    scheduler: Any = None) -> tuple[Any, list[Any], Any]:
        module, optimizers, scheduler = super().setup_module_and_optimizers(module, optimizers, scheduler)
        if scheduler is not None:
            self.ft_worker.register("scheduler", scheduler, kind="replica")
        return module, optimizers, scheduler

    def optimizer_step(self, optimizer: Any, **kwargs: Any) -> Any:
        parent = super()
        return self.ft_optimizer_step(lambda: parent.optimizer_step(optimizer, **kwargs))


class FTDDPStrategy(FTUpdates, DDPStrategy):
    """Fabric's ``DDPStrategy`` with ftrun's model, optimizer and update (see the module docstring).
    :class:`FTFabric` makes the strategy Fabric's connector built one under ftrun; never built
    directly."""

    def setup_module(self, module: torch.nn.Module) -> Any:
        ft = self.ft_worker
        if "model" in ft.registry:
            raise ValueError("ftrun.integrations.fabric: one model only (setup was called twice)")
        return ft.wrap_model(module, ddp=True, **self._ddp_kwargs)


#: Mesh dimensions whose ranks take the same batches (they split each sample's work, not the data).
TENSOR_PARALLEL_DIMS = ("tp", "tensor_parallel")


class FTMeshStrategy(ModelParallelStrategy):
    """Fabric's ``ModelParallelStrategy`` on the DeviceMesh declared at ``ftrun.init`` (under ftrun
    and under torchrun alike, so ``parallelize_fn`` gets the same mesh in both): the strategy's
    ``data_parallel_size``/``tensor_parallel_size`` are not used. The distributed sampler splits the
    data over every mesh dimension but a tensor-parallel one (:data:`TENSOR_PARALLEL_DIMS`).
    :class:`FTFabric` makes the strategy Fabric's connector built one; never built directly."""

    ft_worker: Worker

    def setup_environment(self) -> None:
        super(ModelParallelStrategy, self).setup_environment()
        self._setup_distributed()  # the process group is ftrun's already: Lightning keeps it
        self._device_mesh = self.ft_worker.device_mesh()

    @property
    def distributed_sampler_kwargs(self) -> dict[str, Any]:
        mesh = self.device_mesh
        shape, names = tuple(mesh.shape), tuple(mesh.mesh_dim_names or ())
        coords = mesh_coordinates(self.global_rank, shape)
        replicas, rank = 1, 0
        for size, name, coord in zip(shape, names, coords):
            if name not in TENSOR_PARALLEL_DIMS:
                replicas, rank = replicas * size, rank * size + coord
        return {"num_replicas": replicas, "rank": rank}


class FTShardedStrategy(FTUpdates, FTMeshStrategy):
    """:class:`FTMeshStrategy` under ftrun: the model ``parallelize_fn`` sharded is
    ``ft.wrap_model(module)`` (its local shards are its state), the optimizer ftrun's, the update
    and the forward through :class:`FTFabric` (a failed step retried)."""

    ft_forward: Callable[[Callable[[], Any]], Any]  # FTFabric's: the forward, run again after a recovery

    def setup_module(self, module: torch.nn.Module) -> Any:
        ft = self.ft_worker
        if "model" in ft.registry:
            raise ValueError("ftrun.integrations.fabric: one model only (setup was called twice)")
        module = super().setup_module(module)
        if not is_sharded(module):
            raise ValueError("ftrun.integrations.fabric: parallelize_fn left the model without a sharded (DTensor) "
                             "parameter; apply fully_shard on the mesh it gets")
        return ft.wrap_model(module)


class _FTFabricModule(_FabricModule):
    """Fabric's model wrapper whose forward, inside a step of a sharded model under ftrun, is run
    again after a recovery when one of its collectives (FSDP's all-gathers) fails."""

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        parent = super()
        return self._strategy.ft_forward(lambda: parent.forward(*args, **kwargs))


class FTFabric(RecoverableWork, Fabric):
    """``lightning.fabric.Fabric`` whose training loop is recovered rank by rank under ftrun; see the
    module docstring. Takes ``Fabric``'s arguments. Call ``ftrun.init()`` before it.

    Raises:
        RuntimeError: under ftrun, ``ftrun.init()`` was not called first (Fabric would own the
            process group, which ftrun must rebuild after a fault).
        ValueError: under ftrun, a strategy other than Fabric's ``DDPStrategy`` or
            ``ModelParallelStrategy`` (DeepSpeed, ``FSDPStrategy``, ``ddp_spawn``...), a
            ``ModelParallelStrategy`` without the mesh declared at ``ftrun.init``, or a precision
            with a ``GradScaler`` (``16-mixed``).
    """

    _ft_label, _ft_loop, _ft_pass_name = "fabric", "Fabric loop", PASS_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ft: Worker | None = None
        self._ft_counter = StepCounter()  # optimizer.step() calls (not under ftrun)
        self._ft_sharded = False  # a sharded model (ModelParallelStrategy) recovered under ftrun
        super().__init__(*args, **kwargs)
        env = RankEnv.from_environ(os.environ)
        ft = current()
        strategy = self._strategy
        on_mesh = type(strategy) is ModelParallelStrategy and ft is not None and ft.sharding.shape is not None
        if on_mesh:
            strategy.__class__ = FTMeshStrategy  # ftrun's mesh, under torchrun too
            strategy.ft_worker = ft
        if env.control_addr is None or not env.arf:
            self._callbacks.append(self._ft_counter)
            return  # torchrun, one process, or ftrun without ARF: the plain Fabric (on ftrun's mesh)
        if ft is None:
            raise RuntimeError("ftrun.integrations.fabric: call ftrun.init() before FTFabric(...) "
                               "(the process group must be ftrun's)")
        if not ft.managed or ft.world_size == 1:
            self._callbacks.append(self._ft_counter)
            return
        if type(strategy) is ModelParallelStrategy:
            raise ValueError("ftrun.integrations.fabric: ModelParallelStrategy needs the mesh declared at "
                             "ftrun.init(mesh_shape=..., mesh_dim_names=...) (ftrun builds it and knows each rank's replicas)")
        if type(strategy) is not FTMeshStrategy and (type(strategy) is not DDPStrategy or strategy._start_method != "popen"):
            raise ValueError(f"ftrun.integrations.fabric: strategy {type(strategy).__name__} is not supported: use "
                             "strategy=\"ddp\", or ModelParallelStrategy (FSDP2, HSDP) for a sharded model")
        if getattr(self._precision, "scaler", None) is not None:
            raise ValueError("ftrun.integrations.fabric: a precision with a GradScaler (16-mixed) is not supported "
                             "(bf16-mixed is)")
        self._ft_sharded = on_mesh
        strategy.__class__ = FTShardedStrategy if on_mesh else FTDDPStrategy
        strategy.ft_worker, strategy.ft_optimizer_step, strategy.ft_params = ft, self._optimizer_step, []
        if on_mesh:
            strategy.ft_forward = self._forward
        self._ft = ft
        self._ft_marker = WorkMarker()
        ft.register("fabric", self._ft_marker, kind="replica")
        self._ft_loaders = 0
        self._ft_loader_states: dict[int, LoaderState] = {}
        self._ft_pass: Iterator[tuple[Any, list[Any]]] | None = None
        self._ft_ahead: Any = None  # the next step, already begun by a recovery inside recoverable work
        self._ft_step: int | None = None  # the step whose micro-batches are being given
        self._ft_sync = True  # whether the current micro-batch is its step's last
        self._ft_place = (0, 1)  # (index, size) of the current micro-batch in its step
        self._ft_retained: _Retained | None = None
        self._ft_forward: _Forward | None = None  # a sharded model's forward in the step under way
        self._ft_work: list[Callable[..., Any]] = []

    # ------------------------------------------------------------------ data
    def _setup_dataloader(self, dataloader: Any, use_distributed_sampler: bool = True,
                          move_to_device: bool = True) -> Any:
        prepared = super()._setup_dataloader(dataloader, use_distributed_sampler=use_distributed_sampler,
                                             move_to_device=move_to_device)
        ft = self._ft
        if ft is None:
            return prepared
        state = LoaderState(prepared)
        self._ft_loader_states[id(prepared)] = state
        ft.register(f"fabric_loader_{self._ft_loaders}", state, kind="replica")
        self._ft_loaders += 1
        return prepared

    # ------------------------------------------------------------------ the training pass
    def train_batches(self, loader: Any, accumulate: int = 1) -> Iterator[Any]:
        """Yield ``loader``'s (micro-)batches for one pass, as ``for batch in loader`` does, each
        ``accumulate`` of them (from the pass's start; the pass's last closes a shorter group) being
        one optimizer step and one of ftrun's steps (see the module docstring). Under torchrun or
        as one process: the loader itself.

        Args:
            loader: a training ``DataLoader`` returned by :meth:`setup_dataloaders`.
            accumulate: micro-batches per optimizer step (>= 1).

        Raises:
            ValueError: ``accumulate`` < 1, or (under ftrun) a loader not set up by this Fabric,
                or ``accumulate`` > 1 with a sharded model.
            RuntimeError: (under ftrun) a step's last micro-batch passed without ``optimizer.step()``.
        """
        if int(accumulate) < 1:
            raise ValueError(f"ftrun.integrations.fabric: accumulate must be >= 1, not {accumulate}")
        if self._ft_sharded and int(accumulate) != 1:
            raise ValueError(f"ftrun.integrations.fabric: accumulate={accumulate} with a sharded model is not "
                             "supported (one micro-batch a step)")
        if self._ft is None:
            return iter(loader)
        return self._ft_batches(loader, int(accumulate))

    def _ft_batches(self, loader: Any, accumulate: int) -> Iterator[Any]:
        ft = self._ft
        assert ft is not None
        state = self._ft_loader_states.get(id(loader))
        if state is None:
            raise ValueError("ftrun.integrations.fabric: train_batches takes a DataLoader returned by setup_dataloaders()")
        steps = OptimizerSteps(loader, state, accumulate)
        self._ft_pass = iter(ft.batches(steps, name=PASS_NAME))
        try:
            item = self._next_step()
            pending = self._ft_marker.pending
            if pending is not None:
                # A respawned rank whose replicas were in recoverable work after the step it
                # starts from: it does that work first, with them.
                self._ft_ahead = END if item is None else item
                self._ft_work[int(pending["work"])](*pending["args"])
                item = self._next_step()
            while item is not None:
                step, group = item
                self._ft_step = int(step)
                last = len(group) - 1
                for i, batch in enumerate(group):
                    self._ft_sync, self._ft_place = i == last, (i, len(group))
                    yield batch
                if ft.committed != self._ft_step:
                    raise RuntimeError(f"ftrun.integrations.fabric: step {self._ft_step}'s last micro-batch passed "
                                       f"without optimizer.step(): call it every {accumulate} micro-batches of "
                                       "train_batches (and at the pass's end)")
                item = self._next_step()
            steps.finish()
        finally:
            gen, self._ft_pass, self._ft_step, self._ft_ahead = self._ft_pass, None, None, None
            self._ft_sync, self._ft_retained, self._ft_forward = True, None, None
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    @property
    def completed_steps(self) -> int:
        """The optimizer steps completed so far: under ftrun, its committed step + 1 (a respawned
        rank takes it from its replicas); else the ``optimizer.step()`` calls."""
        return self._ft.committed + 1 if self._ft is not None else self._ft_counter.count

    # ------------------------------------------------------------------ one step
    def setup(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = super().setup(module, *args, **kwargs)
        if self._ft_sharded:  # (_FabricModule's __setattr__ would set it on the wrapped model)
            object.__setattr__(out[0] if isinstance(out, tuple) else out, "__class__", _FTFabricModule)
        return out

    def setup_module(self, module: torch.nn.Module, *args: Any, **kwargs: Any) -> Any:
        out = super().setup_module(module, *args, **kwargs)
        if self._ft_sharded:
            object.__setattr__(out, "__class__", _FTFabricModule)
        return out

    def _in_step(self) -> bool:
        """Whether a step of the training pass is under way (its micro-batch given, its update not
        yet committed): a collective failing now is recovered inside the step's doors."""
        ft = self._ft
        return ft is not None and self._ft_pass is not None and self._ft_step is not None and ft.committed != self._ft_step

    def _forward(self, run: Callable[[], Any]) -> Any:
        """A sharded model's forward (``run``) inside a step: a fault in its collectives (FSDP's
        all-gathers) is recovered (:meth:`_rejoin_step`) and the forward runs again, from the random
        streams it began with. Returns its output detached from the model's graph, as a tensor that
        requires grad (the loop's loss is built on it): :meth:`backward` carries that tensor's
        gradient into the model (:class:`_Forward`), so a retry runs the forward and the model's
        backward again, the collectives in the order a respawned rank makes them.

        Raises:
            ValueError: the forward returned something other than one tensor.
            RuntimeError: a second forward in the step."""
        ft = self._ft
        if ft is None or not self._in_step():
            return run()
        if self._ft_forward is not None:
            raise RuntimeError(f"ftrun.integrations.fabric: a sharded model's forward ran twice in step {self._ft_step}: "
                               "one forward a step (its backward is carried from the one output)")
        rng = RNGState().state_dict()

        def recover() -> None:
            self._rejoin_step(f"step {self._ft_step}'s forward failed; it runs again after the recovery")
            RNGState().load_state_dict(rng)

        out = until_done(ft, run, "a collective of the Fabric loop failed in the forward", recover)
        if not torch.is_tensor(out):
            raise ValueError("ftrun.integrations.fabric: a sharded model's forward must return one tensor "
                             f"(got {type(out).__name__})")
        if not out.requires_grad:
            return out
        leaf = out.detach().requires_grad_()
        self._ft_forward = _Forward(run, rng, out, leaf)
        return leaf

    def backward(self, tensor: torch.Tensor, *args: Any, model: Any = None, **kwargs: Any) -> None:
        if self._ft is None or self._ft_pass is None or not self._ft_sync:
            return super().backward(tensor, *args, model=model, **kwargs)
        # A step's last micro-batch: what a retry inside optimizer.step() starts from.
        params = self._ft_params()
        grads = keep_grads(params)
        if not self._ft_sharded:
            kwargs = {**kwargs, "retain_graph": True}
            self._ft_retained = _Retained((tensor, *args), {**kwargs, "model": model}, grads, RNGState().state_dict())
            return super().backward(tensor, *args, model=model, **kwargs)
        forward = self._ft_forward
        if forward is None:
            raise RuntimeError("ftrun.integrations.fabric: fabric.backward of a sharded model without its forward "
                               "in this step")
        rng = RNGState().state_dict()
        super().backward(tensor, *args, model=model, **kwargs)  # the loss's graph, down to the model's output
        grad = forward.leaf.grad
        if grad is None:
            raise RuntimeError("ftrun.integrations.fabric: the loss given to fabric.backward does not depend on the "
                               "model's output of this step")
        self._ft_retained = _Retained((forward.out, grad), {"model": model}, grads, rng)
        forward.out, forward.leaf.grad = None, None
        failure = None
        try:
            return super().backward(*self._ft_retained.args, model=model)  # the model's graph: its collectives
        except Exception as err:  # FSDP's reduce-scatters raise
            if not is_fault(self._ft, err):
                raise
            failure = f"a collective of the Fabric loop failed in the backward: {describe(err)}"
        self._ft.record_failure(failure)
        self._retry(f"step {self._ft_step}'s backward failed; its forward and backward run again after the recovery")
        return None

    def clip_gradients(self, module: Any, optimizer: Any, *args: Any, **kwargs: Any) -> Any:
        ft = self._ft

        def clip() -> Any:
            return super(FTFabric, self).clip_gradients(module, optimizer, *args, **kwargs)

        if ft is None or not self._ft_sharded or not self._in_step():
            result = clip()
        else:  # a sharded model's norm is a collective
            result = until_done(ft, clip, "a collective of the Fabric loop failed in clip_gradients", lambda: self._retry(
                f"step {self._ft_step}'s clip_gradients failed; its forward and backward run again after the recovery"))
        if self._ft is not None and self._ft_retained is not None and self._ft_sync:
            self._ft_retained.clip = ((module, optimizer, *args), kwargs, result)
        return result

    def _ft_params(self) -> list[torch.Tensor]:
        params = self._strategy.ft_params
        if not params:
            raise RuntimeError("ftrun.integrations.fabric: fabric.setup(model, optimizer) first")
        return params

    def _optimizer_step(self, update: Callable[[], Any]) -> Any:
        """``optimizer.step()`` (through the strategy): the update if the step's collectives
        succeeded; else recover and retry the step's last backward, then update."""
        ft = self._ft
        if ft is None or self._ft_pass is None:
            return update()
        if not self._ft_sync:
            index, size = self._ft_place
            raise RuntimeError(f"ftrun.integrations.fabric: optimizer.step() at micro-batch {index + 1} of step "
                               f"{self._ft_step}'s {size}: train_batches(loader, accumulate) groups the micro-batches "
                               "of a step, call optimizer.step() at each group's last")
        while True:
            out = update()
            if ft.committed == self._ft_step:
                break
            self._retry(f"step {self._ft_step}'s update failed; its last backward runs again after the recovery")
        self._ft_retained = self._ft_forward = None
        return out

    def _rejoin_step(self, why: str) -> None:
        """A fault was recorded inside the step under way: recover (ftrun's step loop rolls this
        rank's state back to the step's start) and check the recovery resumes that very step.

        Raises:
            RuntimeError: the recovery resumed another step (this rank alone failed while its
                replicas committed it, or the pass moved on): the loop's code after the step would
                run over the state it took; the rank ends and ARF replaces it."""
        ft = self._ft
        assert ft is not None
        step = self._ft_step
        item = self._next_step()
        if item is None or int(item[0]) != step:
            got = "the pass's end" if item is None else f"step {int(item[0])}"
            raise RuntimeError(f"ftrun.integrations.fabric: rank {ft.rank} recovered at {got}, not at step {step} "
                               "whose update it retries")
        print(f"ftrun: rank {ft.rank}: {why}", file=sys.stderr, flush=True)

    def _retry(self, why: str) -> None:
        """The step's collectives failed (recorded): recover, put back the gradients and streams
        the step's last backward started from, run it again (its collectives over the new group)
        and clip again. A sharded model's forward runs again first (a respawned rank's step makes
        the forward's all-gathers before the backward's), and the model's backward from the
        gradient the loss gave its output; a fault there is recovered again."""
        ft = self._ft
        retained = self._ft_retained
        assert ft is not None
        if retained is None:
            raise RuntimeError("ftrun.integrations.fabric: the step's update failed and its last micro-batch's "
                               "backward did not go through fabric.backward")
        while True:
            self._rejoin_step(why)
            put_grads(self._ft_params(), retained.grads)
            forward = self._ft_forward
            if self._ft_sharded and forward is not None:
                RNGState().load_state_dict(forward.rng)
            kwargs = dict(retained.kwargs)
            model = kwargs.pop("model")
            failure = None
            try:
                args = retained.args
                if self._ft_sharded and forward is not None:
                    out = forward.run()  # the model's forward again: its all-gathers, with the new rank's
                    args = (out, *args[1:])
                RNGState().load_state_dict(retained.rng)
                super().backward(*args, model=model, **kwargs)
                if retained.clip is not None:
                    args, clip_kwargs, result = retained.clip
                    again = super().clip_gradients(*args, **clip_kwargs)
                    if isinstance(result, torch.Tensor) and isinstance(again, torch.Tensor):
                        result.copy_(again)  # the norm the loop holds
                return
            except Exception as err:
                if not self._ft_sharded or not is_fault(ft, err):
                    raise
                failure = f"a collective of the Fabric loop failed in the retried backward: {describe(err)}"
            ft.record_failure(failure)
            why = f"step {self._ft_step}'s retried backward failed; it runs again after the recovery"
