"""The byte language model example: corpus, batches and sizes are deterministic; a faulted 2-rank run
under ftrun ends bitwise equal to a fault-free one."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "examples"))
import charlm_common as cc  # noqa: E402

SCRIPT = ROOT / "examples" / "train_charlm.py"
TORCHRUN_SCRIPT = ROOT / "examples" / "train_charlm_torchrun.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")
SMALL_RUN = ["--size", "tiny", "--steps", "12", "--batch_size", "4", "--context", "32",
             "--corpus_bytes", "65536", "--eval_windows", "8", "--log_every", "4"]


def _env(extra: dict[str, str] | None = None) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT")) and k not in ("RANK", "WORLD_SIZE")}
    env.update(extra or {})
    return env


def _final(stdout: str) -> re.Match[str]:
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-3000:]}"
    return match


def _run_alone(script: Path) -> str:
    proc = subprocess.run([sys.executable, str(script), *SMALL_RUN], env=_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    return proc.stdout


def test_corpus_is_deterministic_and_split() -> None:
    a, b = cc.load_corpus(1 << 16), cc.load_corpus(1 << 16)
    assert torch.equal(a.train, b.train) and torch.equal(a.held_out, b.held_out)
    assert len(a.train) + len(a.held_out) == 1 << 16
    assert len(a.held_out) == int((1 << 16) * cc.HELD_OUT_FRACTION)
    assert a.files >= 1
    assert all("site-packages" not in str(p) for p in cc.stdlib_files()[:50])


def test_corpus_too_large_is_one_clear_error(tmp_path: Path) -> None:
    (tmp_path / "a.py").write_bytes(b"x = 1\n" * 1000)
    with pytest.raises(ValueError, match="only 6000 bytes"):
        cc.load_corpus(1 << 20, root=tmp_path)


def test_batches_are_a_pure_function_of_seed_step_rank() -> None:
    corpus = torch.arange(1000, dtype=torch.int64) % 256
    x, y = cc.batch(corpus, 0, 7, 1, 4, 3, 16)
    x2, y2 = cc.batch(corpus, 0, 7, 1, 4, 3, 16)
    assert x.shape == y.shape == (3, 16) and x.dtype == torch.int64
    assert torch.equal(x, x2) and torch.equal(y, y2)
    assert torch.equal(x[:, 1:], y[:, :-1])  # targets are the inputs shifted by one byte
    # Rank r's windows are the r-th slice of the step's global batch.
    whole_x, _ = cc.batch(corpus, 0, 7, 0, 1, 12, 16)
    assert torch.equal(whole_x[3:6], x)
    assert not torch.equal(cc.batch(corpus, 0, 8, 1, 4, 3, 16)[0], x)
    with pytest.raises(ValueError):
        cc.batch(corpus, 0, 0, 4, 4, 3, 16)


def test_sizes_span_one_megabyte_to_one_gigabyte_of_state() -> None:
    with torch.device("meta"):
        sizes = {name: cc.state_bytes(cc.build_model(name, 128)) for name in cc.SIZES}
    assert 0.5e6 <= sizes["tiny"] <= 2e6
    assert 0.8e9 <= sizes["xl"] <= 1.2e9
    assert list(sizes.values()) == sorted(sizes.values())
    with pytest.raises(ValueError, match="unknown --size"):
        cc.build_model("huge", 128)


def test_one_process_runs_of_both_twins_end_bitwise_equal() -> None:
    # Two separate processes (the ftrun script and its plain-DDP twin) must agree bit for bit.
    first = _run_alone(SCRIPT)
    assert "state_mb=" in first
    match = _final(first)
    assert match.group(1) == "12"
    assert 0.0 <= float(match.group(3)) <= 1.0
    assert _final(_run_alone(TORCHRUN_SCRIPT)).group(0) == match.group(0)


@pytest.mark.integration
@pytest.mark.timeout(240)
def test_two_rank_kill_recovers_bitwise(tmp_path: Path) -> None:
    digests = []
    for name, fault in (("clean", None), ("fault", "rank=1,step=5,point=allreduce,kind=kill")):
        cmd = [sys.executable, "-m", "ftrun", "--worker_num", "2", "--master_port", "0", "--plain",
               "--log_dir", str(tmp_path / name), "--tail_worker_log", "0", str(SCRIPT), *SMALL_RUN]
        env = _env({"FTRUN_FAULT": fault} if fault else None)
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=220, cwd=tmp_path)
        assert proc.returncode == 0, f"{name}: exit {proc.returncode}\n{proc.stdout[-4000:]}"
        digests.append(_final(proc.stdout).group(4))
        if fault:
            events = (tmp_path / name / "events.jsonl").read_text()
            assert '"recovery_finished"' in events and '"job_restarting"' not in events
    assert digests[0] == digests[1]
