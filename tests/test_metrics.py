"""Prometheus metrics: the metrics fed with synthetic events and status snapshots (no job), the HTTP
endpoint, the checks of ``--metrics_port``, zero cost when off, and one real 2-rank digits job with a
fault whose ``/metrics`` is scraped while it runs and whose log directory ``ftrun report`` reads after.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import REGISTRY
from prometheus_client.parser import text_string_to_metric_families

from ftrun.cli import main
from ftrun.coordinator.metrics import JobMetrics, MetricsError, check_endpoint, metrics_bind_address
from ftrun.tools.report import Sample

ROOT = Path(__file__).resolve().parent.parent
T0 = 1_700_000_000.0


def values(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """(sample name, sorted labels) -> value of a /metrics text."""
    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def ev(kind: str, t: float, **detail: Any) -> dict[str, Any]:
    return {"time": T0 + t, "kind": kind, "message": kind, "rank": detail.pop("rank", None), "attempt": 0, "detail": detail}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_events_and_status_become_metrics():
    status = {"state": "running", "attempt": 0, "restarts_used": 1, "max_restarts": 3, "recovering": False,
              "ranks": [{"rank": r, "node": 0, "state": "healthy", "step": 20 + r, "total_steps": 40,
                         "last_step_seconds": 0.05, "restarts": r} for r in range(2)]}
    metrics = JobMetrics(Path("."), status_source=lambda: status, clock=lambda: T0 + 30.0)
    for event in (
        ev("job_started", 0.0),
        ev("rank_failed", 12.0, rank=1, detection_seconds=0.2),
        ev("recovery_started", 12.0, failed=[1], fault="death"),
        ev("recovery_started", 13.0, failed=[1], fault="death", round=2),  # a second round: not a second recovery
        ev("recovery_finished", 15.0, total_seconds=3.2, detection_seconds=0.2, respawn_seconds={"1": 2.5},
           rebuild_seconds=0.3, transfer_seconds=0.05),
        ev("checkpoint_saved", 20.0, step=19, bytes=2_000_000, seconds=0.4),
        ev("job_restarting", 25.0),
    ):
        metrics.observe(event)
    metrics.add_sample(Sample(T0 + 5.0, 0, (0, 0)))  # the first step, from the progress recorder
    got = values(metrics.render().decode())
    assert got[("ftrun_recoveries_total", (("fault", "death"),))] == 1
    assert got[("ftrun_recoveries_total", (("fault", "hang"),))] == 0
    assert got[("ftrun_rank_failures_total", ())] == 1 and got[("ftrun_job_restarts_total", ())] == 1
    assert got[("ftrun_recovery_seconds_count", ())] == 1 and got[("ftrun_recovery_seconds_sum", ())] == pytest.approx(3.2)
    assert got[("ftrun_recovery_seconds_bucket", (("le", "5.0"),))] == 1
    assert got[("ftrun_recovery_seconds_bucket", (("le", "2.5"),))] == 0
    assert got[("ftrun_recovery_phase_seconds_sum", (("phase", "respawn"),))] == pytest.approx(2.5)
    assert got[("ftrun_detection_seconds_count", ())] == 1
    assert got[("ftrun_checkpoint_bytes_total", ())] == 2_000_000 and got[("ftrun_checkpoint_step", ())] == 19
    assert got[("ftrun_checkpoint_seconds_count", ())] == 1
    assert got[("ftrun_rank_state", (("node", "0"), ("rank", "1"), ("state", "healthy")))] == 1
    assert got[("ftrun_rank_state", (("node", "0"), ("rank", "1"), ("state", "failed")))] == 0
    assert got[("ftrun_rank_step", (("node", "0"), ("rank", "1")))] == 21
    assert got[("ftrun_rank_step_seconds", (("node", "0"), ("rank", "0")))] == pytest.approx(0.05)
    assert got[("ftrun_rank_restarts_total", (("node", "0"), ("rank", "1")))] == 1
    assert got[("ftrun_job_step", ())] == 20 and got[("ftrun_job_total_steps", ())] == 40
    assert got[("ftrun_job_up", ())] == 1 and got[("ftrun_job_restarts_used", ())] == 1
    # goodput at T0+30: start-up 5 s; the ARF fault 11.8..15 s; the restart from 25 s still open
    assert got[("ftrun_wall_seconds", ())] == pytest.approx(30.0)
    assert got[("ftrun_startup_seconds", ())] == pytest.approx(5.0)
    assert got[("ftrun_lost_seconds", ())] == pytest.approx(3.2 + 5.0)
    assert got[("ftrun_goodput_ratio", ())] == pytest.approx((30.0 - 5.0 - 8.2) / 30.0)
    # a private registry: nothing of ftrun's in the process-wide one
    assert not [m for m in REGISTRY.collect() if m.name.startswith("ftrun_")]


def test_a_communication_error_that_a_death_follows_counts_as_a_death():
    """CI31: a survivor's "connection closed by peer" reached the coordinator before the killed
    rank's SIGCHLD, so the recovery began as a communication error (HCCE, no respawn) and was
    restarted by the death 10 ms later. The recovery is counted once, as the death that began it;
    a communication error that no death follows counts as one when its recovery ends."""
    metrics = JobMetrics(Path("."), status_source=lambda: None, clock=lambda: T0 + 30.0)

    def count(fault: str) -> float:
        return values(metrics.render().decode())[("ftrun_recoveries_total", (("fault", fault),))]

    metrics.observe(ev("recovery_started", 1.0, failed=[], fault="comm_error"))
    assert count("comm_error") == count("death") == 0  # not known yet
    metrics.observe(ev("recovery_started", 1.01, failed=[1], fault="death", round=2))
    metrics.observe(ev("recovery_finished", 3.0, total_seconds=2.0))
    assert (count("death"), count("comm_error")) == (1, 0)
    metrics.observe(ev("recovery_started", 5.0, failed=[], fault="comm_error"))  # a real one
    metrics.observe(ev("recovery_started", 5.5, failed=[], fault="comm_error", round=2))
    metrics.observe(ev("recovery_finished", 6.0, total_seconds=1.0))
    assert (count("death"), count("comm_error")) == (1, 1)


def test_endpoint_serves_and_refuses_a_taken_port():
    metrics = JobMetrics(Path("."), status_source=lambda: None)
    server = metrics.serve(0, "127.0.0.1")
    try:
        port = server.server_port
        body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
        assert "ftrun_recoveries_total" in body
        with pytest.raises(MetricsError, match=f"--metrics_port {port} is already in use"):
            check_endpoint("127.0.0.1", port)
        with pytest.raises(MetricsError, match="already in use"):
            JobMetrics(Path("."), status_source=lambda: None).serve(port, "127.0.0.1")
    finally:
        server.shutdown()
    assert metrics_bind_address(None, "127.0.0.1", 1) == "127.0.0.1"
    assert metrics_bind_address("10.1.2.3", "127.0.0.1", 1) == "10.1.2.3"


@pytest.mark.parametrize("flags, expected", [
    (["--metrics_port", "TAKEN"], "is already in use on 127.0.0.1; pick a free port"),
    (["--metrics_port", "70000"], "--metrics_port must be at least 0 and at most 65535, got 70000"),
    (["--metrics_port", "29600", "--master_port", "29600"], "is also --master_port"),
    (["--metrics_port", "29601", "--metrics_addr", "999.1.1.1"], "--metrics_addr"),
])
def test_bad_metrics_options_are_one_line_and_exit_2(tmp_path, capsys, monkeypatch, flags, expected):
    monkeypatch.chdir(tmp_path)
    script = tmp_path / "train.py"
    script.write_text("print('never runs')\n")
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        argv = [port if f == "TAKEN" else f for f in flags] + ["--log_dir", str(tmp_path / "logs"), str(script)]
        with pytest.raises(SystemExit) as exc:
            main(argv)
    err = capsys.readouterr().err
    assert exc.value.code == 2
    assert len(err.splitlines()) == 1 and err.startswith("ftrun: error: ") and expected in err, err
    assert not (tmp_path / "logs").exists(), "the job started despite the bad option"


def test_metrics_off_costs_no_import():
    code = "import sys, ftrun.node.supervisor, ftrun.cli, ftrun.node.console; print('prometheus_client' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    assert out.strip() == "False"


# --------------------------------------------------------------------------- one real job


def scrape(port: int) -> dict[tuple[str, tuple[tuple[str, str], ...]], float] | None:
    try:
        return values(urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode())
    except (urllib.error.URLError, ConnectionError, OSError):
        return None  # not serving yet


@pytest.mark.integration
@pytest.mark.timeout(420)
def test_a_faulted_job_counts_its_recovery_and_reports_it(ftrun_proc, tmp_path):
    """One 2-rank digits job (4 s of steps), rank 1 killed in the all-reduce of step 5: /metrics counts
    the recovery while the job runs; afterwards ``ftrun report`` prints it and draws the PNG."""
    port = free_port()
    log_dir = tmp_path / "logs"
    job = ftrun_proc(["--worker_num", "2", "--master_port", "0", "--plain", "--log_dir", log_dir,
                      "--metrics_port", port, "--tail_worker_log", "", ROOT / "examples" / "train_digits.py",
                      "--steps", "40", "--log_every", "0", "--step_pause", "0.1"],
                     env={"FTRUN_FAULT": "rank=1,step=5,point=allreduce,kind=kill"})
    deadline = time.monotonic() + 300
    got = None
    while True:
        got = scrape(port) or got
        # the steps' total comes with the ranks' heartbeats (one a second): a recovery may be over first
        if got and got.get(("ftrun_recoveries_total", (("fault", "death"),)), 0) >= 1 \
                and got.get(("ftrun_recovery_seconds_count", ()), 0) >= 1 and ("ftrun_job_total_steps", ()) in got:
            break
        if job.popen.poll() is not None:
            pytest.fail(f"the job ended before /metrics counted the recovery\nlast scrape: {got}\n{job.stdout()}\n{job.stderr()}")
        assert time.monotonic() < deadline, f"no recovery counted on /metrics within 300 s; last scrape: {got}"
        time.sleep(0.2)
    assert got[("ftrun_rank_failures_total", ())] >= 1
    assert got[("ftrun_job_total_steps", ())] == 40
    assert got[("ftrun_rank_restarts_total", (("node", "0"), ("rank", "1")))] >= 1
    assert 0 <= got[("ftrun_goodput_ratio", ())] < 1 and got[("ftrun_lost_seconds", ())] > 0

    result = job.wait(timeout=300)
    report = subprocess.run([sys.executable, "-m", "ftrun", "report", str(log_dir), "--plot", str(tmp_path / "t.png")],
                            capture_output=True, text=True, timeout=120)
    detail = f"job exit {result.returncode}\n{result.stdout[-3000:]}\nreport:\n{report.stdout}\n{report.stderr}"
    assert report.returncode == 0 and "Traceback" not in report.stderr, detail
    assert "recovery_finished" in report.stdout and "recovered rank(s) [1]" in report.stdout, detail
    fault = next((line for line in report.stdout.splitlines() if "death of rank 1" in line and "respawned" in line), None)
    assert fault is not None, detail
    assert report.stdout.splitlines()[2].startswith("goodput: ") and "%" in report.stdout.splitlines()[2], detail
    assert (tmp_path / "t.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    samples = [json.loads(line) for line in (log_dir / "progress.jsonl").read_text().splitlines()]
    assert samples and all(len(s["steps"]) == 2 for s in samples)
    assert os.path.getsize(tmp_path / "t.png") > 10_000
