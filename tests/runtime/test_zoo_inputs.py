"""Models beyond "one token tensor in, logits out" train the numbers one device trains under dp.

T5 fed keyword inputs (``input_ids``, ``decoder_input_ids``), Qwen3 fed a
padding mask and its labels (its own ``.loss``), a ResNet with BatchNorm and
an MLP-Mixer classifying images, an LSTM language model returning
``(logits, hidden)`` and Mamba, each built as its upstream writes it
(tests/zoo.py ``BEYOND``), under ZeRO-3 and replicated data parallelism on 2
ranks: first-step loss and gradients, and parameters (BatchNorm's running
statistics included) after 3 SGD steps within 1e-5 of one device; and Qwen3's
keyword inputs (ids and padding mask) into the first stage of a 2-stage pipeline, and (with
its labels) under tensor parallelism on its blocks. Models with 0-d parameters, which FSDP2
cannot shard (Hugging Face's CLIP and its ``logit_scale``; an MLP of ReZero-gated blocks with a
learned temperature), at ZeRO-3, at ZeRO-2 over two microbatches and inside pipeline stages;
CLIP's keyword inputs into interleaved pipeline stages, where one rank holds the first stage and a
later one. A language model on PyTorch's own ``nn.TransformerEncoder`` under ZeRO-3, Megatron tensor
parallelism on its layers, and at pp=2 cut after each layer capture offers.
"""

from __future__ import annotations

import pytest
from distributed import EXACT, check_equivalent, every_rank
from zoo import BEYOND

pytestmark = pytest.mark.distributed

CASES = ([f"zoo_cases:{m}/zero3" for m in BEYOND] + ["zoo_cases:resnet_bn/dp2", "zoo_cases:hf_qwen3_padded/dp2"]
         + ["zoo_cases:hf_qwen3_mask/pp2", "zoo_cases:hf_qwen3_padded/tp"]
         + ["zoo_cases:scalar_gated/zero2mb2", "zoo_cases:hf_clip/zero3", "zoo_cases:hf_clip/pp2interleaved"]
         + ["zoo_cases:torch_lm/tp"])


def test_keyword_inputs_own_losses_classifiers_batchnorm_lstm_and_mamba_match_one_device_under_dp(ranks) -> None:
    results = ranks(2).run(CASES)
    for case in CASES:
        check_equivalent(results[case])
    for case, prefix in (("hf_qwen3_padded/tp", "model.layers."), ("torch_lm/tp", "encoder.layers.")):
        blocks = [tp for name, tp, *_ in results[f"zoo_cases:{case}"]["layers"] if name.startswith(prefix)]
        assert blocks and set(blocks) == {"megatron"}, case


def test_torch_transformer_encoder_lm_at_every_pipeline_cut_matches_one_device(ranks) -> None:
    """PyTorch's nn.TransformerEncoder LM at pp=2, cut after each layer capture offers a cut after."""
    (metrics,) = ranks(2).run(["cut_matrix_cases:torch_lm"]).values()
    cuts = every_rank(metrics)[0]["cuts"]
    assert {"encoder.layers.0", "encoder.layers.1"} <= set(cuts), cuts
    assert all(isinstance(v, float) and v < EXACT for v in cuts.values()), cuts


def test_scalar_parameters_inside_pipeline_stages_at_zero3_match_one_device(ranks) -> None:
    """0-d parameters in each stage stay whole beside its FSDP2 units, their gradients the mean over dp."""
    (metrics,) = ranks(4).run(["zoo_cases:scalar_gated/pp2dp2"]).values()
    assert metrics["stages"] == [0, 0, 1, 1]
    check_equivalent(metrics)


def test_batchnorm_inside_pipeline_stages_under_dp_matches_one_device(ranks) -> None:
    """pp=2 × dp=2 with one microbatch: the stages' BatchNorms normalise over the dp group's batch, and
    the pipeline's first-step metadata inference (one more forward) leaves running statistics alone."""
    (metrics,) = ranks(4).run(["zoo_cases:resnet_bn/pp2dp2"]).values()
    assert metrics["mesh"] == [2, 2, 1]
    check_equivalent(metrics)
