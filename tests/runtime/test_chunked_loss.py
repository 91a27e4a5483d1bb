"""The chunked loss in one process: the same numbers as the default loss on the whole logits, its
peak memory as priced, and the head replaced only while a step runs (no process group)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from equivalence_cases import _max_rel, gpt_tiny, hf_llama, make_batch
from peak_memory import peak_bytes

import autopar
import autopar.contract_loss as contract_loss
from autopar.choice import LossKind
from autopar.cost_models.pipeline import Schedule, ScheduleKind
from autopar.errors import LossError
from autopar.inputs import call
from autopar.mesh import Mesh
from autopar.planning.configuration import Configuration, TrainingSpec
from autopar.planning.pricing import PriceTable
from autopar.runtime import default_loss
from autopar.runtime.chunked_loss import chunked_cross_entropy

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("chunk", [1, 5, 33, 1000])
def test_chunks_give_the_default_loss_and_its_gradients(bias: bool, chunk: int) -> None:
    g = torch.Generator().manual_seed(0)
    h = torch.randn(3, 11, 16, generator=g, requires_grad=True)
    w = torch.randn(50, 16, generator=g, requires_grad=True)
    b = torch.randn(50, generator=g, requires_grad=True) if bias else None
    y = torch.randint(0, 50, (3, 11), generator=g)
    y[0, :4] = -100  # ignored, as F.cross_entropy's default ignore_index
    leaves = [h, w] + ([b] if bias else [])
    ref = F.cross_entropy(F.linear(h, w, b).reshape(-1, 50), y.reshape(-1))
    got = chunked_cross_entropy(h, w, b, y, chunk)
    assert abs(got.item() - ref.item()) <= 1e-6 * abs(ref.item())
    for a, r in zip(torch.autograd.grad(got, leaves), torch.autograd.grad(ref, leaves)):
        assert (a - r).norm() <= 1e-5 * r.norm()


def _one_process(build, chunk_tokens: int, vocab: int, monkeypatch) -> dict:
    """Train a chunked plan 3 SGD steps in this process beside the model with the default loss."""
    torch.manual_seed(0)
    model, inputs = build()
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", pins=["microbatches=1", "loss=chunked"],
                         global_batch=4)
    ref_model, _ = build()
    ref_model.load_state_dict(model.state_dict())
    keys = sorted(model.state_dict())
    monkeypatch.setattr(contract_loss, "CHUNK_LOGITS_BYTES", 4 * vocab * chunk_tokens)
    sgd = dict(lr=0.05, momentum=0.9)
    pm = autopar.compile(model, 1, plan=plan, graph=graph, optimizer=lambda p: torch.optim.SGD(p, **sgd))
    opt = torch.optim.SGD(ref_model.parameters(), **sgd)
    out: dict = {"plan": plan, "loss_rel": 0.0}
    for k in range(3):
        x, y = make_batch(inputs, model, 4, seed=1 + k)
        y[1, :5] = -100
        loss = pm.train_step(x, y)
        opt.zero_grad()
        ref = default_loss(call(ref_model, x), y)
        ref.backward()
        if k == 0:
            out["grad_rel"] = _max_rel(pm.full_grads(), {n: p.grad for n, p in ref_model.named_parameters()})[0]
        opt.step()
        out["loss_rel"] = max(out["loss_rel"], abs(loss - ref.item()) / abs(ref.item()))
    state = pm.state_dict()
    out["param_rel"] = _max_rel(state, dict(ref_model.named_parameters()))[0]
    out["same_keys"] = sorted(state) == keys
    out["outside_a_step"] = call(pm.module, x)
    return out


@pytest.mark.parametrize("build,vocab", [(gpt_tiny, 256), (hf_llama, 128)], ids=["gpt", "hf_llama"])
@pytest.mark.slow
def test_a_chunked_plan_trains_as_the_default_loss(build, vocab: int, monkeypatch) -> None:
    out = _one_process(build, 7, vocab, monkeypatch)
    assert out["plan"].training.loss is LossKind.CHUNKED
    assert out["loss_rel"] < 1e-5 and out["grad_rel"] < 1e-5 and out["param_rel"] < 1e-5
    assert out["same_keys"]  # the head's weight still there, under its own name
    logits = autopar.inputs.prediction(out["outside_a_step"])
    assert logits.shape[-1] == vocab  # outside a step the head is the head


def test_a_loss_function_with_a_chunked_plan_is_refused() -> None:
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    graph = autopar.capture(model, inputs)
    plan = autopar.solve(graph, 1, cluster="cpu", dtype="fp32", global_batch=2, pins=["loss=chunked"])
    assert plan.training.loss is LossKind.CHUNKED

    def mine(output, targets):
        return default_loss(output, targets)

    with pytest.raises(LossError, match="loss=full"):
        autopar.compile(model, 1, plan=plan, graph=graph, loss_fn=mine)
    named = autopar.compile(model, 1, plan=plan, graph=graph, loss_fn=default_loss)  # the default, by name
    assert named.chunked_loss
    x = torch.zeros(2, 16, dtype=torch.long)
    with pytest.raises(LossError, match="labels"):  # the model must not compute its own loss on the hidden state
        named.train_step({"idx": x, "labels": x}, x)
    torch.manual_seed(0)
    model, inputs = gpt_tiny()
    own = autopar.compile(model, 1, graph=graph, loss_fn=mine, dtype="fp32", global_batch=2)
    assert own.plan.training.loss is LossKind.FULL
    assert any("a loss function was given" in n for n in own.plan.notes)


@pytest.mark.slow
def test_the_measured_peak_is_the_priced_one(monkeypatch) -> None:
    """fp32 on a CPU: the chunked loss's forward and backward over one microbatch peak within 10% of
    ``PriceTable.loss_bytes``, beside the gradients it returns (of h and W: priced as the head layer's
    backward and its gradient)."""
    import gpt

    vocab, hidden, seq, batch, chunk = 8192, 64, 512, 8, 512
    monkeypatch.setattr(contract_loss, "CHUNK_LOGITS_BYTES", 4 * vocab * chunk)
    model, inputs = gpt.gpt(n_layer=1, d_model=hidden, n_head=4, vocab_size=vocab, seq_len=seq)
    graph = autopar.capture(model, inputs)
    config = Configuration(Mesh(), 1, Schedule(ScheduleKind.NONE))
    table = PriceTable(graph, config, autopar.cost_models.presets.load_cluster("cpu").for_world_size(1),
                       TrainingSpec(batch, dtype="fp32", loss=LossKind.CHUNKED))
    priced, beside = table.loss_bytes
    assert table.loss is LossKind.CHUNKED and beside == 0
    assert priced == 2 * chunk * vocab * 4
    g = torch.Generator().manual_seed(0)
    h = torch.randn(batch, seq, hidden, generator=g, requires_grad=True)
    w = torch.randn(vocab, hidden, generator=g, requires_grad=True)
    y = torch.randint(0, vocab, (batch, seq), generator=g)

    def step() -> None:
        chunked_cross_entropy(h, w, None, y, chunk).backward()

    measured = peak_bytes(step) - (h.numel() + w.numel()) * 4
    assert abs(measured - priced) <= 0.1 * priced, (measured, priced)
    full = TrainingSpec(batch, dtype="fp32")  # the whole logits: three fp32 logits at the peak
    assert PriceTable(graph, config, table.cluster, full).loss_bytes[0] == 3 * batch * seq * vocab * 4
