"""The agent's side of the node's fork server (:mod:`ftrun.rank.zygote`): requests out, pids back.

The fork server imports torch once; the agent asks it for each rank instead of starting a new
interpreter. The requests are asynchronous. The server may still be importing when the job's
first ranks are ordered, and the agent must not stop beating and reading meanwhile. So
:meth:`ForkServer.request` writes the request and returns; :meth:`ForkServer.answers` gives what
has come back since. A forked rank is re-parented to the agent (a subreaper) before its pid comes
back, so :class:`ForkedProcess` reaps it like a child the agent spawned itself.
"""

from __future__ import annotations

import json
import logging
import os
import select
import socket
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Mapping

from ftrun.common import contract, procs

log = logging.getLogger("ftrun.node.forks")

ANSWER_WAIT_S = 5.0  # how long a spawn waits for the server's answer once it is past its imports (a fork: ms)
START_WAIT_S = 60.0  # how long a rank about to be signalled waits for the answer (the server's imports, at worst)


class ForkedProcess:
    """A rank forked by the fork server and re-parented to this process: the part of
    :class:`subprocess.Popen` the spawner uses (``pid``, ``returncode``, :meth:`poll`, :meth:`wait`).
    ``pid`` is None until the server has answered (the rank is then taken as running)."""

    stdin = None

    def __init__(self, pid: int | None = None) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def poll(self) -> int | None:
        """The exit code (negative: the signal that killed it) once it ended and was reaped, else None."""
        if self.returncode is None and self.pid is not None:
            self._reap(os.WNOHANG)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        """Block until it ends (at most ``timeout`` seconds); its exit code.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.poll() is None:
            if deadline is not None and time.monotonic() > deadline:
                raise subprocess.TimeoutExpired(str(self.pid), timeout or 0.0)
            if deadline is None and self.pid is not None:
                self._reap(0)
            else:
                time.sleep(0.01)
        return self.returncode  # type: ignore[return-value]

    def _reap(self, flags: int) -> None:
        assert self.pid is not None
        try:
            pid, status = os.waitpid(self.pid, flags)
        except ChildProcessError:  # not this process's child (never re-parented here): nothing to read
            log.error("forked rank process %d is not this process's child: its exit status is unknown", self.pid)
            self.returncode = -9
            return
        if pid:
            self.returncode = os.waitstatus_to_exitcode(status)


@dataclass(frozen=True)
class Answer:
    """The fork server's answer to request ``ident``: the rank's ``pid``, or why there is none."""

    ident: int
    pid: int | None
    error: str | None = None


class ForkServer:
    """The node's fork server process and the pipes to it.

    Args:
        env: its environment (the node's, with no rank identity: a warm spare's).
        log_path: where its own output goes (``spares.log``).
        dynamo: import ``torch._dynamo`` before forking too (:func:`ftrun.rank.spare.import_libraries`).
        store: (the listening socket's descriptor, the operation timeout in seconds) of the job's
            rendezvous store, for the server to host (:func:`ftrun.rank.zygote.start_store`), or None.
    """

    def __init__(self, env: Mapping[str, str], log_path: Path, dynamo: bool = True,
                 store: tuple[int, float] | None = None) -> None:
        args = [contract.DYNAMO_FLAG] if dynamo else []
        if store is not None:
            args += [contract.STORE_FD_FLAG, str(store[0]), contract.STORE_TIMEOUT_FLAG, str(store[1])]
        argv = procs.ftrun_module_argv("ftrun.rank.zygote", args, unbuffered=True)
        with open(log_path, "ab") as fh:
            self.proc = procs.spawn(argv, env=dict(env), stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                    stderr=fh.fileno(), pass_fds=(store[0],) if store is not None else ())
        assert self.proc.stdin is not None and self.proc.stdout is not None
        self._in = self.proc.stdin.fileno()
        self._out = self.proc.stdout.fileno()
        os.set_blocking(self._in, False)
        os.set_blocking(self._out, False)
        self.ready = False
        self.store_pid: int | None = None  # the process serving the rendezvous store, once it serves
        self.store_error: str | None = None  # why it could not host the store it was given
        self.broken: str | None = None  # why it serves no more requests
        self._outbox = b""
        self._inbox = b""
        self._answers: list[Answer] = []  # read, not yet handed out by answers()
        self._next = 0

    def usable(self) -> bool:
        """Whether requests may still be sent (it neither died nor failed)."""
        if self.broken is None and self.proc.poll() is not None:
            self.broken = f"the fork server exited with code {self.proc.returncode}"
        return self.broken is None

    def request(self, assignment: Mapping[str, Any]) -> int:
        """Ask for a rank with this assignment (``env``, ``argv``, ``module``, ``log``, ``cwd``); its id."""
        self._next += 1
        self._outbox += (json.dumps({**assignment, "id": self._next}) + "\n").encode()
        self._flush()
        return self._next

    def answers(self, wait_for: int | None = None, timeout: float = 0.0) -> list[Answer]:
        """What the server answered since the last call; with ``wait_for``, block up to ``timeout``
        seconds for that request's answer. Marks the server broken when it is gone."""
        found: list[Answer] = []
        deadline = time.monotonic() + timeout
        while True:
            self._flush()
            self._read()
            found.extend(self._answers)
            self._answers.clear()
            if wait_for is None or any(a.ident == wait_for for a in found) or not self.usable():
                return found
            left = deadline - time.monotonic()
            if left <= 0:
                return found
            select.select([self._out], [self._in] if self._outbox else [], [], left)

    def _flush(self) -> None:
        if not self._outbox or self.broken is not None:
            return
        try:
            sent = os.write(self._in, self._outbox)
        except BlockingIOError:
            return
        except OSError as err:  # BrokenPipeError: it died
            self.broken = f"the fork server's input closed ({err})"
            return
        self._outbox = self._outbox[sent:]

    def hosts_store(self) -> bool | None:
        """Whether it serves the rendezvous store it was given: True once it said so, False when it
        could not (or died first), None while that is not known yet."""
        self._read()
        if self.store_pid is not None:
            return True
        return False if self.store_error is not None or not self.usable() else None

    def _read(self) -> None:
        try:
            while chunk := os.read(self._out, 1 << 16):
                self._inbox += chunk
        except BlockingIOError:
            pass
        except OSError as err:
            self.broken = f"the fork server's output failed ({err})"
        while b"\n" in self._inbox:
            line, self._inbox = self._inbox.split(b"\n", 1)
            try:
                obj = json.loads(line)
            except ValueError:
                self.broken = f"the fork server wrote {line[:80]!r}"
                continue
            if obj.get("ready"):
                self.ready = True
                self.store_pid, self.store_error = obj.get("store"), obj.get("store_error")
            elif isinstance(obj.get("id"), int):
                self._answers.append(Answer(obj["id"], obj.get("pid"), obj.get("error")))

    def close(self) -> None:
        """End the server (its children, the ranks, are not its own: they live on)."""
        procs.stop_all([self.proc], 0.0)
        for pipe in (self.proc.stdin, self.proc.stdout):
            if pipe is not None:
                pipe.close()


@dataclass(frozen=True)
class StartReport:
    """A rank process the fork server started after the spawn order was carried out (its pid was
    not known then): report it as spawned now.

    Attributes:
        rank, incarnation, pid: the process.
        spare: "warm" when it replaces a rank (a fork of a process that has imported torch is a warm
            spare's start), else "".
    """

    rank: int
    incarnation: int
    pid: int
    spare: str


class ForkedStarts:
    """The node's fork server and the ranks asked of it that it has not answered yet.

    A rank is a record with ``rank``, ``incarnation`` and ``proc`` (a :class:`ForkedProcess` whose
    pid is filled in by the answer). A failed fork, or a server that is gone, starts the rank as a
    new process instead (``start_anew(rank, env)``); the server is then given up for good.

    Args:
        server: the fork server.
        start_anew: starts a rank's process without the server; sets its ``proc``.
    """

    def __init__(self, server: ForkServer, start_anew: Callable[[Any, dict[str, str]], None]) -> None:
        self.server: ForkServer | None = server
        self._start_anew = start_anew
        self._asked: dict[int, tuple[Any, dict[str, str], str]] = {}  # request id -> (rank, its env, spare kind)
        self._early: list[StartReport] = []  # answered while another rank was being asked for
        self._store_hosted: bool | None = None  # what hosts_store() said last

    def usable(self) -> bool:
        return self.server is not None and self.server.usable()

    def pending(self) -> bool:
        """Whether some rank's pid is not known yet."""
        return bool(self._asked)

    def server_pid(self) -> int | None:
        return self.server.proc.pid if self.server is not None else None

    def ask(self, rank: Any, assignment: Mapping[str, Any], env: dict[str, str], spare: str) -> int | None:
        """Ask for ``rank``'s process; its pid when the server answers at once (it is past its
        imports), else None (:meth:`take` reports it later)."""
        assert self.server is not None
        ident = self.server.request(assignment)
        self._asked[ident] = (rank, env, spare)
        started = self._take()
        if self.server is not None and self.server.ready and ident in self._asked:
            started += self._take(ident, ANSWER_WAIT_S)
        mine = [s for s in started if s.rank == rank.rank and s.incarnation == rank.incarnation]
        self._early.extend(s for s in started if s not in mine)
        return mine[0].pid if mine else None

    def take(self) -> list[StartReport]:
        """The ranks started since the last call."""
        started, self._early = self._early + self._take(), []
        return started

    def resolve(self, rank: Any) -> None:
        """Block until ``rank``'s process is known (at most :data:`START_WAIT_S` per try)."""
        while rank.proc.pid is None:
            ident = next((i for i, (r, _e, _s) in self._asked.items() if r is rank), None)
            if ident is None:
                return
            self._early.extend(self._take(ident, START_WAIT_S))

    def hosts_store(self) -> bool | None:
        """Whether the fork server serves the rendezvous store (:meth:`ForkServer.hosts_store`),
        also once the server is given up."""
        if self.server is not None:
            self._store_hosted = self.server.hosts_store()
        return self._store_hosted

    def close(self) -> None:
        if self.server is not None:
            self._store_hosted = self.server.hosts_store() is True
            self.server.close()
            self.server = None

    def _take(self, wait_for: int | None = None, timeout: float = 0.0) -> list[StartReport]:
        if self.server is None or not self._asked:
            return []
        started = []
        for answer in self.server.answers(wait_for, timeout):
            rank, env, spare = self._asked.pop(answer.ident, (None, {}, ""))
            if rank is None:
                continue
            if answer.pid is None:
                log.warning("the fork server could not start rank %d (%s): a new process takes it", rank.rank, answer.error)
                self._start_anew(rank, env)
            else:
                rank.proc.pid = answer.pid
            started.append(StartReport(rank.rank, rank.incarnation, rank.proc.pid, spare if answer.pid else ""))
        if not self.server.usable():
            log.warning("%s: ranks start as new processes from now on", self.server.broken)
            for rank, env, _spare in self._asked.values():
                self._start_anew(rank, env)
                started.append(StartReport(rank.rank, rank.incarnation, rank.proc.pid, ""))
            self._asked.clear()
            self.close()
        return started


class NodeStore:
    """The store this node was given to host, as its listening socket ((descriptor, operation
    timeout in seconds), bound by the launcher; None: none to host): the job's rendezvous store on
    node 0 of a single-node job, the node's record store in a multi-node job
    (:mod:`ftrun.rank.rankstate`).

    The fork server hosts it (:func:`ftrun.rank.zygote.start_store`): node 0 then imports torch once.
    Once the server cannot (it is off, could not host it, or died before it did), this process
    hosts it on the same socket (:meth:`ensure`), importing torch.
    """

    def __init__(self, socket_and_timeout: tuple[int, float] | None) -> None:
        self._socket = socket_and_timeout
        self.store: Any = None  # the store, when this process hosts it

    def ensure(self, forks: ForkedStarts | None) -> None:
        """Host the store here if the fork server (``forks``, None: none) cannot; called before
        each spawn and each reap, it does nothing once settled."""
        if self._socket is None:
            return
        hosted = forks.hosts_store() if forks is not None else False
        if hosted is None:
            return  # the fork server has not said yet
        fd, timeout_s = self._socket
        self._socket = None
        if hosted:
            os.close(fd)  # the store's process has its own copy
            return
        from ftrun.common.stores import store_on_socket

        log.warning("the fork server does not host the node's store: the agent does")
        self.store = store_on_socket(socket.socket(fileno=fd), timeout_s)
