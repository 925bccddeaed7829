"""State transfer between replicas: point-to-point over the training process group.

A donor sends a recipient the whole registered state (model, optimizer, scheduler, RNG, data
position, user objects) of its replica group:

1. a *skeleton* (:func:`ftrun.common.codec.flatten`, the codec checkpoints use too): the nested
   ``state_dict`` structure with every tensor replaced by a reference (key path, dtype, shape,
   device), tuples, dtypes, ``OrderedDict`` and ``_metadata`` kept, encoded with msgpack (never
   pickle), sent as a length then a uint8 tensor;
2. the tensors' bytes, those under :data:`ALONE_BYTES` coalesced into chunks of up to
   :data:`CHUNK_BYTES` so the number of messages stays small, larger ones sent as they are, with
   no copy. The recipient receives
   straight into its own tensors where its current state has a tensor of the same key path, dtype,
   shape and device (the model's parameters, existing optimizer buffers), so memory is not doubled.

Bytes are moved as bytes (``uint8`` views), so every dtype gloo or NCCL can carry travels bitwise
unchanged. Measured on gloo (docs/benchmarks.md has later measurements): 200 MB point-to-point in about 0.12 s on one machine.
"""

from __future__ import annotations

import random
import sys
from typing import Any, Callable, Iterator

import msgpack
import numpy as np
import torch
import torch.distributed as dist

from ftrun.common import codec
from ftrun.rank import rngmemory
from ftrun.rank.cuda import placement

CHUNK_BYTES = 16 << 20  # small tensors are coalesced into chunks of up to this many bytes
ALONE_BYTES = 1 << 20  # tensors of this size or more travel alone, with no copy on either side



def flatten(state: Any) -> tuple[Any, list[torch.Tensor]]:
    """Split a state into (msgpack-able skeleton, tensors): :func:`ftrun.common.codec.flatten`."""
    return codec.flatten(state)


def unflatten(skeleton: Any, tensors: list[torch.Tensor]) -> Any:
    """Inverse of :func:`flatten`: :func:`ftrun.common.codec.unflatten`."""
    return codec.unflatten(skeleton, tensors)


def state_bytes(state: Any) -> int:
    """The bytes of the tensors in ``state`` (what a transfer of it moves, give or take its skeleton)."""
    return sum(t.numel() * t.element_size() for t in flatten(state)[1])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.detach().resolve_conj().resolve_neg()  # a lazy negation or conjugation applied: the values' bytes
    if t.dim() == 0:
        t = t.reshape(1)
    return t.contiguous().view(-1).view(torch.uint8)


def _chunks(sizes: list[int]) -> Iterator[list[int]]:
    """Group tensor indices: consecutive small tensors share a chunk, big ones go alone."""
    chunk: list[int] = []
    total = 0
    for i, size in enumerate(sizes):
        if size >= ALONE_BYTES:
            if chunk:
                yield chunk
                chunk, total = [], 0
            yield [i]
            continue
        if total + size > CHUNK_BYTES and chunk:
            yield chunk
            chunk, total = [], 0
        chunk.append(i)
        total += size
    if chunk:
        yield chunk


def send_state(state: Any, dst: int, group: Any = None, on_progress: Callable[[int], None] | None = None,
               device: Any = "cpu") -> int:
    """Send a nested state to rank ``dst``; returns the bytes sent.

    Args:
        state: ``{name: state_dict}`` of the registered objects.
        dst: the recipient's global rank.
        group: process group (default: the default group).
        on_progress: called with the bytes sent so far after each message (fault injection hook).

    Raises:
        RuntimeError: the collective failed (peer died, connection reset).
        TypeError: the state holds something that is not a tensor or primitive.
    """
    device = torch.device(device)
    skeleton, tensors = flatten(state)
    meta = msgpack.packb(skeleton, use_bin_type=True)
    dist.send(torch.tensor([len(meta)], dtype=torch.int64, device=device), dst, group=group)
    dist.send(torch.frombuffer(bytearray(meta), dtype=torch.uint8).to(device), dst, group=group)
    views = [_as_bytes(t if t.device == device else t.to(device)) for t in tensors]
    sent = 0
    for chunk in _chunks([v.numel() for v in views]):
        buf = views[chunk[0]] if len(chunk) == 1 else torch.cat([views[i] for i in chunk])
        if buf.numel():
            dist.send(buf, dst, group=group)
        sent += buf.numel()
        if on_progress is not None:
            on_progress(sent)
    return sent + len(meta) + 8


def recv_state(src: int, current: Any, group: Any = None, device: Any = "cpu") -> tuple[Any, int]:
    """Receive a nested state from rank ``src``; returns (state, bytes received).

    Tensors are received into the matching tensors of ``current`` (same key path, dtype, shape
    and device) when there are any, else into new ones on ``device`` (the backend's: CUDA for
    NCCL, CPU for gloo; the sender sends from the same kind of device).

    Raises:
        RuntimeError: the collective failed (peer died, connection reset).
        ValueError: the skeleton names an unknown dtype.
    """
    device = torch.device(device)
    length = torch.zeros(1, dtype=torch.int64, device=device)
    dist.recv(length, src, group=group)
    meta = torch.empty(int(length.item()), dtype=torch.uint8, device=device)
    dist.recv(meta, src, group=group)
    skeleton = msgpack.unpackb(meta.cpu().numpy().tobytes(), raw=False, strict_map_key=False)
    refs = codec.tensor_refs(skeleton)
    cur_skeleton, cur_tensors = flatten(current)
    mine_by_path = {ref["path"]: cur_tensors[i] for i, ref in enumerate(codec.tensor_refs(cur_skeleton))}
    targets: list[torch.Tensor] = []
    for ref in refs:
        dtype = codec.dtype_of(ref["dtype"])
        if dtype is None:
            raise ValueError(f"state transfer: unsupported dtype {ref['dtype']}")
        mine = mine_by_path.get(ref["path"])
        if (
            mine is not None
            and mine.dtype == dtype
            and list(mine.shape) == ref["shape"]
            and mine.is_contiguous()
            and not (mine.is_neg() or mine.is_conj())  # a lazy view's bytes are not its values: a new tensor
            and mine.device == device
        ):
            targets.append(mine.detach())
        else:
            targets.append(torch.empty(ref["shape"], dtype=dtype, device=device))
    views = [_as_bytes(t) for t in targets]
    received = 0
    for chunk in _chunks([v.numel() for v in views]):
        if len(chunk) == 1:
            if views[chunk[0]].numel():
                dist.recv(views[chunk[0]], src, group=group)
            received += views[chunk[0]].numel()
            continue
        buf = torch.empty(sum(views[i].numel() for i in chunk), dtype=torch.uint8, device=device)
        dist.recv(buf, src, group=group)
        offset = 0
        for i in chunk:
            n = views[i].numel()
            views[i].copy_(buf[offset : offset + n])
            offset += n
        received += buf.numel()
    # A CUDA tensor that travelled through host memory (gloo) goes back to a GPU: this rank's own.
    local = f"cuda:{torch.cuda.current_device()}" if torch.cuda.is_available() and torch.cuda.is_initialized() else None
    for i, ref in enumerate(refs):
        home = torch.device(placement(ref.get("device", "cpu"), local))
        if targets[i].device != home and mine_by_path.get(ref["path"]) is not targets[i]:
            targets[i] = targets[i].to(home)
    return unflatten(skeleton, targets), received + meta.numel() + 8


def _mt_keys(words: bytes) -> tuple[np.ndarray, int]:
    """numpy's MT19937 state as read in place (the 624 key words, then ``pos``) as
    ``get_state()`` gives it: (a new array of the keys, pos)."""
    keys = np.frombuffer(words, dtype=np.uint32, count=rngmemory.MT_WORDS).copy()
    return keys, int.from_bytes(words[4 * rngmemory.MT_WORDS:], sys.byteorder, signed=True)


_BIG_INT = "__ftrun_int__"  # an integer beyond 64 bits, kept as its decimal text


def _big_ints_as_text(value: Any) -> Any:
    """``value`` (nested dicts and lists) with every int outside [-2**63, 2**64) as
    ``{_BIG_INT: its decimal text}``: the state codec takes integers of up to 64 bits."""
    if isinstance(value, dict):
        return {k: _big_ints_as_text(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_big_ints_as_text(v) for v in value]
    if isinstance(value, int) and not isinstance(value, bool) and not -(1 << 63) <= value < (1 << 64):
        return {_BIG_INT: str(value)}
    return value


def _text_as_big_ints(value: Any) -> Any:
    """Inverse of :func:`_big_ints_as_text`."""
    if isinstance(value, dict):
        if set(value) == {_BIG_INT}:
            return int(value[_BIG_INT])
        return {k: _text_as_big_ints(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_text_as_big_ints(v) for v in value]
    return value


class RNGState:
    """The random number generators of torch (CPU and CUDA), numpy and ``random``, as one state_dict.

    Its state is taken twice a step (a rank's own records, :mod:`ftrun.rank.rankstate`), so the two
    Mersenne Twisters are read in place (:mod:`ftrun.rank.rngmemory`: 2,500 bytes each, instead of
    numpy's ``get_state()`` and ``random.getstate()``, which copy word by word; the public getters
    where the readers could not confirm the layout), and an unchanged generator's words (the read
    bytes equal) give the same array or tensor as the previous call: Python's ``random`` is rarely
    drawn from in a training loop. numpy's gaussian cache (``has_gauss``, ``cached``) is read at
    every call, since a draw can change it without touching the words. Callers copy the arrays and
    tensors (:func:`ftrun.common.checkpoint.snapshot`, :func:`ftrun.common.codec.to_bytes`) and never write them.
    """

    def __init__(self) -> None:
        self._py: tuple[Any, torch.Tensor] | None = None  # (random's read bytes or getstate(), its words as a tensor)
        self._np: tuple[bytes, np.ndarray, int] | None = None  # (numpy's read bytes, its key words, pos)

    def _python_words(self, key: Any, words: Any) -> torch.Tensor:
        if self._py is None or type(self._py[0]) is not type(key) or self._py[0] != key:
            self._py = (key, torch.as_tensor(words() if callable(words) else words, dtype=torch.int64))
        return self._py[1]

    def _numpy(self) -> dict[str, Any]:
        reader = rngmemory.readers()[1]
        raw = reader.read() if reader is not None else None
        if raw is None:
            get_bit_generator = getattr(np.random, "get_bit_generator", None)  # numpy >= 1.25, with set_bit_generator
            if get_bit_generator is not None and not isinstance(get_bit_generator(), np.random.MT19937):
                # Another bit generator put in the global one's place (np.random.set_bit_generator):
                # numpy's dict of its state, whose integers may not fit 64 bits (PCG64's 128-bit state).
                return {"name": "dict", "state": _big_ints_as_text(np.random.get_state(legacy=False))}
            np_state = np.random.get_state()
            return {"name": np_state[0], "keys": np_state[1], "pos": int(np_state[2]),
                    "has_gauss": int(np_state[3]), "cached": float(np_state[4])}
        words, has_gauss, gauss = raw
        if self._np is None or self._np[0] != words:
            self._np = (words, *_mt_keys(words))
        return {"name": "MT19937", "keys": self._np[1], "pos": self._np[2], "has_gauss": int(has_gauss), "cached": float(gauss)}

    def state_dict(self) -> dict[str, Any]:
        reader = rngmemory.readers()[0]
        if reader is not None:
            raw = reader.read()
            words = self._python_words(raw, lambda: reader.as_words(raw))
            gauss = reader.inst.gauss_next
        else:
            py_state = random.getstate()
            words = self._python_words(py_state, lambda: [*py_state[1], py_state[0]])
            gauss = py_state[2]
        state: dict[str, Any] = {
            "torch": torch.get_rng_state(),
            "numpy": self._numpy(),
            # One int64 tensor (Mersenne Twister's 624 words, its index, then the version), not a
            # list of 626 ints: copied and encoded at every step start and all-reduce, a list cost ~10x more.
            "random": words,
            "random_gauss": gauss,
        }
        if torch.cuda.is_initialized():  # CUDA in use (it cannot be without being available); the cheaper test first
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def record_state(self) -> dict[str, Any]:
        """The state as a rank's record keeps it (:meth:`ftrun.rank.registry.StateRegistry.record_state`,
        twice a step): the three generators' bytes as read, which the record's encoder copies as
        they are, where :meth:`state_dict`'s tensors and arrays each cost it a callback and a
        dozen calls. :meth:`load_state_dict` takes either. :meth:`state_dict` itself where an
        in-place reader could not confirm its layout (``rngmemory``)."""
        py_reader, np_reader = rngmemory.readers()
        np_raw = np_reader.read() if np_reader is not None else None
        if py_reader is None or np_raw is None:
            return self.state_dict()
        inst = py_reader.inst
        words, has_gauss, gauss = np_raw
        state: dict[str, Any] = {
            "torch_bytes": torch.get_rng_state().numpy().tobytes(),
            "numpy_words": words, "numpy_has_gauss": int(has_gauss), "numpy_cached": float(gauss),
            "random_words": py_reader.read(), "random_version": inst.VERSION, "random_gauss": inst.gauss_next,
        }
        if torch.cuda.is_initialized():
            state["cuda"] = torch.cuda.get_rng_state_all()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if "numpy_words" in state:  # record_state's form
            state = self._from_record(state)
        torch.set_rng_state(state["torch"])
        np_state = state["numpy"]
        if np_state["name"] == "dict":
            np.random.set_state(_text_as_big_ints(np_state["state"]))
        else:
            np.random.set_state((np_state["name"], np_state["keys"], np_state["pos"], np_state["has_gauss"], np_state["cached"]))
        words = state["random"]
        if isinstance(words, torch.Tensor):
            words = words.tolist()
        random.setstate((words[-1], tuple(words[:-1]), state["random_gauss"]))  # a list in older checkpoints
        if "cuda" in state and torch.cuda.is_available():
            torch.cuda.set_rng_state_all(state["cuda"])

    @staticmethod
    def _from_record(state: dict[str, Any]) -> dict[str, Any]:
        """:meth:`record_state`'s form as :meth:`state_dict`'s (a record is loaded only when a step
        is retried or a rank respawned)."""
        keys, pos = _mt_keys(state["numpy_words"])
        raw = state["random_words"]  # int index, then the 624 words
        words = np.frombuffer(raw, dtype=np.uint32, count=rngmemory.MT_WORDS, offset=4).tolist()
        index = int.from_bytes(raw[:4], sys.byteorder, signed=True)
        out = {"torch": torch.frombuffer(bytearray(state["torch_bytes"]), dtype=torch.uint8),
               "numpy": {"name": "MT19937", "keys": keys, "pos": pos, "has_gauss": int(state["numpy_has_gauss"]),
                         "cached": float(state["numpy_cached"])},
               "random": [*words, index, int(state["random_version"])], "random_gauss": state["random_gauss"]}
        if "cuda" in state:
            out["cuda"] = state["cuda"]
        return out
