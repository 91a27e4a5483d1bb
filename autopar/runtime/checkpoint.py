"""Distributed checkpoints: the training state saved by any plan, loaded under any other.

    pm.save("ckpt/step-100", extra={"data_position": 100})     # every rank, together
    extra = pm.load(autopar.latest_checkpoint("ckpt"))          # under this plan, any world size

A checkpoint is a directory written with ``torch.distributed.checkpoint``
(DCP): each rank writes its own shards, and the state is keyed by the
original model's names, laid out as the unsharded model (tensor parallelism's
row permutations undone, :class:`autopar.runtime.state.OriginalRows`), so DCP
reshards it on load for whatever ZeRO stages, tensor-parallel degree,
pipeline cuts or world size the loading plan has. Its keys:

* ``model.<fqn>`` — the fp32 master weights and the persistent buffers;
* ``optimizer.state.<fqn>.<key>`` and ``optimizer.param_groups`` — the
  optimizer's state per parameter (sharded like it) and each group's
  hyperparameters (torch's ``get_optimizer_state_dict`` cannot name the
  masters a bf16 plan optimizes, so these are named here);
* ``trainer`` — rank 0's step count, the caller's ``extra`` dict, the
  learning-rate scheduler's state and the optimizer groups' hyperparameters
  (one tuple: DCP would split a dict into keys of its own).

Visible only once complete: the files are written to ``PATH.partial``;
``autopar.json`` — the step, the plan, the model's fingerprint, and every
file's size and CRC-32 — is written last, and the directory is then renamed
to ``PATH``. :func:`latest_checkpoint` returns the newest directory with that
file. Before anything is read into the model, :func:`load` checks the
fingerprint, every file's size and CRC-32 (each rank a share of the files)
and that every tensor the current plan needs is in the checkpoint with its
shape; any failure is a :class:`~autopar.errors.CheckpointError` naming what
is missing, raised on every rank, with nothing loaded.

DCP's ``.metadata`` (and ``extra``, and the scheduler state) are pickled, and
unpickling runs code: load only checkpoints your own jobs wrote. To share
weights with anyone, use :meth:`ParallelModel.export` (safetensors).
"""

from __future__ import annotations

import json
import shutil
import time
import warnings
import zlib
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import CheckpointError
from autopar.runtime.state import Trainable, checkpoint_view, persistent_buffers

MARKER = "autopar.json"
FORMAT = 1
PARTIAL = ".partial"


# ------------------------------------------------------------------ the state, by original names


def _copy(t: torch.Tensor, copy: bool) -> torch.Tensor:
    t = t.detach()
    return t.clone() if copy else t


def _optimizer_state(pm: Trainable, copy: bool) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """Per parameter FQN its optimizer state (views, or copies), and each group's hyperparameters."""
    from torch.distributed.tensor import DTensor

    entry_of = {id(e.value): e for e in pm.entries}
    state: dict[str, Any] = {}
    groups = []
    for group in pm.optimizer.param_groups:
        for p in group["params"]:
            e = entry_of.get(id(p))
            if e is None:
                raise CheckpointError("the optimizer steps a tensor that is none of the model's parameters: "
                                      "build it from the parameters compile passes to the optimizer factory")
            per = {}
            for key, value in pm.optimizer.state.get(p, {}).items():
                if isinstance(value, torch.Tensor):
                    same = isinstance(value, DTensor) and value.shape == e.value.shape
                    value = checkpoint_view(_copy(value, copy), e.perm if same else None)
                per[key] = value
            state[e.fqn] = per
        groups.append({k: v for k, v in group.items() if k != "params"})
    return state, groups


def training_state(pm: Trainable, *, copy: bool = False) -> dict[str, Any]:
    """This rank's state for DCP: views of the live tensors (to load into), or copies (to save
    asynchronously while training goes on)."""
    lowered = pm._require_launch()
    model: dict[str, Any] = {e.fqn: checkpoint_view(_copy(e.value, copy), e.perm) for e in pm.entries}
    for name, buf in persistent_buffers(lowered.parts).items():
        model.setdefault(name, _copy(buf, copy))
    optim, _ = _optimizer_state(pm, copy)
    return {"model": model, "optimizer": {"state": optim}}


def trainer_state(pm: Trainable, extra: dict[str, Any] | None) -> tuple[Any, ...]:
    """(step, extra, scheduler state, optimizer group hyperparameters): what is not a tensor."""
    _, groups = _optimizer_state(pm, copy=False)
    scheduler = pm.scheduler.state_dict() if pm.scheduler is not None else None
    return (pm.step, dict(extra or {}), scheduler, groups)


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


@contextmanager
def _one_process_quiet() -> Iterator[None]:
    """DCP warns that it assumes one process when there is no process group: here that is the intent."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


# ------------------------------------------------------------------ saving


class _Staged:
    """DCP's async stager for a state already copied by :func:`training_state`: stage nothing more."""

    _synchronize_after_execute = False

    @property
    def should_synchronize_after_execute(self) -> bool:
        return False

    def stage(self, state_dict: dict[str, Any]) -> dict[str, Any]:
        return state_dict

    def synchronize_staging(self) -> None:
        return None

    def close(self) -> None:
        return None


@dataclass
class SaveHandle:
    """A save in progress (``async_save``) or done: ``result()`` waits and returns the checkpoint's path."""

    path: Path
    future: Future | None = None

    def result(self, timeout: float | None = None) -> Path:
        if self.future is not None:
            self.future.result(timeout)
        return self.path

    def done(self) -> bool:
        return self.future is None or self.future.done()


def _own_files(tmp: Path, rank: int) -> dict[str, dict[str, int]]:
    """Size and CRC-32 of the files this rank wrote (rank 0: also DCP's ``.metadata``)."""
    names = [f for f in tmp.iterdir() if f.name.startswith(f"__{rank}_")]
    if rank == 0:
        names.append(tmp / ".metadata")
    out = {}
    for f in sorted(names):
        crc = 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        out[f.name] = {"bytes": f.stat().st_size, "crc32": crc}
    return out


def _publish(tmp: Path, path: Path, group: Any, marker: dict[str, Any]) -> None:
    """After DCP wrote everything: record every file, write the marker, rename into place."""
    files = _own_files(tmp, _rank())
    if dist.is_initialized():
        gathered: list[Any] = [None] * dist.get_world_size(group)
        dist.all_gather_object(gathered, files, group=group)
    else:
        gathered = [files]
    if _rank() == 0:
        marker["files"] = {k: v for part in gathered for k, v in part.items()}
        (tmp / (MARKER + ".tmp")).write_text(json.dumps(marker, indent=1))
        (tmp / (MARKER + ".tmp")).rename(tmp / MARKER)
        old = path.with_name(path.name + ".old")
        if path.exists():
            shutil.rmtree(old, ignore_errors=True)
            path.rename(old)
        tmp.rename(path)
        shutil.rmtree(old, ignore_errors=True)
    if dist.is_initialized():
        dist.barrier(group=group)


def _checkpoint_group(pm: Trainable) -> Any:
    """A gloo group of every rank for checkpoint traffic, so an async save's collectives in the
    background never interleave with training's (made on first use: a collective)."""
    if not dist.is_initialized():
        return None
    if pm._checkpoint_group is None:
        pm._checkpoint_group = dist.new_group(backend="gloo")
    return pm._checkpoint_group


def _marker(pm: Trainable) -> dict[str, Any]:
    return {"format": FORMAT, "step": pm.step, "model": pm.plan.model,
            "fingerprint": pm.graph.fingerprint(), "world_size": pm.plan.world_size,
            "dtype": pm.plan.training.dtype, "plan": json.loads(pm.plan.to_json()),
            "lr_scheduler": pm.scheduler is not None, "param_groups": len(pm.optimizer.param_groups),
            "saved_unix_s": time.time(), "torch": torch.__version__}


_EXECUTOR = ThreadPoolExecutor(max_workers=1, thread_name_prefix="autopar-checkpoint")


def save(pm: Trainable, path: str | Path, extra: dict[str, Any] | None = None,
         async_save: bool = False) -> SaveHandle:
    """Write a checkpoint of ``pm`` at ``path`` (every rank calls it); see the module docstring.

    ``async_save``: copy the state in memory, return at once and write in the
    background (``SaveHandle.result()`` waits; the next save or load waits too).
    """
    import torch.distributed.checkpoint as dcp

    pm._require_launch()
    pm.wait_for_checkpoint()
    path = Path(path)
    tmp = path.with_name(path.name + PARTIAL)
    group = _checkpoint_group(pm)
    if _rank() == 0:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
    if group is not None:
        dist.barrier(group=group)
    state = training_state(pm, copy=async_save)
    if _rank() == 0:
        state["trainer"] = trainer_state(pm, extra)
    marker = _marker(pm)
    if not async_save:
        with _one_process_quiet():
            dcp.save(state, checkpoint_id=str(tmp), process_group=group, no_dist=group is None)
        _publish(tmp, path, group, marker)
        return SaveHandle(path)
    with _one_process_quiet():
        upload = dcp.async_save(state, checkpoint_id=str(tmp), process_group=group, async_stager=_Staged(),
                                no_dist=group is None)

    def finish() -> None:
        upload.result()
        _publish(tmp, path, group, marker)

    handle = SaveHandle(path, _EXECUTOR.submit(finish))
    pm._pending_save = handle
    return handle


# ------------------------------------------------------------------ loading


def read_marker(path: Path) -> dict[str, Any]:
    """The checkpoint's ``autopar.json``, or a :class:`CheckpointError` saying why there is none."""
    marker = path / MARKER
    if not marker.is_file():
        partial = path.with_name(path.name + PARTIAL)
        if path.name.endswith(PARTIAL) or partial.exists():
            raise CheckpointError(f"checkpoint {path} is incomplete: its save did not finish "
                                  f"(no {MARKER}); load an earlier one (autopar.latest_checkpoint)")
        what = "does not exist" if not path.exists() else f"has no {MARKER} (not an autopar checkpoint, or incomplete)"
        raise CheckpointError(f"checkpoint {path} {what}")
    try:
        data = json.loads(marker.read_text())
        data["step"], data["fingerprint"], data["files"]  # noqa: B018 - the fields load needs
    except (ValueError, KeyError, TypeError) as exc:
        raise CheckpointError(f"checkpoint {path}: {MARKER} is corrupt ({exc})") from None
    if data.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint {path} has format {data.get('format')}, this autopar reads {FORMAT}")
    return data


def _file_problems(path: Path, files: dict[str, dict[str, int]], rank: int, world: int) -> list[str]:
    """Missing, truncated or altered files among this rank's share of ``files``."""
    problems = []
    for i, (name, want) in enumerate(sorted(files.items())):
        if i % world != rank:
            continue
        f = path / name
        if not f.is_file():
            problems.append(f"{name} is missing")
            continue
        if f.stat().st_size != want["bytes"]:
            problems.append(f"{name} has {f.stat().st_size} bytes, {want['bytes']} were written")
            continue
        crc = 0
        with open(f, "rb") as fh:
            while chunk := fh.read(1 << 24):
                crc = zlib.crc32(chunk, crc)
        if crc != want["crc32"]:
            problems.append(f"{name} is corrupt (CRC-32 {crc:08x}, {want['crc32']:08x} was written)")
    return problems


def _agree(problems: list[str], group: Any) -> list[str]:
    """Every rank's problems on every rank (a collective), so all raise together or none does."""
    if not dist.is_initialized():
        return problems
    gathered: list[Any] = [None] * dist.get_world_size(group)
    dist.all_gather_object(gathered, problems, group=group)
    return [p for part in gathered for p in part]


def _missing_keys(state: dict[str, Any], metadata: Any) -> list[str]:
    """What this rank needs that the checkpoint lacks, or holds in another shape. Optimizer state
    is named by its kind ("exp_avg of 29 parameters"): a checkpoint of another optimizer lacks all."""
    from torch.distributed.checkpoint._nested_dict import flatten_state_dict
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    flat, _ = flatten_state_dict(state)
    saved = metadata.state_dict_metadata
    problems, optimizer_state = [], {}
    for key, value in flat.items():
        md = saved.get(key)
        if md is None and key.startswith("optimizer.state."):
            kind = key.rpartition(".")[2]
            optimizer_state[kind] = optimizer_state.get(kind, 0) + 1
        elif md is None:
            problems.append(f"{key} is not in it")
        elif isinstance(md, TensorStorageMetadata) and isinstance(value, torch.Tensor) \
                and tuple(md.size) != tuple(value.size()):
            problems.append(f"{key} has shape {tuple(md.size)} there, {tuple(value.size())} here")
    by_count: dict[int, list[str]] = {}
    for kind, n in sorted(optimizer_state.items()):
        by_count.setdefault(n, []).append(kind)
    problems += [f"optimizer state {', '.join(kinds)} of {n} parameter{'s' * (n != 1)} is not in it "
                 "(saved with another optimizer?)" for n, kinds in sorted(by_count.items())]
    return problems


def _fail(path: Path, problems: list[str], what: str) -> CheckpointError:
    shown = "; ".join(problems[:6]) + (f"; … {len(problems) - 6} more" if len(problems) > 6 else "")
    return CheckpointError(f"checkpoint {path} {what}: {shown}. Nothing was loaded")


def init_optimizer_state(opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """Create the optimizer's state (as its first step does) with zero gradients and learning
    rate 0, so there is state to load into; parameters do not move. Returns the parameters
    whose state it created (to drop again if the load is refused)."""
    params = [p for g in opt.param_groups for p in g["params"]]
    created = [p for p in params if p not in opt.state]
    if not created:
        return []
    saved = [p.grad for p in params]
    for p in params:
        p.grad = torch.zeros_like(p)
    lrs = [g["lr"] for g in opt.param_groups]
    for g in opt.param_groups:
        g["lr"] = torch.tensor(0.0) if isinstance(g["lr"], torch.Tensor) else 0.0
    opt.step()
    for g, lr in zip(opt.param_groups, lrs):
        g["lr"] = lr
    for p, grad in zip(params, saved):
        p.grad = grad
    return created


def _restore_optimizer(pm: Trainable, state: dict[str, Any], groups: list[dict[str, Any]]) -> None:
    """Put what DCP loaded (in place for tensors) back into the optimizer and its groups."""
    entry_of = {e.fqn: e for e in pm.entries}
    for fqn, per in state["optimizer"]["state"].items():
        p = entry_of[fqn].value
        for key, value in per.items():
            if not isinstance(value, torch.Tensor):
                pm.optimizer.state[p][key] = value
    for group, saved in zip(pm.optimizer.param_groups, groups):
        group.update({k: v for k, v in saved.items() if k != "params"})


def _short(fingerprint: str) -> str:
    return fingerprint.rpartition(":")[2][:12] + "…"


def load(pm: Trainable, path: str | Path) -> dict[str, Any]:
    """Load the checkpoint at ``path`` into ``pm`` under its current plan; returns the saved ``extra``."""
    import torch.distributed.checkpoint as dcp

    pm._require_launch()
    pm.wait_for_checkpoint()
    path = Path(path)
    group = _checkpoint_group(pm)
    marker = read_marker(path)
    if marker["fingerprint"] != pm.graph.fingerprint():
        raise CheckpointError(f"checkpoint {path} was saved for another model ({marker.get('model')}, "
                              f"fingerprint {_short(marker['fingerprint'])}), this one is {pm.plan.model} "
                              f"({_short(pm.graph.fingerprint())}): load a checkpoint of this model, or "
                              "its weights alone with load_weights from an export")
    if pm.scheduler is not None and not marker.get("lr_scheduler"):
        raise CheckpointError(f"checkpoint {path} was saved without an lr_scheduler: compile without "
                              "one, or load the weights alone with load_weights")
    if marker.get("param_groups", 1) != len(pm.optimizer.param_groups):
        raise CheckpointError(f"checkpoint {path} holds {marker.get('param_groups')} optimizer parameter "
                              f"groups, this optimizer has {len(pm.optimizer.param_groups)}: build it the "
                              "same way")
    world = dist.get_world_size() if dist.is_initialized() else 1
    problems = _agree(_file_problems(path, marker["files"], _rank(), world), group)
    if problems:
        raise _fail(path, problems, "is damaged")
    created = init_optimizer_state(pm.optimizer)
    state = training_state(pm)
    state["trainer"] = ()  # a placeholder DCP replaces with the saved tuple
    try:
        metadata = dcp.FileSystemReader(str(path)).read_metadata()
        missing = _missing_keys(state, metadata)
    except Exception as exc:  # noqa: BLE001 - a damaged .metadata, whatever unpickling raised
        missing = [f".metadata cannot be read ({type(exc).__name__}: {exc})"]
    missing = _agree(missing, group)
    if missing:
        for p in created:  # as it was: no optimizer state made up for a load that did not happen
            del pm.optimizer.state[p]
        raise _fail(path, missing, "does not hold what this plan needs")
    with _one_process_quiet():
        dcp.load(state, checkpoint_id=str(path), process_group=group, no_dist=group is None)
    step, extra, scheduler, groups = state["trainer"]
    _restore_optimizer(pm, state, groups)
    if pm.masters is not None:
        pm.masters.copy_to_params()
    if pm.scheduler is not None:
        pm.scheduler.load_state_dict(scheduler)
    pm.step = int(step)
    return dict(extra)


def latest_checkpoint(root: str | Path) -> Path | None:
    """The newest complete checkpoint directly under ``root`` (highest step, then newest), or None."""
    root = Path(root)
    if not root.is_dir():
        return None
    best: tuple[tuple[int, float], Path] | None = None
    for d in root.iterdir():
        marker = d / MARKER
        if d.name.endswith(PARTIAL) or not marker.is_file():
            continue
        try:
            key = (int(json.loads(marker.read_text())["step"]), marker.stat().st_mtime)
        except (ValueError, KeyError, TypeError, OSError):
            continue
        if best is None or key > best[0]:
            best = (key, d)
    return None if best is None else best[1]
