"""A Hugging Face ``Trainer`` script, recoverable rank by rank under ftrun.

    ftrun --worker_num 4 examples/hf_trainer.py --max_steps 24
    torchrun --nproc_per_node 4 examples/hf_trainer.py --max_steps 24 --no_ftrun   # the same without ftrun

A tiny causal language model built by hand (embedding, GRU, dropout, a head: no download) on
synthetic token sequences; ``TrainingArguments`` with gradient accumulation, ``eval_steps``,
``logging_steps``, ``save_steps``, ``max_steps``, optionally bf16 autocast on CPU. The port is four
lines, marked ``# ftrun``: the imports, ``ftrun.init()`` before ``TrainingArguments``, ``FTTrainer`` in
place of ``Trainer`` and ``ft.finish()``
(``ftrun.integrations.hf``; README, "Hugging Face Trainer"). Under torchrun or as one process
``FTTrainer`` is ``Trainer``. Rank 0 prints ``final step=<n> loss=<x> test_accuracy=<eval loss>
params_sha256=<digest> logs_sha256=<digest of the log history without timings>``.
"""
import argparse
import hashlib
import os
import time

import torch
from torch import nn
from transformers import Trainer, TrainerCallback, TrainingArguments

import ftrun  # ftrun
from ftrun.integrations.hf import FTTrainer  # ftrun

VOCAB, SEQ = 64, 16


class TinyLM(nn.Module):
    """Embedding -> GRU -> dropout -> head; ``forward(input_ids, labels)`` returns ``{"loss", "logits"}``."""

    def __init__(self, width: int = 32) -> None:
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.rnn = nn.GRU(width, width, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, input_ids: torch.Tensor, labels: torch.Tensor | None = None) -> dict:
        hidden, _ = self.rnn(self.embed(input_ids))
        logits = self.head(self.drop(hidden))
        out = {"logits": logits}
        if labels is not None:
            out["loss"] = nn.functional.cross_entropy(logits[:, :-1].reshape(-1, VOCAB), labels[:, 1:].reshape(-1))
        return out


class Tokens(torch.utils.data.Dataset):
    """``n`` synthetic sequences: a noisy counting pattern, deterministic in ``seed``."""

    def __init__(self, n: int, seed: int) -> None:
        gen = torch.Generator().manual_seed(seed)
        start = torch.randint(0, VOCAB, (n, 1), generator=gen)
        step = torch.randint(1, 4, (n, 1), generator=gen)
        self.ids = (start + step * torch.arange(SEQ)) % VOCAB

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


class PrintLogs(TrainerCallback):
    """Rank 0 prints each log line as ``log step=<n> {...}`` (the tests watch for them)."""

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero:
            print(f"log step={state.global_step} {logs}", flush=True)


class StepTimes(TrainerCallback):
    """Rank 0 prints ``step <n> loss - time <unix time>`` at the end of each optimizer step
    (``scripts/bench.py`` times recoveries from these lines)."""

    def on_step_end(self, args, state, control, **kwargs):
        if state.is_world_process_zero:
            print(f"step {state.global_step} loss - time {time.time():.6f}", flush=True)


class Pause(TrainerCallback):
    """Rank 0 prints ``pause <event> step=<n>`` and sleeps at the first ``event`` (``step_end``,
    ``epoch_end`` or ``eval``: an evaluation batch) at or after global step ``n``: the other ranks
    wait in their next collective, and a test kills one of them there."""

    def __init__(self, spec: str, seconds: float) -> None:
        event, _, step = spec.partition(":")
        self.event, self.step, self.seconds, self.done = event, int(step or 0), seconds, False

    def _maybe(self, event: str, state) -> None:
        if self.done or event != self.event or state.global_step < self.step or not state.is_world_process_zero:
            return
        self.done = True
        print(f"pause {event} step={state.global_step}", flush=True)
        time.sleep(self.seconds)

    def on_step_end(self, args, state, control, **kwargs):
        self._maybe("step_end", state)

    def on_epoch_end(self, args, state, control, **kwargs):
        self._maybe("epoch_end", state)

    def on_prediction_step(self, args, state, control, **kwargs):
        self._maybe("eval", state)


def logs_digest(log_history: list) -> str:
    """SHA-256 of the Trainer's log history without its timings (runtimes, rates)."""
    timeless = [{k: v for k, v in entry.items() if "runtime" not in k and "per_second" not in k} for entry in log_history]
    return hashlib.sha256(repr(timeless).encode()).hexdigest()


def params_digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for name, tensor in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(tensor.detach().cpu().contiguous().view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output_dir", default="hf_out")
    parser.add_argument("--max_steps", type=int, default=24)
    parser.add_argument("--train_size", type=int, default=256)
    parser.add_argument("--batch_size", type=int, default=4, help="per rank and micro-batch")
    parser.add_argument("--accum", type=int, default=2)
    parser.add_argument("--eval_steps", type=int, default=8)
    parser.add_argument("--save_steps", type=int, default=0, help="0: no checkpoints")
    parser.add_argument("--bf16", action="store_true", help="bf16 autocast on CPU")
    parser.add_argument("--pause_on", default="", help="EVENT:STEP (step_end, epoch_end, eval): rank 0 pauses there once")
    parser.add_argument("--pause", type=float, default=2.0, help="seconds of that pause")
    parser.add_argument("--model", choices=["tiny", "gpt2"], default="tiny",
                        help="tiny: a GRU built by hand; gpt2: a one-layer GPT2LMHeadModel from a GPT2Config")
    parser.add_argument("--no_ftrun", action="store_true", help="plain transformers.Trainer")
    parser.add_argument("--step_times", action="store_true", help="rank 0 prints 'step N loss - time T' after every step")
    args = parser.parse_args()
    if "OMP_NUM_THREADS" not in os.environ:
        torch.set_num_threads(1)
    ft = None if args.no_ftrun else ftrun.init()  # ftrun: before TrainingArguments (ftrun's process group)
    torch.manual_seed(0)
    if args.model == "gpt2":  # a transformers model built from a config (no download)
        from transformers import GPT2Config, GPT2LMHeadModel

        model = GPT2LMHeadModel(GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=32, n_layer=1, n_head=2))
    else:
        model = TinyLM()
    training_args = TrainingArguments(
        output_dir=args.output_dir, max_steps=args.max_steps, per_device_train_batch_size=args.batch_size,
        per_device_eval_batch_size=8, gradient_accumulation_steps=args.accum, learning_rate=3e-3,
        lr_scheduler_type="cosine", warmup_steps=2, weight_decay=0.01, max_grad_norm=1.0,
        eval_strategy="steps", eval_steps=args.eval_steps, logging_steps=2,
        save_strategy="steps" if args.save_steps else "no", save_steps=args.save_steps or 500,
        bf16=args.bf16, use_cpu=True, report_to=[], seed=0, dataloader_num_workers=0, disable_tqdm=True,
    )
    trainer_cls = Trainer if args.no_ftrun else FTTrainer  # ftrun
    callbacks = ([PrintLogs()] + ([Pause(args.pause_on, args.pause)] if args.pause_on else [])
                 + ([StepTimes()] if args.step_times else []))
    trainer = trainer_cls(model=model, args=training_args, train_dataset=Tokens(args.train_size, 1),
                          eval_dataset=Tokens(64, 2), callbacks=callbacks)
    trainer.train()
    metrics = trainer.evaluate()
    if trainer.is_world_process_zero():
        print(f"final step={trainer.state.global_step} loss={trainer.state.log_history[-2].get('train_loss', 0):.6f} "
              f"test_accuracy={metrics['eval_loss']:.6f} params_sha256={params_digest(trainer.model)} "
              f"logs_sha256={logs_digest(trainer.state.log_history)}", flush=True)
    if ft is not None:
        ft.finish()  # ftrun


if __name__ == "__main__":
    main()
