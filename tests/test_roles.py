"""Roles on one real 4-bit backbone: reference = base, gradients stay in their own role, role
switches keep the trainable flags, left padding changes nothing, and a policy started from an
adapter keeps that adapter frozen as its reference."""

from __future__ import annotations

import json

import pytest
import torch

from lora_ppo.config import AdaptersConfig, ModelConfig
from lora_ppo.model import load_base_model
from lora_ppo.roles import POLICY, REFERENCE, VALUE, RoleModel
from tests.conftest import bnb_4bit_layers, prompt_and_random_response

ATOL = 1e-5


@pytest.fixture(scope="module")
def model_cfg(tiny_model_dir):
    return ModelConfig(name=str(tiny_model_dir), quantization="4bit")


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=1, scale=0.5)


def test_backbone_is_real_4bit(roles):
    assert bnb_4bit_layers(roles)


@torch.no_grad()
def test_reference_equals_base_model_and_policy_differs(roles, model_cfg, tokenizer):
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting in this comedy"])
    with roles.as_role(REFERENCE):
        ref, _ = roles.response_logprobs(ids, mask, start, temperature=1.0)
    with roles.as_role(POLICY):
        pol, _ = roles.response_logprobs(ids, mask, start, temperature=1.0)
    base = load_base_model(model_cfg)
    logits = base(input_ids=ids, attention_mask=mask, position_ids=(mask.cumsum(-1) - 1).clamp(min=0)).logits
    base_lp = torch.log_softmax(logits[:, start - 1 : -1].float(), -1).gather(-1, ids[:, start:, None]).squeeze(-1)
    torch.testing.assert_close(ref, base_lp, atol=ATOL, rtol=1e-5)
    assert (pol - base_lp).abs().max() > 1e-2


def test_policy_loss_backward_leaves_value_grads_untouched_and_vice_versa(roles, tokenizer):
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was"])
    with roles.as_role(POLICY):
        lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
    lp.sum().backward()
    assert all(p.grad is not None for p in roles.policy_parameters())
    assert all(p.grad is None for p in roles.value_parameters())

    for p in roles.policy_parameters():
        p.grad = None
    with roles.as_role(VALUE):
        values = roles.values(ids, mask, start)
    values.sum().backward()
    assert all(p.grad is None for p in roles.policy_parameters())
    assert all(p.grad is not None for p in roles.value_parameters())


def test_trainable_flags_survive_role_switches(roles, tokenizer):
    # PEFT's set_adapter freezes every adapter but the active one; both must stay trainable.
    for role in (VALUE, REFERENCE, POLICY, VALUE):
        with roles.as_role(role):
            pass
        assert all(p.requires_grad for p in roles.policy_parameters() + roles.value_parameters())


@torch.no_grad()
def test_left_padding_gives_same_logprobs_and_values(roles, tokenizer):
    short = "This movie was"
    longer = "I went to see this horror movie last weekend with my family and honestly"
    g = torch.Generator().manual_seed(3)
    response = torch.randint(3, len(tokenizer), (1, 6), generator=g)

    def score(prompts):
        enc = tokenizer(prompts, return_tensors="pt", padding=True)
        resp = response.expand(len(prompts), -1)
        ids = torch.cat([enc["input_ids"], resp], 1)
        mask = torch.cat([enc["attention_mask"], torch.ones_like(resp)], 1)
        start = enc["input_ids"].shape[1]
        with roles.as_role(POLICY):
            lp, ent = roles.response_logprobs(ids, mask, start, 0.7)
        with roles.as_role(VALUE):
            v = roles.values(ids, mask, start)
        return lp, ent, v

    alone = score([short])
    batched = score([longer, short])
    assert tokenizer([longer, short], padding=True)["attention_mask"][1][0] == 0  # really left-padded
    for a, b in zip(alone, batched):
        torch.testing.assert_close(a[0], b[1], atol=ATOL, rtol=1e-5)


def test_4bit_backward_reaches_early_layers_after_inference(roles, tokenizer):
    # Regression: an inference pass must not switch bitsandbytes to a kernel without backward.
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was"])
    with torch.no_grad(), roles.as_role(POLICY):
        roles.response_logprobs(ids, mask, start, 1.0)
    with roles.as_role(POLICY):
        lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
    lp.sum().backward()
    first_layer_a = [p for n, p in roles.peft.named_parameters() if "layers.0." in n and "lora_A.policy" in n]
    assert first_layer_a and all(p.grad is not None and p.grad.abs().sum() > 0 for p in first_layer_a)


def test_gradient_checkpointing_gives_same_gradients(roles, tokenizer):
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting"])

    def grads(checkpointing: bool):
        for p in roles.policy_parameters():
            p.grad = None
        with roles.gradient_checkpointing(checkpointing), roles.as_role(POLICY):
            lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
            lp.sum().backward()
        return [p.grad.clone() for p in roles.policy_parameters()]

    for a, b in zip(grads(False), grads(True)):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_init_from_adapter_becomes_frozen_reference(roles, model_cfg, tokenizer, tmp_path):
    roles.save_adapter(POLICY, tmp_path / "sft")
    adapters = AdaptersConfig(policy={"r": 4, "alpha": 8, "init_from": str(tmp_path / "sft")}, value={"r": 4})
    assert adapters.reference_adapter_path == str(tmp_path / "sft")
    started = RoleModel(load_base_model(model_cfg), adapters)
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting"])
    with torch.no_grad():
        with roles.as_role(POLICY):
            sft_lp, _ = roles.response_logprobs(ids, mask, start, 1.0)
        with started.as_role(POLICY):
            pol_lp, _ = started.response_logprobs(ids, mask, start, 1.0)
        with started.as_role(REFERENCE):
            ref_lp, _ = started.response_logprobs(ids, mask, start, 1.0)
    torch.testing.assert_close(pol_lp, sft_lp, atol=ATOL, rtol=1e-5)
    torch.testing.assert_close(ref_lp, sft_lp, atol=ATOL, rtol=1e-5)
    assert not any(p.requires_grad for p in started._params[REFERENCE])
    # Training the policy copy leaves the reference where it started.
    with torch.no_grad():
        for p in started.policy_parameters():
            p.add_(0.1)
        with started.as_role(REFERENCE):
            ref_after, _ = started.response_logprobs(ids, mask, start, 1.0)
        with started.as_role(POLICY):
            pol_after, _ = started.response_logprobs(ids, mask, start, 1.0)
    torch.testing.assert_close(ref_after, sft_lp, atol=ATOL, rtol=1e-5)
    assert (pol_after - sft_lp).abs().max() > 1e-3


@torch.no_grad()
def test_role_switches_set_what_peft_sets(roles, tokenizer):
    # lora_ppo sets the active adapter on each LoRA layer itself (lora_ppo/adapter_switch.py); a
    # forward after each switch must equal one after PEFT's own set_adapter / disable_adapter.
    from peft.tuners.tuners_utils import BaseTunerLayer

    assert roles._switch is not None
    ids, mask, _ = prompt_and_random_response(tokenizer, ["This movie was"])
    layers = [m for m in roles.peft.modules() if isinstance(m, BaseTunerLayer)]
    for role in (VALUE, POLICY, REFERENCE, VALUE):
        with roles.as_role(role):
            ours = roles.hidden_states(ids, mask)
            if role != REFERENCE:
                assert roles.peft.active_adapter == role and all(m.active_adapters == [role] for m in layers)
                roles.peft.set_adapter(role)
                peft_own = roles.hidden_states(ids, mask)
            else:
                assert all(m.disable_adapters for m in layers)
                with roles.peft.disable_adapter():
                    peft_own = roles.hidden_states(ids, mask)
        torch.testing.assert_close(ours, peft_own, atol=0, rtol=0)
        roles._fix_requires_grad()
    assert not any(m.disable_adapters for m in layers)


def plain_peft_model(model_dir, **lora):
    """The tiny model unquantized with one LoRA adapter on q_proj (PEFT's own wrapping, no roles)."""
    from peft import LoraConfig, get_peft_model

    base = load_base_model(ModelConfig(name=str(model_dir), quantization="none"))
    return get_peft_model(base, LoraConfig(r=2, target_modules=["q_proj"], **lora))


def test_adapter_switch_leaves_modules_to_save_to_peft(tiny_untied_model_dir):
    # PEFT switches a `modules_to_save` copy (or trainable tokens) by a module walk of its own:
    # with one in the model, the roles switch through PEFT.
    from lora_ppo.adapter_switch import AdapterSwitch

    assert AdapterSwitch.of(plain_peft_model(tiny_untied_model_dir)) is not None
    assert AdapterSwitch.of(plain_peft_model(tiny_untied_model_dir, modules_to_save=["lm_head"])) is None


@pytest.mark.parametrize("attribute", ["_active_adapter", "_disable_adapters"])
def test_adapter_switch_leaves_a_peft_without_either_attribute_it_sets_to_peft(tiny_untied_model_dir, monkeypatch,
                                                                               attribute):
    # A PEFT whose LoRA layers lack one of the two attributes the switch writes (a later release
    # renaming it) switches through PEFT's own calls, not through a write its forward never reads.
    from peft.tuners.tuners_utils import BaseTunerLayer

    from lora_ppo.adapter_switch import AdapterSwitch

    model = plain_peft_model(tiny_untied_model_dir)
    monkeypatch.delattr(BaseTunerLayer, attribute)
    for layer in model.modules():
        if isinstance(layer, BaseTunerLayer):
            vars(layer).pop(attribute, None)
    assert AdapterSwitch.of(model) is None


@torch.no_grad()
def test_a_fresh_value_head_scores_every_position_zero(make_roles, tokenizer):
    """The value head starts at zero (weight and bias), so every value is exactly 0 before the critic
    learns, whatever the value adapter computes: a random head put offsets the size of the hidden
    states into the first steps' returns."""
    roles = make_roles(seed=2, perturbed=("policy", "value"))
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting in this comedy"])
    with roles.as_role(VALUE):
        values = roles.values(ids, mask, start)
        hidden = roles.hidden_states(ids, mask)
    assert hidden.abs().max() > 0.1 and torch.equal(values, torch.zeros_like(values))


def test_a_saved_adapter_loads_on_its_hub_base_with_no_dropout(make_roles, tmp_path):
    """What `save_adapter` writes is a PEFT folder: adapter_config.json names the base the recipe
    named (a builtin model's hub id, never a local cache folder), the recipe's rank, alpha and
    modules, and no dropout (a user training it further would otherwise drop activations PPO never
    dropped); the value's head lies beside its adapter, the policy has none."""
    import json

    from safetensors.torch import load_file

    roles = make_roles(seed=4)
    roles.base_name = "HuggingFaceTB/SmolLM2-135M-Instruct"
    with torch.no_grad():
        roles.value_head.weight.normal_(generator=torch.Generator().manual_seed(1))
    for role in (POLICY, VALUE):
        roles.save_adapter(role, tmp_path / role)
    config = json.loads((tmp_path / POLICY / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert (config["r"], config["lora_alpha"], config["lora_dropout"]) == (4, 8, 0.0)
    # all-linear as PEFT resolves it: every linear layer of both decoder layers, the LM head left out
    assert sorted(name.rsplit(".", 1)[-1] for name in config["target_modules"]) == sorted(
        ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"] * 2)
    assert sorted(p.name for p in (tmp_path / POLICY).iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    head = load_file(str(tmp_path / VALUE / "value_head.safetensors"))
    assert torch.equal(head["weight"], roles.value_head.weight.detach()) and torch.equal(head["bias"],
                                                                                       roles.value_head.bias.detach())


@torch.no_grad()
def test_a_value_started_from_a_saved_value_adapter_scores_as_it_did(make_roles, model_cfg, tokenizer, tmp_path):
    """adapters.value.init_from: a value adapter folder with its head beside it (a run's final/value):
    the new critic's values are the saved one's, head included, and its parameters train."""
    roles = make_roles(seed=6)
    roles.value_head.weight.normal_(generator=torch.Generator().manual_seed(2))
    roles.value_head.bias.fill_(0.25)
    roles.save_adapter(VALUE, tmp_path / "value")
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting"])
    with roles.as_role(VALUE):
        saved = roles.values(ids, mask, start)
    started = RoleModel(load_base_model(model_cfg), AdaptersConfig(policy={"r": 4},
                                                                   value={"r": 4, "init_from": str(tmp_path / "value")}))
    with started.as_role(VALUE):
        values = started.values(ids, mask, start)
    torch.testing.assert_close(values, saved, atol=ATOL, rtol=1e-5)
    assert saved.abs().min() > 0.01  # the head moved every value off 0
    assert all(p.requires_grad for p in started.value_parameters())


def adapter_dir(folder):
    folder.mkdir(parents=True)
    (folder / "adapter_config.json").write_text("{}")
    return folder


def test_a_folder_names_its_adapter_a_run_its_final_one_and_a_checkpoint_the_first_it_holds(tmp_path):
    """What `init_from` / `adapters.reference` may name (`adapter_folder`): an adapter folder as it is;
    a checkpoint, the first of the adapters asked for that it holds; a run, its final/ checkpoint's."""
    from lora_ppo.errors import RecipeError
    from lora_ppo.roles import REWARD, adapter_folder
    from lora_ppo.run_dir import FINAL_DIR, MANIFEST_FILE, RECIPE_FILE

    plain = adapter_dir(tmp_path / "sft-adapter")
    assert adapter_folder(str(plain), "f") == str(plain)
    checkpoint = tmp_path / "run" / "checkpoints" / "step-2"
    adapter_dir(checkpoint / POLICY)
    (checkpoint / MANIFEST_FILE).write_text("{}")
    assert adapter_folder(str(checkpoint), "f") == str(checkpoint / POLICY)
    adapter_dir(checkpoint / REWARD)
    assert adapter_folder(str(checkpoint), "f", (REWARD, POLICY)) == str(checkpoint / REWARD)  # the first asked for
    assert adapter_folder(str(checkpoint), "f", (VALUE, POLICY)) == str(checkpoint / POLICY)
    with pytest.raises(RecipeError, match=rf"^f: checkpoint {str(checkpoint)!r} holds no value adapter$"):
        adapter_folder(str(checkpoint), "f", (VALUE,))
    run = tmp_path / "run"
    (run / RECIPE_FILE).write_text("{}")
    with pytest.raises(RecipeError, match=r"has no complete final/ checkpoint yet \(it has not finished\); name one "
                                          r"of its checkpoints/step-N$"):
        adapter_folder(str(run), "adapters.policy.init_from")
    adapter_dir(run / FINAL_DIR / POLICY)
    (run / FINAL_DIR / MANIFEST_FILE).write_text("{}")
    assert adapter_folder(str(run), "f") == str(run / FINAL_DIR / POLICY)
    with pytest.raises(RecipeError, match=r"^f: '.*empty' is not a PEFT adapter folder \(no adapter_config.json\)$"):
        (tmp_path / "empty").mkdir()
        adapter_folder(str(tmp_path / "empty"), "f")


@torch.no_grad()
def test_a_critic_free_backbone_has_every_role_but_the_value(model_cfg, tokenizer):
    """RLOO and GRPO build no value adapter: the policy and the reference compute as usual, the value
    role is refused by name."""
    roles = RoleModel(load_base_model(model_cfg), AdaptersConfig(policy={"r": 4, "alpha": 8}), with_value=False)
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was"])
    for role in (POLICY, REFERENCE):
        with roles.as_role(role):
            logprobs, _ = roles.response_logprobs(ids, mask, start, 1.0)
        assert torch.isfinite(logprobs).all()
    assert roles.value_head is None and roles.value_parameters() == []
    with pytest.raises(ValueError, match="without a value adapter"):
        with roles.as_role(VALUE):
            pass


@torch.no_grad()
def test_roles_switched_through_pefts_own_calls_compute_what_the_fast_switch_computes(make_roles, tokenizer):
    """Where lora_ppo's own switch cannot run (a `modules_to_save` copy in the model: AdapterSwitch.of
    gives None), each role switches through PEFT's calls: every role's forward, a batch of rows under
    several roles, and the trainable flags after the reference equal the fast switch's. A batch that
    raises inside its rows' roles leaves no per-row adapter behind for the forwards after it."""
    roles = make_roles(seed=5)
    ids, mask, _ = prompt_and_random_response(tokenizer, ["This movie was", "The acting"])
    fast = {}
    for role in (POLICY, VALUE, REFERENCE):
        with roles.as_role(role):
            fast[role] = roles.hidden_states(ids, mask)
    fast_rows = roles.hidden_states_as_roles(ids, mask, [POLICY, VALUE, REFERENCE])
    roles._switch = None
    for role in (VALUE, REFERENCE, POLICY, VALUE):
        with roles.as_role(role):
            torch.testing.assert_close(roles.hidden_states(ids, mask), fast[role], atol=0, rtol=0)
        assert all(p.requires_grad for p in roles.policy_parameters() + roles.value_parameters())
    for got, want in zip(roles.hidden_states_as_roles(ids, mask, [POLICY, VALUE, REFERENCE]), fast_rows):
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    with roles.as_role(VALUE):  # after it, a batch under one role again
        torch.testing.assert_close(roles.hidden_states(ids, mask), fast[VALUE], atol=0, rtol=0)
    with pytest.raises(RuntimeError, match="a failing batch"):
        with roles.rows_as_roles([VALUE, POLICY], ids.shape[0]):
            raise RuntimeError("a failing batch")
    with roles.as_role(POLICY):  # as many rows as that batch had: each one the policy's
        twice = roles.hidden_states(ids.repeat(2, 1), mask.repeat(2, 1))
    torch.testing.assert_close(twice, fast[POLICY].repeat(2, 1, 1), atol=1e-6, rtol=1e-5)


def test_a_target_module_no_layer_has_names_the_layers_there_are():
    """GPT-2's layers are Conv1D, not nn.Linear: they are the names a misspelt target is shown."""
    from transformers import AutoModelForCausalLM

    from lora_ppo.errors import RecipeError
    from lora_ppo.roles import module_targets
    from tests.architectures import configs

    with torch.device("meta"):
        gpt2 = AutoModelForCausalLM.from_config(configs(vocab=320)["gpt2"])
    assert module_targets(gpt2, ["c_attn", "h.0.mlp.c_fc"], "adapters.value") == ["c_attn", "h.0.mlp.c_fc"]
    with pytest.raises(RecipeError, match=r"^adapters.value.target_modules: 'c_atn', 'mlp.c_fc.x' names no module of "
                                          r"this model; its linear layers: c_attn, c_fc, c_proj$"):
        module_targets(gpt2, ["c_atn", "c_attn", "mlp.c_fc.x"], "adapters.value")


def _foreign_adapter(folder, model, name: str) -> str:
    """A LoRA adapter of `model` (another base than the tiny Llama's, known as `name`), saved as PEFT
    saves one."""
    from peft import LoraConfig, get_peft_model

    names = {n.rsplit(".", 1)[-1] for n, m in model.named_modules() if type(m).__name__ in ("Linear", "Conv1D")}
    targets = sorted(names & {"q_proj", "c_attn"})
    get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=targets)).save_pretrained(str(folder))
    config = json.loads((folder / "adapter_config.json").read_text())
    (folder / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": name}))
    return str(folder)


def test_an_adapter_of_another_model_is_refused_in_one_line_naming_the_field(tmp_path, tiny_model_dir):
    """PEFT's own errors were tracebacks of 160 lines: an adapter whose layers this model lacks
    (GPT-2's `c_attn` on a Llama), and one of a Llama with another hidden size (weights of other
    shapes). Both are one line naming the recipe's field, through `train` and `train-sft`, before
    any run folder is made."""
    import yaml
    from transformers import LlamaConfig, LlamaForCausalLM
    from typer.testing import CliRunner

    from lora_ppo.cli import app
    from tests.architectures import configs
    from tests.conftest import tiny_recipe_dict
    from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl

    torch.manual_seed(0)
    from transformers import AutoModelForCausalLM

    gpt2 = _foreign_adapter(tmp_path / "gpt2-adapter", AutoModelForCausalLM.from_config(configs(300)["gpt2"]),
                            "org/tiny-gpt2")
    narrow = _foreign_adapter(tmp_path / "narrow-adapter", LlamaForCausalLM(LlamaConfig(
        vocab_size=300, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2)), "org/narrow-llama")

    recipe = tmp_path / "ppo.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "run")))
    result = CliRunner().invoke(app, ["train", str(recipe), f"adapters.policy.init_from={gpt2}", "--no-progress"])
    assert result.exit_code == 2, result.output
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: adapters.policy.init_from: {gpt2} was trained on org/tiny-gpt2: this model has no layer c_attn")

    result = CliRunner().invoke(app, ["train", str(recipe), f"adapters.reference={narrow}", "--no-progress"])
    assert result.exit_code == 2 and result.stderr.strip().splitlines()[-1].startswith(
        f"error: adapters.reference: {narrow} was trained on org/narrow-llama: its weights have other shapes"), \
        result.output

    data = write_jsonl(tmp_path / "d.jsonl", demonstration_rows(8))
    sft = tmp_path / "sft.yaml"
    sft.write_text(yaml.safe_dump(sft_recipe_dict(tiny_model_dir, data, data, tmp_path / "sft-run")))
    result = CliRunner().invoke(app, ["train-sft", str(sft), f"adapter.init_from={narrow}", "--no-progress"])
    assert result.exit_code == 2, result.output
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: adapter.init_from: {narrow} was trained on org/narrow-llama: its weights have other "
                           "shapes than this model's (model.layers.0.self_attn.q_proj.lora_A.")
    assert last.endswith(".weight: [4, 32] there, [4, 64] here)")
    assert not (tmp_path / "run").exists() and not (tmp_path / "sft-run").exists()
