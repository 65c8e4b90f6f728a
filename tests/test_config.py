"""The recipe schema: overrides, derived sizes, errors that name the field (and the field meant),
the fields a resume may change, the compute-dtype rule, and the generated reference."""

from __future__ import annotations

import pytest

from lora_ppo.config import (
    RewardRecipe,
    SFTRecipe,
    RESUME_ALLOWED,
    ModelConfig,
    Recipe,
    leaf_fields,
    recipe_from_dict,
    resume_differences,
)
from lora_ppo.errors import RecipeError
from lora_ppo.recipe_reference import REFERENCES, REGENERATE, reference_markdown


def _error(data, overrides=()) -> str:
    with pytest.raises(RecipeError) as err:
        recipe_from_dict(data, list(overrides))
    message = str(err.value)
    assert "\n" not in message
    return message


def test_overrides_reach_nested_fields_and_parse_types():
    recipe = recipe_from_dict({}, ["ppo.kl_coef=0.2", "train.steps=7", "ppo.whiten_rewards=true",
                                   "adapters.policy.target_modules=[q_proj, v_proj]"])
    assert recipe.ppo.kl_coef == 0.2 and recipe.train.steps == 7 and recipe.ppo.whiten_rewards is True
    assert recipe.adapters.policy.target_modules == ["q_proj", "v_proj"]


def test_derived_sizes():
    recipe = recipe_from_dict({"rollout": {"batch_size": 16}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 4}})
    assert (recipe.minibatch_size, recipe.micro_batch_size) == (8, 2)


def test_reference_resolution():
    assert recipe_from_dict({}).adapters.reference_adapter_path is None
    started = recipe_from_dict({"adapters": {"policy": {"init_from": "sft"}}})
    assert started.adapters.reference_adapter_path == "sft"
    assert recipe_from_dict({"adapters": {"policy": {"init_from": "sft"}, "reference": "disable"}}).adapters.reference_adapter_path is None


@pytest.mark.parametrize("data, field", [
    ({"rollout": {"top_p": 1.5}}, "rollout.top_p"),
    ({"ppo": {"gamma": 2}}, "ppo.gamma"),
    ({"train": {"output_dir": 3}}, "train.output_dir"),
    ({"reward": {"kind": "function", "function": "no_colon"}}, "module:function"),
    ({"model": "x"}, "model"),
    ({"model": {"quantization": "none", "dequantize_per_step": True}}, "model.dequantize_per_step"),
    ({"ppo": {"kl_coef_min": 0.05}}, "ppo.kl_coef_min (0.05) has no effect without target_kl"),
    ({"ppo": {"kl_coef_min": 0.2, "target_kl": 6, "kl_coef": 0.1}}, "ppo.kl_coef_min (0.2) must not exceed kl_coef (0.1)"),
])
def test_errors_name_the_field(data, field):
    assert field in _error(data)


@pytest.mark.parametrize("overrides, expected", [
    (["model.dequantize_per_step=maybe"], "model.dequantize_per_step: should be a valid boolean or 'auto' (got 'maybe')"),
    (["adapters.policy.target_modules=5"], "adapters.policy.target_modules: should be 'all-linear' or a valid list (got 5)"),
    (["model.dequantize_per_step=maybe", "train.steps=-1"],
     "model.dequantize_per_step: should be a valid boolean or 'auto' (got 'maybe') (and 1 more problem)"),
    # Two sibling fields with the same bad value are two problems, not the types of one field.
    (["train.steps=-1", "train.log_every=-1"], "train.steps: Input should be greater than 0 (got -1) (and 1 more problem)"),
])
def test_a_value_that_fits_no_type_of_a_union_field_gets_one_line_naming_them(overrides, expected):
    assert _error({}, overrides) == expected


@pytest.mark.parametrize("data, overrides, expected", [
    ({"ppoo": {}}, [], "ppoo: unknown field (did you mean ppo?)"),
    ({"ppo": {"clip_epz": 0.2}}, [], "ppo.clip_epz: unknown field (did you mean ppo.clip_eps?)"),
    ({"adapters": {"policy": {"rr": 8}}}, [], "adapters.policy.rr: unknown field (did you mean adapters.policy.r?)"),
    ({}, ["train.stpes=3"], "train.stpes: unknown field (did you mean train.steps?)"),
    ({"xyzzy": 1}, [], "xyzzy: unknown field (check the spelling)"),
    ({"train": {"colour": 1}}, [], "train.colour: unknown field (check the spelling)"),
])
def test_unknown_field_names_the_closest_known_one(data, overrides, expected):
    assert _error(data, overrides) == expected


def test_missing_eos_penalty_needs_a_stop_token():
    message = _error({"rollout": {"stop_token": None, "missing_eos_penalty": 0.5}})
    assert message.startswith("rollout.missing_eos_penalty (0.5)") and "rollout.stop_token is null" in message
    recipe = recipe_from_dict({"rollout": {"missing_eos_penalty": 0.5}})
    assert (recipe.rollout.stop_token, recipe.rollout.missing_eos_penalty) == ("eos", 0.5)


def test_a_negative_missing_eos_penalty_is_refused_with_the_sign_that_penalizes():
    """The penalty is subtracted, as TRL subtracts it: -3.0 would add 3 to every response that
    never stops."""
    assert _error({"rollout": {"missing_eos_penalty": -3.0}}) == (
        "rollout.missing_eos_penalty (-3.0) is subtracted from the score of a response that never stopped, so a "
        "negative one rewards it: give 3.0 to penalize")
    assert recipe_from_dict({"rollout": {"missing_eos_penalty": 0.0}}).rollout.missing_eos_penalty == 0.0


def test_resume_allowed_fields():
    assert RESUME_ALLOWED == {
        "train.steps", "train.log_every", "train.sample_every", "train.save_every", "train.keep_last",
        "train.eval", "train.overwrite", "train.max_consecutive_skips", "train.report_to", "data.eval_size",
        "data.eval_batch_size", "data.eval_samples_per_prompt", "model.dequantize_per_step",
        "rollout.compile",  # the same sampling either way (docs/performance.md)
        "ppo.compile_update",  # the same update up to float rounding (docs/performance.md)
        "ppo.trim_padding",  # the same numbers on real tokens up to float rounding (docs/performance.md)
        "ppo.packing",  # the same numbers on real tokens up to float rounding (docs/performance.md)
        "train.output_dir",  # a run folder moved elsewhere resumes where it is
        "train.memory_budget_gb",  # it chooses `auto` sizes; a resumed run keeps those it recorded
        "model.dequantize_budget_gb",  # how much of the dequantized copy is held: the same numbers
    }


def test_resume_takes_auto_sizes_as_the_run_recorded_them():
    saved = recipe_from_dict({}, ["ppo.grad_accum_steps=2", "rollout.forward_batch_size=8"]).model_dump(mode="json")
    auto = recipe_from_dict({}, ["ppo.grad_accum_steps=auto", "rollout.forward_batch_size=auto"])
    assert resume_differences(saved, auto) == []
    # A number the run did not record is a change like any other.
    assert resume_differences(saved, recipe_from_dict({}, ["ppo.grad_accum_steps=4"])) == ["ppo.grad_accum_steps",
                                                                                            "rollout.forward_batch_size"]


def test_resume_differences_ignore_allowed_fields_only():
    saved = recipe_from_dict({}).model_dump(mode="json")
    changed = recipe_from_dict({}, ["train.steps=5", "data.eval_size=3", "ppo.kl_coef=0.2",
                                    "adapters.value.r=8"])
    assert resume_differences(saved, changed) == ["adapters.value.r", "ppo.kl_coef"]
    del saved["train"]["seed"]
    assert resume_differences(saved, recipe_from_dict({})) == ["train.seed"]


def test_the_held_out_size_is_fixed_on_resume_where_it_is_split_off_the_training_data():
    """Without data.eval_source the held-out rows come out of data.source: another eval_size would
    train the rest of the run on other rows (some held out before)."""
    split = recipe_from_dict({}, ["data.eval_source=null"])
    saved = split.model_dump(mode="json")
    assert resume_differences(saved, recipe_from_dict({}, ["data.eval_source=null", "data.eval_size=3"])) == \
        ["data.eval_size"]
    assert resume_differences(saved, recipe_from_dict({}, ["data.eval_source=null", "train.steps=5"])) == []
    # `auto` splits too where the source has no held-out set beside it.
    own = recipe_from_dict({}, ["data.source=my_prompts.txt"])
    assert resume_differences(own.model_dump(mode="json"),
                              recipe_from_dict({}, ["data.source=my_prompts.txt", "data.eval_size=3"])) == \
        ["data.eval_size"]
    # Either side splitting is enough; with a held-out file on both sides the size may change.
    held = recipe_from_dict({}, ["data.eval_source=held.jsonl"])
    assert resume_differences(saved, recipe_from_dict({}, ["data.eval_source=held.jsonl", "data.eval_size=3"])) == \
        ["data.eval_size", "data.eval_source"]
    assert resume_differences(held.model_dump(mode="json"),
                              recipe_from_dict({}, ["data.eval_source=null", "data.eval_size=3"])) == \
        ["data.eval_size", "data.eval_source"]
    assert resume_differences(held.model_dump(mode="json"),
                              recipe_from_dict({}, ["data.eval_source=held.jsonl", "data.eval_size=3"])) == []
    sft = recipe_from_dict(sft_dict := {"data": {"source": "builtin:arithmetic_sft", "eval_source": None}},
                           schema=SFTRecipe)
    changed = recipe_from_dict({**sft_dict, "data": {**sft_dict["data"], "eval_size": 3}}, schema=SFTRecipe)
    assert resume_differences(sft.model_dump(mode="json"), changed) == ["data.eval_size"]


@pytest.mark.parametrize("compute_dtype, device, bf16_supported, expected", [
    ("auto", "cpu", True, "float32"),
    ("auto", "cpu", False, "float32"),
    ("auto", "cuda", True, "bfloat16"),
    ("auto", "cuda", False, "float16"),
    ("float16", "cpu", True, "float16"),
    ("bfloat16", "cuda", False, "bfloat16"),
    ("float32", "cuda", True, "float32"),
])
def test_compute_dtype_name(compute_dtype, device, bf16_supported, expected):
    cfg = ModelConfig(compute_dtype=compute_dtype)
    assert cfg.compute_dtype_name(device, bf16_supported) == expected


def test_compute_dtype_name_refuses_other_devices():
    with pytest.raises(ValueError, match="'mps'"):
        ModelConfig().compute_dtype_name("mps")


def test_every_field_and_section_is_described():
    for schema in (Recipe, RewardRecipe):
        undescribed = [path for path, field in leaf_fields(schema) if not field.description]
        assert not undescribed
        sections = [schema.model_fields[name].annotation for name in schema.model_fields]
        assert all(section.__doc__ and "\n" not in section.__doc__.strip() for section in sections)


@pytest.mark.parametrize("path", list(REFERENCES), ids=lambda p: p.name)
def test_recipe_reference_is_current(path):
    current = path.read_text(encoding="utf-8") if path.exists() else ""
    assert current == reference_markdown(REFERENCES[path]), f"{path.name} is stale: regenerate it with {REGENERATE}"


def test_a_recipe_of_the_other_kind_names_the_command_that_takes_it():
    from pathlib import Path

    from lora_ppo.config import load_recipe

    recipes = Path(__file__).resolve().parents[1] / "recipes"
    with pytest.raises(RecipeError) as ppo_as_reward:
        load_recipe(recipes / "quickstart.yaml", schema=RewardRecipe)
    assert str(ppo_as_reward.value) == f"recipe {recipes / 'quickstart.yaml'}: a PPO recipe; run it with lora-ppo train"
    with pytest.raises(RecipeError) as reward_as_ppo:
        load_recipe(recipes / "movie_reward.yaml")
    assert str(reward_as_ppo.value).endswith(": a reward-model recipe; run it with lora-ppo train-reward")
    with pytest.raises(RecipeError, match=r"^train.stpes: unknown field"):  # a typo is still a typo
        load_recipe(recipes / "quickstart.yaml", ["train.stpes=3"])


def test_an_override_removes_a_field_so_a_recipe_can_become_a_mix():
    """`~reward.kind` and `~reward.function` take the one source out; `reward.sources` then mixes.
    Without the removal the recipe's own source sits beside `sources` and is refused."""
    data = {"reward": {"kind": "function", "function": "tests.reward_fns:count_letter_e"}}
    mix = "reward.sources=[{kind: vader}, {kind: textblob, weight: 0.5}]"
    with pytest.raises(RecipeError, match="with sources, set each source's fields"):
        recipe_from_dict(data, [mix])
    recipe = recipe_from_dict(data, ["~reward.kind", "~reward.function", mix])
    assert [(s.kind, s.weight) for s in recipe.reward.source_list()] == [("vader", 1.0), ("textblob", 0.5)]
    with pytest.raises(RecipeError, match=r"^override '~reward.model': the recipe does not set reward.model$"):
        recipe_from_dict(data, ["~reward.model"])


@pytest.mark.parametrize("sections, message", [
    ({"rollout": {"batch_size": 6, "samples_per_prompt": 4}},
     "rollout.batch_size (6) must be divisible by rollout.samples_per_prompt (4)"),
    # divisible by num_minibatches (2) alone, not by num_minibatches * grad_accum_steps (6)
    ({"rollout": {"batch_size": 8}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 3}},
     "rollout.batch_size (8) must be divisible by ppo.num_minibatches * ppo.grad_accum_steps (6)"),
])
def test_a_batch_that_does_not_split_into_groups_or_micro_batches_is_refused(sections, message):
    """Caught in the recipe, before anything loads: otherwise groups of samples would straddle
    prompts, or the last micro-batches of each minibatch be silently dropped."""
    with pytest.raises(RecipeError) as raised:
        recipe_from_dict(sections)
    assert message in str(raised.value)


@pytest.mark.parametrize("data, expected", [
    ({"model": {"dequantize_budget_gb": 4, "dequantize_per_step": False}},
     "model.dequantize_budget_gb (4) needs dequantize_per_step true or auto"),
    ({"model": {"quantization": "none", "quantize_lm_head": True}},
     "model.quantize_lm_head: needs model.quantization 4bit or 8bit (got 'none')"),
    ({"adapters": {"value": {"init_from": "reward"}}},
     "adapters.value.init_from: 'reward' starts the value from the reward adapter, and this recipe has none "
     "(reward.kind: adapter)"),
])
def test_settings_that_need_another_are_refused_in_one_line(data, expected):
    assert _error(data) == expected


@pytest.mark.parametrize("data", [
    {"model": {"dequantize_budget_gb": 4, "dequantize_per_step": "auto"}},
    {"model": {"dequantize_budget_gb": 4, "dequantize_per_step": True}},
    {"model": {"quantization": "8bit", "quantize_lm_head": True}},
    {"reward": {"kind": "adapter", "adapter": "runs/reward/final/reward", "function": None},
     "adapters": {"value": {"init_from": "reward"}}},
    {"ppo": {"kl_coef": 0.1, "kl_coef_min": 0.1, "target_kl": 6}},  # a floor at the start value: allowed
])
def test_the_settings_next_to_each_refusal_are_accepted(data):
    recipe_from_dict(data)


@pytest.mark.parametrize("setting, expected", [(True, True), (False, False), ("auto", True)])
def test_gradient_checkpointing_left_to_auto_without_a_memory_plan_is_on(setting, expected):
    assert ModelConfig(gradient_checkpointing=setting).checkpointing_on is expected


@pytest.mark.parametrize("compile_, device, steps, expected", [
    ("auto", "cuda", 1999, False), ("auto", "cuda", 2000, True), ("auto", "cpu", 10**6, False),
    (True, "cpu", 1, True), (False, "cuda", 10**6, False),
])
def test_compile_auto_is_on_for_cuda_from_2000_decode_steps(compile_, device, steps, expected):
    from lora_ppo.config import RolloutConfig

    assert RolloutConfig(compile=compile_).compiles_on(device, steps) is expected


def test_the_response_budget_is_the_new_tokens_or_the_episodes():
    from lora_ppo.config import RolloutConfig

    assert RolloutConfig(max_new_tokens=32).response_tokens == 32
    assert RolloutConfig(max_new_tokens=32, max_turns=3, tools=["calculator"]).response_tokens == 96
    assert RolloutConfig(max_new_tokens=32, max_turns=3, tools=["calculator"],
                         max_episode_tokens=50).response_tokens == 50


def test_an_override_removes_a_field_three_levels_down():
    data = {"adapters": {"policy": {"r": 8, "init_from": "runs/sft"}}}
    assert recipe_from_dict(data, ["~adapters.policy.init_from"]).adapters.policy.init_from is None
    with pytest.raises(RecipeError, match=r"^override '~adapters.value.r': the recipe does not set adapters.value.r$"):
        recipe_from_dict(data, ["~adapters.value.r"])


@pytest.mark.parametrize("data, expected", [
    ({"reward": {"sources": [{"kind": "vader"}, {"knd": "textblob"}]}},
     "reward.sources.1.knd: unknown field (did you mean reward.sources.1.kind?)"),
    ({"ppo\n": {}}, "'ppo\\n': unknown field (did you mean ppo?)"),
    ({"ppo ": {}}, "'ppo ': unknown field (did you mean ppo?)"),
    ({"": {}}, "'': unknown field (check the spelling)"),
])
def test_unknown_fields_in_list_entries_and_odd_keys_are_named_on_one_line(data, expected):
    assert _error(data) == expected


def test_a_bad_list_entry_is_named_by_its_index():
    assert _error({"rollout": {"tools": ["calculator", 5]}}) == \
        "rollout.tools.1: Input should be a valid string (got 5)"


@pytest.mark.parametrize("overrides, expected", [
    (["model.name="], "model.name: must not be empty"),
    (["data.source="], "data.source: must not be empty"),
    (["data.eval_source="], "data.eval_source: must not be empty"),
    (["train.output_dir="], "train.output_dir: must not be empty"),
    (["rollout.tools=[calculator, '']"], "rollout.tools.1: must not be empty"),
    # A list for `'all-linear' or list[str]`: the list's bad entry, not the union's two types.
    (["adapters.policy.target_modules=[q_proj, '']"], "adapters.policy.target_modules.1: must not be empty"),
    (["adapters.policy.target_modules=[q_proj, 3]", "train.steps=-1"],
     "adapters.policy.target_modules.1: Input should be a valid string (got 3) (and 1 more problem)"),
])
def test_an_empty_name_path_or_column_is_refused_naming_the_field(overrides, expected):
    """`data.source=` on the command line read as the recipe's own folder, and `model.name=` failed
    only once the tokenizer loaded."""
    assert _error({}, overrides) == expected


def test_a_path_object_is_taken_wherever_a_recipe_names_a_file_or_folder(tmp_path):
    """From Python, `recipe_from_dict({"train": {"output_dir": tmp_path / "run"}})` was refused: "Input
    should be a valid string (got PosixPath(...))"."""
    recipe = recipe_from_dict({"model": {"name": tmp_path / "model"}, "data": {"source": tmp_path / "p.jsonl"},
                               "adapters": {"policy": {"init_from": tmp_path / "sft"}},
                               "train": {"output_dir": tmp_path / "run"}})
    assert (recipe.model.name, recipe.data.source, recipe.adapters.policy.init_from, recipe.train.output_dir) == \
        (str(tmp_path / "model"), str(tmp_path / "p.jsonl"), str(tmp_path / "sft"), str(tmp_path / "run"))
    sft = recipe_from_dict({"data": {"source": tmp_path / "d.jsonl"}, "sft": {}}, schema=SFTRecipe)
    assert sft.data.source == str(tmp_path / "d.jsonl")


@pytest.mark.parametrize("schema", [Recipe, RewardRecipe, SFTRecipe])
def test_an_empty_system_prompt_is_still_accepted_as_none(schema):
    assert recipe_from_dict({"data": {"system_prompt": ""}}, schema=schema).data.system_prompt == ""


def test_invalid_yaml_names_the_problem_and_where(tmp_path):
    from lora_ppo.config import load_recipe

    path = tmp_path / "bad.yaml"
    path.write_text("train:\n  steps: 3\n   log_every: 2\n")
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == f"recipe {path}: mapping values are not allowed here at line 3, column 13"


@pytest.mark.parametrize("text, key, lines", [
    # A section written again at the bottom: PyYAML kept the second alone, so the learning rate
    # went back to its default without a word.
    ("ppo:\n  learning_rate: 1.0e-5\ntrain:\n  steps: 3\nppo:\n  kl_coef: 0.2\n", "ppo", (1, 5)),
    ("ppo:\n  kl_coef: 0.1\n  kl_coef: 0.2\n", "kl_coef", (2, 3)),
])
def test_a_key_set_twice_is_refused_naming_both_lines(tmp_path, text, key, lines):
    from lora_ppo.config import load_recipe

    path = tmp_path / "twice.yaml"
    path.write_text(text)
    with pytest.raises(RecipeError) as err:
        load_recipe(path)
    assert str(err.value) == (f"recipe {path}: {key!r} is set twice, at lines {lines[0]} and {lines[1]} "
                              "(YAML would keep the last alone): keep one")


def test_a_yaml_merge_key_may_still_be_set_again_after_it(tmp_path):
    """`<<: *anchor` then a key of the anchor: YAML's override, not a key set twice."""
    from lora_ppo.config import load_recipe

    path = tmp_path / "merged.yaml"
    path.write_text("ppo: &ppo\n  kl_coef: 0.1\n  learning_rate: 1.0e-5\n")
    assert load_recipe(path).ppo.kl_coef == 0.1
    path.write_text("train: {steps: 3}\nppo:\n  <<: {kl_coef: 0.1, learning_rate: 1.0e-5}\n  kl_coef: 0.3\n")
    recipe = load_recipe(path)
    assert (recipe.ppo.kl_coef, recipe.ppo.learning_rate, recipe.train.steps) == (0.3, 1.0e-5, 3)


def test_local_paths_and_matching_globs_are_made_absolute_and_hub_ids_kept(tmp_path, monkeypatch):
    """recipe.yaml in the run folder must work from any folder: a model folder and a data glob named
    relative to where the run started become absolute; a hub id (no such local path) and a glob
    that matches nothing stay as written."""
    from lora_ppo.config import with_absolute_paths

    (tmp_path / "models" / "tiny").mkdir(parents=True)
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "a.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    local = with_absolute_paths(recipe_from_dict({"model": {"name": "models/tiny"}, "data": {"source": "data/*.jsonl"}}))
    assert (local.model.name, local.data.source) == (str(tmp_path / "models/tiny"), str(tmp_path / "data/*.jsonl"))
    hub = with_absolute_paths(recipe_from_dict({"model": {"name": "org/model"}, "data": {"source": "none/*.jsonl"}}))
    assert (hub.model.name, hub.data.source) == ("org/model", "none/*.jsonl")
    # In each entry of a list of sources.
    (tmp_path / "rewards" / "a").mkdir(parents=True)
    mixed = with_absolute_paths(recipe_from_dict({"reward": {"sources": [
        {"kind": "vader"}, {"kind": "adapter", "adapter": "rewards/a"}, {"kind": "classifier", "model": "hub/b"}]}}))
    assert [(s.adapter, s.model) for s in mixed.reward.sources] == \
        [(None, None), (str(tmp_path / "rewards/a"), None), (None, "hub/b")]


def test_the_written_recipe_lists_its_sections_in_the_schemas_order():
    import yaml

    from lora_ppo.config import recipe_to_yaml

    assert list(yaml.safe_load(recipe_to_yaml(recipe_from_dict({})))) == list(Recipe.model_fields)


def test_a_reward_module_found_as_a_file_is_recorded_by_its_path(tmp_path, monkeypatch):
    """A `module:function` whose module is a .py file in the current folder, or beside the recipe,
    is recorded by that file's absolute path; a dotted module, or one found nowhere, stays an import."""
    from lora_ppo.config import with_absolute_paths

    here, beside = tmp_path / "here", tmp_path / "recipes"
    here.mkdir()
    beside.mkdir()
    (here / "my_reward.py").write_text("def score(completions, **kw):\n    return [0.0] * len(completions)\n")
    (beside / "their_reward.py").write_text("def score(completions, **kw):\n    return [0.0] * len(completions)\n")
    monkeypatch.chdir(here)

    def recorded(spec, recipe_dir=None):
        recipe = recipe_from_dict({"reward": {"kind": "function", "function": spec}})
        return with_absolute_paths(recipe, recipe_dir).reward.function

    assert recorded("my_reward:score") == f"{here}/my_reward.py:score"
    assert recorded("their_reward:score", beside) == f"{beside}/their_reward.py:score"
    assert recorded("their_reward:score") == "their_reward:score"  # no recipe folder to look in
    assert recorded("tests.reward_fns:count_letter_e", beside) == "tests.reward_fns:count_letter_e"
    # A builtin tool's name is no module:function, whatever files share it.
    (here / "calculator.py").write_text("")
    tools = with_absolute_paths(recipe_from_dict({"rollout": {"tools": ["calculator", "my_reward:score"]}}))
    assert tools.rollout.tools == ["calculator", f"{here}/my_reward.py:score"]


@pytest.mark.parametrize("data, float32, roles", [
    ({}, True, 2),  # reference and value; the policy's logprobs come from generation in float32
    ({}, False, 3),  # and the policy, scored again where generation ran in another precision
    ({"rollout": {"logprobs_from_generation": False}}, True, 3),
    ({"adapters": {"reference": "none"}}, True, 1),
    ({"ppo": {"advantage_estimator": "rloo"}, "rollout": {"samples_per_prompt": 2}}, True, 1),
    ({"ppo": {"advantage_estimator": "grpo"}, "rollout": {"samples_per_prompt": 2}, "adapters": {"reference": "none"}},
     False, 1),
])
def test_the_roles_a_rollout_is_scored_as(data, float32, roles):
    assert recipe_from_dict(data).scored_roles(float32) == roles


def test_the_sizes_left_to_auto_are_the_ones_the_recipe_says_auto():
    assert recipe_from_dict({}).auto_sizes == []
    assert recipe_from_dict({"ppo": {"grad_accum_steps": "auto"}}).auto_sizes == ["ppo.grad_accum_steps"]


def test_a_recipe_cannot_be_changed_in_place():
    """A run's recipe is what ran: changing one goes through `with_values` (validated again), never
    an assignment that skips the checks."""
    import pydantic

    recipe = recipe_from_dict({})
    with pytest.raises(pydantic.ValidationError, match="frozen"):
        recipe.train.steps = -5
    assert recipe.with_values({"train.steps": 5}).train.steps == 5


def test_fused_4bit_decode_needs_nf4_weights():
    assert _error({"model": {"fused_4bit_decode": True, "bnb_4bit_quant_type": "fp4"}}) == \
        "model.fused_4bit_decode: needs model.quantization 4bit with bnb_4bit_quant_type nf4 (got '4bit', 'fp4')"
    assert recipe_from_dict({"model": {"fused_4bit_decode": True}}).model.fused_4bit_decode


def test_an_estimate_for_a_gpu_assumes_bfloat16():
    assert ModelConfig().compute_dtype_name("cuda") == "bfloat16"


def test_two_odd_top_level_keys_are_two_unknown_fields():
    """Two misspelt sections with the same value are two problems, not one field's types."""
    assert _error({"ppo ": 1, "ppo\t": 1}) == "'ppo ': unknown field (did you mean ppo?) (and 1 more problem)"


def test_a_batch_that_the_micro_batches_do_not_divide_is_refused():
    assert _error({"rollout": {"batch_size": 12}, "ppo": {"num_minibatches": 2, "grad_accum_steps": 4}}) == \
        "rollout.batch_size (12) must be divisible by ppo.num_minibatches * ppo.grad_accum_steps (8)"


def test_a_steps_longest_sequence_and_a_runs_decode_steps():
    recipe = recipe_from_dict({"data": {"max_prompt_tokens": 64}, "rollout": {"max_new_tokens": 24},
                               "train": {"steps": 100}})
    assert (recipe.sequence_tokens, recipe.decode_steps) == (64 + 24, 100 * 24)


def test_a_recipe_file_of_another_kind_than_its_sections_suggest_is_read_as_the_kind_it_validates_as(tmp_path):
    """An `adapter` section reads as a reward model's recipe; when that fails and the file is a
    valid SFT recipe (an SFT-only data field, no `sft` section), it is read as one, overrides and all."""
    import yaml

    from lora_ppo.config import load_recipe

    path = tmp_path / "sft.yaml"
    path.write_text(yaml.safe_dump({"adapter": {"r": 4}, "data": {"source": "demos.jsonl", "eval_samples": 2}}))
    recipe = load_recipe(path, ["train.epochs=3"], schema=None)
    assert isinstance(recipe, SFTRecipe) and (recipe.data.eval_samples, recipe.train.epochs) == (2, 3)


@pytest.mark.parametrize("schema", [RewardRecipe, SFTRecipe])
def test_a_stages_batch_that_its_micro_batches_do_not_divide_is_refused(schema):
    with pytest.raises(RecipeError) as err:
        recipe_from_dict({"train": {"batch_size": 6, "grad_accum_steps": 4}}, schema=schema)
    assert str(err.value) == "train.batch_size (6) must be divisible by grad_accum_steps (4)"
    assert recipe_from_dict({"train": {"batch_size": 8, "grad_accum_steps": 4}}, schema=schema).train.batch_size == 8


def test_a_packing_length_of_max_length_is_accepted_and_a_shorter_one_refused():
    data = {"data": {"max_length": 512}, "sft": {"packing": True, "packing_length": 512}}
    assert recipe_from_dict(data, schema=SFTRecipe).packing_length == 512
    assert recipe_from_dict(data, ["sft.packing_length=1024"], schema=SFTRecipe).packing_length == 1024
    assert recipe_from_dict(data, ["sft.packing_length=null"], schema=SFTRecipe).packing_length == 512  # max_length
    with pytest.raises(RecipeError, match=r"sft.packing_length \(511\) must be at least data.max_length \(512\)"):
        recipe_from_dict(data, ["sft.packing_length=511"], schema=SFTRecipe)
