"""The runs the training, checkpoint and weights tests share: one request to the W = 4 pool, then one
to the W = 2 pool, once a session (the ``training`` fixture), whichever test file asks first.

The W = 4 request saves checkpoints the W = 2 one loads under other plans; both read and write
the shared directory :attr:`TrainingRuns.dir` (``$AUTOPAR_TEST_DIR`` in the workers, for their
requests only), which also holds the weight files the weights cases load (an HF Llama saved with
``save_pretrained``, a GPT's state dict as safetensors).
"""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from functools import cached_property
from pathlib import Path

import torch
from distributed import RankPool
from equivalence_cases import gpt_tiny, hf_llama
from training_cases import DIR_ENV

W4 = ["save_zero3_w4", "save_zero1_w4", "save_dp2tp2_w4"]
W2 = ["zero3_w4_to_tp", "zero1_w4_to_pp", "save_tp_w2", "tp_to_pp", "tp_to_zero3", "save_pp_w2",
      "pp_to_zero1", "pp_to_tp", "clip_zero3", "clip_tp", "clip_pp", "bf16_zero3", "bf16_ddp", "bf16_tp",
      "bf16_pp", "dropout_tp", "weights_hf_tp", "weights_hf_zero3", "weights_gpt_tp", "export_hf",
      "export_gpt_tp"]


class TrainingRuns:
    """Every case of :mod:`training_cases`, run on the session's pools on first use."""

    def __init__(self, ranks: Callable[[int], RankPool]):
        self.ranks = ranks

    @cached_property
    def dir(self) -> Path:
        """A directory for the session's checkpoints and weight files (removed by :meth:`cleanup`)."""
        from safetensors.torch import save_file

        path = Path(tempfile.mkdtemp(prefix="autopar-training-"))
        torch.manual_seed(0)
        llama, _ = hf_llama()
        llama.save_pretrained(str(path / "hf_in"))
        torch.manual_seed(3)
        model, _ = gpt_tiny()
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(path / "gpt_in.safetensors"))
        return path

    @cached_property
    def w4(self) -> dict[str, dict]:
        return self.ranks(4).run(["training_cases:" + c for c in W4], env={DIR_ENV: str(self.dir)})

    @cached_property
    def w2(self) -> dict[str, dict]:
        self.w4  # noqa: B018 - the checkpoints W = 2 loads
        return self.ranks(2).run(["training_cases:" + c for c in W2], env={DIR_ENV: str(self.dir)})

    def case(self, name: str) -> dict:
        """One case's metrics (rank 0's, every rank's under ``"ranks"``), from whichever request ran it."""
        results = self.w4 if name in W4 else self.w2
        return results["training_cases:" + name]

    def cleanup(self) -> None:
        if "dir" in self.__dict__:
            shutil.rmtree(self.dir, ignore_errors=True)
