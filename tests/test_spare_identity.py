"""Spares carry no rank identity until their promotion (issue 23): during a run, a process listing
(``ps e``: each process's ``/proc/<pid>/environ``, the block it was started with) shows each
rank's ``RANK`` on exactly one process, the one serving that rank, even after a warm or hot spare
was promoted to a failed rank's identity; a spare still waiting shows none."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path

import digits_job as dj
import psutil
import pytest

pytestmark = [pytest.mark.integration]


def _environ(pid: int) -> dict[str, str]:
    try:
        raw = Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return {}
    out = {}
    for item in raw.split(b"\0"):
        key, sep, value = item.decode(errors="replace").partition("=")
        if sep and key not in out:
            out[key] = value
    return out


def _job_processes(root: int) -> list[psutil.Process]:
    try:
        return [p for p in psutil.Process(root).children(recursive=True) if p.status() != psutil.STATUS_ZOMBIE]
    except psutil.Error:
        return []


@pytest.mark.parametrize("spares", ["--warm_spares", "--hot_spares"])
def test_each_rank_shows_on_exactly_one_process(tmp_path: Path, spares: str) -> None:
    log_dir = tmp_path / "logs"
    cmd = dj.cmd(log_dir, dj.LONG_STEPS)
    at = cmd.index(str(dj.SCRIPT))
    cmd = [*cmd[:at], spares, "1", *cmd[at:], "--step_pause", "0.2"]
    proc = subprocess.Popen(cmd, env=dj.env({"FTRUN_FAULT": "rank=2,step=6,kind=kill"}), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, cwd=tmp_path, start_new_session=True)
    try:
        dj.wait_for(lambda: [e for e in dj.events(log_dir) if e["kind"] == "recovery_finished"] or proc.poll() is not None,
                    timeout=240)
        assert proc.poll() is None, "the job ended before its recovery was seen"
        started = [e for e in dj.events(log_dir) if e["kind"] == "rank_started"]
        promoted = started[-1]
        assert promoted["rank"] == 2 and (promoted["detail"].get("warm_spare") or promoted["detail"].get("hot_spare")), started
        # The node starts a new spare in place of the promoted one: wait until it is up, then look.
        dj.wait_for(lambda: sum("ftrun.spare" in " ".join(p.cmdline()) for p in _job_processes(proc.pid)) >= 2
                    or proc.poll() is not None, timeout=120)
        shown: dict[str, list[int]] = {}
        spare_pids = []
        for p in _job_processes(proc.pid):
            env = _environ(p.pid)
            if "RANK" in env:
                shown.setdefault(env["RANK"], []).append(p.pid)
            if "ftrun.spare" in " ".join(p.cmdline()) and p.pid != promoted["pid"]:
                spare_pids.append(p.pid)
                assert "RANK" not in env and "LOCAL_RANK" not in env, (p.pid, env.get("RANK"))
        assert sorted(shown) == ["0", "1", "2", "3"], shown
        assert all(len(pids) == 1 for pids in shown.values()), shown  # never two processes with one RANK
        assert shown["2"] == [promoted["pid"]], (shown, promoted)
        assert _environ(promoted["pid"]).get("LOCAL_RANK") == "2"
        assert spare_pids, "no waiting spare was found"
    finally:
        # What the promoted spare computes is checked bitwise elsewhere (test_hot_spares, test_arf:
        # the same promotion): here the job need not run to its end. Stopped as a user would.
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
