"""Prompts: load dataset rows (a builtin set, local files, or a Hugging Face dataset with its config
name), turn each into a PromptRow (the prompt as given, the text and tokens the policy sees, the
row's other columns), drop and count unusable rows, and serve them in a seeded, resumable order.
"""

from __future__ import annotations

import functools
import glob
import json
import logging
import math
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Generic, Optional, TypeVar, Union

from lora_ppo.builtin_datasets import BUILTIN_DATASETS
from lora_ppo.config import BUILTIN_PREFIX, DataConfig, PreferenceDataConfig, SFTDataConfig, held_out_source
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.state import PromptPosition

log = logging.getLogger(__name__)

FILE_BUILDERS = {".jsonl": "json", ".json": "json", ".csv": "csv", ".parquet": "parquet", ".txt": "text"}
ROLES = ("system", "user", "assistant", "tool")
# An assistant turn's text while reading what the chat template writes after it.
TURN_END_MARKER = "LORA_PPO_ANSWER"
Messages = list[dict[str, str]]

# Why a row was dropped.
NOT_TEXT = "not_text"  # neither text nor a list of messages
# Text holding a JSON list of messages (a conversation column saved through CSV): reading it as a
# prompt would train on JSON; load the file as .jsonl (or parse the column) instead.
JSON_TEXT = "conversation_as_json_text"
EMPTY = "empty"
TOO_LONG = "too_long"
BAD_MESSAGE = "message_without_role_or_content"
UNKNOWN_ROLE = "unknown_role"
ASSISTANT_LAST = "assistant_turn_last"


@dataclass(frozen=True)
class PromptRow:
    """One prompt with everything that travels with it."""

    prompt: Union[str, Messages]  # as the dataset gives it: what reward functions see
    text: str  # what the policy sees: the chat-templated prompt, or the text itself
    ids: tuple[int, ...]  # the tokens of `text`, special tokens included
    columns: dict[str, Any] = field(default_factory=dict)  # the row's other columns, for rewards
    # The conversation `text` was rendered from (data.system_prompt included); None for plain text.
    messages: Optional[Messages] = None

    @property
    def is_conversation(self) -> bool:
        return isinstance(self.prompt, list)


@dataclass
class PromptSet:
    """The rows that are usable, how many were dropped for which reason, and the names of the
    columns other than the prompt (what a reward function may ask for)."""

    rows: list[PromptRow]
    dropped: dict[str, int] = field(default_factory=dict)
    columns: list[str] = field(default_factory=list)


# ---- loading rows -----------------------------------------------------------------------------


def load_rows(source: str, split: str, name: Optional[str] = None, revision: Optional[str] = None,
              field_name: str = "data.source") -> tuple[list[dict], list[str]]:
    """The rows (dicts) and column names of a builtin set (`builtin:<name>`), a local file, a folder
    or glob of files, or a Hugging Face dataset id (with its config `name` and `revision`). `split`
    may slice: `train[:2000]`, `test[10%:]`."""
    if source.startswith(BUILTIN_PREFIX):
        return _builtin_rows(source[len(BUILTIN_PREFIX):], name, split, field_name)
    import datasets

    builder = None
    try:
        files = _local_files(source, field_name)
        if files is not None:
            builder = _one_builder(files, field_name)
            for file in files:
                check_text_file(Path(file), field_name)
            dataset = datasets.load_dataset(builder, data_files=files, split=split)
            if builder == "text":  # one prompt a line: the column is "text"
                dataset = dataset.rename_column("text", "prompt")
        else:
            # datasets caches a local dataset folder by its name and config, not its contents: an
            # edited folder would load stale rows, so a local folder is always read afresh.
            local = Path(source).expanduser().is_dir()
            dataset = datasets.load_dataset(source, name=name, split=split, revision=revision,
                                            download_mode="force_redownload" if local else None)
    except RecipeError:
        raise
    except Exception as err:  # datasets raises many types; all mean "this source is unusable"
        config = f" (data.name {name!r})" if name else ""
        raise RecipeError(f"{field_name}: cannot load {source!r}{config}: {first_line(err)}") from None
    rows = dataset.to_list()
    if builder == "text":  # datasets keeps the byte-order mark (Windows editors write one) in a file's first line
        rows = [{**row, "prompt": row["prompt"].removeprefix(BOM)} for row in rows]
    return rows, list(dataset.column_names)


def _builtin_rows(key: str, name: Optional[str], split: str, field_name: str) -> tuple[list[dict], list[str]]:
    from datasets import ReadInstruction

    if key not in BUILTIN_DATASETS:
        raise RecipeError(f"{field_name}: unknown builtin dataset {key!r} (known: {', '.join(BUILTIN_DATASETS)})")
    split_name = split.split("[")[0]
    rows = BUILTIN_DATASETS[key](name, split_name)
    try:  # the slicing syntax of datasets' splits: train[:100], test[10%:20%]
        ranges = ReadInstruction.from_spec(split).to_absolute({split_name: len(rows)})
    except (ValueError, AssertionError) as err:
        raise RecipeError(f"data.split: cannot read {split!r} of builtin:{key}: {first_line(err)}") from None
    picked = [row for r in ranges for row in rows[r.from_:r.to]]
    return picked, list(rows[0]) if rows else []


def _local_files(source: str, field_name: str) -> Optional[list[str]]:
    """The data files `source` names (a file, a glob, or a folder holding only data files), or
    None when it is a dataset id or a dataset folder (one with its own README/config)."""
    path = Path(source).expanduser()
    if any(ch in source for ch in "*?["):
        files = sorted(glob.glob(str(path)))
        if not files:
            raise RecipeError(f"{field_name}: no file matches {source!r}")
        return files
    if path.is_file() or path.suffix.lower() in FILE_BUILDERS:
        if not path.is_file():
            raise RecipeError(f"{field_name}: file not found: {source}")
        return [str(path)]
    if path.is_dir() and not (path / "README.md").is_file():
        files = sorted(str(p) for p in path.iterdir() if p.is_file() and not p.name.startswith("."))
        if not files:
            raise RecipeError(f"{field_name}: folder {source!r} holds no data files")
        return files
    if source.startswith((".", "/", "~")) and not path.exists():
        raise RecipeError(f"{field_name}: not found: {source}")
    return None


# Text formats read line by line: checked here first, since datasets reports a bad line as "An
# error occurred while generating the dataset" and an empty file as StopIteration.
TEXT_SUFFIXES = (".jsonl", ".json", ".csv", ".txt")
BOM = "\ufeff"


def check_text_file(path: Path, field_name: str) -> None:
    """Refuse, naming the file and the line, a text data file that is empty, is not UTF-8, or (for
    `.jsonl`) has a line that is not JSON."""
    if path.suffix.lower() not in TEXT_SUFFIXES:
        return
    blank = True
    with path.open("rb") as f:
        for number, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8-sig" if number == 1 else "utf-8")  # a byte-order mark first
            except UnicodeDecodeError as err:
                raise RecipeError(f"{field_name}: {path} line {number}: not UTF-8 text (byte "
                                  f"0x{err.object[err.start]:02x} at column {err.start + 1})") from None
            if not line.strip():
                continue
            blank = False
            if path.suffix.lower() == ".jsonl":
                try:
                    json.loads(line.rstrip("\r\n"))
                except json.JSONDecodeError as err:
                    raise RecipeError(f"{field_name}: {path} line {number}: not JSON ({err.msg} at column "
                                      f"{err.colno})") from None
    if blank:
        raise RecipeError(f"{field_name}: {path} is empty")


def _one_builder(files: list[str], field_name: str) -> str:
    suffixes = {Path(f).suffix.lower() for f in files}
    unknown = [f for f in files if Path(f).suffix.lower() not in FILE_BUILDERS]
    if unknown:  # the file named: a folder of data files may hold another (a run folder's recipe.yaml)
        kind = Path(unknown[0]).suffix.lower() or "(none)"
        raise RecipeError(f"{field_name}: {unknown[0]}: unsupported file type {kind!r} (use {', '.join(FILE_BUILDERS)})")
    builders = {FILE_BUILDERS[s] for s in suffixes}
    if len(builders) > 1:
        raise RecipeError(f"{field_name}: files of different types ({', '.join(sorted(suffixes))}); use one type")
    return builders.pop()


# ---- formatting -------------------------------------------------------------------------------


def _is_json_conversation(text: str) -> bool:
    """Whether `text` is a JSON list of `{role, content}` messages."""
    stripped = text.strip()
    if not (stripped.startswith("[") and stripped.endswith("]")):
        return False
    try:
        value = json.loads(stripped)
    except json.JSONDecodeError:
        return False
    return bool(value) and isinstance(value, list) and all(isinstance(m, dict) and "role" in m for m in value)


class PromptProblem(ValueError):
    """Why one row cannot be a prompt (one of the reason names above)."""


def checked_messages(value: Any) -> Messages:
    """A conversation as plain `{role, content}` messages; raises PromptProblem for one that is not a
    list of messages with known roles."""
    if not isinstance(value, list):
        raise PromptProblem(NOT_TEXT)
    if not value:
        raise PromptProblem(EMPTY)
    for message in value:
        if not (isinstance(message, dict) and isinstance(message.get("role"), str)
                and isinstance(message.get("content"), str)):
            raise PromptProblem(BAD_MESSAGE)
        if message["role"] not in ROLES:
            raise PromptProblem(UNKNOWN_ROLE)
    return [{"role": m["role"], "content": m["content"]} for m in value]


class PromptFormat:
    """How a dataset's prompt becomes what the policy sees. A conversation (a list of {role,
    content} messages) always goes through the tokenizer's chat template with the generation
    prompt added; text goes through it as a user message when data.chat_template is on.
    data.system_prompt comes first as a system message, unless the conversation has its own."""

    def __init__(self, tokenizer, chat_template: bool, system_prompt: Optional[str] = None):
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.system_prompt = system_prompt

    def render(self, prompt: Any) -> tuple[str, tuple[int, ...]]:
        """(text, token ids) the policy sees for `prompt`; raises PromptProblem for a bad row."""
        row = self.row(prompt)
        return row.text, row.ids

    def row(self, prompt: Any, columns: Optional[dict[str, Any]] = None) -> PromptRow:
        """The PromptRow of `prompt` (and the row's other columns); raises PromptProblem for a bad row."""
        messages = self._messages(prompt)
        if messages is None:
            text = prompt
            # A plain text prompt gets the tokenizer's usual special tokens (a BOS, for some).
            ids = self.tokenizer(text, add_special_tokens=True)["input_ids"]
        else:
            text = self._apply_template(messages)
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]  # the template has them
        return PromptRow(prompt, text, tuple(ids), columns or {}, messages)

    @functools.cached_property
    def assistant_turn_end(self) -> Optional[int]:
        """The token the chat template closes an assistant turn with, when it is a special token (the
        one a policy writes to end its answer: Gemma's `<end_of_turn>`, ChatML's `<|im_end|>`), else the
        tokenizer's eos. Read once per format."""
        eos = self.tokenizer.eos_token_id
        messages = [{"role": "user", "content": "?"}, {"role": "assistant", "content": TURN_END_MARKER}]
        try:
            text = self.tokenizer.apply_chat_template(messages, tokenize=False)
        except Exception:  # noqa: BLE001 - a template that refuses this conversation says nothing of its turns
            return eos
        at = text.find(TURN_END_MARKER)
        after = self.tokenizer(text[at + len(TURN_END_MARKER):], add_special_tokens=False)["input_ids"] if at >= 0 else []
        # added special tokens (a template's markers) besides the named ones, which all_special_ids holds alone
        special = set(self.tokenizer.all_special_ids) | {
            i for i, token in self.tokenizer.added_tokens_decoder.items() if token.special}
        return after[0] if after and after[0] in special else eos

    def template_tokens(self) -> int:
        """How many tokens the chat template (and system prompt) add around an empty user turn."""
        return len(self.render([{"role": "user", "content": ""}])[1])

    def _messages(self, prompt: Any) -> Optional[Messages]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise PromptProblem(EMPTY)
            if _is_json_conversation(prompt):
                raise PromptProblem(JSON_TEXT)
            if not self.chat_template:
                if self.system_prompt:
                    raise RecipeError("data.system_prompt: text prompts take a system prompt only with "
                                      "data.chat_template: true")
                return None
            return self.with_system([{"role": "user", "content": prompt}])
        messages = checked_messages(prompt)
        if messages[-1]["role"] == "assistant":
            raise PromptProblem(ASSISTANT_LAST)
        return self.with_system(messages)

    def with_system(self, messages: Messages) -> Messages:
        """The messages after the recipe's system prompt, unless they open with one of their own."""
        if self.system_prompt and messages[0]["role"] != "system":
            return [{"role": "system", "content": self.system_prompt}, *messages]
        return messages

    def _apply_template(self, messages: Messages) -> str:
        if not getattr(self.tokenizer, "chat_template", None):
            raise RecipeError("data.chat_template: the tokenizer has no chat template, and conversations "
                              "and data.chat_template need one")
        return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)


def prepare_rows(rows: list[dict], prompt_column: str, fmt: PromptFormat, max_prompt_tokens: int,
                 source: str) -> PromptSet:
    """PromptRows for the rows that are usable; the others are dropped and counted by reason."""
    columns = list(rows[0]) if rows else []
    if rows and prompt_column not in rows[0]:
        raise RecipeError(
            f"data.prompt_column: column {prompt_column!r} not in {source!r} (columns: {', '.join(columns)})"
        )
    kept: list[PromptRow] = []
    dropped: dict[str, int] = {}
    for row in rows:
        try:
            prompt_row = fmt.row(row[prompt_column], {k: v for k, v in row.items() if k != prompt_column})
            if len(prompt_row.ids) > max_prompt_tokens:
                raise PromptProblem(TOO_LONG)
        except PromptProblem as problem:
            dropped[str(problem)] = dropped.get(str(problem), 0) + 1
            continue
        kept.append(prompt_row)
    return PromptSet(kept, dropped, [c for c in columns if c != prompt_column])


# ---- the recipe's prompt sets -----------------------------------------------------------------


# A held-out split off the training prompts, pairs or rows takes at most this share of them:
# eval_size's default (64 prompts, 256 pairs) would otherwise leave 1 of 65 prompts to train on.
MAX_HELD_OUT_SHARE = 0.2


def split_off(items: list[Row], size: int, seed: int, max_share: float = 1.0) -> tuple[list[Row], list[Row]]:
    """(kept, held out): `size` items (at most `max_share` of them, and never all) drawn with
    `seed`, each list in its original order."""
    order = list(range(len(items)))
    random.Random(seed).shuffle(order)
    cut = min(size, max(0, len(order) - 1), int(max_share * len(order)))
    held_idx = set(order[:cut])
    return ([x for i, x in enumerate(items) if i not in held_idx], [x for i, x in enumerate(items) if i in held_idx])


def split_held_out(items: list[Row], size: int, seed: int, source: str, what: str) -> tuple[list[Row], list[Row]]:
    """(kept, held out) for `data.eval_source: null`: `size` of the usable `what` (prompts, pairs,
    rows) split off with `seed`, at most MAX_HELD_OUT_SHARE of them; the log says which it was,
    and warns where data.eval_size asked for more."""
    kept, held = split_off(items, size, seed, MAX_HELD_OUT_SHARE)
    if len(held) < min(size, len(items) - 1):
        log.warning("data.eval_size %d would leave %d of %d %s to train on: held out %d (%.0f%%, the most a split "
                    "takes); data.eval_source names a held-out set of its own", size, max(len(items) - size, 0),
                    len(items), what, len(held), 100 * MAX_HELD_OUT_SHARE)
    elif held:
        log.info("held-out %s: %d of %s's %d usable ones, split off with seed %d before training (data.eval_source "
                 "names a set of its own)", what, len(held), source, len(items), seed)
    return kept, held


def resolved_eval_source(cfg: DataConfig) -> Optional[str]:
    """Where held-out prompts come from (`config.held_out_source`)."""
    return held_out_source(cfg.source, cfg.eval_source)


def text_prompt_format(tokenizer, cfg: DataConfig, conversational: bool) -> "PromptFormat":
    """How a text prompt given after training (`generate`, `eval --prompts`, export's parity
    probes) is formatted to look like the run's prompts: in the chat template when the recipe
    said so, and whenever the run trained on conversations, which always go through it."""
    return PromptFormat(tokenizer, cfg.chat_template or conversational, cfg.system_prompt)


def first_training_row(cfg: Union[DataConfig, SFTDataConfig]) -> Optional[tuple[dict, list[str]]]:
    """A run's first training row (empty when there is none) and its columns, read to tell how it
    formatted its prompts; None, with a warning, when its data source can no longer be read."""
    try:
        rows, columns = load_rows(cfg.source, cfg.split, cfg.name, cfg.revision)
    except RecipeError as err:
        log.warning("%s: text prompts are formatted by data.chat_template alone", err)
        return None
    return (rows[0] if rows else {}), columns


def trained_on_conversations(cfg: DataConfig) -> bool:
    """Whether the run's training prompts were conversations (read off its data source's first
    row; False, with a warning, when the source can no longer be read)."""
    found = first_training_row(cfg)
    return found is not None and isinstance(found[0].get(cfg.prompt_column), list)


def load_prompt_sets(cfg: DataConfig, tokenizer, seed: int) -> tuple[PromptSet, PromptSet]:
    """(train, held-out) prompt sets for a recipe's data section."""
    fmt = PromptFormat(tokenizer, cfg.chat_template, cfg.system_prompt)
    rows, _ = load_rows(cfg.source, cfg.split, cfg.name, cfg.revision)
    train = prepare_rows(rows, cfg.prompt_column, fmt, cfg.max_prompt_tokens, cfg.source)
    eval_source = resolved_eval_source(cfg)
    if eval_source:
        same = eval_source == cfg.source
        eval_name = cfg.eval_name if cfg.eval_name is not None else (cfg.name if same else None)
        eval_rows, _ = load_rows(eval_source, cfg.eval_split, eval_name, cfg.revision if same else None,
                                 "data.eval_source")
        held_out = prepare_rows(eval_rows, cfg.prompt_column, fmt, cfg.max_prompt_tokens, eval_source)
        held_out.rows = held_out.rows[: cfg.eval_size]
    else:
        # Split the held-out prompts off the training set with the run's seed, before training.
        train.rows, held = split_held_out(train.rows, cfg.eval_size, seed, cfg.source, "prompts")
        held_out = PromptSet(held, columns=train.columns)
    if not train.rows:
        raise RecipeError(f"data.source: no usable prompts in {cfg.source!r} ({_no_rows_reason(train, fmt, cfg)})")
    return train, held_out


def _no_rows_reason(prompts: PromptSet, fmt: PromptFormat, cfg: DataConfig) -> str:
    reasons = ", ".join(f"{v} {k}" for k, v in prompts.dropped.items()) or "the source is empty"
    if prompts.dropped.get(TOO_LONG) and (cfg.chat_template or fmt.system_prompt):
        try:
            overhead = fmt.template_tokens()
        except (RecipeError, PromptProblem):
            return reasons
        reasons += (f"; data.max_prompt_tokens is {cfg.max_prompt_tokens} and the chat template alone "
                    f"adds {overhead} tokens")
    return reasons


Row = TypeVar("Row")


class PromptStream(Generic[Row]):
    """Endless batches of prompts (or preference pairs), reshuffled each pass with a seeded RNG.

    The stream holds no position of its own: `take` reads one and returns the next, so the
    position lives in the run's TrainState and a resumed run continues the same order.
    """

    def __init__(self, rows: list[Row], seed: int):
        self.rows = rows
        self.seed = seed
        self._orders: dict[int, list[int]] = {}

    def _order(self, epoch: int) -> list[int]:
        if epoch not in self._orders:
            order = list(range(len(self.rows)))
            random.Random(self.seed * 100_003 + epoch).shuffle(order)
            self._orders = {epoch: order}  # only the current pass is ever needed again
        return self._orders[epoch]

    def take(self, size: int, position: PromptPosition) -> tuple[list[Row], PromptPosition]:
        """The next `size` rows from `position`, and the position after them."""
        epoch, cursor = position
        batch: list[Row] = []
        while len(batch) < size:
            if cursor >= len(self.rows):
                epoch, cursor = epoch + 1, 0
            batch.append(self.rows[self._order(epoch)[cursor]])
            cursor += 1
        return batch, PromptPosition(epoch, cursor)


def count_summary(prompt_set: PromptSet) -> Optional[str]:
    return drop_counts_text(prompt_set.dropped) or None


def drop_counts_text(dropped: dict[str, int]) -> str:
    """Rows dropped by reason, as a log line says them ("2 too long, 1 empty")."""
    return ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in dropped.items())


# ---- preference pairs (lora-ppo train-reward) -------------------------------------------------

PROMPT_MISMATCH = "prompt_mismatch"  # implicit prompts: chosen and rejected start differently
NOT_AN_ANSWER = "last_turn_not_assistant"
IDENTICAL = "chosen_equals_rejected"
BAD_MARGIN = "margin_not_a_finite_number"  # missing, not a number, or inf/nan (a NaN loss)


@dataclass(frozen=True)
class PreferencePair:
    """A prompt with a preferred and a rejected response, as the tokens the reward model reads:
    the prompt formatted as the PPO run formats it, then the response and the stop token."""

    prompt: Any  # as the dataset gives it (None for implicit text prompts)
    chosen_ids: tuple[int, ...]
    rejected_ids: tuple[int, ...]
    margin: float = 0.0


@dataclass
class PreferenceSet:
    pairs: list[PreferencePair]
    dropped: dict[str, int] = field(default_factory=dict)


def _response_text(value: Any) -> str:
    """A response as text: the text itself, or the content of its (last, assistant) message."""
    if isinstance(value, str):
        if not value.strip():
            raise PromptProblem(EMPTY)
        return value
    if not isinstance(value, list) or not value:
        raise PromptProblem(NOT_TEXT if not isinstance(value, list) else EMPTY)
    last = value[-1]
    if not (isinstance(last, dict) and isinstance(last.get("role"), str) and isinstance(last.get("content"), str)):
        raise PromptProblem(BAD_MESSAGE)
    if last["role"] != "assistant":
        raise PromptProblem(NOT_AN_ANSWER)
    return last["content"]


def make_pair(row: dict, cfg: PreferenceDataConfig, fmt: PromptFormat, eos_id: Optional[int]) -> PreferencePair:
    """One row as a pair of token sequences; raises PromptProblem for a bad row."""
    chosen, rejected = row.get(cfg.chosen_column), row.get(cfg.rejected_column)
    if chosen is None or rejected is None:
        raise PromptProblem(NOT_TEXT)
    prompt = row.get(cfg.prompt_column) if cfg.prompt_column else None
    if prompt is None and isinstance(chosen, list) and isinstance(rejected, list):
        # Implicit prompt: two conversations that share everything but the last (assistant) turn.
        if chosen[:-1] != rejected[:-1]:
            raise PromptProblem(PROMPT_MISMATCH)
        prompt = chosen[:-1] or None
    answers = (_response_text(chosen), _response_text(rejected))
    if answers[0] == answers[1]:
        raise PromptProblem(IDENTICAL)
    prompt_row = fmt.row(prompt) if prompt is not None else None
    prompt_ids = prompt_row.ids if prompt_row is not None else ()
    # A response is read as the policy writes it: its tokens, then the stop token (after a templated
    # prompt, the one the template closes an assistant turn with).
    end = fmt.assistant_turn_end if prompt_row is not None and prompt_row.messages is not None else eos_id
    ends = (end,) if end is not None else ()
    sequences = [tuple(prompt_ids) + tuple(fmt.tokenizer(a, add_special_tokens=prompt is None)["input_ids"]) + ends
                 for a in answers]
    if max(len(s) for s in sequences) > cfg.max_length:
        raise PromptProblem(TOO_LONG)
    margin = _margin(row[cfg.margin_column]) if cfg.margin_column else 0.0
    return PreferencePair(prompt, sequences[0], sequences[1], margin)


def _margin(value: Any) -> float:
    """A row's margin as a finite number (text that reads as one, as CSV columns give, will do)."""
    try:
        margin = math.nan if isinstance(value, bool) else float(value)
    except (TypeError, ValueError):
        margin = math.nan
    if not math.isfinite(margin):
        raise PromptProblem(BAD_MARGIN)
    return margin


def prepare_pairs(rows: list[dict], cfg: PreferenceDataConfig, fmt: PromptFormat, eos_id: Optional[int],
                  source: str) -> PreferenceSet:
    """PreferencePairs for the usable rows; the others are dropped and counted by reason."""
    columns = list(rows[0]) if rows else []
    for needed in (cfg.chosen_column, cfg.rejected_column, cfg.margin_column):
        if needed and rows and needed not in columns:
            raise RecipeError(f"data: column {needed!r} not in {source!r} (columns: {', '.join(columns)})")
    pairs: list[PreferencePair] = []
    dropped: dict[str, int] = {}
    for row in rows:
        try:
            pairs.append(make_pair(row, cfg, fmt, eos_id))
        except PromptProblem as problem:
            dropped[str(problem)] = dropped.get(str(problem), 0) + 1
    return PreferenceSet(pairs, dropped)


def load_preference_sets(cfg: PreferenceDataConfig, tokenizer, seed: int) -> tuple[PreferenceSet, PreferenceSet]:
    """(train, held-out) preference pairs for a reward recipe's data section."""
    fmt = PromptFormat(tokenizer, cfg.chat_template, cfg.system_prompt)
    rows, _ = load_rows(cfg.source, cfg.split, cfg.name, cfg.revision)
    train = prepare_pairs(rows, cfg, fmt, tokenizer.eos_token_id, cfg.source)
    if cfg.eval_source:
        same = cfg.eval_source == cfg.source
        eval_rows, _ = load_rows(cfg.eval_source, cfg.eval_split, cfg.name if same else None,
                                 cfg.revision if same else None, "data.eval_source")
        held_out = prepare_pairs(eval_rows, cfg, fmt, tokenizer.eos_token_id, cfg.eval_source)
        held_out.pairs = held_out.pairs[: cfg.eval_size]
    else:
        train.pairs, held = split_held_out(train.pairs, cfg.eval_size, seed, cfg.source, "pairs")
        held_out = PreferenceSet(held)
    if not train.pairs:
        reasons = ", ".join(f"{v} {k}" for k, v in train.dropped.items()) or "the source is empty"
        raise RecipeError(f"data.source: no usable preference pairs in {cfg.source!r} ({reasons})")
    return train, held_out
