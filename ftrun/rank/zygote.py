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
import signal
import sys
import time
from typing import Any

from ftrun.common import procs
from ftrun.rank.promotion import apply_assignment, show_command
from ftrun.common.contract import DYNAMO_FLAG
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


def main() -> None:
    agent = os.getppid()
    started = time.monotonic()
    import_libraries(DYNAMO_FLAG in sys.argv[1:])
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():  # a CUDA context cannot cross a fork: new processes then
        print("ftrun: the fork server's imports initialized CUDA; the ranks start as new processes", file=sys.stderr,
              flush=True)
        sys.exit(1)
    # Into spares.log (its stderr): when the node's ranks can start without imports.
    print(f"ftrun: fork server (pid {os.getpid()}) ready at {time.time():.3f}: its imports took "
          f"{time.monotonic() - started:.2f} s", file=sys.stderr, flush=True)
    _answer({"ready": True})
    job = serve(agent)  # in a rank from here on
    os.chdir(job["cwd"])
    run_script([str(a) for a in job["argv"]], bool(job["module"]))


if __name__ == "__main__":
    main()
