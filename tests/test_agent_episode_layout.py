"""An episode's tokens, written out by hand: what the chat template puts between turns (after a
stopped, an empty or a cut turn, with a template that trims the text, ends an assistant message
apart or checks who speaks before it, with a tokenizer that adds a BOS token), the budget cutting each row's last turn to its own tokens left, an observation with
no room after it, the flags and rewards the limits leave, whose format the tool calls are read
in, the recipe's system prompt, the logprobs recorded at sampling, each turn's seeds, the row
numbers errors give, and the transcript's lines. The policy is scripted
(tests/test_agent_episodes_scripted.py), so every token is known."""

from __future__ import annotations

import dataclasses
import hashlib

import pytest
import torch

from lora_ppo.agents.environment import EpisodeError, Observation
from lora_ppo.agents.episodes import EpisodeSettings, run_episodes, transcript_text
from lora_ppo.config import RolloutConfig
from lora_ppo.data import PromptFormat
from lora_ppo.parts import episode_settings
from tests.conftest import CHAT_TEMPLATE, bos_first, prompt_rows, tokenizer_copy
from tests.test_agent_episodes_scripted import ADD_CALL, ScriptedPolicy, again_settings
from tests.test_agent_tools import QWEN_TEMPLATE, RESPONSE_TEMPLATE

PROMPT = "What is 2 plus 3?"
AGAIN = "<|im_start|>user\nagain<|im_end|>\n<|im_start|>assistant\n"  # the template's user turn and header


class Reply:
    """Answers every turn with the row's `reply` column (so rows get observations of their own
    lengths) and never ends the episode: only the limits do."""

    def __init__(self, reply: str):
        self.reply = reply

    def step(self, message):
        return Observation([{"role": "user", "content": self.reply}])


def ids_of(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def trimming(tokenizer):
    copy = tokenizer_copy(tokenizer)
    copy.chat_template = CHAT_TEMPLATE.replace("{{ m['content'] }}", "{{ m['content'] | trim }}")
    return copy


def assistant_ends_apart(tokenizer):
    """A template that ends an assistant message otherwise than the others (an extra newline)."""
    copy = tokenizer_copy(tokenizer)
    extra_newline = "{% if m['role'] == 'assistant' %}{{ '\\n' }}{% endif %}"
    copy.chat_template = CHAT_TEMPLATE.replace("<|im_end|>\n{% endfor %}", f"<|im_end|>\n{extra_newline}{{% endfor %}}")
    assert copy.chat_template != CHAT_TEMPLATE
    return copy


# ---- what the template writes between turns --------------------------------------------------


@pytest.mark.parametrize("first_turn, stopped, max_new_tokens, tokenizer_of, between", [
    # the action's own stop token (<|im_end|>) closed the turn: the rest of the template's end of turn
    ("Four.", True, 400, None, "\n" + AGAIN),
    # the policy stopped at once: an empty message, still followed by the template's "\n"
    ("", True, 400, None, "\n" + AGAIN),
    # cut by max_new_tokens: the whole end-of-turn marker is the template's
    ("Four and more words here", False, 3, None, "<|im_end|>\n" + AGAIN),
    # the template trims the text it writes (as Llama 3's does): the end of turn is found all the same
    (" Four. ", True, 400, trimming, "\n" + AGAIN),
    (" Four and more words here", False, 3, trimming, "<|im_end|>\n" + AGAIN),
    # observations are encoded without the BOS token a plain call would add
    ("Four.", True, 400, bos_first, "\n" + AGAIN),
    # the end of an assistant's turn, not of any message's
    ("Four.", True, 400, assistant_ends_apart, "\n\n" + AGAIN),
], ids=["stopped", "empty-turn", "cut", "trimming-template", "trimming-template-cut", "bos-tokenizer",
        "assistant-ending"])
def test_the_tokens_between_turns_are_what_the_template_writes_between_them(
        tiny_tokenizer, first_turn, stopped, max_new_tokens, tokenizer_of, between):
    tokenizer = tokenizer_of(tiny_tokenizer) if tokenizer_of else tiny_tokenizer
    eos = tokenizer.eos_token_id
    rows = prompt_rows(tokenizer, [PROMPT], chat_template=True, turns=[2])
    policy = ScriptedPolicy(tokenizer, [first_turn, "Five."], [stopped, True], max_new_tokens=max_new_tokens)
    batch = run_episodes(policy, rows, again_settings(max_turns=2, max_episode_tokens=None))

    first = ids_of(tokenizer, first_turn)[:max_new_tokens] + [eos] * stopped
    second = ids_of(tokenizer, "Five.")[:max_new_tokens]
    second += [eos] * (len(second) < max_new_tokens)
    observation = ids_of(tokenizer, between)
    assert batch.queries()[0] == list(rows[0].ids)
    assert batch.completion_ids()[0] == first + observation + second
    assert batch.action_mask()[0] == [True] * len(first) + [False] * len(observation) + [True] * len(second)
    assert tokenizer.decode(observation) == between  # no BOS, nothing the template does not write
    assert batch.transcripts[0] == [
        {"role": "user", "content": PROMPT},
        {"role": "assistant", "content": tokenizer.decode(first, skip_special_tokens=True)},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": tokenizer.decode(second, skip_special_tokens=True)}]
    assert batch.last_turn_ids == [second] and batch.completions == [tokenizer.decode(second, skip_special_tokens=True)]
    assert batch.metrics["episode/observation_tokens"] == len(observation)


# ---- the episode budget ------------------------------------------------------------------------


def reply_rows(tokenizer, replies):
    return prompt_rows(tokenizer, [PROMPT] * len(replies), chat_template=True, reply=replies)


def reply_settings(budget: int) -> EpisodeSettings:
    return EpisodeSettings(max_turns=4, max_episode_tokens=budget, environment=Reply,
                           environment_name="tests.test_agent_episode_layout:Reply")


LONG_TURN = "I think it is four, or maybe five, I cannot say which of the two it is."


def test_the_budget_cuts_each_rows_last_turn_to_its_own_tokens_left(tiny_tokenizer):
    """Two rows whose observations differ in length: the turn after them is sampled for the row
    with more room, and the other row's copy is cut to its own tokens left; both end at exactly
    the budget, truncated, not stopped, each turn's text that of its own tokens (a special token
    among them skipped, as in a sampled turn's text)."""
    eos = tiny_tokenizer.eos_token_id
    replies = ["ok", "a much longer answer than the other one"]
    observations = [ids_of(tiny_tokenizer, f"\n<|im_start|>user\n{r}<|im_end|>\n<|im_start|>assistant\n")
                    for r in replies]
    first = ids_of(tiny_tokenizer, "Four.") + [eos]
    budget = len(first) + len(observations[1]) + 2  # row 1 has 2 tokens left for its second turn
    left = [budget - len(first) - len(o) for o in observations]
    turn = "I<|im_start|>" + LONG_TURN
    second = ids_of(tiny_tokenizer, turn)
    assert left[1] == 2 < left[0] < len(second) and second[1] == tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")

    policy = ScriptedPolicy(tiny_tokenizer, ["Four.", turn, "never sampled"], [True, True, True], max_new_tokens=40)
    batch = run_episodes(policy, reply_rows(tiny_tokenizer, replies), reply_settings(budget))

    for i in range(2):
        assert batch.completion_ids()[i] == first + observations[i] + second[: left[i]]
        assert len(batch.completion_ids()[i]) == budget
        assert batch.action_mask()[i] == [True] * len(first) + [False] * len(observations[i]) + [True] * left[i]
        assert batch.last_turn_ids[i] == second[: left[i]]
        assert batch.completions[i] == tiny_tokenizer.decode(second[: left[i]], skip_special_tokens=True)
    assert batch.completions[1] == "I"
    assert policy.turn == 2  # no third turn: the budget is spent
    assert batch.stopped.tolist() == [False, False]
    assert batch.metrics["episode/truncated_frac"] == 1.0 and batch.metrics["episode/turn_limit_frac"] == 0.0
    assert batch.metrics["episode/turns"] == 2.0
    assert batch.metrics["episode/observation_tokens"] == (len(observations[0]) + len(observations[1])) / 2


def test_an_observation_that_leaves_no_room_for_a_turn_ends_the_episode_before_it(tiny_tokenizer):
    """Row 1's observation would fill the budget: it is not added, and row 1 ends after its first
    turn; row 0's shorter one fits, and its second turn gets the tokens left."""
    eos = tiny_tokenizer.eos_token_id
    replies = ["ok", "a much longer answer than the other one"]
    observations = [ids_of(tiny_tokenizer, f"\n<|im_start|>user\n{r}<|im_end|>\n<|im_start|>assistant\n")
                    for r in replies]
    first = ids_of(tiny_tokenizer, "Four.") + [eos]
    budget = len(first) + len(observations[1])
    policy = ScriptedPolicy(tiny_tokenizer, ["Four.", LONG_TURN], [True, True], max_new_tokens=40)
    batch = run_episodes(policy, reply_rows(tiny_tokenizer, replies), reply_settings(budget))

    left = budget - len(first) - len(observations[0])
    assert batch.completion_ids()[0] == first + observations[0] + ids_of(tiny_tokenizer, LONG_TURN)[:left]
    assert batch.completion_ids()[1] == first
    assert batch.transcripts[1] == [{"role": "user", "content": PROMPT}, {"role": "assistant", "content": "Four."}]
    assert batch.metrics["episode/turns"] == (2 + 1) / 2 and batch.metrics["episode/truncated_frac"] == 1.0
    # row 1's last turn ended with its stop token, but the budget ended the episode
    assert batch.stopped.tolist() == [False, False]


# ---- what ends an episode, and the rewards on its turns ---------------------------------------


def test_an_episode_the_environment_ends_is_neither_truncated_nor_cut_by_the_turn_limit(tiny_tokenizer):
    eos = tiny_tokenizer.eos_token_id
    rows = prompt_rows(tiny_tokenizer, [PROMPT], chat_template=True, turns=[2])
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four.", "Five."], [True, True]), rows,
                         again_settings(max_turns=3, max_episode_tokens=None))
    first, second = ids_of(tiny_tokenizer, "Four.") + [eos], ids_of(tiny_tokenizer, "Five.") + [eos]
    observation = ids_of(tiny_tokenizer, "\n" + AGAIN)
    assert batch.metrics == {"episode/turns": 2.0, "episode/truncated_frac": 0.0, "episode/turn_limit_frac": 0.0,
                             "episode/observation_tokens": float(len(observation)), "episode/env_reward": 1.0}
    assert batch.stopped.tolist() == [True]
    # each turn's 0.5 on its last action token (its stop token), nothing elsewhere
    rewards = [0.0] * (len(first) + len(observation) + len(second))
    rewards[len(first) - 1] = rewards[-1] = 0.5
    assert batch.turn_rewards[0].tolist() == rewards
    assert batch.env_rewards() == [1.0]


def test_the_turn_limit_keeps_the_last_turns_reward_and_counts_the_episode_as_cut(tiny_tokenizer):
    """The environment wants three turns and the recipe allows two: the second turn's reward is
    kept, no observation follows it, and the episode is truncated by the turn limit, not stopped,
    though its last turn ended with the stop token."""
    eos = tiny_tokenizer.eos_token_id
    rows = prompt_rows(tiny_tokenizer, [PROMPT], chat_template=True, turns=[3])
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four.", "Five."], [True, True]), rows,
                         again_settings(max_turns=2, max_episode_tokens=None))
    first, second = ids_of(tiny_tokenizer, "Four.") + [eos], ids_of(tiny_tokenizer, "Five.") + [eos]
    assert batch.completion_ids()[0] == first + ids_of(tiny_tokenizer, "\n" + AGAIN) + second
    assert batch.metrics["episode/turn_limit_frac"] == 1.0 and batch.metrics["episode/truncated_frac"] == 1.0
    assert batch.metrics["episode/env_reward"] == 1.0 and batch.stopped.tolist() == [False]


# ---- whose format the tool calls are read in ----------------------------------------------------

TEMPLATE_ADD_CALL = '<call>{"name": "add", "arguments": {"a": 2, "b": "3"}}</call>'


def test_calls_are_read_by_the_tokenizers_response_template_when_the_template_writes_the_tools(tiny_tokenizer):
    """A template that renders `tools=` and a response_template in a format no fallback reads:
    the call is read by the response_template (which casts "3" to the schema's integer)."""
    tokenizer = tokenizer_copy(tiny_tokenizer)
    tokenizer.chat_template, tokenizer.response_template = QWEN_TEMPLATE, RESPONSE_TEMPLATE
    settings = episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=2), tokenizer)
    assert settings.tools_in_system is None
    batch = run_episodes(ScriptedPolicy(tokenizer, [TEMPLATE_ADD_CALL, "It is 5."], [True, True]),
                         prompt_rows(tokenizer, [PROMPT], chat_template=True), settings)
    assert batch.transcripts[0][2] == {"role": "tool", "name": "add", "content": "5"}


def test_calls_are_read_in_the_format_our_system_message_asks_for_whatever_the_tokenizers_own(tiny_tokenizer):
    """The template ignores `tools=`, so the system message asks for <tool_call> JSON: that is the
    format read, though the tokenizer's response_template reads another."""
    tokenizer = tokenizer_copy(tiny_tokenizer)
    tokenizer.response_template = RESPONSE_TEMPLATE
    settings = episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=2), tokenizer)
    assert settings.tools_in_system is not None
    batch = run_episodes(ScriptedPolicy(tokenizer, [ADD_CALL, "It is 5."], [True, True]),
                         prompt_rows(tokenizer, [PROMPT], chat_template=True), settings)
    assert batch.transcripts[0][2] == {"role": "tool", "name": "add", "content": "5"}


# ---- the recipe's system prompt ----------------------------------------------------------------


def system_prompt_rows(tokenizer):
    return [PromptFormat(tokenizer, chat_template=True, system_prompt="Be kind.").row(PROMPT)]


def test_the_recipes_system_prompt_opens_an_episode_with_tools_before_their_schemas(tiny_tokenizer):
    """data.system_prompt with rollout.tools: the prompt (rendered again, with the tools) keeps it,
    the schemas after it in the same system message, and the transcript starts with it."""
    settings = episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=2), tiny_tokenizer)
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, [ADD_CALL, "It is 5."], [True, True]),
                         system_prompt_rows(tiny_tokenizer), settings)
    prompt = tiny_tokenizer.decode(batch.queries()[0])
    assert prompt.startswith("<|im_start|>system\nBe kind.\n\n# Tools\n\nYou may call one or more functions")
    assert prompt.endswith("</tool_call><|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n"
                           "<|im_start|>assistant\n")
    assert batch.transcripts[0][:2] == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": PROMPT}]
    assert batch.transcripts[0][3] == {"role": "tool", "name": "add", "content": "5"}


def test_the_recipes_system_prompt_is_in_an_episodes_tokens_and_its_transcript(tiny_tokenizer):
    """With an environment (no tools) the prompt's own tokens are kept, system prompt included;
    the transcript the reward functions get as `messages` holds it too."""
    rows = system_prompt_rows(tiny_tokenizer)
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four.", "Five."], [True, True]), rows,
                         again_settings(max_turns=2, max_episode_tokens=None))
    assert tiny_tokenizer.decode(batch.queries()[0]) == (
        "<|im_start|>system\nBe kind.<|im_end|>\n<|im_start|>user\nWhat is 2 plus 3?<|im_end|>\n<|im_start|>assistant\n")
    assert [m["role"] for m in batch.transcripts[0]] == ["system", "user", "assistant", "user", "assistant"]
    assert batch.transcripts[0][0] == {"role": "system", "content": "Be kind."}
    assert rows[0].messages == [{"role": "system", "content": "Be kind."}, {"role": "user", "content": PROMPT}]


# ---- logprobs recorded at sampling, each turn's seeds, the rows' numbers -----------------------


class RecordingPolicy(ScriptedPolicy):
    """Also gives each sampled token a known logprob (-0.01 * (100 * turn + position + 1)) and
    keeps the seeds each turn was sampled with."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.seeds_per_turn = []

    def sample(self, rows, record_logprobs=False, role=None, seeds=None):
        turn = self.turn
        samples = super().sample(rows, record_logprobs, role, seeds)
        self.seeds_per_turn.append(seeds)
        width = samples.response_ids.shape[1]
        logprobs = torch.tensor([[-0.01 * (100 * turn + k + 1) for k in range(width)]] * len(rows))
        return dataclasses.replace(samples, logprobs=logprobs if record_logprobs else None)


def test_logprobs_recorded_at_sampling_sit_on_their_action_tokens_and_are_cut_with_them(tiny_tokenizer):
    """The budget scenario above with logprobs recorded: each action token keeps the logprob it
    was sampled with (row 1's last turn cut to its 2 tokens left, logprobs and all), observation
    tokens get 0, and the padding after a shorter episode 0."""
    eos = tiny_tokenizer.eos_token_id
    replies = ["ok", "a much longer answer than the other one"]
    observations = [ids_of(tiny_tokenizer, f"\n<|im_start|>user\n{r}<|im_end|>\n<|im_start|>assistant\n")
                    for r in replies]
    first = ids_of(tiny_tokenizer, "Four.") + [eos]
    budget = len(first) + len(observations[1]) + 2
    left = [budget - len(first) - len(o) for o in observations]
    policy = RecordingPolicy(tiny_tokenizer, ["Four.", LONG_TURN], [True, True], max_new_tokens=40)
    batch = run_episodes(policy, reply_rows(tiny_tokenizer, replies), reply_settings(budget), record_logprobs=True)

    width = max(len(c) for c in batch.completion_ids())
    for i in range(2):
        expected = ([-0.01 * (k + 1) for k in range(len(first))] + [0.0] * len(observations[i])
                    + [-0.01 * (100 + k + 1) for k in range(left[i])])
        expected += [0.0] * (width - len(expected))
        torch.testing.assert_close(batch.old_logprobs[i], torch.tensor(expected), atol=1e-7, rtol=0)
    unrecorded = run_episodes(RecordingPolicy(tiny_tokenizer, ["Four.", LONG_TURN], [True, True], max_new_tokens=40),
                              reply_rows(tiny_tokenizer, replies), reply_settings(budget))
    assert unrecorded.old_logprobs is None


def test_turn_zero_samples_with_the_rows_seed_and_later_turns_with_one_derived_from_it_and_the_turn(tiny_tokenizer):
    """rollout.seed_per_row: the first turn is drawn as a single-turn rollout of that row would be
    (from the row's seed), turn k from sha256 of "seed/turn/k/0" (rollout.row_seeds' derivation,
    written out here)."""
    seeds = [11, 12]
    policy = RecordingPolicy(tiny_tokenizer, ["Four.", "Five.", "Six."], [True, True, True])
    rows = prompt_rows(tiny_tokenizer, [PROMPT, PROMPT], chat_template=True, turns=[3, 3])
    run_episodes(policy, rows, again_settings(max_turns=3, max_episode_tokens=None), seeds=seeds)

    def derived(seed: int, turn: int) -> int:
        digest = hashlib.sha256(f"{seed}/turn/{turn}/0".encode()).digest()
        return int.from_bytes(digest[:8], "little") >> 1

    assert policy.seeds_per_turn == [seeds, [derived(11, 1), derived(12, 1)], [derived(11, 2), derived(12, 2)]]
    unseeded = RecordingPolicy(tiny_tokenizer, ["Four.", "Five."], [True, True])
    run_episodes(unseeded, rows, again_settings(max_turns=2, max_episode_tokens=None))
    assert unseeded.seeds_per_turn == [None, None]


class BreaksOnBad:
    """Raises in step() for the row whose prompt is "bad"."""

    def __init__(self, prompt):
        self.prompt = prompt

    def step(self, message):
        if self.prompt == "bad":
            raise ValueError("cannot play this one")
        return Observation(done=True)


def test_an_environments_error_names_the_rows_place_in_the_steps_whole_batch(tiny_tokenizer):
    """first_index: where these rows start in the step's batch (another process's rows come
    before them): the second row here is row 5."""
    rows = prompt_rows(tiny_tokenizer, ["fine", "bad"], chat_template=True)
    settings = EpisodeSettings(max_turns=2, max_episode_tokens=None, environment=BreaksOnBad,
                               environment_name="tests.test_agent_episode_layout:BreaksOnBad")
    with pytest.raises(EpisodeError, match=r"^environment tests.test_agent_episode_layout:BreaksOnBad raised ValueError "
                                           r"while stepping for row 5 \(prompt 'bad'\): cannot play this one$"):
        run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four."], [True]), rows, settings, first_index=4)
    # alone (generate(), eval): the rows' own places
    with pytest.raises(EpisodeError, match=r"while stepping for row 1 \(prompt 'bad'\)"):
        run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four."], [True]), rows, settings)


def test_a_transcript_reads_one_line_per_turn_after_the_prompt_with_who_wrote_it(tiny_tokenizer):
    settings = episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=2), tiny_tokenizer)
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, [ADD_CALL, "It is 5."], [True, True]),
                         system_prompt_rows(tiny_tokenizer), settings)
    assert transcript_text(batch.transcripts[0]) == f"[assistant] {ADD_CALL}\n[tool result: add] 5\n[assistant] It is 5."
    assert transcript_text([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                            {"role": "tool", "content": "no name"}, {"role": "user", "content": "ok"}]) == \
        "[assistant] yo\n[tool] no name\n[user] ok"


UNKNOWN_TOOL_CALL = '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'


@pytest.mark.parametrize("call, errors", [(ADD_CALL, 0.0), (UNKNOWN_TOOL_CALL, 1.0)])
def test_tool_calls_and_errors_are_counted_per_episode(tiny_tokenizer, call, errors):
    settings = episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=2), tiny_tokenizer)
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, [call, "Done."], [True, True]),
                         prompt_rows(tiny_tokenizer, [PROMPT, PROMPT], chat_template=True), settings)
    assert batch.metrics["episode/tool_calls"] == 1.0 and batch.metrics["episode/tool_errors"] == errors


def test_a_turn_without_a_tool_call_ends_an_episode_with_tools_and_no_environment(tiny_tokenizer):
    settings = episode_settings(RolloutConfig(tools=["tests.agent_envs:add"], max_turns=4), tiny_tokenizer)
    policy = ScriptedPolicy(tiny_tokenizer, [ADD_CALL, "It is 5.", "never sampled"], [True, True, True])
    batch = run_episodes(policy, prompt_rows(tiny_tokenizer, [PROMPT], chat_template=True), settings)
    assert policy.turn == 2 and batch.transcripts[0][-1] == {"role": "assistant", "content": "It is 5."}
    assert batch.metrics["episode/turns"] == 2.0 and batch.metrics["episode/truncated_frac"] == 0.0
    assert batch.stopped.tolist() == [True]


def test_a_budget_above_max_new_tokens_leaves_each_turn_at_max_new_tokens(tiny_tokenizer):
    rows = prompt_rows(tiny_tokenizer, [PROMPT], chat_template=True, turns=[2])
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, [LONG_TURN, LONG_TURN], [True, True], max_new_tokens=3), rows,
                         again_settings(max_turns=2, max_episode_tokens=200))
    turns = [len(run) for run in "".join("a" if a else " " for a in batch.action_mask()[0]).split()]
    assert turns == [3, 3]


def test_a_last_turn_that_ends_exactly_at_the_budget_is_answered_and_keeps_its_reward(tiny_tokenizer):
    """The environment's second answer ends the episode, and the second turn fills the budget to
    the token: the environment is still asked, so the turn's reward counts and the episode ends
    done (stopped), not cut by the budget."""
    eos = tiny_tokenizer.eos_token_id
    first, second = ids_of(tiny_tokenizer, "Four.") + [eos], ids_of(tiny_tokenizer, "Five.") + [eos]
    budget = len(first) + len(ids_of(tiny_tokenizer, "\n" + AGAIN)) + len(second)
    rows = prompt_rows(tiny_tokenizer, [PROMPT], chat_template=True, turns=[2])
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four.", "Five."], [True, True]), rows,
                         again_settings(max_turns=3, max_episode_tokens=budget))
    assert len(batch.completion_ids()[0]) == budget
    assert batch.metrics["episode/truncated_frac"] == 0.0 and batch.metrics["episode/env_reward"] == 1.0
    assert batch.stopped.tolist() == [True]


def test_a_turn_cut_by_the_budget_is_not_answered_and_reads_as_its_own_tokens(tiny_tokenizer):
    """The environment would end the episode after the second turn, but the budget cuts that turn
    first: the environment is not asked (its second reward never comes), the episode counts as
    truncated, and the turn's text is that of the tokens kept, special tokens skipped."""
    eos = tiny_tokenizer.eos_token_id
    second_turn = "It is<|im_start|> five, or maybe six, or seven."
    first, observation = ids_of(tiny_tokenizer, "Four.") + [eos], ids_of(tiny_tokenizer, "\n" + AGAIN)
    written = ids_of(tiny_tokenizer, second_turn)
    kept = written[: written.index(tiny_tokenizer.convert_tokens_to_ids("<|im_start|>")) + 2]
    rows = prompt_rows(tiny_tokenizer, [PROMPT], chat_template=True, turns=[2])
    batch = run_episodes(ScriptedPolicy(tiny_tokenizer, ["Four.", second_turn], [True, True]), rows,
                         again_settings(max_turns=3, max_episode_tokens=len(first) + len(observation) + len(kept)))
    assert batch.completion_ids()[0] == first + observation + kept
    assert batch.metrics["episode/truncated_frac"] == 1.0 and batch.metrics["episode/env_reward"] == 0.5
    text = tiny_tokenizer.decode(kept, skip_special_tokens=True)
    assert "<|im_start|>" not in text and batch.completions == [text]
    assert batch.transcripts[0][-1] == {"role": "assistant", "content": text}


# Like Mistral's: an assistant message must follow a user message (a system message may open); and
# an assistant message ends otherwise than the others (an extra newline).
FOLLOWS_A_USER = (
    "{% for m in messages %}{% if m['role'] == 'assistant' and (loop.first or messages[loop.index0 - 1]['role'] != "
    "'user') %}{{ raise_exception('an assistant message must follow a user message') }}{% endif %}"
    "<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% if m['role'] == 'assistant' %}{{ '\\n' }}{% endif %}"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_the_end_of_turn_is_read_from_the_whole_conversation_for_a_template_that_checks_it(tiny_tokenizer):
    """With a system prompt first, the assistant's turn follows the user's only in the whole
    conversation: the end of turn is read from it, so the template's check passes, and it is the
    end of the assistant's message, not of the first one's."""
    tokenizer = tokenizer_copy(tiny_tokenizer)
    tokenizer.chat_template = FOLLOWS_A_USER
    rows = [PromptFormat(tokenizer, chat_template=True, system_prompt="Be kind.").row(PROMPT, {"turns": 2})]
    batch = run_episodes(ScriptedPolicy(tokenizer, ["Four.", "Five."], [True, True]), rows,
                         again_settings(max_turns=2, max_episode_tokens=None))
    observation = [t for t, a in zip(batch.completion_ids()[0], batch.action_mask()[0]) if not a]
    assert tokenizer.decode(observation) == "\n\n" + AGAIN
