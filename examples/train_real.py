"""A training loop as people write it, under ftrun, recoverable rank by rank.

    ftrun --worker_num 2 examples/train_real.py --epochs 3

train_real_torchrun.py (DDP; a DistributedSampler with set_epoch feeding torchdata's
StatefulDataLoader; gradient accumulation over micro-batches with ``no_sync()``;
``clip_grad_norm_``; AdamW with a OneCycleLR schedule stepped every step; an evaluation every
``--eval_every`` steps, slowed by ``--eval_pause``) ported to the worker library: the 12 lines that
changed say ``# ftrun``, two more are indented under ``ft.section``, and four lines of the twin
went (two imports, its step counter). A run with faults ends with the parameters of the run
without, and of the torchrun twin, bitwise (``ddp=True`` keeps DDP's own buckets, averaged over
ftrun's group). The evaluation runs in an ``ft.section``, so a slow one is not taken for a hung
step. Data and model: real_common.py. Rank 0 prints ``final step=<n> loss=<x> test_accuracy=<y> params_sha256=<digest>``.
"""
import argparse
import contextlib
import os
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data.distributed import DistributedSampler
from torchdata.stateful_dataloader import StatefulDataLoader

sys.path.insert(0, str(Path(__file__).resolve().parent))
import real_common as rc  # noqa: E402

import ftrun  # ftrun


def parse_args():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch_size", type=int, default=64, help="samples per rank and optimizer step")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=3e-3, help="OneCycleLR's peak learning rate")
    parser.add_argument("--clip", type=float, default=1.0, help="gradient norm clipping threshold")
    parser.add_argument("--eval_every", type=int, default=10, help="evaluate every N steps")
    parser.add_argument("--eval_pause", type=float, default=0.0, help="extra seconds each evaluation takes")
    parser.add_argument("--log_every", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    return parser.parse_args()


def train_step(model, x, y, accum, clip):
    """Forward and backward over ``accum`` micro-batches (averaged once, on the last), then clip."""
    total = 0.0
    for i, (mx, my) in enumerate(zip(x.chunk(accum), y.chunk(accum))):
        with model.no_sync() if i < accum - 1 else contextlib.nullcontext():
            loss = F.cross_entropy(model(mx), my) / accum
            loss.backward()
        total += loss.item()
    torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    return total


def main():
    args = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    ft = ftrun.init(backend="gloo")  # ftrun
    rank, world = ft.rank, ft.world_size  # ftrun
    torch.manual_seed(args.seed)
    train, val = rc.datasets(args.seed)
    sampler = DistributedSampler(train, num_replicas=world, rank=rank, seed=args.seed, drop_last=True)
    loader = StatefulDataLoader(train, batch_size=args.batch_size, sampler=sampler, drop_last=True)
    model = ft.wrap_model(rc.Net(), ddp=True)  # ftrun: a DDP whose buckets are averaged over ftrun's group
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01))  # ftrun
    sched = ft.register("scheduler", torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=args.lr, total_steps=args.epochs * len(loader)))  # ftrun

    for epoch in ft.epochs(0, args.epochs):  # ftrun: a respawned rank starts in its replicas' epoch
        sampler.set_epoch(epoch)
        for step, (x, y) in ft.batches(loader):  # ftrun: the global step; a retried step gets its batch again
            opt.zero_grad(set_to_none=True)
            loss = train_step(model, x, y, args.accum, args.clip)
            if not opt.step():  # ftrun: the update failed (a peer died): the step is retried
                continue  # ftrun
            sched.step()
            if rank == 0 and step % args.log_every == 0:
                print(f"epoch {epoch} step {step} loss {loss:.4f} lr {sched.get_last_lr()[0]:.2e}", flush=True)
            if (step + 1) % args.eval_every == 0:
                with ft.section("eval"):  # ftrun: not bounded by the step watchdog
                    val_loss, acc = rc.evaluate(model, val)
                    time.sleep(args.eval_pause)
                if rank == 0:
                    print(f"step {step} validation loss {val_loss:.4f} accuracy {acc:.4f}", flush=True)

    _, acc = rc.evaluate(model, val)
    if rank == 0:
        print(rc.final_line(args.epochs * len(loader), loss, acc, model.module), flush=True)
    ft.finish()  # ftrun


if __name__ == "__main__":
    main()
