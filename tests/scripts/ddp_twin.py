"""One rank of a comparison between torch's DistributedDataParallel and ftrun's gradient sync
(``ft.wrap_model(ddp=True, **kwargs)``'s engine), trained side by side in one process over one gloo
group: both models start from the same weights, see the same batches, and after every step their
parameters, gradients and buffers must be bitwise equal.

Usage: python ddp_twin.py RANK WORLD STORE_FILE CASE[,CASE...]  (prints "ok CASE STEPS" per case, or raises)
"""

from __future__ import annotations

import copy
import sys
import threading
from types import SimpleNamespace

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from ftrun.rank.client import StepBoard
from ftrun.rank.gradsync import GradientSync
from ftrun.rank.transaction import StepTransaction
from ftrun.rank.workerstate import WorkerState

rank, world, store_file, cases = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3], sys.argv[4].split(",")
case = ""
torch.set_num_threads(1)
dist.init_process_group("gloo", init_method=f"file://{store_file}", rank=rank, world_size=world)


class Lstm(nn.Module):
    """word_lm's model: embedding, 2-layer LSTM, decoder (every parameter used)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.rnn, self.dec = nn.Embedding(50, 16), nn.LSTM(16, 16, 2), nn.Linear(16, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out, _ = self.rnn(self.emb(x))
        return self.dec(out)


class Transformer(nn.Module):
    """A small encoder language model (torch's TransformerEncoder, dropout 0)."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(50, 32)
        layer = nn.TransformerEncoderLayer(32, 4, 64, dropout=0.0)
        self.enc, self.dec = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False), nn.Linear(32, 50)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dec(self.enc(self.emb(x)))


class Branchy(nn.Module):
    """Two heads, one per batch parity and rank: some steps a head is unused on some ranks only,
    some steps on every rank; a BatchNorm whose running statistics differ per rank."""

    def __init__(self) -> None:
        super().__init__()
        self.emb, self.norm = nn.Embedding(50, 16), nn.BatchNorm1d(16)
        self.a, self.b, self.dec = nn.Linear(16, 16), nn.Linear(16, 16), nn.Linear(16, 50)
        self.calls = 0

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = self.norm(self.emb(x).mean(0))
        self.calls += 1
        head = self.a if (self.calls + (rank if self.calls % 3 else 0)) % 2 else self.b
        return self.dec(torch.tanh(head(h))).unsqueeze(0).expand(x.shape[0], -1, -1)


CASES = {
    "lstm": (Lstm, {}),
    "lstm-unused": (Lstm, {"find_unused_parameters": True}),
    "transformer-unused": (Transformer, {"find_unused_parameters": True, "bucket_cap_mb": 0.01}),
    "transformer-caps": (Transformer, {"bucket_cap_mb": 0.02}),
    "branchy-unused": (Branchy, {"find_unused_parameters": True}),
    "branchy-nobuffers": (Branchy, {"find_unused_parameters": True, "broadcast_buffers": False}),
    # Two synced backward passes a step (a GAN's shape): DDP rebuilds its buckets at the forward
    # after the first, inside step 0, so the second pass of step 0 already uses the rebuilt ones.
    "transformer-twopass": (Transformer, {"bucket_cap_mb": 0.02}),
}
TWO_PASSES = {"transformer-twopass"}


def ftrun_sync() -> GradientSync:
    """GradientSync as the worker builds it, with the worker's callbacks reduced to records."""
    failures: list[str] = []
    progress = SimpleNamespace(current_step=0, generation=0, stage="step", committed=-1)
    control = SimpleNamespace(abandon=threading.Event(), io_aborted_beyond=lambda generation: False,
                              board=StepBoard(progress))
    checks = SimpleNamespace(check_local_gradient=lambda fp: True, holds_for_check=lambda: False,
                             record_provisional=lambda: None, record_gradient=lambda: None)
    sync = GradientSync(world, 30.0, WorkerState(managed=True), progress, SimpleNamespace(cut=lambda: None), control,
                        checks, send=lambda *a, **k: None, record_error=failures.append,
                        repair_in_place=lambda error, drop: failures.append(error), is_recoverable=lambda err: False,
                        transaction=StepTransaction(lambda: [], lambda optimizer: None))
    sync.failures = failures  # type: ignore[attr-defined]
    return sync


def same(a: nn.Module, b: nn.Module, what: str) -> None:
    for (name, x), (_, y) in zip(a.named_parameters(), b.named_parameters()):
        assert torch.equal(x, y), f"{case}: {what}: parameter {name} differs by {(x - y).abs().max().item():.3g}"
        gx, gy = x.grad, y.grad
        assert (gx is None) == (gy is None), f"{case}: {what}: grad of {name}: DDP {gx is None and 'None'} vs ftrun {gy is None and 'None'}"
        if gx is not None:
            assert torch.equal(gx, gy), f"{case}: {what}: grad of {name} differs by {(gx - gy).abs().max().item():.3g}"
    for (name, x), (_, y) in zip(a.named_buffers(), b.named_buffers()):
        assert torch.equal(x, y), f"{case}: {what}: buffer {name} differs"


def run(case: str) -> int:
    global step
    build, kwargs = CASES[case]
    torch.manual_seed(1234 + rank)  # replicas start apart: both sides must broadcast rank 0's weights
    base = build()
    theirs = DistributedDataParallel(copy.deepcopy(base), **kwargs)
    mine_module = copy.deepcopy(base)
    sync = ftrun_sync()
    with torch.no_grad():  # ft.wrap_model's initial broadcast
        sync.broadcast_initial(mine_module)
    step = 0
    mine = sync.wrap(mine_module, torch.device("cpu"), True, dict(kwargs), check_gradients=False, is_first_step=lambda: step == 0)
    opt_theirs = torch.optim.SGD(theirs.parameters(), lr=0.5, momentum=0.9)
    opt_mine = torch.optim.SGD(mine.parameters(), lr=0.5, momentum=0.9)
    gen = torch.Generator().manual_seed(77 + rank)  # each rank its own data
    for step in range(8):
        x = torch.randint(0, 50, (6, 4), generator=gen)
        y = torch.randint(0, 50, (6, 4), generator=gen)
        for model, opt in ((theirs, opt_theirs), (mine, opt_mine)):
            opt.zero_grad()
            accumulate = step % 4 == 3  # a gradient accumulation of 2 now and then
            if case in TWO_PASSES:  # a first synced backward, then the step's own (the gradients add up)
                nn.functional.cross_entropy(model(x[:3]).flatten(0, 1), y[:3].flatten()).backward()
            elif accumulate:
                with model.no_sync():
                    nn.functional.cross_entropy(model(x[:3]).flatten(0, 1), y[:3].flatten()).backward()
            nn.functional.cross_entropy(model(x if not accumulate else x[3:]).flatten(0, 1),
                                        (y if not accumulate else y[3:]).flatten()).backward()
        same(theirs.module, mine.module, f"after backward {step}")
        opt_theirs.step()
        opt_mine.step()
        same(theirs.module, mine.module, f"after step {step}")
        with torch.no_grad():  # an evaluation forward between steps (DDP's buffer rule)
            theirs(x)
            mine(x)
        same(theirs.module, mine.module, f"after evaluation {step}")
    assert not sync.failures, sync.failures  # type: ignore[attr-defined]
    return step + 1


for case in cases:
    print(f"ok {case} {run(case)}", flush=True)
dist.destroy_process_group()
