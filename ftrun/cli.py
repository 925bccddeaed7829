"""``ftrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]``: the command line (typer).

Option names follow msrun (``--worker_num``, ``--local_worker_num``, ``--master_addr``,
``--master_port``, ``--node_rank``, ``--log_dir``, ``--join``, ``--cluster_time_out``,
``--tail_worker_log``) and torchrun where msrun has none (``--nproc_per_node``, ``--max_restarts``,
``--monitor_interval``, ``-m/--module``, ``--no_python``). Hyphenated spellings are accepted too.
Values are read as text and converted by :mod:`ftrun.config`, so a bad value from the command line,
the environment or TOML gets the same one-line error and exit code 2.
"""

from __future__ import annotations

import sys
from typing import List, Optional

import typer

from .config import OPTIONS, ConfigError, resolve

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
_ABORTS = _exception_types(("Abort",))

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
    return typer.Option(None, *_flags(name), help=opt.help + default + f" Env: FTRUN_{name.upper()}.", show_default=False)


@app.command()
def run(
    script: Optional[str] = typer.Argument(None, help="Training script (or module with -m, program with --no_python).", show_default=False),
    script_args: Optional[List[str]] = typer.Argument(None, help="Arguments passed to the script.", show_default=False),
    worker_num: Optional[str] = _opt("worker_num"),
    local_worker_num: Optional[str] = _opt("local_worker_num"),
    nproc_per_node: Optional[str] = typer.Option(None, *_flags("nproc_per_node"), help="torchrun's name for --local_worker_num.", show_default=False),
    master_addr: Optional[str] = _opt("master_addr"),
    master_port: Optional[str] = _opt("master_port"),
    node_rank: Optional[str] = _opt("node_rank"),
    log_dir: Optional[str] = _opt("log_dir"),
    join: Optional[str] = _opt("join"),
    cluster_time_out: Optional[str] = _opt("cluster_time_out"),
    tail_worker_log: Optional[str] = _opt("tail_worker_log"),
    max_restarts: Optional[str] = _opt("max_restarts"),
    monitor_interval: Optional[str] = _opt("monitor_interval"),
    grace_period: Optional[str] = _opt("grace_period"),
    heartbeat_interval: Optional[str] = _opt("heartbeat_interval"),
    pg_timeout: Optional[str] = _opt("pg_timeout"),
    tft: Optional[str] = _opt("tft"),
    heartbeat_timeout: Optional[str] = _opt("heartbeat_timeout"),
    step_timeout: Optional[str] = _opt("step_timeout"),
    step_timeout_factor: Optional[str] = _opt("step_timeout_factor"),
    step_timeout_min: Optional[str] = _opt("step_timeout_min"),
    warmup_steps: Optional[str] = _opt("warmup_steps"),
    setup_timeout: Optional[str] = _opt("setup_timeout"),
    warm_spares: Optional[str] = _opt("warm_spares"),
    recoverable_errors: Optional[str] = _opt("recoverable_errors"),
    checkpoint_dir: Optional[str] = _opt("checkpoint_dir"),
    save_steps: Optional[str] = _opt("save_steps"),
    keep_checkpoints: Optional[str] = _opt("keep_checkpoints"),
    resume: Optional[str] = _opt("resume"),
    module: bool = typer.Option(False, "-m", "--module", help="Run SCRIPT as a module (python -m)."),
    no_python: bool = typer.Option(False, *_flags("no_python"), help="Run SCRIPT as a program, not with Python."),
    config: Optional[str] = typer.Option(None, "--config", help="TOML file of options (default: [tool.ftrun] in ./pyproject.toml).", show_default=False),
    plain: bool = typer.Option(False, "--plain", help="Plain timestamped lines even on a terminal."),
) -> None:
    """Launch SCRIPT on --worker_num ranks; on a fault, respawn only the failed rank (ARF)."""
    if nproc_per_node is not None:
        if local_worker_num is not None and local_worker_num != nproc_per_node:
            raise ConfigError("--nproc_per_node and --local_worker_num disagree; give only one of them")
        local_worker_num = nproc_per_node
    cli_values = {
        "worker_num": worker_num,
        "local_worker_num": local_worker_num,
        "master_addr": master_addr,
        "master_port": master_port,
        "node_rank": node_rank,
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
        "warm_spares": warm_spares,
        "recoverable_errors": recoverable_errors,
        "checkpoint_dir": checkpoint_dir,
        "save_steps": save_steps,
        "keep_checkpoints": keep_checkpoints,
        "resume": resume,
    }
    spec = resolve(
        cli_values,
        script=script,
        script_args=tuple(script_args or ()),
        module=module,
        no_python=no_python,
        config_file=config,
    )
    if spec.resume.lower() not in ("auto", "none"):
        from .checkpoint import CheckpointError, resolve_resume

        try:
            resolve_resume(None, spec.resume, on_skip=lambda *_: None)
        except CheckpointError as err:
            raise ConfigError(f"--resume {spec.resume}: {err}; give a checkpoint directory, 'auto' or 'none'") from None
    from .console import make_console
    from .launcher import Launcher

    console = make_console(f"ftrun: {spec.script} on {spec.worker_num} rank(s)", force_plain=plain)
    raise SystemExit(Launcher(spec, console).run())


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the CLI; user errors print one line and exit 2."""
    command = typer.main.get_command(app)
    try:
        command.main(args=argv if argv is not None else sys.argv[1:], prog_name="ftrun", standalone_mode=False)
    except ConfigError as err:
        print(f"ftrun: error: {err}", file=sys.stderr)
        sys.exit(2)
    except _CLICK_ERRORS as err:  # unknown option, missing value...: typer's vendored click or click
        print(f"ftrun: error: {err.format_message()} (see ftrun --help)", file=sys.stderr)
        sys.exit(2)
    except (KeyboardInterrupt, *_ABORTS):
        sys.exit(130)

if __name__ == "__main__":
    main()
