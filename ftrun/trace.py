"""The trace of one rank process that ``ftrun check`` compares between runs (:mod:`ftrun.check`).

Under ``ftrun check`` (``FTRUN_CHECK_TRACE`` names a directory) each rank process records, per
committed step, a fingerprint of each parameter of the registered models (:mod:`ftrun.digest`),
the first step of each epoch and the sections it opened, and writes them at ``ft.finish()`` as
``trace_rank<rank>_inc<incarnation>.json``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

import torch

from .registry import StateRegistry


class RunTrace:
    """What this process did, step by step, for ``ftrun check``.

    Args:
        directory: where the trace is written.
        registry: the registered state (its models' parameters are traced).
    """

    def __init__(self, directory: str, registry: StateRegistry) -> None:
        self.directory = Path(directory)
        self.registry = registry
        self.steps: dict[str, list[str]] = {}
        self.epochs: list[dict[str, int]] = []
        self.sections: list[dict[str, Any]] = []

    def parameters(self) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` of every parameter of the registered models, named
        ``<registered name>.<parameter name>`` (what ``ftrun check`` compares)."""
        return [(f"{name}.{pname}", p) for name, obj in self.registry.items()
                if self.registry.kinds[name] == "committed" and isinstance(obj, torch.nn.Module)
                for pname, p in obj.named_parameters()]

    def committed(self, step: int) -> None:
        """``step`` committed: a fingerprint of each parameter."""
        from .digest import fingerprint

        self.steps[str(step)] = [fingerprint([p]) for _, p in self.parameters()]

    def write(self, rank: int, incarnation: int, committed: int, divergences: Iterable[tuple[int, str, str]]) -> Path:
        """Write the trace (with the divergences the rank found) as JSON; returns its path."""
        doc = {"rank": rank, "incarnation": incarnation, "committed": committed,
               "names": [n for n, _ in self.parameters()], "steps": self.steps,
               "epochs": self.epochs, "sections": self.sections,
               "divergences": [{"step": s, "check": c, "reason": r} for s, c, r in divergences]}
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"trace_rank{rank}_inc{incarnation}.json"
        path.with_suffix(".tmp").write_text(json.dumps(doc))
        path.with_suffix(".tmp").replace(path)
        return path
