"""The sizes a recipe leaves `auto` (micro-batch, scoring batch, gradient checkpointing, and with
them the dequantized copy), chosen for a run's memory budget by the estimate's memory plan, or
taken from the run's recipe.yaml when it resumes: what a run records is what it ran with. And
where generation looks tokens up when the embeddings are kept in CPU memory, as the same plan says."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Optional

import torch

from lora_ppo.config import AUTO, Recipe, field_value
from lora_ppo.devices import device, device_type
from lora_ppo.distributed import World
from lora_ppo.errors import RecipeError
from lora_ppo.estimate import GB, RUNTIME_BYTES, choose_auto_sizes, estimate, faster_update_budget, recipe_shapes
from lora_ppo.model import CpuEmbedding, free_memory_bytes
from lora_ppo.model_shape import ModelShape
from lora_ppo.run_dir import RunDir, find_run_root

log = logging.getLogger(__name__)

# What the plan decides of the dequantized copy, where model.dequantize_per_step is `auto`.
DEQUANTIZED_COPY = ("model.dequantize_per_step", "model.dequantize_budget_gb")


def with_auto_sizes(recipe: Recipe, resume: Optional[str | Path], world: World) -> Recipe:
    """The recipe with the sizes it leaves `auto` chosen by the memory plan for the budget
    (train.memory_budget_gb, else the device's free memory, the least of every process's), or,
    resuming, as the run chose and recorded them. The choice and its reasons go to the log."""
    if not recipe.auto_sizes:
        return recipe
    saved = saved_run_recipe(recipe, resume)
    if saved is not None:
        recorded = {path: field_value(saved, path) for path in recipe.auto_sizes}
        if all(value not in (None, AUTO) for value in recorded.values()):
            if recipe.model.dequantize_per_step == AUTO and \
                    field_value(saved, "model.dequantize_per_step") not in (None, AUTO):
                recorded |= {path: field_value(saved, path) for path in DEQUANTIZED_COPY}  # the copy planned for
            return recipe.with_values(recorded)
    kind = "cpu" if device_type() == "cpu" else "cuda"
    budget_gb, source = recipe.train.memory_budget_gb, "train.memory_budget_gb"
    if budget_gb is None:
        free = world.gather(free_memory_bytes(device()))
        if None not in free:
            budget_gb, source = budget_from_free(min(free), kind), "free on the device now"
    shape, classifiers = recipe_shapes(recipe)
    planned, choices = choose_auto_sizes(shape, recipe, kind, budget_gb, world.size, classifiers)
    where = "no budget known" if budget_gb is None else f"{budget_gb:.1f} GB, {source}"
    if world.is_main:
        faster = None if budget_gb is None else \
            faster_update_budget(shape, recipe, kind, budget_gb, world.size, classifiers)
        log.info("auto sizes for %s: %s%s", where, "; ".join(str(choice) for choice in choices),
                 f" (from {faster[0]:g} GB the update would run {faster[1]})" if faster else "")
    return planned


def budget_from_free(free_bytes: int, kind: str) -> float:
    """The budget (GB) a plan gets from what the device has free: what tensors may take, and the
    process's fixed cost the estimate counts (RUNTIME_BYTES)."""
    return (free_bytes + RUNTIME_BYTES[kind]) / GB


def stage_embeddings_as_planned(model: torch.nn.Module, recipe: Recipe, processes: int = 1) -> None:
    """With the embeddings in CPU memory on a GPU: generation copies the table to the device for
    its lookups where the memory plan finds room (generation's peak with it at or under scoring's
    and the update's, so the run's peak stays the plan's); else each decoded token waits to reach
    the host for its lookup (a third of the tokens/s: bench/README.md)."""
    embedding = model.get_input_embeddings()
    if not isinstance(embedding, CpuEmbedding) or embedding.out_device.type == "cpu":
        return
    try:
        plan = estimate(ModelShape.from_config(model.config), recipe, "cuda", processes=processes,
                        propose_levers=False)
    except RecipeError as error:  # a model type the plan cannot count: the lookups stay on the host
        log.info("model.offload_embeddings: generation looks tokens up in CPU memory (%s)", error)
        return
    embedding.staged_for_generation = plan.embeddings_staged
    table = plan.host["embeddings"] / GB
    if plan.embeddings_staged:
        log.info("model.offload_embeddings: generation looks tokens up in a copy of the table on the GPU "
                 "(%.2f GB; generation's peak with it, %.2f GB, stays within the plan's %.2f GB)",
                 table, plan.phases["generate"] / GB, plan.peak / GB)
    else:
        log.info("model.offload_embeddings: generation looks tokens up in CPU memory (a %.2f GB copy on the GPU "
                 "would take generation's peak above scoring's and the update's)", table)


def saved_run_recipe(recipe: Recipe, resume: Optional[str | Path]) -> Optional[dict]:
    """The recipe.yaml of the run a resume continues (None for a new run, or none found)."""
    if resume is None:
        return None
    root = recipe.train.output_dir if str(resume) == "auto" else find_run_root(Path(resume))
    path = None if root is None else RunDir(root).recipe
    if path is None or not path.is_file():
        return None
    import yaml

    try:
        saved = yaml.safe_load(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return None  # resolve_resume says what is wrong with it
    return saved if isinstance(saved, dict) else None
