"""Datasets: the `Dataset` protocol, in-memory and iterable datasets, on-device arrays."""

from ._datasets import ArrayDataset as ArrayDataset
from ._datasets import Dataset as Dataset
from ._iterables import IterableDataset as IterableDataset

__all__ = ["ArrayDataset", "Dataset", "IterableDataset"]
