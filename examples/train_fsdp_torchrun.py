"""Plain torchrun FSDP2/HSDP (and tensor-parallel) training of a small GPT; knows nothing about ftrun.

    torchrun --nproc_per_node 4 examples/train_fsdp_torchrun.py --mesh 2,2
    torchrun --nproc_per_node 4 examples/train_fsdp_torchrun.py --mesh 1,2 --tp 2

The twin of ``train_fsdp.py`` (same arguments, same batches: ``fsdp_common``). Rank 0 prints
``final step=<n> loss=<x> params_sha256=<digest>`` over the full parameters (``full_tensor()``).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import fsdp_common as fc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = fc.add_common_args(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    shape, names = fc.mesh_of(args)
    dist.init_process_group("gloo")  # env:// rendezvous from torchrun's variables
    rank, world_size = dist.get_rank(), dist.get_world_size()
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    torch.manual_seed(args.seed)
    model = fc.shard(fc.build_model(args), mesh, args.tp)
    opt = fc.optimizer(model, args.lr)
    dp_rank, dp_size = fc.dp_coordinates(rank, world_size, args.tp)

    loss = torch.tensor(float("nan"))
    for step in range(args.steps):
        x, y = fc.batch(args.seed, step, dp_rank, dp_size, args.batch_size, args.context)
        opt.zero_grad(set_to_none=True)
        loss = fc.loss_of(model, x, y)
        loss.backward()  # FSDP reduce-scatters (and, over replicas, all-reduces) the gradients here
        opt.step()
        if args.log_every and rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)

    digest = fc.full_params_sha256(model)  # a collective: every rank
    if rank == 0:
        print(fc.final_line(args.steps, loss.item(), digest), flush=True)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
