"""An unmodified torchrun-style script gives under ftrun the same result as under torchrun."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_digits_torchrun.py"
FINAL = re.compile(r"final step=24 loss=(\S+) test_accuracy=(\S+) params_sha256=([0-9a-f]{64})")

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_", "MS_ENABLE_TFT"))}
    env["OMP_NUM_THREADS"] = "1"  # torchrun and ftrun both set it for several ranks; pin it for both
    return env


def _final(cmd: list[str], cwd: Path) -> tuple[str, str, str]:
    proc = subprocess.run(cmd, env=_env(), capture_output=True, text=True, timeout=220, cwd=cwd)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    match = FINAL.search(proc.stdout)
    assert match, proc.stdout[-3000:]
    return match.groups()


def test_same_result_as_torchrun(tmp_path: Path) -> None:
    args = [str(SCRIPT), "--steps", "24"]
    under_torchrun = _final(
        [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "4", *args], tmp_path
    )
    under_ftrun = _final(
        [sys.executable, "-m", "ftrun", "--worker_num", "4", "--master_port", "0", "--plain",
         "--log_dir", str(tmp_path / "logs"), "--tail_worker_log", "0", *args],
        tmp_path,
    )
    assert under_ftrun == under_torchrun
