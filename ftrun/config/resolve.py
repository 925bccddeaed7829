"""One :class:`~ftrun.config.options.JobSpec` from every layer: :func:`resolve`.

Each option's value comes from, highest first: the command line (with torchrun's flags, at the
same level), ``FTRUN_<OPTION>``, TOML, a cluster's environment, the default (docs/reference/cli.md, section
Options). Then the combination is checked (sizes, node index, ports, addresses, the checkpoint
directory, ``FTRUN_FAULT``, the job's secret), each error one line naming its source."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

from ftrun.config.checks import (
    check_address,
    check_faults,
    check_script,
    check_writable_dir,
    convert_text,
    parse_nnodes,
    parse_tail,
    parse_tft,
    read_job_token,
)
from ftrun.config.options import (MAX_WORLD_SIZE, OPTIONS, OPTIONS_BY_NAME, STANDBY_SPARES, ConfigError, JobSpec, TftSwitches,
                                  relay_fits)
from ftrun.config.sources import ClusterEnv, read_cluster_env, read_env, read_toml
from ftrun.config.torchrun import TorchrunFlags, apply_torchrun


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
        script, script_args: the script, module or program to run, and its arguments.
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
    torchrun.check_start(module, no_python)
    toml = _read_toml_layer(config_file, cwd)
    env = _read_env_layer(environ)
    cluster = read_cluster_env(environ)  # Slurm's or a PyTorchJob's: just above the defaults
    command_line = _read_command_line(cli)
    warnings: list[str] = []
    is_host = apply_torchrun(torchrun, command_line.values, command_line.labels, warnings)
    # Highest first: the command line (torchrun's flags too), FTRUN_<OPTION>, TOML, the cluster, the default.
    chosen = _first_given(command_line, env, toml, _Layer(cluster.values, cluster.labels))
    _check_how_to_run(script, module, no_python)
    shape = _place_node(chosen, cluster, torchrun, is_host, warnings)
    checked = {**_store_address(chosen, shape.nnodes), **_recovery_settings(chosen), **_names_and_paths(chosen, cwd)}
    checked["tft"] = TftSwitches() if chosen.values["tft"] is None else parse_tft(chosen.values["tft"], chosen.label("tft"))
    checked["tail_worker_log"] = _console_ranks(chosen, torchrun, "tail_worker_log" in command_line.values, shape)
    checked["metrics_addr"] = _metrics_address(chosen)
    fault_text = environ.get("FTRUN_FAULT", "")
    if fault_text.strip():
        check_faults(fault_text, shape.worker_num)
    check_script(script, module, no_python)
    if checked["tft"].ttp:
        check_writable_dir(chosen.values["checkpoint_dir"], chosen.label("checkpoint_dir"), cwd, "checkpoints")
    spec = _job_spec(chosen, shape, checked, script=script, script_args=script_args, module=module,
                     no_python=no_python, config_file=config_file, warnings=warnings)
    read_job_token(spec, environ)  # a multi-node job needs a secret; a given one must be usable
    return spec


# --------------------------------------------------------------------------- the layers and their precedence


@dataclass
class _Layer:
    """One source's options: option name -> value, and option name -> what gave it (a flag, a
    variable, a TOML key and file)."""

    values: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)


@dataclass
class _Chosen:
    """Every option's value from the highest layer that gives it, else its default; ``labels``
    holds what gave each option that some layer gives."""

    values: dict[str, Any] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)

    def given(self, name: str) -> bool:
        """Whether a layer gave the option (it is not at its default)."""
        return name in self.labels

    def label(self, name: str) -> str:
        """What gave the option, for errors (its flag when it is at its default)."""
        return self.labels.get(name, f"--{name}")

    def drop(self, name: str) -> None:
        """Put the option back at its default, as if no layer gave it."""
        self.values[name] = OPTIONS_BY_NAME[name].default
        self.labels.pop(name, None)


def _read_command_line(cli: Mapping[str, Any]) -> _Layer:
    """The options given on the command line (not None), converted and checked, labelled by flag."""
    layer = _Layer()
    for opt in OPTIONS:
        if cli.get(opt.name) is not None:
            layer.values[opt.name] = convert_text(opt, cli[opt.name], f"--{opt.name}")
            layer.labels[opt.name] = f"--{opt.name}"
    return layer


def _read_env_layer(environ: Mapping[str, str]) -> _Layer:
    """The ``FTRUN_<OPTION>`` variables (and ``MS_ENABLE_TFT`` for tft), labelled by variable."""
    values = read_env(environ)
    tft_source = values.pop("_tft_source", "FTRUN_TFT")
    labels = {name: tft_source if name == "tft" else OPTIONS_BY_NAME[name].env_var for name in values}
    return _Layer(values, labels)


def _read_toml_layer(config_file: str | None, cwd: Path) -> _Layer:
    """The ``--config`` file's options, else those of ``[tool.ftrun]`` in ``cwd/pyproject.toml``
    when that file exists, labelled by key and file."""
    if config_file is not None:
        where, values = config_file, read_toml(Path(config_file))
    elif (cwd / "pyproject.toml").is_file():
        where = f"{cwd / 'pyproject.toml'} [tool.ftrun]"
        values = read_toml(cwd / "pyproject.toml", section=("tool", "ftrun"))
    else:
        return _Layer()
    return _Layer(values, {name: f"{name} in {where}" for name in values})


def _first_given(*layers: _Layer) -> _Chosen:
    """Each option from the first of ``layers`` (highest first) that gives it, else its default."""
    chosen = _Chosen()
    for opt in OPTIONS:
        layer = next((layer for layer in layers if opt.name in layer.values), None)
        if layer is None:
            chosen.values[opt.name] = opt.default
        else:
            chosen.values[opt.name] = layer.values[opt.name]
            chosen.labels[opt.name] = layer.labels[opt.name]
    return chosen


# --------------------------------------------------------------------------- the combination, checked and derived


@dataclass(frozen=True)
class _Shape:
    """The job's size and this node's place in it."""

    worker_num: int
    local_worker_num: int
    nnodes: int
    min_nodes: int
    node_rank: int
    node_rank_auto: bool


def _check_how_to_run(script: str | None, module: bool, no_python: bool) -> None:
    """Refuse a missing script, and ``-m`` with ``--no_python``.

    Raises:
        ConfigError: either.
    """
    if not script:
        raise ConfigError("no script given; usage: ftrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]")
    if module and no_python:
        raise ConfigError("-m/--module and --no_python cannot be used together; pick one")


def _place_node(
    chosen: _Chosen, cluster: ClusterEnv, torchrun: TorchrunFlags, is_host: bool | None, warnings: list[str]
) -> _Shape:
    """The job's sizes and this node's index; the cluster's values that do not fit the job are
    dropped (:func:`_fit_cluster_env`).

    Raises:
        ConfigError: sizes that do not fit together, a node index outside the job or against
            ``--rdzv-conf is_host``, or ``--standalone`` with more than one node.
    """
    worker_num, local = _sizes(chosen, warnings)
    nnodes = worker_num // local
    nnodes_text = chosen.values["nnodes"]
    min_nodes = parse_nnodes(nnodes_text, chosen.label("nnodes"))[0] if nnodes_text is not None else nnodes
    _fit_cluster_env(cluster, nnodes, chosen, warnings)
    node_rank = _node_rank(chosen, is_host, nnodes)
    # No node index anywhere: decided at start, as torchrun's dynamic rendezvous does (node 0 where
    # the store can be hosted, else the next free index, else a vacant one of a lost node).
    node_rank_auto = nnodes > 1 and not chosen.given("node_rank") and is_host is None
    if torchrun.standalone and nnodes > 1:
        raise ConfigError(
            f"--standalone runs a single-node job, but {chosen.label('worker_num')} {worker_num} and "
            f"{chosen.label('local_worker_num')} {local} make {nnodes} nodes; drop --standalone or run one node"
        )
    return _Shape(worker_num, local, nnodes, min_nodes, node_rank, node_rank_auto)


def _node_rank(chosen: _Chosen, is_host: bool | None, nnodes: int) -> int:
    """This node's index: the chosen one, or 0 when ``--rdzv-conf is_host=1`` makes it the host.

    Raises:
        ConfigError: an index against ``is_host``, or outside 0..nnodes-1.
    """
    node_rank = chosen.values["node_rank"]
    if is_host is not None:
        if is_host and chosen.given("node_rank") and node_rank != 0:
            raise ConfigError(
                f"--rdzv-conf is_host=1 makes this node 0, but {chosen.label('node_rank')} is {node_rank}; give one"
            )
        if not is_host and (not chosen.given("node_rank") or node_rank == 0):
            raise ConfigError("--rdzv-conf is_host=0: this node does not host the store, so give its --node_rank (1 or more)")
        node_rank = 0 if is_host else node_rank
    if not 0 <= node_rank < nnodes:
        raise ConfigError(f"{chosen.label('node_rank')} {node_rank} is outside 0..{nnodes - 1} for {nnodes} node(s)")
    return node_rank


def _store_address(chosen: _Chosen, nnodes: int) -> dict[str, Any]:
    """master_addr and local_addr checked and resolved, and master_port (0, a free port, on one node only).

    Raises:
        ConfigError: port 0 in a multi-node job, or an address that does not resolve.
    """
    port = chosen.values["master_port"]
    if port == 0 and nnodes > 1:
        raise ConfigError(f"{chosen.label('master_port')} 0 (pick a free port) works on one node only; give a fixed port")
    master_addr = check_address(chosen.values["master_addr"], chosen.label("master_addr"))
    local_addr = chosen.values["local_addr"]
    if local_addr is not None:
        local_addr = check_address(local_addr, chosen.label("local_addr"))
    return {"master_addr": master_addr, "master_port": port, "local_addr": local_addr}


def _recovery_settings(chosen: _Chosen) -> dict[str, Any]:
    """How faults are seen and met: the heartbeat's timeout against its interval, and
    recoverable_errors, on_divergence, standby_spares, fork_server, heartbeat_relay and resume parsed.

    Raises:
        ConfigError: a timeout not longer than the interval, a name that is not an exception
            type's, or a word that is not one of the option's.
    """
    values, label = chosen.values, chosen.label
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
    standby_spares = values["standby_spares"].strip().lower()
    if standby_spares not in STANDBY_SPARES:
        raise ConfigError(f"{label('standby_spares')} {values['standby_spares']!r} must be 'hot', 'warm' or 'none'")
    fork_server = values["fork_server"].strip().lower()
    if fork_server not in ("on", "off"):
        raise ConfigError(f"{label('fork_server')} {values['fork_server']!r} must be 'on' or 'off'")
    heartbeat_relay = values["heartbeat_relay"].strip().lower()
    if heartbeat_relay not in ("auto", "on", "off"):
        raise ConfigError(f"{label('heartbeat_relay')} {values['heartbeat_relay']!r} must be 'auto', 'on' or 'off'")
    if heartbeat_relay == "on" and not relay_fits(values["heartbeat_timeout"], values["heartbeat_interval"]):
        raise ConfigError(
            f"{label('heartbeat_relay')} on needs {label('heartbeat_timeout')} above two heartbeat intervals (a relayed "
            f"beat arrives up to 1.5 intervals late), but it is {values['heartbeat_timeout']:g} with "
            f"{label('heartbeat_interval')} {values['heartbeat_interval']:g}; raise the timeout or use --heartbeat_relay off")
    resume = values["resume"].strip()
    if not resume:
        raise ConfigError(f"{label('resume')} is empty; use 'auto', 'none' or the path of a checkpoint")
    return {"recoverable_errors": recoverable, "on_divergence": on_divergence, "standby_spares": standby_spares,
            "fork_server": fork_server, "heartbeat_relay": heartbeat_relay, "resume": resume}


def _names_and_paths(chosen: _Chosen, cwd: Path) -> dict[str, Any]:
    """run_id and role checked, and token_file made absolute (from ``cwd``); log_dir and
    checkpoint_dir must not be empty.

    Raises:
        ConfigError: an empty directory or token file, or an id that is not printable ASCII.
    """
    for name in ("log_dir", "checkpoint_dir"):
        if not chosen.values[name].strip():
            raise ConfigError(f"{chosen.label(name)} is empty; give a directory")
    run_id = _printable(chosen.values["run_id"], chosen.label("run_id"), "job-42")
    role = _printable(chosen.values["role"], chosen.label("role"), "trainer")
    token_file = chosen.values["token_file"]
    if token_file is not None:
        if not token_file.strip():
            raise ConfigError(
                f"{chosen.label('token_file')} is empty; give the path of the file holding the job's secret"
            )
        token_file = str(Path(token_file) if Path(token_file).is_absolute() else cwd / token_file)
    return {"run_id": run_id, "role": role, "token_file": token_file}


def _console_ranks(
    chosen: _Chosen, torchrun: TorchrunFlags, tail_on_command_line: bool, shape: _Shape
) -> tuple[int, ...] | None:
    """The local ranks whose output reaches the console (None: all), from tail_worker_log or
    torchrun's ``--tee``/``--redirects``/``--local-ranks-filter``.

    Raises:
        ConfigError: both ways given on the command line, or a malformed value.
    """
    if torchrun.sets_console:
        if tail_on_command_line:
            raise ConfigError("--tail_worker_log and torchrun's --tee/--redirects/--local-ranks-filter both choose the "
                              "console's ranks; give one of them")
        return torchrun.console_ranks(shape.local_worker_num)
    return parse_tail(chosen.values["tail_worker_log"], shape.local_worker_num, chosen.label("tail_worker_log"))


def _metrics_address(chosen: _Chosen) -> str | None:
    """The metrics endpoint's address checked (None: none, also for a blank value).

    Raises:
        ConfigError: an address that does not resolve.
    """
    metrics_addr = chosen.values["metrics_addr"]
    if metrics_addr is None or not metrics_addr.strip():
        return None
    return check_address(metrics_addr, chosen.label("metrics_addr"))


def _job_spec(
    chosen: _Chosen, shape: _Shape, checked: Mapping[str, Any], *, script: str | None, script_args: tuple[str, ...],
    module: bool, no_python: bool, config_file: str | None, warnings: list[str],
) -> JobSpec:
    """The :class:`JobSpec`: every stored option as chosen, then the ones computed, checked or
    parsed from them (``shape`` and ``checked``)."""
    options = {opt.name: chosen.values[opt.name] for opt in OPTIONS if opt.stored}
    options.update(checked, worker_num=shape.worker_num, local_worker_num=shape.local_worker_num,
                   node_rank=shape.node_rank)
    return JobSpec(
        script=script,
        script_args=tuple(script_args),
        module=module,
        no_python=no_python,
        master_port_auto=shape.nnodes == 1 and not chosen.given("master_port") and checked["master_port"] != 0,
        node_rank_auto=shape.node_rank_auto,
        min_nodes=shape.min_nodes,
        tft_explicit=chosen.values["tft"] is not None,
        config_file=config_file,
        warnings=tuple(warnings),
        **options,
    )


def _printable(text: str | None, where: str, example: str) -> str | None:
    """An id as given (stripped): 1 to 256 printable ASCII characters, no spaces (None stays None).

    Raises:
        ConfigError: empty, too long, or holding spaces or other characters.
    """
    if text is None:
        return None
    if not re.fullmatch(r"[\x21-\x7e]{1,256}", text.strip()):
        raise ConfigError(f"{where} {text!r} must be 1 to 256 printable characters without spaces, e.g. {example}")
    return text.strip()


def _fit_cluster_env(cluster: ClusterEnv, nnodes: int, chosen: _Chosen, warnings: list[str]) -> None:
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
        return name in cluster.labels and chosen.labels.get(name) == cluster.labels[name]

    if from_cluster("node_rank") and cluster.nodes is not None and cluster.nodes != nnodes:
        warnings.append(
            f"{cluster.labels['node_rank']} is not used: the job has {nnodes} node(s), the {cluster.name} environment "
            f"{cluster.nodes}" + ("; this node's index is decided at start (a free or vacant one)" if nnodes > 1 else "")
        )
        chosen.drop("node_rank")
    if nnodes == 1:
        for name in ("master_addr", "master_port"):
            if from_cluster(name):
                chosen.drop(name)
    elif from_cluster("node_rank") and cluster.tasks_per_node is not None:
        tasks, step_nodes, names = cluster.tasks_per_node
        if tasks != step_nodes:
            raise ConfigError(
                f"Slurm runs {tasks} tasks on {step_nodes} node(s) ({names}), but ftrun is one launcher per node "
                "that starts the node's ranks itself; run it with srun --ntasks-per-node=1"
            )


def _sizes(chosen: _Chosen, warnings: list[str]) -> tuple[int, int]:
    """The job's (worker_num, local_worker_num) from worker_num, local_worker_num and nnodes.

    With ``nnodes`` (torchrun): worker_num = nnodes x local_worker_num (local_worker_num defaults
    to 1, or worker_num / nnodes when worker_num is given). Without it (msrun): local_worker_num
    defaults to worker_num, and a local_worker_num given alone sets worker_num.

    Raises:
        ConfigError: sizes that do not fit together.
    """
    values, label = chosen.values, chosen.label
    worker_num = values["worker_num"]
    local = values["local_worker_num"]
    if values["nnodes"] is not None:
        low, nodes = parse_nnodes(values["nnodes"], label("nnodes"))
        if low < nodes:
            warnings.append(
                f"{label('nnodes')} {values['nnodes'].strip()}: the world keeps {nodes} nodes' ranks (torchrun would "
                f"resize it); with {low} to {nodes} nodes present, an absent node's ranks run on the others until it "
                "joins (ARF)"
            )
        if local is None:
            if chosen.given("worker_num"):
                if worker_num % nodes:
                    raise ConfigError(
                        f"{label('worker_num')} {worker_num} cannot be split over {label('nnodes')} {nodes} nodes; "
                        "give a multiple of the node count, or --nproc_per_node"
                    )
                local = worker_num // nodes
            else:
                local = 1
        if chosen.given("worker_num") and worker_num != nodes * local:
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
    elif not chosen.given("worker_num") and local is not None:
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
