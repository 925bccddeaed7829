"""A training loop written with Hugging Face Accelerate, and its port to ftrun.

    torchrun --nproc_per_node 4 examples/accelerate_loop.py              # the loop as written
    ftrun --worker_num 4 examples/accelerate_loop.py --ftrun            # the port, recovered rank by rank

A small classifier built by hand (two linear layers, dropout) on synthetic data (no download),
``Accelerator(gradient_accumulation_steps=...)`` with ``accelerator.prepare`` of the model, the
optimizer, a shuffled training ``DataLoader``, an evaluation ``DataLoader`` and a scheduler; the
training loop under ``with accelerator.accumulate(model):`` with ``accelerator.backward`` and
``accelerator.clip_grad_norm_``; an evaluation every ``--eval_every`` optimizer steps that gathers
its losses with ``gather_for_metrics``; logging on ``accelerator.is_main_process``.

:func:`main` is the loop as an Accelerate user writes it; :func:`main_ftrun` is the same loop
ported to ftrun (``ftrun.integrations.accelerate``; README, "Accelerate loops"): the lines that
differ say ``# ftrun`` (tests/test_accelerate.py checks they are at most ten). Rank 0 prints
``final step=<n> loss=<x> test_accuracy=<eval loss> params_sha256=<digest>``.
"""
import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from accelerate.utils import set_seed
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

FEATURES, CLASSES = 16, 4


class Net(nn.Module):
    """Linear -> ReLU -> dropout -> linear."""

    def __init__(self, width: int = 64) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Dropout(0.1), nn.Linear(width, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


def dataset(n: int, seed: int) -> TensorDataset:
    """``n`` points labelled by a fixed random linear map plus noise, deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    weights = torch.randn(FEATURES, CLASSES, generator=torch.Generator().manual_seed(1234))
    x = torch.randn(n, FEATURES, generator=gen)
    y = (x @ weights + 0.5 * torch.randn(n, CLASSES, generator=gen)).argmax(dim=1)
    return TensorDataset(x, y)


class Pause:
    """Rank 0 prints ``pause <event> step=<n>`` and sleeps at the first ``event`` (``step_end``,
    ``epoch_end`` or ``eval``: an evaluation batch) at or after optimizer step ``n``: the other
    ranks wait in their next collective, and a test kills one of them there."""

    def __init__(self, spec: str, seconds: float, main: bool) -> None:
        event, _, step = spec.partition(":")
        self.event, self.step, self.seconds, self.done = event, int(step or 0), seconds, not (spec and main)

    def at(self, event: str, step: int) -> None:
        if self.done or event != self.event or step < self.step:
            return
        self.done = True
        print(f"pause {event} step={step}", flush=True)
        time.sleep(self.seconds)


def evaluate(accelerator, model, loader, pause: Pause, step: int) -> tuple[float, float]:
    """Mean loss and accuracy over the whole evaluation set (gathered over the ranks)."""
    model.eval()
    losses, hits = [], []
    for x, y in loader:
        pause.at("eval", step)
        with torch.no_grad():
            logits = model(x)
        loss, hit = accelerator.gather_for_metrics((F.cross_entropy(logits, y, reduction="none"), logits.argmax(1) == y))
        losses.append(loss)
        hits.append(hit)
    model.train()
    return torch.cat(losses).mean().item(), torch.cat(hits).float().mean().item()


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--train_size", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=4, help="per rank and micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="micro-batches per optimizer step")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--clip", type=float, default=1.0)
    parser.add_argument("--eval_every", type=int, default=5, help="evaluate every N optimizer steps")
    parser.add_argument("--log_every", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--pause_on", default="", help="EVENT:STEP (step_end, epoch_end, eval): rank 0 pauses there once")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of that pause")
    parser.add_argument("--cpu", type=int, default=1, help="1: Accelerator(cpu=True) (what makes accelerate distributed on CPU)")
    parser.add_argument("--ftrun", action="store_true", help="run main_ftrun (the port) instead of main")
    return parser.parse_args(argv)


def main(args) -> None:
    accelerator = Accelerator(cpu=args.cpu, gradient_accumulation_steps=args.accum)
    set_seed(args.seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    train_loader = DataLoader(dataset(args.train_size, 1), batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(dataset(64, 2), batch_size=8)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    pause = Pause(args.pause_on, args.pause, accelerator.is_main_process)

    def run_evaluation(step: int) -> None:
        loss, accuracy = evaluate(accelerator, model, eval_loader, pause, step)
        if accelerator.is_main_process:
            print(f"step {step} eval_loss {loss:.6f} accuracy {accuracy:.4f}", flush=True)

    completed_steps = 0
    for epoch in range(args.epochs):
        model.train()
        for x, y in train_loader:
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps += 1
                if accelerator.is_main_process and completed_steps % args.log_every == 0:
                    print(f"epoch {epoch} step {completed_steps} loss {loss.item():.6f}", flush=True)
                pause.at("step_end", completed_steps)
                if completed_steps % args.eval_every == 0:
                    run_evaluation(completed_steps)
        pause.at("epoch_end", completed_steps)
    loss, accuracy = evaluate(accelerator, model, eval_loader, pause, completed_steps)
    if accelerator.is_main_process:
        print(f"final step={completed_steps} loss={loss:.6f} test_accuracy={accuracy:.6f} "
              f"params_sha256={params_digest(accelerator.unwrap_model(model))}", flush=True)


def main_ftrun(args) -> None:
    import ftrun  # ftrun
    from ftrun.integrations.accelerate import FTAccelerator  # ftrun
    ft = ftrun.init()  # ftrun: before the Accelerator (ftrun builds the process group)
    accelerator = FTAccelerator(cpu=args.cpu, gradient_accumulation_steps=args.accum)  # ftrun: was Accelerator
    set_seed(args.seed)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    train_loader = DataLoader(dataset(args.train_size, 1), batch_size=args.batch_size, shuffle=True)
    eval_loader = DataLoader(dataset(64, 2), batch_size=8)
    model, optimizer, train_loader, eval_loader, scheduler = accelerator.prepare(
        model, optimizer, train_loader, eval_loader, scheduler)
    pause = Pause(args.pause_on, args.pause, accelerator.is_main_process)

    def run_evaluation(step: int) -> None:
        loss, accuracy = evaluate(accelerator, model, eval_loader, pause, step)
        if accelerator.is_main_process:
            print(f"step {step} eval_loss {loss:.6f} accuracy {accuracy:.4f}", flush=True)

    run_evaluation = accelerator.recoverable(run_evaluation)  # ftrun: a fault inside is recovered, the evaluation run again
    completed_steps = 0
    for epoch in ft.epochs(0, args.epochs):  # ftrun: a respawned rank starts in its replicas' epoch
        model.train()
        for x, y in accelerator.train_batches(train_loader):  # ftrun: one ftrun step per optimizer step
            with accelerator.accumulate(model):
                loss = F.cross_entropy(model(x), y)
                accelerator.backward(loss)
                if accelerator.sync_gradients:
                    accelerator.clip_grad_norm_(model.parameters(), args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
            if accelerator.sync_gradients:
                completed_steps = accelerator.completed_steps  # ftrun: was += 1 (a respawned rank knows the count)
                if accelerator.is_main_process and completed_steps % args.log_every == 0:
                    print(f"epoch {epoch} step {completed_steps} loss {loss.item():.6f}", flush=True)
                pause.at("step_end", completed_steps)
                if completed_steps % args.eval_every == 0:
                    run_evaluation(completed_steps)
        pause.at("epoch_end", completed_steps)
    loss, accuracy = evaluate(accelerator, model, eval_loader, pause, completed_steps)
    if accelerator.is_main_process:
        print(f"final step={completed_steps} loss={loss:.6f} test_accuracy={accuracy:.6f} "
              f"params_sha256={params_digest(accelerator.unwrap_model(model))}", flush=True)
    ft.finish()  # ftrun


if __name__ == "__main__":
    arguments = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    (main_ftrun if arguments.ftrun else main)(arguments)
