"""Every library's names for the parts of a routed-experts layer, in one place: a new layout is one entry here.

Capture finds experts by what they compute (two or more ``[E, ·, ·]`` weights
of one module, or a module list; ``autopar.capturing.moe``) and ep reroutes
the block's call of them whatever their names (``autopar.experts.calls``).
What still needs a library's names is read here, and only here:

- :data:`LAYOUTS`: which parameters are the gate, up and down projections,
  in which orientation, with which biases — named in plans and refusals, and
  read by the one lowering that splits an expert inside
  (expert tensor parallelism: :func:`hidden_split_refusal`, ``passes/expert_tensor.py``);
- the attributes a block's top-k, a router, shared experts, a router's balance
  bias and Hugging Face's experts implementation switch go by.

The orientation is what the forward multiplies by: ``[E, out, in]`` with
``F.linear(x, W[e])`` (Hugging Face's Mixtral family, torchtitan) or
``[E, in, out]`` with ``x @ W[e]`` (gpt-oss, Llama 4).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from autopar.experts.description import Call


@dataclass(frozen=True)
class WeightLayout:
    """One library's expert weights: their names, and how a token's expert output is computed from them."""

    name: str
    library: str
    call: Call  # how the library's blocks call these experts (what capture records on a block it can run)
    down: str
    gate_up: str = ""  # gate and up fused in one weight
    gate: str = ""  # or held apart
    up: str = ""
    biases: tuple[str, ...] = ()
    transposed: bool = False  # [E, in, out] (x @ W[e]) rather than [E, out, in] (F.linear(x, W[e]))
    interleaved: bool = False  # a fused gate_up's gate and up alternate (gpt-oss) rather than gate half first

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(n for n in (self.gate_up, self.gate, self.up, self.down, *self.biases) if n)

    def matches(self, shapes: dict[str, tuple[int, ...]]) -> bool:
        """Whether a module's own parameters (name → shape) are this layout's, all [E, …] over one E."""
        if set(shapes) != set(self.names) or len({s[0] for s in shapes.values()}) != 1:
            return False
        down = shapes[self.down]
        hidden, inner = (down[2], down[1]) if self.transposed else (down[1], down[2])
        fused = (2 * inner, hidden) if not self.transposed else (hidden, 2 * inner)
        single = (inner, hidden) if not self.transposed else (hidden, inner)
        if self.gate_up and shapes[self.gate_up][1:] != fused:
            return False
        return all(shapes[n][1:] == single for n in (self.gate, self.up) if n)


LAYOUTS: tuple[WeightLayout, ...] = (
    # Mixtral, Qwen2/3-MoE, DeepSeek-V3, … (transformers 5.x *Experts): gate_up [E, 2I, H], down [E, H, I]
    WeightLayout("hf-fused", "Hugging Face fused *Experts", Call.INDEXED, down="down_proj", gate_up="gate_up_proj"),
    # GptOssExperts: gate_up [E, H, 2I] (gate, up interleaved), down [E, I, H], biases, clamped SwiGLU
    WeightLayout("gpt-oss", "Hugging Face GptOssExperts", Call.INDEXED, down="down_proj", gate_up="gate_up_proj",
                 biases=("gate_up_proj_bias", "down_proj_bias"), transposed=True, interleaved=True),
    # Llama4TextExperts: gate_up [E, H, 2I], down [E, I, H], run by bmm on every expert's block of rows
    WeightLayout("llama4", "Hugging Face Llama4TextExperts", Call.BLOCKED, down="down_proj", gate_up="gate_up_proj",
                 transposed=True),
    # torchtitan's GroupedExperts: w1 (gate) [E, I, H], w2 (down) [E, H, I], w3 (up) [E, I, H]
    WeightLayout("torchtitan", "torchtitan GroupedExperts", Call.GROUPED, down="w2", gate="w1", up="w3"),
)

TOP_K_ATTRS = ("top_k", "num_experts_per_tok", "k", "topk", "moe_top_k")  # on a block, its router or config
ROUTER_NAMES = ("gate", "router", "gating", "wg", "switch")  # a router child's name, preferred among candidates
SHARED_PREFIX = "shared"  # shared experts: Qwen2-MoE's shared_expert, DeepSeek's shared_experts, Llama 4's …
ROUTER_BIAS = "e_score_correction_bias"  # DeepSeek-V3's per-expert routing bias (Hugging Face's buffer name)
HF_EXPERTS_SWITCH = "_experts_implementation"  # transformers 5.x: config field choosing eager/grouped_mm/batched_mm
ACTIVATION = "act_fn"  # the fused layout's activation attribute (SiLU for Mixtral's family)


def identify(experts: Any, call: str = "") -> WeightLayout | None:
    """The layout of ``experts``' own parameters (None for a layout of no known library). Hugging Face's
    fused and Llama 4's differ only by orientation, the same shapes where H = 2I: the block's call tells
    them apart (Llama 4's runs every expert on every token's block of rows)."""
    shapes = {n: tuple(p.shape) for n, p in experts.named_parameters(recurse=False)}
    found = [layout for layout in LAYOUTS if layout.matches(shapes)]
    if len(found) > 1:
        found = [layout for layout in found if (layout.name == "llama4") == ("E·T" in call)] or found
    if found and found[0].name == "hf-fused" and (getattr(experts, "is_transposed", False)
                                                  or getattr(experts, "has_bias", False)):
        return None  # transformers' flags say another orientation, or biases this entry does not name
    return found[0] if found else None


def hidden_split_refusal(experts: Any) -> str:
    """Why ``experts`` cannot be split across their hidden dim I over tp ("" when they can): Hugging Face's
    fused layout, gate half first, no bias (a down-projection bias would be added on every rank), no
    post-expert norm, an activation between (``passes/expert_tensor.py`` splits the rows of each half)."""
    layout = identify(experts)
    own = sorted(n for n, _ in experts.named_parameters(recurse=False))
    if layout is None or layout.name != "hf-fused":
        return (f"{type(experts).__name__} holds {own} ({layout.library if layout else 'no known layout'}); "
                "only Hugging Face's fused gate_up_proj [E, 2I, H] / down_proj [E, H, I] is split across its "
                "hidden dim")
    if (not callable(getattr(experts, ACTIVATION, None)) or not getattr(experts, "has_gate", True)
            or getattr(experts, "has_post_expert_norm", False) or not getattr(experts, "is_concatenated", True)):
        return (f"{type(experts).__name__} is ungated or normed after its experts "
                "(only the gated act(gate) * up layout without bias is split)")
    return ""


def hidden_split_weights(experts: Any) -> tuple[str, str]:
    """(fused gate_up, down) names of experts :func:`hidden_split_refusal` accepts."""
    layout = identify(experts)
    assert layout is not None and layout.name == "hf-fused", type(experts).__name__
    return layout.gate_up, layout.down


def uses_hf_switch(module: Any) -> bool:
    """Whether ``module`` is a transformers 5.x experts module whose implementation its config selects."""
    return (hasattr(module, "_is_expert_parallel") and hasattr(module, "config")
            and hasattr(module, "has_gate"))


__all__ = ["ACTIVATION", "HF_EXPERTS_SWITCH", "LAYOUTS", "ROUTER_BIAS", "ROUTER_NAMES", "SHARED_PREFIX",
           "TOP_K_ATTRS", "WeightLayout", "hidden_split_refusal", "hidden_split_weights", "identify",
           "uses_hf_switch"]
