"""Microbenchmark of a rank's records: the per-step cost of the step-start copy and record
and of the provisional record, for a registry like examples/word_lm.py's (RNG streams, the carried
LSTM state at its default size, a data position, a replica object), with an in-memory store.

    .venv/bin/python scripts/bench_records.py                         # this tree
    PYTHONPATH=/path/to/older/tree .venv/bin/python scripts/bench_records.py   # an older tree (before the records took bytes)

Mirrors ExactlyOnceChecks: step start (the copy for roll_back and the record, left out when equal to
the provisional one), the batch and forward, then the provisional record. Figures in microseconds,
the best of 7 repeats of 2,000."""
import inspect
import timeit

import torch
from ftrun.rank.registry import StateRegistry
from ftrun.rank.transfer import RNGState
from ftrun.rank.rankstate import RankStateStore
from ftrun.common.checkpoint import snapshot
from ftrun.common import codec

torch.set_num_threads(1)
NEW = "encode_rank" in inspect.signature(StateRegistry.snapshot_step_start).parameters

class FakeStore:
    def __init__(self): self.d = {}
    def set(self, k, v): self.d[k] = v
    def get(self, k): return self.d[k]
    def check(self, ks): return all(k in self.d for k in ks)

class Hidden:  # word_lm's carried LSTM state at its defaults (2 layers, batch 20, 200 hidden)
    def __init__(self): self.h = (torch.randn(2, 20, 200), torch.randn(2, 20, 200))
    def state_dict(self): return {"h": self.h[0], "c": self.h[1]}
    def load_state_dict(self, s): self.h = (s["h"].clone(), s["c"].clone())

class Cursor:
    def __init__(self): self.epoch, self.position = 1, 0
    def state_dict(self): return {"epoch": int(self.epoch), "position": int(self.position)}
    def load_state_dict(self, s): self.epoch, self.position = s["epoch"], s["position"]

class Annealing:
    def state_dict(self): return {"lr": 20.0, "best_val_loss": -1.0}
    def load_state_dict(self, s): pass

reg = StateRegistry()
reg.register("rng", RNGState(), kind="rank")
reg.register("hidden", Hidden(), kind="rank")
reg.register("annealing", Annealing())
reg.register("data", Cursor(), kind="rank")
rs = RankStateStore(FakeStore(), 0, 0)
step = [1]

def step_start():
    s = step[0]
    if NEW:
        rs.put_encoded(s - 1, reg.snapshot_step_start(s - 1, encode_rank=True), mid_pass=True)
    else:
        rs.put(s - 1, reg.snapshot_step_start(s - 1), mid_pass=True)

def provisional():
    s = step[0]
    if NEW:
        rs.put(s, reg.state_dict(only=("rank",)), provisional=True)
    else:
        rs.put(s, snapshot(reg.state_dict(only=("rank",))), provisional=True)

def forward():  # the batch and forward: RNG moves, hidden replaced, cursor moves
    torch.rand(1)
    reg["data"].position += 1
    h = reg["hidden"]; h.h = (h.h[0] + 0, h.h[1] + 0)

def one_step():
    step_start(); forward(); provisional(); step[0] += 1



def best(fn) -> float:
    """Microseconds a call, the best of 7 repeats of 2,000 calls."""
    return min(timeit.repeat(fn, number=2000, repeat=7)) / 2000 * 1e6


for _ in range(200):
    one_step()
provisional_us, step_start_us = best(provisional), best(step_start)
print(f"{'this tree' if NEW else 'a tree before the records took bytes'}: both records of a step {provisional_us + step_start_us:.1f} us")
print(f"  provisional record: {provisional_us:.1f} us")
print(f"  step-start copy and record (the record left out: equal to the provisional one): {step_start_us:.1f} us")
print(f"  RNGState.state_dict: {best(reg['rng'].state_dict):.1f} us")
state = reg.state_dict(only=("rank",))
print(f"  codec.to_bytes(rank state): {best(lambda: codec.to_bytes(state)):.1f} us")
if hasattr(codec, "to_record"):
    print(f"  codec.to_record(rank state), what the records use: {best(lambda: codec.to_record(state)):.1f} us")
print(f"  put_gradient_digest: {best(lambda: rs.put_gradient_digest(5, 'ab' * 16)):.1f} us")
