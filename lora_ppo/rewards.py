"""Reward sources and how they are called: built-in sentiment lexicons (VADER, TextBlob),
verifiable answers (math answer, exact match), a Python function, and a Hugging Face sequence
classifier with its own tokenizer.

Every source is called as TRL calls reward functions, so functions written for TRL work unchanged:
`f(prompts=..., completions=..., completion_ids=..., **columns)`. `prompts` are the dataset's own
(text, or a list of messages), never chat-templated; a completion is the decoded text, or for a
conversational prompt `[{"role": "assistant", "content": text}]`; each other dataset column
arrives as a keyword with one value per completion. A function `f(prompts, completions)` works too.
"""

from __future__ import annotations

import importlib
import inspect
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Sequence, Union

import torch

from lora_ppo.config import RewardConfig
from lora_ppo.errors import RecipeError
from lora_ppo.verifiable import answers_match, normalise_text, states_answer_in_format

RewardFn = Callable[..., Sequence[float]]
Completion = Union[str, list[dict[str, str]]]
# What every source may ask for by name, besides the dataset's own columns.
STANDARD_ARGUMENTS = ("prompts", "completions", "completion_ids")


class RewardError(RuntimeError):
    """A reward source that raised or returned something unusable, with the source named."""


def completion_text(completion: Completion) -> str:
    """The text of a completion in either form (text, or a one-message list)."""
    return completion if isinstance(completion, str) else completion[-1]["content"]


def prompt_text(prompt: Union[str, list[dict[str, str]]]) -> str:
    """A prompt as plain text: the text itself, or its messages' contents one per line."""
    return prompt if isinstance(prompt, str) else "\n".join(m["content"] for m in prompt)


@dataclass(frozen=True)
class RewardBatch:
    """What a reward source is given: one entry per completion in each list."""

    prompts: list[Any]
    completions: list[Completion]
    completion_ids: list[list[int]] = field(default_factory=list)
    columns: dict[str, list[Any]] = field(default_factory=dict)

    @classmethod
    def from_rows(cls, rows: Sequence[Any], texts: Sequence[str],
                  completion_ids: Optional[Sequence[Sequence[int]]] = None) -> "RewardBatch":
        """From PromptRows (prompt, conversation or not, columns) and the decoded responses."""
        completions = [[{"role": "assistant", "content": t}] if r.is_conversation else t for r, t in zip(rows, texts)]
        names = list(rows[0].columns) if rows else []
        return cls(
            prompts=[r.prompt for r in rows], completions=completions,
            completion_ids=[list(ids) for ids in completion_ids] if completion_ids is not None else [],
            columns={name: [r.columns.get(name) for r in rows] for name in names},
        )


def vader_reward() -> RewardFn:
    """VADER compound sentiment of the completion, in [-1, 1] (the lexicon ships with the package)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def vader(prompts: Sequence[Any], completions: Sequence[Completion], **_: Any) -> list[float]:
        return [analyzer.polarity_scores(completion_text(c))["compound"] for c in completions]

    return vader


def textblob_reward() -> RewardFn:
    """TextBlob pattern-lexicon polarity of the completion, in [-1, 1]: a second, independent
    sentiment measure so that gaming one lexicon shows."""
    from textblob import TextBlob

    def textblob(prompts: Sequence[Any], completions: Sequence[Completion], **_: Any) -> list[float]:
        return [float(TextBlob(completion_text(c)).sentiment.polarity) for c in completions]

    return textblob


def math_answer_reward(answer_column: str, format_bonus: float = 0.0) -> RewardFn:
    """1 when the completion's final answer equals the reference in `answer_column` as a number
    (see lora_ppo.verifiable), else 0; plus `format_bonus` when it marks its answer `#### N` or
    `\\boxed{N}`."""
    def math_answer(prompts: Sequence[Any], completions: Sequence[Completion], **columns: Any) -> list[float]:
        texts = [completion_text(c) for c in completions]
        return [float(answers_match(text, str(reference))) + (format_bonus if states_answer_in_format(text) else 0.0)
                for text, reference in zip(texts, columns[answer_column])]

    return math_answer


def exact_match_reward(answer_column: str) -> RewardFn:
    """1 when the completion equals the reference in `answer_column`, case and spacing ignored."""
    def exact_match(prompts: Sequence[Any], completions: Sequence[Completion], **columns: Any) -> list[float]:
        return [float(normalise_text(completion_text(c)) == normalise_text(str(reference)))
                for c, reference in zip(completions, columns[answer_column])]

    return exact_match


def import_function(spec: str) -> RewardFn:
    """Import `package.module:function`; only ever called for the function a recipe names."""
    module_name, _, attr = spec.partition(":")
    try:
        module = importlib.import_module(module_name)
    except Exception as err:  # an import error in user code is a recipe problem, not a crash
        raise RecipeError(f"reward.function: cannot import module {module_name!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"reward.function: {module_name!r} has no callable named {attr!r}")
    return fn


class ClassifierReward:
    """Score completions with a sequence classifier: decode, re-tokenize with its own
    tokenizer, and take one logit (`label`, default the last) as the reward."""

    def __init__(self, path: str, label: Optional[int], batch_size: int, max_length: int, trust_remote_code: bool):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        try:
            self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
            self.model = AutoModelForSequenceClassification.from_pretrained(
                path, trust_remote_code=trust_remote_code, use_safetensors=True
            )
        except OSError as err:
            raise RecipeError(f"reward.model: cannot load a sequence classifier from {path!r}: {err}") from None
        if torch.cuda.is_available():
            self.model.to("cuda")
        self.model.eval().requires_grad_(False)
        num_labels = self.model.config.num_labels
        self.label = num_labels - 1 if label is None else label
        if not 0 <= self.label < num_labels:
            raise RecipeError(f"reward.label: {label} is out of range for a classifier with {num_labels} labels")
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size = batch_size
        self.max_length = max_length
        self.__name__ = f"classifier({path})"

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Completion], **_: Any) -> list[float]:
        scores: list[float] = []
        texts = [prompt_text(p) + completion_text(c) for p, c in zip(prompts, completions)]
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size],
                return_tensors="pt",
                padding=True,
                truncation=True,
                max_length=self.max_length,
            ).to(self.model.device)
            logits = self.model(**enc).logits.float()  # [b, num_labels]
            scores.extend(logits[:, self.label].tolist())
        return scores


@dataclass(frozen=True)
class RewardSources:
    """The reward the policy optimises, and the side scores logged beside it (never optimised)."""

    reward: RewardFn
    side: dict[str, RewardFn] = field(default_factory=dict)
    answer_column: Optional[str] = None  # the column the built-in verifiable reward reads

    def score(self, batch: RewardBatch) -> tuple[list[float], dict[str, list[float]]]:
        """(reward scores, {side metric name: scores}), one checked float per completion each."""
        side = {name: score_completions(fn, batch) for name, fn in self.side.items()}
        return score_completions(self.reward, batch), side

    def check_columns(self, columns: Sequence[str], source: str) -> None:
        """Refuse a reward that needs a column the data does not have, before anything loads."""
        available = ", ".join(columns) or "none"
        if self.answer_column is not None and self.answer_column not in columns:
            raise RecipeError(f"reward.answer_column: column {self.answer_column!r} not in {source!r} "
                              f"(columns besides the prompt: {available})")
        missing = missing_columns(self.reward, columns)
        if missing:
            raise RecipeError(f"reward.function: {_name(self.reward)} needs column {missing[0]!r}, which "
                              f"{source!r} does not have (columns besides the prompt: {available})")


def build_reward_sources(cfg: RewardConfig, trust_remote_code: bool = False,
                         reward_fn: Optional[RewardFn] = None) -> RewardSources:
    """The recipe's reward (or `reward_fn`, given from Python, in its place) and side metrics."""
    if reward_fn is not None:
        return RewardSources(reward_fn, build_side_metrics(cfg))
    answer_column = cfg.answer_column if cfg.kind in ("math_answer", "exact_match") else None
    return RewardSources(build_reward(cfg, trust_remote_code), build_side_metrics(cfg), answer_column)


def build_reward(cfg: RewardConfig, trust_remote_code: bool = False) -> RewardFn:
    """The reward function the recipe names."""
    if cfg.kind == "vader":
        return vader_reward()
    if cfg.kind == "function":
        return import_function(cfg.function)
    if cfg.kind == "math_answer":
        return math_answer_reward(cfg.answer_column, cfg.format_bonus)
    if cfg.kind == "exact_match":
        return exact_match_reward(cfg.answer_column)
    return ClassifierReward(cfg.model, cfg.label, cfg.batch_size, cfg.max_length, trust_remote_code)


def build_side_metrics(cfg: RewardConfig) -> dict[str, RewardFn]:
    """Scores logged beside the reward, never optimised."""
    makers = {"vader": vader_reward, "textblob": textblob_reward}
    return {name: makers[name]() for name in cfg.also_log}


def _parameters(fn: RewardFn) -> Optional[list[inspect.Parameter]]:
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # some callables have no signature to read
        return None


def call_reward(fn: RewardFn, batch: RewardBatch) -> Any:
    """Call `fn` as TRL does: every argument by keyword (`prompts`, `completions`,
    `completion_ids`, each column) when it takes `**kwargs` or names `completions`; else the
    two-argument form `fn(prompts, completions)`."""
    offered = {**batch.columns, "prompts": batch.prompts, "completions": batch.completions,
               "completion_ids": batch.completion_ids}
    params = _parameters(fn)
    if params is None:
        return fn(batch.prompts, batch.completions)
    if any(p.kind is p.VAR_KEYWORD for p in params):
        return fn(**offered)
    named = {p.name for p in params if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
    if "completions" in named:
        return fn(**{k: v for k, v in offered.items() if k in named})
    return fn(batch.prompts, batch.completions)


def missing_columns(fn: RewardFn, columns: Sequence[str]) -> list[str]:
    """The parameters `fn` requires by name that no column (nor a standard argument) provides."""
    params = _parameters(fn)
    if params is None or "completions" not in {p.name for p in params}:
        return []  # the two-argument form asks for nothing by name
    required = [p.name for p in params if p.default is p.empty
                and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY) and p.name not in STANDARD_ARGUMENTS]
    return [name for name in required if name not in columns]


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", repr(fn))


def score_completions(fn: RewardFn, batch: RewardBatch) -> list[float]:
    """Call a reward source and check what it returns: one finite float per completion."""
    name = _name(fn)
    try:
        raw = call_reward(fn, batch)
    except Exception as err:
        raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}") from err
    try:
        scores = [float(x) for x in raw]
    except (TypeError, ValueError) as err:
        raise RewardError(f"reward function {name} must return a list of floats: {err}") from None
    if len(scores) != len(batch.completions):
        raise RewardError(
            f"reward function {name} returned {len(scores)} scores for {len(batch.completions)} completions"
        )
    for index, value in enumerate(scores):
        if not math.isfinite(value):
            raise RewardError(
                f"reward function {name} returned {value} for prompt index {index}: {batch.prompts[index]!r}"
            )
    return scores
