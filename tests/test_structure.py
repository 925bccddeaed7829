"""The import graph is part of the design: the launcher, the coordinator and the node agents never
import torch (a launcher starts in a fraction of a second; an agent stays small beside its ranks),
and the roles import one way: cli -> launcher -> coordinator/agent -> policy/protocol/spawner."""

from __future__ import annotations

import subprocess
import sys

import pytest


@pytest.mark.parametrize("module", ["ftrun.cli", "ftrun.launcher", "ftrun.supervisor", "ftrun.coordinator",
                                    "ftrun.agent", "ftrun.spawner", "ftrun.policy", "ftrun.protocol"])
def test_control_side_does_not_import_torch(module: str) -> None:
    code = f"import sys, {module}; print('torch' in sys.modules, 'ftrun.worker' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.split() == ["False", "False"], f"{module} imports torch or the worker library"


@pytest.mark.parametrize("module, forbidden", [
    ("ftrun.agent", ("ftrun.coordinator", "ftrun.launcher")),
    ("ftrun.spawner", ("ftrun.coordinator", "ftrun.agent", "ftrun.launcher")),
    ("ftrun.policy", ("ftrun.coordinator", "ftrun.agent", "ftrun.launcher", "ftrun.protocol")),
    ("ftrun.protocol", ("ftrun.coordinator", "ftrun.agent", "ftrun.launcher")),
])
def test_imports_flow_one_way(module: str, forbidden: tuple[str, ...]) -> None:
    code = f"import sys, {module}; print(' '.join(m for m in {forbidden!r} if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "", f"{module} imports {out.strip()}"
