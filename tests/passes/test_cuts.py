"""Every cut the planner offers is one the runtime carries (issue 23 item 1).

In-process: at every cut capture offers, the stage modules chained reproduce
the model's output exactly, on models the project did not write (HF Qwen2 and
tied Llama, an LSTM LM) and on a model whose boundary is a dict holding a
dataclass, ``None``, a Python int and a non-contiguous tensor. At plan time, a
cut that would leave a buffer written during the step unwritten where another
layer reads it is withdrawn, said in the plan's notes, and a stage pin needing
it fails in one line. Distributed (2 gloo ranks): those models train as one
device does (1e-5), and ``autopar.compile`` of a Qwen2 with pp=2 trains.
"""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn as nn
from cut_cases import PP2, gemma3_tied, llama_tied, lstm, qwen2, stage_pins, t5_labels
from distributed import check_equivalent, every_rank

import autopar
from autopar.capturing.boundary import describe
from autopar.errors import PinError
from autopar.passes.stage_split import split_model


def _cut_plan(graph, i: int):
    names = [l.name for l in graph]
    return autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=8,
                         pins=list(PP2) + list(stage_pins(names, names[i])))


def _chain(modules: list[nn.Module], inputs: tuple):
    h = inputs
    for mod in modules:
        h = mod(*h) if isinstance(h, tuple) else mod(h)
    return h


@dataclass
class Carried:
    h: torch.Tensor
    note: str


class DictBoundary(nn.Module):
    """Blocks hand each other a dict: a dataclass, None, an int and a transposed (strided) tensor."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([Block() for _ in range(2)])
        self.head = nn.Linear(8, 32)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        state = {"x": Carried(self.emb(ids), "start"), "mask": None, "k": 1, "t": self.emb(ids).transpose(1, 2)}
        for block in self.blocks:
            state = block(state)
        return self.head(state["x"].h + state["t"].transpose(1, 2) * state["k"])


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, state: dict) -> dict:
        h = torch.tanh(self.fc(state["x"].h))
        return {"x": Carried(h, state["x"].note), "mask": state["mask"], "k": state["k"] + 1,
                "t": (h.transpose(1, 2) + state["t"])}


def _dict_model():
    return DictBoundary(), (torch.zeros(4, 6, dtype=torch.long),)


@pytest.mark.parametrize("build", [qwen2, llama_tied, lstm, _dict_model], ids=["qwen2", "llama_tied", "lstm", "dict"])
@pytest.mark.slow
def test_every_offered_cut_chains_to_the_model(build) -> None:
    torch.manual_seed(0)
    model, inputs = build()
    inputs = (torch.randint(0, 32, inputs[0].shape),)
    graph = autopar.capture(model, inputs)
    offered = [i for i, l in enumerate(graph.layers[:-1]) if l.can_cut_after]
    assert len(offered) == len(graph) - 1  # every cut between layers is offered on these models
    ref = model(*inputs)
    ref = getattr(ref, "logits", ref)
    for i in offered:
        split = split_model(model, inputs, graph, _cut_plan(graph, i))
        out = _chain(split.modules, inputs)
        assert torch.equal(getattr(out, "logits", out), ref), graph.layers[i].name


@pytest.mark.slow
def test_a_tied_weight_is_held_under_the_models_first_name_on_both_ends() -> None:
    torch.manual_seed(0)
    model, inputs = gemma3_tied()
    graph = autopar.capture(model, inputs)
    split = split_model(model, inputs, graph, _cut_plan(graph, 0))
    ends = [[n for n, _ in m.named_parameters() if n in ("model.embed_tokens.weight", "lm_head.weight")]
            for m in split.modules]
    assert ends == [["model.embed_tokens.weight"], ["model.embed_tokens.weight"]]


def test_values_without_a_tensor_form_are_named() -> None:
    assert describe((torch.ones(1), {"a": None, "n": 2})) == ""
    assert describe((torch.ones(1), object())) == "tuple holding a object"


class Planted(nn.Module):
    """A buffer (left uninitialised) written during the step after the embedding, read by block 1."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(32, 8)
        self.blocks = nn.ModuleList([nn.Linear(8, 8) for _ in range(2)])
        self.head = nn.Linear(8, 32)
        self.register_buffer("scale", torch.empty(8), persistent=False)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        h = self.blocks[0](self.emb(ids))
        self.scale.copy_(h.detach().mean(dim=(0, 1)))
        h = self.blocks[1](h) * self.scale
        return self.head(h)


def test_a_buffer_written_across_a_cut_is_caught_at_plan_time() -> None:
    model, inputs = Planted(), (torch.zeros(4, 6, dtype=torch.long),)
    graph = autopar.capture(model, inputs)
    names = [l.name for l in graph]
    writer = next(l for l in graph if "scale" in l.cut_blocked_by)
    assert not writer.can_cut_after and "buffer scale" in writer.cut_blocked_by
    plan = autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=8, pins=list(PP2))
    assert any("buffer scale" in n for n in plan.notes)
    pins = list(PP2) + list(stage_pins(names, writer.name))
    with pytest.raises(PinError, match="buffer scale, written by .* during the step"):
        autopar.solve(graph, 2, cluster="cpu", dtype="fp32", global_batch=8, pins=pins)


W2 = ["qwen2_rotary_cut", "llama_tied_embedding_cut", "gemma3_tied_embedding_cut", "lstm_cut_after_emb",
      "lstm_cut_after_lstm"]


@pytest.fixture(scope="module")
def w2(ranks) -> dict[str, dict]:
    return ranks(2).run([*W2, "qwen2_compile_trains", "meta_qwen2_pipeline", "meta_buffer_refused"],
                        module="cut_cases")


@pytest.mark.distributed
@pytest.mark.parametrize("case", W2)
def test_models_cut_where_they_need_match_one_device(w2: dict, case: str) -> None:
    check_equivalent(w2[case])


@pytest.mark.distributed
def test_compile_of_qwen2_with_pp2_trains(w2: dict) -> None:
    m = w2["qwen2_compile_trains"]
    # the schedule is searched (a V or interleaved one has 2 stages a rank): one cut between each two stages
    assert m["pp"] == 2 and m["stages"] >= 2 and len(m["cut_after"]) == m["stages"] - 1, m
    assert all(l == l for l in m["losses"]) and m["losses"][-1] < m["losses"][0]


@pytest.mark.distributed
def test_a_meta_built_qwen2_gets_its_real_rotary_tables_on_every_stage(w2: dict) -> None:
    ranks = every_rank(w2["meta_qwen2_pipeline"])
    assert sum(r["inv_freq_held"] for r in ranks) >= 1  # the stage holding the rotary embedding
    for r in ranks:
        assert r["inv_freq_equal"]  # computed as the model's own __init__ does, not torch.empty
        assert all(l == l for l in r["losses"]) and r["losses"][-1] < r["losses"][0]


@pytest.mark.distributed
def test_a_buffer_nothing_can_set_is_refused_on_every_rank(w2: dict) -> None:
    for r in every_rank(w2["meta_buffer_refused"]):
        assert r["raised"] == "LoweringError" and "buffer gain" in r["message"]


@pytest.mark.distributed
def test_inputs_read_only_past_the_cut_arrive_with_their_real_values(ranks) -> None:
    """Qwen3 computing its own loss from its labels on the second stage, integer position ids read only
    past the cut, and T5 (its shared embedding on both stages, the encoder's output crossing to the
    decoder) train as one device does (the labels once read uninitialised memory there)."""
    cases = ["qwen3_labels_cut", "late_positions_cut", "t5_shared_embedding_pp2"]
    results = ranks(2).run(cases, module="cut_cases")
    for case in cases:
        check_equivalent(results[case])


@pytest.mark.parametrize("pp", [2, 3])
@pytest.mark.slow
def test_t5s_shared_embedding_keeps_its_readers_on_the_first_and_last_stage(pp: int) -> None:
    """T5 reads one embedding in its encoder, its decoder and its head: cuts are offered (pp=2 was
    refused), and every plan puts each reader on the first or the last stage, the only two that
    hold a tied weight; the cuts withdrawn for it say why."""
    model, inputs = t5_labels()
    graph = autopar.capture(model, inputs)
    readers = ["encoder.embed_tokens", "decoder.embed_tokens", "lm_head"]
    assert [l.name for l in graph if l.can_cut_after]
    blocked = [l.cut_blocked_by for l in graph if "shared.weight is tied" in l.cut_blocked_by]
    assert blocked and "first or the last stage" in blocked[0]
    plan = autopar.solve(graph, pp, cluster="cpu", dtype="fp32", global_batch=8,
                         pins=[f"pp={pp}", "dp=1", "tp=1", "zero=0", "recompute=none", "microbatches=2",
                               "schedule=1f1b" if pp == 2 else "schedule=gpipe"])
    stage = {lp.name: lp.stage for lp in plan.layers}
    assert plan.stages == pp and {stage[r] for r in readers} <= {0, pp - 1}
