"""Batches for a data-parallel rank, read ahead in a thread, with a data position a checkpoint holds.

    data = autopar.data.open_dataset("corpus.txt", seq_len=256)
    loader = DataLoader.for_model(data, pm, seed=0)         # pm.dp_rank's share, from pm.step on
    if extra:                                                # pm.load(...) returned the saved extra
        loader.load_state_dict(extra["data"])               # refused if it is another dataset
    for batch in loader:                                     # batch.step == pm.step
        loss = pm.train_step(batch.inputs, batch.targets)
        ...
        pm.save(path, extra={"data": loader.state_dict()})

Each batch is this rank's share of the step's global batch
(:class:`autopar.data.sampler.GlobalSampler`: the order depends on the seed
and the step only), read from the dataset by a background thread
``prefetch`` steps ahead, so the training step does not wait on the file;
:attr:`DataLoader.wait_s` adds up the time ``next`` did wait. With
``hashes=True`` each batch also carries ``tokens_hash``: the hash of the
whole global batch's token ids, the same under every plan (what the
metrics file records so runs can be compared step for step).

The state (:meth:`DataLoader.state_dict`) is plain ints and strings, for a
checkpoint's ``extra``: the next step, its epoch and sample offset in the
epoch, the seed, the global batch, the sequence length and the dataset's
identity (path, bytes, encoding, tokens, fingerprint). Packing is fixed by
the file (:mod:`autopar.data.dataset`), so no tokens are buffered between
steps and the step is the whole position. :meth:`DataLoader.load_state_dict`
refuses a state from another dataset naming both, and one with another
global batch, sequence length or seed (the order would not continue).

Why not torchdata's ``StatefulDataLoader``: it installs from PyPI (0.11.0,
checked) but its state is one rank's — the count of samples that rank's
sampler has yielded — and a checkpoint's ``extra`` is rank 0's. Resumed
under another data-parallel degree, that count indexes another rank's
order: a check here (global batch 4, dp 2 for 3 steps, resumed at dp 1
from rank 0's state) repeated 4 of the 12 samples already seen in the next
batch. The state has to be global; with the order a function of the step,
a plain index sampler is exact and has no workers to restore.
"""

from __future__ import annotations

import dataclasses
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from autopar.data.dataset import DatasetIdentity, PackedDataset
from autopar.data.sampler import GlobalSampler, shard, tokens_hash
from autopar.errors import DataError

STATE_VERSION = 1


@dataclass(frozen=True)
class Batch:
    """One step's data for this rank: ``inputs`` and ``targets`` ``(local samples, seq_len)`` int64."""

    step: int
    epoch: int
    inputs: torch.Tensor
    targets: torch.Tensor
    global_tokens: int  # tokens the whole step trains on (every dp rank's inputs)
    tokens_hash: str | None = None  # of the global batch's windows (hashes=True)


class DataLoader:
    """This data-parallel rank's batches, step after step from ``step`` (see the module docstring)."""

    def __init__(self, dataset: PackedDataset, global_batch: int, *, dp_rank: int = 0, dp_size: int = 1,
                 seed: int = 0, shuffle: bool = True, step: int = 0, prefetch: int = 2, hashes: bool = False,
                 sequence_shard: Callable[[torch.Tensor], torch.Tensor] | None = None):
        """``sequence_shard``: what cuts this rank's samples to its share of the sequence (under cp, a
        ParallelModel's :meth:`~autopar.ParallelModel.sequence_shard`), applied as each batch is handed out."""
        self.dataset = dataset
        self.sequence_shard = sequence_shard
        dataset.require_batch(global_batch)
        self.sampler = GlobalSampler(len(dataset), global_batch, seed, shuffle)
        shard(torch.arange(global_batch), dp_rank, dp_size)  # the batch splits into the dp shares
        self.dp_rank, self.dp_size, self.prefetch, self.hashes = dp_rank, dp_size, prefetch, hashes
        self.step = step
        self.wait_s = 0.0
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        self._queue: queue.Queue = queue.Queue(maxsize=max(1, prefetch))

    @classmethod
    def for_model(cls, dataset: PackedDataset, pm: Any, **kwargs: Any) -> DataLoader:
        """A loader feeding ``pm`` (a ParallelModel): its global batch, its dp share, from its step."""
        return cls(dataset, pm.dp_size * pm.local_batch_size, dp_rank=pm.dp_rank, dp_size=pm.dp_size,
                   step=pm.step, sequence_shard=pm.sequence_shard, **kwargs)

    @property
    def global_batch(self) -> int:
        return self.sampler.global_batch

    # -------------------------------------------------------------- reading

    def read(self, step: int) -> Batch:
        """Step ``step``'s batch for this rank, read now (the thread calls this)."""
        epoch, _ = self.sampler.position(step)
        indices = self.sampler.global_indices(step)
        digest = None
        if self.hashes:
            windows = self.dataset.windows(indices)
            digest = tokens_hash(windows)
            windows = shard(windows, self.dp_rank, self.dp_size)
        else:
            windows = self.dataset.windows(shard(indices, self.dp_rank, self.dp_size))
        return Batch(step, epoch, windows[:, :-1], windows[:, 1:], self.global_batch * self.dataset.seq_len, digest)

    def _produce(self, start: int, stop: threading.Event, out: queue.Queue) -> None:
        step = start
        while not stop.is_set():
            try:
                item: Any = self.read(step)
            except Exception as exc:  # noqa: BLE001 - handed to the consumer, which raises it
                item = exc
            while not stop.is_set():
                try:
                    out.put(item, timeout=0.1)
                    break
                except queue.Full:
                    continue
            if isinstance(item, Exception):
                return
            step += 1

    def _start(self) -> None:
        self._stop = threading.Event()
        self._queue = queue.Queue(maxsize=self.prefetch)
        self._thread = threading.Thread(target=self._produce, args=(self.step, self._stop, self._queue),
                                        name="autopar-data", daemon=True)
        self._thread.start()

    def __iter__(self) -> DataLoader:
        return self

    def __next__(self) -> Batch:
        t = time.perf_counter()
        if self.prefetch < 1:
            batch = self.read(self.step)
        else:
            if self._thread is None:
                self._start()
            item = self._queue.get()
            if isinstance(item, Exception):
                self.close()
                raise item
            batch = item
        self.wait_s += time.perf_counter() - t
        assert batch.step == self.step, (batch.step, self.step)
        self.step += 1
        if self.sequence_shard is not None:  # here, not in the reading thread: it asks the device mesh
            batch = dataclasses.replace(batch, inputs=self.sequence_shard(batch.inputs),
                                        targets=self.sequence_shard(batch.targets))
        return batch

    def seek(self, step: int) -> None:
        """Continue from ``step`` (what was read ahead is dropped)."""
        self.close()
        self.sampler.position(step)  # a negative step is refused here
        self.step = step

    def close(self) -> None:
        """Stop the read-ahead thread (it ends within a tenth of a second)."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
            self._thread = None

    def __enter__(self) -> DataLoader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -------------------------------------------------------------- state

    def state_dict(self) -> dict[str, Any]:
        """The data position, plain ints and strings (see the module docstring)."""
        epoch, batch = self.sampler.position(self.step)
        return {"version": STATE_VERSION, "step": self.step, "epoch": epoch, "position": batch * self.global_batch,
                "seed": self.sampler.seed, "shuffle": self.sampler.shuffle, "global_batch": self.global_batch,
                "seq_len": self.dataset.seq_len, "dataset": self.dataset.identity.to_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue where ``state`` was saved; a DataError if it belongs to other data or another order."""
        check_state(state, self)
        self.seek(int(state["step"]))


def check_state(state: dict[str, Any], loader: DataLoader) -> None:
    """Refuse a saved data position that this loader cannot continue exactly, naming both sides."""
    if not isinstance(state, dict) or state.get("version") != STATE_VERSION or "dataset" not in state:
        raise DataError(f"the checkpoint's data state is not one this autopar writes (got {type(state).__name__} "
                        f"{str(state)[:80]})")
    saved = DatasetIdentity.from_dict(state["dataset"])
    here = loader.dataset.identity
    if not saved.same_data(here):
        raise DataError(f"the checkpoint was trained on {saved.describe()}, this run reads {here.describe()}: "
                        "resume with the same data, or start a new checkpoint directory")
    ours = {"global_batch": loader.global_batch, "seq_len": loader.dataset.seq_len,
            "seed": loader.sampler.seed, "shuffle": loader.sampler.shuffle}
    differ = [f"{k} {state.get(k)} there, {v} here" for k, v in ours.items() if state.get(k) != v]
    if differ:
        raise DataError(f"the checkpoint's data order cannot continue in this run ({'; '.join(differ)}): "
                        "resume with the same settings")
