"""The memory-plan table of docs/memory.md: what `lora-ppo estimate` predicts for common models on 8, 12,
16 and 24 GB cards, at recipes/single_gpu_8b.yaml with only the model swapped. The phase columns are
at fixed sizes (update micro-batch 2, scoring 4 rows, checkpointing on); each card's cell gives the
sizes the recipe's `auto` chooses there and the largest batch that fits. Reads the model configs
saved in bench/model_configs/ (copied from the hub; no weights, no network).

    python bench/estimate_table.py [--recipe recipes/single_gpu_8b.yaml] [--json]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

MODELS = ["smollm2-135m", "qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b", "llama-3.1-8b"]
BUDGETS = [8, 12, 16, 24]
# The phase columns' sizes (the recipe's before they were `auto`), so they compare across models.
FIXED_SIZES = ["ppo.grad_accum_steps=4", "rollout.forward_batch_size=4", "model.gradient_checkpointing=true"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--recipe", default=str(REPO / "recipes" / "single_gpu_8b.yaml"))
    parser.add_argument("--json", action="store_true")
    parser.add_argument("overrides", nargs="*")
    args = parser.parse_args()

    from lora_ppo import load_recipe
    from lora_ppo.estimate import GB, estimate_recipe

    rows = []
    for name in MODELS:
        folder = REPO / "bench" / "model_configs" / name
        source = json.loads((folder / "config.json").read_text()).get("_source", name)
        recipe = load_recipe(args.recipe, [f"model.name={folder}", *args.overrides])
        # The phase columns without a budget: `dequantize_per_step: auto` counted off, as for a
        # card with no room to spare; each budget decides it for itself.
        est = estimate_recipe(load_recipe(args.recipe, [f"model.name={folder}", *FIXED_SIZES, *args.overrides]),
                              device="cuda")
        row = {"model": source, "params_b": round(est.shape.total_params / 1e9, 2),
               "phases_gb": {k: round(v / GB, 2) for k, v in est.phases.items()}, "budgets": {}}
        for budget in BUDGETS:
            est = estimate_recipe(recipe, device="cuda", budget_gb=budget)
            auto = {c.field: c.value for c in est.auto_choices}
            row["budgets"][budget] = {"fits": est.fits, "largest_batch": est.fitting.get("rollout.batch_size"),
                                      "auto": auto}
        rows.append(row)
    if args.json:
        print(json.dumps(rows, indent=2))
        return
    print("| model | params | generate | score | update | " + " | ".join(f"{b} GB" for b in BUDGETS) + " |")
    print("|---|---|---|---|---|" + "---|" * len(BUDGETS))
    for r in rows:
        p = r["phases_gb"]
        cells = [(f"fits: {_sizes(v['auto'])}batch up to {v['largest_batch']}" if v["fits"] else "no")
                 for v in r["budgets"].values()]
        print(f"| {r['model']} | {r['params_b']}B | {p['generate']} GB | {p['score']} GB | {p['update']} GB | "
              + " | ".join(cells) + " |")


def _sizes(auto: dict) -> str:
    """The `auto` sizes chosen for a card, in a few words: micro-batch (of the minibatch of 8),
    scoring rows, checkpointing."""
    if not auto:
        return ""
    micro = 8 // auto["ppo.grad_accum_steps"] if "ppo.grad_accum_steps" in auto else None
    parts = [f"micro {micro}" if micro else "", f"scoring {auto.get('rollout.forward_batch_size', '')}",
             "" if auto.get("model.gradient_checkpointing", True) else "no checkpointing"]
    return ", ".join(p for p in parts if p and not p.endswith(" ")) + "; "


if __name__ == "__main__":
    main()
