"""Shared helpers for the character language model examples (ftrun and plain torchrun twins).

The workload: a small GPT-style model over bytes (vocabulary 256, so no tokenizer) trained on the
Python standard library's own source files, which every Python installation has offline. Like
``digits_common``, everything here is a pure function of its arguments (no global RNG state), so
the ftrun script and the torchrun script train the same model on the same batches, and a run with
faults ends with parameters bitwise equal to a run without.

Model sizes (``--size``) span about 1 MB to 1 GB of training state, counted as what a recovering
rank must receive: fp32 parameters plus AdamW's two moments, 12 bytes per parameter.
"""

from __future__ import annotations

import argparse
import hashlib
import os
import sys
import sysconfig
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

# The parameters' digest and the final line are the digits examples' own, so both workloads print
# (and tests and benchmarks parse) one format. This file sits beside digits_common.py.
_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
from digits_common import final_line, params_sha256  # noqa: E402

__all__ = [
    "SIZES",
    "Corpus",
    "CharLM",
    "ModelSize",
    "add_common_args",
    "batch",
    "build_model",
    "evaluate",
    "final_line",
    "load_corpus",
    "params_sha256",
    "state_bytes",
]

VOCAB = 256  # bytes
HELD_OUT_FRACTION = 0.1
STATE_BYTES_PER_PARAM = 12  # fp32 parameter + AdamW exp_avg + exp_avg_sq


@dataclass(frozen=True)
class ModelSize:
    """Shape of one model size: ``layers`` transformer blocks of width ``d_model`` with ``heads`` heads."""

    layers: int
    d_model: int
    heads: int


# name -> shape; the comment is the training state (params + AdamW moments) at --context 128.
SIZES: dict[str, ModelSize] = {
    "tiny": ModelSize(2, 48, 4),  # ~1 MB
    "small": ModelSize(4, 128, 4),  # ~10 MB
    "medium": ModelSize(6, 320, 5),  # ~90 MB
    "large": ModelSize(8, 576, 9),  # ~390 MB
    "xl": ModelSize(8, 896, 14),  # ~930 MB
}


@dataclass(frozen=True)
class Corpus:
    """The byte corpus, split once: ``train`` and ``held_out`` are 1-D uint8 tensors of byte values."""

    train: torch.Tensor
    held_out: torch.Tensor
    files: int


def stdlib_files(root: str | os.PathLike[str] | None = None) -> list[Path]:
    """Every ``.py`` file under the standard library directory, in sorted path order.

    Third-party packages (``site-packages``, ``dist-packages``) are skipped, so the list depends
    only on the Python installation. Directories are walked in sorted order.
    """
    base = Path(root if root is not None else sysconfig.get_paths()["stdlib"])
    found: list[Path] = []
    for dirpath, dirnames, filenames in os.walk(base):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "dist-packages", "__pycache__"))
        found.extend(Path(dirpath) / f for f in sorted(filenames) if f.endswith(".py"))
    return sorted(found)


def load_corpus(num_bytes: int = 2 << 20, root: str | os.PathLike[str] | None = None) -> Corpus:
    """The first ``num_bytes`` bytes of the standard library's sources, concatenated in path order.

    The last :data:`HELD_OUT_FRACTION` of the bytes is held out for evaluation.

    Raises:
        ValueError: ``num_bytes`` is too small, or the directory holds fewer bytes than asked for
            (the message says how many there are).
    """
    if num_bytes < 4096:
        raise ValueError(f"--corpus_bytes must be at least 4096, got {num_bytes}")
    chunks: list[bytes] = []
    total = 0
    files = 0
    for path in stdlib_files(root):
        try:
            data = path.read_bytes()
        except OSError:
            continue
        chunks.append(data)
        total += len(data)
        files += 1
        if total >= num_bytes:
            break
    if total < num_bytes:
        raise ValueError(f"the standard library sources hold only {total} bytes; lower --corpus_bytes")
    data = torch.frombuffer(bytearray(b"".join(chunks)[:num_bytes]), dtype=torch.uint8)
    n_held = int(num_bytes * HELD_OUT_FRACTION)
    return Corpus(train=data[:-n_held].clone(), held_out=data[-n_held:].clone(), files=files)


def _derive_seed(*parts: object) -> int:
    """Stable 63-bit seed from ``parts`` (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(repr(("charlm",) + parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def batch(
    corpus: torch.Tensor, seed: int, step: int, rank: int, world_size: int, batch_size: int, context: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (int64, shape (batch_size, context)) for ``rank`` at ``step``.

    The global batch of a step is ``world_size * batch_size`` windows at offsets drawn from a
    private generator seeded with (seed, step); rank r takes the r-th slice. A pure function of its
    arguments, so a respawned or restarted rank sees exactly the batch its predecessor would have.

    Raises:
        ValueError: bad arguments, or a corpus shorter than one window.
    """
    if batch_size <= 0 or world_size <= 0 or context <= 0:
        raise ValueError("batch_size, world_size and context must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if len(corpus) <= context + 1:
        raise ValueError(f"corpus of {len(corpus)} bytes is shorter than one window of {context + 1}")
    gen = torch.Generator().manual_seed(_derive_seed("batch", seed, step))
    offsets = torch.randint(0, len(corpus) - context - 1, (world_size * batch_size,), generator=gen)
    mine = offsets[rank * batch_size : (rank + 1) * batch_size]
    windows = torch.stack([corpus[o : o + context + 1] for o in mine.tolist()]).long()
    return windows[:, :-1], windows[:, 1:]


class Block(nn.Module):
    """Pre-norm transformer block: causal self-attention (SDPA) and a 4x MLP."""

    def __init__(self, d_model: int, heads: int) -> None:
        super().__init__()
        if d_model % heads:
            raise ValueError(f"d_model {d_model} is not divisible by heads {heads}")
        self.heads = heads
        self.ln1 = nn.LayerNorm(d_model)
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.ln2 = nn.LayerNorm(d_model)
        self.fc = nn.Linear(d_model, 4 * d_model)
        self.out = nn.Linear(4 * d_model, d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = self.qkv(self.ln1(x)).split(d, dim=2)
        q, k, v = (z.view(b, t, self.heads, d // self.heads).transpose(1, 2) for z in (q, k, v))
        att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(att.transpose(1, 2).reshape(b, t, d))
        return x + self.out(F.gelu(self.fc(self.ln2(x))))


class CharLM(nn.Module):
    """GPT-style byte model: token + position embeddings, ``layers`` blocks, final norm, head.

    Input (B, T) int64 bytes with T <= ``context``; output (B, T, 256) logits.
    """

    def __init__(self, size: ModelSize, context: int) -> None:
        super().__init__()
        self.context = context
        self.tok = nn.Embedding(VOCAB, size.d_model)
        self.pos = nn.Embedding(context, size.d_model)
        self.blocks = nn.ModuleList(Block(size.d_model, size.heads) for _ in range(size.layers))
        self.ln = nn.LayerNorm(size.d_model)
        self.head = nn.Linear(size.d_model, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def build_model(size: str, context: int) -> CharLM:
    """The model of size ``size`` (a key of :data:`SIZES`). Call ``torch.manual_seed`` first.

    Raises:
        ValueError: unknown size name.
    """
    if size not in SIZES:
        raise ValueError(f"unknown --size {size!r}; expected one of {', '.join(SIZES)}")
    return CharLM(SIZES[size], context)


def state_bytes(model: nn.Module) -> int:
    """Bytes of training state a recovering rank receives: parameters + AdamW's two moments."""
    return STATE_BYTES_PER_PARAM * sum(p.numel() for p in model.parameters())


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-byte cross-entropy of ``model`` on inputs ``x`` and targets ``y`` (B, T), moved to
    the model's device first (``--device cuda``: batches are built on the CPU)."""
    device = next(model.parameters()).device
    logits = model(x.to(device))
    return F.cross_entropy(logits.reshape(-1, VOCAB), y.to(device).reshape(-1))


@torch.no_grad()
def evaluate(model: nn.Module, held_out: torch.Tensor, context: int, windows: int) -> float:
    """Next-byte accuracy in [0, 1] on the first ``windows`` non-overlapping windows of the held-out
    bytes (fewer if it is shorter). Restores train mode."""
    n = min(windows, (len(held_out) - 1) // context)
    if n <= 0:
        raise ValueError(f"held-out text of {len(held_out)} bytes is shorter than one window of {context + 1}")
    was_training = model.training
    model.eval()
    try:
        correct = 0
        for i in range(0, n, 8):
            rows = torch.stack([held_out[j * context : j * context + context + 1] for j in range(i, min(n, i + 8))])
            rows = rows.long().to(next(model.parameters()).device)
            pred = model(rows[:, :-1]).argmax(dim=-1)
            correct += int((pred == rows[:, 1:]).sum().item())
        return correct / (n * context)
    finally:
        model.train(was_training)


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training flags shared by the charlm scripts; returns ``parser``."""
    parser.add_argument("--size", default="tiny", choices=list(SIZES), help="model size (default: tiny, ~1 MB of state)")
    parser.add_argument("--steps", type=int, default=200, help="optimizer steps (default: 200)")
    parser.add_argument("--batch_size", type=int, default=8, help="per-rank windows per step (default: 8)")
    parser.add_argument("--context", type=int, default=128, help="window length in bytes (default: 128)")
    parser.add_argument("--lr", type=float, default=3e-3, help="AdamW learning rate (default: 3e-3)")
    parser.add_argument("--weight_decay", type=float, default=0.01, help="AdamW weight decay (default: 0.01)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init and batches (default: 0)")
    parser.add_argument("--corpus_bytes", type=int, default=2 << 20, help="bytes of stdlib source to train on (default: 2 MiB)")
    parser.add_argument("--eval_windows", type=int, default=64, help="held-out windows to score (default: 64)")
    parser.add_argument("--log_every", type=int, default=50, help="print the loss every N steps (0: never)")
    parser.add_argument("--device", default="cpu",
                        help="where the model trains (default: cpu; cuda: each rank on its node's GPUs, shared "
                             "round-robin, gradients averaged over gloo with CUDA tensors)")
    return parser
