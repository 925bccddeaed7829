"""A rank's own state (kind ``rank``: data position, RNG streams) kept off its process.

A respawned rank must continue with its predecessor's data position and random streams, which no
other rank holds (another rank's are different by construction). So each rank writes them to the
job's c10d TCPStore (the one at ``MASTER_ADDR:MASTER_PORT``, hosted by node 0's launcher, or for
its launcher by a process of node 0's fork server; either outlives every rank), labelled with the
committed step they belong to:

- at each step start, the state before the step (label: the step before, committed);
- provisionally when each synced backward pass of the step starts, before any of its gradients
  leaves, the state after its batch and its forward passes so far (label: the step itself; a
  backward changes no rank state). Each replaces the last: peers cannot commit the step before
  this rank's last pass has sent its gradients, so the record they commit against is that pass's. If peers commit that step and this rank dies before its next step start, the recovery
  step is that step, and this is its state; the next step start's record replaces it (only when
  it differs: most steps write one record).

The fingerprint of the step's local gradient is written apart (:meth:`RankStateStore.put_gradient_digest`),
right after the step's last bucket left, while its all-reduce runs.

Two slots per rank (label parity), so the record of the recovery step S and the one of S + 1
never overwrite each other. A respawned rank reads the slot of S and checks its label.

The writes are made on the training thread with its own store client, and cost a send: a
``TCPStore.set`` is one request with no reply (measured with torch 2.13: 11 us for an 8 KB
record, and 4 us a call with the store's process stopped), so nothing waits for the launcher's
process to be scheduled. Once ``set`` has returned, the record is in this host's socket buffer, in
order with the rank's earlier records, and reaches the store even if the rank is SIGKILLed right
after (its socket is closed gracefully by the kernel: the client has no unread reply that would
turn the close into a reset). The provisional record is the one peers may commit against: it is
written before the step's first gradient bucket leaves. (A background writer thread did this
before; on 2 busy cores, handing it each record cost more than the send: 3.4% of a rank's
training-thread time on word_lm's small steps, plus 1.8% waiting for it.)
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import msgpack

from ftrun.common import codec
from ftrun.common.contract import RANK_STATE_PREFIX

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
            record after (:meth:`ftrun.rank.worker.Worker.epochs`).
        epoch_boundary: written by :meth:`ftrun.rank.worker.Worker.epochs` once an epoch's end (the code
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

    A failed write (the job's store gone with its host) is reported once on stderr and counts as
    done: the record is then missing, which costs a respawned successor its exact state (its
    exactly-once checks report the difference) rather than stopping a rank whose store is gone
    anyway (a standby coordinator that takes over hosts a new one: the rank makes a new
    :class:`RankStateStore` on it).
    """

    def __init__(self, store: Any, attempt: int, rank: int) -> None:
        self.store = store
        self.prefix = f"{PREFIX}/attempt{attempt}/rank{rank}"
        # Written once or twice a step: the keys made once, the packer's buffer reused.
        self._keys = (f"{self.prefix}/0", f"{self.prefix}/1")  # by label parity
        self._gradient_keys = (f"{self.prefix}/grad/0", f"{self.prefix}/grad/1")
        self._packer = msgpack.Packer(use_bin_type=True)
        self._provisional: tuple[int, bytes] | None = None  # (label, encoded state) of the last write, if provisional
        self._failed = False  # a write failed (reported once)

    def _set(self, key: str, value: bytes) -> None:
        try:
            self.store.set(key, value)
        except Exception as err:  # the store's host is gone
            if not self._failed:
                self._failed = True
                print(f"ftrun: could not write this rank's records to the job's store: {type(err).__name__}: {err}",
                      file=sys.stderr, flush=True)

    def put(self, label: int, state: dict[str, Any], provisional: bool = False, epoch_boundary: bool = False,
            mid_pass: bool = False, gradient: str | None = None) -> None:
        """Record ``state`` (``{name: state_dict}``) as the rank's state at committed step ``label``
        (``provisional``: taken at that step's all-reduce; ``epoch_boundary``: after an epoch's end;
        see :class:`RankRecord`). :meth:`put_encoded` has the rest.

        Raises:
            TypeError: a state the codec refuses (naming its place).
        """
        self.put_encoded(label, codec.to_record(state), provisional, epoch_boundary, mid_pass, gradient)

    def put_encoded(self, label: int, blob: bytes, provisional: bool = False, epoch_boundary: bool = False,
                    mid_pass: bool = False, gradient: str | None = None) -> None:
        """:meth:`put` of a state already encoded (``blob``: :func:`ftrun.common.codec.to_record` of
        ``{name: state_dict}``).

        ``mid_pass``: a step-start record inside a data pass (not its first step). When its state
        is, byte for byte, the provisional record of the same label written last, nothing is
        written: the two differ only in the flag, which a successor reads only at a pass's first
        step (:meth:`ftrun.rank.epochs.EpochLoop.epochs`). The common case: a step's end changes none of
        the rank's own state, so most steps write one record, not two.

        ``gradient``: the fingerprint of the rank's local gradient of step ``label``, when the
        record is made after it was computed (an epoch boundary's; :meth:`get_gradient_digest`
        reads it there first). A step's own fingerprint is written apart, once its last bucket
        has left (:meth:`put_gradient_digest`)."""
        last, self._provisional = self._provisional, (label, blob, gradient) if provisional else None
        if mid_pass and not provisional and not epoch_boundary and last is not None and last == (label, blob, gradient):
            self._provisional = last  # the store still holds it
            return
        doc = {"label": int(label), "state": blob, "provisional": bool(provisional), "epoch_boundary": bool(epoch_boundary)}
        if gradient is not None:
            doc["gradient"] = str(gradient)
        self._set(self._keys[label % 2], self._packer.pack(doc))

    def get(self, label: int) -> RankRecord | None:
        """The record of committed step ``label``, or None if there is none."""
        key = self._keys[label % 2]
        if not self.store.check([key]):
            return None
        doc = msgpack.unpackb(bytes(self.store.get(key)), raw=False)
        if int(doc["label"]) != label:
            return None
        return RankRecord(label, codec.from_record(doc["state"]), bool(doc["provisional"]), bool(doc["epoch_boundary"]))

    def put_gradient_digest(self, step: int, digest: str) -> None:
        """Record the digest of this rank's local gradient (before averaging) of ``step`` alone
        (written once the step's last bucket has left, while its all-reduce runs): the bytes
        of :func:`ftrun.common.codec.to_bytes` of ``{"step": step, "digest": digest}``, packed directly
        (a fixed shape)."""
        doc = {"skeleton": {"__d": [["step", int(step)], ["digest", str(digest)]]}, "data": []}
        self._set(self._gradient_keys[step % 2], self._packer.pack(doc))

    def get_gradient_digest(self, step: int) -> str | None:
        """The recorded local-gradient digest of ``step``, or None (never computed, or overwritten):
        the one the record labelled ``step`` carries, else the one recorded alone."""
        key = self._keys[step % 2]
        if self.store.check([key]):
            doc = msgpack.unpackb(bytes(self.store.get(key)), raw=False)
            if int(doc["label"]) == step and isinstance(doc.get("gradient"), str):
                return doc["gradient"]
        key = self._gradient_keys[step % 2]
        if not self.store.check([key]):
            return None
        doc = codec.from_bytes(bytes(self.store.get(key)))
        return str(doc["digest"]) if int(doc["step"]) == step else None
