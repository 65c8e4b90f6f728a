"""Every `lora-ppo` command the README shows works as written on a fresh clone, as far as it can
without minutes of training: recipe commands resolve their recipe and overrides, and every local
file the resolved recipe names exists unless the command itself names it (a user's own file, such
as `my_pairs.jsonl`); `estimate` runs; commands on a trained run accept their options and fail
only for want of the run."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.config import LOCAL_PATH_FIELDS, PATH_KEYWORDS, BUILTIN_PREFIX, load_recipe

REPO = Path(__file__).resolve().parents[1]
RECIPE_COMMANDS = {"train", "train-reward", "validate"}
RUN_COMMANDS = {"report", "eval", "generate", "merge-and-export"}


def readme_commands() -> list[list[str]]:
    """The `lora-ppo ...` lines of the README's bash blocks (the install line's last command too)."""
    text = (REPO / "README.md").read_text(encoding="utf-8")
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", text, flags=re.S):
        for line in block.splitlines():
            for part in line.split("&&"):
                words = shlex.split(part, comments=True)
                if words[:1] == ["lora-ppo"]:
                    commands.append(words[1:])
    return commands


def local_paths(recipe) -> list[str]:
    """The local files and folders a resolved recipe names (builtin sets, hub ids and words aside)."""
    data = recipe.model_dump(mode="json")
    found = []

    def walk(node, keys):
        if not keys or node is None:
            if isinstance(node, str) and node not in PATH_KEYWORDS and not node.startswith(BUILTIN_PREFIX):
                found.append(node)
            return
        key, rest = keys[0], keys[1:]
        children = node if key == "*" and isinstance(node, list) else \
            [node.get(key)] if isinstance(node, dict) else []
        for child in children:
            walk(child, rest)

    for field in LOCAL_PATH_FIELDS:
        walk(data, field.split("."))
    # A hub id ("org/name") is not local; a path the recipe means as local has a folder or a suffix.
    return [p for p in found if p.startswith((".", "/", "~", "runs/", "data/", "bench/")) or Path(p).suffix]


def test_the_readme_shows_commands():
    names = {words[0] for words in readme_commands()}
    assert {"train", "train-reward", "validate", "estimate", "merge-and-export", "eval", "generate"} <= names


@pytest.mark.parametrize("words", [w for w in readme_commands() if w[0] in RECIPE_COMMANDS], ids=shlex.join)
def test_a_recipe_command_resolves_and_names_only_files_a_fresh_clone_has(words, monkeypatch):
    monkeypatch.chdir(REPO)
    recipe_path = words[1]
    overrides = [w for w in words[2:] if not w.startswith("--") and "=" in w or w.startswith("~")]
    given = {w.split("=", 1)[1] for w in overrides if "=" in w}
    recipe = load_recipe(recipe_path, overrides, schema=None)
    missing = [p for p in local_paths(recipe) if p not in given and not Path(p).expanduser().exists()]
    assert missing == [], f"`lora-ppo {shlex.join(words)}` names files a fresh clone does not have"


@pytest.mark.parametrize("words", [w for w in readme_commands() if w[0] == "estimate"], ids=shlex.join)
def test_an_estimate_command_prints_a_peak_and_exits_as_its_verdict_says(words, monkeypatch):
    """With --gpu-gb the verdict line and the exit code agree (0: fits, 1: does NOT fit, an answer
    too); without it there is no verdict and the exit code is 0."""
    monkeypatch.chdir(REPO)
    result = CliRunner().invoke(app, words)
    lines = result.output.splitlines()
    verdicts = [line for line in lines if line.startswith(("fits in ", "does NOT fit in "))]
    if "--gpu-gb" in words:
        budget = f"{float(words[words.index('--gpu-gb') + 1]):g} GB"
        expected = {0: f"fits in {budget}", 1: f"does NOT fit in {budget}"}.get(result.exit_code)
        assert verdicts == [expected], result.output
    else:
        assert result.exit_code == 0 and verdicts == [], result.output
    assert any(line.startswith("peak: ") and line.endswith(" GB") for line in lines), result.output


@pytest.mark.parametrize("words", [w for w in readme_commands() if w[0] in RUN_COMMANDS], ids=shlex.join)
def test_a_run_command_accepts_its_options(words, tmp_path):
    """Pointed at a folder without a run, it gets as far as looking for the run: its options parse."""
    absent = str(tmp_path / "no-run")
    args = [absent if w.startswith("runs/") else w for w in words]
    args = [str(tmp_path / "out") if w.startswith("exports/") else w for w in args]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2, result.output
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and absent in lines[0], result.stderr
