"""The trace of one rank process that ``ftrun check`` compares between runs (:mod:`ftrun.tools.check`).

Under ``ftrun check`` (``FTRUN_CHECK_TRACE`` names a directory) each rank process records, per
committed step, a fingerprint (:mod:`ftrun.rank.digest`) of

- each parameter and each buffer (BatchNorm's ``running_mean``, ``running_var``,
  ``num_batches_tracked``) of the registered modules, named ``<registered name>.<tensor name>``;
- what the script holds that ftrun does not know about: the modules and optimizers reachable from
  the script's ``__main__`` globals and from the locals of its functions on the stack (and one
  level into the objects and containers held there) that are not registered, nor part of a
  registered object (a submodule, a DDP wrapper's ``.module``, an ``FTOptimizer``'s inner
  optimizer). They are looked for once per process, at its first committed step, and traced
  under ``unregistered:<name>.<tensor name>`` (an optimizer: ``unregistered:<name>.state``, its
  per-parameter state, and ``unregistered:<name>.param_groups``, its hyperparameters);

with how many times each fault point was reached at the step (:meth:`ftrun.common.faults.FaultInjector.counts`:
the step's shape, from which ``ftrun check`` places faults), the first step of each epoch and the
sections it opened; and writes them at ``ft.finish()`` as ``trace_rank<rank>_inc<incarnation>.json``.

The cost per committed step is one pass over the traced tensors' bytes on the CPU; tensors on an
accelerator are reduced there (:func:`ftrun.rank.digest.tensor_sums`) and brought to the host in one
transfer per device.
"""

from __future__ import annotations

import json
import sys
import types
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable, Iterator

import torch
import xxhash

from ftrun.rank.digest import tensor_sums
from ftrun.rank.registry import StateRegistry

#: What a traced tensor is (the trace's ``kinds``; :mod:`ftrun.tools.check` names differences with it).
PARAMETER = "parameter"
BUFFER = "buffer"
UNREGISTERED_MODULE = "unregistered module"
UNREGISTERED_OPTIMIZER = "unregistered optimizer"

#: How many items of a list, tuple or dict, or attributes of an object, are looked into.
_MAX_ITEMS = 64


@dataclass
class Traced:
    """One traced entry: its name, what it is (:data:`PARAMETER`...), the registered or global name
    of the object it belongs to, and what its fingerprint covers (tensors, then bytes)."""

    name: str
    kind: str
    owner: str
    tensors: list[torch.Tensor]
    extra: bytes = b""


class RunTrace:
    """What this process did, step by step, for ``ftrun check``.

    Args:
        directory: where the trace is written.
        registry: the registered state (its modules' parameters and buffers are traced, and what it
            holds is not reported as unregistered).
    """

    def __init__(self, directory: str, registry: StateRegistry) -> None:
        self.directory = Path(directory)
        self.registry = registry
        self.steps: dict[str, list[str]] = {}
        self.points: dict[str, dict[str, int]] = {}
        self.epochs: list[dict[str, int]] = []
        self.sections: list[dict[str, Any]] = []
        self._layout: list[tuple[str, str, str]] = []  # (name, kind, owner) of the newest step's entries
        self._unregistered: list[tuple[str, Any]] | None = None  # found at the first committed step

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter of the registered modules, named
        ``<registered name>.<parameter name>``."""
        return [(e.name, e.tensors[0]) for e in self._registered() if e.kind == PARAMETER]

    def committed(self, step: int, points: dict[str, int] | None = None) -> None:
        """``step`` committed: a fingerprint of each traced entry (module docstring).

        Args:
            step: the committed step.
            points: ``{fault point: times reached at the step}``
                (:meth:`ftrun.common.faults.FaultInjector.counts`), or None when not known.
        """
        if self._unregistered is None:
            self._unregistered = find_unregistered(self.registry, script_namespaces())
        entries = self._registered() + self._unregistered_entries()
        self._layout = [(e.name, e.kind, e.owner) for e in entries]
        self.steps[str(step)] = fingerprints(entries)
        if points is not None:
            self.points[str(step)] = dict(points)

    def unregistered(self) -> list[tuple[str, str]]:
        """``(name, "module" | "optimizer")`` of the unregistered objects found (empty before the
        first committed step)."""
        return [(n, "module" if isinstance(o, torch.nn.Module) else "optimizer") for n, o in self._unregistered or []]

    def write(self, rank: int, incarnation: int, committed: int, divergences: Iterable[tuple[int, str, str]]) -> Path:
        """Write the trace (with the divergences the rank found) as JSON; returns its path.

        The document: ``names``, ``kinds``, ``owners`` (one per traced entry, in order), ``steps``
        (``{step: [fingerprint per entry]}``), ``points`` (``{step: {point: count}}``),
        ``unregistered`` (``{name: "module" | "optimizer"}``), ``epochs``, ``sections``,
        ``divergences``, and the rank, incarnation and committed step.
        """
        layout = self._layout or [(e.name, e.kind, e.owner) for e in self._registered()]
        doc = {"rank": rank, "incarnation": incarnation, "committed": committed,
               "names": [n for n, _, _ in layout], "kinds": [k for _, k, _ in layout],
               "owners": [o for _, _, o in layout], "steps": self.steps, "points": self.points,
               "unregistered": dict(self.unregistered()), "epochs": self.epochs, "sections": self.sections,
               "divergences": [{"step": s, "check": c, "reason": r} for s, c, r in divergences]}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace_rank{rank}_inc{incarnation}.json"
        path.with_suffix(".tmp").write_text(json.dumps(doc))
        path.with_suffix(".tmp").replace(path)
        return path

    def _registered(self) -> list[Traced]:
        """The registered modules' parameters, then their buffers (each tensor once)."""
        params: list[Traced] = []
        buffers: list[Traced] = []
        seen: set[int] = set()
        for name, obj in self.registry.items():
            if not isinstance(obj, torch.nn.Module):
                continue
            for pname, p in obj.named_parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    params.append(Traced(f"{name}.{pname}", PARAMETER, name, [p]))
            for bname, b in obj.named_buffers():
                if id(b) not in seen:
                    seen.add(id(b))
                    buffers.append(Traced(f"{name}.{bname}", BUFFER, name, [b]))
        return params + buffers

    def _unregistered_entries(self) -> list[Traced]:
        out: list[Traced] = []
        seen = {id(t) for _, obj in self.registry.items() if isinstance(obj, torch.nn.Module)
                for t in _module_tensors(obj)}
        for name, obj in self._unregistered or []:
            if isinstance(obj, torch.nn.Module):
                for tname, t in _named_module_tensors(obj):
                    if id(t) not in seen:
                        seen.add(id(t))
                        out.append(Traced(f"unregistered:{name}.{tname}", UNREGISTERED_MODULE, name, [t]))
            else:
                out.extend(_optimizer_entries(name, obj, seen))
        return out


def fingerprints(entries: list[Traced]) -> list[str]:
    """One fingerprint (32 hex digits) per entry: XXH3-128 of each tensor's shape, dtype and bytes
    (for a tensor not on the CPU, of its :func:`ftrun.rank.digest.tensor_sums`, computed on its device
    and brought over in one transfer per device), then of ``extra``. A tensor alone gives what
    :func:`ftrun.rank.digest.fingerprint` gives for it."""
    pending: dict[torch.device, list[torch.Tensor]] = {}
    places: list[list[tuple[torch.device, int]]] = []
    for e in entries:
        mine = []
        for t in e.tensors:
            if t.device.type != "cpu":
                on = pending.setdefault(t.device, [])
                on.append(tensor_sums(t))
                mine.append((t.device, len(on) - 1))
        places.append(mine)
    host = {device: torch.stack(sums).cpu().numpy() for device, sums in pending.items()}
    out = []
    for e, mine in zip(entries, places):
        h = xxhash.xxh3_128()
        for t in e.tensors:
            h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
            if t.device.type == "cpu":
                flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
                if flat.numel():
                    if flat.is_complex():
                        flat = torch.view_as_real(flat).reshape(-1)
                    h.update(flat.view(torch.uint8).numpy())
        if mine:
            h.update(b"".join(host[device][i].tobytes() for device, i in mine))
        h.update(e.extra)
        out.append(h.hexdigest())
    return out


def _named_module_tensors(module: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    yield from module.named_parameters()
    yield from module.named_buffers()


def _module_tensors(module: torch.nn.Module) -> Iterator[torch.Tensor]:
    for _, t in _named_module_tensors(module):
        yield t


def _optimizer_entries(name: str, opt: torch.optim.Optimizer, seen: set[int]) -> list[Traced]:
    """An unregistered optimizer's entries: its per-parameter state (``.state``), its
    hyperparameters (``.param_groups`` without the parameters), and its parameters that nothing
    else traced (``.params``)."""
    state: list[torch.Tensor] = []
    extra: list[str] = []
    hyper: list[str] = []
    hyper_tensors: list[torch.Tensor] = []
    params: list[torch.Tensor] = []
    for g, group in enumerate(opt.param_groups):
        for i, p in enumerate(group["params"]):
            for key, value in sorted(opt.state.get(p, {}).items(), key=lambda kv: str(kv[0])):
                if isinstance(value, torch.Tensor):
                    state.append(value)
                    extra.append(f"{g}.{i}.{key}:tensor")
                else:
                    extra.append(f"{g}.{i}.{key}={_scalar(value)}")
            if id(p) not in seen:
                seen.add(id(p))
                params.append(p)
        for key, value in sorted((k, v) for k, v in group.items() if k != "params"):
            if isinstance(value, torch.Tensor):
                hyper_tensors.append(value)
                hyper.append(f"{g}.{key}:tensor")
            else:
                hyper.append(f"{g}.{key}={_scalar(value)}")
    out = [Traced(f"unregistered:{name}.state", UNREGISTERED_OPTIMIZER, name, state, ";".join(extra).encode()),
           Traced(f"unregistered:{name}.param_groups", UNREGISTERED_OPTIMIZER, name, hyper_tensors,
                  ";".join(hyper).encode())]
    if params:
        out.append(Traced(f"unregistered:{name}.params", UNREGISTERED_OPTIMIZER, name, params))
    return out


def _scalar(value: Any) -> str:
    """A value's text, exact for floats (``float.hex``)."""
    if isinstance(value, float):
        return value.hex()
    if isinstance(value, (tuple, list)):
        return "(" + ",".join(_scalar(v) for v in value) + ")"
    return repr(value)


def script_namespaces() -> list[dict[str, Any]]:
    """Where the script's objects are: the ``__main__`` module's globals, then the locals of the
    script's functions on the calling thread's stack, outermost first (a training loop inside
    ``main()``)."""
    main = sys.modules.get("__main__")
    if main is None:
        return []
    namespace = vars(main)
    frames = []
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_globals is namespace and frame.f_code.co_name != "<module>":
            frames.append(frame)
        frame = frame.f_back
    return [namespace] + [dict(f.f_locals) for f in reversed(frames)]


def _children(value: Any) -> Iterator[tuple[str, Any]]:
    """One level into ``value``: ``("[i]", item)`` of a list or tuple, ``("[key]", item)`` of a
    dict, ``(".attr", item)`` of a plain object's attributes (at most :data:`_MAX_ITEMS`)."""
    if isinstance(value, (list, tuple)):
        yield from ((f"[{i}]", v) for i, v in enumerate(value[:_MAX_ITEMS]))
    elif isinstance(value, dict):
        for i, (k, v) in enumerate(value.items()):
            if i >= _MAX_ITEMS:
                break
            yield f"[{k!r}]", v
    elif not isinstance(value, (torch.nn.Module, torch.optim.Optimizer, torch.Tensor, type, types.ModuleType,
                                types.FunctionType, types.BuiltinFunctionType, types.MethodType, str, bytes)):
        try:
            attributes = vars(value)
        except TypeError:
            return
        for i, (k, v) in enumerate(list(attributes.items())):
            if i >= _MAX_ITEMS:
                break
            if not k.startswith("__"):
                yield f".{k}", v


def find_unregistered(registry: StateRegistry, namespaces: list[dict[str, Any]]) -> list[tuple[str, Any]]:
    """The modules and optimizers in ``namespaces`` (and one level into what they hold) that ftrun
    does not know about, as ``(name, object)`` in the order found, each object once.

    A module is reported when it has a parameter or buffer that no registered module has (so a
    registered module, its submodules and a DDP wrapper around it are not, nor is a module without
    tensors, such as a loss). An optimizer is reported unless it is registered or wraps one that
    is (``.optimizer``, followed a few levels: ftrun's ``FTOptimizer``, accelerate's
    ``AcceleratedOptimizer``). What a registered object holds one level down counts as registered
    (the model inside a registered EMA object).

    Args:
        registry: the registered state.
        namespaces: name -> object mappings (:func:`script_namespaces`), searched in order.
    """
    registered = {id(obj) for _, obj in registry.items()}
    held = [obj for _, obj in registry.items()]
    for _, obj in registry.items():  # what a registered object holds is its (an EMA object's model)
        try:
            held.extend(child for _, child in _children(obj))
        except Exception:
            continue
    registered.update(id(obj) for obj in held)
    known_tensors = {id(t) for obj in held if isinstance(obj, torch.nn.Module) for t in _module_tensors(obj)}
    found: list[tuple[str, Any]] = []
    seen: set[int] = set()

    def consider(name: str, value: Any) -> bool:
        try:
            if isinstance(value, torch.nn.Module):
                if id(value) not in seen and any(id(t) not in known_tensors for t in _module_tensors(value)):
                    found.append((name, value))
                    known_tensors.update(id(t) for t in _module_tensors(value))
                seen.add(id(value))
                return True
            if isinstance(value, torch.optim.Optimizer):
                if id(value) not in seen and not _wraps_registered(value, registered):
                    found.append((name, value))
                seen.add(id(value))
                return True
        except Exception:  # an object whose class or attributes misbehave: not ours to judge
            return True
        return False

    for namespace in namespaces:
        for name, value in list(namespace.items()):
            if name.startswith("__") or consider(name, value):
                continue
            try:
                for suffix, child in _children(value):
                    consider(f"{name}{suffix}", child)
            except Exception:  # a container that changed or refuses to be read
                continue
    return found


def _wraps_registered(opt: Any, registered: set[int]) -> bool:
    for _ in range(4):
        if id(opt) in registered:
            return True
        opt = opt.__dict__.get("optimizer") if hasattr(opt, "__dict__") else None
        if opt is None:
            return False
    return False
