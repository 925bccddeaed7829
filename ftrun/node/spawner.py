"""The processes of one node: ranks and warm spares, spawned, reaped, signalled (no torch here).

This is the machinery of a node agent (MindCluster's ``reset_process`` role), used by node 0's
in-process agent and by the agent process of every other node alike. It follows two process
rules: whoever spawns a process reaps it (exit codes and signals are exact), and no process
outlives its parent (``PR_SET_PDEATHSIG``, see :mod:`ftrun.common.procs`). It decides nothing:
the coordinator tells it what to spawn and what to kill, and it reports each exit.

Each rank's environment is this node's own environment plus the variables the coordinator sends
(torchrun's, msrun's and ftrun's contract, :func:`ftrun.coordinator.environment.rank_environment`), so that what differs
between hosts (paths, interfaces, virtual environments) stays each host's. A spare's environment
has no rank identity (:data:`ftrun.common.contract.IDENTITY_VARS`) until its promotion hands one over.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import os
import re
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Mapping

from ftrun.common import contract, procs
from ftrun.node import errorfile
from ftrun.node.forks import ForkedProcess, ForkedStarts, ForkServer, NodeStore, StartReport
from ftrun.common.contract import nccl_environment

log = logging.getLogger("ftrun.node.spawner")

STACK_DUMP_WAIT_S = 2.0  # how long a hung rank gets to write its stacks before it is killed
# Variables of ftrun's own processes that a rank must not inherit.
INTERNAL_VARS = (
    "FTRUN_TOKEN_FOR_SUPERVISOR", "FTRUN_SUPERVISOR_SPEC", "FTRUN_EVENTS_ADDR", "FTRUN_STORE_PORT", "FTRUN_STORE_FD",
    "FTRUN_AGENT_SPEC", "FTRUN_CONTROL_FOR_AGENT",
)
TOKEN_VAR = contract.TOKEN  # the job secret in a rank's environment (set by its node's agent, never sent)
HOT_SPARE_VAR = contract.HOT_SPARE  # "1" in a hot spare's environment until it is promoted
SPARE_READY_VAR = contract.SPARE_READY  # the file a hot spare creates once it waits for its rank
#: Lines of a rank's log kept with its exit report when it exited with an error code, or was killed by
#: a fatal signal (its faulthandler stacks), and wrote no error file.
EXIT_TAIL_LINES = 20
FATAL_SIGNALS = frozenset({signal.SIGSEGV, signal.SIGABRT, signal.SIGBUS, signal.SIGFPE, signal.SIGILL})
# What names a rank: absent from a spare's environment (hot or warm) until its promotion gives them.
RANK_IDENTITY_VARS = contract.IDENTITY_VARS


@dataclass(frozen=True)
class ExitReport:
    """A rank process that ended, as its parent saw it.

    Attributes:
        rank, incarnation, pid: the process.
        error: the uncaught exception it recorded (torchrun's ``@record`` error file), one line.
        log_tail: the last lines of its log when it exited with a code other than 0 and wrote no
            error file (a traceback, usually: the root cause the event log keeps).
        returncode: ``Popen.returncode`` (negative: killed by that signal).
        at: Unix time the exit was seen (the SIGCHLD's arrival when there was one), seconds.
    """

    rank: int
    incarnation: int
    pid: int
    returncode: int
    at: float
    error: str | None = None  # "Type: message" from the rank's torchrun error file (@record), if any
    log_tail: tuple[str, ...] = ()


@dataclass(frozen=True)
class StopReport:
    """A rank process stopped by a signal (SIGSTOP, SIGTSTP...): frozen, seen at once by its parent.

    Attributes:
        rank, incarnation, pid: the process.
        signal: the signal that stopped it.
        at: Unix time the SIGCHLD arrived, seconds.
    """

    rank: int
    incarnation: int
    pid: int
    signal: int
    at: float


@dataclass
class _Proc:
    rank: int
    incarnation: int
    proc: subprocess.Popen | ForkedProcess
    log_path: Path
    error_file: Path | None = None
    stop_reported: bool = False
    setup_ready: Path | None = None  # a hot spare given this rank in its set-up: the file it makes at its loop


def loopback_hostname() -> bool:
    """True when this host's name resolves to a loopback address (common in containers and
    network namespaces): gloo would then bind its data plane to loopback and never meet the
    other hosts (the classic torchrun multi-node hang)."""
    try:
        infos = socket.getaddrinfo(socket.gethostname(), None, socket.AF_INET)
    except OSError:
        return True
    return all(ipaddress.ip_address(info[4][0]).is_loopback for info in infos)


def interface_towards(addr: str) -> str | None:
    """The name of the network interface this host uses to reach ``addr``, or None.

    A UDP socket is "connected" to ``addr`` (which sends nothing) and its local address is matched
    against the interfaces' addresses (psutil).
    """
    import psutil

    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
            sock.connect((addr, 9))
            local = sock.getsockname()[0]
    except OSError:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == local for a in addrs):
            return name
    return None


class RankProcesses:
    """Owns one node's rank processes and warm spares.

    Args:
        argv: the command line of a rank (``python -u script args`` or a program).
        script_argv: the script and its arguments as a warm spare runs them (``runpy``).
        module: whether the script is a module (``-m``).
        log_dir: where ``worker_<rank>.log`` and ``spares.log`` go.
        local_worker_num: ranks on this node (for ``OMP_NUM_THREADS``).
        master_addr: node 0's address (to choose the data-plane interface).
        multi_node: whether the job spans several nodes.
        token: the job secret, given to every rank and spare as ``FTRUN_TOKEN`` (the node's own copy:
            the coordinator's ``spawn`` frames never carry it).
        fork_server: start ranks from the node's fork server (:mod:`ftrun.node.forks`).
        store: (descriptor, operation timeout in seconds) of the listening socket of a store,
            bound by the launcher, for this node to host (the job's rendezvous store on node 0 of
            a single-node job, the node's record store in a multi-node job): the fork server does
            (the node then imports torch once, not once more in the agent); without one, or when
            it cannot, this process does (:class:`~ftrun.node.forks.NodeStore`).
    """

    def __init__(self, argv: list[str], script_argv: list[str], module: bool, log_dir: Path, local_worker_num: int,
                 master_addr: str, multi_node: bool, token: str, fork_server: bool = False,
                 store: tuple[int, float] | None = None) -> None:
        self.argv = argv
        self.token = token
        self.script_argv = script_argv
        self.module = module
        self.log_dir = log_dir
        self.local_worker_num = local_worker_num
        self.procs: dict[int, _Proc] = {}
        self.spares: list[subprocess.Popen] = []
        self._hot: dict[subprocess.Popen, Path] = {}  # the hot spares -> the file each creates once it waits for a rank
        self._spare_count = 0
        self.hot_broken: str | None = None  # why this node no longer starts hot spares
        self._pending_note: str | None = None  # a finding of reap() for the next keep_spares() to return
        self.sigchld_at: float | None = None  # arrival of the first SIGCHLD not yet acted on
        self.interface_note: str | None = None
        self._extra_env: dict[str, str] = {}
        if multi_node and "GLOO_SOCKET_IFNAME" not in os.environ and loopback_hostname():
            iface = interface_towards(master_addr)
            if iface is not None:
                self._extra_env["GLOO_SOCKET_IFNAME"] = iface
                self.interface_note = (
                    f"this host's name resolves to a loopback address; ranks get GLOO_SOCKET_IFNAME={iface} "
                    f"(the interface that routes to {master_addr}); set GLOO_SOCKET_IFNAME to choose another"
                )
        # The node's fork server (ftrun.rank.zygote), started now: it imports while the job sets up.
        # Its ranks are re-parented here, so this process must be able to adopt them (a subreaper).
        self.forks: ForkedStarts | None = None
        self.dynamo = not module and imports_ftrun(script_argv[0])  # import torch._dynamo in advance
        self.store = NodeStore(store)
        if fork_server and argv[:1] == [sys.executable] and not module and procs.become_subreaper():
            self.forks = ForkedStarts(ForkServer(self._spare_env(), log_dir / "spares.log", self.dynamo, store),
                                      self._spawn_anew)
        self.store.ensure(self.forks)

    # ----------------------------------------------------------------- environment
    def environment(self, rank_vars: Mapping[str, str]) -> dict[str, str]:
        """This node's environment, less ftrun's internal variables, plus ``rank_vars`` and the job
        secret."""
        env = {k: v for k, v in os.environ.items() if k not in INTERNAL_VARS}
        if contract.RESUME_DIR not in rank_vars:
            env.pop(contract.RESUME_DIR, None)
            env.pop(contract.RESUME_STEP, None)
        env.update(self._extra_env)
        env.update(rank_vars)
        env[TOKEN_VAR] = self.token
        # A rank killed by a fatal signal (SIGSEGV in an extension, SIGABRT from C++) leaves the
        # Python stacks of its threads in its log (faulthandler), unless the user chose otherwise.
        env.setdefault("PYTHONFAULTHANDLER", "1")
        # NCCL's watchdog must not end a rank ftrun recovers (ftrun.common.contract.NCCL_SETTINGS; the user's win).
        env.update(nccl_environment(env, env.get("FTRUN_ARF") == "1"))
        if self.local_worker_num > 1 and "OMP_NUM_THREADS" not in os.environ:
            env["OMP_NUM_THREADS"] = "1"  # as torchrun does: ranks would oversubscribe the cores
        return env

    # ----------------------------------------------------------------- spawning
    def spawn(self, rank: int, incarnation: int, rank_vars: Mapping[str, str], header: str, use_spare: bool) -> tuple[int, str]:
        """Start ``incarnation`` of ``rank`` (in an idle warm spare if ``use_spare`` and one is up).

        Args:
            rank, incarnation: the identity of the new process.
            rank_vars: the coordinator's variables for it.
            header: the line written to its log before it starts.
            use_spare: hand it to a warm spare when one is idle.

        Returns:
            (its pid, which spare took it: "hot", "warm", or "" for a new process).

        Raises:
            OSError: the program cannot be executed.
        """
        self.store.ensure(self.forks)
        path = self.log_dir / f"worker_{rank}.log"
        env = self.environment(rank_vars)
        if rank in self.procs and self.procs[rank].proc.pid is not None:  # its predecessor: a respawned rank waits
            env[contract.PREVIOUS_PID] = str(self.procs[rank].proc.pid)  # for its GPU memory (ftrun.rank.cuda)
        # torchrun's contract: @record writes the rank's uncaught exception here (read at its exit)
        error_file = errorfile.error_file_path(self.log_dir, rank, incarnation, int(rank_vars.get("FTRUN_ATTEMPT", "0")))
        errorfile.prepare_error_file(error_file)
        env.update(errorfile.error_file_env(error_file))
        with open(path, "ab") as fh:
            fh.write(header.encode())
            fh.flush()
            proc, spare, setup_ready = self._take_spare(env, path) if use_spare else (None, "", None)
            if proc is None and self.forks is not None and self.forks.usable():
                p = self.procs[rank] = _Proc(rank, incarnation, ForkedProcess(), path, error_file)
                job = {"env": env, "argv": self.script_argv, "module": self.module, "log": str(path), "cwd": os.getcwd()}
                return self.forks.ask(p, job, env, "warm" if use_spare else ""), "warm" if use_spare else ""
            if proc is None:
                proc = self._new_interpreter(env, fh.fileno())
        self.procs[rank] = _Proc(rank, incarnation, proc, path, error_file, setup_ready=setup_ready)
        return proc.pid, spare

    def _spawn_anew(self, p: _Proc, env: dict[str, str]) -> None:
        """Start ``p``'s process as a new interpreter (the fork server could not)."""
        with open(p.log_path, "ab") as fh:
            p.proc = self._new_interpreter(env, fh.fileno())

    def _new_interpreter(self, env: dict[str, str], log_fd: int) -> subprocess.Popen:
        """A rank's process started as a new interpreter, its output (both streams) on ``log_fd``."""
        return procs.spawn(self.argv, env=env, stdout=log_fd, stderr=subprocess.STDOUT)

    def keep_spares(self, warm: int, hot: int, model_vars: Mapping[str, str]) -> str | None:
        """Keep ``warm`` warm spares (torch imported, waiting on their stdin) and ``hot`` hot ones
        (the script itself runs in them up to its training loop, without a rank: :mod:`ftrun.rank.spare`)
        running, side by side: a fault that comes before a hot spare is ready, or right after one was
        promoted, finds a warm one. Spares above the counts are left running.

        A hot spare that exits with an error code before it is promoted shows that the script
        breaks the hot-spare contract (it needs its rank in its set-up); the node then keeps warm
        spares in place of its hot ones. Returns that finding, once, as a sentence; else None. A
        spare killed by a signal is simply replaced.
        """
        note, self._pending_note = self._pending_note, None
        alive = []
        for spare in self.spares:
            code = spare.poll()
            if code is None:
                alive.append(spare)
            elif code > 0 and spare in self._hot and self.hot_broken is None:
                last = tail_lines(self.log_dir / "spares.log", 3)
                self.hot_broken = (f"a hot spare exited with code {code} in the script's set-up, before any "
                                   f"rank was given to it ({' | '.join(last)[-300:] or 'no output'}); the script needs "
                                   "its rank before its training loop (docs/hot_spares.md): this node keeps warm "
                                   "spares instead")
                note = self.hot_broken
        self.spares = alive
        for gone in [p for p in self._hot if p not in alive]:
            _unlink(self._hot.pop(gone))
        if self.hot_broken is not None:
            warm, hot = warm + hot, 0
        if self.forks is not None and self.forks.usable():
            warm = 0  # the fork server is this node's warm spare: a fork of it takes a failed rank's place
        # hot ones first: they take a rank first (_take_spare), and a warm one imports meanwhile
        while len(self._hot) < hot:
            self._start_spare(True, model_vars)
        while len(self.spares) - len(self._hot) < warm:
            self._start_spare(False, model_vars)
        return note

    def _spare_env(self, model_vars: Mapping[str, str] | None = None) -> dict[str, str]:
        """A spare's (or the fork server's) environment: no rank's identity (the coordinator's
        variables are some rank's), so a process listing never shows a spare as a rank, and a hot
        spare's script that reads them before its loop fails, never guesses. The promotion hands
        the identity over (ftrun.rank.promotion), written in the room kept last."""
        env = contract.strip_identity(self.environment(model_vars or {}))
        env.pop(contract.IDENTITY_PAD, None)
        env[contract.IDENTITY_PAD] = "-" * contract.IDENTITY_PAD_BYTES  # last: see ftrun.rank.promotion.show_identity
        return env

    def _start_spare(self, hot: bool, model_vars: Mapping[str, str]) -> None:
        env = self._spare_env(model_vars)
        argv = spare_argv(hot, self.dynamo)
        ready = None
        if hot:
            env[HOT_SPARE_VAR] = "1"
            env[contract.SPARE_JOB] = json.dumps({"argv": self.script_argv, "module": self.module, "cwd": os.getcwd()})
            self._spare_count += 1
            ready = self.log_dir / f".hot_spare_{os.getpid()}_{self._spare_count}.ready"
            env[SPARE_READY_VAR] = str(ready)
            env[contract.IDENTITY_PAD] = env.pop(contract.IDENTITY_PAD)  # last again
        with open(self.log_dir / "spares.log", "ab") as fh:
            spare = procs.spawn(argv, env=env, stdout=fh.fileno(), stderr=subprocess.STDOUT, stdin=subprocess.PIPE)
        self.spares.append(spare)
        if ready is not None:
            self._hot[spare] = ready
        log.info("%s spare started (pid %d)", "hot" if hot else "warm", spare.pid)

    def _take_spare(self, env: dict[str, str], log_path: Path) -> tuple[subprocess.Popen | None, str, Path | None]:
        """Hand the rank to an idle spare: (it, "hot" or "warm", for a hot spare still in the
        script's set-up the file it creates at its loop), or (None, "", None) when none is idle."""
        # A hot spare that waits for its rank first (past the script's set-up, or as far as the
        # script lets it go), then one still in its set-up (it has imported and built more than a
        # warm spare: it finishes its set-up and takes the rank at the loop, never later than a new
        # process would), then a warm one. A hot spare in its set-up that then fails as
        # the rank shows the script breaks the contract (reap() turns hot spares off, as for a spare).
        ready = [p for p in self.spares if p in self._hot and self._hot[p].exists()]
        in_setup = [p for p in self.spares if p in self._hot and p not in ready]
        candidates = ready + in_setup + [p for p in self.spares if p not in self._hot]
        for spare in candidates:
            self.spares.remove(spare)
            kind, setup_ready = "warm", None
            if spare in self._hot:
                ready_file = self._hot.pop(spare)
                if spare in in_setup:
                    setup_ready = ready_file  # removed by reap() once the rank has ended
                else:
                    _unlink(ready_file)
                kind = "hot"
            if spare.poll() is not None or spare.stdin is None:
                continue
            job = {"env": env, "argv": self.script_argv, "module": self.module, "log": str(log_path), "cwd": os.getcwd()}
            try:
                spare.stdin.write(json.dumps(job).encode())
                spare.stdin.close()
            except OSError:
                continue  # it died just now
            return spare, kind, setup_ready
        return None, "", None

    # ----------------------------------------------------------------- reaping and signals
    def reap(self) -> list[ExitReport | StopReport | StartReport]:
        """Report the ranks the fork server started since the last look, and reap every rank process
        that has ended (and SIGKILL what it left in its session); after a SIGCHLD, also report once
        each rank that a signal stopped (the kernel tells a parent when a child stops: a frozen rank
        is found at once, not after the heartbeat timeout)."""
        died_at, self.sigchld_at = self.sigchld_at, None
        reports: list[ExitReport | StopReport | StartReport] = [*self.forks.take()] if self.forks is not None else []
        self.store.ensure(self.forks)
        if died_at is not None:
            reports.extend(self._stopped(died_at))
            if self.forks is not None and not self.forks.pending():
                self._reap_orphans()
        for rank, p in list(self.procs.items()):
            rc = p.proc.poll()
            if rc is None:
                continue
            procs.signal_group(p.proc, signal.SIGKILL)  # leave none of its children behind
            del self.procs[rank]
            reached_loop = p.setup_ready is None or p.setup_ready.exists()
            if p.setup_ready is not None:
                _unlink(p.setup_ready)
            if not reached_loop and rc > 0 and self.hot_broken is None:
                self.hot_broken = (f"rank {rank}, given to a hot spare still in the script's set-up, exited with code {rc} "
                                   "before its training loop; the script may need its rank before its loop "
                                   "(docs/hot_spares.md): this node keeps warm spares instead")
                self._pending_note = self.hot_broken
            error = errorfile.read_error_file(p.error_file) if rc != 0 and p.error_file is not None else None
            explained = rc > 0 or -rc in FATAL_SIGNALS  # an error code, or a crash that dumped its stacks
            tail = tuple(line[:300] for line in tail_lines(p.log_path, EXIT_TAIL_LINES)) if explained and error is None else ()
            reports.append(ExitReport(rank, p.incarnation, p.proc.pid, rc, died_at or time.time(),
                                      error.summary()[:500] if error is not None else None, tail))
        return reports

    def _reap_orphans(self) -> None:
        """Reap the processes re-parented here that are not this node's ranks, spares or fork server
        (what a dead rank left in its session, killed by :meth:`reap`): a subreaper adopts them."""
        import psutil

        known = {p.proc.pid for p in self.procs.values()} | {s.pid for s in self.spares}
        if self.forks is not None:
            known.add(self.forks.server_pid())
        try:
            children = psutil.Process().children()
        except psutil.Error:
            return
        for child in children:
            try:
                if child.pid not in known and child.status() == psutil.STATUS_ZOMBIE:
                    os.waitpid(child.pid, os.WNOHANG)
            except (psutil.Error, ChildProcessError):
                pass

    def _stopped(self, at: float) -> list[StopReport]:
        found = []
        for p in self.procs.values():
            if p.stop_reported or p.proc.pid is None:
                continue
            try:
                info = os.waitid(os.P_PID, p.proc.pid, os.WSTOPPED | os.WNOHANG | os.WNOWAIT)
            except ChildProcessError:
                continue
            if info is not None and info.si_code == os.CLD_STOPPED:
                p.stop_reported = True
                found.append(StopReport(p.rank, p.incarnation, p.proc.pid, info.si_status, at))
        return found

    def pid(self, rank: int, incarnation: int) -> int | None:
        p = self.procs.get(rank)
        return p.proc.pid if p is not None and p.incarnation == incarnation else None

    def signal(self, rank: int, incarnation: int, sig: int) -> None:
        """Send ``sig`` to the process group of that rank's process, if it is still that process."""
        if self.holds(rank, incarnation):
            self._resolve(self.procs[rank])
            procs.signal_group(self.procs[rank].proc, sig)

    def stop(self, grace_period: float) -> list[ExitReport | StopReport | StartReport]:
        """Stop every rank (SIGTERM, then SIGKILL after ``grace_period`` s) and reap them."""
        for p in self.procs.values():
            self._resolve(p)
        procs.stop_all([p.proc for p in self.procs.values()], grace_period)
        return self.reap()

    def _resolve(self, p: _Proc) -> None:
        """Wait for the fork server's answer about ``p`` (before it is signalled or stopped)."""
        if p.proc.pid is None and self.forks is not None:
            self.forks.resolve(p)

    def stop_spares(self) -> None:
        """Stop the spares and the fork server (the job ends)."""
        if self.forks is not None:
            self.forks.close()
        procs.stop_all(self.spares, 0.0)
        self.spares = []
        for path in self._hot.values():
            _unlink(path)
        self._hot.clear()

    def holds(self, rank: int, incarnation: int) -> bool:
        """Whether this node runs (or has not reaped yet) that incarnation of ``rank``."""
        p = self.procs.get(rank)
        return p is not None and p.incarnation == incarnation

    def kill_hung(self, rank: int, incarnation: int, line: str,
                  dump: bool) -> tuple[list[str], str, ExitReport | None]:
        """Dump a hung rank's stacks (if ``dump``: only the worker library answers), write ``line``
        in its log (``{note}`` replaced by how the dump went), SIGKILL it; returns (the stacks' lines,
        the note, the exit to report when this node never ran that incarnation, else None).

        An incarnation this node never ran: a coordinator that took the job over restored its spawn,
        but the order died with the coordinator that gave it. No process will ever exit for it, so
        its exit is reported as killed, and the coordinator that asked for the kill recovers the
        rank as a death instead of waiting."""
        held = self.holds(rank, incarnation)
        if held:
            self._resolve(self.procs[rank])
        if dump:
            lines, note = self.dump_stacks(rank, incarnation)
        else:
            lines, note = [], "no stack dump (the rank does not use the worker library)"
        self.note_in_log(rank, line.replace("{note}", note))
        self.signal(rank, incarnation, signal.SIGKILL)
        gone = None if held else ExitReport(
            rank, incarnation, 0, -signal.SIGKILL, time.time(),
            log_tail=(f"ftrun: this node runs no incarnation {incarnation} of rank {rank} (its spawn order was lost with the "
                      "coordinator that gave it)",))
        return lines, note, gone

    def dump_stacks(self, rank: int, incarnation: int) -> tuple[list[str], str]:
        """Ask a rank for the Python stacks of all its threads (faulthandler on SIGUSR1, set up by
        the worker library) and return the lines it wrote to its log, and a note. A stopped
        process cannot answer and is not waited for; the wait is at most
        :data:`STACK_DUMP_WAIT_S` seconds."""
        import psutil

        p = self.procs.get(rank)
        if p is None or p.incarnation != incarnation:
            return [], "no stack dump (the process is gone)"
        path = p.log_path
        try:
            if psutil.Process(p.proc.pid).status() == psutil.STATUS_STOPPED:
                return [], "no stack dump (the process is stopped)"
            start = path.stat().st_size
            os.kill(p.proc.pid, signal.SIGUSR1)
        except (OSError, psutil.Error):
            return [], "no stack dump (the process is gone)"
        deadline = time.monotonic() + STACK_DUMP_WAIT_S
        size, changed = start, time.monotonic()
        while time.monotonic() < deadline:
            time.sleep(0.05)
            try:
                now_size = path.stat().st_size
            except OSError:
                break
            if now_size != size:
                size, changed = now_size, time.monotonic()
            elif size > start and time.monotonic() - changed >= 0.2:
                break  # written and quiet: the dump is complete
        if size <= start:
            return [], f"no stack dump within {STACK_DUMP_WAIT_S:g} s"
        with open(path, "rb") as fh:
            fh.seek(start)
            lines = fh.read(size - start).decode("utf-8", "replace").splitlines()
        return lines, f"stacks of all threads written to {path}"

    def note_in_log(self, rank: int, line: str) -> None:
        try:
            with open(self.log_dir / f"worker_{rank}.log", "a", encoding="utf-8") as fh:
                fh.write(line + "\n")
        except OSError:
            pass


def _unlink(path: Path) -> None:
    try:
        path.unlink()
    except OSError:
        pass


def tail_lines(path: Path, n: int) -> list[str]:
    """The last ``n`` lines a rank's current incarnation wrote to its log (empty if unreadable)."""
    try:
        with open(path, "rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 64 * 1024))
            data = fh.read().decode("utf-8", "replace")
    except OSError:
        return []
    lines = data.splitlines()
    starts = [i for i, line in enumerate(lines) if line.startswith("===== ftrun:")]
    lines = lines[(starts[-1] + 1) if starts else 0 :]
    crashes = [i for i, line in enumerate(lines) if line.startswith("Fatal Python error:")]
    if crashes:  # faulthandler's dump of a fatal signal: its header and the crashed thread first
        return crash_first(lines[crashes[-1]:])[:n]
    return lines[-n:]


def crash_first(dump: list[str]) -> list[str]:
    """faulthandler's dump (from its ``Fatal Python error:`` line) with the crashed thread's stack
    (``Current thread ...``) right after the header, then the other threads': one stack per
    thread of the rank (its I/O and record threads included) would push the header and the
    crashing frame out of a short tail."""
    current = next((i for i, line in enumerate(dump) if line.startswith("Current thread")), None)
    if current is None:
        return dump
    end = next((i for i in range(current + 1, len(dump)) if not dump[i].startswith("  ")), len(dump))
    return dump[:1] + dump[current:end] + [line for line in dump[1:current] + dump[end:] if line.strip()]


def spare_argv(hot: bool, dynamo: bool = True) -> list[str]:
    """A spare's command line: ``python -u -m ftrun.rank.spare`` (``--hot`` for a hot one,
    ``--with_dynamo`` to import ``torch._dynamo`` in advance), importing the installed ftrun and torch
    whatever the job's working directory holds (:func:`ftrun.common.procs.ftrun_module_argv`); the
    script it runs later gets its own directory first on ``sys.path`` (:func:`ftrun.rank.spare.run_script`)."""
    return procs.ftrun_module_argv("ftrun.rank.spare", [*(["--hot"] if hot else []), *([contract.DYNAMO_FLAG] if dynamo else [])],
                                   unbuffered=True)


_FTRUN_IMPORT = re.compile(rb"^[ \t]*(import|from)[ \t]+ftrun\b", re.MULTILINE)


def imports_ftrun(script: str) -> bool:
    """Whether the script's own file imports ftrun (a line ``import ftrun...`` or ``from ftrun...``).

    Only for such a script do the fork server and the spares import ``torch._dynamo`` in advance; a
    script written for torchrun imports it itself, as under torchrun
    (:func:`ftrun.rank.spare.import_libraries` says why: a DDP script that starts with it imported
    could hang at its exit). A script that imports ftrun only through another module of its own is
    not seen: its ranks import torch._dynamo themselves, a little slower, never wrong."""
    try:
        with open(script, "rb") as fh:
            return _FTRUN_IMPORT.search(fh.read(1 << 20)) is not None
    except OSError:
        return False


def rank_argv(no_python: bool, module: bool, script: str, script_args: list[str]) -> list[str]:
    """A rank's command line: the program itself, ``python -u -m module``, or ``python -u script``."""
    if no_python:
        return [script, *script_args]
    if module:
        return [sys.executable, "-u", "-m", script, *script_args]
    return [sys.executable, "-u", script, *script_args]


def kw(obj: Any, name: str, default: Any = None) -> Any:
    """``getattr`` for JobSpec fields that older specs may lack."""
    return getattr(obj, name, default)


def shared_dir_marker(control_addr: str, token: str) -> str:
    """The name of the marker file that shows a node sees node 0's checkpoint directory (unique to
    the job: derived from its control address and secret, revealing neither)."""
    import hashlib

    return ".ftrun-node0-" + hashlib.sha256(f"{control_addr}\0{token}".encode()).hexdigest()[:20]
