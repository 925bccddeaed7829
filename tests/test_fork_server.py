"""The node's fork server: ranks forked from one process that imported torch, re-parented to the
agent, which reaps them, sees them stop, signals their session and hears of them even when the
server answers late, fails a fork, or dies (a new process then takes the rank)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import psutil
import pytest

from ftrun.node.forks import Answer, ForkedProcess, ForkedStarts, StartReport

ROOT = Path(__file__).resolve().parent.parent


class FakeServer:
    """A fork server's pipes without its process: answers are handed out as the test says."""

    def __init__(self) -> None:
        self.ready = False
        self.broken: str | None = None
        self.asked: list[dict[str, Any]] = []
        self.answering: list[Answer] = []
        self.proc = ForkedProcess(4242)
        self.closed = False

    def usable(self) -> bool:
        return self.broken is None

    def request(self, assignment: dict[str, Any]) -> int:
        self.asked.append(dict(assignment))
        return len(self.asked)

    def answers(self, wait_for: int | None = None, timeout: float = 0.0) -> list[Answer]:
        out, self.answering = self.answering, []
        return out

    def hosts_store(self) -> bool | None:
        return None

    def close(self) -> None:
        self.closed = True


class Rank:
    def __init__(self, rank: int, incarnation: int = 0) -> None:
        self.rank, self.incarnation, self.proc = rank, incarnation, ForkedProcess()


def starts(server: FakeServer) -> tuple[ForkedStarts, list[tuple[int, dict[str, str]]]]:
    anew: list[tuple[int, dict[str, str]]] = []

    def start_anew(rank: Rank, env: dict[str, str]) -> None:
        anew.append((rank.rank, env))
        rank.proc = ForkedProcess(9000 + rank.rank)

    return ForkedStarts(server, start_anew), anew  # type: ignore[arg-type]


def test_ranks_asked_before_the_server_is_ready_are_reported_when_it_answers() -> None:
    server = FakeServer()
    forks, anew = starts(server)
    r0, r1 = Rank(0), Rank(1)
    assert forks.ask(r0, {"log": "a"}, {"RANK": "0"}, "") is None  # importing: no answer waited for
    assert forks.ask(r1, {"log": "b"}, {"RANK": "1"}, "warm") is None
    assert forks.pending() and [a["log"] for a in server.asked] == ["a", "b"]
    server.answering = [Answer(2, 102), Answer(1, 101)]
    assert forks.take() == [StartReport(1, 0, 102, "warm"), StartReport(0, 0, 101, "")]
    assert (r0.proc.pid, r1.proc.pid) == (101, 102) and not forks.pending() and not anew
    assert forks.take() == []


def test_an_answer_for_another_rank_is_kept_for_the_next_look() -> None:
    server = FakeServer()
    server.ready = True
    forks, _ = starts(server)
    r0, r1 = Rank(0), Rank(1)
    forks.ask(r0, {}, {}, "")
    server.answering = [Answer(1, 101), Answer(2, 102)]  # r0's late answer, then r1's
    assert forks.ask(r1, {}, {}, "") == 102
    assert forks.take() == [StartReport(0, 0, 101, "")]


def test_a_failed_fork_and_a_dead_server_start_the_ranks_as_new_processes() -> None:
    server = FakeServer()
    forks, anew = starts(server)
    r0, r1, r2 = Rank(0), Rank(1), Rank(2)
    for r in (r0, r1, r2):
        forks.ask(r, {}, {"RANK": str(r.rank)}, "warm")
    server.answering = [Answer(1, None, "fork: [Errno 11] Resource temporarily unavailable")]
    assert forks.take() == [StartReport(0, 0, 9000, "")]
    server.broken = "the fork server exited with code -9"
    assert forks.take() == [StartReport(1, 0, 9001, ""), StartReport(2, 0, 9002, "")]
    assert [rank for rank, _ in anew] == [0, 1, 2] and anew[1][1] == {"RANK": "1"}
    assert server.closed and not forks.usable() and not forks.pending()


def test_resolving_a_rank_waits_for_its_answer_only() -> None:
    server = FakeServer()
    forks, _ = starts(server)
    r0 = Rank(0)
    forks.ask(r0, {}, {}, "")
    server.answering = [Answer(1, 101)]
    forks.resolve(r0)
    assert r0.proc.pid == 101
    assert forks.take() == [StartReport(0, 0, 101, "")]  # resolving reports it still


# A node's agent in miniature: RankProcesses with its fork server, in a process of its own (it
# becomes a subreaper), driving a script that says who its parent is and exits with a code.
_AGENT = r"""
import json, os, signal, sys, time
from pathlib import Path
from ftrun.node.spawner import RankProcesses
from ftrun.node.forks import StartReport

log_dir = Path(sys.argv[1])
script = log_dir / "rank.py"
script.write_text("import os, sys, time, torch\nimport ftrun\n"
                  "print('parent', os.getppid(), 'pgid', os.getpgid(0), 'rank', os.environ['RANK'],"
                  " 'torch', 'torch' in sys.modules, flush=True)\n"
                  "print('cmdline', open('/proc/self/cmdline', 'rb').read().split(b'\\0')[0].decode(), flush=True)\n"
                  "time.sleep(float(sys.argv[1]))\n"
                  "sys.exit(int(sys.argv[2]))\n")
out = {}

def run(seconds, code):
    return RankProcesses([sys.executable, "-u", str(script), seconds, code], [str(script), seconds, code], False,
                         log_dir, 2, "127.0.0.1", False, "t" * 64, fork_server=True)

def reports(processes, until, timeout=120.0):
    seen, deadline = [], time.monotonic() + timeout
    while not until(seen) and time.monotonic() < deadline:
        processes.sigchld_at = time.time()
        seen += processes.reap()
        time.sleep(0.02)
    return seen

def describe(seen):
    return [[type(r).__name__, r.rank, r.incarnation, getattr(r, "returncode", getattr(r, "signal", None))] for r in seen]

processes = run("0", "3")
assert processes.forks is not None
pid, spare = processes.spawn(0, 0, {"RANK": "0"}, "== header ==\n", use_spare=False)
seen = reports(processes, lambda s: any(type(r).__name__ == "ExitReport" for r in s))
out["first"] = describe(seen)
out["first_pid"] = pid if pid is not None else next(r.pid for r in seen if isinstance(r, StartReport))
out["log0"] = (log_dir / "worker_0.log").read_text()
# a respawn once the server is ready: answered at once, as a warm spare's start
pid, spare = processes.spawn(1, 0, {"RANK": "1"}, "== header ==\n", use_spare=True)
out["respawn"] = [pid is not None, spare]
# stop it (it exits 3 at once: give it time to be stopped first)
seen = reports(processes, lambda s: any(type(r).__name__ == "ExitReport" for r in s))
out["second"] = describe(seen)
processes2 = run("30", "0")
processes2.spawn(2, 0, {"RANK": "2"}, "", use_spare=True)
processes2.signal(2, 0, signal.SIGSTOP)
out["stopped"] = describe(reports(processes2, lambda s: any(type(r).__name__ == "StopReport" for r in s)))
processes2.signal(2, 0, signal.SIGKILL)
out["killed"] = describe(reports(processes2, lambda s: any(type(r).__name__ == "ExitReport" for r in s)))
server = processes2.forks.server.proc
processes.stop_spares()
processes2.stop_spares()
out["server_ended"] = server.poll() is not None
out["me"] = os.getpid()
print(json.dumps(out))
"""


@pytest.mark.integration
def test_a_forked_rank_is_the_agents_child_in_its_own_session(tmp_path: Path) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _AGENT, str(tmp_path)], env=env, capture_output=True, text=True,
                          timeout=400)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    assert out["first"] == [["StartReport", 0, 0, None], ["ExitReport", 0, 0, 3]]
    assert out["log0"].startswith("== header ==\nparent ")
    words = out["log0"].splitlines()[1].split()
    parent, pgid = words[1], words[3]
    assert int(parent) == out["me"] and int(pgid) == out["first_pid"]  # the agent's child, leading its own session
    assert "rank 0 torch True" in out["log0"]  # torch came imported
    assert f"cmdline {sys.executable} -u {tmp_path / 'rank.py'} 0 3\n" in out["log0"]  # ps shows the rank's command
    assert out["respawn"] == [True, "warm"]
    assert out["second"][-1] == ["ExitReport", 1, 0, 3]
    # asked of a server still importing, resolved before the signal: reported as started first
    assert out["stopped"] == [["StartReport", 2, 0, None], ["StopReport", 2, 0, 19]]
    assert out["killed"] == [["ExitReport", 2, 0, -9]]
    assert out["server_ended"]
    assert "fork server" in (tmp_path / "spares.log").read_text()


@pytest.mark.parametrize("text, forked", [
    ("import torch\nimport ftrun\n", True),
    ("from ftrun.integrations.hf import FTTrainer\n", True),
    ("def main():\n    import ftrun as ft\n", True),
    ("import torch.distributed as dist  # no ftrun here\n", False),
    ("# import ftrun\nprint('ftrun')\n", False),
    ("import ftrunner\n", False),
])
def test_only_scripts_that_import_ftrun_get_dynamo_in_advance(tmp_path: Path, text: str, forked: bool) -> None:
    from ftrun.node.spawner import imports_ftrun

    script = tmp_path / "train.py"
    script.write_text(text)
    assert imports_ftrun(str(script)) is forked
    assert not imports_ftrun(str(tmp_path / "missing.py"))


# Node 0 of a single-node job in miniature: the store's listening socket bound (as the launcher
# does), given to RankProcesses; a rank uses the store. With the fork server, the store's process
# is forked from it and adopted here, and this process never imports torch; without it (or when
# it cannot), this process hosts the store on the same socket.
_STORE_AGENT = r"""
import json, os, sys, time
from pathlib import Path
from ftrun.common.stores import listen_socket
from ftrun.node.spawner import RankProcesses

log_dir, fork_server = Path(sys.argv[1]), sys.argv[2] == "on"
script = log_dir / "rank.py"
script.write_text("import sys\nfrom datetime import timedelta\nfrom torch.distributed import TCPStore\n"
                  "store = TCPStore('127.0.0.1', int(sys.argv[1]), is_master=False, timeout=timedelta(seconds=60))\n"
                  "store.set('seen', 'by rank ' + sys.argv[2])\nprint('store says', store.get('seen').decode(), flush=True)\n")
sock = listen_socket("127.0.0.1", 0)
port = str(sock.getsockname()[1])
processes = RankProcesses([sys.executable, "-u", str(script), port, "0"], [str(script), port, "0"], False,
                          log_dir, 1, "127.0.0.1", False, "t" * 64, fork_server=fork_server, store=(sock.detach(), 60.0))
processes.spawn(0, 0, {"RANK": "0"}, "", use_spare=False)
deadline, done = time.monotonic() + 120, False
while not done and time.monotonic() < deadline:
    processes.sigchld_at = time.time()
    done = any(type(r).__name__ == "ExitReport" for r in processes.reap())
    time.sleep(0.02)
import psutil
out = {"log": (log_dir / "worker_0.log").read_text(), "torch_here": "torch" in sys.modules,
       "children": {c.pid: " ".join(c.cmdline()) for c in psutil.Process().children()}}
processes.stop_spares()
print(json.dumps(out))
"""


@pytest.mark.integration
@pytest.mark.parametrize("fork_server", ["on", "off"])
def test_node_zeros_store_is_hosted_by_the_fork_server_or_else_by_the_agent(tmp_path: Path, fork_server: str) -> None:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    done = subprocess.run([sys.executable, "-c", _STORE_AGENT, str(tmp_path), fork_server], env=env,
                          capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads(done.stdout.strip().splitlines()[-1])
    stores = [int(pid) for pid, cmd in out["children"].items() if cmd.startswith("ftrun: rendezvous store 127.0.0.1:")]
    try:
        assert "store says by rank 0" in out["log"], out
        assert (len(stores), out["torch_here"]) == ((1, False) if fork_server == "on" else (0, True)), out
        # The store outlives the agent, as a launcher's store would: it serves until its launcher
        # (here, this test's process) ends, so ranks orphaned by a dead agent can finish their gasp.
        assert all(psutil.Process(pid).is_running() for pid in stores), out
    finally:
        for pid in stores:
            os.kill(pid, signal.SIGKILL)
