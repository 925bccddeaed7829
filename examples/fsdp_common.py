"""Shared helpers for the sharded GPT examples (``train_fsdp.py`` under ftrun, ``train_fsdp_torchrun.py``
under plain torchrun).

The workload: a small GPT-style model (token and position embeddings, pre-norm blocks with causal
attention and an MLP, a language-model head) sharded with FSDP2's ``fully_shard`` over a DeviceMesh:

- ``--mesh R,S``: HSDP, R replica groups of S ranks that shard the parameters between them
  (mesh dimensions ``("replicate", "shard")``; ``--mesh 1,4`` is pure FSDP over 4 ranks);
- ``--tp N``: tensor parallelism inside (a third dimension ``"tp"``, Megatron's column-wise then
  row-wise split of attention and MLP); the world size is R x S x N.

Every rank builds the full model from the same seed before it is sharded, so replicas start equal
with no broadcast. Data is a pure function of (seed, step): the global batch of ``--batch_size``
sequences is split over the R x S data-parallel ranks (the N ranks of a tensor-parallel group take
the same slice), so the ftrun script and the torchrun script train the same model on the same
batches, and a run with faults ends with parameters bitwise equal to a run without.
"""

from __future__ import annotations

import argparse
import hashlib

import torch
import torch.nn.functional as F
from torch import nn

VOCAB = 64
MESH_DIMS = ("replicate", "shard")
TP_DIM = "tp"


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The arguments both scripts take."""
    parser.add_argument("--mesh", default="2,2", help="R,S: R replica groups of S sharding ranks (HSDP); 1,N is FSDP")
    parser.add_argument("--tp", type=int, default=1, help="tensor-parallel ranks inside each data-parallel rank")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--batch_size", type=int, default=8, help="global batch (sequences), split over R x S ranks")
    parser.add_argument("--context", type=int, default=16, help="tokens per sequence")
    parser.add_argument("--d_model", type=int, default=32)
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--heads", type=int, default=4)
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--log_every", type=int, default=0, help="print the loss every N steps (0: never)")
    return parser


def mesh_of(args: argparse.Namespace) -> tuple[tuple[int, ...], tuple[str, ...]]:
    """(mesh shape, dimension names) of ``--mesh R,S`` and ``--tp N``.

    Raises:
        SystemExit: ``--mesh`` is not two positive integers (exit code 2, one line).
    """
    try:
        r, s = (int(x) for x in str(args.mesh).split(","))
        if r < 1 or s < 1 or args.tp < 1:
            raise ValueError
    except ValueError:
        raise SystemExit(f"error: --mesh wants R,S (two positive integers) and --tp a positive integer, not "
                         f"{args.mesh!r}, {args.tp!r}") from None
    if args.tp > 1:
        return (r, s, args.tp), MESH_DIMS + (TP_DIM,)
    return (r, s), MESH_DIMS


class Block(nn.Module):
    """A pre-norm transformer block; attention heads are inferred from the local width, so it runs
    unchanged when ``q``/``k``/``v``/``fc1`` are split column-wise over tensor-parallel ranks."""

    def __init__(self, d: int, heads: int) -> None:
        super().__init__()
        self.head_dim = d // heads
        self.ln1, self.ln2 = nn.LayerNorm(d), nn.LayerNorm(d)
        self.q, self.k, self.v, self.proj = (nn.Linear(d, d) for _ in range(4))
        self.fc1, self.fc2 = nn.Linear(d, 4 * d), nn.Linear(4 * d, d)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, _ = x.shape
        h = self.ln1(x)
        q, k, v = (lin(h).view(b, t, -1, self.head_dim).transpose(1, 2) for lin in (self.q, self.k, self.v))
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        x = x + self.proj(a)
        return x + self.fc2(F.gelu(self.fc1(self.ln2(x))))


class GPT(nn.Module):
    """Token and position embeddings, ``layers`` blocks, a final norm and a head over :data:`VOCAB`;
    maps tokens (batch, tokens) to logits (batch x tokens, VOCAB)."""

    def __init__(self, d: int, layers: int, heads: int, context: int) -> None:
        super().__init__()
        self.tok, self.pos = nn.Embedding(VOCAB, d), nn.Embedding(context, d)
        self.blocks = nn.ModuleList(Block(d, heads) for _ in range(layers))
        self.ln, self.head = nn.LayerNorm(d), nn.Linear(d, VOCAB)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1], device=idx.device))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x).reshape(-1, x.shape[-1]))  # (batch x tokens, VOCAB): no view returned


def build_model(args: argparse.Namespace) -> GPT:
    """The full (unsharded) model, from the global RNG (seed it first: every rank the same)."""
    if args.d_model % args.heads or args.heads % args.tp:
        raise SystemExit(f"error: --d_model {args.d_model} must divide by --heads {args.heads}, and --heads by --tp {args.tp}")
    return GPT(args.d_model, args.layers, args.heads, args.context)


def shard(model: GPT, mesh, tp: int) -> GPT:
    """Apply tensor parallelism over ``mesh["tp"]`` (if ``tp`` > 1), then ``fully_shard`` each block
    and the root over the data-parallel dimensions (HSDP on a 2-D mesh). Returns ``model``."""
    from torch.distributed.fsdp import fully_shard

    dp_mesh = mesh[MESH_DIMS] if tp > 1 else mesh
    if tp > 1:
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        plan = {"q": ColwiseParallel(), "k": ColwiseParallel(), "v": ColwiseParallel(), "proj": RowwiseParallel(),
                "fc1": ColwiseParallel(), "fc2": RowwiseParallel()}
        for block in model.blocks:
            parallelize_module(block, mesh[TP_DIM], plan)
    for block in model.blocks:
        fully_shard(block, mesh=dp_mesh)
    fully_shard(model, mesh=dp_mesh)
    return model


def dp_coordinates(rank: int, world_size: int, tp: int) -> tuple[int, int]:
    """(data-parallel rank, data-parallel size) of a global ``rank``: ranks are laid out row-major
    over (replicate, shard, tp), so the ``tp`` ranks of a tensor-parallel group share one."""
    return rank // tp, world_size // tp


def _seed_of(seed: int, step: int) -> int:
    digest = hashlib.sha256(f"fsdp:{seed}:{step}".encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def batch(seed: int, step: int, dp_rank: int, dp_size: int, batch_size: int, context: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Inputs and targets (int64, shape (batch_size / dp_size, context)) of ``dp_rank`` at ``step``:
    its slice of a global batch of affine sequences ``x[t+1] = (a x[t] + b) mod VOCAB``, learnable
    from context, drawn from (seed, step) alone.

    Raises:
        SystemExit: ``batch_size`` does not divide by ``dp_size``.
    """
    if batch_size % dp_size:
        raise SystemExit(f"error: --batch_size {batch_size} must divide by the data-parallel size {dp_size}")
    g = torch.Generator().manual_seed(_seed_of(seed, step))
    a = torch.randint(1, VOCAB, (batch_size, 1), generator=g) | 1
    b = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    x0 = torch.randint(0, VOCAB, (batch_size, 1), generator=g)
    seqs = [x0]
    for _ in range(context):
        seqs.append((a * seqs[-1] + b) % VOCAB)
    tokens = torch.cat(seqs, dim=1)
    per = batch_size // dp_size
    mine = tokens[dp_rank * per:(dp_rank + 1) * per]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def loss_of(model: nn.Module, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean next-token cross entropy."""
    return F.cross_entropy(model(x), y.reshape(-1))


def full_params_sha256(model: nn.Module) -> str:
    """SHA-256 over every parameter's name, dtype, shape and bytes, each gathered whole
    (``full_tensor()``, a collective: every rank calls it; the digest is the same on all)."""
    h = hashlib.sha256()
    for name, p in model.named_parameters():
        full = p.full_tensor() if hasattr(p, "full_tensor") else p
        full = full.detach().cpu().contiguous()
        h.update(f"{name}:{full.dtype}:{tuple(full.shape)}".encode())
        h.update(full.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def final_line(steps: int, loss: float, digest: str) -> str:
    """What rank 0 prints at the end (tests and benchmarks parse ``params_sha256=``)."""
    return f"final step={steps} loss={loss:.6f} params_sha256={digest}"


def optimizer(model: nn.Module, lr: float) -> torch.optim.Optimizer:
    """AdamW over the (sharded) parameters."""
    return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.01)


__all__ = ["VOCAB", "MESH_DIMS", "add_common_args", "mesh_of", "build_model", "shard", "dp_coordinates", "batch",
           "loss_of", "full_params_sha256", "final_line", "optimizer"]
