"""float8 training at run time: the plan's linears swapped for torchao's ``Float8Linear`` before lowering.

The plan says which linears (``training.float8``, :mod:`autopar.float8`);
:func:`convert` swaps exactly those with ``convert_to_float8_training`` (the
state-dict keys stay the same: a ``Float8Linear`` keeps ``weight`` and
``bias``), before the parallel lowering, as torchao and torchtitan order it
(float8 first, then ``fully_shard`` / DDP). On a CUDA device of compute
capability 8.9 or later the matmuls are ``torch._scaled_mm``'s; on a CPU
torchao's emulation runs (``Float8LinearConfig.emulate``: the operands are
rounded to float8 with their scales, exactly as on a GPU, and multiplied in
fp32), which is what the tests train with. Any other device is refused with
one line naming it. torchao is optional (``pip install 'autopar[float8]'``)
and imported only here, when a plan asks for float8.

What runs is proven for DDP and FSDP2/ZeRO plans, also under context parallelism
(cp=2 at ZeRO-3 with each attention method: a cp rank's linears see its S/cp
tokens, and FSDP2 gathers over dp × cp; ``tests/runtime/test_float8_training.py``);
:mod:`autopar.admission` refuses the other lowerings (tensor parallelism: autopar's
sharding runtime rewrites the linears' ops itself and torchao's float8 tensor-
parallel styles are not wired in; pipelines, experts: not tried) before the
first collective.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import torch
import torch.nn as nn

from autopar.admission import Here, float8_device_refusal
from autopar.contract import Engine, data_ranks, plan_layout
from autopar.errors import Float8Error
from autopar.float8 import Float8Settings
from autopar.graph import LayerGraph
from autopar.plan import Plan
from autopar.runtime.here import device_facts

# "tensorwise"/"rowwise": ``compile``'s float8 defaults to it (set by ``autopar run --float8``)
FLOAT8_ENV = "AUTOPAR_FLOAT8"


def requested(float8: Any) -> Any:
    """``float8`` as given, else the recipe ``autopar run --float8`` set for this process."""
    if float8 is None and os.environ.get(FLOAT8_ENV):
        return os.environ[FLOAT8_ENV]
    return float8


def check_device(device: torch.device | None = None) -> bool:
    """Whether this process's device emulates float8 (a CPU); raises :class:`Float8Error` naming a device
    without float8 matmuls (:func:`autopar.admission.float8_device_refusal`)."""
    facts = Here(world_size=1, **device_facts(device))
    if why := float8_device_refusal(facts):
        raise Float8Error(why)
    return facts.device == "cpu"


def _torchao() -> Any:
    try:
        import torchao.float8 as f8
    except ImportError:
        raise Float8Error("float8 training needs torchao, which is not installed: "
                          "pip install 'autopar[float8]' (torchao 0.18)") from None
    return f8


def gathered_in_float8(plan: Plan, graph: LayerGraph) -> frozenset[str]:
    """The converted linears whose weights FSDP2 gathers in float8: with the plan's ``fsdp_all_gather``,
    those of layers a ``fully_shard`` unit holds (the contract's role: ZeRO ≥ 1 over more than one data
    rank, dp × cp), which is where pricing moves their all-gathers to 1 byte an element (``planning.pricing``);
    a replicated layer's weights are never gathered."""
    settings = plan.training.float8
    if settings is None or not settings.fsdp_all_gather or data_ranks(plan.mesh) <= 1:
        return frozenset()
    sharded = {role.name for role in plan_layout(graph, plan).layers
               if role.engine is Engine.FULLY_SHARD and role.zero >= 1}
    return frozenset(l.path for l in settings.linears if l.layer in sharded)


def convert(model: nn.Module, settings: Float8Settings, *, emulate: bool,
            gathered: frozenset[str] = frozenset()) -> list[str]:
    """Swap the plan's linears of ``model`` for ``Float8Linear`` in place (``emulate``: torchao's fp32
    matmuls, on a CPU; ``gathered``: the paths whose weights FSDP2 will gather in float8,
    :func:`gathered_in_float8`); returns the paths converted, which must be all the plan names."""
    f8 = _torchao()
    config = f8.Float8LinearConfig.from_recipe_name(settings.recipe.value)
    if emulate:
        config = dataclasses.replace(config, emulate=True)
    wanted = settings.paths()
    missing = sorted(p for p in wanted if not isinstance(_get(model, p), nn.Linear))
    if missing:
        raise Float8Error(f"the plan's float8 linears {', '.join(missing[:3])} are not nn.Linear modules of this "
                          f"model: re-plan it with --float8")
    if gathered:
        f8.convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in gathered,
                                      config=dataclasses.replace(config, enable_fsdp_float8_all_gather=True))
    f8.convert_to_float8_training(model, module_filter_fn=lambda _m, fqn: fqn in wanted - gathered, config=config)
    return sorted(p for p, m in model.named_modules() if type(m).__name__ == "Float8Linear")


def precompute_scales(module: nn.Module) -> None:
    """Before a step's forward: every float8-gathered weight's scale from one all-reduce of their amaxes
    (torchao's ``precompute_float8_dynamic_scale_for_fsdp``; the same scale, to the bit, as each weight's
    own all-reduce before its gather, which is what runs without it)."""
    _torchao().precompute_float8_dynamic_scale_for_fsdp(module)


def drop_scales(module: nn.Module) -> None:
    """After the step has moved the weights: forget the scales :func:`precompute_scales` set, so that a
    forward outside ``train_step`` (or after a checkpoint load) takes each weight's own amax again
    rather than a scale of weights that no longer exist."""
    for m in module.modules():
        local = getattr(getattr(m, "weight", None), "_local_tensor", None)
        if local is not None and hasattr(local, "_precomputed_scale"):
            local._precomputed_scale = None


def _get(model: nn.Module, path: str) -> nn.Module | None:
    try:
        return model.get_submodule(path)
    except AttributeError:
        return None


__all__ = ["FLOAT8_ENV", "check_device", "convert", "drop_scales", "gathered_in_float8", "precompute_scales",
           "requested"]
