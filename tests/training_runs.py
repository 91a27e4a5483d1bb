"""The spawns the training, checkpoint and weights tests share: one of W = 4 processes, then one of 2.

Spawning and importing torch costs seconds on a small machine, so every case of
:mod:`training_cases` runs in these two spawns, once per test session
(``functools.cache``), whichever test file asks first. The W = 4 spawn saves
checkpoints the W = 2 one loads under other plans; both read and write the
shared directory :func:`shared_dir`, which also holds the weight files the
weights cases load (an HF Llama saved with ``save_pretrained``, a GPT's state
dict as safetensors).
"""

from __future__ import annotations

import atexit
import functools
import os
import shutil
import tempfile
from pathlib import Path

import torch
from distributed import run_cases
from equivalence_cases import gpt_tiny, hf_llama
from training_cases import DIR_ENV

W4 = ["save_zero3_w4", "save_zero1_w4", "save_dp2tp2_w4"]
W2 = ["zero3_w4_to_tp", "zero1_w4_to_pp", "save_tp_w2", "tp_to_pp", "tp_to_zero3", "save_pp_w2",
      "pp_to_zero1", "pp_to_tp", "clip_zero3", "clip_tp", "clip_pp", "bf16_zero3", "bf16_ddp", "bf16_tp",
      "bf16_pp", "dropout_tp", "weights_hf_tp", "weights_hf_zero3", "weights_gpt_tp", "export_hf",
      "export_gpt_tp"]


@functools.cache
def shared_dir() -> Path:
    """A directory for the session's checkpoints and weight files (removed at exit)."""
    from safetensors.torch import save_file

    path = Path(tempfile.mkdtemp(prefix="autopar-training-"))
    atexit.register(shutil.rmtree, path, ignore_errors=True)
    os.environ[DIR_ENV] = str(path)
    torch.manual_seed(0)
    llama, _ = hf_llama()
    llama.save_pretrained(str(path / "hf_in"))
    torch.manual_seed(3)
    model, _ = gpt_tiny()
    save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "gpt_in.safetensors"))
    return path


@functools.cache
def w4() -> dict[str, dict]:
    shared_dir()
    return run_cases(4, ["training_cases:" + c for c in W4])


@functools.cache
def w2() -> dict[str, dict]:
    w4()  # the checkpoints W = 2 loads
    return run_cases(2, ["training_cases:" + c for c in W2])


def case(name: str) -> dict:
    """One case's rank-0 metrics, from whichever spawn ran it."""
    results = w4() if name in W4 else w2()
    return results["training_cases:" + name]
