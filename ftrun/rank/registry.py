"""The registered training state of one rank, by kind (the state registry, split out of
:class:`ftrun.rank.worker.Worker`).

Every object with ``state_dict()``/``load_state_dict()`` registered with a worker has a *kind*:

- ``"committed"``: changed only by the updates (the model, the optimizer). A donor sends it; it is
  not copied at step start: an update runs only once a step's collectives succeeded, and one that
  may not be the step's last change keeps an undo copy until the step commits
  (:class:`ftrun.rank.transaction.StepTransaction`), so a retried step never finds it changed. A
  model's buffers, which change in its forward passes, are rank state
  (:class:`ftrun.rank.transaction.ModuleBuffers`).
- ``"replica"``: identical on every replica and changed by work after the update (a scheduler, a
  counter, an EMA). A donor sends it; it is snapshotted at every step's start and rolled back when
  the step is retried, so ``scheduler.step()`` never runs twice for one step.
- ``"rank"``: this rank's own (a data loader's position, per-rank RNG streams). Snapshotted and
  rolled back the same way, never taken from another rank (TorchFT's separation of replica and
  rank state; a respawned rank gets its predecessor's from the job's store, :mod:`ftrun.rank.rankstate`).
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Iterator

import torch

from ftrun.common import codec
from ftrun.common.checkpoint import snapshot
from ftrun.rank.transaction import ModuleBuffers, StepTransaction, UpdateUndo

KINDS = ("replica", "rank", "committed")


class StateRegistry:
    """Named stateful objects and their kinds, with the step-start snapshot used to retry a step.

    ``registry[name]`` is the object, ``name in registry`` tests registration, ``items()`` yields
    ``(name, obj)`` in registration order, ``kinds[name]`` is its kind.
    """

    def __init__(self) -> None:
        self.objects: dict[str, Any] = {}
        self.kinds: dict[str, str] = {}
        self._start: StepStart | None = None  # the copy taken at the last step start
        self._undos: dict[int, UpdateUndo] = {}  # by id of the optimizer (0: a hand-written update)
        # The step as a transaction over its updates (ftrun.rank.transaction).
        self.transaction = StepTransaction(self.optimizers, self._undo_for)

    def register(self, name: str, obj: Any, kind: str = "replica", replace: bool = False) -> Any:
        """Add ``obj`` under ``name`` as ``kind`` (see the module docstring). Returns ``obj``.

        Registering the same object again under its name changes nothing but its kind; another
        object under a taken name is refused unless ``replace`` (a framework integration putting
        the real optimizer where a placeholder stood).

        Raises:
            TypeError: ``obj`` has no ``state_dict``/``load_state_dict``.
            ValueError: an unknown ``kind``, or ``name`` is taken by another object (one line
                naming both).
        """
        if not (callable(getattr(obj, "state_dict", None)) and callable(getattr(obj, "load_state_dict", None))):
            raise TypeError(f"ftrun.register({name!r}): the object needs state_dict() and load_state_dict()")
        if kind not in KINDS:
            raise ValueError(f"ftrun.register({name!r}): kind must be 'replica', 'rank' or 'committed', not {kind!r}")
        taken = self.objects.get(name)
        if taken is not None and taken is not obj and not replace:
            raise ValueError(f"ftrun.register({name!r}): the name is taken by {describe_object(taken)}; "
                             f"{describe_object(obj)} needs a name of its own (name=...)")
        self.objects[name] = obj
        self.kinds[name] = kind
        return obj

    def free_name(self, name: str) -> str:
        """``name`` if no object holds it, else the first of ``name2``, ``name3``... that is free."""
        if name not in self.objects:
            return name
        n = 2
        while f"{name}{n}" in self.objects:
            n += 1
        return f"{name}{n}"

    def name_for(self, name: str | None, default: str, obj: Any) -> str:
        """``name``, or the first free one of ``default``, ``default2``... (said on the rank's log
        when it is not ``default`` itself: the script wrapped a second model or optimizer without
        naming it)."""
        if name is not None:
            return name
        free = self.free_name(default)
        if free != default:
            print(f"ftrun: {describe_object(obj)} registered as {free!r} ({default!r} is taken by "
                  f"{describe_object(self.objects[default])}); pass name=... to choose", file=sys.stderr, flush=True)
        return free

    def optimizers(self) -> list[torch.optim.Optimizer]:
        """The registered optimizers (kind ``committed``), in registration order."""
        return [o for n, o in self.objects.items() if self.kinds[n] == "committed" and isinstance(o, torch.optim.Optimizer)]

    def modules(self, kind: str = "committed") -> list[tuple[str, torch.nn.Module]]:
        """``(name, module)`` of the registered models (kind ``committed``), in registration order."""
        return [(n, o) for n, o in self.objects.items() if self.kinds[n] == kind and isinstance(o, torch.nn.Module)]

    def module_buffers(self) -> list[ModuleBuffers]:
        """The registered modules' buffers (rank state), in registration order."""
        return [o for o in self.objects.values() if isinstance(o, ModuleBuffers)]

    def buffer_values(self) -> list[list[torch.Tensor]]:
        """A copy of every registered model's buffers (for :meth:`load_buffer_values`)."""
        return [[b.detach().clone() for b in mb.module.buffers()] for mb in self.module_buffers()]

    def load_buffer_values(self, values: list[list[torch.Tensor]]) -> None:
        """Put back buffers copied by :meth:`buffer_values` (in place)."""
        with torch.no_grad():
            for mb, saved in zip(self.module_buffers(), values):
                for b, value in zip(mb.module.buffers(), saved):
                    b.copy_(value)

    def _undo_for(self, optimizer: Any) -> UpdateUndo:
        """The undo copy kept for ``optimizer``'s updates (None: a hand-written update's, which
        covers the registered models and other ``committed`` objects), made once and reused."""
        key = id(optimizer) if optimizer is not None else 0
        undo = self._undos.get(key)
        if undo is None:
            others = [o for n, o in self.objects.items() if self.kinds[n] == "committed"
                      and not isinstance(o, (torch.nn.Module, torch.optim.Optimizer))]
            undo = self._undos[key] = UpdateUndo(optimizer, [m for _, m in self.modules()], others)
        return undo

    def __getitem__(self, name: str) -> Any:
        return self.objects[name]

    def __contains__(self, name: object) -> bool:
        return name in self.objects

    def items(self) -> Iterator[tuple[str, Any]]:
        return iter(list(self.objects.items()))

    def state_dict(self, exclude: tuple[str, ...] = (), only: tuple[str, ...] = KINDS) -> dict[str, Any]:
        """``{name: obj.state_dict()}`` for the objects whose kind is in ``only`` and not in ``exclude``."""
        return {n: o.state_dict() for n, o in self.objects.items() if self.kinds[n] in only and self.kinds[n] not in exclude}

    def record_state(self) -> dict[str, Any]:
        """``{name: state}`` of the ``rank`` objects, for this rank's record (twice a step): an
        object's ``record_state()`` where it has one (ftrun's ``RNGState``: the same state in a
        form cheaper to encode, which its ``load_state_dict`` also takes), else its ``state_dict()``."""
        out = {}
        for name, obj in self.objects.items():
            if self.kinds[name] == "rank":
                record_state = getattr(obj, "record_state", None)
                out[name] = record_state() if record_state is not None else obj.state_dict()
        return out

    def load(self, state: dict[str, Any], kinds: tuple[str, ...] = KINDS) -> None:
        """``load_state_dict`` each registered object of a kind in ``kinds`` that ``state`` names;
        names ``state`` has but the registry lacks are ignored."""
        for name, obj in self.objects.items():
            if name in state and self.kinds[name] in kinds:
                obj.load_state_dict(state[name])

    def has_own_rank_state(self) -> bool:
        """Whether objects of kind ``rank`` other than the per-rank RNG streams (``"rng"``) exist (a
        model's buffers count once one of them has changed: until then every replica's are rank 0's)."""
        return any(k == "rank" and n != "rng" and (not isinstance(self.objects[n], ModuleBuffers) or self.objects[n].changed())
                   for n, k in self.kinds.items())

    def snapshot_step_start(self, committed: int, encode_rank: bool = False) -> bytes | None:
        """Copy the state that work after the update changes (kinds ``replica`` and ``rank``), labelled
        with the committed step it belongs to (buffers of the previous copy are reused).

        Args:
            committed: the committed step the copy belongs to.
            encode_rank: keep the ``rank`` objects' copy as the bytes of this rank's record
                (:func:`ftrun.common.codec.to_record` of :meth:`record_state`, which :meth:`roll_back`
                decodes): one walk gives both the copy and the record, and bytes are
                never changed by training. Otherwise every kind is deep-copied
                (:func:`ftrun.common.checkpoint.snapshot`).

        Returns:
            with ``encode_rank``, the record's bytes (for this rank's record in the store); else None.

        Raises:
            TypeError: a state the codec refuses (naming its place).
        """
        reuse = self._start.replica if self._start is not None else None
        blob = codec.to_record(self.record_state()) if encode_rank else None
        copied = snapshot(self.state_dict(exclude=("committed", "rank") if encode_rank else ("committed",)), reuse=reuse)
        self._start = StepStart(committed, copied, blob)
        for buffers in self.module_buffers():
            buffers.begin_step()
        self.transaction.begin()
        return blob

    def undo_updates(self, where: str = "") -> bool:
        """The step failed: undo the updates it applied (:meth:`ftrun.rank.transaction.StepTransaction.abort`).
        False (said on the log, ``where`` naming the rank and step) when the rank's state is a
        partial step that cannot be undone: committed at an update, the step went on with another
        update or backward pass (its shape grew past what earlier steps showed)."""
        if self.transaction.abort():
            return True
        print(f"ftrun: {where} failed after it was committed at an update and went on with another update or "
              "backward pass; its state is a partial step, so it takes a replica's", file=sys.stderr, flush=True)
        return False

    def roll_back(self, step: int, kinds: tuple[str, ...]) -> bool:
        """Restore the ``kinds`` objects to their state at committed ``step`` if the step-start
        snapshot is that step's (a retried step: its scheduler.step(), counters and data position
        are undone), in registration order. True if it did."""
        if self._start is None or self._start.committed != step:
            return False
        encoded = codec.from_record(self._start.rank) if self._start.rank is not None and "rank" in kinds else {}
        for name, obj in self.objects.items():
            if self.kinds[name] not in kinds:
                continue
            if isinstance(obj, ModuleBuffers):
                obj.roll_back()  # its own copy of every buffer, not only those in the record
            elif name in self._start.replica:
                obj.load_state_dict(snapshot(self._start.replica[name]))
            elif name in encoded:
                obj.load_state_dict(encoded[name])  # decoded afresh: nothing else holds it
        return True


def describe_object(obj: Any) -> str:
    """A short description of a registered object for a message: its class, and for a module its
    parameter count (``Generator (3,576,704 parameters)``)."""
    if isinstance(obj, torch.nn.Module):
        return f"{type(obj).__name__} ({sum(p.numel() for p in obj.parameters()):,} parameters)"
    return type(obj).__name__


@dataclass
class StepStart:
    """The copy taken at a step's start (:meth:`StateRegistry.snapshot_step_start`).

    Attributes:
        committed: the committed step it belongs to.
        replica: ``{name: deep copy of state_dict}`` of the ``replica`` objects, and of the
            ``rank`` ones when ``rank`` is None.
        rank: the ``rank`` objects' state as record bytes (:func:`ftrun.common.codec.to_record`), or None.
    """

    committed: int
    replica: dict[str, Any]
    rank: bytes | None = None
