"""The fork server: one process per node that imports torch once and forks the node's ranks.

Starting a rank as ``python script`` costs a new interpreter and its imports: ``import torch`` and
``torch._dynamo`` (which the first ``torch.optim`` optimizer imports) are about 3.5 s of CPU on this
project's machines, paid by every rank at the job's start (on a node of 8 ranks, 8 times at once)
and again by every respawned rank inside its recovery. So each node's agent starts this process
first (:class:`ftrun.node.forks.ForkServer`). It imports what a rank imports
(:func:`ftrun.rank.spare.import_libraries`: ``torch._dynamo`` too, with ``--with_dynamo``, given
for a script that imports ftrun) and forks one child per request. The idea is Android's zygote and
the ``forkserver`` start method of :mod:`multiprocessing`, applied to a launcher's ranks.

Its protocol runs on its standard input and output, pipes to the agent. It is JSON, one object a
line, and nothing is unpickled:

- once its imports are done it writes ``{"ready": true}``; requests sent before then wait in the pipe;
- it also hosts the store its launcher bound a listening socket for (``--store_fd N``, passed
  down): the job's rendezvous store on node 0 of a single-node job, the node's record store
  (:mod:`ftrun.rank.rankstate`) on every node of a multi-node job; before that answer, it forks
  the store's process (:func:`start_store`), adopted by the agent as a rank is, so the node imports
  torch once for the store and the ranks; the answer then says ``"store": pid`` (or ``"store_error": "..."``:
  the agent hosts the store itself);
- a request is a rank's assignment as a warm spare gets it (``env``, ``argv``, ``module``, ``log``,
  ``cwd``: :func:`ftrun.rank.promotion.apply_assignment`) with an ``id``;
- each answer is ``{"id": ..., "pid": ...}``, or ``{"id": ..., "error": "..."}`` when no process
  could be forked.

A rank is forked twice: this process forks a child, which forks the rank and exits. The rank is
then re-parented to the agent, a subreaper (``PR_SET_CHILD_SUBREAPER``), before its pid is
answered. So the agent is the rank's parent: it reaps it and sees its exit status and its stops
exactly as for a process it spawned (the process tree's rules, docs/architecture.md). The rank
waits for that re-parenting, arms its death signal against the agent, starts its own session,
takes its assignment, shows the rank's command line in place of the server's
(:func:`ftrun.rank.promotion.show_command`: ``ps`` shows ``python -u script args``) and runs the
script as ``__main__`` (:func:`ftrun.rank.spare.run_script`), as a promoted warm spare does.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import sys
import time
from typing import Any

from ftrun.common import procs
from ftrun.rank.promotion import apply_assignment, show_command
from ftrun.common.contract import DYNAMO_FLAG, STORE_FD_FLAG, STORE_TIMEOUT_FLAG
from ftrun.rank.spare import import_libraries, run_script

ADOPTION_WAIT_S = 10.0  # how long a forked rank waits to become its agent's child before it gives up
ADOPTION_FAILED = 70  # the exit code of a forked rank that never became its agent's child (EX_SOFTWARE)


def _answer(obj: dict[str, Any]) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(1, data):]


def fork_rank(agent: int) -> dict[str, Any] | None:
    """Fork a rank that becomes the agent's child: ``{"pid": ...}`` or ``{"error": ...}`` in this
    process, once the rank is the agent's child and leads its own session (so the agent may signal
    its group at once); None in the rank (which goes on to take its assignment)."""
    read_end, write_end = os.pipe()
    try:
        child = os.fork()
    except OSError as err:
        os.close(read_end)
        os.close(write_end)
        return {"error": f"fork: {err}"}
    if child == 0:
        os.close(read_end)
        try:
            rank = os.fork()
        except OSError:
            os._exit(1)
        if rank == 0:
            be_adopted(agent)
            os.write(write_end, b"\n")  # adopted, in its own session
            os.close(write_end)
            return None
        os.write(write_end, str(rank).encode())
        os._exit(0)  # the rank is re-parented as this process ends
    os.close(write_end)
    said = b""
    try:
        while not said.endswith(b"\n") and (chunk := os.read(read_end, 32)):  # EOF: the rank died first
            said += chunk
    finally:
        os.close(read_end)
    os.waitpid(child, 0)
    pid = said.strip()
    return {"pid": int(pid)} if pid else {"error": "the intermediate process could not fork"}


def serve(agent: int) -> dict[str, Any]:
    """Answer the agent's requests until its end of the pipe closes (then exit). Returns only in a
    forked rank: its assignment."""
    pending = b""
    while True:
        chunk = os.read(0, 1 << 16)
        if not chunk:
            sys.exit(0)
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                job = json.loads(line)
                ident = job["id"]
            except (ValueError, KeyError, TypeError) as err:
                _answer({"id": None, "error": f"a request that is not an assignment: {err}"})
                continue
            result = fork_rank(agent)
            if result is None:
                apply_assignment(job, hot=False)
                show_command([sys.executable, "-u", *(["-m"] if job["module"] else []), *map(str, job["argv"])])
                if "numpy" in sys.modules:  # each rank its own unseeded numpy stream, as in a new interpreter
                    sys.modules["numpy"].random.seed()
                return job
            _answer({"id": ident, **result})


def be_adopted(agent: int) -> None:
    """In a forked rank: wait to be the agent's child, die with it, lead a session of its own."""
    deadline = time.monotonic() + ADOPTION_WAIT_S
    while os.getppid() != agent:
        if time.monotonic() > deadline:
            os._exit(ADOPTION_FAILED)
        time.sleep(0.0005)
    procs.set_death_signal(signal.SIGKILL)
    if os.getppid() != agent:  # the agent died meanwhile
        os._exit(128 + signal.SIGKILL)
    os.setsid()


STORE_START_WAIT_S = 30.0  # how long the fork server waits for the store's process to say it serves


def start_store(agent: int, fd: int, timeout_s: float) -> dict[str, Any]:
    """Fork the process that serves the job's ``TCPStore`` on the listening socket ``fd``, adopted by
    the agent as a rank is (:func:`fork_rank`), in a session of its own. It lives as long as the
    launcher, as a store the launcher hosted would: a supervisor's death leaves it to the launcher,
    which ends it once the orphaned ranks wrote their dying gasp. Returns ``{"store": pid}`` once
    it serves, or ``{"store_error": why}``; never returns in the store's process. ``fd`` is closed
    here either way: no rank forked later inherits it."""
    import psutil

    try:
        launcher = psutil.Process(agent).ppid()
    except psutil.Error:
        launcher = None
    read_end, write_end = os.pipe()
    forked = fork_rank(agent)
    if forked is None:  # the store's process
        os.close(read_end)
        serve_store_forever(fd, timeout_s, write_end, launcher)
    os.close(write_end)
    os.close(fd)
    said = b""
    try:
        deadline = time.monotonic() + STORE_START_WAIT_S
        while "pid" in forked and time.monotonic() < deadline:
            if select.select([read_end], [], [], max(0.0, deadline - time.monotonic()))[0]:
                chunk = os.read(read_end, 4096)
                if not chunk:
                    break
                said += chunk
    finally:
        os.close(read_end)
    if "pid" in forked and said == b"ok":
        return {"store": forked["pid"]}
    return {"store_error": forked.get("error") or said.decode(errors="replace") or "the store's process ended before it served"}


def serve_store_forever(fd: int, timeout_s: float, report: int, launcher: int | None) -> None:
    """In the store's process: serve the store on ``fd``, say ``ok`` (or why not) on ``report``,
    then serve until the ``launcher`` process ends (without its pid, or without ``pidfd_open``:
    until the agent's death signal)."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for std in (0, 1):  # the agent's pipes to the fork server are not this process's to hold
        os.dup2(devnull, std)
    os.close(devnull)
    sock = socket.socket(fileno=fd)
    host, port = sock.getsockname()[:2]
    show_command(["ftrun:", "rendezvous", "store", f"{host}:{port}"])
    from ftrun.common.stores import StoreBindError, store_on_socket

    try:
        store = store_on_socket(sock, timeout_s)
    except StoreBindError as err:
        os.write(report, str(err).encode())
        os._exit(1)
    os.write(report, b"ok")
    os.close(report)
    try:
        ended = os.pidfd_open(launcher) if launcher is not None else None
    except ProcessLookupError:
        os._exit(0)  # the launcher is gone already
    except (AttributeError, OSError):
        ended = None
    if ended is not None:
        procs.set_death_signal(0)  # not the agent's death: the launcher's
        select.select([ended], [], [])  # readable once the launcher has ended
        os._exit(0)
    while True:  # ``store`` (a local of this frame) serves from its own thread
        signal.pause()


def _flag_value(flag: str) -> str | None:
    args = sys.argv[1:]
    return args[args.index(flag) + 1] if flag in args[:-1] else None


def main() -> None:
    agent = os.getppid()
    started = time.monotonic()
    import_libraries(DYNAMO_FLAG in sys.argv[1:])
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context cannot cross a fork: new processes then
        print("ftrun: the fork server's imports initialized CUDA; the ranks start as new processes", file=sys.stderr,
              flush=True)
        sys.exit(1)
    store_fd = _flag_value(STORE_FD_FLAG)
    store = start_store(agent, int(store_fd), float(_flag_value(STORE_TIMEOUT_FLAG) or 300)) if store_fd else {}
    # Into spares.log (its stderr): when the node's ranks can start without imports.
    print(f"ftrun: fork server (pid {os.getpid()}) ready at {time.time():.3f}: its imports took "
          f"{time.monotonic() - started:.2f} s" + (f"; the rendezvous store: {store}" if store else ""),
          file=sys.stderr, flush=True)
    _answer({"ready": True, **store})
    job = serve(agent)  # in a rank from here on
    os.chdir(job["cwd"])
    run_script([str(a) for a in job["argv"]], bool(job["module"]))


if __name__ == "__main__":
    main()
