"""The job coordinator (one per job, on node 0), as a package of roles: see :mod:`.core`.

Imports flow one way inside it: :mod:`.core` wires the roles (:mod:`.control`, :mod:`.membership`,
:mod:`.environment`, :mod:`.rounds`, :mod:`.watchdog`, :mod:`.ttp`, :mod:`.publish`), which use the
rank table and phases (:mod:`.ranks`, :mod:`.phases`) and ``ftrun.coordinator.policy`` / ``ftrun.common.protocol``;
none imports torch (the store of a whole-job restart imports it lazily). The names below are
loaded on first use, so importing one pure role (the watchdog, the phases) loads only that role.
"""

from __future__ import annotations

import importlib
from typing import Any

_EXPORTS = {
    "Coordinator": "core", "DIVERGENCE_EXIT_CODE": "messages", "TEARDOWN_CRASH_CODES": "core",
    "OFFENDER_REJECTS": "control",
    "IllegalPhaseTransition": "phases", "JobPhase": "phases", "JobPhases": "phases",
    "write_status_file": "publish",
    "Incarnation": "ranks", "Rank": "ranks", "RankPhase": "ranks",
    "PLAN_DEADLINE_S": "watchdog", "REPORT_DEADLINE_S": "watchdog", "STALL_BASE_S": "watchdog",
    "STALL_MIN_BYTES_PER_S": "watchdog",
}
__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    if name not in _EXPORTS:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(f".{_EXPORTS[name]}", __name__), name)
