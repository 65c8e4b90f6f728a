"""The recipe references, docs/recipe.md (PPO), docs/reward-recipe.md (train-reward) and
docs/sft-recipe.md (train-sft), generated from the schema in lora_ppo/config.py.

`python -m lora_ppo.recipe_reference` writes them; `--check` exits 1 when one is stale.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path
from typing import Any, Literal, Optional, Sequence, Union

import annotated_types
import yaml
from pydantic.fields import FieldInfo

from lora_ppo.config import Recipe, RewardRecipe, Section, SFTRecipe, may_change_on_resume, nested_section

DOCS = Path(__file__).resolve().parents[1] / "docs"
REFERENCE_PATH = DOCS / "recipe.md"
REWARD_REFERENCE_PATH = DOCS / "reward-recipe.md"
SFT_REFERENCE_PATH = DOCS / "sft-recipe.md"
REGENERATE = "python -m lora_ppo.recipe_reference"

REWARD_INTRO = f"""\
# Reward-model recipe reference

The recipe of `lora-ppo train-reward`: a reward LoRA adapter and scalar head trained on preference
pairs, on the base model the PPO run will use. Up to four sections:
{", ".join(f"`{name}`" for name in RewardRecipe.model_fields)}. It follows the PPO recipe's rules
([recipe.md](recipe.md)): every field has a default, unknown keys are one-line errors, overrides
are `section.field=value`, and `lora-ppo validate` prints the resolved recipe.

This file is generated from the field descriptions in `lora_ppo/config.py`; do not edit it by
hand. After changing the schema, regenerate it with `{REGENERATE}`.
"""

SFT_INTRO = f"""\
# SFT recipe reference

The recipe of `lora-ppo train-sft`: a policy LoRA adapter trained with the supervised loss on
demonstrations, on the base model the PPO run will use ([pipeline.md](pipeline.md)). Up to five
sections: {", ".join(f"`{name}`" for name in SFTRecipe.model_fields)}; the `sft` section marks an SFT
recipe (`lora-ppo validate` tells the kinds apart by it). It follows the PPO recipe's rules
([recipe.md](recipe.md)): every field has a default, unknown keys are one-line errors, overrides
are `section.field=value`, and `lora-ppo validate` prints the resolved recipe.

This file is generated from the field descriptions in `lora_ppo/config.py`; do not edit it by
hand. After changing the schema, regenerate it with `{REGENERATE}`.
"""

INTRO = f"""\
# Recipe reference

A recipe is YAML with up to seven sections: {", ".join(f"`{name}`" for name in Recipe.model_fields)}.
Every field has a default, so a recipe names only what it changes. Unknown keys are errors:
a misspelt key is named in a one-line error, with the closest known field when there is one, and
so is a key set twice in one mapping (a section written again lower down), which YAML alone would
read as the last one, dropping the first's settings. A text field may not be empty (`data.source=`
names no file); only `data.system_prompt: ""` is taken, as no system prompt.

Any field can be overridden on the command line as `section.field=value`; values are YAML
(`3`, `true`, `[q_proj, v_proj]`). `~section.field` removes a field the recipe sets, so its default
applies: `~reward.kind ~reward.function "reward.sources=[...]"` turns a one-source recipe into a mix.
`lora-ppo validate RECIPE [overrides]` prints the fully resolved recipe without loading anything.
From Python, `lora_ppo.recipe_from_dict` takes the same sections as a dict, with a `pathlib.Path`
wherever a file or folder is named.

The column "on resume" says whether a resumed run (`--resume`) may set the field differently
from the run's `recipe.yaml`: `may change` fields alter how long a run goes, what it logs or
evaluates, or how fast a step runs; any other difference is refused.

This file is generated from the field descriptions in `lora_ppo/config.py`; do not edit it by
hand. After changing the schema, regenerate it with `{REGENERATE}`.
"""

TABLE_HEAD = "| field | type | default | on resume | meaning |\n|---|---|---|---|---|"


def _number(value: float) -> str:
    # A large power of two (the seed's bound, 2**63) reads better as 2^k than as 19 digits.
    if isinstance(value, int) and value >= 1024 and value & (value - 1) == 0:
        return f"2^{value.bit_length() - 1}"
    return format(value, "g")


def _bounds(field: FieldInfo) -> str:
    """The field's numeric constraints: ` > 0`, ` >= 0`, ` in (0, 1]`, or nothing."""
    lower = upper = None  # (interval bracket, comparison, number)
    for item in field.metadata:
        if isinstance(item, annotated_types.Gt):
            lower = ("(", ">", item.gt)
        elif isinstance(item, annotated_types.Ge):
            lower = ("[", ">=", item.ge)
        elif isinstance(item, annotated_types.Lt):
            upper = (")", "<", item.lt)
        elif isinstance(item, annotated_types.Le):
            upper = ("]", "<=", item.le)
    if lower and upper:
        return f" in {lower[0]}{_number(lower[2])}, {_number(upper[2])}{upper[0]}"
    bound = lower or upper
    return f" {bound[1]} {_number(bound[2])}" if bound else ""


def _type_text(annotation: Any, bounds: str = "") -> str:
    """A readable type: `int > 0`, one of `4bit`/`8bit`/`none`, `float > 0 or null`, `list of str`."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if annotation is type(None):
        return "null"
    if origin is Literal:
        values = "/".join(f"`{value}`" for value in args)
        return values if len(args) == 1 else f"one of {values}"
    if origin in (Union, types.UnionType):
        return " or ".join(_type_text(arg, bounds) for arg in args)
    if origin is list:
        return f"list of {_type_text(args[0]).removeprefix('one of ')}"
    if origin is dict:
        return f"mapping of {_type_text(args[0])} to values"
    return annotation.__name__ + (bounds if annotation in (int, float) else "")


def _yaml_value(value: Any) -> str:
    """A default as a recipe would spell it: `null`, `true`, `[]`, `0.0001`."""
    # A scalar dumps as a document: "value\n...\n".
    return yaml.safe_dump(value, default_flow_style=True, width=1000).removesuffix("\n...\n").strip()


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def _field_row(path: str, field: FieldInfo) -> str:
    cells = [
        f"`{path}`",
        _type_text(field.annotation, _bounds(field)),
        f"`{_yaml_value(field.default)}`",
        "may change" if may_change_on_resume(field) else "must match",
        field.description or "",
    ]
    return "| " + " | ".join(_cell(cell) for cell in cells) + " |"


def _section_text(model: type[Section], path: str, level: int, intro: Optional[str]) -> list[str]:
    """A heading, the intro, a table of the section's value fields, then its nested sections."""
    blocks = [f"{'#' * level} `{path}`"]
    if intro:
        blocks.append(intro)
    rows = [_field_row(f"{path}.{name}", field) for name, field in model.model_fields.items()
            if nested_section(field) is None]
    if rows:
        blocks.append("\n".join([TABLE_HEAD, *rows]))
    for name, field in model.model_fields.items():
        inner = nested_section(field)
        if inner is not None:
            blocks.extend(_section_text(inner, f"{path}.{name}", level + 1, field.description))
    return blocks


def reference_markdown(schema: type[Section] = Recipe) -> str:
    """The whole of docs/recipe.md (or, for RewardRecipe, docs/reward-recipe.md; for SFTRecipe,
    docs/sft-recipe.md)."""
    blocks = [{Recipe: INTRO, RewardRecipe: REWARD_INTRO, SFTRecipe: SFT_INTRO}[schema].rstrip("\n")]
    for name, field in schema.model_fields.items():
        section = nested_section(field)
        blocks.extend(_section_text(section, name, 2, (section.__doc__ or "").strip()))
    return "\n\n".join(blocks) + "\n"


REFERENCES = {REFERENCE_PATH: Recipe, REWARD_REFERENCE_PATH: RewardRecipe, SFT_REFERENCE_PATH: SFTRecipe}


def main(argv: Optional[Sequence[str]] = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="exit 1 when a reference is stale")
    args = parser.parse_args(argv)
    for path, schema in REFERENCES.items():
        text = reference_markdown(schema)
        shown = path.relative_to(path.parents[1])
        if args.check:
            current = path.read_text(encoding="utf-8") if path.exists() else None
            if current != text:
                print(f"{shown} is stale: regenerate it with {REGENERATE}", file=sys.stderr)
                return 1
            continue
        path.parent.mkdir(exist_ok=True)
        path.write_text(text, encoding="utf-8")
        print(f"wrote {shown}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
