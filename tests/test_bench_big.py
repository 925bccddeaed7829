"""scripts/bench_big.py without processes: its arguments, its plan, the time budget (a fake clock and
a fake job), and the report, JSON and plot of made-up runs."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))
import bench_big as bb  # noqa: E402


class FakeJob:
    """Stands in for bench.run_job: each run takes ``seconds[mode]`` on the fake clock and recovers in
    ``recover[mode]`` seconds; a launcher listed in ``fail`` raises as a failed job does."""

    def __init__(self, seconds: dict[str, float], recover: dict[str, float], fail: tuple[str, ...] = ()) -> None:
        self.now = 0.0
        self.seconds, self.recover, self.fail = seconds, recover, fail
        self.calls: list[tuple[str, int, float]] = []

    def clock(self) -> float:
        return self.now

    def __call__(self, launcher: str, case, timeout: float):
        mode = "ftrun-hot" if case.hot else launcher
        self.calls.append((mode, case.ranks, timeout))
        self.now += self.seconds[mode]
        if mode in self.fail:
            raise RuntimeError(f"{launcher} {case.label()}: exit 1, final line missing")
        return bb.Run(launcher, case, total_s=self.seconds[mode], step_s=0.02, failed_step=case.kill_step + 1,
                      recover_s=self.recover[mode], recomputed=5 if launcher == "torchrun" else 0,
                      breakdown={} if launcher == "torchrun" else {"detection": 0.01, "respawn": 0.5})


def _bench(tmp_path: Path, job: FakeJob, budget: float, cores: int = 16) -> tuple[object, list[str]]:
    said: list[str] = []
    estimate = bb.Estimate(cores, {"cpu": bb.CPU_COST, "gpu": bb.GPU_COST})
    bench = bb.Bench(estimate, budget, tmp_path, "python scripts/bench_big.py", (60, 3000), job=job, clock=job.clock, say=said.append)
    return bench, said


def test_world_sizes_and_parts_are_parsed_and_checked() -> None:
    assert bb.parse_worlds("8,16,32,64") == [8, 16, 32, 64]
    assert bb.parse_worlds(" 2, 4 ") == [2, 4]
    for bad in ("8,x", "1,4", ""):
        with pytest.raises(ValueError, match="--worlds"):
            bb.parse_worlds(bad)
    assert bb.parse_parts("gpu") == ["gpu"]
    with pytest.raises(ValueError, match="choose from cpu, gpu"):
        bb.parse_parts("cpu,tpu")


def test_defaults_are_the_lent_machines_run_and_bad_flags_are_one_error(capsys) -> None:
    args = bb.parse_args([])
    assert (args.world_list, args.part_list, args.budget_s) == ([8, 16, 32, 64], ["cpu", "gpu"], 480.0)
    assert bb.parse_args(["--worlds", "2,4", "--out", "x"]).world_list == [2, 4]
    for argv in (["--worlds", "2", "--victim", "2"], ["--kill_step", "29"], ["--worlds", "8,a"]):
        with pytest.raises(SystemExit) as exit_info:
            bb.parse_args(argv)
        assert exit_info.value.code == 2
    assert "error:" in capsys.readouterr().err


def test_the_plan_runs_three_modes_a_world_the_cpu_worlds_first_then_the_gpu() -> None:
    args = bb.parse_args(["--worlds", "8,16", "--repeats", "2"])
    plan = bb.triples(args, ["cpu", "gpu"], args.world_list)
    assert [(t[0].part, t[0].case.ranks, t[0].repeat) for t in plan] == [
        ("cpu", 8, 0), ("cpu", 16, 0), ("cpu", 8, 1), ("cpu", 16, 1), ("gpu", 4, 0), ("gpu", 4, 1)]
    for triple in plan:
        assert [s.mode for s in triple] == list(bb.MODES)
        assert [s.launcher for s in triple] == ["ftrun", "ftrun", "torchrun"]
        warm, hot, torchrun = (s.case for s in triple)
        assert warm == torchrun and not warm.hot and hot.hot and hot.steps == args.hot_steps
    gpu = plan[-1][0].case
    assert (gpu.size, gpu.args[-2:]) == ("medium", ("--device", "cuda"))
    assert all("--device" not in t[0].case.args for t in plan if t[0].part == "cpu")


def test_estimates_grow_with_the_world_and_follow_the_runs_measured() -> None:
    args = bb.parse_args(["--worlds", "8,64", "--repeats", "1"])
    small, big = bb.triples(args, ["cpu"], args.world_list)
    estimate = bb.Estimate(16, {"cpu": bb.CPU_COST})
    assert estimate.of(big[0]) > estimate.of(small[0])
    assert estimate.of(small[2]) > estimate.of(small[0])  # torchrun starts every rank twice and recomputes
    before = estimate.of(big[0])
    estimate.observe(small[0], 3 * estimate.raw(small[0]))  # the machine is three times slower than the model
    assert estimate.factor("cpu") == pytest.approx(3.0)
    assert estimate.of(big[0]) == pytest.approx(3 * before)


def test_each_triple_prints_its_pairwise_ratios_and_the_json_keeps_every_run(tmp_path: Path) -> None:
    job = FakeJob({"ftrun": 10, "ftrun-hot": 20, "torchrun": 30}, {"ftrun": 2.0, "ftrun-hot": 1.0, "torchrun": 20.0})
    bench, said = _bench(tmp_path, job, budget=1000)
    args = bb.parse_args(["--worlds", "8,16", "--repeats", "1"])
    results = bench.run(bb.triples(args, ["cpu"], args.world_list))
    assert [(m, r) for m, r, _ in job.calls] == [(m, w) for w in (8, 16) for m in bb.MODES]
    assert len(results["parts"]["cpu"]) == 6 and not results["skipped"] and not results["errors"]
    lines = [line for line in said if line.startswith("  => ")]
    assert len(lines) == 2 and "torchrun/ftrun 10.0x" in lines[0] and "torchrun/ftrun-hot 20.0x" in lines[0]
    saved = json.loads((tmp_path / "bench_big.json").read_text())  # rewritten after every run
    assert len(saved["parts"]["cpu"]) == 6 and len(saved["estimates"]) == 6
    assert saved["estimates"][0]["took_s"] == 10


def test_a_triple_that_does_not_fit_is_skipped_and_the_gpu_part_keeps_its_share(tmp_path: Path) -> None:
    job = FakeJob({"ftrun": 1, "ftrun-hot": 1, "torchrun": 1}, {"ftrun": 1.0, "ftrun-hot": 1.0, "torchrun": 9.0})
    args = bb.parse_args(["--worlds", "64", "--repeats", "1"])
    plan = bb.triples(args, ["cpu", "gpu"], args.world_list)
    estimate = bb.Estimate(16, {"cpu": bb.CPU_COST, "gpu": bb.GPU_COST})
    cpu_need, gpu_need = (sum(estimate.of(s) for s in triple) for triple in plan)
    assert cpu_need > gpu_need
    bench, said = _bench(tmp_path, job, budget=cpu_need + gpu_need - 1)  # either alone fits, not both
    results = bench.run(plan)
    assert [r for _, r, _ in job.calls] == [4, 4, 4]  # x64 skipped, the GPU part ran
    assert len(results["skipped"]) == 1 and "kept for the GPU part" in results["skipped"][0]
    assert said[0].startswith("[cpu] x64 repeat 1 skipped: estimated")


def test_a_failed_run_is_recorded_and_the_rest_goes_on(tmp_path: Path) -> None:
    job = FakeJob({"ftrun": 10, "ftrun-hot": 10, "torchrun": 10}, {"ftrun": 1.0, "ftrun-hot": 1.0, "torchrun": 9.0},
                  fail=("ftrun-hot",))
    bench, said = _bench(tmp_path, job, budget=1000)
    args = bb.parse_args(["--worlds", "8", "--repeats", "1"])
    results = bench.run(bb.triples(args, ["cpu"], args.world_list))
    assert [r["mode"] for r in results["parts"]["cpu"]] == ["ftrun", "torchrun"]
    assert len(results["errors"]) == 1 and results["errors"][0].startswith("cpu x8 ftrun-hot: ftrun charlm-tiny x8 hot: exit 1")
    assert said[-4] == "    FAILED: ftrun charlm-tiny x8 hot: exit 1, final line missing"  # its first line, no timeout
    assert "torchrun/ftrun 9.0x" in said[-1] and "ftrun-hot" not in said[-1]


def test_the_first_run_of_a_part_may_run_twenty_times_its_estimate_later_ones_four_times(tmp_path: Path) -> None:
    job = FakeJob({}, {})
    bench, _ = _bench(tmp_path, job, budget=5000)
    args = bb.parse_args(["--worlds", "64", "--repeats", "1"])
    warm, hot, torchrun = bb.triples(args, ["cpu"], args.world_list)[0]
    # nothing measured yet: the model may be far off
    assert bench.timeout(warm, reserve=100) == pytest.approx(max(180.0, 20 * bench.estimate.raw(warm)))
    assert bench.timeout(warm, reserve=4900) == pytest.approx(100)
    bench.estimate.observe(warm, 2 * bench.estimate.raw(warm))
    assert bench.timeout(torchrun, reserve=100) == pytest.approx(max(60.0, 4 * 2 * bench.estimate.raw(torchrun)))
    job.now = 4990.0
    assert bench.timeout(torchrun, reserve=0) == 30.0  # never past the budget, but never under 30 s


def test_the_hot_spare_job_is_long_enough_for_the_spare_to_be_ready() -> None:
    # 12 s of start-up at 50 ms a step: (1.5 * 12 + 5) / 0.05 = 460 steps after the kill step, and 10 more
    assert bb.hot_steps(15, 12.0, 0.05, floor=60, ceiling=3000) == 15 + 460 + 10
    assert bb.hot_steps(15, 0.1, 1.0, floor=60, ceiling=3000) == 60
    assert bb.hot_steps(15, 100.0, 0.001, floor=60, ceiling=3000) == 3000


def test_a_hot_job_is_sized_from_its_warm_twins_start_up_and_step_time(tmp_path: Path) -> None:
    job = FakeJob({"ftrun": 40, "ftrun-hot": 60, "torchrun": 50}, {"ftrun": 2.0, "ftrun-hot": 1.0, "torchrun": 20.0})
    bench, said = _bench(tmp_path, job, budget=10000)
    args = bb.parse_args(["--worlds", "8", "--repeats", "1"])
    bench.run(bb.triples(args, ["cpu"], args.world_list))
    # the warm run: 40 s in all, 30 steps of 20 ms, 2 s of recovery: 37.4 s of start-up
    hot = [line for line in said if "ftrun-hot repeat 1:" in line][0]
    assert f"{bb.hot_steps(15, 40 - 30 * 0.02 - 2.0, 0.02, 60, 3000)} steps" in hot


def _results() -> dict:
    def run(mode: str, ranks: int, repeat: int, recover: float, step: float) -> dict:
        launcher = "torchrun" if mode == "torchrun" else "ftrun"
        return {"mode": mode, "repeat": repeat, "part": "cpu", "launcher": launcher, "case": {"ranks": ranks},
                "failed_step": 16, "recover_s": recover, "recomputed": 5 if launcher == "torchrun" else 0,
                "step_s": step, "total_s": 30.0, "breakdown": {} if launcher == "torchrun" else {"respawn": 0.4}}

    runs = [run("ftrun", 8, k, 2.0 + k, 0.010) for k in (0, 1)] + [run("ftrun-hot", 8, k, 1.0, 0.011) for k in (0, 1)]
    runs += [run("torchrun", 8, k, 20.0 + 10 * k, 0.009) for k in (0, 1)]
    return {"machine": {"cpu": "test CPU", "cores": 16, "gpu": None}, "command": "python scripts/bench_big.py",
            "budget_s": 480, "took_s": 300, "parts": {"cpu": runs}, "skipped": ["[cpu] x64 repeat 1 skipped: ..."],
            "errors": []}


def test_the_report_gives_medians_and_the_median_of_pairwise_ratios() -> None:
    text = bb.report(_results())
    table = text.split("where ftrun's recovery time goes")[0]  # the first table, not the breakdown's
    rows = {tuple(line.split()[:2]): line.split() for line in table.splitlines() if line.strip().startswith("8 ")}
    # pairs: 20/2 = 10 and 30/3 = 10 for ftrun; 20/1 and 30/1 for the hot spare: median 25
    assert rows[("8", "ftrun")][-1] == "10.0x" and rows[("8", "ftrun-hot")][-1] == "25.0x"
    assert rows[("8", "torchrun")][4] == "25.00" and rows[("8", "torchrun")][6] == "5"  # median recover, recomputed
    assert rows[("8", "ftrun")][7] == "10.0"  # step ms
    assert "GPU none" in text and "x64 repeat 1 skipped" in text


def test_from_json_reports_and_plots_again_without_running(tmp_path: Path, capsys) -> None:
    pytest.importorskip("matplotlib")
    source = tmp_path / "in.json"
    source.write_text(json.dumps(_results()))
    bb.main(["--from_json", str(source), "--out", str(tmp_path / "out")])
    out = capsys.readouterr().out
    assert "10.0x" in out and (tmp_path / "out" / "bench_big.png").stat().st_size > 0
    assert json.loads((tmp_path / "out" / "bench_big.json").read_text())["parts"]["cpu"]


def test_a_hot_job_too_long_for_what_is_left_is_shortened_not_below_its_floor(tmp_path: Path) -> None:
    bench, _ = _bench(tmp_path, FakeJob({}, {}), budget=40)
    args = bb.parse_args(["--worlds", "8", "--repeats", "1"])
    warm, hot, torchrun = bb.triples(args, ["cpu"], args.world_list)[0]
    long = bb.replace(hot, case=bb.replace(hot.case, steps=3000))
    fitted = bench.fit(long, torchrun, reserve=0)
    assert 60 <= fitted.case.steps < 3000
    assert bench.estimate.of(fitted) + bench.estimate.of(torchrun) <= 40 or fitted.case.steps == 60
    assert bench.fit(long, torchrun, reserve=1000).case.steps == 60  # nothing left: the floor
    assert bench.fit(hot, torchrun, reserve=0) == hot  # fits already
