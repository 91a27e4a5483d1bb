"""A CPU rank's peak tensor bytes, read from the profiler's allocation events (CPU tensors have no
allocator statistics as CUDA's ``max_memory_allocated``). ``autopar tune`` and ``benchmarks/fidelity.py``
measure a plan's memory this way."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

MARK = "autopar.measured"  # the profiler range whose start ``since_ns`` is, in :func:`profiled`


def peak_tensor_bytes(events: list[tuple[int, int, int]], since_ns: int) -> int:
    """The most bytes live at once from ``since_ns`` on, from (time, ±bytes, address) allocation events.

    Live bytes are counted from the first event on, so tensors allocated
    before ``since_ns`` (the model's shards, created while compiling) count.
    The profiler records no free made on a thread it does not follow (a gloo
    worker dropping the last reference to a tensor): an address allocated
    again with no free between was freed unseen, at the latest just then,
    and is counted live until then, never forgotten.
    """
    live, peak, inside = 0, 0, False
    held: dict[int, int] = {}
    for t, nbytes, address in sorted(events):
        if t >= since_ns and not inside:
            peak, inside = live, True
        if nbytes > 0:
            live -= held.pop(address, 0)  # freed unseen
            held[address] = nbytes
        else:
            held.pop(address, None)
        live += nbytes
        if inside:
            peak = max(peak, live)
    return peak if inside else live


def profiled(fn: Callable[[], Any]) -> tuple[Any, tuple[list[tuple[int, int, int]], int]]:
    """Run ``fn`` under the profiler: its result, every CPU allocation and free (time, ±bytes,
    address), and the time the :data:`MARK` range began (on the profiler's own clock; the first
    event's when ``fn`` opened none)."""
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        result = fn()
    events, started, todo = [], [], list(prof.profiler.kineto_results.experimental_event_tree())
    while todo:
        node = todo.pop()
        if node.tag == _EventType.Allocation:
            fields = node.extra_fields
            if fields.device.type == "cpu":
                events.append((node.start_time_ns, fields.alloc_size, fields.ptr))
        else:
            if node.name == MARK:
                started.append(node.start_time_ns)
            todo.extend(node.children)
    first = min((e[0] for e in events), default=0)
    return result, (events, min(started) if started else first)
