"""Plain torchrun-style DDP training on sklearn digits (or MNIST); knows nothing about ftrun.

    torchrun --nproc_per_node 4 examples/train_digits_torchrun.py
    python examples/train_digits_torchrun.py          # single process, no process group

Rank 0 prints ``final step=... loss=... test_accuracy=... params_sha256=...``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:  # already there when run as a script; needed for `python -m` / imports
    sys.path.insert(0, _HERE)
import digits_common as dc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = dc.add_common_args(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1

    try:
        ds = dc.load_dataset(args.data, args.seed)
        torch.manual_seed(args.seed)
        model = dc.build_model(ds.in_features)
        ddp_model: torch.nn.Module = DistributedDataParallel(model) if distributed else model
        opt = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=args.momentum)
        n_train = len(ds.train_y)

        loss = torch.tensor(float("nan"))
        for step in range(args.steps):
            idx = dc.batch_indices(args.seed, step, rank, world_size, args.batch_size, n_train)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp_model(ds.train_x[idx]), ds.train_y[idx])
            loss.backward()  # DDP averages gradients across ranks here
            opt.step()

        # Report the last step's loss averaged over ranks (= loss of the global batch).
        final_loss = loss.detach().clone()
        if distributed:
            dist.all_reduce(final_loss)
            final_loss /= world_size
        if rank == 0:
            acc = dc.evaluate(model, ds)
            print(dc.final_line(args.steps, final_loss.item(), acc, dc.params_sha256(model)), flush=True)
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
