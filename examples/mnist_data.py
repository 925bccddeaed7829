"""Data for mnist.py and mnist_torchrun.py: scikit-learn's digits scaled to 28x28 (or MNIST).

The 8x8 digits (seeded 80/20 split, see digits_common) are resized to MNIST's 28x28 (bilinear) and
normalized with MNIST's mean and std, as pytorch/examples' transform does, so the upstream Net runs
unchanged. ``mnist:DIR`` reads the IDX files instead.
"""

from __future__ import annotations

import hashlib
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.utils.data import TensorDataset

_HERE = str(Path(__file__).resolve().parent)
if _HERE not in sys.path:
    sys.path.insert(0, _HERE)
import digits_common as dc  # noqa: E402

MEAN, STD = 0.1307, 0.3081


def _images(x: torch.Tensor) -> torch.Tensor:
    x = x[:, None].float()
    if x.shape[-1] != 28:
        x = F.interpolate(x, size=(28, 28), mode="bilinear", align_corners=False)
    return (x - MEAN) / STD


def datasets(spec: str, seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, test) datasets of (1x28x28 image, label)."""
    ds = dc.load_dataset(spec, seed)
    return TensorDataset(_images(ds.train_x), ds.train_y), TensorDataset(_images(ds.test_x), ds.test_y)


def final_line(steps: int, loss: float, acc: float, model: torch.nn.Module) -> str:
    """The line the tests compare: steps, last loss, test accuracy, SHA-256 of the parameters."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return f"final step={steps} loss={loss:.6f} test_accuracy={acc:.4f} params_sha256={h.hexdigest()}"
