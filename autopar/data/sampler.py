"""Which samples a step trains on: a global order from the seed and the step alone, never the plan.

    sampler = GlobalSampler(num_samples=len(data), global_batch=32, seed=0)
    sampler.global_indices(step)                  # the step's 32 sample indices, whatever the plan
    sampler.local_indices(step, dp_rank, dp_size) # this data-parallel rank's contiguous share

Epoch ``e`` is a permutation of every sample index drawn from a generator
seeded by ``(seed, e)`` (or the identity without shuffling); it is cut into
``num_samples // global_batch`` global batches in order, the remainder of
the permutation left out that epoch (so every global batch is full). Step
``k`` is batch ``k mod steps_per_epoch`` of epoch ``k // steps_per_epoch``.
Nothing else enters: not the world size, the mesh, microbatches, or how
many steps a process has run. So the data position is one integer — the
next step — and a job resumed under any plan, with the same global batch,
trains on exactly the samples an uninterrupted one would have.

A data-parallel rank's share of a global batch is the contiguous slice
``[r·B/dp, (r+1)·B/dp)`` of the step's indices, which is what
``ParallelModel.local_batch`` cuts from a global batch tensor
(``chunk(dp)[r]``): the ranks of one pipeline and of one tensor-parallel
group share a dp coordinate, and so the same inputs and targets, as
``train_step`` expects. Within a share, the plan's microbatches are
consecutive slices again (``train_step`` splits them), so gradient
accumulation over a larger share sums the same samples as dp ranks would.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import torch

from autopar.errors import DataError


def _epoch_seed(seed: int, epoch: int) -> int:
    """A 63-bit generator seed for (seed, epoch): distinct pairs give unrelated orders."""
    digest = hashlib.sha256(f"autopar-data:{seed}:{epoch}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


@dataclass
class GlobalSampler:
    """The global order of samples over epochs (see the module docstring)."""

    num_samples: int
    global_batch: int
    seed: int = 0
    shuffle: bool = True
    _order: tuple[int, torch.Tensor] | None = field(default=None, repr=False)

    def __post_init__(self) -> None:
        if self.global_batch < 1:
            raise DataError(f"the global batch must be at least 1 sample, got {self.global_batch}")
        if self.num_samples < self.global_batch:
            raise DataError(f"the data holds {self.num_samples:,} samples, fewer than one global batch of "
                            f"{self.global_batch}: use more data, shorter sequences or a smaller batch")

    @property
    def steps_per_epoch(self) -> int:
        return self.num_samples // self.global_batch

    def epoch_order(self, epoch: int) -> torch.Tensor:
        """Every sample index in epoch ``epoch``'s order (int64)."""
        if self._order is not None and self._order[0] == epoch:
            return self._order[1]
        if self.shuffle:
            g = torch.Generator().manual_seed(_epoch_seed(self.seed, epoch))
            order = torch.randperm(self.num_samples, generator=g)
        else:
            order = torch.arange(self.num_samples)
        self._order = (epoch, order)
        return order

    def position(self, step: int) -> tuple[int, int]:
        """(epoch, batch within the epoch) of ``step``."""
        if step < 0:
            raise DataError(f"a step is at least 0, got {step}")
        return divmod(step, self.steps_per_epoch)

    def global_indices(self, step: int) -> torch.Tensor:
        """The ``global_batch`` sample indices of ``step``, in order."""
        epoch, batch = self.position(step)
        start = batch * self.global_batch
        return self.epoch_order(epoch)[start:start + self.global_batch]

    def local_indices(self, step: int, dp_rank: int, dp_size: int) -> torch.Tensor:
        """Data-parallel rank ``dp_rank``'s contiguous share of ``step``'s global batch."""
        return shard(self.global_indices(step), dp_rank, dp_size)


def shard(indices: torch.Tensor, dp_rank: int, dp_size: int) -> torch.Tensor:
    """Share ``dp_rank`` of ``dp_size`` equal contiguous shares of ``indices`` along dim 0 (as
    ``local_batch`` cuts a global batch)."""
    n = indices.shape[0]
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"data-parallel rank {dp_rank} of {dp_size} does not exist")
    if n % dp_size:
        raise DataError(f"a global batch of {n} samples does not split into {dp_size} equal data-parallel shares")
    per = n // dp_size
    return indices[dp_rank * per:(dp_rank + 1) * per]


def tokens_hash(windows: torch.Tensor) -> str:
    """sha256 (first 16 hex digits) of a global batch's token ids as int64, row by row: the same
    whatever the plan, so runs under different plans can be compared step for step."""
    data = windows.detach().to(torch.int64).contiguous().cpu().numpy().tobytes()
    return hashlib.sha256(data).hexdigest()[:16]
