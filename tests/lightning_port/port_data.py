"""What the ported Lightning examples and docs pages share: quiet Trainer settings and MNIST-shaped data."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

QUIET = dict(enable_progress_bar=False, enable_model_summary=False, accelerator="cpu")


def fake_mnist(samples: int = 64, seed: int = 0) -> TensorDataset:
    """MNIST's shapes ((1, 28, 28) images, 10 classes) with a learnable signal: the class sets one pixel row (a
    download replaced by synthetic tensors)."""
    generator = torch.Generator().manual_seed(seed)
    labels = torch.randint(0, 10, (samples,), generator=generator)
    images = torch.rand(samples, 1, 28, 28, generator=generator) * 0.1
    images[torch.arange(samples), 0, labels * 2, :] = 1.0
    return TensorDataset(images, labels)
