"""How far apart lora_ppo's logit path and a model's own forward are, and what the logprob
self-check reads, printed as JSON:

- per architecture of tests/architectures.py (tiny random models, 4-bit): the load-time probe's
  largest logprob difference with the transform lora_ppo derives and with none, and which
  mixed-adapter batches work;
- on the embedded SmolLM2-135M (quickstart prompts): `check/logprob_max_diff` and
  `check/logprob_mean_diff` over a few PPO steps, for each compute dtype and each source of the
  old logprobs (generation, or a scoring pass).

    python bench/logit_path.py                      # both parts
    python bench/logit_path.py --part architectures
    python bench/logit_path.py --part selfcheck --steps 3 --dtypes float32 bfloat16
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def architectures() -> list[dict]:
    import torch

    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.logprobs import IDENTITY
    from lora_ppo.model import load_base_model
    from lora_ppo.model_checks import logit_path_error, probe_ids
    from lora_ppo.roles import RoleModel
    from tests.architectures import ARCHITECTURES, build_model
    from tests.conftest import build_tiny_tokenizer

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in ARCHITECTURES:
            folder = Path(tmp) / name
            folder.mkdir()
            build_model(name, folder, len(build_tiny_tokenizer(folder)))
            roles = RoleModel(load_base_model(ModelConfig(name=str(folder))), AdaptersConfig())
            ids = probe_ids(roles.lm_head.weight.shape[0], roles.lm_head.weight.device)
            mask = torch.ones_like(ids)

            def error(transform) -> float:
                return logit_path_error(lambda x: roles.peft(input_ids=x, attention_mask=mask).logits,
                                        lambda x: transform(roles.lm_head(roles.hidden_states(x, mask)).float()), ids)

            rows.append({
                "architecture": name, "transform": repr(roles.logit_transform),
                "probe_error": error(roles.logit_transform), "probe_error_without_transform": error(IDENTITY),
                "mixed_batches_no_grad": roles.mixed_batches[False], "mixed_batches_grad": roles.mixed_batches[True],
            })
    return rows


def selfcheck(steps: int, dtypes: list[str]) -> list[dict]:
    from lora_ppo.config import load_recipe
    from lora_ppo.trainer import PPOTrainer

    recipe_path = Path(__file__).resolve().parents[1] / "recipes" / "quickstart.yaml"
    rows = []
    for dtype in dtypes:
        for from_generation in (True, False):
            with tempfile.TemporaryDirectory() as tmp:
                recipe = load_recipe(recipe_path, [
                    f"train.steps={steps}", "train.eval=false", f"train.output_dir={tmp}/run",
                    f"model.compute_dtype={dtype}", f"rollout.logprobs_from_generation={str(from_generation).lower()}",
                    "rollout.batch_size=16",
                ])
                trainer = PPOTrainer(recipe, progress=False)
                trainer.train()
                lines = (Path(tmp) / "run" / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
                for line in lines:
                    m = json.loads(line)
                    rows.append({"compute_dtype": dtype, "old_logprobs": "generation" if from_generation else "scoring",
                                 "step": m["step"], "max_diff": m.get("check/logprob_max_diff"),
                                 "mean_diff": m.get("check/logprob_mean_diff"), "kl": m["objective/kl"]})
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--part", choices=("architectures", "selfcheck", "both"), default="both")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--dtypes", nargs="+", default=["float32", "bfloat16"])
    args = parser.parse_args()
    out = {}
    if args.part in ("architectures", "both"):
        out["architectures"] = architectures()
    if args.part in ("selfcheck", "both"):
        out["selfcheck"] = selfcheck(args.steps, args.dtypes)
    print(json.dumps(out, indent=1))


if __name__ == "__main__":
    main()
