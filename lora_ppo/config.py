"""The recipe schema: one pydantic model per YAML section, cross-field checks, derived sizes.

A recipe is validated once and never written back at run time. Every bad value becomes a
one-line `RecipeError` naming the field path and the value.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Literal, Optional, Union

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from lora_ppo.errors import RecipeError

Quantization = Literal["4bit", "8bit", "none"]


class Section(BaseModel):
    # Unknown keys are errors: a typo in a recipe must not silently fall back to a default.
    # NaN and inf are never meaningful settings (a NaN learning rate passes every `gt` check).
    model_config = ConfigDict(extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False)


class ModelConfig(Section):
    name: str = "builtin:smollm2-135m-instruct"
    quantization: Quantization = "4bit"
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    double_quant: bool = True
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    # Recompute decoder activations during the update (never during generation): the update's
    # activation memory drops to the layer inputs. The quickstart's 135M model turns it off for speed.
    gradient_checkpointing: bool = True
    # Dequantize the 4-bit layers once per PPO step (and per evaluation) and compute with that
    # copy, instead of dequantizing in every forward and backward pass. Same numbers, about 25%
    # faster steps on CPU, but the layers are held unquantized in the compute dtype during the
    # step: worth it for small models on CPU, never for a large model on a GPU.
    dequantize_per_step: bool = False
    trust_remote_code: bool = False


class LoraSettings(Section):
    r: int = Field(16, gt=0)
    alpha: float = Field(32.0, gt=0)
    target_modules: Union[Literal["all-linear"], list[str]] = "all-linear"
    # A PEFT adapter folder to start from (e.g. an SFT adapter) instead of a fresh LoRA.
    init_from: Optional[str] = None


class AdaptersConfig(Section):
    policy: LoraSettings = LoraSettings()
    value: LoraSettings = LoraSettings()
    # "auto": the policy's init_from adapter, frozen, when there is one, else adapters disabled.
    # "disable": the bare base model. "none": no reference at all (KL-free run).
    # Anything else: a PEFT adapter folder, loaded frozen.
    reference: str = "auto"

    @property
    def reference_enabled(self) -> bool:
        return self.reference != "none"

    @property
    def reference_adapter_path(self) -> Optional[str]:
        """The adapter folder the reference role uses, or None for adapters disabled / no reference."""
        if self.reference in ("disable", "none"):
            return None
        if self.reference == "auto":
            return self.policy.init_from
        return self.reference


class RewardConfig(Section):
    kind: Literal["vader", "function", "classifier"] = "vader"
    # kind=function: "package.module:function" taking (prompts, completions) -> list[float].
    function: Optional[str] = None
    # kind=classifier: a Hugging Face sequence-classification model (folder or hub id).
    model: Optional[str] = None
    # Which classifier logit is the score; default: the last one (the "positive" class).
    label: Optional[int] = None
    batch_size: int = Field(16, gt=0)
    max_length: int = Field(512, gt=0)
    # Independent scores logged beside the reward (never optimised) so reward hacking shows.
    also_log: list[Literal["vader", "textblob"]] = []

    @model_validator(mode="after")
    def _source_fields(self) -> "RewardConfig":
        if self.kind == "function" and not self.function:
            raise ValueError("reward.function is required when reward.kind is 'function'")
        if self.kind == "function" and ":" not in (self.function or ""):
            raise ValueError(f"reward.function must look like 'module:function', got {self.function!r}")
        if self.kind == "classifier" and not self.model:
            raise ValueError("reward.model is required when reward.kind is 'classifier'")
        return self


class DataConfig(Section):
    # A local .jsonl/.json/.csv/.parquet/.txt file, a Hugging Face dataset id, or builtin:<name>.
    source: str = "builtin:movie_review_openers"
    split: str = "train"
    prompt_column: str = "prompt"
    chat_template: bool = False
    max_prompt_tokens: int = Field(64, gt=0)
    # Held-out prompts: from eval_source when given, else eval_size prompts split off source.
    eval_source: Optional[str] = "builtin:movie_review_openers_heldout"
    eval_split: str = "train"
    eval_size: int = Field(64, ge=0)
    # Responses generated at once when evaluating; null: rollout.batch_size. Generation on CPU
    # costs about the same per step for 16 or 32 rows, so a larger one evaluates faster.
    eval_batch_size: Optional[int] = Field(None, gt=0)
    # Completions sampled per held-out prompt: the held-out mean is a mean over prompts of
    # their samples' mean, so more samples lower the sampling noise of before/after scores.
    eval_samples_per_prompt: int = Field(1, gt=0)


class RolloutConfig(Section):
    batch_size: int = Field(16, gt=0)
    max_new_tokens: int = Field(24, gt=0)
    temperature: float = Field(1.0, gt=0.0)
    top_k: int = Field(0, ge=0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    # "eos": the tokenizer's eos token; any other string: that token; null: never stop early.
    stop_token: Optional[str] = "eos"
    missing_eos_penalty: Optional[float] = None
    # Rows per forward pass when scoring a rollout (old/ref logprobs, values).
    forward_batch_size: int = Field(16, gt=0)
    # Take the old logprobs from the logits generation computed (one forward pass fewer per
    # step) instead of re-scoring the responses. In float32 the two agree to ~1e-5; in bf16/fp16
    # KV-cached decoding can drift further from a full forward, hence off by default.
    logprobs_from_generation: bool = False
    # Responses sampled per prompt (RLOO/GRPO need >= 2); batch_size counts responses.
    samples_per_prompt: int = Field(1, gt=0)


class PPOConfig(Section):
    # "gae": PPO with the value adapter as critic. "rloo" / "grpo": critic-free baselines over
    # rollout.samples_per_prompt samples per prompt; no value adapter is created.
    advantage_estimator: Literal["gae", "rloo", "grpo"] = "gae"
    num_epochs: int = Field(4, gt=0)
    num_minibatches: int = Field(1, gt=0)
    grad_accum_steps: int = Field(1, gt=0)
    clip_eps: float = Field(0.2, gt=0.0)
    value_clip_eps: float = Field(0.2, gt=0.0)
    vf_coef: float = Field(0.1, ge=0.0)
    kl_coef: float = Field(0.05, ge=0.0)
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    # "reward": -kl_coef * KL per token inside the reward; "loss": kl_coef * KL as a loss term.
    kl_penalty: Literal["reward", "loss"] = "reward"
    # Set to adapt kl_coef toward this per-sequence KL (Ziegler et al. 2019) over kl_horizon samples.
    target_kl: Optional[float] = Field(None, gt=0.0)
    kl_horizon: int = Field(10000, gt=0)
    # Score shaping, in this order: running mean/std normalisation, clipping, length penalty.
    score_norm: bool = False
    score_clip: Optional[float] = Field(None, gt=0.0)
    length_penalty: float = 0.0
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    lam: float = Field(0.95, ge=0.0, le=1.0)
    whiten_rewards: bool = False
    whiten_advantages: bool = True
    entropy_coef: float = Field(0.0, ge=0.0)
    clip_value_loss: bool = True
    # Dual-clip PPO: cap the loss of negative-advantage tokens at -dual_clip * A (typically 3).
    dual_clip: Optional[float] = Field(None, gt=1.0)
    # A minibatch whose mean ratio exceeds this is skipped, or its policy gradient scaled down.
    ratio_threshold: Optional[float] = Field(None, gt=1.0)
    ratio_threshold_action: Literal["skip", "scale"] = "skip"
    # "token": every real token weighs the same; "sequence": every response weighs the same.
    loss_aggregation: Literal["token", "sequence"] = "token"
    max_grad_norm: float = Field(1.0, gt=0.0)
    learning_rate: float = Field(1e-4, gt=0.0)
    # The value adapter and head; default: learning_rate.
    value_learning_rate: Optional[float] = Field(None, gt=0.0)
    lr_schedule: Literal["constant", "linear"] = "constant"


class TrainConfig(Section):
    steps: int = Field(100, gt=0)
    # Within what torch.manual_seed accepts.
    seed: int = Field(0, ge=0, lt=2**63)
    output_dir: str = "runs/ppo"
    overwrite: bool = False
    # 0 turns a periodic action off.
    save_every: int = Field(0, ge=0)
    log_every: int = Field(1, gt=0)
    sample_every: int = Field(10, ge=0)
    eval: bool = True
    # Full-state checkpoints kept under output_dir/checkpoints/ (older ones are deleted).
    keep_last: int = Field(3, ge=1)
    # Steps in a row whose update was skipped for a NaN/inf before the run stops.
    max_consecutive_skips: int = Field(3, gt=0)


class Recipe(Section):
    model: ModelConfig = ModelConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    reward: RewardConfig = RewardConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    ppo: PPOConfig = PPOConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _batch_split(self) -> "Recipe":
        k = self.rollout.samples_per_prompt
        if self.rollout.batch_size % k:
            raise ValueError(
                f"rollout.batch_size ({self.rollout.batch_size}) must be divisible by rollout.samples_per_prompt ({k})"
            )
        if self.ppo.advantage_estimator != "gae" and k < 2:
            raise ValueError(
                f"ppo.advantage_estimator {self.ppo.advantage_estimator!r} needs rollout.samples_per_prompt >= 2 (got {k})"
            )
        if self.model.dequantize_per_step and self.model.quantization != "4bit":
            raise ValueError(
                f"model.dequantize_per_step: needs model.quantization 4bit (got {self.model.quantization!r})"
            )
        parts = self.ppo.num_minibatches * self.ppo.grad_accum_steps
        if self.rollout.batch_size % parts:
            raise ValueError(
                f"rollout.batch_size ({self.rollout.batch_size}) must be divisible by "
                f"ppo.num_minibatches * ppo.grad_accum_steps ({parts})"
            )
        return self

    @property
    def uses_critic(self) -> bool:
        """Whether a value adapter and score head exist (only for GAE)."""
        return self.ppo.advantage_estimator == "gae"

    @property
    def minibatch_size(self) -> int:
        return self.rollout.batch_size // self.ppo.num_minibatches

    @property
    def micro_batch_size(self) -> int:
        return self.minibatch_size // self.ppo.grad_accum_steps


# Fields a resumed run may change: they alter how long it runs or what it logs, never what a
# step computes. Any other difference from the run's recipe.yaml is refused.
RESUME_ALLOWED = frozenset({
    "train.steps", "train.log_every", "train.sample_every", "train.save_every", "train.keep_last",
    "train.eval", "train.overwrite", "train.max_consecutive_skips", "data.eval_size",
    "data.eval_batch_size", "data.eval_samples_per_prompt", "model.dequantize_per_step",
})


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_differences(saved: dict[str, Any], recipe: Recipe) -> list[str]:
    """Field paths where `recipe` differs from the run's saved recipe and a resume is unsafe."""
    old, new = _flatten(saved), _flatten(recipe.model_dump(mode="json"))
    changed = sorted(k for k in set(old) | set(new) if old.get(k, "<unset>") != new.get(k, "<unset>"))
    return [k for k in changed if k not in RESUME_ALLOWED]


def _path_part(part: Any) -> str:
    # A key with a line break or other control character is quoted, so the error stays one line.
    text = str(part)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


def _format_validation_error(err: ValidationError) -> str:
    first = err.errors()[0]
    path = ".".join(_path_part(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    if first["type"] == "extra_forbidden":
        line = f"{path}: unknown field (check the spelling)"
    elif first["type"] == "missing":
        line = f"{path}: required field is missing"
    elif path:
        line = f"{path}: {msg} (got {first.get('input')!r})"
    else:
        line = msg
    more = len(err.errors()) - 1
    return line + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides; values are parsed as YAML (`3`, `true`, `[a, b]`)."""
    for item in overrides:
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key.path=value")
        key, raw = item.split("=", 1)
        parts = key.strip().split(".")
        if not all(parts):
            raise RecipeError(f"override {item!r}: empty name in the key path")
        try:
            value = yaml.safe_load(raw) if raw.strip() else ""
        except yaml.YAMLError:
            value = raw
        node = data
        for part in parts[:-1]:
            child = node.setdefault(part, {})
            if not isinstance(child, dict):
                raise RecipeError(f"override {item!r}: {part} is not a section")
            node = child
        node[parts[-1]] = value
    return data


def recipe_from_dict(data: dict[str, Any], overrides: list[str] = ()) -> Recipe:
    """Validate a recipe given as a dict (e.g. from Python), with optional overrides."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: expected a mapping of sections, got {type(data).__name__}")
    import copy

    data = apply_overrides(copy.deepcopy(data), list(overrides))
    try:
        return Recipe.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation_error(err)) from None


def load_recipe(path: str | Path, overrides: list[str] = ()) -> Recipe:
    """Read and validate a YAML recipe file."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"recipe file {path} cannot be read: {err}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise RecipeError(f"recipe {path}: {problem}{where}") from None
    if data is None:
        data = {}
    return recipe_from_dict(data, overrides)


def recipe_to_yaml(recipe: Recipe) -> str:
    """The fully resolved recipe (every default filled in) as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
