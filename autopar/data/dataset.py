"""Token datasets: a file of token ids read through a memory map, or text tokenized once, both packed
into training windows of ``seq_len + 1`` tokens.

    data = open_dataset("train.bin", seq_len=1024, dtype="uint16", vocab_size=50304)   # nanoGPT's .bin
    data = open_dataset("corpus.txt", seq_len=256)          # bytes as tokens (vocabulary 256), no download
    data = open_dataset("corpus.txt", seq_len=256, tokenizer=AutoTokenizer.from_pretrained(...))
    x, y = data.batch(torch.tensor([3, 17]))                # inputs and next-token targets, (2, seq_len) int64

Packing: the file is one stream of tokens; sample ``i`` is the window
``tokens[i·seq_len : i·seq_len + seq_len + 1]``, its first ``seq_len``
tokens the inputs and its last ``seq_len`` the targets, so every token but
the first is a target exactly once an epoch (nanoGPT's contiguous packing,
without its random offsets: a sample is an index, and the sampler's order of
indices is all the data position there is). A stream of ``n`` tokens holds
``(n - 1) // seq_len`` samples; the tail shorter than a window is not used.

A dataset's :class:`DatasetIdentity` — path, size in bytes, how it is read
(``uint16``, ``uint32``, ``text:bytes``, ``text:<tokenizer>``), token
count and a content fingerprint — goes into checkpoints as plain strings
and ints, so a job resumed on another file (or the same path rewritten) is
refused by name (:mod:`autopar.data.loader`).

Bad input is a :class:`~autopar.errors.DataError` raised while opening,
before any process group is needed: a missing file, a token file whose size
is not a whole number of tokens, ids the model's vocabulary cannot hold
(``vocab_size``: the largest id in the file is found and named), a stream
shorter than one window.
"""

from __future__ import annotations

import hashlib
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from autopar.errors import DataError

TOKEN_DTYPES = {"uint16": np.uint16, "uint32": np.uint32}
BYTE_VOCAB = 256  # the default tokenizer: each UTF-8 byte is a token
_FINGERPRINT_CHUNK = 1 << 20  # the fingerprint reads this many bytes from each end of a file


@dataclass(frozen=True)
class DatasetIdentity:
    """What a checkpoint records of the data it was trained on (plain values, no pickle of objects)."""

    path: str
    size_bytes: int
    encoding: str  # uint16, uint32, text:bytes, text:<tokenizer name>
    tokens: int
    fingerprint: str  # sha256 of the size, the encoding and the file's first and last MiB

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> DatasetIdentity:
        return cls(str(data["path"]), int(data["size_bytes"]), str(data["encoding"]), int(data["tokens"]),
                   str(data["fingerprint"]))

    def describe(self) -> str:
        return f"{self.path} ({self.size_bytes:,} bytes, {self.encoding}, fingerprint {self.fingerprint[:12]})"

    def same_data(self, other: DatasetIdentity) -> bool:
        """The same tokens: size, encoding and content agree (the path may have moved)."""
        return (self.size_bytes, self.encoding, self.tokens, self.fingerprint) == \
            (other.size_bytes, other.encoding, other.tokens, other.fingerprint)


def _fingerprint(path: Path, size: int, encoding: str) -> str:
    h = hashlib.sha256(f"{size}:{encoding}:".encode())
    with open(path, "rb") as fh:
        h.update(fh.read(_FINGERPRINT_CHUNK))
        if size > _FINGERPRINT_CHUNK:
            fh.seek(max(_FINGERPRINT_CHUNK, size - _FINGERPRINT_CHUNK))
            h.update(fh.read())
    return h.hexdigest()


def _existing(path: str | Path) -> Path:
    path = Path(path)
    if not path.is_file():
        what = "is a directory, not a file" if path.is_dir() else "does not exist"
        raise DataError(f"data file {path} {what}")
    return path


class PackedDataset:
    """Windows of ``seq_len + 1`` tokens over a 1-D array of token ids (a memory map or an array)."""

    def __init__(self, tokens: np.ndarray, seq_len: int, identity: DatasetIdentity,
                 vocab_size: int | None = None):
        if seq_len < 1:
            raise DataError(f"seq_len must be at least 1, got {seq_len}")
        self.tokens, self.seq_len, self.identity = tokens, seq_len, identity
        n = len(tokens)
        if n < seq_len + 1:
            raise DataError(f"data file {identity.path} holds {n:,} tokens, shorter than one sequence "
                            f"(seq_len {seq_len} needs {seq_len + 1})")
        self.num_samples = (n - 1) // seq_len
        if vocab_size is not None:  # one pass over the file (a memory map: read, not loaded)
            top = int(tokens.max())
            if top >= vocab_size:
                raise DataError(f"data file {identity.path} holds token id {top:,}, beyond the model's "
                                f"vocabulary of {vocab_size:,} ({identity.encoding}): {self._vocab_hint()}")

    def _vocab_hint(self) -> str:
        return "tokenize it with the model's tokenizer, or build the model with a larger vocabulary"

    def require_batch(self, global_batch: int) -> None:
        """Raise DataError unless the data holds at least one global batch of samples."""
        if self.num_samples < global_batch:
            raise DataError(f"data file {self.identity.path} holds {self.num_samples:,} samples of "
                            f"{self.seq_len}+1 tokens, fewer than one global batch of {global_batch}: "
                            "use more data, shorter sequences or a smaller batch")

    def __len__(self) -> int:
        return self.num_samples

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({self.identity.path}, {len(self.tokens):,} tokens, "
                f"{self.num_samples:,} samples of {self.seq_len}+1)")

    def windows(self, indices: torch.Tensor | list[int]) -> torch.Tensor:
        """The samples at ``indices`` as one ``(len(indices), seq_len + 1)`` int64 tensor."""
        idx = torch.as_tensor(indices, dtype=torch.int64)
        if idx.numel() and (int(idx.min()) < 0 or int(idx.max()) >= self.num_samples):
            raise IndexError(f"sample indices must lie in [0, {self.num_samples}), got "
                             f"{int(idx.min())}..{int(idx.max())}")
        starts = idx.numpy()[:, None] * self.seq_len  # one gather: (n, seq_len + 1) positions
        return torch.from_numpy(np.asarray(self.tokens[starts + np.arange(self.seq_len + 1)], dtype=np.int64))

    def batch(self, indices: torch.Tensor | list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        """Inputs and next-token targets of the samples at ``indices``, each ``(n, seq_len)`` int64."""
        w = self.windows(indices)
        return w[:, :-1], w[:, 1:]


class TokenFileDataset(PackedDataset):
    """A flat binary file of token ids (nanoGPT's ``train.bin``), read through ``numpy.memmap``."""

    def __init__(self, path: str | Path, seq_len: int, dtype: str = "uint16", vocab_size: int | None = None):
        path = _existing(path)
        if dtype not in TOKEN_DTYPES:
            raise DataError(f"token dtype must be one of {', '.join(TOKEN_DTYPES)}, got {dtype!r}")
        np_dtype = TOKEN_DTYPES[dtype]
        size = path.stat().st_size
        width = np.dtype(np_dtype).itemsize
        if size % width:
            raise DataError(f"data file {path} has {size:,} bytes, not a whole number of {dtype} tokens "
                            f"({width} bytes each): is it a token file of another dtype?")
        tokens = np.memmap(path, dtype=np_dtype, mode="r") if size else np.zeros(0, dtype=np_dtype)
        identity = DatasetIdentity(str(path.resolve()), size, dtype, size // width, _fingerprint(path, size, dtype))
        super().__init__(tokens, seq_len, identity, vocab_size)

    def _vocab_hint(self) -> str:
        if self.identity.encoding == "uint32":
            return "was it written as uint16 (read it so), or with another tokenizer?"
        return "was it written with another tokenizer, or for a larger vocabulary?"


def _tokenizer_name(tokenizer: Any) -> str:
    return str(getattr(tokenizer, "name_or_path", "") or type(tokenizer).__name__)


def _encode(text: str, tokenizer: Any) -> np.ndarray:
    """Token ids of ``text``: a Hugging Face tokenizer's ``encode`` (no special tokens added)."""
    try:
        ids = tokenizer.encode(text, add_special_tokens=False)
    except TypeError:  # a tokenizer whose encode takes the text alone
        ids = tokenizer.encode(text)
    ids = getattr(ids, "ids", ids)  # a `tokenizers` Encoding
    return np.asarray(ids, dtype=np.int64)


class TextDataset(PackedDataset):
    """A text file tokenized once in memory: by its UTF-8 bytes (vocabulary 256, no download), or
    by ``tokenizer`` (an object with ``encode(text)``: a Hugging Face tokenizer)."""

    def __init__(self, path: str | Path, seq_len: int, tokenizer: Any = None, vocab_size: int | None = None):
        path = _existing(path)
        raw = path.read_bytes()
        if tokenizer is None:
            tokens, encoding, self.vocab = np.frombuffer(raw, dtype=np.uint8), "text:bytes", BYTE_VOCAB
        else:
            text = raw.decode("utf-8", errors="replace")
            tokens, encoding = _encode(text, tokenizer), f"text:{_tokenizer_name(tokenizer)}"
            self.vocab = int(getattr(tokenizer, "vocab_size", 0) or 0) or None
        identity = DatasetIdentity(str(path.resolve()), len(raw), encoding, len(tokens),
                                   _fingerprint(path, len(raw), encoding))
        super().__init__(tokens, seq_len, identity, vocab_size)

    def _vocab_hint(self) -> str:
        size = f"is {self.vocab:,}" if self.vocab else "is larger"
        return (f"the tokenizer's vocabulary {size}: build the model with at least that many "
                "embeddings, or pass the model's own tokenizer")


def open_dataset(path: str | Path, seq_len: int, *, dtype: str | None = None, tokenizer: Any = None,
                 vocab_size: int | None = None) -> PackedDataset:
    """A ``.bin`` token file (``dtype`` uint16 by default, or uint32), else a text file (bytes, or
    ``tokenizer``). ``vocab_size``: refuse ids the model cannot embed. Raises DataError on bad input."""
    path = Path(path)
    if path.suffix == ".bin":
        if tokenizer is not None:
            raise DataError(f"data file {path} is a token file (.bin): it takes no tokenizer")
        return TokenFileDataset(path, seq_len, dtype or "uint16", vocab_size)
    if dtype is not None:
        raise DataError(f"data file {path} is text (not .bin): a token dtype ({dtype}) applies to .bin files only")
    return TextDataset(path, seq_len, tokenizer, vocab_size)
