"""Training data: token files and text packed into sequences, a global order of samples from the seed
and the step alone, each data-parallel rank's share, and a data position a checkpoint holds.

    data = open_dataset("corpus.txt", seq_len=256)          # or a .bin of uint16/uint32 token ids
    loader = DataLoader.for_model(data, pm, seed=0)         # this rank's share, from pm.step on
    for batch in loader:
        pm.train_step(batch.inputs, batch.targets)

:mod:`~autopar.data.dataset` (files, packing, identity), :mod:`~autopar.data.sampler` (the global
order, a rank's share, the tokens hash), :mod:`~autopar.data.loader` (read-ahead, state). The
runtime may import this package; it imports nothing above :mod:`autopar.errors`.
"""

from autopar.data.dataset import (
    BYTE_VOCAB,
    DatasetIdentity,
    PackedDataset,
    TextDataset,
    TokenFileDataset,
    open_dataset,
)
from autopar.data.loader import Batch, DataLoader
from autopar.data.sampler import GlobalSampler, shard, tokens_hash

__all__ = ["BYTE_VOCAB", "Batch", "DataLoader", "DatasetIdentity", "GlobalSampler", "PackedDataset", "TextDataset",
           "TokenFileDataset", "open_dataset", "shard", "tokens_hash"]
