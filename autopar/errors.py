"""Typed errors of autopar's public API.

Every error a user can cause is one of these, with a message that names the
thing that is wrong and what to do about it. The CLI prints the message on one
line and exits 2 (3 for :class:`InfeasibleError`).
"""

from __future__ import annotations


class AutoparError(ValueError):
    """Base class of every error autopar raises for bad input."""


class CaptureError(AutoparError):
    """The model could not be traced into a LayerGraph (both tracers were tried)."""


class PinError(AutoparError):
    """A pin is malformed, names no layer, or contradicts another pin or the world size."""


class MeshError(AutoparError):
    """A mesh names an axis that is not declared, or its degrees are not positive integers."""


class PlanError(AutoparError):
    """A plan file is corrupt, of another schema version, or made for another model."""


class SpecError(AutoparError):
    """A CLI model SPEC could not be loaded or returned something other than (model, inputs)."""


class InfeasibleError(AutoparError):
    """No plan satisfies the constraints; the message names the binding one."""

    def __init__(self, message: str, *, binding: str, min_memory_bytes: int | None = None):
        super().__init__(message)
        self.binding = binding
        self.min_memory_bytes = min_memory_bytes


class LoweringError(AutoparError):
    """A plan cannot be lowered onto this model (e.g. tp does not divide its heads or widths)."""


class CompileError(LoweringError):
    """torch.compile was asked for a lowering it does not run yet (tensor parallelism, pipelines…)."""


class LaunchError(AutoparError):
    """Training needs a process group that was not launched; the message says how to launch."""


class BatchError(AutoparError):
    """A training batch or loss does not fit the plan (microbatches × microbatch size, a scalar loss)."""


class CheckpointError(AutoparError):
    """A checkpoint is missing, incomplete, corrupt or made for another model; the message says which."""


class WeightsError(AutoparError):
    """A safetensors weights file or directory lacks a parameter, or holds one of another shape."""


class InputsError(AutoparError):
    """Example inputs or a batch do not fit the model's forward signature; the message names the argument."""


class LossError(BatchError):
    """No default loss fits the model's output and the targets: the message asks for a loss function."""


class DataError(AutoparError):
    """A data file is missing, too short for one sequence, or holds token ids the model's vocabulary
    cannot take; or a checkpoint's data position belongs to another dataset or batch."""


class MetricsError(AutoparError):
    """A metrics output cannot be made (TensorBoard asked for without its package, an unwritable file)."""


class Float8Error(AutoparError):
    """float8 training was asked where it cannot run (a device without float8 matmuls, torchao missing,
    a lowering it does not run yet); the message names the device or the missing piece."""
