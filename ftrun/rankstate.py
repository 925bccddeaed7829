"""A rank's own state (kind ``rank``: data position, RNG streams) kept off its process.

A respawned rank must continue with its predecessor's data position and random streams, which no
other rank holds (another rank's are different by construction). So each rank writes them to the
job's c10d TCPStore (the one at ``MASTER_ADDR:MASTER_PORT``, hosted by the launcher, which outlives
every rank), labelled with the committed step they belong to:

- at each step start, the state before the step (label: the step before, committed);
- provisionally when the step's gradient all-reduce starts, the state after its batch and its
  forward/backward (label: the step itself). If peers commit that step and this rank dies before
  its next step start, the recovery step is that step, and this is its state; the next step
  start's record replaces it.

Two slots per rank (label parity), so the record of the recovery step S and the one of S + 1
never overwrite each other. A respawned rank reads the slot of S and checks its label.
"""

from __future__ import annotations

from typing import Any

from . import codec

PREFIX = "ftrun/rank_state"


class RankStateStore:
    """Reads and writes one rank's records.

    Args:
        store: a ``torch.distributed.Store`` (the job's TCPStore).
        attempt: the whole-job attempt (a restart starts with no records).
        rank: the global rank.
    """

    def __init__(self, store: Any, attempt: int, rank: int) -> None:
        self.store = store
        self.prefix = f"{PREFIX}/attempt{attempt}/rank{rank}"

    def put(self, label: int, state: dict[str, Any]) -> None:
        """Record ``state`` (``{name: state_dict}``) as the rank's state at committed step ``label``."""
        self.store.set(f"{self.prefix}/{label % 2}", codec.to_bytes({"label": int(label), "state": state}))

    def get(self, label: int) -> dict[str, Any] | None:
        """The record of committed step ``label``, or None if there is none."""
        key = f"{self.prefix}/{label % 2}"
        if not self.store.check([key]):
            return None
        doc = codec.from_bytes(bytes(self.store.get(key)))
        return doc["state"] if int(doc["label"]) == label else None
