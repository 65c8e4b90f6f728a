"""`lora-ppo report`: the plots have content, the page references every plot and holds the
held-out table and the completions before and after, and a folder without a run is refused."""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lora_ppo.cli import app
from lora_ppo.report import plots_for, write_report
from lora_ppo.run_dir import read_jsonl

runner = CliRunner()


@pytest.fixture(scope="module")
def report(tmp_path_factory, finished_run) -> Path:
    run = tmp_path_factory.mktemp("report") / "run"
    shutil.copytree(finished_run, run)
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    page = Path(result.stdout.strip())
    assert page == run / "report" / "index.html"
    return page


def _pixels(png: Path):
    from matplotlib import image

    return image.imread(str(png))


def test_every_plot_has_content(report):
    metrics = read_jsonl(report.parents[1] / "metrics.jsonl")
    names = {p.name for p in plots_for(metrics)}
    # A PPO run with a critic and a side metric fills every figure.
    assert names == {"score", "kl", "entropy", "clipping", "selfcheck", "value", "length", "time", "memory",
                     "throughput", "padding"}
    for name in names:
        pixels = _pixels(report.parent / "plots" / f"{name}.png")
        assert pixels.shape[0] > 200 and pixels.shape[1] > 300
        # Not a blank canvas: many distinct colours (lines, text), not one background.
        assert len({tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}) > 20, name


def test_page_references_each_plot_and_holds_the_tables(report, finished_run):
    page = report.read_text(encoding="utf-8")
    # Self-contained: the images are inlined, so the page can be mailed on its own.
    inlined = re.findall(r"<img[^>]+src='data:image/png;base64,", page)
    assert len(inlined) == len(list((report.parent / "plots").glob("*.png")))
    for name in ("score", "kl", "entropy", "clipping", "value", "length", "time", "memory", "throughput", "padding"):
        assert f"data-file='plots/{name}.png'" in page
    summary = json.loads((finished_run / "summary.json").read_text())
    assert "held-out" in page and f"{summary['heldout_score_after']:.3f}" in page
    assert "textblob" in page
    before = read_jsonl(finished_run / "eval_before.jsonl")
    after = read_jsonl(finished_run / "eval_after.jsonl")
    assert [r["prompt"] for r in before] == [r["prompt"] for r in after]
    import html

    for record in (before[0], after[0]):
        assert html.escape(record["completion"]) in page
    assert "steps:" in page and "clip_eps" in page  # the recipe


def test_report_of_a_folder_without_a_run_is_refused(tmp_path):
    result = runner.invoke(app, ["report", str(tmp_path)])
    assert result.exit_code == 2
    assert result.stderr.startswith("error: report:") and len(result.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "report").exists()


def test_report_of_an_unfinished_run(tmp_path, finished_run):
    # A run interrupted before its final evaluation: plots and the steps so far, no after table.
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    (run / "summary.json").unlink()
    (run / "eval_after.jsonl").unlink()
    page = write_report(run).read_text(encoding="utf-8")
    assert "data-file='plots/score.png'" in page and "not finished" in page
    assert "(not evaluated yet)" in page


@pytest.mark.skipif(not (shutil.which("chromium") or shutil.which("chromium-browser")), reason="no Chromium")
def test_page_renders_in_a_browser(report, tmp_path):
    browser = shutil.which("chromium") or shutil.which("chromium-browser")
    shot = tmp_path / "page.png"
    subprocess.run([browser, "--headless", "--no-sandbox", "--disable-gpu", "--hide-scrollbars",
                    f"--screenshot={shot}", "--window-size=1280,2400", report.as_uri()],
                   check=True, capture_output=True, timeout=120)
    pixels = _pixels(shot)
    assert len({tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::11].tolist()}) > 50


def test_episodes_show_as_transcripts(tmp_path, finished_run):
    """An episode's record (multi-turn runs keep a `transcript`) shows every turn after the prompt
    with who wrote it: the policy's turns, the environment's replies, tool results by tool."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    records = read_jsonl(run / "eval_before.jsonl")
    records[0]["transcript"] = [
        {"role": "user", "content": "What is 2 + 2?"},
        {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"a": 2}}</tool_call>'},
        {"role": "tool", "name": "calculator", "content": "4"},
        {"role": "assistant", "content": "5"},
        {"role": "user", "content": "That is not right, try again."},
        {"role": "assistant", "content": "4"},
    ]
    (run / "eval_before.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    page = write_report(run).read_text(encoding="utf-8")
    shown = ("[assistant] &lt;tool_call&gt;{&quot;name&quot;: &quot;calculator&quot;, &quot;arguments&quot;: "
             "{&quot;a&quot;: 2}}&lt;/tool_call&gt;\n[tool result: calculator] 4\n[assistant] 5\n"
             "[user] That is not right, try again.\n[assistant] 4")
    assert shown in page
    assert "[user] What is 2 + 2?" not in page  # the prompt has its own column


def test_an_environment_run_plots_its_episodes(tmp_path, finished_run):
    """Episode metrics (turns, truncation, tool calls and errors, return, environment reward) get
    two figures with every series drawn; a single-turn run gets neither (test above)."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    episode = {"episode/turns": 2.5, "episode/truncated_frac": 0.25, "episode/tool_calls": 1.0,
               "episode/tool_errors": 0.5, "episode/return": 0.75, "episode/env_reward": 0.5}
    metrics = [{**m, **{k: v * m["step"] for k, v in episode.items()}} for m in read_jsonl(run / "metrics.jsonl")]
    (run / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics), encoding="utf-8")
    plots = {p.name: p for p in plots_for(metrics)}
    drawn = {key for name in ("episode", "episode_return") for key, _ in plots[name].left + plots[name].right}
    assert drawn == set(episode)
    write_report(run)
    for name in ("episode", "episode_return"):
        pixels = _pixels(run / "report" / "plots" / f"{name}.png")
        assert len({tuple(px) for px in pixels.reshape(-1, pixels.shape[-1])[::7].tolist()}) > 20, name


def test_a_metrics_line_being_written_is_left_out_and_a_broken_one_before_it_named(tmp_path, finished_run):
    """The report of a running run (or one killed mid-write) meets a last line cut short: it
    crashed with a JSONDecodeError traceback; now that line waits for the next report. A line
    broken before the last is corruption: one line naming it, exit 2."""
    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    complete = run.joinpath("metrics.jsonl").read_text(encoding="utf-8")
    steps = [json.loads(line)["step"] for line in complete.splitlines()]
    with open(run / "metrics.jsonl", "a", encoding="utf-8") as f:
        f.write('{"step": 4, "objective/kl": 0.')
    result = runner.invoke(app, ["report", str(run)])
    assert result.exit_code == 0, result.output
    assert [m["step"] for m in read_jsonl(run / "metrics.jsonl")] == steps == [1, 2, 3]

    lines = complete.splitlines()
    lines[1] = lines[1][:-1]  # its closing brace lost
    run.joinpath("metrics.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    broken = runner.invoke(app, ["report", str(run)])
    assert broken.exit_code == 2
    assert broken.stderr.startswith(f"error: {run / 'metrics.jsonl'} line 2: not JSON (")
    assert len(broken.stderr.strip().splitlines()) == 1


def test_a_last_line_without_its_line_break_is_read_when_it_is_whole(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text('{"a": 1}\n\n{"a": 2}', encoding="utf-8")  # as a hand-edited file may end
    assert read_jsonl(path) == [{"a": 1}, {"a": 2}]
