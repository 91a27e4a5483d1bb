"""The planner: choose mesh, microbatches, schedule and per-layer strategies.

Search, in two levels:

1. **Configurations** (:func:`enumerate_configs`): every mesh of the declared
   axes (:mod:`autopar.mesh`: pp × dp × cp × tp = world size, ep folded into dp × cp, each degree dividing
   what its axis splits, tp within a node unless pinned), microbatch count m dividing the
   per-replica batch, schedule (GPipe only where 1F1B cannot run, since
   under this cost model 1F1B has GPipe's time and never more memory;
   interleaved 1F1B with 2 or 4 chunks per rank), and data-parallel mode
   (replicated, or sharded with the root units at ZeRO-1, 2 or 3: the
   contract's, :mod:`autopar.contract`), in :mod:`.configs`; each layer's
   strategies the pins allow in :mod:`.choices`. Each configuration has a
   cheap lower bound on its step time (fastest strategy per layer, perfectly
   balanced stages), and tighter ones with its memory terms
   (:func:`.bounds.pooled_bound_s`: a knapsack over all ranks' memory;
   :func:`.bounds.lower_bound_s`: also rank by rank, with in-flight activations
   and FSDP2's buffers; :func:`.rank_dp.rank_dp`: in a pipeline, also a dynamic
   programme over how many alike blocks each rank holds, run only on a configuration
   about to be solved, whose allotment gives a whole plan offered to the search and
   CP-SAT's start: a plan that meets its bound is proved without a solve). The
   search is best first (branch and bound): a configuration is keyed by its cheap
   bound, then by the pooled one, then by the rank-by-rank one, then by the
   programme's, each computed only when its key is the least of all, and solved
   when its last bound is; the search stops when the least key
   reaches the best plan found, so the answer is optimal over the whole space
   when every inner solve is, and the first plan found is most often the best
   (Llama 3 70B at 131,072 tokens on 512: 7 CP-SAT solves where the search in
   order of the cheap bound made 25, 3.9 s of solve instead of 6.7). One whose
   least memory over every choice its rows offer exceeds the ranks' budgets
   (:func:`.memory_floor.memory_floor_bytes`, the knapsack's own test) is dropped
   before its rows are priced (most of a long-sequence search cannot fit). A
   configuration's first solve is short (``SolverOptions.first_solve_s``); one
   that runs out is solved again, held to the better plans found since, after
   the others (:func:`solve_deferred`). When
   nothing fits, :mod:`.infeasible` names the least memory a plan needs.

2. **Per configuration, a CP-SAT model** (:func:`.model.build_model`) over runs of
   identical consecutive layers (a run r = layers [a_r, b_r), all pricing
   alike), S = pp·v virtual stages, strategies k of each run:

   Variables
     cut_c ∈ allowed cut positions, c = 1..S−1       stage c = layers [cut_c, cut_{c+1})
     cnt_{r,c} = |[a_r, b_r) ∩ [cut_c, cut_{c+1})|   layers of run r in stage c
     n_{r,c,k} ∈ [0, |r|],  Σ_k n_{r,c,k} = cnt_{r,c}  how many of them use strategy k
     T, X                                              critical rank time, tail

   Constraints (each group names the function of :mod:`.model` that adds it)
     contiguity     cut_{c+1} ≥ cut_c + 1 and stage pins       (_add_cuts)
     counts         cnt via min/max of interval ends          (_add_counts)
     rank time      T ≥ Σ_{c on j} Σ n·t + p2p at j's cuts     (_add_rank_terms)
     tail           X ≥ Σ_{c on j} Σ n·(exposed dp comm + optimizer) + Σ_z e_z·f_z
                    f_z ∈ {0,1}: some rank runs an FSDP2 unit at ZeRO ≥ z; e_z what a rank's first
                    and last unit expose over level z − 1 (planning.edges)      (_edge_exposure)
     memory         Σ n·mem_{r,k,j} + workspace_j + rs·u_j + ag·v_j ≤ budget   (memory_j)
                    u_j, v_j ∈ {0,1}: rank j has a ZeRO ≥ 1 / ZeRO-3 layer (FSDP2's buffers)
     rank floors    (redundant) time of a group of alike layers on j ≥ g_j(their count), the least
                    that many can take in j's own memory; T ≥ the bound they give  (add_rank_floors)
     sharded plan   a sharded mode's plan shards some layer (Σ n over ZeRO ≥ 1 ≥ 1), where no
                    root unit holds parameters to imply it              (_add_sharded_plan)

   Objective (× den(w), to stay integral): minimise (m − w)·T + w·S + X with
   S = Σ_j t_j, i.e. step = m·T + w·(S − T) + X, the model of :mod:`autopar.planning.pricing`.
   Where ranks share cores: P + X, with P ≥ that critical path / σ and P ≥ each
   node's work term (:func:`_step_objective`).

Times become integers in one place (:class:`.model.Units`); memory is integral
bytes already. Runs with 1 worker and a deterministic time limit, so the same
inputs give the same plan.

Runners-up. The search keeps the best plan of each *distinct configuration*
(the mesh, and whether data parallelism is sharded; microbatches and
schedule are details within one) until it holds the best ``RUNNERS_UP + 1`` of
them, so a plan can say what came next without solving again
(``autopar explain``). Branch and bound then prunes against the last of those
instead of the best alone: a configuration is skipped, or its CP-SAT model
bounded, by what it must beat to enter the list (:meth:`Search.threshold`).
Pruning against the best would leave no runner-up whenever the first
configuration solved wins. The chosen plan is the same optimum: a
configuration whose bound is no better than the best plan so far can only be
a runner-up, so its CP-SAT solve is short (``RUNNER_UP_SOLVE_S``
deterministic seconds; its candidate says whether it was proved optimal) and
leaves the chosen plan's gap alone. Runners-up are solved after the chosen plan
is proved, not on the way: a configuration that can only be a runner-up waits
until every one that could be chosen is done, and the runners-up then get what
is left of the time limit, at most :data:`RUNNER_UP_SHARE` of it (0.9 s of 30; GPT-1T on
4,096 GPUs: the runners-up's short solves, taken on the way, once spent 24 of
its 30 s and left the optimum unproved), best first as well, each held to plans
within :data:`RUNNER_UP_BAND` of its bound (:func:`_runners_up`). ``runners_up=0``
is the plain search.
"""

from __future__ import annotations

import heapq
import math
import time
from dataclasses import dataclass, field, replace

from ortools.sat.python import cp_model

from autopar.choice import LayerChoice, LossKind
from autopar.cost_models.hardware import ClusterSpec
from autopar.errors import InfeasibleError, PinError
from autopar.graph import LayerGraph
from autopar.pins import Pins
from autopar.planning import hsdp_price
from autopar.planning.bounds import lower_bound_s, pooled_bound_s
from autopar.planning.candidates import Candidates
from autopar.planning.choices import allowed_choices, check_recompute_pins, check_sp_pins
from autopar.planning.configs import cut_positions, enumerate_configs, searched_configs
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.cut_checks import check_stage_pins
from autopar.planning.evaluate import Evaluation
from autopar.planning.infeasible import raise_infeasible
from autopar.planning.memory_floor import memory_floor_bytes
from autopar.planning.model import SolverOptions, cp_solver, hint_plan
from autopar.planning.pricing import PriceTable
from autopar.planning.rank_dp import RankDp, rank_dp
from autopar.planning.shared_prices import SharedPrices
from autopar.planning.solves import (
    Candidate,
    Deferred,
    InFlight,
    Prepared,
    Search,
    bound_objective,
    distinct_key,
    finish,
    overlap_pool,
    prepare,
    solve_deferred,
)

__all__ = ["Candidate", "RUNNERS_UP", "Solution", "SolverOptions", "cut_positions", "distinct_key",
           "enumerate_configs", "solve"]

RUNNERS_UP = 3  # distinct configurations a plan records after its own: enough to see what came next
# CP-SAT deterministic seconds for a configuration that can only be a runner-up, and the most wall time
# the runners-up may take after the chosen plan is proved, as a share of the time limit. Runners-up say
# what came next; one not proved best for its mesh says so (Candidate.optimal). At 0.25 s and 5% they
# took more time than finding and proving the chosen plan (Llama 3 70B × 512: 1.9 of 2.4 s of CP-SAT),
# and at 0.1 s and 3% the first two runners-up of Llama 3 70B × 512 and GPT-3 175B × 1,024 kept their
# meshes and step times (to 0.1%), the third another mesh, 2-3% slower
RUNNER_UP_SOLVE_S = 0.1
RUNNER_UP_SHARE = 0.03
RUNNER_UP_BAND = 0.05  # a runner-up's solve looks for plans within 5% of its bound: _runners_up


@dataclass(frozen=True)
class LossRunnerUp:
    """The chosen plan's own choices priced under the loss it does not run: that loss's kind, the step, and
    whether it fits the memory budget (:func:`autopar.planning.api.whole_logits_if_faster`)."""

    kind: LossKind
    step_time_s: float
    fits: bool


@dataclass
class Solution:
    """The chosen assignment, its prediction, and how the search went."""

    config: Configuration
    stages: tuple[int, ...]
    choices: tuple[LayerChoice, ...]
    prediction: Evaluation
    table: PriceTable
    status: str
    gap: float
    wall_s: float
    configs_total: int
    configs_solved: int
    memory_budget_bytes: int
    runners_up: tuple[Candidate, ...] = ()  # the next distinct configurations, fastest first
    cp_pp_left_out: int = 0  # configurations with cp inside pipeline stages the search left out (configs.py)
    schedule_runner_up: Candidate | None = None  # the best plan found on this mesh under another pipeline schedule
    loss_runner_up: LossRunnerUp | None = None  # the plan's choices under the other loss (api.whole_logits_if_faster)


def solve(graph: LayerGraph, world_size: int, cluster: ClusterSpec, training: TrainingSpec, *,
          pins: Pins | None = None, memory_budget_bytes: int | None = None,
          options: SolverOptions | None = None, runners_up: int = RUNNERS_UP, keep_idle: bool = False) -> Solution:
    """The fastest plan under the memory budget, by branch and bound over configurations, and the
    best plans of the next ``runners_up`` distinct configurations (0: the shortest search). Meshes whose
    tp ranks would repeat each other's work are searched only when no other plan fits (``keep_idle``:
    :func:`.configs.searched_configs`)."""
    start = time.perf_counter()
    options = options or SolverOptions()
    pins = pins or Pins()
    budget = cluster.memory_budget_bytes if memory_budget_bytes is None else memory_budget_bytes
    layer_pins = pins.resolve_layers([layer.name for layer in graph])
    check_recompute_pins(graph, pins)
    check_sp_pins(graph, pins)
    check_stage_pins(graph, layer_pins)
    cuts_ok = cut_positions(graph)
    # Configurations in order of a cheap bound (fastest strategy per layer, balanced),
    # priced in full only when that bound could still beat the best plan so far.
    configs, left_out = searched_configs(graph, world_size, cluster, training, pins, keep_idle=keep_idle)
    candidates = Candidates.keyed(graph, configs, cluster, training, SharedPrices())  # tables built when read
    pinned = pins.mesh_degrees()
    search, priced = Search(keep=1 + max(0, runners_up)), []
    # configurations no plan of which fits (memory_floor: what the bound would find), dropped before pricing;
    # a pin outside the search space may extend a row with a choice holding less: no screen then
    screened: list[tuple[float, Configuration, PriceTable]] = []
    fits = _Screen(budget if not any(layer_pins) else None, screened)
    # 1. the chosen plan, best first: each configuration is keyed by its cheap bound until it is examined
    #    (screened, its choices allowed), then by its pooled bound, and by its full one once it comes next
    #    with that; the least key is taken next, and solved once it is the full bound. The first plan found is
    #    then most often the best, a configuration whose bound it beats is never solved, and most are never
    #    bounded rank by rank. Those that can only be runners-up wait, so runners-up never take the time the
    #    optimum needs. With no plan found by half the time limit, each configuration examined is solved at once
    #    (a search too large to reach its first solve in time still returns a plan).
    queue: list[_Queued] = [_Queued(candidates.cheap(n), n) for n in range(len(candidates))]  # sorted: a heap
    later: list[tuple[float, Configuration, PriceTable, list[list[int]] | None, float]] = []
    unexamined = 0
    deferred: list[Deferred] = []  # configurations whose first, short solve ran out: solved again below
    with overlap_pool(options) as pool:
        flight = InFlight(pool, deferred)
        while queue:
            head = queue[0]
            cheap, config, table = candidates[head.index]
            # what the head needs is prepared while the previous CP-SAT solve runs (landing pushes nothing, so
            # the head stays the head); every decision below is taken after that solve has landed
            ahead = _look_ahead(search, head, table, layer_pins, budget, cuts_ok, fits) if flight.job else None
            flight.land(search, later)
            best = search.best
            if _stops(search, head.key):
                break
            remaining = options.time_limit_s - (time.perf_counter() - start)
            # else: examine one, never blame the pins (a configuration the screen dropped was examined: it cannot fit)
            if remaining <= 0 and (priced or screened or best is not None):
                search.open_bounds += [q.key for q in queue]
                unexamined = sum(q.allowed is None for q in queue)
                break
            heapq.heappop(queue)
            enough = search.threshold(config)
            if head.allowed is None:  # examine it: its pooled bound becomes its key
                if not (ahead or fits(cheap, table)):
                    continue
                twin = candidates.twin_table(config) if config.mesh.dp_replicate > 1 else None
                if twin is not None and not ("dp_replicate" in pinned or pins.dp_shard
                                             or hsdp_price.worth_searching(table, twin, cheap)):
                    continue  # replicas cannot save enough against ZeRO over all of dp (planning.hsdp_price)
                allowed = ahead.allowed if ahead else allowed_choices(table, layer_pins)
                if any(not ks for ks in allowed):
                    continue
                priced.append((cheap, config, table, allowed))
                bound = ahead.bound if ahead else pooled_bound_s(table, allowed, budget, cuts_ok)
                if math.isinf(bound) or bound >= enough:
                    continue
                if best is None and remaining < options.time_limit_s / 2:  # no plan yet, half the time gone
                    flight.submit(search, later, prepare(table, allowed, layer_pins, cuts_ok, budget), remaining,
                                  options, (cheap, config, table, allowed, bound))
                else:
                    heapq.heappush(queue, _Queued(bound, head.index, allowed))
                continue
            if not head.full:  # next in line: its full bound becomes its key
                bound = ahead.bound if ahead and ahead.enough == enough else \
                    lower_bound_s(table, head.allowed, budget, cuts_ok, enough=enough)
                if not (math.isinf(bound) or bound >= enough):
                    heapq.heappush(queue, _Queued(bound, head.index, head.allowed, full=True))
                continue
            entry = (cheap, config, table, head.allowed, head.key)
            if head.key >= enough:
                continue
            if best is not None and head.key >= best.step_time_s:  # cannot be chosen: a runner-up at most
                later.append(entry)
                continue
            if head.found is None:  # about to be solved: the rank programme's bound becomes its key (.rank_dp)
                found = rank_dp(table, head.allowed, budget, cuts_ok, layer_pins)
                if found.bound_s > head.key:  # waits again, keyed by it (or leaves, when it cannot be kept)
                    if not (math.isinf(found.bound_s) or found.bound_s >= enough):
                        heapq.heappush(queue, _Queued(found.bound_s, head.index, head.allowed, full=True, found=found))
                    continue
                head.found = found
            if _offer_plan(search, table, head.found):
                continue  # its plan meets its bound: proved best for its configuration, no solve
            prepared = ahead.prepared if ahead and ahead.prepared else \
                prepare(table, head.allowed, layer_pins, cuts_ok, budget)
            if (plan := head.found.plan()) is not None:
                # CP-SAT starts from it: the 462B stand-in's best configuration proved in 0.23 deterministic
                # seconds instead of 0.49, within its first solve (0.5 s)
                hint_plan(prepared.built, table, prepared.runs, plan[0], plan[1])
            flight.submit(search, later, prepared, remaining, options, entry)
        flight.land(search, later)
    solve_deferred(search, deferred, later, start, options)
    # 2. runners-up, in what time is left: short solves of configurations that cannot be chosen
    if search.best is not None and runners_up > 0:
        waiting = [_Waiting(bound, n, cheap, config, table, allowed, full=True)
                   for n, (cheap, config, table, allowed, bound) in enumerate(later)]
        waiting += [_Waiting(q.key, len(later) + q.index, candidates.cheap(q.index), candidates.entries[q.index][1],
                             None, q.allowed, q.full, q.index) for q in queue]  # tables built when reached
        until = min(options.time_limit_s, time.perf_counter() - start + RUNNER_UP_SHARE * options.time_limit_s)
        _runners_up(search, waiting, until - (time.perf_counter() - start), fits, layer_pins, cuts_ok, budget,
                    options, candidates)
    wall = time.perf_counter() - start
    if search.best is None:
        if not keep_idle and len(searched_configs(graph, world_size, cluster, training, pins,
                                                  keep_idle=True)[0]) > len(configs):
            # nothing else runs: the meshes whose tp ranks repeat each other's work too (the plan notes it)
            return solve(graph, world_size, cluster, training, pins=pins, memory_budget_bytes=memory_budget_bytes,
                         options=options, runners_up=runners_up, keep_idle=True)
        priced = _with_screened(priced, screened, layer_pins)
        if not priced:
            degrees = ", ".join(f"tp={t}" for t in sorted({config.mesh.tp for config in candidates.configs()}))
            raise PinError(f"no configuration the pins allow can run every layer: the pinned tensor-parallel "
                           f"styles admit none of the degrees the pins leave ({degrees}), or the pinned ZeRO "
                           "stages cannot run (inside an export-captured model's pipeline stages every layer "
                           "is replicated), or under cp a pinned style holds key/value projections whole on "
                           "every tp rank or pinned sp leaves S/cp tokens tp does not divide, or a pinned style "
                           "splitting experts over tp (megatron+experts) meets pp, cp or ep, which it does not "
                           "run beside, or under --compile a pinned selective or alternate-mm recompute meets a block "
                           "compiled around an eager exchange (ep's dispatch, cp's ring), which recomputes "
                           "compiled in full only")
        try:
            raise_infeasible(priced, layer_pins, cuts_ok, budget, options, unexamined,
                             timed_out=wall >= options.time_limit_s)
        except InfeasibleError as exc:
            if not (exc.binding == "solver" and options.presolve_inclusion):
                raise
            # a plan fits that no solve found: CP-SAT's presolve refuted a feasible model (SolverOptions.
            # presolve_inclusion); searched again without the step that does
            return solve(graph, world_size, cluster, training, pins=pins, memory_budget_bytes=memory_budget_bytes,
                         options=replace(options, presolve_inclusion=False), runners_up=runners_up,
                         keep_idle=keep_idle)
    best, *runners_up = search.ranked()
    step = best.step_time_s
    bound = min([step] + search.open_bounds)
    gap = max(0.0, (step - bound) / step) if step > 0 else 0.0
    return Solution(best.config, best.stages, best.choices, best.prediction, best.table,
                    "OPTIMAL" if gap <= 1e-9 else "FEASIBLE", gap, wall,
                    len(candidates), search.solved, budget, tuple(runners_up), left_out,
                    search.schedule_runner_up(best) if best.config.mesh.pp > 1 else None)


@dataclass
class _Screen:
    """Whether a configuration may fit in ``budget`` (None: every one may), by the least memory its pipeline
    ranks hold together (:func:`memory_floor_bytes`); one that cannot is kept in ``screened``, once."""

    budget: int | None
    screened: list[tuple[float, Configuration, PriceTable]]
    seen: set[int] = field(default_factory=set)

    def __call__(self, cheap: float, table: PriceTable) -> bool:
        if self.budget is None or memory_floor_bytes(table) <= table.config.mesh.pp * self.budget:
            return True
        if id(table) not in self.seen:
            self.seen.add(id(table))
            self.screened.append((cheap, table.config, table))
        return False


def _with_screened(priced: list, screened: list[tuple[float, Configuration, PriceTable]], layer_pins) -> list:
    """What the search priced and the configurations the memory screen dropped, priced now, in the search's
    order (its cheap bound): what the search for the least memory a plan needs is given, as before the screen."""
    out = list(priced)
    for cheap, config, table in screened:
        allowed = allowed_choices(table, layer_pins)
        if not any(not ks for ks in allowed):
            out.append((cheap, config, table, allowed))
    return sorted(out, key=lambda item: (item[0], item[1]))


@dataclass(order=True)
class _Waiting:
    """A configuration the runners-up may come from, keyed as :class:`_Queued` is, or by what a solve proved
    none of its plans beats."""

    key: float
    index: int
    cheap: float = field(compare=False)
    config: Configuration = field(compare=False)
    table: PriceTable | None = field(compare=False)  # None: candidates[source]'s, built when reached
    allowed: list[list[int]] | None = field(compare=False)
    full: bool = field(default=False, compare=False)
    source: int = field(default=-1, compare=False)


def _runners_up(search: Search, waiting: list[_Waiting], time_limit_s: float, fits: _Screen, layer_pins,
                cuts_ok, budget, options: SolverOptions, candidates: Candidates) -> None:
    """The best plans of configurations that cannot be chosen, in ``time_limit_s``, best first as the chosen
    plan's search goes, each solve short (``RUNNER_UP_SOLVE_S``) and held to plans within
    ``RUNNER_UP_BAND`` of its bound (or of the best plan, if higher): CP-SAT finds such a plan or refutes
    one fast, where a short solve held to nothing finds poor plans (Llama 3 70B at 131,072 tokens on 512:
    pp=4 × cp=32's first plan took 1,071 s a step, its best 506 s). A refuted configuration waits again,
    keyed by what it was held to."""
    start = time.perf_counter()
    heapq.heapify(waiting)
    while waiting:
        item = heapq.heappop(waiting)
        remaining = time_limit_s - (time.perf_counter() - start)
        threshold = search.threshold(item.config)
        if remaining <= 0 or item.key >= search.cutoff:
            return
        if item.key >= threshold:
            continue
        item.table = candidates[item.source][2] if item.table is None else item.table
        if item.allowed is None:
            if fits(item.cheap, item.table):
                item.allowed = allowed_choices(item.table, layer_pins)
                if not any(not ks for ks in item.allowed):
                    item.key = pooled_bound_s(item.table, item.allowed, budget, cuts_ok)
                    heapq.heappush(waiting, item)
        elif not item.full:
            item.key, item.full = lower_bound_s(item.table, item.allowed, budget, cuts_ok, enough=threshold), True
            heapq.heappush(waiting, item)
        else:
            prepared = prepare(item.table, item.allowed, layer_pins, cuts_ok, budget)
            held = min(threshold, max(item.key, search.best.step_time_s) * (1 + RUNNER_UP_BAND))
            bound_objective(search, prepared, runner_up=True, held=held)
            solver = cp_solver(min(remaining, RUNNER_UP_SOLVE_S), options)
            status = solver.Solve(prepared.built.model)
            finish(search, prepared, solver, status, runner_up=True)
            if status == cp_model.INFEASIBLE and held < threshold:
                item.key = held
                heapq.heappush(waiting, item)


def _offer_plan(search: Search, table: PriceTable, found: RankDp) -> bool:
    """Offer the rank programme's plan of a configuration about to be solved (:mod:`.rank_dp`) to the search,
    which holds its CP-SAT model and every later configuration to it (the 462B stand-in at tp 8 × pp 16 ×
    dp 48: the programme's plan of its best configuration is 9.64 s a step, the optimum 9.46; without it the
    first solves were held to nothing, and main's search ended its 30 s at 10.52 s). Whether the plan meets
    the configuration's bound: then it is proved best for it (no plan beats a lower bound), and no solve is
    needed."""
    plan = found.plan()
    if plan is None:
        return False
    stages, choices, prediction = plan
    proved = prediction.step_time_s <= found.bound_s
    search.offer(Candidate(table.config, stages, choices, prediction, table, optimal=proved))
    return proved


def _stops(search: Search, cheap: float) -> bool:
    """Whether no configuration from this cheap bound on can be kept (they come in its order)."""
    best = search.best
    return cheap >= search.cutoff or (best is not None and cheap >= best.step_time_s)


@dataclass(order=True)
class _Queued:
    """A configuration waiting in the search (``index`` into its candidates), keyed by its cheap bound until
    examined (``allowed`` None), then by its pooled bound (:func:`pooled_bound_s`), then by its ``full`` one
    (:func:`lower_bound_s`); ties in candidate order."""

    key: float
    index: int
    allowed: list[list[int]] | None = field(default=None, compare=False)
    full: bool = field(default=False, compare=False)
    found: RankDp | None = field(default=None, compare=False)  # its rank programme, once it was about to be solved


@dataclass
class _Ahead:
    """What the head configuration's next step needs, prepared while an earlier configuration's solve ran:
    its allowed choices and pooled bound, its full bound (with the ``enough`` it was computed for), or its
    model."""

    allowed: list[list[int]]
    bound: float = math.inf
    enough: float = math.nan
    prepared: Prepared | None = None


def _look_ahead(search: Search, head: _Queued, table: PriceTable, layer_pins, budget, cuts_ok,
                fits: _Screen) -> _Ahead | None:
    """Prepare what the search will most likely need of the head configuration, judged on the search as it is
    before the solve in flight lands. That search is never ahead of the landed one (its best and thresholds
    only fall), so what it rules out stays ruled out; what it lets through is checked again after landing."""
    if _stops(search, head.key):
        return None
    best = search.best
    if head.allowed is None:
        if not fits(head.key, table):
            return None
        ahead = _Ahead(allowed_choices(table, layer_pins))
        if not any(not ks for ks in ahead.allowed):
            ahead.bound = pooled_bound_s(table, ahead.allowed, budget, cuts_ok)
        return ahead
    if not head.full:
        enough = search.threshold(table.config)
        return _Ahead(head.allowed, lower_bound_s(table, head.allowed, budget, cuts_ok, enough=enough), enough)
    if head.key >= search.threshold(table.config) or (best is not None and head.key >= best.step_time_s):
        return None
    return _Ahead(head.allowed, head.key, prepared=prepare(table, head.allowed, layer_pins, cuts_ok, budget))


