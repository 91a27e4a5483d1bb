"""The device mesh: every parallelism axis, declared once.

An axis is one :class:`MeshAxis` in :data:`AXES`, outermost first. That one
declaration gives it

* its **degree** in :class:`Mesh` (``mesh.pp``, ``mesh["pp"]``; 1 when not
  given, so a mesh written before the axis existed means what it meant);
* its **rank stride**: the mesh is row-major over :data:`AXES`, so the
  neighbours of an axis are the product of the later axes' degrees apart
  (:meth:`Mesh.stride`; tp innermost keeps a tensor-parallel group inside
  a node, pp outermost puts pipeline neighbours furthest apart);
* or, for a **folded** axis (``folds``: ``ep`` folds into ``dp`` × ``cp``), no
  ranks of its own: it splits the ranks of the axes it folds into, flattened
  and innermost — an ``ep`` group is ``ep`` neighbouring ranks of one dp × cp
  group (the cp ranks of a sample first, then dp's), as torchtitan and
  Megatron-Core's "parallel folding" lay experts out — so it does not
  multiply the world size, is no dimension of the device mesh
  (:meth:`Mesh.dim_names`), its degree must divide its hosts' product
  (:meth:`Mesh.host`), and its stride is its innermost host's; one declared
  ``outermost`` (``dp_replicate`` folds into ``dp``) splits its hosts' ranks
  outermost instead: its groups are strided, host/degree host ranks apart,
  and what is left of the host (``dp / dp_replicate``, the shard group of
  hybrid sharding) is neighbouring ranks;
* its dimension name in ``init_device_mesh`` (:meth:`Mesh.dim_names`), its pin
  key (``tp=8``) and its key in a plan's ``mesh`` object: all ``name``;
* its **validation**: the degrees multiply to the world size
  (:meth:`Mesh.check_world`), and each degree must divide what the axis
  splits (:meth:`MeshAxis.refusal`, read by the planner's enumeration and by
  pins); an axis the planner does not search (``searched`` False: declared,
  not yet priced or lowered) runs at degree 1 only.

An axis of degree 1 costs nothing and prints nothing (:meth:`Mesh.describe`).
Torch-free: the planner and ``autopar show`` read it without importing torch.
``docs/extending.md`` says what else a real axis needs (its price, its lowering).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from autopar.errors import MeshError


@dataclass(frozen=True)
class AxisLimits:
    """What an axis's degree must divide or stay within, for one planning request."""

    world_size: int
    global_batch: int
    max_stages: int  # the pipeline stages the model can be cut into
    gpus_per_node: int
    experts: tuple[int, ...] = ()  # the expert count of each mixture-of-experts block (autopar.experts)
    layers: int = 0  # the layers of the model (named when an ep pin finds no experts)
    expert_refusal: str = ""  # why ep cannot split some MoE block ("" when it can split them all)
    seq_len: int = 0  # the captured sequence length (0: the inputs have none)
    context_refusal: str = ""  # why cp cannot split this model's sequence ("" when it can: capturing.context)


@dataclass(frozen=True)
class MeshAxis:
    """One parallelism axis. ``name`` is its pin key, its plan-JSON key and its device-mesh dim.

    ``splits`` says in words what a degree > 1 divides; ``check`` returns why a
    degree cannot run for a request (None if it can); ``searched`` False keeps a
    declared axis at degree 1 unless something prices and lowers it;
    ``within_node`` searches only degrees that divide a node (pins may go further);
    ``folds`` names the axes whose ranks a folded axis borrows, outermost first (see the module docstring);
    ``outermost`` puts a folded axis's groups outermost in its hosts' ranks rather than innermost.
    """

    name: str
    splits: str
    check: Callable[[int, AxisLimits], str | None] = field(default=lambda degree, limits: None, compare=False)
    searched: bool = True
    within_node: bool = False
    folds: tuple[str, ...] | None = None
    outermost: bool = False
    pending: str = "nothing prices or lowers it yet"  # why an axis not searched runs at degree 1 only

    def refusal(self, degree: int, limits: AxisLimits) -> str | None:
        """Why ``degree`` cannot run on this axis for ``limits`` (None when it can)."""
        if degree == 1:
            return None
        if not self.searched:
            return f"the {self.name} axis runs at degree 1 only ({self.pending})"
        if limits.world_size % degree:
            return f"{self.name}={degree} does not divide the world size {limits.world_size}"
        return self.check(degree, limits)

    def searched_degrees(self, limits: AxisLimits) -> list[int]:
        """The degrees the planner tries on its own: each divides the world, runs, and (for an axis
        searched within a node) divides the node."""
        if not self.searched:
            return [1]
        return [d for d in divisors(limits.world_size) if self.refusal(d, limits) is None
                and (not self.within_node or limits.gpus_per_node % d == 0)]


@functools.lru_cache(maxsize=64)
def divisors(n: int) -> tuple[int, ...]:
    """The divisors of ``n``, ascending (the search asks for them thousands of times a plan: testing every
    degree up to a world of 4,096 took 1.8 s of GPT-1T's planning)."""
    small = [d for d in range(1, math.isqrt(n) + 1) if n % d == 0]
    return tuple(sorted({*small, *(n // d for d in small)}))


def _pp_check(degree: int, limits: AxisLimits) -> str | None:
    if degree > limits.max_stages:
        return (f"pp={degree} needs {degree} pipeline stages but the model can be cut into at most "
                f"{limits.max_stages}")
    return None


def _dp_check(degree: int, limits: AxisLimits) -> str | None:
    if limits.global_batch % degree:
        return f"batch size {limits.global_batch} does not divide over dp={degree}"
    return None


def _ep_check(degree: int, limits: AxisLimits) -> str | None:
    if not limits.experts:
        return (f"ep={degree} shards the experts of mixture-of-experts layers, but none of this model's "
                f"{limits.layers} layers has experts")
    if limits.expert_refusal:
        return f"ep={degree} cannot split every mixture-of-experts block: {limits.expert_refusal}"
    wrong = sorted({e for e in limits.experts if e % degree})
    if wrong:
        counts = ", ".join(f"{e} experts in {limits.experts.count(e)} of {len(limits.experts)} "
                           f"mixture-of-experts blocks" for e in wrong)
        return f"ep={degree} does not divide the number of experts ({counts})"
    return None


def _cp_check(degree: int, limits: AxisLimits) -> str | None:
    if limits.context_refusal:
        return f"cp={degree} cannot split this model's sequence: {limits.context_refusal}"
    if not limits.seq_len:
        return f"cp={degree} splits the sequence, but this model's inputs have no sequence dimension"
    if limits.seq_len % (2 * degree):
        return (f"cp={degree} needs the sequence length divisible by 2·cp = {2 * degree} (each rank holds a "
                f"head and a tail chunk, so causal work is balanced), got {limits.seq_len}")
    return None


# The axes, outermost first (the rank layout: global rank = ((pp_rank · dp + dp_rank) · cp + cp_rank) · tp
# + tp_rank; ep folds into dp × cp: an ep group is ep consecutive ranks of the flattened dp × cp, the cp
# ranks of one sample first; dp_replicate folds into dp outermost: dp_rank = replica · dp/dp_replicate + shard).
AXES: tuple[MeshAxis, ...] = (
    MeshAxis("pp", "the layers into pipeline stages", _pp_check),
    MeshAxis("dp", "the global batch", _dp_check),
    # hybrid sharding (HSDP): ZeRO shards over dp / dp_replicate × cp neighbouring ranks and all-reduces across
    # the dp_replicate replicas (autopar.contract_hsdp; FSDP2's 2-D mesh, passes/zero.py; priced in
    # planning/hsdp_price.py); 1, the default, shards over all of dp as a plan without the key did
    MeshAxis("dp_replicate", "the dp ranks into replicas of ZeRO's shards (hybrid sharding)", folds=("dp",),
             outermost=True),
    # lowered by passes/expert_parallel.py, priced by autopar.planning.pricing (experts, all-to-all, edp)
    MeshAxis("ep", "the experts of mixture-of-experts layers, over ranks borrowed from dp × cp", _ep_check,
             folds=("dp", "cp")),
    # lowered by passes/context_parallel.py, priced by autopar.planning.pricing (K/V all-gather or Ulysses'
    # head all-to-all, the plan's cp_attention; ÷ cp);
    # between dp and tp, as torchtitan's (dp_shard, cp, tp): the dp × cp ranks shard the weights together
    MeshAxis("cp", "the sequence of every sample (head-tail balanced chunks; attention gathers K/V or "
             "all-to-alls heads)", _cp_check),
    MeshAxis("tp", "each layer's weights and activations (its tensor-parallel style)", within_node=True),
)


def axis_names() -> tuple[str, ...]:
    return tuple(a.name for a in AXES)


def axis(name: str) -> MeshAxis:
    """The declared axis ``name``; a :class:`MeshError` naming the known axes otherwise."""
    for a in AXES:
        if a.name == name:
            return a
    raise MeshError(f"unknown mesh axis {name!r}; the mesh axes are {', '.join(axis_names())}")


@contextmanager
def declared(*extra: MeshAxis) -> Iterator[None]:
    """Declare ``extra`` axes (innermost) for the duration of a block: how a test shows that one
    declaration carries a new axis through planning, plans, pins and lowering."""
    global AXES
    saved = AXES
    AXES = saved + extra
    try:
        yield
    finally:
        AXES = saved


class Mesh:
    """The degree of every declared axis; ``Mesh(pp=2, dp=4)`` leaves the others at 1.

    Frozen, hashable and ordered by its degrees outermost first (pp, then dp, ep, cp, then tp).
    """

    __slots__ = ("_degrees", "_by_name", "_derived")
    _degrees: tuple[tuple[str, int], ...]
    _by_name: dict[str, int]  # the same, for reading a degree by name (the solver reads millions)
    _derived: dict[str, Any]  # items, grid and strides for the axes declared now (:meth:`_layout`)

    def __init__(self, **degrees: int):
        names = axis_names()
        for name, degree in degrees.items():
            if name not in names:
                raise MeshError(f"unknown mesh axis {name!r}; the mesh axes are {', '.join(names)}")
            if isinstance(degree, bool) or not isinstance(degree, int) or degree < 1:
                raise MeshError(f"mesh axis {name} must be a positive integer, got {degree!r}")
        object.__setattr__(self, "_degrees", tuple((n, degrees.get(n, 1)) for n in names))
        object.__setattr__(self, "_by_name", dict(self._degrees))
        object.__setattr__(self, "_derived", {})
        for a in AXES:
            if a.folds is not None and self.host(a.name) % getattr(self, a.name):
                raise MeshError(f"{a.name}={getattr(self, a.name)} must divide {hosts_text(a, self._by_name)} "
                                f"({a.name} borrows its ranks from {' × '.join(a.folds)})")

    @classmethod
    def of(cls, degrees: Mapping[str, int]) -> Mesh:
        return cls(**dict(degrees))

    # ------------------------------------------------------------ reading

    def __getattr__(self, name: str) -> int:
        if name.startswith("_"):
            raise AttributeError(name)
        degree = self._by_name.get(name)
        if degree is not None:
            return degree
        if name in axis_names():  # declared after this mesh was made
            return 1
        raise AttributeError(f"'Mesh' has no attribute {name!r} (mesh axes: {', '.join(axis_names())})")

    def __getitem__(self, name: str) -> int:
        axis(name)  # an unknown name is a MeshError
        return getattr(self, name)

    def __setattr__(self, name: str, value: Any) -> None:
        raise AttributeError("a Mesh is frozen: build another with Mesh.replace")

    def _layout(self) -> dict[str, Any]:
        """:meth:`items`, :meth:`grid` and every axis's :meth:`stride`, computed once for the axes declared
        now (again if :func:`declared` changed them): the solver reads them for every layer it prices."""
        derived = self._derived
        if derived.get("axes") is not AXES:
            items = tuple((a.name, self._by_name.get(a.name, 1)) for a in AXES)
            grid = tuple((a.name, d) for a, (_, d) in zip(AXES, items) if a.folds is None)
            below = {n: math.prod(d for _, d in grid[i + 1:]) for i, (n, _) in enumerate(grid)}
            strides = {a.name: below[a.folds[-1] if a.folds else a.name] for a in AXES}
            for a in AXES:  # an outermost folded axis: its neighbours a host's worth over its degree apart
                if a.outermost and a.folds:
                    host = math.prod(self._by_name.get(h, 1) for h in a.folds)
                    strides[a.name] = below[a.folds[-1]] * host // self._by_name.get(a.name, 1)
            derived.clear()
            derived.update(axes=AXES, items=items, grid=grid, strides=strides)
        return derived

    def items(self) -> tuple[tuple[str, int], ...]:
        """(axis, degree) for every declared axis, outermost first."""
        return self._layout()["items"]

    def grid(self) -> tuple[tuple[str, int], ...]:
        """(axis, degree) for the axes that own ranks (every axis but the folded ones), outermost first."""
        return self._layout()["grid"]

    @property
    def degrees(self) -> tuple[int, ...]:
        """The device mesh's shape: the degrees of the axes that own ranks (:meth:`grid`)."""
        return tuple(d for _, d in self.grid())

    @property
    def world_size(self) -> int:
        return math.prod(self.degrees)

    def replace(self, **degrees: int) -> Mesh:
        return Mesh(**{**dict(self.items()), **degrees})

    def host(self, name: str) -> int:
        """The ranks a folded axis ``name`` splits: the product of its hosts' degrees (dp × cp for ep)."""
        return math.prod(getattr(self, h) for h in axis(name).folds or ())

    def stride(self, name: str) -> int:
        """Global ranks between neighbours of axis ``name``: the product of the later axes' degrees
        (a folded axis's neighbours are its host's)."""
        strides = self._layout()["strides"]
        if name not in strides:
            axis(name)  # an unknown name is a MeshError
        return strides[name]

    def dim_names(self) -> tuple[str, ...]:
        """``init_device_mesh``'s ``mesh_dim_names``, outermost first (shape: :attr:`degrees`)."""
        return tuple(n for n, _ in self.grid())

    def check_world(self, world_size: int, source: str = "the mesh") -> None:
        if self.world_size != world_size:
            raise MeshError(f"{source} {self.describe(all_axes=True)} does not multiply to world size {world_size}")

    # ------------------------------------------------------------ text and JSON

    def describe(self, sep: str = " × ", *, all_axes: bool = False) -> str:
        """``pp=2 × dp=4``: the axes of degree > 1 (every axis with ``all_axes``); one rank: ``1 rank``."""
        shown = [(n, d) for n, d in self.items() if all_axes or d > 1]
        return sep.join(f"{n}={d}" for n, d in shown) if shown else "1 rank"

    def to_dict(self) -> dict[str, int]:
        """The plan file's ``mesh`` object: every declared axis by name."""
        return dict(self.items())

    @classmethod
    def from_dict(cls, raw: Any, source: str) -> Mesh:
        """A mesh from its JSON object; an axis the file leaves out is 1 (a plan written before the
        axis was declared), an unknown one is a :class:`MeshError` naming the known axes."""
        if not isinstance(raw, dict):
            raise MeshError(f"{source}: field 'mesh' is not a JSON object")
        unknown = sorted(set(raw) - set(axis_names()))
        if unknown:
            raise MeshError(f"{source}: mesh axis {', '.join(map(repr, unknown))} is not one this autopar knows "
                            f"({', '.join(axis_names())}); a newer autopar wrote it")
        for name, degree in raw.items():
            if isinstance(degree, bool) or not isinstance(degree, int):
                raise MeshError(f"{source}: mesh axis {name!r} has the wrong type ({type(degree).__name__})")
        try:
            return cls(**raw)
        except MeshError as exc:
            raise MeshError(f"{source}: {exc}") from None

    def __repr__(self) -> str:
        return f"Mesh({', '.join(f'{n}={d}' for n, d in self.items())})"

    def _order(self) -> tuple[int, ...]:
        return tuple(d for _, d in self.items())

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Mesh) and self.items() == other.items()

    def __hash__(self) -> int:
        return hash(self.items())

    def __lt__(self, other: Mesh) -> bool:
        return self._order() < other._order()

    def __le__(self, other: Mesh) -> bool:
        return self._order() <= other._order()

    def __gt__(self, other: Mesh) -> bool:
        return self._order() > other._order()

    def __ge__(self, other: Mesh) -> bool:
        return self._order() >= other._order()

    def __reduce__(self) -> tuple:
        return (Mesh.of, (dict(self.items()),))


def hosts_text(a: MeshAxis, degrees: Mapping[str, int]) -> str:
    """``dp × cp = 2 × 1 = 2``: a folded axis's hosts and the ranks they give it (``dp=2`` for one host)."""
    hosts = a.folds or ()
    values = [degrees.get(h, 1) for h in hosts]
    if len(hosts) == 1:
        return f"{hosts[0]}={values[0]}"
    return f"{' × '.join(hosts)} = {' × '.join(map(str, values))} = {math.prod(values)}"


def _degree(name: str) -> property:
    return property(lambda self: self._by_name.get(name, 1), doc=f"The degree of the {name} axis.")


for _axis in AXES:  # read as plain properties: the solver reads degrees millions of times, and
    setattr(Mesh, _axis.name, _degree(_axis.name))  # __getattr__ comes only after a failed lookup


def meshes(limits: AxisLimits, pinned: Mapping[str, int]) -> list[Mesh]:
    """Every mesh of ``limits.world_size`` ranks whose degrees run (:meth:`MeshAxis.refusal`): a pinned
    axis at its pin, every other one at a degree it searches. Empty when a pin cannot run; the
    caller says why."""
    found: list[Mesh] = []

    def extend(i: int, left: int, chosen: dict[str, int]) -> None:
        if i == len(AXES):  # a folded axis divides its hosts' product, known once all are chosen
            if left == 1 and all(math.prod(chosen[h] for h in a.folds) % chosen[a.name] == 0
                                 for a in AXES if a.folds is not None):
                found.append(Mesh(**chosen))
            return
        a = AXES[i]
        if a.name in pinned:
            options = [] if a.refusal(pinned[a.name], limits) else [pinned[a.name]]
        else:
            options = a.searched_degrees(limits)
        for degree in options:
            if a.folds is not None:  # borrows its hosts' ranks, consumes none (checked at the leaf)
                extend(i + 1, left, {**chosen, a.name: degree})
            elif left % degree == 0:
                extend(i + 1, left // degree, {**chosen, a.name: degree})

    extend(0, limits.world_size, {})
    return found


__all__ = ["AXES", "AxisLimits", "Mesh", "MeshAxis", "MeshError", "axis", "axis_names", "declared", "hosts_text",
           "meshes"]
