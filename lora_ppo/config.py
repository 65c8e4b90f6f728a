"""The recipe schema: one pydantic model per YAML section, cross-field checks, derived sizes.

Each field's description lives here; docs/recipe.md is generated from them
(`python -m lora_ppo.recipe_reference`). A recipe is validated once and never written back at
run time. Every bad value becomes a one-line `RecipeError` naming the field path and the value.
"""

from __future__ import annotations

import difflib
import os
from pathlib import Path
from typing import Any, Iterator, Literal, Optional, Union, get_args

import yaml
from pydantic import BaseModel, ConfigDict, Field, PositiveInt, ValidationError, model_validator
from pydantic.fields import FieldInfo

from lora_ppo.errors import RecipeError

# The prefix of the model and dataset names that ship with the package (`builtin:<name>`).
BUILTIN_PREFIX = "builtin:"

Quantization = Literal["4bit", "8bit", "none"]

# Sizes a PPO recipe may leave to the memory plan (`auto`): `lora-ppo estimate` and the run choose
# them for the budget (train.memory_budget_gb, --gpu-gb, or the device's free memory) and the run
# records its choice in its recipe.yaml; a resumed run keeps the choice it recorded.
AUTO = "auto"
AUTO_SIZES = ("ppo.grad_accum_steps", "rollout.forward_batch_size", "model.gradient_checkpointing",
              "model.offload_embeddings")

# The mark of a field a resumed run may change: it alters how long the run goes, what it logs
# or evaluates, or how fast a step runs, never what a step computes. RESUME_ALLOWED is derived
# from these marks; any other difference from the run's recipe.yaml is refused.
MAY_CHANGE_ON_RESUME = {"resume": "may change"}
# `data.eval_source: auto` for a builtin training set: the held-out set shipped beside it.
HELD_OUT_COMPANIONS = {"builtin:movie_review_openers": "builtin:movie_review_openers_heldout"}


class Section(BaseModel):
    """A recipe section: unknown keys, NaN and inf are refused; values never change after loading."""

    # Unknown keys are errors: a typo in a recipe must not silently fall back to a default.
    # NaN and inf are never meaningful settings (a NaN learning rate passes every `gt` check).
    # An empty string names no model, file, column or folder (`data.source=` on the command line
    # read as the recipe's own folder); a field where empty means something says so (min_length=0).
    # Each field's description is the docstring below it (docs/recipe.md is generated from them).
    model_config = ConfigDict(
        extra="forbid", frozen=True, validate_default=True, allow_inf_nan=False, use_attribute_docstrings=True,
        str_min_length=1,
    )

    @model_validator(mode="before")
    @classmethod
    def _paths_as_text(cls, data: Any) -> Any:
        """From Python a file or folder is naturally a pathlib.Path (`tmp_path / "run"`): taken as its text."""
        if isinstance(data, dict):
            return {key: os.fspath(value) if isinstance(value, os.PathLike) else value for key, value in data.items()}
        return data


# model.dequantize_per_step auto: the share of the memory free after loading that the dequantized
# copy may take; the rest is left to the step's own activations.
AUTO_DEQUANTIZE_SHARE = 0.5
# rollout.compile auto: the decode steps a run must take on a CUDA GPU for compiling to pay back.
# Compiling takes about a minute; on the 8B recipe it saves 40-75 ms a decode step (bench/README.md),
# so it pays after 1,000-1,300; smaller models save less per step.
AUTO_COMPILE_MIN_DECODE_STEPS = 2000


# apply_chat_template's own arguments, which lora_ppo sets at each call (model.chat_template_kwargs may not).
TEMPLATE_ARGUMENTS_SET_HERE = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt", "continue_final_message",
    "tokenize", "padding", "truncation", "max_length", "return_tensors", "return_dict", "return_assistant_tokens_mask",
    "tokenizer_kwargs"})


class ModelConfig(Section):
    """The base model: where it comes from, how it is quantized, and the dtype it computes in."""

    name: str = "builtin:smollm2-135m-instruct"
    """A local folder holding `.safetensors` weights, a Hugging Face hub id, or
    `builtin:smollm2-135m-instruct`. The default is embedded in the package, so a first run downloads
    nothing.
    """
    quantization: Quantization = "4bit"
    """How the frozen base weights are stored: `4bit` (bitsandbytes), `8bit`, or `none`. 4-bit by default: the
    one backbone serves every role, so its size is most of a run's memory.
    """
    bnb_4bit_quant_type: Literal["nf4", "fp4"] = "nf4"
    """The 4-bit data type: `nf4` (NormalFloat, made for normally distributed weights; QLoRA's choice) or
    `fp4`.
    """
    double_quant: bool = True
    """Quantize the 4-bit layers' scales too (QLoRA's double quantization): a little less memory for the same
    results.
    """
    compute_dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """The dtype of computation and of the unquantized parts (norms, embeddings, heads). `auto`: bfloat16 on a
    GPU that supports it, else float16; float32 on CPU.
    """
    gradient_checkpointing: Union[bool, Literal["auto"]] = True
    """Recompute decoder activations during the update (generation always keeps its KV cache), so the update
    holds only each layer's inputs. On by default because memory is what stops a large model; a small model
    with memory to spare runs faster with it off. `auto` (PPO): off when the update fits the memory budget
    without it at the same micro-batch (`train.memory_budget_gb`), else on; elsewhere (`train-reward`, `train-sft`) on.
    """
    dequantize_per_step: Union[bool, Literal["auto"]] = Field("auto", json_schema_extra=MAY_CHANGE_ON_RESUME)
    """4-bit only: dequantize every 4-bit layer once and compute every step and evaluation from that copy
    instead of dequantizing in every forward and backward pass: same numbers, faster steps (on CPU
    generation about 2x), but the layers are held unquantized from the first step to the end of the
    run (the name is older: until 2026-11-28 the copy was made again each step). `auto`: on when that copy
    takes at most half the memory free after loading (a small model; never an 8B model on a 24 GB card),
    else off; the run's log says which. Free memory is what this process may still allocate: a cap set
    with `torch.cuda.set_per_process_memory_fraction` (to share a card) counts.
    """
    dequantize_budget_gb: Optional[float] = Field(None, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """With `dequantize_per_step` on: hold at most this many GB of dequantized layers (those that fit, in
    the model's order; the others compute from their 4 bits as without it), so a card with memory to spare
    beyond the step's needs gets part of the speed of the full copy. null: every layer. Same numbers either
    way.
    """
    offload_embeddings: Union[bool, Literal["auto"]] = False
    """Keep the input embedding table in CPU memory and look each forward's tokens up there (a few thousand
    rows), instead of holding it on the GPU: saves vocabulary x hidden x 2 bytes of GPU memory (1.56 GB for
    Qwen2.5-32B, 1.05 GB for Llama-3.1-8B) for the same hidden states. Generation looks its tokens up in a
    copy of the table on the GPU where the memory plan has room for one (its peak then stays at or under
    scoring's and the update's), else on the CPU, where each decoded token waits to reach the host. Not for
    models whose LM head shares the table (tied embeddings: refused at load). `auto` (PPO on a GPU): on
    where the memory plan needs it to fit the budget or, with it, runs the update in fewer micro-batches or
    without recomputing (`ppo.grad_accum_steps` or `model.gradient_checkpointing` auto), else off; the
    run's log says which and why. Off for tied embeddings, on CPU and in `train-reward` and `train-sft`.
    """
    quantize_lm_head: bool = False
    """Quantize the LM head as the linear layers are (`model.quantization`) instead of keeping it at the
    compute dtype: in 4-bit it takes a quarter of vocabulary x hidden x 2 bytes (saves 1.17 GB on Qwen2.5-32B).
    Every role reads the same head, so the PPO ratio, the KL and the logprob self-check stay exact, but the
    policy's distribution carries the head's rounding (logits within NF4's error of the checkpoint's). Needs a
    quantized model; not for tied embeddings (refused at load).
    """
    adapter_autocast: bool = False
    """Run the LoRA adapters' matrix multiplies in bfloat16 under `torch.autocast`, their float32 weights
    kept as the optimizer's master copies, instead of float32 multiplies with every activation cast to
    float32 and back around them (most of the update's elementwise GPU work: bench/README.md). Generation,
    scoring and the update all run it, so the PPO ratio and the logprob self-check stay exact; the adapters'
    outputs carry bfloat16 rounding. Only where computation runs in bfloat16 (a GPU's `auto`); elsewhere it
    stays off and the log says so. Off by default until its speed is measured on a GPU.
    """
    fused_lora: bool = False
    """Compute each LoRA linear layer as its base layer's output plus the adapter's product added by one
    matrix multiply-add in the compute dtype (`addmm`), instead of PEFT's float32 arithmetic (which every run
    otherwise computes without PEFT's copy of the base output and, for a power-of-two scale, without its
    multiply: the same numbers bit for bit): a float32 copy of the input kept per projection for the
    backward, and a cast and an add over the full output width. Fewer kernels and launches per layer, and
    no float32 copies of activations; the
    adapters' float32 weights stay the optimizer's master copies. Each training pass casts them to the compute
    dtype once for every layer, not at each layer's call, and holds those copies and their gradients until its
    backward ends (0.17 GB for the 8B recipe's policy). In bfloat16 the adapters' products carry bfloat16
    rounding (as with `adapter_autocast`); in float32 the numbers are PEFT's within rounding. LoRA layers of
    other kinds (embeddings, 8-bit, expert parameters) keep PEFT's forward. Off by default until its speed is
    measured on a GPU.
    """
    fused_4bit_decode: bool = False
    """4-bit nf4 only: compute the 4-bit layers in each decode step (at most 64 rows, no gradient) with one
    Triton kernel that reads the 4-bit codes and dequantizes them in registers, instead of dequantizing
    the whole weight to the compute dtype for every generated token (what bitsandbytes does for most of an
    8B model's layers at 16 rows on an H100). The same weights, their products summed in another order.
    Needs a CUDA GPU and Triton (installed with PyTorch's CUDA builds); elsewhere the layers keep
    bitsandbytes' forward and the log says why. Layers held dequantized (`dequantize_per_step`) compute from
    their copy. Off by default until its speed is measured on a GPU.
    """
    trust_remote_code: bool = False
    """Run model code downloaded from the hub. Off unless the recipe says so, since it executes code that
    comes with the model.
    """
    chat_template_kwargs: dict[str, Any] = {}
    """Variables for the tokenizer's chat template, passed wherever lora_ppo renders it (prompts, an episode's
    turns, SFT rows, preference pairs, `eval`, `generate`): `{enable_thinking: false}` turns Qwen3's thinking
    off. Each name must be one the template reads (checked when the tokenizer loads: a misspelt name would change
    nothing), and none lora_ppo sets itself (`add_generation_prompt`, `tokenize`, `tools`, ...). An export's
    tokenizer does not keep them: pass them to `apply_chat_template` there too.
    """

    @model_validator(mode="after")
    def _template_variables(self) -> "ModelConfig":
        taken = sorted(set(self.chat_template_kwargs) & TEMPLATE_ARGUMENTS_SET_HERE)
        if taken:
            raise ValueError(f"chat_template_kwargs: {taken[0]!r} is set by lora_ppo itself wherever it renders the "
                             "template; name only the template's own variables")
        return self

    @model_validator(mode="after")
    def _levers(self) -> "ModelConfig":
        if self.dequantize_budget_gb is not None and self.dequantize_per_step is False:
            raise ValueError(f"dequantize_budget_gb ({self.dequantize_budget_gb:g}) needs dequantize_per_step "
                             "true or auto")
        if self.fused_4bit_decode and (self.quantization, self.bnb_4bit_quant_type) != ("4bit", "nf4"):
            raise ValueError(f"fused_4bit_decode: needs model.quantization 4bit with bnb_4bit_quant_type nf4 (got "
                             f"{self.quantization!r}, {self.bnb_4bit_quant_type!r})")
        if self.quantize_lm_head and self.quantization == "none":
            raise ValueError("quantize_lm_head: needs model.quantization 4bit or 8bit (got 'none')")
        return self

    @property
    def embeddings_on_cpu(self) -> bool:
        """Whether the embedding table is kept in CPU memory: `auto` left undecided (no memory plan) is off."""
        return self.offload_embeddings is True

    @property
    def checkpointing_on(self) -> bool:
        """Whether updates recompute activations: `auto` left undecided (no memory plan) is on."""
        return self.gradient_checkpointing is not False

    def compute_dtype_name(self, device: str, bf16_supported: bool = True) -> str:
        """The dtype computation runs in on `device` ("cuda" or "cpu"): "float32", "bfloat16" or
        "float16". `bf16_supported` says whether the GPU computes in bfloat16 (ignored on CPU)."""
        if device not in ("cuda", "cpu"):
            raise ValueError(f"device must be 'cuda' or 'cpu', got {device!r}")
        if self.compute_dtype != "auto":
            return self.compute_dtype
        if device == "cpu":
            return "float32"
        return "bfloat16" if bf16_supported else "float16"


class LoraSettings(Section):
    """One LoRA adapter on the shared backbone."""

    r: int = Field(16, gt=0)
    """LoRA rank: the adapter's capacity and number of trainable parameters. 16 is the usual starting point
    for LoRA fine-tuning.
    """
    alpha: float = Field(32.0, gt=0)
    """LoRA scaling: the adapter's output is multiplied by alpha / r. Twice the rank by default, the usual
    choice.
    """
    target_modules: Union[Literal["all-linear"], list[str]] = "all-linear"
    """Which linear layers get LoRA: `all-linear`, or a list of module names such as `[q_proj, v_proj]` (a name
    no module has is refused when the model loads, with the names there are). All of them by default, as QLoRA found adapting every layer works best. On an MoE model whose experts are
    fused 3-D weights (transformers 5), `all-linear` and a list both mean linear layers only (attention and
    any dense MLP or shared expert), not the experts or the router: see `target_parameters` (docs/models.md).
    """
    target_parameters: list[str] = []
    """3-D weight parameters to adapt as well, by name suffix, e.g. `[mlp.experts.gate_up_proj,
    mlp.experts.down_proj]` for fused MoE experts (PEFT's `target_parameters`). Empty by default: expert
    LoRA holds one rank-r adapter per expert and cannot share a forward with other roles (docs/models.md).
    """
    init_from: Optional[str] = None
    """A PEFT adapter folder to start from instead of a fresh LoRA, or a run folder (its `final/`
    adapter: a `lora-ppo train-sft` run's policy) or checkpoint folder; for the value adapter a
    `value_head.safetensors` beside it is loaded too. For the value adapter, `reward` starts it
    as a trainable copy of the reward adapter and its head (with `reward.kind: adapter`), which lowers the
    early value loss.
    """


class RewardAdapterSettings(LoraSettings):
    """The reward adapter `train-reward` trains: LoRA settings, plus dropout."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """LoRA dropout while the reward adapter trains (off when it scores): a regulariser against
    memorising a small preference set. PPO's adapters never use dropout (their ratios must start at
    exactly 1). An adapter from `init_from` keeps the dropout it was saved with.
    """


class AdaptersConfig(Section):
    """The LoRA adapters on the one backbone (LoRA dropout is always 0: the PPO ratio starts at 1)."""

    policy: LoraSettings = Field(LoraSettings())
    """The policy adapter: the one PPO trains."""
    value: LoraSettings = Field(LoraSettings())
    """The value adapter and its score head: the critic (GAE only; RLOO and GRPO create none)."""
    reference: str = "auto"
    """What the KL penalty compares the policy with. `auto`: the policy's `init_from` adapter, frozen, when
    there is one, else the base model with adapters disabled; `disable`: the bare base model; `none`: no
    reference at all (a KL-free run, one forward pass fewer per step); anything else: a PEFT adapter
    folder, loaded frozen. `auto` because a policy started from an adapter must stay near that adapter, not
    near the bare base model. A run folder (e.g. a `train-sft` run) stands for its `final/policy`.
    """

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


RewardKind = Literal["vader", "textblob", "function", "classifier", "math_answer", "exact_match", "adapter", "python",
                     "none"]
# What a source is called by default in the logs (objective/<name>): its kind, or its function's name.
VERIFIABLE_KINDS = ("math_answer", "exact_match")


class RewardSourceConfig(Section):
    """One source of reward."""

    kind: RewardKind = "vader"
    """`vader` / `textblob`: sentiment of the completion, in [-1, 1]; `function`: a Python function;
    `classifier`: a sequence-classification model; `adapter`: a reward adapter and score head on the
    policy's own backbone (no second model); `math_answer`: 1 when the completion's final answer (a
    `#### N` line, a `\\boxed{N}`, else its last number) equals the `answer_column` value as a number,
    else 0; `exact_match`: 1 when the completion equals the `answer_column` value (case and spacing
    ignored); `none`: 0 for every completion (an episode's rewards then come from its environment alone,
    `rollout.environment`). VADER by default: it needs no download and is the quickstart's task. `python` is written,
    never chosen: a run given `PPOTrainer(recipe, reward_fn=f)` with an `f` that has no importable name
    records it so (with `name`), and commands that score need `f` passed again from Python.
    """
    name: Optional[str] = None
    """What the source is called in the logs (`objective/<name>`); null: its kind (a function: its name)."""
    weight: float = 1.0
    """The source's weight in the total score (a negative weight makes it a penalty)."""
    normalize: bool = False
    """Scale the source's scores by a running mean and standard deviation over the run before weighting,
    so sources on different scales mix as the weights say.
    """
    function: Optional[str] = None
    """For `kind: function`: `package.module:function`, called as TRL calls reward functions:
    `f(prompts=..., completions=..., completion_ids=..., **columns)` with every other dataset column as a
    keyword (one value per completion); `f(prompts, completions)` works too. Imported only when `kind`
    is `function`.
    """
    answer_column: Optional[str] = None
    """For `math_answer` and `exact_match`: the dataset column holding the reference answer (a bare answer,
    or a worked solution ending in `#### N` as in GSM8K).
    """
    format_bonus: float = Field(0.0, ge=0.0)
    """For `math_answer`: added to the score when the completion marks its final answer as `#### N` or
    `\\boxed{N}`, right or wrong; 0 leaves the score the accuracy.
    """
    adapter: Optional[str] = None
    """For `kind: adapter`: a reward adapter folder (a PEFT adapter and its `reward_head.safetensors`), as
    `lora-ppo train-reward` writes it to `final/reward`, or that run's folder. It scores prompt + response at the last real
    token, frozen, on the policy's own 4-bit backbone.
    """
    model: Optional[str] = None
    """For `kind: classifier`: a Hugging Face sequence-classification model (folder or hub id). It keeps its
    own tokenizer; with a chat template it scores the conversation in it.
    """
    quantization: Optional[Quantization] = None
    """For `kind: classifier`: how its weights are stored (`4bit`, `8bit`, `none`); null: as the policy's
    (`model.quantization`). An 8B reward model in fp32 needs 32 GB; in 4-bit it fits beside the policy.
    """
    dtype: Optional[Literal["auto", "float32", "bfloat16", "float16"]] = None
    """For `kind: classifier`: its compute dtype; null: the policy's (`model.compute_dtype`)."""
    label: Optional[int] = None
    """For `kind: classifier`: which logit is the score; null: the last one (a reward model's only logit,
    or the positive class of a sentiment classifier).
    """
    batch_size: int = Field(16, gt=0)
    """Texts per classifier or reward-adapter forward pass."""
    max_length: int = Field(512, gt=0)
    """Classifier truncation length in tokens. Truncation drops the start of the text, never its end: the
    last token is the one a reward model scores.
    """

    @model_validator(mode="after")
    def _source_fields(self) -> "RewardSourceConfig":
        if self.kind == "function" and not self.function:
            raise ValueError("function is required when kind is 'function'")
        if self.kind == "function" and ":" not in (self.function or ""):
            raise ValueError(f"function must look like 'module:function', got {self.function!r}")
        if self.kind == "classifier" and not self.model:
            raise ValueError("model is required when kind is 'classifier'")
        if self.kind == "adapter" and not self.adapter:
            raise ValueError("adapter is required when kind is 'adapter'")
        if self.kind in VERIFIABLE_KINDS and not self.answer_column:
            raise ValueError(f"answer_column is required when kind is {self.kind!r}")
        if self.format_bonus and self.kind != "math_answer":
            raise ValueError(f"format_bonus applies to kind 'math_answer' only (kind is {self.kind!r})")
        return self

    @property
    def log_name(self) -> str:
        if self.name:
            return self.name
        return self.function.rpartition(":")[2] if self.kind == "function" else self.kind


class RewardConfig(RewardSourceConfig):
    """Where the score of a completion comes from: one source (the fields below), or a weighted mix of several."""

    sources: list[RewardSourceConfig] = []
    """Several sources, each with its own `kind`, fields, `weight` and `normalize`; the score is the
    weighted sum and each source is logged as `objective/<name>`. Empty: the single source above.
    """
    also_log: list[Literal["vader", "textblob"]] = []
    """Independent scores logged beside the reward, never optimised (`vader`, `textblob`), so reward hacking
    shows as a gap between the reward and them.
    """
    timeout_s: Optional[float] = Field(None, gt=0)
    """Seconds each reward source (and side metric) may take on one batch; past it the run stops with one
    line naming the function (the last checkpoint stays as it was). null: no limit. A function that calls a
    server or runs tests should have one: a hung call otherwise hangs the run.
    """

    @model_validator(mode="after")
    def _mix(self) -> "RewardConfig":
        if self.sources:
            # A field written out at its default (a run's resolved recipe.yaml) is not set beside them.
            beside = sorted(name for name in self.model_fields_set & set(RewardSourceConfig.model_fields)
                            if getattr(self, name) != RewardSourceConfig.model_fields[name].default)
            if beside:
                raise ValueError(f"{beside[0]}: with sources, set each source's fields in its entry of sources")
            names = [source.log_name for source in self.sources]
            repeated = sorted({n for n in names if names.count(n) > 1})
            if repeated:
                raise ValueError(f"sources: two sources are named {repeated[0]!r}; give one a `name`")
        clash = sorted({s.log_name for s in self.source_list()} & set(self.also_log))
        if clash:
            raise ValueError(f"also_log: {clash[0]!r} is also a reward source; name the source otherwise")
        if sum(s.kind == "adapter" for s in self.source_list()) > 1:
            raise ValueError("sources: one reward adapter at most shares the policy's backbone")
        return self

    def source_list(self) -> list[RewardSourceConfig]:
        """The sources of the score: `sources`, or this section as the one source."""
        if self.sources:
            return list(self.sources)
        fields = {name: getattr(self, name) for name in RewardSourceConfig.model_fields}
        return [RewardSourceConfig(**fields)]

    @property
    def adapter_path(self) -> Optional[str]:
        """The reward adapter a source scores with, if any (it lives on the policy's backbone)."""
        return next((s.adapter for s in self.source_list() if s.kind == "adapter"), None)


class DataConfig(Section):
    """The prompts: training rows, and held-out rows scored before and after training."""

    source: str = "builtin:movie_review_openers"
    """A local `.jsonl`, `.json`, `.csv`, `.parquet` or `.txt` file (one prompt a line, column `prompt`), a
    folder or glob of such files, a Hugging Face dataset id or dataset folder, or `builtin:<name>`
    (`movie_review_openers`, `arithmetic`). The default ships with the package.
    """
    name: Optional[str] = None
    """The dataset's config name, for datasets that have several (`main` for `openai/gsm8k`; the
    difficulty of `builtin:arithmetic`: `addsub1`, `add12`, `addsub12`, `add2`, `addsub2`, `addsub3`)."""
    revision: Optional[str] = None
    """A hub dataset's revision (branch, tag or commit), so a run can be repeated on the same data."""
    split: str = "train"
    """The split to read; slices select part of it: `train[:2000]`, `train[10%:]`."""
    prompt_column: str = "prompt"
    """The column holding the prompt: text, or a conversation (a list of `{role, content}` messages, the
    format of TRL's conversational datasets). Every other column reaches reward functions.
    """
    chat_template: bool = False
    """Wrap each text prompt as a user message in the tokenizer's chat template; off: text is given to the
    model as it is. Conversations always go through the chat template.
    """
    system_prompt: Optional[str] = Field(None, min_length=0)  # "" reads as none, as it always has
    """A system message put first in every prompt's conversation (conversations that have their own keep
    it). Text prompts take one only with `chat_template: true`.
    """
    max_prompt_tokens: int = Field(64, gt=0)
    """Longer prompts (counted after the chat template) are dropped and counted, so prompt length stays within
    what the memory plan assumed.
    """
    eval_source: Optional[str] = "auto"
    """Held-out prompts, in any form `source` takes; null: `eval_size` prompts are split off `source` instead
    (seeded, said in the log), at most a fifth of them (a warning says when that is fewer). `auto`: a builtin set's held-out companion
    (`builtin:movie_review_openers_heldout` for the default source), else the split off `source`, so a
    run on your data is never evaluated on another set.
    """
    eval_split: str = "train"
    """The split of `eval_source` (slices allowed, as for `split`)."""
    eval_name: Optional[str] = None
    """The config name of `eval_source`; null: `name` when `eval_source` is the same dataset as `source`,
    else none.
    """
    eval_size: int = Field(64, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """How many held-out prompts to evaluate on (fixed on resume when `eval_source` is null: it decides the training prompts)."""
    eval_batch_size: Optional[int] = Field(None, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Responses generated at once when evaluating; null: `rollout.batch_size`. Generation on CPU costs little
    more per step for more rows, so a larger batch evaluates faster.
    """
    eval_samples_per_prompt: int = Field(1, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Completions sampled per held-out prompt. The held-out score is the mean over prompts of each prompt's
    mean, so more samples lower the sampling noise of the before/after comparison.
    """


class RolloutConfig(Section):
    """Sampling the responses a PPO step learns from."""

    batch_size: int = Field(16, gt=0)
    """Responses per PPO step; must divide by `rollout.samples_per_prompt` and by `ppo.num_minibatches *
    ppo.grad_accum_steps`.
    """
    max_new_tokens: int = Field(24, gt=0)
    """The response length limit in tokens; with `data.max_prompt_tokens` it must fit the model's context
    (checked before the model loads).
    """
    temperature: float = Field(1.0, gt=0.0)
    """Sampling temperature; old and reference logprobs use the same one, so the PPO ratio starts at 1."""
    top_k: int = Field(0, ge=0)
    """Top-k sampling; 0: off. Logprobs are of the full tempered distribution, so top-k and top-p bias the KL
    estimate: both are off by default.
    """
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    """Nucleus sampling; 1.0: off (see `top_k` for why)."""
    stop_token: Optional[str] = "eos"
    """Where a response ends: `eos` (the tokenizer's eos token and every end token the model's generation config
    names, as `generate()` stops at them: an instruction model's end of turn, such as Gemma's `<end_of_turn>`, is
    often not the tokenizer's eos), any other token string (that token alone), or null (never stop early).
    """
    missing_eos_penalty: Optional[float] = None
    """Subtracted from the score of a response that never produced `stop_token` (before the `ppo` score
    shaping), so >= 0 (TRL's sign); needs a `stop_token`. null: no penalty.
    """
    forward_batch_size: Union[PositiveInt, Literal["auto"]] = 16
    """Sequences per forward pass when scoring a rollout (old and reference logprobs, values): trades memory
    for speed. With `score_roles_together` a forward holds this many rows per role scored. `auto`: the most
    (up to the batch) whose scoring fits the memory budget (`train.memory_budget_gb`).
    """
    score_roles_together: bool = True
    """Score the roles a rollout needs (reference, value, and the policy unless
    `logprobs_from_generation`) in one forward per micro-batch: the sequences repeated once per role,
    each copy under its own adapter, so every base weight is read and dequantized once for all (same
    numbers). A scoring forward then holds `forward_batch_size` x roles rows; off: one forward per role.
    """
    logprobs_from_generation: Union[bool, Literal["auto"]] = "auto"
    """Take the old logprobs from the logits generation computed (full vocabulary, at the sampling
    temperature) instead of re-scoring the responses: one forward pass fewer per step. In float32 the two
    agree to ~3e-5 (tested); in bf16/fp16 KV-cached decoding can drift further from a full forward. `auto`:
    on where the model computes in float32 (CPU, or `model.compute_dtype: float32`), off in bf16/fp16.
    """
    samples_per_prompt: int = Field(1, gt=0)
    """Responses sampled per prompt (consecutive rows); `batch_size` counts responses. RLOO and GRPO need at
    least 2.
    """
    seed_per_row: bool = False
    """Sample each response from a random stream of its own, seeded by the run's seed, the step and the
    response's row in the step's batch, instead of one stream for the batch: a step then samples the same
    responses whatever the number of processes (`--num-processes`) or the batch layout. Off: one stream
    (the run's seed), as most trainers do.
    """
    compile: Union[bool, Literal["auto"]] = Field("auto", json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Sample with a static KV cache and a decode step compiled once (torch.compile; CUDA graphs on a GPU)
    instead of transformers' `generate()`: the same sampling with a fraction of its per-token overhead,
    after a one-time compile of about a minute. `auto`: on for training on a CUDA GPU when the run decodes
    at least 2,000 token steps (`train.steps` x the response budget), off elsewhere, and for `eval` and
    `generate` (docs/performance.md has the measurements behind the rule). Where compiling fails,
    `generate()` takes over with one log line. The static KV cache stays held through every phase of a
    step (1.07 GB for the 8B recipe), as `lora-ppo estimate` counts: `false` where memory is what a run lacks.
    """
    environment: Optional[str] = None
    """Multi-turn episodes: `module:Factory` (or `path/file.py:Factory`), created per episode with the
    dataset row's columns; `reset()` gives the first messages, `step(assistant_message)` the next ones, a
    reward and whether the episode is done (docs/agents.md). null: one completion per prompt.
    """
    tools: list[str] = []
    """Python functions the policy may call, each `module:function` with type hints and a docstring: their
    JSON schemas go to the chat template (`tools=`), or into the system message where the template ignores
    them; calls are parsed from its completions and answered as `tool` messages. They run with your
    permissions (no sandbox).
    """
    max_turns: int = Field(1, gt=0)
    """Turns of the policy per episode (with `environment` or `tools`); an episode still going after them
    is counted as truncated (`episode/truncated_frac`), and when that is most episodes at the first step
    the log warns.
    """
    max_episode_tokens: Optional[int] = Field(None, gt=0)
    """The budget of an episode in tokens after the prompt (actions and observations); each turn writes at
    most `max_new_tokens`. null: `max_turns * max_new_tokens` plus what observations add, unbounded.
    """
    tool_timeout_s: Optional[float] = Field(10.0, gt=0.0)
    """Seconds a tool call may take before the model is told it timed out (the call is left running in the
    background); null: no limit.
    """

    def compiles_on(self, device_type: str, decode_steps: int) -> bool:
        """`compile` decided for a device type ("cuda", "cpu", ...) and the decode steps the job
        will take: `auto` is on for CUDA when there are enough of them to pay the compile back."""
        if self.compile != "auto":
            return bool(self.compile)
        return device_type == "cuda" and decode_steps >= AUTO_COMPILE_MIN_DECODE_STEPS

    @property
    def response_tokens(self) -> int:
        """The most tokens after the prompt: a response's `max_new_tokens`, or an episode's budget
        (without one, every turn's new tokens; observations come on top)."""
        if not self.episodic:
            return self.max_new_tokens
        return self.max_episode_tokens or self.max_turns * self.max_new_tokens

    @property
    def episodic(self) -> bool:
        """Whether a step plays multi-turn episodes (an environment or tools) instead of one completion."""
        return self.environment is not None or bool(self.tools)

    @model_validator(mode="after")
    def _episodes(self) -> "RolloutConfig":
        if self.max_turns > 1 and not self.episodic:
            raise ValueError(f"max_turns is {self.max_turns}, but nothing answers a turn: set rollout.environment "
                             "or rollout.tools")
        if self.max_episode_tokens is not None and not self.episodic:
            raise ValueError("max_episode_tokens needs rollout.environment or rollout.tools")
        return self


class PPOConfig(Section):
    """The update: advantages, KL penalty, score shaping, losses and optimizer."""

    advantage_estimator: Literal["gae", "rloo", "grpo"] = "gae"
    """`gae`: PPO with the value adapter as critic. `rloo` (leave-one-out baseline) and `grpo` ((R - group
    mean) / group std): critic-free over `rollout.samples_per_prompt` samples per prompt; no value adapter
    or score head is created.
    """
    num_epochs: int = Field(4, gt=0)
    """Passes over each rollout; 4 is PPO's usual value."""
    num_minibatches: int = Field(1, gt=0)
    """Optimizer steps per epoch."""
    grad_accum_steps: Union[PositiveInt, Literal["auto"]] = 1
    """Micro-batches per minibatch: less memory for the same update. `rollout.batch_size` must divide by
    `num_minibatches * grad_accum_steps`. `auto`: the fewest (the largest micro-batch) whose update fits the
    memory budget (`train.memory_budget_gb`); the run's log says what it chose and why.
    """
    update_roles_together: bool = False
    """Train the policy and the value (with a critic) in one forward and backward per micro-batch: the
    sequences twice, each copy under its own adapter, so every base weight is read and dequantized once
    for both (same numbers), but an update forward holds twice the micro-batch's rows. Off by default:
    on CPU it was no faster and held more memory (bench/README.md); off: one pass per role.
    """
    trim_padding: bool = Field(True, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Run each scoring and update micro-batch over the columns its rows use, with a minibatch's (or,
    scoring, the rollout's) rows ordered by length before they are split into micro-batches, instead of
    over the whole rollout's width (the longest prompt's left padding plus the longest response): padding
    is computed by every layer and thrown away. The same numbers for every real token (up to rounding where
    a matmul's shape changes); rows that fit one micro-batch are not reordered. `update/padding_frac` in
    `metrics.jsonl` says how much of the update's work was padding. Off: every micro-batch at the
    rollout's width, as before 2026-11-27.
    """
    packing: bool = Field(False, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Pack the rows of each scoring and update micro-batch back to back into sequences of at most the
    rollout's width, each row with its own positions from 0 and no attention across rows: a micro-batch
    holds `rollout.forward_batch_size` (scoring) or the update's micro-batch size of sequences. Short
    responses share a sequence, so less padding is computed than `trim_padding` leaves and fewer
    micro-batches can run, with no more tokens in one. The same numbers for every real token (up to
    rounding). Checked on a probe when the model loads: transformers masks packed rows apart from the
    positions alone, and a model whose attention does not is refused. Off by default until a GPU measures it.
    """
    compile_update: bool = Field(False, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Run the forward and backward of each of the update's decoder layers as one function compiled
    with `torch.compile` (gradient checkpointing, where on, around it), not op by op from Python: fewer
    kernel launches, where a GPU update below 8 rows a micro-batch spent half its time (bench/README.md).
    On CPU the same numbers as without it (Inductor rounds each intermediate as eager does; float32 sums
    can differ in the last bits), and no more memory. On a GPU in bfloat16 its logprobs round apart from
    the eager scoring pass's, past the self-check's limit, so the logprob_mismatch alarm fires
    (docs/performance.md). Compiling takes a while once per role at the first update (a failure logs one
    line and the update runs eager). Off by default: on a GPU its logprobs fail the bfloat16 self-check,
    and its speed there is not settled (docs/performance.md).
    """
    clip_eps: float = Field(0.2, gt=0.0)
    """Policy ratio clip: the objective ignores ratios beyond 1 ± clip_eps; 0.2 is PPO's standard value."""
    value_clip_eps: float = Field(0.2, gt=0.0)
    """Value clip around the rollout values (with `clip_value_loss`)."""
    vf_coef: float = Field(0.1, ge=0.0)
    """Value loss weight."""
    kl_coef: float = Field(0.05, ge=0.0)
    """KL penalty coefficient (the starting value when `target_kl` adapts it)."""
    kl_estimator: Literal["k1", "k2", "k3"] = "k1"
    """Per-token KL estimate (Schulman, "Approximating KL divergence"): `k1` = log(p/p_ref), unbiased, can be
    negative per token; `k2` = (log ratio)^2 / 2, >= 0, low variance, biased; `k3` = (r - 1) - log r,
    unbiased and >= 0.
    """
    kl_penalty: Literal["reward", "loss"] = "reward"
    """`reward`: -kl_coef * KL per token inside the reward (Ziegler et al.); `loss`: kl_coef * KL added to the
    policy loss (GRPO's placement, usually with `k3`).
    """
    target_kl: Optional[float] = Field(None, gt=0.0)
    """Adapt `kl_coef` toward this per-sequence KL (Ziegler et al. 2019): after each step kl_coef *= 1 +
    clip(KL/target - 1, -0.2, 0.2) * batch / kl_horizon. null: a fixed `kl_coef`.
    """
    kl_horizon: int = Field(10000, gt=0)
    """Samples over which the adaptive KL controller acts: a step moves `kl_coef` by at most 20% x batch /
    kl_horizon. Ziegler et al.'s 10000 suits thousands of steps; in a run of tens of steps it barely
    moves, and kl_horizon = batch lets each step move it by up to 20%.
    """
    kl_coef_min: Optional[float] = Field(None, gt=0.0)
    """The adaptive controller never lowers `kl_coef` below this (at most the starting `kl_coef`); null: no
    floor. In a short run the controller spends the first steps, while the KL is still under the target,
    lowering the coefficient, and then raises it too late to stop the KL overshooting; a floor at the
    starting value keeps the controller raising it only when the KL passes the target.
    """

    @model_validator(mode="after")
    def _kl_floor(self) -> "PPOConfig":
        if self.kl_coef_min is None:
            return self
        if self.target_kl is None:
            raise ValueError(f"kl_coef_min ({self.kl_coef_min:g}) has no effect without target_kl "
                             "(the adaptive controller): set both or neither")
        if self.kl_coef_min > self.kl_coef:
            raise ValueError(f"kl_coef_min ({self.kl_coef_min:g}) must not exceed kl_coef ({self.kl_coef:g}), "
                             "the coefficient the controller starts from")
        return self
    score_norm: bool = False
    """Normalise scores by a running mean and std over all steps so far. Score shaping runs in this order:
    normalisation, clipping, length penalty.
    """
    score_clip: Optional[float] = Field(None, gt=0.0)
    """Clip scores (after normalisation) to [-x, x]; null: no clipping."""
    length_penalty: float = 0.0
    """Subtracted from the score per response token."""
    gamma: float = Field(1.0, ge=0.0, le=1.0)
    """GAE discount; 1: the score, given once at the end, is not shrunk by response length."""
    lam: float = Field(0.95, ge=0.0, le=1.0)
    """GAE lambda: lower trusts the critic more. With a score only at the last token and a fresh critic, 1.0
    gives early tokens their full share of the score.
    """
    whiten_rewards: bool = False
    """Whiten per-token rewards (scale only; GAE only)."""
    whiten_advantages: bool = True
    """Whiten advantages over real tokens, so the step size does not depend on the reward's scale."""
    entropy_coef: float = Field(0.0, ge=0.0)
    """Entropy bonus weight."""
    clip_value_loss: bool = True
    """Clip the value loss around the rollout values, as PPO does; false: plain squared error."""
    dual_clip: Optional[float] = Field(None, gt=1.0)
    """Dual-clip PPO (Ye et al. 2020): the loss of a negative-advantage token is capped at -dual_clip * A
    (typically 3). null: off.
    """
    ratio_threshold: Optional[float] = Field(None, gt=1.0)
    """A minibatch whose mean ratio exceeds this is skipped or has its policy gradient scaled down
    (`ratio_threshold_action`). null: off.
    """
    ratio_threshold_action: Literal["skip", "scale"] = "skip"
    """`skip` the minibatch, or `scale` its policy gradient by threshold / ratio; the share is logged as
    `policy/skipped_minibatch_frac` or `policy/scaled_minibatch_frac`.
    """
    loss_aggregation: Literal["token", "sequence"] = "token"
    """`token`: every real token weighs the same; `sequence`: every response weighs the same (its tokens'
    mean). Either way micro-batches add up to the minibatch loss.
    """
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient norm clip, per adapter (policy; value adapter and head)."""
    learning_rate: float = Field(1e-4, gt=0.0)
    """AdamW learning rate of the policy adapter."""
    optimizer_state: Literal["device", "8bit", "cpu"] = "device"
    """Where AdamW keeps its two moments per trainable weight (8 bytes a weight in fp32: 2.15 GB for r=16
    policy and value adapters on a 32B model). `device`: fp32 beside the weights; `8bit`: bitsandbytes'
    blockwise 8-bit AdamW (about 2 bytes a weight; tensors under 4,096 elements stay 32-bit); `cpu`: fp32 in
    CPU memory, each optimizer step copying weights and gradients there and back (as ZeRO-Offload does).
    `device` by default: the exact, fastest choice where memory allows.
    """
    value_learning_rate: Optional[float] = Field(None, gt=0.0)
    """AdamW learning rate of the value adapter and head; null: `learning_rate`."""
    lr_schedule: Literal["constant", "linear"] = "constant"
    """`constant`, or `linear` decay to 0 over `train.steps`."""


class TrainConfig(Section):
    """The run: its length, seed, output folder, logging and checkpoints."""

    steps: int = Field(100, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """PPO steps, each one rollout and its update."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds python, numpy and torch, the prompt order and the evaluation samples; below 2^63, as
    torch.manual_seed requires.
    """
    output_dir: str = Field("runs/ppo", json_schema_extra=MAY_CHANGE_ON_RESUME)
    """The folder everything the run writes goes to (a run folder moved elsewhere resumes there)."""
    overwrite: bool = Field(False, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Start over in a folder that already holds a run: the old run is moved aside to
    `NAME.old-<date>-<time>`, never deleted. Off: such a folder is refused, so a run never displaces
    another by accident.
    """
    save_every: int = Field(0, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Save a full-state checkpoint to `checkpoints/step-N/` every N steps; 0: only at the end (to `final/`)
    and on Ctrl-C.
    """
    log_every: int = Field(1, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Print a log line every N steps when there is no progress bar."""
    sample_every: int = Field(10, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Write 4 samples to `samples.jsonl` every N steps and at the end; 0: never."""
    eval: bool = Field(True, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Score the held-out prompts before and after training."""
    keep_last: int = Field(3, ge=1, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Full-state checkpoints kept under `checkpoints/`; older ones are deleted."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field([], json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Trackers that receive every step's metrics, the resolved recipe as the run's config, and samples as
    a table (`tensorboard` writes to `output_dir/tensorboard`; `wandb` follows its own login or
    `WANDB_MODE=offline`; `trackio` writes locally). Each needs its extra: `pip install 'lora_ppo[wandb]'`.
    metrics.jsonl is written whatever this says.
    """
    memory_budget_gb: Optional[float] = Field(None, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """The memory (GB, the whole process: CUDA context included) that the recipe's `auto` sizes
    (`ppo.grad_accum_steps`, `rollout.forward_batch_size`, `model.gradient_checkpointing`,
    `model.offload_embeddings`) are chosen to fit, as `lora-ppo estimate --gpu-gb` chooses them. null: what
    the device has free when the run starts (on a GPU what this process may still allocate: a cap set with
    `set_per_process_memory_fraction` counts). The choice is written to the run's recipe.yaml; a resumed run
    keeps it.
    """
    max_consecutive_skips: int = Field(3, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Stop the run (with a checkpoint) after this many steps in a row whose update was skipped for a NaN/inf:
    one can be a fluke, several in a row mean the run has diverged.
    """


class Recipe(Section):
    """A whole recipe: the seven sections, and the checks that span fields."""

    model: ModelConfig = ModelConfig()
    adapters: AdaptersConfig = AdaptersConfig()
    reward: RewardConfig = RewardConfig()
    data: DataConfig = DataConfig()
    rollout: RolloutConfig = RolloutConfig()
    ppo: PPOConfig = PPOConfig()
    train: TrainConfig = TrainConfig()

    @model_validator(mode="after")
    def _cross_field_checks(self) -> "Recipe":
        k = self.rollout.samples_per_prompt
        if self.rollout.batch_size % k:
            raise ValueError(
                f"rollout.batch_size ({self.rollout.batch_size}) must be divisible by rollout.samples_per_prompt ({k})"
            )
        if self.ppo.advantage_estimator != "gae" and k < 2:
            raise ValueError(
                f"ppo.advantage_estimator {self.ppo.advantage_estimator!r} needs rollout.samples_per_prompt >= 2 (got {k})"
            )
        penalty = self.rollout.missing_eos_penalty
        if penalty is not None and penalty < 0:
            raise ValueError(
                f"rollout.missing_eos_penalty ({penalty}) is subtracted from the score of a response that never "
                f"stopped, so a negative one rewards it: give {-penalty} to penalize"
            )
        if penalty is not None and self.rollout.stop_token is None:
            raise ValueError(
                f"rollout.missing_eos_penalty ({penalty}) has no effect while rollout.stop_token is null: "
                "set a stop token or remove the penalty"
            )
        if self.model.dequantize_per_step is True and self.model.quantization != "4bit":
            raise ValueError(
                f"model.dequantize_per_step: needs model.quantization 4bit (got {self.model.quantization!r})"
            )
        if self.ppo.grad_accum_steps == AUTO:  # chosen later, among the divisors of the minibatch
            if self.rollout.batch_size % self.ppo.num_minibatches:
                raise ValueError(f"rollout.batch_size ({self.rollout.batch_size}) must be divisible by "
                                 f"ppo.num_minibatches ({self.ppo.num_minibatches})")
        elif self.rollout.batch_size % (self.ppo.num_minibatches * self.ppo.grad_accum_steps):
            raise ValueError(
                f"rollout.batch_size ({self.rollout.batch_size}) must be divisible by "
                f"ppo.num_minibatches * ppo.grad_accum_steps ({self.ppo.num_minibatches * self.ppo.grad_accum_steps})"
            )
        if self.uses_critic and self.adapters.value.init_from == "reward" and self.reward.adapter_path is None:
            raise ValueError("adapters.value.init_from: 'reward' starts the value from the reward adapter, "
                             "and this recipe has none (reward.kind: adapter)")
        return self

    @property
    def sequence_tokens(self) -> int:
        """The longest sequence a step holds: the prompt limit plus the response (or episode) budget."""
        return self.data.max_prompt_tokens + self.rollout.response_tokens

    @property
    def decode_steps(self) -> int:
        """Token steps a training run decodes at most (what `rollout.compile: auto` weighs its compile
        against)."""
        return self.train.steps * self.rollout.response_tokens

    @property
    def uses_critic(self) -> bool:
        """Whether a value adapter and score head exist (only for GAE)."""
        return self.ppo.advantage_estimator == "gae"

    @property
    def minibatch_size(self) -> int:
        return self.rollout.batch_size // self.ppo.num_minibatches

    def logprobs_from_generation_on(self, float32: bool) -> bool:
        """`rollout.logprobs_from_generation` decided: `auto` is on where computation runs in float32."""
        setting = self.rollout.logprobs_from_generation
        return float32 if setting == "auto" else setting

    def scored_roles(self, float32: bool) -> int:
        """Roles a rollout is scored as: the reference, the value, and the policy unless generation
        recorded its logprobs (computing in float32 or not decides `auto`)."""
        return (not self.logprobs_from_generation_on(float32)) + self.adapters.reference_enabled + self.uses_critic

    @property
    def micro_batch_size(self) -> int:
        if self.ppo.grad_accum_steps == AUTO:
            raise ValueError("ppo.grad_accum_steps is auto: choose the sizes first (estimate.with_auto_sizes)")
        return self.minibatch_size // self.ppo.grad_accum_steps

    @property
    def auto_sizes(self) -> list[str]:
        """The fields of AUTO_SIZES this recipe leaves to the memory plan."""
        return [path for path in AUTO_SIZES if field_value(self, path) == AUTO]

    def with_values(self, values: dict[str, Any]) -> "Recipe":
        """The recipe with fields set by dotted path (`{"ppo.grad_accum_steps": 2}`), validated again."""
        data = self.model_dump(mode="json")
        for path, value in values.items():
            *sections, name = path.split(".")
            node = data
            for section in sections:
                node = node[section]
            node[name] = value
        return type(self).model_validate(data)


# ---- the reward model's recipe (lora-ppo train-reward) --------------------------------------


class PreferenceDataConfig(Section):
    """Preference pairs: a prompt with a chosen and a rejected response (TRL's preference format)."""

    source: str = "data/preferences.jsonl"
    """Where the pairs are, in any form `data.source` of a PPO recipe takes (local files, a folder or glob
    of files, a Hugging Face dataset id or dataset folder).
    """
    name: Optional[str] = None
    """The dataset's config name, for datasets that have several."""
    revision: Optional[str] = None
    """A hub dataset's revision (branch, tag or commit)."""
    split: str = "train"
    """The split to read; slices select part of it: `train[:2000]`."""
    prompt_column: Optional[str] = "prompt"
    """The prompt (text or messages). A dataset without it has implicit prompts: `chosen` and
    `rejected` are whole conversations that share the prompt and differ in the last (assistant) turn.
    """
    chosen_column: str = "chosen"
    """The preferred response: text, or messages (the assistant turn last)."""
    rejected_column: str = "rejected"
    """The other response, in the same form."""
    margin_column: Optional[str] = None
    """A column with how much better `chosen` is; the loss becomes -log sigmoid(r_chosen - r_rejected -
    margin) (as in Llama 2's reward models). null: no margin.
    """
    chat_template: bool = False
    """Wrap text prompts in the tokenizer's chat template, as the PPO recipe that will use this reward
    model formats its prompts; conversations always go through it.
    """
    system_prompt: Optional[str] = Field(None, min_length=0)  # "" reads as none, as it always has
    """A system message first in every templated prompt, as in the PPO recipe."""
    max_length: int = Field(512, gt=0)
    """Longer pairs (prompt + response, in tokens) are dropped and counted."""
    eval_source: Optional[str] = None
    """Held-out pairs; null: `eval_size` pairs are split off `source` (seeded), at most a fifth of them
    (with a warning when that caps it).
    """
    eval_split: str = "test"
    """The split of `eval_source`."""
    eval_size: int = Field(256, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """How many held-out pairs to measure accuracy and margin on (fixed on resume when `eval_source` is null: it decides the training pairs)."""


class RewardTrainConfig(Section):
    """How long and how fast the reward adapter trains, and what the run writes."""

    epochs: int = Field(1, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Passes over the training pairs; one is the usual choice, as reward models overfit quickly."""
    batch_size: int = Field(8, gt=0)
    """Pairs per optimizer step."""
    grad_accum_steps: int = Field(1, gt=0)
    """Micro-batches per step (`batch_size` must divide by it): less memory for the same update."""
    learning_rate: float = Field(1e-4, gt=0.0)
    """AdamW learning rate of the reward adapter and its head."""
    lr_schedule: Literal["constant", "linear"] = "linear"
    """`linear`: decay to 0 over the run; `constant`."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping of the adapter and head together."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds the adapter's initial weights, the held-out split and the order of pairs."""
    output_dir: str = Field("runs/reward", json_schema_extra=MAY_CHANGE_ON_RESUME)
    """The folder everything the run writes goes to; the adapter ends in `final/reward` (a run folder moved
    elsewhere resumes there)."""
    overwrite: bool = Field(False, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Start over in a folder that already holds a run (the old run is moved aside, never deleted)."""
    eval_every: int = Field(50, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Measure held-out accuracy and margin every N steps (and before and after training); 0: only then."""
    save_every: int = Field(0, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Save a full-state checkpoint to `checkpoints/step-N/` every N steps; 0: only at the end."""
    keep_last: int = Field(3, ge=1, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Full-state checkpoints kept under `checkpoints/`."""
    log_every: int = Field(10, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Print a log line every N steps when there is no progress bar."""
    report_to: list[Literal["tensorboard", "wandb", "trackio"]] = Field([], json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Trackers that receive every step's metrics and the resolved recipe, as in a PPO recipe's
    `train.report_to`; metrics.jsonl is written whatever this says.
    """

    @model_validator(mode="after")
    def _accumulation(self) -> "RewardTrainConfig":
        check_accumulation(self.batch_size, self.grad_accum_steps)
        return self


def check_accumulation(batch_size: int, grad_accum_steps: int) -> None:
    """A step's batch splits into whole micro-batches."""
    if batch_size % grad_accum_steps:
        raise ValueError(f"batch_size ({batch_size}) must be divisible by grad_accum_steps ({grad_accum_steps})")


class RewardRecipe(Section):
    """A reward model's recipe: a reward LoRA adapter and head trained on preference pairs."""

    model: ModelConfig = ModelConfig()
    adapter: RewardAdapterSettings = RewardAdapterSettings()
    data: PreferenceDataConfig = PreferenceDataConfig()
    train: RewardTrainConfig = RewardTrainConfig()


# ---- the supervised stage's recipe (lora-ppo train-sft) -------------------------------------


class SFTAdapterSettings(LoraSettings):
    """The policy adapter `train-sft` trains: LoRA settings, plus dropout. A PPO recipe starts from it
    with `adapters.policy.init_from` (the run folder, or its `final/policy`)."""

    dropout: float = Field(0.0, ge=0.0, lt=1.0)
    """LoRA dropout while the adapter trains (off when it is evaluated or samples). PPO started from
    the adapter runs without any: its ratios must start at exactly 1.
    """


SFTFormat = Literal["auto", "text", "prompt_completion", "messages"]


class SFTDataConfig(Section):
    """Demonstrations in TRL's SFT formats: text, a prompt and its completion, or a conversation."""

    source: str = "data/sft.jsonl"
    """Where the rows are, in any form `data.source` of a PPO recipe takes (local files, a folder or glob
    of files, a Hugging Face dataset id or dataset folder, `builtin:<name>`).
    """
    name: Optional[str] = None
    """The dataset's config name, for datasets that have several."""
    revision: Optional[str] = None
    """A hub dataset's revision (branch, tag or commit)."""
    split: str = "train"
    """The split to read; slices select part of it: `train[:2000]`."""
    format: SFTFormat = "auto"
    """`text`: the `text_column`, trained on whole; `prompt_completion`: a prompt (text or messages) and its
    completion (text or assistant messages); `messages`: a conversation in the chat template. `auto`:
    the first of `messages`, `prompt_completion`, `text` whose columns the data has.
    """
    text_column: str = "text"
    """The column of `text` rows."""
    prompt_column: str = "prompt"
    """The prompt of `prompt_completion` rows: text, or messages (TRL's conversational prompt)."""
    completion_column: str = "completion"
    """The completion of `prompt_completion` rows: text, or assistant messages."""
    messages_column: str = "messages"
    """The conversation of `messages` rows: a list of `{role, content}` messages."""
    chat_template: bool = False
    """Wrap a text prompt and its completion as a user and an assistant turn in the tokenizer's chat
    template, as the PPO recipe that starts from this adapter formats its prompts (its
    `data.chat_template`); conversations always go through the template.
    """
    system_prompt: Optional[str] = Field(None, min_length=0)  # "" reads as none, as it always has
    """A system message first in every templated row (conversations that have one keep theirs), as in
    the PPO recipe.
    """
    max_length: int = Field(512, gt=0)
    """The longest row in tokens (chat template and stop token included); longer rows are handled as
    `too_long` says. It must fit the model's context.
    """
    too_long: Literal["drop", "truncate", "error"] = "drop"
    """A row longer than `max_length`: `drop` it, or `truncate` it to its first `max_length` tokens (either
    way counted and logged), or stop with an `error` naming the row. `drop` by default: a cut
    demonstration teaches the model to stop mid-answer, without its stop token.
    """
    eval_source: Optional[str] = None
    """Held-out rows; null: `eval_size` rows are split off `source` (seeded), at most a fifth of them."""
    eval_split: str = "test"
    """The split of `eval_source`."""
    eval_size: int = Field(64, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """How many held-out rows to measure the loss and perplexity on (fixed on resume when `eval_source` is null: it decides the training rows)."""
    eval_batch_size: int = Field(16, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Held-out rows per forward pass."""
    eval_samples: int = Field(8, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Held-out prompts whose greedy completion is written before and after training
    (`eval_before.jsonl`, `eval_after.jsonl`; `lora-ppo report` shows them). Text rows have no prompt.
    """
    eval_max_new_tokens: int = Field(64, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """The length limit of those completions in tokens."""


class SFTConfig(Section):
    """The supervised loss, and how a micro-batch's rows are laid out."""

    completion_only: bool = True
    """The loss on the completion (`prompt_completion` rows) or the assistant turns (conversations) only,
    as TRL's `completion_only_loss` and torchtune's `train_on_input: false`; false: on every token.
    Text rows are trained on whole either way. Assistant tokens are what the chat template marks with
    `{% generation %}` where it does, else what each assistant turn adds to the rendered conversation.
    """
    packing: bool = False
    """Pack each micro-batch's rows into as few sequences of at most `packing_length` tokens as fit
    (best-fit decreasing), each row with its own positions and no attention across rows: the same loss
    and gradients as padded rows, with less padding to compute. Checked on a probe when the model loads
    (transformers masks packed rows apart for `sdpa` and `eager` attention from the positions alone).
    """
    packing_length: Optional[int] = Field(None, gt=0)
    """The longest packed sequence in tokens (at least `data.max_length`); null: `data.max_length`."""


class SFTTrainConfig(RewardTrainConfig):
    """How long and how fast the adapter trains, and what the run writes (checkpoints, logging and
    trackers as `train-reward`'s)."""

    epochs: int = Field(1, gt=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Passes over the training rows."""
    batch_size: int = Field(8, gt=0)
    """Rows per optimizer step."""
    grad_accum_steps: int = Field(1, gt=0)
    """Micro-batches per step (`batch_size` must divide by it): less memory for the same update. The loss
    is summed over a step's target tokens and divided by their number, whatever the split.
    """
    learning_rate: float = Field(2e-4, gt=0.0)
    """AdamW learning rate of the adapter (a usual LoRA SFT value)."""
    max_grad_norm: float = Field(1.0, gt=0.0)
    """Gradient clipping of the adapter."""
    seed: int = Field(0, ge=0, lt=2**63)
    """Seeds the adapter's initial weights, the held-out split and the order of rows."""
    output_dir: str = Field("runs/sft", json_schema_extra=MAY_CHANGE_ON_RESUME)
    """The folder everything the run writes goes to; the adapter ends in `final/policy` (a run folder moved
    elsewhere resumes there)."""
    eval_every: int = Field(50, ge=0, json_schema_extra=MAY_CHANGE_ON_RESUME)
    """Measure the held-out loss every N steps (and before and after training); 0: only then."""


class SFTRecipe(Section):
    """A supervised stage's recipe: a policy LoRA adapter trained on demonstrations (the `sft` section
    marks it)."""

    model: ModelConfig = ModelConfig()
    adapter: SFTAdapterSettings = SFTAdapterSettings()
    data: SFTDataConfig = SFTDataConfig()
    sft: SFTConfig = SFTConfig()
    train: SFTTrainConfig = SFTTrainConfig()

    @model_validator(mode="after")
    def _packing_fits_a_row(self) -> "SFTRecipe":
        length = self.sft.packing_length
        if length is not None and length < self.data.max_length:
            raise ValueError(f"sft.packing_length ({length}) must be at least data.max_length ({self.data.max_length}): "
                             "a row that fits the one must fit the other")
        return self

    @property
    def packing_length(self) -> int:
        return self.sft.packing_length or self.data.max_length


def field_value(data: Any, path: str) -> Any:
    """The value at a dotted field path (`ppo.grad_accum_steps`) of a recipe, a section, or a
    recipe mapping (a run's recipe.yaml); None where a mapping lacks it."""
    value = data
    for name in path.split("."):
        value = value.get(name) if isinstance(value, dict) else getattr(value, name)
    return value


def nested_section(field: FieldInfo) -> Optional[type[Section]]:
    """The section model a field holds (e.g. `adapters.policy` holds LoraSettings), or None for a value."""
    annotation = field.annotation
    return annotation if isinstance(annotation, type) and issubclass(annotation, Section) else None


def _listed_section(field: FieldInfo) -> Optional[type[Section]]:
    """The section model of each entry of a list field (`reward.sources`), or None."""
    args = get_args(field.annotation)
    inner = args[0] if len(args) == 1 else None
    return inner if isinstance(inner, type) and issubclass(inner, Section) else None


def leaf_fields(model: type[Section], prefix: str = "") -> Iterator[tuple[str, FieldInfo]]:
    """Every value field under `model` with its dotted path (`ppo.clip_eps`, `adapters.policy.r`),
    in declaration order, walking into nested sections."""
    for name, field in model.model_fields.items():
        path = f"{prefix}.{name}" if prefix else name
        inner = nested_section(field)
        if inner is None:
            yield path, field
        else:
            yield from leaf_fields(inner, path)


def may_change_on_resume(field: FieldInfo) -> bool:
    """Whether a resumed run may set `field` differently from the run's recipe.yaml."""
    extra = field.json_schema_extra
    return isinstance(extra, dict) and extra.get("resume") == MAY_CHANGE_ON_RESUME["resume"]


def resume_allowed(schema: type[Section]) -> frozenset[str]:
    """The fields a resumed run of `schema` may change (those marked MAY_CHANGE_ON_RESUME)."""
    return frozenset(path for path, field in leaf_fields(schema) if may_change_on_resume(field))


RESUME_ALLOWED = resume_allowed(Recipe)


def _flatten(data: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(data, dict):
        return {prefix: data}
    out: dict[str, Any] = {}
    for key, value in data.items():
        out.update(_flatten(value, f"{prefix}.{key}" if prefix else str(key)))
    return out


def resume_differences(saved: dict[str, Any], recipe: Section) -> list[str]:
    """Field paths where `recipe` differs from the run's saved recipe and a resume is unsafe."""
    old, new = _flatten(saved), _flatten(recipe.model_dump(mode="json"))
    # A size left to the memory plan (`auto`) takes the value the run chose and recorded.
    changed = sorted(k for k in set(old) | set(new) if old.get(k, "<unset>") != new.get(k, "<unset>")
                     and not (k in AUTO_SIZES and new.get(k) == AUTO))
    allowed = resume_allowed(type(recipe))
    if _splits_held_out_rows(old) or _splits_held_out_rows(new):
        # Held-out rows split off data.source: how many decides which rows the run trains on.
        allowed = allowed - {"data.eval_size"}
    return [k for k in changed if k not in allowed]


def held_out_source(source: Optional[str], eval_source: Optional[str]) -> Optional[str]:
    """Where held-out rows come from: `eval_source`, with `auto` read as the builtin source's held-out
    companion, or None (split off the training source)."""
    return HELD_OUT_COMPANIONS.get(source) if eval_source == AUTO else eval_source


def _splits_held_out_rows(flat: dict[str, Any]) -> bool:
    """Whether a recipe (flattened) takes its held-out rows out of `data.source`."""
    return held_out_source(flat.get("data.source"), flat.get("data.eval_source")) is None


def _path_part(part: Any) -> str:
    # A key with a line break or other control character is quoted, so the error stays one line.
    text = str(part)
    return text if text and text.isprintable() and text.strip() == text else repr(text)


def _unknown_field(loc: tuple[Any, ...], schema: type[Section]) -> str:
    """`path: unknown field`, naming the known field at the same level that is closest in spelling."""
    path = ".".join(_path_part(p) for p in loc)
    model: Optional[type[Section]] = schema
    listed: Optional[type[Section]] = None  # the entry model after a list field, for the index that follows
    for part in loc[:-1]:
        if isinstance(part, int) and listed is not None:
            model, listed = listed, None
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        model = nested_section(field) if field is not None else None
        listed = _listed_section(field) if field is not None else None
        if model is None and listed is None:
            return f"{path}: unknown field (check the spelling)"
    if model is None:
        return f"{path}: unknown field (check the spelling)"
    name = loc[-1]
    close = difflib.get_close_matches(name, list(model.model_fields), n=1) if isinstance(name, str) else []
    if not close:
        return f"{path}: unknown field (check the spelling)"
    return f"{path}: unknown field (did you mean {'.'.join(str(p) for p in [*loc[:-1], close[0]])}?)"


def _union_members(errors: list[dict]) -> list[dict]:
    """The errors pydantic reports for one value that fits none of a Union field's types (e.g.
    `bool or 'auto'`): the same input at the same field, each loc ending in a member's tag. A tag
    like `literal['auto']` or `list[str]` is no field name, which tells these from two sibling
    fields that got the same bad value."""
    first = errors[0]
    members = [e for e in errors if len(e["loc"]) > 1 and e["loc"][:-1] == first["loc"][:-1]
               and e.get("input") == first.get("input")]
    tags = [str(e["loc"][-1]) for e in members]
    return members if len(set(tags)) > 1 and not all(tag.isidentifier() for tag in tags) else []


def _inside_a_member(errors: list[dict]) -> list[dict]:
    """A Union field's value that has one member's type but a bad part (`[q_proj, '']` for
    `'all-linear' or list[str]`): that member's error first, its tag left out of the loc (the value's
    type already says which member was meant), then the other fields' errors."""
    field, first_tag = errors[0]["loc"][:-1], (errors[0]["loc"] or (None,))[-1]
    if not isinstance(first_tag, str) or first_tag.isidentifier():
        return errors
    for e in errors[1:]:
        loc = e["loc"]
        tag = loc[len(field)] if len(loc) > len(field) + 1 and loc[:len(field)] == field else None
        if isinstance(tag, str) and not tag.isidentifier():  # a member's tag, not a list index or field
            others = [o for o in errors if o["loc"][:len(field)] != field]
            return [{**e, "loc": (*field, *loc[len(field) + 1:])}, *others]
    return errors


def _format_validation_error(err: ValidationError, schema: type[Section]) -> str:
    errors = _inside_a_member(err.errors())
    first = errors[0]
    path = ".".join(_path_part(p) for p in first["loc"])
    msg = first["msg"].removeprefix("Value error, ")
    members = _union_members(errors)
    if members:  # one line naming the field and every type it takes, not one line per member
        path = ".".join(_path_part(p) for p in first["loc"][:-1])
        kinds = [e["msg"].removeprefix("Input should be ").split(",")[0] for e in members]
        line = f"{path}: should be {' or '.join(kinds)} (got {first.get('input')!r})"
    elif first["type"] == "extra_forbidden":
        line = _unknown_field(tuple(first["loc"]), schema)
    elif first["type"] == "missing":
        line = f"{path}: required field is missing"
    elif first["type"] == "string_too_short":
        line = f"{path}: must not be empty"
    elif path and first["type"] == "value_error" and isinstance(first.get("input"), dict):
        line = f"{path}.{msg}"  # a section's own check, naming fields relative to the section
    elif path:
        line = f"{path}: {msg} (got {first.get('input')!r})"
    else:
        line = msg
    more = len(errors) - max(1, len(members))
    return line + (f" (and {more} more problem{'s' if more > 1 else ''})" if more else "")


def apply_overrides(data: dict[str, Any], overrides: list[str]) -> dict[str, Any]:
    """Apply `section.field=value` overrides; values are parsed as YAML (`3`, `true`, `[a, b]`).
    `~section.field` removes a field the recipe sets, so its default applies (e.g. `~reward.kind`
    before `reward.sources=[...]` turns a one-source recipe into a mix)."""
    for item in overrides:
        if item.startswith("~") and "=" not in item:
            parts = item[1:].strip().split(".")
            node = data
            for part in parts[:-1]:
                node = node.get(part) if isinstance(node, dict) else None
            if not isinstance(node, dict) or parts[-1] not in node:
                raise RecipeError(f"override {item!r}: the recipe does not set {item[1:]}")
            del node[parts[-1]]
            continue
        if "=" not in item:
            raise RecipeError(f"override {item!r}: expected key.path=value (or ~key.path to remove one)")
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


def recipe_from_dict(data: dict[str, Any], overrides: list[str] = (), schema: type[Section] = Recipe) -> Any:
    """Validate a recipe given as a dict (e.g. from Python), with optional overrides; `schema` is
    `Recipe` (PPO), `RewardRecipe` (train-reward) or `SFTRecipe` (train-sft)."""
    if not isinstance(data, dict):
        raise RecipeError(f"recipe: expected a mapping of sections, got {type(data).__name__}")
    import copy

    data = apply_overrides(copy.deepcopy(data), list(overrides))
    try:
        return schema.model_validate(data)
    except ValidationError as err:
        raise RecipeError(_format_validation_error(err, schema)) from None


def recipe_schema(data: dict[str, Any]) -> type[Section]:
    """Which recipe a mapping is: an SFT recipe has an `sft` section, a reward model's an `adapter`
    section (one adapter), a PPO recipe `adapters`."""
    if "sft" in data:
        return SFTRecipe
    return RewardRecipe if "adapter" in data and "adapters" not in data else Recipe


# Each kind of recipe, what it is called and the command that runs it, in the order a recipe that
# validates as several is taken (an SFT recipe without its `sft` section reads as a reward model's).
RECIPE_KINDS: dict[type[Section], tuple[str, str]] = {
    Recipe: ("a PPO recipe", "lora-ppo train"),
    RewardRecipe: ("a reward-model recipe", "lora-ppo train-reward"),
    SFTRecipe: ("an SFT recipe", "lora-ppo train-sft"),
}


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a mapping that names a key twice: PyYAML keeps the last one
    silently, so a section written twice (`ppo:` at the top, again at the bottom) lost the first's
    settings to their defaults."""

    def construct_mapping(self, node, deep=False):
        first_line: dict[Any, int] = {}
        for key_node, _ in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":  # `<<: *anchor`: its keys may be set again
                continue
            key = self.construct_object(key_node, deep=deep)
            try:
                seen = key in first_line
            except TypeError:  # an unhashable key: the base class refuses it
                continue
            if seen:
                raise yaml.constructor.ConstructorError(
                    problem=f"{key!r} is set twice, at lines {first_line[key] + 1} and {key_node.start_mark.line + 1} "
                            "(YAML would keep the last alone): keep one")
            first_line[key] = key_node.start_mark.line
        return super().construct_mapping(node, deep)


def as_recipe(recipe: Any, schema: type[Section], who: str) -> Any:
    """A trainer's recipe as given from Python: a validated `schema`, a dict of its sections
    (validated here) or a recipe file's path (read); anything else is a TypeError naming what it
    takes (it was an AttributeError about `model_copy`)."""
    if isinstance(recipe, schema):
        return recipe
    if isinstance(recipe, dict):
        return recipe_from_dict(recipe, schema=schema)
    if isinstance(recipe, (str, os.PathLike)):
        return load_recipe(recipe, schema=schema)
    raise TypeError(f"{who}: recipe must be a {schema.__name__}, a dict of its sections or a recipe file's path, "
                    f"got {type(recipe).__name__}")


def load_recipe(path: str | Path, overrides: list[str] = (), schema: Optional[type[Section]] = Recipe) -> Any:
    """Read and validate a YAML recipe file: a `Recipe`, the `schema` given, or with
    `schema=None` whichever the file is (`recipe_schema`)."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"recipe file not found: {path}") from None
    except (OSError, UnicodeDecodeError) as err:
        raise RecipeError(f"recipe file {path} cannot be read: {err}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 (a SafeLoader)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or "invalid YAML"
        raise RecipeError(f"recipe {path}: {problem}{where}") from None
    if data is None:
        data = {}
    detect = schema is None
    if detect:
        schema = recipe_schema(data) if isinstance(data, dict) else Recipe
    try:
        return recipe_from_dict(data, overrides, schema)
    except RecipeError:
        # A valid recipe of another kind: read as such when the kind was guessed, else say which
        # command takes it, not which fields are unknown.
        for other, (kind, command) in RECIPE_KINDS.items():
            if other is not schema and isinstance(data, dict) and _validates(data, overrides, other):
                if detect:
                    return recipe_from_dict(data, overrides, other)
                raise RecipeError(f"recipe {path}: {kind}; run it with {command}") from None
        raise


def _validates(data: dict[str, Any], overrides: list[str], schema: type[Section]) -> bool:
    try:
        recipe_from_dict(data, overrides, schema)
    except RecipeError:
        return False
    return True


# Fields that may name a local file or folder, by path in the recipe ("*": every list entry).
LOCAL_PATH_FIELDS = (
    "model.name", "data.source", "data.eval_source", "adapters.policy.init_from", "adapters.value.init_from",
    "adapters.reference", "adapter.init_from", "reward.adapter", "reward.model", "reward.sources.*.adapter",
    "reward.sources.*.model",
)
# Values of those fields that are words, not paths (a folder of that name does not change them).
PATH_KEYWORDS = {"", "auto", "disable", "none", "reward"}


def with_absolute_paths(recipe: Section, recipe_dir: Optional[Path] = None) -> Section:
    """The recipe with every local path it names (relative to the current folder, where it was
    found) made absolute, and a reward module found as a `.py` file there named by that file, so
    the run folder's recipe.yaml works from anywhere: `eval`, `generate`, `merge-and-export` and
    `--resume` from another folder. A reward module is also looked for beside the recipe file
    (`recipe_dir`). Hub ids and keywords stay as they are."""
    import glob

    data = recipe.model_dump(mode="json")

    def absolute(value: Any) -> Any:
        if (not isinstance(value, str) or value in PATH_KEYWORDS or value.startswith(BUILTIN_PREFIX)
                or Path(value).is_absolute()):
            return value
        if Path(value).expanduser().exists() or (any(c in value for c in "*?[") and glob.glob(value)):
            return str(Path.cwd() / Path(value).expanduser())  # "~/x" expands to an absolute path as it is
        return value

    def module_file(spec: Any) -> Any:
        # A reward module found as a file in the current folder (or beside the recipe) is
        # recorded by its path.
        module, colon, attr = spec.rpartition(":") if isinstance(spec, str) else ("", "", "")
        if colon and module.isidentifier():
            for folder in (Path.cwd(), recipe_dir):
                if folder is not None and (Path(folder) / f"{module}.py").is_file():
                    return f"{Path(folder).absolute() / module}.py:{attr}"
        return spec

    def walk(node: Any, keys: list[str], convert) -> None:
        if node is None or not keys:
            return
        key, rest = keys[0], keys[1:]
        items = list(enumerate(node)) if key == "*" and isinstance(node, list) else \
            [(key, node.get(key))] if isinstance(node, dict) and key in node else []
        for k, child in items:
            if rest:
                walk(child, rest, convert)
            else:
                node[k] = convert(child)

    for field in LOCAL_PATH_FIELDS:
        walk(data, field.split("."), absolute)
    for field in ("reward.function", "reward.sources.*.function", "rollout.environment", "rollout.tools.*"):
        walk(data, field.split("."), module_file)
    return type(recipe).model_validate(data)


def recipe_to_yaml(recipe: Section) -> str:
    """The fully resolved recipe (every default filled in) as YAML."""
    return yaml.safe_dump(recipe.model_dump(mode="json"), sort_keys=False)
