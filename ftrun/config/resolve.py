"""One :class:`~ftrun.config.options.JobSpec` from every layer: :func:`resolve`.

Each option's value comes from, highest first: the command line (with torchrun's flags, at the
same level), ``FTRUN_<OPTION>``, TOML, a cluster's environment, the default (docs/reference/cli.md, section
Options). Then the combination is checked (sizes, node index, ports, addresses, the checkpoint
directory, ``FTRUN_FAULT``, the job's secret), each error one line naming its source."""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any, Callable, Mapping

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
from ftrun.config.options import MAX_WORLD_SIZE, OPTIONS, OPTIONS_BY_NAME, STANDBY_SPARES, ConfigError, JobSpec, TftSwitches
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
    torchrun.check_start(module, no_python)
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
    is_host = apply_torchrun(torchrun, from_cli, labels, warnings)

    values: dict[str, Any] = {}
    for opt in OPTIONS:
        if opt.name in from_cli:
            values[opt.name] = from_cli[opt.name]
        elif opt.name in from_env:
            values[opt.name] = from_env[opt.name]
            labels[opt.name] = tft_source if opt.name == "tft" else opt.env_var
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
    min_nodes = parse_nnodes(values["nnodes"], label("nnodes"))[0] if values["nnodes"] is not None else nnodes
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
    standby_spares = values["standby_spares"].strip().lower()
    if standby_spares not in STANDBY_SPARES:
        raise ConfigError(f"{label('standby_spares')} {values['standby_spares']!r} must be 'hot', 'warm' or 'none'")
    resume = values["resume"].strip()
    if not resume:
        raise ConfigError(f"{label('resume')} is empty; use 'auto', 'none' or the path of a checkpoint")
    for name in ("log_dir", "checkpoint_dir"):
        if not values[name].strip():
            raise ConfigError(f"{label(name)} is empty; give a directory")
    run_id = _printable(values["run_id"], label("run_id"), "job-42")
    role = _printable(values["role"], label("role"), "trainer")
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
    metrics_addr = values["metrics_addr"]
    if metrics_addr is not None:
        metrics_addr = check_address(metrics_addr, label("metrics_addr")) if metrics_addr.strip() else None
    fault_text = environ.get("FTRUN_FAULT", "")
    if fault_text.strip():
        check_faults(fault_text, worker_num)
    check_script(script, module, no_python)
    if tft.ttp:
        check_writable_dir(values["checkpoint_dir"], label("checkpoint_dir"), cwd, "checkpoints")
    # Every stored option as resolved, then the ones computed, checked or parsed above.
    chosen = {opt.name: values[opt.name] for opt in OPTIONS if opt.stored}
    chosen.update(
        worker_num=worker_num, local_worker_num=local, master_addr=master_addr, master_port=port, node_rank=node_rank,
        run_id=run_id, role=role, local_addr=local_addr, token_file=token_file, tail_worker_log=tail, tft=tft,
        recoverable_errors=recoverable, on_divergence=on_divergence, standby_spares=standby_spares, resume=resume, metrics_addr=metrics_addr,
    )
    spec = JobSpec(
        script=script,
        script_args=tuple(script_args),
        module=module,
        no_python=no_python,
        master_port_auto=nnodes == 1 and "master_port" not in given and port != 0,
        node_rank_auto=node_rank_auto,
        min_nodes=min_nodes,
        tft_explicit=values["tft"] is not None,
        config_file=config_file,
        warnings=tuple(warnings),
        **chosen,
    )
    read_job_token(spec, environ)  # a multi-node job needs a secret; a given one must be usable
    return spec



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
                f"{label('nnodes')} {values['nnodes'].strip()}: the world keeps {nodes} nodes' ranks (torchrun would "
                f"resize it); with {low} to {nodes} nodes present, an absent node's ranks run on the others until it "
                "joins (ARF)"
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
