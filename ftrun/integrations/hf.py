"""Rank-level recovery for Hugging Face ``Trainer`` (transformers + accelerate): :class:`FTTrainer`.

The port of a ``Trainer`` script is a few lines (docs/frameworks/hf.md)::

    import ftrun
    from ftrun.integrations.hf import FTTrainer

    ft = ftrun.init()                     # before TrainingArguments: ftrun builds the process group
    args = TrainingArguments(...)
    trainer = FTTrainer(model=model, args=args, ...)   # in place of Trainer
    trainer.train()
    ...
    ft.finish()

Under torchrun, or as one process, :class:`FTTrainer` is ``Trainer``: none of its overrides does
anything. Under ftrun a rank that dies is respawned alone, and the Trainer's loop never sees the
fault. The Trainer owns its loop, so the integration drives ftrun's step loop (``ft.steps``) from
the doors the Trainer leaves, one ftrun step per optimizer step (``TrainerState.global_step``):

- ``get_batch_samples`` begins the step (ftrun's step start: the replica and rank state are
  snapshotted and this rank's own state is written to the job's store) and keeps the step's
  micro-batches (all of a gradient accumulation) for a retry.
- The model is ``ft.wrap_model(model, ddp=True, **accelerate's DDP keywords)``: a DDP whose buckets
  are averaged over ftrun's group during the last micro-batch's backward, bitwise equal to the DDP
  accelerate would build; accelerate then only adds its autocast (bf16).
- The optimizer is wrapped (:class:`RetryingOptimizer`, MindSpore's ``OptTFTWrapper`` idea): its
  ``step()`` applies the update only if the step's collectives succeeded; if they failed it
  recovers (the coordinator's plan, the new group, state to whoever needs it), rolls this rank's
  state back to the step's start, runs the step's micro-batches again with the inputs it holds,
  clips again (the gradient norm the Trainer logs is updated in place), and tries the update
  again. The Trainer then goes on as after a fault-free step: callbacks, the scheduler, logging,
  evaluation and saving each run once for the step.
- The logging, evaluation and saving after a step (``_maybe_log_save_evaluate``) make collectives
  of their own (gathers of the loss and of the evaluation's outputs). Their start is a second
  snapshot of the step's state; a fault there is recovered, the state rolled back to it, and the
  work done again with the new rank, which runs it first (a marker in the replica state says so).
- A respawned rank builds its Trainer as its predecessor did; at ``train()`` it takes the model,
  optimizer, scheduler and ``TrainerState`` (log history, callbacks' states, control flags) from a
  replica, its RNG streams and loss accumulators from the job's store, and goes on at its
  replicas' step through the Trainer's own resume path (``epochs_trained``, ``skip_first_batches``
  over the deterministic sampler), exactly as a resume from ``checkpoint-N`` does, but from a
  peer's memory.

The contract (docs/frameworks/hf.md): the model's forward is a function of its inputs, parameters and the global
RNG streams; callbacks keep their state in ``TrainerState`` or are stateless; the data order is the
Trainer's (a seeded sampler); no fp16 ``GradScaler`` (bf16 autocast is fine), no DeepSpeed or FSDP.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
from typing import Any, Iterator

import torch
from transformers import Trainer, TrainerControl

from ftrun.common.contract import RankEnv
from ftrun.integrations.common import FSDP_INSTEAD, until_done
from ftrun.rank.optim import FTOptimizer
from ftrun.rank.transfer import RNGState
from ftrun.rank.worker import Worker, current

#: The ``resume_from_checkpoint`` a respawned rank passes to the Trainer's resume path: no
#: directory; the state came from a replica (:meth:`FTTrainer._load_rng_state` knows it).
FROM_REPLICA = "<ftrun: state from a replica>"


class _Held:
    """A respawned rank's stand-in for an object the Trainer creates later (the optimizer, the
    scheduler): it keeps the state received from the donor until the real object takes it."""

    def __init__(self) -> None:
        self.state: dict[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        return self.state if self.state is not None else {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = state


class Stateful:
    """An object with ``state_dict()``/``load_state_dict()`` made of two functions (what ftrun's
    registry takes), for state the Trainer keeps in attributes of its own."""

    def __init__(self, get: Any, load: Any) -> None:
        self.get, self.load = get, load

    def state_dict(self) -> dict[str, Any]:
        return self.get()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.load(state)


#: ``TrainerState`` fields that belong to the process, not to the training: never taken from a donor.
PROCESS_FIELDS = frozenset({"is_local_process_zero", "is_world_process_zero"})


class RetryingOptimizer(FTOptimizer):
    """The optimizer the Trainer steps (inside accelerate's ``AcceleratedOptimizer``): an
    :class:`ftrun.rank.optim.FTOptimizer` whose ``step()`` does not return before the step's update is
    applied. When the step's collectives failed it recovers and runs the step again
    (:meth:`FTTrainer.retry_step`), as many times as faults come. Returns None, as
    ``torch.optim.Optimizer.step`` does without a closure.
    """

    def __init__(self, optimizer: torch.optim.Optimizer, worker: Worker, trainer: "FTTrainer") -> None:
        super().__init__(optimizer, worker)
        self.__dict__["trainer"] = trainer

    def step(self, closure: Any = None) -> Any:  # type: ignore[override]
        if closure is not None:
            raise ValueError("ftrun.integrations.hf: the Trainer's optimizer step takes no closure")
        while not super().step():
            self.trainer.retry_step()
        return None


#: The ``Trainer`` members :class:`FTTrainer` overrides or calls, present in the tested transformers (5.23).
TRAINER_MEMBERS = ("_init_training_state", "_prepare_for_training", "_run_epoch", "_maybe_log_save_evaluate",
                   "_load_rng_state", "_get_num_items_in_batch", "_get_grad_norm", "_clip_grad_norm",
                   "_track_num_input_tokens", "get_batch_samples", "training_step", "create_optimizer",
                   "create_scheduler", "floating_point_ops")


def _check_trainer() -> None:
    """Raises RuntimeError (one line) when this transformers' ``Trainer`` lacks a member FTTrainer needs."""
    missing = [name for name in TRAINER_MEMBERS if not callable(getattr(Trainer, name, None))]
    if missing:
        import transformers

        raise RuntimeError(f"ftrun.integrations.hf: transformers {transformers.__version__}'s Trainer has no "
                           f"{', '.join(missing)}, which FTTrainer needs (tested with 5.23; pip install 'ftrun[hf]')")


class FTTrainer(Trainer):
    """``transformers.Trainer`` whose ranks are recovered one by one under ftrun; see the module
    docstring. Takes ``Trainer``'s arguments. Call ``ftrun.init()`` before ``TrainingArguments``.

    Raises:
        RuntimeError: under ftrun, the process group was built before ``ftrun.init()`` (by
            ``TrainingArguments``/accelerate), so ftrun cannot rebuild it after a fault; or this
            transformers' ``Trainer`` lacks a member it overrides (:data:`TRAINER_MEMBERS`).
        ValueError: under ftrun, FSDP or DeepSpeed is enabled (one line; for FSDP it names what to
            use instead: :data:`ftrun.integrations.common.FSDP_INSTEAD`).
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._ft: Worker | None = None
        self._ft_in_loop = False
        self._ft_post_update: dict[str, Any] | None = None
        super().__init__(*args, **kwargs)
        env = RankEnv.from_environ(os.environ)
        if env.control_addr is None or not env.arf:
            return  # torchrun, one process, or ftrun without ARF: the plain Trainer
        ft = current()
        if ft is None:
            raise RuntimeError("ftrun.integrations.hf: call ftrun.init() before TrainingArguments(...) "
                               "(the process group must be ftrun's)")
        if not ft.managed or ft.world_size == 1:
            return
        if self.is_fsdp_enabled:
            raise ValueError(f"ftrun.integrations.hf: FSDP is not recovered by this integration: {FSDP_INSTEAD}")
        if self.is_deepspeed_enabled:
            raise ValueError("ftrun.integrations.hf: DeepSpeed is not supported (plain DDP only)")
        _check_trainer()
        self._ft = ft
        self._ft_steps: Iterator[int] | None = None
        self._ft_step: int | None = None  # the step begun and not yet ended
        self._ft_begun = False  # the next step was already begun (by a recovery) when the Trainer fetches its batches
        self._ft_batches: list[Any] = []
        self._ft_num_items: Any = None
        self._ft_device: Any = None
        self._ft_rng_after_fetch: dict[str, Any] | None = None
        self._ft_grad_norm: Any = None
        self._ft_joined_rng: dict[str, Any] | None = None
        self._ft_resumed = False
        self._ft_skipped = False
        self._ft_rng_at_begin = True  # a respawned rank: its predecessor's streams go back as its first step begins
        self._ft_held: dict[str, Any] = {}  # a respawned rank: the optimizer's and scheduler's received state
        ddp_kwargs = self.accelerator.ddp_handler.to_kwargs() if self.accelerator.ddp_handler is not None else {}
        # The Trainer leaves a model it finds wrapped alone (``_wrap_model``), and accelerate prepares
        # only the optimizer; _prepare_for_training adds the rest of accelerate's preparation.
        self.model_wrapped = ft.wrap_model(self.model, ddp=True, **ddp_kwargs)
        self._ft_pending: dict[str, dict[str, Any]] = {}  # a respawned rank's, until the Trainer's loop is set up
        ft.register("trainer", Stateful(self.replica_state, self.load_replica_state), kind="replica")
        ft.register("trainer_rank", Stateful(self.rank_state, self.load_rank_state), kind="rank")
        if ft.joining or ft.resume_dir is not None:
            ft.register("optimizer", _Held(), kind="committed")
            ft.register("scheduler", _Held(), kind="replica")

    # ------------------------------------------------------------------ the Trainer's own state
    def replica_state(self) -> dict[str, Any]:
        """The Trainer's state that is the same on every replica (registered as ``"trainer"``, kind
        ``replica``): ``TrainerState`` (global step, epoch, log history, best metric, the stateful
        callbacks' states; as JSON, as in ``checkpoint-N/trainer_state.json``), the control flags, the
        logging's loss total and counters, and the logging/evaluation/saving under way, if any (a
        respawned rank runs it before its first step)."""
        return {
            # Keys in their order (not sorted, as trainer_state.json has them): a log entry reads
            # the same after a roll-back.
            "trainer_state": json.dumps(dataclasses.asdict(self.state)),
            "control": {f.name: getattr(self.control, f.name) for f in dataclasses.fields(TrainerControl)},
            "total_loss": float(getattr(self, "_total_loss_scalar", 0.0)),
            "last_logged": int(getattr(self, "_globalstep_last_logged", 0)),
            "initial_step": int(getattr(self, "_initial_global_step", 0)),
            "initial_tokens": int(getattr(self, "_initial_num_input_tokens_seen", 0) or 0),
            "post_update": self._ft_post_update,
        }

    def load_replica_state(self, state: dict[str, Any]) -> None:
        """Take a donor's :meth:`replica_state` (or this rank's, rolled back)."""
        if not self._ft_in_loop:
            self._ft_pending["replica"] = dict(state)  # the loop's set-up resets some: applied again then
        for name, value in json.loads(state["trainer_state"]).items():
            if hasattr(self.state, name) and name not in PROCESS_FIELDS:
                setattr(self.state, name, value)
        for name, value in state["control"].items():
            setattr(self.control, name, value)
        self._total_loss_scalar = float(state["total_loss"])
        self._globalstep_last_logged = int(state["last_logged"])
        self._initial_global_step = int(state["initial_step"])
        self._initial_num_input_tokens_seen = int(state["initial_tokens"])
        self._ft_post_update = state["post_update"]

    def rank_state(self) -> dict[str, Any]:
        """This rank's own accumulators (registered as ``"trainer_rank"``, kind ``rank``): the loss
        summed since the last log (gathered over the ranks at each log) and the floating-point
        operations since the last store. A respawned rank takes its predecessor's from the job's store."""
        tr_loss = getattr(self, "_tr_loss", None)
        return {"tr_loss": tr_loss.detach().clone() if isinstance(tr_loss, torch.Tensor) else torch.tensor(0.0),
                "flos": float(getattr(self, "current_flos", 0.0))}

    def load_rank_state(self, state: dict[str, Any]) -> None:
        """Take this rank's :meth:`rank_state` back (a retry, or a predecessor's record)."""
        if not self._ft_in_loop:
            self._ft_pending["rank"] = dict(state)
            return
        self._tr_loss.copy_(state["tr_loss"])
        self.current_flos = float(state["flos"])

    # ------------------------------------------------------------------ optimizer and scheduler
    def create_optimizer(self, model: Any = None) -> Any:
        optimizer = super().create_optimizer(model) if model is not None else super().create_optimizer()
        ft = self._ft
        if ft is None or isinstance(optimizer, RetryingOptimizer):
            return optimizer
        self._hold("optimizer")
        ft.register("optimizer", optimizer, kind="committed", replace=True)  # where the placeholder stood
        self.optimizer = RetryingOptimizer(optimizer, ft, self)
        return self.optimizer

    def create_scheduler(self, num_training_steps: int, optimizer: Any = None) -> Any:
        scheduler = super().create_scheduler(num_training_steps, optimizer)
        ft = self._ft
        if ft is not None:
            self._hold("scheduler")
            ft.register("scheduler", scheduler, kind="replica", replace=True)  # where the placeholder stood
        return scheduler

    def _hold(self, name: str) -> None:
        """Keep the state a respawned rank received for ``name`` before the Trainer created it."""
        ft = self._ft
        assert ft is not None
        held = ft.registry[name] if name in ft.registry else None
        if isinstance(held, _Held) and held.state is not None:
            self._ft_held[name] = held.state

    # ------------------------------------------------------------------ the loop's set-up
    def _prepare_for_training(self, max_steps: int, train_dataloader: Any, resume_from_checkpoint: Any) -> Any:
        model, train_dataloader = super()._prepare_for_training(max_steps, train_dataloader, resume_from_checkpoint)
        if self._ft is not None:
            # accelerate's own part of preparing a model, without its DDP (ftrun's is there): autocast
            # (bf16) on the inner module's forward, where accelerate puts it before it wraps the
            # module in its DDP (evaluations, which use the inner module, run under it too), and the
            # model in its list of prepared models (an evaluation then prepares nothing more).
            self.accelerator.prepare_model(self.model, device_placement=False, evaluation_mode=True)
            # A respawned rank: the optimizer's and then the scheduler's received state, in the order
            # of the Trainer's own resume (``_load_optimizer_and_scheduler``): a scheduler's
            # construction sets the learning rates of its first step, the optimizer's state puts
            # them back, and the scheduler's state then takes its place in the schedule.
            held, self._ft_held = self._ft_held, {}
            if "optimizer" in held:
                self.optimizer.load_state_dict(held["optimizer"])
            if "scheduler" in held:
                self.lr_scheduler.load_state_dict(held["scheduler"])
        return model, train_dataloader

    def _init_training_state(self, max_steps: int, num_update_steps_per_epoch: int, num_train_epochs: int,
                             resume_from_checkpoint: Any, trial: Any) -> tuple[int, int]:
        epochs_trained, steps_in_epoch = super()._init_training_state(
            max_steps, num_update_steps_per_epoch, num_train_epochs, resume_from_checkpoint, trial)
        ft = self._ft
        if ft is None:
            return epochs_trained, steps_in_epoch
        self._ft_in_loop = False
        self._ft_steps = ft.steps(max_steps, start=self.state.global_step)
        if not ft.joining and ft.resume_dir is None:
            return epochs_trained, steps_in_epoch
        # A respawned rank: recover now (model, optimizer, scheduler and TrainerState from a replica),
        # then start where its replicas are, through the Trainer's resume path. A rank starting from
        # one of ftrun's checkpoints (TTP, a whole-job restart) loads it now, the same way.
        self._ft_step = next(self._ft_steps)
        self._ft_begun = True
        self._ft_joined_rng = RNGState().state_dict()  # its predecessor's, where the step began
        if self.state.global_step != self._ft_step:
            raise RuntimeError(f"ftrun.integrations.hf: recovered at step {self._ft_step} but TrainerState says "
                               f"global_step={self.state.global_step}")
        self._ft_resumed = True
        epochs_trained = self.state.global_step // num_update_steps_per_epoch
        steps_in_epoch = (self.state.global_step % num_update_steps_per_epoch) * self.args.gradient_accumulation_steps
        self._ft_skipped = steps_in_epoch > 0 and not self.args.ignore_data_skip
        return epochs_trained, steps_in_epoch

    def _run_epoch(self, model: Any, epoch: int, train_dataloader: Any, steps_in_epoch: int,
                   num_update_steps_per_epoch: int, trial: Any, ignore_keys_for_eval: Any, start_time: float,
                   resume_from_checkpoint: Any, epochs_trained: int, steps_trained_in_current_epoch: int) -> Any:
        ft = self._ft
        if ft is not None and not self._ft_in_loop:
            self._ft_in_loop = True
            pending, self._ft_pending = self._ft_pending, {}
            if "replica" in pending:  # what the Trainer reset when its loop started
                self.load_replica_state(pending["replica"])
            if "rank" in pending:
                self.load_rank_state(pending["rank"])
            if self._ft_post_update is not None:  # its replicas were logging/evaluating/saving: join them
                post = self._ft_post_update
                if self._ft_joined_rng is not None:
                    # Its predecessor's streams where that work began; what the work draws (an
                    # evaluation DataLoader's seed) is drawn again, and the step starts after it.
                    RNGState().load_state_dict(self._ft_joined_rng)
                    self._ft_joined_rng = None
                self._maybe_log_save_evaluate(self._tr_loss, post["grad_norm"], model, trial, post["epoch"],
                                              ignore_keys_for_eval, start_time, learning_rate=post["learning_rate"])
                if self._ft_skipped:  # the mid-epoch fetch below must not move the streams
                    self._ft_joined_rng = RNGState().state_dict()
                    self._ft_rng_at_begin = False
        if ft is not None and self._ft_resumed and epoch == epochs_trained:
            resume_from_checkpoint = FROM_REPLICA
        return super()._run_epoch(model, epoch, train_dataloader, steps_in_epoch, num_update_steps_per_epoch, trial,
                                  ignore_keys_for_eval, start_time, resume_from_checkpoint, epochs_trained,
                                  steps_trained_in_current_epoch)

    def _load_rng_state(self, checkpoint: Any) -> None:
        if checkpoint == FROM_REPLICA:
            return  # the predecessor's streams are put back where its step began (get_batch_samples)
        super()._load_rng_state(checkpoint)

    # ------------------------------------------------------------------ one step
    def _begin_step(self) -> int:
        ft = self._ft
        assert ft is not None and self._ft_steps is not None
        if self._ft_begun:
            self._ft_begun = False
            if self._ft_joined_rng is not None and self._ft_rng_at_begin:
                RNGState().load_state_dict(self._ft_joined_rng)
            ft.checks.snapshot_step_start()  # the state here, not where the recovery left it
        else:
            self._ft_step = next(self._ft_steps)
        if self._ft_step != self.state.global_step:
            raise RuntimeError(f"ftrun.integrations.hf: ftrun's step {self._ft_step} is not the Trainer's "
                               f"global_step {self.state.global_step}")
        return self._ft_step

    def get_batch_samples(self, epoch_iterator: Iterator, num_batches: int, device: torch.device) -> tuple[list, Any]:
        if self._ft is None:
            return super().get_batch_samples(epoch_iterator, num_batches, device)
        self._begin_step()
        batches: list[Any] = []
        for _ in range(num_batches):
            try:
                batches.append(next(epoch_iterator))
            except StopIteration:
                break
        self._ft_batches = batches
        joined, self._ft_joined_rng = self._ft_joined_rng, None
        if joined is not None and self._ft_skipped:
            # A respawned rank resumed mid-epoch: its first fetch came from a fresh iterator over the
            # skipped loader, which drew its seeds from the global generator; a fetch mid-epoch draws
            # nothing in the run without a fault. Its predecessor's streams go back (the Trainer's
            # own resume does the same: ``_load_rng_state`` after the first fetch).
            RNGState().load_state_dict(joined)
        self._ft_rng_after_fetch = RNGState().state_dict()
        self._ft_device = device
        self._count_items()
        return batches, self._ft_num_items

    def _count_items(self) -> None:
        """The step's item count (a gather over the ranks when the loss is averaged over tokens
        across devices): a collective of the step's start, which a retry makes again, as the
        respawned rank makes it at its first step."""
        batches, device = self._ft_batches, self._ft_device
        self._ft_num_items = self._guarded(lambda: self._get_num_items_in_batch(batches, device), redo_step=True)

    def _get_grad_norm(self, model: Any, grad_norm: Any = None) -> Any:
        norm = super()._get_grad_norm(model, grad_norm)
        self._ft_grad_norm = norm
        return norm

    def retry_step(self) -> None:
        """The step's collectives failed: recover (ftrun's step loop rolls this rank's state back to
        the step's start), then run the step's micro-batches again with the inputs held since
        ``get_batch_samples`` and clip again. Called by :class:`RetryingOptimizer`."""
        ft = self._ft
        assert ft is not None and self._ft_steps is not None
        step = next(self._ft_steps)
        if step != self._ft_step:
            # Its replicas committed the step (this rank alone failed its update: a recoverable
            # error repaired in place), and the state it took is theirs after the step's logging,
            # scheduler and callbacks, which the Trainer is about to run here again. It cannot go
            # on without counting them twice: it ends, and ARF replaces it (its record is right).
            raise RuntimeError(f"ftrun.integrations.hf: rank {self._ft.rank} repaired step {self._ft_step}, which its "
                               f"replicas committed; it resumes at step {step} as a respawned rank")
        self._count_items()
        self._replay()

    def _replay(self) -> None:
        """The Trainer's micro-batch loop for the held batches (``_run_epoch``'s inner loop, without
        the callbacks, which ran for the first try)."""
        model, batches = self.model_wrapped, self._ft_batches
        if self._ft_rng_after_fetch is not None:
            RNGState().load_state_dict(self._ft_rng_after_fetch)
        model.zero_grad()
        last = len(batches) - 1
        for i, inputs in enumerate(batches):
            self.accelerator.gradient_state._set_sync_gradients(i == last)
            sync = contextlib.nullcontext() if i == last else self.accelerator.no_sync(model=model)
            with sync:
                loss = self.training_step(model, inputs, self._ft_num_items)
            if self.args.logging_nan_inf_filter and (torch.isnan(loss) or torch.isinf(loss)):
                self._tr_loss += self._tr_loss / (1 + self.state.global_step - self._globalstep_last_logged)
            else:
                self._tr_loss += loss
            self.current_flos += float(self.floating_point_ops(inputs))
            self._track_num_input_tokens(inputs)
        norm = self._clip_grad_norm(model) if self.args.max_grad_norm > 0 else None
        norm = super()._get_grad_norm(model, grad_norm=norm)
        first = self._ft_grad_norm
        if isinstance(first, torch.Tensor) and isinstance(norm, torch.Tensor):
            first.copy_(norm)  # the value the Trainer logs for this step
        else:
            self._ft_grad_norm = norm

    def _guarded(self, work: Any, redo_step: bool) -> Any:
        """Run ``work`` (a collective the Trainer makes); on a fault, recover and run it again.
        ``redo_step``: the step has not been updated yet (its start is the retry's start)."""
        ft = self._ft
        assert ft is not None and self._ft_steps is not None
        steps = self._ft_steps

        def recover() -> None:
            step = next(steps)
            if redo_step:
                if step != self._ft_step:
                    raise RuntimeError(f"ftrun.integrations.hf: a retry of step {self._ft_step} resumed at step {step}")
                if self._ft_rng_after_fetch is not None:
                    RNGState().load_state_dict(self._ft_rng_after_fetch)
            else:
                self._ft_step, self._ft_begun = step, True

        return until_done(ft, work, "a collective of the Trainer failed", recover)

    def _maybe_log_save_evaluate(self, tr_loss: Any, grad_norm: Any, model: Any, trial: Any, epoch: Any,
                                 ignore_keys_for_eval: Any, start_time: float, learning_rate: Any = None) -> None:
        ft = self._ft
        if ft is None:
            return super()._maybe_log_save_evaluate(tr_loss, grad_norm, model, trial, epoch, ignore_keys_for_eval,
                                                    start_time, learning_rate=learning_rate)
        norm = grad_norm.item() if isinstance(grad_norm, torch.Tensor) else grad_norm
        self._ft_post_update = {"grad_norm": norm, "epoch": epoch, "learning_rate": learning_rate}
        # The work's start is the state a fault in it rolls back to, and this rank's record in the store.
        ft.checks.snapshot_step_start()

        def work() -> None:
            if self._ft_post_update is None:  # a recovery moved past it (not expected)
                return
            super(FTTrainer, self)._maybe_log_save_evaluate(self._tr_loss, self._ft_post_update["grad_norm"], model,
                                                            trial, self._ft_post_update["epoch"], ignore_keys_for_eval,
                                                            start_time, learning_rate=self._ft_post_update["learning_rate"])

        # An evaluation or a save may outlast the step bound: bounded as a section instead.
        long_work = self.control.should_evaluate or self.control.should_save
        with ft.section("evaluate/save") if long_work else contextlib.nullcontext():
            self._guarded(work, redo_step=False)
        self._ft_post_update = None
        # And its end: a rank that dies after this work (its replicas finish it too) is replaced by
        # one that starts from here: the logged loss reset, the evaluation's draws made (the
        # record is sent before the loop goes on: a rank killed right after an evaluation leaves
        # its successor the record with its draws).
        ft.checks.snapshot_step_start()

    def train(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().train(*args, **kwargs)
        finally:
            steps, self._ft_steps = getattr(self, "_ft_steps", None), None
            if steps is not None:
                steps.close()  # ftrun's step loop ends with the Trainer's
