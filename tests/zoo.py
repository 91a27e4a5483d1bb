"""Small models written the way their upstream writes them (never downloaded: built from configs).

Each builder returns ``(model, example_inputs)`` on the CPU with dropout off
and its blocks' module pattern (``BLOCKS``), so a test can pin
``BLOCKS:tp=megatron``. The hand-written GPTs read their shapes from the
tensors (``x.size()``, ``x.shape``), split fused projections by width or by
``chunk``, and keep their widths in attributes that stay whole under tensor
parallelism — what a user brings, not what the planner was written around.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

VOCAB, SEQ, BATCH = 128, 16, 2


# ------------------------------------------------------------------ nanoGPT, as its author writes it


@dataclass
class NanoConfig:
    block_size: int = SEQ
    vocab_size: int = VOCAB
    n_layer: int = 2
    n_head: int = 4
    n_embd: int = 32
    dropout: float = 0.0
    bias: bool = True
    flash: bool = False


class NanoCausalSelfAttention(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.attn_dropout = nn.Dropout(config.dropout)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head = config.n_head
        self.n_embd = config.n_embd
        self.dropout = config.dropout
        self.flash = config.flash
        if not self.flash:
            self.register_buffer("bias", torch.tril(torch.ones(config.block_size, config.block_size))
                                 .view(1, 1, config.block_size, config.block_size))

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)
        if self.flash:
            y = torch.nn.functional.scaled_dot_product_attention(
                q, k, v, attn_mask=None, dropout_p=self.dropout if self.training else 0, is_causal=True)
        else:
            att = (q @ k.transpose(-2, -1)) * (1.0 / math.sqrt(k.size(-1)))
            att = att.masked_fill(self.bias[:, :, :T, :T] == 0, float("-inf"))
            att = F.softmax(att, dim=-1)
            att = self.attn_dropout(att)
            y = att @ v
        y = y.transpose(1, 2).contiguous().view(B, T, C)
        y = self.resid_dropout(self.c_proj(y))
        return y


class NanoMLP(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class NanoBlock(nn.Module):
    def __init__(self, config: NanoConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.attn = NanoCausalSelfAttention(config)
        self.ln_2 = nn.LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = NanoMLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        x = x + self.mlp(self.ln_2(x))
        return x


class NanoGPT(nn.Module):
    """nanoGPT's model.py, less generation; ``forward(idx)`` returns every position's logits."""

    def __init__(self, config: NanoConfig, tie: bool = False):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([NanoBlock(config) for _ in range(config.n_layer)]),
            ln_f=nn.LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        if tie:
            self.transformer.wte.weight = self.lm_head.weight

    def forward(self, idx):
        device = idx.device
        b, t = idx.size()
        assert t <= self.config.block_size, f"Cannot forward sequence of length {t}"
        pos = torch.arange(0, t, dtype=torch.long, device=device)
        tok_emb = self.transformer.wte(idx)
        pos_emb = self.transformer.wpe(pos)
        x = self.transformer.drop(tok_emb + pos_emb)
        for block in self.transformer.h:
            x = block(x)
        x = self.transformer.ln_f(x)
        return self.lm_head(x)


# ------------------------------------------------------------------ a GPT reading x.shape, chunk(3)


class ShapeAttention(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(width, 3 * width)
        self.out = nn.Linear(width, width)

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = self.qkv(x).chunk(3, dim=-1)
        q = q.reshape(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)
        k = k.reshape(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)
        v = v.reshape(b, t, self.heads, c // self.heads).permute(0, 2, 1, 3)
        scores = torch.matmul(q, k.transpose(-1, -2)) / math.sqrt(q.shape[-1])
        mask = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        scores = scores.masked_fill(mask, float("-inf"))
        y = torch.matmul(scores.softmax(dim=-1), v)
        return self.out(y.permute(0, 2, 1, 3).reshape(b, t, c))


class ShapeBlock(nn.Module):
    def __init__(self, width: int, heads: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.attn = ShapeAttention(width, heads)
        self.up, self.down = nn.Linear(width, 4 * width), nn.Linear(4 * width, width)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class ShapeGPT(nn.Module):
    def __init__(self, width: int = 32, heads: int = 4, depth: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, width)
        self.pos = nn.Parameter(torch.randn(SEQ, width) * 0.02)
        self.blocks = nn.ModuleList([ShapeBlock(width, heads) for _ in range(depth)])
        self.norm = nn.LayerNorm(width)
        self.head = nn.Linear(width, VOCAB)

    def forward(self, idx):
        x = self.embed(idx) + self.pos[: idx.shape[1]]
        for blk in self.blocks:
            x = blk(x)
        return self.head(self.norm(x))


# ------------------------------------------------------------------ Hugging Face, from configs


def _ids() -> tuple[torch.Tensor]:
    return (torch.zeros(BATCH, SEQ, dtype=torch.long),)


def _hf(cls_name: str, config_name: str, **cfg) -> Callable[[], tuple[nn.Module, tuple]]:
    def build() -> tuple[nn.Module, tuple]:
        import transformers

        transformers.logging.set_verbosity_error()
        config = getattr(transformers, config_name)(**cfg)
        return getattr(transformers, cls_name)(config), _ids()
    return build


_LLAMA_LIKE = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                   num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64, use_cache=False,
                   tie_word_embeddings=False)

MODELS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], str]] = {
    "nanogpt": (lambda: (NanoGPT(NanoConfig()), _ids()), "transformer.h.*"),
    "nanogpt_flash": (lambda: (NanoGPT(NanoConfig(flash=True)), _ids()), "transformer.h.*"),
    "shape_gpt": (lambda: (ShapeGPT(), _ids()), "blocks.*"),
    "hf_gpt2": (_hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                    n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False,
                    tie_word_embeddings=False), "transformer.h.*"),
    "hf_llama": (_hf("LlamaForCausalLM", "LlamaConfig", **_LLAMA_LIKE), "model.layers.*"),
    "hf_mistral": (_hf("MistralForCausalLM", "MistralConfig", **_LLAMA_LIKE), "model.layers.*"),
    "hf_qwen2": (_hf("Qwen2ForCausalLM", "Qwen2Config", **_LLAMA_LIKE), "model.layers.*"),
    "hf_phi3": (_hf("Phi3ForCausalLM", "Phi3Config", **_LLAMA_LIKE, pad_token_id=0, resid_pdrop=0.0,
                    embd_pdrop=0.0, attention_dropout=0.0), "model.layers.*"),
    "hf_neox": (_hf("GPTNeoXForCausalLM", "GPTNeoXConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, rotary_pct=0.5,
                    hidden_dropout=0.0, attention_dropout=0.0, use_cache=False, tie_word_embeddings=False),
                "gpt_neox.layers.*"),
    "hf_opt": (_hf("OPTForCausalLM", "OPTConfig", vocab_size=VOCAB, hidden_size=32, ffn_dim=64,
                   num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64, word_embed_proj_dim=32,
                   dropout=0.0, attention_dropout=0.0, use_cache=False, tie_word_embeddings=False),
               "model.decoder.layers.*"),
    "hf_bert": (_hf("BertForMaskedLM", "BertConfig", vocab_size=VOCAB, hidden_size=32, intermediate_size=64,
                    num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=64,
                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, tie_word_embeddings=False),
                "bert.encoder.layer.*"),
}




def _vit() -> tuple[nn.Module, tuple]:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.ViTConfig(image_size=16, patch_size=4, num_channels=3, hidden_size=32, num_hidden_layers=2,
                                    num_attention_heads=4, intermediate_size=64, num_labels=CLASSES,
                                    hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
    return transformers.ViTForImageClassification(config), (torch.zeros(BATCH, 3, 16, 16),)


CLASSES = 10
MODELS["hf_vit"] = (_vit, "vit.layers.*")  # an image classifier: one class index per sample


def _tied_nanogpt() -> tuple[nn.Module, tuple]:
    return NanoGPT(NanoConfig(), tie=True), _ids()


TIED: dict[str, tuple[Callable[[], tuple[nn.Module, tuple]], str]] = {
    "nanogpt_tied": (_tied_nanogpt, "transformer.h.*"),
    "hf_gpt2_tied": (_hf("GPT2LMHeadModel", "GPT2Config", vocab_size=VOCAB, n_embd=32, n_layer=2, n_head=4,
                         n_positions=64, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0, use_cache=False),
                     "transformer.h.*"),
}


# ------------------------------------------------------------------ beyond one token tensor in, logits out
# (issue 23): keyword inputs, a model's own loss, classifiers, and models that are not transformers


class BasicBlock(nn.Module):
    """A ResNet basic block (He et al. 2015, as torchvision writes it): conv-BN-ReLU-conv-BN plus a shortcut."""

    def __init__(self, inplanes: int, planes: int, stride: int = 1):
        super().__init__()
        self.conv1 = nn.Conv2d(inplanes, planes, 3, stride=stride, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(planes)
        self.relu = nn.ReLU(inplace=True)
        self.conv2 = nn.Conv2d(planes, planes, 3, padding=1, bias=False)
        self.bn2 = nn.BatchNorm2d(planes)
        self.downsample = None
        if stride != 1 or inplanes != planes:
            self.downsample = nn.Sequential(nn.Conv2d(inplanes, planes, 1, stride=stride, bias=False),
                                            nn.BatchNorm2d(planes))

    def forward(self, x):
        identity = x if self.downsample is None else self.downsample(x)
        out = self.relu(self.bn1(self.conv1(x)))
        out = self.bn2(self.conv2(out))
        return self.relu(out + identity)


class ResNetSmall(nn.Module):
    """A small ResNet image classifier: stem conv-BN-ReLU, basic blocks, global average pool, fc."""

    def __init__(self, num_classes: int = 10, width: int = 8):
        super().__init__()
        self.conv1 = nn.Conv2d(3, width, 3, padding=1, bias=False)
        self.bn1 = nn.BatchNorm2d(width)
        self.relu = nn.ReLU(inplace=True)
        self.layer1 = nn.Sequential(BasicBlock(width, width), BasicBlock(width, width))
        self.layer2 = nn.Sequential(BasicBlock(width, 2 * width, stride=2), BasicBlock(2 * width, 2 * width))
        self.avgpool = nn.AdaptiveAvgPool2d((1, 1))
        self.fc = nn.Linear(2 * width, num_classes)

    def forward(self, x):
        x = self.relu(self.bn1(self.conv1(x)))
        x = self.layer2(self.layer1(x))
        return self.fc(torch.flatten(self.avgpool(x), 1))


class MlpBlock(nn.Module):
    def __init__(self, dim: int, hidden: int):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(dim, hidden), nn.Linear(hidden, dim)

    def forward(self, x):
        return self.fc2(F.gelu(self.fc1(x)))


class MixerBlock(nn.Module):
    """MLP-Mixer's layer (Tolstikhin et al. 2021): token mixing across patches, then channel mixing."""

    def __init__(self, patches: int, channels: int, tokens_hidden: int, channels_hidden: int):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(channels), nn.LayerNorm(channels)
        self.token_mixing = MlpBlock(patches, tokens_hidden)
        self.channel_mixing = MlpBlock(channels, channels_hidden)

    def forward(self, x):
        x = x + self.token_mixing(self.norm1(x).transpose(1, 2)).transpose(1, 2)
        return x + self.channel_mixing(self.norm2(x))


class MlpMixer(nn.Module):
    """Per-patch linear embedding (a strided conv), Mixer layers, pre-head LayerNorm, mean pool, head."""

    def __init__(self, num_classes: int = 10, image: int = 16, patch: int = 4, channels: int = 32, depth: int = 2):
        super().__init__()
        patches = (image // patch) ** 2
        self.stem = nn.Conv2d(3, channels, patch, stride=patch)
        self.blocks = nn.ModuleList([MixerBlock(patches, channels, 2 * patches, 4 * channels) for _ in range(depth)])
        self.pre_head_norm = nn.LayerNorm(channels)
        self.head = nn.Linear(channels, num_classes)

    def forward(self, x):
        x = self.stem(x).flatten(2).transpose(1, 2)
        for block in self.blocks:
            x = block(x)
        return self.head(self.pre_head_norm(x).mean(dim=1))


class LSTMModel(nn.Module):
    """PyTorch's word-language-model RNN (encoder, LSTM, decoder), batch first; returns (logits, hidden)."""

    def __init__(self, ntoken: int = VOCAB, ninp: int = 32, nhid: int = 32, nlayers: int = 2, dropout: float = 0.0):
        super().__init__()
        self.drop = nn.Dropout(dropout)
        self.encoder = nn.Embedding(ntoken, ninp)
        self.rnn = nn.LSTM(ninp, nhid, nlayers, dropout=dropout, batch_first=True)
        self.decoder = nn.Linear(nhid, ntoken)
        self.nlayers, self.nhid = nlayers, nhid

    def forward(self, input, hidden=None):
        emb = self.drop(self.encoder(input))
        output, hidden = self.rnn(emb, hidden)
        return self.decoder(self.drop(output)), hidden


def _images() -> tuple[torch.Tensor]:
    return (torch.zeros(BATCH, 3, 16, 16),)


def _t5() -> tuple[nn.Module, dict]:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_decoder_layers=2,
                                   num_heads=4, dropout_rate=0.0, use_cache=False, decoder_start_token_id=0,
                                   pad_token_id=0, tie_word_embeddings=False)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    return transformers.T5ForConditionalGeneration(config), {"input_ids": ids, "decoder_input_ids": ids}


def _qwen3_padded() -> tuple[nn.Module, dict]:
    """Qwen3 fed a padding mask (the second sample's last quarter padded) and its labels: its own loss."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.Qwen3Config(**_LLAMA_LIKE, head_dim=8, attention_dropout=0.0)
    ids = torch.zeros(BATCH, SEQ, dtype=torch.long)
    mask = torch.ones(BATCH, SEQ, dtype=torch.long)
    mask[1, -SEQ // 4:] = 0
    return transformers.Qwen3ForCausalLM(config), {"input_ids": ids, "attention_mask": mask, "labels": ids}


def _mamba() -> tuple[nn.Module, tuple]:
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=8, num_hidden_layers=2,
                                      expand=2, conv_kernel=4, use_cache=False, tie_word_embeddings=False)
    return transformers.MambaForCausalLM(config), _ids()


class GatedBlock(nn.Module):
    """A residual MLP block gated by a learned 0-d scalar (ReZero, Bachlechner et al. 2020: ``x + α·f(x)``;
    α from 0.5 here, not 0, so that f's first-step gradients are not all zero)."""

    def __init__(self, dim: int):
        super().__init__()
        self.norm, self.mlp = nn.LayerNorm(dim), MlpBlock(dim, 2 * dim)
        self.alpha = nn.Parameter(torch.tensor(0.5))

    def forward(self, x):
        return x + self.alpha * self.mlp(self.norm(x))


class ScalarGatedMLP(nn.Module):
    """An MLP classifier of gated blocks whose logits a learned 0-d temperature scales (CLIP's
    ``logit_scale``): 0-d parameters in the repeated blocks and at the root, which FSDP2 cannot shard."""

    def __init__(self, dim: int = 32, depth: int = 2, num_classes: int = CLASSES):
        super().__init__()
        self.stem = nn.Linear(16, dim)
        self.blocks = nn.ModuleList([GatedBlock(dim) for _ in range(depth)])
        self.head = nn.Linear(dim, num_classes)
        self.logit_scale = nn.Parameter(torch.tensor(2.0).log())

    def forward(self, x):
        x = self.stem(x)
        for block in self.blocks:
            x = block(x)
        return self.head(x) * self.logit_scale.exp()


def _clip() -> tuple[nn.Module, dict]:
    """Hugging Face's CLIP (text and vision towers, projections, a 0-d ``logit_scale``), tiny."""
    import transformers

    transformers.logging.set_verbosity_error()
    config = transformers.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, max_position_embeddings=SEQ),
        vision_config=dict(image_size=16, patch_size=4, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4),
        projection_dim=16)
    return transformers.CLIPModel(config), {"input_ids": torch.zeros(BATCH, SEQ, dtype=torch.long),
                                            "pixel_values": torch.zeros(BATCH, 3, 16, 16)}


def clip_matched_pairs(output, targets):
    """A loss per sample for CLIP: each image with its own text, ``-log σ(logit_scale · cos)`` (SigLIP's
    positive pairs). CLIP's contrastive loss pits each sample against the whole batch, so a dp rank's
    loss over its own shard is another number than one device's (open_clip gathers the features)."""
    return -F.logsigmoid(output.logits_per_image.diagonal()).mean()


class TorchEncoderLM(nn.Module):
    """A causal language model on PyTorch's own ``nn.TransformerEncoder`` (post-norm layers, batch first), as
    PyTorch's tutorials write one: token and learned position embeddings, the causal mask from
    ``nn.Transformer.generate_square_subsequent_mask`` (``is_causal`` given, or left for the encoder to detect
    from the mask's values), a final LayerNorm and a linear head."""

    def __init__(self, vocab: int = VOCAB, dim: int = 32, heads: int = 4, depth: int = 2, seq: int = SEQ,
                 say_causal: bool = False):
        super().__init__()
        self.tok, self.pos = nn.Embedding(vocab, dim), nn.Embedding(seq, dim)
        layer = nn.TransformerEncoderLayer(dim, heads, 4 * dim, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, depth, norm=nn.LayerNorm(dim), enable_nested_tensor=False)
        self.head = nn.Linear(dim, vocab)
        self.say_causal = say_causal

    def forward(self, idx):
        t = idx.size(1)
        x = self.tok(idx) + self.pos(torch.arange(t, device=idx.device))
        mask = nn.Transformer.generate_square_subsequent_mask(t, device=idx.device)
        x = self.encoder(x, mask=mask, is_causal=True) if self.say_causal else self.encoder(x, mask=mask)
        return self.head(x)


# name -> (builder, blocks pattern): planned and trained under dp and ZeRO-3 (test_zoo_inputs)
BEYOND: dict[str, tuple[Callable[[], tuple[nn.Module, tuple | dict]], str]] = {
    "hf_t5": (_t5, "encoder.block.*"),
    "hf_qwen3_padded": (_qwen3_padded, "model.layers.*"),
    "resnet_bn": (lambda: (ResNetSmall(CLASSES), _images()), "layer1.*"),
    "mlp_mixer": (lambda: (MlpMixer(CLASSES), _images()), "blocks.*"),
    "lstm_lm": (lambda: (LSTMModel(), _ids()), "rnn"),
    "hf_mamba": (_mamba, "backbone.layers.*"),
    "scalar_gated": (lambda: (ScalarGatedMLP(), (torch.zeros(BATCH, 16),)), "blocks.*"),
    "torch_lm": (lambda: (TorchEncoderLM(), _ids()), "encoder.layers.*"),
}
# trained with its own loss (zoo_cases): name -> (builder, blocks pattern, loss)
OWN_LOSS: dict[str, tuple[Callable[[], tuple[nn.Module, tuple | dict]], str, Callable]] = {
    "hf_clip": (_clip, "vision_model.encoder.layers.*", clip_matched_pairs),
}
MODELS_ALL = {**MODELS, **TIED, **BEYOND, **{k: v[:2] for k, v in OWN_LOSS.items()}}


def build(name: str) -> tuple[nn.Module, tuple]:
    torch.manual_seed(0)
    return MODELS_ALL[name][0]()


__all__ = ["BEYOND", "MODELS", "MODELS_ALL", "OWN_LOSS", "TIED", "build"]
