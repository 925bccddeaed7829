"""Fingerprints of tensors, to check exactly-once while training runs.

ftrun promises that a run with recovered faults ends with the parameters of the run without. Two
checks make a break of that promise loud instead of silent:

- each rank fingerprints its *local* gradient (before averaging) at every step's all-reduce and
  keeps it next to its rank state (:mod:`ftrun.rank.rankstate`); a rank that computes a step again (a
  retried step, or a respawned rank recomputing the step its predecessor computed but did not see
  committed) compares: the same state must give the same bits, so a difference is state the script
  carries outside what ftrun restores (an unregistered carried tensor, a global, a random draw);
- after every recovery, replicas compare fingerprints of their parameters.

A fingerprint is XXH3-128 (the ``xxhash`` package) over the tensors' shapes, dtypes and each CPU
tensor's bytes, read in place: about 20 us for word_lm's 1.1 MB of gradients where SHA-1 over a
CRC-32 of each took 260 us (it ran at every step's all-reduce, 4% of a small step). A
changed bit changes it; two different gradients share it with probability about 2^-128, which is
a detector's budget, not a signature's (XXH3 is not cryptographic: no one forges a gradient here). A tensor on an accelerator is not copied
to the host: there, per tensor, the sum and the sum of squares of its elements' bit patterns as
64-bit integers (wrapping) are computed on the device and hashed; one changed element changes
them, as does nearly any change of several (only a permutation of equal bit patterns goes unseen).
"""

from __future__ import annotations

from typing import Iterable

import torch
import xxhash

_INT_OF_SIZE = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def tensor_sums(t: torch.Tensor) -> torch.Tensor:
    """``[sum, sum of squares]`` (int64, wrapping) of the bit patterns of ``t``'s elements."""
    flat = t.detach().resolve_conj().resolve_neg().reshape(-1)  # the values, not a lazy view's base
    if flat.is_complex():
        flat = torch.view_as_real(flat).reshape(-1)
    bits = flat.view(_INT_OF_SIZE[flat.element_size()]).to(torch.int64)
    return torch.stack([bits.sum(), (bits * bits).sum()])


class Fingerprint:
    """A fingerprint built piece by piece (:func:`fingerprint` is one over a sequence): XXH3-128 of
    each CPU tensor's bytes, read in place, and of the per-tensor sums of the others (hashed once,
    at :meth:`hexdigest`: one device sync).

    Args:
        describe: hash each tensor's shape and dtype before its bytes (and None as absent), so that
            the same bytes in another shape differ; without it, only the bytes count (the gradient
            reducer's flattened buckets: one update each, no per-tensor overhead).
    """

    def __init__(self, describe: bool = True) -> None:
        self._h = xxhash.xxh3_128()
        self._sums: list[torch.Tensor] = []
        self._describe = describe

    def update(self, t: torch.Tensor | None) -> None:
        """Add ``t`` (any shape, dtype, device; None: absent)."""
        if t is None:
            self._h.update(b"none;")
            return
        if self._describe:
            self._h.update(f"{tuple(t.shape)}:{t.dtype};".encode())
        if t.device.type == "cpu":
            flat = t.detach().resolve_conj().resolve_neg().contiguous().reshape(-1)
            if flat.numel():
                if flat.is_complex():
                    flat = torch.view_as_real(flat).reshape(-1)
                self._h.update(flat.view(torch.uint8).numpy())
        else:
            self._sums.append(tensor_sums(t))

    def hexdigest(self) -> str:
        """The fingerprint so far (32 hex digits)."""
        if self._sums:
            h = self._h.copy()
            h.update(torch.stack(self._sums).cpu().numpy().tobytes())
            return h.hexdigest()
        return self._h.hexdigest()


def fingerprint(tensors: Iterable[torch.Tensor | None]) -> str:
    """The fingerprint (32 hex digits) of a sequence of tensors, in order; None counts as absent."""
    f = Fingerprint()
    for t in tensors:
        f.update(t)
    return f.hexdigest()


def first_difference(names: list[str], a: list[torch.Tensor], b: list[torch.Tensor]) -> str | None:
    """The name of the first tensor where ``a`` and ``b`` differ bitwise (None: all equal)."""
    for name, x, y in zip(names, a, b):
        if x.shape != y.shape or x.dtype != y.dtype or not torch.equal(x.reshape(-1).view(_INT_OF_SIZE[x.element_size()]),
                                                                        y.reshape(-1).view(_INT_OF_SIZE[y.element_size()])):
            return name
    return None
