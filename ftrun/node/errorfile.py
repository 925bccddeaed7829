"""Error files of ranks that die of an uncaught Python exception (torchrun's ``@record`` contract).

A training script written for torchrun decorates its entry point with
``torch.distributed.elastic.multiprocessing.errors.record``. When the decorated function raises,
``record`` writes a small JSON document to the path in the environment variable
``TORCHELASTIC_ERROR_FILE`` before the exception propagates, so the launcher can name the root
cause with its type, message, time and traceback instead of only an exit code.

The document, as torch writes it::

    {"message": {"message": "ValueError: bad input",
                 "extraInfo": {"py_callstack": "Traceback (most recent call last): ...",
                               "timestamp": "1700000000"}}}

(an agent that copies a child's file into its own may add ``"errorCode": N`` next to
``"extraInfo"``; another producer may write ``"message"`` as a plain string with a top-level
``"timestamp"``). This module gives each rank process its own path (:func:`error_file_path`) and
reads such a file back (:func:`read_error_file`), tolerating a missing, partial or foreign file.
It does not import torch.
"""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

#: The variable torch's ``@record`` reads the path from.
ERROR_FILE_ENV: str = "TORCHELASTIC_ERROR_FILE"
#: A file larger than this (bytes) is not read: it is not an error file.
MAX_ERROR_FILE_BYTES: int = 1 << 20

# "ValueError: text", "torch.OutOfMemoryError: text", "ValueError" (empty message).
_TYPE_PREFIX = re.compile(r"([A-Za-z_][\w.]*)(?:: ?(.*))?", re.DOTALL)


@dataclass(frozen=True)
class RankError:
    """The uncaught exception a rank recorded before it died.

    Attributes:
        exc_type: the exception's class name as the file gives it, qualified with its module when
            the traceback's last line names it so (e.g. ``"ftrun.common.faults.InjectedFault"``);
            ``""`` when the file does not say.
        message: the exception's text, without the type (may be empty).
        timestamp: when it was recorded, Unix time in seconds; None when absent or unreadable.
        traceback: the formatted Python traceback; None when absent.
    """

    exc_type: str
    message: str
    timestamp: float | None
    traceback: str | None

    def summary(self) -> str:
        """One line: ``"ValueError: bad input"`` (the first line of a multi-line message)."""
        first = self.message.strip().splitlines()[0] if self.message.strip() else ""
        if self.exc_type and first:
            return f"{self.exc_type}: {first}"
        return self.exc_type or first


def error_file_path(log_dir: Path, rank: int, incarnation: int, attempt: int) -> Path:
    """The error file of one rank process: ``LOG_DIR/errors/attempt_A/rank_R.I.json``.

    Each process (rank R, incarnation I, whole-job attempt A) gets its own file, so a respawned
    rank never overwrites, or is mistaken for, its predecessor's error. The path is only computed;
    the directories are created by :func:`prepare_error_file`.

    Args:
        log_dir: the job's log directory.
        rank: global rank, >= 0.
        incarnation: the rank's incarnation (0 for the first process of the rank), >= 0.
        attempt: the whole-job attempt (``TORCHELASTIC_RESTART_COUNT``), >= 0.

    Raises:
        ValueError: a negative or non-integer number.
    """
    for name, value in (("rank", rank), ("incarnation", incarnation), ("attempt", attempt)):
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ValueError(f"error_file_path: {name} must be an integer >= 0, got {value!r}")
    return Path(log_dir) / "errors" / f"attempt_{attempt}" / f"rank_{rank}.{incarnation}.json"


def prepare_error_file(path: Path) -> None:
    """Make ``path`` ready to be given as ``TORCHELASTIC_ERROR_FILE``: create its directory and
    remove a stale file left there (torch's ``@record`` overwrites it anyway; a stale one could be
    read back as this process's error).

    Raises:
        OSError: the directory cannot be created, or the stale file cannot be removed.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        path.unlink()
    except FileNotFoundError:
        pass


def read_error_file(path: Path) -> RankError | None:
    """Read an error file written by torch's ``@record`` (or in its format).

    Never raises: a missing file, a directory, an unreadable, empty, truncated (the rank died while
    writing), non-JSON or foreign file, or one larger than 1 MiB, gives None.

    Args:
        path: the file (see :func:`error_file_path`).

    Returns:
        The recorded error, or None.
    """
    try:
        with open(path, "rb") as fh:
            raw = fh.read(MAX_ERROR_FILE_BYTES + 1)
    except (OSError, ValueError):
        return None
    if not raw or len(raw) > MAX_ERROR_FILE_BYTES:
        return None
    try:
        data = json.loads(raw)
    except (ValueError, RecursionError):  # UnicodeDecodeError and JSONDecodeError are ValueErrors
        return None
    if not isinstance(data, dict):
        return None
    return _parse(data)


def _parse(data: dict[str, Any]) -> RankError | None:
    body = data.get("message")
    timestamp = _timestamp(data.get("timestamp"))
    traceback: str | None = None
    if isinstance(body, dict):
        text = body.get("message")
        extra = body.get("extraInfo")
        if isinstance(extra, dict):
            callstack = extra.get("py_callstack")
            traceback = callstack if isinstance(callstack, str) and callstack.strip() else None
            timestamp = _timestamp(extra.get("timestamp"), timestamp)
    else:
        text = body
    if not isinstance(text, str):
        return None
    exc_type, message = "", text
    match = _TYPE_PREFIX.fullmatch(text)
    if match and (match.group(2) is not None or _looks_like_type(match.group(1))):
        exc_type, message = match.group(1), match.group(2) or ""
    exc_type = _qualified(exc_type, traceback)
    return RankError(exc_type=exc_type, message=message, timestamp=timestamp, traceback=traceback)


def _looks_like_type(name: str) -> bool:
    """A bare word counts as a type name only if it reads like one (``KeyboardInterrupt``, ``MyError``)."""
    last = name.rsplit(".", 1)[-1]
    return bool(last) and last[0].isupper() and any(last.endswith(s) for s in ("Error", "Exception", "Interrupt", "Exit", "Fault"))


def _qualified(exc_type: str, traceback: str | None) -> str:
    """``exc_type`` with its module, when the traceback's last line gives the qualified name."""
    if not exc_type or not traceback:
        return exc_type
    lines = [line for line in traceback.strip().splitlines() if line.strip()]
    if not lines:
        return exc_type
    head = lines[-1].split(":", 1)[0].strip()
    if head.endswith("." + exc_type) and re.fullmatch(r"[A-Za-z_][\w.]*", head):
        return head
    return exc_type


def _timestamp(value: Any, default: float | None = None) -> float | None:
    """A Unix time from a number or a numeric string (torch writes ``str(int(time.time()))``)."""
    if isinstance(value, bool):
        return default
    if isinstance(value, (int, float)):
        number = float(value)
    elif isinstance(value, str):
        try:
            number = float(value.strip())
        except ValueError:
            return default
    else:
        return default
    if number != number or number in (float("inf"), float("-inf")) or number < 0:
        return default
    return number


def error_file_env(path: Path) -> dict[str, str]:
    """The environment entry that makes torch's ``@record`` write to ``path``."""
    return {ERROR_FILE_ENV: os.fspath(path)}
