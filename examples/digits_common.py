"""Shared helpers for the digits/MNIST example training scripts.

Dependency-light on purpose (torch, numpy, scikit-learn only) so that the
plain torchrun script and the ftrun-aware script train the exact same model on
the exact same batches and can be compared bit for bit via ``params_sha256``.
"""

from __future__ import annotations

import argparse
import gzip
import hashlib
import importlib.util
import os
import zlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from torch import nn

__all__ = [
    "Dataset",
    "add_common_args",
    "batch_indices",
    "build_model",
    "evaluate",
    "final_line",
    "load_dataset",
    "params_sha256",
    "read_idx",
]

# IDX type code -> big-endian numpy dtype (see http://yann.lecun.com/exdb/mnist/).
_IDX_DTYPES: dict[int, np.dtype] = {
    0x08: np.dtype(">u1"),
    0x09: np.dtype(">i1"),
    0x0B: np.dtype(">i2"),
    0x0C: np.dtype(">i4"),
    0x0D: np.dtype(">f4"),
    0x0E: np.dtype(">f8"),
}

_MNIST_FILES = {
    "train_x": "train-images-idx3-ubyte",
    "train_y": "train-labels-idx1-ubyte",
    "test_x": "t10k-images-idx3-ubyte",
    "test_y": "t10k-labels-idx1-ubyte",
}

DIGITS_TEST_FRACTION = 0.2


@dataclass(frozen=True)
class Dataset:
    """Train/test split held in memory.

    ``*_x`` are float32 tensors of shape (N, H, W) with values in [0, 1];
    ``*_y`` are int64 class labels of shape (N,); ``in_features`` is H * W.
    """

    train_x: torch.Tensor
    train_y: torch.Tensor
    test_x: torch.Tensor
    test_y: torch.Tensor
    in_features: int


def on_device(ds: Dataset, device: torch.device | str) -> Dataset:
    """``ds`` with its tensors on ``device``."""
    return Dataset(ds.train_x.to(device), ds.train_y.to(device), ds.test_x.to(device), ds.test_y.to(device),
                   ds.in_features)


def build_model(in_features: int = 64) -> nn.Module:
    """MLP from MindSpore's UCE example: in_features -> 512 -> 512 -> 10.

    Input (N, ...) is flattened to (N, in_features); output is (N, 10) logits.
    The caller must set ``torch.manual_seed(seed)`` first so that every rank
    builds identical initial weights.
    """
    return nn.Sequential(
        nn.Flatten(),
        nn.Linear(in_features, 512),
        nn.ReLU(),
        nn.Linear(512, 512),
        nn.ReLU(),
        nn.Linear(512, 10),
    )


def read_idx(path: str | os.PathLike[str]) -> np.ndarray:
    """Read an IDX file (optionally gzip-compressed when the name ends in .gz).

    Returns a native-endian array whose shape and dtype come from the header.
    Raises ``ValueError`` naming the file on a bad magic number, unknown type
    code, corrupt gzip stream (incl. truncated .gz) or a size that does not match the header.
    """
    p = Path(path)
    raw = p.read_bytes()  # OSError (e.g. FileNotFoundError) propagates unchanged
    if p.suffix == ".gz":
        try:
            raw = gzip.decompress(raw)
        except (gzip.BadGzipFile, EOFError, zlib.error) as e:
            raise ValueError(f"{p}: corrupt gzip-compressed IDX file: {e}") from e

    if len(raw) < 4:
        raise ValueError(f"{p}: truncated IDX file ({len(raw)} bytes, need a 4-byte magic number)")
    zero0, zero1, code, ndim = raw[0], raw[1], raw[2], raw[3]
    if zero0 != 0 or zero1 != 0:
        raise ValueError(f"{p}: bad IDX magic number 0x{raw[:4].hex()} (first two bytes must be zero)")
    if code not in _IDX_DTYPES:
        raise ValueError(f"{p}: bad IDX magic number 0x{raw[:4].hex()} (unknown type code 0x{code:02x})")
    if ndim == 0:
        raise ValueError(f"{p}: bad IDX magic number 0x{raw[:4].hex()} (zero dimensions)")

    header_len = 4 + 4 * ndim
    if len(raw) < header_len:
        raise ValueError(f"{p}: truncated IDX header ({len(raw)} bytes, need {header_len} for {ndim} dims)")
    shape = tuple(int(d) for d in np.frombuffer(raw, dtype=">u4", count=ndim, offset=4))
    dtype = _IDX_DTYPES[code]
    expected = header_len + int(np.prod(shape, dtype=np.int64)) * dtype.itemsize
    if len(raw) != expected:
        what = "truncated" if len(raw) < expected else "trailing bytes in"
        raise ValueError(
            f"{p}: {what} IDX file: header says shape {shape} of {dtype.name} "
            f"({expected} bytes total) but file has {len(raw)} bytes"
        )
    data = np.frombuffer(raw, dtype=dtype, offset=header_len).reshape(shape)
    return data.astype(dtype.newbyteorder("="))


def _find_idx(directory: Path, name: str) -> Path:
    """Return ``directory/name`` or ``directory/name.gz``; FileNotFoundError if neither exists."""
    for candidate in (directory / name, directory / f"{name}.gz"):
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"MNIST file {name}[.gz] not found in {directory}")


def _load_mnist(directory: Path) -> Dataset:
    arrays = {key: read_idx(_find_idx(directory, name)) for key, name in _MNIST_FILES.items()}
    for split in ("train", "test"):
        x, y = arrays[f"{split}_x"], arrays[f"{split}_y"]
        xname, yname = _MNIST_FILES[f"{split}_x"], _MNIST_FILES[f"{split}_y"]
        if x.ndim != 3 or x.dtype != np.uint8:
            raise ValueError(f"{directory / xname}: expected 3-D uint8 images, got {x.ndim}-D {x.dtype}")
        if y.ndim != 1:
            raise ValueError(f"{directory / yname}: expected 1-D labels, got {y.ndim}-D")
        if y.size and (y.min() < 0 or y.max() > 9):
            raise ValueError(f"{directory / yname}: labels must be in 0..9, got {y.min()}..{y.max()}")
        if len(x) != len(y):
            raise ValueError(f"{directory}: {xname} has {len(x)} images but {yname} has {len(y)} labels")
    if arrays["train_x"].shape[1:] != arrays["test_x"].shape[1:]:
        raise ValueError(f"{directory}: train/test image sizes differ")

    def images(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.float32) / 255.0)

    def labels(a: np.ndarray) -> torch.Tensor:
        return torch.from_numpy(a.astype(np.int64))

    _, h, w = arrays["train_x"].shape
    return Dataset(
        train_x=images(arrays["train_x"]),
        train_y=labels(arrays["train_y"]),
        test_x=images(arrays["test_x"]),
        test_y=labels(arrays["test_y"]),
        in_features=h * w,
    )


def _digits_arrays() -> tuple[np.ndarray, np.ndarray]:
    """sklearn's 8x8 digits as (images (1797, 8, 8) float64 in 0..16, labels (1797,) int64).

    Parses the CSV that ships inside scikit-learn, exactly as ``load_digits``
    does, without importing ``sklearn.datasets`` (which pulls in scipy and costs
    seconds per rank on a small CPU box). Falls back to ``load_digits``.
    """
    spec = importlib.util.find_spec("sklearn")
    if spec is not None and spec.origin is not None:
        csv = Path(spec.origin).parent / "datasets" / "data" / "digits.csv.gz"
        if csv.is_file():
            data = np.loadtxt(csv, delimiter=",")
            return data[:, :-1].reshape(-1, 8, 8), data[:, -1].astype(np.int64)
    from sklearn.datasets import load_digits

    bunch = load_digits()
    return bunch.images, bunch.target.astype(np.int64)


def _load_digits(seed: int) -> Dataset:
    images, target = _digits_arrays()
    x = torch.from_numpy((images / 16.0).astype(np.float32))  # (1797, 8, 8) in [0, 1]
    y = torch.from_numpy(target)
    n = len(y)
    n_test = int(round(n * DIGITS_TEST_FRACTION))
    perm = torch.randperm(n, generator=torch.Generator().manual_seed(_derive_seed("split", seed)))
    test_idx, train_idx = perm[:n_test], perm[n_test:]
    return Dataset(
        train_x=x[train_idx],
        train_y=y[train_idx],
        test_x=x[test_idx],
        test_y=y[test_idx],
        in_features=8 * 8,
    )


def load_dataset(spec: str = "digits", seed: int = 0) -> Dataset:
    """Load ``"digits"`` (sklearn 8x8 digits, seeded 80/20 split) or ``"mnist:DIR"``.

    For MNIST, DIR holds the four standard IDX files (each optionally ``.gz``);
    its fixed train/t10k split is used and ``seed`` is ignored.
    Raises ``ValueError`` for an unknown spec or malformed files and
    ``FileNotFoundError`` for missing MNIST files.
    """
    if spec == "digits":
        return _load_digits(seed)
    if spec.startswith("mnist:"):
        directory = spec[len("mnist:"):]
        if not directory:
            raise ValueError("dataset spec 'mnist:' needs a directory, e.g. 'mnist:/data/mnist'")
        return _load_mnist(Path(directory))
    raise ValueError(f"unknown dataset spec {spec!r}; expected 'digits' or 'mnist:DIR'")


def _derive_seed(*parts: object) -> int:
    """Stable 63-bit seed from arbitrary parts (independent of PYTHONHASHSEED)."""
    digest = hashlib.sha256(repr(parts).encode()).digest()
    return int.from_bytes(digest[:8], "big") & ((1 << 63) - 1)


def batch_indices(
    seed: int, step: int, rank: int, world_size: int, batch_size: int, n_train: int
) -> torch.Tensor:
    """Training-set indices (int64, shape (batch_size,)) for ``rank`` at ``step``.

    Each epoch is a permutation of range(n_train) drawn from a private
    generator seeded with (seed, epoch) and cut into global batches of
    world_size * batch_size, dropping the remainder (drop_last), so an epoch
    lasts n_train // (world_size * batch_size) steps. Rank r takes the r-th
    slice of length batch_size of the global batch, so ranks are disjoint
    within a step. A pure function of its arguments (no global RNG state): a
    restarted job resumes on exactly the same batches. Raises ``ValueError`` on
    bad arguments, including world_size * batch_size > n_train.
    """
    global_batch = world_size * batch_size
    if n_train <= 0 or batch_size <= 0 or world_size <= 0:
        raise ValueError("n_train, batch_size and world_size must be positive")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank {rank} out of range for world_size {world_size}")
    if step < 0:
        raise ValueError(f"step must be >= 0, got {step}")
    if global_batch > n_train:
        raise ValueError(
            f"global batch world_size*batch_size = {world_size}*{batch_size} = {global_batch} "
            f"exceeds the {n_train} training samples; lower --batch_size"
        )
    steps_per_epoch = n_train // global_batch
    epoch, k = divmod(step, steps_per_epoch)
    gen = torch.Generator().manual_seed(_derive_seed("epoch", seed, epoch))
    perm = torch.randperm(n_train, generator=gen)
    start = k * global_batch + rank * batch_size
    return perm[start : start + batch_size].clone()


@torch.no_grad()
def evaluate(model: nn.Module, ds: Dataset) -> float:
    """Top-1 accuracy in [0, 1] of ``model`` on the test split (restores train mode)."""
    was_training = model.training
    model.eval()
    try:
        pred = model(ds.test_x).argmax(dim=1)
        return float((pred == ds.test_y).float().mean().item())
    finally:
        model.train(was_training)


def params_sha256(model: nn.Module) -> str:
    """Hex sha256 over the raw bytes of all parameters in ``named_parameters()`` order."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def final_line(step: int, loss: float, acc: float, digest: str) -> str:
    """The one-line summary the launcher tests grep for."""
    return f"final step={step} loss={loss:.6f} test_accuracy={acc:.4f} params_sha256={digest}"


def add_common_args(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add the training flags shared by the example scripts; returns ``parser``."""
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps (default: 300)")
    parser.add_argument("--batch_size", type=int, default=32, help="per-rank batch size (default: 32)")
    parser.add_argument("--lr", type=float, default=0.05, help="SGD learning rate (default: 0.05)")
    parser.add_argument("--momentum", type=float, default=0.9, help="SGD momentum (default: 0.9)")
    parser.add_argument("--seed", type=int, default=0, help="seed for init, split and batches (default: 0)")
    parser.add_argument(
        "--data", default="digits", help="'digits' (sklearn, default) or 'mnist:DIR' (IDX files in DIR)"
    )
    parser.add_argument("--device", default="cpu",
                        help="where the model and data live (default: cpu; cuda: each rank on its node's GPUs, "
                             "shared round-robin, gradients averaged over gloo with CUDA tensors)")
    return parser
