"""The architecture contract in pyproject.toml ([tool.importlinter]): layers that import only
downward, and ppo_math / logprobs importing torch alone. Every module of the package must be
placed in a layer, so a new module cannot slip past the contract."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

try:
    import tomllib
except ImportError:  # Python 3.10: import-linter brings tomli
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]


def _contracts() -> list[dict]:
    return tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["importlinter"]["contracts"]


def test_import_contracts_are_kept():
    lint = Path(sys.executable).with_name("lint-imports")
    result = subprocess.run([str(lint), "--no-cache"], cwd=REPO, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_every_module_is_in_a_layer():
    layers = next(c for c in _contracts() if c["type"] == "layers")["layers"]
    placed = {name.strip() for layer in layers for name in layer.split("|")}
    modules = {f"lora_ppo.{p.stem}" for p in (REPO / "lora_ppo").glob("*.py") if p.stem != "__init__"}
    # a subpackage is one layer: its modules sit together in it
    modules |= {f"lora_ppo.{p.parent.name}" for p in (REPO / "lora_ppo").glob("*/*.py") if p.stem != "__init__"}
    assert modules - placed == set(), "add these modules to a layer in pyproject.toml"
    assert placed - modules == set(), "these layers name modules that do not exist"
