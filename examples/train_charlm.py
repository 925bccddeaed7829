"""Data-parallel training of a GPT-style byte language model under ftrun, recoverable rank by rank (ARF).

    ftrun --worker_num 4 examples/train_charlm.py --size small
    FTRUN_FAULT='rank=1,step=50,point=allreduce,kind=kill' ftrun --worker_num 2 examples/train_charlm.py

The model (``charlm_common``: token and position embeddings, pre-norm blocks with causal
``scaled_dot_product_attention``, AdamW) learns to predict the next byte of the Python standard
library's own sources, so it needs nothing downloaded. ``--size`` runs from ``tiny`` (about 1 MB of
parameters + AdamW state) to ``xl`` (about 1 GB); rank 0 prints the state size at start. The batch
a rank sees is a function of (seed, step, rank), so a run with faults ends with parameters bitwise
equal to a run without. Rank 0 prints ``step N loss L time T`` every ``--log_every`` steps and
finally ``final step=<n> loss=<x> test_accuracy=<y> params_sha256=<digest>``, where test_accuracy
is the next-byte accuracy on held-out text and loss the final model's loss on the last step's
global batch.

It also runs under plain torchrun, or alone (one process), without recovery.
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
import charlm_common as cc  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    args = cc.add_common_args(argparse.ArgumentParser(description=__doc__)).parse_args(argv)
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    ft = ftrun.init(backend="gloo", seed=args.seed, device=args.device)
    corpus = cc.load_corpus(args.corpus_bytes)
    torch.manual_seed(args.seed)
    model = ft.wrap_model(cc.build_model(args.size, args.context))  # on ft.device
    opt = ft.wrap_optimizer(torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=args.weight_decay))
    describe = (f"charlm size={args.size} params={sum(p.numel() for p in model.parameters())} "
                f"state_mb={cc.state_bytes(model) / 1e6:.1f} world_size={ft.world_size} corpus_files={corpus.files}")
    # Nothing before the loop depends on the rank, so a hot spare is ready past all of the above
    # (docs/hot_spares.md): rank 0 prints the description at its first step.

    for step in ft.steps(args.steps):
        if describe and ft.rank == 0:
            print(describe, flush=True)
        describe = ""
        x, y = cc.batch(corpus.train, args.seed, step, ft.rank, ft.world_size, args.batch_size, args.context)
        opt.zero_grad(set_to_none=True)
        loss = cc.loss_of(model, x, y)
        loss.backward()
        if not opt.step():  # averages gradients over the ranks; updates only if that succeeded
            continue  # the step failed (a peer died): ft.steps() recovers and retries it
        ft.report(step, loss=loss.item())
        if args.log_every and ft.rank == 0 and step % args.log_every == 0:
            print(f"step {step} loss {loss.item():.4f} time {time.time():.3f}", flush=True)

    if ft.rank == 0:
        with torch.no_grad():
            parts = [cc.batch(corpus.train, args.seed, args.steps - 1, r, ft.world_size, args.batch_size, args.context)
                     for r in range(ft.world_size)]
            final_loss = cc.loss_of(model, torch.cat([p[0] for p in parts]), torch.cat([p[1] for p in parts])).item()
        acc = cc.evaluate(model, corpus.held_out, args.context, args.eval_windows)
        print(cc.final_line(args.steps, final_loss, acc, cc.params_sha256(model)), flush=True)
    ft.finish()
    return 0


if __name__ == "__main__":
    sys.exit(main())
