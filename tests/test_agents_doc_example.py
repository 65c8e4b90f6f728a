"""The `generate()` / `step()` loop of docs/agents.md runs as written, on the tiny model (its
recipe file and output folder swapped in), and leaves what a run leaves."""

from __future__ import annotations

import contextlib
import io
import json
import re
from pathlib import Path

import pytest
import yaml

from tests.conftest import tiny_recipe_dict

DOC = Path(__file__).resolve().parents[1] / "docs" / "agents.md"


def test_the_documented_step_loop_trains_and_logs_each_step(tmp_path, tiny_model_dir, monkeypatch):
    section = DOC.read_text(encoding="utf-8").split("## Your own rollouts")[1]
    code = re.search(r"```python\n(.*?)```", section, re.S).group(1)
    recipe = tmp_path / "tiny.yaml"
    recipe.write_text(yaml.safe_dump(tiny_recipe_dict(tiny_model_dir, tmp_path / "unused")), encoding="utf-8")
    assert '"recipes/quickstart.yaml"' in code and "runs/my-loop" in code
    code = code.replace('"recipes/quickstart.yaml"', repr(str(recipe))).replace("runs/my-loop", str(tmp_path / "loop"))
    monkeypatch.chdir(tmp_path)
    printed = io.StringIO()
    namespace: dict = {}
    with contextlib.redirect_stdout(printed):
        exec(compile(code, str(DOC), "exec"), namespace)

    lines = printed.getvalue().splitlines()
    assert len(lines) == 2 and all(len(line.split()) == 3 for line in lines)
    metrics = [json.loads(line) for line in (tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == [1, 2]
    # what was printed is what was logged
    assert [float(line.split()[0]) for line in lines] == [m["objective/scores"] for m in metrics]
    assert (tmp_path / "loop" / "final" / "manifest.json").is_file()

    # One more step after close() was logged past final/, which no resume would ever reach.
    samples = namespace["samples"]
    with pytest.raises(RuntimeError, match="is closed"):
        namespace["trainer"].step(samples.queries(), samples.completion_ids(), [0.0] * len(samples.completions))
    assert len((tmp_path / "loop" / "metrics.jsonl").read_text().splitlines()) == 2
