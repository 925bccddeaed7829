"""Data and final line for time_sequence_prediction.py and its torchrun twin (pytorch/examples'
time_sequence_prediction, ported).

Upstream writes its sine waves to ``traindata.pt`` with generate_sine_wave.py (N=100 waves of
L=1000 samples, period 2*pi*T with T=20, each shifted by a random offset drawn after
``np.random.seed(2)``) and train.py loads them. Here they are made in memory by the same formula
and the same draws (a ``RandomState(2)`` of their own, which leaves numpy's global stream alone),
with N and L as arguments: ``sine_waves(100, 1000)`` is upstream's file's array.
"""

from __future__ import annotations

import hashlib

import numpy as np
import torch

T = 20


def sine_waves(n: int, length: int) -> np.ndarray:
    """``n`` shifted sine waves of ``length`` samples, float64, shape (n, length)."""
    rng = np.random.RandomState(2)
    x = np.empty((n, length), 'int64')
    x[:] = np.array(range(length)) + rng.randint(-4 * T, 4 * T, n).reshape(n, 1)
    return np.sin(x / 1.0 / T).astype('float64')


def final_line(steps: int, test_loss: float, model: torch.nn.Module) -> str:
    """The line the tests compare: steps, the last step's test loss, the SHA-256 of the model's
    ``state_dict()`` tensors (its parameters: the LSTM cells hold no buffers). A regression has no
    test accuracy: ``n/a``."""
    h = hashlib.sha256()
    for tensor in model.state_dict().values():
        h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return f"final step={steps} loss={test_loss:.9f} test_accuracy=n/a params_sha256={h.hexdigest()}"
