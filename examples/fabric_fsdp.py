"""A Lightning Fabric loop over an FSDP2 (HSDP 2x2) model, ported to ftrun.

    torchrun --nproc_per_node 4 examples/fabric_fsdp.py    # plain torchrun: no recovery
    ftrun --worker_num 4 examples/fabric_fsdp.py           # recovered rank by rank

The shape of Lightning's own FSDP2 / tensor-parallel examples for Fabric (``ModelParallelStrategy``
with a ``parallelize_fn(model, device_mesh)`` applying ``fully_shard``; ``fabric.launch()``;
``fabric.setup(model)`` then the optimizer made from the sharded parameters and
``fabric.setup_optimizers``; a ``DataLoader`` through ``fabric.setup_dataloaders``; forward,
``fabric.backward``, ``fabric.clip_gradients``, ``optimizer.step()``, ``optimizer.zero_grad()``),
on a small GPT (``fsdp_common.GPT``) learning affine token sequences. ``parallelize`` shards each
block and the root over the whole 2-D mesh: HSDP, replicated over its first dimension and sharded
over its second.

The port (docs/frameworks/fabric.md, "FSDP2 and HSDP"): the lines marked ``# ftrun``. The mesh is
declared at ``ftrun.init`` (``("replicate", "shard")``, 2 x 2) and ``FTFabric`` hands it to
``parallelize``; the loader is iterated through ``fabric.train_batches`` inside ``ft.epochs``.
Rank 0 prints ``final step=<n> loss=<x> params_sha256=<digest>`` over the full parameters
(``full_tensor()``).
"""
import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from lightning.fabric.strategies import ModelParallelStrategy
from torch.distributed.fsdp import fully_shard
from torch.utils.data import DataLoader, TensorDataset

import ftrun  # ftrun
from ftrun.integrations.fabric import FTFabric  # ftrun: was lightning.fabric.Fabric

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import fsdp_common as fc  # noqa: E402


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--train_size", type=int, default=64, help="sequences in the training set")
    parser.add_argument("--batch_size", type=int, default=2, help="sequences per rank and step")
    parser.add_argument("--context", type=int, default=16)
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause_at", type=int, default=-1,
                        help="rank 0 prints 'pause step=<n>' and sleeps --pause seconds after optimizer step n")
    parser.add_argument("--pause", type=float, default=2.0)
    return parser.parse_args(argv)


def dataset(n: int, context: int, seed: int) -> TensorDataset:
    """``n`` sequences ``x[t+1] = (a x[t] + b) mod VOCAB`` of ``context + 1`` tokens (int64),
    deterministic in ``seed``: inputs are the first ``context``, targets the last."""
    g = torch.Generator().manual_seed(seed)
    a = torch.randint(1, fc.VOCAB, (n, 1), generator=g) | 1
    b = torch.randint(0, fc.VOCAB, (n, 1), generator=g)
    seqs = [torch.randint(0, fc.VOCAB, (n, 1), generator=g)]
    for _ in range(context):
        seqs.append((a * seqs[-1] + b) % fc.VOCAB)
    tokens = torch.cat(seqs, dim=1)
    return TensorDataset(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous())


def parallelize(model: fc.GPT, device_mesh) -> fc.GPT:
    """FSDP2 over ``device_mesh``: each block, then the root (HSDP on a 2-D mesh)."""
    for block in model.blocks:
        fully_shard(block, mesh=device_mesh)
    fully_shard(model, mesh=device_mesh)
    return model


def main(args: argparse.Namespace) -> None:
    ft = ftrun.init(mesh_shape=(2, 2), mesh_dim_names=("replicate", "shard"))  # ftrun: the mesh, before Fabric
    strategy = ModelParallelStrategy(parallelize_fn=parallelize, data_parallel_size=2, tensor_parallel_size=2)
    fabric = FTFabric(accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), strategy=strategy)
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)  # every rank builds the same full model
    model = fc.GPT(args.d_model, args.layers, args.heads, args.context)
    model = fabric.setup(model)  # parallelize(model, mesh): the sharded model
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    optimizer = fabric.setup_optimizers(optimizer)
    train_loader = fabric.setup_dataloaders(
        DataLoader(dataset(args.train_size, args.context, 1), batch_size=args.batch_size, shuffle=True))

    step = 0
    loss = torch.tensor(float("nan"))
    for epoch in ft.epochs(0, args.epochs):  # ftrun: was range(args.epochs)
        for x, y in fabric.train_batches(train_loader):  # ftrun: was train_loader
            loss = F.cross_entropy(model(x), y.reshape(-1))
            fabric.backward(loss)
            fabric.clip_gradients(model, optimizer, max_norm=args.clip)
            optimizer.step()
            optimizer.zero_grad()
            step = fabric.completed_steps  # ftrun: was += 1
            if fabric.is_global_zero and step == args.pause_at:
                print(f"pause step={step}", flush=True)
                time.sleep(args.pause)
        if fabric.is_global_zero:
            print(f"epoch {epoch} step {step} loss {loss.item():.6f}", flush=True)

    digest = fc.full_params_sha256(model)  # full_tensor(): a collective, every rank
    if fabric.is_global_zero:
        print(fc.final_line(step, loss.item(), digest), flush=True)
    ft.finish()  # ftrun


if __name__ == "__main__":
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    main(parse_args())
