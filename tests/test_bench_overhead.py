"""scripts/bench.py's overhead-real part, pure logic only (no process): where a fault-free run's
steady state starts, so that both runs of a pair are measured over the same steps, after the
job's one-time costs."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def _bench():
    spec = importlib.util.spec_from_file_location("bench_overhead_under_test", ROOT / "scripts" / "bench.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


bench = _bench()
LINES = [(s, 100.0 + 0.01 * s) for s in range(300)]  # step s printed at 100 + s/100 s


def test_ftrun_starts_once_its_warm_spare_was_ready() -> None:
    assert bench.steady_start(LINES, 50, 101.205, "ftrun", None) == 121  # the first step printed after it
    assert bench.steady_start(LINES, 50, 100.2, "ftrun", None) == 50  # ready within the first epoch


def test_without_a_ready_line_it_starts_after_the_first_epoch() -> None:
    assert bench.steady_start(LINES, 50, None, "ftrun", None) == 50


def test_a_spare_ready_after_the_last_step_leaves_no_steady_state() -> None:
    start = bench.steady_start(LINES, 50, 200.0, "ftrun", None)
    assert start == 299
    assert bench.steady_step_time(LINES, warmup=start) is None


def test_torchrun_takes_its_pair_s_start() -> None:
    assert bench.steady_start(LINES, 50, None, "torchrun", 121) == 121
    assert bench.steady_start(LINES, 50, None, "torchrun", 10) == 50
    assert bench.steady_start(LINES, 50, None, "torchrun", None) == 50


def test_the_ready_line_is_read_from_spares_log(tmp_path: Path) -> None:
    assert bench.warm_spare_ready(tmp_path) is None
    (tmp_path / "logs").mkdir()
    (tmp_path / "logs" / "spares.log").write_text(
        "ftrun: warm spare (pid 12) ready at 1795808004.250: its imports took 6.17 s at idle priority\n"
        "ftrun: warm spare (pid 13) ready at 1795808099.000: its imports took 1.00 s\n")
    assert bench.warm_spare_ready(tmp_path) == 1795808004.25
