"""Merged exports of a tiny trained run: the merged model reproduces adapter-on-base, exports
are byte-identical, the folder works with transformers alone, and a wrong merge is caught."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from lora_ppo.export import ParityError, merge_and_export
from lora_ppo.parity import TOLERANCES
from tests.export.conftest import safetensors_state

# fp32 merged weights vs adapter-on-base: only the summation order differs (measured ~2e-5).
LOGIT_ATOL = 1e-4


def _logits(model, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=ids).logits.float()


def test_merged_logits_match_adapter_on_unquantized_base(exported, trained_run, tiny_model_dir):
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    folder, report = exported
    assert report.parity.passed and report.base == "original" and report.dtype == "fp32"
    # Built here independently of lora_ppo: the adapter on the base loaded unquantized, fp32.
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    reference = PeftModel.from_pretrained(base, str(trained_run / "final" / "policy")).eval()
    merged = AutoModelForCausalLM.from_pretrained(folder).eval()
    ids = torch.randint(3, base.config.vocab_size, (3, 20), generator=torch.Generator().manual_seed(0))

    expected = _logits(reference, ids)
    torch.testing.assert_close(_logits(merged, ids), expected, atol=LOGIT_ATOL, rtol=LOGIT_ATOL)
    with reference.disable_adapter():
        bare = _logits(reference, ids)
    assert (bare - expected).abs().max() > 0.1  # the adapter matters, so the match means something


def test_export_folder_is_a_standard_model_folder(exported):
    folder, report = exported
    names = sorted(p.name for p in folder.iterdir())
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json", "chat_template.jinja", "README.md"} <= set(names)
    assert not any("adapter" in n for n in names)
    config = json.loads((folder / "config.json").read_text())
    assert config["dtype"] == "float32" and "quantization_config" not in config
    assert not any("lora" in key for key in safetensors_state(folder / "model.safetensors"))
    card = (folder / "README.md").read_text()
    assert "Base model:" in card and "## Recipe" in card and "## Training summary" in card
    assert "| steps | 1 |" in card and "learning_rate: 0.05" in card and "Parity check: passed" in card
    assert not list(folder.parent.glob(".*"))  # no staging folder left beside it


def test_second_export_is_byte_identical(exported, trained_run, tmp_path):
    folder, _ = exported
    again = tmp_path / "again"
    merge_and_export(trained_run / "final", again)  # the checkpoint folder this time, not the run
    names = sorted(p.name for p in folder.iterdir())
    assert sorted(p.name for p in again.iterdir()) == names
    for name in names:
        assert (again / name).read_bytes() == (folder / name).read_bytes(), name


# Runs in a fresh interpreter where peft and lora_ppo cannot be imported (as if not installed).
LOAD_AND_GENERATE = r'''
import sys

HIDDEN = {"peft", "lora_ppo"}


class Hide:
    def __init__(self, finder):
        self.finder = finder

    def find_spec(self, name, path=None, target=None):
        if name.partition(".")[0] in HIDDEN:
            return None
        return self.finder.find_spec(name, path, target)

    def find_distributions(self, context=None, **kwargs):
        find = getattr(self.finder, "find_distributions", None)
        if find is None or (getattr(context, "name", None) or "").replace("-", "_") in HIDDEN:
            return iter(())
        return find(context, **kwargs) if context is not None else find(**kwargs)


sys.meta_path[:] = [Hide(f) for f in sys.meta_path]

import json
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

folder = sys.argv[1]
tokenizer = AutoTokenizer.from_pretrained(folder)
model = AutoModelForCausalLM.from_pretrained(folder)
text = tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
enc = tokenizer(text, return_tensors="pt", add_special_tokens=False)
out = model.generate(**enc, max_new_tokens=5, min_new_tokens=5, do_sample=False)
try:
    import peft  # noqa: F401
    peft_importable = True
except ImportError:
    peft_importable = False
print(json.dumps({
    "new_tokens": out.shape[1] - enc["input_ids"].shape[1],
    "eos_token_id": model.generation_config.eos_token_id,
    "peft_importable": peft_importable,
    "loaded": sorted(m for m in ("peft", "lora_ppo") if m in sys.modules),
}))
'''


def test_export_loads_and_generates_with_transformers_only(exported, tmp_path):
    folder, _ = exported
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(HF_HUB_OFFLINE="1", OMP_NUM_THREADS="1")
    # -P: the working directory (a temp folder anyway) is not put on sys.path.
    result = subprocess.run(
        [sys.executable, "-P", "-c", LOAD_AND_GENERATE, str(folder)],
        cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    info = json.loads(result.stdout.strip().splitlines()[-1])
    assert info == {"new_tokens": 5, "eos_token_id": 2, "peft_importable": False, "loaded": []}


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_wrong_merge_is_caught_by_parity_check(trained_run, tmp_path, wrong_merge, dtype):
    out = tmp_path / "exports" / "bad"
    with pytest.raises(ParityError, match="parity check failed") as caught:
        merge_and_export(trained_run, out, dtype=dtype)
    report = caught.value.report
    assert not report.passed
    # bf16's own limits are loose, so a bf16 export is caught by the fp32 check of the merge itself.
    assert report.exported == ("exported fp32 model" if dtype == "fp32" else "merged fp32 weights (before the cast)")
    assert report.kl_mean > 1000 * TOLERANCES[torch.float32].max_kl
    assert report.max_logit_diff > 10 * TOLERANCES[torch.float32].max_logit_diff
    assert not out.exists() and list(tmp_path.rglob("*")) in ([], [tmp_path / "exports"])


def test_no_verify_skips_the_check_and_writes_the_same_weights(exported, trained_run, tmp_path):
    folder, _ = exported
    report = merge_and_export(trained_run, tmp_path / "unverified", verify=False)
    assert report.parity is None and "parity: skipped" in report.format()
    assert "Parity check: skipped" in (tmp_path / "unverified" / "README.md").read_text()
    assert (tmp_path / "unverified" / "model.safetensors").read_bytes() == (folder / "model.safetensors").read_bytes()


def test_dequantized_base_matches_the_4bit_model_it_was_trained_on(exported, trained_run, tmp_path):
    folder, _ = exported
    report = merge_and_export(trained_run, tmp_path / "deq", base="dequantized")
    # Reference here is the adapter on the 4-bit base (what was trained), at fp32 tolerance.
    assert report.parity.passed and "4bit base" in report.parity.reference
    assert report.parity.tolerance == TOLERANCES[torch.float32]
    config = json.loads((tmp_path / "deq" / "config.json").read_text())
    assert "quantization_config" not in config and config["dtype"] == "float32"
    deq = safetensors_state(tmp_path / "deq" / "model.safetensors")
    orig = safetensors_state(folder / "model.safetensors")
    assert deq.keys() == orig.keys() and all(t.dtype == torch.float32 for t in deq.values())
    # NF4 rounding moved the quantized projections away from the original weights.
    key = next(k for k in orig if k.endswith("q_proj.weight"))
    assert (deq[key] - orig[key]).abs().max() > 1e-3


def test_bf16_export_passes_at_bf16_tolerance(trained_run, tmp_path):
    report = merge_and_export(trained_run, tmp_path / "bf16", dtype="bf16")
    assert report.parity.passed and report.parity.tolerance == TOLERANCES[torch.bfloat16]
    assert report.merge_parity.passed and report.merge_parity.tolerance == TOLERANCES[torch.float32]
    assert report.parity.kl_mean > 0  # really compared in bf16, not against itself
    state = safetensors_state(tmp_path / "bf16" / "model.safetensors")
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    assert json.loads((tmp_path / "bf16" / "config.json").read_text())["dtype"] == "bfloat16"


def test_cli_prints_both_parity_reports_of_a_bf16_export_then_where_it_went(trained_run, tmp_path):
    from typer.testing import CliRunner

    from lora_ppo.cli import app

    out = tmp_path / "bf16"
    result = CliRunner().invoke(app, ["merge-and-export", str(trained_run), "--out", str(out), "--dtype", "bf16"])
    assert result.exit_code == 0, result.output
    lines = result.stdout.strip().splitlines()
    reports = [ln for ln in lines if ln.startswith("parity: ")]
    # The merge checked in fp32 before the cast, then the bf16 files as written.
    assert len(reports) == 2 and "merged fp32 weights (before the cast)" in reports[0]
    assert "exported bf16 model" in reports[1] and lines.count("  passed") == 2
    assert lines[-1] == f"exported the policy adapter merged into the original base (bf16) to {out}"
