"""The one state codec (ftrun.common.codec) that transfers, checkpoints and rank state share: each case
round-trips through the wire form, the byte form and a checkpoint file."""

from __future__ import annotations

import random
import struct
from collections import OrderedDict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from ftrun.common import checkpoint as ckpt
from ftrun.common import codec
from ftrun.rank.transfer import RNGState


def _wire(state: Any) -> Any:
    import msgpack

    skeleton, tensors = codec.flatten(state)
    skeleton = msgpack.unpackb(msgpack.packb(skeleton, use_bin_type=True), raw=False, strict_map_key=False)
    return codec.unflatten(skeleton, [t.clone() for t in tensors])


def _file(state: Any, tmp_path: Path) -> Any:
    directory = ckpt.step_dir(tmp_path, 1)
    info = ckpt.save_shard(directory, 0, {"x": state})
    ckpt.write_manifest(directory, 1, 1, [[0]], {0: info.to_json()})
    return ckpt.load_shard(directory, 0)["x"]


def _forms(state: Any, tmp_path: Path) -> list[Any]:
    return [_wire(state), codec.from_bytes(codec.to_bytes(state)), _file(state, tmp_path)]


def test_dtype(tmp_path: Path) -> None:
    for out in _forms({"dtype": torch.bfloat16, "device": torch.device("cpu"), "size": torch.Size([2, 3])}, tmp_path):
        assert out["dtype"] is torch.bfloat16 and out["device"] == torch.device("cpu") and out["size"] == torch.Size([2, 3])
        assert type(out["size"]) is torch.Size


def test_tuple_stays_a_tuple(tmp_path: Path) -> None:
    adam = torch.optim.Adam([torch.nn.Parameter(torch.ones(2))], betas=(0.8, 0.95)).state_dict()
    for out in _forms(adam, tmp_path):
        assert out["param_groups"][0]["betas"] == (0.8, 0.95) and type(out["param_groups"][0]["betas"]) is tuple


def test_ordered_dict_and_metadata(tmp_path: Path) -> None:
    sd = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).state_dict()
    for out in _forms(sd, tmp_path):
        assert type(out) is OrderedDict and list(out) == list(sd)
        assert out._metadata == sd._metadata  # type: ignore[attr-defined]
        assert all(torch.equal(out[k], sd[k]) for k in sd)
        torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2)).load_state_dict(out)


def test_nested_lists(tmp_path: Path) -> None:
    state = {"a": [[1, [2.5, None]], ["x", b"y", True]], "c": 1 + 2j, "t": [torch.arange(3), (torch.zeros(()),)]}
    for out in _forms(state, tmp_path):
        assert out["a"] == state["a"] and out["c"] == 1 + 2j
        assert torch.equal(out["t"][0], torch.arange(3)) and type(out["t"][1]) is tuple and out["t"][1][0].shape == ()


def test_numpy_rng_state_round_trips(tmp_path: Path) -> None:
    np.random.seed(3)
    random.seed(4)
    torch.manual_seed(5)
    state = RNGState().state_dict()
    draws = (np.random.rand(4), random.random(), torch.rand(2))
    for out in _forms(state, tmp_path):
        RNGState().load_state_dict(out)
        again = (np.random.rand(4), random.random(), torch.rand(2))
        assert np.array_equal(draws[0], again[0]) and draws[1] == again[1] and torch.equal(draws[2], again[2])


def test_numpy_arrays_and_scalars(tmp_path: Path) -> None:
    state = {"arr": np.arange(6, dtype=np.int16).reshape(2, 3), "scalar": np.float32(0.5)}
    for out in _forms(state, tmp_path):
        assert out["arr"].dtype == np.int16 and np.array_equal(out["arr"], state["arr"]) and out["scalar"] == 0.5


def test_tensor_refs_carry_key_paths() -> None:
    skeleton, _ = codec.flatten({"model": OrderedDict(w=torch.ones(2)), "opt": {"state": {0: {"m": torch.zeros(1)}}}})
    assert [r["path"] for r in codec.tensor_refs(skeleton)] == ["state['model']['w']", "state['opt']['state'][0]['m']"]


def test_refuses_objects_naming_their_place() -> None:
    with pytest.raises(TypeError, match=r"state\['opt'\]\['hook'\]"):
        codec.flatten({"opt": {"hook": object()}})


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a GPU")
def test_cuda_tensors_keep_their_device() -> None:
    skeleton, tensors = codec.flatten({"w": torch.ones(2, device="cuda")})
    assert codec.tensor_refs(skeleton)[0]["device"].startswith("cuda") and tensors[0].is_cuda


def test_rng_state_reuses_python_randoms_words_only_while_unchanged():
    """RNGState keeps the tensor of Python's ``random`` state while that state is unchanged (issue
    27: taken twice a step); a draw, including one that only uses the cached gauss, gives a new
    one, and loading an older state dict restores the stream exactly."""
    import random

    from ftrun.rank.transfer import RNGState

    rng = RNGState()
    random.seed(5)
    first = rng.state_dict()
    assert rng.state_dict()["random"] is first["random"]
    random.gauss(0, 1)  # draws two numbers, caches one
    second = rng.state_dict()
    assert second["random"] is not first["random"] and not torch.equal(second["random"], first["random"])
    random.gauss(0, 1)  # only the cached gauss: the words stay, the gauss goes
    third = rng.state_dict()
    assert third["random_gauss"] != second["random_gauss"]
    expected = [random.random() for _ in range(3)]
    rng.load_state_dict(third)
    assert [random.random() for _ in range(3)] == expected
    rng.load_state_dict(first)
    random.gauss(0, 1)
    assert rng.state_dict()["random"] is not first["random"]


def _general_to_bytes(state: Any) -> bytes:
    """codec.to_bytes as it was before its plain-state walk: the reference bytes."""
    import msgpack

    skeleton, tensors = codec.flatten(state)
    data = [t.detach().cpu().contiguous().reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"" for t in tensors]
    return msgpack.packb({"skeleton": skeleton, "data": data}, use_bin_type=True)


PLAIN_STATES = [
    {"rng": RNGState().state_dict(), "hidden": {"h": torch.randn(2, 3, 4), "c": torch.randn(2, 3, 4)}, "data": {"epoch": 1, "position": 5}},
    {"a": [1, 2.5, None, "x", b"y", True, [torch.arange(5)[1:], (torch.zeros(()),)]], 3: torch.Size([2, 3]),
     "empty": torch.empty(0), "empty_array": np.zeros((0, 3)), "row": np.arange(3.0).reshape(3, 1)[1], "zero_d": np.array(5.0)},
    {"strided": torch.ones(2, 3)[:, 1], "bf16": torch.ones(3, dtype=torch.bfloat16), "grad": torch.ones(2, requires_grad=True),
     "complex": torch.tensor([1 + 2j]), "bool": torch.tensor([True, False]), "big_endian": np.arange(6, dtype=">i4").reshape(2, 3).T},
]


@pytest.mark.parametrize("index", range(len(PLAIN_STATES)))
def test_plain_states_take_the_one_pass_walk_and_give_the_same_bytes(index: int) -> None:
    """A rank's records (twice a step) take a one-pass walk; a record must read back as
    it did, so its bytes are those of the general walk, byte for byte."""
    state = PLAIN_STATES[index]
    codec._plain_flatten(state)  # it is plain: no fallback taken
    blob = codec.to_bytes(state)
    assert blob == _general_to_bytes(state)
    assert codec.to_bytes(codec.from_bytes(blob)) == blob


def test_other_states_take_the_general_walk() -> None:
    for state in ({"od": OrderedDict(a=torch.ones(1))}, {"scalar": np.float32(0.5)}, {"p": torch.nn.Parameter(torch.ones(2))},
                  {"dtype": torch.float16, "c": 1 + 2j}, {True: 3}):
        with pytest.raises(codec._NotPlain):
            codec._plain_flatten(state)
        assert codec.to_bytes(state) == _general_to_bytes(state)
    with pytest.raises(TypeError, match=r"state\['bad'\]"):
        codec.to_bytes({"bad": object()})


def _same(a, b) -> bool:  # type: ignore[no-untyped-def]
    """Equal values of the very same types, bit for bit (NaN and -0.0 included)."""
    import math

    import numpy as np

    if type(a) is not type(b):
        return False
    if isinstance(a, dict):
        return list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, torch.Tensor):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and torch.equal(
            a.detach().contiguous().reshape(-1).view(torch.uint8), b.detach().contiguous().reshape(-1).view(torch.uint8))
    if isinstance(a, np.ndarray):
        return (a.dtype, a.shape) == (b.dtype, b.shape) and a.tobytes() == b.tobytes()
    if isinstance(a, float):
        return struct.pack("<d", a) == struct.pack("<d", b) or (math.isnan(a) and math.isnan(b))
    return a == b


def test_a_rank_record_keeps_every_value_and_type_bit_for_bit() -> None:
    """Rank records (``to_record``) are walked by msgpack's C packer, about twice as fast
    as :func:`to_bytes`. Whatever they take must come back exactly: scalar types (1, 1.0 and True
    differ), -0.0 and NaN, tuples, sizes and lists, non-string keys, tensors of any dtype, shape,
    layout in memory or gradient flag, numpy arrays; equal states give equal bytes. What they do
    not take goes through :func:`to_bytes`, and ``from_record`` reads both."""
    import collections

    import numpy as np

    from ftrun.common.codec import from_bytes, from_record, to_bytes, to_record
    from ftrun.rank.transfer import RNGState

    fast = [
        {"rng": RNGState().state_dict(), "hidden": {"h": torch.randn(2, 3, requires_grad=True), "c": torch.randn(3, 4)[:, 1]}},
        {"a": (1, 1.0, True, -0.0, float("nan"), None, "x", b"y"), 3: [torch.Size([2, 3]), (), [], {}], (1, 2): "key", 2.5: 1},
        {"bf16": torch.ones(3, dtype=torch.bfloat16), "empty": torch.empty(0, 4), "i8": torch.arange(5, dtype=torch.int8),
         "np0": np.zeros((2, 0)), "np_bool": np.array([True, False]), "np_f": np.arange(6.0).reshape(2, 3).T},
    ]
    for state in fast:
        blob = to_record(state)
        assert blob[0] == 0x92 and _same(from_record(blob), state)
        assert to_record(state) == blob and to_record(from_record(blob)) == blob
    assert to_record({"a": (1,)}) != to_record({"a": [1]}) != to_record({"a": [True]})
    assert to_record({"x": torch.zeros(2)}) != to_record({"x": torch.zeros(2, dtype=torch.int32)})
    assert to_record({"x": torch.zeros(2, 3)}) != to_record({"x": torch.zeros(3, 2)})
    for other in ({"od": collections.OrderedDict(a=torch.ones(1))}, {"p": torch.nn.Parameter(torch.ones(2))}):
        blob = to_record(other)
        assert blob == to_bytes(other) and _same(from_record(blob), from_bytes(blob))
    with pytest.raises(TypeError, match="at state"):
        to_record({"bad": object()})


def test_a_record_takes_the_common_tensor_by_a_short_path_with_the_same_bytes() -> None:
    """A contiguous CPU tensor of a dtype numpy can view, with no gradient, is recorded
    with a third of the calls (a record is made twice a step); its bytes must be those of the
    general path, which a strided view or a tensor that requires grad takes."""
    from ftrun.common.codec import from_record, to_record

    for dtype in (torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
                  torch.uint8, torch.bool):
        for shape in ((2, 3), (0, 4), ()):
            t = (torch.randn(shape) * 50).to(dtype)
            strided = torch.stack([t, t], dim=-1)[..., 0]  # not contiguous (for a 0-d tensor: the tensor itself)
            assert to_record({"t": t}) == to_record({"t": strided}), (dtype, shape)
            if dtype.is_floating_point:
                assert to_record({"t": t}) == to_record({"t": t.clone().requires_grad_()}), (dtype, shape)
            back = from_record(to_record({"t": t}))["t"]
            assert back.dtype == dtype and back.shape == t.shape and torch.equal(back, t)


def test_a_lazily_negated_or_conjugated_tensor_is_kept_as_its_values(monkeypatch: pytest.MonkeyPatch) -> None:
    """A tensor with the negative or conjugate bit (``torch._neg_view``, ``.conj()`` of a complex
    one) is a lazy view: its memory holds the base's values. A record, a byte form, a fingerprint
    and a transfer keep its values (they raised a RuntimeError from ``view(torch.uint8)``), and a
    transfer never receives into such a tensor's memory (the values would come out negated)."""
    import torch.distributed as dist

    from ftrun.rank.digest import fingerprint
    from ftrun.rank.transfer import recv_state, send_state

    base, complex_base = torch.tensor([1.5, -2.0, 0.0]), torch.tensor([1 + 2j, 3 - 1j], dtype=torch.complex64)
    lazy = {"neg": torch._neg_view(base), "conj": complex_base.conj()}
    values = {"neg": torch.tensor([-1.5, 2.0, -0.0]), "conj": torch.tensor([1 - 2j, 3 + 1j], dtype=torch.complex64)}
    for back in (codec.from_record(codec.to_record({"x": lazy}))["x"], codec.from_bytes(codec.to_bytes(lazy))):
        assert all(_same(back[k], values[k]) for k in values), back
    assert fingerprint(list(lazy.values())) == fingerprint(list(values.values()))

    wire: list[torch.Tensor] = []
    monkeypatch.setattr(dist, "send", lambda t, dst, group=None: wire.append(t.clone()))
    monkeypatch.setattr(dist, "recv", lambda t, src, group=None: t.copy_(wire.pop(0)))
    send_state(lazy, dst=1)
    current = {"neg": torch._neg_view(torch.zeros(3)), "conj": torch.zeros(2, dtype=torch.complex64).conj()}
    received, _ = recv_state(0, current)
    assert all(_same(received[k], values[k]) for k in values), received
    assert not wire
