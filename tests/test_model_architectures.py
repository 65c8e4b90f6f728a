"""The architecture matrix: every architecture of tests/architectures.py, built tiny and random,
loaded in real 4-bit through the real loading path, trains one PPO step on the default settings
with the policy equal to the reference (KL 0, ratio 1: the logit path is the model's own), and
exports with parity. Then the checks that guard it: a dropped logit transform is refused at load
time, and when the load-time check is bypassed too, the logprob self-check stops the first step.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from tests.architectures import ARCHITECTURES, build_model
from tests.conftest import build_tiny_tokenizer, tiny_recipe_dict

# Step 1's KL and ratio are exact up to float32 rounding when the policy equals the reference.
STEP_ONE_TOLERANCE = 1e-4


@pytest.fixture(scope="session")
def arch_dir(tmp_path_factory):
    """arch_dir(name): a folder with a tiny random model of that architecture and a tokenizer."""
    root = tmp_path_factory.mktemp("architectures")

    def make(name: str) -> Path:
        folder = root / name
        if not folder.exists():
            folder.mkdir()
            tokenizer = build_tiny_tokenizer(folder)
            build_model(name, folder, len(tokenizer))
        return folder

    return make


def train_one_step(model_dir: Path, out: Path, **sections) -> list[dict]:
    from lora_ppo.config import Recipe
    from lora_ppo.trainer import PPOTrainer

    recipe = tiny_recipe_dict(model_dir, out, train={"steps": 1, "eval": False}, **sections)
    PPOTrainer(Recipe(**recipe), progress=False).train()
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text(encoding="utf-8").splitlines()]


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_one_step_with_policy_equal_to_reference_then_export_with_parity(name, arch_dir, tmp_path):
    from lora_ppo.export import merge_and_export

    run = tmp_path / "run"
    # Old logprobs come from generation (the model's own forward, float32 here): the reference
    # and the update recompute them through lora_ppo's logit path, so both agree only if that
    # path is the model's distribution.
    step = train_one_step(arch_dir(name), run)[0]
    assert abs(step["objective/kl"]) < STEP_ONE_TOLERANCE, step["objective/kl"]
    assert step["check/logprob_max_diff"] < STEP_ONE_TOLERANCE, step["check/logprob_max_diff"]
    assert step["alarm/logprob_mismatch"] == 0.0

    report = merge_and_export(run, tmp_path / "export")
    assert report.parity is not None and report.parity.passed, report.parity.format()
    assert (tmp_path / "export" / "config.json").is_file()


@pytest.mark.parametrize("name", ["gemma2", "granite", "cohere"])
def test_a_model_whose_logit_transform_is_missed_is_refused_at_load(name, arch_dir, monkeypatch):
    from lora_ppo import roles as roles_module
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.errors import RecipeError
    from lora_ppo.logprobs import IDENTITY
    from lora_ppo.model import load_base_model

    monkeypatch.setattr(roles_module, "logit_transform_of", lambda config: IDENTITY)
    with pytest.raises(RecipeError, match=f"model.name: a {name} model's logits do not match"):
        roles_module.RoleModel(load_base_model(ModelConfig(name=str(arch_dir(name)))), AdaptersConfig())


@pytest.mark.parametrize("name", ["gemma2", "granite"])
def test_the_self_check_stops_the_first_step_when_the_transform_is_dropped(name, arch_dir, tmp_path, monkeypatch):
    from lora_ppo import roles as roles_module
    from lora_ppo.logprobs import IDENTITY
    from lora_ppo.trainer import TrainingHalted

    # Both load-time guards off: only the update's own comparison with the rollout is left.
    monkeypatch.setattr(roles_module, "logit_transform_of", lambda config: IDENTITY)
    monkeypatch.setattr(roles_module, "check_logit_path", lambda *args: None)
    with pytest.raises(TrainingHalted, match="logprob self-check failed at the first step") as raised:
        train_one_step(arch_dir(name), tmp_path / "run")
    assert "\n" not in str(raised.value)


def test_mixed_adapter_batches_fall_back_where_peft_refuses_them(arch_dir):
    """OPT flattens [B, T, H] before its MLP: PEFT refuses per-row adapters there, so scoring
    runs one pass per role, with the same numbers as the mixed pass gives elsewhere."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import POLICY, REFERENCE, VALUE, RoleModel
    from lora_ppo.rollout import score_passes

    roles = RoleModel(load_base_model(ModelConfig(name=str(arch_dir("opt")))), AdaptersConfig())
    assert roles.mixed_batches == {False: False, True: False}
    ids = torch.randint(3, 300, (3, 10), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    together = score_passes(roles, ids, mask, 4, 1.0, 2, together=True)
    apart = score_passes(roles, ids, mask, 4, 1.0, 2, together=False)
    for a, b in zip(together, apart):
        assert torch.equal(a, b)
    # A forward after the refused probe is an ordinary one (PEFT's hooks were not left behind).
    with roles.as_role(POLICY), torch.no_grad():
        assert roles.hidden_states(ids, mask).shape == (3, 10, roles.hidden_size)
    assert REFERENCE and VALUE  # the roles the probe tried


@pytest.mark.parametrize("name, shared_expert", [("qwen3_moe", False), ("qwen2_moe", True)])
def test_moe_experts_stay_out_of_module_targets(name, shared_expert, arch_dir):
    """`all-linear`, or a list naming the shared expert's `down_proj` (PEFT 0.22 reads that name on
    Qwen2-MoE as the fused experts' too), adapts Linear layers only; on Qwen3-MoE, whose only
    `down_proj` is the experts' weight, that list is refused with where expert weights go. Mixed
    batches work on Qwen3-MoE; Qwen2-MoE's block flattens [B, T, H] to [B*T, H] before its shared
    expert, as OPT does."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.errors import RecipeError
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import RoleModel

    model = ModelConfig(name=str(arch_dir(name)))
    linears = {n for n, m in load_base_model(model).named_modules()
               if type(m).__name__ in ("Linear4bit", "Linear") and n != "lm_head"}
    named = AdaptersConfig(policy={"r": 4, "alpha": 8, "target_modules": ["q_proj", "down_proj"]})
    if not shared_expert:
        with pytest.raises(RecipeError, match=r"^adapters.policy.target_modules: 'down_proj' names no module of this "
                                              r"model; its linear layers: k_proj, o_proj, q_proj, v_proj; expert "
                                              r"weights go in adapters.policy.target_parameters "
                                              r"\(mlp.experts.down_proj\)$"):
            RoleModel(load_base_model(model), named)
    cases = [(AdaptersConfig(), linears)]
    if shared_expert:
        cases.append((named, {n for n in linears if n.endswith(("q_proj", "down_proj"))}))
    for adapters, expected in cases:
        roles = RoleModel(load_base_model(model), adapters)
        wrapped = {n.split(".lora_A.")[0] for n, _ in roles.peft.named_parameters() if ".lora_A.policy" in n}
        assert {n.removeprefix("base_model.model.") for n in wrapped} == expected
        assert any(".shared_expert." in n for n in expected) == shared_expert
        assert roles.mixed_batches == {False: not shared_expert, True: not shared_expert}


@pytest.mark.parametrize("name", ["qwen3_moe", "qwen2_moe"])
def test_every_adapter_on_an_moe_model_holds_the_same_layers_and_loads_whole(name, arch_dir, tmp_path):
    """The value adapter, added second, and a saved adapter loaded as the reference after the policy
    wrap the policy's layers, and the reference holds the saved weights bit for bit. PEFT 0.22 took a
    layer another adapter had wrapped for a fused expert (its wrapper is no nn.Linear) and dropped
    Qwen2-MoE's shared expert from every adapter but the first."""
    from safetensors.torch import load_file

    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import POLICY, REFERENCE, VALUE, RoleModel

    def layers(roles, adapter):
        return {n.split(".lora_A.")[0] for n, _ in roles.peft.named_parameters() if f".lora_A.{adapter}." in n}

    model = ModelConfig(name=str(arch_dir(name)))
    first = RoleModel(load_base_model(model), AdaptersConfig())
    assert layers(first, VALUE) == layers(first, POLICY)
    torch.manual_seed(0)
    with torch.no_grad():
        for n, p in first.peft.named_parameters():
            if f".lora_B.{POLICY}." in n:
                p.normal_()  # LoRA B starts at 0: make the saved adapter tell its layers apart
    first.save_adapter(POLICY, tmp_path / "start")
    saved = load_file(str(tmp_path / "start" / "adapter_model.safetensors"))

    second = RoleModel(load_base_model(model), AdaptersConfig(policy={"init_from": str(tmp_path / "start")}))
    assert second.reference_adapter and layers(second, REFERENCE) == layers(second, POLICY) == layers(first, POLICY)
    reference = {n.replace(f".{REFERENCE}.", "."): p for n, p in second.peft.named_parameters() if f".{REFERENCE}." in n}
    assert reference.keys() == saved.keys()
    assert all(torch.equal(reference[k], saved[k]) for k in saved)


def test_moe_experts_train_when_named(arch_dir, tmp_path):
    from safetensors.torch import load_file

    folder = arch_dir("qwen3_moe")
    experts = ["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]
    lora = {"r": 4, "alpha": 8, "target_parameters": experts}
    steps = train_one_step(folder, tmp_path / "run", adapters={"policy": lora, "value": lora})
    assert abs(steps[0]["objective/kl"]) < STEP_ONE_TOLERANCE
    assert steps[0]["check/logprob_max_diff"] < STEP_ONE_TOLERANCE
    saved = load_file(str(tmp_path / "run" / "final" / "policy" / "adapter_model.safetensors"))
    expert_b = [t for n, t in saved.items() if "experts" in n and "lora_B" in n]
    assert expert_b and any(t.abs().sum() > 0 for t in expert_b)  # LoRA B starts at 0: it trained


def documented_mixed_batches() -> dict[str, tuple[bool, bool]]:
    """docs/models.md's architecture table: model_type -> (mixed batches without, with autograd)."""
    table = (Path(__file__).resolve().parents[1] / "docs" / "models.md").read_text(encoding="utf-8")
    names = {"Llama, Mistral, Phi-3, OLMo 2, SmolLM3, Qwen3": ("llama", "mistral", "phi3", "olmo2", "smollm3", "qwen3"),
             "Gemma 2, Gemma 3": ("gemma2", "gemma3")}
    documented = {}
    for row in table.split("## Tested architectures")[1].split("\n## ")[0].splitlines():
        cells = [c.strip() for c in row.strip("|").split("|")]
        if len(cells) != 3 or "/" not in cells[2] or cells[0].startswith(("architecture", "---")):
            continue
        label = cells[0].split(" (")[0]
        types = names.get(label) or tuple(t.strip("`") for t in cells[0].split("(")[1].rstrip(")").split(", ")
                                          if t.strip("`") in ARCHITECTURES)
        without, with_grad = (part.strip().startswith("yes") for part in cells[2].split("/"))
        documented.update({t: (without, with_grad) for t in types})
    return documented


@pytest.mark.parametrize("name", ARCHITECTURES)
def test_the_mixed_batch_probes_find_what_docs_models_md_says(name, arch_dir):
    """Each architecture's probes (a forward with a different adapter per block of rows, without and
    with a backward) agree with the table users read; where they fail, one pass per role runs."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import RoleModel

    expected = documented_mixed_batches()[name]
    roles = RoleModel(load_base_model(ModelConfig(name=str(arch_dir(name)))), AdaptersConfig())
    assert (roles.mixed_batches[False], roles.mixed_batches[True]) == expected
