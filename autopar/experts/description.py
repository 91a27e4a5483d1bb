"""What a routed-experts layer is, in one record capture writes and pricing, the contract and every pass read
(:class:`MoEFacts`).

Capture recognises an MoE block by what it computes (``autopar.capturing.moe``):
a router — a weight with one row per expert — beside experts held either as
3-D parameters whose first dim is the expert (a per-expert GEMM chain: two or
more ``[E, ·, ·]`` weights) or as an ``nn.ModuleList`` of identical modules;
how the block calls its experts (:class:`Call`, recorded from one call) and
which library's weight layout they hold (``autopar.experts.layouts``, the one
module that names any library's expert parameters). What it reads is kept
here, per layer, so that every price of the layer (its FLOPs per token, its
memory, its all-to-all volume and its experts' share per rank under ``ep``) and
every lowering of it (``passes/expert_*.py``) reads one description.

A routed token costs top-k experts' FLOPs plus the router's and the shared
experts'; every expert's parameters, gradients and optimizer state are held
(``routed_params`` of them, all in the layer's ``param_count``).
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from enum import StrEnum
from typing import Any

# Load-imbalance margin on the routed activations of one rank when the experts are split over ranks
# and routing is dropless (no capacity): a rank's experts receive a share of the tokens that varies from
# step to step, and the step's memory must hold the largest share, not the mean. 1.25 is the training
# capacity factor of the Switch Transformer (Fedus et al. 2022, JMLR, §2.2 and Table 1: 1.0–1.25 kept
# quality while dropping few tokens), i.e. the imbalance a trained router with an auxiliary
# load-balancing loss is held to.
DEFAULT_IMBALANCE_MARGIN = 1.25


class RouterKind(StrEnum):
    """How a router scores experts and picks its top-k (read from the router module)."""

    SOFTMAX_TOPK = "softmax top-k"  # Mixtral, Qwen2/3-MoE, Switch, GShard: softmax over experts, top-k
    SIGMOID_GROUPED = "sigmoid + bias, group-limited top-k"  # DeepSeek-V3: correction bias, n_group/topk_group
    UNREAD = "top-k (scoring not read)"  # a router module autopar does not know: its top-k is still read


class ExpertLayout(StrEnum):
    """How the experts' weights are held."""

    FUSED = "3-D parameters"  # [E, ...] per weight: grouped GEMM, a loop over the expert dim or one-hot einsum
    MODULE_LIST = "module list"  # nn.ModuleList of E identical modules


class Call(StrEnum):
    """How a block calls its 3-D experts, recorded from one call at capture; ep reroutes that call
    (``autopar.experts.calls``: the same conventions run split over ranks, proved in one process)."""

    INDEXED = "experts(hidden [T, H], top_k_index [T, k], top_k_weights [T, k])"  # Hugging Face 5.x, gpt-oss
    GROUPED = "experts(rows sorted by expert [R, H], rows per expert [E])"  # torchtitan's GroupedExperts
    BLOCKED = "experts(rows [E·T, H], expert-major)"  # Llama 4: every expert on every (scored) token
    NONE = "not called as a module"  # a module list, or a block holding its 3-D experts itself


class Dispatch(StrEnum):
    """How the captured graph moves tokens to experts, as far as capture could see it run."""

    GROUPED = "grouped GEMM"  # rows sorted by expert, one grouped GEMM per projection (static shapes)
    # Hugging Face's eager loop over the experts hit, captured through HF's own grouped_mm path (the same
    # function of the same weights, with static shapes); the eager loop is what runs
    HF_EAGER = "eager loop, captured as HF's grouped GEMM"
    CAPACITY = "one-hot einsum"  # one-hot dispatch/combine einsums into [E, capacity, H] buffers (GShard, Switch)
    LOOP = "per-expert loop"  # a data-dependent loop, measured on real example inputs
    STAND_IN = "stand-in"  # a data-dependent loop on the meta device: the block priced from its structure


@dataclass(frozen=True)
class MoEFacts:
    """One mixture-of-experts block of a layer, as capture read it.

    ``expert_params`` is one routed expert's parameter count and
    ``expert_flops_per_token`` its forward FLOPs for one token it receives
    (2 × its matrix parameters: each weight element is one multiply-add per
    row). ``routed_activation_bytes_per_sample`` is what the routed experts
    save for backward, per sample, as captured (dropless routing: every routed
    row exactly once; fixed capacity: the capacity-sized buffers the model
    allocates).
    """

    module_path: str
    experts_path: str
    num_experts: int
    top_k: int
    expert_params: int
    expert_flops_per_token: float
    router_params: int
    router: RouterKind
    layout: ExpertLayout
    dispatch: Dispatch
    shared_params: int = 0
    shared_flops_per_token: float = 0.0
    capacity_factor: float | None = None
    routed_activation_bytes_per_sample: float = 0.0
    # a module list run by the block's own loop: why ep cannot reroute that loop ("" where capture
    # proved the rerouted forward equal to the block's own: autopar/capturing/moe_reroute.py); a capacity
    # block's own 3-D experts: why ep cannot split its expert region (autopar/capturing/moe_capacity.py)
    reroute_refusal: str = ""
    call: Call = Call.NONE  # how the block calls its 3-D experts module (Call.NONE otherwise)
    weights: str = ""  # the weight layout's name (autopar.experts.layouts.LAYOUTS), "" when no library's
    per_expert: tuple[str, ...] = ()  # the experts module's own [E, …] parameters: what ep shards on dim 0
    router_path: str = ""
    shared_paths: tuple[str, ...] = ()  # shared experts beside the routed ones (every token runs them)
    router_bias: str = ""  # the router's per-expert balance bias buffer (DeepSeek-V3): runtime/balance.py

    @property
    def expert_tensors(self) -> int:
        """The tensors ep holds this block's experts in: a module list's local experts are one flat bucket;
        3-D experts, their [E, …] weights (two where capture did not list them: GShard's w_in, w_out)."""
        if self.layout is ExpertLayout.MODULE_LIST:
            return 1
        return len(self.per_expert) or 2

    @property
    def routed_params(self) -> int:
        """Every routed expert's parameters (held in full at ep = 1)."""
        return self.num_experts * self.expert_params

    @property
    def active_params(self) -> int:
        """The parameters one token's forward reads: its top-k experts, the shared experts, the router."""
        return self.top_k * self.expert_params + self.shared_params + self.router_params

    @property
    def flops_per_token(self) -> float:
        """Forward FLOPs of the block per token: top-k experts, the shared experts and the router's scores."""
        return (self.top_k * self.expert_flops_per_token + self.shared_flops_per_token
                + 2.0 * self.router_params)

    @property
    def block_held(self) -> bool:
        """Whether the experts are the block's own 3-D weights (GShard/Switch): ep splits them in place
        (``passes/expert_capacity.py``), and they cannot be an FSDP2 unit apart from the block's router."""
        return self.layout is ExpertLayout.FUSED and self.experts_path == self.module_path

    @property
    def drops_tokens(self) -> bool:
        """Whether a fixed capacity can drop tokens: an expert receives at most every token of a call (a
        token picks an expert once), so capacity ⌈cf · T · k / E⌉ ≥ T for every T iff cf · k ≥ E."""
        return self.capacity_factor is not None and self.capacity_factor * self.top_k < self.num_experts

    @property
    def split_refusal(self) -> str:
        """Why a split of the batch (dp, cp or microbatches) would change this block's numbers ("" when it
        would not): the capacity is computed from the tokens of one call, and which tokens drop depends
        on it; drop-free (cf ≥ E / top-k) no token drops, whatever the call's tokens."""
        if not self.drops_tokens:
            return ""
        return (f"{self.module_path}: capacity factor {self.capacity_factor:g} × top-{self.top_k} < "
                f"{self.num_experts} experts drops tokens over capacity, and which drop depends on the tokens "
                "of one call, which a split of the batch (dp, cp, microbatches) changes; plan dp=1, cp=1, "
                f"microbatches=1, or use capacity_factor ≥ {self.num_experts / self.top_k:g} (drop-free)")

    @property
    def ep_refusal(self) -> str:
        """Why expert parallelism cannot split this block ("" when it can): ``passes/expert_parallel.py``
        reroutes an experts module of its own holding 3-D weights (Hugging Face's fused ``*Experts``),
        a module list driven by the block's own loop where capture proved that loop reroutable
        (``passes/expert_list.py``), and a capacity block's own 3-D weights where capture proved its
        expert region splittable (``passes/expert_capacity.py``; a block that drops tokens drops them
        per dp rank's microbatch under ep as under dp, :mod:`autopar.batch_coupling`); other expert
        weights held by the block itself are not rerouted."""
        if self.layout is ExpertLayout.MODULE_LIST:
            return f"{self.module_path}: {self.reroute_refusal}" if self.reroute_refusal else ""
        if self.block_held and self.dispatch is Dispatch.CAPACITY:  # split between dispatch and combine
            # each rank dispatches its own tokens with its own capacity: a token-dropping block computes its
            # capacity per dp rank's microbatch under ep as under dp alone (autopar.batch_coupling's split)
            return f"{self.module_path}: {self.reroute_refusal}" if self.reroute_refusal else ""
        if self.experts_path == self.module_path:
            return f"{self.module_path}: its expert weights are the block's own (no experts module to reroute)"
        if self.reroute_refusal:  # capture's proof of the rerouted call failed (autopar.experts.calls.proof)
            held = self.weights or "a layout of no known library"
            return (f"{self.module_path}: experts {self.experts_path!r} ({held}, called as {self.call}): "
                    f"{self.reroute_refusal}")
        return ""

    def activation_margin(self, ep: int = 1) -> float:
        """The factor on ``routed_activation_bytes_per_sample`` one rank must hold at expert-parallel
        degree ``ep``.

        1.0 when a rank holds every expert (``ep`` = 1): dropless routing sends
        every token to exactly top-k experts, so the rows the experts process
        add up to tokens × top-k whatever the balance. 1.0 also with a
        capacity factor: the capacity-sized buffers are the model's own, and
        capture measured them. Otherwise :data:`DEFAULT_IMBALANCE_MARGIN`: a
        rank's share of the experts receives a share of the tokens that
        varies with the routing.
        """
        if ep <= 1 or self.capacity_factor is not None:
            return 1.0
        return DEFAULT_IMBALANCE_MARGIN

    def describe(self) -> str:
        """One line for the plan: the experts, their top-k, the router and how dispatch was captured."""
        shared = f" + shared experts ({self.shared_params:,} parameters)" if self.shared_params else ""
        held = f"{self.layout}: {self.weights}" if self.weights else str(self.layout)
        cap = f", capacity factor {self.capacity_factor:g}" if self.capacity_factor is not None else ""
        return (f"{self.num_experts} experts ({held}, {self.expert_params:,} parameters each), "
                f"top-{self.top_k}{shared}, router {self.router}, dispatch: {self.dispatch}{cap}")

    def signature(self) -> tuple:
        return (self.num_experts, self.top_k, self.expert_params, round(self.expert_flops_per_token, 3),
                self.shared_params, self.capacity_factor, self.dispatch.value,
                round(self.routed_activation_bytes_per_sample, 3))

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> MoEFacts:
        d = dict(d)
        d["router"], d["layout"], d["dispatch"] = (RouterKind(d["router"]), ExpertLayout(d["layout"]),
                                                   Dispatch(d["dispatch"]))
        d["call"] = Call(d.get("call", Call.NONE))
        d["per_expert"], d["shared_paths"] = tuple(d.get("per_expert", ())), tuple(d.get("shared_paths", ()))
        return cls(**d)


__all__ = ["DEFAULT_IMBALANCE_MARGIN", "Call", "Dispatch", "ExpertLayout", "MoEFacts", "RouterKind"]
