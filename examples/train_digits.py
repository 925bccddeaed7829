"""Data-parallel training of the digits MLP under ftrun, recoverable rank by rank (ARF).

    ftrun --worker_num 4 examples/train_digits.py
    FTRUN_FAULT='rank=2,step=100,point=allreduce,kind=kill' ftrun --worker_num 4 examples/train_digits.py

The model is the MLP of MindSpore's UCE example (flatten, 64->512, ReLU, 512->512, ReLU, 512->10,
SGD) on scikit-learn's handwritten digits (1,797 8x8 images, 20% held out), or MNIST with
``--data mnist:DIR``. The batch a rank sees is a function of (seed, step, rank), so a run with
faults ends with parameters bitwise equal to a run without. Rank 0 prints
``final step=<n> loss=<x> test_accuracy=<y> params_sha256=<digest>``, where loss is the final
model's loss on the last step's global batch.

It also runs under plain torchrun, or alone (one process), without recovery.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

import ftrun

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import digits_common as dc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = dc.add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--log_every", type=int, default=50, help="print the loss every N steps (0: never)")
    parser.add_argument("--ddp", action="store_true", help="train through DistributedDataParallel (same result)")
    parser.add_argument("--step_pause", type=float, default=0.0,
                        help="sleep this many seconds after each step: stretches a demo or a test job (same result)")
    parser.add_argument("--pause_while", default=None, metavar="FILE",
                        help="sleep --step_pause only while FILE exists (a test stretches the job while it "
                             "injects faults, then removes FILE and lets the job finish at full speed)")
    parser.add_argument("--hand_update", action="store_true",
                        help="update the parameters by hand (p -= lr * grad, plain SGD: needs --momentum 0) under "
                             "ft.apply_update, as a script without a torch optimizer does (same result as SGD)")
    parser.add_argument("--replica_groups", default=None,
                        help="declare replica groups, e.g. '0,2;1,3' (a DP x TP layout's shape; default: all ranks)")
    args = parser.parse_args(argv)
    if args.hand_update and args.momentum:
        parser.error("--hand_update is plain SGD: give --momentum 0")
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    groups = [[int(r) for r in g.split(",")] for g in args.replica_groups.split(";")] if args.replica_groups else None
    ft = ftrun.init(backend="gloo", seed=args.seed, replica_groups=groups, device=args.device)
    ds = dc.on_device(dc.load_dataset(args.data, args.seed), ft.device)
    torch.manual_seed(args.seed)
    model = ft.wrap_model(dc.build_model(ds.in_features), ddp=args.ddp)
    opt = None if args.hand_update else ft.wrap_optimizer(torch.optim.SGD(model.parameters(), lr=args.lr, momentum=args.momentum))
    n_train = len(ds.train_y)

    def sgd() -> None:  # the update a script without a torch optimizer writes
        with torch.no_grad():
            for p in model.parameters():
                p.add_(p.grad, alpha=-args.lr)

    for step in ft.steps(args.steps):
        with step:  # a RecoverableError raised in here is repaired in place (UCE)
            idx = dc.batch_indices(args.seed, step, ft.rank, ft.world_size, args.batch_size, n_train)
            model.zero_grad(set_to_none=True)
            loss = F.cross_entropy(model(ds.train_x[idx]), ds.train_y[idx])
            loss.backward()  # averages gradients over the ranks (a failure is recorded, not raised)
            # The update runs only if the step's collectives succeeded: opt.step() for a wrapped
            # optimizer, ft.apply_update(fn) for hand-written code; both commit the step.
            applied = ft.apply_update(sgd)[0] if opt is None else opt.step()
            if not applied:
                continue  # the step failed (a peer died): ft.steps() recovers and retries it
            ft.report(step, loss=loss.item())
            if args.log_every and ft.rank == 0 and step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)
            if args.step_pause and (args.pause_while is None or os.path.exists(args.pause_while)):
                time.sleep(args.step_pause)

    if ft.rank == 0:
        with torch.no_grad():
            last = torch.cat([
                dc.batch_indices(args.seed, args.steps - 1, r, ft.world_size, args.batch_size, n_train)
                for r in range(ft.world_size)
            ])
            final_loss = F.cross_entropy(model(ds.train_x[last]), ds.train_y[last]).item()
        acc = dc.evaluate(model, ds)
        print(dc.final_line(args.steps, final_loss, acc, dc.params_sha256(model)), flush=True)
    ft.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
