"""A plan as people read it: the summary ``autopar plan`` prints, its layer table, and the line-wrapping that
keeps both (and ``autopar diff``'s table) within a terminal's :data:`WIDTH` columns.

It reads a :class:`~autopar.plan.Plan` by its fields and imports nothing of that module (``Plan.summary``
calls :func:`render_summary`), so the plan's data and its rendering stay apart.
"""

from __future__ import annotations

from typing import Any

from autopar.choice import CpAttention, LossKind
from autopar.contract_hsdp import dp_shard, shard_ranks
from autopar.float8 import describe
from autopar.units import device_noun, format_bytes, format_flop_rate


def _fold(layers: tuple[Any, ...]) -> list[tuple[str, Any, int]]:
    """Runs of consecutive layers with identical choices: (label, first, count)."""
    rows: list[tuple[str, Any, int]] = []
    start = 0
    for i in range(1, len(layers) + 1):
        if i < len(layers) and _choices(layers[i]) == _choices(layers[start]):
            continue
        first, count = layers[start], i - start
        label = first.name if count == 1 else f"{first.name} … {layers[i - 1].name} ({count})"
        rows.append((label, first, count))
        start = i
    return rows


def _choices(layer: Any) -> tuple:
    return (layer.stage, layer.choice)


def _layer_rows(plan: Any) -> tuple[list[tuple[str, ...]], tuple[str, ...]]:
    """The layer table's rows and header. Plans of several chunks a rank also show each row's
    pipeline rank (stage mod pp, or in a V for zbv and dualpipev) and its chunk on that rank (stage div pp)."""
    interleaved, pp = plan.chunks > 1, plan.mesh.pp
    rank = {s: r for r in range(pp) for s in plan.rank_stages(r)}
    rows = []
    for label, l, _ in _fold(plan.layers):
        where = (str(l.stage), str(rank[l.stage]), str(l.stage // pp)) if interleaved else (str(l.stage),)
        rows.append((label, *where, l.choice.style_text(), str(l.choice.zero), str(l.choice.recompute)))
    header = ("layer", "stage", *(("rank", "chunk") if interleaved else ()), "tp", "zero", "recompute")
    return rows, header


WIDTH = 120  # the columns a summary (and autopar diff's table) keeps within: a terminal's, side by side


def per_rank_memory(memory: tuple[int, ...], width: int) -> str:
    """Each pipeline rank's peak memory, listed when that fits in ``width`` columns, else their range with the
    rank that holds the most named (all the ranks of one pipeline rank hold alike)."""
    listed = "  ".join(f"rank {j}: {format_bytes(x)}" for j, x in enumerate(memory))
    if len(memory) == 1 or len(listed) <= width:
        return listed if len(memory) > 1 else format_bytes(memory[0])
    spread, most = memory_range(memory)
    return f"{spread} over {len(memory)} pipeline ranks, most on rank {most}"


def memory_range(memory: tuple[int, ...]) -> tuple[str, int]:
    """("68.82–70.56 GiB", the rank holding the most) of the pipeline ranks' peak memory."""
    low, high = format_bytes(min(memory)), format_bytes(max(memory))
    unit = high.rpartition(" ")[2]
    return f"{low.removesuffix(' ' + unit)}–{high}", max(range(len(memory)), key=lambda j: memory[j])


def _memory_lines(plan: Any) -> list[str]:
    """Peak memory of each pipeline rank, and the budget with what the cluster keeps back from it (unless the
    budget was given), wrapped to :data:`WIDTH`."""
    p, head = plan.predicted, "memory/rank   "
    budget = format_bytes(p.memory_budget_bytes)
    if p.memory_budget_bytes == plan.cluster.memory_budget_bytes:
        budget += ": " + plan.cluster.memory_budget().describe()
    ranks = per_rank_memory(p.memory_per_rank_bytes, WIDTH - len(head))
    per = "per pipeline rank; " if "rank 1:" in ranks else ""
    return wrap_line(f"{head}{ranks}  ({per}budget {budget})", len(head))


def wrap_line(line: str, indent: int, sep: str = " ") -> list[str]:
    """``line`` in lines of at most :data:`WIDTH` columns, broken at ``sep``, the rest indented by ``indent``."""
    if len(line) <= WIDTH:
        return [line]
    out, current = [], None
    for part in line.split(sep):
        joined = part if current is None else f"{current}{sep}{part}"
        if len(joined) > WIDTH and current is not None and current.strip():
            out.append(current.rstrip())
            current = " " * indent + (sep.strip() + " " if sep.strip() else "") + part  # "· optimizer …"
        else:
            current = joined
    return out + [current.rstrip()]


_METHOD = {CpAttention.ALL_GATHER: "allgather (K/V all-gather)",
           CpAttention.ULYSSES: "ulysses (head all-to-all)", CpAttention.RING: "ring (K/V passed round the cp ring)"}
_COMM = {CpAttention.ALL_GATHER: "K/V", CpAttention.ULYSSES: "all-to-all", CpAttention.RING: "ring K/V, unhidden"}


def _hybrid(m: Any) -> str:
    """Hybrid sharding's groups on the mesh line: ZeRO's shard group and the replicas it is all-reduced over."""
    if m.dp_replicate <= 1:
        return ""
    over = f"{dp_shard(m)} dp" + (f" × {m.cp} cp" if m.cp > 1 else "")
    return f"   HSDP: ZeRO over {over} = {shard_ranks(m)} ranks × {m.dp_replicate} replicas"


def render_summary(plan: Any) -> str:
    p, m = plan.predicted, plan.mesh
    sched = plan.schedule.value + (f" × {plan.chunks} chunks" if plan.chunks > 1 else "")
    gap = f", gap {plan.solver.gap:.2%}" if plan.solver.gap > 0 else ""
    noun = device_noun(plan.cluster)
    tokens = f"  ({p.tokens_per_s_per_gpu:,.0f} tokens/s per {noun})" if p.tokens_per_s_per_gpu else ""
    b = p.breakdown
    breakdown = (f"  breakdown   compute {b.compute_s:.4g} s · bubble {b.bubble_s:.4g} s · tp {b.tp_comm_s:.4g} s"
                 + (f" · ep all-to-all {b.ep_comm_s:.4g} s" if m.ep > 1 else "")
                 + (f" · cp {_COMM[plan.cp_attention]} {b.cp_comm_s:.4g} s" if m.cp > 1 else "")
                 + f" · dp {b.dp_comm_s:.4g} s · pp {b.pp_comm_s:.4g} s · optimizer {b.optimizer_s:.4g} s")
    lines = [
        f"autopar plan — {plan.model} on {plan.world_size} × {plan.cluster.device.name}"
        f" ({plan.cluster.name}, {plan.training.dtype}"
        + (", blocks under torch.compile" if plan.training.compiled else "")
        + (", float8 linears" if plan.training.float8 is not None else "") + ")",
        f"mesh          {m.describe()}" + (f"   cp attention {_METHOD[plan.cp_attention]}" if m.cp > 1 else "")
        + _hybrid(m),
        f"batch         {plan.training.global_batch} = dp {m.dp} × {plan.microbatches} microbatches"
        f" × {plan.microbatch_size}   schedule {sched}",
        f"step time     {p.step_time_s:.4g} s   {format_flop_rate(p.tflops_per_gpu * 1e12)} per {noun}{tokens}",
        *wrap_line(breakdown, 14, " · "),
        *_memory_lines(plan),
        f"solver        {plan.solver.status}{gap} in {plan.solver.wall_s:.2f} s"
        f" ({plan.solver.configs_solved} of {plan.solver.configs_considered} configurations solved)",
    ]
    if plan.pins:
        lines.append("pins          " + " ".join(plan.pins))
    if plan.training.float8 is not None:
        sharded = m.dp > 1 and any(lp.choice.zero >= 1 for lp in plan.layers)
        lines.append("float8        " + describe(plan.training.float8, plan.training.dtype, sharded=sharded))
    if plan.training.loss is LossKind.CHUNKED:
        lines.append("loss          chunked: the head's GEMM and cross-entropy a chunk of tokens at a time")
    if plan.training.loss is LossKind.VOCAB_PARALLEL:
        lines.append("loss          vocabulary-parallel: the head's GEMM and cross-entropy a chunk of tokens at a "
                     f"time on each rank's 1/{m.tp} of the vocabulary, never gathered")
    rows, header = _layer_rows(plan)
    widths = [max(len(r[i]) for r in rows + [header]) for i in range(len(header))]
    fmt = "  ".join(f"{{:<{w}}}" for w in widths)
    lines += ["", fmt.format(*header), fmt.format(*("-" * w for w in widths))]
    lines += [fmt.format(*r) for r in rows]
    if plan.notes:
        lines += [""] + [wrapped for note in plan.notes for wrapped in wrap_line(f"note: {note}", 6)]
    return "\n".join(line.rstrip() for line in lines)
