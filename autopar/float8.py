"""float8 training as a plan choice: which linear layers run their matmuls in float8, and where it runs.

torchao's ``convert_to_float8_training`` swaps ``nn.Linear`` modules for
``Float8Linear``, which casts each operand of the forward and both backward
GEMMs to float8 with a dynamic scale (one per tensor, ``tensorwise``; one per
row, ``rowwise``) and multiplies with ``torch._scaled_mm``. Which linears are
converted is part of the plan (:class:`Float8Settings`), decided here from the
model's modules once and then read by pricing (those GEMMs at the device's
float8 peak, plus the casts: :mod:`autopar.planning.layer_compute`) and by the
runtime (the same modules converted, :mod:`autopar.runtime.float8`).

The default rule (:func:`select_linears`): every ``nn.Linear`` inside a
repeated block of the stack (:attr:`autopar.graph.LayerGraph.blocks`) whose
``in_features`` and ``out_features`` are multiples of 16. Not the layers
outside the blocks: the embedding is no linear, and the output head is the
projection whose rounding reaches the loss directly — torchtitan's float8
converter leaves ``output`` out by default and torchao's own example filter
keeps "the last module" in high precision, as does Hugging Face Accelerate
("keeping the first and last layers unquantized" for stability). Multiples of
16: ``torch._scaled_mm`` (cuBLASLt's float8 GEMM) needs both weight
dimensions divisible by 16, the condition of torchao's example filter
(``convert_to_float8_training``'s documentation).

Where it runs (:func:`float8_device`): a device with a float8 peak
(``DeviceSpec.peak_flops_fp8``: SM 8.9 and later); a CPU (a ``gloo``
cluster) as torchao's emulation (``Float8LinearConfig.emulate``: the casts to
float8 and back are real, the GEMM runs in fp32 on the rounded values), priced
at the CPU's own peak with no speedup and a note saying so; any other device
is refused with one line naming it and what float8 needs.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum
from typing import Any

from autopar.cost_models.gpu_figures import FP8_MIN_COMPUTE_CAPABILITY
from autopar.cost_models.hardware import ClusterSpec
from autopar.errors import Float8Error, PlanError

FLOAT8_MULTIPLE = 16  # both weight dimensions of a converted linear (torch._scaled_mm's requirement)
SM = ".".join(map(str, FP8_MIN_COMPUTE_CAPABILITY))
NEEDS = (f"float8 matmuls need a GPU of compute capability {SM} or later (L4, L40S, H100, H200, B200) "
         "with its float8 peak in the cluster (device.peak_flops_fp8)")


class Recipe(StrEnum):
    """torchao's float8 scaling recipes (``Float8LinearConfig.from_recipe_name``)."""

    TENSORWISE = "tensorwise"
    ROWWISE = "rowwise"


@dataclass(frozen=True)
class Float8Linear:
    """One converted linear: its module path, the plan layer that holds it, its weight's shape."""

    path: str
    layer: str
    in_features: int
    out_features: int

    def to_dict(self) -> dict[str, Any]:
        return {"path": self.path, "layer": self.layer, "in_features": self.in_features,
                "out_features": self.out_features}


@dataclass(frozen=True)
class Float8Settings:
    """The plan's float8 choice (``training.float8`` in the file): the recipe, the converted linears, and
    whether FSDP2 all-gathers their weights in float8 (``fsdp_all_gather``: torchao's
    ``enable_fsdp_float8_all_gather``, tensorwise only). Gathered in float8, each weight is cast on the
    rank's shard with the amax of the whole weight (an all-reduce of one value over the dp group) and
    moves 1 byte an element instead of the plan's dtype's; the GEMMs see the same float8 weight as
    when the cast follows the gather, so the numbers do not change (2 gloo ranks, ZeRO-3, 3 SGD steps:
    equal to the last bit). It matters where a fully_shard unit gathers weights; a DDP plan ignores it."""

    recipe: Recipe
    linears: tuple[Float8Linear, ...]
    fsdp_all_gather: bool = False

    def __post_init__(self) -> None:
        object.__setattr__(self, "recipe", Recipe(self.recipe))
        if self.fsdp_all_gather and self.recipe is not Recipe.TENSORWISE:
            raise PlanError(f"float8: FSDP2's float8 all-gather runs tensorwise scaling only, not "
                            f"{self.recipe.value} (torchao's enable_fsdp_float8_all_gather)")

    def gathered_elements(self, layer: str) -> tuple[int, int]:
        """(weight elements, weights) of ``layer``'s converted linears FSDP2 gathers in float8
        ((0, 0) when the weights are gathered in the plan's dtype)."""
        if not self.fsdp_all_gather:
            return 0, 0
        mine = [l for l in self.linears if l.layer == layer]
        return sum(l.in_features * l.out_features for l in mine), len(mine)

    def shapes(self, layer: str) -> frozenset[tuple[int, int]]:
        """(out_features, in_features) of the converted linears of ``layer``: the (n, k) of the GEMMs
        pricing runs in float8 (a GEMM of the layer with another shape stays in the plan's dtype)."""
        return frozenset((l.out_features, l.in_features) for l in self.linears if l.layer == layer)

    def paths(self) -> frozenset[str]:
        return frozenset(l.path for l in self.linears)

    def to_dict(self) -> dict[str, Any]:
        return {"recipe": self.recipe.value, "linears": [l.to_dict() for l in self.linears],
                "fsdp_all_gather": self.fsdp_all_gather}

    @classmethod
    def from_dict(cls, d: Any, source: str = "training.float8") -> Float8Settings:
        """The settings of a plan file (one written before ``fsdp_all_gather`` existed gathers in the
        plan's dtype, as it was priced)."""
        if (not isinstance(d, dict) or not {"recipe", "linears"} <= set(d) <= {"recipe", "linears", "fsdp_all_gather"}
                or not isinstance(d["linears"], list) or not isinstance(d.get("fsdp_all_gather", False), bool)):
            raise PlanError(f"{source} must be an object with 'recipe', a list 'linears' and optionally a "
                            "boolean 'fsdp_all_gather'")
        try:
            recipe = Recipe(d["recipe"])
        except ValueError:
            raise PlanError(f"{source}: recipe is {d['recipe']!r}; use "
                            f"{' or '.join(r.value for r in Recipe)}") from None
        linears = []
        for item in d["linears"]:
            keys = ("path", "layer", "in_features", "out_features")
            if (not isinstance(item, dict) or set(item) != set(keys)
                    or not all(isinstance(item[k], str) for k in keys[:2])
                    or not all(isinstance(item[k], int) and not isinstance(item[k], bool) for k in keys[2:])):
                raise PlanError(f"{source}: each linear is {{path, layer, in_features, out_features}}, "
                                f"got {item!r}")
            linears.append(Float8Linear(**item))
        return cls(recipe, tuple(linears), d.get("fsdp_all_gather", False))


def parse_recipe(value: str | bool | Recipe) -> Recipe:
    """``True`` (tensorwise, torchao's default and the one FSDP2's float8 all-gather supports), or a name."""
    if value is True:
        return Recipe.TENSORWISE
    try:
        return Recipe(value)
    except ValueError:
        raise Float8Error(f"float8 recipe {value!r} is not one of "
                          f"{', '.join(r.value for r in Recipe)}") from None


def select_linears(model: Any, graph: Any) -> tuple[Float8Linear, ...]:
    """The default rule (module docstring): every ``nn.Linear`` of a repeated block whose dimensions are
    multiples of :data:`FLOAT8_MULTIPLE`, in module order, each with the layer that holds it."""
    import torch.nn as nn

    blocks = {l.module_path: l.name for l, is_block in zip(graph.layers, graph.blocks) if is_block}
    found = []
    for path, module in model.named_modules():
        if type(module) is not nn.Linear:  # a subclass may compute otherwise; torchao swaps plain ones
            continue
        owner = next((b for b in blocks if path.startswith(b + ".")), None)
        if owner is None:
            continue
        if module.in_features % FLOAT8_MULTIPLE or module.out_features % FLOAT8_MULTIPLE:
            continue
        found.append(Float8Linear(path, blocks[owner], module.in_features, module.out_features))
    return tuple(found)


def settings_for(model: Any, graph: Any, recipe: str | bool | Recipe) -> Float8Settings:
    """:class:`Float8Settings` for ``model`` by the default rule; refused when no linear qualifies."""
    chosen = parse_recipe(recipe)
    linears = select_linears(model, graph)
    if not linears:
        raise Float8Error(f"float8: the model has no "
                          f"nn.Linear inside a repeated block with both dimensions multiples of "
                          f"{FLOAT8_MULTIPLE}: nothing to convert; drop --float8")
    # tensorwise: FSDP2 gathers the weights in float8 (half of bf16's bytes, same numbers), as torchtitan
    # recommends with it; rowwise scales per row, which torchao's float8 all-gather does not run
    return Float8Settings(chosen, linears, fsdp_all_gather=chosen is Recipe.TENSORWISE)


def emulated(cluster: ClusterSpec) -> bool:
    """Whether float8 on ``cluster`` is torchao's emulation (a CPU cluster); raises :class:`Float8Error`
    naming the device when it has no float8 peak and is no CPU."""
    if cluster.device.peak_flops_fp8 > 0:
        return False
    if cluster.backend == "gloo":
        return True
    raise Float8Error(f"--float8: {cluster.device.name} (cluster {cluster.name!r}) has no float8 matmuls; "
                      f"{NEEDS}")


def describe(settings: Float8Settings, dtype: str = "bf16", *, sharded: bool = False) -> str:
    """One line for ``show``: the recipe and which linears of which layers (by their path inside the
    layer, once per run of layers converting the same ones), and, in a plan whose FSDP2 units gather
    weights (``sharded``), whether they gather them in float8."""
    layers: dict[str, list[str]] = {}
    for l in settings.linears:
        rel = l.path[len(l.layer) + 1:] if l.path.startswith(l.layer + ".") else l.path
        layers.setdefault(l.layer, []).append(rel)
    runs: list[tuple[tuple[str, ...], list[str]]] = []
    for layer, rels in layers.items():
        if runs and runs[-1][0] == tuple(rels):
            runs[-1][1].append(layer)
        else:
            runs.append((tuple(rels), [layer]))
    parts = [f"{', '.join(rels)} of {names[0]}" + (f" … {names[-1]} ({len(names)} layers)" if len(names) > 1 else "")
             for rels, names in runs]
    gathered = "; FSDP2 gathers their weights in float8" if settings.fsdp_all_gather and sharded else ""
    return (f"{settings.recipe.value} scaling, {len(settings.linears)} linears: {'; '.join(parts)}; "
            f"every other layer in {dtype}{gathered}")


__all__ = ["FLOAT8_MULTIPLE", "NEEDS", "Float8Linear", "Float8Settings", "Recipe", "describe", "emulated",
           "parse_recipe", "select_linears", "settings_for"]
