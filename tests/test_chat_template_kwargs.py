"""`model.chat_template_kwargs`: variables for the chat template (Qwen3's `enable_thinking: false`)
reach every rendering of the run's tokenizer: the prompts PPO samples from, SFT's rows, an exported
policy's parity check and card; a name the template never reads, or one lora_ppo sets itself, is
refused in one line before anything loads."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.config import ModelConfig, SFTConfig, SFTDataConfig, recipe_from_dict
from lora_ppo.data import PromptFormat
from lora_ppo.errors import RecipeError
from lora_ppo.model import load_tokenizer, pass_template_variables
from lora_ppo.sft.rows import prepare_sft_rows
from tests.conftest import tiny_recipe_dict, tokenizer_copy

# Qwen3's switch, in the tiny tokenizer's ChatML: an empty thought block opens each answer when off
# (the generation prompt's and an answer's alike, as Qwen3's template writes its last answer).
NO_THOUGHT = "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}" + NO_THOUGHT
    + "{% endif %}{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n" + NO_THOUGHT + "{% endif %}")
EMPTY_THOUGHT = "<think>\n\n</think>\n\n"
QUESTION = [{"role": "user", "content": "Rate the film."}]


@pytest.fixture(scope="module")
def thinking_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with a chat template that reads `enable_thinking`."""
    folder = tmp_path_factory.mktemp("thinking-model")
    shutil.copytree(tiny_model_dir, folder, dirs_exist_ok=True)
    config = json.loads((folder / "tokenizer_config.json").read_text())
    config.pop("chat_template", None)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    (folder / "chat_template.jinja").write_text(THINKING_TEMPLATE)
    return folder


def test_the_prompts_render_with_the_variables(thinking_model_dir):
    on = load_tokenizer(ModelConfig(name=str(thinking_model_dir)))
    off = load_tokenizer(ModelConfig(name=str(thinking_model_dir), chat_template_kwargs={"enable_thinking": False}))
    header = "<|im_start|>user\nRate the film.<|im_end|>\n<|im_start|>assistant\n"
    assert PromptFormat(on, False).row(QUESTION).text == header
    row = PromptFormat(off, False).row(QUESTION)
    assert row.text == header + EMPTY_THOUGHT
    assert list(row.ids) == off(header + EMPTY_THOUGHT, add_special_tokens=False)["input_ids"]
    # A call's own argument comes first: the run's variables are defaults, not a lock.
    assert off.apply_chat_template(QUESTION, tokenize=False, add_generation_prompt=True,
                                   enable_thinking=True) == header


def test_sft_rows_render_with_the_variables(thinking_model_dir):
    """A prompt-completion row trains on the answer after the prompt as PPO will render it (the empty
    thought block included, and not a target)."""
    tokenizer = load_tokenizer(ModelConfig(name=str(thinking_model_dir), chat_template_kwargs={"enable_thinking": False}))
    rows = [{"prompt": QUESTION, "completion": [{"role": "assistant", "content": "Great."}]}]
    (row,) = prepare_sft_rows(rows, ["prompt", "completion"], SFTDataConfig(), SFTConfig(), tokenizer, "d").rows
    assert tokenizer.decode(row.prompt_ids).endswith("assistant\n" + EMPTY_THOUGHT)
    assert tuple(row.ids[: len(row.prompt_ids)]) == row.prompt_ids and not any(row.targets[: len(row.prompt_ids)])


def test_a_name_the_template_never_reads_is_refused(thinking_model_dir, tiny_model_dir):
    with pytest.raises(RecipeError, match=r"^model.chat_template_kwargs: 'enable_thinkng' would change nothing: its "
                                          r"chat template never reads it$"):
        load_tokenizer(ModelConfig(name=str(thinking_model_dir), chat_template_kwargs={"enable_thinkng": False}))
    with pytest.raises(RecipeError, match="its chat template never reads it"):  # ChatML without the switch
        load_tokenizer(ModelConfig(name=str(tiny_model_dir), chat_template_kwargs={"enable_thinking": False}))


def test_the_cli_refuses_a_bad_name_in_one_line_before_anything_is_written(thinking_model_dir, tmp_path):
    recipe = tiny_recipe_dict(thinking_model_dir, tmp_path / "run")
    recipe["model"]["chat_template_kwargs"] = {"enable_thinkng": False}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    result = CliRunner().invoke(app, ["train", str(tmp_path / "r.yaml"), "--no-progress"])
    assert result.exit_code == 2
    assert result.output.strip().splitlines()[-1] == (
        "error: model.chat_template_kwargs: 'enable_thinkng' would change nothing: its chat template never reads it")
    assert not (tmp_path / "run").exists()


@pytest.mark.parametrize("name", ["add_generation_prompt", "tools", "tokenize"])
def test_a_name_lora_ppo_sets_itself_is_refused_by_the_schema(tmp_path, name):
    recipe = {"model": {"chat_template_kwargs": {name: True}}}
    with pytest.raises(RecipeError, match=rf"^model.chat_template_kwargs: {name!r} is set by lora_ppo itself"):
        recipe_from_dict(recipe)


def test_an_override_sets_one_variable():
    recipe = recipe_from_dict({}, ["model.chat_template_kwargs.enable_thinking=false"])
    assert recipe.model.chat_template_kwargs == {"enable_thinking": False}


def test_an_exported_policy_passes_parity_and_its_card_says_how_to_render(thinking_model_dir, tmp_path):
    """A run on conversational prompts with the variables set: the export's parity check renders its
    probe prompts with them on both sides (the exported tokenizer keeps no variables), and the model
    card shows the call that does."""
    data = tmp_path / "questions.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"Rate film {i}."}]}) + "\n"
                            for i in range(12)))
    recipe = tiny_recipe_dict(thinking_model_dir, tmp_path / "run", train={"steps": 1},
                              data={"source": str(data), "eval_size": 2})
    recipe["model"]["chat_template_kwargs"] = {"enable_thinking": False}
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(recipe))
    runner = CliRunner()
    trained = runner.invoke(app, ["train", str(tmp_path / "r.yaml"), "--no-progress"])
    assert trained.exit_code == 0, trained.output[-2000:]
    held_out = [json.loads(line)["prompt"] for line in (tmp_path / "run" / "eval_before.jsonl").read_text().splitlines()]
    assert held_out  # rendered through the template with the variables: what the export's probes must match
    exported = runner.invoke(app, ["merge-and-export", str(tmp_path / "run"), "--out", str(tmp_path / "export")])
    assert exported.exit_code == 0, exported.output[-2000:]
    assert "tokenizer         same ids" in exported.output
    card = (tmp_path / "export" / "README.md").read_text()
    assert "**{'enable_thinking': False})" in card


def test_the_variables_are_defaults_of_every_call_and_a_name_is_found_in_any_named_template():
    """`pass_template_variables` on a tokenizer with several named templates (a dict): a name one of
    them reads is taken; every call gets the variables under its own arguments."""
    from types import SimpleNamespace

    tokenizer = SimpleNamespace(chat_template={"default": "{{ messages }}", "tool_use": "{% if thinking %}{% endif %}"},
                                apply_chat_template=lambda conversation, *args, **kwargs: (conversation, args, kwargs))
    pass_template_variables(tokenizer, {"thinking": False})
    assert tokenizer.apply_chat_template(["m"], tokenize=False) == (["m"], (), {"thinking": False, "tokenize": False})
    assert tokenizer.apply_chat_template(["m"], thinking=True)[2] == {"thinking": True}


def test_a_tokenizer_without_a_chat_template_takes_no_variables(tiny_tokenizer):
    tokenizer = tokenizer_copy(tiny_tokenizer)
    tokenizer.chat_template = None
    with pytest.raises(RecipeError, match=r"^model.chat_template_kwargs: 'enable_thinking' would change nothing: the "
                                          r"tokenizer has no chat template$"):
        pass_template_variables(tokenizer, {"enable_thinking": False})
