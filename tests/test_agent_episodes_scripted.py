"""Episodes played by a scripted policy (turns of known text, no model): how the tools reach a
template that ignores `tools=`, a tool call cut by the token limit, the turn limit's warning, the
episode's return, and `eval`'s length and distinct-n counted over the episode's action tokens, as
training counts length."""

from __future__ import annotations

import logging
from types import SimpleNamespace

import pytest
import torch

from lora_ppo.agents.episodes import EpisodeSettings, run_episodes
from lora_ppo.agents.tools import TOOLS_SYSTEM_MESSAGE, parse_tool_calls
from lora_ppo.config import RolloutConfig
from lora_ppo.evaluation import evaluate
from lora_ppo.parts import episode_settings
from lora_ppo.rewards import RewardSources, no_reward
from lora_ppo.rollout import Samples, left_pad
from tests.conftest import prompt_rows
from tests.test_agent_tools import QWEN_TEMPLATE

ADD_CALL = '<tool_call>\n{"name": "add", "arguments": {"a": 2, "b": 3}}\n</tool_call>'


class ScriptedPolicy:
    """A sampler whose every row writes turn k's text (cut at max_new_tokens; the stop token added
    when `stops[k]`), with the tokenizer's real ids: run_episodes cannot tell it from the policy."""

    def __init__(self, tokenizer, turns: list[str], stops: list[bool], max_new_tokens: int = 400, embedding=None):
        self.tokenizer, self.turns, self.stops, self.turn = tokenizer, turns, stops, 0
        self.cfg = RolloutConfig(max_new_tokens=max_new_tokens, batch_size=4)
        self.roles = SimpleNamespace(lm_head=SimpleNamespace(weight=torch.zeros(1)),
                                     peft=SimpleNamespace(get_input_embeddings=lambda: embedding))
        self.staged_per_turn = []  # the embedding table's copy on the device each turn sampled with

    def with_settings(self, **settings):
        self.cfg = self.cfg.model_copy(update=settings)
        return self

    def sample(self, rows, record_logprobs=False, role=None, seeds=None) -> Samples:
        ids = self.tokenizer(self.turns[self.turn], add_special_tokens=False)["input_ids"][: self.cfg.max_new_tokens]
        stopped = self.stops[self.turn] and len(ids) < self.cfg.max_new_tokens
        ids = ids + [self.tokenizer.eos_token_id] * stopped
        self.turn += 1
        self.staged_per_turn.append(getattr(self.roles.peft.get_input_embeddings(), "_staged", None))
        query_ids, query_mask = left_pad(rows, self.tokenizer.pad_token_id, "cpu")
        B = len(rows)
        return Samples(query_ids, query_mask, torch.tensor([ids] * B), torch.ones(B, len(ids), dtype=torch.bool),
                       torch.tensor([stopped] * B), [self.tokenizer.decode(ids, skip_special_tokens=True)] * B)


def tool_settings(tokenizer, caplog=None, **rollout) -> EpisodeSettings:
    with caplog.at_level(logging.INFO, logger="lora_ppo.parts") if caplog else torch.no_grad():
        return episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=2, **rollout), tokenizer)


def test_a_template_that_ignores_tools_gets_them_in_the_system_message_the_parser_reads(tiny_tokenizer, caplog):
    """The tiny model's template (like SmolLM2's) drops `tools=`: the schemas go into a system
    message, said in one log line; the model's call in the format it asks for runs the tool."""
    settings = tool_settings(tiny_tokenizer, caplog)
    assert settings.tools_in_system is not None
    assert [r.getMessage() for r in caplog.records if "tools=" in r.getMessage()] == [
        "rollout.tools: the chat template ignores tools=, so their schemas go into the system message, with the "
        "<tool_call> format the calls are read in (docs/agents.md)"]
    rows = prompt_rows(tiny_tokenizer, ["What is 2 plus 3?"], chat_template=True)
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, [ADD_CALL, "It is 5."], [True, True]), rows, settings)
    prompt = tiny_tokenizer.decode(batch.queries()[0])
    assert prompt.startswith("<|im_start|>system\n# Tools\n\nYou may call one or more functions")
    assert prompt.count('"name": "add"') == 1 and "Add two numbers" in prompt
    assert prompt.endswith("<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n")
    # The format the system message asks for is one parse_tool_calls reads.
    example = TOOLS_SYSTEM_MESSAGE.split("<tool_call></tool_call> XML tags:\n")[1]
    assert parse_tool_calls(example.replace("<function-name>", '"add"').replace("<args-json-object>", "{}"))[0].name \
        == "add"
    assert batch.transcripts[0][1:] == [
        {"role": "assistant", "content": ADD_CALL}, {"role": "tool", "name": "add", "content": "5"},
        {"role": "assistant", "content": "It is 5."}]
    assert batch.metrics["episode/tool_calls"] == 1 and batch.metrics["episode/tool_errors"] == 0


def test_every_turn_of_an_episode_batch_reads_one_copy_of_an_offloaded_table(tiny_tokenizer):
    """model.offload_embeddings where the plan stages the table: an episode batch copies it to the
    device once for all its turns (a copy per turn would cost each turn the transfer)."""
    from lora_ppo.model import CpuEmbedding

    embedding = CpuEmbedding(torch.nn.Embedding(8, 4), torch.device("cpu"))
    embedding.staged_for_generation = True
    policy = ScriptedPolicy(tiny_tokenizer, [ADD_CALL, "It is 5."], [True, True], embedding=embedding)
    run_episodes(policy, prompt_rows(tiny_tokenizer, ["What is 2 plus 3?"], chat_template=True),
                 tool_settings(tiny_tokenizer))
    first, second = policy.staged_per_turn
    assert first is not None and first is second and embedding._staged is None


def test_a_template_that_renders_tools_gets_them_once_and_no_system_message_of_ours(tiny_tokenizer):
    tokenizer = tiny_tokenizer.__class__.from_pretrained(tiny_tokenizer.name_or_path)
    tokenizer.chat_template = QWEN_TEMPLATE
    tokenizer.pad_token, tokenizer.padding_side = tiny_tokenizer.pad_token, "left"
    settings = tool_settings(tokenizer)
    assert settings.tools_in_system is None
    rows = prompt_rows(tokenizer, ["What is 2 plus 3?"], chat_template=True)
    batch = run_episodes(ScriptedPolicy(tokenizer, [ADD_CALL, "It is 5."], [True, True]), rows, settings)
    prompt = tokenizer.decode(batch.queries()[0])
    assert prompt.count('"name": "add"') == 1 and "You may call one or more functions" not in prompt
    assert batch.transcripts[0][2] == {"role": "tool", "name": "add", "content": "5"}


def test_a_tool_call_cut_by_the_token_limit_says_so_and_names_the_setting(tiny_tokenizer):
    """Cut inside its arguments: not "not valid JSON (...)" but the cut and the setting to raise."""
    limit = len(tiny_tokenizer(ADD_CALL[: ADD_CALL.index('"b"')], add_special_tokens=False)["input_ids"])
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, [ADD_CALL, "It is 5."], [True, True], max_new_tokens=limit),
                         prompt_rows(tiny_tokenizer, ["What is 2 plus 3?"], chat_template=True),
                         tool_settings(tiny_tokenizer))
    assert batch.transcripts[0][1]["content"].endswith('"a": 2, ')
    assert batch.transcripts[0][2] == {
        "role": "tool", "name": "add",
        "content": "error: could not read the tool call to add: the tool call was cut off by the token limit "
                   f"(rollout.max_new_tokens: {limit}) before it ended"}
    assert batch.metrics["episode/tool_errors"] == 1


def again_settings(**limits) -> EpisodeSettings:
    from tests.agent_envs import Again

    return EpisodeSettings(environment=Again, environment_name="tests.agent_envs:Again", **limits)


def test_evals_length_counts_the_action_tokens_of_the_whole_episode_as_training_does(tiny_tokenizer):
    turns = ["Hello there, I think it is four.", "Fine, five."]
    actions = sum(len(tiny_tokenizer(t, add_special_tokens=False)["input_ids"]) + 1 for t in turns)  # + stop token
    rows = prompt_rows(tiny_tokenizer, ["What is 2 plus 3?"], chat_template=True)
    evaluation = evaluate(ScriptedPolicy(tiny_tokenizer, turns, [True, True]), rows, RewardSources.of(no_reward),
                          seed=0, with_text_stats=True, episodes=again_settings(max_turns=2, max_episode_tokens=None))
    assert evaluation.scores["length"] == actions
    # distinct-n over the same action tokens: both turns' (and their stop tokens), the observation between left out
    written = [t for turn in turns for t in tiny_tokenizer(turn, add_special_tokens=False)["input_ids"]
               + [tiny_tokenizer.eos_token_id]]
    bigrams = list(zip(written, written[1:]))
    assert evaluation.scores["distinct_1"] == pytest.approx(len(set(written)) / len(written))
    assert evaluation.scores["distinct_2"] == pytest.approx(len(set(bigrams)) / len(bigrams))
    assert evaluation.scores["score"] == pytest.approx(0.5 + 0.5)  # no reward source: the environment's rewards
