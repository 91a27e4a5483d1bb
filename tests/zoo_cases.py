"""Cases for :mod:`distributed`: the zoo's models (:mod:`zoo`) under each strategy, each against one
process (:func:`equivalence_cases.equivalence`)."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from typing import Any

from equivalence_cases import PP1, Spec, equivalence
from zoo import BEYOND, CLASSES, MODELS, OWN_LOSS, TIED, build


@functools.cache
def _builder(name: str) -> Callable:
    """One builder per model, so that its plans share one capture (``equivalence_cases._captured``)."""
    return lambda: build(name)


SPECS: dict[str, Spec] = {}
for _name, (_, _blocks) in MODELS.items():
    _classes = CLASSES if _name == "hf_vit" else None
    _tp = f"{_blocks}:tp=megatron"
    for _kind, _pins, _batch in (
        ("tp", PP1 + ("dp=1", "tp=2", "zero=0", _tp), 4),
        ("zero3", PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4),
        ("dp2tp2", PP1 + ("dp=2", "tp=2", "zero=3", "microbatches=1", _tp), 4),
        ("pp2tp2", ("pp=2", "dp=1", "tp=2", "microbatches=2", "schedule=1f1b", _tp, f"{_blocks}:recompute=on"), 4),
        ("3d", ("pp=2", "dp=2", "tp=2", "zero=3", "microbatches=2", "schedule=1f1b", "recompute=none", _tp), 8),
    ):
        SPECS[f"{_name}/{_kind}"] = Spec(_builder(_name), _pins, _batch, classes=_classes)

# sequence parallelism on the blocks of the zoo's models whose blocks take it (GPT-2's Conv1D and OPT's
# flattening MLP included where the simulation proves them; OPT and ViT are refused, see test_zoo)
SEQUENCE_MODELS = ("nanogpt", "nanogpt_flash", "shape_gpt", "hf_gpt2", "hf_llama", "hf_mistral", "hf_qwen2",
                   "hf_phi3", "hf_neox", "hf_bert")
for _name in SEQUENCE_MODELS:
    _blocks = MODELS[_name][1]
    _sp = (f"{_blocks}:tp=megatron", f"{_blocks}:sp=on")
    for _kind, _pins, _batch in (
        ("sp", PP1 + ("dp=1", "tp=2", "zero=0") + _sp, 4),
        ("dp2tp2sp", PP1 + ("dp=2", "tp=2", "zero=3", "microbatches=1") + _sp, 4),
        ("pp2tp2sp", ("pp=2", "dp=1", "tp=2", "microbatches=2", "schedule=1f1b", f"{_blocks}:recompute=selective")
         + _sp, 4),
    ):
        SPECS[f"{_name}/{_kind}"] = Spec(_builder(_name), _pins, _batch)
SPECS["nanogpt/sp"] = dataclasses.replace(SPECS["nanogpt/sp"], adam=True)  # sp's AdamW case (ADAM_CASES)
# one plan mixing, block by block, sequence parallelism with and without recompute
SPECS["nanogpt/sp_mixed"] = Spec(_builder("nanogpt"), ("pp=1",
    "dp=1", "tp=2", "zero=0", "transformer.h.*:tp=megatron", "transformer.h.0:sp=on", "transformer.h.0:recompute=full",
    "transformer.h.1:sp=off", "transformer.h.1:recompute=selective"), 4)

for _name, (_, _blocks) in TIED.items():  # tied input/output embeddings split across the stages
    SPECS[f"{_name}/pp2"] = Spec(_builder(_name), ("pp=2", "dp=1", "tp=1", "microbatches=2", "schedule=1f1b",
                                                   "recompute=none"), 4)
    SPECS[f"{_name}/pp2dp2"] = Spec(_builder(_name), ("pp=2", "dp=2", "tp=2", "zero=3", "microbatches=2",
                                                      "schedule=interleaved_1f1b", "recompute=none",
                                                      f"{_blocks}:tp=megatron"), 8)

# beyond one token tensor in and logits out: keyword inputs, a model's own loss, classifiers, BatchNorm,
# an LSTM and a state-space model, under ZeRO-3 and plain replicated dp (batches as verify makes them)
for _name in BEYOND:
    SPECS[f"{_name}/zero3"] = Spec(_builder(_name), PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4,
                                   synthetic=True)
    SPECS[f"{_name}/dp2"] = Spec(_builder(_name), PP1 + ("dp=2", "tp=1", "zero=0", "microbatches=1"), 4,
                                 synthetic=True)

# 0-d parameters (FSDP2 shards none: kept whole beside its units) with gradients accumulated over two
# microbatches, and inside the stages of a pipeline
SPECS["scalar_gated/zero2mb2"] = Spec(_builder("scalar_gated"), PP1 + ("dp=2", "tp=1", "zero=2", "microbatches=2"),
                                      4, synthetic=True)
SPECS["scalar_gated/pp2dp2"] = Spec(_builder("scalar_gated"), ("pp=2", "dp=2", "tp=1", "zero=3", "microbatches=2",
                                                                "schedule=1f1b", "recompute=none"), 8, synthetic=True)
for _name, (_, _blocks, _loss) in OWN_LOSS.items():  # trained with a loss of their own, batches as verify makes
    SPECS[f"{_name}/zero3"] = Spec(_builder(_name), PP1 + ("dp=2", "tp=1", "zero=3", "microbatches=1"), 4,
                                   synthetic=True, loss=_loss)
    # keyword inputs (ids, pixels) into a rank that holds the first stage and a later one: the later is
    # given what it uses of them by the stage before, never the keywords again
    SPECS[f"{_name}/pp2interleaved"] = Spec(_builder(_name), ("pp=2", "dp=1", "tp=1", "microbatches=2",
                                                              "schedule=interleaved_1f1b", "chunks=2",
                                                              "recompute=none"), 4, synthetic=True, loss=_loss)

# PyTorch's nn.TransformerEncoder: Megatron tensor parallelism on its layers (fused in_proj, its attention's
# own head split), the style proved on the graph capture traced with the fast path off
SPECS["torch_lm/tp"] = Spec(_builder("torch_lm"), PP1 + ("dp=1", "tp=2", "zero=0", "encoder.layers.*:tp=megatron"),
                            4, synthetic=True)

# keyword inputs (ids, padding mask, labels) under Megatron tensor parallelism on the blocks
SPECS["hf_qwen3_padded/tp"] = Spec(_builder("hf_qwen3_padded"), PP1 + ("dp=1", "tp=2", "zero=0",
                                                                      "model.layers.*:tp=megatron"), 4, synthetic=True)

# BatchNorm inside pipeline stages under dp: one microbatch, so one device's whole-batch statistics
SPECS["resnet_bn/pp2dp2"] = Spec(_builder("resnet_bn"), ("pp=2", "dp=2", "tp=1", "zero=0", "microbatches=1",
                                                          "schedule=gpipe", "recompute=none"), 4, synthetic=True)


def _qwen3_mask_only() -> tuple:
    model, inputs = build("hf_qwen3_padded")
    inputs.pop("labels")
    return model, inputs


# keyword inputs into a pipeline's first stage; the padding mask reaches the second
SPECS["hf_qwen3_mask/pp2"] = Spec(_qwen3_mask_only, ("pp=2", "dp=1", "tp=1", "microbatches=2", "schedule=1f1b",
                                                    "recompute=none"), 4, synthetic=True)

CASES: dict[str, Callable[[int, int], dict[str, Any]]] = {k: equivalence(v) for k, v in SPECS.items()}


def tp_dropout_masks(rank: int, world_size: int) -> dict[str, Any]:
    """nanoGPT with dropout 0.1 under tp=2: the ranks of the tp group must draw the same masks where
    the activation is replicated, so their replicated parameters (LayerNorms, row biases) stay equal."""
    import torch
    import torch.distributed as dist
    from equivalence_cases import plan_for
    from zoo import NanoConfig, NanoGPT, _ids

    import autopar

    def model() -> tuple:
        torch.manual_seed(0)
        return NanoGPT(NanoConfig(dropout=0.1)), _ids()

    spec = Spec(model, PP1 + ("dp=1", "tp=2", "zero=0", "transformer.h.*:tp=megatron"), 4)
    plan, graph = plan_for(spec, world_size)
    m, inputs = model()
    pm = autopar.compile(m, example_inputs=inputs, plan=plan, graph=graph,
                         optimizer=lambda p: torch.optim.SGD(p, lr=0.1))
    g = torch.Generator().manual_seed(1)
    x = torch.randint(0, 128, (4, 16), generator=g)
    torch.manual_seed(100 + rank)  # each rank's own stream: the runtime must seed the tp group alike
    losses = [pm.train_step(x, x) for _ in range(3)]
    from torch.distributed.tensor import DTensor

    replicated = torch.cat([(p.to_local() if isinstance(p, DTensor) else p).detach().reshape(-1)
                            for n, p in m.named_parameters() if "ln_" in n or n.endswith("c_proj.bias")])
    gathered = [torch.empty_like(replicated) for _ in range(world_size)]
    dist.all_gather(gathered, replicated)
    return {"spread": max(float((t - gathered[0]).abs().max()) for t in gathered), "losses": losses,
            "dropout_on": m.training}


CASES["tp_dropout_masks"] = tp_dropout_masks
