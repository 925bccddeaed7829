"""Data loading the way PyTorch users write it: an epoch loop over a ``DataLoader``.

::

    for epoch in ft.epochs(1, args.epochs + 1):       # a respawned rank starts in the donor's epoch
        sampler.set_epoch(epoch)
        for step, (x, y) in ft.batches(loader):       # a retried step gets the same batch again
            ...
        test(model)                                   # end-of-epoch work: never run twice for one epoch

Two kinds of state make that exact:

- :class:`EpochProgress` is *replica* state (registered as ``"epochs"``): the epoch in progress and
  the global step its first batch has. A donor sends it, so a respawned rank resumes in the epoch
  its replicas are in and does not repeat end-of-epoch work they already did.
- :class:`LoaderCursor` is *rank* state (registered as ``"data"``): how many batches of this epoch
  this rank's loader has given, the state of the generator ``iter(loader)`` draws its seeds from
  at the epoch's start (none for a list, tuple or range, which draw nothing), and a
  ``StatefulDataLoader``'s own ``state_dict()``. It is snapshotted at
  every step start and rolled back when a step is retried; a respawned rank gets its
  predecessor's from the job's store (:mod:`ftrun.rank.rankstate`), never from another rank.

The loader is positioned without changing the user's random stream: ``iter(DataLoader)`` draws a
seed from the loader's generator (torch's global one by default), exactly as the same loop under
torchrun does; a rank that has to rebuild its iterator (a respawned rank, a rolled-back step it can
not serve from its cache) rebuilds it from the generator state saved at the epoch's start and puts
the current state back, so no draw is added or moved. A plain ``DataLoader`` (``num_workers=0``)
skips the batches already given by advancing its sampler only (no sample is loaded); with workers
the batches are loaded and dropped. torchdata's ``StatefulDataLoader`` (or anything with
``state_dict``/``load_state_dict`` that resumes its iterator from them) is restored from its own
state.
"""

from __future__ import annotations

from typing import Any

import torch


class EpochProgress:
    """The epoch loop's position, identical on every replica (kind ``replica``).

    Attributes:
        epoch: the epoch in progress (None before :meth:`ftrun.rank.worker.Worker.epochs` starts).
        step: the global step number of the first batch of that epoch's :meth:`batches` pass.
    """

    def __init__(self) -> None:
        self.epoch: int | None = None
        self.step = 0
        # Whether the last epoch's end (the code after its batch loop) moved this rank's random
        # streams: then a rank replaced right after that epoch's last step cannot know them.
        self.end_moved_rng = False

    def state_dict(self) -> dict[str, Any]:
        return {"epoch": -1 if self.epoch is None else int(self.epoch), "step": int(self.step),
                "end_moved_rng": bool(self.end_moved_rng)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.epoch = None if int(state["epoch"]) < 0 else int(state["epoch"])
        self.step = int(state["step"])
        self.end_moved_rng = bool(state.get("end_moved_rng", False))


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(getattr(loader, "load_state_dict", None))


class LoaderCursor:
    """One rank's place in one pass over ``loader`` (kind ``rank``); see the module docstring.

    Args:
        loader: a ``torch.utils.data.DataLoader``, a ``StatefulDataLoader``, or any iterable.
        epoch: the epoch this pass belongs to (-1 outside an epoch loop).
    """

    def __init__(self, loader: Any, epoch: int) -> None:
        self.loader = loader
        self.epoch = epoch
        self.position = 0  # batches given in this pass
        self.stateful = _is_stateful(loader)
        # Iterating a list, tuple or range draws from no generator: no generator state is kept
        # or compared for it (a record a step start and a provisional one carry it).
        self._draws = type(loader) not in (list, tuple, range)
        self._it: Any = None
        self._it_position = 0  # batches the live iterator has given
        self._iter_rng: torch.Tensor | None = None  # the seed generator's state before iter()
        self._loader_state: Any = None  # a StatefulDataLoader's state at `position` (if restored)
        self._cache: tuple[int, Any, Any, Any] | None = None  # (position, batch, generator before, after) of the last batch given
        self._prefetched: Any = None  # the batch at `position`, fetched while repositioning

    def _generator(self) -> torch.Generator:
        gen = getattr(self.loader, "generator", None)
        return gen if isinstance(gen, torch.Generator) else torch.default_generator

    # ---------------------------------------------------------------- rank state
    def state_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"epoch": int(self.epoch), "position": int(self.position)}
        if self._iter_rng is not None:
            state["iter_rng"] = self._iter_rng
        if self.stateful and self.position > 0:
            state["loader"] = self.loader.state_dict() if self._it_position == self.position else self._loader_state
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Take a saved place; the iterator is repositioned lazily, at the next batch."""
        if int(state["epoch"]) != self.epoch:
            return  # a record of another epoch's pass (e.g. the end of the previous one)
        self.position = int(state["position"])
        if "iter_rng" in state:
            self._iter_rng = state["iter_rng"]
        self._loader_state = state.get("loader")

    # ---------------------------------------------------------------- batches
    def exhausted(self) -> bool:
        """Whether the pass is over, when the loader has a length (else the next fetch says so)."""
        try:
            return self.position >= len(self.loader)
        except TypeError:
            return False

    def next(self) -> Any:
        """The batch at :attr:`position` (then one further). Raises StopIteration at the end."""
        gen = self._generator()
        if self._it is None or self._it_position != self.position:
            cache = self._cache
            if cache is not None and cache[0] == self.position and self._it_position == self.position + 1:
                # A retried step: the same batch again, the iterator untouched. If the first fetch
                # drew from the generator (iter() draws its seed at a pass's first batch) and the
                # retry rolled the generator back to where it was then, the draw is replayed: the
                # user's next draws (dropout...) are those of the first try.
                _, batch, before, after = cache
                if before is not None and torch.equal(gen.get_state(), before):
                    gen.set_state(after)
                self.position += 1
                return batch
        before = gen.get_state() if self._draws else None
        if self._it is None or self._it_position != self.position:
            self._reposition()
        if self._prefetched is not None:
            batch, self._prefetched = self._prefetched, None
        else:
            batch = next(self._it)
        after = gen.get_state() if self._draws else None
        moved = self._draws and not torch.equal(before, after)
        self._cache = (self.position, batch, before if moved else None, after if moved else None)
        self.position += 1
        self._it_position += 1
        return batch

    def _reposition(self) -> None:
        gen = self._generator()
        if self.position == 0:
            # The pass's start (the seed generator is where it was before the pass's first batch
            # then, too): iter() and the first batch draw their seeds exactly as the plain loop does.
            self._iter_rng = gen.get_state() if self._draws else None
            self._it, self._it_position, self._prefetched = iter(self.loader), 0, None
            return
        # Seeds are drawn lazily (a sampler draws at its first index), so everything up to the
        # batch at `position` is done with the generator as it was at the pass's start, then the
        # current state is put back.
        current = gen.get_state()
        try:
            if self._iter_rng is not None:
                gen.set_state(self._iter_rng)
            if self.stateful and self._loader_state is not None:
                self.loader.load_state_dict(self._loader_state)
                self._it, self._it_position = iter(self.loader), self.position
            else:
                self._it, self._it_position = iter(self.loader), 0
                self._skip(self.position)
            if not self._skips_by_index():
                self._prefetched = next(self._it)
        finally:
            gen.set_state(current)  # rebuilding the iterator moves no one's random stream

    def _skips_by_index(self) -> bool:
        it = self._it
        return type(it).__name__ == "_SingleProcessDataLoaderIter" and getattr(it, "_sampler_iter", None) is not None

    def _skip(self, count: int) -> None:
        it = self._it
        by_index = self._skips_by_index()
        while self._it_position < count:
            if by_index:
                next(it._sampler_iter)  # the indices only: nothing is loaded
                it._num_yielded += 1
            else:
                next(it)
            self._it_position += 1
