"""A step is a transaction: everything it changes is committed at its end or rolled back whole.

The unit of exactly-once is the step between two ``ft.steps``/``ft.batches`` iterations, whatever
it holds: several models, several optimizers, several backward passes, an update that reads an
earlier update of the same step (a GAN's D, then G through the updated D), an optimizer whose
``step(closure)`` runs forward and backward passes between changes of the parameters (LBFGS).
What a step can change, and how each part is undone when the step fails and is retried:

- the ``replica`` and ``rank`` objects of the registry (a scheduler, a data position, the RNG
  streams): copied at the step's start and rolled back (:class:`ftrun.rank.registry.StateRegistry`);
- the registered modules' buffers (BatchNorm's running statistics change in every training
  forward, not in the update): each rank's own (under DDP every rank's differ after its forward;
  rank 0's are broadcast before the next one), so they are rank state, copied at the step's start
  (:class:`ModuleBuffers`) and kept in the rank's records for a respawned successor;
- the updates (an optimizer's parameters and state, or a hand-written update's): an update that
  may not be the step's last change keeps an *undo copy* of what it changes until the step
  commits (:class:`StepTransaction`).

The cheapest path is today's: with one optimizer stepped once a step and no closure, its update
is the step's last change, nothing needs an undo copy, and the step commits at the update. The
step's shape is learnt as the job runs (the most updates seen in one step, and at least one per
registered optimizer before the last is trusted), so a two-optimizer step keeps an undo copy of
its first update only. A step that grows past the learnt shape after committing at an update
(an optimizer stepped a second time in a step, for the first time) cannot be undone: a failure in
what follows leaves the rank without usable state (it takes a replica's, or the job restarts from
a checkpoint), never silently wrong.

The idea is the database's (a write-ahead undo log); in training, TorchFT's ``should_commit``
applies one update per step after every collective succeeded, and MindIO TTP's "Updated" state
marks a step whose update finished.
"""

from __future__ import annotations

from typing import Any, Iterable

import torch

__all__ = ["ModuleBuffers", "StepTransaction", "UpdateUndo"]


def _deep_copy(value: Any) -> Any:
    """A copy of ``value`` whose tensors (on their own device) and containers are new: an
    optimizer's state may hold lists it appends to (LBFGS's history of directions and steps)."""
    if isinstance(value, torch.Tensor):
        return value.detach().clone()
    if isinstance(value, (list, tuple)):
        return type(value)(_deep_copy(v) for v in value)
    if isinstance(value, dict):
        return {k: _deep_copy(v) for k, v in value.items()}
    return value


def _copy_into(old: torch.Tensor | None, value: torch.Tensor) -> torch.Tensor:
    """``value``'s bytes in ``old`` when it fits (same shape, dtype and device), else in a new tensor."""
    value = value.detach()
    if old is not None and old.shape == value.shape and old.dtype == value.dtype and old.device == value.device:
        old.copy_(value)
        return old
    return value.clone()


class ModuleBuffers:
    """The buffers of one registered module as rank state (registered by ``ft.wrap_model`` as
    ``"<name>.buffers"``, kind ``rank``, when the module has buffers).

    ``state_dict()`` holds the buffers that have changed since the module was wrapped (BatchNorm's
    running statistics once it trained): those differ from rank to rank, so a respawned rank takes
    its predecessor's from its record. A buffer that never changed is rank 0's initial one on every
    replica, which the donor's model state already carries; leaving it out keeps records small
    (a constant attention mask is not written to the job's store every step).

    :meth:`begin_step` keeps a copy of every buffer (reused from step to step: one copy of the
    buffers' bytes in memory) and :meth:`roll_back` puts it back, so a retried step's forward
    passes start from the same statistics as its first try's. Changes are found by value, not by
    ``Tensor._version``: the batch-norm kernel updates its running statistics in place without
    bumping it (torch 2.13).
    """

    def __init__(self, module: torch.nn.Module) -> None:
        self.module = module
        # Each buffer at the step's start; a buffer that never changed keeps its initial copy
        # (which is then its value at every step's start), so one copy serves both purposes.
        self._copies = {name: b.detach().clone() for name, b in module.named_buffers()}
        self._changed: set[str] = set()  # buffers seen different from their initial value

    def _buffers(self) -> list[tuple[str, torch.Tensor]]:
        return list(self.module.named_buffers())

    def _note_changes(self, buffers: Iterable[tuple[str, torch.Tensor]]) -> None:
        for name, b in buffers:
            if name not in self._changed:
                initial = self._copies.get(name)
                if initial is None or initial.shape != b.shape or initial.dtype != b.dtype or not torch.equal(initial, b):
                    self._changed.add(name)

    def changed(self) -> bool:
        """Whether a buffer changed since the module was wrapped."""
        if not self._changed:
            self._note_changes(self._buffers())
        return bool(self._changed)

    def constant(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, buffer)`` of the buffers that never changed (rank 0's initial ones on every replica)."""
        buffers = self._buffers()
        self._note_changes(buffers)
        return [(name, b) for name, b in buffers if name not in self._changed]

    def state_dict(self) -> dict[str, torch.Tensor]:
        buffers = self._buffers()
        self._note_changes(buffers)
        return {name: b for name, b in buffers if name in self._changed}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        buffers = dict(self._buffers())
        with torch.no_grad():
            for name, value in state.items():
                if name in buffers:
                    buffers[name].copy_(torch.as_tensor(value))
                    self._changed.add(name)

    def begin_step(self) -> None:
        """Copy every buffer as it is at the step's start (a memcpy of those that changed since
        the module was wrapped; a comparison of the others with their initial copy)."""
        buffers = self._buffers()
        self._note_changes(buffers)
        for name, b in buffers:
            if name in self._changed:
                self._copies[name] = _copy_into(self._copies.get(name), b)

    def roll_back(self) -> None:
        """Put every buffer back as it was at the last :meth:`begin_step`."""
        with torch.no_grad():
            for name, b in self._buffers():
                copy = self._copies.get(name)
                if copy is not None and copy.shape == b.shape and copy.dtype == b.dtype:
                    b.copy_(copy)


class UpdateUndo:
    """What one update changes, copied before it runs, so it can be undone in place.

    Args:
        optimizer: the ``torch.optim.Optimizer`` the update steps (its parameters, per-parameter
            state and ``param_groups`` hyperparameters are copied), or None for a hand-written
            update (``ft.apply_update``): then ``modules``' parameters and ``others``' state dicts.
        modules: the registered models (a hand-written update's parameters).
        others: other registered ``committed`` objects (a hand-written update's momentum buffers).

    Copies are made into the tensors of the previous use when shapes allow (no allocation in the
    steady state); memory is one copy of the parameters and optimizer state that the update touches.
    Restoring copies back into the live tensors (their identity is kept: a scheduler, a DDP bucket
    view or a script holding a reference sees the restored values); optimizer state created by
    the update (Adam's moments on its first step) is removed again.
    """

    def __init__(self, optimizer: Any, modules: list[torch.nn.Module], others: list[Any]) -> None:
        self.optimizer = optimizer
        self.modules = modules
        self.others = others
        self._params: list[torch.Tensor] = []
        self._param_copies: list[torch.Tensor] = []
        self._state: dict[int, dict[str, Any] | None] = {}
        self._groups: list[dict[str, Any]] = []
        self._others: list[Any] = []

    def take(self) -> None:
        """Copy what the update is about to change."""
        from ftrun.common.checkpoint import snapshot

        if self.optimizer is not None:
            params = [p for g in self.optimizer.param_groups for p in g["params"]]
        else:
            params = [p for m in self.modules for p in m.parameters()]
        old = dict(zip(map(id, self._params), self._param_copies))
        self._params = params
        self._param_copies = [_copy_into(old.get(id(p)), p) for p in params]
        if self.optimizer is not None:
            state = self.optimizer.state
            kept = self._state
            self._state = {}
            for p in params:
                entry = state.get(p)
                if entry is None:
                    self._state[id(p)] = None
                    continue
                previous = kept.get(id(p)) or {}
                self._state[id(p)] = {k: _copy_into(previous.get(k), v) if isinstance(v, torch.Tensor) else _deep_copy(v)
                                      for k, v in entry.items()}
            self._groups = [{k: _deep_copy(v) for k, v in g.items() if k != "params"} for g in self.optimizer.param_groups]
        self._others = [snapshot(o.state_dict()) for o in self.others]

    def restore(self) -> None:
        """Undo the update: everything :meth:`take` copied is put back in place."""
        from ftrun.common.checkpoint import snapshot

        with torch.no_grad():
            for p, copy in zip(self._params, self._param_copies):
                p.copy_(copy)
            if self.optimizer is not None:
                state = self.optimizer.state
                for p in self._params:
                    saved = self._state.get(id(p))
                    if saved is None:
                        state.pop(p, None)
                        continue
                    entry = state[p]
                    for key in [k for k in entry if k not in saved]:
                        del entry[key]
                    for key, value in saved.items():
                        live = entry.get(key)
                        if isinstance(value, torch.Tensor):
                            if isinstance(live, torch.Tensor) and live.shape == value.shape and live.dtype == value.dtype:
                                live.copy_(value)
                            else:
                                entry[key] = value.clone()
                        else:
                            entry[key] = _deep_copy(value)  # the copy stays as taken for another retry
                for group, saved_group in zip(self.optimizer.param_groups, self._groups):
                    for key, value in saved_group.items():
                        live = group.get(key)
                        if isinstance(value, torch.Tensor) and isinstance(live, torch.Tensor) and live.shape == value.shape:
                            live.copy_(value)
                        else:
                            group[key] = _deep_copy(value)
        for obj, saved_state in zip(self.others, self._others):
            obj.load_state_dict(snapshot(saved_state))

    def nbytes(self) -> int:
        """Bytes held by the copies (parameters and optimizer state tensors)."""
        total = sum(c.numel() * c.element_size() for c in self._param_copies)
        for saved in self._state.values():
            for value in (saved or {}).values():
                if isinstance(value, torch.Tensor):
                    total += value.numel() * value.element_size()
        return total


class StepTransaction:
    """One rank's step as a transaction over its updates (see the module docstring).

    The step loop (or a framework integration) calls :meth:`begin` at each step's start; the
    optimizer wrapper calls :meth:`before_update` and :meth:`after_update` around each update it
    applies; the loop calls
    :meth:`end` when the step's body ended well, and a recovery :meth:`abort` when it failed.

    Args:
        optimizers: returns the registered optimizers (their number is the least count of updates
            a step makes before its last one is trusted to be the last).
        undo_for: returns the :class:`UpdateUndo` to use for an optimizer (None: a hand-written
            update), reused from step to step.

    Attributes:
        most_updates: the most updates one step has made so far in this process (0 before any).
        updates: updates applied in the current try of the step.
        committed_at_update: the current try was committed by an update (nothing to undo).
        grown: after that commit, the step went on with another update or synced backward pass
            (its shape grew past what was learnt): if it fails now, it cannot be undone.
    """

    def __init__(self, optimizers: Any, undo_for: Any) -> None:
        self._optimizers = optimizers
        self._undo_for = undo_for
        self.most_updates = 0
        self.updates = 0
        self.committed_at_update = False
        self.grown = False
        self._undo: list[UpdateUndo] = []
        self._copied: set[int] = set()
        self._last = False  # the update running now is the last one the step's shape expects
        # A step went on with a synced backward pass or another update after committing at an
        # update (an unwrapped model's gradients averaged after the update, say): from then on no
        # update is trusted to be the last, and steps commit at their body's end.
        self.late_work = False

    def begin(self) -> None:
        """A step (or a retry of one) starts: nothing is applied yet."""
        self.updates = 0
        self.committed_at_update = False
        self.grown = False
        self._undo.clear()
        self._copied.clear()

    def before_update(self, optimizer: Any, closure: bool) -> None:
        """An update is about to run: keep an undo copy of what it changes unless it is the step's
        last change (the last update the step's learnt shape expects) and makes no collective of
        its own.

        Args:
            optimizer: the optimizer it steps (None: a hand-written update).
            closure: it calls a closure that runs forward and backward passes (LBFGS): the
                parameters change between its collectives, so it always keeps an undo copy.
        """
        if self.committed_at_update:
            self.grown = True
        self.updates += 1
        self._last = not self.late_work and self.updates >= max(self.most_updates, len(self._optimizers()), 1)
        if (closure or not self._last) and not self.committed_at_update and id(optimizer) not in self._copied:
            undo = self._undo_for(optimizer)
            undo.take()
            self._undo.append(undo)
            self._copied.add(id(optimizer))

    def after_update(self, ok: bool) -> bool:
        """The update ran; ``ok``: no collective failed meanwhile (a closure's backward passes).
        Returns whether the step is committed by it (it was the last update expected)."""
        if not ok or not self._last or self.committed_at_update:
            return False
        self.committed_at_update = True
        self._undo.clear()  # the step's last change is made: nothing of it will be undone
        self._copied.clear()
        return True

    def backward_pass(self) -> None:
        """A synced backward pass starts (its gradients will be averaged)."""
        if self.committed_at_update:
            self.grown = True

    def end(self) -> None:
        """The step's body ended well: it is committed; its shape is learnt."""
        self.most_updates = max(self.most_updates, self.updates)
        self.late_work = self.late_work or self.grown
        self.begin()

    def abort(self) -> bool:
        """The step failed: undo its updates, newest first. Returns False when it cannot (it was
        committed at an update and grew after it: the rank's state is a partial step)."""
        if self.committed_at_update:
            self.most_updates = max(self.most_updates, self.updates)
            self.late_work = self.late_work or self.grown
            return not self.grown
        for undo in reversed(self._undo):
            undo.restore()
        self._undo.clear()
        self._copied.clear()
        self.updates = 0
        return True

    def undo_bytes(self) -> int:
        """Bytes held by the current undo copies."""
        return sum(u.nbytes() for u in self._undo)
