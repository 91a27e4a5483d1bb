"""What people watch during a run, each figure beside the plan's prediction and the ratio.

    metrics = MetricsLogger(pm, log_every=10, metrics_file="metrics.jsonl", tensorboard="tb",
                            total_steps=1000)                  # after pm.load: it starts at pm.step
    for batch in loader:
        t = time.perf_counter()
        loss = pm.train_step(batch.inputs, batch.targets)
        metrics.log(batch.step, loss, step_s=time.perf_counter() - t, tokens=batch.global_tokens,
                    lr=lr, tokens_hash=batch.tokens_hash)
    metrics.close()

``step_s`` is the training step's own time (forward, backward, the optimizer step: what the plan
predicts and ``autopar tune`` measures); making the batch (reading, generating, hashing it) is not
in it but in ``data_wait_s``, so ``autopar calibrate --from-metrics`` refits from the same figure
tune does.

Every ``log_every`` steps (and at ``total_steps``) rank 0 reports, over the
steps since its last report: the loss of the step, the global gradient norm
before clipping (``pm.grad_norm``: set when ``compile`` was given
``max_grad_norm``), the learning rate, tokens/s, TFLOP/s per device and MFU
against the cluster's peak (the model's FLOPs per step — forward and
backward, no recompute, as the plan counts them — over the measured time),
and peak memory; each beside the plan's predicted figure and the ratio
measured/predicted. The line gives tokens/s per rank, as the plan's header
does (the JSON's ``tokens_per_s`` is the global figure, its ``plan`` too).
Memory is ``torch.cuda.max_memory_allocated`` on a GPU; on CPU the process's
peak resident set, which also holds the interpreter and its libraries, so it
is printed as ``host rss`` alone: no ratio to the plan's tensors (``vs_plan``'s
``memory_bytes`` is null). On a CPU cluster the line prints no MFU either: the
``cpu`` preset's peak is a guess, not a measured rate, so a percentage of it
says nothing (the JSON keeps ``mfu``, against the cluster file's peak).

Where it goes:

* a progress bar (tqdm) when stdout is a terminal and tqdm is installed,
  else one plain line per report;
* ``metrics_file``: JSON lines, one object per report — ``step`` (0-based
  index of the step trained), ``loss``, ``tokens`` (trained through this
  step, ``(step + 1) ×`` tokens per step), ``tokens_per_s``, ``tflops``
  (per device), ``mfu``, ``memory_bytes``, ``tokens_hash`` (the global
  batch's, :func:`autopar.data.tokens_hash`: the same under every plan),
  and ``grad_norm``, ``lr``, ``step_time_s``, ``data_wait_s``,
  ``memory_kind``, ``plan`` (the predictions), ``vs_plan`` (the
  ratios) and ``time`` (when it was written, seconds since the epoch).
  A run resumed at step k keeps the file's reports of steps
  before k and drops the rest (a restarted job logged them before it died),
  so the file holds each step once;
* ``tensorboard``: a directory of TensorBoard events
  (``torch.utils.tensorboard``; the ``tensorboard`` package is optional, and
  asking without it is a :class:`~autopar.errors.MetricsError`, raised by
  :func:`check_tensorboard` before anything starts).
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import IO, Any

import torch
import torch.distributed as dist

from autopar.errors import MetricsError
from autopar.units import device_noun

MiB = 2**20


def check_tensorboard() -> None:
    """Raise MetricsError, one line, unless ``torch.utils.tensorboard`` can write events here."""
    try:
        from torch.utils.tensorboard import SummaryWriter  # noqa: F401
    except ImportError as exc:
        raise MetricsError(f"TensorBoard logging needs the tensorboard package ({exc}): "
                           "pip install tensorboard, or leave --tensorboard out") from None


def peak_memory() -> tuple[int, str]:
    """(bytes, kind): CUDA's peak allocated on a GPU run, else this process's peak resident set."""
    if torch.cuda.is_available() and dist.is_initialized() and dist.get_backend() == "nccl":
        return torch.cuda.max_memory_allocated(), "cuda_peak_allocated"
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024, "process_max_rss"


def _ratio(measured: float | None, planned: float | None) -> float | None:
    return measured / planned if measured is not None and planned else None


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


class MetricsLogger:
    """Rank 0's reports of a training run (see the module docstring); other ranks do nothing."""

    def __init__(self, pm: Any, *, log_every: int = 1, metrics_file: str | Path | None = None,
                 tensorboard: str | Path | None = None, total_steps: int | None = None,
                 progress: bool | None = None, stream: IO[str] | None = None, rank: int | None = None):
        if log_every < 1:
            raise MetricsError(f"log_every must be at least 1, got {log_every}")
        if tensorboard is not None:
            check_tensorboard()
        self.pm, self.log_every, self.total_steps = pm, log_every, total_steps
        self.stream = stream or sys.stdout
        self.active = (_rank() if rank is None else rank) == 0
        self.records: list[dict[str, Any]] = []  # this process's reports, in order
        self._time_s, self._steps, self._tokens, self._wait_s = 0.0, 0, 0, 0.0
        self._file = self._writer = self._bar = None
        if not self.active:
            return
        if metrics_file is not None:
            self._file = _open_resumed(Path(metrics_file), pm.step)
        if tensorboard is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(str(tensorboard), purge_step=pm.step or None)
        use_bar = progress if progress is not None else _is_tty(self.stream)
        if use_bar:
            try:
                from tqdm import tqdm
            except ImportError:
                use_bar = False
            else:
                self._bar = tqdm(total=total_steps, initial=pm.step, file=self.stream, unit="step",
                                 dynamic_ncols=True)

    # -------------------------------------------------------------- the plan's figures

    def predicted(self, tokens_per_step: int) -> dict[str, float | None]:
        """The plan's step time, tokens/s, TFLOP/s per device, MFU and peak memory per rank."""
        p, plan = self.pm.plan.predicted, self.pm.plan
        peak = plan.cluster.device.peak_flops(plan.training.dtype)
        return {"step_time_s": p.step_time_s,
                "tokens_per_s": tokens_per_step / p.step_time_s if p.step_time_s > 0 else None,
                "tflops": p.tflops_per_gpu, "mfu": p.tflops_per_gpu * 1e12 / peak if peak else None,
                "memory_bytes": max(p.memory_per_rank_bytes) if p.memory_per_rank_bytes else None}

    def _flops_per_step(self) -> float:
        """The model's FLOPs in one step, as the plan counts them (3 × forward, no recompute)."""
        p, plan = self.pm.plan.predicted, self.pm.plan
        return p.tflops_per_gpu * 1e12 * p.step_time_s * plan.world_size

    # -------------------------------------------------------------- reporting

    def log(self, step: int, loss: float, *, step_s: float, tokens: int, lr: float | None = None,
            tokens_hash: str | None = None, data_wait_s: float = 0.0) -> dict[str, Any] | None:
        """Count step ``step`` (0-based; ``tokens``: the global batch's); report when it is due.
        Returns the report (rank 0), or None."""
        self._time_s += step_s
        self._steps += 1
        self._tokens += tokens
        self._wait_s += data_wait_s
        if self._bar is not None:
            self._bar.update(1)
        last = self.total_steps is not None and step + 1 >= self.total_steps
        if not self.active or ((step + 1) % self.log_every and not last):
            return None
        record = self._record(step, loss, tokens, lr, tokens_hash)
        self._time_s, self._steps, self._tokens, self._wait_s = 0.0, 0, 0, 0.0
        self.records.append(record)
        if self._file is not None:
            self._file.write(json.dumps(record) + "\n")
            self._file.flush()
        if self._writer is not None:
            self._tensorboard(record)
        if self._bar is not None:
            self._bar.set_postfix_str(self._short(record), refresh=True)
        else:
            print(self.line(record), file=self.stream, flush=True)
        return record

    def _record(self, step: int, loss: float, tokens: int, lr: float | None,
                tokens_hash: str | None) -> dict[str, Any]:
        per_step_s = self._time_s / self._steps
        tokens_per_s = self._tokens / self._time_s if self._time_s > 0 else None
        world = self.pm.plan.world_size
        tflops = self._flops_per_step() / world / per_step_s / 1e12 if per_step_s > 0 else None
        plan = self.predicted(tokens)
        peak = self.pm.plan.cluster.device.peak_flops(self.pm.plan.training.dtype)
        mfu = tflops * 1e12 / peak if tflops is not None and peak else None
        memory, kind = peak_memory()
        # a host's resident set is no measure of the plan's device tensors: no ratio to them
        measured = {"step_time_s": per_step_s, "tokens_per_s": tokens_per_s, "tflops": tflops, "mfu": mfu,
                    "memory_bytes": memory if kind == "cuda_peak_allocated" else None}
        return {"step": step, "loss": loss, "tokens": (step + 1) * tokens, "tokens_per_s": tokens_per_s,
                "tflops": tflops, "mfu": mfu, "memory_bytes": memory, "tokens_hash": tokens_hash,
                "grad_norm": self.pm.grad_norm, "lr": lr, "step_time_s": per_step_s,
                "data_wait_s": self._wait_s / self._steps, "memory_kind": kind, "plan": plan,
                "vs_plan": {k: _ratio(v, plan[k]) for k, v in measured.items()},
                "world_size": world, "per": device_noun(self.pm.plan.cluster), "time": time.time()}

    @staticmethod
    def line(r: dict[str, Any]) -> str:
        """One report as a line: each measured figure with the plan's and the ratio (per rank or GPU, as the
        plan's header counts; on a CPU cluster no MFU and the host's resident set alone)."""
        p, v = r["plan"], r["vs_plan"]
        per, world = r.get("per", "device"), r.get("world_size", 1)
        norm = f"{r['grad_norm']:.3f}" if r["grad_norm"] is not None else "-"
        lr = f"{r['lr']:.2e}" if r["lr"] is not None else "-"
        wait = r["data_wait_s"] / r["step_time_s"] if r["step_time_s"] else 0.0
        tokens, planned = (x and x / world for x in (r["tokens_per_s"], p["tokens_per_s"]))
        mfu = f"MFU {_num(r['mfu'], '.1%')} (plan {_num(p['mfu'], '.1%')})  " if per != "rank" else ""
        return (f"step {r['step']:5d}  loss {r['loss']:.4f}  lr {lr}  grad norm {norm}  "
                f"{_num(tokens, ',.0f')} tok/s/{per} (plan {_num(planned, ',.0f')}, {_x(v['tokens_per_s'])})  "
                f"{_num(r['tflops'], '.3g')} TFLOP/s/{per} (plan {_num(p['tflops'], '.3g')}, {_x(v['tflops'])})  "
                f"{mfu}{_memory(r)}  data wait {wait:.1%}")

    @staticmethod
    def _short(r: dict[str, Any]) -> str:
        per, world = r.get("per", "device"), r.get("world_size", 1)
        tokens = r["tokens_per_s"] and r["tokens_per_s"] / world
        mfu = f", MFU {_num(r['mfu'], '.1%')}" if per != "rank" else ""
        return (f"loss {r['loss']:.4f}, {_num(tokens, ',.0f')} tok/s/{per} ({_x(r['vs_plan']['tokens_per_s'])} "
                f"plan){mfu}, {'' if r['memory_kind'] == 'cuda_peak_allocated' else 'host rss '}"
                f"{r['memory_bytes'] / MiB:,.0f} MiB")

    def _tensorboard(self, r: dict[str, Any]) -> None:
        w, step = self._writer, r["step"]
        for key in ("loss", "grad_norm", "lr", "tokens_per_s", "tflops", "mfu", "memory_bytes", "step_time_s",
                    "data_wait_s"):
            if r[key] is not None:
                w.add_scalar(f"train/{key}", r[key], step)
        for key, value in r["plan"].items():
            if value is not None:
                w.add_scalar(f"plan/{key}", value, step)
        for key, value in r["vs_plan"].items():
            if value is not None:
                w.add_scalar(f"vs_plan/{key}", value, step)

    def close(self) -> None:
        """Flush and close the file, the event writer and the bar."""
        for thing in (self._file, self._writer, self._bar):
            if thing is not None:
                thing.close()
        self._file = self._writer = self._bar = None


def _memory(r: dict[str, Any]) -> str:
    """The device's peak allocated beside the plan's; a host's resident set alone (it holds the interpreter)."""
    if r["memory_kind"] != "cuda_peak_allocated":
        return f"host rss {r['memory_bytes'] / MiB:,.0f} MiB"
    planned = r["plan"]["memory_bytes"]
    return (f"peak {r['memory_bytes'] / MiB:,.0f} MiB (plan {_num(planned and planned / MiB, ',.0f')} MiB, "
            f"{_x(r['vs_plan']['memory_bytes'])})")


def _num(value: float | None, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _x(ratio: float | None) -> str:
    return "-" if ratio is None else f"{ratio:.2f}×"


def _is_tty(stream: IO[str]) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False


def _open_resumed(path: Path, start_step: int) -> IO[str]:
    """The metrics file to append to, its reports of steps from ``start_step`` on dropped first."""
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        kept = []
        if path.exists():
            for line in path.read_text().splitlines():
                try:
                    if json.loads(line)["step"] < start_step:
                        kept.append(line)
                except (ValueError, KeyError, TypeError):
                    continue  # a line cut short by a killed run
        path.write_text("".join(line + "\n" for line in kept))
        return open(path, "a")
    except OSError as exc:
        raise MetricsError(f"metrics file {path} cannot be written: {exc.strerror or exc}") from None
