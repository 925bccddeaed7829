"""A rank's own state (kind ``rank``: data position, RNG streams) kept off its process.

A respawned rank must continue with its predecessor's data position and random streams, which no
other rank holds (another rank's are different by construction). So each rank writes them to a
c10d TCPStore that outlives it, labelled with the committed step they belong to:

- at each step start, the state before the step (label: the step before, committed);
- provisionally when each synced backward pass of the step starts, before any of its gradients
  leaves, the state after its batch and its forward passes so far (label: the step itself; a
  backward changes no rank state). Each replaces the last: peers cannot commit the step before
  this rank's last pass has sent its gradients, so the record they commit against is that pass's. If peers commit that step and this rank dies before its next step start, the recovery
  step is that step, and this is its state; the next step start's record replaces it (only when
  it differs: most steps write one record).

The fingerprint of the step's local gradient is written apart (:meth:`RankStateStore.put_gradient_digest`),
right after the step's last bucket left, while its all-reduce runs.

Where the records go (:func:`open_rank_records`):

- **a multi-node job**: to the rank's own node's *record store* (a TCPStore its node's fork server
  hosts, or else its agent, on a port the launcher bound: ``FTRUN_RECORD_STORE``), and a copy to its
  *buddy's*, the next node's (node ``(n + 1) mod nodes``; where it listens the coordinator keeps in
  the job's store, ``ftrun/record_store/<node>``, and removes while that node is lost). No record
  goes through node 0 (unless node 0 is the rank's node or its buddy): its store's load grows with
  the nodes' count of membership changes, not with ranks times steps (a word_lm record, 18,912
  bytes, made 313.6 MB a step at node 0 at 16,384 ranks; ``docs/scale.md``). A node's loss keeps
  every record: its ranks' are at its buddy, its predecessor's ranks' own at home. A respawned
  rank reads its own node's store first (it is written first, so it is never older), then its
  buddy's (its node was replaced: the new one's store is empty). Losing a node and its buddy at
  once loses those ranks' records: their successors start from a fresh state and the
  exactly-once checks report the difference. The buddy is looked up again at each new
  generation (a replaced buddy listens elsewhere), so a record written before that lookup may
  have no copy at the replacement: it is still at home.
- **a single-node job**: to the job's store (node 0's, the only node).

Two slots per rank (label parity), so the record of the recovery step S and the one of S + 1
never overwrite each other. A respawned rank reads the slot of S and checks its label.

The writes are made on the training thread with its own store clients, and cost a send each: a
``TCPStore.set`` is one request with no reply (measured with torch 2.13: 11 us for an 8 KB
record, and 4 us a call with the store's process stopped), so nothing waits for the store's
process to be scheduled. Once ``set`` has returned, the record is in this host's socket buffer, in
order with the rank's earlier records, and reaches the store even if the rank is SIGKILLed right
after (its socket is closed gracefully by the kernel: the client has no unread reply that would
turn the close into a reset). The provisional record is the one peers may commit against: it is
written before the step's first gradient bucket leaves. (A background writer thread did this
before; on 2 busy cores, handing it each record cost more than the send: 3.4% of a rank's
training-thread time on word_lm's small steps, plus 1.8% waiting for it.)
"""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, Mapping, Sequence

import msgpack

from ftrun.common import codec, contract
from ftrun.common.contract import RANK_STATE_PREFIX

PREFIX = RANK_STATE_PREFIX
BUDDY_CONNECT_S = 10.0  # how long a rank waits to connect to its buddy's record store before it writes without a copy


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
        store: a ``torch.distributed.Store``: the rank's node's record store, or the job's store.
        attempt: the whole-job attempt (a restart starts with no records).
        rank: the global rank.
        copies: more stores every record also goes to, after ``store`` (the buddy node's record
            store); read after ``store``, in order.

    A failed write (the store gone with its host) is reported once on stderr and counts as
    done: the record is then missing, which costs a respawned successor its exact state (its
    exactly-once checks report the difference) rather than stopping a rank whose store is gone
    anyway (a standby coordinator that takes over hosts a new job store: the rank makes a new
    :class:`RankStateStore` on it). A copy whose write failed gets no more (its host is gone).
    """

    def __init__(self, store: Any, attempt: int, rank: int, copies: Sequence[Any] = ()) -> None:
        self.store = store
        self.stores = [store, *copies]  # written in this order, read in this order
        self.source: Any = None  # the store the last record read came from
        self.prefix = f"{PREFIX}/attempt{attempt}/rank{rank}"
        # Written once or twice a step: the keys made once, the packer's buffer reused.
        self._keys = (f"{self.prefix}/0", f"{self.prefix}/1")  # by label parity
        self._gradient_keys = (f"{self.prefix}/grad/0", f"{self.prefix}/grad/1")
        self._packer = msgpack.Packer(use_bin_type=True)
        self._provisional: tuple[int, bytes] | None = None  # (label, encoded state) of the last write, if provisional
        self._failed = False  # a write failed (reported once)

    def _set(self, key: str, value: bytes) -> None:
        for store in tuple(self.stores):
            try:
                store.set(key, value)
            except Exception as err:  # the store's host is gone
                if store is not self.store:
                    self.stores.remove(store)  # a copy (the buddy's): none more there
                    print(f"ftrun: could not write a copy of this rank's records to its buddy node: {type(err).__name__}: "
                          f"{err}; it writes without one", file=sys.stderr, flush=True)
                elif not self._failed:
                    self._failed = True
                    print(f"ftrun: could not write this rank's records: {type(err).__name__}: {err}", file=sys.stderr, flush=True)

    def _read(self, key: str, label: int) -> tuple[dict[str, Any], bytes] | None:
        """The first document under ``key`` labelled ``label``, store by store: (it decoded, its
        bytes); None if none.

        Raises:
            Exception: what the first store raised (its host is gone) when no later one holds it.
        """
        error: Exception | None = None
        for store in self.stores:
            try:
                if not store.check([key]):
                    continue
                raw = bytes(store.get(key))
            except Exception as err:  # noqa: BLE001  the next store may hold it
                error = error or err
                continue
            doc = msgpack.unpackb(raw, raw=False)
            if _label_of(doc) == label:
                self.source = store
                return doc, raw
        if error is not None:
            raise error
        return None

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
        """The record of committed step ``label``, or None if no store holds one."""
        found = self._read(self._keys[label % 2], label)
        if found is None:
            return None
        doc = found[0]
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
        found = self._read(self._keys[step % 2], step)
        if found is not None and isinstance(found[0].get("gradient"), str):
            return found[0]["gradient"]
        found = self._read(self._gradient_keys[step % 2], step)
        return None if found is None else str(codec.from_bytes(found[1])["digest"])


def _label_of(doc: dict[str, Any]) -> int:
    """The step a stored document is labelled with: a record's ``label``, a gradient digest's ``step``
    (:meth:`RankStateStore.put_gradient_digest`'s fixed shape)."""
    if "label" in doc:
        return int(doc["label"])
    return int(dict(doc["skeleton"]["__d"])["step"])


_clients: dict[str, Any] = {}  # record store clients by address (the training thread's own; made once)


def _connect(addr: str, timeout_s: float) -> Any:
    """A client of the record store at ``addr`` (``host:port``), made once per address."""
    client = _clients.get(addr)
    if client is None:
        import torch.distributed as dist

        host, _, port = addr.rpartition(":")
        client = dist.TCPStore(host, int(port), is_master=False, timeout=timedelta(seconds=timeout_s))
        _clients[addr] = client
    return client


def buddy_node(node: int, nnodes: int) -> int | None:
    """The node whose record store keeps a copy of node ``node``'s ranks' records: the next one,
    ``(node + 1) mod nnodes``; None in a single-node job."""
    return (node + 1) % nnodes if nnodes > 1 else None


def record_stores(job_store: Any, cluster_timeout: float, environ: Mapping[str, str] = os.environ,
                  connect: Callable[[str, float], Any] = _connect) -> tuple[Any, list[Any], list[int]]:
    """Where this rank's records go (see the module): (its store, the copies' stores, the remote
    ports of both, for the process group to leave alone). Without ``FTRUN_RECORD_STORE`` (a
    single-node job), or when its node's record store cannot be reached, the job's store
    (``job_store``) and no copy. A buddy that is lost (no address published), is this node's own
    store, or cannot be reached within :data:`BUDDY_CONNECT_S` gets no copy (said on stderr).

    Args:
        job_store: a client of the job's store (where the buddy's address is published).
        cluster_timeout: the operation timeout of the own node's client, seconds.
        environ: the rank's environment (``FTRUN_RECORD_STORE``, ``GROUP_RANK``, ``GROUP_WORLD_SIZE``).
        connect: makes a client of ``host:port`` with a timeout in seconds.
    """
    own = environ.get(contract.RECORD_STORE, "")
    if not own:
        return job_store, [], []
    try:
        store = connect(own, cluster_timeout)
    except Exception as err:  # noqa: BLE001  the job's store keeps them, as in a single-node job
        print(f"ftrun: cannot reach this node's record store at {own} ({type(err).__name__}: {err}); "
              "this rank's records go to the job's store", file=sys.stderr, flush=True)
        return job_store, [], []
    ports = [int(own.rpartition(":")[2])]
    buddy = buddy_node(int(environ.get("GROUP_RANK") or 0), int(environ.get("GROUP_WORLD_SIZE") or 1))
    if buddy is None:
        return store, [], ports
    key = contract.record_store_key(buddy)
    try:
        addr = job_store.get(key).decode() if job_store.check([key]) else ""
    except Exception:  # noqa: BLE001  the job's store is moving (a takeover): the next generation looks again
        addr = ""
    if not addr or addr == own:
        return store, [], ports
    try:
        copy = connect(addr, BUDDY_CONNECT_S)
    except Exception as err:  # noqa: BLE001  written without a copy until the next generation
        print(f"ftrun: cannot reach node {buddy}'s record store at {addr} ({type(err).__name__}: {err}); "
              "this rank's records have no copy there for now", file=sys.stderr, flush=True)
        return store, [], ports
    return store, [copy], ports + [int(addr.rpartition(":")[2])]


def open_rank_records(group: Any, attempt: int, rank: int) -> RankStateStore:
    """This rank's :class:`RankStateStore` on its record stores (:func:`record_stores`), whose
    connections its process group's release leaves alone (``group``: a
    :class:`ftrun.rank.group.TrainingGroup`)."""
    store, copies, ports = record_stores(group.store(), group.cluster_timeout)
    group.conns.keep_ports.update(ports)
    return RankStateStore(store, attempt, rank, copies)
