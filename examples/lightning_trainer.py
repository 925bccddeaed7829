"""A PyTorch Lightning script (``Trainer.fit``, automatic optimization), recoverable rank by rank under ftrun.

    ftrun --worker_num 4 examples/lightning_trainer.py --max_epochs 3
    torchrun --nproc_per_node 4 examples/lightning_trainer.py --max_epochs 3 --no_ftrun   # the same without ftrun

A small classifier built by hand (two linear layers, dropout) on synthetic points, no download:
``Trainer.fit`` with gradient accumulation, clipping, AdamW with a per-step LR schedule, validation
every few training batches (its loss logged with ``sync_dist``), and ``ModelCheckpoint`` keeping the
two best by that loss. The port is four lines, marked ``# ftrun``: the imports, ``ftrun.init()``
before the ``Trainer``, ``FTStrategy`` in place of ``DDPStrategy`` and ``ft.finish()``
(``ftrun.integrations.lightning``; README, "Lightning"). Rank 0 prints ``final step=<n> epoch=<e>
val_loss=<x> best=<score> best_path=<file> params_sha256=<digest>``.
"""
import argparse
import hashlib
import os
import time

import lightning.pytorch as pl
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from lightning.pytorch.strategies import DDPStrategy
from torch import nn

import ftrun  # ftrun
from ftrun.integrations.lightning import FTStrategy  # ftrun

FEATURES, CLASSES = 16, 4


def points(n: int, seed: int) -> torch.utils.data.TensorDataset:
    """``n`` synthetic points in ``CLASSES`` noisy clusters, deterministic in ``seed``."""
    gen = torch.Generator().manual_seed(seed)
    centres = torch.randn(CLASSES, FEATURES, generator=torch.Generator().manual_seed(0)) * 2
    labels = torch.randint(0, CLASSES, (n,), generator=gen)
    return torch.utils.data.TensorDataset(centres[labels] + torch.randn(n, FEATURES, generator=gen), labels)


class Classifier(pl.LightningModule):
    """Linear -> ReLU -> dropout -> linear; AdamW with a linear warm-up then decay, per step."""

    def __init__(self, lr: float = 3e-3, width: int = 32) -> None:
        super().__init__()
        self.save_hyperparameters()
        self.net = nn.Sequential(nn.Linear(FEATURES, width), nn.ReLU(), nn.Dropout(0.2), nn.Linear(width, CLASSES))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.net(x)

    def training_step(self, batch, batch_idx):
        x, y = batch
        loss = nn.functional.cross_entropy(self(x), y)
        self.log("train_loss", loss, on_step=True, on_epoch=False)
        return loss

    def validation_step(self, batch, batch_idx):
        x, y = batch
        self.log("val_loss", nn.functional.cross_entropy(self(x), y), on_epoch=True, sync_dist=True)

    def configure_optimizers(self):
        opt = torch.optim.AdamW(self.parameters(), lr=self.hparams.lr, weight_decay=0.01)
        total = self.trainer.estimated_stepping_batches
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 3) * max(0.1, 1 - s / total))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}


class PrintLogs(Callback):
    """Rank 0 prints ``log step=<n> {...}`` after each optimizer step and ``val step=<n> loss=<x>``
    after each validation (the tests watch for them)."""

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if trainer.is_global_zero and (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            print(f"log step={trainer.global_step} epoch={trainer.current_epoch} batch={batch_idx} "
                  f"loss={float(outputs['loss']):.6f}", flush=True)

    def on_validation_end(self, trainer, pl_module):
        if trainer.is_global_zero and not trainer.sanity_checking:
            print(f"val step={trainer.global_step} loss={float(trainer.callback_metrics['val_loss']):.6f}", flush=True)


class Pause(Callback):
    """Rank 0 prints ``pause <event> step=<n>`` and sleeps at the first ``event`` (``step_end``,
    ``epoch_end`` or ``eval``: a validation batch) at or after global step ``n``: the other ranks
    wait in their next collective, and a test kills one of them there."""

    def __init__(self, spec: str, seconds: float) -> None:
        event, _, step = spec.partition(":")
        self.event, self.step, self.seconds, self.done = event, int(step or 0), seconds, False

    def _maybe(self, event: str, trainer) -> None:
        if self.done or event != self.event or trainer.global_step < self.step or not trainer.is_global_zero:
            return
        self.done = True
        print(f"pause {event} step={trainer.global_step}", flush=True)
        time.sleep(self.seconds)

    def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
        if (batch_idx + 1) % trainer.accumulate_grad_batches == 0:
            self._maybe("step_end", trainer)

    def on_train_epoch_end(self, trainer, pl_module):
        self._maybe("epoch_end", trainer)

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0):
        if not trainer.sanity_checking:
            self._maybe("eval", trainer)


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="lightning_out")
    parser.add_argument("--max_epochs", type=int, default=3)
    parser.add_argument("--train_size", type=int, default=192)
    parser.add_argument("--batch_size", type=int, default=4, help="per rank and micro-batch")
    parser.add_argument("--accum", type=int, default=2, help="accumulate_grad_batches")
    parser.add_argument("--val_every", type=int, default=6, help="validate every this many training batches")
    parser.add_argument("--pause_on", default="", help="EVENT:STEP (step_end, epoch_end, eval): rank 0 pauses there once")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of that pause")
    parser.add_argument("--no_ftrun", action="store_true", help="Lightning's own DDPStrategy")
    args = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    ft = None if args.no_ftrun else ftrun.init()  # ftrun: before the Trainer (ftrun's process group)
    pl.seed_everything(0, verbose=False)
    model = Classifier()
    train = torch.utils.data.DataLoader(points(args.train_size, 1), batch_size=args.batch_size, shuffle=True)
    val = torch.utils.data.DataLoader(points(64, 2), batch_size=8)
    strategy = DDPStrategy(process_group_backend="gloo") if args.no_ftrun else FTStrategy()  # ftrun
    best = ModelCheckpoint(dirpath=os.path.join(args.output_dir, "checkpoints"), monitor="val_loss", save_top_k=2,
                           filename="{epoch}-{step}")
    callbacks = [best, PrintLogs()] + ([Pause(args.pause_on, args.pause)] if args.pause_on else [])
    trainer = pl.Trainer(
        accelerator="cpu", devices=int(os.environ.get("LOCAL_WORLD_SIZE", 1)), num_nodes=1, strategy=strategy,
        max_epochs=args.max_epochs, accumulate_grad_batches=args.accum, gradient_clip_val=1.0,
        val_check_interval=args.val_every, check_val_every_n_epoch=None, num_sanity_val_steps=0,
        callbacks=callbacks, logger=False, enable_progress_bar=False, enable_model_summary=False,
        default_root_dir=args.output_dir, deterministic=True,
    )
    trainer.fit(model, train_dataloaders=train, val_dataloaders=val)
    if trainer.is_global_zero:
        print(f"final step={trainer.global_step} epoch={trainer.current_epoch} "
              f"val_loss={float(trainer.callback_metrics['val_loss']):.6f} best={float(best.best_model_score):.6f} "
              f"best_path={os.path.basename(best.best_model_path)} params_sha256={params_digest(model)}", flush=True)
    if ft is not None:
        ft.finish()  # ftrun


if __name__ == "__main__":
    main()
