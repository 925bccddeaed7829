"""Elastic jobs (``--nnodes MIN:MAX``): an absent node's ranks run on the nodes present, and go home when it joins.

torchrun's elastic agent answers a lost node by restarting every rank with a smaller world; TorchFT
goes on with the replica groups it has and the lost group's samples of each step are never trained.
Either way the run is another run: another global batch, or other samples, or other sums. ftrun
keeps the job's ranks (the world size, each rank's data shard and its share of the global batch)
and moves where they run. A node absent for ``--replace_timeout`` (lost with no standby node and no
replacement launcher; at the start, one not joined after :data:`START_SETTLE_S`, as torchrun's
rendezvous closes its last call) while ``MIN`` nodes or more are present has its
ranks started on those nodes, the least loaded first; each recovers from a replica as after any
rank's death (ARF), and the survivors keep their processes. When a launcher takes the node's index
again (a replacement, a standby node, a late node at the start), its ranks move back: their
processes elsewhere are stopped and respawned there, again from replicas, without spending the
restart budget. The same ranks train the same samples in the same order, so the run ends bitwise
equal to the fault-free one (EasyScale's logical workers, decoupled from the devices that run
them, give elastic jobs the same property). The cost: a node that hosts moved ranks runs more
processes than its own (on GPUs they share its devices, and each needs its memory there); steps
run at the pace of the busiest node. Below ``MIN`` nodes, the job ends after ``--replace_timeout``
with a dying-gasp checkpoint.

:func:`place` is the pure placement; :class:`Elastic` applies it for the coordinator.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ftrun.common.events import EventKind

START_SETTLE_S = 30.0  # a node not joined at the start is awaited this long at least (torchrun's last_call_timeout)

if TYPE_CHECKING:
    from ftrun.coordinator.core import Coordinator


@dataclass(frozen=True)
class Shrink:
    """``node`` has been absent for ``--replace_timeout`` with ``MIN`` nodes or more present: its
    ranks start on the others (``reason``: why it is absent, in words)."""

    node: int
    reason: str


def place(moving: Sequence[int], load: Mapping[int, int]) -> dict[int, int]:
    """Choose a present node for each of the ranks ``moving``: the node running the fewest ranks
    (``load``: node -> ranks it runs), the lowest index on a tie, counting each placement.

    Raises:
        ValueError: no node is present.
    """
    if not load:
        raise ValueError("no node is present to run the ranks")
    counts = dict(load)
    placed = {}
    for rank in sorted(moving):
        node = min(counts, key=lambda n: (counts[n], n))
        placed[rank] = node
        counts[node] += 1
    return placed


class Elastic:
    """Where an absent node's ranks run (module docstring).

    Attributes:
        moved: absent node -> its ranks, running on other nodes until it joins.
        going_home: rank -> its node, while its process on another node is being stopped.
    """

    def __init__(self, job: "Coordinator") -> None:
        self.job = job
        self.moved: dict[int, list[int]] = {}
        self.going_home: dict[int, int] = {}

    @property
    def on(self) -> bool:
        """The job may go on with fewer nodes: ``--nnodes MIN:MAX`` with MIN < MAX, ARF on, and a
        ``--replace_timeout``."""
        spec = self.job.spec
        return 0 < spec.min_nodes < spec.nnodes and spec.replace_timeout > 0 and spec.tft.arf

    def status(self) -> dict[str, Any]:
        """For ``ftrun status`` (an elastic job only): the nodes present, and the ranks run away from
        their absent node (node -> ranks)."""
        if not self.on:
            return {}
        return {"nodes_present": len(self.job.members.agents), "moved_ranks": {str(k): v for k, v in self.moved.items()}}

    def wait_for(self, lost: bool) -> float:
        """Seconds an absent node is awaited before its ranks run elsewhere: ``--replace_timeout``
        for a lost node; at the start, at least :data:`START_SETTLE_S` (launchers start seconds apart)."""
        spec = self.job.spec
        return spec.replace_timeout if lost else max(spec.replace_timeout, START_SETTLE_S)

    def shrink(self, found: Shrink) -> None:
        """Start ``found.node``'s ranks on the present nodes (their spawn orders, kept for the
        node, go there instead)."""
        job = self.job
        load = {node: 0 for node in job.members.agents}
        for r in job.ranks.values():
            if r.node in load:
                load[r.node] += 1
        ranks = sorted(r.rank for r in job.ranks.values() if r.node == found.node)
        target = place(ranks, load)
        self.moved[found.node] = ranks
        orders = {order[0]: order for order in job.members.pending_spawns.pop(found.node, [])}
        for rank in ranks:
            r = job.ranks[rank]
            guests = sum(1 for x in job.ranks.values() if x.node == target[rank] and x.local_rank >= job.spec.local_worker_num)
            r.node, r.local_rank = target[rank], job.spec.local_worker_num + guests
            order = orders.get(rank)
            if order is not None:
                r.proc.started_at = job.clock()  # its set-up time counts from now
                self._spawn_again(rank, order)
        present = len(load)
        job.emit(EventKind.JOB_SHRUNK,
                 f"{found.reason}: its rank(s) {ranks} run on node(s) {sorted(set(target.values()))} until it joins; "
                 f"the job goes on with "
                 f"{present} of {job.spec.nnodes} nodes, the same {job.spec.worker_num} ranks and global batch",
                 node_absent=found.node, ranks=ranks, placed={str(k): v for k, v in target.items()}, nodes=present)

    def on_joined(self, node: int) -> None:
        """``node``'s agent joined: its ranks that run elsewhere move back (stopped there, then
        respawned here from replicas by :meth:`home`); ranks not started yet start here."""
        job = self.job
        ranks = self.moved.pop(node, None)
        if ranks is None:
            return
        stopping = []
        for rank in ranks:
            r = job.ranks[rank]
            host = job.members.agents.get(r.node)
            if r.proc.running and host is not None:
                self.going_home[rank] = node
                r.proc.kill_reason = f"moving back to node {node}, which joined again"
                r.proc.hung_since = job.clock()
                host.signal(rank, r.incarnation, signal.SIGKILL)
                stopping.append(rank)
                continue
            kept = job.members.pending_spawns.get(r.node, [])
            order = next((o for o in kept if o[0] == rank), None)
            self._set_home(rank, node)
            if order is not None:
                kept.remove(order)
                self._spawn_again(rank, order)
        job.emit(EventKind.JOB_GROWN,
                 f"node {node} joined: its rank(s) {ranks} move back to it"
                 + (f" (rank(s) {stopping} stopped where they ran, then respawned there from replicas)" if stopping else "")
                 + f"; the job runs on {len(job.members.agents)} of {job.spec.nnodes} nodes",
                 node_joined=node, ranks=ranks, nodes=len(job.members.agents))

    def home(self, failed: Sequence[int]) -> bool:
        """The ranks ``failed`` are all ranks stopped to move home (:meth:`on_joined`): they now
        belong to their node again, and the caller respawns them there (no restart is spent).
        Returns whether that is the case."""
        if not failed or any(rank not in self.going_home for rank in failed):
            return False
        for rank in failed:
            self._set_home(rank, self.going_home.pop(rank))
        return True

    def _spawn_again(self, rank: int, order: tuple) -> None:
        """Send a spawn order kept for ``rank`` to the node it now runs on, its environment made
        again for that node (its node index and local rank there)."""
        r = self.job.ranks[rank]
        _rank, incarnation, _vars, header, use_spare = order
        self.job.members.spawn(r.node, (rank, incarnation, self.job.spawning.rank_env(r).to_environ(), header, use_spare))

    def _set_home(self, rank: int, node: int) -> None:
        r = self.job.ranks[rank]
        r.node, r.local_rank = node, rank - node * self.job.spec.local_worker_num
