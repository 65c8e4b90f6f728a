"""What a model needs, found from its config and checked against its forward: the logit
transform per config field, the refusal past the probe's limit, fused MoE experts and Linear
subclasses that bitsandbytes leaves unquantized."""

from __future__ import annotations

import pytest
import torch

from lora_ppo.errors import RecipeError
from lora_ppo.logprobs import LogitTransform
from lora_ppo.model_checks import (LOGIT_PATH_TOLERANCE, check_logit_path, logit_path_error, logit_transform_of,
                                   probe_ids)
from tests.architectures import COHERE_LOGIT_SCALE, GEMMA_SOFTCAP, GRANITE_LOGITS_SCALING, configs


@pytest.mark.parametrize("name, expected", [
    ("llama", LogitTransform()),
    ("gpt2", LogitTransform()),
    ("gemma2", LogitTransform(softcap=GEMMA_SOFTCAP)),
    ("gemma3", LogitTransform(softcap=GEMMA_SOFTCAP)),
    ("granite", LogitTransform(scale=1 / GRANITE_LOGITS_SCALING)),
    ("cohere", LogitTransform(scale=COHERE_LOGIT_SCALE)),
])
def test_the_transform_each_config_asks_for(name, expected):
    assert logit_transform_of(configs(320)[name]) == expected


def test_a_gemma3_multimodal_config_is_read_through_its_text_config():
    from transformers import Gemma3Config

    config = Gemma3Config(text_config={**configs(320)["gemma3"].to_dict(), "final_logit_softcapping": 7.0})
    assert logit_transform_of(config) == LogitTransform(softcap=7.0)


def test_the_probe_error_is_the_largest_log_softmax_difference():
    ids = probe_ids(50, torch.device("cpu"))
    assert ids.shape == (1, 16) and int(ids.max()) < 50 and len(set(ids[0].tolist())) > 8
    logits = torch.randn(1, 16, 50, generator=torch.Generator().manual_seed(0))
    shifted = logits + 3.0  # the same distribution
    assert logit_path_error(lambda x: logits, lambda x: shifted, ids) < 1e-5
    scaled = logits * 2
    by_hand = (torch.log_softmax(logits, -1) - torch.log_softmax(scaled, -1)).abs().max().item()
    assert logit_path_error(lambda x: logits, lambda x: scaled, ids) == pytest.approx(by_hand, rel=1e-6)


def test_the_refusal_names_the_model_type_and_the_numbers():
    limit = LOGIT_PATH_TOLERANCE[torch.float32]
    check_logit_path(limit, LogitTransform(), torch.float32, "llama")  # at the limit: fine
    check_logit_path(0.2, LogitTransform(), torch.bfloat16, "llama")  # bf16's own rounding: fine
    with pytest.raises(RecipeError) as raised:
        check_logit_path(2.5, LogitTransform(softcap=30.0), torch.float32, "gemma2")
    message = str(raised.value)
    assert message.startswith("model.name: a gemma2 model's logits do not match lora_ppo's logit path")
    assert "largest logprob difference 2.5" in message and "soft-cap 30" in message and "\n" not in message


def test_unquantized_parts_of_a_4bit_load_are_found(tmp_path, caplog):
    """Qwen3-MoE's fused experts (3-D) and Falcon's FalconLinear layers stay at full precision, and
    a quantized load says so (an unquantized one has nothing to say)."""
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.model_checks import fused_expert_parameters, unconverted_linears
    from tests.architectures import build_model
    from tests.conftest import build_tiny_tokenizer

    found, said = {}, {}
    for name in ("qwen3_moe", "falcon", "llama"):
        folder = tmp_path / name
        folder.mkdir()
        build_model(name, folder, len(build_tiny_tokenizer(folder)))
        caplog.clear()
        with caplog.at_level("WARNING", logger="lora_ppo.model"):
            model = load_base_model(ModelConfig(name=str(folder)))
        found[name] = (fused_expert_parameters(model), unconverted_linears(model))
        said[name] = [r.getMessage() for r in caplog.records if r.name == "lora_ppo.model"]
    assert [m.split(" (")[0] for m in said["qwen3_moe"]] == ["model.quantization 4bit leaves 4 fused MoE expert weights"]
    assert [m.split(" (")[0] for m in said["falcon"]] == ["model.quantization 4bit leaves 8 linear layers of a Linear subclass"]
    assert all("unquantized in float32: bitsandbytes converts exact nn.Linear layers only" in m
               for m in said["qwen3_moe"] + said["falcon"]) and said["llama"] == []
    caplog.clear()
    with caplog.at_level("WARNING", logger="lora_ppo.model"):
        load_base_model(ModelConfig(name=str(tmp_path / "falcon"), quantization="none"))
    assert not [r for r in caplog.records if r.name == "lora_ppo.model"]
    experts, _ = found["qwen3_moe"]
    # 2 layers x (gate_up [4, 64, 64] + down [4, 64, 32]) as the config gives them.
    assert experts == {f"model.layers.{i}.mlp.experts.{p}": n for i in range(2)
                       for p, n in (("gate_up_proj", 4 * 64 * 64), ("down_proj", 4 * 64 * 32))}
    _, falcon_linears = found["falcon"]
    assert len(falcon_linears) == 2 * 4 and all("transformer.h." in n for n in falcon_linears)
    assert found["llama"] == ({}, {})


@pytest.mark.parametrize("dtype, limit", [
    (torch.float32, 1e-3), (torch.bfloat16, 0.25), (torch.float16, 0.25),
    (torch.float64, 0.25),  # a format the table does not name gets the half-precision limit
])
def test_the_probe_limit_per_format_is_the_one_docs_models_md_gives(dtype, limit):
    """docs/models.md: within 1e-3 nats in float32, 0.25 in bf16/fp16; at the limit is fine."""
    check_logit_path(limit, LogitTransform(), dtype, "llama")
    with pytest.raises(RecipeError, match=f"limit {limit:g};"):
        check_logit_path(limit * 1.2, LogitTransform(), dtype, "llama")


def test_a_transform_that_passed_the_probe_is_said_once_with_its_error(caplog):
    with caplog.at_level("INFO", logger="lora_ppo.model_checks"):
        check_logit_path(2e-5, LogitTransform(scale=0.25, softcap=30.0), torch.float32, "granite")
        check_logit_path(0.0, LogitTransform(), torch.float32, "llama")  # nothing to say
    assert [r.getMessage() for r in caplog.records] == [
        "logit transform: x0.25, soft-cap 30 (checked against the model's forward: largest logprob difference 2e-05)"]


@pytest.mark.parametrize("transform, said", [
    (LogitTransform(), "none"), (LogitTransform(scale=2.0), "x2"), (LogitTransform(softcap=50.0), "soft-cap 50"),
    (LogitTransform(scale=1 / 8, softcap=30.0), "x0.125, soft-cap 30"),
])
def test_a_transform_is_described_by_what_it_does(transform, said):
    from lora_ppo.model_checks import describe

    assert describe(transform) == said


class PositionalDecoder(torch.nn.Module):
    """A stand-in decoder whose hidden state at a token is [its position x `scale`, its token's id x
    `scale`, `error` where positions were passed]: rows apart by construction, with a chosen
    difference between a packed row and the row alone. `crosses`: every position also adds the
    sum of the ids before it in the sequence, as attention blind to the packed rows would."""

    def __init__(self, dtype, scale=1.0, error=0.0, crosses=False):
        super().__init__()
        self.dtype_, self.scale, self.error, self.crosses = dtype, scale, error, crosses

    def forward(self, input_ids, position_ids=None, use_cache=False):
        from types import SimpleNamespace

        given = position_ids is not None
        positions = position_ids if given else torch.arange(input_ids.shape[1])[None]
        hidden = torch.stack([positions.double() * self.scale, input_ids.double() * self.scale,
                              torch.full(input_ids.shape, self.error if given else 0.0, dtype=torch.float64)], -1)
        if self.crosses:
            hidden[..., 1] += (torch.cumsum(input_ids, 1) - input_ids).double()
        return SimpleNamespace(last_hidden_state=hidden.to(self.dtype_))


def check_packing_on(decoder, vocab=50):
    from lora_ppo.model_checks import check_packing

    check_packing(decoder, vocab, torch.device("cpu"), "stand-in", "ppo.packing")


@pytest.mark.parametrize("dtype, share", [
    (torch.float32, 1e-4), (torch.bfloat16, 5e-2), (torch.float16, 5e-2),
    (torch.float64, 5e-2),  # a format the table does not name gets the half-precision share
])
def test_a_packed_row_may_differ_from_itself_alone_by_rounding_only(dtype, share):
    """The limit is `share` of the row's largest |hidden value|, counted as at least 1: at or
    within it a packed row is its row alone (rounding), past it the positions were not used."""
    ids = (torch.arange(4, 7) * 7919 % 50).double()  # the probe's second row: the tokens the check runs alone
    for scale in (0.25 / float(ids.max()), 4.0 / float(ids.max())):  # largest |hidden| 0.25 and 4.0
        limit = share * max(1.0, float((ids * scale).max()))
        for error in (0.0, 0.8 * limit):
            check_packing_on(PositionalDecoder(dtype, scale, error))
        if dtype == torch.float64:  # exactly representable: the limit itself is within
            check_packing_on(PositionalDecoder(dtype, scale, limit))
        with pytest.raises(RecipeError, match="^ppo.packing: stand-in does not count a packed row's positions from 0 "
                                              "as given; set ppo.packing: false$"):
            check_packing_on(PositionalDecoder(dtype, scale, 1.25 * limit))


def test_a_packed_row_that_sees_the_row_before_it_is_refused_first():
    with pytest.raises(RecipeError, match="^ppo.packing: stand-in's attention lets a packed row see the row before it"):
        check_packing_on(PositionalDecoder(torch.float32, crosses=True))
