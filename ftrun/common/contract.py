"""What passes between the launcher, a node's agent and a rank: the rank's environment and the
c10d store's key names (no torch here: the control side imports this module).

A rank learns who it is and how the job runs from its environment only: torchrun's variables
(``RANK``, ``LOCAL_RANK``, ``WORLD_SIZE``, ``MASTER_ADDR``...), msrun's (``RANK_ID``,
``MS_WORKER_NUM``...) and ftrun's own (``FTRUN_*``). :class:`RankEnv` is that environment as one
frozen value: the coordinator builds one per rank (:meth:`RankEnv.to_environ` gives the variables
its node's agent adds to the node's environment), and the worker library reads its own with
:meth:`RankEnv.from_environ`. The defaults here are what a rank assumes when a variable is absent
(a script started by plain ``torchrun``, or by no launcher at all).

Spares carry no rank identity (:data:`IDENTITY_VARS`) until their promotion: the agent drops
those variables from a spare's environment and hands them over on its standard input
(:mod:`ftrun.rank.spare`), so a process listing (``ps e``, ``/proc/<pid>/environ``) never shows two
processes with one ``RANK``.

The store keys (:data:`CONTROL_ADDR_KEY` and the others) are the names under which the launcher,
the coordinator and the ranks meet in the job's c10d store (hosted by node 0's launcher, or for it by
node 0's fork server: :func:`ftrun.node.launcher.store_in_fork_server`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Mapping

# ----------------------------------------------------------------------------- variable names
INITIAL = -1  # committed step of a rank holding the synchronised initial state (no update applied)
NO_STATE = -2  # committed step of a rank holding no usable state

RANK = "RANK"
LOCAL_RANK = "LOCAL_RANK"
WORLD_SIZE = "WORLD_SIZE"
MASTER_ADDR = "MASTER_ADDR"
MASTER_PORT = "MASTER_PORT"
INCARNATION = "FTRUN_INCARNATION"
GENERATION = "FTRUN_GENERATION"
ATTEMPT = "FTRUN_ATTEMPT"
RESTART_COUNT = "TORCHELASTIC_RESTART_COUNT"  # torchrun's name of the attempt (read when FTRUN_ATTEMPT is absent)
CONTROL_ADDR = "FTRUN_CONTROL_ADDR"
RECORD_STORE = "FTRUN_RECORD_STORE"  # this node's store of its ranks' records, host:port (launcher -> agent -> rank; ftrun.rank.rankstate)
RELAY_ADDR = "FTRUN_RELAY_ADDR"  # the node agent's heartbeat relay (agent -> rank; ftrun.node.relay)
STANDBY_LINE = "FTRUN_STANDBY_LINE"  # the standby coordinators' endpoints, first first, comma-separated (agent -> rank)
TOKEN = "FTRUN_TOKEN"  # the job secret (set by the rank's node agent, never sent over the network)
FAULT = "FTRUN_FAULT"  # fault injection (tests, ftrun check): see ftrun.common.faults
CHECK_TRACE = "FTRUN_CHECK_TRACE"  # ftrun check: where the rank writes its trace
RESUME_DIR = "FTRUN_RESUME_DIR"
RESUME_STEP = "FTRUN_RESUME_STEP"
ERROR_FILE = "TORCHELASTIC_ERROR_FILE"  # torchrun's contract: where @record writes an uncaught exception
HOT_SPARE = "FTRUN_HOT_SPARE"  # "1" in a hot spare's environment until it is promoted
SPARE_READY = "FTRUN_SPARE_READY"  # the file a hot spare creates once it waits for its rank
SPARE_JOB = "FTRUN_SPARE_JOB"  # a hot spare's script (JSON: argv, module, cwd)
DYNAMO_FLAG = "--with_dynamo"  # a spare's or fork server's argument: import torch._dynamo in advance too
STORE_FD_FLAG = "--store_fd"  # the fork server's: host the rendezvous store on this inherited listening socket
STORE_TIMEOUT_FLAG = "--store_timeout"  # the fork server's: that store's operation timeout, seconds
PREVIOUS_PID = "FTRUN_PREVIOUS_PID"  # a respawned rank's predecessor (agent -> rank: its GPU memory is waited for)

#: What names a rank: absent from a spare's environment (hot or warm) until its promotion gives them.
IDENTITY_VARS = ("RANK", "LOCAL_RANK", "ROLE_RANK", "RANK_ID", "DEVICE_ID", INCARNATION, GENERATION, ERROR_FILE)
#: The last variable of a spare's environment: room in its initial environment block (what
#: ``/proc/<pid>/environ`` and ``ps e`` show) that its promotion overwrites with the rank's identity
#: (:func:`ftrun.rank.promotion.show_identity`).
IDENTITY_PAD = "FTRUN_IDENTITY_PAD"
IDENTITY_PAD_BYTES = 1024

#: The node index a standby launcher's agent says hello with (a launcher that came after every node had
#: its index): it has no node until the coordinator hands it a lost one (``take_node``).
STANDBY_NODE_INDEX = -1

# ----------------------------------------------------------------------------- c10d store keys
CONTROL_ADDR_KEY = "ftrun/control_addr"  # the coordinator's control address (coordinator -> launchers)
VACANT_KEY = "ftrun/vacant"  # nodes the coordinator waits for, comma-separated (coordinator -> launchers)
NEXT_NODE_KEY = "ftrun/next_node"  # a counter handing node indices to launchers without --node_rank
RANK_STATE_PREFIX = "ftrun/rank_state"  # each rank's own state for its successor (ftrun.rank.rankstate)
JOINED_KEY = "joined/{rank}"  # under a generation's prefix: the incarnation that joined it


def record_store_key(node: int) -> str:
    """Where node ``node``'s record store listens, ``host:port`` (coordinator -> ranks; absent while
    the node is lost: :mod:`ftrun.rank.rankstate`)."""
    return f"ftrun/record_store/{node}"


def node_key(node: int) -> str:
    """Who holds node index ``node`` (launchers without ``--node_rank``)."""
    return f"ftrun/node/{node}"


def claim_epoch_key(node: int) -> str:
    return f"ftrun/claim_epoch/{node}"


def claim_key(node: int, epoch: int) -> str:
    return f"ftrun/claim/{node}/{epoch}"


def generation_prefix(attempt: int, generation: int) -> str:
    """The prefix of one generation's process-group store (ftrun.rank.group)."""
    return f"ftrun/attempt{attempt}/gen{generation}/"


def _int(environ: Mapping[str, str], name: str, default: int | None) -> int | None:
    value = environ.get(name)
    return int(value) if value not in (None, "") else default


def _flag(environ: Mapping[str, str], name: str, default: bool) -> bool:
    value = environ.get(name)
    return default if value is None else value == "1"


@dataclass(frozen=True)
class RankEnv:
    """One rank's environment: torchrun's, msrun's and ftrun's contract.

    Identity (None in a spare until its promotion; :data:`IDENTITY_VARS`):
        rank, local_rank: ``RANK`` (also ``ROLE_RANK``, ``RANK_ID``), ``LOCAL_RANK`` (``DEVICE_ID``).
        incarnation: which process serving this rank (0 = the first).
        generation: the process group's generation the rank joins.

    The job (every rank alike):
        world_size, local_world_size, node, nnodes: ``WORLD_SIZE``, ``LOCAL_WORLD_SIZE``,
            ``GROUP_RANK``, ``GROUP_WORLD_SIZE``.
        role: torchrun's ``ROLE_NAME`` (``--role``).
        master_addr, master_port: the c10d store of the current attempt.
        attempt, max_restarts, run_id: torchelastic's restart count, its limit, the run's id.
        store_port: the store's port as msrun's ``MS_SCHED_PORT``.
        control_addr: the coordinator's ZeroMQ address (None: not under ftrun).
        heartbeat_interval, pg_timeout, cluster_time_out: seconds.
        arf, uce, ttp: ``--tft`` switches. recoverable_errors: ``--recoverable_errors``.
        on_divergence: ``warn`` or ``fail``. checkpoint_dir, save_steps: TTP's checkpoints.
        resume_dir, resume_step: the checkpoint to start from, if any.

    Set by the rank's node agent or by the user, not by the coordinator:
        token, fault, check_trace, error_file, hot_spare, spare_ready.
    """

    rank: int | None = None
    local_rank: int | None = None
    incarnation: int | None = None
    generation: int | None = None
    world_size: int = 1
    local_world_size: int = 1
    role: str = "default"
    node: int = 0
    nnodes: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int | None = None
    attempt: int = 0
    max_restarts: int = 0
    run_id: str = ""
    store_port: int | None = None
    control_addr: str | None = None
    heartbeat_interval: float = 1.0
    pg_timeout: float = 300.0
    cluster_time_out: float = 600.0
    arf: bool = True
    uce: bool = True
    ttp: bool = True
    recoverable_errors: tuple[str, ...] = ()
    on_divergence: str = "warn"
    checkpoint_dir: str | None = None
    save_steps: int = 0
    resume_dir: str | None = None
    resume_step: int | None = None
    token: str | None = None
    fault: str = ""
    check_trace: str | None = None
    error_file: str | None = None
    hot_spare: bool = False
    spare_ready: str | None = None

    @property
    def has_identity(self) -> bool:
        """Whether it names a rank (a spare's does not, until its promotion)."""
        return self.rank is not None

    def without_identity(self) -> "RankEnv":
        """The same job's environment with no rank in it (what a spare starts with)."""
        return dataclasses.replace(self, rank=None, local_rank=None, incarnation=None, generation=None,
                                   error_file=None)

    def to_environ(self) -> dict[str, str]:
        """The variables, as strings: every name the coordinator's ranks have always had (torchrun's,
        msrun's, ftrun's); identity variables only when there is an identity, the optional ones
        (resume, token, fault, trace, error file, spare markers) only when set."""
        out: dict[str, str] = {}
        if self.rank is not None:
            out.update({"RANK": str(self.rank), "ROLE_RANK": str(self.rank), "RANK_ID": str(self.rank)})
        if self.local_rank is not None:
            out.update({"LOCAL_RANK": str(self.local_rank), "DEVICE_ID": str(self.local_rank)})
        out.update({
            # torchrun
            WORLD_SIZE: str(self.world_size),
            "LOCAL_WORLD_SIZE": str(self.local_world_size),
            "GROUP_RANK": str(self.node),
            "GROUP_WORLD_SIZE": str(self.nnodes),
            "ROLE_WORLD_SIZE": str(self.world_size),
            "ROLE_NAME": self.role,
            MASTER_ADDR: self.master_addr,
            RESTART_COUNT: str(self.attempt),
            "TORCHELASTIC_MAX_RESTARTS": str(self.max_restarts),
            "TORCHELASTIC_RUN_ID": self.run_id,
            "TORCHELASTIC_USE_AGENT_STORE": "True",
            # msrun
            "RANK_SIZE": str(self.world_size),
            "MS_WORKER_NUM": str(self.world_size),
            "MS_LOCAL_WORKER": str(self.local_world_size),
            "MS_NODE_RANK": str(self.node),
            "MS_ROLE": "MS_WORKER",
            "MS_SCHED_HOST": self.master_addr,
            # ftrun's worker library
            ATTEMPT: str(self.attempt),
            "FTRUN_HEARTBEAT_INTERVAL": str(self.heartbeat_interval),
            "FTRUN_PG_TIMEOUT": str(self.pg_timeout),
            "FTRUN_CLUSTER_TIME_OUT": str(self.cluster_time_out),
            "FTRUN_ARF": "1" if self.arf else "0",
            "FTRUN_UCE": "1" if self.uce else "0",
            "FTRUN_TTP": "1" if self.ttp else "0",
            "FTRUN_RECOVERABLE_ERRORS": ",".join(self.recoverable_errors),
            "FTRUN_ON_DIVERGENCE": self.on_divergence,
            "FTRUN_SAVE_STEPS": str(self.save_steps),
            "PYTHONUNBUFFERED": "1",
        })
        optional = {
            MASTER_PORT: self.master_port, "MS_SCHED_PORT": self.store_port, CONTROL_ADDR: self.control_addr,
            INCARNATION: self.incarnation, GENERATION: self.generation, "FTRUN_CHECKPOINT_DIR": self.checkpoint_dir,
            RESUME_DIR: self.resume_dir, RESUME_STEP: self.resume_step, TOKEN: self.token,
            FAULT: self.fault or None, CHECK_TRACE: self.check_trace, ERROR_FILE: self.error_file,
            HOT_SPARE: "1" if self.hot_spare else None, SPARE_READY: self.spare_ready,
        }
        out.update({name: str(value) for name, value in optional.items() if value is not None})
        return out

    @classmethod
    def from_environ(cls, environ: Mapping[str, str]) -> "RankEnv":
        """Read it from ``environ`` (``os.environ`` in a rank); absent variables take the defaults
        above, an absent identity stays None.

        Raises:
            ValueError: a number that does not parse.
        """
        d = cls()
        return cls(
            rank=_int(environ, RANK, None),
            local_rank=_int(environ, LOCAL_RANK, None),
            incarnation=_int(environ, INCARNATION, None),
            generation=_int(environ, GENERATION, None),
            world_size=_int(environ, WORLD_SIZE, d.world_size),  # type: ignore[arg-type]
            local_world_size=_int(environ, "LOCAL_WORLD_SIZE", d.local_world_size),  # type: ignore[arg-type]
            role=environ.get("ROLE_NAME") or d.role,
            node=_int(environ, "GROUP_RANK", d.node),  # type: ignore[arg-type]
            nnodes=_int(environ, "GROUP_WORLD_SIZE", d.nnodes),  # type: ignore[arg-type]
            master_addr=environ.get(MASTER_ADDR) or d.master_addr,
            master_port=_int(environ, MASTER_PORT, None),
            attempt=_int(environ, ATTEMPT, _int(environ, RESTART_COUNT, d.attempt)),  # type: ignore[arg-type]
            max_restarts=_int(environ, "TORCHELASTIC_MAX_RESTARTS", d.max_restarts),  # type: ignore[arg-type]
            run_id=environ.get("TORCHELASTIC_RUN_ID", d.run_id),
            store_port=_int(environ, "MS_SCHED_PORT", None),
            control_addr=environ.get(CONTROL_ADDR) or None,
            heartbeat_interval=float(environ.get("FTRUN_HEARTBEAT_INTERVAL") or d.heartbeat_interval),
            pg_timeout=float(environ.get("FTRUN_PG_TIMEOUT") or d.pg_timeout),
            cluster_time_out=float(environ.get("FTRUN_CLUSTER_TIME_OUT") or d.cluster_time_out),
            arf=_flag(environ, "FTRUN_ARF", d.arf),
            uce=_flag(environ, "FTRUN_UCE", d.uce),
            ttp=_flag(environ, "FTRUN_TTP", d.ttp),
            recoverable_errors=tuple(n.strip() for n in environ.get("FTRUN_RECOVERABLE_ERRORS", "").split(",") if n.strip()),
            on_divergence=environ.get("FTRUN_ON_DIVERGENCE") or d.on_divergence,
            checkpoint_dir=environ.get("FTRUN_CHECKPOINT_DIR") or None,
            save_steps=_int(environ, "FTRUN_SAVE_STEPS", d.save_steps),  # type: ignore[arg-type]
            resume_dir=environ.get(RESUME_DIR) or None,
            resume_step=_int(environ, RESUME_STEP, None),
            token=environ.get(TOKEN) or None,
            fault=environ.get(FAULT, ""),
            check_trace=environ.get(CHECK_TRACE) or None,
            error_file=environ.get(ERROR_FILE) or None,
            hot_spare=environ.get(HOT_SPARE) == "1",
            spare_ready=environ.get(SPARE_READY) or None,
        )


def strip_identity(environ: dict[str, str]) -> dict[str, str]:
    """Remove the rank identity variables (:data:`IDENTITY_VARS`) from ``environ`` in place; returns it."""
    for name in IDENTITY_VARS:
        environ.pop(name, None)
    return environ


#: What a managed rank's environment gets for NCCL (torch 2.2 and later read these when a
#: ProcessGroupNCCL is built), unless the user set the variable:
#: - ASYNC_ERROR_HANDLING=2 ("clean up only"): a failed or timed-out collective aborts its
#:   communicator and fails its work, and the process lives on (torch's default, 3, ends it);
#: - BLOCKING_WAIT=1: ``work.wait()`` blocks until the collective ends and raises when it failed or
#:   was aborted, so the training thread sees the failure where it called the collective, as with gloo;
#: - ENABLE_MONITORING=0: no heartbeat monitor ending a process whose watchdog is stuck (ftrun's
#:   own heartbeats detect a hung rank and replace it);
#: - DUMP_ON_TIMEOUT=0: no flight-recorder dump on a timeout (it delays the release).
NCCL_SETTINGS: dict[str, str] = {
    "TORCH_NCCL_ASYNC_ERROR_HANDLING": "2",
    "TORCH_NCCL_BLOCKING_WAIT": "1",
    "TORCH_NCCL_ENABLE_MONITORING": "0",
    "TORCH_NCCL_DUMP_ON_TIMEOUT": "0",
}


def nccl_environment(environ: Mapping[str, str], managed: bool) -> dict[str, str]:
    """The NCCL variables to add to a rank's environment ``environ``: :data:`NCCL_SETTINGS` less the
    ones it already has (the user's choice wins); none for a rank ftrun does not recover (an
    unmanaged job restarts whole, as under torchrun, and keeps torch's defaults)."""
    if not managed:
        return {}
    return {name: value for name, value in NCCL_SETTINGS.items() if name not in environ}
