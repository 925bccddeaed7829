"""``ftrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]``: the command line (typer).

Option names follow msrun (``--worker_num``, ``--local_worker_num``, ``--master_addr``,
``--master_port``, ``--node_rank``, ``--log_dir``, ``--join``, ``--cluster_time_out``,
``--tail_worker_log``) and torchrun where msrun has none (``--nproc_per_node``, ``--max_restarts``,
``--monitor_interval``, ``-m/--module``, ``--no_python``). Hyphenated spellings are accepted too.
torchrun's whole command line is accepted as well (``--nnodes``, ``--standalone``, ``--rdzv-backend``,
``--rdzv-endpoint``, ``--rdzv-id``, ``--rdzv-conf``, ``--local-addr``, ``--run-path``, ``-r``, ``-t``,
``--local-ranks-filter``, ``--shutdown-timeout``), and the torchrun flags ftrun does not implement are
refused by name with the reason. Values are read as text and converted by :mod:`ftrun.config`, so a
bad value from the command line, the environment or TOML gets the same one-line error and exit code 2.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, List, Optional

import typer

from .config import OPTIONS, ConfigError, TorchrunFlags, count_local_devices, resolve

def _exception_types(names: tuple[str, ...]) -> tuple[type[BaseException], ...]:
    """The named exception classes of click and of typer's vendored copy of click, where present
    (recent typer releases ship their own copy and do not depend on click)."""
    import importlib

    modules = []
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            modules.append(importlib.import_module(name))
        except ImportError:
            pass
    found = {getattr(m, n) for m in modules for n in names if isinstance(getattr(m, n, None), type)}
    return tuple(found)


_CLICK_ERRORS = _exception_types(("ClickException",))
_NO_SUCH_OPTION = _exception_types(("NoSuchOption",))
_ABORTS = _exception_types(("Abort",))

# torchrun flags ftrun does not implement, and why (both spellings are looked up).
UNSUPPORTED_TORCHRUN_FLAGS: dict[str, str] = {
    "--start-method": "ranks are always started as new processes running a fresh interpreter, as torchrun's "
    "default 'spawn'",
    "--role": "every rank has the role 'default' (ROLE_NAME)",
    "--event-log-handler": "ftrun writes its events to LOG_DIR/events.jsonl",
    "--logs-specs": "ftrun writes each rank's output to LOG_DIR/worker_<rank>.log",
    "--duplicate-stdout-filters": "each rank's output is in LOG_DIR/worker_<rank>.log; filter that file",
    "--duplicate-stderr-filters": "each rank's output is in LOG_DIR/worker_<rank>.log; filter that file",
    "--numa-binding": "ranks are not bound to CPUs; bind them in the script (os.sched_setaffinity) if needed",
    "--signals-to-handle": "ftrun forwards SIGINT and SIGTERM to the ranks",
    "--virtual-local-rank": "LOCAL_RANK is always the rank's index on its node",
}

app = typer.Typer(
    add_completion=False,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]},
)


def _flags(name: str) -> list[str]:
    flags = [f"--{name}"]
    if "_" in name:
        flags.append(f"--{name.replace('_', '-')}")
    return flags


def _opt(name: str) -> typer.models.OptionInfo:
    opt = next(o for o in OPTIONS if o.name == name)
    default = "" if opt.default is None else f" [default: {str(opt.default).lower() if opt.type is bool else opt.default}]"
    bounds = f" Range: {opt.range_text()}." if opt.range_text() else ""
    return typer.Option(
        None,
        *_flags(name),
        help=opt.help + bounds + default + f" Env: FTRUN_{name.upper()}.",
        show_default=False,
    )


def _torchrun_opt(name: str, help: str, *short: str) -> typer.models.OptionInfo:
    return typer.Option(None, *short, *_flags(name), help=help + " (torchrun; command line only).", show_default=False)


def _same(first: Optional[str], first_flag: str, second: Optional[str], second_flag: str) -> Optional[str]:
    """Two flags with one meaning: the one given, or ConfigError if both are given and differ."""
    if first is not None and second is not None and first.strip() != second.strip():
        raise ConfigError(f"{first_flag} {first} and {second_flag} {second} disagree; give only one of them")
    return first if first is not None else second


@app.command()
def run(
    script: Optional[str] = typer.Argument(None, help="Training script (or module with -m, program with --no_python).", show_default=False),
    script_args: Optional[List[str]] = typer.Argument(None, help="Arguments passed to the script.", show_default=False),
    worker_num: Optional[str] = _opt("worker_num"),
    local_worker_num: Optional[str] = _opt("local_worker_num"),
    nproc_per_node: Optional[str] = typer.Option(None, *_flags("nproc_per_node"), help="torchrun's name for --local_worker_num; also auto, cpu, gpu or xpu (that many ranks as devices).", show_default=False),
    nnodes: Optional[str] = _opt("nnodes"),
    master_addr: Optional[str] = _opt("master_addr"),
    master_port: Optional[str] = _opt("master_port"),
    node_rank: Optional[str] = _opt("node_rank"),
    run_id: Optional[str] = _opt("run_id"),
    rdzv_id: Optional[str] = _torchrun_opt("rdzv_id", "The run id: same as --run_id"),
    local_addr: Optional[str] = _opt("local_addr"),
    token_file: Optional[str] = _opt("token_file"),
    standalone: bool = typer.Option(False, "--standalone", help="Single-node job: the store on 127.0.0.1 on a free port (torchrun)."),
    rdzv_backend: Optional[str] = _torchrun_opt("rdzv_backend", "c10d or static: both mean ftrun's own store on node 0"),
    rdzv_endpoint: Optional[str] = _torchrun_opt("rdzv_endpoint", "HOST[:PORT] of node 0's store ([ADDR]:PORT for IPv6; port 29400 by default): sets --master_addr/--master_port"),
    rdzv_conf: Optional[str] = _torchrun_opt("rdzv_conf", "KEY=VALUE,...: is_host, join_timeout or timeout (set --cluster_time_out); read_timeout, last_call_timeout, close_timeout are accepted and ignored"),
    run_path: bool = typer.Option(False, *_flags("run_path"), help="Run SCRIPT as a Python file (torchrun runs it with runpy.run_path; so does ftrun's default)."),
    redirects: Optional[str] = _torchrun_opt("redirects", "0-3 or e.g. 0:3,1:1; ftrun always writes every rank's output to LOG_DIR/worker_<rank>.log, so this only decides with --tee which local ranks reach the console (3 without --tee: none)", "-r"),
    tee: Optional[str] = _torchrun_opt("tee", "0-3 or e.g. 0:3,1:1: local ranks whose output is also shown on the console", "-t"),
    local_ranks_filter: Optional[str] = _torchrun_opt("local_ranks_filter", "e.g. 0,1: only these local ranks on the console"),
    log_dir: Optional[str] = _opt("log_dir"),
    join: Optional[str] = _opt("join"),
    cluster_time_out: Optional[str] = _opt("cluster_time_out"),
    tail_worker_log: Optional[str] = _opt("tail_worker_log"),
    max_restarts: Optional[str] = _opt("max_restarts"),
    monitor_interval: Optional[str] = _opt("monitor_interval"),
    grace_period: Optional[str] = _opt("grace_period"),
    shutdown_timeout: Optional[str] = _torchrun_opt("shutdown_timeout", "Same as --grace_period"),
    heartbeat_interval: Optional[str] = _opt("heartbeat_interval"),
    pg_timeout: Optional[str] = _opt("pg_timeout"),
    tft: Optional[str] = _opt("tft"),
    heartbeat_timeout: Optional[str] = _opt("heartbeat_timeout"),
    step_timeout: Optional[str] = _opt("step_timeout"),
    step_timeout_factor: Optional[str] = _opt("step_timeout_factor"),
    step_timeout_min: Optional[str] = _opt("step_timeout_min"),
    warmup_steps: Optional[str] = _opt("warmup_steps"),
    setup_timeout: Optional[str] = _opt("setup_timeout"),
    node_wait_timeout: Optional[str] = _opt("node_wait_timeout"),
    warm_spares: Optional[str] = _opt("warm_spares"),
    hot_spares: Optional[str] = _opt("hot_spares"),
    recoverable_errors: Optional[str] = _opt("recoverable_errors"),
    on_divergence: Optional[str] = _opt("on_divergence"),
    checkpoint_dir: Optional[str] = _opt("checkpoint_dir"),
    save_steps: Optional[str] = _opt("save_steps"),
    keep_checkpoints: Optional[str] = _opt("keep_checkpoints"),
    resume: Optional[str] = _opt("resume"),
    metrics_port: Optional[str] = _opt("metrics_port"),
    metrics_addr: Optional[str] = _opt("metrics_addr"),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module (python -m)."),
    no_python: bool = typer.Option(False, *_flags("no_python"), help="Run SCRIPT as a program, not with Python."),
    config: Optional[str] = typer.Option(None, "--config", help="TOML file of options (default: [tool.ftrun] in ./pyproject.toml).", show_default=False),
    plain: bool = typer.Option(False, "--plain", help="Plain timestamped lines even on a terminal."),
) -> None:
    """Launch SCRIPT on --worker_num ranks; on a fault, respawn only the failed rank (ARF).

    Also: `ftrun status [--log_dir DIR] [--watch]` shows a running or finished job; `ftrun report
    LOG_DIR [--plot FILE.png]` summarises a run; `ftrun check SCRIPT [ARGS]` tells whether SCRIPT is exactly-once under ftrun (a script named status, report or check runs as ./status)."""
    if nproc_per_node is not None and not nproc_per_node.strip().isdigit():
        nproc_per_node = str(count_local_devices(nproc_per_node))  # torchrun's auto, cpu, gpu, xpu
    local_worker_num = _same(nproc_per_node, "--nproc_per_node", local_worker_num, "--local_worker_num")
    run_id = _same(rdzv_id, "--rdzv-id", run_id, "--run_id")
    grace_period = _same(shutdown_timeout, "--shutdown-timeout", grace_period, "--grace_period")
    if run_path and (module or no_python):
        raise ConfigError("--run-path runs SCRIPT as a Python file; it cannot be combined with -m/--module or --no_python")
    cli_values = {
        "worker_num": worker_num,
        "local_worker_num": local_worker_num,
        "nnodes": nnodes,
        "master_addr": master_addr,
        "master_port": master_port,
        "node_rank": node_rank,
        "run_id": run_id,
        "local_addr": local_addr,
        "token_file": token_file,
        "log_dir": log_dir,
        "join": join,
        "cluster_time_out": cluster_time_out,
        "tail_worker_log": tail_worker_log,
        "max_restarts": max_restarts,
        "monitor_interval": monitor_interval,
        "grace_period": grace_period,
        "heartbeat_interval": heartbeat_interval,
        "pg_timeout": pg_timeout,
        "tft": tft,
        "heartbeat_timeout": heartbeat_timeout,
        "step_timeout": step_timeout,
        "step_timeout_factor": step_timeout_factor,
        "step_timeout_min": step_timeout_min,
        "warmup_steps": warmup_steps,
        "setup_timeout": setup_timeout,
        "node_wait_timeout": node_wait_timeout,
        "warm_spares": warm_spares,
        "hot_spares": hot_spares,
        "recoverable_errors": recoverable_errors,
        "on_divergence": on_divergence,
        "checkpoint_dir": checkpoint_dir,
        "save_steps": save_steps,
        "keep_checkpoints": keep_checkpoints,
        "resume": resume,
        "metrics_port": metrics_port,
        "metrics_addr": metrics_addr,
    }
    spec = resolve(
        cli_values,
        script=script,
        script_args=tuple(script_args or ()),
        module=module,
        no_python=no_python,
        config_file=config,
        torchrun=TorchrunFlags(
            standalone=standalone,
            rdzv_backend=rdzv_backend,
            rdzv_endpoint=rdzv_endpoint,
            rdzv_conf=rdzv_conf,
            redirects=redirects,
            tee=tee,
            local_ranks_filter=local_ranks_filter,
        ),
    )
    if spec.resume.lower() not in ("auto", "none"):
        from .checkpoint import CheckpointError, resolve_resume

        try:
            resolve_resume(None, spec.resume, on_skip=lambda *_: None)
        except CheckpointError as err:
            raise ConfigError(f"--resume {spec.resume}: {err}; give a checkpoint directory, 'auto' or 'none'") from None
    if spec.metrics_port and spec.node_rank == 0 and not spec.node_rank_auto:
        _check_metrics_endpoint(spec)
    from .console import make_console
    from .launcher import Launcher

    console = make_console(f"ftrun: {spec.script} on {spec.worker_num} rank(s)", force_plain=plain)
    raise SystemExit(Launcher(spec, console).run())


def _check_metrics_endpoint(spec: Any) -> None:
    """Refuse a metrics endpoint that cannot be served, before any rank starts.

    Raises:
        ConfigError: the port is the store's, is taken, or the address is not this host's.
    """
    if spec.metrics_port == spec.master_port:
        raise ConfigError(f"--metrics_port {spec.metrics_port} is also --master_port (the rendezvous store's); "
                          "give the metrics another port")
    from .metrics import MetricsError, check_endpoint, metrics_bind_address

    try:
        check_endpoint(metrics_bind_address(spec.metrics_addr, spec.master_addr, spec.nnodes), spec.metrics_port)
    except MetricsError as err:
        raise ConfigError(str(err)) from None


# --------------------------------------------------------------------------- ftrun status, ftrun report

status_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                         context_settings={"help_option_names": ["-h", "--help"]})


@status_app.command()
def status(
    log_dir: Optional[str] = typer.Option(None, *_flags("log_dir"), help="The job's log directory (default: "
                                          "FTRUN_LOG_DIR, log_dir in [tool.ftrun] of ./pyproject.toml, or ftrun_logs).",
                                          show_default=False),
    watch: bool = typer.Option(False, "--watch", "-w", help="Keep showing the job until it ends."),
    plain: bool = typer.Option(False, "--plain", help="Plain lines even on a terminal."),
) -> None:
    """Show a job's ranks, progress, goodput and faults, read from its log directory. Exit code: 0 when it
    runs or succeeded, its exit code when it failed (1 when it ended without a final status), 2 when there
    is no job."""
    from .status import resolve_log_dir, show

    raise SystemExit(show(resolve_log_dir(log_dir), watch=watch, plain=True if plain else None))


report_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                         context_settings={"help_option_names": ["-h", "--help"]})


@report_app.command()
def report(
    log_dir: Optional[str] = typer.Argument(None, help="The job's log directory (default: as ftrun status finds it).",
                                            show_default=False),
    plot: Optional[str] = typer.Option(None, "--plot", help="Also draw the timeline (step against time per rank, "
                                       "faults and recoveries marked) into this PNG file.", show_default=False),
) -> None:
    """Summarise a run from its events.jsonl: the faults and recoveries on a timeline with their cost
    (detection, respawn, rebuild, transfer), goodput, checkpoints, and the root cause of a failure."""
    from .report import ReportError, format_report, load_report, plot_timeline
    from .status import resolve_log_dir

    if plot is not None:
        target = Path(plot)
        if target.suffix.lower() != ".png":
            raise ConfigError(f"--plot {plot}: the plot is a PNG; give a file name ending in .png")
        if not target.parent.is_dir():
            raise ConfigError(f"--plot {plot}: directory {target.parent} does not exist")
    directory = Path(log_dir) if log_dir else resolve_log_dir(None)
    if log_dir and not directory.is_dir():
        raise ReportError(f"{log_dir} is not a directory; give the job's --log_dir")
    loaded = load_report(directory)
    for problem in loaded.problems:
        print(f"ftrun: {problem}", file=sys.stderr)
    print("\n".join(format_report(loaded)))
    if plot is not None:
        plot_timeline(loaded, Path(plot))
        print(f"timeline plot written to {plot}")


check_app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, rich_markup_mode=None,
                        context_settings={"allow_interspersed_args": False, "help_option_names": ["-h", "--help"]})


@check_app.command()
def check(
    script: str = typer.Argument(..., help="The training script (it uses the worker library).", show_default=False),
    script_args: Optional[List[str]] = typer.Argument(None, help="Arguments passed to the script.", show_default=False),
    worker_num: int = typer.Option(2, *_flags("worker_num"), help="Ranks per run (at least 2)."),
    timeout: float = typer.Option(600.0, "--timeout", help="Seconds each run may take."),
    keep: Optional[str] = typer.Option(None, "--keep", help="Keep every run's logs and traces in this directory.",
                                       show_default=False),
) -> None:
    """Tell whether SCRIPT is exactly-once under ftrun: a fault-free run, then runs with a rank killed
    mid-epoch in the all-reduce, after an epoch's last step, before an epoch's first step and inside a
    section; each must end with the same parameters. If one does not: the step and parameter tensor
    where it first differs, and the likely cause. Exit code 0: exactly-once; 1: not; 2: it did not run."""
    from .check import check as run_check

    if worker_num < 2:
        raise ConfigError(f"--worker_num {worker_num}: a check needs at least 2 ranks (a replacement takes its state from a replica)")
    if not Path(script).is_file():
        raise ConfigError(f"{script}: no such script")
    raise SystemExit(run_check(script, list(script_args or ()), world=worker_num, timeout=timeout, keep=keep))


SUBCOMMANDS = {"status": status_app, "report": report_app, "check": check_app}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the CLI; user errors print one line and exit 2.

    ``ftrun status ...``, ``ftrun report ...`` and ``ftrun check ...`` are subcommands when the first
    argument is exactly ``status``, ``report`` or ``check``; a script of that name runs as ``ftrun ./status``.
    """
    from .report import ReportError

    args = list(argv if argv is not None else sys.argv[1:])
    if args and args[0] in SUBCOMMANDS:
        command, prog, args = typer.main.get_command(SUBCOMMANDS[args[0]]), f"ftrun {args[0]}", args[1:]
    else:
        command, prog = typer.main.get_command(app), "ftrun"
    try:
        command.main(args=args, prog_name=prog, standalone_mode=False)
    except (ConfigError, ReportError) as err:
        print(f"ftrun: error: {err}", file=sys.stderr)
        sys.exit(2)
    except _NO_SUCH_OPTION as err:
        name = str(getattr(err, "option_name", "") or "")
        reason = UNSUPPORTED_TORCHRUN_FLAGS.get(name.replace("_", "-"))
        if reason is None:
            print(f"ftrun: error: {' '.join(err.format_message().split())} (see ftrun --help)", file=sys.stderr)
        else:
            print(f"ftrun: error: ftrun does not support torchrun's {name}: {reason}; remove the flag", file=sys.stderr)
        sys.exit(2)
    except _CLICK_ERRORS as err:  # unknown option, missing value...: typer's vendored click or click
        print(f"ftrun: error: {' '.join(err.format_message().split())} (see ftrun --help)", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, *_ABORTS):
        sys.exit(130)

if __name__ == "__main__":
    main()
