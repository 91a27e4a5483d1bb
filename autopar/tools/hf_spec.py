"""Hugging Face SPECs: a model's ``config.json``, or a model directory holding one.

Most people planning a published model have its config, not a spec
function. The model is built from the config with transformers (the class
its ``architectures`` names, else ``AutoModelForCausalLM``), with
``use_cache=False`` (training), under ``torch.device(device)``: on meta to
plan, with random weights to verify — or, when the directory holds
``*.safetensors``, with those weights (``use_safetensors=True``: a pickled
checkpoint is never read). Nothing is downloaded: the hub is switched off
and a string that names no file but looks like a hub id is refused, asking
for a local path. The example inputs are token ids of ``batch × seq_len``
(zeros; an encoder-decoder also gets ``decoder_input_ids``).

Every way this can fail is a :class:`~autopar.errors.SpecError` of one line.
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path
from typing import TYPE_CHECKING, Any

from autopar.errors import SpecError

if TYPE_CHECKING:
    import torch.nn as nn

DEFAULT_BATCH = 2  # dim 0 must tell the batch from broadcast dims of 1
MAX_DEFAULT_SEQ = 4096  # a 128k context is not what a plan is usually for; --seq-len says otherwise
_HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")
_POSITION_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "n_ctx")


def _config_file(spec: str) -> Path | None:
    p = Path(spec)
    if p.is_dir():
        return p / "config.json"
    if p.suffix == ".json":
        return p
    return None


def is_config_spec(spec: str) -> bool:
    """Whether ``spec`` is for this loader: a directory, a ``.json`` file that is a model config (not
    a saved plan), or a hub-id-looking string with no colon that names nothing here."""
    p = Path(spec)
    if p.is_dir():
        return True
    if p.suffix == ".json":
        if not p.is_file():
            return True
        try:
            data = json.loads(p.read_text())
        except (OSError, ValueError):
            return False
        return isinstance(data, dict) and ("model_type" in data or "architectures" in data)
    return ":" not in spec and bool(_HUB_ID.match(spec)) and not p.exists()


def _transformers() -> Any:
    os.environ.setdefault("HF_HUB_OFFLINE", "1")  # never reach the hub, whatever a call defaults to
    try:
        import transformers
    except ImportError as exc:
        raise SpecError("a Hugging Face config SPEC needs the transformers package: "
                        "pip install 'transformers>=5'") from exc
    transformers.logging.set_verbosity_error()
    transformers.logging.disable_progress_bar()  # loading a checkpoint: one line of ours, not bars
    return transformers


def _config(spec: str) -> tuple[Any, Path]:
    path = _config_file(spec)
    if path is None:
        raise SpecError(f"model spec {spec!r} is not a local path; autopar never downloads a model: pass the "
                        "path to its config.json or to a model directory holding one "
                        "(e.g. after `hf download ID --include config.json --local-dir DIR`)")
    if not path.is_file():
        where = f"directory {spec!r} has no config.json" if Path(spec).is_dir() else f"file {spec!r} does not exist"
        raise SpecError(f"model spec {spec!r}: {where}")
    transformers = _transformers()
    try:
        config = transformers.AutoConfig.from_pretrained(str(path), local_files_only=True)
    except Exception as exc:  # noqa: BLE001 - an unknown model_type, malformed JSON...
        raise SpecError(f"model spec {spec!r}: transformers {transformers.__version__} cannot read "
                        f"{str(path)!r}: {_one_line(exc)}") from exc
    return config, path


def _one_line(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    text = text if len(text) <= 300 else text[:297] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _model_class(spec: str, config: Any) -> Any:
    """The class the config's ``architectures`` names, else what AutoModelForCausalLM maps it to."""
    transformers = _transformers()
    names = list(getattr(config, "architectures", None) or [])
    if names:
        cls = getattr(transformers, names[0], None)
        if cls is None or not isinstance(cls, type) or not issubclass(cls, transformers.PreTrainedModel):
            raise SpecError(f"model spec {spec!r}: config.json names architecture {names[0]!r}, which transformers "
                            f"{transformers.__version__} has no model class for (custom code is not run)")
        return cls
    try:
        return transformers.AutoModelForCausalLM._model_mapping[type(config)]
    except KeyError as exc:
        raise SpecError(f"model spec {spec!r}: config.json names no architectures and {type(config).__name__} "
                        "has no causal-LM class; add \"architectures\": [\"...ForCausalLM\"] (or the class "
                        "to build) to it") from exc


def _seq_len(config: Any, seq_len: int | None) -> int:
    if seq_len is not None:
        return seq_len
    for key in _POSITION_KEYS:
        value = getattr(config, key, None)
        if isinstance(value, int) and value > 0:
            return min(value, MAX_DEFAULT_SEQ)
    return 1024


def _inputs(model: nn.Module, config: Any, batch: int, seq: int) -> Any:
    import torch

    main = getattr(model, "main_input_name", "input_ids")
    if main != "input_ids":
        raise SpecError(f"{type(model).__name__} takes {main!r}, not token ids; only text models plan from a "
                        "config.json for now (write a spec function returning the inputs)")
    ids = torch.zeros(batch, seq, dtype=torch.long)
    if getattr(config, "is_encoder_decoder", False):
        return {"input_ids": ids, "decoder_input_ids": torch.zeros(batch, seq, dtype=torch.long)}
    return (ids,)


def _weights(directory: Path) -> bool:
    return any(directory.glob("*.safetensors"))


def model_name(spec: str) -> str:
    """The plan's model name: the model directory's name (``Llama-3-70B``), else the config file's."""
    p = Path(spec).resolve()
    return p.name if p.is_dir() else (p.parent.name or p.stem)


def describe(spec: str, seq_len: int | None, batch: int | None) -> str:
    """The note the CLI prints about defaults it chose for a config SPEC ('' when none)."""
    chosen = []
    if batch is None:
        chosen.append(f"batch {DEFAULT_BATCH}")
    if seq_len is None:
        chosen.append(f"sequence length min(config's positions, {MAX_DEFAULT_SEQ})")
    return (f"note: {spec}: example inputs are token ids of {' and '.join(chosen)} "
            "(--batch-size and --seq-len set them)") if chosen else ""


def load_config_spec(spec: str, *, seq_len: int | None = None, device: str = "meta",
                     batch: int | None = None) -> tuple[nn.Module, Any]:
    """``(model, example_inputs)`` of a config SPEC, built on ``device``: see the module docstring."""
    import torch

    config, path = _config(spec)
    if hasattr(config, "use_cache"):
        config.use_cache = False
    cls = _model_class(spec, config)
    directory = path.parent
    try:
        if device != "meta" and _weights(directory):
            model = cls.from_pretrained(str(directory), config=config, local_files_only=True,
                                        use_safetensors=True, dtype=torch.float32)
        else:
            with torch.device(device):
                model = cls._from_config(config)
    except SpecError:
        raise
    except Exception as exc:  # noqa: BLE001 - the model's own constructor or the checkpoint
        raise SpecError(f"model spec {spec!r}: building {cls.__name__} failed: {_one_line(exc)}") from exc
    with torch.device(device):
        inputs = _inputs(model, config, batch or DEFAULT_BATCH, _seq_len(config, seq_len))
    return model, inputs


__all__ = ["describe", "is_config_spec", "load_config_spec", "model_name"]
