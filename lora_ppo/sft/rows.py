"""Demonstrations as the model reads them: each row of TRL's SFT formats (`text`; `prompt` +
`completion`; `messages`) becomes its tokens and the tokens the loss predicts, with the prompt a
sample starts from. Bad rows are dropped and counted; long ones dropped, truncated or refused.

    | system | user  | assistant turn <eos> | user  | assistant turn <eos> |
      targets (completion_only): ^^^^^^^^^^^^^^^^^^^^        ^^^^^^^^^^^^^^^^^^^^

Assistant tokens are what the chat template marks with `{% generation %}` where it does, else
what each assistant turn adds to the rendered conversation (as multi-turn episodes find them).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field, replace
from typing import Any, Optional

from lora_ppo.config import SFTConfig, SFTDataConfig
from lora_ppo.data import (EMPTY, NOT_TEXT, TOO_LONG, Messages, PromptFormat, PromptProblem,
                           checked_messages, load_rows, split_held_out)
from lora_ppo.errors import RecipeError

NO_TARGET = "no_target_token"  # nothing for the loss: a conversation without an assistant turn, a one-token text
ASSISTANT_FIRST = "assistant_turn_first"  # a conversation that opens with its answer: no prompt before it
TRUNCATED = "truncated"  # kept, cut to data.max_length (counted, not dropped)
FORMATS = ("messages", "prompt_completion", "text")
# transformers' own test for a template that marks assistant tokens.
GENERATION_MARK = re.compile(r"\{\%-?\s*generation\s*-?\%\}")


@dataclass(frozen=True)
class SFTRow:
    """One demonstration: its tokens, which of them the loss predicts, and what a sample starts from."""

    ids: tuple[int, ...]
    targets: tuple[bool, ...]  # True where the loss predicts the token from the ones before (never the first)
    prompt: Any = None  # as the dataset gives it (None for a text row): what the report shows
    prompt_ids: tuple[int, ...] = ()  # the tokens a sample continues, as the PPO run renders the prompt
    completion: str = ""  # the demonstration's answer (the last assistant turn), for the report

    @property
    def target_count(self) -> int:
        return sum(self.targets)


@dataclass
class SFTSet:
    rows: list[SFTRow]
    dropped: dict[str, int] = field(default_factory=dict)  # and the truncated count, under TRUNCATED


def detect_format(cfg: SFTDataConfig, columns: list[str], source: str) -> str:
    """The rows' format: `data.format`, or with `auto` the first whose columns the data has; a
    missing column is a RecipeError naming it."""
    needed = {"messages": [cfg.messages_column], "prompt_completion": [cfg.prompt_column, cfg.completion_column],
              "text": [cfg.text_column]}
    if cfg.format == "auto":
        found = next((f for f in FORMATS if all(c in columns for c in needed[f])), None)
        if found is None:
            raise RecipeError(f"data.format: auto finds neither a {cfg.messages_column!r} column, nor "
                              f"{cfg.prompt_column!r} and {cfg.completion_column!r}, nor {cfg.text_column!r} in "
                              f"{source!r} (columns: {', '.join(columns)}); name them with data.*_column")
        return found
    missing = [c for c in needed[cfg.format] if c not in columns]
    if missing:
        raise RecipeError(f"data: column {missing[0]!r} not in {source!r} (columns: {', '.join(columns)})")
    return cfg.format


def _text(value: Any) -> str:
    if not isinstance(value, str):
        raise PromptProblem(NOT_TEXT)
    if not value.strip():
        raise PromptProblem(EMPTY)
    return value


def _as_turns(value: Any, role: str) -> Messages:
    """Text as one message of `role`, or messages as they are."""
    return [{"role": role, "content": _text(value)}] if isinstance(value, str) else checked_messages(value)


class RowTokenizer:
    """Turns a dataset row into an `SFTRow`, as the recipe's data and sft sections say."""

    def __init__(self, tokenizer, cfg: SFTDataConfig, sft: SFTConfig, row_format: str):
        self.tokenizer, self.cfg, self.completion_only, self.format = tokenizer, cfg, sft.completion_only, row_format
        self.prompts = PromptFormat(tokenizer, cfg.chat_template, cfg.system_prompt)
        self.stop = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)

    def row(self, row: dict) -> SFTRow:
        """Raises PromptProblem for a row that cannot be a demonstration."""
        made = self._row(row)
        # Nothing comes before the first token to predict it from: it is never a target, whatever
        # the template marked (the loss reads targets from position 1 on).
        targets = (False,) + made.targets[1:]
        if not any(targets):
            raise PromptProblem(NO_TARGET)
        return replace(made, targets=targets)

    def _row(self, row: dict) -> SFTRow:
        cfg = self.cfg
        if self.format == "text":
            ids = tuple(self.tokenizer(_text(row.get(cfg.text_column)), add_special_tokens=True)["input_ids"])
            ids += self.stop if ids[-1:] != self.stop else ()
            return SFTRow(ids, (False,) + (True,) * (len(ids) - 1))
        if self.format == "messages":
            messages = self.prompts.with_system(checked_messages(row.get(cfg.messages_column)))
            return self._conversation(None, messages, first_trained=0)
        prompt, completion = row.get(cfg.prompt_column), row.get(cfg.completion_column)
        if isinstance(prompt, str) and isinstance(completion, str) and not cfg.chat_template:
            return self._text_pair(prompt, completion)
        turns = self.prompts.with_system(_as_turns(prompt, "user"))
        answer = _as_turns(completion, "assistant")
        return self._conversation(prompt, turns + answer, first_trained=len(turns))

    def _text_pair(self, prompt: str, completion: str) -> SFTRow:
        """Prompt tokens as a PPO run renders a text prompt, then the completion's and the stop token:
        the sequence the policy writes after that prompt."""
        prompt_ids = self.prompts.render(prompt)[1]
        answer = tuple(self.tokenizer(_text(completion), add_special_tokens=False)["input_ids"]) + self.stop
        ids = prompt_ids + answer
        targets = (False,) * len(prompt_ids) + (True,) * len(answer) if self.completion_only else \
            (False,) + (True,) * (len(ids) - 1)
        return SFTRow(ids, targets, prompt, prompt_ids, completion)

    def _conversation(self, given: Any, messages: Messages, first_trained: int) -> SFTRow:
        """A conversation through the chat template; targets on the assistant turns from
        `first_trained` on (every token without completion_only). `given`: the dataset's prompt (None:
        the conversation before its last answer)."""
        tokenizer = self.tokenizer
        if not getattr(tokenizer, "chat_template", None):
            raise RecipeError("data: conversations need a chat template, and the tokenizer has none")
        if not any(m["role"] == "assistant" for m in messages[first_trained:]):
            raise PromptProblem(NO_TARGET)
        text = tokenizer.apply_chat_template(messages, tokenize=False)
        encoded = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
        ids = tuple(encoded["input_ids"])
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        if last == 0:
            raise PromptProblem(ASSISTANT_FIRST)
        prompt_text = tokenizer.apply_chat_template(messages[:last], tokenize=False, add_generation_prompt=True)
        prompt_ids = tuple(tokenizer(prompt_text, add_special_tokens=False)["input_ids"])
        if not self.completion_only:
            targets = (False,) + (True,) * (len(ids) - 1)
        else:
            trained_from = len(tokenizer.apply_chat_template(messages[:first_trained], tokenize=False,
                                                             add_generation_prompt=True)) if first_trained else 0
            marked = self._assistant_tokens(messages, text, encoded["offset_mapping"])
            targets = tuple(m and start >= trained_from for m, (start, _) in zip(marked, encoded["offset_mapping"]))
        prompt = given if given is not None else messages[:last]
        return SFTRow(ids, targets, prompt, prompt_ids, messages[last]["content"])

    def _assistant_tokens(self, messages: Messages, text: str, offsets: list[tuple[int, int]]) -> list[bool]:
        """Whether each token of the rendered conversation belongs to an assistant turn."""
        tokenizer = self.tokenizer
        if GENERATION_MARK.search(tokenizer.chat_template):
            out = tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                return_assistant_tokens_mask=True)
            return [bool(m) for m in out["assistant_masks"]]
        spans = assistant_spans(tokenizer, messages, text)
        return [any(start < end_span and end > start_span for start_span, end_span in spans) for start, end in offsets]


def assistant_spans(tokenizer, messages: Messages, text: str) -> list[tuple[int, int]]:
    """The characters of `text` (the rendered conversation) each assistant turn adds: from the end
    of the conversation before it (with the assistant header) to the end of its turn, cut after
    the stop token where the template writes more after it (ChatML's line break)."""
    spans = []
    stop = tokenizer.eos_token or ""
    for i, message in enumerate(messages):
        if message["role"] != "assistant":
            continue
        before = tokenizer.apply_chat_template(messages[:i], tokenize=False, add_generation_prompt=True) if i else ""
        through = tokenizer.apply_chat_template(messages[: i + 1], tokenize=False)
        if not (text.startswith(before) and text.startswith(through)):
            raise RecipeError("data: the chat template renders earlier turns differently once later ones follow, "
                              "so its assistant tokens cannot be found; give it {% generation %} markers or set "
                              "sft.completion_only: false")
        if len(through) <= len(before):
            raise RecipeError("data: the chat template writes nothing for an assistant turn, so there is nothing "
                              "to train on; give it one that writes them, or {% generation %} markers")
        end = len(through)
        at = through.find(message["content"], len(before))
        after = at + len(message["content"]) if at >= 0 else len(before)
        stop_at = through.find(stop, after) if stop else -1
        if stop_at >= 0:
            end = stop_at + len(stop)
        spans.append((len(before), end))
    return spans


def limit_length(row: SFTRow, max_length: int, too_long: str, where: str) -> tuple[Optional[SFTRow], Optional[str]]:
    """The row within `max_length` tokens, as `too_long` says: (row, None), (cut row, TRUNCATED),
    (None, TOO_LONG) when dropped or left without a target; `error` raises RecipeError naming `where`."""
    if len(row.ids) <= max_length:
        return row, None
    if too_long == "error":
        raise RecipeError(f"data.max_length: {where} has {len(row.ids)} tokens, more than {max_length} "
                          "(data.too_long: error; `drop` or `truncate` would keep going)")
    if too_long == "drop":
        return None, TOO_LONG
    targets = row.targets[:max_length]
    if not any(targets):
        return None, TOO_LONG
    prompt_ids = row.prompt_ids if len(row.prompt_ids) < max_length else ()
    return SFTRow(row.ids[:max_length], targets, row.prompt, prompt_ids, row.completion), TRUNCATED


def prepare_sft_rows(rows: list[dict], columns: list[str], cfg: SFTDataConfig, sft: SFTConfig, tokenizer,
                     source: str) -> SFTSet:
    """SFTRows for the usable rows; the others are dropped and counted by reason."""
    if not rows:
        return SFTSet([])
    maker = RowTokenizer(tokenizer, cfg, sft, detect_format(cfg, columns, source))
    kept: list[SFTRow] = []
    counts: dict[str, int] = {}
    for index, raw in enumerate(rows):
        try:
            row, note = limit_length(maker.row(raw), cfg.max_length, cfg.too_long, f"row {index} of {source!r}")
        except PromptProblem as problem:
            row, note = None, str(problem)
        if note is not None:
            counts[note] = counts.get(note, 0) + 1
        if row is not None:
            kept.append(row)
    return SFTSet(kept, counts)


def load_sft_sets(cfg: SFTDataConfig, sft: SFTConfig, tokenizer, seed: int) -> tuple[SFTSet, SFTSet]:
    """(train, held-out) demonstrations for an SFT recipe's data section."""
    rows, columns = load_rows(cfg.source, cfg.split, cfg.name, cfg.revision)
    train = prepare_sft_rows(rows, columns, cfg, sft, tokenizer, cfg.source)
    if cfg.eval_source:
        same = cfg.eval_source == cfg.source
        eval_rows, eval_columns = load_rows(cfg.eval_source, cfg.eval_split, cfg.name if same else None,
                                            cfg.revision if same else None, "data.eval_source")
        held_out = prepare_sft_rows(eval_rows, eval_columns, cfg, sft, tokenizer, cfg.eval_source)
        held_out.rows = held_out.rows[: cfg.eval_size]
    else:
        train.rows, held = split_held_out(train.rows, cfg.eval_size, seed, cfg.source, "rows")
        held_out = SFTSet(held)
    if not train.rows:
        reasons = ", ".join(f"{v} {k}" for k, v in train.dropped.items() if k != TRUNCATED) or "the source is empty"
        raise RecipeError(f"data.source: no usable rows in {cfg.source!r} ({reasons})")
    return train, held_out
