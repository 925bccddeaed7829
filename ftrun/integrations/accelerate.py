"""Rank-level recovery for training loops written with Hugging Face Accelerate: :class:`FTAccelerator`.

The port of an Accelerate loop (docs/frameworks/accelerate.md; ``examples/accelerate_loop.py``)::

    ft = ftrun.init()                                        # before the Accelerator
    accelerator = FTAccelerator(gradient_accumulation_steps=2)   # in place of Accelerator
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(...)
    evaluate = accelerator.recoverable(evaluate)             # work with collectives after a step
    for epoch in ft.epochs(0, epochs):                       # in place of range(epochs)
        for batch in accelerator.train_batches(train_loader):    # in place of train_loader
            with accelerator.accumulate(model):
                ...                                          # unchanged
            if accelerator.sync_gradients:
                completed_steps = accelerator.completed_steps    # in place of += 1
                ...                                          # logging, evaluate(completed_steps)
    ft.finish()

Under torchrun, or as one process, :class:`FTAccelerator` is ``Accelerator``: its overrides do
nothing, ``train_batches`` is the loader and ``recoverable`` returns the function. Under ftrun a
rank that dies is respawned alone and the loop ends with the parameters of the run without the
fault, bitwise. What accelerate keeps outside the step is made ftrun's:

- ``prepare`` gives the model as ``ft.wrap_model(model, ddp=True, **the DDP keywords accelerate
  would use)`` (its buckets averaged over ftrun's group during the last micro-batch's backward,
  bitwise as accelerate's own DDP) after accelerate's own preparation without its DDP (autocast);
  the optimizer as accelerate's ``AcceleratedOptimizer`` around ``ft.wrap_optimizer(...)`` (the
  update is applied only if the step's collectives succeeded); the scheduler registered as replica
  state (rolled back with a retried step); each ``DataLoader`` as accelerate prepares it, with its
  pass counter and its synchronised sampler generator registered as replica state (one broadcast
  of rank 0's generator at ``prepare`` makes every rank's the same, as accelerate's broadcast at
  each ``iter()`` would; that broadcast, a collective a respawned rank would make alone, is off).
- ``train_batches(loader)`` drives ftrun's step loop (``ft.batches``) over the loader's
  micro-batches grouped as accelerate's ``accumulate`` groups them (``gradient_accumulation_steps``
  from the pass's start, the pass's last micro-batch closing a shorter group): one ftrun step per
  optimizer step. A failed step's micro-batches are given again; a respawned rank starts at its
  replicas' step and place in the pass (:mod:`ftrun.rank.data`).
- ``accumulate`` takes ``sync_gradients`` from the micro-batch's place in the step instead of the
  ``Accelerator``'s counter and the loader's end-of-data flag. When the step's update failed (a
  peer died), it leaves ``sync_gradients`` False after the block, so the loop's
  ``if accelerator.sync_gradients:`` work (logging, evaluation) is skipped, and the next
  micro-batch is the retried step's first.
- ``recoverable(fn)``: ``fn`` runs collectives of its own after a step (an evaluation's
  ``gather_for_metrics``). Its start is a snapshot of the step's state; a fault in it is recovered,
  the state rolled back to that snapshot, and ``fn`` run again with the new rank, which runs it
  first, before its first step (a marker in the replica state says so).

The contract (docs/frameworks/accelerate.md): ``ftrun.init()`` before the ``Accelerator``; the forward is a function of
its inputs, the parameters and the global RNG streams; work after a step that makes collectives
is called through ``recoverable`` with plain arguments (numbers, strings); that work and the
loop's other post-step code are under ``if accelerator.sync_gradients:``; no DeepSpeed, FSDP
(refused: what to use instead is :data:`ftrun.integrations.common.FSDP_INSTEAD`) or fp16
``GradScaler``; the default ``sync_with_dataloader`` and ``rng_types``.
"""

from __future__ import annotations

import contextlib
import itertools
import math
import os
from typing import Any, Callable, Iterator

import torch
from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.utils import DistributedType

from ftrun.common.contract import RankEnv
from ftrun.integrations.common import END, FSDP_INSTEAD, RecoverableWork, WorkMarker
from ftrun.rank.worker import Worker, current

#: The name of the training pass's position in ftrun's registered rank state.
PASS_NAME = "accelerate_pass"


class LoaderState:
    """A prepared ``DataLoader``'s state outside its iterator (kind ``replica``: the same on every
    rank): its pass counter (``iteration``, what ``set_epoch`` gets at each ``iter()``), the state of
    the sampler generator accelerate keeps synchronised across ranks, and that generator's state
    where the current pass drew its order (so a pass's iterator can be rebuilt mid-pass)."""

    def __init__(self, loader: Any) -> None:
        self.loader = loader
        gen = loader.synchronized_generator
        self.generator = gen if isinstance(gen, torch.Generator) else None
        self.pass_start: tuple[int, torch.Tensor] | None = None  # (iteration, generator state) of the pass's draw
        self.drawn: tuple[int, torch.Tensor, torch.Tensor] | None = None  # this process's last draw: (iteration, before, after)

    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"iteration": int(self.loader.iteration)}
        if self.generator is not None:
            state["generator"] = self.generator.get_state()
        if self.pass_start is not None:
            state["pass_iteration"], state["pass_generator"] = self.pass_start[0], self.pass_start[1].clone()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.loader.iteration = int(state["iteration"])
        if self.generator is not None and "generator" in state:
            self.generator.set_state(state["generator"])
        self.pass_start = (int(state["pass_iteration"]), state["pass_generator"].clone()) if "pass_generator" in state else None
        drawn, iteration = self.drawn, self.loader.iteration
        if (self.generator is not None and drawn is not None and drawn[0] == iteration
                and (self.pass_start is None or self.pass_start[0] != iteration)
                and torch.equal(self.generator.get_state(), drawn[1])):
            # A state from before this pass's draw (a step-start snapshot of the pass's first step)
            # while this process's iterator has drawn it (a retried first step gets its batches
            # from ftrun's cache, with no new draw): the generator is where that draw left it.
            self.generator.set_state(drawn[2])
            self.pass_start = (iteration, drawn[1].clone())

    def iterate(self) -> Iterator[Any]:
        """``iter(loader)``: at a pass's start, keeps the generator's state its order is drawn from;
        the same pass iterated again (a respawned rank, a rolled-back step) draws the same order
        from that state, and the generator is put back where it was."""
        gen, iteration = self.generator, int(self.loader.iteration)
        it = iter(self.loader)
        if gen is None:
            return it
        again = self.pass_start is not None and self.pass_start[0] == iteration
        current = gen.get_state()
        if again:
            gen.set_state(self.pass_start[1])
        else:
            self.pass_start = (iteration, current.clone())
        try:
            first = next(it)  # the sampler draws its order here (the loader reads one batch ahead)
        except StopIteration:
            return iter(())
        finally:
            if again:
                gen.set_state(current)
        if not again:
            self.drawn = (iteration, current.clone(), gen.get_state())
        return itertools.chain([first], it)


class OptimizerSteps:
    """A prepared training loader seen as optimizer steps: each item is the list of micro-batches
    of one step, grouped as ``Accelerator.accumulate`` groups them (``accum`` from the pass's start;
    the pass's last micro-batch closes its group). The seed ``iter()`` draws from torch's global
    generator is :class:`ftrun.rank.data.LoaderCursor`'s to replay; the sampler generator's draw is
    :class:`LoaderState`'s."""

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
        group: list[Any] = []
        for batch in self.state.iterate():
            group.append(batch)
            if len(group) == self.accum or self.loader.end_of_dataloader:
                yield group
                group = []
        if group:
            yield group

    def finish(self) -> None:
        """The pass is over: let the loader's own iterator end as under a plain ``for`` (its pass
        counter goes up, it leaves accelerate's gradient state). A rank that joined after the
        pass's last step never iterated it: the counter goes up all the same."""
        live, self.live = self.live, None
        if live is None:
            self.loader.iteration += 1
            return
        for _ in live:
            pass


class FTAcceleratedOptimizer(AcceleratedOptimizer):
    """accelerate's ``AcceleratedOptimizer`` around an :class:`ftrun.rank.optim.FTOptimizer` whose
    ``step_was_skipped`` is also True when the step's update was not applied (its collectives
    failed): accelerate's prepared scheduler then does not step (it would set the learning rates
    of the next step before the retried step's update). :meth:`FTAccelerator.prepare_optimizer`
    makes the ``AcceleratedOptimizer`` accelerate built one."""

    ft_worker: Worker
    ft_skipped: bool

    def step(self, closure: Any = None) -> Any:
        committed = self.ft_worker.committed
        result = super().step(closure)
        self.ft_skipped = bool(self.gradient_state.sync_gradients) and self.ft_worker.committed == committed
        return result

    @property
    def step_was_skipped(self) -> bool:
        return bool(self._is_overflow) or self.ft_skipped


class FTAccelerator(RecoverableWork, Accelerator):
    """``accelerate.Accelerator`` whose training loop is recovered rank by rank under ftrun; see the
    module docstring. Takes ``Accelerator``'s arguments. Call ``ftrun.init()`` before it.

    Raises:
        RuntimeError: under ftrun, ``ftrun.init()`` was not called first (accelerate would own the
            process group, which ftrun must rebuild after a fault).
        ValueError: under ftrun, a setting whose state ftrun cannot carry (DeepSpeed, FSDP: its line
            names what to use instead, ``sync_with_dataloader=False``, ``rng_types`` other than
            ``["generator"]``).
    """

    _ft_label, _ft_loop, _ft_pass_name = "accelerate", "Accelerate loop", PASS_NAME

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ft: Worker | None = None
        self._ft_completed = 0  # optimizer steps counted by accumulate (not under ftrun)
        super().__init__(*args, **kwargs)
        env = RankEnv.from_environ(os.environ)
        if env.control_addr is None or not env.arf:
            return  # torchrun, one process, or ftrun without ARF: the plain Accelerator
        ft = current()
        if ft is None:
            raise RuntimeError("ftrun.integrations.accelerate: call ftrun.init() before Accelerator(...) "
                               "(the process group must be ftrun's)")
        if not ft.managed or ft.world_size == 1:
            return
        if self.distributed_type is DistributedType.FSDP:
            raise ValueError(f"ftrun.integrations.accelerate: FSDP is not recovered by this integration: {FSDP_INSTEAD}")
        if self.distributed_type not in (DistributedType.MULTI_CPU, DistributedType.MULTI_GPU):
            raise ValueError(f"ftrun.integrations.accelerate: {self.distributed_type} is not supported (plain DDP only)")
        if not self.gradient_state.sync_with_dataloader:
            raise ValueError("ftrun.integrations.accelerate: sync_with_dataloader=False is not supported")
        if not self.step_scheduler_with_optimizer:
            raise ValueError("ftrun.integrations.accelerate: step_scheduler_with_optimizer=False is not supported "
                             "(a scheduler stepped after a failed update would count twice)")
        if list(self.rng_types) not in ([], ["generator"]):
            raise ValueError(f"ftrun.integrations.accelerate: rng_types={self.rng_types} is not supported "
                             "(torch's own streams are each rank's state under ftrun)")
        self._ft = ft
        self._ft_marker = WorkMarker()
        ft.register("accelerate", self._ft_marker, kind="replica")
        self._ft_loaders = 0
        self._ft_loader_states: dict[int, LoaderState] = {}
        self._ft_pass: Iterator[tuple[Any, list[Any]]] | None = None
        self._ft_ahead: Any = None  # the next step, already begun by a recovery inside recoverable work
        self._ft_step: int | None = None  # the step whose micro-batches are being given
        self._ft_sync = True  # whether the current micro-batch is its step's last
        self._ft_work: list[Callable[..., Any]] = []

    # ------------------------------------------------------------------ prepare
    def prepare_model(self, model: torch.nn.Module, device_placement: bool | None = None,
                      evaluation_mode: bool = False) -> Any:
        ft = self._ft
        if ft is None or evaluation_mode:
            return super().prepare_model(model, device_placement=device_placement, evaluation_mode=evaluation_mode)
        ddp_kwargs = self.ddp_handler.to_kwargs() if self.ddp_handler is not None else {}
        # accelerate's own preparation of the module (device, autocast) without its DDP; ftrun's DDP
        # (over a private one-rank group, its buckets averaged over ftrun's group) wraps it.
        super().prepare_model(model, device_placement=device_placement, evaluation_mode=True)
        return ft.wrap_model(model, ddp=True, **ddp_kwargs)

    def prepare_optimizer(self, optimizer: torch.optim.Optimizer, device_placement: bool | None = None) -> Any:
        ft = self._ft
        if ft is None:
            return super().prepare_optimizer(optimizer, device_placement=device_placement)
        if self.scaler is not None:
            raise ValueError("ftrun.integrations.accelerate: fp16 with a GradScaler is not supported (bf16 is)")
        name = "optimizer" if "optimizer" not in ft.registry else f"optimizer_{len(self._optimizers)}"
        prepared = super().prepare_optimizer(ft.wrap_optimizer(optimizer, name=name), device_placement=device_placement)
        if type(prepared) is AcceleratedOptimizer:
            prepared.__class__ = FTAcceleratedOptimizer
            prepared.ft_worker, prepared.ft_skipped = ft, False
        return prepared

    def prepare_scheduler(self, scheduler: Any) -> Any:
        ft = self._ft
        if ft is not None:
            ft.register("scheduler" if "scheduler" not in ft.registry else f"scheduler_{len(self._schedulers)}",
                        scheduler, kind="replica")
        return super().prepare_scheduler(scheduler)

    def prepare_data_loader(self, data_loader: Any, device_placement: bool | None = None,
                            slice_fn_for_dispatch: Any = None) -> Any:
        prepared = super().prepare_data_loader(data_loader, device_placement=device_placement,
                                               slice_fn_for_dispatch=slice_fn_for_dispatch)
        ft = self._ft
        if ft is None:
            return prepared
        if not hasattr(prepared, "synchronized_generator") or not hasattr(prepared, "iteration"):
            raise ValueError(f"ftrun.integrations.accelerate: a {type(prepared).__name__} is not supported "
                             "(dispatch_batches and iterable datasets: not yet)")
        gen = prepared.synchronized_generator
        if isinstance(gen, torch.Generator) and not ft.joining:
            # What accelerate's broadcast at each iter() does, once: every rank takes rank 0's state
            # (a respawned rank takes its replicas' with the replica state).
            state = gen.get_state()
            torch.distributed.broadcast(state, src=0)
            gen.set_state(state)
        prepared.rng_types = None
        state = LoaderState(prepared)
        self._ft_loader_states[id(prepared)] = state
        ft.register(f"accelerate_loader_{self._ft_loaders}", state, kind="replica")
        self._ft_loaders += 1
        return prepared

    # ------------------------------------------------------------------ the training pass
    def train_batches(self, loader: Any) -> Iterator[Any]:
        """Yield ``loader``'s (micro-)batches for one pass, as ``for batch in loader`` does, each
        optimizer step being one of ftrun's steps (see the module docstring). Under torchrun or
        as one process: the loader itself.

        Args:
            loader: a training ``DataLoader`` returned by :meth:`prepare`.
        """
        if self._ft is None:
            return iter(loader)
        return self._ft_batches(loader)

    def _ft_batches(self, loader: Any) -> Iterator[Any]:
        ft = self._ft
        assert ft is not None
        state = self._ft_loader_states.get(id(loader))
        if state is None:
            raise ValueError("ftrun.integrations.accelerate: train_batches takes a DataLoader returned by prepare()")
        steps = OptimizerSteps(loader, state, self.gradient_accumulation_steps)
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
                    self._ft_sync = i == last
                    self.step = 0 if (self._ft_sync and step.index == len(steps) - 1) else step.index * steps.accum + i + 1
                    self.gradient_state._set_sync_gradients(self._ft_sync)
                    yield batch
                item = self._next_step()
            steps.finish()
        finally:
            gen, self._ft_pass, self._ft_step, self._ft_ahead = self._ft_pass, None, None, None
            self._ft_sync = True
            close = getattr(gen, "close", None)
            if close is not None:
                close()

    @contextlib.contextmanager
    def accumulate(self, *models: Any) -> Iterator[None]:
        ft = self._ft
        if ft is None or self._ft_pass is None:
            with super().accumulate(*models):
                yield
            if self.sync_gradients:
                self._ft_completed += 1
            return
        sync = self._ft_sync
        self.gradient_state._set_sync_gradients(sync)
        allow_sync = sync or self.gradient_state.plugin_kwargs.get("sync_each_batch", False)
        with contextlib.ExitStack() as stack:
            for model in models:
                if not allow_sync:
                    stack.enter_context(self.no_sync(model))
            yield
        if sync and ft.committed != self._ft_step:
            # The update failed (a peer died): the step is retried with its micro-batches; the
            # loop's post-step work (under ``if accelerator.sync_gradients:``) waits for it.
            self.gradient_state._set_sync_gradients(False)

    @property
    def completed_steps(self) -> int:
        """The optimizer steps completed so far: under ftrun, its committed step + 1 (a respawned
        rank takes it from its replicas); else the ``accumulate`` blocks that ended with
        ``sync_gradients``."""
        return self._ft.committed + 1 if self._ft is not None else self._ft_completed

    # ------------------------------------------------------------------ work after a step
    def _work_begins(self) -> Any:
        return list(self.gradient_state.dataloader_references)

    def _work_failed(self, begun: Any) -> None:
        for ref in list(self.gradient_state.dataloader_references):
            if ref is not None and all(ref is not kept for kept in begun):
                self.gradient_state._remove_dataloader(ref)  # an evaluation pass cut short
