"""The ranks' environment and their spawning, on whichever node each runs.

:func:`rank_environment` is torchrun's and msrun's contract plus ftrun's own variables (pure: the
job, the rank and where the job stands in, a mapping out). :class:`Spawning` has each node's agent
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
from ..spawner import SPARE_MODE_VAR, shared_dir_marker
from .ranks import Rank

if TYPE_CHECKING:
    from .core import Coordinator


def rank_environment(spec: JobSpec, r: Rank, *, attempt: int, generation: int, attempt_port: int, store_port: int,
                     control_addr: str, run_id: str, checkpoint_root: Path,
                     resume_from: ckpt.Manifest | None) -> dict[str, str]:
    """The variables of one rank's environment (the agent of its node adds them to that node's
    environment, with the job secret). No secret is in them: they travel in the spawn order.

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
    out = {
        # torchrun
        "RANK": str(r.rank),
        "LOCAL_RANK": str(r.local_rank),
        "WORLD_SIZE": str(spec.worker_num),
        "LOCAL_WORLD_SIZE": str(spec.local_worker_num),
        "GROUP_RANK": str(r.node),
        "GROUP_WORLD_SIZE": str(spec.nnodes),
        "ROLE_RANK": str(r.rank),
        "ROLE_WORLD_SIZE": str(spec.worker_num),
        "ROLE_NAME": spec.role,
        "MASTER_ADDR": spec.master_addr,
        "MASTER_PORT": str(attempt_port),
        "TORCHELASTIC_RESTART_COUNT": str(attempt),
        "TORCHELASTIC_MAX_RESTARTS": str(spec.max_restarts),
        "TORCHELASTIC_RUN_ID": run_id,
        "TORCHELASTIC_USE_AGENT_STORE": "True",
        # msrun
        "RANK_ID": str(r.rank),
        "RANK_SIZE": str(spec.worker_num),
        "MS_WORKER_NUM": str(spec.worker_num),
        "MS_LOCAL_WORKER": str(spec.local_worker_num),
        "MS_NODE_RANK": str(r.node),
        "MS_ROLE": "MS_WORKER",
        "MS_SCHED_HOST": spec.master_addr,
        "MS_SCHED_PORT": str(store_port),
        "DEVICE_ID": str(r.local_rank),
        # ftrun worker library
        "FTRUN_CONTROL_ADDR": control_addr,
        "FTRUN_INCARNATION": str(r.incarnation),
        "FTRUN_GENERATION": str(generation),
        "FTRUN_ATTEMPT": str(attempt),
        "FTRUN_HEARTBEAT_INTERVAL": str(spec.heartbeat_interval),
        "FTRUN_PG_TIMEOUT": str(spec.pg_timeout),
        "FTRUN_CLUSTER_TIME_OUT": str(spec.cluster_time_out),
        "FTRUN_ARF": "1" if spec.tft.arf else "0",
        "FTRUN_UCE": "1" if spec.tft.uce else "0",
        "FTRUN_TTP": "1" if spec.tft.ttp else "0",
        "FTRUN_RECOVERABLE_ERRORS": ",".join(spec.recoverable_errors),
        "FTRUN_ON_DIVERGENCE": spec.on_divergence,
        "FTRUN_CHECKPOINT_DIR": str(checkpoint_root),
        "FTRUN_SAVE_STEPS": str(spec.save_steps),
        "PYTHONUNBUFFERED": "1",
    }
    if resume_from is not None:
        out["FTRUN_RESUME_DIR"] = str(resume_from.directory)
        out["FTRUN_RESUME_STEP"] = str(resume_from.step)
    return out


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
        self._spares_sent = -1.0

    def rank_vars(self, r: Rank) -> dict[str, str]:
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
        job.members.spawn(r.node, (r.rank, r.incarnation, self.rank_vars(r), header, use_spare))

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
        """Keep spares on every node once a rank has said hello through the worker library
        (only such jobs use ARF; a spare imports while the ranks set up), never while a recovery
        runs (it would compete with the recovery for the CPU). Hot spares run the script's
        set-up: only once the ranks are past theirs."""
        job, spec = self.job, self.job.spec
        ranks = job.ranks.values()
        if not spec.tft.arf or spec.no_python or job.rounds.current is not None or not any(r.library for r in ranks):
            return
        hot = spec.hot_spares > 0
        if hot and not all(r.proc.step is not None or r.proc.state == RankState.SUCCEEDED for r in ranks):
            return
        now = job.clock()
        if self._spares_sent >= 0 and now - self._spares_sent < 1.0:
            return  # at most once a second: an agent refills what a promotion used
        self._spares_sent = now
        for node, agent in job.members.agents.items():
            model = next((r for r in ranks if r.node == node), None)
            if model is not None and agent.connected():
                model_vars = self.rank_vars(model)
                model_vars[SPARE_MODE_VAR] = "hot" if hot else "warm"
                agent.keep_spares(spec.hot_spares if hot else spec.warm_spares, model_vars)

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
        job.members.main_store.set("ftrun/control_addr", job.control_addr)
