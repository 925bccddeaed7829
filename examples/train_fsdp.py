"""FSDP2/HSDP (and tensor-parallel) training of a small GPT under ftrun, recoverable rank by rank (ARF).

    ftrun --worker_num 4 examples/train_fsdp.py --mesh 2,2
    FTRUN_FAULT='rank=3,step=5,point=before_forward,kind=kill' ftrun --worker_num 4 examples/train_fsdp.py --mesh 2,2

The twin of ``train_fsdp_torchrun.py`` (same arguments, same batches: ``fsdp_common``). The mesh is
declared to ftrun at ``ftrun.init``, so ftrun knows each rank's replicas (in HSDP 2x2, ranks 0 and 2
hold shard 0, ranks 1 and 3 shard 1) and builds the mesh's groups again after a fault; a respawned
rank receives its shards and AdamW state from its replica. The step's body runs under ``with step:``:
FSDP's collectives run inside forward and backward, and a failed one is recorded there instead of
ending the rank. Rank 0 prints ``final step=<n> loss=<x> params_sha256=<digest>`` over the full
parameters (``full_tensor()``).

It also runs under plain torchrun (without recovery).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch

import ftrun

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import fsdp_common as fc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = fc.add_common_args(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    shape, names = fc.mesh_of(args)
    ft = ftrun.init(backend="gloo", seed=args.seed, mesh_shape=shape, mesh_dim_names=names)
    mesh = ft.device_mesh()
    torch.manual_seed(args.seed)
    model = ft.wrap_model(fc.shard(fc.build_model(args), mesh, args.tp))
    opt = ft.wrap_optimizer(fc.optimizer(model, args.lr))
    dp_rank, dp_size = fc.dp_coordinates(ft.rank, ft.world_size, args.tp)

    loss = torch.tensor(float("nan"))
    for step in ft.steps(args.steps):
        with step:  # a collective that fails inside forward or backward is recorded; the step is retried
            x, y = fc.batch(args.seed, step, dp_rank, dp_size, args.batch_size, args.context)
            opt.zero_grad(set_to_none=True)
            loss = fc.loss_of(model, x, y)
            loss.backward()
            opt.step()
        ft.report(step, loss=loss.item())
        if args.log_every and ft.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)

    digest = fc.full_params_sha256(model)  # a collective: every rank
    if ft.rank == 0:
        print(fc.final_line(args.steps, loss.item(), digest), flush=True)
    ft.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
