"""Reading the random generators' state in place (ftrun.rank.rngmemory): RNGState must give
what the public getters give, for every kind of change, including numpy's cached gaussian, which
changes while the Mersenne Twister words do not."""

from __future__ import annotations

import random
from typing import Any, Callable

import numpy as np
import pytest
import torch

from ftrun.common import codec
from ftrun.rank import rngmemory
from ftrun.rank.transfer import RNGState


def _public() -> dict[str, Any]:
    """RNGState's state dict as it was built from the public getters before the readers."""
    np_state = np.random.get_state()
    py_state = random.getstate()
    return {"torch": torch.get_rng_state(),
            "numpy": {"name": np_state[0], "keys": np_state[1], "pos": int(np_state[2]),
                      "has_gauss": int(np_state[3]), "cached": float(np_state[4])},
            "random": torch.tensor([*py_state[1], py_state[0]], dtype=torch.int64), "random_gauss": py_state[2]}


def _same_numpy_words_other_gauss() -> None:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    np.random.set_state((name, keys, pos, 1 - has_gauss, 0.75 if not has_gauss else 0.0))


CHANGES: list[tuple[str, Callable[[], Any]]] = [
    ("nothing", lambda: None),
    ("numpy gaussian: a pair drawn, one kept", np.random.standard_normal),
    ("numpy gaussian: the kept one taken, words unchanged", np.random.standard_normal),
    ("numpy uniform", lambda: np.random.rand(3)),
    ("numpy seed", lambda: np.random.seed(4)),
    ("numpy set_state: same words, another gauss", _same_numpy_words_other_gauss),
    ("numpy set_state: same words, the gauss back", _same_numpy_words_other_gauss),
    ("random gauss: a pair drawn", lambda: random.gauss(0, 1)),
    ("random gauss: the kept one taken", lambda: random.gauss(0, 1)),
    ("random seed", lambda: random.seed(3)),
    ("random draw", random.random),
    ("torch draw", lambda: torch.rand(2)),
]


def test_the_readers_are_calibrated_on_this_interpreter() -> None:
    py, npy = rngmemory.readers()
    assert py is not None and npy is not None
    assert py.read() == py.read() and len(py.read()) == 4 + 4 * rngmemory.MT_WORDS


@pytest.mark.parametrize("readers", ["in place", "public getters"])
def test_rng_state_is_what_the_public_getters_give_after_every_change(readers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    if readers == "public getters":
        monkeypatch.setattr(rngmemory, "_readers", (None, None))  # as where the layout is not confirmed
    rng = RNGState()
    np.random.seed(1)
    random.seed(2)
    for _ in range(2):
        for what, change in CHANGES:
            change()
            mine, public = rng.state_dict(), _public()
            assert codec.to_bytes(mine) == codec.to_bytes(public), what  # the same record, byte for byte
            assert type(mine["numpy"]["keys"]) is np.ndarray and mine["numpy"]["keys"].flags.writeable


def test_numpy_cached_gaussian_is_seen_while_the_words_stay() -> None:
    """The brief's trap: a gaussian drawn from numpy's cache changes ``has_gauss`` and ``cached``
    but no word, so the state cannot be cached on its words; the records differ, and loading the
    earlier one gives the earlier draws back."""
    rng = RNGState()
    np.random.seed(5)
    np.random.standard_normal()  # a pair drawn, one kept
    kept = rng.state_dict()
    blob = codec.to_bytes(kept)
    taken = np.random.standard_normal()  # the kept one: no word drawn
    after = rng.state_dict()
    assert np.array_equal(after["numpy"]["keys"], kept["numpy"]["keys"]) and after["numpy"]["pos"] == kept["numpy"]["pos"]
    assert (kept["numpy"]["has_gauss"], after["numpy"]["has_gauss"]) == (1, 0)
    assert codec.to_bytes(after) != blob
    rng.load_state_dict(codec.from_bytes(blob))
    assert np.random.standard_normal() == taken


def test_numpy_words_unchanged_give_the_same_array_changed_a_new_one() -> None:
    rng = RNGState()
    np.random.seed(6)
    first = rng.state_dict()["numpy"]["keys"]
    assert rng.state_dict()["numpy"]["keys"] is first
    np.random.rand()
    second = rng.state_dict()["numpy"]["keys"]
    assert second is not first and not np.array_equal(second, first)
    assert np.array_equal(first, codec.from_bytes(codec.to_bytes({"k": first}))["k"])  # the earlier one untouched


@pytest.mark.parametrize("readers", ["in place", "public getters"])
def test_a_record_of_the_streams_gives_the_same_draws_after_every_change(readers: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """``record_state`` (the generators' bytes as read, twice a step in a rank's record) loads
    back to the same streams as ``state_dict`` after every kind of change, cached gaussians
    included; where a reader is not confirmed it is ``state_dict`` itself."""
    if readers == "public getters":
        monkeypatch.setattr(rngmemory, "_readers", (None, None))
    rng = RNGState()
    np.random.seed(1)
    random.seed(2)

    def draws() -> tuple:
        return (torch.rand(3).tolist(), np.random.standard_normal(3).tolist(), np.random.standard_normal(),
                random.gauss(0, 1), random.random(), random.getrandbits(70))

    for what, change in CHANGES:
        change()
        blob = codec.to_record({"rng": rng.record_state()})
        public = _public()
        expected = draws()
        rng.load_state_dict(codec.from_record(blob)["rng"])
        assert codec.to_bytes(rng.state_dict()) == codec.to_bytes(public), what
        assert draws() == expected, what
        if readers == "in place":
            assert "numpy_words" in codec.from_record(blob)["rng"], what


def test_a_new_global_bit_generator_is_read_or_left_to_the_public_getter() -> None:
    """numpy's reader keeps views of the global generator's memory; another MT19937 bit generator
    put in its place (``np.random.set_bit_generator``) is read through new views, and the record
    still loads back to the same draws."""
    rng = RNGState()
    original = np.random.get_bit_generator()
    try:
        for bit_generator in (np.random.MT19937(11), np.random.MT19937(13)):
            np.random.set_bit_generator(bit_generator)
            np.random.standard_normal()  # a gaussian kept in the cache
            assert codec.to_bytes(rng.state_dict()) == codec.to_bytes(_public()), type(bit_generator).__name__
            blob = codec.to_record({"rng": rng.record_state()})
            expected = (np.random.standard_normal(3).tolist(), np.random.standard_normal())
            rng.load_state_dict(codec.from_record(blob)["rng"])
            assert (np.random.standard_normal(3).tolist(), np.random.standard_normal()) == expected
    finally:
        np.random.set_bit_generator(original)


@pytest.mark.parametrize("bit_generator", ["PCG64", "PCG64DXSM", "Philox", "SFC64"])
def test_a_global_generator_other_than_mt19937_is_kept_too(bit_generator: str) -> None:
    """A script that puts another bit generator in numpy's global one's place
    (``np.random.set_bit_generator``; PCG64's state is a 128-bit integer) still has its streams
    in the checkpoint codec's bytes and in a rank's record, and both load back to the same draws."""
    rng = RNGState()
    original = np.random.get_bit_generator()
    try:
        np.random.set_bit_generator(getattr(np.random, bit_generator)(21))
        np.random.standard_normal()  # a gaussian kept in the cache
        checkpoint, record = codec.to_bytes(rng.state_dict()), codec.to_record({"rng": rng.record_state()})
        expected = (np.random.standard_normal(3).tolist(), np.random.standard_normal(), np.random.randint(0, 1 << 62))
        for state in (codec.from_bytes(checkpoint), codec.from_record(record)["rng"]):
            rng.load_state_dict(state)
            assert (np.random.standard_normal(3).tolist(), np.random.standard_normal(), np.random.randint(0, 1 << 62)) == expected
    finally:
        np.random.set_bit_generator(original)
