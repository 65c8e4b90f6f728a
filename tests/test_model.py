"""Loading the base model: on CPU the checkpoint file is not kept mapped (that mapping counted the
whole unquantized checkpoint in resident memory after a 4-bit load), and a model folder's own
Python code never runs unless the recipe trusts it."""

from __future__ import annotations

import json
import re
import shutil
import sys
import types

import pytest
import torch
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo import model as model_module
from lora_ppo.config import ModelConfig
from lora_ppo.errors import RecipeError
from lora_ppo.model import check_context, check_row_length, load_base_model, model_context, resolve_model_path
from tests.conftest import tiny_recipe_dict, write_recipe


@pytest.mark.skipif(not sys.platform.startswith("linux") or torch.cuda.is_available(), reason="reads /proc/self/maps on CPU")
@pytest.mark.parametrize("quantization", ["4bit", "none"])
def test_no_mapping_of_the_checkpoint_file_survives_loading(tiny_model_dir, tmp_path, quantization):
    folder = tmp_path / "copy"
    shutil.copytree(tiny_model_dir, folder)
    model = load_base_model(ModelConfig(name=str(folder), quantization=quantization))
    mapped = [line for line in open("/proc/self/maps") if str(folder) in line]
    assert mapped == []
    # Tied embeddings are still one tensor, and the copies hold the file's weights: the logits are
    # those of the same checkpoint loaded by transformers alone (NF4 with double quantization in
    # float32 is what a 4-bit recipe asks for on CPU), which keeps its mapping.
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig

    nf4 = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                             bnb_4bit_compute_dtype=torch.float32)
    plain = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32,
                                                 quantization_config=nf4 if quantization == "4bit" else None)
    plain.train()  # 4-bit layers on the kernel lora_ppo keeps them on (no dropout in this model)
    ids = torch.tensor([[1, 5, 9, 40, 7]])
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids).logits, plain(input_ids=ids).logits, atol=1e-6, rtol=1e-5)


def test_model_code_from_a_folder_never_runs_unless_the_recipe_trusts_it(tmp_path, tiny_model_dir):
    """A model folder whose config points at its own Python code (auto_map) is refused with one
    line, and the code is never imported, unless model.trust_remote_code says so."""
    import shutil

    folder = tmp_path / "custom-code-model"
    shutil.copytree(tiny_model_dir, folder)
    marker = tmp_path / "code-ran"
    (folder / "modeling_custom.py").write_text(
        f"open({str(marker)!r}, 'w').write('ran')\n"
        "from transformers import LlamaConfig, LlamaForCausalLM\n"
        "class CustomConfig(LlamaConfig):\n    model_type = 'custom-llama'\n"
        "class CustomModel(LlamaForCausalLM):\n    config_class = CustomConfig\n"
    )
    config = json.loads((folder / "config.json").read_text())
    # A model type transformers does not know, so only the folder's own code could build it.
    config["model_type"] = "custom-llama"
    config["auto_map"] = {"AutoConfig": "modeling_custom.CustomConfig",
                          "AutoModelForCausalLM": "modeling_custom.CustomModel"}
    (folder / "config.json").write_text(json.dumps(config))
    recipe = write_recipe(tmp_path / "r.yaml", folder, tmp_path / "run")
    result = CliRunner().invoke(app, ["train", str(recipe)])
    assert result.exit_code == 2
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: model.name: "), result.stderr
    assert "model.trust_remote_code: true" in lines[0]
    assert not marker.exists()


def test_a_truncated_weights_file_is_one_line_naming_the_model(tmp_path, tiny_model_dir):
    """A download cut short leaves a .safetensors that safetensors refuses with its own error
    type: exit 2 and one line, not a traceback."""
    folder = tmp_path / "truncated"
    shutil.copytree(tiny_model_dir, folder)
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    recipe = write_recipe(tmp_path / "r.yaml", folder, tmp_path / "run")
    result = CliRunner().invoke(app, ["train", str(recipe)])
    lines = result.stderr.strip().splitlines()
    assert result.exit_code == 2 and len(lines) == 1, result.stderr
    assert lines[0].startswith(f"error: model.name: cannot load {str(folder)!r}: ") and "Traceback" not in result.output


def test_prompt_and_response_longer_than_the_context_are_refused_before_loading(tmp_path, tiny_model_dir):
    """The tiny Llama has 256 positions: 200 prompt + 100 new tokens cannot fit."""
    recipe = write_recipe(tmp_path / "r.yaml", tiny_model_dir, tmp_path / "run")
    result = CliRunner().invoke(app, ["train", str(recipe), "data.max_prompt_tokens=200", "rollout.max_new_tokens=100"])
    assert result.exit_code == 2
    assert result.stderr.strip() == ("error: rollout.max_new_tokens: prompts of up to 200 tokens "
                                     "(data.max_prompt_tokens) plus 100 new ones exceed the model's context of 256 tokens")


@pytest.mark.parametrize("stage, field", [
    ("train", "adapters.policy.init_from"), ("train", "adapters.value.init_from"), ("train", "adapters.reference"),
    ("train", "reward.adapter"), ("train", "reward.model"), ("train-sft", "adapter.init_from"),
    ("train-reward", "adapter.init_from")])
def test_an_adapter_folder_that_holds_no_adapter_is_refused_before_the_model_loads(tmp_path, tiny_model_dir,
                                                                                  monkeypatch, stage, field):
    """A typo in an adapter's path (or a reward classifier's): one line, before the weights (minutes
    for a large model) load."""
    import yaml

    from lora_ppo import parts, reward_training
    from lora_ppo.sft import trainer as sft_trainer
    from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl
    from tests.test_reward_training import preference_rows, reward_recipe_dict

    def loading(*args, **kwargs):
        raise AssertionError("the base model loaded before the adapter folder was checked")

    for module in (parts, sft_trainer, reward_training):
        monkeypatch.setattr(module, "load_base_model", loading)
    missing = tmp_path / "no-adapter-here"
    missing.mkdir()
    if stage == "train":
        recipe = tiny_recipe_dict(tiny_model_dir, tmp_path / "run")
        if field == "reward.adapter":
            recipe["reward"] = {"kind": "adapter", "adapter": str(missing)}
        elif field == "reward.model":
            recipe["reward"] = {"kind": "classifier", "model": str(missing)}
        else:
            section, role, *key = field.split(".")
            recipe[section][role] = {**recipe[section].get(role, {}), key[0]: str(missing)} if key else str(missing)
    elif stage == "train-sft":
        data = write_jsonl(tmp_path / "demos.jsonl", demonstration_rows(8))
        recipe = sft_recipe_dict(tiny_model_dir, data, data, tmp_path / "run")
        recipe["adapter"]["init_from"] = str(missing)
    else:
        data = write_jsonl(tmp_path / "pairs.jsonl", preference_rows(16))
        recipe = reward_recipe_dict(tiny_model_dir, data, data, tmp_path / "run")
        recipe["adapter"]["init_from"] = str(missing)
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, [stage, str(tmp_path / "r.yaml"), "--no-progress"])
    assert result.exit_code == 2 and len(result.stderr.splitlines()) == 1, result.stderr
    assert result.stderr.startswith(f"error: {field}: cannot load a sequence classifier from {str(missing)!r}: "
                                    if field == "reward.model" else
                                    f"error: {field}: {str(missing)!r} is not a PEFT adapter folder (no adapter_config.json)")


@pytest.mark.parametrize("quantization, dtype", [("4bit", "float32"), ("4bit", "bfloat16"), ("8bit", "float32")])
def test_a_checkpoint_saved_quantized_computes_in_the_recipes_dtype(tmp_path, quantization, dtype, caplog):
    """A `...-bnb-4bit` checkpoint loads, by transformers alone, in the dtype it was saved to compute in
    (bfloat16 here) whatever dtype it is asked for. lora_ppo casts it to the recipe's: its logits are
    those of the same weights quantized at load in that dtype (the same codes), bit for bit."""
    from tests.conftest import build_tiny_llama, build_tiny_tokenizer

    plain, saved = tmp_path / "plain", tmp_path / "saved-quantized"
    tokenizer = build_tiny_tokenizer(plain)
    # bfloat16 values, so the unquantized weights saved in bfloat16 lose nothing against the plain ones
    build_tiny_llama(plain, len(tokenizer)).to(torch.bfloat16).save_pretrained(plain)
    load_base_model(ModelConfig(name=str(plain), compute_dtype="bfloat16", quantization=quantization)).save_pretrained(saved)
    assert json.loads((saved / "config.json").read_text())["quantization_config"][f"load_in_{quantization}"]
    with caplog.at_level("INFO", logger="lora_ppo.quantization"):
        loaded = load_base_model(ModelConfig(name=str(saved), compute_dtype=dtype, quantization=quantization))
    quantized_at_load = load_base_model(ModelConfig(name=str(plain), compute_dtype=dtype, quantization=quantization))
    assert loaded.model.embed_tokens.weight.dtype == loaded.model.norm.weight.dtype == getattr(torch, dtype)
    if quantization == "4bit":
        layer = loaded.model.layers[0].self_attn.q_proj
        assert layer.compute_dtype == layer.weight.quant_state.dtype == getattr(torch, dtype)
    ids = torch.tensor([[5, 9, 17, 33, 60, 7]])
    with torch.no_grad():
        assert torch.equal(loaded(ids).logits, quantized_at_load(ids).logits)
    layers = " and 4-bit layers" if quantization == "4bit" else ""
    said = [r.getMessage() for r in caplog.records if r.getMessage().startswith("model.compute_dtype")]
    assert said == ([f"model.compute_dtype: {saved} was saved quantized to compute in bfloat16; its unquantized "
                     f"weights{layers} now compute in float32"] if dtype == "float32" else [])


def test_the_tokenizer_pads_on_the_left_with_its_own_pad_token_or_else_its_eos(tiny_model_dir, tmp_path):
    """Prompts are left-padded (generation continues from the last column); a tokenizer with a pad
    token of its own keeps it, one without gets its eos."""
    from lora_ppo.model import load_tokenizer

    own = tmp_path / "own-pad"
    shutil.copytree(tiny_model_dir, own)
    config = json.loads((own / "tokenizer_config.json").read_text())
    config["pad_token"] = "<|endoftext|>"
    (own / "tokenizer_config.json").write_text(json.dumps(config))
    none = tmp_path / "no-pad"
    shutil.copytree(tiny_model_dir, none)
    config.pop("pad_token")
    (none / "tokenizer_config.json").write_text(json.dumps(config))
    kept, filled = (load_tokenizer(ModelConfig(name=str(folder))) for folder in (own, none))
    assert kept.pad_token == "<|endoftext|>" and filled.pad_token == filled.eos_token == "<|im_end|>"
    assert kept.padding_side == filled.padding_side == "left"


@pytest.mark.parametrize("name", ["gpt2", "HuggingFaceTB/SmolLM2-135M-Instruct"])
def test_a_hub_id_goes_to_from_pretrained_as_given(tmp_path, monkeypatch, name):
    monkeypatch.chdir(tmp_path)  # no folder of that name here
    assert resolve_model_path(name) == name


@pytest.mark.parametrize("name", ["./model", "/no/such/model", "~/no-such-model", "runs/last/policy"])
def test_a_name_that_can_only_be_a_folder_is_refused_when_the_folder_is_missing(tmp_path, monkeypatch, name):
    """A leading ., / or ~, or more than one slash (a hub id has one at most), means a local folder."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    with pytest.raises(RecipeError, match=rf"^model.name: folder not found: {re.escape(name)}$"):
        resolve_model_path(name)


def test_an_existing_folder_is_loaded_from_disk_even_where_it_reads_like_a_hub_id(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HOME", str(tmp_path))
    (tmp_path / "org" / "name").mkdir(parents=True)
    (tmp_path / "models" / "mine").mkdir(parents=True)
    assert resolve_model_path("org/name") == "org/name"  # the folder here, by the same relative path
    assert resolve_model_path("org") == "org"
    assert resolve_model_path("~/models/mine") == str(tmp_path / "models" / "mine")  # ~ expanded


@pytest.mark.parametrize("text, expected", [
    ({"max_position_embeddings": 512, "n_positions": 64}, 512),
    ({"n_positions": 1024}, 1024),  # GPT-2 style names
    ({}, None),  # ALiBi (Bloom): no fixed limit
])
def test_the_context_is_read_from_either_name_of_the_position_table(monkeypatch, text, expected):
    config = types.SimpleNamespace(get_text_config=lambda: types.SimpleNamespace(**text))
    monkeypatch.setattr(model_module, "model_config", lambda cfg: config)
    assert model_context(ModelConfig()) == expected


def test_a_sequence_as_long_as_the_context_fits_and_one_token_more_does_not(tiny_model_dir):
    cfg = ModelConfig(name=str(tiny_model_dir))  # 256 positions
    check_context(cfg, 200, 56)
    check_row_length(cfg, 256, "data.max_length")
    with pytest.raises(RecipeError, match="exceed the model's context of 256 tokens"):
        check_context(cfg, 200, 57)
    with pytest.raises(RecipeError, match="^data.max_length: rows of up to 257 tokens exceed"):
        check_row_length(cfg, 257, "data.max_length")


def test_the_loaded_base_is_frozen_and_decodes_with_its_cache(tmp_path, tiny_model_dir):
    """Only adapters train, and a checkpoint saved with `use_cache: false` (as training with
    gradient checkpointing leaves it) still decodes from its KV cache, not the whole prefix per token."""
    folder = tmp_path / "saved_without_cache"
    shutil.copytree(tiny_model_dir, folder)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "use_cache": False}))
    model = load_base_model(ModelConfig(name=str(folder)))
    assert not [name for name, p in model.named_parameters() if p.requires_grad]
    assert model.config.use_cache is True


def _saved_quantized_stand_in(pre_quantized=True) -> torch.nn.Module:
    """A model as transformers hands back a pre-quantized checkpoint: a quantizer that says so, and
    the modules its class keeps in float32 at any dtype."""
    model = torch.nn.Module()
    model.hf_quantizer = types.SimpleNamespace() if pre_quantized is None else \
        types.SimpleNamespace(pre_quantized=pre_quantized)
    model._keep_in_fp32_modules, model._keep_in_fp32_modules_strict = ["router"], ["gate"]
    for name, dtype in (("embed", torch.float16), ("router", torch.float32), ("gate", torch.float32),
                        ("norm", torch.float32), ("routerx", torch.float32)):
        model.add_module(name, torch.nn.Linear(2, 2, bias=False, dtype=dtype))
    model.codes = torch.nn.Parameter(torch.zeros(2, dtype=torch.uint8), requires_grad=False)
    return model


def test_a_pre_quantized_checkpoint_is_cast_to_the_recipes_dtype_but_what_its_class_keeps_in_float32():
    from lora_ppo.quantization import compute_in

    model = _saved_quantized_stand_in()
    compute_in(model, torch.bfloat16, "m")
    assert {name: p.dtype for name, p in model.named_parameters()} == {
        "embed.weight": torch.bfloat16, "norm.weight": torch.bfloat16,
        "router.weight": torch.float32, "gate.weight": torch.float32,  # kept, by either list
        "routerx.weight": torch.bfloat16,  # a module name matches whole, not as a prefix
        "codes": torch.uint8}  # quantized codes are not floats: left as they are
    for untouched in (_saved_quantized_stand_in(pre_quantized=False), _saved_quantized_stand_in(pre_quantized=None)):
        before = {name: p.dtype for name, p in untouched.named_parameters()}
        compute_in(untouched, torch.bfloat16, "m")  # quantized at load: already in the recipe's dtype
        assert {name: p.dtype for name, p in untouched.named_parameters()} == before
