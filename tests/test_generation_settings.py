"""What shapes sampling besides the policy: only the recipe's settings, and where responses end.

- `rollout.stop_token: eos` is the tokenizer's eos token and every end token the model's own
  generation config names, as `model.generate()` stops at them. Gemma's instruction models end a
  turn with `<end_of_turn>` while their tokenizer's eos is `<eos>`; Phi-3's with `<|end|>`: a
  response cut at the tokenizer's eos alone would run on past the end of its turn.
- Nothing else of that generation config reaches sampling: transformers fills every setting left
  unset from it (a repetition penalty, `no_repeat_ngram_size`, `min_p`), and the responses would
  then come from another distribution than the policy's, which scoring computes."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from transformers import GenerationConfig

from lora_ppo.agents.given import rollout_from_tokens
from lora_ppo.config import ModelConfig, RolloutConfig
from lora_ppo.model import load_base_model
from lora_ppo.rollout import Sampler, collect_rollout, model_end_tokens, score_passes, stop_token_ids
from lora_ppo.rewards import RewardSources
from tests.conftest import prompt_rows
from tests.reward_fns import count_letter_e

PROMPTS = ["This movie was", "The acting in this film was quite", "Honestly", "I rented the sequel on a whim and"]
SAMPLING = dict(batch_size=4, max_new_tokens=8, temperature=1.0)


class ModelWithEnds:
    """What `model_end_tokens` reads of a model: its generation config and its vocabulary's size."""

    def __init__(self, eos_token_id, vocab: int = 10):
        self.generation_config = None if eos_token_id == "none" else GenerationConfig(eos_token_id=eos_token_id)
        self.embedding = torch.nn.Embedding(vocab, 2)

    def get_input_embeddings(self):
        return self.embedding


@pytest.mark.parametrize("eos_token_id, ends", [
    (2, (2,)),
    ([2, 7], (2, 7)),
    ([7, 2, 7], (7, 2)),  # each once, in the config's order
    ([2, 10, -1], (2,)),  # ids outside the vocabulary name no token
    ([0, 2], (0, 2)),  # GPT-NeoX's end of text is token 0
    (None, ()),
    ("none", ()),  # a model without a generation config
])
def test_the_models_end_tokens_are_its_generation_configs_within_its_vocabulary(eos_token_id, ends):
    assert model_end_tokens(ModelWithEnds(eos_token_id)) == ends


def test_eos_is_the_tokenizers_eos_then_the_models_end_tokens(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    assert stop_token_ids(tiny_tokenizer, "eos", (5, eos, 7)) == (eos, 5, 7)
    assert stop_token_ids(tiny_tokenizer, "eos", ()) == (eos,)
    # A token named in the recipe is the one stop, whatever the model names; null: none.
    assert stop_token_ids(tiny_tokenizer, "<|im_start|>", (5, 7)) == (tiny_tokenizer.convert_tokens_to_ids("<|im_start|>"),)
    assert stop_token_ids(tiny_tokenizer, None, (5, 7)) == ()


def test_a_stop_token_named_as_text_is_the_one_token_it_encodes_to(tiny_tokenizer):
    """`rollout.stop_token` as the text a token stands for (" and", not its vocabulary form "Ġand"),
    also with a tokenizer that has an unknown token or puts a BOS first; text of several tokens is
    refused in one line."""
    from lora_ppo.errors import RecipeError
    from tests.conftest import bos_first, tokenizer_copy

    word = tiny_tokenizer.convert_tokens_to_ids("Ġand")
    assert tiny_tokenizer.convert_tokens_to_ids(" and") is None  # not a vocabulary entry as written
    with_unknown = tokenizer_copy(tiny_tokenizer)
    with_unknown.unk_token = "<|endoftext|>"  # an unknown entry now maps to this token's id
    for tokenizer in (tiny_tokenizer, with_unknown, bos_first(tiny_tokenizer)):
        assert stop_token_ids(tokenizer, " and") == (word,)
    with pytest.raises(RecipeError, match=r"^rollout.stop_token: ' the film' is not a single token of this tokenizer$"):
        stop_token_ids(tiny_tokenizer, " the film")


def test_the_generation_settings_are_the_recipes_and_the_stop_tokens(tiny_tokenizer):
    """What `generate()` is given: sampling with the recipe's temperature, top-k and top-p (or, with
    row seeds, greedy over the one-hot the seeded processor writes), its response budget, the pad
    token, every stop token (none: it never stops early) and the KV cache."""
    from lora_ppo.rollout import generation_config

    cfg = RolloutConfig(max_new_tokens=7, temperature=0.7, top_k=5, top_p=0.9)
    sampled = generation_config(cfg, tiny_tokenizer, (2, 5))
    assert (sampled.do_sample, sampled.temperature, sampled.top_k, sampled.top_p) == (True, 0.7, 5, 0.9)
    assert (sampled.max_new_tokens, sampled.pad_token_id, sampled.eos_token_id, sampled.use_cache) == (
        7, tiny_tokenizer.pad_token_id, [2, 5], True)
    assert generation_config(cfg, tiny_tokenizer, ()).eos_token_id is None
    seeded = generation_config(cfg, tiny_tokenizer, (2,), sample_in_processor=True)
    assert seeded.do_sample is False and seeded.temperature is None and seeded.top_k is None
    assert generation_config(cfg, tiny_tokenizer, (2,)).do_sample is True  # sampling unless told


def test_rows_of_one_prompt_without_seeds_are_sampled_not_decoded_greedily(roles, tiny_tokenizer):
    """Eight copies of one prompt, no row seeds: the rows differ (a path that fell to greedy decoding
    would give eight equal responses, and a group baseline nothing to compare)."""
    rows = prompt_rows(tiny_tokenizer, ["This movie was"] * 8)
    torch.manual_seed(0)
    samples = Sampler(roles, tiny_tokenizer, RolloutConfig(batch_size=8, max_new_tokens=6, stop_token=None)).sample(rows)
    assert len({tuple(r) for r in samples.response_ids.tolist()}) > 4


def test_a_models_saved_generation_config_names_its_end_tokens(tiny_model_dir, tmp_path):
    """Read as a run loads the model: generation_config.json beside the weights."""
    folder = tmp_path / "chat-model"
    shutil.copytree(tiny_model_dir, folder)
    (folder / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 1], "pad_token_id": 2}))
    assert model_end_tokens(load_base_model(ModelConfig(name=str(folder)))) == (2, 1)
    assert model_end_tokens(load_base_model(ModelConfig(name=str(tiny_model_dir)))) == (2,)


@pytest.fixture(scope="module")
def roles(make_roles):
    torch.manual_seed(0)  # the fresh adapters' random init: the same whichever tests ran before
    return make_roles(seed=3, perturbed=("policy",))


@pytest.fixture(scope="module")
def rows(tiny_tokenizer):
    return prompt_rows(tiny_tokenizer, PROMPTS)


@pytest.fixture(scope="module")
def unstopped(roles, tiny_tokenizer, rows):
    """What the seeded policy samples when nothing stops it."""
    torch.manual_seed(11)
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    return Sampler(roles, tiny_tokenizer, cfg).sample(rows).response_ids


def end_of_turn_token(unstopped, eos: int) -> int:
    """A token row 0 samples third (none of its first two), standing for a model's end-of-turn token."""
    token = int(unstopped[0, 2])
    assert token != eos and token not in unstopped[0, :2].tolist()
    return token


def cut_by_hand(unstopped: torch.Tensor, stops: set[int]) -> list[list[int]]:
    cut = []
    for row in unstopped.tolist():
        end = next((i + 1 for i, t in enumerate(row) if t in stops), len(row))
        cut.append(row[:end])
    return cut


# What a chat model's generation_config.json may hold besides its end tokens: each changes the
# distribution generate() samples from (no token twice, the repeated ones' logits divided by 5, ...).
SAMPLING_PREFERENCES = {"no_repeat_ngram_size": 1, "repetition_penalty": 5.0, "min_p": 0.2, "top_k": 3}


def test_a_response_ends_at_the_end_token_the_models_generation_config_names(roles, tiny_tokenizer, rows, unstopped,
                                                                            monkeypatch):
    """Every row is cut after its first eos or end-of-turn token (kept as its last real token, the
    one that carries the score), counts as stopped, escapes `missing_eos_penalty`, and the reward
    reads its text up to there; with the tokenizer's eos alone, row 0 runs past that token. The
    tokens before are the ones sampled without any end token: the model's other settings in the
    same generation config changed none of them."""
    eos = tiny_tokenizer.eos_token_id
    end = end_of_turn_token(unstopped, eos)
    cfg = RolloutConfig(**SAMPLING, missing_eos_penalty=1.0)
    torch.manual_seed(11)
    only_eos = Sampler(roles, tiny_tokenizer, cfg).sample(rows)
    assert int(only_eos.response_mask[0].sum()) > 3

    chat = GenerationConfig(eos_token_id=[eos, end], pad_token_id=eos, **SAMPLING_PREFERENCES)
    monkeypatch.setattr(roles.peft.get_base_model(), "generation_config", chat)
    sampler = Sampler(roles, tiny_tokenizer, cfg)
    assert sampler.stop_ids == (eos, end)
    torch.manual_seed(11)
    rollout = collect_rollout(sampler, rows, RewardSources.of(count_letter_e))
    expected = cut_by_hand(unstopped, {eos, end})
    assert [ids[mask].tolist() for ids, mask in zip(rollout.response_ids, rollout.response_mask)] == expected
    assert len(expected[0]) == 3
    stopped = [row[-1] in (eos, end) for row in expected]
    assert rollout.stopped.tolist() == stopped
    assert rollout.completions == tiny_tokenizer.batch_decode(expected, skip_special_tokens=True)
    raw = torch.tensor([float(text.count("e")) for text in rollout.completions])
    assert rollout.raw_scores.tolist() == raw.tolist()
    assert rollout.scores.tolist() == (raw - 1.0 * ~torch.tensor(stopped)).tolist()


@pytest.mark.parametrize("seeded_rows", [False, True])
def test_sampling_follows_the_recipe_alone_whatever_the_models_generation_config_says(roles, tiny_tokenizer, rows,
                                                                                   monkeypatch, seeded_rows):
    """With the model's generation config asking for no repeated token, a repetition penalty, min_p
    and top-k, the recorded logprobs of the sampled tokens are the policy's as a scoring pass
    computes them (as with `rollout.logprobs_from_generation`), tokens repeat, and the responses are
    the ones sampled under a blank generation config; with row seeds (`rollout.seed_per_row`) too."""
    cfg = RolloutConfig(batch_size=4, max_new_tokens=16, temperature=0.8, stop_token=None)
    seeds = [3, 4, 5, 6] if seeded_rows else None
    base = roles.peft.get_base_model()
    monkeypatch.setattr(base, "generation_config", GenerationConfig())
    torch.manual_seed(5)
    blank = Sampler(roles, tiny_tokenizer, cfg).sample(rows, seeds=seeds)
    monkeypatch.setattr(base, "generation_config", GenerationConfig(**SAMPLING_PREFERENCES))
    torch.manual_seed(5)
    samples = Sampler(roles, tiny_tokenizer, cfg).sample(rows, record_logprobs=True, seeds=seeds)
    assert torch.equal(samples.response_ids, blank.response_ids)
    assert any(len(set(row)) < len(row) for row in samples.response_ids.tolist())
    ids = torch.cat([samples.query_ids, samples.response_ids], dim=1)
    mask = torch.cat([samples.query_mask, samples.response_mask.long()], dim=1)
    scored = score_passes(roles, ids, mask, samples.query_ids.shape[1], cfg.temperature, forward_batch_size=4,
                          with_values=False, with_reference=False)[0]
    torch.testing.assert_close(samples.logprobs, scored, atol=1e-4, rtol=0)
    assert base.generation_config.to_dict() == GenerationConfig(**SAMPLING_PREFERENCES).to_dict()  # left as it was


def test_a_given_response_ending_with_an_end_token_counts_as_stopped(roles, tiny_tokenizer, monkeypatch):
    """`PPOTrainer.step()`'s rollout from the caller's tokens: a response whose last token is any end
    token stopped; one ending elsewhere did not (and loses `missing_eos_penalty`)."""
    eos = tiny_tokenizer.eos_token_id
    monkeypatch.setattr(roles.peft.get_base_model().generation_config, "eos_token_id", [eos, 5])
    cfg = RolloutConfig(batch_size=3, max_new_tokens=4, missing_eos_penalty=0.5)
    query = tiny_tokenizer("This movie was", add_special_tokens=False)["input_ids"]
    rollout = rollout_from_tokens(Sampler(roles, tiny_tokenizer, cfg), [query] * 3,
                                  [[40, 41, 5], [40, eos], [40, 5, 41]], [1.0, 1.0, 1.0])
    assert rollout.stopped.tolist() == [True, True, False]
    assert rollout.scores.tolist() == [1.0, 1.0, 0.5]


def test_the_log_names_the_end_tokens_when_the_model_adds_any(roles, tiny_tokenizer, monkeypatch, caplog):
    import logging

    from lora_ppo.parts import log_end_tokens

    eos = tiny_tokenizer.eos_token_id
    start = tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")
    with caplog.at_level(logging.INFO, logger="lora_ppo.parts"):
        log_end_tokens(tiny_tokenizer, RolloutConfig(), roles)  # the tiny model names its eos alone
        assert not caplog.messages
        monkeypatch.setattr(roles.peft.get_base_model(), "generation_config", GenerationConfig(eos_token_id=[start]))
        log_end_tokens(tiny_tokenizer, RolloutConfig(stop_token="<|im_end|>"), roles)  # a named token: no more
        assert not caplog.messages
        log_end_tokens(tiny_tokenizer, RolloutConfig(), roles)
    assert eos != start and caplog.messages == [
        "rollout.stop_token eos: responses end at <|im_end|>, <|im_start|> (the tokenizer's eos token and the end "
        "tokens the model's generation config names)"]
