"""What train_real.py and its torchrun twin share: the data, the model, the evaluation, the final line.

Data: scikit-learn's handwritten digits (bundled with the package: 1,797 8x8 images, 10 classes),
standardised, split 80/20 by a seeded permutation, as tensors. The model is a small MLP with dropout
(so per-rank random state matters to the result).
"""
from __future__ import annotations

import hashlib

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.data import TensorDataset


def datasets(seed: int) -> tuple[TensorDataset, TensorDataset]:
    """(train, validation) as TensorDatasets of (float32 [64], int64 label)."""
    from sklearn.datasets import load_digits

    x, y = load_digits(return_X_y=True)
    x = torch.tensor(x, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(y, dtype=torch.int64)
    order = torch.randperm(len(y), generator=torch.Generator().manual_seed(seed))
    cut = int(0.8 * len(y))
    train, val = order[:cut], order[cut:]
    return TensorDataset(x[train], y[train]), TensorDataset(x[val], y[val])


class Net(nn.Module):
    def __init__(self, hidden: int = 256, dropout: float = 0.1):
        super().__init__()
        self.fc1 = nn.Linear(64, hidden)
        self.fc2 = nn.Linear(hidden, hidden)
        self.fc3 = nn.Linear(hidden, 10)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x):
        x = self.dropout(F.gelu(self.fc1(x)))
        x = self.dropout(F.gelu(self.fc2(x)))
        return self.fc3(x)


@torch.no_grad()
def evaluate(model: nn.Module, val: TensorDataset) -> tuple[float, float]:
    """(mean loss, accuracy) on the whole validation set; the model is left in train mode."""
    model.eval()
    x, y = val.tensors
    out = model(x)
    loss = F.cross_entropy(out, y).item()
    acc = (out.argmax(1) == y).float().mean().item()
    model.train()
    return loss, acc


def final_line(steps: int, loss: float, acc: float, model: nn.Module) -> str:
    """The line the tests compare: steps, last loss, validation accuracy, SHA-256 of the parameters."""
    h = hashlib.sha256()
    for _, p in model.named_parameters():
        h.update(p.detach().cpu().contiguous().numpy().tobytes())
    return f"final step={steps} loss={loss:.6f} test_accuracy={acc:.4f} params_sha256={h.hexdigest()}"
