"""Checks of single values, whatever layer gave them: option text, switches, node counts, console
ranks, addresses, the script, writable directories, ``FTRUN_FAULT``, the job's secret, and
torchrun's device words. Each raises :class:`~ftrun.config.options.ConfigError` with one line
naming the value's source and the fix."""

from __future__ import annotations

import importlib.util
import ipaddress
import os
import re
import shutil
import socket
import stat
import sys
import tempfile
from pathlib import Path
from typing import Any, Mapping

from ftrun.config.options import (
    MAX_TOKEN_FILE_BYTES,
    MAX_WORLD_SIZE,
    MIN_TOKEN_CHARS,
    TFT_SWITCHES,
    ConfigError,
    JobSpec,
    Option,
    TftSwitches,
)

_KIND = {bool: "true or false", int: "an integer", float: "a number"}


def _invalid(opt: Option, where: str, shown: str) -> ConfigError:
    return ConfigError(f"{where}: {shown} is not valid for {opt.name}; it must be {_KIND.get(opt.type, 'a string')}")


def check_text(opt: Option, text: str, where: str) -> str:
    """The checks every string option gets, whatever its source.

    Raises:
        ConfigError: the text holds a NUL character.
    """
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
        return check_text(opt, str(raw), where)
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
        ConfigError: :func:`ftrun.common.faults.parse_faults` refuses it, or a fault names a rank the job
            does not have.
    """
    from ftrun.common.faults import parse_faults

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


