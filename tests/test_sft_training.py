"""`lora-ppo train-sft` on the tiny 4-bit model: the held-out loss falls; the run folder, metrics,
samples and checkpoints behave like the other stages', and a resumed run ends where an uninterrupted
one does; the adapter is a plain PEFT folder that PPO starts from (its step-1 KL to it is 0), that
`merge-and-export` merges and `report` shows; hostile data is one line and exit 2."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.config import SFTRecipe, recipe_from_dict
from lora_ppo.sft.trainer import SFTTrainer
from tests.conftest import adapter_tensors, deterministic_metrics, tiny_recipe_dict
from tests.sft_helpers import demonstration_rows, nll_by_hand, sft_recipe_dict, write_jsonl


@pytest.fixture(scope="session")
def sft_data(tmp_path_factory) -> tuple[Path, Path]:
    root = tmp_path_factory.mktemp("sft-data")
    return (write_jsonl(root / "train.jsonl", demonstration_rows(32)),
            write_jsonl(root / "held_out.jsonl", demonstration_rows(8, start=1000)))


@pytest.fixture(scope="session")
def sft_run(tiny_model_dir, sft_data, tmp_path_factory) -> Path:
    """A trained tiny SFT adapter: 32 rows, 2 epochs of 4 steps, packed. Read-only."""
    out = tmp_path_factory.mktemp("sft-run") / "run"
    recipe = recipe_from_dict(sft_recipe_dict(tiny_model_dir, *sft_data, out, sft={"packing": True}),
                              schema=SFTRecipe)
    SFTTrainer(recipe, progress=False).train()
    return out


def test_the_held_out_loss_falls_and_the_run_folder_says_so(sft_run):
    summary = json.loads((sft_run / "summary.json").read_text())
    assert summary["steps"] == 8 and summary["train_rows"] == 32 and summary["heldout_rows"] == 8
    assert summary["heldout_loss_after"] < summary["heldout_loss_before"] - 1.0
    assert summary["heldout_perplexity_after"] == pytest.approx(torch.tensor(summary["heldout_loss_after"]).exp().item())
    metrics = [json.loads(line) for line in (sft_run / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, 9))
    assert "sft/eval_loss" in metrics[3] and "sft/eval_loss" not in metrics[4]
    # The held-out curve ends where the run does, at the summary's "after".
    assert metrics[-1]["sft/eval_loss"] == summary["heldout_loss_after"]
    assert all(0.0 <= m["sft/padding_frac"] < 1.0 and m["sft/target_tokens"] > 0 for m in metrics)
    before = [json.loads(line) for line in (sft_run / "eval_before.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (sft_run / "eval_after.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in before] == [r["prompt"] for r in after] == \
        [row["prompt"] for row in demonstration_rows(4, start=1000)]
    assert after[0]["reference"] == demonstration_rows(1, start=1000)[0]["completion"]


def test_a_loss_too_large_for_a_perplexity_still_logs_a_finite_one():
    """A diverged run's loss (here 10,000 nats) must not overflow exp() and stop the run."""
    import math

    from lora_ppo.sft.trainer import perplexity

    assert perplexity(2.0) == math.exp(2.0)
    assert math.isfinite(perplexity(1e4)) and perplexity(1e4) == perplexity(800.0) > 1e20


def test_held_out_loss_and_samples_are_each_rows_own_by_hand(tmp_path, tiny_model_dir, sft_data, caplog):
    """8 held-out rows scored 3 at a time: the loss is the mean negative log-likelihood of every
    completion token, from a plain forward of one row at a time; the samples of the first 5 rows,
    generated 3 at a time, are each prompt's greedy continuation one token at a time, cut at the
    stop token or after data.eval_max_new_tokens."""
    import logging

    from tests.conftest import perturb_lora_b

    recipe = sft_recipe_dict(tiny_model_dir, *sft_data, tmp_path / "run")
    recipe["data"].update(eval_batch_size=3, eval_samples=5, eval_max_new_tokens=6)
    trainer = SFTTrainer(recipe_from_dict(recipe, schema=SFTRecipe), progress=False)
    perturb_lora_b(trainer.model, "policy", seed=5, scale=0.3)
    model, tokenizer, rows = trainer.model, trainer.tokenizer, trainer.eval_rows.rows
    assert len(rows) == 8
    total, count = nll_by_hand(model, tokenizer, rows)
    greedy = []
    with torch.no_grad():
        for row in rows[:5]:
            tokens = list(row.prompt_ids)
            for _ in range(6):
                tokens.append(int(model.peft(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
                if tokens[-1] == tokenizer.eos_token_id:
                    break
            greedy.append(tokenizer.decode(tokens[len(row.prompt_ids):], skip_special_tokens=True))
    with caplog.at_level(logging.INFO, logger="lora_ppo.progress"):
        scores = trainer.evaluate()
    assert scores["loss"] == pytest.approx(total / count, rel=1e-5)
    assert scores["perplexity"] == pytest.approx(torch.tensor(total / count).exp().item(), rel=1e-5)
    assert [r.getMessage().split(" (")[0] for r in caplog.records if r.name == "lora_ppo.progress"] == \
        ["held-out: 0/8 rows", "held-out: 3/8 rows", "held-out: 6/8 rows", "held-out: 8/8 rows"]
    trainer.write_samples(tmp_path / "samples.jsonl")
    records = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["prompt"] for r in records] == [row.prompt for row in rows[:5]]
    assert [r["completion"] for r in records] == greedy
    assert [r["reference"] for r in records] == [row.completion for row in rows[:5]]


def test_the_closing_lines_round_the_numbers_and_say_n_a_without_held_out_rows():
    from lora_ppo.sft.trainer import format_sft_summary

    summary = {"heldout_loss_before": 2.34567, "heldout_loss_after": 1.23449, "heldout_perplexity_before": 10.4399,
               "heldout_perplexity_after": 3.43671, "heldout_rows": 8, "wall_time_s": 12.4, "peak_memory_gb": 1.2345,
               "adapter": "runs/sft/final/policy", "output_dir": "runs/sft"}
    assert format_sft_summary(summary).splitlines() == [
        "held-out loss: 2.346 -> 1.234 (perplexity 10.44 -> 3.44, 8 rows)",
        "wall time: 12 s, peak memory: 1.23 GB",
        "adapter: runs/sft/final/policy (PPO starts from it with adapters.policy.init_from: runs/sft)",
    ]
    no_held_out = {k: v for k, v in summary.items() if not k.startswith("heldout_")} | {"heldout_rows": 0}
    assert format_sft_summary(no_held_out).splitlines()[0] == "held-out loss: n/a -> n/a (perplexity n/a -> n/a, 0 rows)"


def test_the_adapter_is_a_plain_peft_folder(sft_run, tiny_model_dir):
    """PeftModel.from_pretrained loads final/policy onto the base model as any PEFT adapter, and it
    computes what the run's model computed (on the 4-bit kernel training used: bitsandbytes'
    inference kernel rounds differently)."""
    from peft import PeftModel

    from lora_ppo.bnb_workarounds import eval_on_training_kernel
    from lora_ppo.config import ModelConfig, SFTAdapterSettings
    from lora_ppo.model import load_base_model
    from lora_ppo.sft.model import SFTModel

    folder = sft_run / "final" / "policy"
    config = json.loads((folder / "adapter_config.json").read_text())
    assert config["peft_type"] == "LORA" and config["r"] == 4
    loaded = PeftModel.from_pretrained(load_base_model(ModelConfig(name=str(tiny_model_dir))), str(folder))
    eval_on_training_kernel(loaded)
    ours = SFTModel(load_base_model(ModelConfig(name=str(tiny_model_dir))),
                    SFTAdapterSettings(init_from=str(sft_run)))
    ids = torch.tensor([[5, 9, 17, 33, 60]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(input_ids=ids).logits, ours.peft(input_ids=ids).logits)
    trained = adapter_tensors(folder)
    assert any("lora_B" in k and t.abs().sum() > 0 for k, t in trained.items())  # lora_B starts at zero


def test_resume_mid_run_ends_as_an_uninterrupted_run(tmp_path, tiny_model_dir, sft_data, monkeypatch):
    def recipe(out):
        return recipe_from_dict(sft_recipe_dict(tiny_model_dir, *sft_data, out, epochs=1, batch_size=4, save_every=3,
                                                eval_every=0, lr_schedule="linear", learning_rate=1e-2),
                                schema=SFTRecipe)

    SFTTrainer(recipe(tmp_path / "whole"), progress=False).train()
    real_step = SFTTrainer.train_step

    def killed_in_step_5(self):
        metrics = real_step(self)
        if self.state.step == 5:  # step 5 done, past the checkpoint of step 3: lost
            raise KeyboardInterrupt
        return metrics

    monkeypatch.setattr(SFTTrainer, "train_step", killed_in_step_5)
    with pytest.raises(KeyboardInterrupt):
        SFTTrainer(recipe(tmp_path / "parts"), progress=False).train()
    monkeypatch.undo()
    assert (tmp_path / "parts" / "checkpoints" / "step-3").is_dir()
    SFTTrainer(recipe(tmp_path / "parts"), progress=False, resume="auto").train()
    whole, parts = (adapter_tensors(tmp_path / run / "final" / "policy") for run in ("whole", "parts"))
    assert whole.keys() == parts.keys() and all(torch.equal(whole[k], parts[k]) for k in whole)
    assert deterministic_metrics(tmp_path / "parts") == deterministic_metrics(tmp_path / "whole")
    assert len(deterministic_metrics(tmp_path / "whole")) == 8


def test_ctrl_c_saves_a_checkpoint_after_the_step_and_says_how_to_resume(tmp_path, tiny_model_dir, sft_data,
                                                                        monkeypatch):
    """The first Ctrl-C (SIGINT, sent here from inside step 2) lets the step finish, saves
    checkpoints/step-2 and exits 130 with the command that resumes; eval and generate refuse the run
    in one line."""
    import os
    import signal

    real_step = SFTTrainer.train_step

    def interrupted_in_step_2(self):
        if self.state.step == 1:
            os.kill(os.getpid(), signal.SIGINT)
        return real_step(self)

    monkeypatch.setattr(SFTTrainer, "train_step", interrupted_in_step_2)
    recipe = tmp_path / "sft.yaml"
    recipe.write_text(yaml.safe_dump(sft_recipe_dict(tiny_model_dir, *sft_data, tmp_path / "run", eval_every=0)))
    result = CliRunner().invoke(app, ["train-sft", str(recipe), "--no-progress"])
    assert result.exit_code == 130, result.output
    assert "stopping after this step to save a checkpoint (again to abandon the step)" in result.stderr
    assert "interrupted at step 2: checkpoint saved to" in result.stderr
    assert f"resume with: lora-ppo train-sft {recipe} --resume auto" in result.stderr
    assert (tmp_path / "run" / "checkpoints" / "step-2" / "manifest.json").is_file()
    refused = CliRunner().invoke(app, ["eval", str(tmp_path / "run" / "checkpoints" / "step-2")])
    assert refused.exit_code == 2 and refused.stderr.strip().endswith("generate takes it, eval takes a PPO run")


def test_generate_samples_an_sft_run_greedily_as_its_report_does(sft_run):
    """`lora-ppo generate` on an SFT run (it refused: "eval and generate take a PPO run"): the
    adapter's greedy answers, which the run's own after-samples are (checked token by token
    against a plain forward above), and with --compare-reference the bare base's, which its
    before-samples are (the fresh adapter adds nothing)."""
    before = [json.loads(line) for line in (sft_run / "eval_before.jsonl").read_text().splitlines()]
    after = [json.loads(line) for line in (sft_run / "eval_after.jsonl").read_text().splitlines()]
    prompts = [record["prompt"] for record in after]
    result = CliRunner().invoke(app, ["generate", str(sft_run), *prompts, "--compare-reference", "--json"])
    assert result.exit_code == 0, result.stderr
    records = [json.loads(line) for line in result.stdout.splitlines()]
    assert [r["policy"] for r in records] == [r["completion"] for r in after]
    assert [r["reference"] for r in records] == [r["completion"] for r in before]
    assert [r["policy"] for r in records] != [r["reference"] for r in records]  # SFT changed the answers


@pytest.mark.parametrize("rows, data, expected", [
    ([{"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}], {}, True),
    ([{"prompt": "hi", "completion": " yo"}], {}, False),
    ([{"prompt": "hi", "completion": " yo"}], {"chat_template": True}, True),
    ([{"prompt": [{"role": "user", "content": "hi"}], "completion": [{"role": "assistant", "content": "yo"}]}],
     {}, True),
    ([{"text": "hi yo"}], {}, False),
    ([{"chat": [{"role": "user", "content": "hi"}]}], {"messages_column": "chat"}, True),
])
def test_an_sft_runs_prompts_are_read_as_conversations_where_it_trained_on_them(tmp_path, rows, data, expected):
    from lora_ppo.config import SFTDataConfig
    from lora_ppo.trained import sft_on_conversations

    source = write_jsonl(tmp_path / "d.jsonl", rows)
    assert sft_on_conversations(SFTDataConfig(source=str(source), **data)) is expected


def test_an_sft_run_whose_data_is_gone_formats_prompts_by_its_chat_template_setting(tmp_path, caplog):
    from lora_ppo.config import SFTDataConfig
    from lora_ppo.trained import sft_on_conversations

    gone = str(tmp_path / "gone.jsonl")
    assert sft_on_conversations(SFTDataConfig(source=gone)) is False
    assert "file not found" in caplog.text
    assert sft_on_conversations(SFTDataConfig(source=gone, chat_template=True)) is True
    assert sft_on_conversations(SFTDataConfig(source=gone, format="messages")) is True


def test_trackers_and_counted_long_rows(tmp_path, tiny_model_dir, sft_data, caplog):
    """train.report_to sends the steps to TensorBoard, as a PPO run's; truncated rows are counted in
    the log, never silently."""
    import logging

    rows = demonstration_rows(16) + [{"prompt": "Review 99: the film was", "completion": " great and" * 30}]
    data = write_jsonl(tmp_path / "d.jsonl", rows)
    recipe = sft_recipe_dict(tiny_model_dir, data, sft_data[1], tmp_path / "run", epochs=1,
                             report_to=["tensorboard"])
    recipe["data"]["too_long"] = "truncate"
    with caplog.at_level(logging.WARNING, logger="lora_ppo.sft.trainer"):
        SFTTrainer(recipe_from_dict(recipe, schema=SFTRecipe), progress=False).train()
    assert f"truncated 1 training rows from {data} to data.max_length (48 tokens)" in caplog.text
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    board = EventAccumulator(str(tmp_path / "run" / "tensorboard" / "run"))  # tensorboard/<run name>/
    board.Reload()
    metrics = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    for key in ("sft/loss", "lr"):
        assert [(e.step, e.value) for e in board.Scalars(key)] == \
            [(m["step"], pytest.approx(m[key], rel=1e-6)) for m in metrics]


@pytest.mark.parametrize("reference", ["auto", "run"])
def test_ppo_starts_from_the_sft_run_and_its_first_kl_to_it_is_zero(tmp_path, tiny_model_dir, sft_run, reference):
    """adapters.policy.init_from (and adapters.reference) name the SFT run folder: the policy and the
    frozen reference are its final/policy adapter, so the first step's KL is 0."""
    import lora_ppo
    from lora_ppo.roles import POLICY, REFERENCE

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "ppo", adapters={"policy": {"init_from": str(sft_run)},
                                                    "reference": "auto" if reference == "auto" else str(sft_run)},
        rollout={"logprobs_from_generation": False}, train={"steps": 1, "eval": False}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    sft = adapter_tensors(sft_run / "final" / "policy")
    for role in (POLICY, REFERENCE):
        weights = {n.replace(f".{role}.", "."): p for n, p in trainer.roles.peft.named_parameters() if f".{role}." in n}
        assert len(weights) == len(sft)
        for name, tensor in sft.items():
            key = name.replace("base_model.model.", "").replace(".weight", "")
            match = [p for n, p in weights.items() if n.endswith(key + ".weight")]
            assert len(match) == 1 and torch.equal(match[0].detach().cpu(), tensor), name
    trainer.train()
    first = json.loads((tmp_path / "ppo" / "metrics.jsonl").read_text().splitlines()[0])
    assert abs(first["objective/kl"]) < 1e-5


def test_merge_and_export_merges_an_sft_run(sft_run, tmp_path):
    from lora_ppo.export import merge_and_export

    report = merge_and_export(sft_run, tmp_path / "merged")
    assert report.parity.passed and (tmp_path / "merged" / "config.json").is_file()
    assert "# SFT-trained policy, merged" in (tmp_path / "merged" / "README.md").read_text()


def test_report_shows_the_loss_and_the_samples_before_and_after(sft_run, tmp_path):
    import html
    import shutil

    from lora_ppo.report import plots_for, write_report
    from lora_ppo.run_dir import read_jsonl

    run = tmp_path / "run"
    shutil.copytree(sft_run, run)
    page = write_report(run).read_text()
    names = [p.name for p in plots_for(read_jsonl(run / "metrics.jsonl"))]
    assert names == ["sft_loss", "sft_perplexity", "sft_throughput"]
    summary = json.loads((run / "summary.json").read_text())
    assert f"{summary['heldout_loss_before']:.3f}" in page and f"{summary['heldout_loss_after']:.3f}" in page
    after = json.loads((run / "eval_after.jsonl").read_text().splitlines()[0])
    assert demonstration_rows(1, start=1000)[0]["prompt"] in page and after["completion"] in page
    # The dataset's answer beside the samples, and no score columns (an SFT sample has none).
    assert "<th>reference</th>" in page and html.escape(after["reference"]) in page
    assert "<th>score</th>" not in page


def _write(tmp_path: Path, model_dir: Path, rows, suffix: str = ".jsonl", **data) -> Path:
    source = tmp_path / f"d{suffix}"
    if isinstance(rows, bytes):
        source.write_bytes(rows)
    else:
        write_jsonl(source, rows)
    recipe = sft_recipe_dict(model_dir, source, source, tmp_path / "run")
    recipe["data"].update(data)
    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump(recipe))
    return path


HOSTILE = {
    "empty completions": ([{"prompt": "a", "completion": ""}, {"prompt": "b", "completion": "  "}], {},
                          r"data.source: no usable rows in '{source}' \(2 empty\)$"),
    "rows longer than the context": (demonstration_rows(4), {"max_length": 1000},
                                     r"data.max_length: rows of up to 1000 tokens exceed the model's context of 256 "
                                     r"tokens$"),
    "a row longer than max_length, refused": (demonstration_rows(2) + [{"prompt": "x", "completion": " good" * 60}],
                                              {"too_long": "error"},
                                              r"data.max_length: row 2 of '{source}' has \d+ tokens, more than 48 "
                                              r"\(data.too_long: error"),
    "rows longer than max_length, dropped": ([{"prompt": "x", "completion": " good" * 60}], {},
                                             r"data.source: no usable rows in '{source}' \(1 too_long\)$"),
    "missing columns": ([{"question": "a", "answer": "b"}], {},
                        r"data.format: auto finds neither a 'messages' column.* \(columns: question, answer\)"),
    "not UTF-8": (b'{"prompt": "a", "completion": "b"}\n{"prompt": "\xff\xfe"}\n', {},
                  r"data.source: {source} line 2: not UTF-8 text \(byte 0xff at column 13\)$"),
}


@pytest.mark.parametrize("case", list(HOSTILE), ids=str)
def test_hostile_data_is_one_line_and_exit_2(tmp_path, tiny_model_dir, case):
    rows, data, message = HOSTILE[case]
    recipe = _write(tmp_path, tiny_model_dir, rows, **data)
    result = CliRunner().invoke(app, ["train-sft", str(recipe), "--no-progress"])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and re.match("error: " + message.format(source=re.escape(str(tmp_path / "d.jsonl"))),
                                        lines[0]), lines
    assert not (tmp_path / "run").exists()  # nothing half-written


def test_train_again_on_a_finished_trainer_is_refused_and_leaves_its_run_where_it_is(tmp_path, tiny_model_dir,
                                                                                     sft_data):
    """As PPO's: a second train() would have moved the trainer's own finished run aside."""
    trainer = SFTTrainer(recipe_from_dict(sft_recipe_dict(tiny_model_dir, *sft_data, tmp_path / "run", eval_every=0),
                                          schema=SFTRecipe), progress=False)
    trainer.train()
    before = sorted((str(p.relative_to(tmp_path)), p.stat().st_size) for p in tmp_path.rglob("*"))
    with pytest.raises(RuntimeError, match=r"has started already; to go on, make a new trainer with resume='auto'"):
        trainer.train()
    assert sorted((str(p.relative_to(tmp_path)), p.stat().st_size) for p in tmp_path.rglob("*")) == before
