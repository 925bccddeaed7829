"""torchrun's command line under ftrun: the flags that have no ftrun option of their own
(:class:`TorchrunFlags`), torchrun's other names of ftrun options (``--nproc-per-node``,
``--rdzv-id``, ``--shutdown-timeout``: :func:`merge_aliases`), their parsers, and how they become
ftrun's options (:func:`apply_torchrun`). A torchrun command runs under ftrun with only the
command's name changed (docs/reference/cli.md: torchrun's command line); flags ftrun does not
implement are refused by name with the reason (:data:`UNSUPPORTED_TORCHRUN_FLAGS`)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any, Mapping

from ftrun.config.checks import count_local_devices
from ftrun.config.options import (
    DEFAULT_RDZV_PORT,
    MAX_TIMEOUT_S,
    OPTIONS,
    TIMEOUT_WHY,
    ConfigError,
    format_number,
)

# torchrun flags ftrun does not implement, and why (both spellings are looked up).
UNSUPPORTED_TORCHRUN_FLAGS: dict[str, str] = {
    "--event-log-handler": "ftrun writes its events to LOG_DIR/events.jsonl",
    "--logs-specs": "ftrun writes each rank's output to LOG_DIR/worker_<rank>.log",
    "--duplicate-stdout-filters": "each rank's output is in LOG_DIR/worker_<rank>.log; filter that file",
    "--duplicate-stderr-filters": "each rank's output is in LOG_DIR/worker_<rank>.log; filter that file",
    "--numa-binding": "ranks are not bound to CPUs; bind them in the script (os.sched_setaffinity) if needed",
    "--signals-to-handle": "ftrun forwards SIGINT and SIGTERM to the ranks",
    "--virtual-local-rank": "LOCAL_RANK is always the rank's index on its node",
}

#: The option alias that also takes torchrun's device words (auto, cpu, gpu, xpu).
DEVICE_COUNT_ALIAS = "nproc_per_node"

# torchrun's --start-method values: the --fork_server each stands for, or why it is refused.
START_METHODS: dict[str, tuple[str, str]] = {
    "spawn": ("off", ""),
    "forkserver": ("on", ""),
    "fork": ("", "fork would copy the launcher's state into every rank; ftrun's fork server (forkserver, its "
             "default) forks them from a process that has only imported the libraries"),
}


def merge_aliases(values: Mapping[str, Any]) -> dict[str, Any]:
    """Fold torchrun's names of ftrun options (:attr:`Option.alias`) into the options.

    Args:
        values: option name or alias -> the text given on the command line (None: not given).

    Returns:
        option name -> text (None: not given), for every option; ``--nproc-per-node``'s device
        words (auto, cpu, gpu, xpu) are replaced by the count of those devices.

    Raises:
        ConfigError: an option and its alias are both given and differ, or an unknown device word.
    """
    out: dict[str, Any] = {}
    for opt in OPTIONS:
        value = values.get(opt.name)
        if opt.alias:
            other = values.get(opt.alias)
            if opt.alias == DEVICE_COUNT_ALIAS and other is not None and not other.strip().isdigit():
                other = str(count_local_devices(other))
            if other is not None and value is not None and other.strip() != value.strip():
                raise ConfigError(f"--{opt.alias.replace('_', '-')} {other} and --{opt.name} {value} disagree; "
                                  "give only one of them")
            value = other if other is not None else value
        out[opt.name] = value
    return out


def torchrun_flag(help: str, *short: str, switch: bool = False) -> Any:
    """Declare a :class:`TorchrunFlags` field: its ``--help`` text, its short flags (``-r``), and
    whether it is a switch (no value)."""
    return field(default=False if switch else None, metadata={"help": help, "short": short, "switch": switch})


@dataclass(frozen=True)
class TorchrunFlags:
    """torchrun's flags that have no ftrun option of their own (command line only; None or False:
    not given). Each field is a flag, ``--name`` and ``--name-with-hyphens``; the command line is
    built from these fields.

    Attributes:
        standalone: ``--standalone``: one node, the store on 127.0.0.1 on a free port.
        rdzv_backend: ``--rdzv-backend``: ``c10d`` or ``static`` (both: ftrun's store on node 0).
        rdzv_endpoint: ``--rdzv-endpoint HOST[:PORT]``: node 0's store (master_addr/master_port).
        rdzv_conf: ``--rdzv-conf KEY=VALUE,...`` (see :data:`RDZV_CONF_KEYS`).
        run_path: ``--run-path``: SCRIPT is a Python file, as ftrun always takes it.
        start_method: ``--start-method``: ``spawn`` (``--fork_server off``: each rank a fresh
            interpreter) or ``forkserver`` (``--fork_server on``, ftrun's default); ``fork`` is refused.
        redirects, tee: ``-r/--redirects`` and ``-t/--tee`` (torchrun's 0-3 or ``0:1,1:2``);
            ftrun always writes every rank's output to its log file; together they choose the
            local ranks whose output reaches the console.
        local_ranks_filter: ``--local-ranks-filter 0,1``: only these local ranks on the console.
    """

    standalone: bool = torchrun_flag("Single-node job: the store on 127.0.0.1 on a free port.", switch=True)
    rdzv_backend: str | None = torchrun_flag("c10d or static: both mean ftrun's own store on node 0.")
    rdzv_endpoint: str | None = torchrun_flag("HOST[:PORT] of node 0's store ([ADDR]:PORT for IPv6; port 29400 "
                                              "by default): sets --master_addr/--master_port.")
    rdzv_conf: str | None = torchrun_flag("KEY=VALUE,...: is_host, join_timeout or timeout (set "
                                          "--cluster_time_out); read_timeout, last_call_timeout, close_timeout are "
                                          "accepted and ignored.")
    run_path: bool = torchrun_flag("Run SCRIPT as a Python file (torchrun runs it with runpy.run_path; so does "
                                   "ftrun's default).", switch=True)
    start_method: str | None = torchrun_flag("spawn (--fork_server off: each rank a fresh interpreter) or "
                                             "forkserver (--fork_server on, the default); fork is refused.")
    redirects: str | None = torchrun_flag("0-3 or e.g. 0:3,1:1; ftrun always writes every rank's output to "
                                          "LOG_DIR/worker_<rank>.log, so this only decides with --tee which local "
                                          "ranks reach the console (3 without --tee: none).", "-r")
    tee: str | None = torchrun_flag("0-3 or e.g. 0:3,1:1: local ranks whose output is also shown on the console.",
                                    "-t")
    local_ranks_filter: str | None = torchrun_flag("e.g. 0,1: only these local ranks on the console.")

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

    def check_start(self, module: bool, no_python: bool) -> None:
        """Refuse a way of starting the ranks that ftrun does not have.

        Args:
            module, no_python: how SCRIPT is run (``-m``, ``--no-python``).

        Raises:
            ConfigError: ``--run-path`` with ``-m`` or ``--no-python``; a ``--start-method`` that
                is not torchrun's, or ``fork`` (it would copy the launcher's state into the ranks).
        """
        if self.run_path and (module or no_python):
            raise ConfigError("--run-path runs SCRIPT as a Python file; it cannot be combined with -m/--module or "
                              "--no_python")
        if self.start_method is None:
            return
        method = self.start_method.strip().lower()
        if method not in START_METHODS:
            raise ConfigError(f"--start-method {self.start_method!r} is not one of torchrun's spawn, fork, forkserver; "
                              "give spawn or forkserver, or leave it out")
        if START_METHODS[method][1]:
            raise ConfigError(f"--start-method {method} is refused: {START_METHODS[method][1]}; give spawn or "
                              "forkserver, or leave it out")

    @property
    def sets_console(self) -> bool:
        """Whether a flag choosing the console's ranks was given."""
        return any(v is not None for v in (self.redirects, self.tee, self.local_ranks_filter))


_LOOPBACK_NAMES = ("localhost", "127.0.0.1", "::1", "[::1]")



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
    "last_call_timeout": "ignored: an elastic job keeps its ranks; a node absent 30 s after the start has them run on the others",
    "close_timeout": "ignored: an elastic job keeps its ranks; a node absent 30 s after the start has them run on the others",
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
                f"{format_number(MAX_TIMEOUT_S)} ({TIMEOUT_WHY})"
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



def apply_torchrun(
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
        _check_backend(torchrun.rdzv_backend)
    if torchrun.standalone:
        _apply_standalone(torchrun, from_cli, labels)
    elif torchrun.rdzv_endpoint is not None:
        _apply_endpoint(torchrun.rdzv_endpoint, from_cli, labels)
    if torchrun.start_method is not None:
        fork_server = START_METHODS[torchrun.start_method.strip().lower()][0]
        given = from_cli.get("fork_server")
        if given is not None and given.strip().lower() != fork_server:
            raise ConfigError(f"--start-method {torchrun.start_method.strip()} means --fork_server {fork_server}, but "
                              f"--fork_server {given} is given; drop one of them")
        from_cli["fork_server"] = fork_server
        labels.setdefault("fork_server", "--start-method")
    if torchrun.rdzv_conf is None:
        return None
    return _apply_rdzv_conf(torchrun.rdzv_conf, from_cli, labels, warnings)


def _check_backend(rdzv_backend: str) -> None:
    """Refuse a rendezvous backend other than c10d and static (both: ftrun's store on node 0)."""
    backend = rdzv_backend.strip().lower()
    if backend not in ("c10d", "static"):
        raise ConfigError(
            f"--rdzv-backend {rdzv_backend!r} is not supported: ftrun hosts its own store on node 0; "
            "use c10d or static (or leave it out)"
        )


def _take_flag(from_cli: dict[str, Any], labels: dict[str, str], name: str, value: Any, flag: str) -> None:
    """Set option ``name`` from torchrun's ``flag``, unless the command line gives it another value.

    Raises:
        ConfigError: the command line gives the option a different value.
    """
    if name in from_cli and from_cli[name] != value:
        raise ConfigError(
            f"{flag} gives {name} {format_number(value)}, but {labels[name]} gives {format_number(from_cli[name])}; give only one"
        )
    from_cli[name] = value
    labels[name] = flag


def _apply_standalone(torchrun: TorchrunFlags, from_cli: dict[str, Any], labels: dict[str, str]) -> None:
    """``--standalone``: the store on 127.0.0.1 on a free port (a given ``--master_port`` is kept).

    Raises:
        ConfigError: with ``--rdzv-endpoint``, or a ``--master_addr`` that is not loopback.
    """
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


def _apply_endpoint(rdzv_endpoint: str, from_cli: dict[str, Any], labels: dict[str, str]) -> None:
    """``--rdzv-endpoint HOST[:PORT]``: node 0's store, as master_addr and master_port.

    Raises:
        ConfigError: a malformed endpoint, or a host or port other than the command line's.
    """
    host, port = parse_rdzv_endpoint(rdzv_endpoint)
    if "master_addr" in from_cli:
        given = from_cli["master_addr"].strip()
        if given.strip("[]") != host:
            raise ConfigError(
                f"--rdzv-endpoint {rdzv_endpoint} and --master_addr {given} name different hosts; give only one"
            )
    from_cli["master_addr"] = host
    labels["master_addr"] = "--rdzv-endpoint"
    _take_flag(from_cli, labels, "master_port", port, "--rdzv-endpoint")


def _apply_rdzv_conf(
    rdzv_conf: str, from_cli: dict[str, Any], labels: dict[str, str], warnings: list[str]
) -> bool | None:
    """``--rdzv-conf KEY=VALUE,...``: its join timeout as cluster_time_out, a warning for each
    key ignored.

    Returns:
        ``is_host`` (None: not given).

    Raises:
        ConfigError: a malformed conf, or a timeout other than the command line's.
    """
    conf = parse_rdzv_conf(rdzv_conf)
    join = conf.get("join_timeout", conf.get("timeout"))
    if join is not None:
        _take_flag(from_cli, labels, "cluster_time_out", float(join), "--rdzv-conf")
    for key in conf:
        if RDZV_CONF_KEYS[key].startswith("ignored"):
            warnings.append(f"--rdzv-conf {key} is {RDZV_CONF_KEYS[key]}")
    return bool(conf["is_host"]) if "is_host" in conf else None


