"""Rank-level recovery for PyTorch Lightning's ``Trainer.fit`` (automatic optimization): :class:`FTStrategy`.

The port of a Lightning script is a few lines (docs/frameworks/lightning.md)::

    import ftrun
    from ftrun.integrations.lightning import FTStrategy

    ft = ftrun.init()                       # before the Trainer: ftrun builds the process group
    trainer = pl.Trainer(strategy=FTStrategy(), accelerator="cpu", devices=4, ...)   # was "ddp"
    trainer.fit(model, train_loader, val_loader)
    ft.finish()

Under torchrun, or as one process, :class:`FTStrategy` is Lightning's ``DDPStrategy``: none of its
overrides does anything. Under ftrun a rank that dies is respawned alone and the survivors' ``fit``
never sees the fault. Lightning owns its loop, so the strategy drives ftrun's step loop
(``ft.steps``) from the doors a strategy has, one ftrun step per optimizer step (``global_step``):

- The model is ``ft.wrap_model(module, ddp=True, **the strategy's DDP keywords)`` (``_setup_model``):
  a DDP whose buckets are averaged over ftrun's group during the last micro-batch's backward,
  bitwise as the DDP Lightning builds.
- ``on_train_batch_start`` of a step's first micro-batch begins ftrun's step (the replica and rank
  state are snapshotted and this rank's own state is written to the job's store).
- ``optimizer_step`` receives Lightning's closure (the last micro-batch's forward and backward). It
  runs the closure, then the update through Lightning's precision plugin (``on_before_optimizer_step``,
  clipping, ``optimizer.step``) only if the step's collectives succeeded. If they failed it
  recovers (the coordinator's plan, the new group, state to whoever needs it), puts back the
  gradients the earlier micro-batches accumulated, the random streams and the logged step metrics as
  they were when the closure first ran, runs the closure again and applies the update. The loop
  then goes on as after a fault-free step: the scheduler, callbacks and validation run once.
- Validation (the fit loop's ``val_loop.run``) makes collectives of its own (``sync_dist``
  metrics, ``ModelCheckpoint``'s decisions and barrier). Its start is a second snapshot of the
  step's state; a fault there is recovered, the validation's progress and the callbacks' states
  are rolled back to it, and the validation runs again with the new rank, which runs it first.
- A respawned rank builds its ``Trainer`` as its predecessor did. In ``setup`` it takes the model,
  optimizer and schedulers from a replica, with the state Lightning checkpoints for the fit loop
  (its progress as a ``ModelCheckpoint(every_n_train_steps=1)`` would save it after the replicas'
  last step, or as saved at the start of the validation under way) and the callbacks' states (as
  at the replicas' step start), and goes through Lightning's own resume path (the checkpoint
  connector's restore, the loops' restart), as ``fit(ckpt_path=...)`` would, but from a peer's
  memory. Lightning restarts a plain ``DataLoader``'s epoch from its first batch; the respawned rank
  reads and drops the batches its replicas already trained on in the epoch. Its random streams
  come from the job's store (its predecessor's, where the step or the validation began).

Until its first step (or the validation it joins) a respawned rank's ``barrier``, ``broadcast``
and ``reduce`` are its own (its set-up's collectives have no partner: the replicas are inside
their step). Lightning's per-batch SIGTERM broadcast is turned off under ftrun (ftrun forwards
signals itself), and the validation data loaders are set up at ``on_train_start`` rather than at
the first validation, so no rank makes a set-up collective later alone.

The contract (docs/frameworks/lightning.md): automatic optimization with one optimizer; the model's forward is a
function of its inputs, parameters and the global RNG streams; map-style training data through a
plain ``DataLoader`` (the sampler Lightning puts in; no stateful loader); callbacks keep their state
in ``state_dict`` (as Lightning checkpoints it) or hold none that changes the training; metrics
logged in ``training_step`` without ``sync_dist``.
"""

from __future__ import annotations

import copy
import os
from typing import Any, Callable, Iterator

import torch
from lightning.pytorch import Callback
from lightning.pytorch import __version__ as LIGHTNING_VERSION
from lightning.pytorch.strategies import DDPStrategy
from lightning.pytorch.trainer import call

from ftrun.common.contract import RankEnv
from ftrun.integrations.common import keep_grads, put_grads, until_done
from ftrun.rank.transfer import RNGState
from ftrun.rank.worker import Worker, current

#: The fit loop's state-dict key of the validation loop's batch progress (Lightning 2.6).
VAL_PROGRESS = "epoch_loop.val_loop.batch_progress"
#: The fit loop's state-dict key of the training epoch loop's batch progress (Lightning 2.6).
TRAIN_PROGRESS = "epoch_loop.batch_progress"


class Stateful:
    """An object with ``state_dict()``/``load_state_dict()`` made of two functions (what ftrun's
    registry takes)."""

    def __init__(self, get: Callable[[], dict[str, Any]], load: Callable[[dict[str, Any]], None]) -> None:
        self.get, self.load = get, load

    def state_dict(self) -> dict[str, Any]:
        return self.get()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load(state)


class _StepEnd(Callback):
    """The strategy's eyes on the loop where a strategy has no hook: the end of a step's last
    micro-batch (the fit loop's state there is what ``ModelCheckpoint`` saves every N steps), and
    the start of training (the validation loaders are set up there, on every rank at once)."""

    def __init__(self, strategy: "FTStrategy") -> None:
        self.strategy = strategy

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        trainer.fit_loop.epoch_loop.val_loop.setup_data()

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        self.strategy.step_ended()


class FTStrategy(DDPStrategy):
    """Lightning's ``DDPStrategy`` whose ranks are recovered one by one under ftrun; see the module
    docstring. Takes ``DDPStrategy``'s arguments. Call ``ftrun.init()`` before the ``Trainer``.

    Raises:
        RuntimeError: under ftrun with ARF, ``ftrun.init()`` was not called first; the module uses
            manual optimization or more than one optimizer; the training data is a stateful loader.
    """

    strategy_name = "ftrun_ddp"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._ft: Worker | None = None
        env = RankEnv.from_environ(os.environ)
        if env.control_addr is None or not env.arf:
            return  # torchrun, one process, or ftrun without ARF: Lightning's DDPStrategy
        ft = current()
        if ft is None:
            raise RuntimeError("ftrun.integrations.lightning: call ftrun.init() before the Trainer "
                               "(the process group must be ftrun's)")
        if not ft.managed or ft.world_size == 1:
            return
        self._ft = ft
        self._trainer: Any = None
        self._steps: Iterator[int] | None = None
        self._total = 0  # the fit's optimizer steps (Lightning's estimate)
        self._step: int | None = None  # the step begun and not yet ended
        self._open = False  # a step is begun and its update not applied yet
        self._stepped = False  # the update of this micro-batch's step was applied
        self._begun = False  # the next step was already begun (by a recovery)
        self._joined_rng: dict[str, Any] | None = None  # a respawned rank: its predecessor's streams
        self._local = ft.joining  # a respawned rank's set-up: its collectives have no partner
        self._skip_batches = False  # a respawned rank: drop the epoch's batches its replicas trained on
        # The state a respawned rank takes (registered as "lightning"): the fit loop's state after
        # the last step, the callbacks' states at the step's (or the validation's) start.
        self._loops: dict[str, Any] | None = None
        self._callbacks: dict[str, Any] | None = None
        self._mid_eval = False
        self._validated = False  # a validation ended since the last step began
        self._received: dict[str, Any] | None = None

    # ------------------------------------------------------------------ set-up
    @property
    def restore_checkpoint_after_setup(self) -> bool:
        # A respawned rank's state arrives in setup(), once the optimizers exist.
        return True if self._ft is not None else super().restore_checkpoint_after_setup

    def _setup_model(self, model: torch.nn.Module) -> Any:
        if self._ft is None:
            return super()._setup_model(model)
        return self._ft.wrap_model(model, ddp=True, **self._ddp_kwargs)

    def setup(self, trainer: Any) -> None:
        ft = self._ft
        if ft is None:
            return super().setup(trainer)
        self._trainer = trainer
        super().setup(trainer)
        if not trainer.lightning_module.automatic_optimization or len(self.optimizers) != 1:
            raise RuntimeError("ftrun.integrations.lightning: FTStrategy takes automatic optimization with one "
                               "optimizer (docs/frameworks/lightning.md)")
        self._patch_loops(trainer)
        ft.register("optimizer", self.optimizers[0], kind="committed")
        for i, config in enumerate(self.lr_scheduler_configs):
            ft.register(f"lr_scheduler{i}", config.scheduler, kind="replica")
        ft.register("lightning", Stateful(self.replica_state, self.load_replica_state), kind="committed")
        total = trainer.estimated_stepping_batches
        if total == float("inf"):
            raise RuntimeError("ftrun.integrations.lightning: the number of steps must be known (max_steps or a sized "
                               "training DataLoader)")
        self._total = int(total)
        if ft.joining:
            self._join(trainer)

    def _patch_loops(self, trainer: Any) -> None:
        """Under ftrun: no per-batch SIGTERM broadcast; validation guarded; a respawned rank's skip
        of the batches its replicas trained on; the callback at each step's end."""
        epoch_loop = trainer.fit_loop.epoch_loop
        epoch_loop._broadcast_sigterm_tensor = lambda: None
        validation = epoch_loop.val_loop.run
        epoch_loop.val_loop.run = lambda: self._guarded_validation(validation)
        run_start = epoch_loop.on_run_start

        def on_run_start(data_fetcher: Any) -> None:
            run_start(data_fetcher)
            if self._skip_batches:
                self._skip_batches = False
                if any(hasattr(dl, "state_dict") for dl in data_fetcher.combined_loader.flattened):
                    # Lightning restores a stateful loader's position itself, from the donor's
                    # state: another rank's. (A plain DataLoader's is the epoch's batch count.)
                    raise RuntimeError("ftrun.integrations.lightning: a stateful training loader is not supported "
                                       "(docs/frameworks/lightning.md)")
                for _ in range(epoch_loop.batch_progress.current.ready):
                    next(data_fetcher.iterator)

        epoch_loop.on_run_start = on_run_start
        trainer.callbacks.append(_StepEnd(self))

    def _join(self, trainer: Any) -> None:
        """A respawned rank: recover now (model, optimizer, schedulers and the loop's state from a
        replica), and hand Lightning a checkpoint of that state to restore as a resume would."""
        self._step = next(self._step_loop())
        self._begun = True
        self._joined_rng = RNGState().state_dict()  # its predecessor's, where the step began
        trainer.num_sanity_val_steps = 0
        received, self._received = self._received, None
        if received is None or received.get("loops") is None:
            return  # its replicas were in their first step: the fit starts from the beginning
        self._callbacks = received["callbacks"]
        checkpoint = {  # what Lightning's dump_checkpoint writes, the weights being already in place
            "epoch": received["loops"]["fit_loop"]["epoch_progress"]["current"]["completed"], "global_step": self._step, "pytorch-lightning_version": LIGHTNING_VERSION,
            "state_dict": self.lightning_module.state_dict(),
            "optimizer_states": [opt.state_dict() for opt in self.optimizers],
            "lr_schedulers": [config.scheduler.state_dict() for config in self.lr_scheduler_configs],
            "loops": copy.deepcopy(received["loops"]), "callbacks": copy.deepcopy(self._callbacks),
        }
        trainer._checkpoint_connector._loaded_checkpoint = checkpoint
        self._skip_batches = True

    # ------------------------------------------------------------------ the state a respawned rank takes
    def replica_state(self) -> dict[str, Any]:
        """What a donor sends (registered as ``"lightning"``, kind ``committed``: never rolled back):
        the fit loop's state after the last step, the callbacks' states at the current step's start
        (or the validation's), and whether a validation was under way."""
        loops = _mid_evaluation(self._loops) if self._mid_eval and self._loops is not None else self._loops
        return {"loops": loops, "callbacks": self._callbacks, "mid_eval": self._mid_eval}

    def load_replica_state(self, state: dict[str, Any]) -> None:
        """Keep a donor's :meth:`replica_state` (a respawned rank applies it in ``setup``)."""
        self._received = dict(state)

    def step_ended(self) -> None:
        """At the end of a step's last micro-batch: the fit loop's state as Lightning checkpoints it."""
        if self._ft is None or not self._stepped:
            return
        self._stepped = False
        self._loops = copy.deepcopy(self._trainer._checkpoint_connector._get_loops_state_dict())

    def _capture_callbacks(self, mid_eval: bool) -> None:
        self._callbacks = copy.deepcopy(call._call_callbacks_state_dict(self._trainer))
        self._mid_eval = mid_eval

    # ------------------------------------------------------------------ one step
    def on_train_batch_start(self, batch: Any, batch_idx: int, *args: Any, **kwargs: Any) -> None:
        super().on_train_batch_start(batch, batch_idx, *args, **kwargs)
        if self._ft is not None and not self._open:
            self._begin_step()

    def _step_loop(self) -> Iterator[int]:
        """ftrun's step loop (``ft.steps``) over the fit's optimizer steps, from Lightning's
        ``global_step`` (created at the first step: a resume has restored it by then)."""
        assert self._ft is not None
        if self._steps is None:
            self._steps = self._ft.steps(self._total, start=self._trainer.global_step)
        return self._steps

    def _begin_step(self) -> None:
        ft = self._ft
        assert ft is not None
        self._local = False
        self._capture_callbacks(mid_eval=False)
        if self._begun:
            self._begun = False
            self._restore_joined_rng()
            ft.checks.snapshot_step_start()  # the state here, not where the recovery left it
        else:
            if self._validated:
                # A recovery at this step's start rolls the state back to the newest snapshot of
                # the committed step: here, not the validation's end (the epoch's end, a new
                # epoch's data loader iterator drew from the streams since).
                ft.checks.snapshot_step_start()
            self._step = next(self._step_loop())
        self._validated = False
        if self._step != self._trainer.global_step:
            raise RuntimeError(f"ftrun.integrations.lightning: ftrun's step {self._step} is not Lightning's "
                               f"global_step {self._trainer.global_step}")
        self._open = True

    def _restore_joined_rng(self) -> None:
        if self._joined_rng is not None:
            RNGState().load_state_dict(self._joined_rng)
            self._joined_rng = None

    def optimizer_step(self, optimizer: Any, closure: Callable[[], Any], model: Any = None, **kwargs: Any) -> Any:
        ft = self._ft
        if ft is None:
            return super().optimizer_step(optimizer, closure, model, **kwargs)
        params = [p for group in optimizer.param_groups for p in group["params"]]
        # What the closure's retry starts from: the gradients the earlier micro-batches accumulated
        # (only the last micro-batch is run again), the random streams, the logged step metrics.
        grads = keep_grads(params)
        rng = RNGState().state_dict()
        results = _results_state(self._trainer)
        while True:
            loss = closure()
            applied, out = ft.apply_update(
                lambda: super(FTStrategy, self).optimizer_step(optimizer, lambda: loss, model, **kwargs))
            if applied:
                break
            self._retry(params, grads, rng, results)
        self._open, self._stepped = False, True
        return out

    def _retry(self, params: list[torch.Tensor], grads: list[torch.Tensor | None], rng: dict[str, Any],
               results: dict[str, Any]) -> None:
        """The step's collectives failed: recover (ftrun's step loop rolls this rank's state back to
        the step's start), then put back what the closure started from."""
        assert self._ft is not None
        step = next(self._step_loop())
        if step != self._step:
            # Its replicas committed the step (this rank alone failed its update: a recoverable
            # error repaired in place): Lightning would run the step's scheduler and callbacks a
            # second time over the state it took. It ends, and ARF replaces it.
            raise RuntimeError(f"ftrun.integrations.lightning: rank {self._ft.rank} repaired step {self._step}, which "
                               f"its replicas committed; it resumes at step {step} as a respawned rank")
        put_grads(params, grads)
        RNGState().load_state_dict(rng)
        _load_results_state(self._trainer, results)

    # ------------------------------------------------------------------ validation
    def _guarded_validation(self, run: Callable[[], Any]) -> Any:
        """The fit loop's validation: on a fault, recover, roll the validation's progress and the
        callbacks' states back to its start, and run it again (with the new rank)."""
        ft, trainer = self._ft, self._trainer
        if ft is None or trainer.sanity_checking:
            return run()
        self._local = False
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        self._capture_callbacks(mid_eval=True)
        progress = copy.deepcopy(val_loop.batch_progress.state_dict())
        modes = [(module, module.training) for module in self.lightning_module.modules()]
        self._restore_joined_rng()  # a respawned rank joining its replicas' validation
        # The validation's start is the state a fault in it rolls back to, and this rank's record.
        ft.checks.snapshot_step_start()

        def recover() -> None:
            self._step, self._begun = next(self._step_loop()), True
            # What the failed run left: its progress, its logged metrics (reset at a validation's
            # end only), the modules in eval mode (a run puts back the mode it found), the
            # callbacks' states (ModelCheckpoint may have taken the score in).
            val_loop.batch_progress.load_state_dict(copy.deepcopy(progress))
            val_loop._results.reset()
            for module, training in modes:
                module.training = training
            call._call_callbacks_load_state_dict(trainer, {"callbacks": copy.deepcopy(self._callbacks)})
            trainer.validating = True

        with ft.section("validation"):
            result = until_done(ft, run, "a collective of Lightning's validation failed", recover)
        self._mid_eval = False
        # And its end: a rank replaced after it is replaced by one whose streams made its draws
        # (its record is sent before the loop goes on); a recovery at the next step's
        # start rolls back no further than here (see _begin_step).
        ft.checks.snapshot_step_start()
        self._validated = True
        return result

    # ------------------------------------------------------------------ the end
    def teardown(self) -> None:
        steps, self._steps = getattr(self, "_steps", None), None
        if steps is not None:
            steps.close()  # ftrun's step loop ends with the fit
        super().teardown()

    # ------------------------------------------------------------------ a respawned rank's set-up
    def barrier(self, *args: Any, **kwargs: Any) -> None:
        if self._ft is not None and self._local:
            return
        super().barrier(*args, **kwargs)

    def broadcast(self, obj: Any, src: int = 0) -> Any:
        if self._ft is not None and self._local:
            return obj
        return super().broadcast(obj, src)

    def reduce(self, tensor: Any, group: Any = None, reduce_op: Any = "mean") -> Any:
        if self._ft is not None and self._local:
            return tensor
        return super().reduce(tensor, group, reduce_op)


def _mid_evaluation(loops: dict[str, Any]) -> dict[str, Any]:
    """The fit loop's state after a step (``loops``, as saved at the end of its last micro-batch)
    made into the state Lightning would checkpoint at the start of that step's validation, before
    its first batch: the training batch completed (Lightning's ``restarted_on_last``, so a restart
    at an epoch's last batch ends that epoch after the validation instead of skipping its end), and
    the validation's batch progress saying one batch started and none processed
    (``restarted_mid_evaluation``: a restart runs the validation from its first batch)."""
    loops = copy.deepcopy(loops)
    fit = loops["fit_loop"]
    for counter in ("total", "current"):
        train = fit[TRAIN_PROGRESS][counter]
        train["completed"] = train["processed"]
        val = fit[VAL_PROGRESS][counter]
        done = val["completed"] if counter == "total" else 0
        val.update(ready=done + 1, started=done + 1, processed=done, completed=done)
    return loops


def _results_state(trainer: Any) -> dict[str, dict[str, Any]]:
    """The training step's logged metrics (Lightning's ``ResultCollection``): each metric's
    attributes, shallow (logging replaces its tensors, it never changes them in place)."""
    return {key: dict(metric.__dict__) for key, metric in trainer.fit_loop.epoch_loop._results.items()}


def _load_results_state(trainer: Any, state: dict[str, dict[str, Any]]) -> None:
    results = trainer.fit_loop.epoch_loop._results
    for key in [key for key in results if key not in state]:
        del results[key]
    for key, attributes in state.items():
        if key in results:
            results[key].__dict__.clear()
            results[key].__dict__.update(attributes)


