"""Weights in and out as safetensors, keyed like the original model: the format shared with the world.

* :func:`export` writes one consolidated, unsharded state dict: each tensor
  is gathered whole (a collective among the ranks holding it, one tensor at a
  time, tensor parallelism's row permutations undone) and rank 0 writes it
  with the ``safetensors`` package — ``model.safetensors``, or shards of at
  most ``max_shard_bytes`` with ``model.safetensors.index.json``, Hugging
  Face's layout; a model with a Hugging Face config also gets its
  ``config.json``, so ``from_pretrained(path)`` loads the export.
* :func:`load_weights` reads a ``.safetensors`` file or a directory holding
  ``model.safetensors`` or an index of shards (a Hugging Face checkpoint
  directory). Each rank opens the files lazily (safetensors memory-maps
  them) and reads only the rows and columns of the shards it holds; where
  tensor parallelism permuted rows, it reads the runs of original rows its
  shard holds. No rank allocates a whole tensor it shards.

Pickle is never read here: a ``pytorch_model.bin`` is refused.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from autopar.errors import WeightsError
from autopar.runtime.lowering import held_group
from autopar.runtime.state import Permutation, Trainable, full_tensor, local, persistent_buffers, row_runs, shard_box

INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"
DEFAULT_SHARD_BYTES = 4 * 2**30


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _agree(problems: list[str]) -> list[str]:
    """Every rank's problems on every rank, so they raise together (a collective)."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return problems
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, problems)
    return sorted({p for part in gathered for p in part})


def _tensors(pm: Trainable) -> list[tuple[str, torch.Tensor, Permutation | None]]:
    """(FQN, tensor, permutation) of every parameter and persistent buffer this rank holds."""
    lowered = pm._require_launch()
    out = [(e.fqn, e.value, e.perm) for e in pm.entries]
    names = {e.fqn for e in pm.entries}
    out += [(name, buf, None) for name, buf in persistent_buffers(lowered.parts).items() if name not in names]
    return out


# ------------------------------------------------------------------ export


def _my_stage(pm: Trainable) -> int:
    lowered = pm._require_launch()
    return 0 if lowered.pp_group is None else lowered.mesh["pp"].get_local_rank()


def _owners(pm: Trainable, mine: list[tuple[str, torch.Tensor, Permutation | None]]) -> list[Any]:
    """Per pipeline rank (and per rank of the first ep group where a module list's experts are each held
    by one rank of it): (its pp coordinate, the global rank that sends its tensors to rank 0,
    [(FQN, shape, dtype)]). A collective under a pipeline or such experts."""
    lowered = pm._require_launch()
    keys = [(n, tuple(t.shape), t.dtype) for n, t, _ in mine]
    ep = pm.plan.mesh.ep if held_group(lowered) is not None else 1
    if lowered.pp_group is None and ep == 1:
        return [(0, 0, keys)]
    mesh = lowered.mesh
    # the first ep group is dp ranks 0 … ep − 1 (ep innermost in dp: passes/expert_parallel.expert_mesh)
    first = all(mesh[name].get_local_rank() < (ep if name == "dp" else 1)
                for name in mesh.mesh_dim_names if name != "pp")
    item = (mesh["pp"].get_local_rank(), dist.get_rank(), keys) if first else None
    gathered: list[Any] = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, item)
    owners, seen = [], set()
    for stage, sender, held in sorted((g for g in gathered if g is not None), key=lambda g: g[0]):
        owners.append((stage, sender, [k for k in held if k[0] not in seen]))  # each tensor from its first holder
        seen.update(k[0] for k in held)
    return owners


def _config(model: Any) -> Any:
    config = getattr(model, "config", None)
    return config if callable(getattr(config, "save_pretrained", None)) else None


def _write(files: list[dict[str, torch.Tensor]], path: Path, single_file: bool) -> None:
    from safetensors.torch import save_file

    if single_file:
        save_file(files[0], str(path), metadata={"format": "pt"})
        return
    path.mkdir(parents=True, exist_ok=True)
    if len(files) == 1:
        save_file(files[0], str(path / SINGLE), metadata={"format": "pt"})
        return
    weight_map, total = {}, 0
    for i, shard in enumerate(files):
        name = f"model-{i + 1:05d}-of-{len(files):05d}.safetensors"
        save_file(shard, str(path / name), metadata={"format": "pt"})
        weight_map.update({k: name for k in shard})
        total += sum(t.numel() * t.element_size() for t in shard.values())
    (path / INDEX).write_text(json.dumps({"metadata": {"total_size": total}, "weight_map": weight_map},
                                         indent=2))


def export(pm: Trainable, path: str | Path, *, dtype: torch.dtype | None = None,
           max_shard_bytes: int = DEFAULT_SHARD_BYTES) -> Path:
    """Write the whole model's weights as safetensors at ``path`` (every rank calls it); returns ``path``.

    ``path`` ending in ``.safetensors`` is one file; anything else a directory
    in Hugging Face's layout. ``dtype`` casts floating tensors (default: as
    trained, the fp32 masters of a bf16 plan).
    """
    path = Path(path)
    mine = _tensors(pm)
    held = {name: (t, perm) for name, t, perm in mine}
    files: list[dict[str, torch.Tensor]] = [{}]
    size, stage, written = 0, _my_stage(pm), set()
    for owner, sender, keys in _owners(pm, mine):
        for name, shape, kind in keys:
            tensor = None
            # every rank of the stage holding the tensor takes part in gathering it (a module list's expert:
            # the ranks of its owner's edp group, which are those of the tensor's FSDP2 mesh if it has one)
            if owner == stage and name in held:
                tensor = full_tensor(*held[name]).detach()
                if dtype is not None and tensor.is_floating_point():
                    tensor = tensor.to(dtype)
                if sender != 0 and dist.get_rank() == sender:
                    dist.send(tensor.contiguous(), dst=0)
            if _rank() == 0:
                if tensor is None:  # another pipeline rank's tensor
                    tensor = torch.empty(shape, dtype=dtype if dtype is not None and kind.is_floating_point
                                         else kind)
                    dist.recv(tensor, src=sender)
                if name in written:  # a buffer several stages read
                    continue
                written.add(name)
                nbytes = tensor.numel() * tensor.element_size()
                if files[-1] and size + nbytes > max_shard_bytes and not str(path).endswith(".safetensors"):
                    files.append({})
                    size = 0
                files[-1][name] = tensor.cpu().contiguous()
                size += nbytes
    if _rank() == 0:
        _write(files, path, str(path).endswith(".safetensors"))
        config = _config(pm.module)
        if config is not None and not str(path).endswith(".safetensors"):
            config.save_pretrained(str(path))
    if dist.is_initialized():
        dist.barrier()
    return path


# ------------------------------------------------------------------ weights in


def weight_files(path: str | Path) -> dict[str, Path]:
    """Which safetensors file holds each tensor: a file, a Hugging Face directory (index or single)."""
    from safetensors import safe_open

    path = Path(path)
    if path.is_dir():
        if (path / INDEX).is_file():
            try:
                weight_map = json.loads((path / INDEX).read_text())["weight_map"]
            except (ValueError, KeyError) as exc:
                raise WeightsError(f"{path / INDEX} is not a safetensors index ({exc})") from None
            return {k: path / v for k, v in weight_map.items()}
        found = sorted(path.glob("*.safetensors"))
        if (path / SINGLE).is_file():
            found = [path / SINGLE]
        if len(found) != 1:
            pickled = [p.name for p in path.glob("*.bin")] + [p.name for p in path.glob("*.pt")]
            why = (f"; {pickled[0]} is pickle, which autopar never loads: convert it to safetensors"
                   if pickled else "")
            raise WeightsError(f"{path} has {len(found)} .safetensors files and no {INDEX}: give the "
                               f"file, or a directory with {SINGLE} or an index{why}")
        path = found[0]
    if not path.is_file():
        raise WeightsError(f"weights file {path} does not exist")
    if path.suffix != ".safetensors":
        raise WeightsError(f"{path} is not a .safetensors file: autopar reads weights only as safetensors "
                           "(pickle is never loaded)")
    with safe_open(str(path), framework="pt") as f:
        return {k: path for k in f.keys()}


def _aliases(pm: Trainable) -> dict[str, list[str]]:
    """Every name of each parameter (tied weights have several), by its first name."""
    out: dict[str, list[str]] = {}
    first: dict[int, str] = {}
    for part in pm.lowered.parts:
        for name, p in part.named_parameters(remove_duplicate=False):
            out.setdefault(first.setdefault(id(p), name), []).append(name)
    return out


def _plan_reads(pm: Trainable, where: dict[str, Path]) -> tuple[list[Any], list[str]]:
    """(what each tensor of this rank reads: (file key, file, tensor, perm), problems)."""
    from safetensors import safe_open

    aliases, params = _aliases(pm), {e.fqn for e in pm.entries}
    reads, problems = [], []
    for name, tensor, perm in _tensors(pm):
        key = next((a for a in aliases.get(name, [name]) if a in where), None)
        if key is None:
            if name in params:
                problems.append(f"{name} is missing")
            continue
        with safe_open(str(where[key]), framework="pt") as f:
            shape = tuple(f.get_slice(key).get_shape())
        if shape != tuple(tensor.shape):
            problems.append(f"{key} has shape {shape} in the file, {tuple(tensor.shape)} in the model")
            continue
        reads.append((key, where[key], tensor, perm))
    return reads, problems


@torch.no_grad()
def _read_into(key: str, file: Path, tensor: torch.Tensor, perm: Permutation | None, handles: dict) -> None:
    """Read this rank's block of ``key`` (and only it) into ``tensor``'s local shard."""
    from safetensors import safe_open

    if file not in handles:
        handles[file] = safe_open(str(file), framework="pt")
    sl = handles[file].get_slice(key)
    target = local(tensor)
    if target.numel() == 0:
        return
    if tensor.dim() == 0:
        target.copy_(handles[file].get_tensor(key))
        return
    sizes, offsets = shard_box(tensor)
    block = [slice(o, o + s) for o, s in zip(offsets, sizes)]
    if perm is None:
        target.copy_(sl[tuple(block)])
        return
    d = perm.dim
    for row, at, n in row_runs(perm.index, offsets[d], sizes[d]):
        block[d] = slice(row, row + n)
        target.narrow(d, at, n).copy_(sl[tuple(block)])


def load_weights(pm: Trainable, path: str | Path) -> None:
    """Load safetensors weights (see the module docstring) into ``pm``; every rank calls it.

    Raises :class:`WeightsError` on every rank, having loaded nothing, when a
    parameter is missing or has another shape.
    """
    try:
        where = weight_files(path)
        reads, problems = _plan_reads(pm, where)
    except WeightsError as exc:
        reads, problems = [], [str(exc)]
    problems = _agree(problems)
    if problems:
        sample = ", ".join(sorted(where)[:4]) if "where" in locals() and where else "none"
        shown = "; ".join(problems[:6]) + (f"; … {len(problems) - 6} more" if len(problems) > 6 else "")
        raise WeightsError(f"weights {path} do not fit this model: {shown} (the file's keys begin: "
                           f"{sample}). Nothing was loaded")
    handles: dict[Path, Any] = {}
    for key, file, tensor, perm in reads:
        _read_into(key, file, tensor, perm, handles)
    if pm.masters is not None:
        pm.masters.copy_to_params()
    if dist.is_initialized():
        dist.barrier()
