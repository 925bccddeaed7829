"""A Lightning Fabric loop over an FSDP2 (HSDP 2x2) model under ftrun: examples/fabric_fsdp.py
(``ModelParallelStrategy`` with a ``parallelize_fn`` applying ``fully_shard`` on the mesh declared at
``ftrun.init``, ``ftrun.integrations.fabric.FTFabric``) on 4 ranks against the same script under
plain torchrun, bitwise (the full parameters' SHA-256).

One job carries two kills: rank 1 SIGKILLed from outside while rank 0 pauses after step 2, then
rank 3 killed by an injected fault inside FSDP's all-gathers of step 5 (its replica, the rank 1
respawned before, is its donor). Each is respawned alone, the survivors keep their processes, and
the run ends with the torchrun run's parameters. The run without a fault is ``slow``.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

import pytest

pytest.importorskip("lightning", reason="the lightning extra (pip install 'ftrun[lightning]') is not installed")

import digits_job as dj  # noqa: E402
import framework_helpers as fh  # noqa: E402
from conftest import run_bounded  # noqa: E402
from once import shared_once  # noqa: E402
from reference_runs import run_torchrun  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "fabric_fsdp.py"
FINAL = re.compile(r"final step=(\d+) loss=(\S+) params_sha256=([0-9a-f]{64})")
WORLD = 4

pytestmark = [pytest.mark.integration, pytest.mark.frameworks, pytest.mark.xdist_group("fabric")]


def _final(stdout: str) -> tuple[str, ...]:
    match = FINAL.search(stdout)
    assert match, f"no final line in output:\n{stdout[-4000:]}"
    return match.groups()


def _ftrun_cmd(tmp_path: Path, args: list[str]) -> list[str]:
    return [sys.executable, "-m", "ftrun", "--worker_num", str(WORLD), "--master_port", "0", "--plain",
            "--log_dir", str(tmp_path / "logs"), "--tail_worker_log", "0", "--max_restarts", "3",
            "--step_timeout", "120", str(SCRIPT), *args]


@pytest.fixture(scope="module")
def reference(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, ...]:
    """The script under plain torchrun (FTFabric is Fabric there, on the mesh ftrun.init declared)."""
    def run() -> tuple[str, ...]:
        cwd = tmp_path_factory.mktemp("fabric_fsdp_torchrun")
        env = {**fh.env(), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
        proc = run_torchrun(["--standalone", "--nproc_per_node", str(WORLD), str(SCRIPT)], env=env, cwd=cwd, timeout=240)
        fh.assert_torchrun_ok(proc, FINAL)
        final = _final(proc.stdout)
        assert final[0] == "16", final  # 2 epochs of 8 steps
        return final

    return tuple(shared_once(tmp_path_factory, "fabric_fsdp_reference", run))


@pytest.mark.timeout(420)
def test_fabric_fsdp_ranks_killed_outside_and_in_the_allgather_end_bitwise(tmp_path: Path,
                                                                           reference: tuple[str, ...]) -> None:
    """Rank 1 SIGKILLed from outside (rank 0 pauses after step 2: the others wait in step 3's
    collectives), then rank 3 killed inside the all-gathers of step 5 (ftrun's step 5, the sixth).
    The survivors recover inside the step's doors (the forward, the backward or clip_gradients,
    each run again after the recovery); only ranks 1 and 3 are started again."""
    env = {**fh.env(), "FTRUN_FAULT": "rank=3,step=5,point=allgather,kind=kill"}
    log_dir = tmp_path / "logs"
    out = dj.kill_rank_when_logged(_ftrun_cmd(tmp_path, ["--pause_at", "2"]), env, tmp_path, log_dir,
                                   "pause step=2", rank=1)
    assert _final(out) == reference
    events = fh.events(log_dir)
    started: dict[int, int] = {}
    for ev in events:
        if ev["kind"] == "rank_started":
            started[ev["rank"]] = started.get(ev["rank"], 0) + 1
    assert started == {0: 1, 1: 2, 2: 1, 3: 2}, started
    assert [e["rank"] for e in events if e["kind"] == "rank_failed"] == [1, 3]
    assert len([e for e in events if e["kind"] == "recovery_finished"]) >= 2
    assert not [e for e in events if e["kind"] == "job_restarting"], "fell back to a whole-job restart"
    assert not [e.get("message") for e in events if e["kind"] == "divergence"]
    # Rank 3 died inside step 5: each survivor's step 5 failed in one of its doors and ran again.
    logs = {rank: (log_dir / f"worker_{rank}.log").read_text() for rank in (0, 1, 2)}
    assert all(re.search(r"step 5's \S+ failed; .* again after the recovery", log) for log in logs.values()), logs


@pytest.mark.slow
@pytest.mark.timeout(420)
def test_fabric_fsdp_fault_free_matches_torchrun(tmp_path: Path, reference: tuple[str, ...]) -> None:
    proc = run_bounded(_ftrun_cmd(tmp_path, []), env=fh.env(), cwd=tmp_path, timeout=280)
    assert proc.returncode == 0, proc.stdout[-4000:]
    assert _final(proc.stdout) == reference
    assert not [e for e in fh.events(tmp_path / "logs") if e["kind"] in ("rank_failed", "divergence")]
