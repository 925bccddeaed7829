"""``ft.wrap_model(ddp=True, **kwargs)`` gives DistributedDataParallel's bits for every DDP keyword
it accepts, and refuses the others with one line.

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
from typing import Any

import pytest
import torch

from ftrun.rank.reducer import BucketLayout

SCRIPT = Path(__file__).parent / "scripts" / "ddp_twin.py"
CASES = ("lstm", "lstm-unused", "transformer-unused", "transformer-caps", "branchy-unused", "branchy-nobuffers",
         "transformer-twopass")


@pytest.mark.integration
def test_every_accepted_ddp_keyword_gives_ddps_bits(tmp_path: Path) -> None:
    """LSTM and Transformer with find_unused_parameters and bucket caps; a model whose heads are
    unused on some ranks only, or on all, with a BatchNorm (buffers broadcast or not); a gradient
    accumulation under no_sync; two synced backward passes a step (DDP's buckets rebuilt between
    the two passes of step 0); evaluation forwards between steps. Parameters, gradients (None
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

    from ftrun.rank.reducer import GradientReducer

    reducer = GradientReducer([torch.nn.Parameter(torch.ones(2))], 2, before_first_bucket=lambda: None,
                              is_failed=lambda: False, on_hook_error=lambda err: False, on_failure=lambda error: None,
                              waiting=threading.Event(), abandon=threading.Event())
    reducer._pending = [([0], torch.ones(2), _Work(3, fails=fails), False)]
    reducer.wait()
    assert (reducer.error is not None and "Connection closed" in reducer.error) if fails else reducer.error is None


def test_the_local_gradient_fingerprint_is_the_same_however_the_pass_launches_its_buckets() -> None:
    """The local gradient's fingerprint is taken from each bucket's flat copy as it is launched
    (no per-tensor pass over ``.grad`` after backward). The same gradients must give the
    same fingerprint whether the buckets leave during backward (a running rank), all at its end
    (a respawned rank's first pass, which learns the layout from it), or only after the check (a
    recomputed step held under ``--on_divergence fail``); other gradients another one. The
    provisional record (``at_pass_start``) comes at the pass's first gradient, before anything
    leaves (no peer can commit the step without it); the check before the last bucket leaves, and
    the fingerprint's write (``after_last_bucket``) right after it left, while the all-reduce runs."""
    import threading

    from ftrun.rank.reducer import BucketLayout, GradientReducer

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
    events: list[str] = []
    digests: list[str] = []
    hold = {"on": False}

    def on_local_gradient(digest: str) -> bool:
        events.append("checked")
        digests.append(digest)
        return True

    reducer = GradientReducer(list(model.parameters()), 2, before_first_bucket=lambda: events.append("first bucket"),
                              is_failed=lambda: False, on_hook_error=lambda err: False, on_failure=lambda error: None,
                              waiting=threading.Event(), is_first_step=lambda: False,
                              on_local_gradient=on_local_gradient, hold_for_check=lambda: hold["on"],
                              layout=BucketLayout(first_cap=16, cap=16),
                              at_pass_start=lambda: events.append("pass start"),
                              after_last_bucket=lambda: events.append("after last bucket"))
    reducer.attach()
    launched: list[int] = []

    def launch(flat: torch.Tensor, average: bool = True) -> None:  # no group: note the bucket
        events.append("launched")
        launched.append(flat.numel())

    reducer.launch = launch

    def backward(x: torch.Tensor) -> None:
        model.zero_grad(set_to_none=True)
        events.clear()
        launched.clear()
        model(x).sum().backward()

    x = torch.randn(3, 4)
    backward(x)  # no layout known yet: every bucket at the end
    layout = list(launched)
    last = ["checked", "launched", "after last bucket"]
    assert len(layout) > 1 and sum(layout) == 30
    assert events == ["pass start", "first bucket"] + ["launched"] * (len(layout) - 1) + last
    backward(x)  # the rebuilt layout: buckets leave during backward
    assert launched == layout and events == ["pass start", "first bucket"] + ["launched"] * (len(layout) - 1) + last
    hold["on"] = True
    backward(x)  # held: checked before anything leaves
    assert launched == layout and events == ["pass start", "checked", "first bucket"] + ["launched"] * (len(layout) - 1) + last[1:]
    hold["on"] = False
    backward(x + 1)
    assert digests[0] == digests[1] == digests[2] != digests[3]


class _DoneWork:
    """A finished all-reduce (the fake group below did its work at launch)."""

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def]
        return True

    def is_completed(self) -> bool:
        return True


class _StuckWork(_DoneWork):
    """An all-reduce that never finishes by itself (a peer gone silent)."""

    def __init__(self) -> None:
        self.done = False

    def wait(self, timeout=None) -> bool:  # type: ignore[no-untyped-def]
        if self.done:
            return True
        raise RuntimeError("Operation timed out!")

    def is_completed(self) -> bool:
        return self.done


def _ddp_reducer(model: torch.nn.Module, launch: Any, abandon: Any = None) -> tuple[Any, Any]:
    """``model`` wrapped as ``wrap_model(ddp=True)`` does, with a reducer for a world of 2 whose
    all-reduces ``launch(flat)`` fakes (no process group)."""
    import threading

    from torch.nn.parallel import DistributedDataParallel

    from ftrun.rank.reducer import GradientReducer, local_gradients_hook, one_rank_group

    reducer = GradientReducer(list(model.parameters()), 2, before_first_bucket=lambda: None, is_failed=lambda: False,
                              on_hook_error=lambda err: False, on_failure=lambda error: None,
                              waiting=threading.Event(), is_first_step=lambda: False, abandon=abandon)
    ddp = DistributedDataParallel(model, process_group=one_rank_group(torch.device("cpu"), 30.0), gradient_as_bucket_view=True)
    ddp.register_comm_hook(None, local_gradients_hook)
    reducer.attach(after_ddp=True)
    reducer.launch = launch
    return ddp, reducer


def test_ddp_bucket_views_are_reduced_in_place_with_the_bits_of_a_copy() -> None:
    """Under ``wrap_model(ddp=True)`` the gradients are DDP's bucket views, end to end in
    bucket order; once the layout is known every bucket is reduced in place (no flat copy, no copy
    back) and ``.grad`` ends as the copying path leaves it, bit for bit (the plain model here)."""
    import threading

    from ftrun.rank.reducer import GradientReducer

    def fake_all_reduce(flat: torch.Tensor, average: bool = True) -> _DoneWork:
        in_place.append(any(flat.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr()
                            for p in model.parameters()))
        flat.div_(2).add_(torch.arange(flat.numel(), dtype=flat.dtype) / 7)  # another rank's half
        return _DoneWork()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    plain = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(), torch.nn.Linear(5, 3))
    plain.load_state_dict(model.state_dict())
    in_place: list[bool] = []
    ddp, _ = _ddp_reducer(model, fake_all_reduce)
    copying = GradientReducer(list(plain.parameters()), 2, before_first_bucket=lambda: None, is_failed=lambda: False,
                              on_hook_error=lambda err: False, on_failure=lambda error: None,
                              waiting=threading.Event(), is_first_step=lambda: False)
    copying.attach()
    copying.launch = fake_all_reduce
    for step in range(3):
        x = torch.randn(4, 6)
        model.zero_grad(set_to_none=True)
        plain.zero_grad(set_to_none=True)
        in_place.clear()
        ddp(x).sum().backward()
        assert in_place and all(in_place) == (step > 0), in_place  # the first pass learns the layout (copies)
        in_place.clear()
        plain(x).sum().backward()
        assert in_place and not any(in_place)
        for a, b in zip(model.parameters(), plain.parameters()):
            assert torch.equal(a.grad, b.grad)


def test_an_in_place_all_reduce_given_up_on_blocks_the_next_step_until_it_settles(monkeypatch: pytest.MonkeyPatch) -> None:
    """An aborted pass gives up on an all-reduce still in flight. Reduced in place, it could yet
    write into DDP's bucket views, which the next backward fills: the reducer keeps it, copies
    meanwhile, and the step loop's gate (``GradientSync.settle``) waits for it to fail or finish;
    one still in flight after ``SETTLE_S`` ends the process, to be respawned, rather than let it
    write into a later step's gradients."""
    import threading
    from types import SimpleNamespace

    from ftrun.rank import gradsync, reducer as reducer_mod

    monkeypatch.setattr(reducer_mod, "ABANDON_GRACE_S", 0.0)
    stuck: list[_StuckWork] = []
    copies: list[bool] = []

    def launch(flat: torch.Tensor, average: bool = True) -> _DoneWork:
        copies.append(not any(flat.untyped_storage().data_ptr() == p.grad.untyped_storage().data_ptr()
                              for p in model.parameters()))
        if abandon.is_set():
            stuck.append(_StuckWork())
            return stuck[-1]
        return _DoneWork()

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Linear(5, 3))
    abandon = threading.Event()
    ddp, reducer = _ddp_reducer(model, launch, abandon)
    x = torch.randn(4, 6)
    for _ in range(2):  # the layout is known; in place from the second pass
        ddp(x).sum().backward()
    assert not copies[-1] and not reducer.unsettled
    abandon.set()  # an abort: the pass gives up on its all-reduces
    ddp(x).sum().backward()
    assert stuck and reducer.unsettled and not reducer.settle(0.05)
    abandon.clear()
    copies.clear()
    ddp(x).sum().backward()  # not settled yet: a copy, never the views that work may write into
    assert copies and all(copies)

    exits: list[int] = []
    monkeypatch.setattr(gradsync, "SETTLE_S", 0.05)
    monkeypatch.setattr(gradsync.os, "_exit", exits.append)
    sync = SimpleNamespace(reducers=[reducer], group=SimpleNamespace(rank=1))
    gradsync.GradientSync.settle(sync)  # type: ignore[arg-type]
    assert exits == [1]
    for work in stuck:
        work.done = True  # it failed at last (the abort's connection cut)
    gradsync.GradientSync.settle(sync)  # type: ignore[arg-type]
    assert exits == [1] and not reducer.unsettled
    copies.clear()
    ddp(x).sum().backward()
    assert copies and not any(copies)  # in place again

