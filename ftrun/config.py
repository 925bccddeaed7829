"""The job specification and where its values come from.

One :class:`JobSpec` describes a job. Each option has three spellings that resolve with this
precedence (highest first):

1. a command-line flag (``--worker_num 4`` or ``--worker-num 4``),
2. an environment variable ``FTRUN_<OPTION>`` (``FTRUN_WORKER_NUM=4``),
3. a TOML key (``worker_num = 4``) in the ``--config FILE`` file, else in ``[tool.ftrun]`` of
   ``./pyproject.toml``,
4. a cluster's environment, when the launcher runs under one (:func:`read_cluster_env`): Slurm's
   ``SLURM_NNODES``, ``SLURM_NODEID``, ``SLURM_JOB_NODELIST``, or a Kubeflow PyTorchJob's
   ``PET_NNODES``, ``PET_NODE_RANK``, ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NPROC_PER_NODE``,
5. the default. A multi-node job whose node index none of these gives decides it at start
   (``JobSpec.node_rank_auto``).

Fault-tolerance switches use MindSpore's ``MS_ENABLE_TFT`` form, e.g. ``'{ARF:1,TTP:1,UCE:1}'``
(separators may be commas or spaces; ``FTRUN_TFT`` wins over ``MS_ENABLE_TFT``). As in MindSpore,
UCE and ARF imply TTP. With no switch given anywhere, ARF is on.

Every value is converted and range-checked where it is read (each number option has bounds, shown
in ``--help``; a TOML value must have the option's TOML type), and the combination is checked by
:func:`resolve`, which also resolves addresses, tries the checkpoint directory, parses
``FTRUN_FAULT`` and, for a multi-node job, reads the shared secret (:func:`read_job_token`).

torchrun's own command line is accepted too (``--nnodes``, ``--standalone``, ``--rdzv-*``, ``--tee``...:
see :class:`TorchrunFlags`), so a torchrun user only swaps the command's name.

Every error a user can cause raises :class:`ConfigError` whose message is one line naming the
problem and the fix; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import ipaddress
import json
import math
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib


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


_TFT_ITEM = re.compile(r"^([A-Za-z]+):([01])$")


def parse_tft(text: str, source: str = "FTRUN_TFT") -> TftSwitches:
    """Parse a MindSpore-style switch string such as ``'{ARF:1,TTP:1,UCE:1}'``.

    Braces are optional; items are separated by commas and/or whitespace; values are 0 or 1;
    switch names are case-insensitive. UCE and ARF imply TTP (as in MindSpore). Switches not
    named are off.

    Args:
        text: the switch string.
        source: where it came from, used in error messages (e.g. ``"MS_ENABLE_TFT"``).

    Raises:
        ConfigError: on an unknown switch, a value other than 0/1, or a malformed item.
    """
    body = text.strip()
    if body.startswith("{") != body.endswith("}"):
        raise ConfigError(f"{source}={text!r} has unbalanced braces; write it like '{{ARF:1,TTP:1}}'")
    body = re.sub(r"\s*:\s*", ":", body.strip("{}").strip())
    values: dict[str, bool] = {}
    for item in filter(None, re.split(r"[,\s]+", body)):
        match = _TFT_ITEM.match(item)
        if not match:
            raise ConfigError(
                f"{source}={text!r}: cannot read {item!r}; write switches as NAME:0 or NAME:1, "
                "e.g. '{ARF:1,TTP:1}'"
            )
        name = match.group(1).upper()
        if name not in TFT_SWITCHES:
            raise ConfigError(
                f"{source}={text!r}: unknown switch {match.group(1)!r}; known switches are "
                + ", ".join(TFT_SWITCHES)
            )
        values[name] = match.group(2) == "1"
    arf, uce = values.get("ARF", False), values.get("UCE", False)
    ttp = values.get("TTP", False) or arf or uce
    return TftSwitches(arf=arf, ttp=ttp, uce=uce, hcce=values.get("HCCE", False))


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

_TIMEOUT_WHY = "7 days is the longest timeout ftrun accepts; torch's timers overflow on far longer ones"


@dataclass(frozen=True)
class Option:
    """One configurable option: its type, default, help and allowed range, shared by CLI, env and TOML.

    Attributes:
        name: the option's name (``--name``, ``FTRUN_NAME``, TOML key ``name``).
        type: ``int``, ``float``, ``bool`` or ``str``.
        default: the value when no layer gives one (None: computed in :func:`resolve`).
        help: one sentence for ``--help``.
        low, high: the smallest and largest accepted value of a number option (None: unbounded).
        low_open: ``low`` itself is refused (e.g. a timeout must be more than 0).
        unit: unit of the number, shown in help and errors (``"s"`` for seconds).
        why: the reason for the bounds, appended to a range error.
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

    def range_text(self) -> str:
        """The accepted numbers in words, e.g. ``"more than 0 and at most 604800 s"`` ('' if unbounded)."""
        parts = []
        if self.low is not None:
            parts.append(("more than " if self.low_open else "at least ") + _num(self.low))
        if self.high is not None:
            parts.append("at most " + _num(self.high))
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
            shown = _num(value) if shown is None else shown
            why = f" ({self.why})" if self.why else ""
            raise ConfigError(f"{where} must be {self.range_text()}, got {shown}{why}")


def _num(value: float) -> str:
    """A number as a user would write it: ``604800``, ``0.001``, ``1e+15``."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return str(value)
    return f"{value:g}"


def _timeout(name: str, default: float, help: str, *, zero_ok: bool = False, why: str = _TIMEOUT_WHY) -> Option:
    return Option(name, float, default, help, low=0.0, high=MAX_TIMEOUT_S, low_open=not zero_ok, unit="s", why=why)


# The options that have a CLI flag, an FTRUN_<NAME> variable and a TOML key. Order = --help order.
OPTIONS: tuple[Option, ...] = (
    Option("worker_num", int, 1, "Total number of ranks in the job (all nodes).",
           low=1, high=MAX_WORLD_SIZE, why="the ranks of the whole job"),
    Option("local_worker_num", int, None, "Ranks on this node (default: worker_num). Alias: --nproc_per_node.",
           low=1, high=MAX_LOCAL_WORKERS, why="the ranks one node runs"),
    Option("nnodes", str, None, "Nodes in the job: N, or torchrun's MIN:MAX (ftrun does not resize jobs and runs MAX "
           "nodes). Default: worker_num / local_worker_num; without --worker_num, worker_num = nnodes x nproc_per_node."),
    Option("master_addr", str, "127.0.0.1", "Address of node 0, which hosts the rendezvous store: an IPv4/IPv6 "
           "address or a host name that resolves."),
    Option("master_port", int, 29500, "Port of the rendezvous store on node 0 (0: pick a free one, single node only).",
           low=0, high=65535, why="a TCP port; 0 picks a free one on a single node"),
    Option("node_rank", int, 0, "Index of this node, 0 .. nnodes-1.", low=0, high=MAX_WORLD_SIZE - 1,
           why="a node's index"),
    Option("run_id", str, None, "Id of the run, the ranks' TORCHELASTIC_RUN_ID (torchrun's --rdzv-id; default: "
           "generated)."),
    Option("local_addr", str, None, "Address this node's agent and ranks advertise to the other nodes (torchrun's "
           "--local-addr; default: found by ftrun)."),
    Option("token_file", str, None, "File holding the job's shared secret, the same on every node (or set "
           f"FTRUN_TOKEN); a multi-node job needs one; at least {MIN_TOKEN_CHARS} characters."),
    Option("log_dir", str, "ftrun_logs", "Directory for worker_<rank>.log, supervisor.log and events.jsonl."),
    Option("join", bool, False, "Wait for every rank to exit on its own after the first rank fails (msrun --join)."),
    _timeout("cluster_time_out", 600.0, "Seconds to wait for all nodes and ranks to join the rendezvous."),
    Option("tail_worker_log", str, "-1", "Local ranks whose output is streamed to the console: -1 for all, '' for "
           "none, or e.g. '0,3'."),
    Option("max_restarts", int, 3, "Restart budget: each respawned rank or whole-job restart uses one.",
           low=0, high=1_000_000, why="the restart budget"),
    Option("monitor_interval", float, 0.1, "Seconds between health checks of the ranks.", low=0.001,
           high=MAX_INTERVAL_S, unit="s",
           why="checking more often than every millisecond only burns CPU; an hour apart, failures go unnoticed"),
    Option("grace_period", float, 5.0, "Seconds between SIGTERM and SIGKILL when stopping ranks "
           "(alias: torchrun's --shutdown-timeout).", low=0.0, high=MAX_INTERVAL_S, unit="s",
           why="ranks get at most an hour to stop after SIGTERM"),
    Option("heartbeat_interval", float, 1.0, "Seconds between a rank's heartbeats to the supervisor.", low=0.01,
           high=MAX_INTERVAL_S, unit="s",
           why="heartbeats more often than every 10 ms flood the supervisor; an hour apart they detect nothing"),
    _timeout("pg_timeout", 300.0, "Timeout in seconds of the process group's collectives (gloo/NCCL)."),
    Option("tft", str, None, "Fault-tolerance switches, e.g. '{ARF:1,TTP:1}' (also FTRUN_TFT / MS_ENABLE_TFT)."),
    _timeout("heartbeat_timeout", 5.0, "Seconds without a heartbeat after which a rank is declared hung (frozen) "
             "and replaced."),
    _timeout("step_timeout", 0.0, "Seconds without step progress after which the job is declared hung (0: computed "
             "from observed step times).", zero_ok=True, why="0 means automatic; " + _TIMEOUT_WHY),
    Option("step_timeout_factor", float, 10.0, "Automatic step timeout: the largest observed step time times this "
           "factor.", low=1.0, high=1e6, why="a multiple of the largest step time"),
    _timeout("step_timeout_min", 3.0, "Automatic step timeout: never below this many seconds."),
    Option("warmup_steps", int, 3, "Steps per rank left out of the automatic step timeout (compilation, caches).",
           low=0, high=MAX_STEPS, why="a number of steps"),
    _timeout("setup_timeout", 300.0, "Seconds a rank may take from its start to its first steps (imports, "
             "compilation, rendezvous)."),
    _timeout("node_wait_timeout", 300.0, "Seconds the coordinator waits for a replacement launcher of a lost node "
             "(ARF) before it writes a dying-gasp checkpoint and fails the job (a Kubernetes pod or Slurm step "
             "restart takes tens of seconds to minutes)."),
    Option("warm_spares", int, 1, "Processes kept with torch already imported, to replace a failed rank faster (ARF; "
           "0: none).", low=0, high=64, why="each spare is an idle process holding torch in memory"),
    Option("hot_spares", int, 0, "Spares per node that run the script's own set-up (imports, data, model, optimizer) "
           "before any fault and wait at its training loop for a rank to replace (ARF; 0: warm spares only). The "
           "script must not read its rank before the loop; see docs/hot_spares.md.",
           low=0, high=64, why="each hot spare holds the script's data, model and optimizer in memory"),
    Option("recoverable_errors", str, "", "More exception types repaired in place (UCE), e.g. "
           "'torch.OutOfMemoryError,MyError'."),
    Option("on_divergence", str, "warn", "What a detected divergence does (a rank that recomputes a step gets "
           "another local gradient than the first time, or replicas hold other parameters after a recovery): 'warn' "
           "(a divergence event and a console warning) or 'fail' (stop the job with a dying-gasp checkpoint of the "
           "last step known good)."),
    Option("checkpoint_dir", str, "ftrun_checkpoints", "Directory of checkpoints (periodic and dying-gasp); created "
           "and checked for writing at start when TTP is on."),
    Option("save_steps", int, 0, "Write a checkpoint every N committed steps, in the background (0: never).",
           low=0, high=MAX_STEPS, why="a number of steps; 0 writes only dying-gasp checkpoints"),
    Option("keep_checkpoints", int, 3, "Keep the newest K complete checkpoints (0: keep all).",
           low=0, high=1_000_000, why="a number of checkpoints; 0 keeps all"),
    Option("resume", str, "auto", "Start from a checkpoint: 'auto' (the newest complete one, when TTP is on), a "
           "PATH, or 'none'."),
    Option("metrics_port", int, 0, "Serve Prometheus metrics on this port of node 0 (http://ADDR:PORT/metrics; "
           "0: off).", low=0, high=65535, why="a TCP port; 0 turns the metrics off"),
    Option("metrics_addr", str, None, "Address the metrics endpoint listens on (default: 127.0.0.1 for a "
           "single-node job, else the address the rendezvous store listens on)."),
)
OPTIONS_BY_NAME: dict[str, Option] = {opt.name: opt for opt in OPTIONS}


@dataclass(frozen=True)
class JobSpec:
    """Everything needed to run a job on one node.

    Attributes:
        script: path of the Python script, module name (``module``) or program (``no_python``).
        script_args: arguments passed to the script unchanged.
        module: run ``python -m script``.
        no_python: run ``script`` directly, not through the Python interpreter.
        worker_num: total ranks in the job.
        local_worker_num: ranks on this node.
        master_addr, master_port: rendezvous store endpoint (node 0); an IPv6 address is kept
            without brackets.
        master_port_auto: the port is the default, of a single-node job (given nowhere): when it is
            in use, the launcher takes a free one, as torchrun does, instead of refusing to start.
        node_rank: this node's index.
        node_rank_auto: no node index was given anywhere (flag, variable, TOML, cluster
            environment) in a multi-node job: the launcher decides it at start (node 0 where it can
            host the store, else the next free index or a vacant one; see
            :func:`ftrun.launcher.claim_node_rank`); ``node_rank`` is 0 until then.
        log_dir: where logs and events go.
        join: after a failure, let the remaining ranks finish instead of stopping them (no restart).
        cluster_time_out: seconds for all ranks to join a rendezvous.
        tail_worker_log: local ranks streamed to the console (``None`` = all).
        max_restarts: restart budget (rank respawns plus whole-job restarts).
        monitor_interval: seconds between health checks.
        grace_period: seconds between SIGTERM and SIGKILL.
        heartbeat_interval: seconds between worker heartbeats.
        pg_timeout: collective timeout of the training process group, seconds.
        tft: fault-tolerance switches.
        tft_explicit: whether the switches were given (not the default).
        heartbeat_timeout: seconds without a heartbeat before a rank is declared hung.
        step_timeout: seconds without progress before the job is declared hung (0: automatic).
        step_timeout_factor, step_timeout_min: the automatic step timeout is
            max(step_timeout_min, largest observed step time * step_timeout_factor).
        warmup_steps: steps per rank not used for the automatic step timeout.
        setup_timeout: seconds from a rank's start to its first steps.
        node_wait_timeout: seconds to wait for a replacement of a lost node (ARF) before failing.
        warm_spares: processes kept with torch imported, to replace failed ranks faster.
        hot_spares: processes per node kept past the script's set-up, waiting at its training loop.
        recoverable_errors: extra exception type names repaired in place (UCE).
        on_divergence: ``"warn"`` or ``"fail"``: what a detected divergence does (issue 20).
        checkpoint_dir, save_steps, keep_checkpoints, resume: checkpoints (TTP).
        config_file: the TOML file the spec was read from, if any.
        run_id: the run's id (torchrun's ``--rdzv-id``), the ranks' ``TORCHELASTIC_RUN_ID``;
            None: the launcher makes one up.
        local_addr: the address this node's agent and ranks advertise to other nodes (torchrun's
            ``--local-addr``); None: the launcher finds one.
        token_file: absolute path of the file holding the job's shared secret (read with
            :func:`read_job_token`), or None.
        metrics_port: node 0's Prometheus metrics port (0: no metrics).
        metrics_addr: the address the metrics endpoint listens on (None: see
            :func:`ftrun.metrics.metrics_bind_address`).
        warnings: one-line notices for the user about flags accepted with a different meaning
            (e.g. ``--nnodes 1:4`` runs 4 nodes); the launcher prints them and emits them as
            ``warning`` events.
    """

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    worker_num: int = 1
    local_worker_num: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    master_port_auto: bool = False
    node_rank: int = 0
    node_rank_auto: bool = False
    log_dir: str = "ftrun_logs"
    join: bool = False
    cluster_time_out: float = 600.0
    tail_worker_log: tuple[int, ...] | None = None
    max_restarts: int = 3
    monitor_interval: float = 0.1
    grace_period: float = 5.0
    heartbeat_interval: float = 1.0
    pg_timeout: float = 300.0
    tft: TftSwitches = field(default_factory=TftSwitches)
    tft_explicit: bool = False
    heartbeat_timeout: float = 5.0
    step_timeout: float = 0.0
    step_timeout_factor: float = 10.0
    step_timeout_min: float = 3.0
    warmup_steps: int = 3
    setup_timeout: float = 300.0
    node_wait_timeout: float = 300.0
    warm_spares: int = 1
    hot_spares: int = 0
    recoverable_errors: tuple[str, ...] = ()
    on_divergence: str = "warn"
    checkpoint_dir: str = "ftrun_checkpoints"
    save_steps: int = 0
    keep_checkpoints: int = 3
    resume: str = "auto"
    config_file: str | None = None
    run_id: str | None = None
    local_addr: str | None = None
    token_file: str | None = None
    warnings: tuple[str, ...] = ()
    metrics_port: int = 0
    metrics_addr: str | None = None

    @property
    def nnodes(self) -> int:
        """Number of nodes (worker_num / local_worker_num; ``--nnodes`` sets worker_num to match)."""
        return self.worker_num // self.local_worker_num

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
        """Rebuild a spec written by :meth:`to_json` (fields missing from older writers get their defaults)."""
        values = dict(data)
        values["script_args"] = tuple(values["script_args"])
        if values["tail_worker_log"] is not None:
            values["tail_worker_log"] = tuple(values["tail_worker_log"])
        values["tft"] = TftSwitches(**values["tft"])
        values["recoverable_errors"] = tuple(values.get("recoverable_errors", ()))
        values["warnings"] = tuple(values.get("warnings", ()))
        return cls(**values)


# --------------------------------------------------------------------------- reading values

_KIND = {bool: "true or false", int: "an integer", float: "a number"}


def _invalid(opt: Option, where: str, shown: str) -> ConfigError:
    return ConfigError(f"{where}: {shown} is not valid for {opt.name}; it must be {_KIND.get(opt.type, 'a string')}")


def _check_text(opt: Option, text: str, where: str) -> str:
    """Checks every string option gets, whatever its source."""
    if "\x00" in text:
        raise ConfigError(f"{where}: the value of {opt.name} contains a NUL character; remove it")
    return text


def convert_text(opt: Option, raw: Any, where: str) -> Any:
    """Convert a value written as text (a flag or an ``FTRUN_<OPTION>`` variable) to the option's
    type and check its range.

    Args:
        opt: the option.
        raw: the text (None: not given; other types are converted with ``str``).
        where: what gave it, used in errors (``"--worker_num"``, ``"FTRUN_WORKER_NUM"``).

    Returns:
        The value, or None when ``raw`` is None.

    Raises:
        ConfigError: not of the option's type, or out of its range.
    """
    if raw is None:
        return None
    if opt.type is bool and isinstance(raw, bool):
        return raw
    if opt.type is str:
        return _check_text(opt, str(raw), where)
    text = str(raw).strip()
    if opt.type is bool:
        word = text.lower()
        if word in ("1", "true", "yes", "on"):
            return True
        if word in ("0", "false", "no", "off"):
            return False
        raise _invalid(opt, where, repr(str(raw)))
    if opt.type is int:
        if not re.fullmatch(r"[+-]?[0-9]+", text):
            raise _invalid(opt, where, repr(str(raw)))
        value: float = int(text)
    else:
        try:
            value = float(text)
        except ValueError:
            raise _invalid(opt, where, repr(str(raw))) from None
    opt.check_range(value, where, text)
    return value


_TOML_TYPE_NAMES: tuple[tuple[type, str], ...] = (
    (bool, "a boolean"), (int, "an integer"), (float, "a float"), (str, "a string"), (list, "an array"),
    (dict, "a table"),
)


def _toml_type(value: Any) -> str:
    for kind, name in _TOML_TYPE_NAMES:
        if isinstance(value, kind):
            return name
    return "a date/time"


def _toml_example(opt: Option) -> str:
    if opt.type is bool:
        return f"{opt.name} = true"
    if opt.type is int:
        return f"{opt.name} = {opt.default if isinstance(opt.default, int) else 2}"
    if opt.type is float:
        return f"{opt.name} = {opt.default!r}"
    return f"{opt.name} = {json.dumps(opt.default if isinstance(opt.default, str) and opt.default else '...')}"


def _short(value: Any, limit: int = 40) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def convert_toml(opt: Option, value: Any, where: str) -> Any:
    """Convert a TOML value to the option's type, refusing values of another TOML type, and check
    its range.

    Accepted: booleans for bool options; integers (or floats with no fraction) for int options;
    integers and floats for float options; strings for string options, plus a table for ``tft``
    (``{ARF = 1, TTP = true}``), an integer for ``nnodes`` and ``tail_worker_log``, an array of
    integers for ``tail_worker_log`` and an array of strings for ``recoverable_errors``.

    Args:
        opt: the option.
        value: what tomllib read.
        where: the key and file, used in errors (``"key worker_num in cfg.toml"``).

    Raises:
        ConfigError: a value of the wrong TOML type or out of range; the message names the
            expected type with an example.
    """

    def wrong(expected: str) -> ConfigError:
        return ConfigError(
            f"{where} is {_toml_type(value)} ({_short(value)}); {opt.name} takes {expected}, "
            f"e.g. {_toml_example(opt)}"
        )

    if opt.type is bool:
        if isinstance(value, bool):
            return value
        raise wrong("true or false")
    if opt.type is int:
        if isinstance(value, int) and not isinstance(value, bool):
            opt.check_range(value, where)
            return value
        if isinstance(value, float) and value.is_integer():
            opt.check_range(value, where)
            return int(value)
        raise wrong("an integer")
    if opt.type is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            try:
                number = float(value)
            except OverflowError:
                number = math.inf
            opt.check_range(number, where, _short(value))
            return number
        raise wrong("a number")
    if isinstance(value, str):
        return _check_text(opt, value, where)
    if opt.name == "tft" and isinstance(value, dict):
        items = []
        for key, flag in value.items():
            if isinstance(flag, bool) or (isinstance(flag, int) and flag in (0, 1)):
                items.append(f"{key}:{int(flag)}")
            else:
                raise ConfigError(f"{where}: switch {key} = {_short(flag)} must be true/false or 1/0, "
                                  "e.g. tft = {ARF = 1, TTP = 1}")
        return "{" + ",".join(items) + "}"
    if opt.name in ("nnodes", "tail_worker_log") and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if opt.name == "tail_worker_log" and isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return ",".join(str(v) for v in value)
        raise wrong("a string or an array of local ranks")
    if opt.name == "recoverable_errors" and isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return ",".join(value)
        raise wrong("a string or an array of strings")
    raise wrong("a string")


def read_toml(path: Path, *, section: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read ftrun options from a TOML file, converted and range-checked.

    Args:
        path: the file (at most 1 MiB of UTF-8 text).
        section: nested table holding the options (``("tool", "ftrun")`` for pyproject.toml);
            empty for a dedicated file, where a top-level ``[ftrun]`` table is also accepted.

    Returns:
        option name -> value.

    Raises:
        ConfigError: unreadable, too large, not UTF-8 or invalid TOML; the section is not a table;
            an unknown key, a key given twice (``worker-num`` and ``worker_num``), or a value of
            the wrong type or range.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_CONFIG_BYTES + 1)
    except OSError as err:
        raise ConfigError(
            f"cannot read config file {path}: {err.strerror or err}; check the --config path"
        ) from None
    if len(raw) > MAX_CONFIG_BYTES:
        raise ConfigError(f"config file {path} is larger than {MAX_CONFIG_BYTES} bytes; give a TOML file of options")
    try:
        data = tomllib.loads(raw.decode("utf-8"))
    except UnicodeDecodeError as err:
        raise ConfigError(
            f"config file {path} is not UTF-8 text (byte 0x{raw[err.start]:02x} at offset {err.start}); "
            "give a TOML file, which is UTF-8"
        ) from None
    except tomllib.TOMLDecodeError as err:
        reason = " ".join(str(err).split())
        raise ConfigError(f"config file {path} is not valid TOML ({reason}); fix the syntax") from None
    for depth, key in enumerate(section):
        data = data.get(key, {})
        if not isinstance(data, dict):
            name = ".".join(section[: depth + 1])
            raise ConfigError(f"{name} in {path} is not a table; put ftrun's options in a [{'.'.join(section)}] table")
    if not section and set(data) == {"ftrun"} and isinstance(data["ftrun"], dict):
        data = data["ftrun"]
    where = f"{path}" + (f" [{'.'.join(section)}]" if section else "")
    out: dict[str, Any] = {}
    spelled: dict[str, str] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in OPTIONS_BY_NAME:
            raise ConfigError(
                f"unknown key {key!r} in {where}; known keys: " + ", ".join(OPTIONS_BY_NAME)
            )
        if name in spelled:
            raise ConfigError(f"{where} sets {name} twice ({spelled[name]!r} and {key!r}); keep one")
        spelled[name] = key
        out[name] = convert_toml(OPTIONS_BY_NAME[name], value, f"key {key} in {where}")
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Read ``FTRUN_<OPTION>`` variables, converted and range-checked (empty values are ignored).

    Raises:
        ConfigError: a value of the wrong type or out of range, naming the variable.
    """
    out: dict[str, Any] = {}
    for opt in OPTIONS:
        var = f"FTRUN_{opt.name.upper()}"
        raw = environ.get(var)
        if raw is not None and raw.strip() != "":
            out[opt.name] = convert_text(opt, raw, var)
    if "tft" not in out and environ.get("MS_ENABLE_TFT", "").strip():
        out["tft"] = environ["MS_ENABLE_TFT"]
        out["_tft_source"] = "MS_ENABLE_TFT"
    return out


# --------------------------------------------------------------------------- value parsers


def parse_tail(text: str, local_worker_num: int, where: str = "--tail_worker_log") -> tuple[int, ...] | None:
    """Parse ``--tail_worker_log``: ``-1`` means all local ranks (returns None), ``''`` none.

    Raises:
        ConfigError: not a list of local ranks.
    """
    text = text.strip()
    if text == "-1":
        return None
    ranks: list[int] = []
    for part in filter(None, re.split(r"[,\s]+", text)):
        if not re.fullmatch(r"[0-9]+", part) or int(part) >= local_worker_num:
            raise ConfigError(
                f"{where} {text!r}: {part!r} is not a local rank 0..{local_worker_num - 1}; "
                "give -1 for all, or a comma-separated list"
            )
        if int(part) not in ranks:
            ranks.append(int(part))
    return tuple(ranks)


def parse_nnodes(text: str, where: str = "--nnodes") -> tuple[int, int]:
    """Parse torchrun's ``--nnodes``: ``N`` or ``MIN:MAX``.

    Returns:
        (min_nodes, max_nodes); ``N`` gives (N, N).

    Raises:
        ConfigError: not of that form, a count below 1 or above the job-size limit, or MIN > MAX.
    """
    match = re.fullmatch(r"\s*([0-9]+)\s*(?::\s*([0-9]+)\s*)?", text)
    if not match:
        raise ConfigError(f"{where} {text!r} is not a node count; write N (e.g. 2) or torchrun's MIN:MAX (e.g. 2:2)")
    low = int(match.group(1))
    high = low if match.group(2) is None else int(match.group(2))
    for count in (low, high):
        if not 1 <= count <= MAX_WORLD_SIZE:
            raise ConfigError(f"{where} {text!r}: a node count must be at least 1 and at most {MAX_WORLD_SIZE}")
    if low > high:
        raise ConfigError(f"{where} {text!r}: MIN {low} is larger than MAX {high}; write MIN:MAX with MIN <= MAX")
    return low, high


# --------------------------------------------------------------------------- cluster environments

_HOSTLIST_ITEM = re.compile(r"([0-9]+)(?:-([0-9]+))?")


def _hostlist_exprs(text: str, where: str) -> list[str]:
    """Split a Slurm host list at its top-level commas (commas inside brackets stay)."""
    exprs, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch == "[":
            depth += 1
            if depth > 1:
                raise ConfigError(f"{where} {text!r}: nested brackets; a Slurm host list looks like node[01-04,07]")
        elif ch == "]":
            depth -= 1
            if depth < 0:
                raise ConfigError(f"{where} {text!r}: ']' without '['; a Slurm host list looks like node[01-04,07]")
        elif ch == "," and depth == 0:
            exprs.append(text[start:i])
            start = i + 1
    if depth:
        raise ConfigError(f"{where} {text!r}: '[' without ']'; a Slurm host list looks like node[01-04,07]")
    exprs.append(text[start:])
    return exprs


def _hostlist_numbers(group: str, expr: str, where: str) -> list[tuple[int, int, int]]:
    """The ranges of one bracket group (``01-04,07``): (low, high, width) each, width = digits of
    ``low`` (Slurm keeps zero padding: ``[08-10]`` is 08, 09, 10)."""
    ranges = []
    for item in group.split(","):
        match = _HOSTLIST_ITEM.fullmatch(item.strip())
        if not match:
            raise ConfigError(
                f"{where}: {item!r} in {expr!r} is not a number or a range LOW-HIGH; a Slurm host list looks like "
                "node[01-04,07]"
            )
        low_text, high_text = match.group(1), match.group(2) or match.group(1)
        if int(high_text) < int(low_text):
            raise ConfigError(f"{where}: the range {item!r} in {expr!r} runs backwards; write LOW-HIGH")
        ranges.append((int(low_text), int(high_text), len(low_text)))
    return ranges


def iter_hostlist(text: str, where: str = "SLURM_JOB_NODELIST") -> Any:
    """The host names of a Slurm compressed host list, in order, one at a time.

    ``node[01-04,07]`` is node01, node02, node03, node04, node07; ``a1,b[2-3]`` is a1, b2, b3;
    ``gpu-[001-002]-x`` is gpu-001-x, gpu-002-x. Zero padding is kept (the width of a range is
    the number of digits of its low end, as in Slurm). Several bracket groups in one name
    (``r[1-2]n[1-2]``) expand left to right, the last one fastest. Nothing is expanded ahead of
    what is read, so ``node[0-999999]`` costs nothing to take the first host of.

    Args:
        text: the host list (e.g. ``SLURM_JOB_NODELIST``).
        where: what gave it, used in errors.

    Raises:
        ConfigError: (when iterated) an empty list or name, unbalanced or nested brackets, an
            empty bracket group, an item that is not a number or LOW-HIGH, or a backwards range.
    """
    text = text.strip()
    if not text:
        raise ConfigError(f"{where} is empty; a Slurm host list looks like node[01-04,07]")
    for expr in _hostlist_exprs(text, where):
        expr = expr.strip()
        if not expr:
            raise ConfigError(f"{where} {text!r} has an empty host name (two commas in a row, or one at an end)")
        parts = re.split(r"\[([^\]]*)\]", expr)  # literal, group, literal, group, ..., literal
        literals, groups = parts[0::2], parts[1::2]
        if any(not group.strip() for group in groups):
            raise ConfigError(f"{where}: empty brackets in {expr!r}; a Slurm host list looks like node[01-04,07]")
        ranges = [_hostlist_numbers(group, expr, where) for group in groups]
        yield from _hostlist_product(literals, ranges)


def _hostlist_product(literals: list[str], ranges: list[list[tuple[int, int, int]]]) -> Any:
    if not ranges:
        yield literals[0]
        return
    for low, high, width in ranges[0]:
        for number in range(low, high + 1):
            head = literals[0] + str(number).zfill(width)
            for tail in _hostlist_product(literals[1:], ranges[1:]):
                yield head + tail


def expand_hostlist(text: str, where: str = "SLURM_JOB_NODELIST", limit: int = MAX_WORLD_SIZE) -> list[str]:
    """Every host name of a Slurm compressed host list (see :func:`iter_hostlist`).

    Raises:
        ConfigError: a malformed list, or more than ``limit`` hosts.
    """
    hosts = []
    for host in iter_hostlist(text, where):
        if len(hosts) == limit:
            raise ConfigError(f"{where} names more than {limit} hosts")
        hosts.append(host)
    return hosts


def first_host(text: str, where: str = "SLURM_JOB_NODELIST") -> str:
    """The first host of a Slurm compressed host list (``node[01-04]`` -> ``node01``).

    Raises:
        ConfigError: a malformed list (its brackets are checked whole, its names and ranges up to
            the first host).
    """
    return next(iter(iter_hostlist(text, where)))


@dataclass
class ClusterEnv:
    """Options read from a cluster's environment, which rank just above the defaults.

    Attributes:
        name: ``"Slurm"`` or ``"PyTorchJob"`` ('' when neither environment is present).
        values: option name -> value.
        labels: option name -> what gave it, naming the variable, e.g.
            ``"SLURM_NODEID (Slurm environment)"``.
        nodes: the cluster's own node count (None: not given or not a count). Its node index is
            this node's only in a job of that many nodes (a one-node Slurm step started to replace
            a node of a larger job has node index 0 in its step, not in the job).
        tasks_per_node: for Slurm, ``(tasks, nodes, var names)`` of the step, to refuse more than one
            launcher per node; None elsewhere.
    """

    name: str = ""
    values: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    nodes: int | None = None
    tasks_per_node: tuple[int, int, str] | None = None


def _env_value(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-empty value: (name, value)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


def read_cluster_env(environ: Mapping[str, str]) -> ClusterEnv:
    """Read the job's shape from Slurm's or a Kubeflow PyTorchJob's environment, when present.

    PyTorchJob (and Kubeflow Trainer), the variables torchrun reads too: ``PET_NNODES`` (nnodes),
    ``PET_NODE_RANK`` (node_rank), ``PET_MASTER_ADDR``, ``PET_MASTER_PORT``, ``PET_NPROC_PER_NODE``
    (local_worker_num; torchrun's ``auto``, ``cpu``, ``gpu``, ``xpu`` count devices). Slurm, under
    ``srun`` (one task per node): ``SLURM_NNODES`` (or ``SLURM_JOB_NUM_NODES``) -> nnodes,
    ``SLURM_NODEID`` -> node_rank, the first host of ``SLURM_JOB_NODELIST`` (or ``SLURM_NODELIST``)
    -> master_addr. When any ``PET_`` variable of these is set, Slurm's are not read.

    Returns:
        The values with their labels (empty when neither environment is present).

    Raises:
        ConfigError: a malformed value, naming the variable.
    """
    out = ClusterEnv()

    def take(option: str, var: str, raw: str, label: str | None = None) -> None:
        label = label or f"{var} ({out.name} environment)"
        out.values[option] = convert_text(OPTIONS_BY_NAME[option], raw, label)
        out.labels[option] = label

    pet = {name: environ.get(name, "").strip() for name in
           ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE")}
    if any(pet.values()):
        out.name = "PyTorchJob"
        for option, var in (("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK"),
                            ("master_addr", "PET_MASTER_ADDR"), ("master_port", "PET_MASTER_PORT")):
            if pet[var]:
                take(option, var, pet[var])
        nproc = pet["PET_NPROC_PER_NODE"]
        if nproc:
            label = f"PET_NPROC_PER_NODE ({out.name} environment)"
            if not re.fullmatch(r"[+-]?[0-9]+", nproc):
                try:
                    nproc = str(count_local_devices(nproc))
                except ConfigError as err:
                    raise ConfigError(f"PET_NPROC_PER_NODE={pet['PET_NPROC_PER_NODE']} ({out.name} environment): "
                                      f"{err}") from None
            take("local_worker_num", "PET_NPROC_PER_NODE", nproc, label)
        if pet["PET_NNODES"]:
            match = re.fullmatch(r"\s*[0-9]+\s*(?::\s*([0-9]+)\s*)?", pet["PET_NNODES"])
            if match:
                out.nodes = int(match.group(1) or pet["PET_NNODES"].strip())
        return out
    nnodes = _env_value(environ, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_id = _env_value(environ, "SLURM_NODEID")
    nodelist = _env_value(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if not (nnodes or node_id or nodelist):
        return out
    out.name = "Slurm"
    if nnodes:
        take("nnodes", *nnodes)
        if re.fullmatch(r"[0-9]+", nnodes[1]):
            out.nodes = int(nnodes[1])
    if node_id:
        take("node_rank", *node_id)
    if nodelist:
        var, raw = nodelist
        take("master_addr", var, first_host(raw, f"{var}={raw} (Slurm environment)"),
             f"the first host of {var}={raw} (Slurm environment)")
    tasks = _env_value(environ, "SLURM_STEP_NUM_TASKS")
    step_nodes = _env_value(environ, "SLURM_STEP_NUM_NODES")
    if tasks and step_nodes and tasks[1].isdigit() and step_nodes[1].isdigit():
        out.tasks_per_node = (int(tasks[1]), int(step_nodes[1]), "SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES")
    return out


_HOST_LABEL = re.compile(r"[A-Za-z0-9_](?:[A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?")


def check_address(text: str, where: str) -> str:
    """Check a host address: an IPv4 or IPv6 literal (IPv6 may be in brackets, ``[::1]``), or a
    host name that resolves (``socket.getaddrinfo``; a literal is never looked up).

    Args:
        text: the address.
        where: what gave it, used in errors (``"--master_addr"``).

    Returns:
        The address, stripped, IPv6 without brackets.

    Raises:
        ConfigError: empty, a malformed IP address or host name, or a name that does not resolve.
    """
    host = text.strip()
    bracketed = host.startswith("[") and host.endswith("]")
    if bracketed:
        host = host[1:-1]
    if not host:
        raise ConfigError(f"{where} is empty; give an IP address or a host name")
    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    if bracketed or ":" in host:
        raise ConfigError(f"{where} {text!r} is not a valid IPv6 address; write e.g. ::1 or [fe80::1]")
    if re.fullmatch(r"[0-9.]+", host):
        raise ConfigError(
            f"{where} {text!r} is not a valid IPv4 address (four numbers 0..255, e.g. 10.0.0.1); "
            "give a valid address or a host name"
        )
    labels = host[:-1].split(".") if host.endswith(".") else host.split(".")
    if len(host) > 253 or not all(_HOST_LABEL.fullmatch(label) for label in labels):
        raise ConfigError(
            f"{where} {text!r} is neither an IP address nor a valid host name (letters, digits, '-' and '.'); "
            "give e.g. 10.0.0.1 or node0.example.com"
        )
    try:
        socket.getaddrinfo(host, None, type=socket.SOCK_STREAM)
    except (socket.gaierror, UnicodeError) as err:
        reason = getattr(err, "strerror", None) or str(err)
        raise ConfigError(
            f"{where} {text!r}: cannot resolve host name ({reason}); give an IP address or a name this machine resolves"
        ) from None
    return host


def parse_rdzv_endpoint(text: str, where: str = "--rdzv-endpoint") -> tuple[str, int]:
    """Parse torchrun's ``--rdzv-endpoint HOST[:PORT]`` (``[IPv6]:PORT`` for IPv6; a bare IPv6
    address has no port).

    Returns:
        (host without brackets, port); the port defaults to 29400 as in torchrun's c10d backend.
        The host is not checked here (see :func:`check_address`).

    Raises:
        ConfigError: empty, unbalanced brackets, or a port that is not 0..65535.
    """
    value = text.strip()
    port_text: str | None = None
    bracket = re.fullmatch(r"\[([^\[\]]*)\](?::(.*))?", value)
    if bracket:
        host, port_text = bracket.group(1), bracket.group(2)
    elif "[" in value or "]" in value:
        raise ConfigError(f"{where} {text!r}: unbalanced brackets; write an IPv6 endpoint as [ADDR]:PORT, e.g. [::1]:29400")
    elif value.count(":") > 1:
        host = value  # a bare IPv6 address: no port
    elif ":" in value:
        host, port_text = value.rsplit(":", 1)
    else:
        host = value
    if not host.strip():
        raise ConfigError(f"{where} {text!r} names no host; write HOST[:PORT], e.g. node0:29400")
    port = DEFAULT_RDZV_PORT
    if port_text is not None:
        if not re.fullmatch(r"[0-9]{1,5}", port_text.strip()) or int(port_text) > 65535:
            raise ConfigError(
                f"{where} {text!r}: {port_text!r} is not a TCP port 0..65535; write HOST:PORT, e.g. node0:29400"
            )
        port = int(port_text)
    return host.strip(), port


# torchrun's --rdzv-conf keys ftrun accepts, and what it does with each.
RDZV_CONF_KEYS: dict[str, str] = {
    "is_host": "whether this node hosts the store: is_host=1 means --node_rank 0",
    "join_timeout": "seconds for nodes to join: sets --cluster_time_out",
    "timeout": "seconds for nodes to join (static backend): sets --cluster_time_out unless join_timeout is given",
    "read_timeout": "ignored: ftrun's store has no separate read timeout",
    "last_call_timeout": "ignored: ftrun does not resize jobs",
    "close_timeout": "ignored: ftrun does not resize jobs",
}


def parse_rdzv_conf(text: str, where: str = "--rdzv-conf") -> dict[str, float | bool]:
    """Parse torchrun's ``--rdzv-conf KEY=VALUE,KEY=VALUE``.

    Keys: ``is_host`` (1/0, true/false, yes/no), and the timeouts ``join_timeout``, ``timeout``,
    ``read_timeout``, ``last_call_timeout``, ``close_timeout`` (seconds, more than 0 and at most
    7 days).

    Raises:
        ConfigError: an item that is not KEY=VALUE, an unknown key, or a bad value.
    """
    out: dict[str, float | bool] = {}
    if not text.strip():
        return out
    for item in text.split(","):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not key or not sep or not value:
            raise ConfigError(f"{where} {text!r}: {item.strip()!r} is not KEY=VALUE; write e.g. join_timeout=900,is_host=1")
        if key not in RDZV_CONF_KEYS:
            raise ConfigError(f"{where}: unknown key {key!r}; ftrun accepts " + ", ".join(RDZV_CONF_KEYS))
        if key == "is_host":
            word = value.lower()
            if word not in ("1", "0", "true", "false", "yes", "no"):
                raise ConfigError(f"{where}: is_host={value!r} must be 1 or 0 (true or false)")
            out[key] = word in ("1", "true", "yes")
            continue
        try:
            seconds = float(value)
        except ValueError:
            seconds = math.nan
        if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT_S):
            raise ConfigError(
                f"{where}: {key}={value!r} must be a number of seconds more than 0 and at most "
                f"{_num(MAX_TIMEOUT_S)} ({_TIMEOUT_WHY})"
            )
        out[key] = seconds
    return out


def parse_std_streams(text: str, flag: str, local_worker_num: int) -> dict[int, int]:
    """Parse torchrun's ``--redirects``/``--tee``: ``0`` (none), ``1`` (stdout), ``2`` (stderr),
    ``3`` (both) for every local rank, or per local rank, ``0:3,1:1`` (ranks not named: 0).

    Returns:
        local rank -> 0..3, for every local rank.

    Raises:
        ConfigError: another form, or a local rank outside 0..local_worker_num-1.
    """
    value = re.sub(r"\s+", "", text)
    if re.fullmatch(r"[0-3]", value):
        return {rank: int(value) for rank in range(local_worker_num)}
    if not re.fullmatch(r"[0-9]+:[0-3](?:,[0-9]+:[0-3])*", value):
        raise ConfigError(
            f"{flag} {text!r}: write 0 (none), 1 (stdout), 2 (stderr), 3 (both), or per local rank, e.g. 0:3,1:1"
        )
    streams = {rank: 0 for rank in range(local_worker_num)}
    for item in value.split(","):
        rank_text, std = item.split(":")
        if int(rank_text) >= local_worker_num:
            raise ConfigError(f"{flag} {text!r}: {rank_text} is not a local rank 0..{local_worker_num - 1}")
        streams[int(rank_text)] = int(std)
    return streams


def check_script(script: str, module: bool, no_python: bool) -> None:
    """Check that the thing to run exists.

    Raises:
        ConfigError: missing script file, module or program.
    """
    if module:
        # Search as `python -m` will in the rank: with the current directory first on the path. A
        # dotted name imports its parent packages; whatever they raise means "not runnable here".
        saved = list(sys.path)
        sys.path.insert(0, os.getcwd())
        try:
            found = importlib.util.find_spec(script) is not None
        except Exception:
            found = False
        finally:
            sys.path[:] = saved
        if not found:
            raise ConfigError(f"module {script!r} not found; check the name and that it is importable here")
    elif no_python:
        if shutil.which(script) is None:
            raise ConfigError(f"program {script!r} not found or not executable; give a path or a command on PATH")
    elif not Path(script).is_file():
        raise ConfigError(f"script {script!r} not found; give the path of a Python file (or -m MODULE)")


def check_writable_dir(path_text: str, where: str, cwd: Path, purpose: str) -> None:
    """Create a directory (and its parents) if needed and check that a file can be written in it
    (a temporary file, removed at once).

    Args:
        path_text: the directory as given; a relative one is taken from ``cwd``.
        where: the option that gave it, used in errors (``"--checkpoint_dir"``).
        cwd: the directory relative paths start from.
        purpose: what goes there, for the messages (``"checkpoints"``).

    Raises:
        ConfigError: it is a file, or cannot be created or written.
    """
    path = Path(path_text)
    if not path.is_absolute():
        path = cwd / path
    if path.exists() and not path.is_dir():
        raise ConfigError(f"{where} {path_text} is a file, not a directory; give a directory for {purpose}")
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(
            f"cannot create {where} {path_text}: {err.strerror or err}; choose a directory you can write for {purpose}"
        ) from None
    try:
        fd, probe = tempfile.mkstemp(prefix=".ftrun-write-test-", dir=path)
        os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise ConfigError(
            f"cannot write to {where} {path_text}: {err.strerror or err}; choose a directory you can write for {purpose}"
        ) from None


def check_faults(text: str, worker_num: int) -> None:
    """Check an ``FTRUN_FAULT`` value before any rank starts (every rank parses it at import).

    Raises:
        ConfigError: :func:`ftrun.faults.parse_faults` refuses it, or a fault names a rank the job
            does not have.
    """
    from .faults import parse_faults

    fix = "fix or unset FTRUN_FAULT; its form is 'rank=2,step=50,point=allreduce,kind=kill' (several separated by ';')"
    try:
        faults = parse_faults(text)
    except ValueError as err:
        raise ConfigError(f"{err}; {fix}") from None
    for fault in faults:
        if fault.rank >= worker_num:
            raise ConfigError(
                f"FTRUN_FAULT names rank {fault.rank}, but the job has ranks 0..{worker_num - 1}; {fix}"
            )


def _check_token(token: str, where: str) -> str:
    token = token.strip()
    if not token:
        raise ConfigError(f"{where} is empty; the job's secret must be at least {MIN_TOKEN_CHARS} characters, " + _TOKEN_EXAMPLE)
    if not all(33 <= ord(ch) <= 126 for ch in token):
        raise ConfigError(
            f"{where} holds spaces or characters other than printable ASCII; use one word, " + _TOKEN_EXAMPLE
        )
    if len(token) < MIN_TOKEN_CHARS:
        raise ConfigError(
            f"{where} is {len(token)} characters long; the job's secret must be at least {MIN_TOKEN_CHARS}, "
            + _TOKEN_EXAMPLE
        )
    return token


_TOKEN_EXAMPLE = "e.g. FTRUN_TOKEN=$(python -c 'import secrets; print(secrets.token_hex(32))')"


def read_job_token(spec: JobSpec, environ: Mapping[str, str] | None = None) -> str | None:
    """The job's shared secret: ``FTRUN_TOKEN`` from the environment, or the content of
    ``spec.token_file`` (whitespace around it stripped). Every node of a job must use the same one.

    Args:
        spec: the job; its ``token_file`` and ``nnodes`` are used.
        environ: the environment (default ``os.environ``).

    Returns:
        The secret, or None on a single-node job that gives none (the launcher makes one up).
        The secret itself never appears in an error message.

    Raises:
        ConfigError: both sources are given; the secret is empty, shorter than 16 characters or not
            one word of printable ASCII; the file is missing, unreadable, larger than 4 KiB or not
            UTF-8; a multi-node job gives no secret.
    """
    environ = os.environ if environ is None else environ
    from_env = environ.get("FTRUN_TOKEN")
    if from_env is not None and spec.token_file:
        raise ConfigError("FTRUN_TOKEN and --token_file are both set; give the job's secret one way only")
    if from_env is not None:
        return _check_token(from_env, "FTRUN_TOKEN")
    if spec.token_file:
        where = f"--token_file {spec.token_file}"
        try:
            # Opened without blocking and checked before any read: a FIFO or a device would block
            # (or never end) where a file holding a secret is read at once.
            fd = os.open(spec.token_file, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
        except OSError as err:
            raise ConfigError(f"cannot read {where}: {err.strerror or err}; give a readable file holding the secret") from None
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            os.close(fd)
            kind = "a FIFO" if stat.S_ISFIFO(mode) else "a directory" if stat.S_ISDIR(mode) else "not a regular file"
            raise ConfigError(f"{where} is {kind}; give a regular file holding the secret")
        with os.fdopen(fd, "rb") as fh:
            try:
                raw = fh.read(MAX_TOKEN_FILE_BYTES + 1)
            except OSError as err:
                raise ConfigError(f"cannot read {where}: {err.strerror or err}; give a readable file holding the secret") from None
        if len(raw) > MAX_TOKEN_FILE_BYTES:
            raise ConfigError(f"{where} is larger than {MAX_TOKEN_FILE_BYTES} bytes; it must hold only the secret")
        try:
            text = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise ConfigError(f"{where} is not text; it must hold only the secret, " + _TOKEN_EXAMPLE) from None
        return _check_token(text, where)
    if spec.nnodes > 1:
        raise ConfigError(
            "a multi-node job needs a shared secret: set FTRUN_TOKEN (the same value on every node) or "
            "--token_file FILE; " + _TOKEN_EXAMPLE
        )
    return None


def count_local_devices(kind: str) -> int:
    """torchrun's word values of ``--nproc_per_node``: ``cpu`` (CPU cores), ``gpu`` (CUDA
    devices), ``xpu`` (XPU devices), ``auto`` (GPUs if any, else XPUs, else CPU cores).

    Raises:
        ConfigError: an unknown word, or ``gpu``/``xpu`` on a machine without such devices.
    """
    word = kind.strip().lower()
    if word == "cpu":
        return os.cpu_count() or 1
    if word not in ("gpu", "xpu", "auto"):
        raise ConfigError(f"--nproc_per_node {kind!r}: give a number of ranks, or one of auto, cpu, gpu, xpu")
    kind = word
    import torch  # only for these words: it takes a second or two

    cuda = torch.cuda.device_count() if torch.cuda.is_available() else 0
    xpu_mod = getattr(torch, "xpu", None)
    xpu = xpu_mod.device_count() if xpu_mod is not None and xpu_mod.is_available() else 0
    if kind == "gpu" or (kind == "auto" and cuda):
        if not cuda:
            raise ConfigError("--nproc_per_node gpu: no CUDA device is visible here; give a number of ranks instead")
        return cuda
    if kind == "xpu" or (kind == "auto" and xpu):
        if not xpu:
            raise ConfigError("--nproc_per_node xpu: no XPU device is visible here; give a number of ranks instead")
        return xpu
    return os.cpu_count() or 1


# --------------------------------------------------------------------------- torchrun's flags


@dataclass(frozen=True)
class TorchrunFlags:
    """torchrun's flags that have no ftrun option of their own (command line only; None: not given).

    Attributes:
        standalone: ``--standalone``: one node, the store on 127.0.0.1 on a free port.
        rdzv_backend: ``--rdzv-backend``: ``c10d`` or ``static`` (both: ftrun's store on node 0).
        rdzv_endpoint: ``--rdzv-endpoint HOST[:PORT]``: node 0's store (master_addr/master_port).
        rdzv_conf: ``--rdzv-conf KEY=VALUE,...`` (see :data:`RDZV_CONF_KEYS`).
        redirects, tee: ``-r/--redirects`` and ``-t/--tee`` (torchrun's 0-3 or ``0:1,1:2``);
            ftrun always writes every rank's output to its log file; together they choose the
            local ranks whose output reaches the console.
        local_ranks_filter: ``--local-ranks-filter 0,1``: only these local ranks on the console.
    """

    standalone: bool = False
    rdzv_backend: str | None = None
    rdzv_endpoint: str | None = None
    rdzv_conf: str | None = None
    redirects: str | None = None
    tee: str | None = None
    local_ranks_filter: str | None = None

    def console_ranks(self, local_worker_num: int) -> tuple[int, ...] | None:
        """The local ranks streamed to the console as torchrun would show them (None: all of them).

        A rank's output reaches torchrun's console unless all of it is redirected to files and
        none teed (``--redirects 3`` without ``--tee``); ``--local-ranks-filter`` then keeps only
        the ranks it names.

        Raises:
            ConfigError: a malformed value or a local rank this node does not have.
        """
        tee = parse_std_streams(self.tee or "0", "--tee", local_worker_num)
        redirects = parse_std_streams(self.redirects or "0", "--redirects", local_worker_num)
        shown = [r for r in range(local_worker_num) if tee[r] != 0 or redirects[r] != 3]
        if self.local_ranks_filter is not None and self.local_ranks_filter.strip():
            wanted = set()
            for part in self.local_ranks_filter.split(","):
                part = part.strip()
                if not re.fullmatch(r"[0-9]+", part) or int(part) >= local_worker_num:
                    raise ConfigError(
                        f"--local-ranks-filter {self.local_ranks_filter!r}: {part!r} is not a local rank "
                        f"0..{local_worker_num - 1}; write e.g. 0,1"
                    )
                wanted.add(int(part))
            shown = [r for r in shown if r in wanted]
        return None if len(shown) == local_worker_num else tuple(shown)

    @property
    def sets_console(self) -> bool:
        """Whether a flag choosing the console's ranks was given."""
        return any(v is not None for v in (self.redirects, self.tee, self.local_ranks_filter))


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")


# --------------------------------------------------------------------------- resolve


def resolve(
    cli: Mapping[str, Any],
    *,
    script: str | None,
    script_args: tuple[str, ...] = (),
    module: bool = False,
    no_python: bool = False,
    config_file: str | None = None,
    environ: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    torchrun: TorchrunFlags | None = None,
) -> JobSpec:
    """Resolve a :class:`JobSpec` from CLI values (None = not given), env, TOML and defaults.

    Every value is converted and range-checked where it is read (flag, ``FTRUN_<OPTION>``, TOML
    key), so an error names its source. Then the combination is checked: sizes, node rank, port,
    addresses (resolved), the checkpoint directory (created and tried when TTP is on), the
    ``FTRUN_FAULT`` variable, and a multi-node job's shared secret (:func:`read_job_token`).

    Args:
        cli: option name -> value from the command line, None where the flag was not given.
        script: the script, module or program to run.
        script_args: its arguments.
        module, no_python: how to run it.
        config_file: ``--config`` path; when None, ``[tool.ftrun]`` of ``cwd/pyproject.toml`` is used.
        environ: the environment (default ``os.environ``).
        cwd: directory searched for pyproject.toml, and the start of relative checkpoint and token
            paths (default the current one).
        torchrun: torchrun's own flags, at the command line's precedence.

    Raises:
        ConfigError: any invalid value, with one line naming it and the fix.
    """
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    torchrun = TorchrunFlags() if torchrun is None else torchrun
    if config_file is not None:
        toml_where = config_file
        from_toml = read_toml(Path(config_file))
    elif (cwd / "pyproject.toml").is_file():
        toml_where = f"{cwd / 'pyproject.toml'} [tool.ftrun]"
        from_toml = read_toml(cwd / "pyproject.toml", section=("tool", "ftrun"))
    else:
        toml_where, from_toml = "", {}
    from_env = read_env(environ)
    tft_source = from_env.pop("_tft_source", "FTRUN_TFT")
    cluster = read_cluster_env(environ)  # Slurm's or a PyTorchJob's: just above the defaults

    from_cli: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for opt in OPTIONS:
        if cli.get(opt.name) is not None:
            from_cli[opt.name] = convert_text(opt, cli[opt.name], f"--{opt.name}")
            labels[opt.name] = f"--{opt.name}"
    warnings: list[str] = []
    is_host = _apply_torchrun(torchrun, from_cli, labels, warnings)

    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.name in from_cli:
            values[opt.name] = from_cli[opt.name]
        elif opt.name in from_env:
            values[opt.name] = from_env[opt.name]
            labels[opt.name] = tft_source if opt.name == "tft" else f"FTRUN_{opt.name.upper()}"
        elif opt.name in from_toml:
            values[opt.name] = from_toml[opt.name]
            labels[opt.name] = f"{opt.name} in {toml_where}"
        elif opt.name in cluster.values:
            values[opt.name] = cluster.values[opt.name]
            labels[opt.name] = cluster.labels[opt.name]
        else:
            values[opt.name] = opt.default
    given = set(labels)

    def label(name: str) -> str:
        return labels.get(name, f"--{name}")

    if not script:
        raise ConfigError("no script given; usage: ftrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]")
    if module and no_python:
        raise ConfigError("-m/--module and --no_python cannot be used together; pick one")

    worker_num, local = _sizes(values, given, label, warnings)
    nnodes = worker_num // local
    _fit_cluster_env(cluster, nnodes, values, labels, given, warnings)
    node_rank = values["node_rank"]
    if is_host is not None:
        if is_host and "node_rank" in given and node_rank != 0:
            raise ConfigError(f"--rdzv-conf is_host=1 makes this node 0, but {label('node_rank')} is {node_rank}; give one")
        if not is_host and ("node_rank" not in given or node_rank == 0):
            raise ConfigError("--rdzv-conf is_host=0: this node does not host the store, so give its --node_rank (1 or more)")
        node_rank = 0 if is_host else node_rank
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"{label('node_rank')} {node_rank} is outside 0..{nnodes - 1} for {nnodes} node(s)")
    # No node index anywhere: decided at start, as torchrun's dynamic rendezvous does (node 0 where
    # the store can be hosted, else the next free index, else a vacant one of a lost node).
    node_rank_auto = nnodes > 1 and "node_rank" not in given and is_host is None
    if torchrun.standalone and nnodes > 1:
        raise ConfigError(
            f"--standalone runs a single-node job, but {label('worker_num')} {worker_num} and "
            f"{label('local_worker_num')} {local} make {nnodes} nodes; drop --standalone or run one node"
        )
    port = values["master_port"]
    if port == 0 and nnodes > 1:
        raise ConfigError(f"{label('master_port')} 0 (pick a free port) works on one node only; give a fixed port")
    master_addr = check_address(values["master_addr"], label("master_addr"))
    local_addr = None if values["local_addr"] is None else check_address(values["local_addr"], label("local_addr"))

    if values["heartbeat_timeout"] <= values["heartbeat_interval"]:
        raise ConfigError(
            f"{label('heartbeat_timeout')} {values['heartbeat_timeout']:g} must be longer than "
            f"{label('heartbeat_interval')} {values['heartbeat_interval']:g}; a few intervals (e.g. 5 x) avoid false alarms"
        )
    recoverable = tuple(n.strip() for n in values["recoverable_errors"].split(",") if n.strip())
    for name in recoverable:
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            raise ConfigError(
                f"{label('recoverable_errors')}: {name!r} is not an exception type name; write e.g. 'torch.OutOfMemoryError'"
            )
    on_divergence = values["on_divergence"].strip().lower()
    if on_divergence not in ("warn", "fail"):
        raise ConfigError(f"{label('on_divergence')} {values['on_divergence']!r} must be 'warn' or 'fail'")
    resume = values["resume"].strip()
    if not resume:
        raise ConfigError(f"{label('resume')} is empty; use 'auto', 'none' or the path of a checkpoint")
    for name in ("log_dir", "checkpoint_dir"):
        if not values[name].strip():
            raise ConfigError(f"{label(name)} is empty; give a directory")
    run_id = values["run_id"]
    if run_id is not None:
        run_id = run_id.strip()
        if not re.fullmatch(r"[\x21-\x7e]{1,256}", run_id):
            raise ConfigError(
                f"{label('run_id')} {values['run_id']!r} must be 1 to 256 printable characters without spaces, "
                "e.g. job-42"
            )
    token_file = values["token_file"]
    if token_file is not None:
        if not token_file.strip():
            raise ConfigError(f"{label('token_file')} is empty; give the path of the file holding the job's secret")
        token_file = str(Path(token_file) if Path(token_file).is_absolute() else cwd / token_file)
    tft = TftSwitches() if values["tft"] is None else parse_tft(values["tft"], label("tft"))
    if torchrun.sets_console:
        if "tail_worker_log" in from_cli:
            raise ConfigError("--tail_worker_log and torchrun's --tee/--redirects/--local-ranks-filter both choose the "
                              "console's ranks; give one of them")
        tail = torchrun.console_ranks(local)
    else:
        tail = parse_tail(values["tail_worker_log"], local, label("tail_worker_log"))
    fault_text = environ.get("FTRUN_FAULT", "")
    if fault_text.strip():
        check_faults(fault_text, worker_num)
    check_script(script, module, no_python)
    if tft.ttp:
        check_writable_dir(values["checkpoint_dir"], label("checkpoint_dir"), cwd, "checkpoints")
    spec = JobSpec(
        script=script,
        script_args=tuple(script_args),
        module=module,
        no_python=no_python,
        worker_num=worker_num,
        local_worker_num=local,
        master_addr=master_addr,
        master_port=port,
        node_rank=node_rank,
        node_rank_auto=node_rank_auto,
        master_port_auto=nnodes == 1 and "master_port" not in given and port != 0,
        log_dir=values["log_dir"],
        join=values["join"],
        cluster_time_out=values["cluster_time_out"],
        tail_worker_log=tail,
        max_restarts=values["max_restarts"],
        monitor_interval=values["monitor_interval"],
        grace_period=values["grace_period"],
        heartbeat_interval=values["heartbeat_interval"],
        pg_timeout=values["pg_timeout"],
        tft=tft,
        tft_explicit=values["tft"] is not None,
        heartbeat_timeout=values["heartbeat_timeout"],
        step_timeout=values["step_timeout"],
        step_timeout_factor=values["step_timeout_factor"],
        step_timeout_min=values["step_timeout_min"],
        warmup_steps=values["warmup_steps"],
        setup_timeout=values["setup_timeout"],
        node_wait_timeout=values["node_wait_timeout"],
        warm_spares=values["warm_spares"],
        hot_spares=values["hot_spares"],
        recoverable_errors=recoverable,
        on_divergence=on_divergence,
        checkpoint_dir=values["checkpoint_dir"],
        save_steps=values["save_steps"],
        keep_checkpoints=values["keep_checkpoints"],
        resume=resume,
        config_file=config_file,
        run_id=run_id,
        local_addr=local_addr,
        token_file=token_file,
        warnings=tuple(warnings),
        metrics_port=values["metrics_port"],
        metrics_addr=check_address(values["metrics_addr"], label("metrics_addr"))
        if (values["metrics_addr"] or "").strip() else None,
    )
    read_job_token(spec, environ)  # a multi-node job needs a secret; a given one must be usable
    return spec


def _apply_torchrun(
    torchrun: TorchrunFlags, from_cli: dict[str, Any], labels: dict[str, str], warnings: list[str]
) -> bool | None:
    """Turn torchrun's rendezvous flags into ftrun's options, at the command line's precedence.

    Returns:
        ``is_host`` from ``--rdzv-conf`` (None: not given).

    Raises:
        ConfigError: an unsupported backend, a malformed endpoint or conf, or a flag that
            contradicts another one given on the command line.
    """
    if torchrun.rdzv_backend is not None:
        backend = torchrun.rdzv_backend.strip().lower()
        if backend not in ("c10d", "static"):
            raise ConfigError(
                f"--rdzv-backend {torchrun.rdzv_backend!r} is not supported: ftrun hosts its own store on node 0; "
                "use c10d or static (or leave it out)"
            )

    def take(name: str, value: Any, flag: str) -> None:
        if name in from_cli and from_cli[name] != value:
            raise ConfigError(
                f"{flag} gives {name} {_num(value)}, but {labels[name]} gives {_num(from_cli[name])}; give only one"
            )
        from_cli[name] = value
        labels[name] = flag

    if torchrun.standalone:
        if torchrun.rdzv_endpoint is not None:
            raise ConfigError("--standalone hosts the store on this machine; drop --rdzv-endpoint, or --standalone")
        addr = from_cli.get("master_addr")
        if addr is not None and addr.strip().lower() not in _LOOPBACK_NAMES:
            raise ConfigError(
                f"--standalone runs a single-node job with its store on 127.0.0.1; drop --master_addr {addr}"
            )
        from_cli.setdefault("master_addr", "127.0.0.1")
        labels.setdefault("master_addr", "--standalone")
        from_cli.setdefault("master_port", 0)  # an explicit --master_port is kept
        labels.setdefault("master_port", "--standalone")
    elif torchrun.rdzv_endpoint is not None:
        host, port = parse_rdzv_endpoint(torchrun.rdzv_endpoint)
        if "master_addr" in from_cli:
            given = from_cli["master_addr"].strip()
            if given.strip("[]") != host:
                raise ConfigError(
                    f"--rdzv-endpoint {torchrun.rdzv_endpoint} and --master_addr {given} name different hosts; give only one"
                )
        from_cli["master_addr"] = host
        labels["master_addr"] = "--rdzv-endpoint"
        take("master_port", port, "--rdzv-endpoint")
    is_host: bool | None = None
    if torchrun.rdzv_conf is not None:
        conf = parse_rdzv_conf(torchrun.rdzv_conf)
        join = conf.get("join_timeout", conf.get("timeout"))
        if join is not None:
            take("cluster_time_out", float(join), "--rdzv-conf")
        for key in conf:
            if RDZV_CONF_KEYS[key].startswith("ignored"):
                warnings.append(f"--rdzv-conf {key} is {RDZV_CONF_KEYS[key]}")
        if "is_host" in conf:
            is_host = bool(conf["is_host"])
    return is_host


def _fit_cluster_env(
    cluster: ClusterEnv, nnodes: int, values: dict[str, Any], labels: dict[str, str], given: set[str],
    warnings: list[str],
) -> None:
    """Keep only the cluster environment's values that describe this job.

    Its node index is this node's only when the job has the cluster's node count (a one-node Slurm
    step started with ``--nnodes 4`` to replace a lost node is node 0 of its step, not of the job:
    its index is then decided at start, and a warning says so). A single-node job keeps its store
    on loopback: the cluster's master address and port are not used. Under Slurm, more than one
    task per node (several launchers with one node index) is refused.

    Raises:
        ConfigError: more Slurm tasks than nodes in the step.
    """
    if not cluster.name:
        return

    def from_cluster(name: str) -> bool:
        return name in cluster.labels and labels.get(name) == cluster.labels[name]

    def drop(name: str) -> None:
        values[name] = OPTIONS_BY_NAME[name].default
        labels.pop(name, None)
        given.discard(name)

    if from_cluster("node_rank") and cluster.nodes is not None and cluster.nodes != nnodes:
        warnings.append(
            f"{cluster.labels['node_rank']} is not used: the job has {nnodes} node(s), the {cluster.name} environment "
            f"{cluster.nodes}" + ("; this node's index is decided at start (a free or vacant one)" if nnodes > 1 else "")
        )
        drop("node_rank")
    if nnodes == 1:
        for name in ("master_addr", "master_port"):
            if from_cluster(name):
                drop(name)
    elif from_cluster("node_rank") and cluster.tasks_per_node is not None:
        tasks, step_nodes, names = cluster.tasks_per_node
        if tasks != step_nodes:
            raise ConfigError(
                f"Slurm runs {tasks} tasks on {step_nodes} node(s) ({names}), but ftrun is one launcher per node "
                "that starts the node's ranks itself; run it with srun --ntasks-per-node=1"
            )


def _sizes(
    values: Mapping[str, Any], given: set[str], label: Callable[[str], str], warnings: list[str]
) -> tuple[int, int]:
    """The job's (worker_num, local_worker_num) from worker_num, local_worker_num and nnodes.

    With ``nnodes`` (torchrun): worker_num = nnodes x local_worker_num (local_worker_num defaults
    to 1, or worker_num / nnodes when worker_num is given). Without it (msrun): local_worker_num
    defaults to worker_num, and a local_worker_num given alone sets worker_num.

    Raises:
        ConfigError: sizes that do not fit together.
    """
    worker_num = values["worker_num"]
    local = values["local_worker_num"]
    if values["nnodes"] is not None:
        low, nodes = parse_nnodes(values["nnodes"], label("nnodes"))
        if low < nodes:
            warnings.append(
                f"ftrun does not resize jobs: {label('nnodes')} {values['nnodes'].strip()} runs with {nodes} nodes; "
                f"all {nodes} must join within --cluster_time_out"
            )
        if local is None:
            if "worker_num" in given:
                if worker_num % nodes:
                    raise ConfigError(
                        f"{label('worker_num')} {worker_num} cannot be split over {label('nnodes')} {nodes} nodes; "
                        "give a multiple of the node count, or --nproc_per_node"
                    )
                local = worker_num // nodes
            else:
                local = 1
        if "worker_num" in given and worker_num != nodes * local:
            raise ConfigError(
                f"{label('worker_num')} {worker_num} disagrees with {label('nnodes')} {nodes} x "
                f"{label('local_worker_num')} {local} = {nodes * local}; give --nnodes and --nproc_per_node "
                "(torchrun) or --worker_num and --local_worker_num (msrun)"
            )
        worker_num = nodes * local
        if worker_num > MAX_WORLD_SIZE:
            raise ConfigError(
                f"{label('nnodes')} {nodes} x {label('local_worker_num')} {local} = {worker_num} ranks; "
                f"a job has at most {MAX_WORLD_SIZE}"
            )
    elif "worker_num" not in given and local is not None:
        worker_num = local  # torchrun style: --nproc_per_node alone sets the world
    local = worker_num if local is None else local
    if local > worker_num:
        raise ConfigError(
            f"{label('local_worker_num')} {local} is larger than {label('worker_num')} {worker_num}; "
            "a node cannot run more ranks than the job has"
        )
    if worker_num % local:
        raise ConfigError(
            f"{label('worker_num')} {worker_num} is not a multiple of {label('local_worker_num')} {local}; "
            "every node runs the same number of ranks"
        )
    return worker_num, local
