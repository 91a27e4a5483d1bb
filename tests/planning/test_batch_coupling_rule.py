"""The batch-coupling rule on its own (:mod:`autopar.batch_coupling`): which splits a plan's coupled
layers see, and the rows one process takes for each, in the order the runtime cuts them."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from autopar.batch_coupling import groups, refusal, take
from autopar.choice import BatchCoupling
from autopar.mesh import Mesh

NORM = SimpleNamespace(name="bn", sync_norm_channels=(4,), moe=())
CAPACITY = SimpleNamespace(name="moe", sync_norm_channels=(), moe=(SimpleNamespace(split_refusal="drops"),))
PLAIN = SimpleNamespace(name="fc", sync_norm_channels=(), moe=())


def test_the_splits_each_choice_gives_and_the_rows_of_each() -> None:
    auto, split, exact = BatchCoupling.AUTO, BatchCoupling.SPLIT, BatchCoupling.EXACT
    assert groups([PLAIN], 2, 2, auto) is None and groups([NORM], 2, 1, auto) is None
    assert groups([NORM], 2, 2, auto) == [[(0, 0), (1, 0)], [(0, 1), (1, 1)]]  # per microbatch, over dp
    assert groups([NORM], 2, 1, split) == [[(0, 0)], [(1, 0)]]  # each rank its own statistics
    assert groups([CAPACITY], 2, 2, auto) == [[(0, 0)], [(0, 1)], [(1, 0)], [(1, 1)]]
    x = torch.arange(8)  # rank r holds rows 4r..4r+3, its microbatch i two of them
    assert take(x, [(0, 1), (1, 1)], 2, 2, 8).tolist() == [2, 3, 6, 7]
    rows = take({"a": x, "n": 3}, [(1, 0)], 2, 2, 8)
    assert rows["a"].tolist() == [4, 5] and rows["n"] == 3  # type: ignore[index]
    assert refusal([NORM], Mesh(dp=2), 2, exact) and refusal([NORM], Mesh(dp=2), 1, exact) is None
    assert refusal([CAPACITY], Mesh(dp=2), 1, exact) and refusal([CAPACITY], Mesh(dp=2), 2, auto) is None
    assert "see different splits" in refusal([NORM, CAPACITY], Mesh(dp=2), 1, auto)
    assert refusal([NORM, CAPACITY], Mesh(dp=2), 1, split) is None
