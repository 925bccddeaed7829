"""Plain torchrun-style DDP training of the byte language model; knows nothing about ftrun.

    torchrun --nproc_per_node 4 examples/train_charlm_torchrun.py --size small
    python examples/train_charlm_torchrun.py          # single process, no process group

The twin of ``train_charlm.py`` (same model, corpus and batches; gradients averaged by DDP), used
as the torchrun baseline by ``scripts/bench.py``. With ``--ckpt_dir`` rank 0 saves the model and
optimizer every ``--ckpt_every`` steps and every rank resumes from the file when it exists:
torchrun's recovery recipe. Rank 0 prints ``final step=... loss=... test_accuracy=... params_sha256=...``.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import charlm_common as cc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    parser = cc.add_common_args(argparse.ArgumentParser(description=__doc__))
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
        corpus = cc.load_corpus(args.corpus_bytes)
        torch.manual_seed(args.seed)
        model = cc.build_model(args.size, args.context).to(args.device)
        ddp_model: torch.nn.Module = DistributedDataParallel(model) if distributed else model
        opt = torch.optim.AdamW(ddp_model.parameters(), lr=args.lr, weight_decay=args.weight_decay)
        if rank == 0:
            n_params = sum(p.numel() for p in model.parameters())
            print(f"charlm size={args.size} params={n_params} state_mb={cc.state_bytes(model) / 1e6:.1f} "
                  f"world_size={world_size} corpus_files={corpus.files}", flush=True)

        start = 0
        ckpt = Path(args.ckpt_dir) / "ckpt.pt" if args.ckpt_dir else None
        if ckpt is not None and ckpt.exists():  # torchrun's recipe: reload the last checkpoint
            state = torch.load(ckpt, weights_only=True)
            model.load_state_dict(state["model"])
            opt.load_state_dict(state["optimizer"])
            start = int(state["step"]) + 1

        for step in range(start, args.steps):
            x, y = cc.batch(corpus.train, args.seed, step, rank, world_size, args.batch_size, args.context)
            opt.zero_grad(set_to_none=True)
            loss = cc.loss_of(ddp_model, x, y)
            loss.backward()  # DDP averages gradients across ranks here
            opt.step()
            if args.log_every and rank == 0 and step % args.log_every == 0:
                print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)
            if ckpt is not None and rank == 0 and step % args.ckpt_every == args.ckpt_every - 1:
                ckpt.parent.mkdir(parents=True, exist_ok=True)
                tmp = ckpt.with_suffix(".tmp")
                torch.save({"model": model.state_dict(), "optimizer": opt.state_dict(), "step": step}, tmp)
                os.replace(tmp, ckpt)

        if rank == 0:
            with torch.no_grad():
                parts = [cc.batch(corpus.train, args.seed, args.steps - 1, r, world_size, args.batch_size, args.context)
                         for r in range(world_size)]
                final_loss = cc.loss_of(model, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).item()
            acc = cc.evaluate(model, corpus.held_out, args.context, args.eval_windows)
            print(cc.final_line(args.steps, final_loss, acc, cc.params_sha256(model)), flush=True)
    finally:
        if distributed:
            dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
