"""Reward sources and how they are called: built-in sentiment lexicons (VADER, TextBlob),
verifiable answers (math answer, exact match), a Python function, a Hugging Face sequence
classifier with its own tokenizer, and a reward adapter on the policy's own backbone; several
sources mix as a weighted sum.

Every source is called as TRL calls reward functions, so functions written for TRL work unchanged:
`f(prompts=..., completions=..., completion_ids=..., **columns)`. `prompts` are the dataset's own
(text, or a list of messages), never chat-templated; a completion is the decoded text, or for a
conversational prompt `[{"role": "assistant", "content": text}]`; each other dataset column
arrives as a keyword with one value per completion. A function `f(prompts, completions)` works too.
"""

from __future__ import annotations

import contextlib
import hashlib
import importlib
import inspect
import math
import os
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence, Union

import torch
from safetensors import SafetensorError

from lora_ppo.bnb_workarounds import eval_on_training_kernel
from lora_ppo.config import VERIFIABLE_KINDS, ModelConfig, RewardConfig, RewardSourceConfig
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.devices import device_map
from lora_ppo.quantization import compute_dtype, compute_in, modules_kept_unquantized, quantization_config
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
    # The policy's own tokens of prompt + response, (input_ids, attention_mask) [B, T], for sources
    # on its backbone (a reward adapter); never given to reward functions.
    model_input: Optional[tuple[torch.Tensor, torch.Tensor]] = None

    @classmethod
    def from_rows(cls, rows: Sequence[Any], texts: Sequence[str],
                  completion_ids: Optional[Sequence[Sequence[int]]] = None,
                  model_input: Optional[tuple[torch.Tensor, torch.Tensor]] = None) -> "RewardBatch":
        """From PromptRows (prompt, conversation or not, columns) and the decoded responses."""
        completions = [[{"role": "assistant", "content": t}] if r.is_conversation else t for r, t in zip(rows, texts)]
        names = list(rows[0].columns) if rows else []
        return cls(
            prompts=[r.prompt for r in rows], completions=completions,
            completion_ids=[list(ids) for ids in completion_ids] if completion_ids is not None else [],
            columns={name: [r.columns.get(name) for r in rows] for name in names},
            model_input=model_input,
        )


def no_reward(prompts: Sequence[Any], completions: Sequence[Completion], **_: Any) -> list[float]:
    """0 for every completion (`reward.kind: none`: an environment gives the rewards)."""
    return [0.0] * len(completions)


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
    """Import `package.module:function`, or `path/to/file.py:function` (how a run records a module
    it found in the current folder); only ever called for the function a recipe names."""
    module_name, _, attr = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            module = _module_from_file(Path(module_name))
        else:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as err:
                # `lora-ppo` (a console script) does not search the current folder as `python` does;
                # a module beside the user's recipe and data is what they mean. Installed ones win.
                if err.name != module_name.partition(".")[0] or os.getcwd() in sys.path:
                    raise
                sys.path.append(os.getcwd())
                module = importlib.import_module(module_name)
    except Exception as err:  # an import error in user code is a recipe problem, not a crash
        raise RecipeError(f"reward.function: cannot import module {module_name!r}: {err}") from None
    fn = getattr(module, attr, None)
    if not callable(fn):
        raise RecipeError(f"reward.function: {module_name!r} has no callable named {attr!r}")
    return fn


# The module name a Python file loaded by path gets (unique per file), for errors to recognise.
USER_MODULE_PREFIX = "lora_ppo_user_"


def _module_from_file(path: Path):
    """The module in the Python file `path`, loaded once per process (by its absolute path)."""
    import importlib.util

    name = f"{USER_MODULE_PREFIX}{hashlib.sha256(str(path.resolve()).encode()).hexdigest()[:12]}_{path.stem}"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, path)
        if spec is None or spec.loader is None or not path.is_file():
            raise ModuleNotFoundError(f"no Python file {path}")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        try:
            spec.loader.exec_module(module)
        except BaseException:
            del sys.modules[name]
            raise
    return sys.modules[name]


def importable_name(fn: RewardFn) -> Optional[str]:
    """`module:function` that imports back to `fn` itself, or None (a lambda, a closure, a method,
    a function defined in `__main__` or a notebook)."""
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or module == "__main__" or not name.isidentifier():
        return None
    try:
        return f"{module}:{name}" if getattr(importlib.import_module(module), name, None) is fn else None
    except Exception:  # importing it anew failed: it cannot be recorded by name
        return None


def recorded_reward(cfg: RewardConfig, reward_fn: Optional[RewardFn]) -> RewardConfig:
    """The reward section a run given `reward_fn` from Python trains on: the function by its
    importable name, else `kind: python` under its name (side metrics kept), so the run's
    recipe.yaml never names a reward the run did not use."""
    if reward_fn is None:
        return cfg
    spec = importable_name(reward_fn)
    source = {"kind": "function", "function": spec} if spec else {"kind": "python", "name": _name(reward_fn)}
    return RewardConfig(**source, also_log=cfg.also_log, timeout_s=cfg.timeout_s)


def classifier_head_modules(name: str, trust_remote_code: bool = False) -> list[str]:
    """The modules of the sequence classifier `name` that stay unquantized: its head (every
    top-level module outside the base model) and transformers' default. Reads only the config:
    the model is built on the meta device."""
    from transformers import AutoConfig, AutoModelForSequenceClassification

    config = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
    with torch.device("meta"):
        model = AutoModelForSequenceClassification.from_config(config, trust_remote_code=trust_remote_code)
    return modules_kept_unquantized(model)


def _not_a_classifier(name: str, err: Exception) -> RecipeError:
    return RecipeError(f"reward.model: cannot load a sequence classifier from {name!r}: {first_line(err)}")


def check_classifiers(cfg: RewardConfig, policy_model: ModelConfig) -> None:
    """Each classifier source's tokenizer and config, read before the policy's weights load, which
    takes minutes for a large model: a wrong name fails in seconds, with the line loading it would
    give (and, quantized, a model that is no sequence classifier: its head is found on the meta
    device, as `ClassifierReward` finds it)."""
    from transformers import AutoConfig, AutoTokenizer

    trust = policy_model.trust_remote_code
    for source in cfg.source_list():
        if source.kind != "classifier":
            continue
        try:
            AutoTokenizer.from_pretrained(source.model, trust_remote_code=trust)
            if (source.quantization or policy_model.quantization) != "none":
                classifier_head_modules(source.model, trust)  # reads the config too
            else:
                AutoConfig.from_pretrained(source.model, trust_remote_code=trust)
        except (OSError, ValueError) as err:
            raise _not_a_classifier(source.model, err) from None


class ClassifierReward:
    """Score completions with a sequence classifier (a reward model) that has its own tokenizer.
    With a chat template, it scores the conversation (the dataset's prompt as the user turn(s), the
    completion as the assistant turn) in its own template; otherwise prompt + completion as plain
    text, never in the policy's chat markup. Truncation drops the start of a long text and keeps the
    end, where the reward model reads its score. One logit (`label`, default the last) is the reward."""

    def __init__(self, cfg: RewardSourceConfig, policy_model: ModelConfig):
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        # The policy's number formats unless the source says otherwise (an fp32 8B reward model
        # is 32 GB; in 4-bit it fits beside the policy).
        settings = policy_model.model_copy(update={
            "name": cfg.model,
            "quantization": cfg.quantization or policy_model.quantization,
            "compute_dtype": cfg.dtype or policy_model.compute_dtype,
            "dequantize_per_step": False,
        })
        try:
            self.tokenizer = AutoTokenizer.from_pretrained(cfg.model, trust_remote_code=settings.trust_remote_code)
            # Left to itself transformers quantizes a head whose last parameter is a bias (DeBERTa's).
            quantized = settings.quantization != "none"
            head = classifier_head_modules(cfg.model, settings.trust_remote_code) if quantized else []
            self.model = AutoModelForSequenceClassification.from_pretrained(
                cfg.model, trust_remote_code=settings.trust_remote_code, use_safetensors=True,
                dtype=compute_dtype(settings), quantization_config=quantization_config(settings, head),
                device_map=device_map(),
            )
        except (OSError, ValueError, SafetensorError) as err:
            raise _not_a_classifier(cfg.model, err) from None
        compute_in(self.model, compute_dtype(settings), cfg.model, "reward.dtype")
        # bitsandbytes' CPU inference repacking (AVX512-BF16 hosts) breaks on layers narrower than its
        # block size and rounds differently: the classifier stays on the kernel the policy uses.
        eval_on_training_kernel(self.model).requires_grad_(False)
        num_labels = self.model.config.num_labels
        self.label = num_labels - 1 if cfg.label is None else cfg.label
        if not 0 <= self.label < num_labels:
            raise RecipeError(f"reward.label: {cfg.label} is out of range for a classifier with {num_labels} labels")
        padded_with_eos = self.tokenizer.pad_token_id is None
        if padded_with_eos:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        # A decoder classifier scores the last token that is not `pad_token_id`: without one it
        # refuses batches > 1, and with eos standing in for pad the config's own pad id never shows.
        for config in {id(c): c for c in (self.model.config, self.model.config.get_text_config())}.values():
            if padded_with_eos or getattr(config, "pad_token_id", None) is None:
                config.pad_token_id = self.tokenizer.pad_token_id
        self.tokenizer.truncation_side = "left"  # keep the end: the scored token is the last one
        self.templated = bool(getattr(self.tokenizer, "chat_template", None))
        self.batch_size = cfg.batch_size
        self.max_length = cfg.max_length
        self.__name__ = f"classifier({cfg.model})"

    def text(self, prompt: Any, completion: Completion) -> str:
        """What the classifier reads for one completion."""
        if not self.templated:
            return prompt_text(prompt) + completion_text(completion)
        conversation = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        messages = [*conversation, {"role": "assistant", "content": completion_text(completion)}]
        return self.tokenizer.apply_chat_template(messages, tokenize=False)

    @torch.no_grad()
    def __call__(self, prompts: Sequence[Any], completions: Sequence[Completion], **_: Any) -> list[float]:
        scores: list[float] = []
        texts = [self.text(p, c) for p, c in zip(prompts, completions)]
        for start in range(0, len(texts), self.batch_size):
            enc = self.tokenizer(
                texts[start : start + self.batch_size], return_tensors="pt", padding=True, truncation=True,
                max_length=self.max_length, add_special_tokens=not self.templated,  # a template has its own
            ).to(self.model.device)
            logits = self.model(**enc).logits.float()  # [b, num_labels]
            scores.extend(logits[:, self.label].tolist())
        return scores


class AdapterReward:
    """Score prompt + response with the reward adapter on the policy's own backbone, at the last
    real token, in micro-batches: no second model. Called with the whole RewardBatch, since it
    reads the policy's own tokens (`model_input`)."""

    takes_batch = True

    def __init__(self, score_sequences: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], batch_size: int):
        self.score_sequences = score_sequences
        self.batch_size = batch_size
        self.__name__ = "adapter"

    def __call__(self, batch: "RewardBatch") -> list[float]:
        if batch.model_input is None:
            raise RuntimeError("a reward adapter scores tokens, and this batch holds only text")
        input_ids, attention_mask = batch.model_input
        scores = [self.score_sequences(input_ids[i : i + self.batch_size], attention_mask[i : i + self.batch_size])
                  for i in range(0, input_ids.shape[0], self.batch_size)]
        return torch.cat(scores).tolist() if scores else []


@dataclass(frozen=True)
class WeightedSource:
    """One source of the score, with its weight, and whether the trainer normalises it."""

    name: str
    fn: RewardFn
    weight: float = 1.0
    normalize: bool = False


@dataclass(frozen=True)
class RewardScores:
    """What the sources said about one batch: the weighted total (no normalisation), each
    source's own scores, and the side metrics' scores."""

    total: list[float]
    by_source: dict[str, list[float]]
    side: dict[str, list[float]]


@dataclass(frozen=True)
class RewardSources:
    """The sources the policy optimises (a weighted sum), and the side scores logged beside them
    (never optimised)."""

    sources: list[WeightedSource]
    side: dict[str, RewardFn] = field(default_factory=dict)
    timeout_s: Optional[float] = None  # reward.timeout_s: per source and batch

    @classmethod
    def of(cls, fn: RewardFn, side: Optional[dict[str, RewardFn]] = None,
           timeout_s: Optional[float] = None) -> "RewardSources":
        """One source, with weight 1."""
        return cls([WeightedSource(_name(fn), fn)], side or {}, timeout_s)

    def score(self, batch: RewardBatch) -> RewardScores:
        """Every source's and side metric's checked scores, and the weighted total."""
        by_source = {s.name: score_completions(s.fn, batch, s.name, self.timeout_s) for s in self.sources}
        side = {name: score_completions(fn, batch, name, self.timeout_s) for name, fn in self.side.items()}
        total = [sum(s.weight * by_source[s.name][i] for s in self.sources) for i in range(len(batch.completions))]
        return RewardScores(total, by_source, side)


def check_reward_columns(cfg: RewardConfig, columns: Sequence[str], source: str,
                         reward_fn: Optional[RewardFn] = None) -> None:
    """Refuse, before any weights load, a reward that needs a column the data does not have: a
    verifiable reward's `answer_column`, or a function's named parameter. Imports the functions."""
    available = ", ".join(columns) or "none"
    functions = [reward_fn] if reward_fn is not None else []
    for s in cfg.source_list() if reward_fn is None else []:
        if s.kind in VERIFIABLE_KINDS and s.answer_column not in columns:
            raise RecipeError(f"reward.answer_column: column {s.answer_column!r} not in {source!r} "
                              f"(columns besides the prompt: {available})")
        if s.kind == "function":
            functions.append(import_function(s.function))
        if s.kind == "python":
            build_reward(s)  # refused: the object is not here to score with
    for fn in functions:
        missing = missing_columns(fn, columns)
        if missing:
            raise RecipeError(f"reward.function: {_name(fn)} needs column {missing[0]!r}, which "
                              f"{source!r} does not have (columns besides the prompt: {available})")


def build_reward_sources(cfg: RewardConfig, policy_model: ModelConfig, reward_fn: Optional[RewardFn] = None,
                         adapter_scorer: Optional[Callable] = None) -> RewardSources:
    """The recipe's reward sources (or `reward_fn`, given from Python, in their place) and side
    metrics. `adapter_scorer` scores token sequences with the reward adapter, for `kind: adapter`."""
    side = build_side_metrics(cfg)
    if reward_fn is not None:
        return RewardSources.of(reward_fn, side, cfg.timeout_s)
    sources = [
        WeightedSource(s.log_name, build_reward(s, policy_model, adapter_scorer), s.weight, s.normalize)
        for s in cfg.source_list()
    ]
    return RewardSources(sources, side, cfg.timeout_s)


def build_reward(cfg: RewardSourceConfig, policy_model: Optional[ModelConfig] = None,
                 adapter_scorer: Optional[Callable] = None) -> RewardFn:
    """The reward function one source names."""
    if cfg.kind == "python":
        raise RecipeError(f"reward.kind: python: this run trained on a Python reward object ({cfg.name}) given as "
                          "PPOTrainer(recipe, reward_fn=...); pass it again from Python, or set reward.kind to score "
                          "with something else")
    if cfg.kind == "none":
        return no_reward
    if cfg.kind == "vader":
        return vader_reward()
    if cfg.kind == "textblob":
        return textblob_reward()
    if cfg.kind == "function":
        return import_function(cfg.function)
    if cfg.kind == "math_answer":
        return math_answer_reward(cfg.answer_column, cfg.format_bonus)
    if cfg.kind == "exact_match":
        return exact_match_reward(cfg.answer_column)
    if cfg.kind == "adapter":
        if adapter_scorer is None:
            raise ValueError("a reward adapter needs the backbone it lives on")
        return AdapterReward(adapter_scorer, cfg.batch_size)
    return ClassifierReward(cfg, policy_model or ModelConfig())


def build_side_metrics(cfg: RewardConfig) -> dict[str, RewardFn]:
    """Scores logged beside the reward, never optimised."""
    makers = {"vader": vader_reward, "textblob": textblob_reward}
    return {name: makers[name]() for name in cfg.also_log}


def signature_parameters(fn: Callable) -> Optional[list[inspect.Parameter]]:
    """`fn`'s parameters, or None for a callable without a signature to read (builtins such as dict)."""
    try:
        return list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None


def required_by_name(params: list[inspect.Parameter]) -> list[str]:
    """The parameters a keyword call must give: no default, and neither `*args` nor `**kwargs`."""
    return [p.name for p in params if p.default is p.empty and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]


def call_reward(fn: RewardFn, batch: RewardBatch) -> Any:
    """Call `fn` as TRL does: every argument by keyword (`prompts`, `completions`,
    `completion_ids`, each column) when it takes `**kwargs` or names `completions`; else the
    two-argument form `fn(prompts, completions)`. A source that reads tokens takes the batch."""
    if getattr(fn, "takes_batch", False):
        return fn(batch)
    offered = {**batch.columns, "prompts": batch.prompts, "completions": batch.completions,
               "completion_ids": batch.completion_ids}
    params = signature_parameters(fn)
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
    params = signature_parameters(fn)
    if params is None or "completions" not in {p.name for p in params}:
        return []  # the two-argument form asks for nothing by name
    return [name for name in required_by_name(params) if name not in STANDARD_ARGUMENTS and name not in columns]


def _name(fn: RewardFn) -> str:
    return getattr(fn, "__name__", repr(fn))


class UserCodeClock:
    """Whether the main thread is running code a recipe names (a reward function, an environment,
    a tool), which, and since when: a stop request gives up on a step stuck there (signals.py)."""

    def __init__(self) -> None:
        self.since: Optional[float] = None
        self.what = ""

    @contextlib.contextmanager
    def running(self, what: str) -> Iterator[None]:
        if self.since is not None or threading.current_thread() is not threading.main_thread():
            yield  # the outermost call is the one that counts, and only the main thread's
            return
        self.since, self.what = time.monotonic(), what
        try:
            yield
        finally:
            self.since, self.what = None, ""


USER_CODE = UserCodeClock()

# What `run_within` returns for a call still running at its timeout.
STILL_RUNNING = object()


def run_within(fn: Callable[[], Any], timeout_s: Optional[float], thread_name: str, user_code: bool = True) -> Any:
    """`fn()`, or STILL_RUNNING when it has not returned within `timeout_s` seconds (None: no
    limit). The call runs in a daemon thread, which a hung function keeps, but which never keeps
    the process from exiting; an exception inside is raised here. `user_code`: `fn` runs code the
    recipe names, counted by USER_CODE under `thread_name` (`reward function NAME`, `tool NAME`)."""
    with USER_CODE.running(thread_name) if user_code else contextlib.nullcontext():
        return _run_within(fn, timeout_s, thread_name)


def _run_within(fn: Callable[[], Any], timeout_s: Optional[float], thread_name: str) -> Any:
    if timeout_s is None:
        return fn()
    outcome: dict[str, Any] = {}

    def run() -> None:
        try:
            outcome["value"] = fn()
        except BaseException as err:  # handed to the caller's thread below
            outcome["error"] = err

    thread = threading.Thread(target=run, name=thread_name, daemon=True)
    thread.start()
    thread.join(timeout_s)
    if thread.is_alive():
        return STILL_RUNNING
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


def call_within(fn: RewardFn, batch: RewardBatch, name: str, timeout_s: Optional[float]) -> Any:
    """`call_reward`, given at most `timeout_s` seconds: past it, RewardError."""
    builtin = (getattr(fn, "__module__", None) or "").startswith("lora_ppo.")  # a lexicon, a classifier, an adapter
    value = run_within(lambda: call_reward(fn, batch), timeout_s, f"reward function {name}", user_code=not builtin)
    if value is STILL_RUNNING:
        raise RewardError(f"reward function {name} did not return within reward.timeout_s ({timeout_s:g} s)")
    return value


def score_completions(fn: RewardFn, batch: RewardBatch, name: Optional[str] = None,
                      timeout_s: Optional[float] = None) -> list[float]:
    """Call a reward source and check what it returns: one finite number per completion (text,
    even "0.5", is refused: it is a sign of a function returning what it was meant to parse)."""
    name = name or _name(fn)
    try:
        raw = call_within(fn, batch, name, timeout_s)
    except RewardError:
        raise
    except Exception as err:
        raise RewardError(f"reward function {name} raised {type(err).__name__}: {err}") from err
    try:
        values = [raw] if isinstance(raw, (str, bytes)) else list(raw)
    except TypeError as err:
        raise RewardError(f"reward function {name} must return a list of floats: {err}") from None
    texts = [x for x in values if isinstance(x, (str, bytes))]
    if texts:
        raise RewardError(f"reward function {name} must return a list of numbers, and returned text ({texts[0]!r})")
    try:
        scores = [float(x) for x in values]
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
