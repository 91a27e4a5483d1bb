"""``autopar verify``: run a plan on W local gloo processes against one process.

The model comes from a SPEC built for real (``device="cpu"``; a plain spec is
built under ``torch.device("cpu")``) under a fixed seed, in fp32, trained with
SGD with momentum on synthetic global batches (the same in every process).
Rank 0 also trains the unsharded model in-process on the whole global batch
and compares: first-step loss and gradients, every step's loss, and
parameters after K steps.

What is compared, and why each rule is there:

- **Dropout off.** No parallel plan reproduces one process's dropout masks
  (a dp rank draws its shard's masks from its own generator), so both sides
  run with dropout disabled (:func:`disable_dropout`: every ``nn.Dropout``'s
  ``p``, and every float attribute whose name holds "drop" — ``dropout``,
  ``attention_dropout``, ``layerdrop``, ``attn_pdrop``… — on modules and on
  Hugging Face configs, set to 0), and ``verify`` says what it switched off.
  It then runs the forward twice under different seeds
  (:func:`forward_is_random`); a forward still random gets a warning, since
  no comparison with it can hold.
- **A floor for near-zero tensors.** Each tensor's difference is ‖Δ‖/‖ref‖,
  except that ‖ref‖ counts as at least ``FLOOR × rms × √numel``, where rms is
  the root mean square over every element of every reference tensor of that
  kind (first-step gradients, or parameters after K steps): the norm a tensor
  of its size would have at the model's typical scale. Rounding noise in a
  tensor is set by the size of the terms that made it, which is the model's
  scale, not the tensor's own: an attention key bias has an exact gradient of
  zero (softmax ignores a score added to every key alike), so its computed
  gradient is noise and ‖Δ‖/‖ref‖ is noise over noise (after 3 SGD steps
  the key bias itself is ~1e-11 and 0.7 relative off on OPT and BERT with
  dp = 2, an error 2e-11 of the model's parameter rms). With the floor such
  a tensor passes when its error is below ``TOLERANCE × FLOOR × rms`` per
  element, rounding level at the model's scale; a real bug moves it far
  more than that. Tensors of ordinary size
  are judged on their own norm, as before. The floor and the tensors judged
  against it are printed.
- **Rounding or the plan.** A run that misses the fp32 bar runs again in float64 on both sides
  (:mod:`autopar.tools.rounding`); agreement to 1e-10 there is ``SAME_IN_FLOAT64``: fp32's rounding,
  amplified (a BatchNorm's backward), not the plan.
- **Global batch** defaults to the example inputs' batch, so
  ``--pin microbatches=4`` on a batch-8 example works.

Synthetic batches are made from the example inputs as given, keyword or
positional (:mod:`autopar.tools.batches`: each batched input in its dtype
and the example's value range — a timestep of 0…999 stays there — masks
keep the example's rows, ``labels`` are ids below the output's last dim, an
integer placeholder of one value that an ``nn.Embedding`` reads is drawn
below its size), with targets that fit the model's output; both sides
train with ``--loss`` or the default loss that fits
(:mod:`autopar.runtime.loss`), named in one line before the run.

A rank that raises is reported as :class:`RankFailedError` with that rank's
exception and the file and line it came from (the CLI exits 1): a crash in
the parallel run is a finding, not bad input.
"""

from __future__ import annotations

import json
import math
import os
import sys
import tempfile
import time
import traceback
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from pathlib import Path
from typing import TYPE_CHECKING, Any, NoReturn

import torch
import torch.nn as nn

from autopar.errors import AutoparError
from autopar.inputs import call, describe
from autopar.inputs import tensors as model_tensors
from autopar.plan_table import wrap_line
from autopar.tools.batches import loss_line, probe, synthetic_batch  # noqa: F401 - loss_line: the CLI's

if TYPE_CHECKING:
    from autopar.plan import Plan

SEED, LR, MOMENTUM = 0, 0.05, 0.9
TOLERANCE = 1e-5
# ‖ref‖ counts as at least FLOOR × the model's rms × √numel (see the module docstring): a floored
# tensor passes when its error is below TOLERANCE × FLOOR = 1e-6 of the model's rms per element,
# about 8 fp32 units in the last place (2^-23 ≈ 1.2e-7) at the model's scale
FLOOR = 0.1
# A float8 plan is compared with one process converted the same way (torchao's emulation on both sides).
# Under rowwise scaling the scales are powers of 2, which leave float8's rounding unchanged, so the bar
# is TOLERANCE; under tensorwise each rank's scale is its own batch half's amax, so the two round
# differently, by about as much as float8 differs from fp32: per tensor, 0.11 (GPT) and 0.13 (Llama) in
# first-step gradients measured here (tests/runtime/test_float8_training.py), bounded by this.
FLOAT8_TENSORWISE_TOLERANCE = 0.25


def tolerance_for(plan: Plan) -> float:
    """The bar ``plan``'s run is judged by: :data:`TOLERANCE`, or float8 tensorwise's (above)."""
    f8 = plan.training.float8
    return FLOAT8_TENSORWISE_TOLERANCE if f8 is not None and f8.recipe.value == "tensorwise" else TOLERANCE


class VerifyFailure(RuntimeError):
    """The parallel run did not finish: a rank crashed or the run timed out (exit 1, not bad input)."""


class RankFailedError(VerifyFailure):
    """A rank raised (or died): its rank, the exception as one line, where it was raised, the traceback.

    ``where`` is the innermost frame, ``file:line in function``; when that
    frame is inside torch, ``caller`` is the innermost frame outside it (the
    model's or autopar's line that called into torch), else empty.
    """

    def __init__(self, rank: int, error: str, where: str, caller: str = "", traceback: str = "") -> None:
        self.rank, self.error, self.where, self.caller, self.traceback = rank, error, where, caller, traceback
        super().__init__(str(self))

    def __str__(self) -> str:
        via = f", called from {self.caller}" if self.caller else ""
        return f"rank {self.rank} failed: {self.error}" + (f" (at {self.where}{via})" if self.where else "")

    def to_dict(self) -> dict[str, Any]:
        return {"rank": self.rank, "error": self.error, "where": self.where, "caller": self.caller,
                "traceback": self.traceback}


@dataclass(frozen=True)
class Comparison:
    """The worst tensor of one kind (gradients or parameters) against the reference.

    ``floor`` is the per-element scale FLOOR × rms; ``floored`` names the
    tensors whose ‖ref‖ was below FLOOR × rms × √numel and so were judged
    against the floor, smallest (most likely all rounding noise) first.
    """

    rel: float
    worst: str
    floor: float
    floored: list[str] = field(default_factory=list)


@dataclass(frozen=True)
class VerifyReport:
    """Largest relative differences of a W-rank run from one process, and the losses."""

    world_size: int
    steps: int
    global_batch: int
    losses: list[float]
    ref_losses: list[float]
    loss_rel: float  # max over steps
    grads: Comparison  # first step
    params: Comparison  # after the last step
    float64: bool = False  # both sides run in float64 (autopar.tools.rounding)
    fp32_ref_rel: float | None = None  # float64 runs: one process's own fp32 run from float64's

    @property
    def max_rel(self) -> float:
        return max(self.loss_rel, self.grads.rel, self.params.rel)

    def ok(self, tolerance: float = TOLERANCE) -> bool:
        return self.max_rel <= tolerance

    def to_dict(self) -> dict[str, Any]:
        return {**asdict(self), "max_rel": self.max_rel}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> VerifyReport:
        d = {k: v for k, v in d.items() if k != "max_rel"}
        return cls(**{**d, "grads": Comparison(**d["grads"]), "params": Comparison(**d["params"])})


# ------------------------------------------------------------------ the model under test


def _dropout_attrs(obj: Any) -> list[str]:
    """Float attributes of ``obj`` named like a dropout probability and above 0."""
    return [k for k, v in vars(obj).items()
            if "drop" in k.lower() and isinstance(v, float) and v > 0]


def disable_dropout(model: nn.Module) -> list[str]:
    """Set every dropout probability in ``model`` to 0; return what was changed, one entry each.

    Covers ``nn.Dropout`` and its kin (``p``), float attributes named like a
    dropout (``dropout``, ``attention_dropout``, ``layerdrop``…) that a
    forward passes to ``F.dropout`` or to attention's ``dropout_p``, and the
    same attributes on each module's ``config`` (Hugging Face forwards read
    some from there).
    """
    changed: list[str] = []
    configs: dict[int, tuple[str, Any]] = {}
    for name, module in model.named_modules():
        where = name or type(model).__name__
        if isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
            changed.append(f"{where} ({type(module).__name__} p={module.p:g})")
            module.p = 0.0
        for attr in _dropout_attrs(module):
            changed.append(f"{where}.{attr}={getattr(module, attr):g}")
            setattr(module, attr, 0.0)
        config = vars(module).get("config")
        if config is not None and hasattr(config, "__dict__") and id(config) not in configs:
            configs[id(config)] = (f"{where}.config" if name else "config", config)
    for where, config in configs.values():
        for attr in _dropout_attrs(config):
            changed.append(f"{where}.{attr}={getattr(config, attr):g}")
            setattr(config, attr, 0.0)
    return changed


def forward_is_random(model: nn.Module, example_inputs: Any) -> bool:
    """Whether two training-mode forwards of the same batch under different seeds differ.

    Run after :func:`disable_dropout`: anything still random (a sampling
    layer, stochastic depth under another name) makes one process and W
    ranks disagree whatever the plan. Running statistics (BatchNorm's) are
    put back afterwards.
    """
    from autopar.runtime.loss import prediction

    x, _ = synthetic_batch(model, example_inputs, example_batch(example_inputs), SEED)
    saved = {k: b.clone() for k, b in model.named_buffers()}
    outputs = []
    try:
        with torch.no_grad():
            for seed in (SEED + 101, SEED + 102):
                torch.manual_seed(seed)
                try:
                    out = call(model, x)
                except Exception as exc:  # noqa: BLE001 - the model's own failure, on one process
                    raise AutoparError(f"the model's forward failed on a synthetic batch shaped like the "
                                       f"example inputs ({describe(x)}): {type(exc).__name__}: {exc}") from exc
                outputs.append(prediction(out))
    finally:
        with torch.no_grad():
            for k, b in model.named_buffers():
                b.copy_(saved[k])
    return _rel(outputs[0], outputs[1], 0.0) > 1e-4


RANDOM_FORWARD = ("the model's forward is still random with dropout off (two seeds gave different outputs), "
                  "so one process and the ranks cannot agree whatever the plan: make it deterministic "
                  "to verify it")


def example_batch(example_inputs: Any) -> int:
    """The example inputs' batch (dim 0 of the first tensor): verify's default global batch."""
    tensors = [t for _, t in model_tensors(example_inputs)]
    first = next(iter(tensors), None)
    if first is None or first.dim() == 0:
        raise AutoparError("verify needs example inputs with a batch dimension; the first input is "
                           f"{'not a tensor' if first is None else 'a 0-d tensor'}")
    return int(first.shape[0])


# ------------------------------------------------------------------ the comparison


def _rel(a: torch.Tensor, b: torch.Tensor, floor_norm: float) -> float:
    """‖a − b‖ / max(‖b‖, floor_norm); with both zero, ‖a − b‖ itself."""
    a, b = a.detach().double().cpu(), b.detach().double().cpu()
    d = max(b.norm().item(), floor_norm)
    return (a - b).norm().item() / (d if d > 0 else 1.0)


def rms(tensors: dict[str, torch.Tensor]) -> float:
    """Root mean square over every element of every tensor: the model's scale for one kind."""
    total = sum(t.detach().double().pow(2).sum().item() for t in tensors.values())
    count = sum(t.numel() for t in tensors.values())
    return math.sqrt(total / count) if count else 0.0


def compare(got: dict[str, torch.Tensor], ref: dict[str, torch.Tensor],
            floor: float = FLOOR) -> Comparison:
    """The worst ‖Δ‖ / max(‖ref‖, floor × rms(ref) × √numel) over ``ref``'s tensors."""
    missing = sorted(set(ref) - set(got))
    if missing:
        raise AutoparError(f"the parallel run has no values for {missing[:3]}")
    scale = floor * rms(ref)
    worst, floored = (0.0, ""), []
    for name, r in ref.items():
        floor_norm = scale * math.sqrt(r.numel())
        own = r.detach().double().norm().item()
        if own < floor_norm:
            floored.append((own / floor_norm, name))
        worst = max(worst, (_rel(got[name], r, floor_norm), name))
    return Comparison(worst[0], worst[1], scale, [name for _, name in sorted(floored)])


# ------------------------------------------------------------------ the plan that ran


def plan_warnings(plan: Plan, model: nn.Module | None = None) -> list[str]:
    """What about the plan makes its run say less than it seems to (printed before the result)."""
    f8 = plan.training.float8
    if f8 is not None:
        return [f"float8 ({f8.recipe.value}): one process runs the same {len(f8.linears)} linears in float8 "
                f"(torchao's emulation on both sides); "
                + ("rowwise scales are powers of 2, so the two must round alike" if f8.recipe.value == "rowwise"
                   else f"each rank's tensorwise scale is its own batch half's amax, so the two round "
                        f"differently: judged within {FLOAT8_TENSORWISE_TOLERANCE:g}")]
    if plan.mesh.tp > 1 and not any(l.choice.tp for l in plan.layers):
        return [f"the mesh has tp={plan.mesh.tp} but no layer is tensor-parallel: the {plan.mesh.tp} "
                "ranks of each tp group repeat the same work, so this run checks no tensor "
                "parallelism; pin a style ('GLOB:tp=megatron') or see `autopar plan`'s layer table "
                "for the layers that admit one"]
    return []


def _listed(names: list[str], shown: int = 3) -> str:
    more = f", … (+{len(names) - shown} more)" if len(names) > shown else ""
    return ", ".join(names[:shown]) + more


def setup_lines(plan: Plan, dropout: list[str], warnings: list[str], loss: str = "", graph: Any = None) -> list[str]:
    """What ``verify`` is about to run, printed before it starts: the plan, its layers, dropout, and
    the splits the one-process reference runs where the plan splits batch-coupled layers."""
    from autopar.tools.reference import reference_groups

    lines = [plan.summary(), "",
             f"plan: mesh {plan.mesh.describe()}, {plan.microbatches} microbatches, global batch "
             f"{plan.training.global_batch}, zero {sorted({l.choice.zero for l in plan.layers})}, "
             f"{sum(bool(l.choice.recompute) for l in plan.layers)} layers recomputed, priced on {plan.cluster.name}"]
    if dropout:
        lines += wrap_line(f"dropout: off on both sides (no parallel plan reproduces one process's masks); "
                           f"{len(dropout)} set to 0: {_listed(dropout)}", 2)
    else:
        lines.append("dropout: none in the model")
    if loss:
        lines.append(loss)
    cut = reference_groups(plan, graph) if graph is not None else None
    if cut is not None:
        size = plan.training.global_batch // len(cut)
        lines.append(f"one process: each step as the same {len(cut)} splits of {size} samples its batch-coupled "
                     f"layers see here (batch_coupled={plan.training.batch_coupled.value}), gradients averaged "
                     "over them")
    return lines + [f"warning: {w}" for w in warnings]


def result_lines(report: VerifyReport, tolerance: float = TOLERANCE) -> list[str]:
    """The comparison, as ``verify`` prints it after the run."""
    g, p = report.grads, report.params
    lines = [f"step {k}: loss {a:.8g}  (one process {b:.8g})"
             for k, (a, b) in enumerate(zip(report.losses, report.ref_losses), 1)]
    lines += wrap_line(f"max relative difference: loss {report.loss_rel:.3g}, first-step gradients "
                       f"{g.rel:.3g} ({g.worst}), parameters after {report.steps} steps {p.rel:.3g} ({p.worst})", 2)
    judged = [f"{len(c.floored)} {what} ({_listed(c.floored, 2)})"
              for what, c in (("gradients", g), ("parameters", p)) if c.floored]
    lines += wrap_line(f"near-zero floor: ‖ref‖ counts as at least {FLOOR:g} × rms × √numel (gradients rms "
                       f"{g.floor / FLOOR:.3g}, parameters rms {p.floor / FLOOR:.3g}); judged against it: "
                       + ("; ".join(judged) if judged else "none"), 2)
    ok = report.ok(tolerance)
    same = "SAME as one process" if tolerance <= TOLERANCE else "within float8 tensorwise's rounding of one process"
    lines.append(f"OK: {same}, {report.max_rel:.3g} <= {tolerance:g}" if ok
                 else f"DIFFERENT from one process: {report.max_rel:.3g} > {tolerance:g}")
    return lines


def result_json(plan: Plan, dropout: list[str], warnings: list[str], report: VerifyReport | None = None,
                failure: VerifyFailure | None = None, tolerance: float = TOLERANCE,
                loss: str = "", float64: VerifyReport | None = None) -> dict[str, Any]:
    """``verify --json``: ``result`` is SAME, SAME_IN_FLOAT64 (fp32 missed the bar, the float64 re-run
    ``float64`` met :data:`autopar.tools.rounding.FLOAT64_TOLERANCE`), DIFFERENT or FAILED (a rank
    crashed or timed out)."""
    from autopar.tools.rounding import verdict

    out: dict[str, Any] = {"tolerance": tolerance, "floor": FLOOR, "dropout_disabled": dropout,
                           "loss": loss.removeprefix("loss: "),
                           "warnings": warnings, "plan": plan.to_dict()}
    if report is not None:
        out |= {"result": verdict(report, float64, tolerance), "report": report.to_dict()}
        if float64 is not None:
            out["float64_report"] = float64.to_dict()
    else:
        error = failure.to_dict() if isinstance(failure, RankFailedError) else {"error": str(failure)}
        out |= {"result": "FAILED", "failure": error}
    return out


# ------------------------------------------------------------------ the processes


def _build(spec: str, seq_len: int | None) -> tuple[nn.Module, tuple]:
    """The model for real, seeded, dropout off (each process builds the same one)."""
    from autopar.tools.spec import load_spec

    torch.manual_seed(SEED)
    model, inputs = load_spec(spec, seq_len=seq_len, device="cpu")
    disable_dropout(model)
    return model, inputs


def _sgd(params: Any) -> torch.optim.Optimizer:
    return torch.optim.SGD(params, lr=LR, momentum=MOMENTUM)


def _reference(spec: str, seq_len: int | None, batches: list, steps: int, loss_fn: Any,
               plan: Plan | None = None, graph: Any = None, float64: bool = False) -> dict[str, Any]:
    """One process trained on the same batches (:func:`autopar.tools.reference.train_reference`)."""
    from autopar.tools.reference import train_reference
    from autopar.tools.rounding import model_to_float64

    torch.set_default_dtype(torch.float32)  # built as the ranks built it, then cast
    model, _ = _build(spec, seq_len)
    if float64:
        model = model_to_float64(model)
    if plan is not None and plan.training.float8 is not None:  # the same linears in float8, emulated
        from autopar.runtime.float8 import convert

        convert(model, plan.training.float8, emulate=True)
    return train_reference(model, batches[:steps], loss_fn, _sgd(model.parameters()), plan, graph)


def _frame(f: traceback.FrameSummary) -> str:
    return f"{f.filename}:{f.lineno} in {f.name}"


def _failure(rank: int, exc: BaseException) -> dict[str, Any]:
    """What the parent reports for ``exc`` raised on ``rank`` (see :class:`RankFailedError`)."""
    frames = traceback.extract_tb(exc.__traceback__)
    torch_dir = str(Path(torch.__file__).resolve().parent)
    inner = frames[-1] if frames else None
    outside = next((f for f in reversed(frames) if not str(Path(f.filename).resolve()).startswith(torch_dir)),
                   None)
    caller = _frame(outside) if inner is not None and outside is not None and outside is not inner else ""
    text = " ".join(str(exc).split())
    return {"rank": rank, "error": f"{type(exc).__name__}: {text}" if text else type(exc).__name__,
            "where": _frame(inner) if inner is not None else "?", "caller": caller,
            "traceback": "".join(traceback.format_exception(exc)), "time": time.time(),
            "secondary": _is_secondary(exc)}


def _is_secondary(exc: BaseException) -> bool:
    """A collective that failed because another rank went away: not the cause of the failure."""
    text = str(exc)
    return (type(exc).__name__ in ("DistBackendError", "DistNetworkError", "DistStoreError")
            or any(s in text for s in ("Connection closed by peer", "Connection reset by peer",
                                       "Broken pipe", "Socket Timeout")))


def _worker(rank: int, world_size: int, tmp: str, spec: str, seq_len: int | None,
            plan_json: str, graph: dict, steps: int, loss: str | None = None, float64: bool = False) -> None:
    """One rank of a verify run. Its results are on disk once :func:`_run_rank` returns, so the
    process leaves with ``os._exit(0)``: an interpreter teardown can still abort in gloo's C++
    threads ("terminate called without an active exception", seen once in a loaded full-suite
    run), which would turn a finished run into a dead rank."""
    from autopar.quiet import silence_if_asked

    silence_if_asked()
    try:
        _run_rank(rank, world_size, tmp, spec, seq_len, plan_json, graph, steps, loss, float64)
    except BaseException as exc:
        Path(tmp, f"error-{rank}.json").write_text(json.dumps(_failure(rank, exc)))
        raise
    leave()


def leave() -> NoReturn:
    """Exit this rank at once (``os._exit``), first releasing the named semaphores it made.

    ``os._exit`` skips the interpreter's exit hooks, among them multiprocessing's, whose finalizers
    unlink the semaphores this process made and tell the parent's resource tracker so; skipped, the
    tracker unlinks them itself when the parent exits and warns "resource_tracker: There appear to be
    2 leaked semaphore objects" (tqdm's lock, which torch.fx's interpreter takes under ``--compile``).
    Those finalizers alone run here (multiprocessing has no public name for them): pure Python, none
    of gloo's teardown, and no join of child processes."""
    import multiprocessing.util

    multiprocessing.util._run_finalizers(0)  # exit priority >= 0: a SemLock's unlink is 0
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def loss_function(loss: str | None) -> Any:
    """The loss both sides train with: ``--loss FILE.py:FUNCTION`` (or ``MODULE:FUNCTION``), else the default."""
    from autopar.runtime.loss import default_loss
    from autopar.tools.spec import load_function

    return default_loss if loss is None else load_function(loss)


def _run_rank(rank: int, world_size: int, tmp: str, spec: str, seq_len: int | None,
              plan_json: str, graph: dict, steps: int, loss: str | None = None, float64: bool = False) -> None:
    import torch.distributed as dist

    import autopar
    from autopar.graph import LayerGraph
    from autopar.plan import Plan
    from autopar.tools.host import threads_per_process

    torch.set_num_threads(threads_per_process(world_size))
    dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tmp, "store"), world_size),
                            rank=rank, world_size=world_size, timeout=timedelta(seconds=300))
    plan = Plan.from_json(plan_json)
    model, inputs = _build(spec, seq_len)
    probed = probe(model, inputs, wrap=False)
    batches = [synthetic_batch(model, inputs, plan.training.global_batch, SEED + 1 + k, probed)
               for k in range(steps)]
    loss_fn = loss_function(loss)
    fp32_batches = batches
    if float64:  # the same weights and batches as the fp32 run, cast (autopar.tools.rounding)
        from autopar.tools.rounding import model_to_float64, to_float64

        model, inputs, batches = model_to_float64(model), to_float64(inputs), to_float64(batches)
    pm = autopar.compile(model, example_inputs=inputs, plan=plan, graph=LayerGraph.from_dict(graph),
                         optimizer=_sgd, loss_fn=loss_fn)
    losses, grads = [], {}
    for k, (x, y) in enumerate(batches):
        losses.append(pm.train_step(pm.local_batch(x), pm.local_batch(y)))
        if k == 0:
            grads = pm.full_grads()
    params = pm.state_dict(full=True)
    dist.destroy_process_group()
    if rank == 0:
        ref = _reference(spec, seq_len, batches, steps, loss_fn, plan, LayerGraph.from_dict(graph), float64)
        own = None
        if float64:  # how far one process's own fp32 run is from float64: fp32's rounding at this model
            fp32 = _reference(spec, seq_len, fp32_batches, steps, loss_fn, plan, LayerGraph.from_dict(graph))
            own = max(compare(fp32["grads"], ref["grads"]).rel, compare(fp32["params"], ref["params"]).rel)
        report = VerifyReport(world_size, steps, plan.training.global_batch, losses, ref["losses"],
                              max(abs(a - b) / abs(b) if b else abs(a) for a, b in zip(losses, ref["losses"])),
                              compare(grads, ref["grads"]),
                              compare({k: params[k] for k in ref["params"] if k in params}, ref["params"]),
                              float64, own)
        Path(tmp, "report.json").write_text(json.dumps(report.to_dict()))
def _first_failure(tmp: str, fallback: BaseException) -> RankFailedError:
    """The failure that caused the others: the earliest that is not a peer's disconnection."""
    found = [json.loads(p.read_text()) for p in Path(tmp).glob("error-*.json")]
    if not found:  # the process died without raising: a signal, or os._exit
        rank = getattr(fallback, "error_index", -1)
        signal = getattr(fallback, "signal_name", None)
        hint = " (SIGKILL: killed for memory?)" if signal == "SIGKILL" else ""
        return RankFailedError(rank, " ".join(str(fallback).split()) + hint, "")
    first = min(found, key=lambda f: (f["secondary"], f["time"]))
    return RankFailedError(first["rank"], first["error"], first["where"], first["caller"], first["traceback"])


def verify(spec: str, plan_json: str, graph: dict, *, steps: int = 3, seq_len: int | None = None,
           timeout_s: float = 900.0, loss: str | None = None, float64: bool = False) -> VerifyReport:
    """Spawn ``plan.world_size`` gloo processes running the plan; return rank 0's comparison
    (``float64``: both sides in float64, :mod:`autopar.tools.rounding`).

    Raises :class:`RankFailedError` when a rank raises (or dies), and
    :class:`VerifyFailure` when the run outlasts ``timeout_s``.
    """
    import torch.multiprocessing as mp

    from autopar.plan import Plan

    world_size = Plan.from_json(plan_json).world_size
    with tempfile.TemporaryDirectory(prefix="autopar-verify-") as tmp:
        ctx = mp.start_processes(_worker, args=(world_size, tmp, spec, seq_len, plan_json, graph, steps, loss,
                                                        float64),
                                 nprocs=world_size, join=False, start_method="spawn")
        deadline = time.monotonic() + timeout_s
        try:
            # after a failure the others get a grace period to land their own errors
            while not ctx.join(timeout=1.0, grace_period=3.0):
                if time.monotonic() > deadline:
                    raise VerifyFailure(f"verify did not finish in {timeout_s:.0f} s")
        except (mp.ProcessRaisedException, mp.ProcessExitedException) as exc:
            raise _first_failure(tmp, exc) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.terminate()
        return VerifyReport.from_dict(json.loads(Path(tmp, "report.json").read_text()))
