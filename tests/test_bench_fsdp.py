"""scripts/bench.py's fsdp part, pure logic only (no process): its cases and command lines, the
launchers' alternating order, the final line of the sharded GPT, and the report's pairs (recovery,
wall time lost against the fault-free run, step-time ratio, digests)."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace

import psutil
import pytest

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_fsdp_under_test", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while the class is built
    spec.loader.exec_module(module)
    return module


bench = _bench()
DIGEST = "e1c47e9fb4462b078d4f60b5bbfe4f842cbf214b931530a47fbaa468cd86c8ed"


def _flag(argv: list[str], name: str) -> str:
    return argv[argv.index(name) + 1]


def test_plan_a_fault_free_and_a_faulted_case() -> None:
    clean, faulted = bench.plan(SimpleNamespace(parts=["fsdp"], quick=False, fsdp_steps=None))["fsdp"]
    assert (clean.steps, clean.kill_step) == (bench.FSDP_STEPS, None)
    assert (faulted.steps, faulted.kill_step, faulted.victim) == (bench.FSDP_STEPS, bench.FSDP_STEPS // 2, 3)
    assert clean.args == faulted.args == ("--mesh", "2,2") and clean.ranks == 4
    assert clean.label() == "fsdp-hsdp x4"
    quick = bench.plan(SimpleNamespace(parts=["fsdp"], quick=True, fsdp_steps=None))["fsdp"]
    assert [c.steps for c in quick] == [60, 60]
    knob = bench.plan(SimpleNamespace(parts=["fsdp"], quick=True, fsdp_steps=40))["fsdp"]
    assert [(c.steps, c.kill_step) for c in knob] == [(40, None), (40, 20)]


def test_commands_run_the_example_and_its_twin_without_checkpoints(tmp_path: Path) -> None:
    case = bench.Case("fsdp", "hsdp", 4, 200, 100, victim=3, args=bench.FSDP_ARGS)
    argv, env, script = bench.command("ftrun", case, tmp_path)
    assert script == "train_fsdp.py" and argv[1:3] == ["-m", "ftrun"]
    assert _flag(argv, "--worker_num") == "4" and _flag(argv, "--mesh") == "2,2" and _flag(argv, "--steps") == "200"
    argv, env, script = bench.command("torchrun", case, tmp_path)
    assert script == "train_fsdp_torchrun.py" and argv[1:3] == ["-m", "torch.distributed.run"]
    assert _flag(argv, "--max-restarts") == "1" and _flag(argv, "--mesh") == "2,2"
    assert "--ckpt_dir" not in argv  # the twin has no checkpoint: its restart begins at step 0
    assert env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"


def test_launchers_alternate_by_repeat_in_fsdp_only() -> None:
    assert bench.launcher_order("fsdp", 0) == ("ftrun", "torchrun")
    assert bench.launcher_order("fsdp", 1) == ("torchrun", "ftrun")
    assert bench.launcher_order("recovery", 1) == ("ftrun", "torchrun")


def test_final_line_with_and_without_accuracy() -> None:
    fsdp = bench.FINAL.search(f"[rank0] final step=200 loss=3.543711 params_sha256={DIGEST}")
    assert fsdp is not None and fsdp.group(2) is None and fsdp.group(3) == DIGEST
    digits = bench.FINAL.search(f"final step=200 loss=0.1 test_accuracy=0.97 params_sha256={DIGEST}")
    assert digits is not None and digits.group(2) == "0.97"


def test_span_runs_from_the_first_step_line_to_the_last() -> None:
    assert bench.span([(0, 10.0), (1, 10.5), (0, 20.0), (1, 20.5)]) == 10.5  # a restart's lines count
    assert bench.span([]) is None


def _run(launcher: str, repeat: int, kill: int | None, **fields) -> dict:
    return {"launcher": launcher, "repeat": repeat, "final": f"final step=200 loss=1.0 params_sha256={fields.pop('digest', DIGEST)}",
            "case": {"workload": "fsdp", "size": "hsdp", "ranks": 4, "kill_step": kill}, "state_mb": None,
            "recomputed": 0, "total_s": 30.0, "breakdown": {}, "failed_step": None, "recover_s": None,
            "step_s": None, "span_s": None} | fields


def test_notes_pair_each_fault_with_its_repeat_s_fault_free_run() -> None:
    runs = [
        _run("ftrun", 0, None, step_s=0.105, span_s=21.0, rank_cpu_s=0.044),
        _run("torchrun", 0, None, step_s=0.100, span_s=20.0, rank_cpu_s=0.040),
        _run("ftrun", 0, 100, failed_step=101, recover_s=2.0, span_s=23.5, step_s=0.105,
             breakdown={"reported_total": 1.2, "transfer": 0.01, "rebuild": 0.2, "bytes": 2e5, "restart": None}),
        _run("torchrun", 0, 100, failed_step=101, recover_s=20.0, recomputed=101, span_s=40.0, step_s=0.05,
             breakdown={"restart": 9.0, "recompute": 11.0}, digest="0" * 64),
    ]
    notes = bench.fsdp_notes(runs)
    text = "\n".join(notes)
    assert notes[0] == "repeat 1 (ftrun then torchrun):"
    assert "ftrun: killed at step 100, failed step 101, recovered in 2.00 s: recovery_finished total 1.20 s" in text
    # 23.5 - 21.0; at its own pace: the same (its steps as fast as the fault-free run's)
    assert "wall time lost against the fault-free run 2.50 s (2.50 s at its own pace)" in text
    assert "restart 9.00 s + recompute 11.00 s (101 steps again)" in text
    # 40.0 - 20.0; at its own pace 40.0 - 20.0 * 0.05 / 0.1 (its steps twice as fast)
    assert "wall time lost against the fault-free run 20.00 s (30.00 s at its own pace)" in text
    assert ("torchrun/ftrun: recovery 10.00x, torchrun's restart alone (its best case, a checkpoint at the failed "
            "step) 4.50x, wall time lost 8.00x (12.00x at each run's pace); fault-free step 105.0 ms against 100.0 ms, "
            "ftrun/torchrun 1.05x (the faulted pair's steps away from the fault: 2.10x); a rank's CPU a fault-free "
            "step 44.0 ms against 40.0 ms, 1.10x") in text
    assert f"params_sha256 of the fault-free runs: {DIGEST[:16]}; faulted runs ending with it: ftrun 1/1, torchrun 0/1" in text
    assert notes[-1].startswith("medians of the pairs: recovery 10.00x, restart 4.50x, lost 8.00x, lost_paced 12.00x, "
                                "step 1.05x, step_faulted 2.10x, cpu 1.10x")


def test_pooled_runs_are_numbered_by_file() -> None:
    runs = [_run("ftrun", 1001, None, step_s=0.1, span_s=20.0), _run("torchrun", 1001, None, step_s=0.1, span_s=20.0)]
    assert bench.fsdp_notes(runs)[0] == "repeat 2 of file 2 (torchrun then ftrun):"


def test_ranks_cpu_of_a_missing_launcher_is_nothing() -> None:
    assert bench.ranks_cpu(2**22 + 12345, "train_fsdp.py") == (0.0, 0)


def test_ranks_cpu_counts_the_script_s_processes_with_a_rank() -> None:
    """Below a launcher: one process of the script with RANK, one of another script; only the first counts."""
    sleeper = f"{sys.executable} -c 'import time; time.sleep(60)'"
    launcher = subprocess.Popen(["sh", "-c", f"{sleeper} train_fsdp.py & {sleeper} other.py & wait"],
                                env={**os.environ, "RANK": "0"}, start_new_session=True)
    try:
        deadline = time.monotonic() + 60
        found = (0.0, 0)
        while time.monotonic() < deadline:
            procs = psutil.Process(launcher.pid).children(recursive=True)
            if len(procs) == 2 and all(p.cmdline()[:1] == [sys.executable] for p in procs):  # both past their exec
                found = bench.ranks_cpu(launcher.pid, "train_fsdp.py")
                break
            time.sleep(0.05)
        assert found[1] == 1 and found[0] >= 0.0
    finally:
        os.killpg(launcher.pid, signal.SIGKILL)
        launcher.wait()


def test_a_negative_loss_has_no_ratio() -> None:
    assert bench.wall_time_lost({"span_s": 19.0, "step_s": 0.1}, {"span_s": 20.0, "step_s": 0.1}) == (-1.0, -1.0)
    assert bench.wall_time_lost({"span_s": 19.0}, None) == (None, None)
    assert bench.wall_time_lost({"span_s": 19.0, "step_s": None}, {"span_s": 20.0, "step_s": 0.1}) == (-1.0, None)
    assert bench._ratio(10.0, -1.0) is None and bench._ratio(None, 2.0) is None and bench._ratio(3.0, 2.0) == 1.5


def test_report_has_the_fsdp_tables() -> None:
    runs = [
        _run("ftrun", 0, None, step_s=0.105, span_s=21.0),
        _run("torchrun", 0, None, step_s=0.100, span_s=20.0),
        _run("ftrun", 0, 100, failed_step=101, recover_s=2.0, span_s=23.5, breakdown={"reported_total": 1.2}),
        _run("torchrun", 0, 100, failed_step=101, recover_s=20.0, span_s=40.0, breakdown={"restart": 9.0, "recompute": 11.0}),
    ]
    machine = {"cpu": "cpu", "cores": 2, "memory_gb": 4, "os": "linux", "python": "3", "torch": "2", "load_avg_at_start": [1.0]}
    text = bench.report({"machine": machine, "command": "python scripts/bench.py --parts fsdp", "parts": {"fsdp": runs}})
    assert "== fsdp: examples/train_fsdp.py --mesh 2,2" in text
    row = next(line for line in text.splitlines() if line.startswith("fsdp-hsdp x4") and "torchrun" in line)
    assert row.split()[-1] == "10.00x"
    overhead = next(line for line in text.splitlines() if line.startswith("fsdp-hsdp x4") and "%" in line)
    assert "5.0%" in overhead


@pytest.mark.parametrize("steps", ["4", "-1"])
def test_too_few_steps_is_one_line_and_exit_2(steps: str, monkeypatch: pytest.MonkeyPatch,
                                             capsys: pytest.CaptureFixture[str]) -> None:
    monkeypatch.setattr(sys, "argv", ["bench.py", "--parts", "fsdp", "--fsdp_steps", steps])
    with pytest.raises(SystemExit) as exit_info:
        bench.main()
    assert exit_info.value.code == 2
    assert "--fsdp_steps" in capsys.readouterr().err
