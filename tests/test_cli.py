"""The `lora-ppo` command: bad recipes fail in one line with exit 2 and write nothing; a tiny
recipe trains end to end and writes every output a user reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app
from tests.conftest import tiny_recipe_dict

REPO = Path(__file__).resolve().parents[1]
runner = CliRunner()


def _write(path: Path, data) -> Path:
    path.write_text(yaml.safe_dump(data) if not isinstance(data, str) else data)
    return path


@pytest.mark.parametrize(
    "content, overrides, expected",
    [
        ({"ppo": {"clip_eps": -0.2}}, [], "ppo.clip_eps"),
        ({"ppo": {"clip_epz": 0.2}}, [], "ppo.clip_epz: unknown field"),
        ({"rollout": {"batch_size": 6}, "ppo": {"num_minibatches": 4}}, [], "rollout.batch_size (6)"),
        ({"reward": {"kind": "function"}}, [], "reward.function is required"),
        ({"model": {"quantization": "3bit"}}, [], "model.quantization"),
        ("model: [unclosed", [], "line 1"),
        ("- just\n- a list\n", [], "expected a mapping"),
        ({}, ["train.steps=zero"], "train.steps"),
        ({}, ["nonsense"], "expected key.path=value"),
    ],
)
def test_bad_recipe_is_one_line_exit_2(tmp_path, content, overrides, expected):
    recipe = _write(tmp_path / "bad.yaml", content)
    out_dir = tmp_path / "out"
    result = runner.invoke(app, ["train", str(recipe), *overrides, f"train.output_dir={out_dir}"])
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.output
    assert not out_dir.exists()


def test_missing_recipe_file(tmp_path):
    result = runner.invoke(app, ["train", str(tmp_path / "nope.yaml")])
    assert result.exit_code == 2
    assert result.stderr.strip() == f"error: recipe file not found: {tmp_path / 'nope.yaml'}"


def test_bad_model_path_and_data_fail_before_any_output(tmp_path, tiny_model_dir):
    recipe = tiny_recipe_dict(tmp_path / "no-model", tmp_path / "run")
    result = runner.invoke(app, ["train", str(_write(tmp_path / "r.yaml", recipe))])
    assert result.exit_code == 2 and "error:" in result.stderr and "Traceback" not in result.output
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data={"source": str(tmp_path / "missing.jsonl")})
    result = runner.invoke(app, ["train", str(_write(tmp_path / "r.yaml", recipe))])
    assert result.exit_code == 2
    assert result.stderr.strip().startswith("error: data.source: file not found")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("command, section", [("train", "adapters.policy"), ("train", "adapters.value"),
                                              ("train-sft", "adapter")])
def test_a_target_module_no_layer_has_is_one_line_and_exit_2(tmp_path, tiny_model_dir, command, section):
    from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl

    if command == "train":
        recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run")
    else:
        rows = write_jsonl(tmp_path / "d.jsonl", demonstration_rows(8))
        recipe = sft_recipe_dict(tiny_model_dir, rows, rows, tmp_path / "run")
    override = f"{section}.target_modules=[q_proj, qproj]"
    result = runner.invoke(app, [command, str(_write(tmp_path / "r.yaml", recipe)), override, "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip() == (f"error: {section}.target_modules: 'qproj' names no module of this model; its "
                                     "linear layers: down_proj, gate_proj, k_proj, o_proj, q_proj, up_proj, v_proj")
    assert not (tmp_path / "run").exists()


def test_empty_dataset_refuses_to_start(tmp_path, tiny_model_dir):
    data = tmp_path / "prompts.jsonl"
    data.write_text(json.dumps({"prompt": "   "}) + "\n" + json.dumps({"prompt": "word " * 200}) + "\n")
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", data={"source": str(data)})
    result = runner.invoke(app, ["train", str(_write(tmp_path / "r.yaml", recipe))])
    assert result.exit_code == 2
    assert "no usable prompts" in result.stderr and "1 empty" in result.stderr and "1 too_long" in result.stderr


def test_reward_function_with_wrong_count_names_the_function(tmp_path, tiny_model_dir):
    recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run", reward={"function": "tests.reward_fns:wrong_count"})
    recipe["train"]["eval"] = False
    result = runner.invoke(app, ["train", str(_write(tmp_path / "r.yaml", recipe))])
    assert result.exit_code == 1
    assert "wrong_count returned 1 scores for 4 completions" in result.stderr


def test_smoke_train_end_to_end_writes_every_output(tmp_path, tiny_model_dir, caplog):
    """Smoke test: `lora-ppo train` runs two steps in a subprocess and writes every file and metric key a user reads."""
    out = tmp_path / "run"
    recipe = _write(tmp_path / "tiny.yaml", tiny_recipe_dict(tiny_model_dir, out))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.run(
        [sys.executable, "-m", "lora_ppo.cli", "train", str(recipe), "train.steps=2", "--no-progress"],
        capture_output=True, text=True, env=env, cwd=REPO, timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "held-out mean score" in proc.stdout

    resolved = yaml.safe_load((out / "recipe.yaml").read_text())
    assert resolved["train"]["steps"] == 2 and resolved["ppo"]["clip_eps"] == 0.2
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    for key in [
        "objective/scores", "objective/kl", "objective/rlhf_reward", "policy/approxkl", "policy/clipfrac",
        "policy/entropy", "loss/policy", "loss/value", "value/explained_var", "time/generate",
        "time/score_forward", "time/update", "tokens_per_s", "memory/peak_gb",
        "memory/generate_gb", "memory/score_gb", "memory/update_gb", "perf/generate_tflops", "perf/score_tflops",
        "perf/update_tflops", "perf/generate_tokens_per_s",
    ]:
        assert key in metrics[0], key
    # Per-phase peaks are real resident memory: more than a process with torch loaded, each at
    # most the run's overall peak.
    for phase in ("generate", "score", "update"):
        assert 0.1 < metrics[0][f"memory/{phase}_gb"] <= metrics[0]["memory/peak_gb"] + 1e-6
    samples = [json.loads(line) for line in (out / "samples.jsonl").read_text().splitlines()]
    assert samples and {"step", "prompt", "completion", "score"} <= samples[0].keys()
    summary = json.loads((out / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["heldout_score_before"] is not None
    for role in ("policy", "value"):
        assert (out / "final" / role / "adapter_config.json").is_file()
        assert (out / "final" / role / "adapter_model.safetensors").is_file()
    assert (out / "final" / "value" / "value_head.safetensors").is_file()

    # A second run into the same folder is refused unless asked for; when asked, the first run is
    # moved aside whole, never deleted, and the message says where.
    again = runner.invoke(app, ["train", str(recipe), "train.overwrite=false"])
    assert again.exit_code == 2 and "already holds a run" in again.stderr
    first_metrics = (out / "metrics.jsonl").read_text()
    with caplog.at_level("WARNING"):
        again = runner.invoke(app, ["train", str(recipe), "train.overwrite=true", "train.steps=1", "train.eval=false"])
    assert again.exit_code == 0, again.output
    moved = [p for p in tmp_path.iterdir() if p.name.startswith("run.old-")]
    assert len(moved) == 1 and f"moved it to {moved[0]}" in caplog.text
    assert (moved[0] / "metrics.jsonl").read_text() == first_metrics
    assert (moved[0] / "final" / "policy" / "adapter_model.safetensors").is_file()
    assert len((out / "metrics.jsonl").read_text().splitlines()) == 1


def test_version():
    from lora_ppo import __version__

    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0 and result.stdout.strip() == f"lora-ppo {__version__}"


@pytest.mark.parametrize("args, expected", [
    (["trian", "r.yaml"], "error: No such command 'trian'. Did you mean 'train'? (lora-ppo --help)"),
    (["train"], "error: Missing argument 'recipe'. (lora-ppo train --help)"),
    (["train", "r.yaml", "--no-progres"],
     "error: No such option: --no-progres (Possible options: --no-progress, --num-processes) (lora-ppo train --help)"),
    (["estimate", "r.yaml", "--gpu-gb", "twelve"], "error: Invalid value for '--gpu-gb': "),
])
def test_a_command_line_that_does_not_parse_is_one_line_and_exit_2(args, expected):
    """As every other bad input, where typer draws a box of five lines under the usage."""
    result = runner.invoke(app, args, prog_name="lora-ppo")
    assert result.exit_code == 2
    assert len(result.stderr.splitlines()) == 1 and result.stderr.startswith(expected), result.stderr
    assert result.stdout == ""


def test_no_arguments_show_the_commands():
    result = runner.invoke(app, [])
    assert "train-sft" in result.stdout and "merge-and-export" in result.stdout


def test_misspelt_override_suggests_the_field(tmp_path):
    result = runner.invoke(app, ["validate", str(REPO / "recipes" / "quickstart.yaml"), "train.stpes=3"])
    assert result.exit_code == 2
    assert result.stderr.strip() == "error: train.stpes: unknown field (did you mean train.steps?)"


def test_validate_prints_resolved_recipe(tmp_path):
    result = runner.invoke(app, ["validate", str(REPO / "recipes" / "quickstart.yaml"), "ppo.kl_coef=0.2"])
    assert result.exit_code == 0
    assert yaml.safe_load(result.stdout)["ppo"]["kl_coef"] == 0.2
