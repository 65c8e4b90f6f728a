"""Merge-and-export: turn a trained checkpoint into a standard Hugging Face model folder (policy
adapter merged into the base, checked for parity against adapter-on-base), or copy out one adapter.
"""

from __future__ import annotations

import gc
import json
import logging
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Literal, Optional

import torch

from lora_ppo.atomic import atomic_folder
from lora_ppo.data import trained_on_conversations
from lora_ppo.errors import RecipeError, first_line
from lora_ppo.library_notices import without_peft_rename_notice
from lora_ppo.model_card import MODEL_CARD_FILE, adapter_card, merged_card
from lora_ppo.parity import (
    ParityReport,
    ProbeReference,
    Tolerance,
    compare,
    probe_ids,
    reference_outputs,
    tolerance_for,
)
from lora_ppo.roles import HEAD_FILES as ROLE_HEAD_FILES
from lora_ppo.run_dir import Checkpoint, find_checkpoint

log = logging.getLogger(__name__)

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
AdapterName = Literal["policy", "value", "reward"]
BaseChoice = Literal["original", "dequantized"]
ADAPTERS: tuple[str, ...] = ("policy", "value", "reward")
BASES: tuple[str, ...] = ("original", "dequantized")
DTYPES: dict[str, torch.dtype] = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
DTYPE_ALIASES = {"float32": "fp32", "bfloat16": "bf16", "float16": "fp16"}
# Files an adapter carries beside its LoRA weights (a score head), checked and copied with it.
HEAD_FILES = {name: (file,) for name, file in ROLE_HEAD_FILES.items()}


class ExportError(RuntimeError):
    """The export could not be written (disk full, permissions); nothing was left at the output."""


class ParityError(RuntimeError):
    """The exported model does not reproduce the adapter-on-base model; nothing was written."""

    def __init__(self, message: str, report: ParityReport):
        super().__init__(message)
        self.report = report


def _read_json(path: Path):
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as err:
        raise RecipeError(f"corrupt checkpoint: {path} cannot be read ({first_line(err)})") from None


def _check_safetensors(path: Path) -> None:
    from safetensors.torch import load_file

    if not path.is_file():
        raise RecipeError(f"corrupt checkpoint: {path} is missing")
    try:
        tensors = load_file(str(path))
    except Exception as err:  # safetensors raises its own error type for a bad header or truncation
        raise RecipeError(f"corrupt checkpoint: {path} cannot be read ({first_line(err)})") from None
    bad = [name for name, t in tensors.items() if t.is_floating_point() and not torch.isfinite(t).all()]
    if bad:
        raise RecipeError(f"corrupt checkpoint: {path} holds non-finite values (in {bad[0]})")


def check_adapter(checkpoint: Checkpoint, name: str) -> Path:
    """Return the adapter folder `name` of a checkpoint after checking that it is complete and readable."""
    folder = checkpoint.adapter_dir(name)
    if not folder.is_dir():
        if name == "value":
            raise RecipeError(
                f"checkpoint {checkpoint.folder} has no value adapter (no value/ folder); "
                "critic-free runs (ppo.advantage_estimator rloo or grpo) save none"
            )
        if name == "reward":
            raise RecipeError(
                f"checkpoint {checkpoint.folder} has no reward adapter (no reward/ folder); reward-model runs "
                "(lora-ppo train-reward) and PPO runs with reward.kind: adapter have one"
            )
        if name == "policy" and checkpoint.adapter_dir("reward").is_dir():
            raise RecipeError(
                f"checkpoint {checkpoint.folder} is a reward-model run's (lora-ppo train-reward): it has a reward "
                "adapter, no policy; export it with --adapter reward --adapter-only"
            )
        raise RecipeError(f"corrupt checkpoint: {checkpoint.folder} has no {name}/ adapter folder")
    config = _read_json(folder / ADAPTER_CONFIG_FILE) if (folder / ADAPTER_CONFIG_FILE).is_file() else None
    if not isinstance(config, dict) or "peft_type" not in config:
        raise RecipeError(f"corrupt checkpoint: {folder} has no valid {ADAPTER_CONFIG_FILE}")
    _check_safetensors(folder / ADAPTER_WEIGHTS_FILE)
    for head in HEAD_FILES.get(name, ()):
        _check_safetensors(folder / head)
    return folder


# ---- options and the output folder ----------------------------------------------------------


def _dtype_name(dtype: str) -> str:
    name = DTYPE_ALIASES.get(str(dtype), str(dtype))
    if name not in DTYPES:
        raise RecipeError(f"dtype must be one of {', '.join(DTYPES)}, got {dtype!r}")
    return name


def _check_choice(value: str, choices: tuple[str, ...], what: str) -> str:
    if value not in choices:
        raise RecipeError(f"{what} must be one of {', '.join(choices)}, got {value!r}")
    return value


def _check_out(out: Path, checkpoint: Checkpoint, force: bool, model_name: str) -> Path:
    out = Path(out).expanduser()
    # Resolve the parent only: a link at `out` is replaced by the export, never followed.
    out = out.parent.resolve() / out.name

    def holds(folder: Path) -> bool:  # `out` is `folder` or above it, as named or where its link leads
        return any(o == folder or o in folder.parents for o in (out, out.resolve()))

    if holds(checkpoint.folder):
        raise RecipeError(f"out: {out} holds the checkpoint being exported; choose another folder")
    # Inside the run, an export would be copied, moved and resumed with the checkpoints it sits beside.
    run_root = checkpoint.run.root.resolve()
    if any(run_root == o or run_root in o.parents for o in (out, out.resolve())):
        raise RecipeError(f"out: {out} is inside the run folder {run_root}; export to a folder outside it")
    # Even with --force: the run's every later load (resume, eval, another export) would take the
    # merged model for its base, and the original weights would be gone.
    base = Path(model_name).expanduser()
    if base.is_dir() and holds(base.resolve()):
        raise RecipeError(f"out: {out} holds the base model the run trained on (model.name: {model_name}); "
                          "export to another folder")
    if out.exists() or out.is_symlink():
        if not force:
            raise RecipeError(f"out: {out} already exists; pass --force (force=True) to replace it")
    return out


# ---- merging ----------------------------------------------------------------------------------


@without_peft_rename_notice
def _load_adapter(base_model, folder: Path, model_name: str):
    """The policy adapter on `base_model`, frozen, as PEFT loads it for inference."""
    from peft import PeftModel

    from lora_ppo.bnb_workarounds import eval_on_training_kernel

    try:
        model = PeftModel.from_pretrained(base_model, str(folder), adapter_name="policy", is_trainable=False)
    except (ValueError, RuntimeError, KeyError, OSError) as err:
        raise RecipeError(f"checkpoint {folder}: the adapter does not fit the base model {model_name!r}: "
                          f"{first_line(err)}") from None
    # The reference must be what trained: bitsandbytes' inference kernel rounds differently.
    return eval_on_training_kernel(model)


def _merge(peft_model):
    """Fold the adapter into the base weights; returns the plain transformers model."""
    return peft_model.merge_and_unload(safe_merge=True)


def _release() -> None:
    from lora_ppo.devices import empty_cache

    gc.collect()
    empty_cache()


def _merged_model(recipe, adapter_dir: Path, base: str, prompts: list[torch.Tensor], verify: bool):
    """(merged model in fp32, reference outputs or None, reference description, reference dtype)."""
    from lora_ppo.model import load_base_model
    from lora_ppo.quantization import compute_dtype

    cfg = recipe.model
    if base == "original":
        # The original weights, unquantized and in fp32 whatever the training compute dtype:
        # the merge W + s*B@A then loses nothing before the final cast to the export dtype.
        unquantized = cfg.model_copy(update={"quantization": "none", "compute_dtype": "float32"})
        model = _load_adapter(load_base_model(unquantized), adapter_dir, cfg.name)
        refs = reference_outputs(model, prompts) if verify else None
        return _merge(model), refs, "policy adapter on the original fp32 base", torch.float32

    # The 4-bit base the adapter was trained against: it is the parity reference, and its
    # dequantized weights (the exact values training computed with) are what the adapter is merged into.
    model = _load_adapter(load_base_model(cfg), adapter_dir, cfg.name)
    ref_dtype = compute_dtype(cfg)
    refs = reference_outputs(model, prompts) if verify else None
    quantized = model.unload()
    del model
    dequantized = quantized.dequantize(dtype=torch.float32).to(torch.float32)
    merged = _merge(_load_adapter(dequantized, adapter_dir, cfg.name))
    description = f"policy adapter on the {cfg.quantization} base ({str(ref_dtype).removeprefix('torch.')} compute)"
    return merged, refs, description, ref_dtype


# ---- the entry point --------------------------------------------------------------------------


@dataclass(frozen=True)
class ExportReport:
    """What was exported where. `parity` checks the exported files; `merge_parity` the merged fp32
    weights before a cast to bf16/fp16. Both are None for adapter-only exports and verify=False."""

    out: Path
    checkpoint: Path
    adapter: str
    kind: Literal["merged", "adapter"]
    base: Optional[str]
    dtype: Optional[str]
    parity: Optional[ParityReport]
    files: tuple[str, ...]
    merge_parity: Optional[ParityReport] = None

    def format(self) -> str:
        lines = []
        if self.merge_parity is not None:
            lines.append(self.merge_parity.format())
        if self.kind == "merged":
            lines.append(self.parity.format() if self.parity else "parity: skipped (--no-verify)")
            lines.append(f"exported the {self.adapter} adapter merged into the {self.base} base "
                         f"({self.dtype}) to {self.out}")
        else:
            lines.append(f"exported the {self.adapter} adapter ({', '.join(self.files)}) to {self.out}")
        return "\n".join(lines)


def merge_and_export(
    source: str | Path,
    out: str | Path,
    dtype: str = "fp32",
    base: BaseChoice = "original",
    adapter: AdapterName = "policy",
    verify: bool = True,
    force: bool = False,
    adapter_only: bool = False,
) -> ExportReport:
    """Export a trained checkpoint as a Hugging Face model folder, or one adapter as a PEFT folder.

    Args:
        source: a run folder (its final/ checkpoint is used) or a checkpoint folder (one that
            holds manifest.json: final/ or checkpoints/step-N/).
        out: the folder to create. Everything is written to a temporary folder beside it and
            renamed at the end, so `out` is either complete or untouched.
        dtype: "fp32", "bf16" or "fp16": the merged weights' dtype (merging itself is in fp32).
        base: "original" merges into the base reloaded unquantized from its original weights;
            "dequantized" merges into the dequantized 4-bit weights the adapter was trained on.
        adapter: "policy" (the only one that can be merged), or "value" with adapter_only.
        verify: run the parity check (exported model vs adapter-on-base) before publishing.
        force: replace an existing `out`.
        adapter_only: copy the adapter folder (with its score head, for value and reward) instead of merging.
    Raises:
        RecipeError: bad options or a missing/corrupt checkpoint (nothing written).
        ParityError: the merged model failed the parity check (nothing written).
        ExportError: the output could not be written (nothing left at `out`).
    """
    from lora_ppo.config import load_recipe

    adapter = _check_choice(adapter, ADAPTERS, "adapter")
    base = _check_choice(base, BASES, "base")
    dtype = _dtype_name(dtype)
    if adapter != "policy" and not adapter_only:
        raise RecipeError(
            f"only the policy adapter can be merged into a causal LM; export the {adapter} adapter "
            "with --adapter-only (adapter_only=True)"
        )
    checkpoint = find_checkpoint(source)
    adapter_dir = check_adapter(checkpoint, adapter)
    recipe = load_recipe(checkpoint.run.recipe, schema=None)  # a PPO or a reward-model run
    out = _check_out(Path(out), checkpoint, force, recipe.model.name)
    if not adapter_only and base == "dequantized" and recipe.model.quantization == "none":
        raise RecipeError("base=dequantized: this run trained on unquantized weights "
                          "(model.quantization: none); use base=original")

    if adapter_only:
        return _export_adapter(checkpoint, recipe, adapter, adapter_dir, out)
    return _export_merged(checkpoint, recipe, adapter_dir, out, dtype, base, verify)


def _export_adapter(checkpoint: Checkpoint, recipe, adapter: str, adapter_dir: Path, out: Path) -> ExportReport:
    files = sorted(p.name for p in adapter_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    card = adapter_card(checkpoint, recipe, adapter)
    try:
        with atomic_folder(out) as staging:
            for name in files:
                shutil.copyfile(adapter_dir / name, staging / name)
            if MODEL_CARD_FILE not in files:
                card.save(staging / MODEL_CARD_FILE)
    except OSError as err:
        raise _write_error(out, err) from None
    return ExportReport(out=out, checkpoint=checkpoint.folder, adapter=adapter, kind="adapter", base=None,
                        dtype=None, parity=None, files=tuple(sorted(set(files) | {MODEL_CARD_FILE})))


def _export_merged(checkpoint: Checkpoint, recipe, adapter_dir: Path, out: Path, dtype: str, base: str,
                   verify: bool) -> ExportReport:
    from safetensors import SafetensorError

    from lora_ppo.model import load_tokenizer

    torch_dtype = DTYPES[dtype]
    tokenizer = load_tokenizer(recipe.model)
    conversational = trained_on_conversations(recipe.data)
    prompts = probe_ids(tokenizer, recipe.data, conversational)
    log.info("merging %s into the %s base (%s)", adapter_dir, base, recipe.model.name)
    merged, refs, ref_description, ref_dtype = _merged_model(recipe, adapter_dir, base, prompts, verify)
    merge_parity = None
    if verify and torch_dtype != torch.float32:
        # The low-precision limits are too loose to catch a subtly wrong merge, so the merged fp32
        # weights are checked at the reference's own precision before the cast.
        merge_parity = compare(merged, refs, tolerance_for(torch.float32, ref_dtype), ref_description,
                               "merged fp32 weights (before the cast)")
        _raise_if_failed(merge_parity, out)
    merged = merged.to(torch_dtype)
    merged.requires_grad_(False)

    parity = None
    try:
        with atomic_folder(out) as staging:
            merged.save_pretrained(str(staging))
            tokenizer.save_pretrained(str(staging))
            del merged
            _release()
            if verify:
                # Check the files as written, before they are published: the staging folder is
                # loaded back exactly as a user would load the export.
                parity = _check_written(staging, recipe, prompts, refs, dtype,
                                        tolerance_for(torch_dtype, ref_dtype), ref_description, conversational)
                _raise_if_failed(parity, out)
            merged_card(checkpoint, recipe, base, dtype, parity, merge_parity).save(staging / MODEL_CARD_FILE)
    except (OSError, SafetensorError) as err:
        raise _write_error(out, err) from None
    files = tuple(sorted(p.name for p in out.iterdir()))
    return ExportReport(out=out, checkpoint=checkpoint.folder, adapter="policy", kind="merged", base=base,
                        dtype=dtype, parity=parity, files=files, merge_parity=merge_parity)


def _check_written(folder: Path, recipe, prompts: list[torch.Tensor], refs: list[ProbeReference], dtype: str,
                   tolerance: Tolerance, ref_description: str, conversational: bool) -> ParityReport:
    """Load the exported model and tokenizer from `folder` and compare them with the reference."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from lora_ppo.devices import device_map
    from lora_ppo.model import pass_template_variables

    log.info("parity check on %d probe prompts", len(prompts))
    trust = recipe.model.trust_remote_code
    exported = AutoModelForCausalLM.from_pretrained(
        str(folder), dtype=DTYPES[dtype], device_map=device_map(),
        use_safetensors=True, trust_remote_code=trust,
    )
    exported.eval()
    exported_tok = AutoTokenizer.from_pretrained(str(folder), trust_remote_code=trust)
    if recipe.model.chat_template_kwargs:  # rendered as the run rendered its prompts (the card says how)
        pass_template_variables(exported_tok, recipe.model.chat_template_kwargs)
    same_ids = all(torch.equal(a, b) for a, b in zip(prompts, probe_ids(exported_tok, recipe.data, conversational)))
    parity = compare(exported, refs, tolerance, ref_description, f"exported {dtype} model", same_ids)
    del exported
    _release()
    return parity


def _write_error(out: Path, err: Exception) -> ExportError:
    return ExportError(f"cannot write the export to {out}: {getattr(err, 'strerror', None) or first_line(err)}")


def _raise_if_failed(parity: ParityReport, out: Path) -> None:
    if not parity.passed:
        raise ParityError(
            f"parity check failed, {parity.exported} vs {parity.reference}: "
            f"{'; '.join(parity.failures())}; nothing was written to {out}",
            parity,
        )
