"""Using what a run trained: `lora-ppo eval` scores the final policy as the run's own after
evaluation did; `lora-ppo generate` samples it (and the reference) on the command line's prompts;
bad sources and options fail in one line."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app

runner = CliRunner()


def test_eval_of_the_final_policy_matches_the_runs_after_evaluation(finished_run):
    result = runner.invoke(app, ["eval", str(finished_run), "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    scores = json.loads(result.stdout)
    summary = json.loads((finished_run / "summary.json").read_text())
    # Same prompts, same seed, same adapter: the same completions and scores as the run's own
    # evaluation after training, so eval is a faithful reading of the saved policy.
    assert scores["score"] == summary["heldout_score_after"]
    assert scores["textblob"] == summary["heldout_textblob_after"]
    assert scores["step"] == 3 and scores["checkpoint"].endswith("final")
    assert scores["kl"] > 0  # the policy moved off the reference in 3 steps at lr 1e-2
    assert scores["kl"] == summary["heldout_kl_after"]
    assert 0 < scores["length"] <= 6  # rollout.max_new_tokens
    assert 0 < scores["distinct_1"] <= 1 and 0 < scores["distinct_2"] <= 1
    for name in ("score", "kl", "length"):
        assert scores[f"{name}_se"] >= 0


def test_eval_on_a_prompts_file_and_several_samples(finished_run, tmp_path):
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("The film opens with\nI walked out of the cinema\n\n", encoding="utf-8")
    records = tmp_path / "records.jsonl"
    result = runner.invoke(app, ["eval", str(finished_run), "--prompts", str(prompts), "--samples", "3",
                                 "--out", str(records), "--no-progress"])
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [(r["prompt"], r["sample"]) for r in lines] == [
        ("The film opens with", 0), ("The film opens with", 1), ("The film opens with", 2),
        ("I walked out of the cinema", 0), ("I walked out of the cinema", 1), ("I walked out of the cinema", 2),
    ]
    assert "6 completions of 2 prompts" in result.stdout
    assert "distinct_2" in result.stdout and "±" in result.stdout


def test_eval_of_a_checkpoint_folder(finished_run):
    result = runner.invoke(app, ["eval", str(finished_run / "checkpoints" / "step-2"), "--json", "--no-progress"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["step"] == 2


def test_generate_policy_and_reference_side_by_side(finished_run):
    args = ["generate", str(finished_run), "The film opens with", "My favourite scene", "--compare-reference",
            "--max-new-tokens", "3", "--json"]
    first = runner.invoke(app, args)
    assert first.exit_code == 0, first.output
    records = [json.loads(line) for line in first.stdout.splitlines()]
    assert [r["prompt"] for r in records] == ["The film opens with", "My favourite scene"]
    assert all({"policy", "reference"} <= r.keys() for r in records)
    # Sampling is seeded: the same command gives the same completions.
    assert runner.invoke(app, args).stdout == first.stdout
    other_seed = runner.invoke(app, [*args, "--seed", "123"])
    assert other_seed.exit_code == 0 and other_seed.stdout != first.stdout

    assert all(1 <= r["policy_tokens"] <= 3 and 1 <= r["reference_tokens"] <= 3 for r in records)

    plain = runner.invoke(app, ["generate", str(finished_run), "The film opens with"])
    assert plain.exit_code == 0 and plain.stdout.startswith("prompt: The film opens with\n  policy: ")
    assert "reference:" not in plain.stdout

    # Each prompt's own count: three responses of at most 2 tokens (every one has its first token).
    three = runner.invoke(app, ["generate", str(finished_run), "A", "B", "C", "--max-new-tokens", "2", "--json"])
    assert [1 <= json.loads(line)["policy_tokens"] <= 2 for line in three.stdout.splitlines()] == [True] * 3


def test_bad_sources_and_options_fail_in_one_line(finished_run, tmp_path):
    cases = [
        (["eval", str(tmp_path)], "no complete checkpoint"),
        (["eval", str(tmp_path / "missing")], "checkpoint not found"),
        (["eval", str(finished_run), "--samples", "0"], "--samples must be >= 1"),
        (["eval", str(finished_run), "--prompts", str(tmp_path / "none.txt")], "--prompts"),
        # Refused before the minutes of evaluating: a folder crashed the write at the end, and a file
        # of the run was replaced by the records (a checkpoint's adapter_config.json, metrics.jsonl).
        (["eval", str(finished_run), "--out", str(tmp_path)], f"--out: {tmp_path} is a folder; name the file"),
        (["eval", str(finished_run), "--out", str(finished_run / "final" / "policy" / "adapter_config.json")],
         f"is a file of the run {finished_run}; name one outside its records"),
        (["eval", str(finished_run), "--out", str(finished_run / "eval_after.jsonl")], "is a file of the run"),
        (["generate", str(finished_run), "x", "--max-new-tokens", "0"], "--max-new-tokens must be >= 1"),
        # past 2**63 torch.manual_seed raised an overflow traceback; below 0 train.seed is refused too
        (["generate", str(finished_run), "x", "--seed", str(2**64)], f"--seed must be in [0, 2**63), got {2**64}"),
        (["generate", str(finished_run), "x", "--seed", "-1"], "--seed must be in [0, 2**63), got -1"),
        (["generate", str(finished_run), ""], "generate: a prompt is empty"),
    ]
    for args, expected in cases:
        result = runner.invoke(app, args)
        assert result.exit_code == 2, (args, result.output)
        assert expected in result.stderr and len(result.stderr.strip().splitlines()) == 1, (args, result.stderr)


def test_saved_adapters_name_their_base_model_portably(finished_run):
    # The path the recipe gave (a hub id when it gave one), never a cache folder of this machine.
    model = yaml.safe_load((finished_run / "recipe.yaml").read_text())["model"]["name"]
    for role in ("policy", "value"):
        config = json.loads((finished_run / "final" / role / "adapter_config.json").read_text())
        assert config["base_model_name_or_path"] == model


def test_the_builtin_model_is_named_by_its_hub_id():
    from lora_ppo.builtin_model import BUILTIN_MODELS, BUILTIN_PREFIX, portable_name

    for key, builtin in BUILTIN_MODELS.items():
        assert portable_name(BUILTIN_PREFIX + key) == builtin.hub_id
        assert "/" in builtin.hub_id and not builtin.hub_id.startswith(("/", "."))
    assert portable_name("Qwen/Qwen2.5-0.5B-Instruct") == "Qwen/Qwen2.5-0.5B-Instruct"


def test_a_run_on_conversations_formats_later_text_prompts_in_its_chat_template(tmp_path, tiny_model_dir,
                                                                                monkeypatch):
    """A run trained on `messages` (data.chat_template left false): `generate`'s text prompts and
    export's parity probes go through the chat template as its training prompts did, not as raw
    text (which gave empty answers)."""
    import lora_ppo
    from lora_ppo.parity import PROBE_PROMPTS, probe_ids
    from lora_ppo.rollout import Sampler
    from lora_ppo.trained import generate, load_trained
    from tests.conftest import tiny_recipe_dict

    source = tmp_path / "chats.jsonl"
    source.write_text("".join(json.dumps({"messages": [{"role": "user", "content": f"Ticket {i}"}]}) + "\n"
                              for i in range(10)), encoding="utf-8")  # 2 held out: a fifth
    d = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data={"source": str(source), "prompt_column": "messages",
                                                                   "eval_size": 2}, train={"steps": 1, "eval": False})
    lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(d), progress=False).train()

    trained = load_trained(tmp_path / "run")
    assert trained.conversational and not trained.recipe.data.chat_template
    # From Python it is the whole run by default: its held-out prompts and its reward.
    assert len(trained.parts.eval_prompts.rows) == 2 and trained.parts.rewards.sources
    seen = []
    real = Sampler.sample

    def spy(self, rows, *args, **kwargs):
        seen.extend(row.text for row in rows)
        return real(self, rows, *args, **kwargs)

    monkeypatch.setattr(Sampler, "sample", spy)
    generate(trained, ["Where is my parcel?"], max_new_tokens=2)
    assert seen == ["<|im_start|>user\nWhere is my parcel?<|im_end|>\n<|im_start|>assistant\n"]

    tokenizer = trained.parts.tokenizer
    probes = [tokenizer.decode(ids) for ids in probe_ids(tokenizer, trained.recipe.data, conversational=True)]
    assert probes[0] == f"<|im_start|>user\n{PROBE_PROMPTS[0]}<|im_end|>\n<|im_start|>assistant\n"


def _run_on_a_prompts_file(tmp_path, model_dir, rows=None, **data) -> tuple:
    """A 1-step run whose prompts come from a file of its own: (run folder, the file)."""
    import lora_ppo
    from tests.conftest import tiny_recipe_dict

    source = tmp_path / "prompts.jsonl"
    rows = rows or [{"prompt": f"The film number {i} was"} for i in range(8)]
    source.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    d = tiny_recipe_dict(model_dir, tmp_path / "run", data={"source": str(source), "eval_size": 2, **data},
                         train={"steps": 1, "eval": False})
    lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(d), progress=False).train()
    return tmp_path / "run", source


def test_a_run_copied_without_its_data_or_reward_code_still_generates_and_evaluates_other_prompts(
        tmp_path, tiny_model_dir):
    """A run folder taken to a machine without its prompts file, or without the module of its
    reward function: `generate` needs neither and samples the same completions; `eval --prompts`
    needs the reward alone; `eval` of the held-out prompts needs the data and says so."""
    run, source = _run_on_a_prompts_file(tmp_path, tiny_model_dir)
    args = ["generate", str(run), "The film opens with", "My favourite scene", "--compare-reference", "--json"]
    before = runner.invoke(app, args)
    assert before.exit_code == 0, before.output

    others = tmp_path / "others.jsonl"
    others.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("A quiet drama", "The sequel")),
                      encoding="utf-8")
    source.unlink()
    recipe_file = run / "recipe.yaml"
    recipe = yaml.safe_load(recipe_file.read_text())
    recipe["reward"]["function"] = "module_not_on_this_machine:score"
    recipe_file.write_text(yaml.safe_dump(recipe))

    after = runner.invoke(app, args)
    assert after.exit_code == 0, after.output
    assert after.stdout == before.stdout  # the same policy and reference, sampled with the same seed

    no_reward = runner.invoke(app, ["eval", str(run), "--prompts", str(others), "--json", "--no-progress"])
    assert no_reward.exit_code == 2 and "module_not_on_this_machine" in no_reward.stderr
    assert len(no_reward.stderr.strip().splitlines()) == 1, no_reward.stderr

    recipe["reward"]["function"] = "tests.reward_fns:count_letter_e"
    recipe_file.write_text(yaml.safe_dump(recipe))
    records = tmp_path / "records.jsonl"
    scored = runner.invoke(app, ["eval", str(run), "--prompts", str(others), "--out", str(records), "--json",
                                 "--no-progress"])
    assert scored.exit_code == 0, scored.output
    lines = [json.loads(line) for line in records.read_text().splitlines()]
    assert [r["prompt"] for r in lines] == ["A quiet drama", "The sequel"]
    by_hand = [float(r["completion"].count("e")) for r in lines]  # tests.reward_fns.count_letter_e
    assert [r["score"] for r in lines] == by_hand
    assert json.loads(scored.stdout)["score"] == sum(by_hand) / 2

    held_out = runner.invoke(app, ["eval", str(run), "--no-progress"])
    assert held_out.exit_code == 2 and f"data.source: file not found: {source}" in held_out.stderr


def test_eval_prompts_without_the_column_the_reward_reads_is_one_line_naming_both(tmp_path, tiny_model_dir):
    """A verifiable reward reads its answers from the --prompts file too: a file without that
    column is refused by name, not as a KeyError from inside the reward."""
    source = tmp_path / "qa.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"{i} + 1 =", "answer": str(i + 1)}) + "\n" for i in range(8)),
                      encoding="utf-8")
    import lora_ppo
    from tests.conftest import tiny_recipe_dict

    d = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data={"source": str(source), "eval_size": 2},
                         reward={"kind": "exact_match", "answer_column": "answer", "function": None},
                         train={"steps": 1, "eval": False})
    lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(d), progress=False).train()
    questions = tmp_path / "questions.txt"
    questions.write_text("2 + 2 =\n3 + 3 =\n", encoding="utf-8")

    result = runner.invoke(app, ["eval", str(tmp_path / "run"), "--prompts", str(questions), "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: reward.answer_column: column 'answer' not in '{questions}' "
                                     "(columns besides the prompt: none)")


def test_a_run_on_conversations_read_without_its_prompts_still_knows_it_trained_on_them(tmp_path, tiny_model_dir,
                                                                                         caplog):
    """Loaded without its prompt sets (as `generate` loads it), a run on `messages` still formats
    text prompts in the chat template, read off its data's first row; with the data gone, by
    data.chat_template alone, and it says so."""
    from lora_ppo.trained import load_trained

    chats = [{"messages": [{"role": "user", "content": f"Ticket {i}"}]} for i in range(8)]
    run, source = _run_on_a_prompts_file(tmp_path, tiny_model_dir, chats, prompt_column="messages")
    trained = load_trained(run, with_prompts=False, with_rewards=False)
    assert trained.conversational and not trained.parts.train_prompts.rows and not trained.parts.rewards.sources
    source.unlink()
    with caplog.at_level("WARNING"):
        assert load_trained(run, with_prompts=False, with_rewards=False).conversational is False
    assert "text prompts are formatted by data.chat_template alone" in caplog.text


def test_new_tokens_or_prompts_past_the_models_context_are_refused_in_one_line_not_a_crash(tmp_path, caplog):
    """GPT-2's positions are a table of 256 rows here: a prompt and its new tokens past it crashed
    generate with an IndexError inside the embedding. The room a prompt has is the context less
    the new tokens; at the edge it samples, past it generate refuses in one line and eval --prompts
    leaves the long prompt out, saying so."""
    import lora_ppo
    from tests.architectures import build_model
    from tests.conftest import build_tiny_tokenizer, tiny_recipe_dict

    model_dir = tmp_path / "gpt2"
    model_dir.mkdir()
    tokenizer = build_tiny_tokenizer(model_dir)
    build_model("gpt2", model_dir, len(tokenizer))
    context = 256  # tests.architectures' n_positions for gpt2
    run = tmp_path / "run"
    lora_ppo.PPOTrainer(lora_ppo.recipe_from_dict(
        tiny_recipe_dict(model_dir, run, train={"steps": 1, "eval": False})), progress=False).train()
    prompt = "The film was"
    prompt_tokens = len(tokenizer(prompt)["input_ids"])

    edge = runner.invoke(app, ["generate", str(run), prompt, "--max-new-tokens", str(context - prompt_tokens),
                               "--json", "--seed", "3"])
    assert edge.exit_code == 0, edge.output
    assert 1 <= json.loads(edge.stdout)["policy_tokens"] <= context - prompt_tokens

    cases = [
        (str(context - prompt_tokens + 1),
         f"error: generate: a prompt has more than {prompt_tokens - 1} tokens (the model's context of {context} "
         f"tokens less {context - prompt_tokens + 1} new ones)"),
        (str(context), f"error: --max-new-tokens: {context} new tokens leave no room for a prompt in the model's "
                       f"context of {context} tokens"),
    ]
    for new_tokens, message in cases:
        result = runner.invoke(app, ["generate", str(run), prompt, "--max-new-tokens", new_tokens])
        assert result.exit_code == 2 and result.stderr.strip() == message, result.output

    prompts = tmp_path / "prompts.txt"
    prompts.write_text("word " * 300 + "\nA short one\n", encoding="utf-8")
    records = tmp_path / "records.jsonl"
    with caplog.at_level("WARNING"):
        result = runner.invoke(app, ["eval", str(run), "--prompts", str(prompts), "--out", str(records),
                                     "--no-progress"])
    assert result.exit_code == 0, result.output
    assert [json.loads(line)["prompt"] for line in records.read_text().splitlines()] == ["A short one"]
    assert (f"1 of the prompts in {prompts} have more than {context - 6} tokens and are left out (the model's "
            f"context of {context} tokens less 6 new ones)") in caplog.text  # tiny_recipe_dict's max_new_tokens


def test_eval_records_that_cannot_be_written_are_one_line(finished_run, tmp_path, monkeypatch):
    """A disk that fills up while the records are written: one line, exit 2, no traceback."""
    import errno

    from lora_ppo import run_dir

    def full(path, text):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(run_dir, "write_file_atomically", full)
    out = tmp_path / "records.jsonl"
    result = runner.invoke(app, ["eval", str(finished_run), "--out", str(out), "--no-progress"])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: --out: cannot write {out}: No space left on device"


def test_the_room_a_prompt_has_is_the_context_less_the_new_tokens_and_at_most_4096(tmp_path):
    """From the model's config alone: a context of 10,000 tokens leaves a prompt 4,096 (the cap on
    prompts given after training, whatever the model); 256 leaves 256 less the new tokens; a model
    without a position table (Bloom's ALiBi) has the cap alone. Each refusal says which bound it was."""
    from types import SimpleNamespace

    from transformers import BloomConfig, LlamaConfig

    from lora_ppo.config import ModelConfig
    from lora_ppo.errors import RecipeError
    from lora_ppo.trained import _room_reason, prompt_room

    def trained_on(config) -> SimpleNamespace:
        folder = tmp_path / type(config).__name__ / str(getattr(config, "max_position_embeddings", "none"))
        config.save_pretrained(folder)
        return SimpleNamespace(recipe=SimpleNamespace(model=ModelConfig(name=str(folder))))

    wide = trained_on(LlamaConfig(max_position_embeddings=10_000))
    assert prompt_room(wide, 100, "rollout.max_new_tokens") == 4096
    assert _room_reason(wide, 4096) == "the limit on prompts given after training"
    narrow = trained_on(LlamaConfig(max_position_embeddings=256))
    assert prompt_room(narrow, 6, "rollout.max_new_tokens") == 250
    assert _room_reason(narrow, 250) == "the model's context of 256 tokens less 6 new ones"
    with pytest.raises(RecipeError, match=r"^--max-new-tokens: 256 new tokens leave no room for a prompt in the "
                                          r"model's context of 256 tokens$"):
        prompt_room(narrow, 256, "--max-new-tokens")
    alibi = trained_on(BloomConfig())
    assert prompt_room(alibi, 10_000, "--max-new-tokens") == 4096
    assert _room_reason(alibi, 4096) == "the limit on prompts given after training"


def test_eval_records_may_go_beside_the_run_and_by_a_run_files_name_elsewhere(finished_run, tmp_path):
    """Only the run's own files are refused: a file of one's own in the run folder, or a file named
    metrics.jsonl anywhere else, takes the records."""
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    for out in (run / "heldout_records.jsonl", tmp_path / "metrics.jsonl"):
        result = runner.invoke(app, ["eval", str(run), "--out", str(out), "--no-progress"])
        assert result.exit_code == 0, result.output
        assert len(out.read_text().splitlines()) == 4  # tiny_recipe_dict's eval_size, one sample each
