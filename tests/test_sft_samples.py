"""The held-out samples an SFT run writes before and after training (lora_ppo/sft/samples.py), on a
scripted model whose `generate` continues each prompt with tokens written here: the prompts it is
given (left-padded, in batches), where each completion is cut, and its text."""

from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from transformers import GenerationConfig

from lora_ppo.sft.rows import SFTRow
from lora_ppo.sft.samples import greedy_samples

VOCAB = 320  # the tiny tokenizer's


class Scripted:
    """Stands in for the backbone: `generate` appends to each prompt (its real tokens, read through
    the attention mask) the continuation scripted for it, and records what it was asked. Its own
    generation config names `ends` as its end tokens (None: none)."""

    def __init__(self, continuations: dict[tuple[int, ...], list[int]], ends: Optional[list[int]] = None):
        self.continuations = continuations
        self.calls: list[dict] = []
        self.lm_head = torch.nn.Linear(1, 1)
        self.peft = self
        self.generation_config = GenerationConfig(eos_token_id=ends, no_repeat_ngram_size=1)
        self.embeddings = torch.nn.Embedding(VOCAB, 1)

    def get_base_model(self):
        return self

    def get_input_embeddings(self):
        return self.embeddings

    @contextmanager
    def adapter_compute(self):
        yield

    def generate(self, input_ids, attention_mask, generation_config):
        prompts = [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(input_ids, attention_mask)]
        self.calls.append({"input_ids": input_ids.tolist(), "attention_mask": attention_mask.tolist(),
                           "greedy": not generation_config.do_sample,
                           "max_new_tokens": generation_config.max_new_tokens,
                           "stops": generation_config.eos_token_id,
                           "own_config": self.generation_config.to_dict()})
        return torch.cat([input_ids, torch.tensor([self.continuations[p] for p in prompts])], dim=1)


def row(prompt_ids: tuple[int, ...], prompt: str, completion: str = "") -> SFTRow:
    return SFTRow(ids=prompt_ids + (40,), targets=(False,) * len(prompt_ids) + (True,), prompt=prompt,
                  prompt_ids=prompt_ids, completion=completion)


def test_each_prompt_is_continued_left_padded_in_batches_and_cut_after_its_stop_token(tiny_tokenizer):
    """Three prompts (and one row with none, which gets no sample), 2 at a time: the first batch
    pads the shorter prompt on the left; a completion ends at its stop token (kept out of the text),
    one without a stop token is all its tokens, one that stops first is empty."""
    from tests.conftest import tokenizer_copy

    tokenizer = tokenizer_copy(tiny_tokenizer)
    tokenizer.pad_token = "<|endoftext|>"  # a pad token apart from the stop token
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    assert eos != pad
    a, b, c = tokenizer(" great and dull", add_special_tokens=False)["input_ids"][:3]  # three plain tokens
    assert len({a, b, c, eos, pad} - set(tokenizer.all_special_ids)) == 3
    rows = [row((5, 6, 7), "first", "ref 1"), row((8, 9), "second", "ref 2"), row((), None),
            row((10,), "third", "ref 3")]
    model = Scripted({(5, 6, 7): [a, eos, c, c], (8, 9): [c, b, a, c], (10,): [eos, pad, pad, pad]})
    records = greedy_samples(model, tokenizer, rows, max_new_tokens=4, batch_size=2)

    assert [call["input_ids"] for call in model.calls] == [[[5, 6, 7], [pad, 8, 9]], [[10]]]
    assert [call["attention_mask"] for call in model.calls] == [[[1, 1, 1], [0, 1, 1]], [[1]]]
    assert all(call["greedy"] and call["max_new_tokens"] == 4 for call in model.calls)
    assert records == [
        {"prompt": "first", "completion": tokenizer.decode([a]), "reference": "ref 1", "sample": 0},
        {"prompt": "second", "completion": tokenizer.decode([c, b, a, c]), "reference": "ref 2",
         "sample": 0},
        {"prompt": "third", "completion": "", "reference": "ref 3", "sample": 0},
    ]


def test_a_completion_ends_at_the_end_token_the_models_generation_config_names(tiny_tokenizer):
    """As a PPO run's responses end (`rollout.stop_token: eos`): at the tokenizer's eos or the model's
    own end-of-turn token, whichever comes first; and the model's other generation settings (here no
    repeated token) are not what `generate` runs with: its own config is a blank one for the call."""
    eos = tiny_tokenizer.eos_token_id
    end, a, b = tiny_tokenizer(" great and dull", add_special_tokens=False)["input_ids"][:3]
    model = Scripted({(5, 6): [a, end, b, b], (7,): [a, b, eos, end]}, ends=[end])
    records = greedy_samples(model, tiny_tokenizer, [row((5, 6), "first"), row((7,), "second")], max_new_tokens=4,
                             batch_size=2)
    assert [r["completion"] for r in records] == tiny_tokenizer.batch_decode([[a, end], [a, b, eos]],
                                                                             skip_special_tokens=True)
    (call,) = model.calls
    assert call["stops"] == [eos, end]
    assert call["own_config"] == GenerationConfig().to_dict()
    assert model.generation_config.no_repeat_ngram_size == 1  # given back after the call
