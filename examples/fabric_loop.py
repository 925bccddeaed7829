"""A training loop written with Lightning Fabric, and its port to ftrun.

    torchrun --nproc_per_node 4 examples/fabric_loop.py              # the loop as written
    ftrun --worker_num 4 examples/fabric_loop.py --ftrun            # the port, recovered rank by rank

A small classifier built by hand (two linear layers, dropout) on synthetic data (no download),
``Fabric(strategy="ddp")`` with ``fabric.launch()``, ``fabric.setup`` of the model, the optimizer
and a scheduler, ``fabric.setup_dataloaders`` of a shuffled training ``DataLoader`` and an
evaluation ``DataLoader``; gradient accumulation with ``fabric.no_backward_sync``, ``fabric.backward``
and ``fabric.clip_gradients``; an evaluation every ``--eval_every`` optimizer steps that sums its
losses with ``fabric.all_reduce`` and ends with ``fabric.barrier``; logging on ``fabric.is_global_zero``.

:func:`main` is the loop as a Fabric user writes it; :func:`main_ftrun` is the same loop ported to
ftrun (``ftrun.integrations.fabric``; README, "Lightning Fabric"): the lines that differ say
``# ftrun`` (tests/test_fabric.py checks they are at most ten). Rank 0 prints
``final step=<n> loss=<x> test_accuracy=<accuracy> params_sha256=<digest>``.
"""
import argparse
import hashlib
import os
import time

import torch
import torch.nn.functional as F
from lightning.fabric import Fabric
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


def evaluate(fabric, model, loader, pause: Pause, step: int) -> tuple[float, float]:
    """Mean loss and accuracy over the whole evaluation set (summed over the ranks)."""
    model.eval()
    total = torch.zeros(3, dtype=torch.float64)  # loss sum, hits, samples
    with torch.no_grad():
        for x, y in loader:
            pause.at("eval", step)
            logits = model(x)
            total += torch.stack([F.cross_entropy(logits, y, reduction="sum").double(),
                                  (logits.argmax(1) == y).sum().double(), torch.tensor(len(y), dtype=torch.float64)])
    total = fabric.all_reduce(total, reduce_op="sum")
    fabric.barrier()
    model.train()
    return (total[0] / total[2]).item(), (total[1] / total[2]).item()


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
    parser.add_argument("--ftrun", action="store_true", help="run main_ftrun (the port) instead of main")
    return parser.parse_args(argv)


def devices() -> int:
    return int(os.environ.get("LOCAL_WORLD_SIZE", 1))


def main(args) -> None:
    fabric = Fabric(accelerator="cpu", devices=devices(), strategy="ddp")
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    train_loader, eval_loader = fabric.setup_dataloaders(
        DataLoader(dataset(args.train_size, 1), batch_size=args.batch_size, shuffle=True),
        DataLoader(dataset(64, 2), batch_size=8))
    pause = Pause(args.pause_on, args.pause, fabric.is_global_zero)

    def run_evaluation(step: int) -> None:
        loss, accuracy = evaluate(fabric, model, eval_loader, pause, step)
        if fabric.is_global_zero:
            print(f"step {step} eval_loss {loss:.6f} accuracy {accuracy:.4f}", flush=True)

    completed_steps = 0
    for epoch in range(args.epochs):
        model.train()
        for i, (x, y) in enumerate(train_loader):
            is_accumulating = (i + 1) % args.accum != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / args.accum)
            if not is_accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                completed_steps += 1
                if fabric.is_global_zero and completed_steps % args.log_every == 0:
                    print(f"epoch {epoch} step {completed_steps} loss {loss.item():.6f}", flush=True)
                pause.at("step_end", completed_steps)
                if completed_steps % args.eval_every == 0:
                    run_evaluation(completed_steps)
        pause.at("epoch_end", completed_steps)
    loss, accuracy = evaluate(fabric, model, eval_loader, pause, completed_steps)
    if fabric.is_global_zero:
        print(f"final step={completed_steps} loss={loss:.6f} test_accuracy={accuracy:.6f} "
              f"params_sha256={params_digest(model)}", flush=True)


def main_ftrun(args) -> None:
    import ftrun  # ftrun
    from ftrun.integrations.fabric import FTFabric  # ftrun
    ft = ftrun.init()  # ftrun: before Fabric (ftrun builds the process group)
    fabric = FTFabric(accelerator="cpu", devices=devices(), strategy="ddp")  # ftrun: was Fabric
    fabric.launch()
    fabric.seed_everything(args.seed, verbose=False)
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (1.0 + 0.01 * s))
    model, optimizer, scheduler = fabric.setup(model, optimizer, scheduler=scheduler)
    train_loader, eval_loader = fabric.setup_dataloaders(
        DataLoader(dataset(args.train_size, 1), batch_size=args.batch_size, shuffle=True),
        DataLoader(dataset(64, 2), batch_size=8))
    pause = Pause(args.pause_on, args.pause, fabric.is_global_zero)

    def run_evaluation(step: int) -> None:
        loss, accuracy = evaluate(fabric, model, eval_loader, pause, step)
        if fabric.is_global_zero:
            print(f"step {step} eval_loss {loss:.6f} accuracy {accuracy:.4f}", flush=True)

    run_evaluation = fabric.recoverable(run_evaluation)  # ftrun: a fault inside is recovered, the evaluation run again
    completed_steps = 0
    for epoch in ft.epochs(0, args.epochs):  # ftrun: a respawned rank starts in its replicas' epoch
        model.train()
        for i, (x, y) in enumerate(fabric.train_batches(train_loader, args.accum)):  # ftrun: one ftrun step per optimizer step
            is_accumulating = (i + 1) % args.accum != 0
            with fabric.no_backward_sync(model, enabled=is_accumulating):
                loss = F.cross_entropy(model(x), y)
                fabric.backward(loss / args.accum)
            if not is_accumulating:
                fabric.clip_gradients(model, optimizer, max_norm=args.clip)
                optimizer.step()
                scheduler.step()
                optimizer.zero_grad()
                completed_steps = fabric.completed_steps  # ftrun: was += 1 (a respawned rank knows the count)
                if fabric.is_global_zero and completed_steps % args.log_every == 0:
                    print(f"epoch {epoch} step {completed_steps} loss {loss.item():.6f}", flush=True)
                pause.at("step_end", completed_steps)
                if completed_steps % args.eval_every == 0:
                    run_evaluation(completed_steps)
        pause.at("epoch_end", completed_steps)
    loss, accuracy = evaluate(fabric, model, eval_loader, pause, completed_steps)
    if fabric.is_global_zero:
        print(f"final step={completed_steps} loss={loss:.6f} test_accuracy={accuracy:.6f} "
              f"params_sha256={params_digest(model)}", flush=True)
    ft.finish()  # ftrun


if __name__ == "__main__":
    arguments = parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    (main_ftrun if arguments.ftrun else main)(arguments)
