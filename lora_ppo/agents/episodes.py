"""Multi-turn episodes: the policy writes a turn, an environment (or a tool) answers, and so on,
all in one token sequence per episode, scored like a single-turn rollout into a `Rollout`.

    | [PAD] prompt | action action [EOS] | observation observation | action [EOS] | [PAD] |
                   |<- response_mask: True on action tokens only; observation_mask on the others ->|

Action tokens are the policy's samples: they get logprobs, KL, values and the losses.
Observation tokens (tool results, environment or user replies, in the chat template's roles)
are context: the model reads them (they are in the attention mask) but they are never actions.

Each turn re-reads the whole context (no KV cache is kept between turns; see docs/agents.md).
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Optional, Sequence

import torch

from lora_ppo.agents.environment import (EnvironmentSession, EpisodeError, Messages, Observation,
                                         check_environment_columns)
from lora_ppo.agents.tools import cut_short, parse_tool_calls, run_tool, tool_message, with_system_text
from lora_ppo.data import PromptRow
from lora_ppo.memory import PhasePeaks
from lora_ppo.model import embeddings_on_device
from lora_ppo.rewards import RewardSources
from lora_ppo.roles import POLICY, Role
from lora_ppo.rollout import (Rollout, Sampler, join_prompt_response, left_pad, masked_rows, row_seeds,
                              score_and_reward)

# Stands for an assistant message's text when reading what the template writes after it.
TURN_MARKER = "LORA_PPO_TURN_TEXT"


@dataclass(frozen=True)
class EpisodeSettings:
    """The recipe's episode limits and what the policy talks to."""

    max_turns: int
    max_episode_tokens: Optional[int]  # actions + observations after the prompt; None: no budget
    environment: Optional[Callable[..., Any]] = None  # the factory of `rollout.environment`
    environment_name: str = ""
    tools: dict[str, Callable] = field(default_factory=dict)  # name -> function (`rollout.tools`)
    tool_schemas: Optional[list[dict]] = None
    tool_timeout_s: Optional[float] = None
    # The system message text that carries the schemas when the chat template ignores `tools=`
    # (tools.template_renders_tools); None: the template writes them itself.
    tools_in_system: Optional[str] = None

    def check_columns(self, columns: list[str], source: str, hint: str = "") -> None:
        """Refuse prompts from `source` without a column the environment takes (none: nothing to check)."""
        if self.environment is not None:
            check_environment_columns(self.environment, self.environment_name, columns, source, hint)


@dataclass
class _Episode:
    row: PromptRow
    messages: Messages  # the conversation so far, as text
    context: list[int]  # the prompt's tokens
    tokens: list[int] = field(default_factory=list)  # everything after the prompt
    is_action: list[bool] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # recorded at sampling (0 on observations)
    turn_rewards: dict[int, float] = field(default_factory=dict)  # token index -> reward
    turns: int = 0
    done: bool = False  # the environment (or the end of tool calls) ended it
    truncated: bool = False  # the budget or the turn limit ended it first
    turn_limit: bool = False  # ... the turn limit (rollout.max_turns)
    cut_by: str = ""  # the setting that cut the last turn before its stop token ("" if it stopped)
    stopped: bool = False  # the last turn ended with the stop token
    last_completion: str = ""
    last_action_ids: list[int] = field(default_factory=list)
    tool_calls: int = 0
    tool_errors: int = 0
    session: Optional[EnvironmentSession] = None

    def budget_left(self, limit: Optional[int]) -> Optional[int]:
        return None if limit is None else limit - len(self.tokens)


@dataclass(frozen=True)
class EpisodeBatch:
    """Finished episodes, as the tensors a `Rollout` holds (per-token [B, T_resp])."""

    rows: list[PromptRow]
    query_ids: torch.Tensor
    query_mask: torch.Tensor
    response_ids: torch.Tensor
    response_mask: torch.Tensor  # action tokens
    observation_mask: torch.Tensor
    old_logprobs: Optional[torch.Tensor]  # recorded at sampling, 0 elsewhere; None when not recorded
    turn_rewards: torch.Tensor
    stopped: torch.Tensor
    completions: list[str]  # each episode's last assistant message
    last_turn_ids: list[list[int]]  # its action tokens (the reward sources' `completion_ids`)
    transcripts: list[Messages]
    metrics: dict[str, float]

    def model_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        return join_prompt_response(self.query_ids, self.query_mask, self.response_ids,
                                    self.response_mask | self.observation_mask)

    # What `PPOTrainer.step` takes back (`PPOTrainer.generate` returns episodes on such recipes).
    def queries(self) -> list[list[int]]:
        """Each episode's prompt tokens (as rendered with the tools), without the left padding."""
        return masked_rows(self.query_ids, self.query_mask)

    def completion_ids(self) -> list[list[int]]:
        """Each episode's tokens after its prompt: its turns and the observations between them."""
        return masked_rows(self.response_ids, self.response_mask | self.observation_mask)

    def action_mask(self) -> list[list[bool]]:
        """For `completion_ids()`: True on the policy's own tokens, False on observations."""
        return masked_rows(self.response_mask, self.response_mask | self.observation_mask)

    def env_rewards(self) -> list[float]:
        """Each episode's sum of the rewards its environment gave."""
        return self.turn_rewards.sum(dim=1).tolist()


class ChatRenderer:
    """The token ids the chat template gives the first messages and each observation; the tools
    go to the template (`tools=`), or, where it ignores them, into the system message."""

    def __init__(self, tokenizer, tool_schemas: Optional[list[dict]], tools_in_system: Optional[str] = None):
        self.tokenizer, self.tools, self.tools_in_system = tokenizer, tool_schemas, tools_in_system

    def render(self, messages: Messages, add_generation_prompt: bool) -> str:
        if self.tools_in_system is not None:
            return self.tokenizer.apply_chat_template(with_system_text(messages, self.tools_in_system), tokenize=False,
                                                      add_generation_prompt=add_generation_prompt)
        return self.tokenizer.apply_chat_template(messages, tools=self.tools, tokenize=False,
                                                  add_generation_prompt=add_generation_prompt)

    @property
    def parser_tokenizer(self):
        """The tokenizer whose response_template reads the calls; None (the fallback formats) when
        the system message asked for the Hermes format."""
        return None if self.tools_in_system is not None else self.tokenizer

    def encode(self, text: str) -> list[int]:
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def observation_ids(self, history: Messages, new: Messages, action_ids: list[int]) -> list[int]:
        """The tokens between the policy's last action and its next turn: what the template writes
        after the assistant's text (its end-of-turn marker, unless the action already ended with
        it), the new messages, and the next assistant header."""
        before = self.render(history, add_generation_prompt=False)
        after = self.render(history + new, add_generation_prompt=True)
        if not after.startswith(before):
            raise EpisodeError("the chat template renders earlier turns differently once messages follow them; "
                               "multi-turn episodes need a template that only appends")
        tail = self._end_of_turn(history)
        written = self.tokenizer.decode(action_ids[-1:]) if action_ids else ""
        if written and tail.startswith(written):
            tail = tail[len(written):]  # the action's own stop token already closed the turn
        return self.encode(tail + after[len(before):])

    def _end_of_turn(self, history: Messages) -> str:
        """What the template writes after the last assistant message's text, read from a rendering
        with a marker in place of the text: the template may strip or rewrite the text, and an
        empty turn (the policy stopped at once) has no text to find."""
        marked = history[:-1] + [{**history[-1], "content": TURN_MARKER}]
        rendered = self.render(marked, add_generation_prompt=False)
        at = rendered.rfind(TURN_MARKER)
        return rendered[at + len(TURN_MARKER):] if at >= 0 else ""


def transcript_text(messages: Messages) -> str:
    """An episode's turns after its prompt, one per line with who wrote it (`[assistant]`,
    `[user]`, `[tool result: name]`), so tool calls and their results show."""
    first = next((i for i, m in enumerate(messages) if m.get("role") == "assistant"), len(messages))
    lines = []
    for message in messages[first:]:
        role = message.get("role", "?")
        label = f"tool result: {message['name']}" if role == "tool" and message.get("name") else role
        lines.append(f"[{label}] {message.get('content', '')}")
    return "\n".join(lines)


def run_episodes(
    sampler: Sampler,
    rows: Sequence[PromptRow],
    settings: EpisodeSettings,
    record_logprobs: bool = False,
    seeds: Optional[Sequence[int]] = None,
    first_index: int = 0,
    role: Role = POLICY,
) -> EpisodeBatch:
    """Play one episode per row, all turns of the batch's live episodes sampled together.

    `seeds`: one per row (`rollout.seed_per_row`); turn k > 0 of a row samples from a stream
    derived from its seed and k. `first_index`: the rows' place in the step's batch (errors name it).
    `role`: who plays (the policy; the reference, to compare).
    """
    # One copy of an embedding table kept in CPU memory on the GPU for every turn, not one per turn.
    with embeddings_on_device(sampler.roles.peft):
        return _play(sampler, rows, settings, record_logprobs, seeds, first_index, role)


def _play(sampler: Sampler, rows: Sequence[PromptRow], settings: EpisodeSettings, record_logprobs: bool,
          seeds: Optional[Sequence[int]], first_index: int, role: Role) -> EpisodeBatch:
    tokenizer = sampler.tokenizer
    renderer = ChatRenderer(tokenizer, settings.tool_schemas, settings.tools_in_system)
    episodes = [_start(row, settings, renderer, first_index + i) for i, row in enumerate(rows)]
    per_turn = sampler.cfg.max_new_tokens
    for turn in range(settings.max_turns):
        live = [i for i, e in enumerate(episodes) if not (e.done or e.truncated)]
        if not live:
            break
        budget = [episodes[i].budget_left(settings.max_episode_tokens) for i in live]
        new_tokens = per_turn if budget[0] is None else max(1, min(per_turn, max(budget)))
        limit = (f"rollout.max_new_tokens: {per_turn}" if new_tokens == per_turn else
                 f"rollout.max_episode_tokens: {settings.max_episode_tokens}")
        contexts = [replace(episodes[i].row, ids=tuple(episodes[i].context + episodes[i].tokens)) for i in live]
        turn_seeds = None
        if seeds is not None:
            turn_seeds = [seeds[i] if turn == 0 else row_seeds(seeds[i], ("turn", turn), range(1))[0] for i in live]
        samples = sampler.with_settings(max_new_tokens=new_tokens).sample(
            contexts, record_logprobs=record_logprobs, role=role, seeds=turn_seeds)
        for j, i in enumerate(live):
            e = episodes[i]
            ids = samples.response_ids[j][samples.response_mask[j]].tolist()
            logprobs = samples.logprobs[j][samples.response_mask[j]].tolist() if samples.logprobs is not None else []
            stopped = bool(samples.stopped[j])
            left = e.budget_left(settings.max_episode_tokens)
            # The budget cut this turn (sampled past it, or stopped by it unfinished): the episode ends
            # here and the environment is not stepped on the cut turn, whichever row set new_tokens.
            if left is not None and (len(ids) > left or (len(ids) == left and not stopped)):
                ids, logprobs, stopped, e.truncated = ids[:left], logprobs[:left], False, True
            text = samples.completions[j] if len(ids) == int(samples.response_mask[j].sum()) else \
                tokenizer.decode(ids, skip_special_tokens=True)
            _act(e, ids, logprobs, text, stopped)
            e.cut_by = "" if stopped else limit
            if not e.truncated:
                _observe(e, settings, renderer, turn + 1 == settings.max_turns)
    return _batch(episodes, tokenizer.pad_token_id, sampler.roles.lm_head.weight.device, record_logprobs,
                  bool(settings.tools))


def _start(row: PromptRow, settings: EpisodeSettings, renderer: ChatRenderer, index: int) -> _Episode:
    session = None
    first = None
    if settings.environment is not None:
        session = EnvironmentSession(settings.environment, settings.environment_name, row, index)
        first = session.reset()
    if first is None:
        # The conversation the row was rendered from, system prompt and all; plain text as a user turn.
        first = row.messages or [{"role": "user", "content": row.prompt}]
        if settings.tool_schemas is None:
            # Today's single-turn prompt exactly: the row's own tokens (system prompt and all).
            return _Episode(row, [dict(m) for m in first], list(row.ids), session=session)
    text = renderer.render(first, add_generation_prompt=True)
    return _Episode(row, [dict(m) for m in first], renderer.encode(text), session=session)


def _act(e: _Episode, ids: list[int], logprobs: list[float], text: str, stopped: bool) -> None:
    e.tokens += ids
    e.is_action += [True] * len(ids)
    e.logprobs += logprobs if logprobs else [0.0] * len(ids)
    e.turns += 1
    e.stopped = stopped
    e.last_completion, e.last_action_ids = text, ids
    e.messages.append({"role": "assistant", "content": text})


def _observe(e: _Episode, settings: EpisodeSettings, renderer: ChatRenderer, last_turn: bool) -> None:
    """The answer to the turn just written: tool results, the environment's step, or the end."""
    calls = parse_tool_calls(e.last_completion, renderer.parser_tokenizer, settings.tool_schemas) if settings.tools else []
    if e.cut_by:
        calls = cut_short(calls, e.cut_by)
    if calls:
        results = [run_tool(call, settings.tools, settings.tool_timeout_s) for call in calls]
        e.tool_calls += len(calls)
        e.tool_errors += sum(r.startswith("error:") for r in results)
        answer = Observation([tool_message(c, r) for c, r in zip(calls, results)])
    elif e.session is not None:
        answer = e.session.step(e.last_completion)
    else:
        answer = Observation(done=True)
    if answer.reward is not None and e.last_action_ids:
        e.turn_rewards[len(e.tokens) - 1] = e.turn_rewards.get(len(e.tokens) - 1, 0.0) + float(answer.reward)
    if answer.done:
        e.done = True
        return
    if last_turn:
        e.truncated = e.turn_limit = True  # the environment wanted more turns than rollout.max_turns
        return
    ids = renderer.observation_ids(e.messages, answer.messages, e.last_action_ids)
    left = e.budget_left(settings.max_episode_tokens)
    if left is not None and len(ids) >= left:
        e.truncated = True  # no room for the observation and a next action
        return
    e.messages += answer.messages
    e.tokens += ids
    e.is_action += [False] * len(ids)
    e.logprobs += [0.0] * len(ids)


def _batch(episodes: list[_Episode], pad_id: int, device, record_logprobs: bool, with_tools: bool) -> EpisodeBatch:
    query_ids, query_mask = left_pad([replace(e.row, ids=tuple(e.context)) for e in episodes], pad_id, device)
    width = max((len(e.tokens) for e in episodes), default=0)
    B = len(episodes)
    response_ids = torch.full((B, width), pad_id, dtype=torch.long)
    action = torch.zeros((B, width), dtype=torch.bool)
    observation = torch.zeros((B, width), dtype=torch.bool)
    logprobs = torch.zeros((B, width), dtype=torch.float32)
    turn_rewards = torch.zeros((B, width), dtype=torch.float32)
    for i, e in enumerate(episodes):
        n = len(e.tokens)
        response_ids[i, :n] = torch.tensor(e.tokens, dtype=torch.long)
        action[i, :n] = torch.tensor(e.is_action, dtype=torch.bool)
        observation[i, :n] = ~action[i, :n]
        logprobs[i, :n] = torch.tensor(e.logprobs, dtype=torch.float32)
        for position, reward in e.turn_rewards.items():
            turn_rewards[i, position] = reward
    metrics = {
        "episode/turns": sum(e.turns for e in episodes) / max(B, 1),
        "episode/truncated_frac": sum(e.truncated for e in episodes) / max(B, 1),
        "episode/turn_limit_frac": sum(e.turn_limit for e in episodes) / max(B, 1),
        "episode/observation_tokens": float(observation.sum()) / max(B, 1),
        "episode/env_reward": float(turn_rewards.sum()) / max(B, 1),
    }
    if with_tools:
        metrics["episode/tool_calls"] = sum(e.tool_calls for e in episodes) / max(B, 1)
        metrics["episode/tool_errors"] = sum(e.tool_errors for e in episodes) / max(B, 1)
    return EpisodeBatch(
        rows=[e.row for e in episodes], query_ids=query_ids, query_mask=query_mask,
        response_ids=response_ids.to(device), response_mask=action.to(device), observation_mask=observation.to(device),
        old_logprobs=logprobs.to(device) if record_logprobs else None, turn_rewards=turn_rewards.to(device),
        stopped=torch.tensor([e.stopped and not e.truncated for e in episodes], dtype=torch.bool, device=device),
        completions=[e.last_completion for e in episodes], last_turn_ids=[e.last_action_ids for e in episodes],
        transcripts=[e.messages for e in episodes], metrics=metrics,
    )


def collect_episode_rollout(
    sampler: Sampler,
    rows: Sequence[PromptRow],
    rewards: RewardSources,
    settings: EpisodeSettings,
    with_values: bool = True,
    with_reference: bool = True,
    peaks: Optional[PhasePeaks] = None,
    seeds: Optional[Sequence[int]] = None,
    first_index: int = 0,
) -> Rollout:
    """`collect_rollout` for episodes: play them, then score every action token under no_grad
    (old and reference logprobs, values) with the observations as context, and score the
    episodes with the reward sources (which also get `messages`, the whole episode)."""
    cfg = sampler.cfg
    peaks = peaks if peaks is not None else PhasePeaks()
    timings: dict[str, float] = {}

    t0 = time.perf_counter()
    with peaks.phase("generate"):
        batch = run_episodes(sampler, rows, settings, cfg.logprobs_from_generation is True, seeds, first_index)
    timings["generate"] = time.perf_counter() - t0

    scored = score_and_reward(sampler, rows, rewards, batch.query_ids.shape[1], batch.model_input(),
                              batch.old_logprobs, batch.completions, batch.last_turn_ids, batch.stopped,
                              with_values, with_reference, peaks, timings, {"messages": batch.transcripts})
    # The episode's return: the score plus every reward the environment gave (with `reward.kind:
    # none` the score is 0 and this is the whole of it); the held-out score is the same measure.
    episode_return = (scored.scores + batch.turn_rewards.sum(dim=1)).mean().item()
    return Rollout(
        rows=list(rows), completions=batch.completions, query_ids=batch.query_ids, query_mask=batch.query_mask,
        response_ids=batch.response_ids, response_mask=batch.response_mask, stopped=batch.stopped, timings=timings,
        observation_mask=batch.observation_mask, turn_rewards=batch.turn_rewards, transcripts=batch.transcripts,
        episode_metrics={**batch.metrics, "episode/return": episode_return}, **scored.as_fields(),
    )
