"""Integration tests of the launcher and supervisor with real processes (small torch-free ranks).

Every test synchronises on files the ranks write (``env_<rank>_<attempt>.json`` when they start,
``ready_<rank>_<attempt>.json`` when they wait) and on ftrun's exit; the only clocks are generous
upper bounds. The ``ftrun_proc`` fixture kills whatever a test started, whatever happens.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import psutil
import pytest

from conftest import SCRIPTS, WORKER, is_alive, kinds, read_events, wait_gone

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

EVENT_KEYS = {"time", "kind", "node", "rank", "pid", "incarnation", "generation", "attempt", "message", "detail"}


def base_args(tmp_path: Path, *extra: str) -> list[str]:
    return ["--master_port", "0", "--log_dir", str(tmp_path / "logs"), "--plain", *extra]


@pytest.fixture
def out(tmp_path: Path) -> Path:
    path = tmp_path / "out"
    path.mkdir()
    return path


def env_dump(out: Path, rank: int, attempt: int) -> dict:
    return json.loads((out / f"env_{rank}_{attempt}.json").read_text())


def ready_files(out: Path, n: int, attempt: int = 0) -> list[Path]:
    return [out / f"ready_{rank}_{attempt}.json" for rank in range(n)]


def procs_of(infos: list[dict], key: str = "pid") -> list[psutil.Process]:
    """psutil handles (bound to each process's start time, so pid reuse cannot fool is_alive)."""
    handles = []
    for info in infos:
        try:
            handles.append(psutil.Process(info[key]))
        except psutil.NoSuchProcess:
            pytest.fail(f"process {info[key]} ({key}) was gone before the test acted")
    return handles


def supervisor_of(launcher_pid: int) -> psutil.Process:
    children = [c for c in psutil.Process(launcher_pid).children() if "ftrun.node.supervisor" in " ".join(c.cmdline())]
    assert len(children) == 1, f"expected one supervisor child of the launcher, found {children}"
    return children[0]


def wait_for_event(log_dir: Path, kind: str, proc, timeout: float = 60.0) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        if (log_dir / "events.jsonl").exists():
            found = kinds(read_events(log_dir), kind)
            if found:
                return found[0]
        if proc.popen.poll() is not None:
            pytest.fail(f"ftrun exited before a {kind} event\n{proc.stdout()}\n{proc.stderr()}")
        if time.monotonic() > deadline:
            pytest.fail(f"no {kind} event within {timeout} s")
        time.sleep(0.05)


def check_event_schema(events: list[dict]) -> None:
    for event in events:
        assert set(event) == EVENT_KEYS, event
        assert isinstance(event["time"], float) and isinstance(event["message"], str) and event["message"]
        assert isinstance(event["detail"], dict)


# --------------------------------------------------------------------------- (a) success


def test_three_ranks_succeed(ftrun_proc, tmp_path, out):
    logs = tmp_path / "logs"
    result = ftrun_proc([*base_args(tmp_path, "--worker_num", "3", "--max_restarts", "2"), WORKER, out]).wait()
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail

    for rank in range(3):
        log = (logs / f"worker_{rank}.log").read_text()
        assert f"hello from rank {rank} attempt 0" in log
        assert f"[rank{rank}] hello from rank {rank} attempt 0" in result.stdout, detail
    assert "exit code 0" in result.stdout

    events = read_events(logs)
    check_event_schema(events)
    assert events[0]["kind"] == "job_started"
    assert events[-1]["kind"] == "job_finished" and events[-1]["detail"]["exit_code"] == 0
    started = kinds(events, "rank_started")
    exited = kinds(events, "rank_exited")
    assert sorted(e["rank"] for e in started) == [0, 1, 2]
    assert sorted(e["rank"] for e in exited) == [0, 1, 2]
    assert all(e["detail"]["exit_code"] == 0 for e in exited)
    assert not kinds(events, "rank_failed") and not kinds(events, "job_restarting")

    dumps = [env_dump(out, rank, 0) for rank in range(3)]
    assert {e["rank"]: e["pid"] for e in started} == {int(d["RANK"]): d["pid"] for d in dumps}
    ports = {d["MASTER_PORT"] for d in dumps}
    run_ids = {d["TORCHELASTIC_RUN_ID"] for d in dumps}
    assert len(ports) == 1 and int(ports.pop()) > 0, "ranks disagree on MASTER_PORT (or it is 0)"
    assert len(run_ids) == 1 and run_ids.pop(), "ranks disagree on TORCHELASTIC_RUN_ID (or it is empty)"
    for rank, d in enumerate(dumps):
        expected = {
            "RANK": str(rank),
            "LOCAL_RANK": str(rank),
            "WORLD_SIZE": "3",
            "LOCAL_WORLD_SIZE": "3",
            "GROUP_RANK": "0",
            "ROLE_RANK": str(rank),
            "MASTER_ADDR": "127.0.0.1",
            "TORCHELASTIC_RESTART_COUNT": "0",
            "TORCHELASTIC_MAX_RESTARTS": "2",
            "RANK_ID": str(rank),
            "RANK_SIZE": "3",
            "MS_WORKER_NUM": "3",
        }
        assert {k: d[k] for k in expected} == expected
        assert d["store_reachable"], "nothing listens on MASTER_ADDR:MASTER_PORT"
        assert d["MS_SCHED_PORT"] == d["MASTER_PORT"]  # attempt 0 uses the launcher's store
        assert d["sid"] == d["pid"], "a rank does not run in its own session"
        assert d["pdeathsig"] == signal.SIGKILL, "a rank is not tied to the supervisor by PR_SET_PDEATHSIG"


# --------------------------------------------------------------------------- (b) whole-job restart


def test_sigkilled_rank_restarts_job(ftrun_proc, tmp_path, out):
    logs = tmp_path / "logs"
    args = [*base_args(tmp_path, "--worker_num", "2", "--max_restarts", "1"), WORKER, out,
            "--fail-rank", "1", "--fail-attempt", "0", "--fail-mode", "kill"]
    result = ftrun_proc(args).wait()
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 0, detail

    first, again = env_dump(out, 1, 0), env_dump(out, 1, 1)
    assert first["TORCHELASTIC_RESTART_COUNT"] == "0" and again["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert env_dump(out, 0, 1)["TORCHELASTIC_RESTART_COUNT"] == "1"
    assert again["TORCHELASTIC_RUN_ID"] == first["TORCHELASTIC_RUN_ID"]
    assert again["store_reachable"], "the restarted attempt's MASTER_PORT does not accept connections"
    assert env_dump(out, 0, 1)["MASTER_PORT"] == again["MASTER_PORT"]

    events = read_events(logs)
    check_event_schema(events)
    failed = kinds(events, "rank_failed")
    assert [(e["rank"], e["detail"]["exit_code"], e["attempt"]) for e in failed] == [(1, 137, 0)]
    assert failed[0]["pid"] == first["pid"]
    restarting = kinds(events, "job_restarting")
    assert len(restarting) == 1 and restarting[0]["detail"]["restarts_used"] == 1
    assert events.index(failed[0]) < events.index(restarting[0])
    assert sorted(e["rank"] for e in kinds(events, "rank_started") if e["attempt"] == 1) == [0, 1]
    assert events[-1]["kind"] == "job_finished" and events[-1]["detail"]["exit_code"] == 0
    assert events[-1]["attempt"] == 1


# --------------------------------------------------------------------------- (c) budget exhausted


def test_restarts_exhausted_reports_root_cause(ftrun_proc, tmp_path, out):
    logs = tmp_path / "logs"
    marker = f"MARKER-{uuid.uuid4().hex}"
    args = [*base_args(tmp_path, "--worker_num", "2", "--max_restarts", "1", "--tail_worker_log", ""), WORKER, out,
            "--fail-rank", "1", "--fail-mode", "exit:3", "--marker", marker, "--wait"]
    result = ftrun_proc(args).wait()
    detail = f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert result.returncode == 3, detail
    assert "[rank" not in result.stdout, "no rank's output is tailed with --tail_worker_log ''"
    summary = [line for line in result.stdout.splitlines() if "root cause" in line]
    assert summary and "rank 1" in summary[-1] and "exit code 3" in summary[-1], detail
    assert marker in result.stdout, "the summary does not show the tail of the root cause's log"
    assert "last lines of rank 1's log" in result.stdout
    assert "each of its 2 incarnations failed the same way" in summary[-1], detail

    events = read_events(logs)
    check_event_schema(events)
    assert [(e["rank"], e["attempt"]) for e in kinds(events, "rank_failed")] == [(1, 0), (1, 1)]
    # Each failure keeps the end of the failed incarnation's log (no error file was written).
    assert all(marker in e["detail"]["log_tail"] for e in kinds(events, "rank_failed"))
    assert len(kinds(events, "job_restarting")) == 1
    final = events[-1]
    assert final["kind"] == "job_finished" and final["detail"]["exit_code"] == 3
    assert final["detail"]["root_cause"]["rank"] == 1
    assert marker in final["detail"]["log_tail"]


def test_sigkill_without_restarts_exits_137(ftrun_proc, tmp_path, out):
    args = [*base_args(tmp_path, "--worker_num", "2", "--max_restarts", "0"), WORKER, out,
            "--fail-rank", "0", "--fail-mode", "kill", "--wait"]
    result = ftrun_proc(args).wait()
    assert result.returncode == 137, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "SIGKILL" in result.stdout
    events = read_events(tmp_path / "logs")
    assert not kinds(events, "job_restarting")
    assert events[-1]["detail"]["exit_code"] == 137 and events[-1]["detail"]["root_cause"]["rank"] == 0


# --------------------------------------------------------------------------- (d) SIGINT / SIGTERM


@pytest.mark.parametrize("sig, code", [(signal.SIGINT, 130), (signal.SIGTERM, 143)], ids=["SIGINT", "SIGTERM"])
def test_stop_signal_stops_every_rank(ftrun_proc, tmp_path, out, sig, code):
    proc = ftrun_proc([*base_args(tmp_path, "--worker_num", "3"), WORKER, out, "--wait", "--grandchild"])
    ready = proc.wait_for_files(ready_files(out, 3))
    ranks = procs_of(ready)
    grandchildren = procs_of(ready, "grandchild")
    supervisor = supervisor_of(proc.pid)

    os.kill(proc.pid, sig)
    result = proc.wait()
    assert result.returncode == code, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert not wait_gone(ranks + grandchildren + [supervisor]), "a rank, its child or the supervisor survived"
    events = read_events(tmp_path / "logs")
    assert kinds(events, "stop_requested")
    assert events[-1]["kind"] == "job_finished" and events[-1]["detail"]["exit_code"] == code


def test_sigterm_escalates_to_sigkill_after_grace(ftrun_proc, tmp_path, out):
    proc = ftrun_proc([*base_args(tmp_path, "--worker_num", "2", "--grace_period", "1"), WORKER, out,
                       "--wait", "--ignore-term"])
    ranks = procs_of(proc.wait_for_files(ready_files(out, 2)))
    os.kill(proc.pid, signal.SIGTERM)
    result = proc.wait()
    assert result.returncode == 143, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert not wait_gone(ranks)


def test_second_sigint_kills_without_grace(ftrun_proc, tmp_path, out):
    # The ranks ignore SIGTERM and the grace period is long: only the second Ctrl-C can end the job.
    proc = ftrun_proc([*base_args(tmp_path, "--worker_num", "2", "--grace_period", "600"), WORKER, out,
                       "--wait", "--ignore-term"])
    ranks = procs_of(proc.wait_for_files(ready_files(out, 2)))
    supervisor = supervisor_of(proc.pid)
    os.kill(proc.pid, signal.SIGINT)
    wait_for_event(tmp_path / "logs", "stop_requested", proc)
    os.kill(proc.pid, signal.SIGINT)
    result = proc.wait()
    assert result.returncode == 130, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert not wait_gone(ranks + [supervisor])


def test_second_sigint_leaves_no_grandchild(ftrun_proc, tmp_path, out):
    proc = ftrun_proc([*base_args(tmp_path, "--worker_num", "1", "--grace_period", "600"), WORKER, out,
                       "--wait", "--ignore-term", "--grandchild"])
    ready = proc.wait_for_files(ready_files(out, 1))
    grandchildren = procs_of(ready, "grandchild")
    ranks = procs_of(ready)
    # SIGUSR1 makes the launcher and its supervisor write their stacks, and nothing else.
    supervisor = supervisor_of(proc.pid)
    for target in (proc.pid, supervisor.pid):
        os.kill(target, signal.SIGUSR1)
    deadline = time.monotonic() + 30
    while not ("ftrun/node/launcher.py" in proc.stderr()
               and "ftrun/coordinator/core.py" in (tmp_path / "logs" / "supervisor.log").read_text(errors="replace")):
        assert time.monotonic() < deadline, f"no stacks after SIGUSR1:\n{proc.stderr()}"
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGINT)
    wait_for_event(tmp_path / "logs", "stop_requested", proc)
    os.kill(proc.pid, signal.SIGINT)
    assert proc.wait().returncode == 130
    assert not wait_gone(ranks)
    assert not wait_gone(grandchildren), "a rank's child outlived ftrun"


# --------------------------------------------------------------------------- (e) SIGKILL of the launcher


def test_sigkill_of_launcher_leaves_nothing(ftrun_proc, tmp_path, out):
    proc = ftrun_proc([*base_args(tmp_path, "--worker_num", "2", "--grace_period", "2"), WORKER, out,
                       "--wait", "--grandchild"])
    ready = proc.wait_for_files(ready_files(out, 2))
    ranks = procs_of(ready)
    grandchildren = procs_of(ready, "grandchild")
    supervisor = supervisor_of(proc.pid)
    assert all(r.ppid() == supervisor.pid for r in ranks)

    os.kill(proc.pid, signal.SIGKILL)
    assert proc.popen.wait(timeout=30) == -signal.SIGKILL
    survivors = wait_gone([supervisor, *ranks, *grandchildren])
    assert not survivors, f"processes outlived the launcher: {survivors}"


def test_sigkill_of_supervisor_kills_ranks(ftrun_proc, tmp_path, out):
    proc = ftrun_proc([*base_args(tmp_path, "--worker_num", "2"), WORKER, out, "--wait", "--grandchild"])
    ready = proc.wait_for_files(ready_files(out, 2))
    ranks = procs_of(ready)
    grandchildren = procs_of(ready, "grandchild")
    supervisor = supervisor_of(proc.pid)
    supervisor.kill()
    result = proc.wait()
    assert result.returncode == 137, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "supervisor" in result.stdout
    assert "dying-gasp" not in result.stdout, "a plain script's ranks write no checkpoint of their own"
    assert not wait_gone(ranks), "ranks outlived their supervisor"
    assert not wait_gone(grandchildren), "a rank's child outlived the killed supervisor"


# --------------------------------------------------------------------------- (f) tail_worker_log


def test_tail_worker_log_selects_ranks(ftrun_proc, tmp_path, out):
    result = ftrun_proc([*base_args(tmp_path, "--worker_num", "3", "--tail_worker_log", "1"), WORKER, out]).wait()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert "[rank1] hello from rank 1 attempt 0" in result.stdout
    assert "[rank0]" not in result.stdout and "[rank2]" not in result.stdout
    assert "===== ftrun:" not in result.stdout  # the log's header lines are not shown
    for rank in range(3):  # every rank still has its log
        assert f"hello from rank {rank}" in (tmp_path / "logs" / f"worker_{rank}.log").read_text()


# --------------------------------------------------------------------------- (g) -m and --no_python


def test_module_mode(ftrun_proc, tmp_path, out):
    env = {"PYTHONPATH": str(SCRIPTS)}
    result = ftrun_proc([*base_args(tmp_path, "--worker_num", "2"), "-m", "ftrun_testmod", out, "x"], env=env).wait()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    for rank in range(2):
        d = env_dump(out, rank, 0)
        assert d["RANK"] == str(rank) and d["argv"] == [str(out), "x"]


def _module_in_cwd(tmp_path: Path) -> None:
    (tmp_path / "cwdmod_train.py").write_text((SCRIPTS / "worker.py").read_text())


def test_module_from_cwd_python_m(ftrun_proc, tmp_path, out):
    _module_in_cwd(tmp_path)
    result = ftrun_proc([*base_args(tmp_path), "-m", "cwdmod_train", out]).wait()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert env_dump(out, 0, 0)["RANK"] == "0"


def test_module_from_cwd_console_script(ftrun_proc, tmp_path, out):
    console_script = Path(sys.executable).parent / "ftrun"
    if not console_script.exists():
        pytest.skip("no ftrun console script next to the interpreter")
    _module_in_cwd(tmp_path)
    result = ftrun_proc([*base_args(tmp_path), "-m", "cwdmod_train", out], argv0=[str(console_script)]).wait()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert env_dump(out, 0, 0)["RANK"] == "0"


def test_no_python_shell_script(ftrun_proc, tmp_path, out):
    script = tmp_path / "worker.sh"
    shutil.copy(SCRIPTS / "worker.sh", script)
    script.chmod(0o755)
    result = ftrun_proc([*base_args(tmp_path, "--worker_num", "2"), "--no_python", script, out, "a", "b"]).wait()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    for rank in range(2):
        assert (out / f"sh_{rank}.txt").read_text().split() == [str(rank), str(rank), "2", "a", "b"]
        assert f"shell rank {rank} of 2 args: a b" in (tmp_path / "logs" / f"worker_{rank}.log").read_text()


# --------------------------------------------------------------------------- (h) precedence end to end


def _ranks_started(tmp_path: Path) -> list[int]:
    return sorted(e["rank"] for e in kinds(read_events(tmp_path / "logs"), "rank_started"))


@pytest.mark.parametrize(
    "setup, cli, env, expected",
    [
        ("config", ["--config", "cfg.toml"], {"FTRUN_WORKER_NUM": "3"}, 3),
        ("pyproject", [], {}, 2),
    ],
    ids=["env-over-config", "pyproject"],
)
def test_worker_num_precedence(ftrun_proc, tmp_path, out, setup, cli, env, expected):
    """The launcher's process reads its environment, a --config file and the working directory's
    pyproject.toml. The precedence of every pair (command line, environment, config file,
    pyproject) is tested without processes in test_config.py."""
    if setup == "config":
        (tmp_path / "cfg.toml").write_text("[ftrun]\nworker_num = 2\nmax-restarts = 0\n")
    elif setup == "pyproject":
        (tmp_path / "pyproject.toml").write_text("[tool.ftrun]\nworker-num = 2\n")
    result = ftrun_proc([*base_args(tmp_path, *cli), WORKER, out], env=env).wait()
    assert result.returncode == 0, f"stdout:\n{result.stdout}\nstderr:\n{result.stderr}"
    assert _ranks_started(tmp_path) == list(range(expected))
    assert sorted(p.name for p in out.glob("env_*_0.json")) == [f"env_{r}_0.json" for r in range(expected)]
    assert env_dump(out, 0, 0)["WORLD_SIZE"] == str(expected)
    if setup == "config":
        assert env_dump(out, 0, 0)["TORCHELASTIC_MAX_RESTARTS"] == "0"


def test_a_second_stop_signal_during_the_forwarding_of_the_first_is_not_lost(monkeypatch: pytest.MonkeyPatch) -> None:
    """The second SIGINT arrives while the first is being forwarded: it still kills without grace
    (before, both were counted as handled by the first turn and the second did nothing)."""
    from ftrun.node import launcher as launcher_mod

    done: list[tuple[str, int]] = []
    launcher = launcher_mod.Launcher.__new__(launcher_mod.Launcher)
    launcher.stop_signals = [signal.SIGINT]

    def forward(pid: int, sig: int) -> None:
        done.append(("forward", sig))
        launcher.stop_signals.append(signal.SIGINT)  # the user presses Ctrl-C again right now

    monkeypatch.setattr(launcher_mod.os, "kill", forward)
    monkeypatch.setattr(launcher_mod.procs, "kill_tree", lambda pid: done.append(("kill_tree", pid)))
    assert launcher.act_on_stops(4242, 0) == 2
    assert done == [("forward", signal.SIGINT), ("kill_tree", 4242)]
    assert launcher.act_on_stops(4242, 2) == 2 and len(done) == 2  # nothing new: nothing done
