"""The model card (README.md) of an export: Hugging Face metadata (base model, library, tags),
then how the weights were made, how to load them, the training summary and the recipe.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Optional

from huggingface_hub import ModelCard, ModelCardData
from huggingface_hub.utils import HFValidationError, validate_repo_id

from lora_ppo.builtin_model import BUILTIN_MODELS
from lora_ppo.config import BUILTIN_PREFIX, SFTRecipe
from lora_ppo.parity import ParityReport
from lora_ppo.roles import HEAD_FILES
from lora_ppo.run_dir import Checkpoint

MODEL_CARD_FILE = "README.md"
TAGS = ("lora_ppo", "ppo", "rlhf")


def base_model_id(name: str) -> Optional[str]:
    """The hub id a card names as base_model for the recipe's `model.name`: a builtin model's
    source, the name itself when it is a hub id, None for a local folder."""
    if name.startswith(BUILTIN_PREFIX):
        builtin = BUILTIN_MODELS.get(name.removeprefix(BUILTIN_PREFIX))
        return builtin.hub_id if builtin else None
    if name.startswith((".", "/", "~")) or Path(name).exists():
        return None
    try:
        validate_repo_id(name)
    except HFValidationError:
        return None
    return name


def merged_card(checkpoint: Checkpoint, recipe, base: str, dtype: str, parity: Optional[ParityReport],
                merge_parity: Optional[ParityReport] = None) -> ModelCard:
    """The card of a merged export: the policy adapter folded into the `base` base, saved as `dtype`."""
    into = ("the original, unquantized base weights" if base == "original" else
            f"the dequantized {recipe.model.quantization} base weights the adapter was trained against")
    what = [
        f"The `policy` LoRA adapter from checkpoint `{checkpoint.label}`{_step(checkpoint)} of a lora_ppo run, "
        f"merged into {into}, saved as {dtype}.",
        "",
        *_base_model_lines(recipe.model.name),
        f"- Merged into: {base} base",
        f"- Weights dtype: {dtype}",
    ]
    if parity is None:
        what.append("- Parity check: skipped (--no-verify)")
    else:
        tol = parity.tolerance
        what.append(
            f"- Parity check: passed against the {parity.reference} on {parity.n_prompts} probe prompts "
            f"(mean KL <= {tol.max_kl:g}, max |logit diff| <= {tol.max_logit_diff:g}, "
            f"greedy agreement >= {tol.min_greedy_agreement:.0%})"
            + (", and the merged fp32 weights passed before the cast" if merge_parity else "")
        )
    use = [
        "from transformers import AutoModelForCausalLM, AutoTokenizer",
        "",
        'model = AutoModelForCausalLM.from_pretrained("path/to/this/folder")',
        'tokenizer = AutoTokenizer.from_pretrained("path/to/this/folder")',
    ]
    if recipe.model.chat_template_kwargs:
        use += [
            "",
            "# trained on prompts its chat template rendered with these variables (model.chat_template_kwargs)",
            "text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False,",
            f"                                     **{recipe.model.chat_template_kwargs!r})",
        ]
    return _card(checkpoint, recipe, "transformers", f"# {_stage(recipe)}-trained policy, merged", what, use)


def adapter_card(checkpoint: Checkpoint, recipe, adapter: str) -> ModelCard:
    """The card of an adapter-only export: the PEFT folder of `adapter` (with its head, if any)."""
    name = recipe.model.name
    head_file = HEAD_FILES.get(adapter)
    head = f" with its score head (`{head_file}`: `nn.Linear(hidden, 1)` on the last hidden state)" if head_file else ""
    what = [
        f"The `{adapter}` LoRA adapter{head} from checkpoint `{checkpoint.label}`{_step(checkpoint)} "
        "of a lora_ppo run.",
        "",
        *_base_model_lines(name, f" (trained on its {recipe.model.quantization} weights)"),
    ]
    builtin = name.startswith(BUILTIN_PREFIX)
    # A builtin name is not a hub id: lora_ppo resolves it to a local folder.
    base_ref = f'resolve_model_path("{name}")' if builtin else f'"{name}"'
    use = [
        "from peft import PeftModel",
        "from transformers import AutoModelForCausalLM",
        *(["from lora_ppo.model import resolve_model_path"] if builtin else []),
        "",
        f"base = AutoModelForCausalLM.from_pretrained({base_ref})",
        'model = PeftModel.from_pretrained(base, "path/to/this/folder")',
    ]
    if head_file:
        read = ("values = head(hidden).squeeze(-1)  # [B, T]: the value of each position" if adapter == "value" else
                "score = head(hidden[:, -1]).squeeze(-1)  # [B]: at the last token (no padding here)")
        use += [
            "",
            "# the score head on the decoder's last hidden state",
            "import torch",
            "from safetensors.torch import load_file",
            "",
            "head = torch.nn.Linear(base.config.hidden_size, 1)",
            f'head.load_state_dict(load_file("path/to/this/folder/{head_file}"))',
            "hidden = model.get_base_model().get_decoder()(input_ids).last_hidden_state",
            read,
        ]
    trained = "reward" if adapter == "reward" else f"{_stage(recipe)}-trained {adapter}"
    return _card(checkpoint, recipe, "peft", f"# {trained} adapter", what, use)


def _stage(recipe) -> str:
    """What trained a policy adapter: supervised fine-tuning (`train-sft`) or PPO."""
    return "SFT" if isinstance(recipe, SFTRecipe) else "PPO"


def _card(checkpoint: Checkpoint, recipe, library: str, title: str, what: list[str],
          use: list[str]) -> ModelCard:
    """Metadata header plus the body. Deterministic (no dates, no measured numbers that could vary
    between runs), so re-exports are byte-identical."""
    data = ModelCardData(base_model=base_model_id(recipe.model.name), library_name=library, tags=list(TAGS))
    recipe_text = checkpoint.run.recipe.read_text(encoding="utf-8").rstrip("\n")
    body = [title, "", *what, "", "## Use", "", "```python", *use, "```", "",
            "## Training summary", "", *_summary_lines(checkpoint.summary()), "",
            "## Recipe", "", "```yaml", recipe_text, "```", ""]
    return ModelCard("\n".join(["---", data.to_yaml(), "---", "", *body]))


def _step(checkpoint: Checkpoint) -> str:
    return f" (step {checkpoint.step})" if checkpoint.step is not None else ""


def _base_model_lines(name: str, note: str = "") -> list[str]:
    lines = [f"- Base model: `{name}`{note}"]
    builtin = BUILTIN_MODELS.get(name.removeprefix(BUILTIN_PREFIX)) if name.startswith(BUILTIN_PREFIX) else None
    if builtin is not None:
        # The builtin weights are a quantized file's, so they differ slightly from the hub's.
        lines.append(f"- Converted from: `{builtin.filename}` in the `{builtin.distribution}` package, "
                     f"a quantized copy of `{builtin.hub_id}`")
    return lines


def _summary_lines(summary: Optional[dict]) -> list[str]:
    if summary is None:
        return ["No summary.json: the run had not finished when this checkpoint was saved."]
    lines = ["| metric | value |", "|---|---|"]
    for key, value in summary.items():
        shown = f"{value:.4g}" if isinstance(value, float) else json.dumps(value)
        lines.append(f"| {key} | {shown} |")
    return lines
