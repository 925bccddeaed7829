"""The options, declared once: each is a field of :class:`JobSpec` made with :func:`option`.

An option's field gives its name (the flag ``--name`` and ``--name-with-hyphens``, the variable
``FTRUN_<NAME>``, the TOML key ``name``), its type (the field's annotation, or ``kind`` where the
spec holds a parsed value: ``tft`` is written ``'{ARF:1}'`` and held as :class:`TftSwitches`), its
default, its ``--help`` sentence and its bounds. :data:`OPTIONS` reads the declarations back, in
field order (the order of ``--help``); the command line (:mod:`ftrun.cli`), the environment and
TOML readers (:mod:`ftrun.config.sources`) and :func:`ftrun.config.resolve` know the options only
through it. The model is the NVIDIA resiliency extension's ``FaultToleranceConfig``: one dataclass
whose fields are the CLI flags, the environment variables and the config file's keys.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from dataclasses import dataclass, field
from typing import Any, Mapping


class ConfigError(Exception):
    """A user-caused configuration problem; ``str(err)`` is one line naming it and the fix."""


# The switches MindSpore's MS_ENABLE_TFT knows, and whether this version of ftrun implements each.
TFT_SWITCHES: dict[str, str] = {
    "ARF": "process-level rescheduling: respawn only the failed rank, state from a replica",
    "TTP": "dying-gasp checkpoint of the last committed step",
    "UCE": "in-place repair of a recoverable error, state from a replica",
    "HCCE": "communication error recovery without respawning",
}
TFT_IMPLEMENTED: frozenset[str] = frozenset({"ARF", "TTP", "UCE", "HCCE"})
#: What a standby node runs while it waits (``--standby_spares``): see :class:`JobSpec`.
STANDBY_SPARES = ("hot", "warm", "none")


def relay_fits(heartbeat_timeout: float, heartbeat_interval: float) -> bool:
    """Whether ``--heartbeat_timeout`` leaves room for the heartbeat relay's hop (seconds both): it
    must be above two heartbeat intervals, since a relayed beat is read up to about 1.5 intervals
    late (:mod:`ftrun.node.relay`)."""
    return heartbeat_timeout > 2 * heartbeat_interval


@dataclass(frozen=True)
class TftSwitches:
    """Fault-tolerance switches (MindSpore ``MS_ENABLE_TFT`` semantics).

    Attributes:
        arf: respawn only the failed rank and recover its state from a replica peer.
        ttp: write a dying-gasp checkpoint of the last committed step on an unrecoverable fault.
        uce: repair a recoverable error in place (the rank stays alive).
        hcce: rebuild the process group after a communication error, no respawn.
    """

    arf: bool = True
    ttp: bool = True
    uce: bool = True
    hcce: bool = True

    def enabled(self) -> list[str]:
        """Names of the switches that are on, in MindSpore's spelling (e.g. ``["ARF", "TTP"]``)."""
        return [name for name in TFT_SWITCHES if getattr(self, name.lower())]

    def not_implemented(self) -> list[str]:
        """Switches that are on but that this version of ftrun does not implement yet."""
        return [name for name in self.enabled() if name not in TFT_IMPLEMENTED]

    def __str__(self) -> str:
        return "{" + ",".join(f"{n}:{int(getattr(self, n.lower()))}" for n in TFT_SWITCHES) + "}"


# --------------------------------------------------------------------------- bounds

#: The longest timeout any option accepts, seconds (7 days). torch turns timeouts into timedeltas
#: and milliseconds, which overflow on values such as 1e15; a week is far beyond any real wait.
MAX_TIMEOUT_S: float = 7 * 24 * 3600.0
#: The longest period of a periodic check or heartbeat, seconds (1 hour).
MAX_INTERVAL_S: float = 3600.0
#: The most ranks a job may have, and ranks one node may run.
MAX_WORLD_SIZE: int = 1 << 20
MAX_LOCAL_WORKERS: int = 4096
#: The largest step count an option accepts.
MAX_STEPS: int = 10**9
#: torchrun's default port of a c10d ``--rdzv-endpoint`` given without one.
DEFAULT_RDZV_PORT: int = 29400
#: A job secret shorter than this is refused; a token file larger than this is not a token file.
MIN_TOKEN_CHARS: int = 16
MAX_TOKEN_FILE_BYTES: int = 4096
#: A TOML config file larger than this is refused (bytes).
MAX_CONFIG_BYTES: int = 1 << 20
TIMEOUT_WHY = "7 days is the longest timeout ftrun accepts; torch's timers overflow on far longer ones"


def format_number(value: float) -> str:
    """A number as a user would write it: ``604800``, ``0.001``, ``1e+15``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:g}"


@dataclass(frozen=True)
class Option:
    """One option: its type, default, help and allowed range, shared by CLI, env and TOML.

    Read from a :class:`JobSpec` field declared with :func:`option` (see :data:`OPTIONS`).

    Attributes:
        name: the option's name (``--name``, ``FTRUN_NAME``, TOML key ``name``).
        type: ``int``, ``float``, ``bool`` or ``str``: the type a flag's or variable's text is
            converted to.
        default: the value when no layer gives one (None: computed in :func:`resolve`).
        help: one sentence for ``--help``.
        low, high: the smallest and largest accepted value of a number option (None: unbounded).
        low_open: ``low`` itself is refused (e.g. a timeout must be more than 0).
        unit: unit of the number, shown in help and errors (``"s"`` for seconds).
        why: the reason for the bounds, appended to a range error.
        alias: torchrun's other name for the same flag (``rdzv_id`` for ``run_id``), accepted on
            the command line only ('' when none).
        alias_help: what the alias adds, for ``--help`` (e.g. the words ``--nproc_per_node`` takes).
        stored: the spec holds the option's value as resolved (False: the spec computes its own,
            as ``nnodes`` from worker_num and local_worker_num).
    """

    name: str
    type: type
    default: Any
    help: str
    low: float | None = None
    high: float | None = None
    low_open: bool = False
    unit: str = ""
    why: str = ""
    alias: str = ""
    alias_help: str = ""
    stored: bool = True

    @property
    def env_var(self) -> str:
        """The option's environment variable, ``FTRUN_<NAME>``."""
        return f"FTRUN_{self.name.upper()}"

    def range_text(self) -> str:
        """The accepted numbers in words, e.g. ``"more than 0 and at most 604800 s"`` ('' if unbounded)."""
        parts = []
        if self.low is not None:
            parts.append(("more than " if self.low_open else "at least ") + format_number(self.low))
        if self.high is not None:
            parts.append("at most " + format_number(self.high))
        if not parts:
            return ""
        return " and ".join(parts) + (f" {self.unit}" if self.unit else "")

    def check_range(self, value: float, where: str, shown: str | None = None) -> None:
        """Refuse a number outside ``[low, high]`` (or a NaN or infinity).

        Args:
            value: the converted number.
            where: what gave it, e.g. ``"--pg_timeout"`` or ``"FTRUN_PG_TIMEOUT"``.
            shown: the value as the user wrote it (default: ``value`` formatted).

        Raises:
            ConfigError: out of range; the message gives the range and :attr:`why`.
        """
        if self.low is None and self.high is None:
            return
        if isinstance(value, float) and not math.isfinite(value):
            ok = False
        else:
            ok = (self.low is None or (value > self.low if self.low_open else value >= self.low)) and (
                self.high is None or value <= self.high
            )
        if not ok:
            shown = format_number(value) if shown is None else shown
            why = f" ({self.why})" if self.why else ""
            raise ConfigError(f"{where} must be {self.range_text()}, got {shown}{why}")


_OPTION = "ftrun.option"  # the key of an option's declaration in its field's metadata
_SAME = object()  # given_nowhere not given: the field's default
_FROM_ANNOTATION = type(None)  # Option.type until _read_options reads it from the field's annotation


def option(
    default: Any,
    help: str,
    *,
    kind: type | None = None,
    given_nowhere: Any = _SAME,
    low: float | None = None,
    high: float | None = None,
    low_open: bool = False,
    unit: str = "",
    why: str = "",
    alias: str = "",
    alias_help: str = "",
    init: bool = True,
) -> Any:
    """Declare a :class:`JobSpec` field that is an option (a flag, a variable and a TOML key).

    Args:
        default: the field's default, when a spec is built directly (tests, older writers).
        help: one sentence for ``--help``.
        kind: the type a flag's text converts to, when the field holds something parsed from it
            (``str`` for ``tft``, ``tail_worker_log``...); default: the field's annotation
            (``int``, ``float``, ``bool``, ``str`` or ``str | None``).
        given_nowhere: the option's value when no layer gives one, in ``kind`` (default:
            ``default``; None: :func:`resolve` computes it).
        low, high, low_open, unit, why, alias, alias_help: as in :class:`Option`.
        init: False for an option the spec computes (``nnodes``: worker_num / local_worker_num).

    Returns:
        A ``dataclasses.field`` carrying the declaration.
    """
    declared = Option("", kind or _FROM_ANNOTATION, default if given_nowhere is _SAME else given_nowhere, help,
                      low=low, high=high, low_open=low_open, unit=unit, why=why, alias=alias, alias_help=alias_help,
                      stored=init)
    return field(default=default, init=init, metadata={_OPTION: declared})


def _timeout(default: float, help: str, *, zero_ok: bool = False, why: str = TIMEOUT_WHY) -> Any:
    """An option of seconds up to :data:`MAX_TIMEOUT_S`: more than 0 (or at least 0: ``zero_ok``)."""
    return option(default, help, low=0.0, high=MAX_TIMEOUT_S, low_open=not zero_ok, unit="s", why=why)


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to run a job on one node.

    The fields made with :func:`option` are the options (a flag, an ``FTRUN_<NAME>`` variable and
    a TOML key each; their meaning is their ``help``, shown by ``ftrun --help`` and in the
    CLI reference, docs/reference/cli.md). Their units: seconds for every ``*_timeout``, ``*_interval``, ``grace_period``
    and ``cluster_time_out``; counts of steps for ``warmup_steps`` and ``save_steps``. Parsed ones
    hold the parsed value: ``tail_worker_log`` the local ranks streamed to the console (None: all),
    ``tft`` the switches, ``recoverable_errors`` the names; ``master_addr`` and ``local_addr`` an
    IPv6 address without brackets; ``token_file`` an absolute path (read with
    :func:`~ftrun.config.read_job_token`); ``nnodes`` is computed (worker_num / local_worker_num).

    The other fields:

    Attributes:
        script: path of the Python script, module name (``module``) or program (``no_python``).
        script_args: arguments passed to the script unchanged.
        module: run ``python -m script``.
        no_python: run ``script`` directly, not through the Python interpreter.
        master_port_auto: the port is the default, of a single-node job (given nowhere): when it is
            in use, the launcher takes a free one, as torchrun does, instead of refusing to start.
        node_rank_auto: no node index was given anywhere (flag, variable, TOML, cluster
            environment) in a multi-node job: the launcher decides it at start (node 0 where it can
            host the store, else the next free index or a vacant one; see
            :func:`ftrun.node.launcher.claim_node_rank`); ``node_rank`` is 0 until then.
        tft_explicit: whether the switches were given (not the default).
        config_file: the TOML file the spec was read from, if any.
        warnings: one-line notices for the user about flags accepted with a different meaning
            (e.g. ``--nnodes 1:4`` runs 4 nodes); the launcher prints them and emits them as
            ``warning`` events.
    """

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False

    # The options, in --help order.
    worker_num: int = option(1, "Total number of ranks in the job (all nodes).", low=1, high=MAX_WORLD_SIZE,
                             why="the ranks of the whole job")
    local_worker_num: int = option(
        1, "Ranks on this node (default: worker_num).", given_nowhere=None, low=1, high=MAX_LOCAL_WORKERS,
        why="the ranks one node runs", alias="nproc_per_node",
        alias_help="; also auto, cpu, gpu or xpu (that many ranks as devices)")
    nnodes: int = option(
        1, "Nodes in the job: N, or torchrun's MIN:MAX (MAX nodes' ranks, the job going on with MIN nodes or more: "
        "an absent node's ranks run on the others until it joins). Default: worker_num / local_worker_num; without "
        "--worker_num, worker_num = nnodes x nproc_per_node.",
        kind=str, given_nowhere=None, init=False)
    master_addr: str = option("127.0.0.1", "Address of node 0, which hosts the rendezvous store: an IPv4/IPv6 "
                              "address or a host name that resolves.")
    master_port: int = option(29500, "Port of the rendezvous store on node 0 (0: pick a free one, single node "
                              "only).", low=0, high=65535, why="a TCP port; 0 picks a free one on a single node")
    node_rank: int = option(0, "Index of this node, 0 .. nnodes-1.", low=0, high=MAX_WORLD_SIZE - 1,
                            why="a node's index")
    run_id: str | None = option(None, "Id of the run, the ranks' TORCHELASTIC_RUN_ID (default: generated).",
                                alias="rdzv_id")
    role: str = option("default", "The ranks' role, their ROLE_NAME (torchrun's --role).")
    local_addr: str | None = option(None, "Address this node's agent and ranks advertise to the other nodes "
                                    "(torchrun's --local-addr; default: found by ftrun).")
    token_file: str | None = option(None, "File holding the job's shared secret, the same on every node (or set "
                                    "FTRUN_TOKEN); a multi-node job needs one; at least "
                                    f"{MIN_TOKEN_CHARS} characters.")
    log_dir: str = option("ftrun_logs", "Directory for worker_<rank>.log, supervisor.log and events.jsonl.")
    join: bool = option(False, "Wait for every rank to exit on its own after the first rank fails (msrun --join).")
    cluster_time_out: float = _timeout(600.0, "Seconds to wait for all nodes and ranks to join the rendezvous.")
    tail_worker_log: tuple[int, ...] | None = option(
        None, "Local ranks whose output is streamed to the console: -1 for all, '' for none, or e.g. '0,3'.",
        kind=str, given_nowhere="-1")
    max_restarts: int = option(3, "Restart budget: each respawned rank or whole-job restart uses one.", low=0,
                               high=1_000_000, why="the restart budget")
    monitor_interval: float = option(
        0.1, "Seconds between health checks of the ranks.", low=0.001, high=MAX_INTERVAL_S, unit="s",
        why="checking more often than every millisecond only burns CPU; an hour apart, failures go unnoticed")
    grace_period: float = option(5.0, "Seconds between SIGTERM and SIGKILL when stopping ranks.", low=0.0,
                                 high=MAX_INTERVAL_S, unit="s", why="ranks get at most an hour to stop after SIGTERM",
                                 alias="shutdown_timeout")
    heartbeat_interval: float = option(
        1.0, "Seconds between a rank's heartbeats to the supervisor.", low=0.01, high=MAX_INTERVAL_S, unit="s",
        why="heartbeats more often than every 10 ms flood the supervisor; an hour apart they detect nothing")
    pg_timeout: float = _timeout(300.0, "Timeout in seconds of the process group's collectives (gloo/NCCL).")
    tft: TftSwitches = option(TftSwitches(), "Fault-tolerance switches, e.g. '{ARF:1,TTP:1}' (also FTRUN_TFT / "
                              "MS_ENABLE_TFT).", kind=str, given_nowhere=None)
    heartbeat_timeout: float = _timeout(5.0, "Seconds without a heartbeat after which a rank is declared hung "
                                        "(frozen) and replaced.")
    step_timeout: float = _timeout(0.0, "Seconds without step progress after which the job is declared hung (0: "
                                   "computed from observed step times).", zero_ok=True,
                                   why="0 means automatic; " + TIMEOUT_WHY)
    step_timeout_factor: float = option(10.0, "Automatic step timeout: the largest observed step time times this "
                                        "factor.", low=1.0, high=1e6, why="a multiple of the largest step time")
    step_timeout_min: float = _timeout(3.0, "Automatic step timeout: never below this many seconds.")
    warmup_steps: int = option(3, "Steps per rank left out of the automatic step timeout (compilation, caches).",
                               low=0, high=MAX_STEPS, why="a number of steps")
    setup_timeout: float = _timeout(300.0, "Seconds a rank may take from its start to its first steps (imports, "
                                    "compilation, rendezvous).")
    replace_timeout: float = _timeout(
        10.0, "With --nnodes MIN:MAX: seconds a lost node is awaited before its ranks start on the other nodes (a "
        "node not joined at the start: at least 30 s), while MIN nodes or more are left; below MIN the job ends then "
        "(0: wait --node_wait_timeout, as a fixed-size job).", zero_ok=True, why="0 waits --node_wait_timeout, as a "
        "fixed-size job; " + TIMEOUT_WHY)
    node_wait_timeout: float = _timeout(
        300.0, "Seconds the coordinator waits for a replacement launcher of a lost node (ARF) before it writes a "
        "dying-gasp checkpoint and fails the job (a Kubernetes pod or Slurm step restart takes tens of seconds to "
        "minutes).")
    warm_spares: int = option(1, "Processes kept with torch already imported, to replace a failed rank faster "
                              "(ARF; 0: none).", low=0, high=64,
                              why="each spare is an idle process holding torch in memory")
    fork_server: str = option(
        "on", "Start the ranks of a script that imports ftrun as forks of one process per node that has imported "
        "torch once, instead of one new interpreter each (milliseconds instead of seconds per rank, at the start "
        "and at each respawn; it also takes the place of --warm_spares): 'on' or 'off' (each rank a new 'python "
        "script' process, as torchrun starts them; see docs/recovery.md).")
    heartbeat_relay: str = option(
        "auto", "Whether the ranks of nodes other than node 0 send their heartbeats through their node's agent, "
        "which passes them on in its own beat (one message a heartbeat interval per node to node 0 instead of one "
        "per rank), and a recovery round's orders and answers go through it too: 'on', 'off' or 'auto' (on from "
        "256 ranks when --heartbeat_timeout is above two heartbeat intervals; see docs/scale.md).")
    hot_spares: int = option(
        0, "Spares per node that run the script's own set-up (imports, data, model, optimizer) before any fault and "
        "wait at its training loop for a rank to replace (ARF; 0: warm spares only). The script must not read its "
        "rank before the loop; see docs/hot_spares.md.", low=0, high=64,
        why="each hot spare holds the script's data, model and optimizer in memory")
    standby_spares: str = option(
        "hot", "What a standby node (a launcher started after every node has its index; it takes the next lost "
        "node's index) runs while it waits: 'hot' (one hot spare per local rank, warm ones for a script that breaks "
        "the hot-spare contract), 'warm' (one warm spare per local rank) or 'none' (no process until it takes a node).")
    recoverable_errors: tuple[str, ...] = option(
        (), "More exception types repaired in place (UCE), e.g. 'torch.OutOfMemoryError,MyError'.", kind=str,
        given_nowhere="")
    on_divergence: str = option(
        "warn", "What a detected divergence does (a rank that recomputes a step gets another local gradient than the "
        "first time, or replicas hold other parameters after a recovery): 'warn' (a divergence event and a console "
        "warning) or 'fail' (stop the job with a dying-gasp checkpoint of the last step known good).")
    checkpoint_dir: str = option("ftrun_checkpoints", "Directory of checkpoints (periodic and dying-gasp); created "
                                 "and checked for writing at start when TTP is on.")
    save_steps: int = option(0, "Write a checkpoint every N committed steps, in the background (0: never).", low=0,
                             high=MAX_STEPS, why="a number of steps; 0 writes only dying-gasp checkpoints")
    keep_checkpoints: int = option(3, "Keep the newest K complete checkpoints (0: keep all).", low=0,
                                   high=1_000_000, why="a number of checkpoints; 0 keeps all")
    resume: str = option("auto", "Start from a checkpoint: 'auto' (the newest complete one, when TTP is on), a "
                         "PATH, or 'none'.")
    metrics_port: int = option(0, "Serve Prometheus metrics on this port of node 0 (http://ADDR:PORT/metrics; "
                               "0: off).", low=0, high=65535, why="a TCP port; 0 turns the metrics off")
    metrics_addr: str | None = option(None, "Address the metrics endpoint listens on (default: 127.0.0.1 for a "
                                      "single-node job, else the address the rendezvous store listens on).")

    # Computed by resolve, not options.
    master_port_auto: bool = False
    node_rank_auto: bool = False
    min_nodes: int = 0  # --nnodes MIN:MAX's MIN (0: nnodes, a fixed-size job)
    tft_explicit: bool = False
    config_file: str | None = None
    warnings: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        # nnodes is computed, never given (--nnodes sets worker_num to nnodes x local_worker_num).
        object.__setattr__(self, "nnodes", self.worker_num // self.local_worker_num if self.local_worker_num else 0)

    def global_rank(self, local_rank: int) -> int:
        """Global rank of ``local_rank`` on this node."""
        return self.node_rank * self.local_worker_num + local_rank

    def to_json(self) -> dict[str, Any]:
        """A JSON-serialisable dict, the inverse of :meth:`from_json`."""
        data = dataclasses.asdict(self)
        data["script_args"] = list(self.script_args)
        data["tail_worker_log"] = None if self.tail_worker_log is None else list(self.tail_worker_log)
        data["recoverable_errors"] = list(self.recoverable_errors)
        data["warnings"] = list(self.warnings)
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "JobSpec":
        """Rebuild a spec written by :meth:`to_json` (fields missing from older writers get their
        defaults; computed fields such as ``nnodes`` are computed again)."""
        values = {f.name: data[f.name] for f in dataclasses.fields(cls) if f.init and f.name in data}
        values["script_args"] = tuple(values["script_args"])
        if values.get("tail_worker_log") is not None:
            values["tail_worker_log"] = tuple(values["tail_worker_log"])
        values["tft"] = TftSwitches(**values["tft"])
        values["recoverable_errors"] = tuple(values.get("recoverable_errors", ()))
        values["warnings"] = tuple(values.get("warnings", ()))
        return cls(**values)


def _option_type(hint: Any) -> type | None:
    """``int``, ``float``, ``bool`` or ``str`` for an annotation of one of them (or ``X | None``)."""
    scalars = (int, float, bool, str)
    if hint in scalars:
        return hint
    args = [arg for arg in typing.get_args(hint) if arg is not type(None)]
    return args[0] if len(args) == 1 and args[0] in scalars else None


def _read_options(spec_class: type) -> tuple[Option, ...]:
    """The options declared on ``spec_class``'s fields, in field order, with name and type filled in.

    Raises:
        TypeError: an option whose field type is not a scalar and that gives no ``kind`` (a
            mistake in this module, found at import).
    """
    hints = typing.get_type_hints(spec_class)
    found = []
    for spec_field in dataclasses.fields(spec_class):
        declared = spec_field.metadata.get(_OPTION)
        if declared is None:
            continue
        kind = _option_type(hints[spec_field.name]) if declared.type is _FROM_ANNOTATION else declared.type
        if kind is None:
            raise TypeError(f"JobSpec.{spec_field.name} holds {hints[spec_field.name]}; give option(kind=...)")
        found.append(dataclasses.replace(declared, name=spec_field.name, type=kind))
    return tuple(found)


#: The options that have a CLI flag, an FTRUN_<NAME> variable and a TOML key. Order = --help order.
OPTIONS: tuple[Option, ...] = _read_options(JobSpec)
OPTIONS_BY_NAME: dict[str, Option] = {opt.name: opt for opt in OPTIONS}
