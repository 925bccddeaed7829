"""ftrun.rank.data's cursor, without processes: a rank rebuilt from its saved place (a respawned rank)
gets the batches its predecessor would have, and rebuilding moves no one's random stream."""

from __future__ import annotations

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from ftrun.rank.data import LoaderCursor
from ftrun.common.checkpoint import snapshot
from ftrun.common import codec


def _dataset() -> TensorDataset:
    return TensorDataset(torch.arange(40.0).reshape(20, 2), torch.arange(20))


def _loaders():
    yield "dataloader", lambda: DataLoader(_dataset(), batch_size=3, shuffle=True)
    try:
        from torchdata.stateful_dataloader import StatefulDataLoader
    except ImportError:
        return
    yield "stateful", lambda: StatefulDataLoader(_dataset(), batch_size=3, shuffle=True)


@pytest.mark.parametrize("name,make", list(_loaders()))
def test_respawned_cursor_continues_with_the_same_batches_and_draws(name: str, make) -> None:
    torch.manual_seed(7)
    first = LoaderCursor(make(), epoch=1)
    given = [first.next() for _ in range(3)]
    saved = codec.from_bytes(codec.to_bytes(snapshot(first.state_dict())))  # through the store's codec
    rng_after = torch.get_rng_state()
    rest = [first.next() for _ in range(4)]
    user_draw = torch.rand(3)

    torch.manual_seed(99)  # a new process: anything else in the global generator
    second = LoaderCursor(make(), epoch=1)  # built in its set-up (StatefulDataLoader() draws twice)
    torch.set_rng_state(rng_after)  # at its first step, its RNG comes back from its own record (ftrun.rank.rankstate)
    second.load_state_dict(saved)
    again = [second.next() for _ in range(4)]
    assert all(torch.equal(a[0], b[0]) for a, b in zip(rest, again))
    assert torch.equal(torch.rand(3), user_draw), "rebuilding the iterator moved the user's random stream"
    assert len(given) == 3


def test_retried_step_gets_its_cached_batch() -> None:
    torch.manual_seed(0)
    cursor = LoaderCursor(DataLoader(_dataset(), batch_size=4, shuffle=True), epoch=0)
    cursor.next()
    at_start = snapshot(cursor.state_dict())
    batch = cursor.next()
    cursor.load_state_dict(at_start)  # the step is retried: its start state is rolled back
    assert torch.equal(cursor.next()[0], batch[0])
    assert cursor.position == 2


def test_a_record_of_another_epoch_is_ignored() -> None:
    cursor = LoaderCursor(DataLoader(_dataset(), batch_size=4), epoch=2)
    cursor.load_state_dict({"epoch": 1, "position": 5})
    assert cursor.position == 0 and not cursor.exhausted()


@pytest.mark.parametrize("name,make", list(_loaders()))
def test_retried_first_step_of_a_pass_replays_the_iterators_draw(name: str, make) -> None:
    """A step retried at a pass's first batch: the rank's RNG is rolled back to the step's start,
    before iter() drew its seed; the cached batch is served and the draw replayed, so the user's
    draws (dropout) are those of the first try (a divergence CI found on an epoch's first step)."""
    torch.manual_seed(3)
    cursor = LoaderCursor(make(), epoch=2)
    at_start = (snapshot(cursor.state_dict()), torch.get_rng_state())
    batch = cursor.next()
    first_try = torch.rand(4)  # dropout in the failed step
    cursor.load_state_dict(at_start[0])
    torch.set_rng_state(at_start[1])  # ftrun rolls the rank's RNG back with the step
    assert torch.equal(cursor.next()[0], batch[0])
    assert torch.equal(torch.rand(4), first_try)


@pytest.mark.parametrize("loader", [list(range(0, 40, 4)), tuple(range(10)), range(10)])
def test_a_pass_over_a_sequence_keeps_no_generator_state(loader) -> None:
    """Iterating a list, tuple or range draws from no generator (word_lm's ``ft.batches(batches)``):
    its records carry no generator state (two records a step: 5 KB each), and a
    respawned cursor and a retried step still get the right batches."""
    torch.manual_seed(5)
    cursor = LoaderCursor(loader, epoch=1)
    given = [cursor.next() for _ in range(3)]
    at_start = snapshot(cursor.state_dict())
    fourth = cursor.next()
    assert "iter_rng" not in at_start and given == list(loader)[:3]
    assert len(codec.to_record(at_start)) < 100
    cursor.load_state_dict(at_start)  # a retried step
    assert cursor.next() == fourth and cursor.position == 4
    respawned = LoaderCursor(loader, epoch=1)
    respawned.load_state_dict(codec.from_record(codec.to_record(at_start)))
    assert [respawned.next() for _ in range(3)] == list(loader)[3:6]
