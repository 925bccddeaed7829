"""Where option values come from besides the command line: ``FTRUN_<OPTION>`` variables
(:func:`read_env`), TOML files (:func:`read_toml`: ``--config FILE`` or ``[tool.ftrun]`` of
``./pyproject.toml``) and a cluster's own environment (:func:`read_cluster_env`: Slurm's, with its
compressed host lists, or a Kubeflow PyTorchJob's). Each value is converted and range-checked where
it is read, so an error names the variable, the key and file, or the cluster variable that gave it.
Precedence among them is :func:`ftrun.config.resolve`'s (docs/reference/cli.md)."""

from __future__ import annotations

import json
import math
import re
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator, Mapping

from ftrun.config.checks import check_text, convert_text, count_local_devices
from ftrun.config.options import MAX_CONFIG_BYTES, MAX_WORLD_SIZE, OPTIONS, OPTIONS_BY_NAME, ConfigError, Option

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on Python 3.10
    import tomli as tomllib

# --------------------------------------------------------------------------- TOML and FTRUN_<OPTION>

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

    if opt.type is bool:
        if isinstance(value, bool):
            return value
        raise _wrong_toml_type(opt, value, where, "true or false")
    if opt.type is int:
        return _toml_integer(opt, value, where)
    if opt.type is float:
        return _toml_number(opt, value, where)
    return _toml_text(opt, value, where)


def _wrong_toml_type(opt: Option, value: Any, where: str, expected: str) -> ConfigError:
    """The error for a TOML value of another type than the option takes, with an example."""
    return ConfigError(
        f"{where} is {_toml_type(value)} ({_short(value)}); {opt.name} takes {expected}, "
        f"e.g. {_toml_example(opt)}"
    )


def _toml_integer(opt: Option, value: Any, where: str) -> int:
    """An int option's value: an integer, or a float with no fraction, in range."""
    if isinstance(value, int) and not isinstance(value, bool):
        opt.check_range(value, where)
        return value
    if isinstance(value, float) and value.is_integer():
        opt.check_range(value, where)
        return int(value)
    raise _wrong_toml_type(opt, value, where, "an integer")


def _toml_number(opt: Option, value: Any, where: str) -> float:
    """A float option's value: an integer or a float, in range (an integer too large for a
    float counts as infinite)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        try:
            number = float(value)
        except OverflowError:
            number = math.inf
        opt.check_range(number, where, _short(value))
        return number
    raise _wrong_toml_type(opt, value, where, "a number")


def _toml_text(opt: Option, value: Any, where: str) -> str:
    """A string option's value, as the text its flag would take: a string, or the other TOML
    forms some options accept (a table of switches for tft, an integer for nnodes and
    tail_worker_log, an array for tail_worker_log and recoverable_errors)."""
    if isinstance(value, str):
        return check_text(opt, value, where)
    if opt.name == "tft" and isinstance(value, dict):
        return _tft_table(value, where)
    if opt.name in ("nnodes", "tail_worker_log") and isinstance(value, int) and not isinstance(value, bool):
        return str(value)
    if opt.name == "tail_worker_log" and isinstance(value, list):
        if all(isinstance(v, int) and not isinstance(v, bool) for v in value):
            return ",".join(str(v) for v in value)
        raise _wrong_toml_type(opt, value, where, "a string or an array of local ranks")
    if opt.name == "recoverable_errors" and isinstance(value, list):
        if all(isinstance(v, str) for v in value):
            return ",".join(value)
        raise _wrong_toml_type(opt, value, where, "a string or an array of strings")
    raise _wrong_toml_type(opt, value, where, "a string")


def _tft_table(table: dict[str, Any], where: str) -> str:
    """``tft = {ARF = 1, TTP = true}`` as the flag's text, ``{ARF:1,TTP:1}``.

    Raises:
        ConfigError: a switch that is not true/false or 1/0.
    """
    items = []
    for key, flag in table.items():
        if isinstance(flag, bool) or (isinstance(flag, int) and flag in (0, 1)):
            items.append(f"{key}:{int(flag)}")
        else:
            raise ConfigError(f"{where}: switch {key} = {_short(flag)} must be true/false or 1/0, "
                              "e.g. tft = {ARF = 1, TTP = 1}")
    return "{" + ",".join(items) + "}"


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
        var = opt.env_var
        raw = environ.get(var)
        if raw is not None and raw.strip() != "":
            out[opt.name] = convert_text(opt, raw, var)
    if "tft" not in out and environ.get("MS_ENABLE_TFT", "").strip():
        out["tft"] = environ["MS_ENABLE_TFT"]
        out["_tft_source"] = "MS_ENABLE_TFT"
    return out


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


def iter_hostlist(text: str, where: str = "SLURM_JOB_NODELIST") -> Iterator[str]:
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


def _hostlist_product(literals: list[str], ranges: list[list[tuple[int, int, int]]]) -> Iterator[str]:
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

    def take(self, option: str, var: str, raw: str, label: str | None = None) -> None:
        """Set ``option`` from the cluster variable ``var``'s value ``raw``, converted and checked.

        Args:
            label: what gave it (default ``"VAR (<name> environment)"``), kept in :attr:`labels`
                and used in errors.

        Raises:
            ConfigError: a value of the wrong type or out of range.
        """
        label = label or f"{var} ({self.name} environment)"
        self.values[option] = convert_text(OPTIONS_BY_NAME[option], raw, label)
        self.labels[option] = label


def _env_value(environ: Mapping[str, str], *names: str) -> tuple[str, str] | None:
    """The first of ``names`` set to a non-empty value: (name, value)."""
    for name in names:
        value = environ.get(name, "").strip()
        if value:
            return name, value
    return None


# The variables a Kubeflow PyTorchJob sets for torchrun, and the options they give.
_PET_VARS = ("PET_NNODES", "PET_NODE_RANK", "PET_MASTER_ADDR", "PET_MASTER_PORT", "PET_NPROC_PER_NODE")
_PET_OPTIONS = (("nnodes", "PET_NNODES"), ("node_rank", "PET_NODE_RANK"), ("master_addr", "PET_MASTER_ADDR"),
                ("master_port", "PET_MASTER_PORT"))


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
    pet = {name: environ.get(name, "").strip() for name in _PET_VARS}
    if any(pet.values()):
        return _read_pytorchjob(pet)
    return _read_slurm(environ)


def _read_pytorchjob(pet: Mapping[str, str]) -> ClusterEnv:
    """The options of a PyTorchJob's ``PET_`` variables (stripped; empty: not set).

    Raises:
        ConfigError: a malformed value, naming the variable.
    """
    out = ClusterEnv(name="PyTorchJob")
    for option, var in _PET_OPTIONS:
        if pet[var]:
            out.take(option, var, pet[var])
    nproc = pet["PET_NPROC_PER_NODE"]
    if nproc:
        label = f"PET_NPROC_PER_NODE ({out.name} environment)"
        if not re.fullmatch(r"[+-]?[0-9]+", nproc):
            try:
                nproc = str(count_local_devices(nproc))  # torchrun's auto, cpu, gpu, xpu
            except ConfigError as err:
                raise ConfigError(f"PET_NPROC_PER_NODE={pet['PET_NPROC_PER_NODE']} ({out.name} environment): "
                                  f"{err}") from None
        out.take("local_worker_num", "PET_NPROC_PER_NODE", nproc, label)
    if pet["PET_NNODES"]:
        match = re.fullmatch(r"\s*[0-9]+\s*(?::\s*([0-9]+)\s*)?", pet["PET_NNODES"])
        if match:
            out.nodes = int(match.group(1) or pet["PET_NNODES"].strip())
    return out


def _read_slurm(environ: Mapping[str, str]) -> ClusterEnv:
    """The options of Slurm's variables (an empty :class:`ClusterEnv` when none is set), and the
    step's tasks and nodes.

    Raises:
        ConfigError: a malformed value, naming the variable.
    """
    nnodes = _env_value(environ, "SLURM_NNODES", "SLURM_JOB_NUM_NODES")
    node_id = _env_value(environ, "SLURM_NODEID")
    nodelist = _env_value(environ, "SLURM_JOB_NODELIST", "SLURM_NODELIST")
    if not (nnodes or node_id or nodelist):
        return ClusterEnv()
    out = ClusterEnv(name="Slurm")
    if nnodes:
        out.take("nnodes", *nnodes)
        if re.fullmatch(r"[0-9]+", nnodes[1]):
            out.nodes = int(nnodes[1])
    if node_id:
        out.take("node_rank", *node_id)
    if nodelist:
        var, raw = nodelist
        out.take("master_addr", var, first_host(raw, f"{var}={raw} (Slurm environment)"),
                 f"the first host of {var}={raw} (Slurm environment)")
    tasks = _env_value(environ, "SLURM_STEP_NUM_TASKS")
    step_nodes = _env_value(environ, "SLURM_STEP_NUM_NODES")
    if tasks and step_nodes and tasks[1].isdigit() and step_nodes[1].isdigit():
        out.tasks_per_node = (int(tasks[1]), int(step_nodes[1]), "SLURM_STEP_NUM_TASKS, SLURM_STEP_NUM_NODES")
    return out


