"""Process plumbing shared by the launcher and the supervisor.

Two rules of the process tree (docs/architecture.md) live here: whoever spawns a process reaps it (so exit codes and signals are
exact), and no process outlives its parent (Linux ``PR_SET_PDEATHSIG``; a child whose parent is
already gone when it starts exits at once).
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import io
import os
import signal
import stat
import subprocess
import sys
import time
from typing import Callable, Sequence

_PR_SET_PDEATHSIG = 1
_PR_SET_CHILD_SUBREAPER = 36
_libc: ctypes.CDLL | None = None


def set_death_signal(sig: int) -> bool:
    """Make this process receive ``sig`` when its parent dies (``PR_SET_PDEATHSIG``), replacing
    the signal it was started with. False where unsupported."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc.prctl(_PR_SET_PDEATHSIG, sig, 0, 0, 0) == 0


def die_with_parent(sig: int = signal.SIGKILL) -> Callable[[], None]:
    """A ``preexec_fn`` that makes the child receive ``sig`` when its parent dies.

    It also starts a new session (so a terminal's Ctrl-C reaches only ftrun, which forwards it, and
    the child's own children can be signalled as a group), and exits at once if the parent died
    before the death signal was armed.
    """
    parent = os.getpid()

    def preexec() -> None:
        os.setsid()
        set_death_signal(sig)
        if os.getppid() != parent:
            os._exit(128 + sig)

    return preexec


# The program of ftrun_module_argv: drop the entry ``-c`` put first on sys.path (``''``: the
# working directory; none under PYTHONSAFEPATH, which leaves sys.path[0] to the standard library),
# then run the module as ``python -m`` would.
_RUN_INSTALLED = ("import runpy, sys; sys.path[:1] == [''] and not getattr(sys.flags, 'safe_path', False) "
                  "and sys.path.pop(0); runpy.run_module({module!r}, run_name='__main__', alter_sys=True)")


def ftrun_module_argv(module: str, args: Sequence[str] = (), *, unbuffered: bool = False) -> list[str]:
    """The command line of one of ftrun's own processes: ``python -m module args``, except that it
    imports the installed ftrun (and torch), whatever its working directory holds.

    ``python -m`` puts the working directory first on ``sys.path``, so a job started from a
    directory holding a folder named ``ftrun`` (a clone of this repository, say) would run that
    folder's code in the supervisor, the agents and the spares. Python 3.11's ``-P`` leaves it out,
    but ftrun runs on 3.10 too: one ``-c`` program for every version (it removes the entry, then
    runs the module with :func:`runpy.run_module`, as ``-m`` does) is one path, tested on whichever
    Python runs the tests. The module's name stays in the command line (``ps`` shows it).

    Args:
        module: the module to run as ``__main__`` ("ftrun.rank.spare", "ftrun.node.supervisor"...).
        args: its arguments (its ``sys.argv[1:]``).
        unbuffered: pass ``-u`` (unbuffered output).

    Returns:
        The argv, starting with ``sys.executable``.
    """
    return [sys.executable, *(["-u"] if unbuffered else []), "-c", _RUN_INSTALLED.format(module=module), *args]


def spawn(
    argv: Sequence[str],
    *,
    env: dict[str, str],
    stdout: int | None = None,
    stderr: int | None = None,
    death_signal: int = signal.SIGKILL,
    cwd: str | None = None,
    stdin: int | None = subprocess.DEVNULL,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen:
    """Start ``argv`` in its own session, tied to this process's life by ``death_signal``.

    Args:
        argv: the command line.
        env: the complete environment of the child.
        stdout, stderr: file descriptors (or None to inherit).
        stdin: a file descriptor, ``subprocess.PIPE``, or (default) ``/dev/null``.
        death_signal: signal the child receives when this process dies.
        cwd: working directory.
        pass_fds: descriptors the child inherits, at the same numbers (every other one is closed).

    Raises:
        OSError: the program cannot be executed.
    """
    return subprocess.Popen(
        list(argv),
        env=env,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        cwd=cwd,
        preexec_fn=die_with_parent(death_signal),
        close_fds=True,
        pass_fds=tuple(pass_fds),
    )


def signal_group(proc: subprocess.Popen, sig: int) -> None:
    """Send ``sig`` to the process group led by ``proc`` (its session), ignoring a gone group."""
    try:
        os.killpg(proc.pid, sig)
    except (ProcessLookupError, PermissionError):
        pass


def stop_all(procs: Sequence[subprocess.Popen], grace_period: float, poll: float = 0.02) -> None:
    """Stop processes: SIGTERM to each group, wait up to ``grace_period`` seconds, then SIGKILL.

    Returns when every process in ``procs`` has been reaped.
    """
    live = [p for p in procs if p.poll() is None]
    for proc in live:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_period
    while any(p.poll() is None for p in live) and time.monotonic() < deadline:
        time.sleep(poll)
    for proc in procs:
        signal_group(proc, signal.SIGKILL)
    for proc in procs:
        proc.wait()


def become_subreaper() -> bool:
    """Make orphaned descendants of this process its children (Linux ``PR_SET_CHILD_SUBREAPER``),
    so that what a dead child left behind (a rank's data-loader worker, its ``subprocess``) can
    still be found and ended by :func:`kill_descendants`. False where unsupported."""
    global _libc
    if not sys.platform.startswith("linux"):
        return False
    if _libc is None:
        _libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
    return _libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def dump_stacks_on_sigusr1() -> None:
    """Write the Python stacks of every thread of this process to its stderr on SIGUSR1
    (``faulthandler``): ``kill -USR1 <pid>`` on a launcher, supervisor or agent that seems stuck
    shows where, as it does for a rank (the launcher's stderr is the terminal; the supervisor's
    and agents' are their logs)."""
    import faulthandler

    if hasattr(signal, "SIGUSR1"):
        faulthandler.register(signal.SIGUSR1, all_threads=True)


FULL_DISK = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})  # a write that fails for want of room
_kept_streams: list[object] = []  # the streams replaced by guard_log_output (never closed: they own fds 1 and 2)


class LogFile(io.RawIOBase):
    """File descriptor ``fd`` (1 or 2) of a rank whose output goes to its log file, written so that
    the log's trouble never ends the rank: a full disk drops the bytes (counted in
    :attr:`dropped`) instead of raising from the script's ``print``, and a log file removed under
    the rank (``rm -rf`` of the log directory) is made again at its path and put in place of the
    descriptor (``dup2``), so the rank's later output, C's included, is kept. The path is the one
    the descriptor named when this object was made: a log directory moved away and then removed is
    made again where it was, not under the name it was moved to."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd
        self.dropped = 0  # bytes lost to a full disk
        try:
            self.path: str | None = os.readlink(f"/proc/self/fd/{fd}").removesuffix(" (deleted)")
        except OSError:  # no /proc: the name at the time of the reopen
            self.path = None

    def writable(self) -> bool:
        return True

    def fileno(self) -> int:
        return self.fd

    def write(self, data: bytes | bytearray | memoryview) -> int:  # type: ignore[override]
        size = len(data)
        try:
            if os.fstat(self.fd).st_nlink == 0:
                self._reopen()
            return os.write(self.fd, data)
        except OSError as err:
            if err.errno not in FULL_DISK and err.errno != errno.ENOENT:
                raise
            self.dropped += size
            return size

    def _reopen(self) -> None:
        path = self.path or os.readlink(f"/proc/self/fd/{self.fd}").removesuffix(" (deleted)")
        os.makedirs(os.path.dirname(path), exist_ok=True)
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, self.fd)
        os.close(fd)


def guard_log_output() -> bool:
    """Put :class:`LogFile` under ``sys.stdout`` and ``sys.stderr`` when they write to regular files
    (a rank under ftrun writes to ``worker_<rank>.log``): a full or removed log directory then
    costs output, never the rank. Streams on a terminal or a pipe are left alone. Returns whether
    any stream was guarded."""
    guarded = False
    for name in ("stdout", "stderr"):
        stream = getattr(sys, name)
        try:
            fd = stream.fileno()
            regular = stat.S_ISREG(os.fstat(fd).st_mode)
        except (AttributeError, OSError, ValueError):
            continue
        if not regular or isinstance(getattr(stream, "buffer", None), io.BufferedWriter) and isinstance(
                stream.buffer.raw, LogFile):
            continue
        try:
            stream.flush()
        except OSError:
            pass  # what it held is lost to the full disk
        _kept_streams.append(stream)
        setattr(sys, name, io.TextIOWrapper(io.BufferedWriter(LogFile(fd)), encoding=stream.encoding,
                                            errors=stream.errors, line_buffering=name == "stderr" or stream.line_buffering))
        guarded = True
    return guarded


def kill_descendants() -> int:
    """SIGKILL every live descendant of this process; returns how many there were."""
    import psutil

    try:
        family = psutil.Process().children(recursive=True)
    except psutil.Error:
        return 0
    for proc in family:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(family, timeout=5)
    return len(family)


def wait_for_children(pids: set[int], timeout: float) -> int:
    """Wait up to ``timeout`` seconds for those of ``pids`` that are this process's children now
    (ranks re-parented to the launcher, a subreaper, after their supervisor died) to exit; returns
    how many there were."""
    import psutil

    try:
        waiting = [p for p in psutil.Process().children() if p.pid in pids]
    except psutil.Error:
        return 0
    if waiting:
        psutil.wait_procs(waiting, timeout=timeout)
    return len(waiting)


def kill_tree(pid: int) -> None:
    """SIGKILL a process and every descendant (ranks and whatever they started), no grace."""
    import psutil

    try:
        root = psutil.Process(pid)
        family = [root, *root.children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for proc in family:
        try:
            proc.kill()
        except psutil.NoSuchProcess:
            pass


def describe_exit(returncode: int) -> tuple[int, str]:
    """Turn a ``Popen.returncode`` into (shell-style exit code, description).

    A negative returncode -N (killed by signal N) becomes 128+N, described as e.g. ``"SIGKILL"``.
    """
    if returncode < 0:
        sig = -returncode
        try:
            name = signal.Signals(sig).name
        except ValueError:
            name = f"signal {sig}"
        return 128 + sig, f"killed by {name}"
    return returncode, f"exit code {returncode}"


class WakeupPipe:
    """A non-blocking pipe whose write end is the process's signal wake-up descriptor
    (:func:`signal.set_wakeup_fd`): a signal's arrival makes :attr:`fd` readable, so a poll on it
    returns at once; :meth:`drain` empties it."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def install(self) -> None:
        signal.set_wakeup_fd(self._write_fd)

    def drain(self) -> bool:
        """Empty the pipe; whether a signal had arrived since the last call."""
        arrived = False
        try:
            while os.read(self.fd, 4096):
                arrived = True
        except BlockingIOError:
            pass
        return arrived
