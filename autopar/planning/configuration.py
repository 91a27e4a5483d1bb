"""A configuration: the plan-wide choices one CP-SAT model is solved for, and the training it prices.

A :class:`Configuration` is a :class:`~autopar.mesh.Mesh`, a microbatch
count, a pipeline schedule and how data parallelism runs
(:class:`~autopar.contract.DataParallelism`); :mod:`.configs` enumerates
them, :mod:`.pricing` prices every layer's choices under one.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from autopar import contract
from autopar.choice import BatchCoupling, CpAttention, LossKind
from autopar.contract import REPLICATED, DataParallelism, Engine
from autopar.cost_models.memory import Precision, precision
from autopar.cost_models.pipeline import Schedule
from autopar.float8 import Float8Settings
from autopar.mesh import Mesh


@dataclass(frozen=True, order=True)
class Configuration:
    """The global choices: the mesh, microbatches, pipeline schedule, and how data parallelism
    runs (replicated, or sharded with the root units at one ZeRO stage), and under cp how attention
    sees the whole sequence (:class:`~autopar.choice.CpAttention`; all-gather at cp = 1, where it is moot)."""

    mesh: Mesh
    microbatches: int
    schedule: Schedule = field(compare=False)
    data_parallel: DataParallelism = REPLICATED
    cp_attention: CpAttention = CpAttention.ALL_GATHER

    @property
    def engine(self) -> Engine:
        """The plan's data-parallel engine (:func:`autopar.contract.plan_engine`)."""
        return contract.plan_engine(self.mesh, self.data_parallel)

    @property
    def world_size(self) -> int:
        return self.mesh.world_size

    @property
    def stages(self) -> int:
        """Virtual pipeline stages: pp × chunks per rank."""
        return self.mesh.pp * self.schedule.chunks

    def rank_of_stage(self, stage: int) -> int:
        return contract.pipeline_rank(stage, self.mesh.pp, self.schedule.v_shape)

    def describe(self) -> str:
        dp = f" {self.data_parallel}" if self.mesh.dp * self.mesh.cp > 1 else ""
        cp = f" cp_attention={self.cp_attention}" if self.mesh.cp > 1 else ""
        return f"{self.mesh.describe(' ')} m={self.microbatches} {self.schedule}{dp}{cp}"


@dataclass(frozen=True)
class TrainingSpec:
    """What the plan trains with: global batch (samples per step), precision, whether each
    block runs under torch.compile (its memory-bound ops priced fused), and which linears run float8
    matmuls (:mod:`autopar.float8`; None: none), and the loss asked for (:class:`~autopar.choice.LossKind`:
    chunked runs where :func:`autopar.contract.chunked_loss_refusal` lets it, full elsewhere)."""

    global_batch: int
    dtype: str = "bf16"
    compiled: bool = False
    float8: Float8Settings | None = None
    loss: LossKind = LossKind.FULL
    batch_coupled: BatchCoupling = BatchCoupling.AUTO  # layers whose output depends on their batch

    @property
    def precision(self) -> Precision:
        return precision(self.dtype)


__all__ = ["Configuration", "TrainingSpec"]
