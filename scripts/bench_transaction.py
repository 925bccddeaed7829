"""What a step's undo state costs: a GAN step (pytorch/examples' DCGAN nets, Adam for each) with
ftrun's step transaction against the same step without it, in one process, pair by pair.

With two optimizers, the first update of a step (the discriminator's) may not be the step's last
change, so ftrun keeps an undo copy of what it changes (its parameters and Adam's two moments)
until the step commits (:mod:`ftrun.rank.transaction`); the generator's update, the last, keeps none.
With one optimizer nothing is copied. Prints, as JSON: the bytes held by the undo copy, the
model's parameter bytes, and the step time with and without the transaction (medians over
interleaved rounds, and their ratio).

    .venv/bin/python scripts/bench_transaction.py --ngf 64 --ndf 64 --batch 16 --rounds 5 --steps 10
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from ftrun.rank.registry import StateRegistry  # noqa: E402
from ftrun.rank.transaction import ModuleBuffers  # noqa: E402


def nets(nz: int, ngf: int, ndf: int, nc: int = 3) -> tuple[nn.Module, nn.Module]:
    """DCGAN's generator and discriminator for 64x64 images (pytorch/examples' dcgan/main.py)."""
    g = nn.Sequential(
        nn.ConvTranspose2d(nz, ngf * 8, 4, 1, 0, bias=False), nn.BatchNorm2d(ngf * 8), nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 8, ngf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 4), nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 4, ngf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf * 2), nn.ReLU(True),
        nn.ConvTranspose2d(ngf * 2, ngf, 4, 2, 1, bias=False), nn.BatchNorm2d(ngf), nn.ReLU(True),
        nn.ConvTranspose2d(ngf, nc, 4, 2, 1, bias=False), nn.Tanh())
    d = nn.Sequential(
        nn.Conv2d(nc, ndf, 4, 2, 1, bias=False), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(ndf, ndf * 2, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 2), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(ndf * 2, ndf * 4, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 4), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(ndf * 4, ndf * 8, 4, 2, 1, bias=False), nn.BatchNorm2d(ndf * 8), nn.LeakyReLU(0.2, inplace=True),
        nn.Conv2d(ndf * 8, 1, 4, 1, 0, bias=False), nn.Sigmoid())
    return g, d


def run(args: argparse.Namespace, transaction: bool) -> tuple[float, int]:
    """Median step time (s) of ``args.steps`` GAN steps, and the undo copy's bytes."""
    torch.manual_seed(0)
    g, d = nets(args.nz, args.ngf, args.ndf)
    opt_g = torch.optim.Adam(g.parameters(), lr=2e-4, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(d.parameters(), lr=2e-4, betas=(0.5, 0.999))
    registry = StateRegistry()
    for name, obj in (("netG", g), ("netD", d), ("optimizerG", opt_g), ("optimizerD", opt_d)):
        registry.register(name, obj, kind="committed")
    registry.register("netG.buffers", ModuleBuffers(g), kind="rank")
    registry.register("netD.buffers", ModuleBuffers(d), kind="rank")
    tx = registry.transaction
    criterion = nn.BCELoss()
    real = torch.rand(args.batch, 3, 64, 64) * 2 - 1
    held = 0
    times = []
    for step in range(args.steps + 2):
        started = time.perf_counter()
        if transaction:
            registry.snapshot_step_start(step - 1)
        d.zero_grad()
        out = d(real).view(-1)
        criterion(out, torch.ones_like(out)).backward()
        fake = g(torch.randn(args.batch, args.nz, 1, 1))
        out = d(fake.detach()).view(-1)
        criterion(out, torch.zeros_like(out)).backward()
        for opt, model in ((opt_d, d), (opt_g, g)):
            if model is g:
                g.zero_grad()
                out = d(fake).view(-1)
                criterion(out, torch.ones_like(out)).backward()
            if transaction:
                tx.before_update(opt, closure=False)
            opt.step()
            if transaction:
                held = max(held, tx.undo_bytes())
                tx.after_update(True)
        if transaction:
            tx.end()
        if step >= 2:  # Adam's state exists from the second step on
            times.append(time.perf_counter() - started)
    return statistics.median(times), held


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nz", type=int, default=100)
    parser.add_argument("--ngf", type=int, default=64)
    parser.add_argument("--ndf", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=5, help="interleaved pairs (with, without)")
    args = parser.parse_args()
    torch.set_num_threads(1)
    pairs = []
    held = 0
    for _ in range(args.rounds):
        with_tx, held = run(args, True)
        without, _ = run(args, False)
        pairs.append((with_tx, without))
    g, d = nets(args.nz, args.ngf, args.ndf)
    ratios = [a / b for a, b in pairs]
    print(json.dumps({
        "ngf": args.ngf, "ndf": args.ndf, "batch": args.batch,
        "netD_parameter_bytes": sum(p.numel() * p.element_size() for p in d.parameters()),
        "netG_parameter_bytes": sum(p.numel() * p.element_size() for p in g.parameters()),
        "undo_bytes": held,
        "step_s_with_transaction": statistics.median(a for a, _ in pairs),
        "step_s_without": statistics.median(b for _, b in pairs),
        "ratio_pairwise_median": statistics.median(ratios),
        "ratios": [round(r, 4) for r in ratios],
    }, indent=1))


if __name__ == "__main__":
    main()
