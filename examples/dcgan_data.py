"""Data and final line for dcgan.py and dcgan_torchrun.py (pytorch/examples' dcgan/main.py ported).

No torchvision and no download: the images are a seeded set of random 3xSxS tensors in [-1, 1]
(the range of upstream's ``Normalize((0.5,)*3, (0.5,)*3)``), made the same in every process from a
generator of their own, so neither the data nor its making touches torch's global random stream.
"""

from __future__ import annotations

import hashlib

import torch
from torch.utils.data import TensorDataset


def dataset(num_images: int, image_size: int, seed: int) -> TensorDataset:
    """``num_images`` random 3 x ``image_size`` x ``image_size`` images in [-1, 1], a function of ``seed``.

    A batch of it is a one-element list ``[images]``, as upstream's ``data[0]`` expects.
    """
    generator = torch.Generator().manual_seed(seed)
    images = torch.rand(num_images, 3, image_size, image_size, generator=generator) * 2 - 1
    return TensorDataset(images)


def state_sha256(*modules: torch.nn.Module) -> str:
    """SHA-256 of the modules' ``state_dict()`` tensors (parameters and buffers: BatchNorm's running
    statistics and batch counts too), module after module, each in its ``state_dict`` order."""
    h = hashlib.sha256()
    for module in modules:
        for tensor in module.state_dict().values():
            h.update(tensor.detach().cpu().contiguous().numpy().tobytes())
    return h.hexdigest()


def final_line(steps: int, loss: float, netG: torch.nn.Module, netD: torch.nn.Module) -> str:
    """The line the tests compare: steps, rank 0's last ``Loss_D``, and the digest of netG's then
    netD's parameters and buffers (a GAN has no test accuracy: ``n/a``)."""
    return f"final step={steps} loss={loss:.6f} test_accuracy=n/a params_sha256={state_sha256(netG, netD)}"
