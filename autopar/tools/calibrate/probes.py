"""Probing: what runs inside the process group (every rank at once) and measures this machine."""

from __future__ import annotations

import json
import platform
import signal
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

from autopar.cost_models.communication import Collective, bus_factor
from autopar.tools.calibrate.fit import Measurements, fit_link
from autopar.tools.calibrate.op_probes import (
    CPU_OP_SIZES,
    GPU_OP_SIZES,
    OpProbeSizes,
    attention_times,
    elementwise_bandwidth,
    fused_chain,
    gemm_sweep,
    host_per_op,
)
from autopar.tools.host import cpu_count, threads_per_process
from autopar.units import KiB, MiB

# ------------------------------------------------------------------ what is measured


@dataclass(frozen=True)
class ProbeSizes:
    """The workload of one calibration: layer widths, message sizes, repetition time."""

    widths: tuple[int, ...]
    tokens: tuple[int, int]  # (batch, sequence) of the layer probes
    gemm: int  # square GEMM side for the peak throughput
    message_bytes: tuple[int, ...]
    seconds_per_point: float
    rounds: int = 3  # sweeps of the compute and overlap probes, median taken
    compiled: bool = True  # time a chain of memory-bound ops under torch.compile (a compile on every rank)


CPU_SIZES = ProbeSizes(widths=(64, 128, 192, 256, 384, 512), tokens=(4, 64), gemm=768,
                       message_bytes=tuple(4 ** k * KiB for k in range(1, 9)),  # 4 KiB … 64 MiB
                       seconds_per_point=0.25)
GPU_SIZES = ProbeSizes(widths=(1024, 2048, 4096, 8192), tokens=(4, 2048), gemm=8192,
                       message_bytes=tuple(4 ** k * KiB for k in range(1, 12)),  # 4 KiB … 4 GiB
                       seconds_per_point=0.1)


def probe_sizes(backend: str, quick: bool = False) -> ProbeSizes:
    """The workload for ``backend``; ``quick`` trims it: rougher figures, faster (6–9 s on 2 ranks, 2 cores)."""
    sizes = GPU_SIZES if backend == "nccl" else CPU_SIZES
    if not quick:
        return sizes
    return ProbeSizes(widths=sizes.widths[:3], tokens=sizes.tokens, gemm=sizes.gemm // 2,
                      message_bytes=sizes.message_bytes[:6], seconds_per_point=0.05, rounds=1, compiled=False)


# ------------------------------------------------------------------ the ranks


class _Rank:
    """One rank's measuring loop; rank 0 reports progress and collects every rank's figures."""

    def __init__(self, rank: int, nproc: int, backend: str, sizes: ProbeSizes,
                 progress: Callable[[str], None] | None):
        import torch
        import torch.distributed as dist

        self.torch, self.dist = torch, dist
        self.rank, self.nproc, self.sizes = rank, nproc, sizes
        self.device = torch.device("cuda", rank) if backend == "nccl" else torch.device("cpu")
        self.progress = progress
        self.step, self.steps, self.start = 0, 9 + sizes.compiled, time.perf_counter()

    def say(self, what: str) -> None:
        self.step += 1
        if self.progress is not None:
            self.progress(f"[{self.step}/{self.steps}] {what} ({time.perf_counter() - self.start:.0f} s)")

    def sync(self) -> None:
        if self.device.type == "cuda":
            self.torch.cuda.synchronize()

    def mean_over_ranks(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t)
        return float(t.item()) / self.nproc

    def max_over_ranks(self, value: float) -> float:
        t = self.torch.tensor([value], dtype=self.torch.float64, device=self.device)
        self.dist.all_reduce(t, op=self.dist.ReduceOp.MAX)
        return float(t.item())

    def timed(self, fn: Callable[[], Any], *, min_reps: int = 3, max_reps: int = 30) -> float:
        """Median seconds of ``fn`` on this rank, every rank running it at the same time.

        The repetition count comes from the slowest rank's first run, so ranks
        start and finish together (contention stays what training sees).
        """
        fn()
        self.sync()
        t = time.perf_counter()
        fn()
        self.sync()
        first = self.max_over_ranks(time.perf_counter() - t)
        reps = int(min(max_reps, max(min_reps, self.sizes.seconds_per_point / max(first, 1e-9))))
        self.dist.barrier()
        times = []
        for _ in range(reps):
            t = time.perf_counter()
            fn()
            self.sync()
            times.append(time.perf_counter() - t)
        return statistics.median(times)

    def timed_mean(self, fn: Callable[[], Any], rounds: int) -> float:
        """Mean seconds of ``fn`` over ``rounds`` back-to-back runs after one warm-up and a barrier."""
        fn()
        self.sync()
        self.dist.barrier()
        t = time.perf_counter()
        for _ in range(rounds):
            fn()
        self.sync()
        return (time.perf_counter() - t) / rounds

    # -- the probes

    def layers(self) -> list[dict[str, Any]]:
        import torch.nn as nn
        from torch.utils.flop_counter import FlopCounterMode

        torch = self.torch
        batch, seq = self.sizes.tokens
        out = []
        for width in self.sizes.widths:
            for kind in ("transformer",):
                torch.manual_seed(0)
                layer = nn.TransformerEncoderLayer(width, max(1, width // 64), 4 * width, dropout=0.0,
                                                   activation="gelu", batch_first=True, norm_first=True)
                layer = layer.to(self.device)
                x = torch.randn(batch, seq, width, device=self.device, requires_grad=True)
                grad = torch.ones(batch, seq, width, device=self.device)
                with FlopCounterMode(display=False) as counter:
                    layer(x)
                fwd_flops = counter.get_total_flops()

                def step() -> None:
                    layer(x).backward(grad)

                seconds = self.mean_over_ranks(self.timed(step))
                out.append({"kind": kind, "width": width, "fwd_flops": fwd_flops, "seconds": seconds})
        return out

    @property
    def op_sizes(self) -> OpProbeSizes:
        return GPU_OP_SIZES if self.device.type == "cuda" else CPU_OP_SIZES

    def ops(self) -> tuple[list[dict[str, float]], dict[str, float], dict[str, float]]:
        """The per-op probes (:mod:`autopar.tools.calibrate.op_probes`), every rank at once: in bf16 on
        a GPU (as it trains), in fp32 on a CPU (whose cluster file keeps the FLOPs model)."""
        torch, sizes = self.torch, self.op_sizes
        dtype = torch.bfloat16 if self.device.type == "cuda" else torch.float32

        def timer(fn: Callable[[], Any]) -> float:
            return self.mean_over_ranks(self.timed(fn))

        return (gemm_sweep(torch, self.device, dtype, sizes.gemms, timer),
                elementwise_bandwidth(torch, self.device, dtype, sizes.elementwise, timer),
                attention_times(torch, self.device, dtype, sizes.attention, timer))

    def gemm(self) -> dict[str, float]:
        torch, n = self.torch, self.sizes.gemm
        rates = {}
        for name, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
            a = torch.randn(n, n, device=self.device, dtype=dtype)
            b = torch.randn(n, n, device=self.device, dtype=dtype)
            seconds = self.mean_over_ranks(self.timed(lambda: a @ b))
            rates[name] = 2.0 * n ** 3 / seconds
        return rates

    def collectives(self) -> dict[str, list[tuple[int, float]]]:
        torch, dist, n = self.torch, self.dist, self.nproc
        results: dict[str, list[tuple[int, float]]] = {"all_reduce": [], "all_gather": [],
                                                       "reduce_scatter": [], "p2p": []}
        for nbytes in self.sizes.message_bytes:
            elems = max(n, nbytes // 4 // n * n)
            full = torch.ones(elems, device=self.device)
            shard = torch.ones(elems // n, device=self.device)
            ops = {
                "all_reduce": lambda: dist.all_reduce(full),
                "all_gather": lambda: _all_gather(full, shard),
                "reduce_scatter": lambda: _reduce_scatter(shard, full),
                "p2p": lambda: self._ping_pong(full),
            }
            for kind, op in ops.items():
                seconds = self.timed(op)
                if kind == "p2p":  # a round trip between ranks 0 and 1: half of it is one send
                    seconds = self.max_over_ranks(seconds if self.rank == 0 else 0.0) / 2
                else:
                    seconds = self.mean_over_ranks(seconds)
                results[kind].append((elems * 4, seconds))
        return results

    def _ping_pong(self, buf: Any) -> None:
        if self.rank == 0:
            self.dist.send(buf, 1)
            self.dist.recv(buf, 1)
        elif self.rank == 1:
            self.dist.recv(buf, 0)
            self.dist.send(buf, 0)

    def overlap(self, link: tuple[float, float]) -> dict[str, float]:
        """Compute alone, an all-reduce alone, then the all-reduce issued under the compute; and a
        small blocking all-reduce after the compute, whose extra time is the wait for the slowest
        rank (ranks that compute alike still drift apart between synchronising collectives)."""
        import torch.nn as nn

        torch, dist = self.torch, self.dist
        width = self.sizes.widths[-1]
        batch, seq = self.sizes.tokens
        layer = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        layer = layer.to(self.device)
        x = torch.randn(2 * batch, seq, width, device=self.device, requires_grad=True)
        grad = torch.ones_like(x)

        def compute() -> None:
            layer(x).backward(grad)

        compute_s = self.mean_over_ranks(self.timed(compute))
        latency, busbw = link  # an all-reduce about as long as the compute
        nbytes = max(4 * KiB, (compute_s - latency) * busbw / bus_factor(Collective.ALL_REDUCE, self.nproc))
        nbytes = min(nbytes, self.sizes.message_bytes[-1])  # no larger than the link was measured at
        buf = torch.ones(int(self.max_over_ranks(nbytes)) // 4, device=self.device)
        comm_s = self.mean_over_ranks(self.timed(lambda: dist.all_reduce(buf)))

        def both() -> None:
            work = dist.all_reduce(buf, async_op=True)
            compute()
            work.wait()

        both_s = self.mean_over_ranks(self.timed(both))
        # The wait for the slowest rank, measured at a layer's granularity (the engines synchronise
        # once or a few times per layer) and as a mean over many rounds, since it is the tail
        # of the ranks' drift that a blocking collective pays.
        mid = self.sizes.widths[len(self.sizes.widths) // 2]
        small_layer = nn.Sequential(nn.Linear(mid, 4 * mid), nn.GELU(), nn.Linear(4 * mid, mid)).to(self.device)
        xs = torch.randn(batch, seq, mid, device=self.device, requires_grad=True)
        gs = torch.ones_like(xs)
        small = torch.ones(16 * KiB, device=self.device)

        def layer_step() -> None:
            small_layer(xs).backward(gs)

        def blocking() -> None:  # a layer's compute, then a collective that waits for every rank
            layer_step()
            dist.all_reduce(small)

        rounds = 30
        layer_s = self.mean_over_ranks(self.timed_mean(layer_step, rounds))
        small_s = self.mean_over_ranks(self.timed_mean(lambda: dist.all_reduce(small), rounds))
        blocking_s = self.mean_over_ranks(self.timed_mean(blocking, rounds))
        return {"compute_s": compute_s, "comm_s": comm_s, "both_s": both_s, "bytes": buf.numel() * 4,
                "layer_s": layer_s, "small_s": small_s, "blocking_s": blocking_s,
                "sync_s": max(0.0, blocking_s - layer_s - small_s)}

    def tensor_parallel(self) -> dict[str, float]:
        """A Megatron MLP over every rank with DTensor (column- then row-parallel), and the same
        per-rank shard as a plain local MLP: what tensor parallelism costs beyond its matmuls."""
        import torch.nn as nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module

        torch, n = self.torch, self.nproc
        width = self.sizes.widths[len(self.sizes.widths) // 2]
        batch, seq = self.sizes.tokens
        mesh = init_device_mesh(self.device.type, (n,))
        torch.manual_seed(0)
        tp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width)).to(self.device)
        parallelize_module(tp, mesh, {"0": ColwiseParallel(), "2": RowwiseParallel()})
        local = nn.Sequential(nn.Linear(width, 4 * width // n), nn.GELU(),
                              nn.Linear(4 * width // n, width)).to(self.device)
        x = torch.randn(batch, seq, width, device=self.device, requires_grad=True)
        rounds = 20

        def step(mlp: nn.Module) -> None:
            mlp(x).sum().backward()  # the output is used (its all-reduce waited for), as a next layer would
            x.grad = None

        tp_s = self.mean_over_ranks(self.timed_mean(lambda: step(tp), rounds))
        local_s = self.mean_over_ranks(self.timed_mean(lambda: step(local), rounds))
        return {"tp_s": tp_s, "local_s": local_s, "bytes": float(x.numel() * x.element_size())}

    def zero(self) -> dict[str, float]:
        """A stack of linear layers, each its own FSDP2 unit over every rank (ZeRO-3), against the
        same stack as plain local layers: what FSDP2 costs beyond the compute and its collectives."""
        import torch.nn as nn
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.fsdp import fully_shard

        torch, n, depth = self.torch, self.nproc, 4
        width = self.sizes.widths[-1]
        batch, seq = self.sizes.tokens
        mesh = init_device_mesh(self.device.type, (n,))
        torch.manual_seed(0)
        sharded = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(self.device)
        for layer in sharded:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        local = nn.Sequential(*[nn.Linear(width, width) for _ in range(depth)]).to(self.device)
        x = torch.randn(batch * seq, width, device=self.device)  # 2-D: a view out would warn
        rounds = 6

        def step(stack: nn.Module) -> None:
            stack(x).sum().backward()
            stack.zero_grad(set_to_none=True)

        zero_s = self.mean_over_ranks(self.timed_mean(lambda: step(sharded), rounds))
        local_s = self.mean_over_ranks(self.timed_mean(lambda: step(local), rounds))
        return {"zero_s": zero_s, "local_s": local_s, "layers": float(depth),
                "layer_bytes": float(sum(p.numel() * p.element_size() for p in local[0].parameters()))}

    def optimizer(self) -> dict[str, float]:
        """An AdamW step over large tensors (its bandwidth), and over many small ones as plain
        tensors and as DTensors sharded over every rank (what DTensor adds per parameter)."""
        from torch.distributed.device_mesh import init_device_mesh
        from torch.distributed.tensor import Shard, distribute_tensor

        torch, n = self.torch, self.nproc
        mesh = init_device_mesh(self.device.type, (n,))

        def adamw_step(tensors: list[Any]) -> Callable[[], Any]:
            params = [torch.nn.Parameter(t) for t in tensors]
            for p in params:
                p.grad = torch.full_like(p, 1e-3)  # not random: DTensor warns of random ops on CPU
            return torch.optim.AdamW(params, lr=1e-3).step

        large = [torch.randn(512, 512, device=self.device) for _ in range(8)]
        seconds = self.mean_over_ranks(self.timed(adamw_step(large)))
        small = [torch.randn(64 * n, 64, device=self.device) for _ in range(16)]
        plain_s = self.mean_over_ranks(self.timed(adamw_step([t.chunk(n)[0].clone() for t in small])))
        dtensor_s = self.mean_over_ranks(self.timed(adamw_step(
            [distribute_tensor(t, mesh, [Shard(0)]) for t in small])))
        return {"params": float(sum(t.numel() for t in large)), "seconds": seconds,
                "small_tensors": float(len(small)), "small_plain_s": plain_s, "small_dtensor_s": dtensor_s}

    def repeated(self, probe: Callable[[], Any], rounds: int) -> Any:
        """The probe run ``rounds`` times, a few seconds apart; per figure, the median over rounds.

        A shared machine has slow spells of seconds; repeating whole sweeps
        (not single points back to back) keeps one spell from skewing a figure.
        """
        results = [probe() for _ in range(rounds)]
        if isinstance(results[0], dict):
            return {k: statistics.median(r[k] for r in results) for k in results[0]}
        return [dict(row, seconds=statistics.median(r[i]["seconds"] for r in results))
                for i, row in enumerate(results[0])]

    def run(self, backend: str) -> Measurements:
        m = Measurements(backend=backend, nproc=self.nproc, threads=self.torch.get_num_threads(),
                         cores=cpu_count())
        self.say(f"compute: {len(self.sizes.widths)} transformer layers, widths "
                 f"{self.sizes.widths[0]}…{self.sizes.widths[-1]}, {_count(self.sizes.rounds, 'sweep')}")
        m.layers = self.repeated(self.layers, self.sizes.rounds)
        self.say(f"compute: {self.sizes.gemm}² GEMM in fp32 and bf16")
        m.gemm_flops_s = self.gemm()
        self.say(f"compute per op: {len(self.op_sizes.gemms)} GEMM shapes, an elementwise add, attention")
        m.gemm_shapes, m.bandwidth, m.attention = self.ops()
        if self.sizes.compiled:
            self.say("compute per op: a memory-bound chain eager and under torch.compile")
            m.fused = fused_chain(self.torch, self.device, self.torch.bfloat16 if self.device.type == "cuda"
                                  else self.torch.float32, self.op_sizes.elementwise,
                                  lambda fn: self.mean_over_ranks(self.timed(fn)),
                                  lambda ok: self.max_over_ranks(0.0 if ok else 1.0) == 0.0)
        if self.device.type == "cuda":
            m.sm_count = self.torch.cuda.get_device_properties(self.device).multi_processor_count
            self.say("host: a tiny transformer block's forward and backward, per op the host issues")
            m.host = host_per_op(self.torch, self.device, self.torch.bfloat16,
                                 lambda fn: self.mean_over_ranks(self.timed(fn)))
        sizes = self.sizes.message_bytes
        self.say(f"collectives: all-reduce, all-gather, reduce-scatter, send/recv, "
                 f"{_size(sizes[0])}…{_size(sizes[-1])}")
        m.collectives = self.collectives()
        self.say(f"overlap of an all-reduce with compute, and the wait for the slowest rank, "
                 f"{_count(self.sizes.rounds, 'round')}")
        link = fit_link(m.collectives, self.nproc)
        m.overlap = self.repeated(lambda: self.overlap(link), self.sizes.rounds)
        self.say("optimizer: AdamW steps, plain and DTensor parameters")
        m.optimizer = self.optimizer()
        self.say("tensor parallelism: a DTensor MLP against its local shard")
        m.tensor_parallel = self.repeated(self.tensor_parallel, self.sizes.rounds)
        self.say("ZeRO: FSDP2 units against their local layers")
        m.zero = self.repeated(self.zero, self.sizes.rounds)
        self.say("done")
        return m


def _count(n: int, noun: str) -> str:
    return f"{n} {noun}" if n == 1 else f"{n} {noun}s"


def _all_gather(out: Any, shard: Any) -> None:
    """All-gather into one tensor under the name this torch has (``all_gather_single`` from 2.13)."""
    import torch.distributed as dist

    if hasattr(dist, "all_gather_single"):
        dist.all_gather_single(out, shard)
    else:
        dist.all_gather_into_tensor(out, shard)


def _reduce_scatter(out: Any, full: Any) -> None:
    """Reduce-scatter from one tensor (``reduce_scatter_single`` from torch 2.13)."""
    import torch.distributed as dist

    if hasattr(dist, "reduce_scatter_single"):
        dist.reduce_scatter_single(out, full)
    else:
        dist.reduce_scatter_tensor(out, full)


def _size(nbytes: int) -> str:
    return f"{nbytes // MiB} MiB" if nbytes >= MiB else f"{nbytes // KiB} KiB"


def _worker(rank: int, nproc: int, backend: str, store_path: str, out_path: str, sizes: ProbeSizes,
            memory_bytes: int) -> None:
    import torch
    import torch.distributed as dist

    from autopar.quiet import silence_if_asked

    silence_if_asked()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent handles ^C and stops every rank
    torch.set_num_threads(threads_per_process(nproc))
    if backend == "nccl":
        torch.cuda.set_device(rank)
    dist.init_process_group(backend, store=dist.FileStore(store_path, nproc), rank=rank,
                            world_size=nproc, timeout=timedelta(seconds=300))
    m = measure_in_process_group(backend, sizes, memory_bytes, progress=_progress if rank == 0 else None)
    dist.destroy_process_group()
    if rank == 0:
        Path(out_path).write_text(json.dumps(m.__dict__))


def _progress(line: str) -> None:
    print(f"autopar calibrate: {line}", file=sys.stderr, flush=True)


def measure_in_process_group(backend: str, sizes: ProbeSizes, memory_bytes: int, *,
                             progress: Callable[[str], None] | None = None) -> Measurements:
    """Measure with the ranks of the initialised default process group: every rank calls this,
    each returns the rank means. For callers that already run ranks (benchmarks/fidelity.py
    calibrates in the processes that then train, right before timing them)."""
    import torch
    import torch.distributed as dist

    probe = _Rank(dist.get_rank(), dist.get_world_size(), backend, sizes, progress)
    m = probe.run(backend)
    if backend == "nccl":
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        m.device_memory_bytes, m.device_name = props.total_memory, props.name
    else:
        m.device_memory_bytes, m.device_name = memory_bytes, f"cpu ({platform.processor() or 'host'})"
    m.wall_s = time.perf_counter() - probe.start
    return m
