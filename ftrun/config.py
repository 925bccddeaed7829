"""The job specification and where its values come from.

One :class:`JobSpec` describes a job. Each option has three spellings that resolve with this
precedence (highest first):

1. a command-line flag (``--worker_num 4`` or ``--worker-num 4``),
2. an environment variable ``FTRUN_<OPTION>`` (``FTRUN_WORKER_NUM=4``),
3. a TOML key (``worker_num = 4``) in the ``--config FILE`` file, else in ``[tool.ftrun]`` of
   ``./pyproject.toml``,
4. the default.

Fault-tolerance switches use MindSpore's ``MS_ENABLE_TFT`` form, e.g. ``'{ARF:1,TTP:1,UCE:1}'``
(separators may be commas or spaces; ``FTRUN_TFT`` wins over ``MS_ENABLE_TFT``). As in MindSpore,
UCE and ARF imply TTP. With no switch given anywhere, ARF is on.

Every error a user can cause raises :class:`ConfigError` whose message is one line naming the
problem and the fix; the CLI prints it and exits with code 2.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
import re
import shutil
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

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


@dataclass(frozen=True)
class Option:
    """One configurable option: its type, default and help, shared by CLI, env and TOML."""

    name: str
    type: type
    default: Any
    help: str


# The options that have a CLI flag, an FTRUN_<NAME> variable and a TOML key. Order = --help order.
OPTIONS: tuple[Option, ...] = (
    Option("worker_num", int, 1, "Total number of ranks in the job (all nodes)."),
    Option("local_worker_num", int, None, "Ranks on this node (default: worker_num). Alias: --nproc_per_node."),
    Option("master_addr", str, "127.0.0.1", "Address of node 0, which hosts the rendezvous store."),
    Option("master_port", int, 29500, "Port of the rendezvous store on node 0 (0: pick a free one, single node only)."),
    Option("node_rank", int, 0, "Index of this node, 0 .. nnodes-1."),
    Option("log_dir", str, "ftrun_logs", "Directory for worker_<rank>.log, supervisor.log and events.jsonl."),
    Option("join", bool, False, "Wait for every rank to exit on its own after the first rank fails (msrun --join)."),
    Option("cluster_time_out", float, 600.0, "Seconds to wait for all nodes and ranks to join the rendezvous."),
    Option("tail_worker_log", str, "-1", "Local ranks whose output is streamed to the console: -1 for all, '' for none, or e.g. '0,3'."),
    Option("max_restarts", int, 3, "Restart budget: each respawned rank or whole-job restart uses one."),
    Option("monitor_interval", float, 0.1, "Seconds between health checks of the ranks."),
    Option("grace_period", float, 5.0, "Seconds between SIGTERM and SIGKILL when stopping ranks."),
    Option("heartbeat_interval", float, 1.0, "Seconds between a rank's heartbeats to the supervisor."),
    Option("pg_timeout", float, 300.0, "Timeout in seconds of the process group's collectives (gloo/NCCL)."),
    Option("tft", str, None, "Fault-tolerance switches, e.g. '{ARF:1,TTP:1}' (also FTRUN_TFT / MS_ENABLE_TFT)."),
    Option("heartbeat_timeout", float, 5.0, "Seconds without a heartbeat after which a rank is declared hung (frozen) and replaced."),
    Option("step_timeout", float, 0.0, "Seconds without step progress after which the job is declared hung (0: computed from observed step times)."),
    Option("step_timeout_factor", float, 10.0, "Automatic step timeout: the largest observed step time times this factor."),
    Option("step_timeout_min", float, 3.0, "Automatic step timeout: never below this many seconds."),
    Option("warmup_steps", int, 3, "Steps per rank left out of the automatic step timeout (compilation, caches)."),
    Option("setup_timeout", float, 300.0, "Seconds a rank may take from its start to its first steps (imports, compilation, rendezvous)."),
    Option("warm_spares", int, 1, "Processes kept with torch already imported, to replace a failed rank faster (ARF; 0: none)."),
    Option("recoverable_errors", str, "", "More exception types repaired in place (UCE), e.g. 'torch.OutOfMemoryError,MyError'."),
    Option("checkpoint_dir", str, "ftrun_checkpoints", "Directory of checkpoints (periodic and dying-gasp)."),
    Option("save_steps", int, 0, "Write a checkpoint every N committed steps, in the background (0: never)."),
    Option("keep_checkpoints", int, 3, "Keep the newest K complete checkpoints (0: keep all)."),
    Option("resume", str, "auto", "Start from a checkpoint: 'auto' (the newest complete one, when TTP is on), a PATH, or 'none'."),
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
        master_addr, master_port: rendezvous store endpoint (node 0).
        node_rank: this node's index.
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
        warm_spares: processes kept with torch imported, to replace failed ranks faster.
        recoverable_errors: extra exception type names repaired in place (UCE).
        checkpoint_dir, save_steps, keep_checkpoints, resume: checkpoints (TTP).
        config_file: the TOML file the spec was read from, if any.
    """

    script: str
    script_args: tuple[str, ...] = ()
    module: bool = False
    no_python: bool = False
    worker_num: int = 1
    local_worker_num: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    node_rank: int = 0
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
    warm_spares: int = 1
    recoverable_errors: tuple[str, ...] = ()
    checkpoint_dir: str = "ftrun_checkpoints"
    save_steps: int = 0
    keep_checkpoints: int = 3
    resume: str = "auto"
    config_file: str | None = None

    @property
    def nnodes(self) -> int:
        """Number of nodes (worker_num / local_worker_num)."""
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
        return data

    @classmethod
    def from_json(cls, data: Mapping[str, Any]) -> "JobSpec":
        """Rebuild a spec written by :meth:`to_json`."""
        values = dict(data)
        values["script_args"] = tuple(values["script_args"])
        if values["tail_worker_log"] is not None:
            values["tail_worker_log"] = tuple(values["tail_worker_log"])
        values["tft"] = TftSwitches(**values["tft"])
        values["recoverable_errors"] = tuple(values.get("recoverable_errors", ()))
        return cls(**values)


def _convert(opt: Option, value: Any, source: str) -> Any:
    """Convert a raw env/TOML/CLI value to the option's type, or raise ConfigError."""
    if value is None:
        return None
    try:
        if opt.type is bool:
            if isinstance(value, bool):
                return value
            text = str(value).strip().lower()
            if text in ("1", "true", "yes", "on"):
                return True
            if text in ("0", "false", "no", "off"):
                return False
            raise ValueError(text)
        if opt.type is int:
            if isinstance(value, bool) or (isinstance(value, float) and not value.is_integer()):
                raise ValueError(value)
            return int(str(value).strip()) if isinstance(value, str) else int(value)
        if opt.type is float:
            if isinstance(value, bool):
                raise ValueError(value)
            return float(value)
        if opt.name == "tft" and isinstance(value, dict):
            return "{" + ",".join(f"{k}:{int(bool(v))}" for k, v in value.items()) + "}"
        return str(value)
    except (TypeError, ValueError):
        kind = {bool: "true or false", int: "an integer", float: "a number"}.get(opt.type, "a string")
        raise ConfigError(f"{source}: {value!r} is not valid for {opt.name}; it must be {kind}") from None


def read_toml(path: Path, *, section: tuple[str, ...] = ()) -> dict[str, Any]:
    """Read ftrun options from a TOML file.

    Args:
        path: the file.
        section: nested table holding the options (``("tool", "ftrun")`` for pyproject.toml);
            empty for a dedicated file, where a top-level ``[ftrun]`` table is also accepted.

    Raises:
        ConfigError: unreadable file, invalid TOML, or an unknown key.
    """
    try:
        with open(path, "rb") as fh:
            data = tomllib.load(fh)
    except OSError as err:
        raise ConfigError(f"cannot read config file {path}: {err.strerror}; check the --config path") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(f"config file {path} is not valid TOML ({err}); fix the syntax") from None
    for key in section:
        data = data.get(key, {})
    if not section and set(data) == {"ftrun"} and isinstance(data["ftrun"], dict):
        data = data["ftrun"]
    where = f"{path}" + (f" [{'.'.join(section)}]" if section else "")
    out: dict[str, Any] = {}
    for key, value in data.items():
        name = key.replace("-", "_")
        if name not in OPTIONS_BY_NAME:
            raise ConfigError(
                f"unknown key {key!r} in {where}; known keys: " + ", ".join(OPTIONS_BY_NAME)
            )
        out[name] = _convert(OPTIONS_BY_NAME[name], value, f"{where} key {key}")
    return out


def read_env(environ: Mapping[str, str]) -> dict[str, Any]:
    """Read ``FTRUN_<OPTION>`` variables (empty values are ignored).

    Raises:
        ConfigError: a value of the wrong type.
    """
    out: dict[str, Any] = {}
    for opt in OPTIONS:
        raw = environ.get(f"FTRUN_{opt.name.upper()}")
        if raw is not None and raw.strip() != "":
            out[opt.name] = _convert(opt, raw, f"FTRUN_{opt.name.upper()}")
    if "tft" not in out and environ.get("MS_ENABLE_TFT", "").strip():
        out["tft"] = environ["MS_ENABLE_TFT"]
        out["_tft_source"] = "MS_ENABLE_TFT"
    return out


def parse_tail(text: str, local_worker_num: int) -> tuple[int, ...] | None:
    """Parse ``--tail_worker_log``: ``-1`` means all local ranks (returns None), ``''`` none.

    Raises:
        ConfigError: not a list of local ranks.
    """
    text = text.strip()
    if text == "-1":
        return None
    ranks: list[int] = []
    for part in filter(None, re.split(r"[,\s]+", text)):
        if not part.isdigit() or int(part) >= local_worker_num:
            raise ConfigError(
                f"--tail_worker_log {text!r}: {part!r} is not a local rank 0..{local_worker_num - 1}; "
                "give -1 for all, or a comma-separated list"
            )
        ranks.append(int(part))
    return tuple(ranks)


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
) -> JobSpec:
    """Resolve a :class:`JobSpec` from CLI values (None = not given), env, TOML and defaults.

    Args:
        cli: option name -> value from the command line, None where the flag was not given.
        script: the script, module or program to run.
        script_args: its arguments.
        module, no_python: how to run it.
        config_file: ``--config`` path; when None, ``[tool.ftrun]`` of ``cwd/pyproject.toml`` is used.
        environ: the environment (default ``os.environ``).
        cwd: directory searched for pyproject.toml (default the current one).

    Raises:
        ConfigError: any invalid value, with one line naming it and the fix.
    """
    environ = os.environ if environ is None else environ
    cwd = Path.cwd() if cwd is None else cwd
    if config_file is not None:
        from_toml = read_toml(Path(config_file))
    elif (cwd / "pyproject.toml").is_file():
        from_toml = read_toml(cwd / "pyproject.toml", section=("tool", "ftrun"))
    else:
        from_toml = {}
    from_env = read_env(environ)
    tft_source = from_env.pop("_tft_source", "FTRUN_TFT")
    values: dict[str, Any] = {}
    sources: dict[str, str] = {}
    for opt in OPTIONS:
        for layer, source in ((cli, f"--{opt.name}"), (from_env, f"FTRUN_{opt.name.upper()}"), (from_toml, "config")):
            if layer.get(opt.name) is not None:
                values[opt.name] = _convert(opt, layer[opt.name], source)
                sources[opt.name] = tft_source if (opt.name == "tft" and layer is from_env) else source
                break
        else:
            values[opt.name] = opt.default

    if not script:
        raise ConfigError("no script given; usage: ftrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]")
    if module and no_python:
        raise ConfigError("-m/--module and --no_python cannot be used together; pick one")
    worker_num = values["worker_num"]
    if "worker_num" not in sources and values["local_worker_num"] is not None:
        worker_num = values["local_worker_num"]  # torchrun style: --nproc_per_node alone sets the world
    if worker_num < 1:
        raise ConfigError(f"--worker_num must be at least 1, got {worker_num}")
    local = values["local_worker_num"]
    local = worker_num if local is None else local
    if local < 1:
        raise ConfigError(f"--local_worker_num must be at least 1, got {local}")
    if local > worker_num:
        raise ConfigError(
            f"--local_worker_num {local} is larger than --worker_num {worker_num}; "
            "a node cannot run more ranks than the job has"
        )
    if worker_num % local:
        raise ConfigError(
            f"--worker_num {worker_num} is not a multiple of --local_worker_num {local}; "
            "every node runs the same number of ranks"
        )
    nnodes = worker_num // local
    if not 0 <= values["node_rank"] < nnodes:
        raise ConfigError(f"--node_rank {values['node_rank']} is outside 0..{nnodes - 1} for {nnodes} node(s)")
    port = values["master_port"]
    if not 0 <= port <= 65535:
        raise ConfigError(f"--master_port {port} is not a TCP port; use 1..65535 (or 0 to pick a free one)")
    if port == 0 and nnodes > 1:
        raise ConfigError("--master_port 0 (pick a free port) works on one node only; give a fixed port")
    for name in ("cluster_time_out", "monitor_interval", "heartbeat_interval", "pg_timeout", "heartbeat_timeout",
                 "step_timeout_min", "setup_timeout"):
        if values[name] <= 0:
            raise ConfigError(f"--{name} must be a positive number of seconds, got {values[name]}")
    if values["grace_period"] < 0:
        raise ConfigError(f"--grace_period must be >= 0 seconds, got {values['grace_period']}")
    if values["max_restarts"] < 0:
        raise ConfigError(f"--max_restarts must be >= 0, got {values['max_restarts']}")
    if values["heartbeat_timeout"] <= values["heartbeat_interval"]:
        raise ConfigError(
            f"--heartbeat_timeout {values['heartbeat_timeout']:g} must be longer than --heartbeat_interval "
            f"{values['heartbeat_interval']:g}; a few intervals (e.g. 5 x) avoid false alarms"
        )
    if values["step_timeout"] < 0:
        raise ConfigError(f"--step_timeout must be >= 0 seconds (0: automatic), got {values['step_timeout']}")
    if values["step_timeout_factor"] < 1:
        raise ConfigError(f"--step_timeout_factor must be at least 1, got {values['step_timeout_factor']}")
    for name in ("warmup_steps", "save_steps", "keep_checkpoints", "warm_spares"):
        if values[name] < 0:
            raise ConfigError(f"--{name} must be >= 0, got {values[name]}")
    recoverable = tuple(n.strip() for n in values["recoverable_errors"].split(",") if n.strip())
    for name in recoverable:
        if not re.fullmatch(r"[A-Za-z_][\w.]*", name):
            raise ConfigError(f"--recoverable_errors: {name!r} is not an exception type name; write e.g. 'torch.OutOfMemoryError'")
    resume = values["resume"].strip()
    if not resume:
        raise ConfigError("--resume is empty; use 'auto', 'none' or the path of a checkpoint")
    tft = TftSwitches() if values["tft"] is None else parse_tft(values["tft"], sources.get("tft", "FTRUN_TFT"))
    check_script(script, module, no_python)
    return JobSpec(
        script=script,
        script_args=tuple(script_args),
        module=module,
        no_python=no_python,
        worker_num=worker_num,
        local_worker_num=local,
        master_addr=values["master_addr"],
        master_port=port,
        node_rank=values["node_rank"],
        log_dir=values["log_dir"],
        join=values["join"],
        cluster_time_out=values["cluster_time_out"],
        tail_worker_log=parse_tail(values["tail_worker_log"], local),
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
        warm_spares=values["warm_spares"],
        recoverable_errors=recoverable,
        checkpoint_dir=values["checkpoint_dir"],
        save_steps=values["save_steps"],
        keep_checkpoints=values["keep_checkpoints"],
        resume=resume,
        config_file=config_file,
    )
