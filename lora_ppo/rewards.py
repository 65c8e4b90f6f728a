"""Reward sources: a Python function, built-in sentiment lexicons (VADER, TextBlob), and a
Hugging Face sequence classifier with its own tokenizer. Each maps (prompts, completions)
to one float per completion.
"""

from __future__ import annotations

import importlib
import math
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch

from lora_ppo.config import RewardConfig
from lora_ppo.errors import RecipeError

RewardFn = Callable[[Sequence[str], Sequence[str]], Sequence[float]]


class RewardError(RuntimeError):
    """A reward source that raised or returned something unusable, with the source named."""


def vader_reward() -> RewardFn:
    """VADER compound sentiment of the completion, in [-1, 1] (the lexicon ships with the package)."""
    from vaderSentiment.vaderSentiment import SentimentIntensityAnalyzer

    analyzer = SentimentIntensityAnalyzer()

    def vader(prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        return [analyzer.polarity_scores(text)["compound"] for text in completions]

    return vader


def textblob_reward() -> RewardFn:
    """TextBlob pattern-lexicon polarity of the completion, in [-1, 1]: a second, independent
    sentiment measure so that gaming one lexicon shows."""
    from textblob import TextBlob

    def textblob(prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        return [float(TextBlob(text).sentiment.polarity) for text in completions]

    return textblob


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
    def __call__(self, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
        scores: list[float] = []
        texts = [p + c for p, c in zip(prompts, completions)]
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

    def score(self, prompts: Sequence[str], completions: Sequence[str]) -> tuple[list[float], dict[str, list[float]]]:
        """(reward scores, {side metric name: scores}), one checked float per completion each."""
        side = {name: score_completions(fn, prompts, completions) for name, fn in self.side.items()}
        return score_completions(self.reward, prompts, completions), side


def build_reward_sources(cfg: RewardConfig, trust_remote_code: bool = False,
                         reward_fn: Optional[RewardFn] = None) -> RewardSources:
    """The recipe's reward (or `reward_fn`, given from Python, in its place) and side metrics."""
    return RewardSources(reward_fn or build_reward(cfg, trust_remote_code), build_side_metrics(cfg))


def build_reward(cfg: RewardConfig, trust_remote_code: bool = False) -> RewardFn:
    """The reward function the recipe names."""
    if cfg.kind == "vader":
        return vader_reward()
    if cfg.kind == "function":
        return import_function(cfg.function)
    return ClassifierReward(cfg.model, cfg.label, cfg.batch_size, cfg.max_length, trust_remote_code)


def build_side_metrics(cfg: RewardConfig) -> dict[str, RewardFn]:
    """Scores logged beside the reward, never optimised."""
    makers = {"vader": vader_reward, "textblob": textblob_reward}
    return {name: makers[name]() for name in cfg.also_log}


def score_completions(fn: RewardFn, prompts: Sequence[str], completions: Sequence[str]) -> list[float]:
    """Call a reward source and check what it returns: one finite float per completion."""
    name = getattr(fn, "__name__", repr(fn))
    try:
        raw = fn(list(prompts), list(completions))
    except Exception as err:
        raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}") from err
    try:
        scores = [float(x) for x in raw]
    except (TypeError, ValueError) as err:
        raise RewardError(f"reward function {name} must return a list of floats: {err}") from None
    if len(scores) != len(completions):
        raise RewardError(f"reward function {name} returned {len(scores)} scores for {len(completions)} completions")
    for index, value in enumerate(scores):
        if not math.isfinite(value):
            raise RewardError(f"reward function {name} returned {value} for prompt index {index}: {prompts[index]!r}")
    return scores
