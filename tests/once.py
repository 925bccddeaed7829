"""Work that pytest-xdist's workers share: a fault-free reference run is made once per test run,
not once per worker that needs it (each worker has its own session and module fixtures).

A reference is a digest of a fault-free run: computing it once for both workers hides no fault
(the faulted runs are each test's own). Without xdist, the fixture's own scope does the sharing.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable

import pytest
from filelock import FileLock


def shared_once(tmp_path_factory: pytest.TempPathFactory, name: str, compute: Callable[[], Any]) -> Any:
    """``compute()``'s value (JSON-able; tuples come back as lists), computed by the first xdist
    worker that asks for ``name`` in this test run while the others wait for it; a failure is
    not kept (the next worker that asks computes again, and fails its own tests)."""
    if os.environ.get("PYTEST_XDIST_WORKER") is None:
        return compute()
    root = tmp_path_factory.getbasetemp().parent  # this run's directory, above each worker's own
    path = root / f"shared-{name}.json"
    with FileLock(str(path) + ".lock"):
        if path.exists():
            return json.loads(path.read_text())
        value = compute()
        path.write_text(json.dumps(value))
        return value
