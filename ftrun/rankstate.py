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

from dataclasses import dataclass
from typing import Any

from . import codec
from .contract import RANK_STATE_PREFIX

PREFIX = RANK_STATE_PREFIX


@dataclass
class RankRecord:
    """One record of a rank's own state.

    Attributes:
        label: the committed step it belongs to.
        state: ``{name: state_dict}`` of the rank's ``rank`` objects.
        provisional: written at the all-reduce of step ``label`` (the state right after that step's
            batch and backward) rather than at the start of step ``label + 1``. Whatever the script
            ran between the two (the rest of the step, an epoch's end, the next epoch's prologue)
            is not in it: a respawned rank applies it *before* it replays that code, a step-start
            record after (:meth:`ftrun.worker.Worker.epochs`).
        epoch_boundary: written by :meth:`ftrun.worker.Worker.epochs` once an epoch's end (the code
            after its ``ft.batches`` loop) has run, before the next epoch's prologue: like a
            provisional one it is applied before the prologue, and it holds what the epoch's end
            did to the rank's own state (an evaluation DataLoader's ``iter()`` draws a seed from
            torch's global generator).
    """

    label: int
    state: dict[str, Any]
    provisional: bool = False
    epoch_boundary: bool = False  # written after an epoch's end, before the next epoch's prologue


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

    def put(self, label: int, state: dict[str, Any], provisional: bool = False, epoch_boundary: bool = False) -> None:
        """Record ``state`` (``{name: state_dict}``) as the rank's state at committed step ``label``
        (``provisional``: taken at that step's all-reduce; ``epoch_boundary``: after an epoch's end;
        see :class:`RankRecord`)."""
        self.store.set(f"{self.prefix}/{label % 2}",
                       codec.to_bytes({"label": int(label), "state": state, "provisional": bool(provisional),
                                       "epoch_boundary": bool(epoch_boundary)}))

    def get(self, label: int) -> RankRecord | None:
        """The record of committed step ``label``, or None if there is none."""
        key = f"{self.prefix}/{label % 2}"
        if not self.store.check([key]):
            return None
        doc = codec.from_bytes(bytes(self.store.get(key)))
        if int(doc["label"]) != label:
            return None
        return RankRecord(label, doc["state"], bool(doc.get("provisional", False)), bool(doc.get("epoch_boundary", False)))

    def put_gradient_digest(self, step: int, digest: str) -> None:
        """Record the digest of this rank's local gradient (before averaging) of ``step``."""
        self.store.set(f"{self.prefix}/grad/{step % 2}", codec.to_bytes({"step": int(step), "digest": str(digest)}))

    def get_gradient_digest(self, step: int) -> str | None:
        """The recorded local-gradient digest of ``step``, or None (never computed, or overwritten)."""
        key = f"{self.prefix}/grad/{step % 2}"
        if not self.store.check([key]):
            return None
        doc = codec.from_bytes(bytes(self.store.get(key)))
        return str(doc["digest"]) if int(doc["step"]) == step else None
