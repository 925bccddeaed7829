"""``ft.wrap_model(ddp=True, **kwargs)`` gives DistributedDataParallel's bits for every DDP keyword
it accepts, and refuses the others with one line (issue 27, item 1).

The comparison trains torch's DDP and ftrun's gradient sync side by side in each of 4 gloo
processes (tests/scripts/ddp_twin.py): 4 ranks, because a ring all-reduce over 2 sums each element
in one order whatever the bucket layout, and the layout is what differed
(``find_unused_parameters=True``: DDP never rebuilds its buckets).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from ftrun.reducer import BucketLayout

SCRIPT = Path(__file__).parent / "scripts" / "ddp_twin.py"
CASES = ("lstm", "lstm-unused", "transformer-unused", "transformer-caps", "branchy-unused", "branchy-nobuffers")


@pytest.mark.integration
def test_every_accepted_ddp_keyword_gives_ddps_bits(tmp_path: Path) -> None:
    """LSTM and Transformer with find_unused_parameters and bucket caps; a model whose heads are
    unused on some ranks only, or on all, with a BatchNorm (buffers broadcast or not); a gradient
    accumulation under no_sync; evaluation forwards between steps. Parameters, gradients (None
    where DDP leaves None) and buffers are compared after every backward, step and evaluation."""
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).parents[1]), OMP_NUM_THREADS="1")
    for key in [k for k in env if k.startswith(("FTRUN_", "TORCHELASTIC_")) or k in ("RANK", "WORLD_SIZE", "MASTER_PORT")]:
        del env[key]
    world = 4
    procs = [subprocess.Popen([sys.executable, str(SCRIPT), str(r), str(world), str(tmp_path / "store"), ",".join(CASES)],
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
             for r in range(world)]
    try:
        outs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    for r, (p, out) in enumerate(zip(procs, outs)):
        assert p.returncode == 0, "\n".join(f"=== rank {q}:\n{o[-2500:]}" for q, o in enumerate(outs))
        assert [line for line in out.splitlines() if line.startswith("ok ")] == [f"ok {c} 8" for c in CASES], out[-3000:]


@pytest.mark.parametrize("kwargs, named", [
    ({"static_graph": True}, "static_graph=True"),
    ({"process_group": object()}, "process_group="),
    ({"mixed_precision": object()}, "mixed_precision="),
    ({"skip_all_reduce_unused_params": True}, "skip_all_reduce_unused_params=True"),
    ({"init_sync": False}, "init_sync=False"),
])
def test_keywords_without_ddps_bits_are_refused(kwargs: dict, named: str) -> None:
    with pytest.raises(ValueError) as err:
        BucketLayout.from_ddp_kwargs(kwargs)
    line = str(err.value)
    assert "\n" not in line and named in line and line.startswith("ft.wrap_model(ddp=True) does not take")


def test_ddps_harmless_defaults_are_accepted() -> None:
    assert BucketLayout.from_ddp_kwargs({"static_graph": False, "process_group": None, "init_sync": True,
                                         "skip_all_reduce_unused_params": False}) == BucketLayout()


def test_layouts_follow_ddps_keywords() -> None:
    """Default: one bucket first, rebuilt later; find_unused_parameters: capped from the start,
    the last parameters' bucket first, never rebuilt; bucket_cap_mb caps the first bucket too."""
    params = [torch.zeros(1000) for _ in range(6)]  # 4,000 bytes each
    assert BucketLayout().initial(params) == [[0, 1, 2, 3, 4, 5]] and BucketLayout().rebuilds
    small = 10_000 / (1024 * 1024)  # a bucket closes once it holds 10,000 bytes or more: 3 parameters
    unused = BucketLayout.from_ddp_kwargs({"find_unused_parameters": True, "bucket_cap_mb": small})
    assert not unused.rebuilds and unused.first_cap == unused.cap == 10_000
    assert unused.initial(params) == [[3, 4, 5], [0, 1, 2]]
    capped = BucketLayout.from_ddp_kwargs({"bucket_cap_mb": small})
    assert capped.rebuilt(params, [5, 4, 3, 2, 1, 0]) == [[5, 4, 3], [2, 1, 0]]


class _Work:
    """A ``Work`` whose ``wait(timeout)`` times out ``timeouts`` times, completing (``fails``: with
    an error) as the last timeout is raised: the race between a timeout and ``is_completed()``."""

    def __init__(self, timeouts: int, fails: bool = False) -> None:
        self.timeouts, self.fails, self.completed = timeouts, fails, False

    def wait(self, timeout: object = None) -> bool:
        if self.completed or timeout is None:
            self.completed = True
            if self.fails:
                raise RuntimeError("Connection closed by peer")
            return True
        self.timeouts -= 1
        if self.timeouts == 0:
            self.completed = True  # completes right after its timeout was raised
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.completed


@pytest.mark.parametrize("fails", [False, True])
def test_a_work_that_completes_right_after_a_timed_out_wait_is_taken_for_what_it_did(fails: bool) -> None:
    """Seen under load with the twin above: an all-reduce that completed between its timed-out
    wait and the ``is_completed()`` check was taken for failed, and the local gradients were left
    unaveraged (DDP's bits lost)."""
    import threading

    from ftrun.reducer import GradientReducer

    reducer = GradientReducer([torch.nn.Parameter(torch.ones(2))], 2, before_first_bucket=lambda: None,
                              is_failed=lambda: False, on_hook_error=lambda err: False, on_failure=lambda error: None,
                              waiting=threading.Event(), abandon=threading.Event())
    reducer._pending = [([0], torch.ones(2), _Work(3, fails=fails))]
    reducer.wait()
    assert (reducer.error is not None and "Connection closed" in reducer.error) if fails else reducer.error is None
