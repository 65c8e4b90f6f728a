"""The supervised loss on the tiny 4-bit model: a step's loss is the masked cross-entropy computed by
hand from the model's own logits (completion-only and on every token); packed and padded batches
give the same loss and gradients; packing is refused where attention would cross rows."""

from __future__ import annotations

import math
import time

import pytest
import torch

from lora_ppo.config import SFTAdapterSettings, SFTRecipe, recipe_from_dict
from lora_ppo.errors import RecipeError
from lora_ppo.sft.batches import packed_batch, padded_batch
from lora_ppo.sft.trainer import SFTTrainer
from tests.conftest import perturb_lora_b
from tests.sft_helpers import demonstration_rows, nll_by_hand, sft_recipe_dict, write_jsonl


@pytest.fixture(scope="module")
def trainer_for(tiny_model_dir, tmp_path_factory):
    """An SFT trainer on the tiny model (its adapter's LoRA B randomised, so it is not the base model)."""
    root = tmp_path_factory.mktemp("sft-loss")
    data = write_jsonl(root / "d.jsonl", demonstration_rows(12))

    def make(completion_only: bool = True, **sft) -> SFTTrainer:
        recipe = sft_recipe_dict(tiny_model_dir, data, data, root / f"run-{completion_only}-{len(sft)}",
                                 sft={"completion_only": completion_only, **sft}, batch_size=6, grad_accum_steps=2,
                                 learning_rate=1e-3)
        trainer = SFTTrainer(recipe_from_dict(recipe, schema=SFTRecipe), progress=False)
        perturb_lora_b(trainer.model, "policy", seed=3, scale=0.3)
        return trainer

    return make


@pytest.mark.parametrize("completion_only", [True, False], ids=["completion_only", "every_token"])
def test_a_steps_loss_is_the_masked_cross_entropy_by_hand(trainer_for, completion_only):
    """The logged loss is -mean log p(target | tokens before) over the step's target tokens,
    computed here from the model's own forward (LM head included), one unpadded row at a time."""
    trainer = trainer_for(completion_only)
    rows, _ = trainer.stream.take(trainer.recipe.train.batch_size, trainer.state.position)
    total, count = nll_by_hand(trainer.model, trainer.tokenizer, rows, completion_only)
    started = time.perf_counter()
    metrics = trainer.train_step()
    assert 0 < metrics["time/step"] <= time.perf_counter() - started
    assert metrics["sft/target_tokens"] == count
    assert metrics["sft/loss"] == pytest.approx(total / count, rel=1e-5, abs=1e-6)
    assert metrics["sft/perplexity"] == pytest.approx(math.exp(total / count), rel=1e-5)
    # Two micro-batches of 3 rows, each padded to its longest row.
    tokens = sum(len(row.ids) for row in rows)
    positions = sum(3 * max(len(row.ids) for row in rows[start : start + 3]) for start in (0, 3))
    assert tokens < positions
    assert (metrics["sft/tokens"], metrics["sft/padding_frac"]) == (tokens, pytest.approx(1 - tokens / positions))
    assert metrics["tokens_per_s"] == pytest.approx(tokens / metrics["time/step"])


def test_packed_and_padded_batches_give_the_same_loss_and_gradients(trainer_for):
    trainer = trainer_for(True)
    rows = trainer.train_rows.rows[:6]
    lengths = [len(row.ids) for row in rows]
    assert len(set(lengths)) > 1  # rows of different lengths: padding and packing differ
    pad = trainer.tokenizer.pad_token_id
    targets = sum(row.target_count for row in rows)

    def run(batches):
        params = trainer.model.parameters()
        for p in params:
            p.grad = None
        loss = 0.0
        for batch in batches:
            part = -trainer.model.target_logprobs(batch).sum() / targets
            part.backward()
            loss += float(part.detach())
        return loss, [p.grad.clone() for p in params]

    padded = run([padded_batch(rows[:3], pad), padded_batch(rows[3:], pad)])
    packed_batches = [packed_batch(rows[:3], pad, 2 * max(lengths)), packed_batch(rows[3:], pad, 2 * max(lengths))]
    assert [b.input_ids.shape[0] for b in packed_batches] == [2, 2]  # two rows share a sequence
    assert all(b.attention_mask is None for b in packed_batches)
    packed = run(packed_batches)
    assert packed[0] == pytest.approx(padded[0], rel=1e-5, abs=1e-6)
    for a, b in zip(packed[1], padded[1]):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)
    assert any(g.abs().sum() > 0 for g in padded[1])


def test_a_training_step_with_packing_gives_the_padded_steps_loss(trainer_for):
    """sft.packing through the trainer's own batches (moved to its device), against the same step padded."""
    padded, packed = trainer_for(True), trainer_for(True, packing=True)
    # Rows of 24, 24, 25 and 25 tokens in sequences of at most data.max_length (48) tokens: 24 + 24,
    # then each 25 alone, padded with the pad token; with sft.packing_length 100, all four in one.
    rows = packed.train_rows.rows[:4]
    assert sorted(len(row.ids) for row in rows) == [24, 24, 25, 25] and packed.recipe.data.max_length == 48
    batch = packed.batch(rows)
    assert batch.attention_mask is None and batch.input_ids.shape == (3, 48)
    # The padding, and each row's last token: this tokenizer pads with its end-of-turn token.
    assert (batch.input_ids == packed.tokenizer.pad_token_id).sum() == 2 * 23 + 4
    longer = trainer_for(True, packing=True, packing_length=100).batch(rows)
    assert longer.input_ids.shape == (1, 98)
    assert sorted(longer.input_ids[0].tolist()) == sorted(t for row in rows for t in row.ids)
    assert torch.equal(padded.batch(padded.train_rows.rows[:1]).attention_mask,
                       torch.ones(1, len(padded.train_rows.rows[0].ids), dtype=torch.long))
    assert packed.train_step()["sft/loss"] == pytest.approx(padded.train_step()["sft/loss"], rel=1e-5, abs=1e-6)


def test_packing_is_refused_where_attention_crosses_rows(trainer_for, monkeypatch):
    """transformers parts packed rows by their positions; a model whose attention did not would let
    each row see the one before it, and the load-time probe refuses it."""
    import transformers.masking_utils as masking

    trainer = trainer_for(True, packing=True)
    trainer.model.check_packing("sft.packing")  # the tiny Llama parts them
    monkeypatch.setattr(masking, "find_packed_sequence_indices", lambda position_ids: None)
    with pytest.raises(RecipeError, match="^sft.packing: llama's attention lets a packed row see the row before it"):
        trainer.model.check_packing("sft.packing")
    with pytest.raises(RecipeError, match="^sft.packing: llama's attention"):  # as the run's model loads
        trainer_for(True, packing=True)


def test_target_logprobs_are_one_per_target_token_in_order(tiny_model_dir):
    """[N]: log p(token t | tokens before it) of each target token, as a plain forward gives it."""
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.sft.batches import Batch
    from lora_ppo.sft.model import SFTModel

    model = SFTModel(load_base_model(ModelConfig(name=str(tiny_model_dir))), SFTAdapterSettings(r=4))
    perturb_lora_b(model, "policy", seed=1, scale=0.3)
    ids = torch.tensor([[5, 9, 17, 33, 60, 7]])
    targets = torch.tensor([[False, False, True, True, False, True]])  # tokens 2, 3 and 5
    batch = Batch(ids, torch.arange(6).unsqueeze(0), torch.ones_like(ids), targets)
    with torch.no_grad():
        got = model.target_logprobs(batch)
        logp = torch.log_softmax(model.peft(input_ids=ids).logits[0].double(), dim=-1)  # [T, V]
    expected = torch.stack([logp[t - 1, ids[0, t]] for t in (2, 3, 5)]).float()
    assert got.shape == (3,)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-6)


def test_dropout_acts_in_training_steps_only(tiny_model_dir):
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.sft.batches import Batch
    from lora_ppo.sft.model import SFTModel

    model = SFTModel(load_base_model(ModelConfig(name=str(tiny_model_dir))), SFTAdapterSettings(r=4, dropout=0.5))
    perturb_lora_b(model, "policy", seed=1, scale=0.3)
    ids = torch.tensor([[5, 9, 17, 33, 60, 7]])
    batch = Batch(ids, torch.arange(6).unsqueeze(0), torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    with torch.no_grad():
        assert torch.equal(model.target_logprobs(batch), model.target_logprobs(batch))
        with model.training_mode():
            assert not torch.equal(model.target_logprobs(batch), model.target_logprobs(batch))
    assert not model.peft.training


def test_the_packing_probe_reads_the_vocabulary_of_a_4bit_lm_head(tiny_untied_model_dir):
    """With `model.quantize_lm_head` the head's weight is bitsandbytes' packed tensor (vocabulary x
    hidden / 2 rows): the probe's token ids must come from the head's vocabulary, not that shape."""
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.sft.model import SFTModel

    cfg = ModelConfig(name=str(tiny_untied_model_dir), quantization="4bit", quantize_lm_head=True)
    model = SFTModel(load_base_model(cfg), SFTAdapterSettings(r=4))
    assert model.lm_head.weight.shape[0] > model.lm_head.out_features  # packed: the trap this avoids
    model.check_packing("sft.packing")  # the tiny Llama parts packed rows; ids past the vocabulary would raise
