"""Plain torchrun-style DDP training on sklearn digits (or MNIST); knows nothing about ftrun.

    torchrun --nproc_per_node 4 examples/train_digits_torchrun.py
    python examples/train_digits_torchrun.py          # single process, no process group

Rank 0 prints ``final step=... loss=... test_accuracy=... params_sha256=...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
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
    parser = dc.add_common_args(argparse.ArgumentParser(description=__doc__))
    parser.add_argument("--log_every", type=int, default=0, help="print the loss every N steps (0: never)")
    parser.add_argument("--ckpt_dir", default=None, help="checkpoint directory: resume from it, save to it")
    parser.add_argument("--ckpt_every", type=int, default=10, help="save a checkpoint every N steps")
    args = parser.parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)

    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
        rank, world_size = dist.get_rank(), dist.get_world_size()
    else:
        rank, world_size = 0, 1

    try:
        ds = dc.on_device(dc.load_dataset(args.data, args.seed), args.device)
        torch.manual_seed(args.seed)
        model = dc.build_model(ds.in_features).to(args.device)
        ddp_model: torch.nn.Module = DistributedDataParallel(model) if distributed else model
        opt = torch.optim.SGD(ddp_model.parameters(), lr=args.lr, momentum=args.momentum)
        n_train = len(ds.train_y)

        start = 0
        ckpt = Path(args.ckpt_dir) / "ckpt.pt" if args.ckpt_dir else None
        if ckpt is not None and ckpt.exists():  # torchrun's recipe: reload the last checkpoint
            state = torch.load(ckpt, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"]) + 1

        loss = torch.tensor(float("nan"))
        for step in range(start, args.steps):
            idx = dc.batch_indices(args.seed, step, rank, world_size, args.batch_size, n_train)
            opt.zero_grad(set_to_none=True)
            loss = F.cross_entropy(ddp_model(ds.train_x[idx]), ds.train_y[idx])
            loss.backward()  # DDP averages gradients across ranks here
            opt.step()
            if args.log_every and rank == 0 and step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)
            if ckpt is not None and rank == 0 and step % args.ckpt_every == args.ckpt_every - 1:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt)

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
