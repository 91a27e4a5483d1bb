"""Llama 3 as Hugging Face's ``LlamaForCausalLM``, built from its published config on the meta device.

Usage:
    autopar plan examples/hf_llama.py:llama3_70b --world-size 512 --cluster h100-80g
    python examples/hf_llama.py DIR      # writes DIR/config.json, then: autopar plan DIR --world-size 512 ...

The two plan the same model: a config SPEC builds the class its
``architectures`` names with ``use_cache=False``, as ``llama3_70b`` does
here. Needs ``transformers``; nothing is downloaded.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch

# Llama 3 70B's published config.json (the fields that shape the model)
LLAMA3_70B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 128256, "hidden_size": 8192,
    "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64, "num_key_value_heads": 8,
    "max_position_embeddings": 8192, "rope_theta": 500000.0, "rms_norm_eps": 1e-05, "hidden_act": "silu",
    "bos_token_id": 128000, "eos_token_id": 128001, "tie_word_embeddings": False, "torch_dtype": "bfloat16",
}
LLAMA3_8B = {**LLAMA3_70B, "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
             "num_attention_heads": 32}


def _build(fields: dict, seq_len: int | None):
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.LlamaConfig(**{k: v for k, v in fields.items() if k not in ("architectures", "model_type")})
    config.use_cache = False
    model = transformers.LlamaForCausalLM(config)
    return model, (torch.zeros(1, seq_len or fields["max_position_embeddings"], dtype=torch.long),)


def llama3_70b(seq_len: int | None = None):
    """Plain spec (no ``device``): autopar builds it under ``torch.device("meta")`` to plan."""
    return _build(LLAMA3_70B, seq_len)


def llama3_8b(seq_len: int | None = None):
    return _build(LLAMA3_8B, seq_len)


def write_config(directory: str | Path, fields: dict = LLAMA3_70B) -> Path:
    """A model directory holding only ``config.json`` (what ``hf download ID --include config.json`` gives)."""
    path = Path(directory)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(fields, indent=2))
    return path


if __name__ == "__main__":
    print(write_config(sys.argv[1] if len(sys.argv) > 1 else "llama3-70b"))
