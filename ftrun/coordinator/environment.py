"""The ranks' environment and their spawning, on whichever node each runs.

:func:`rank_environment` is torchrun's and msrun's contract plus ftrun's own variables (pure: the
job, the rank and where the job stands in, a :class:`ftrun.contract.RankEnv` out). :class:`Spawning` has each node's agent
start a rank's next incarnation, keeps warm or hot spares on every node, and gives every whole-job
attempt its own c10d store (so a restarted job never meets a previous attempt's keys).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from .. import checkpoint as ckpt
from ..config import JobSpec
from ..events import EventKind
from ..policy import RankState
from ..contract import CONTROL_ADDR_KEY, RankEnv
from ..spawner import shared_dir_marker
from .ranks import Rank

if TYPE_CHECKING:
    from .core import Coordinator


def rank_environment(spec: JobSpec, r: Rank, *, attempt: int, generation: int, attempt_port: int, store_port: int,
                     control_addr: str, run_id: str, checkpoint_root: Path,
                     resume_from: ckpt.Manifest | None) -> RankEnv:
    """One rank's environment (:class:`ftrun.contract.RankEnv`; its ``to_environ()`` gives the
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
        self._spares_sent = 0.0
        self._spares_order: tuple[int, int, int] | None = None  # (warm, hot, standby_nodes) last sent to the agents

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
        rank's, the node's included)."""
        job, spec = self.job, self.job.spec
        ranks = job.ranks.values()
        if not spec.tft.arf or spec.no_python or job.rounds.current is not None or not any(r.library for r in ranks):
            return
        past_setup = all(r.proc.step is not None or r.proc.state == RankState.SUCCEEDED for r in ranks)
        hot = spec.hot_spares if past_setup else 0
        now = job.clock()
        standby_nodes = list(job.members.standby_nodes.values())
        if ((spec.warm_spares, hot, len(standby_nodes)) == self._spares_order and now - self._spares_sent < 1.0) or not (
                spec.warm_spares or spec.hot_spares or standby_nodes):
            return  # the same order at most once a second (an agent refills what a promotion used); a new one at once
        self._spares_sent, self._spares_order = now, (spec.warm_spares, hot, len(standby_nodes))
        for node, agent in job.members.agents.items():
            model = next((r for r in ranks if r.node == node), None)
            if model is not None and agent.connected() and (spec.warm_spares or spec.hot_spares):
                agent.keep_spares(spec.warm_spares, hot, self.rank_env(model).without_identity().to_environ())
        kind, model = spec.standby_spares, next((r for r in ranks if r.node == 1), None)
        if kind != "none" and model is not None:
            count = spec.local_worker_num
            model_vars = self.rank_env(model).without_identity().to_environ()
            for standby in standby_nodes:
                standby.keep_spares(count if kind == "warm" else 0, count if kind == "hot" else 0, model_vars)

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
        from ..stores import bind_host, serve_store  # imports torch: only a whole-job restart needs it

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
