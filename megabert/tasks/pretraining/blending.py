"""Weighted blends of datasets (--data-path `0.3 A 0.7 B`), as Megatron's BlendedDataset: each
next sample comes from the dataset furthest behind its share (helpers.cpp). Megatron's indexed
data (indexed_splits) and NVIDIA's shards (nvidia_samples) both blend."""
from __future__ import annotations

import numpy as np
import torch

from megabert.errors import DataError
from megabert.tasks.pretraining.cpp_helpers import build_blending_indices


class BlendedDataset(torch.utils.data.Dataset):
    """Interleaves datasets by weight; sample i comes from dataset_index[i], its sample_index[i]."""

    def __init__(self, datasets: list, weights: list[float], size: int):
        self.datasets, self.weights = datasets, weights
        self.dataset_index, self.sample_index = build_blending_indices(np.asarray(weights, np.float64), size)
        for k, ds in enumerate(datasets):
            taken = self.sample_index[self.dataset_index == k]
            if len(taken) and taken.max() >= len(ds):
                raise DataError(f"blend component {k} has {len(ds)} samples but the blend needs {taken.max() + 1}")

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, idx: int) -> dict:
        return self.datasets[int(self.dataset_index[idx])][int(self.sample_index[idx])]

    def masked_sample(self, idx: int, mask_prob: float) -> dict:
        """Sample idx of the blend masked at `mask_prob` (the rate of idx, not of the component's index)."""
        return self.datasets[int(self.dataset_index[idx])].masked_sample(int(self.sample_index[idx]), mask_prob)

    def sample_error(self, idx: int, error: Exception):
        """The component's account of a sample it could not read (megabert.data.sample_errors)."""
        part = self.datasets[int(self.dataset_index[idx])]
        return part.sample_error(int(self.sample_index[idx]), error)
