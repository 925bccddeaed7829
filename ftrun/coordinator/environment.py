"""The ranks' environment and their spawning, on whichever node each runs.

:func:`rank_environment` is torchrun's and msrun's contract plus ftrun's own variables (pure: the
job, the rank and where the job stands in, a :class:`ftrun.common.contract.RankEnv` out). :class:`Spawning` has each node's agent
start a rank's next incarnation, keeps warm or hot spares on every node, and gives every whole-job
attempt its own c10d store (so a restarted job never meets a previous attempt's keys).
"""

from __future__ import annotations

import dataclasses
import os
import time
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ftrun.common import checkpoint as ckpt
from ftrun.config import JobSpec
from ftrun.common.events import EventKind
from ftrun.coordinator.policy import RankState
from ftrun.common.contract import CONTROL_ADDR_KEY, RECORD_STORE, RankEnv
from ftrun.node.spawner import shared_dir_marker
from ftrun.coordinator.ranks import Rank

if TYPE_CHECKING:
    from ftrun.coordinator.agents import AgentHandle
    from ftrun.coordinator.core import Coordinator


def rank_environment(spec: JobSpec, r: Rank, *, attempt: int, generation: int, attempt_port: int, store_port: int,
                     control_addr: str, run_id: str, checkpoint_root: Path,
                     resume_from: ckpt.Manifest | None) -> RankEnv:
    """One rank's environment (:class:`ftrun.common.contract.RankEnv`; its ``to_environ()`` gives the
    variables the agent of its node adds to that node's environment, with the job secret). No
    secret is in it: it travels in the spawn order.

    Args:
        spec: the job.
        r: the rank (its incarnation is the one being started).
        attempt: the whole-job attempt (torchrun's restart count).
        generation: the recovery generation the rank starts in.
        attempt_port: the port of this attempt's store (``MASTER_PORT``).
        store_port: the launcher's store port (msrun's scheduler port).
        control_addr: the coordinator's control plane address.
        run_id: torchrun's run id.
        checkpoint_root: ``--checkpoint_dir``, resolved.
        resume_from: the checkpoint this attempt starts from, if any.
    """
    return RankEnv(
        rank=r.rank, local_rank=r.local_rank, incarnation=r.incarnation, generation=generation,
        world_size=spec.worker_num, local_world_size=spec.local_worker_num, role=spec.role, node=r.node,
        nnodes=spec.nnodes, master_addr=spec.master_addr, master_port=attempt_port, attempt=attempt,
        max_restarts=spec.max_restarts, run_id=run_id, store_port=store_port, control_addr=control_addr,
        heartbeat_interval=spec.heartbeat_interval, pg_timeout=spec.pg_timeout, cluster_time_out=spec.cluster_time_out,
        arf=spec.tft.arf, uce=spec.tft.uce, ttp=spec.tft.ttp, recoverable_errors=tuple(spec.recoverable_errors),
        on_divergence=spec.on_divergence, checkpoint_dir=str(checkpoint_root), save_steps=spec.save_steps,
        resume_dir=str(resume_from.directory) if resume_from is not None else None,
        resume_step=resume_from.step if resume_from is not None else None,
    )


SPARES_CHECK_S = 1.0  # how often the agents' spares orders are looked at when nothing changed, seconds
# An unchanged order is sent again this often, seconds: a node's agent looks at its spares only when
# it gets an order (it replaces those that died, and finds a hot spare that failed in its set-up).
SPARES_REFRESH_S = 1.0
# ... both once per this many nodes a second in a larger job (2,048 nodes: every 10 s): an order
# costs about 180 µs of the coordinator's CPU (a rank's environment, built, encoded and sent), so
# once a second to 2,048 agents was a third of a core (docs/scale.md).
SPARES_NODES_PER_S = 200


def spares_period(base: float, nodes: int) -> float:
    """Seconds between two looks at (or refreshes of) the agents' spares orders for ``nodes`` nodes."""
    return max(base, nodes / SPARES_NODES_PER_S)


@dataclass(frozen=True)
class SparesOrder:
    """The last spares order sent to one agent: to whom, the counts, the spares' environment
    (:meth:`ftrun.common.contract.RankEnv.without_identity`) and when (monotonic seconds)."""

    agent: "AgentHandle"
    warm: int
    hot: int
    env: RankEnv
    sent_at: float
    base: RankEnv | None = None  # the environment it was made from, on any node (Spawning._order_spares)


class Spawning:
    """Starts ranks through their nodes' agents and keeps spares; hosts each attempt's store.

    Args:
        job: the coordinator (its spec, clock, rank table, membership, checkpoints and events).
        store_port: the port of the launcher's store (attempt 0's ``MASTER_PORT``).
    """

    def __init__(self, job: "Coordinator", store_port: int) -> None:
        self.job = job
        self.store_port = store_port
        self.attempt_port = store_port
        self.attempt_store: Any = None
        self.run_id = ""
        self._spares_checked = 0.0
        self._spares_key: tuple[int, int, int] | None = None  # (warm, hot, standby nodes) at the last check
        self._spares_kept: dict[int | bytes, SparesOrder] = {}  # node index (standby: its identity) -> last order sent
        self._setup_witness: Rank | None = None  # a rank still in its set-up when last looked at
        self._past_setup_at: tuple[int, ...] | None = None  # (attempt, generation, restarts, ranks) when every rank was past it

    def rank_env(self, r: Rank) -> RankEnv:
        """:func:`rank_environment` for ``r`` where the job stands now."""
        job = self.job
        return rank_environment(job.spec, r, attempt=job.attempt, generation=job.generation, attempt_port=self.attempt_port,
                                store_port=self.store_port, control_addr=job.control_addr, run_id=self.run_id,
                                checkpoint_root=job.ttp.root, resume_from=job.ttp.resume_from)

    def spawn(self, r: Rank, use_spare: bool = False) -> None:
        """Have the agent of ``r``'s node start its next incarnation (in a spare if ``use_spare``
        and one is idle there). The ``rank_started`` event follows the agent's report."""
        job = self.job
        r.respawned(job.clock())  # r.library stays: a respawned rank runs the same script as before
        header = (
            f"===== ftrun: rank {r.rank} incarnation {r.incarnation} attempt {job.attempt} "
            f"generation {job.generation} started {time.strftime('%Y-%m-%d %H:%M:%S')} =====\n"
        )
        job.members.spawn(r.node, (r.rank, r.incarnation, self.rank_env(r).to_environ(), header, use_spare))

    def on_spawned(self, r: Rank, pid: int, spare: str) -> None:
        job = self.job
        if r.proc.pid is None:
            r.proc.pid = pid
        if spare:  # the node used a spare: its next spares order refills it, whatever changed
            self._spares_kept.pop(r.node, None)
        job.emit(
            EventKind.RANK_STARTED,
            f"rank {r.rank} started (pid {pid}, incarnation {r.incarnation}{f', in a {spare} spare' if spare else ''}"
            f"{f', node {r.node}' if job.spec.nnodes > 1 else ''})",
            rank=r.rank, pid=pid, log=str(job.log_dir / f"worker_{r.rank}.log"), warm_spare=spare == "warm",
            hot_spare=spare == "hot", node=r.node,
        )

    def start_attempt(self) -> None:
        """Start every rank of a new whole-job attempt, on its store, from its checkpoint."""
        job = self.job
        self.attempt_port = self._attempt_store_port()
        job.ttp.choose(job.attempt)
        for r in job.ranks.values():
            self.spawn(r)

    def keep_spares(self) -> None:
        """Keep spares on every node once a rank has said hello through the worker library (only
        such jobs use ARF), never while a recovery runs (it would compete with the recovery for the
        CPU): ``--warm_spares`` warm ones from then on (a warm spare imports while the ranks set
        up), and ``--hot_spares`` hot ones beside them once the ranks are past their set-up (a hot
        spare runs the script's set-up). Both kinds together: a fault before a hot spare is ready,
        or right after one was promoted, still finds a spare.

        Each standby node keeps one spare per local rank (``--standby_spares``: hot, warm or none)
        from its hello on, past-set-up or not (it is another host: it competes with no rank for
        the CPU), modelled on node 1's first rank (a spare has no identity; its promotion gives the
        rank's, the node's included).

        An agent is sent an order (:meth:`_order_spares`) when what its node should keep changes,
        when it is new (a joined, replacement or standby node; every agent after a takeover), after
        its node used a spare (the order refills it), and otherwise every :data:`SPARES_REFRESH_S`
        (:func:`spares_period`: longer in a job of more than :data:`SPARES_NODES_PER_S` nodes)
        (the agent then replaces spares that died on their own, and finds a hot spare that failed
        in its set-up). Called on every pass of the main loop: a pass
        costs a look at one rank still in its set-up (every rank's step once they are past it); the
        agents are looked at once every :data:`SPARES_CHECK_S`, or at once when the counts change."""
        job, spec = self.job, self.job.spec
        ranks = job.ranks.values()
        if not spec.tft.arf or spec.no_python or job.rounds.current is not None or not any(r.library for r in ranks):
            return
        standby_nodes = job.members.standby_nodes
        if not (spec.warm_spares or spec.hot_spares or standby_nodes):
            return
        hot = spec.hot_spares if self._past_setup() else 0
        now = job.clock()
        key = (spec.warm_spares, hot, len(standby_nodes))
        if key == self._spares_key and now - self._spares_checked < spares_period(SPARES_CHECK_S, spec.nnodes):
            return
        self._spares_checked, self._spares_key = now, key
        models: dict[int, Rank] = {}  # node -> its first rank in the table (the model of its spares)
        for r in ranks:
            models.setdefault(r.node, r)
        # A spare's environment differs from node to node by its node alone: made once a look
        # (2,048 nodes: making each node's whole cost a third of a core once a second).
        base = self.rank_env(next(iter(models.values()))).without_identity() if models else None
        if spec.warm_spares or spec.hot_spares:
            for node, agent in job.members.agents.items():
                model = models.get(node)
                if model is None or not agent.connected():
                    self._spares_kept.pop(node, None)  # a reconnected agent gets its order again
                    continue
                self._order_spares(node, agent, spec.warm_spares, hot, model, now, base)
        kind, model = spec.standby_spares, models.get(1)
        if kind != "none" and model is not None:
            count = spec.local_worker_num
            for identity, standby in standby_nodes.items():
                self._order_spares(identity, standby, count if kind == "warm" else 0, count if kind == "hot" else 0, model, now,
                                   base)

    def _past_setup(self) -> bool:
        """Whether every rank is past its set-up (it reported a step, or succeeded). While one is
        not, it is remembered and looked at alone on the next call."""
        def in_setup(r: Rank) -> bool:
            return r.proc.step is None and r.proc.state != RankState.SUCCEEDED

        job, witness = self.job, self._setup_witness
        if witness is not None and job.ranks.get(witness.rank) is witness and in_setup(witness):
            return False
        # Once every rank was past it, no walk until a rank is started again (a respawn, a restart, a new generation).
        started = (job.attempt, job.generation, job.restarts_used, len(job.ranks))
        if witness is None and self._past_setup_at == started:
            return True
        self._setup_witness = next((r for r in job.ranks.values() if in_setup(r)), None)
        self._past_setup_at = started if self._setup_witness is None else None
        return self._setup_witness is None

    def _order_spares(self, key: int | bytes, agent: "AgentHandle", warm: int, hot: int, model: Rank, now: float,
                      base: RankEnv | None = None) -> None:
        """Send ``agent`` (kept under ``key``: its node, or a standby's identity) the order to keep
        ``warm`` and ``hot`` spares modelled on rank ``model`` unless it was sent that order
        less than :data:`SPARES_REFRESH_S` ago. ``base``: a spare's environment on any node
        (:meth:`ftrun.common.contract.RankEnv.without_identity`), when the caller made it."""
        if base is None:
            base = self.rank_env(model).without_identity()
        last = self._spares_kept.get(key)
        if (last is not None and last.agent is agent and (last.warm, last.hot, last.env.node) == (warm, hot, model.node)
                and last.base == base and now - last.sent_at < spares_period(SPARES_REFRESH_S, self.job.spec.nnodes)):
            return
        env = dataclasses.replace(base, node=model.node)
        agent.keep_spares(warm, hot, env.to_environ())
        self._spares_kept[key] = SparesOrder(agent, warm, hot, env, now, base)

    def _attempt_store_port(self) -> int:
        """The port of the store this attempt's ranks rendezvous on (their MASTER_PORT).

        Attempt 0 uses the launcher's store on ``--master_port``, as a torchrun user expects. Every
        later attempt gets a fresh store, hosted here on node 0 (the ranks of every node get its
        port in their variables), because an unmodified ``env://`` script would otherwise meet the
        keys of the attempt before it (the stale-address failure of torchrun's shared store).
        """
        job = self.job
        if job.attempt == 0:
            return self.store_port
        from ftrun.common.stores import bind_host, serve_store  # imports torch: only a whole-job restart needs it

        self.attempt_store = None  # release the previous attempt's store first
        self.attempt_store, port = serve_store(bind_host(job.spec.master_addr, job.spec.nnodes), 0, job.spec.cluster_time_out)
        return port

    def publish_control_addr(self) -> None:
        """Tell the other nodes' launchers where the control plane is, through the launcher's store
        (the address is no secret: every frame on it is authenticated). First, leave a marker in
        the checkpoint directory that each agent looks for (multi-node TTP needs one directory that
        every node sees)."""
        job, spec = self.job, self.job.spec
        if spec.nnodes == 1:
            return
        if spec.tft.ttp:
            try:
                job.ttp.root.mkdir(parents=True, exist_ok=True)
                (job.ttp.root / shared_dir_marker(job.control_addr, job.token)).write_text("ftrun\n")
            except OSError as err:
                job.emit(EventKind.WARNING, f"cannot write to --checkpoint_dir {job.ttp.root}: {err}")
        from datetime import timedelta

        from torch.distributed import TCPStore

        job.members.main_store = TCPStore(spec.master_addr, self.store_port, is_master=False,
                                          timeout=timedelta(seconds=spec.cluster_time_out))
        job.members.main_store.set(CONTROL_ADDR_KEY, job.control_addr)
        job.members.publish_record_store(spec.node_rank, os.environ.get(RECORD_STORE, ""))  # this node's
