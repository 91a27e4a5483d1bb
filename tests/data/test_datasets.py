"""The data pipeline without a process group: files and packing, the global order and each rank's share,
the data position and its refusals, bad input (each one typed line, before anything starts)."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from autopar.data import DataLoader, GlobalSampler, open_dataset, shard, tokens_hash
from autopar.errors import DataError


def _bin(path: Path, tokens: np.ndarray) -> Path:
    tokens.tofile(path)
    return path


@pytest.fixture
def tokens_bin(tmp_path: Path) -> Path:
    return _bin(tmp_path / "train.bin", np.arange(1000, dtype=np.uint16) % 97)


def test_a_token_file_packs_into_windows_that_overlap_by_one_token(tokens_bin: Path) -> None:
    data = open_dataset(tokens_bin, seq_len=10, vocab_size=97)
    assert len(data) == (1000 - 1) // 10 == 99
    assert isinstance(data.tokens, np.memmap)  # read through a memory map, not loaded
    x, y = data.batch([0, 5, 98])
    ref = np.arange(1000) % 97
    assert x.dtype == y.dtype == torch.int64 and x.shape == y.shape == (3, 10)
    assert x[1].tolist() == ref[50:60].tolist() and y[1].tolist() == ref[51:61].tolist()
    assert y[2, -1].item() == ref[990]  # the last window ends at token 990: 9 tokens are a short tail
    with pytest.raises(IndexError):
        data.windows([99])
    wide = _bin(tokens_bin.with_name("wide.bin"), np.array([70000, 1, 2, 3, 4], dtype=np.uint32))
    assert open_dataset(wide, seq_len=2, dtype="uint32").batch([0])[0].tolist() == [[70000, 1]]


def test_text_is_bytes_by_default_or_a_tokenizers_ids(tmp_path: Path) -> None:
    path = tmp_path / "t.txt"
    path.write_text("héllo wörld, " * 20)
    data = open_dataset(path, seq_len=8)
    raw = path.read_bytes()
    assert data.identity.encoding == "text:bytes" and len(data.tokens) == len(raw)
    assert data.windows([1])[0].tolist() == list(raw[8:17])

    class Words:  # a tokenizer's interface: encode(text, add_special_tokens=...), vocab_size
        name_or_path, vocab_size = "words", 4

        def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
            assert not add_special_tokens
            return [len(w) % 4 for w in text.split()]

    words = open_dataset(path, seq_len=4, tokenizer=Words(), vocab_size=4)
    assert words.identity.encoding == "text:words" and len(words.tokens) == 40
    assert words.identity.fingerprint != data.identity.fingerprint  # the same file read another way


def test_the_global_order_depends_on_the_seed_and_the_step_alone() -> None:
    s = GlobalSampler(num_samples=50, global_batch=8, seed=3)
    assert s.steps_per_epoch == 6
    epoch0 = torch.cat([s.global_indices(k) for k in range(6)])
    assert len(set(epoch0.tolist())) == 48  # a permutation, 2 samples left out this epoch
    epoch1 = torch.cat([s.global_indices(k) for k in range(6, 12)])
    assert not torch.equal(epoch0, epoch1) and len(set(epoch1.tolist())) == 48
    again = GlobalSampler(num_samples=50, global_batch=8, seed=3)
    assert torch.equal(again.global_indices(9), s.global_indices(9))  # from the step, not from history
    assert not torch.equal(GlobalSampler(50, 8, seed=4).global_indices(0), s.global_indices(0))
    assert GlobalSampler(50, 8, shuffle=False).global_indices(1).tolist() == list(range(8, 16))
    # each rank's share is the slice ParallelModel.local_batch cuts from the global batch
    glob = s.global_indices(2)
    for dp in (1, 2, 4):
        shares = [s.local_indices(2, r, dp) for r in range(dp)]
        assert all(torch.equal(a, b) for a, b in zip(shares, glob.chunk(dp)))
    with pytest.raises(DataError, match="does not split into 3"):
        shard(glob, 0, 3)


def test_a_loader_reads_ahead_each_ranks_share_and_resumes_from_its_state(tokens_bin: Path) -> None:
    data = open_dataset(tokens_bin, seq_len=10)
    one = DataLoader(data, 8, hashes=True)
    full = [next(one) for _ in range(14)]  # past one epoch (12 steps of 8 of 99 samples)
    one.close()
    assert [b.epoch for b in full[11:13]] == [0, 1] and full[0].global_tokens == 80
    for b in full:
        windows = data.windows(one.sampler.global_indices(b.step))
        assert torch.equal(b.inputs, windows[:, :-1]) and b.tokens_hash == tokens_hash(windows)
    # dp = 2 for 5 steps, then its state continues on one rank: the same samples as the uninterrupted run
    ranks = [DataLoader(data, 8, dp_rank=r, dp_size=2, prefetch=3, hashes=r == 0) for r in range(2)]
    for k in range(5):
        shares = [next(loader) for loader in ranks]
        assert torch.equal(torch.cat([b.inputs for b in shares]), full[k].inputs)
        assert shares[0].tokens_hash == full[k].tokens_hash and shares[1].tokens_hash is None
    state = ranks[0].state_dict()
    assert state == ranks[1].state_dict()
    assert state["step"] == 5 and state["dataset"]["path"] == str(tokens_bin.resolve())
    assert all(isinstance(v, int | str | bool) for v in [*state.values(), *state["dataset"].values()]
               if not isinstance(v, dict))
    resumed = DataLoader(data, 8, prefetch=0, hashes=True)
    resumed.load_state_dict(state)
    for k in range(5, 14):
        b = next(resumed)
        assert b.step == k and b.tokens_hash == full[k].tokens_hash and torch.equal(b.targets, full[k].targets)
    assert resumed.wait_s > 0
    for loader in ranks:
        loader.close()


def test_a_data_state_from_other_data_or_another_order_is_refused_naming_both(tmp_path: Path,
                                                                              tokens_bin: Path) -> None:
    state = DataLoader(open_dataset(tokens_bin, seq_len=10), 8).state_dict()
    other = _bin(tmp_path / "other.bin", np.arange(1200, dtype=np.uint16) % 97)
    with pytest.raises(DataError) as err:
        DataLoader(open_dataset(other, seq_len=10), 8).load_state_dict(state)
    msg = str(err.value)
    assert str(tokens_bin.resolve()) in msg and str(other.resolve()) in msg and "\n" not in msg
    rewritten = _bin(tmp_path / "rewritten.bin", np.arange(1000, dtype=np.uint16) % 89)  # same size, other ids
    with pytest.raises(DataError, match="fingerprint"):
        DataLoader(open_dataset(rewritten, seq_len=10), 8).load_state_dict(state)
    moved = _bin(tmp_path / "moved.bin", np.arange(1000, dtype=np.uint16) % 97)  # same tokens elsewhere: fine
    DataLoader(open_dataset(moved, seq_len=10), 8).load_state_dict(state)
    with pytest.raises(DataError, match="global_batch 8 there, 16 here"):
        DataLoader(open_dataset(tokens_bin, seq_len=10), 16).load_state_dict(state)
    with pytest.raises(DataError, match="seq_len 10 there, 5 here"):
        DataLoader(open_dataset(tokens_bin, seq_len=5), 8).load_state_dict(state)
    with pytest.raises(DataError, match="not one this autopar writes"):
        DataLoader(open_dataset(tokens_bin, seq_len=10), 8).load_state_dict({"data_position": 4})


@pytest.mark.parametrize("how, message", [
    ("missing", "does not exist"),
    ("short", "holds 8 tokens, shorter than one sequence (seq_len 10 needs 11)"),
    ("vocab", "holds token id 300, beyond the model's vocabulary of 256"),
    ("odd_bytes", "not a whole number of uint16 tokens"),
    ("wrong_dtype", "holds token id 65,537, beyond the model's vocabulary of 50,304 (uint32): was it written as"),
    ("text_vocab", "holds token id 195, beyond the model's vocabulary of 128 (text:bytes)"),
    ("too_few_samples", "holds 4 samples of 10+1 tokens, fewer than one global batch of 8"),
])
def test_bad_input_is_one_typed_line(tmp_path: Path, how: str, message: str) -> None:
    path = tmp_path / "d.bin"
    kwargs: dict = {"seq_len": 10}
    if how == "short":
        _bin(path, np.arange(8, dtype=np.uint16))
    elif how == "vocab":
        _bin(path, np.array([1, 2, 300] * 10, dtype=np.uint16))
        kwargs["vocab_size"] = 256
    elif how == "odd_bytes":
        path.write_bytes(b"\x01\x00\x02")
    elif how == "wrong_dtype":  # uint16 ids read as uint32: two ids make one huge one
        _bin(path, np.array([1, 1] * 20, dtype=np.uint16))
        kwargs.update(dtype="uint32", vocab_size=50304)
    elif how == "text_vocab":
        path = tmp_path / "d.txt"
        path.write_text("é" * 40)
        kwargs["vocab_size"] = 128
    elif how == "too_few_samples":
        _bin(path, np.arange(50, dtype=np.uint16))
    with pytest.raises(DataError) as err:
        DataLoader(open_dataset(path, **kwargs), 8)
    assert message in str(err.value) and "\n" not in str(err.value)
