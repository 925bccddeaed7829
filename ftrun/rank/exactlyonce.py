"""The exactly-once checks of one rank, and the records of its own state it keeps in the
job's store for a successor.

A run with faults must end bitwise equal to the run without. Two fingerprints check that, as it
happens (:mod:`ftrun.rank.digest`):

- *the local gradient*: at every synced backward pass the rank fingerprints its local gradient,
  keyed by (step, backward pass within the step: a GAN's step has three); a step computed again
  (a retried step, or the step a respawned rank's predecessor computed) must give the same, pass
  by pass. A difference means state outside what ftrun restores (an unregistered model or
  carried tensor, a module-level variable, a random generator of the script's own).
- *the replicas' parameters*: after a recovery's transfers every rank compares a fingerprint of
  the parameters of every registered model, and of their buffers that never changed (the others,
  BatchNorm's statistics, are each rank's own), with the lowest rank's of its replica group.

A difference is a ``divergence`` event; under ``--on_divergence fail`` the step is held back and
the coordinator stops the job. The rank records (:mod:`ftrun.rank.rankstate`) are this rank's own state
(kind ``rank``: a data position, RNG streams) at each step start, when each synced backward
starts and at each epoch boundary, kept in the store next to the gradient's fingerprint.
"""

from __future__ import annotations

import sys
import time
from typing import Any, Callable, Sequence

import torch
import torch.distributed as dist

from ftrun.errors import describe
from ftrun.common.contract import INITIAL
from ftrun.common.protocol import MsgType
from ftrun.rank.recovery import RankProgress, Recovery
from ftrun.rank.registry import StateRegistry
from ftrun.rank.sharding import LocalShards
from ftrun.rank.workerstate import WorkerState

DIVERGENCE_HOLD_S = 60.0  # how long a rank holding back a divergent step waits for the abort that stops the job


class ExactlyOnceChecks:
    """This rank's fingerprints, divergence reports and rank records.

    Args:
        progress: the step loop's progress (current step, committed step).
        registry: the registered state.
        recovery: the rank's recovery (its predecessor's gradient fingerprint and rank record).
        group: the training group (:class:`ftrun.rank.group.TrainingGroup`; its store keeps the records).
        state: the rank's :class:`ftrun.rank.workerstate.WorkerState` (whether it runs under ftrun).
        send: sends a message to the coordinator (``send(MsgType, **fields)``).
        poll_abort: ``poll_abort(timeout_s)``: True once an abort for a newer generation arrived.
        world_size: ranks in the job. seed: ``ftrun.init(seed=...)``.
        on_divergence: ``"warn"`` or ``"fail"``.
    """

    def __init__(self, progress: RankProgress, registry: StateRegistry, recovery: Recovery, group: Any,
                 state: WorkerState, send: Callable[..., None], poll_abort: Callable[[float], bool],
                 world_size: int, seed: int | None, on_divergence: str) -> None:
        self.progress = progress
        self.registry = registry
        self.recovery = recovery
        self.group = group
        self.state = state
        self.send = send
        self.poll_abort = poll_abort
        self.world_size = world_size
        self.seed = seed
        self.on_divergence = on_divergence
        self.divergences: list[tuple[int, str, str]] = []  # (step, check, reason)
        # The fingerprints of the local gradient of each synced backward pass of the current try
        # of a step: (step, generation it ran in, [fingerprint of pass 1, pass 2, ...]).
        self.computed: tuple[int, int, list[str]] | None = None
        # What the passes of the current step must give, if it was computed before:
        # (step, [fingerprints by pass], who computed them).
        self.expected: tuple[int, list[str], str] | None = None
        self.rank_states: Any = None  # ftrun.rank.rankstate.RankStateStore, once records are kept
        self._opened: tuple[int, int] = (0, 0)  # (the group's store_moves, the generation) when rank_states was made
        self.rank = -1
        self.attempt = 0
        self.device = torch.device("cpu")
        self.replica_group: list[int] = []

    def bind(self, rank: int, attempt: int, device: torch.device, replica_group: Sequence[int]) -> None:
        """Take the rank's identity (at start, or at a hot spare's promotion)."""
        self.rank, self.attempt, self.device, self.replica_group = rank, attempt, device, list(replica_group)

    # ------------------------------------------------------------------ rank records
    def keeps_rank_records(self, gradient: bool = False) -> bool:
        """Whether this rank's own state is worth a copy in the store: it runs under ftrun with
        peers, and holds rank state that per-step reseeding does not make up (a data position,
        or RNG streams when no ``seed`` was given). ``gradient``: for its gradient fingerprint,
        which is always kept."""
        if not (self.state.managed and self.world_size > 1 and self.progress.committed >= INITIAL):
            return False
        if not gradient and self.seed is not None and not self.registry.has_own_rank_state():
            return False
        # Opened again in each new generation: the job's store may have moved (a coordinator
        # takeover), and the buddy node may have been lost or replaced (ftrun.rank.rankstate).
        opened = (getattr(self.group, "store_moves", 0), self.progress.generation)
        if self.rank_states is None or self._opened != opened:
            from ftrun.rank.rankstate import open_rank_records

            self._opened = opened
            self.rank_states = open_rank_records(self.group, self.attempt, self.rank)
        return True

    def snapshot_step_start(self, mid_pass: bool = False) -> None:
        """Copy the state that work after the update changes (kinds ``replica`` and ``rank``) at the
        start of a step, labelled with the committed step it belongs to, and write this rank's
        record of it to the job's store (:class:`ftrun.rank.rankstate.RankStateStore`: a send, done
        when this returns). ``mid_pass``: not a data pass's first step
        (:meth:`ftrun.rank.rankstate.RankStateStore.put_encoded`)."""
        keep = self.keeps_rank_records()
        committed = self.progress.committed
        own = self.registry.snapshot_step_start(committed, encode_rank=keep)
        if keep and own is not None:
            # No gradient fingerprint: the step's own write keeps it (record_gradient), and a
            # record equal to the provisional one, flag aside, is then not written again.
            self.rank_states.put_encoded(committed, own, mid_pass=mid_pass)

    def _gradient_of(self, step: int) -> str | None:
        """The fingerprints of this rank's local gradient of ``step``'s passes, comma-separated,
        if it computed any: every record labelled ``step`` carries them, for a successor that
        recomputes the step."""
        computed = self.computed
        return ",".join(computed[2]) if computed is not None and computed[0] == step and computed[2] else None

    def record_provisional(self) -> None:
        """When the step's synced backward starts (its first gradient is ready; before any bucket
        leaves, and no peer can commit the step before this rank's last bucket arrives): write
        the rank state after its batch and forward, labelled with the step (what a respawned rank
        needs if its peers commit the step and this rank dies before its next step start): one
        write to the job's store. The backward changes no rank state, so this is the state at the
        all-reduce too; the local gradient's fingerprint follows in its own write once the last
        bucket has left (:meth:`record_gradient`). Also called by the optimizer wrapper's
        all-reduce of a model not given to ``wrap_model``, before its gradients leave.

        Raises:
            TypeError: a rank state the codec refuses (naming its place)."""
        step = self.progress.current_step
        if step is None:
            return
        if self.progress.committed == step - 1 and self.keeps_rank_records():
            self.rank_states.put(step, self.registry.record_state(), provisional=True)

    def record_gradient(self) -> None:
        """Right after the step's last bucket left, while its all-reduce runs (a moment this rank
        waits anyway): write the fingerprint of the step's local gradient, which
        :meth:`check_local_gradient` has just kept, for a successor that computes the step again
        (its peers did not commit it). Carried by the provisional record before, it
        made every rank wait for that record at the step's most expensive moment. A rank killed
        between its last bucket and this write leaves no fingerprint of the step: its successor's
        recomputation is then not checked (nothing is reported), never wrongly flagged."""
        step = self.progress.current_step
        if step is None:
            return
        gradient = self._gradient_of(step)
        if gradient is not None and self.keeps_rank_records(gradient=True):
            self.rank_states.put_gradient_digest(step, gradient)  # a failed write is reported there, once

    def record_epoch_boundary(self) -> None:
        """After an epoch's end, before the next epoch's prologue: this rank's own state, labelled
        with its committed step, for a successor that would start the next epoch (its predecessor's
        epoch end is then in it; :class:`ftrun.rank.rankstate.RankRecord`)."""
        if not self.keeps_rank_records():
            return
        committed = self.progress.committed
        self.rank_states.put(committed, self.registry.record_state(), epoch_boundary=True,
                             gradient=self._gradient_of(committed))

    def apply_rank_record(self) -> None:
        """Load the predecessor's record of this rank's own state, if a recovery fetched one and it
        is not applied yet (a respawned rank; :class:`ftrun.rank.rankstate.RankRecord`)."""
        record = self.recovery.take_rank_record()
        if record is not None:
            self.registry.load(record.state, kinds=("rank",))

    # ------------------------------------------------------------------ fingerprints
    def _passes(self) -> list[str]:
        """The fingerprints of the current try's passes so far (a list this rank appends to).
        A try is a step in one generation: a retried step runs after a recovery, in a newer one;
        the passes of its earlier try become what this try must give."""
        step, generation = self.progress.current_step, self.progress.generation
        computed = self.computed
        if computed is not None and computed[0] == step and computed[1] == generation:
            return computed[2]
        expected = self.expected if self.expected is not None and self.expected[0] == step else None
        if computed is not None and computed[0] == step and computed[2]:
            if expected is None or len(computed[2]) >= len(expected[1]):
                expected = (step, list(computed[2]), "its previous try")
        predecessor = self.recovery.predecessor_gradient
        if expected is None and predecessor is not None and predecessor[0] == step:
            expected = (step, predecessor[1].split(","), "its predecessor (the process this one replaced)")
        if predecessor is not None and step is not None and predecessor[0] <= step:
            self.recovery.predecessor_gradient = None
        self.expected = expected
        self.computed = (step, generation, [])  # type: ignore[arg-type]
        return self.computed[2]

    def expected_gradient(self) -> tuple[str, str] | None:
        """What the current step's next backward pass must give, if this rank or its predecessor
        computed that pass before: (fingerprint, who computed it: "its previous try" or "its
        predecessor")."""
        if self.progress.current_step is None:
            return None
        index = len(self._passes())
        expected = self.expected
        if expected is None or index >= len(expected[1]) or not expected[1][index]:
            return None  # never computed, or computed after an earlier pass of its try had failed
        return expected[1][index], expected[2]

    def holds_for_check(self) -> bool:
        """Whether the reducer must hold the pass's all-reduce until the local gradient is checked."""
        return self.on_divergence == "fail" and self.expected_gradient() is not None

    def check_local_gradient(self, digest: str) -> bool:
        """At each synced backward pass, before its last bucket leaves
        (:class:`ftrun.rank.reducer.GradientReducer`): keep the fingerprint of the pass's local
        gradient (in memory, and in the job's store once the last bucket has left,
        :meth:`record_gradient`, for a respawned successor) and, if the step was computed before,
        compare it with the same pass's. A difference means state outside what ftrun restores; it
        is reported (a ``divergence`` event). Passes are counted within a try of a step (each
        wrapped model's reducer is one pass: a backward through two models is two), so a second
        backward of a step is never taken for the step computed again. Returns False only under
        ``--on_divergence fail``: the pass is then held back (never communicated) until the
        coordinator's abort for the dying gasp arrives."""
        step = self.progress.current_step
        if step is None:
            return True
        expected = self.expected_gradient()
        passes = self._passes()
        if self.state.failed:
            # An earlier pass of this try failed: its all-reduce left the gradients this pass adds
            # to half averaged (DDP's bucket views accumulate), so this fingerprint means nothing.
            passes.append("")
            return True
        passes.append(digest)
        if expected is None or expected[0] == digest:
            return True
        reason = (f"step {step} computed again gave another local gradient in its backward pass {len(passes)} than "
                  f"{expected[1]} (fingerprint {digest[:12]} != {expected[0][:12]}): the script carries state ftrun does not "
                  "restore (a model or optimizer not given to ft.wrap_model / ft.wrap_optimizer, an unregistered "
                  "carried tensor, a module-level variable, a random generator of its own); register it (docs/porting.md)")
        return self.report_divergence(step, "gradient", reason)

    def report_divergence(self, step: int, check: str, reason: str, hold: bool = True) -> bool:
        """Tell the coordinator and the rank's log; under ``--on_divergence fail`` and with
        ``hold``, wait (up to :data:`DIVERGENCE_HOLD_S` s) for the abort that stops the job
        (returns False then). Without ``hold`` (inside a recovery) the coordinator's dying gasp
        aborts the rank at its next safe point."""
        self.divergences.append((step, check, reason))
        print(f"ftrun: rank {self.rank}: DIVERGENCE at step {step}: {reason}", file=sys.stderr, flush=True)
        self.send(MsgType.DIVERGENCE, step=int(step), check=check, reason=reason)
        if self.on_divergence != "fail" or not self.state.managed or not hold:
            return True
        deadline = time.monotonic() + DIVERGENCE_HOLD_S
        while not self.poll_abort(0.05) and time.monotonic() < deadline:
            pass
        return False

    def compare_replicas(self, step: int) -> bool:
        """After a recovery's transfers (:class:`ftrun.rank.recovery.Recovery`), on every rank of the new
        generation: all-gather fingerprints of the registered models' parameters (one per model;
        a sharded model's local shards, :class:`ftrun.rank.sharding.LocalShards`)
        and buffers (one per buffer, with whether it changed since the model was wrapped) and
        compare them with the lowest rank's of this rank's replica group; a difference (a transfer
        that went wrong, a replica that diverged) is reported as a ``divergence`` naming the model
        or buffer. A buffer is compared where it never changed on either rank (BatchNorm's
        statistics are each rank's own: :class:`ftrun.rank.transaction.ModuleBuffers`). False if the
        collective failed (the recovery then goes on as after a failed transfer)."""
        if self.world_size == 1:
            return True
        from ftrun.rank.digest import fingerprint

        names: list[str] = []
        words: list[int] = []  # per entry: two words of its fingerprint and a flag (1: compare it)

        def add(name: str, tensors: list[torch.Tensor], compare: bool) -> None:
            raw = bytes.fromhex(fingerprint(tensors))
            names.append(name)
            words.extend([int.from_bytes(raw[:8], "little", signed=True), int.from_bytes(raw[8:16], "little", signed=True),
                          int(compare)])

        buffers_of = {id(b.module): b for b in self.registry.module_buffers()}
        for name, module in self.registry.modules():
            add(f"{name} (parameters)", list(module.parameters()), True)
            buffers = buffers_of.get(id(module))
            if buffers is not None:
                constant = {n for n, _ in buffers.constant()}
                for bname, b in module.named_buffers():
                    add(f"{name}.{bname} (buffer)", [b], bname in constant)
        for name, obj in self.registry.items():
            if isinstance(obj, LocalShards):  # a sharded model: its replicas hold the same local shards
                add(f"{name} (local shards)", list(obj.state_dict().values()), True)
        mine = torch.tensor(words, dtype=torch.int64, device=self.device)
        gathered = [torch.zeros_like(mine) for _ in range(self.world_size)]
        failure = None
        try:
            dist.all_gather(gathered, mine)
        except Exception as err:
            failure = describe(err)
        if failure is not None:
            print(f"ftrun: rank {self.rank}: comparing parameters with its replicas failed: {failure}", file=sys.stderr, flush=True)
            return False
        reference = min(self.replica_group)
        if reference == self.rank:
            return True
        theirs = gathered[reference].view(-1, 3).tolist()
        differ = [name for name, a, b in zip(names, mine.view(-1, 3).tolist(), theirs) if a[2] and b[2] and a[:2] != b[:2]]
        if differ:
            self.report_divergence(step, "replica_parameters",
                                   f"after the recovery to step {step} its state differs from rank {reference}'s, a "
                                   f"replica's, in {', '.join(differ[:3])}{' ...' if len(differ) > 3 else ''} (a transfer "
                                   "that went wrong, or replicas that diverged before)", hold=False)
        return True
