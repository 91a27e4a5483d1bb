"""Mixed precision where no FSDP2 unit keeps the master weights: bf16 parameters, fp32 masters.

A bf16 plan computes in bf16 and keeps its master weights, optimizer state and
gradient reduction in fp32 (DESIGN.md, "Training state"). FSDP2 units do this
themselves (``MixedPrecisionPolicy``, :mod:`autopar.passes.zero`): their sharded
fp32 parameters are the masters. A model part without FSDP2 — one rank, tensor
or pipeline parallelism without dp, a DDP root — gets the same here:

* its parameters become bf16 in place (the same objects, the same FQNs), so
  compute, saved activations, tensor-parallel collectives and pipeline sends
  are bf16; floating inputs are cast to bf16 on the way in;
* an fp32 master copy of each parameter is what the optimizer steps;
* gradients accumulate in fp32 on the masters: each bf16 gradient is added to
  its master's and dropped as soon as autograd has produced it (a
  post-accumulate-grad hook); on a DDP root the last microbatch's bf16
  bucket is all-reduced in fp32 together with the fp32 sum of the earlier
  microbatches (a DDP comm hook), and the mean lands in the masters;
* after the optimizer step the masters are copied back into the parameters.

A parameter then costs 2 (bf16) + 4 (fp32 master gradient) + 12 (master and
Adam moments) bytes, where FSDP2's costs 4 + 4 + 8 sharded; pricing counts both
(:mod:`autopar.planning.pricing`).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist
import torch.nn as nn

BF16 = torch.bfloat16


def plan_dtype(dtype_name: str) -> torch.dtype | None:
    """The compute dtype of a plan's ``training.dtype``: bf16, or None (fp32 runs as it is)."""
    return BF16 if dtype_name == "bf16" else None


def cast_floating(value: Any, dtype: torch.dtype) -> Any:
    """``value`` with every floating tensor in it (tuples, lists, dicts, model outputs) cast to ``dtype``."""
    from torch.utils._pytree import tree_map_only

    return tree_map_only(torch.Tensor, lambda t: t.to(dtype) if t.is_floating_point() else t, value)


def _cast_param_(param: nn.Parameter, dtype: torch.dtype) -> None:
    """Cast ``param`` to ``dtype`` in place, keeping the Parameter object (and so its FQN and hooks)."""
    from torch.distributed.tensor import DTensor

    with torch.no_grad():
        if isinstance(param, DTensor):  # a wrapper subclass: swap its contents, as Module._apply does
            torch.utils.swap_tensors(param, nn.Parameter(param.detach().to(dtype), param.requires_grad))
        else:
            param.data = param.data.to(dtype)


@dataclass
class MasterWeights:
    """fp32 masters of the bf16 parameters of the parts FSDP2 does not wrap.

    ``params[i]`` (bf16, in the model) and ``masters[i]`` (fp32, in the
    optimizer) are one parameter. ``grad_scale`` multiplies each gradient as
    it is added (1/m under a pipeline whose schedule does not divide); while
    ``ddp_syncing`` a DDP root's comm hook, not the accumulate hook, takes
    the gradients.
    """

    params: list[nn.Parameter]
    masters: list[nn.Parameter]
    grad_scale: float = 1.0
    ddp_syncing: bool = False
    _by_param: dict[int, nn.Parameter] = field(default_factory=dict)
    _ddp_params: set[int] = field(default_factory=set)

    def master_of(self, param: nn.Parameter) -> nn.Parameter:
        return self._by_param.get(id(param), param)

    def _accumulate(self, param: nn.Parameter) -> None:
        """Post-accumulate-grad hook: move this bf16 gradient into the fp32 master's gradient."""
        if self.ddp_syncing and id(param) in self._ddp_params:
            return  # the DDP comm hook reduces this microbatch
        grad, param.grad = param.grad, None
        master = self._by_param[id(param)]
        if self.grad_scale != 1.0:
            grad = grad * self.grad_scale
        if master.grad is None:
            master.grad = grad.to(torch.float32)
        else:
            master.grad.add_(grad)

    def drop_param_grads(self) -> None:
        """Forget the bf16 gradients DDP leaves in its buckets' views (the masters hold the fp32 mean)."""
        for p in self.params:
            p.grad = None

    @torch.no_grad()
    def copy_to_params(self) -> None:
        """After the optimizer step: the parameters take the masters' new values (rounded to bf16)."""
        from torch.distributed.tensor import DTensor

        def local(t: torch.Tensor) -> torch.Tensor:
            return t.to_local() if isinstance(t, DTensor) else t

        torch._foreach_copy_([local(p) for p in self.params], [local(m) for m in self.masters])

    def ddp_hook(self, group: Any) -> Any:
        """A DDP comm hook: the bucket's bf16 gradients plus the masters' fp32 sums of earlier
        microbatches, all-reduced in fp32 and averaged into the masters' ``.grad``."""
        world = dist.get_world_size(group)

        def hook(state, bucket):  # unannotated: DDP checks a hook's annotations against its own types
            buffer = bucket.buffer()
            total = buffer.to(torch.float32)
            size = buffer.element_size()
            segments = []
            for p, g in zip(bucket.parameters(), bucket.gradients()):
                start = (g.data_ptr() - buffer.data_ptr()) // size
                segment = total[start:start + p.numel()].view(p.shape)
                master = self._by_param[id(p)]
                if master.grad is not None:
                    segment.add_(master.grad)
                segments.append((master, segment))
            future = dist.all_reduce(total, group=group, async_op=True).get_future()

            def averaged(_: Any) -> torch.Tensor:
                total.div_(world)
                for master, segment in segments:
                    master.grad = segment
                buffer.copy_(total)
                return buffer

            return future.then(averaged)

        return hook


def attach_masters(parts: Iterable[nn.Module], ddp_roots: Iterable[nn.Module | None], dp_group: Any,
                   dtype: torch.dtype, grad_scale: float = 1.0, leave: frozenset[int] = frozenset()) -> MasterWeights:
    """Make the parts' parameters ``dtype`` with fp32 masters; see the module docstring. ``leave``: ids of
    parameters kept as they are (ep's experts: fp32, computed on bf16 copies, reduced by the ep pass).

    Requires: the parts materialised and not FSDP2-wrapped, a DDP root not run
    yet (the composable DDP builds its buckets on its first forward, over the
    bf16 parameters; its comm hook is registered here).
    """
    weights = MasterWeights([], [], grad_scale)
    for part, ddp in zip(parts, ddp_roots):
        own = [p for p in part.parameters() if id(p) not in weights._by_param and id(p) not in leave]
        for p in own:
            master = nn.Parameter(p.detach().clone().to(torch.float32), requires_grad=p.requires_grad)
            _cast_param_(p, dtype)
            weights.params.append(p)
            weights.masters.append(master)
            weights._by_param[id(p)] = master
            if p.requires_grad:
                p.register_post_accumulate_grad_hook(weights._accumulate)
        if ddp is not None:
            weights._ddp_params.update(id(p) for p in own)
            ddp.register_comm_hook(None, weights.ddp_hook(dp_group))
        part.register_forward_pre_hook(lambda _m, args, kwargs: (cast_floating(args, dtype),
                                                                 cast_floating(kwargs, dtype)),
                                       with_kwargs=True)
    return weights
