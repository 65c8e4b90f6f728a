"""Adapter-only exports, clear errors for bad checkpoints and outputs, and the
`lora-ppo merge-and-export` exit codes: bad input 2, parity failure or write failure 1."""

from __future__ import annotations

import errno
import json
import os
import shutil
import stat

import pytest
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.errors import RecipeError
from lora_ppo.export import ExportError, merge_and_export

runner = CliRunner()


def _one_error_line(result, code: int, expected: str) -> None:
    assert result.exit_code == code, (result.output, result.stderr)
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and expected in lines[0], result.stderr
    assert "Traceback" not in result.output + result.stderr


# ---- adapter-only -----------------------------------------------------------------------------


@pytest.mark.parametrize("adapter, expected", [
    ("policy", {"adapter_config.json", "adapter_model.safetensors"}),
    ("value", {"adapter_config.json", "adapter_model.safetensors", "value_head.safetensors"}),
])
def test_adapter_only_copies_the_peft_folder(trained_run, tmp_path, adapter, expected):
    report = merge_and_export(trained_run, tmp_path / adapter, adapter=adapter, adapter_only=True)
    assert report.kind == "adapter" and report.parity is None
    assert report.files == tuple(sorted(expected | {"README.md"}))
    source = trained_run / "final" / adapter
    assert {p.name for p in (tmp_path / adapter).iterdir()} == expected | {"README.md"}
    for name in expected:
        assert (tmp_path / adapter / name).read_bytes() == (source / name).read_bytes()
    card = (tmp_path / adapter / "README.md").read_text()
    assert "library_name: peft" in card and "PeftModel.from_pretrained" in card


def test_adapter_only_copies_no_hidden_file_and_no_folder(run_copy, tmp_path):
    policy = run_copy / "final" / "policy"
    (policy / ".DS_Store").write_bytes(b"\0")  # what a file browser leaves behind
    (policy / "notes").mkdir()
    report = merge_and_export(run_copy, tmp_path / "policy", adapter_only=True)
    assert report.files == ("README.md", "adapter_config.json", "adapter_model.safetensors")
    assert sorted(p.name for p in (tmp_path / "policy").iterdir()) == list(report.files)


def test_adapter_only_policy_loads_with_peft(trained_run, tiny_model_dir, tmp_path):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    merge_and_export(trained_run, tmp_path / "policy", adapter_only=True)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    model = PeftModel.from_pretrained(base, str(tmp_path / "policy"))
    assert any("lora_B" in name for name, _ in model.named_parameters())


def test_critic_free_checkpoint_has_no_value_adapter(run_copy, tmp_path):
    shutil.rmtree(run_copy / "final" / "value")  # what an rloo/grpo run saves
    with pytest.raises(RecipeError, match="has no value adapter .*critic-free"):
        merge_and_export(run_copy, tmp_path / "value", adapter="value", adapter_only=True)
    assert merge_and_export(run_copy, tmp_path / "policy", adapter_only=True).kind == "adapter"


def test_value_cannot_be_merged(trained_run, tmp_path):
    with pytest.raises(RecipeError, match="only the policy adapter can be merged"):
        merge_and_export(trained_run, tmp_path / "out", adapter="value")


# ---- bad checkpoints and outputs --------------------------------------------------------------


def test_corrupt_adapter_weights(run_copy, tmp_path):
    weights = run_copy / "final" / "policy" / "adapter_model.safetensors"
    weights.write_bytes(weights.read_bytes()[:100])
    with pytest.raises(RecipeError, match="corrupt checkpoint: .*adapter_model.safetensors cannot be read"):
        merge_and_export(run_copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_corrupt_adapter_config_and_missing_value_head(run_copy, tmp_path):
    (run_copy / "final" / "value" / "value_head.safetensors").unlink()
    with pytest.raises(RecipeError, match="value_head.safetensors is missing"):
        merge_and_export(run_copy, tmp_path / "out", adapter="value", adapter_only=True)
    (run_copy / "final" / "policy" / "adapter_config.json").write_text("{not json")
    with pytest.raises(RecipeError, match="corrupt checkpoint: .*adapter_config.json cannot be read"):
        merge_and_export(run_copy, tmp_path / "out")


@pytest.mark.parametrize("config", [None, [{"peft_type": "LORA"}], {"r": 4}], ids=["missing", "a list", "no peft_type"])
def test_an_adapter_config_that_is_no_peft_config_is_refused(run_copy, tmp_path, config):
    path = run_copy / "final" / "policy" / "adapter_config.json"
    if config is None:
        path.unlink()
    else:
        path.write_text(json.dumps(config))
    with pytest.raises(RecipeError, match="corrupt checkpoint: .*policy has no valid adapter_config.json"):
        merge_and_export(run_copy, tmp_path / "out", adapter_only=True)
    assert not (tmp_path / "out").exists()


def test_a_checkpoint_without_a_policy_says_what_it_is(run_copy, tmp_path):
    final = run_copy / "final"
    (final / "policy").rename(final / "reward")  # what a reward-model run (train-reward) saves in place of a policy
    with pytest.raises(RecipeError, match="is a reward-model run's .* export it with --adapter reward --adapter-only"):
        merge_and_export(run_copy, tmp_path / "out")
    shutil.rmtree(final / "reward")
    with pytest.raises(RecipeError, match="corrupt checkpoint: .* has no policy/ adapter folder$"):
        merge_and_export(run_copy, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_run_on_unquantized_weights_has_no_dequantized_base(run_copy, tmp_path):
    recipe = run_copy / "recipe.yaml"
    recipe.write_text(recipe.read_text().replace("quantization: 4bit", "quantization: none", 1))
    with pytest.raises(RecipeError, match="base=dequantized: this run trained on unquantized weights"):
        merge_and_export(run_copy, tmp_path / "refused", base="dequantized")
    assert not (tmp_path / "refused").exists()
    # Only a merge needs a base: an adapter copy ignores it, and the original base is there to merge into.
    assert merge_and_export(run_copy, tmp_path / "copy", base="dequantized", adapter_only=True).kind == "adapter"
    report = merge_and_export(run_copy, tmp_path / "merged", base="original")
    assert report.kind == "merged" and report.parity.passed


def test_folder_without_manifest_is_refused(run_copy, tmp_path):
    (run_copy / "final" / "manifest.json").unlink()  # policy/ and value/ are all there
    with pytest.raises(RecipeError, match="no complete checkpoint in .*final: .*manifest.json") as caught:
        merge_and_export(run_copy / "final", tmp_path / "out", adapter_only=True)
    assert "\n" not in str(caught.value)
    (run_copy / "final" / "manifest.json").write_text("{not json")
    with pytest.raises(RecipeError, match="corrupt checkpoint: .*manifest.json cannot be read"):
        merge_and_export(run_copy / "final", tmp_path / "out", adapter_only=True)
    assert not (tmp_path / "out").exists()


def test_run_without_final_names_its_complete_checkpoints(run_copy, tmp_path):
    steps = run_copy / "checkpoints"
    shutil.copytree(run_copy / "final", steps / "step-1")
    shutil.copytree(run_copy / "final", steps / "step-2")
    (steps / "step-2" / "manifest.json").unlink()  # a checkpoint whose writer was cut off
    (run_copy / "final" / "manifest.json").unlink()
    with pytest.raises(RecipeError, match="its final/ is missing or has no manifest.json") as caught:
        merge_and_export(run_copy, tmp_path / "out", adapter_only=True)
    assert str(caught.value).endswith("pass one of: checkpoints/step-1") and "\n" not in str(caught.value)
    shutil.rmtree(steps)
    with pytest.raises(RecipeError, match="nor has it a complete checkpoints/step-N"):
        merge_and_export(run_copy, tmp_path / "out", adapter_only=True)


def test_step_checkpoint_exports_with_the_manifest_step(run_copy, tmp_path):
    folder = run_copy / "checkpoints" / "step-7"
    shutil.copytree(run_copy / "final", folder)
    (folder / "manifest.json").write_text(json.dumps({"format": 1, "step": 7}))  # trainer_state says 1
    report = merge_and_export(folder, tmp_path / "out", adapter_only=True)
    assert report.checkpoint == folder.resolve()
    assert "from checkpoint `checkpoints/step-7` (step 7) of a lora_ppo run" in (tmp_path / "out" / "README.md").read_text()


def test_checkpoint_without_recipe(run_copy, tmp_path):
    (run_copy / "recipe.yaml").unlink()
    with pytest.raises(RecipeError, match="no recipe.yaml"):
        merge_and_export(run_copy, tmp_path / "out")


def test_out_may_not_hold_the_checkpoint(run_copy):
    with pytest.raises(RecipeError, match="holds the checkpoint"):
        merge_and_export(run_copy / "final", run_copy, adapter_only=True, force=True)
    assert (run_copy / "final" / "policy" / "adapter_model.safetensors").is_file()


def test_out_may_not_hold_the_base_model_even_with_force(run_copy, tiny_model_dir, tmp_path):
    """`--out` naming the base model's folder (or one above it) with --force replaced the
    original weights with the merged model, which every later load of the run then took for
    its base."""
    import yaml

    base = tmp_path / "models" / "tiny"
    shutil.copytree(tiny_model_dir, base)
    recipe = yaml.safe_load((run_copy / "recipe.yaml").read_text())
    recipe["model"]["name"] = str(base)
    (run_copy / "recipe.yaml").write_text(yaml.safe_dump(recipe))
    weights = (base / "model.safetensors").read_bytes()
    for out in (base, base.parent):
        result = runner.invoke(app, ["merge-and-export", str(run_copy), "--out", str(out), "--force"])
        _one_error_line(result, 2, f"out: {out} holds the base model the run trained on (model.name: {base}); "
                                   "export to another folder")
    assert (base / "model.safetensors").read_bytes() == weights
    assert merge_and_export(run_copy, tmp_path / "merged").out == tmp_path / "merged"  # elsewhere it exports


@pytest.mark.parametrize("inside", ["final/merged", "exports/policy"])
def test_out_may_not_be_inside_the_run(run_copy, inside):
    """An export inside final/ wrote hundreds of MB into the checkpoint; anywhere in the run it
    travels with every copy and resume of it."""
    with pytest.raises(RecipeError, match="is inside the run folder"):
        merge_and_export(run_copy, run_copy / inside)
    assert not (run_copy / inside).exists()


@pytest.mark.parametrize("options, expected", [
    ({"dtype": "int4"}, "dtype must be one of bf16, fp16, fp32"),
    ({"base": "quantized"}, "base must be one of original, dequantized"),
    ({"adapter": "critic"}, "adapter must be one of policy, value, reward"),
    ({"adapter": "reward"}, "only the policy adapter can be merged"),
    ({"adapter": "reward", "adapter_only": True}, "has no reward adapter"),
])
def test_bad_options(trained_run, tmp_path, options, expected):
    with pytest.raises(RecipeError, match=expected):
        merge_and_export(trained_run, tmp_path / "out", **options)


def test_a_link_at_out_is_replaced_not_followed(trained_run, tmp_path):
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    (elsewhere / "keep.txt").write_text("mine")
    out = tmp_path / "out"
    out.symlink_to(elsewhere, target_is_directory=True)
    with pytest.raises(RecipeError, match="already exists"):
        merge_and_export(trained_run, out, adapter_only=True)
    merge_and_export(trained_run, out, adapter_only=True, force=True)
    assert not out.is_symlink() and (out / "adapter_model.safetensors").is_file()
    assert [p.name for p in elsewhere.iterdir()] == ["keep.txt"]


def test_exported_files_are_readable_by_others(trained_run, tmp_path):
    previous = os.umask(0o022)
    try:
        merge_and_export(trained_run, tmp_path / "out", adapter_only=True)
    finally:
        os.umask(previous)
    assert stat.S_IMODE((tmp_path / "out").stat().st_mode) == 0o755
    assert {stat.S_IMODE(p.stat().st_mode) for p in (tmp_path / "out").iterdir()} == {0o644}


def test_disk_write_failure_leaves_nothing(trained_run, tmp_path, monkeypatch):
    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", no_space)
    with pytest.raises(ExportError, match="No space left on device"):
        merge_and_export(trained_run, tmp_path / "exports" / "out", adapter_only=True)
    assert list((tmp_path / "exports").iterdir()) == []


def test_merged_write_failure_leaves_nothing(trained_run, tmp_path, monkeypatch):
    from huggingface_hub import ModelCard

    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ModelCard, "save", no_space)  # the last file written, after the weights
    with pytest.raises(ExportError, match="No space left on device"):
        merge_and_export(trained_run, tmp_path / "exports" / "out", verify=False)
    assert list((tmp_path / "exports").iterdir()) == []


# ---- the command line -------------------------------------------------------------------------


def test_cli_missing_checkpoint_exits_2(tmp_path):
    result = runner.invoke(app, ["merge-and-export", str(tmp_path / "nope"), "--out", str(tmp_path / "out")])
    _one_error_line(result, 2, f"checkpoint not found: {tmp_path / 'nope'}")
    assert not (tmp_path / "out").exists()


def test_cli_existing_out_needs_force(trained_run, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    result = runner.invoke(app, ["merge-and-export", str(trained_run), "--out", str(out), "--adapter-only"])
    _one_error_line(result, 2, "already exists; pass --force")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]

    result = runner.invoke(app, ["merge-and-export", str(trained_run), "--out", str(out), "--adapter-only",
                                 "--adapter", "value", "--force"])
    assert result.exit_code == 0, result.stderr
    assert "exported the value adapter" in result.stdout
    assert not (out / "keep.txt").exists() and (out / "value_head.safetensors").is_file()
    assert [p.name for p in tmp_path.iterdir()] == ["out"]


@pytest.mark.parametrize("option, expected", [
    (["--dtype", "fp8"], "dtype must be one of"),
    (["--adapter", "critic", "--adapter-only"], "adapter must be one of policy, value, reward, got 'critic'"),
    (["--adapter", "reward", "--adapter-only"], "has no reward adapter (no reward/ folder)"),
])
def test_cli_bad_option_exits_2(trained_run, tmp_path, option, expected):
    result = runner.invoke(app, ["merge-and-export", str(trained_run), "--out", str(tmp_path / "o"), *option])
    _one_error_line(result, 2, expected)
    assert list(tmp_path.iterdir()) == []


def test_cli_parity_failure_exits_1_and_writes_nothing(trained_run, tmp_path, wrong_merge):
    out = tmp_path / "out"
    result = runner.invoke(app, ["merge-and-export", str(trained_run), "--out", str(out)])
    _one_error_line(result, 1, "parity check failed")
    assert "FAILED" in result.stdout and "mean KL" in result.stdout
    assert not out.exists() and list(tmp_path.iterdir()) == []


def test_cli_write_failure_exits_1(trained_run, tmp_path, monkeypatch):
    def no_space(*_args, **_kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(shutil, "copyfile", no_space)
    result = runner.invoke(app, ["merge-and-export", str(trained_run), "--out", str(tmp_path / "o"), "--adapter-only"])
    _one_error_line(result, 1, "No space left on device")
    assert list(tmp_path.iterdir()) == []
