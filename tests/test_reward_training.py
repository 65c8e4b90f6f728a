"""`lora-ppo train-reward` on the tiny 4-bit model: a reward adapter trained on a separable
preference set ranks held-out pairs well; bad pairs are counted; the run folder, checkpoints and
resume behave like PPO's; the result plugs into PPO as `reward.kind: adapter` on the one backbone."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.config import PreferenceDataConfig, RewardRecipe, recipe_from_dict
from lora_ppo.data import PromptFormat, load_preference_sets, prepare_pairs
from lora_ppo.reward_training import RewardTrainer, pair_batch, pairwise_loss
from tests.conftest import adapter_tensors, bnb_4bit_layers, bos_first, tiny_recipe_dict
from tests.sft_helpers import write_jsonl

GOOD = ["great", "wonderful", "lovely", "masterpiece"]
BAD = ["terrible", "boring", "dull", "awful"]


def preference_rows(n: int, start: int = 0) -> list[dict]:
    """Pairs a reward model can separate: the chosen response praises, the rejected one pans."""
    rows = []
    for i in range(start, start + n):
        prompt = f"Review {i}: the film was"
        rows.append({"prompt": prompt, "chosen": f" {GOOD[i % 4]} and {GOOD[(i + 1) % 4]}",
                     "rejected": f" {BAD[i % 4]} and {BAD[(i + 1) % 4]}"})
    return rows


def reward_recipe_dict(model_dir: Path, data: Path, held_out: Path, out: Path, **train) -> dict:
    return {
        "model": {"name": str(model_dir), "quantization": "4bit", "gradient_checkpointing": False},
        "adapter": {"r": 4, "alpha": 8},
        "data": {"source": str(data), "eval_source": str(held_out), "eval_split": "train", "eval_size": 16,
                 "max_length": 64},
        "train": {"epochs": 2, "batch_size": 8, "learning_rate": 3e-2, "eval_every": 5, "output_dir": str(out),
                  "lr_schedule": "constant", **train},
    }


@pytest.fixture(scope="session")
def reward_run(tiny_model_dir, tmp_path_factory) -> Path:
    """A trained tiny reward adapter: 48 training pairs, 2 epochs, 16 held-out pairs."""
    root = tmp_path_factory.mktemp("reward-run")
    data = write_jsonl(root / "train.jsonl", preference_rows(48))
    held_out = write_jsonl(root / "held_out.jsonl", preference_rows(16, start=1000))
    recipe = recipe_from_dict(reward_recipe_dict(tiny_model_dir, data, held_out, root / "run"), schema=RewardRecipe)
    RewardTrainer(recipe, progress=False).train()
    return root / "run"


def test_a_reward_adapter_learns_a_separable_preference(reward_run):
    summary = json.loads((reward_run / "summary.json").read_text())
    assert summary["heldout_pairs"] == 16 and summary["steps"] == 12
    assert summary["heldout_accuracy_before"] == 0.5  # the zero-initialised head ties every pair: chance
    assert summary["heldout_accuracy_after"] >= 0.9
    assert summary["heldout_margin_after"] > summary["heldout_margin_before"] + 0.5
    metrics = [json.loads(line) for line in (reward_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 13))
    assert "eval/accuracy" in metrics[4] and "eval/margin" in metrics[9]
    final = reward_run / "final" / "reward"
    assert {p.name for p in final.iterdir()} >= {"adapter_config.json", "adapter_model.safetensors",
                                                   "reward_head.safetensors"}


def test_a_steps_loss_accuracy_margin_and_gradient_norm_are_its_pairs_by_hand(tmp_path, tiny_model_dir, reward_run):
    """A step of 4 pairs in 2 micro-batches, from the trained adapter (its scores are not 0) and
    with margins: the logged loss is the mean of log(1 + exp(-(chosen - rejected - margin))) over
    the 4 pairs, accuracy the share ranked right, margin the mean score difference, and grad_norm
    the norm of that mean loss's gradient, as a plain backward of the model's scores gives them."""
    import math
    import time

    margins = [17.0, 19.0, 0.0, 15.0, 18.0, 21.0]  # about the trained adapter's score gaps: a loss far from 0
    rows = [{**row, "margin": m} for row, m in zip(preference_rows(6), margins)]
    data = write_jsonl(tmp_path / "train.jsonl", rows)
    recipe = reward_recipe_dict(tiny_model_dir, data, data, tmp_path / "run", epochs=1, batch_size=4,
                                grad_accum_steps=2)
    recipe["adapter"]["init_from"] = str(reward_run / "final" / "reward")
    recipe["data"].update(margin_column="margin", eval_source=None, eval_size=0)
    trainer = RewardTrainer(recipe_from_dict(recipe, schema=RewardRecipe), progress=False)
    pairs, _ = trainer.stream.take(4, trainer.state.position)
    scores = trainer.model.scores(*pair_batch(pairs, trainer.tokenizer.pad_token_id, trainer.device))
    chosen, rejected = scores[:4].tolist(), scores[4:].tolist()
    margin = [p.margin for p in pairs]
    by_hand = torch.log1p(torch.exp(-(scores[:4] - scores[4:] - torch.tensor(margin)))).sum() / 4
    by_hand.backward()
    parameters = list(trainer.model.parameters())
    grad_norm = math.sqrt(sum(float((p.grad.double() ** 2).sum()) for p in parameters if p.grad is not None))
    trainer.optimizer.zero_grad(set_to_none=True)

    started = time.perf_counter()
    metrics = trainer.train_step()
    assert 0 < metrics["time/step"] <= time.perf_counter() - started
    expected_loss = sum(math.log1p(math.exp(-(c - r - m))) for c, r, m in zip(chosen, rejected, margin)) / 4
    assert metrics["loss"] == pytest.approx(expected_loss, rel=1e-5)
    assert metrics["accuracy"] == sum(c > r for c, r in zip(chosen, rejected)) / 4
    assert metrics["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 4, rel=1e-5)
    assert metrics["grad_norm"] == pytest.approx(grad_norm, rel=1e-4)
    assert metrics["step"] == 1


def test_held_out_accuracy_margin_and_loss_cover_every_pair_by_hand(tmp_path, tiny_model_dir, reward_run, caplog):
    """20 held-out pairs (more than one scoring batch), 6 of them the wrong way round, with margins:
    the held-out accuracy, margin and loss are those of each pair scored on its own."""
    import logging
    import math

    rows = preference_rows(20, start=700)
    for row in rows[::3][:6]:
        row["chosen"], row["rejected"] = row["rejected"], row["chosen"]
    rows = [{**row, "margin": float(i % 5) * 4} for i, row in enumerate(rows)]
    held_out = write_jsonl(tmp_path / "held.jsonl", rows)
    data = write_jsonl(tmp_path / "train.jsonl", [{**row, "margin": 0.0} for row in preference_rows(4)])
    recipe = reward_recipe_dict(tiny_model_dir, data, held_out, tmp_path / "run", epochs=1, batch_size=4)
    recipe["adapter"]["init_from"] = str(reward_run / "final" / "reward")
    recipe["data"].update(margin_column="margin", eval_size=20)
    trainer = RewardTrainer(recipe_from_dict(recipe, schema=RewardRecipe), progress=False)
    pairs = trainer.eval_pairs.pairs
    assert len(pairs) == 20
    chosen, rejected = [], []
    with torch.no_grad():
        for pair in pairs:
            ids = [torch.tensor([seq]) for seq in (pair.chosen_ids, pair.rejected_ids)]
            c, r = (float(trainer.model.scores(t, torch.ones_like(t))[0]) for t in ids)
            chosen.append(c)
            rejected.append(r)
    wins = [c > r for c, r in zip(chosen, rejected)]
    assert 0 < sum(wins) < 20
    with caplog.at_level(logging.INFO, logger="lora_ppo.progress"):
        scores = trainer.evaluate()
    # Without a bar, a line per batch of 16 that takes the count past another tenth.
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "lora_ppo.progress"] == \
        ["held-out: 0/20 pairs", "held-out: 16/20 pairs", "held-out: 20/20 pairs"]
    assert scores["accuracy"] == pytest.approx(sum(wins) / 20, abs=1e-6)
    assert scores["margin"] == pytest.approx(sum(c - r for c, r in zip(chosen, rejected)) / 20, rel=1e-4)
    loss = sum(math.log1p(math.exp(-(c - r - p.margin))) for c, r, p in zip(chosen, rejected, pairs)) / 20
    assert scores["loss"] == pytest.approx(loss, rel=1e-4)


def test_the_closing_lines_round_the_numbers_and_say_n_a_without_held_out_pairs():
    from lora_ppo.reward_training import format_reward_summary

    summary = {"heldout_accuracy_before": 0.5, "heldout_accuracy_after": 0.93751, "heldout_margin_before": 0.0,
               "heldout_margin_after": 2.71828, "heldout_pairs": 16, "wall_time_s": 61.6, "peak_memory_gb": 0.987,
               "reward_adapter": "runs/reward/final/reward"}
    assert format_reward_summary(summary).splitlines() == [
        "held-out accuracy: 0.500 -> 0.938 (16 pairs)",
        "held-out mean margin: 0.000 -> 2.718",
        "wall time: 62 s, peak memory: 0.99 GB",
        "reward adapter: runs/reward/final/reward (use it with reward.kind: adapter, reward.adapter: <that folder>)",
    ]
    no_held_out = {k: v for k, v in summary.items() if not k.startswith("heldout_")} | {"heldout_pairs": 0}
    assert format_reward_summary(no_held_out).splitlines()[:2] == ["held-out accuracy: n/a -> n/a (0 pairs)",
                                                                   "held-out mean margin: n/a -> n/a"]


def test_accuracy_counts_a_tie_as_half():
    import torch

    from lora_ppo.reward_training import pair_wins

    wins = pair_wins(torch.tensor([1.0, 0.0, 2.0]), torch.tensor([0.0, 0.0, 3.0]))
    assert wins.tolist() == [1.0, 0.5, 0.0]


def test_pairs_are_scored_at_their_last_real_token_whatever_the_padding():
    from lora_ppo.data import PreferencePair
    from lora_ppo.roles import last_real_index

    pairs = [PreferencePair("p", (5, 6, 7), (5, 6)), PreferencePair("q", (8,), (9, 10, 11, 12))]
    ids, mask = pair_batch(pairs, pad_id=0, device="cpu")
    assert ids.tolist() == [[5, 6, 7, 0], [8, 0, 0, 0], [5, 6, 0, 0], [9, 10, 11, 12]]
    assert last_real_index(mask).tolist() == [2, 0, 1, 3]
    left = torch.tensor([[0, 0, 1, 1], [1, 1, 1, 1]])
    assert last_real_index(left).tolist() == [3, 3]


def test_pairwise_loss_with_and_without_margin():
    chosen, rejected = torch.tensor([2.0, 0.0]), torch.tensor([0.0, 0.0])
    expected = -torch.nn.functional.logsigmoid(torch.tensor([2.0, 0.0]))
    torch.testing.assert_close(pairwise_loss(chosen, rejected, torch.zeros(2)), expected)
    with_margin = pairwise_loss(chosen, rejected, torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(with_margin, -torch.nn.functional.logsigmoid(torch.tensor([1.0, 0.0])))


def test_preference_formats_and_bad_pairs_are_counted(tiny_tokenizer):
    rows = [
        {"prompt": "The film", "chosen": " good", "rejected": " bad"},  # explicit prompt, text
        {"prompt": [{"role": "user", "content": "Rate it"}], "chosen": [{"role": "assistant", "content": "Great"}],
         "rejected": [{"role": "assistant", "content": "Bad"}]},  # explicit conversational prompt
        {"prompt": None, "chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello!"}],
         "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Go away"}]},  # implicit
        {"prompt": None, "chosen": [{"role": "user", "content": "A"}, {"role": "assistant", "content": "x"}],
         "rejected": [{"role": "user", "content": "B"}, {"role": "assistant", "content": "y"}]},  # prompts differ
        {"prompt": "The film", "chosen": " same", "rejected": " same"},
        {"prompt": "The film", "chosen": None, "rejected": " bad"},
        {"prompt": "The film", "chosen": "", "rejected": " bad"},
        {"prompt": "The film", "chosen": " good " * 100, "rejected": " bad"},
        {"prompt": None, "chosen": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "y"}],
         "rejected": [{"role": "assistant", "content": "x"}, {"role": "user", "content": "z"}]},  # no answer last
        {"prompt": "The film", "chosen": 7, "rejected": " bad"},  # a number, not a response
        {"prompt": "The film", "chosen": " good", "rejected": []},  # an empty conversation
        {"prompt": "The film", "chosen": " good", "rejected": [{"role": "assistant", "content": 7}]},  # no text
        # implicit, over two exchanges: the prompt is the first three messages
        {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                    {"role": "user", "content": "And?"}, {"role": "assistant", "content": "Ok"}],
         "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"},
                      {"role": "user", "content": "And?"}, {"role": "assistant", "content": "No"}]},
    ]
    cfg = PreferenceDataConfig(max_length=48)
    pairs = prepare_pairs(rows, cfg, PromptFormat(tiny_tokenizer, False), tiny_tokenizer.eos_token_id, "d")
    assert len(pairs.pairs) == 4
    assert pairs.dropped == {"prompt_mismatch": 1, "chosen_equals_rejected": 1, "not_text": 2, "empty": 2,
                             "too_long": 1, "last_turn_not_assistant": 1, "message_without_role_or_content": 1}
    text_pair = pairs.pairs[0]
    prompt_ids = tiny_tokenizer("The film")["input_ids"]
    assert text_pair.chosen_ids[: len(prompt_ids)] == tuple(prompt_ids)
    assert text_pair.chosen_ids[-1] == tiny_tokenizer.eos_token_id  # the response ends as the policy's do
    # an explicit conversational prompt: its template's tokens, then the answer's, then the stop token
    rendered = "<|im_start|>user\nRate it<|im_end|>\n<|im_start|>assistant\n"
    expected = [tiny_tokenizer(text, add_special_tokens=False)["input_ids"] for text in (rendered, "Great")]
    assert pairs.pairs[1].chosen_ids == (*expected[0], *expected[1], tiny_tokenizer.eos_token_id)
    implicit = pairs.pairs[2]
    assert implicit.prompt == [{"role": "user", "content": "Hi"}]
    assert [m["content"] for m in pairs.pairs[3].prompt] == ["Hi", "Yo", "And?"]


def test_a_templated_pair_ends_with_the_token_the_template_closes_an_assistant_turn_with(tiny_tokenizer):
    """As Gemma's template closes a turn with `<end_of_turn>` while its eos is `<eos>` (here
    `<|im_start|>` and `<|im_end|>` stand for them): a pair after a conversational prompt ends with
    the turn's closing token, which a policy's response ends with (rollout.stop_token eos stops at
    the model's end tokens) and where the reward is read; a pair after a text prompt, with the eos."""
    from tests.conftest import tokenizer_copy

    tokenizer = tokenizer_copy(tiny_tokenizer)
    tokenizer.chat_template = ("{% for m in messages %}<|endoftext|>{{ m['role'] }}\n{{ m['content'] }}<|im_start|>\n"
                               "{% endfor %}{% if add_generation_prompt %}<|endoftext|>assistant\n{% endif %}")
    turn_end, eos = tokenizer.convert_tokens_to_ids("<|im_start|>"), tokenizer.eos_token_id
    assert turn_end != eos
    fmt = PromptFormat(tokenizer, False)
    assert fmt.assistant_turn_end == turn_end
    assert PromptFormat(tiny_tokenizer, False).assistant_turn_end == eos  # ChatML: <|im_end|>, the eos
    rows = [{"prompt": [{"role": "user", "content": "Rate it"}], "chosen": " good", "rejected": " bad"},
            {"chosen": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Yo"}],
             "rejected": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "No"}]},
            {"prompt": "The film", "chosen": " good", "rejected": " bad"}]
    conversational, implicit, text = prepare_pairs(rows, PreferenceDataConfig(), fmt, eos, "d").pairs
    rendered = tokenizer("<|endoftext|>user\nRate it<|im_start|>\n<|endoftext|>assistant\n",
                         add_special_tokens=False)["input_ids"]
    assert conversational.chosen_ids == (*rendered, *tokenizer(" good", add_special_tokens=False)["input_ids"],
                                         turn_end)
    assert implicit.chosen_ids[-1] == implicit.rejected_ids[-1] == turn_end
    assert text.chosen_ids[-1] == text.rejected_ids[-1] == eos
    # a tokenizer that puts a BOS first reads the same token after the answer (not its BOS)
    bos_tokenizer = bos_first(tokenizer)
    bos_tokenizer.chat_template = tokenizer.chat_template
    assert PromptFormat(bos_tokenizer, False).assistant_turn_end == turn_end
    # a template that closes a turn with plain text (a blank line) has no end token of its own: the eos
    tokenizer.chat_template = ("{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n\n{% endfor %}"
                               "{% if add_generation_prompt %}assistant: {% endif %}")
    assert PromptFormat(tokenizer, False).assistant_turn_end == eos


def test_a_margin_that_is_missing_not_a_number_or_not_finite_drops_its_pair(tiny_tokenizer):
    """A NaN margin would make the loss NaN, a missing one stopped the run with a traceback: each
    drops its pair, counted; a number written as text (as CSV columns give) is read."""
    margins = [1.5, "2", -0.5, None, "much", float("nan"), float("inf"), True]
    rows = [{"prompt": "The film", "chosen": " good", "rejected": " bad", "m": m} for m in margins]
    cfg = PreferenceDataConfig(margin_column="m")
    pairs = prepare_pairs(rows, cfg, PromptFormat(tiny_tokenizer, False), tiny_tokenizer.eos_token_id, "d")
    assert [p.margin for p in pairs.pairs] == [1.5, 2.0, -0.5]
    assert pairs.dropped == {"margin_not_a_finite_number": 5}


def test_a_pairs_tokens_take_the_bos_only_where_the_text_starts(tiny_tokenizer):
    """For a tokenizer that puts BOS first: a plain text prompt gets it, and its response after
    it does not; a pair with no prompt starts its response with it. No margin column: margin 0."""
    bos_tokenizer = bos_first(tiny_tokenizer)
    bos, eos = bos_tokenizer.bos_token_id, bos_tokenizer.eos_token_id
    ids = {text: tiny_tokenizer(text, add_special_tokens=False)["input_ids"] for text in ("The film", " good", " bad")}
    rows = [{"prompt": "The film", "chosen": " good", "rejected": " bad"},
            {"prompt": None, "chosen": " good", "rejected": " bad"}]
    explicit, implicit = prepare_pairs(rows, PreferenceDataConfig(), PromptFormat(bos_tokenizer, False), eos, "d").pairs
    assert explicit.chosen_ids == (bos, *ids["The film"], *ids[" good"], eos)
    assert explicit.rejected_ids == (bos, *ids["The film"], *ids[" bad"], eos)
    assert implicit.chosen_ids == (bos, *ids[" good"], eos)
    assert explicit.margin == implicit.margin == 0.0


def test_a_pair_as_long_as_max_length_is_kept_and_one_token_longer_dropped(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    row = {"prompt": "The film", "chosen": " good", "rejected": " bad and dull"}
    longest = len(tiny_tokenizer("The film")["input_ids"]) + len(
        tiny_tokenizer(" bad and dull", add_special_tokens=False)["input_ids"]) + 1
    fmt = PromptFormat(tiny_tokenizer, False)
    assert len(prepare_pairs([row], PreferenceDataConfig(max_length=longest), fmt, eos, "d").pairs) == 1
    assert prepare_pairs([row], PreferenceDataConfig(max_length=longest - 1), fmt, eos, "d").dropped == {"too_long": 1}


def test_no_usable_pair_refuses_in_one_line(tmp_path, tiny_model_dir):
    data = write_jsonl(tmp_path / "p.jsonl", [{"prompt": "x", "chosen": " a", "rejected": " a"}])
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(reward_recipe_dict(tiny_model_dir, data, data, tmp_path / "run")))
    result = CliRunner().invoke(app, ["train-reward", str(recipe)])
    assert result.exit_code == 2
    assert result.stderr.strip().splitlines() == [
        f"error: data.source: no usable preference pairs in {str(data)!r} (1 chosen_equals_rejected)"
    ]
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("override, message", [
    ("train.batch_size=6", "train.batch_size (6) must be divisible by grad_accum_steps"),
    ("data.chosen=c", "data.chosen: unknown field (did you mean data.chosen_column?)"),
    ("train.learning_rate=-1", "train.learning_rate"),
])
def test_bad_reward_recipe_is_one_line_exit_2(tmp_path, tiny_model_dir, override, message):
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(4))
    recipe = tmp_path / "r.yaml"
    recipe.write_text(yaml.safe_dump(reward_recipe_dict(tiny_model_dir, data, data, tmp_path / "run",
                                                        grad_accum_steps=4)))
    result = CliRunner().invoke(app, ["train-reward", str(recipe), override])
    assert result.exit_code == 2 and len(result.stderr.strip().splitlines()) == 1
    assert message in result.stderr and not (tmp_path / "run").exists()


def test_resume_continues_exactly(tmp_path, tiny_model_dir, monkeypatch):
    """A run killed after a checkpoint and resumed ends with the adapter and metrics an
    uninterrupted run has."""
    data = write_jsonl(tmp_path / "train.jsonl", preference_rows(24))
    held_out = write_jsonl(tmp_path / "held.jsonl", preference_rows(8, start=500))

    def recipe(out, **train):
        return recipe_from_dict(reward_recipe_dict(tiny_model_dir, data, held_out, out, epochs=1, batch_size=4,
                                                   save_every=2, eval_every=0, lr_schedule="linear", **train),
                                schema=RewardRecipe)

    RewardTrainer(recipe(tmp_path / "whole"), progress=False).train()
    real_step = RewardTrainer.train_step

    def killed_in_step_5(self):
        metrics = real_step(self)
        if self.state.step == 5:  # step 5 done, its checkpoint not yet written: lost
            raise KeyboardInterrupt
        return metrics

    monkeypatch.setattr(RewardTrainer, "train_step", killed_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        RewardTrainer(recipe(tmp_path / "parts"), progress=False).train()
    monkeypatch.undo()
    RewardTrainer(recipe(tmp_path / "parts"), progress=False, resume="auto").train()
    whole, parts = (adapter_tensors(tmp_path / run / "final" / "reward") for run in ("whole", "parts"))
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)

    def steps(run):
        return [{k: v for k, v in json.loads(line).items() if not k.startswith(("time/", "memory/"))}
                for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()]

    assert steps("parts") == steps("whole") and len(steps("whole")) == 6


def test_adapter_dropout_acts_in_training_steps_only(tmp_path, tiny_model_dir):
    """adapter.dropout regularises the training steps; held-out scores (and so accuracy) stay
    deterministic, and the model is back in eval mode after every step, its 4-bit layers still on
    their differentiable kernel."""
    data = write_jsonl(tmp_path / "train.jsonl", preference_rows(8))
    held_out = write_jsonl(tmp_path / "held.jsonl", preference_rows(4, start=500))
    recipe_dict = reward_recipe_dict(tiny_model_dir, data, held_out, tmp_path / "run", epochs=1, batch_size=4)
    recipe_dict["adapter"]["dropout"] = 0.5
    trainer = RewardTrainer(recipe_from_dict(recipe_dict, schema=RewardRecipe), progress=False)
    trainer.train()
    assert not trainer.model.peft.training
    assert all(layer.training for layer in bnb_4bit_layers(trainer.model))
    ids, mask = pair_batch(trainer.eval_pairs.pairs, 0, trainer.device)
    with torch.no_grad():
        assert torch.equal(trainer.model.scores(ids, mask), trainer.model.scores(ids, mask))
        with trainer.model.training_mode():
            assert not torch.equal(trainer.model.scores(ids, mask), trainer.model.scores(ids, mask))


def test_ppo_with_the_reward_adapter_holds_one_base_model(tmp_path, tiny_model_dir, reward_run, monkeypatch):
    """reward.kind: adapter scores on the policy's backbone: one base model is loaded, the reward
    adapter never gets a gradient nor changes, and the run folder keeps a copy of it."""
    import lora_ppo
    import lora_ppo.parts as parts_module
    from lora_ppo.roles import REWARD, RoleModel

    loads, given = [], []
    real_load, real_scores = parts_module.load_base_model, RoleModel.reward_scores

    def counted(cfg):
        loads.append(cfg.name)
        return real_load(cfg)

    def recorded(self, input_ids, attention_mask):
        scores = real_scores(self, input_ids, attention_mask)
        given.extend(scores.tolist())
        return scores

    monkeypatch.setattr(parts_module, "load_base_model", counted)
    monkeypatch.setattr(RoleModel, "reward_scores", recorded)
    adapter = reward_run / "final" / "reward"
    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "run", reward={"kind": "adapter", "adapter": str(adapter), "function": None},
        train={"steps": 2, "eval": False}, ppo={"learning_rate": 5e-2},
    ))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    roles = trainer.roles
    frozen_before = {n: p.detach().clone() for n, p in roles.peft.named_parameters() if f".{REWARD}." in n}
    head_before = roles.heads[REWARD].weight.detach().clone()
    trainer.train()
    assert loads == [str(tiny_model_dir)]
    assert REWARD in roles.peft.peft_config and frozen_before
    for name, param in roles.peft.named_parameters():
        if f".{REWARD}." in name:
            assert not param.requires_grad and param.grad is None
            assert torch.equal(param.detach(), frozen_before[name]), name
    assert torch.equal(roles.heads[REWARD].weight.detach(), head_before)
    assert not roles.heads[REWARD].weight.requires_grad
    saved = adapter_tensors(tmp_path / "run" / "final" / "reward")
    assert all(torch.equal(saved[k], t) for k, t in adapter_tensors(adapter).items())
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    # Each step's logged score is the mean of what the reward adapter gave that step's responses
    # (test_reward_adapter_scores_equal_a_direct_forward checks those against a direct forward).
    batch = recipe.rollout.batch_size
    assert len(given) == len(metrics) * batch == 2 * batch
    for step, m in enumerate(metrics):
        assert m["objective/scores"] == pytest.approx(sum(given[step * batch : (step + 1) * batch]) / batch, abs=1e-6)


def test_reward_adapter_scores_equal_a_direct_forward(tiny_model_dir, reward_run, tiny_tokenizer):
    """The score PPO uses is the trained head on the reward adapter's last hidden state of the
    prompt + response, whatever the left padding of the prompt."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import RoleModel

    adapter = str(reward_run / "final" / "reward")
    roles = RoleModel(load_base_model(ModelConfig(name=str(tiny_model_dir))),
                      AdaptersConfig(policy={"r": 4}, value={"r": 4}), reward_adapter=adapter)
    good = tiny_tokenizer("Review 5: the film was great and wonderful")["input_ids"] + [tiny_tokenizer.eos_token_id]
    bad = tiny_tokenizer("Review 5: the film was terrible and dull")["input_ids"] + [tiny_tokenizer.eos_token_id]
    width = max(len(good), len(bad)) + 2
    ids = torch.tensor([[0] * (width - len(s)) + s for s in (good, bad)])
    mask = torch.tensor([[0] * (width - len(s)) + [1] * len(s) for s in (good, bad)])
    scores = roles.reward_scores(ids, mask)
    alone = roles.reward_scores(torch.tensor([good]), torch.ones(1, len(good), dtype=torch.long))
    torch.testing.assert_close(scores[0], alone[0], atol=1e-5, rtol=1e-5)
    assert scores[0] > scores[1]


def test_value_init_from_reward_copies_the_reward_adapter_and_head(tiny_model_dir, reward_run):
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import REWARD, VALUE, RoleModel

    roles = RoleModel(load_base_model(ModelConfig(name=str(tiny_model_dir))),
                      AdaptersConfig(policy={"r": 4}, value={"init_from": "reward"}),
                      reward_adapter=str(reward_run / "final" / "reward"))
    value = {n.replace(f".{VALUE}.", "."): p for n, p in roles.peft.named_parameters() if f".{VALUE}." in n}
    reward = {n.replace(f".{REWARD}.", "."): p for n, p in roles.peft.named_parameters() if f".{REWARD}." in n}
    assert value.keys() == reward.keys() and value
    assert all(torch.equal(value[k], reward[k]) for k in value)
    torch.testing.assert_close(roles.value_head.weight, roles.heads[REWARD].weight)
    assert all(p.requires_grad for p in roles.value_parameters())
    assert not any(p.requires_grad for p in reward.values())


def test_the_reward_adapter_exports_with_its_head(reward_run, tmp_path):
    from lora_ppo.export import merge_and_export

    report = merge_and_export(reward_run, tmp_path / "exported", adapter="reward", adapter_only=True)
    assert {"adapter_model.safetensors", "reward_head.safetensors", "README.md"} <= set(report.files)
    card = (tmp_path / "exported" / "README.md").read_text()
    assert "reward_head.safetensors" in card
    # Without the option, the refusal names it (it said "corrupt checkpoint").
    from lora_ppo.errors import RecipeError

    with pytest.raises(RecipeError, match="reward-model run's .* export it with --adapter reward --adapter-only"):
        merge_and_export(reward_run, tmp_path / "merged")


def test_held_out_split_off_the_training_pairs(tiny_tokenizer, tmp_path):
    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(20))
    train, held = load_preference_sets(PreferenceDataConfig(source=str(data), eval_size=4), tiny_tokenizer, seed=3)
    assert len(train.pairs) == 16 and len(held.pairs) == 4
    assert not {p.chosen_ids for p in train.pairs} & {p.chosen_ids for p in held.pairs}


def test_a_split_never_takes_more_than_a_fifth_of_the_pairs(tiny_tokenizer, tmp_path, caplog):
    """eval_size's default (256) against 30 pairs: 6 held out (20%), 24 to train on, and a warning,
    where the split used to hold out 29 and train on 1."""
    import logging

    data = write_jsonl(tmp_path / "p.jsonl", preference_rows(30))
    with caplog.at_level(logging.WARNING, logger="lora_ppo.data"):
        train, held = load_preference_sets(PreferenceDataConfig(source=str(data)), tiny_tokenizer, seed=3)
    assert (len(train.pairs), len(held.pairs)) == (24, 6)
    assert "data.eval_size 256 would leave 0 of 30 pairs to train on: held out 6 (20%" in caplog.text


def test_generate_samples_a_run_whose_critic_started_from_its_reward_adapter(reward_run, tiny_model_dir, tmp_path):
    """`generate` loads neither the run's data nor its reward (a run folder copied without them
    samples too), and no critic: one started from the reward adapter (`adapters.value.init_from:
    reward`) was refused for want of the reward adapter generate had left out."""
    import shutil

    from typer.testing import CliRunner

    from lora_ppo import PPOTrainer, recipe_from_dict
    from lora_ppo.cli import app
    from tests.conftest import tiny_recipe_dict

    run = tmp_path / "ppo"
    recipe = recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, run, reward={"kind": "adapter", "adapter": str(tmp_path / "reward"), "function": None},
        adapters={"value": {"init_from": "reward"}}, train={"steps": 1, "eval": False}))
    shutil.copytree(reward_run, tmp_path / "reward")
    PPOTrainer(recipe, progress=False).train()
    shutil.rmtree(tmp_path / "reward")  # the run taken to a machine without its reward model
    result = CliRunner().invoke(app, ["generate", str(run), "The film was", "--json", "--max-new-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert 1 <= json.loads(result.stdout)["policy_tokens"] <= 3
