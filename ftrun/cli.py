"""``ftrun [OPTIONS] SCRIPT [SCRIPT_ARGS...]``: the command line (typer).

The ``run`` command's flags are built from the option table (:data:`ftrun.config.OPTIONS`, the
fields of :class:`~ftrun.config.JobSpec`): each option is ``--name`` and ``--name-with-hyphens``,
plus torchrun's name for it where it has one (``--nproc-per-node``, ``--rdzv-id``,
``--shutdown-timeout``); torchrun's own flags come from the fields of
:class:`~ftrun.config.TorchrunFlags` (``--standalone``, ``--rdzv-*``, ``--run-path``,
``--start-method``, ``-r``, ``-t``, ``--local-ranks-filter``). Option names follow msrun
(``--worker_num``, ``--master_addr``, ``--join``, ``--cluster_time_out``, ``--tail_worker_log``) and
torchrun where msrun has none. torchrun flags ftrun does not implement are refused by name with the
reason. Values are read as text and converted by :mod:`ftrun.config`, so a bad value from the
command line, the environment or TOML gets the same one-line error and exit code 2.
"""

from __future__ import annotations

import dataclasses
import inspect
import sys
from pathlib import Path
from typing import Any, List, Mapping, Optional

import typer

from ftrun.config import (
    OPTIONS,
    UNSUPPORTED_TORCHRUN_FLAGS,
    ConfigError,
    JobSpec,
    Option,
    TorchrunFlags,
    merge_aliases,
    resolve,
)

__all__ = ["UNSUPPORTED_TORCHRUN_FLAGS", "app", "main", "parse_command_line", "run", "spec_from_flags"]


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


def _option_help(opt: Option) -> str:
    """An option's ``--help`` text: its sentence, its range, its default and its variable."""
    default = "" if opt.default is None else f" [default: {str(opt.default).lower() if opt.type is bool else opt.default}]"
    bounds = f" Range: {opt.range_text()}." if opt.range_text() else ""
    return opt.help + bounds + default + f" Env: {opt.env_var}."


def _parameter(name: str, info: Any, annotation: Any) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=info, annotation=annotation)


def _run_parameters() -> list[inspect.Parameter]:
    """The ``run`` command's parameters: SCRIPT and its arguments, one flag per option (and its
    torchrun alias), one per torchrun flag, and the launcher's own switches. Every value is text
    (None: not given) that :func:`ftrun.config.resolve` converts."""
    params = [
        _parameter("script", typer.Argument(None, help="Training script (or module with -m, program with --no_python).",
                                            show_default=False), Optional[str]),
        _parameter("script_args", typer.Argument(None, help="Arguments passed to the script.", show_default=False),
                   Optional[List[str]]),
    ]
    for opt in OPTIONS:
        params.append(_parameter(opt.name, typer.Option(None, *_flags(opt.name), help=_option_help(opt),
                                                        show_default=False), Optional[str]))
        if opt.alias:
            help = f"torchrun's name for --{opt.name}{opt.alias_help} (command line only)."
            params.append(_parameter(opt.alias, typer.Option(None, *_flags(opt.alias), help=help, show_default=False),
                                     Optional[str]))
    for flag in dataclasses.fields(TorchrunFlags):
        help = flag.metadata["help"] + " (torchrun; command line only)."
        names = (*flag.metadata["short"], *_flags(flag.name))
        if flag.metadata["switch"]:
            params.append(_parameter(flag.name, typer.Option(False, *names, help=help), bool))
        else:
            params.append(_parameter(flag.name, typer.Option(None, *names, help=help, show_default=False),
                                     Optional[str]))
    params += [
        _parameter("module", typer.Option(False, "-m", "--module", help="Run SCRIPT as a module (python -m)."), bool),
        _parameter("no_python", typer.Option(False, *_flags("no_python"),
                                             help="Run SCRIPT as a program, not with Python."), bool),
        _parameter("config", typer.Option(None, "--config", help="TOML file of options (default: [tool.ftrun] in "
                                          "./pyproject.toml).", show_default=False), Optional[str]),
        _parameter("plain", typer.Option(False, "--plain", help="Plain timestamped lines even on a terminal."), bool),
    ]
    names = [param.name for param in params]
    if len(names) != len(set(names)):  # an option, an alias and a torchrun flag must not collide
        raise TypeError(f"two flags share a name: {sorted({n for n in names if names.count(n) > 1})}")
    return params


def spec_from_flags(given: Mapping[str, Any], *, environ: Mapping[str, str] | None = None,
                    cwd: Path | None = None) -> JobSpec:
    """The job the ``run`` command's parsed flags describe: torchrun's aliases folded in, torchrun's
    flags and every layer resolved (:func:`ftrun.config.resolve`).

    Args:
        given: parameter name -> value, as the command passes them (every parameter of
            :func:`_run_parameters`; None or False where a flag was not given).
        environ, cwd: as in :func:`ftrun.config.resolve` (default: this process's).

    Raises:
        ConfigError: any invalid value, in one line.
    """
    values = dict(given)
    torchrun = TorchrunFlags(**{flag.name: values.pop(flag.name) for flag in dataclasses.fields(TorchrunFlags)})
    return resolve(
        merge_aliases(values),
        script=values["script"],
        script_args=tuple(values["script_args"] or ()),
        module=values["module"],
        no_python=values["no_python"],
        config_file=values["config"],
        environ=environ,
        cwd=cwd,
        torchrun=torchrun,
    )


def parse_command_line(argv: list[str], *, environ: Mapping[str, str] | None = None,
                       cwd: Path | None = None) -> JobSpec:
    """The job ``ftrun ARGV`` would launch, without launching it (nothing is started).

    Args:
        argv: the arguments after ``ftrun`` (options, SCRIPT, the script's arguments).
        environ, cwd: as in :func:`ftrun.config.resolve`.

    Raises:
        ConfigError: an invalid value; click's ``UsageError`` for an unknown flag or a missing value.
    """
    context = typer.main.get_command(app).make_context("ftrun", list(argv))
    return spec_from_flags(context.params, environ=environ, cwd=cwd)


def run(**given: Any) -> None:
    """Launch SCRIPT on --worker_num ranks; on a fault, respawn only the failed rank (ARF).

    Also: `ftrun status [--log_dir DIR] [--watch]` shows a running or finished job; `ftrun report
    LOG_DIR [--plot FILE.png]` summarises a run; `ftrun check SCRIPT [ARGS]` tells whether SCRIPT is exactly-once under ftrun (a script named status, report or check runs as ./status)."""
    spec = spec_from_flags(given)
    if spec.resume.lower() not in ("auto", "none"):
        from ftrun.common.checkpoint import CheckpointError, resolve_resume

        try:
            resolve_resume(None, spec.resume, on_skip=lambda *_: None)
        except CheckpointError as err:
            raise ConfigError(f"--resume {spec.resume}: {err}; give a checkpoint directory, 'auto' or 'none'") from None
    if spec.metrics_port and spec.node_rank == 0 and not spec.node_rank_auto:
        _check_metrics_endpoint(spec)
    from ftrun.node.console import make_console
    from ftrun.node.launcher import Launcher

    console = make_console(f"ftrun: {spec.script} on {spec.worker_num} rank(s)", force_plain=given["plain"])
    raise SystemExit(Launcher(spec, console).run())


# typer reads a command's flags from its callback's signature: this one's is built from the tables.
run.__signature__ = inspect.Signature(_run_parameters())  # type: ignore[attr-defined]
app.command()(run)


def _check_metrics_endpoint(spec: JobSpec) -> None:
    """Refuse a metrics endpoint that cannot be served, before any rank starts.

    Raises:
        ConfigError: the port is the store's, is taken, or the address is not this host's.
    """
    if spec.metrics_port == spec.master_port:
        raise ConfigError(f"--metrics_port {spec.metrics_port} is also --master_port (the rendezvous store's); "
                          "give the metrics another port")
    from ftrun.coordinator.metrics import MetricsError, check_endpoint, metrics_bind_address

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
    from ftrun.tools.status import resolve_log_dir, show

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
    from ftrun.tools.report import ReportError, format_report, load_report, plot_timeline
    from ftrun.tools.status import resolve_log_dir

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
    scenarios: Optional[str] = typer.Option(None, "--scenarios", help="Only these faulted runs, comma-separated: "
                                            "allreduce, epoch_end, epoch_start, section, backward, update "
                                            "(default: all).", show_default=False),
) -> None:
    """Tell whether SCRIPT is exactly-once under ftrun: a fault-free run, then runs with a rank killed
    mid-epoch in the all-reduce (and, when that step has several, in each of its all-reduces and
    optimizer updates), after an epoch's last step, before an epoch's first step and inside a
    section; each must end with the same parameters and buffers. If one does not: the step and the
    tensor where it first differs (a parameter or buffer, or a module or optimizer not registered
    with ftrun), and the likely cause. Exit code 0: exactly-once; 1: not; 2: it did not run."""
    from ftrun.tools.check import check as run_check, parse_scenarios

    try:
        only = parse_scenarios(scenarios)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if worker_num < 2:
        raise ConfigError(f"--worker_num {worker_num}: a check needs at least 2 ranks (a replacement takes its state from a replica)")
    if not Path(script).is_file():
        raise ConfigError(f"{script}: no such script")
    raise SystemExit(run_check(script, list(script_args or ()), world=worker_num, timeout=timeout, keep=keep, only=only))


SUBCOMMANDS = {"status": status_app, "report": report_app, "check": check_app}


def main(argv: list[str] | None = None) -> None:
    """Console-script entry point: runs the CLI; user errors print one line and exit 2.

    ``ftrun status ...``, ``ftrun report ...`` and ``ftrun check ...`` are subcommands when the first
    argument is exactly ``status``, ``report`` or ``check``; a script of that name runs as ``ftrun ./status``.
    """
    from ftrun.tools.report import ReportError

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
