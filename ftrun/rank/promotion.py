"""A spare's promotion: the moment a waiting process (warm or hot spare) becomes a rank.

The agent writes the assignment (JSON: the rank's environment, its log, the script) on the spare's
standard input; :func:`take_assignment` reads it and makes this process that rank's: its output to
the rank's log, its environment, and its identity written over the room its initial environment
block kept for it (:func:`show_identity`). A hot spare's worker library calls
:func:`await_promotion` where its script first needs its rank (:mod:`ftrun.rank.spare` runs the
script; docs/hot_spares.md).
"""

from __future__ import annotations

import ctypes
import json
import os
import sys
from typing import Mapping

from ftrun.common.contract import HOT_SPARE, IDENTITY_PAD, IDENTITY_VARS, SPARE_JOB


def take_assignment(hot: bool) -> dict:
    """Block until the agent writes this spare's assignment on its standard input, then become
    that rank's process: its log on stdout/stderr and its environment (a hot spare keeps what
    its script set in its set-up and adds the rank's variables). Returns the assignment.
    Exits (code 0) when the input closes without one: the spare is no longer needed."""
    raw = sys.stdin.buffer.read()
    if not raw:
        sys.exit(0)
    job = json.loads(raw)
    apply_assignment(job, hot)
    return job


def apply_assignment(job: Mapping, hot: bool) -> None:
    """Make this process the rank of ``job`` (an assignment: ``env``, ``log``): its standard input
    from ``/dev/null``, its output to the rank's log, its environment (a hot spare keeps what its
    script set and adds the rank's variables; any other process takes the rank's alone), and its
    identity shown in its initial environment block (:func:`show_identity`).

    Raises:
        OSError: the log cannot be opened.
    """
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    log = os.open(job["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    if hot:
        os.environ.pop(HOT_SPARE, None)
        os.environ.pop(SPARE_JOB, None)
        os.environ.pop(IDENTITY_PAD, None)
    else:
        os.environ.clear()
    os.environ.update(job["env"])
    show_identity(job["env"])


def _memory_bounds(first: int) -> tuple[int, int, bytes] | None:
    """(start, end, bytes) of this process's initial argument block (``first`` 48) or environment
    block (50), from fields ``first`` and ``first + 1`` of ``/proc/self/stat`` (proc(5)); None where
    the kernel does not say, or the block's bytes do not match its bounds."""
    try:
        with open("/proc/self/stat", "rb") as fh:
            stat = fh.read()
        fields = stat[stat.rindex(b")") + 2:].split()
        start, end = int(fields[first - 3]), int(fields[first - 2])
        with open("/proc/self/cmdline" if first == 48 else "/proc/self/environ", "rb") as fh:
            block = fh.read()
    except (OSError, ValueError, IndexError):
        return None
    return (start, end, block) if len(block) == end - start else None


def show_command(argv: list[str]) -> bool:
    """Write ``argv`` over this process's initial argument block, so that ``ps`` and
    ``/proc/<pid>/cmdline`` show the rank's command (``python -u script args``) rather than the
    fork server's it was forked from. Nothing moves: the arguments that do not fit in the block are
    left out, and an argument holding a blank shows as two (the words are joined by blanks, as
    ``setproctitle`` writes a title). Returns False where the kernel does not say where the block
    is."""
    found = _memory_bounds(48)
    if found is None:
        return False
    start, end, _block = found
    room = end - start
    text = b""
    for arg in argv:
        item = (b" " if text else b"") + arg.encode(errors="replace")
        if len(text) + len(item) + 2 > room:
            break
        text += item
    # One string, then blanks: a block whose last byte is not zero is read up to its first zero
    # (the kernel's and psutil's rule for a rewritten command line, as setproctitle writes it).
    ctypes.memmove(start, text + b"\0" + b" " * (room - len(text) - 1), room)
    return True


def show_identity(env: Mapping[str, str]) -> bool:
    """Write the rank's identity variables (those of :data:`ftrun.common.contract.IDENTITY_VARS` in ``env``)
    over the :data:`ftrun.common.contract.IDENTITY_PAD` room at the end of this process's initial
    environment block, so ``/proc/<pid>/environ`` (``ps e``) names the rank it now serves.

    The block's bounds are ``env_start``/``env_end`` of ``/proc/self/stat`` (fields 50 and 51,
    proc(5)); nothing moves, only bytes inside the room change, and the C library's environment no
    longer points there (the variable was unset before). What does not fit in the room is left
    out (the short names come first). Returns False when there is no room (a process not started as
    a spare) or the kernel does not say where the block is."""
    found = _memory_bounds(50)
    if found is None:
        return False
    env_start, _env_end, block = found
    marker = f"{IDENTITY_PAD}=".encode()
    at = 0 if block.startswith(marker) else block.find(b"\0" + marker) + 1
    if at == 0 and not block.startswith(marker):
        return False
    room = len(block) - at
    text = b""
    for name in IDENTITY_VARS:
        item = f"{name}={env[name]}".encode() + b"\0" if name in env else b""
        if len(text) + len(item) <= room:
            text += item
    rest = room - len(text)
    filler = marker + b"-" * (rest - len(marker) - 1) + b"\0" if rest > len(marker) + 1 else b"\0" * rest
    ctypes.memmove(env_start + at, text + filler, room)
    return True


def await_promotion(what: str, ready_file: str | None) -> dict:
    """A hot spare at the point where its script needs its rank (``what``: "the training loop",
    "ft.rank"...): say so in ``spares.log``, create ``ready_file`` (its agent may now give it a
    rank) and block until the rank comes (:func:`take_assignment`). Returns the assignment."""
    print(f"ftrun: hot spare (pid {os.getpid()}) waits for a rank at {what}", flush=True)  # into spares.log
    if ready_file:
        open(ready_file, "a").close()
    return take_assignment(hot=True)
