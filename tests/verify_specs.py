"""Specs for ``autopar verify``'s tests, written as a user writes one: plainly, with no ``device``.

``autopar verify tests/verify_specs.py:opt --world-size 2`` builds them for
real. The Hugging Face models are built from configs (nothing is downloaded)
that keep the upstream defaults that matter to ``verify``: OPT and BERT have
dropout (0.1), and their attention key bias has an exact gradient of zero
(softmax is invariant to a constant added to every key's score), so its
computed gradient is pure rounding noise. ``crashes_on_rank_1`` raises in the
parallel run only, on one rank.
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
import torch.nn as nn

BATCH, SEQ, VOCAB = 8, 16, 128


def _quiet() -> None:
    import transformers

    transformers.logging.set_verbosity_error()


def opt() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A 2-layer OPT causal LM (dropout 0.1, attention dropout 0.1 as configured here)."""
    _quiet()
    from transformers import OPTConfig, OPTForCausalLM

    cfg = OPTConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, ffn_dim=128,
                    num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=64,
                    dropout=0.1, attention_dropout=0.1, use_cache=False)
    return OPTForCausalLM(cfg), (torch.zeros(BATCH, SEQ, dtype=torch.long),)


def bert() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A 2-layer BERT masked LM with its default dropout (hidden and attention 0.1)."""
    _quiet()
    from transformers import BertConfig, BertForMaskedLM

    cfg = BertConfig(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, intermediate_size=128,
                     num_attention_heads=4, max_position_embeddings=64)
    return BertForMaskedLM(cfg), (torch.zeros(BATCH, SEQ, dtype=torch.long),)


class CrashesOnRank1(nn.Module):
    """A linear map that raises on rank 1 of a process group (and nowhere else)."""

    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if dist.is_initialized() and dist.get_rank() == 1:
            raise RuntimeError("rank 1 cannot go on")  # CRASH LINE
        return self.fc(x)


def crashes_on_rank_1() -> tuple[nn.Module, tuple[torch.Tensor]]:
    return CrashesOnRank1(), (torch.zeros(4, 8),)


def t5_keywords() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """A 2+2-layer T5 fed keyword inputs: ``input_ids`` and ``decoder_input_ids`` (issue 23)."""
    _quiet()
    from transformers import T5Config, T5ForConditionalGeneration

    cfg = T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2, num_heads=4,
                   dropout_rate=0.1, use_cache=False, decoder_start_token_id=0, pad_token_id=0)
    ids = torch.zeros(4, SEQ, dtype=torch.long)
    return T5ForConditionalGeneration(cfg), {"input_ids": ids, "decoder_input_ids": ids}


def resnet_bn() -> tuple[nn.Module, tuple[torch.Tensor]]:
    """A small ResNet with BatchNorm classifying 10 classes (tests/zoo.py), images of 16×16."""
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from zoo import ResNetSmall

    return ResNetSmall(10), (torch.zeros(4, 3, 16, 16),)


def smoothed_cross_entropy(output: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """A user's loss for ``verify --loss``: cross-entropy with label smoothing 0.1."""
    return nn.functional.cross_entropy(output, targets, label_smoothing=0.1)


def _sinusoidal(timestep: torch.Tensor, width: int) -> torch.Tensor:
    """The transformer's sinusoidal position code of an integer timestep (DDPM's, as diffusers' ``Timesteps``)."""
    half = width // 2
    freqs = torch.exp(-math.log(10000.0) * torch.arange(half, dtype=torch.float32) / half)
    angles = timestep.float()[:, None] * freqs[None, :]
    return torch.cat([angles.sin(), angles.cos()], dim=1)


class TimedBlock(nn.Module):
    """Two 3×3 convolutions with the timestep's embedding added between them (a DDPM ResBlock, no norm)."""

    def __init__(self, c_in: int, c_out: int, emb: int) -> None:
        super().__init__()
        self.conv1, self.conv2 = nn.Conv2d(c_in, c_out, 3, padding=1), nn.Conv2d(c_out, c_out, 3, padding=1)
        self.time = nn.Linear(emb, c_out)
        self.skip = nn.Conv2d(c_in, c_out, 1)

    def forward(self, x: torch.Tensor, emb: torch.Tensor) -> torch.Tensor:
        h = nn.functional.silu(self.conv1(x)) + self.time(emb)[:, :, None, None]
        return self.skip(x) + self.conv2(nn.functional.silu(h))


class TinyUNet(nn.Module):
    """A diffusion UNet's shape: a noisy image and an integer timestep in, the predicted noise (image-shaped) out.

    The timestep (0…999) is embedded by a sinusoidal code and an MLP, as in DDPM; there is no
    ``nn.Embedding``. One level down and back up, with a skip across."""

    def __init__(self, channels: int = 3, width: int = 8, emb: int = 16) -> None:
        super().__init__()
        self.emb = emb
        self.time = nn.Sequential(nn.Linear(emb, emb), nn.SiLU(), nn.Linear(emb, emb))
        self.inp = nn.Conv2d(channels, width, 3, padding=1)
        self.down = TimedBlock(width, 2 * width, emb)
        self.mid = TimedBlock(2 * width, 2 * width, emb)
        self.up = TimedBlock(3 * width, width, emb)
        self.out = nn.Conv2d(width, channels, 3, padding=1)

    def forward(self, sample: torch.Tensor, timestep: torch.Tensor) -> torch.Tensor:
        emb = self.time(_sinusoidal(timestep, self.emb))
        h0 = self.inp(sample)
        h = self.mid(self.down(nn.functional.avg_pool2d(h0, 2), emb), emb)
        h = self.up(torch.cat([nn.functional.interpolate(h, scale_factor=2.0), h0], dim=1), emb)
        return self.out(h)


def unet_inputs(batch: int = 4) -> tuple[torch.Tensor, torch.Tensor]:
    """A batch of noisy 16×16 RGB images and timesteps drawn from DDPM's 1000."""
    g = torch.Generator().manual_seed(0)
    return torch.randn(batch, 3, 16, 16, generator=g), torch.randint(0, 1000, (batch,), generator=g)


def unet() -> tuple[nn.Module, tuple[torch.Tensor, torch.Tensor]]:
    """The UNet fed positional inputs ``(sample, timestep)``; its default loss: MSE against noise."""
    return TinyUNet(), unet_inputs()


def unet_keywords() -> tuple[nn.Module, dict[str, torch.Tensor]]:
    """The same, fed keyword inputs."""
    sample, timestep = unet_inputs()
    return TinyUNet(), {"sample": sample, "timestep": timestep}
