"""The one state codec: what a ``state_dict`` may hold, for transfers, checkpoints and rank state.

A state is nested dicts (``OrderedDict`` stays ``OrderedDict``; a module state dict's ``_metadata``
is kept), lists, tuples, tensors (a ``Parameter`` becomes its data), numpy arrays and scalars,
``torch.dtype``, ``torch.device``, ``torch.Size`` and primitives (None, bool, int, float, complex,
str, bytes). Anything else is refused with a ``TypeError`` naming its place (``state['opt']['x']``):
ftrun never pickles state.

One walker (:func:`encode` / :func:`decode`), two serialisations of its output:

- a tree ``torch.load(weights_only=True)`` accepts, for checkpoint files (:mod:`ftrun.common.checkpoint`):
  numpy arrays become ``{"__ftrun_ndarray__": uint8 tensor, "dtype": str, "shape": list}``;
- a msgpack *skeleton* plus the list of tensors (:func:`flatten` / :func:`unflatten`), for the wire
  (:mod:`ftrun.rank.transfer`) and for rank state kept in the job's store (:func:`to_bytes` /
  :func:`from_bytes`). Every tensor reference carries its key path, dtype, shape and device, so a
  recipient matches incoming tensors to its own by path (:func:`tensor_refs`), and a CUDA tensor is
  received on its device.

This module imports torch and numpy only when a function is called (the coordinator imports
:mod:`ftrun.common.checkpoint`, which imports this, without paying for torch).
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Mapping

NDARRAY = "__ftrun_ndarray__"  # marker key of a numpy array stored as a uint8 tensor


def key_path(path: str, key: Any) -> str:
    """``state`` + ``'opt'`` -> ``state['opt']``."""
    return f"{path}[{key!r}]"


SCALARS = frozenset({int, float, bool, str, bytes, type(None)})  # immutable primitives msgpack takes as they are


def _is_primitive(obj: Any) -> bool:
    return obj is None or isinstance(obj, (bool, int, float, complex, str, bytes))


def check_key(key: Any, path: str) -> Any:
    """A dict key as stored (numpy scalars become Python scalars).

    Raises:
        TypeError: the key is not a primitive.
    """
    import numpy as np

    if isinstance(key, np.generic):
        key = key.item()
    if not _is_primitive(key):
        raise TypeError(f"checkpoint: the key {key!r} at {path} is a {type(key).__name__}; keys must be str, int, float, bool, bytes or None")
    return key


def new_dict(obj: Mapping[Any, Any]) -> dict[Any, Any]:
    """An empty dict of the same kind (OrderedDict stays OrderedDict) carrying ``_metadata``."""
    out: dict[Any, Any] = OrderedDict() if isinstance(obj, OrderedDict) else {}
    metadata = getattr(obj, "_metadata", None)  # nn.Module.state_dict()'s version information
    if metadata is not None:
        out._metadata = plain_copy(metadata, "_metadata")  # type: ignore[attr-defined]
    return out


def plain_copy(obj: Any, path: str) -> Any:
    """A deep copy of containers of primitives (``_metadata``)."""
    if isinstance(obj, Mapping):
        return {check_key(k, path): plain_copy(v, key_path(path, k)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(plain_copy(v, f"{path}[{i}]") for i, v in enumerate(obj))
    if _is_primitive(obj):
        return obj
    raise TypeError(f"checkpoint: cannot save a {type(obj).__name__} at {path}")


def encode(obj: Any, path: str = "state") -> Any:
    """The state as ``torch.load(weights_only=True)`` accepts it (see the module docstring).

    Raises:
        TypeError: anything that is not part of a state, naming its place.
    """
    import numpy as np
    import torch

    if isinstance(obj, torch.Tensor):
        if type(obj) is torch.Tensor:
            return obj
        if isinstance(obj, torch.nn.Parameter):
            return obj.detach()
        raise TypeError(f"checkpoint: cannot save a tensor subclass {type(obj).__name__} at {path}")
    if isinstance(obj, np.ndarray):
        if obj.dtype.hasobject or obj.dtype.fields is not None or obj.dtype.itemsize == 0:
            raise TypeError(f"checkpoint: cannot save a numpy array of dtype {obj.dtype} at {path}")
        data = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
        return {NDARRAY: torch.from_numpy(data), "dtype": obj.dtype.str, "shape": list(obj.shape)}
    if isinstance(obj, np.generic):
        value = obj.item()
        if not _is_primitive(value):
            raise TypeError(f"checkpoint: cannot save a numpy {type(obj).__name__} at {path}")
        return value
    if isinstance(obj, Mapping):
        out = new_dict(obj)
        for k, v in obj.items():
            out[check_key(k, path)] = encode(v, key_path(path, k))
        return out
    if isinstance(obj, list):
        if all(type(v) in SCALARS for v in obj):
            return list(obj)
        return [encode(v, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, torch.Size):
        return obj
    if type(obj) is tuple:
        return tuple(encode(v, f"{path}[{i}]") for i, v in enumerate(obj))
    if _is_primitive(obj) or isinstance(obj, (torch.dtype, torch.device)):
        return obj
    raise TypeError(
        f"checkpoint: cannot save a {type(obj).__name__} at {path}; "
        "state_dict() must hold tensors, numpy arrays, dicts, lists, tuples and primitives"
    )


def decode(obj: Any) -> Any:
    """Inverse of :func:`encode`: numpy markers back to arrays (containers mutated in place)."""
    import numpy as np
    import torch

    if isinstance(obj, dict):
        if NDARRAY in obj and isinstance(obj[NDARRAY], torch.Tensor):
            data = obj[NDARRAY].cpu().numpy()
            return data.view(np.dtype(obj["dtype"])).reshape(obj["shape"])
        for k, v in obj.items():
            obj[k] = decode(v)
        return obj
    if isinstance(obj, list):
        for i, v in enumerate(obj):
            obj[i] = decode(v)
        return obj
    if type(obj) is tuple:
        return tuple(decode(v) for v in obj)
    return obj


# ------------------------------------------------------------------ the wire form
def dtype_of(name: str) -> Any:
    """``"torch.float32"`` -> ``torch.float32``; None for anything that is not a torch dtype."""
    import torch

    value = getattr(torch, name.removeprefix("torch."), None) if name.startswith("torch.") else None
    return value if isinstance(value, torch.dtype) else None


def flatten(state: Any) -> tuple[Any, list[Any]]:
    """Split a state into (msgpack-able skeleton, tensors in order).

    Raises:
        TypeError: the state holds something :func:`encode` refuses.
    """
    import torch

    tensors: list[torch.Tensor] = []

    def walk(obj: Any, path: str) -> Any:
        if isinstance(obj, torch.Tensor):
            tensors.append(obj)
            return {"__t": len(tensors) - 1, "path": path, "dtype": str(obj.dtype), "shape": list(obj.shape), "device": str(obj.device)}
        if isinstance(obj, dict):
            node: dict[str, Any] = {"__d": [[walk(k, path), walk(v, key_path(path, k))] for k, v in obj.items()]}
            if isinstance(obj, OrderedDict):
                node["od"] = True
            metadata = getattr(obj, "_metadata", None)
            if metadata is not None:
                node["meta"] = walk(metadata, path + "._metadata")
            return node
        if isinstance(obj, torch.Size):
            return {"__size": list(obj)}
        if isinstance(obj, list):
            if all(type(v) in SCALARS for v in obj):  # what encode left: numbers, strings, None
                return {"__l": obj}
            return {"__l": [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, tuple):
            return {"__tu": [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if isinstance(obj, torch.dtype):
            return {"__dtype": str(obj)}
        if isinstance(obj, torch.device):
            return {"__dev": str(obj)}
        if isinstance(obj, complex):
            return {"__c": [obj.real, obj.imag]}
        return obj

    return walk(encode(state), "state"), tensors


def unflatten(skeleton: Any, tensors: list[Any]) -> Any:
    """Inverse of :func:`flatten`."""
    import torch

    def walk(obj: Any) -> Any:
        if not isinstance(obj, dict):
            return obj
        if "__t" in obj:
            return tensors[obj["__t"]]
        if "__d" in obj:
            out: dict[Any, Any] = OrderedDict() if obj.get("od") else {}
            for k, v in obj["__d"]:
                out[walk(k)] = walk(v)
            if "meta" in obj:
                out._metadata = walk(obj["meta"])  # type: ignore[attr-defined]
            return out
        if "__l" in obj:
            return [walk(v) for v in obj["__l"]]
        if "__tu" in obj:
            return tuple(walk(v) for v in obj["__tu"])
        if "__size" in obj:
            return torch.Size(obj["__size"])
        if "__dtype" in obj:
            dtype = dtype_of(obj["__dtype"])
            if dtype is None:
                raise ValueError(f"state: unknown dtype {obj['__dtype']}")
            return dtype
        if "__dev" in obj:
            return torch.device(obj["__dev"])
        if "__c" in obj:
            return complex(*obj["__c"])
        raise ValueError(f"state: malformed skeleton node {sorted(obj)}")

    return decode(walk(skeleton))


def tensor_refs(skeleton: Any) -> list[dict[str, Any]]:
    """The tensor references of a skeleton (path, dtype, shape, device), in tensor order."""
    refs: dict[int, dict[str, Any]] = {}

    def walk(obj: Any) -> None:
        if isinstance(obj, dict):
            if "__t" in obj:
                refs[obj["__t"]] = obj
                return
            for v in obj.values():
                walk(v)
        elif isinstance(obj, list):
            for v in obj:
                walk(v)

    walk(skeleton)
    return [refs[i] for i in range(len(refs))]


class _NotPlain(Exception):
    """:func:`_plain_flatten` met something only the general walk handles."""


def _plain_flatten(state: Any) -> tuple[Any, list[Any]]:
    """:func:`flatten` and the tensors' bytes of :func:`to_bytes` in one walk, for the plain states
    a rank's own records hold (exact ``dict``s with str or int keys, lists, tuples, strided tensors,
    numpy arrays, primitives): the same skeleton, node for node, built without :func:`encode`'s
    intermediate tree, and each contiguous CPU tensor's bytes as a view of its memory
    (:func:`_tensor_memory`) instead of five tensor operations and a copy (others are copied to
    contiguous host memory first, as the general walk does).

    Raises:
        _NotPlain: anything else (OrderedDict, ``_metadata``, subclasses, sparse, quantized,
            conjugate views, numpy scalars, complex, dtypes, devices, other keys): the caller
            takes the general walk, which also names the place of what it refuses.
    """
    import numpy as np
    import torch

    Tensor, ndarray, Size, strided = torch.Tensor, np.ndarray, torch.Size, torch.strided
    data: list[Any] = []  # bytes-like, in tensor order

    def walk(obj: Any, path: str) -> Any:
        kind = type(obj)
        if kind in _PLAIN_SCALARS:
            return obj
        if kind is dict:
            items = []
            for k, v in obj.items():
                if type(k) not in _PLAIN_KEYS:
                    raise _NotPlain
                items.append([k, walk(v, f"{path}[{k!r}]")])
            return {"__d": items}
        if kind is Tensor:
            if obj.layout != strided or obj.is_quantized or obj.is_conj() or obj.is_neg():
                raise _NotPlain
            on_cpu = obj.is_cpu
            host = obj if on_cpu and obj.is_contiguous() else obj.detach().cpu().contiguous()  # as the general walk
            data.append(_tensor_memory(host) if obj.numel() else b"")
            return {"__t": len(data) - 1, "path": path, "dtype": str(obj.dtype), "shape": list(obj.shape),
                    "device": "cpu" if on_cpu else str(obj.device)}
        if kind is ndarray:
            dtype = obj.dtype
            if dtype.hasobject or dtype.fields is not None or dtype.itemsize == 0:
                raise _NotPlain  # encode refuses it, naming its place
            data.append(memoryview(np.ascontiguousarray(obj).reshape(-1).view(np.uint8)) if obj.nbytes else b"")  # encode's view
            ref = {"__t": len(data) - 1, "path": f"{path}[{NDARRAY!r}]", "dtype": "torch.uint8", "shape": [obj.nbytes], "device": "cpu"}
            return {"__d": [[NDARRAY, ref], ["dtype", dtype.str], ["shape", {"__l": list(obj.shape)}]]}
        if kind is list:
            return {"__l": [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if kind is tuple:
            return {"__tu": [walk(v, f"{path}[{i}]") for i, v in enumerate(obj)]}
        if kind is Size:
            return {"__size": list(obj)}
        raise _NotPlain

    return walk(state, "state"), data


def _tensor_memory(t: Any) -> memoryview:
    """The bytes of a contiguous CPU tensor as a view of its memory (no copy: msgpack copies them
    once, into the record)."""
    import torch

    if not t.requires_grad:
        try:
            return memoryview(t.numpy()).cast("B")
        except TypeError:  # a dtype numpy lacks (bfloat16, float8...)
            pass
    return memoryview(t.detach().reshape(-1).view(torch.uint8).numpy())


_PLAIN_SCALARS = frozenset({int, float, bool, str, bytes, type(None)})  # msgpack writes them as flatten leaves them
_PLAIN_KEYS = frozenset({str, int})


def to_bytes(state: Any) -> bytes:
    """The state as one self-contained byte string (msgpack of the skeleton and CPU tensor bytes).

    A plain state (:func:`_plain_flatten`: what a rank's records hold, written twice a step)
    takes a one-pass walk that gives the same bytes as the general one; anything else the general
    walk (:func:`flatten`).

    Raises:
        TypeError: the state holds something :func:`encode` refuses (naming its place).
    """
    import msgpack

    try:
        skeleton, data = _plain_flatten(state)
    except _NotPlain:
        pass
    else:
        return msgpack.packb({"skeleton": skeleton, "data": data}, use_bin_type=True)
    skeleton, tensors = flatten(state)
    # A lazy negation or conjugation (torch._neg_view, .conj()) is applied first: the bytes are the values'.
    data = [t.detach().cpu().resolve_conj().resolve_neg().contiguous().reshape(-1).view(__import__("torch").uint8).numpy().tobytes()
            if t.numel() else b"" for t in tensors]
    return msgpack.packb({"skeleton": skeleton, "data": data}, use_bin_type=True)


def from_bytes(blob: bytes) -> Any:
    """Inverse of :func:`to_bytes` (tensors on CPU)."""
    import msgpack
    import torch

    doc = msgpack.unpackb(blob, raw=False, strict_map_key=False)
    tensors = []
    for ref, raw in zip(tensor_refs(doc["skeleton"]), doc["data"]):
        dtype = dtype_of(ref["dtype"])
        if dtype is None:
            raise ValueError(f"state: unknown dtype {ref['dtype']}")
        t = torch.empty(ref["shape"], dtype=dtype)
        if raw:
            t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(raw), dtype=torch.uint8))
        tensors.append(t)
    return unflatten(doc["skeleton"], tensors)


# ---------------------------------------------------------------------------- rank records
# A rank's own state is encoded twice a step (ftrun.rank.rankstate, ftrun.rank.registry): there the walk's
# Python overhead, not the bytes, is the cost. The record format lets msgpack's C packer walk the
# containers and scalars itself and calls back only for what msgpack has no type for, which
# becomes an array tagged by an empty ext value in its first place; decoding turns such arrays
# back as they complete (map keys included). Anything else falls back to :func:`to_bytes`.
_RECORD_TENSOR, _RECORD_ARRAY, _RECORD_TUPLE, _RECORD_SIZE = 1, 2, 3, 4
_RECORD_FORMAT = 0x52  # first element of a record blob: [format, state] (a to_bytes blob is a map)


class _RecordTags:
    """The empty ext values that tag arrays in the record format (made once, msgpack imported lazily)."""

    def __init__(self) -> None:
        import threading

        import msgpack

        import numpy as np
        import torch

        self.ext = msgpack.ExtType
        self.tensor, self.array, self.tuple, self.size = (msgpack.ExtType(c, b"") for c in
                                                          (_RECORD_TENSOR, _RECORD_ARRAY, _RECORD_TUPLE, _RECORD_SIZE))
        self._local = threading.local()
        self._torch, self._np = torch, np
        # The dtypes of the common tensor (a CPU tensor numpy can view, with no conjugate or
        # quantization bit possible), by name: :meth:`default` takes it with a few checks.
        self._viewable = {dtype: str(dtype) for dtype in (
            torch.float16, torch.float32, torch.float64, torch.int8, torch.int16, torch.int32, torch.int64,
            torch.uint8, torch.bool)}

    @property
    def packer(self) -> Any:
        """This thread's packer (its buffer is reused from record to record)."""
        packer = getattr(self._local, "packer", None)
        if packer is None:
            import msgpack

            packer = self._local.packer = msgpack.Packer(default=self.default, strict_types=True, use_bin_type=True,
                                                         autoreset=False)
        return packer

    def default(self, obj: Any) -> Any:
        np, torch = self._np, self._torch
        kind = type(obj)
        if kind is torch.Tensor:
            name = self._viewable.get(obj.dtype)
            if name is not None and obj.layout is torch.strided and obj.is_cpu and obj.is_contiguous() and not obj.is_neg():
                # The common case (a rank's RNG streams, carried tensors), the same bytes
                # as below with a third of the calls: a record is made twice a step. A carried
                # tensor often still requires grad (a forward's output, before it is detached).
                return [self.tensor, name, list(obj.shape),
                        memoryview((obj.detach() if obj.requires_grad else obj).numpy())]
            if obj.layout != torch.strided or obj.is_quantized or obj.is_conj() or obj.is_neg():
                raise _NotPlain
            host = obj if obj.is_cpu and obj.is_contiguous() else obj.detach().cpu().contiguous()
            return [self.tensor, str(obj.dtype), list(obj.shape), _tensor_memory(host) if obj.numel() else b""]
        if kind is np.ndarray:
            if obj.dtype.hasobject or obj.dtype.fields is not None or obj.dtype.itemsize == 0:
                raise _NotPlain
            return [self.array, obj.dtype.str, list(obj.shape),
                    memoryview(np.ascontiguousarray(obj).reshape(-1).view(np.uint8)) if obj.nbytes else b""]
        if kind is tuple:
            return [self.tuple, *obj]
        if kind is torch.Size:
            return [self.size, *obj]
        raise _NotPlain  # OrderedDict, subclasses, numpy scalars, ExtType values...

    def rebuild(self, items: list[Any]) -> Any:
        import numpy as np
        import torch

        tag = items[0] if items else None
        if type(tag) is not self.ext or tag.data:
            return items
        if tag.code == _RECORD_TENSOR:
            dtype = dtype_of(items[1])
            if dtype is None:
                raise ValueError(f"record: unknown dtype {items[1]}")
            t = torch.empty(items[2], dtype=dtype)
            if items[3]:
                t.reshape(-1).view(torch.uint8).copy_(torch.frombuffer(bytearray(items[3]), dtype=torch.uint8))
            return t
        if tag.code == _RECORD_ARRAY:
            return np.frombuffer(bytearray(items[3]), dtype=np.dtype(items[1])).reshape(items[2])
        if tag.code == _RECORD_TUPLE:
            return tuple(items[1:])
        if tag.code == _RECORD_SIZE:
            return torch.Size(items[1:])
        return items


_record_tags: _RecordTags | None = None


def to_record(state: Any) -> bytes:
    """The bytes of a rank's record of ``state``: what :func:`to_bytes` keeps (containers, keys,
    tuples, scalars of exact built-in types, CPU copies of tensors and arrays, bit for bit), walked
    by msgpack's C packer, about twice as fast for the RNG streams, carried tensors and positions a
    rank's own state holds; any other state is encoded by :func:`to_bytes`. Equal states
    give equal bytes. :func:`from_record` reads both. Unlike :func:`to_bytes`, which refuses them,
    ``bytearray`` and ``memoryview`` values are kept, and come back as ``bytes``.

    Raises:
        TypeError: the state holds something :func:`encode` refuses (naming its place)."""
    global _record_tags
    if _record_tags is None:
        _record_tags = _RecordTags()
    packer = _record_tags.packer
    try:
        packer.pack_array_header(2)
        packer.pack(_RECORD_FORMAT)
        packer.pack(state)
        return packer.bytes()
    except (_NotPlain, TypeError, ValueError, OverflowError):
        return to_bytes(state)  # the general walk, which also names the place of what it refuses
    finally:
        packer.reset()


def from_record(blob: bytes) -> Any:
    """Inverse of :func:`to_record` (tensors and arrays are new CPU copies)."""
    import msgpack

    global _record_tags
    if not blob or blob[0] != 0x92:  # not a two-element array: a to_bytes blob
        return from_bytes(blob)
    if _record_tags is None:
        _record_tags = _RecordTags()
    fmt, state = msgpack.unpackb(blob, raw=False, strict_map_key=False, list_hook=_record_tags.rebuild)
    if fmt != _RECORD_FORMAT:
        raise ValueError(f"record: unknown format {fmt!r}")
    return state
