"""`lora-ppo report RUN_DIR`: PNG plots of a run's metrics and one self-contained HTML page with
them, the held-out scores before and after, the same held-out prompts' completions before and
after, the alarms raised, and the recipe. Reads only the run folder's files.
"""

from __future__ import annotations

import base64
import html
import io
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

from lora_ppo.agents.episodes import transcript_text
from lora_ppo.atomic import atomic_folder
from lora_ppo.errors import RecipeError
from lora_ppo.run_dir import REPORT_DIR, RunDir, read_jsonl

COMPLETIONS_SHOWN = 12  # held-out prompts shown before and after
PHASES = ("generate", "score_forward", "reward", "update")
MEMORY_PHASES = ("generate", "score", "reward", "update")
PERF_PHASES = ("generate", "score", "update")


@dataclass(frozen=True)
class Plot:
    """One figure: series on the left axis, optional series on a right axis."""

    name: str
    title: str
    left: tuple[tuple[str, str], ...]  # (metric, label)
    left_label: str
    right: tuple[tuple[str, str], ...] = ()
    right_label: str = ""


# A supervised run (lora-ppo train-sft).
SFT_PLOTS = (
    Plot("sft_loss", "Token loss: mean negative log-likelihood of the target tokens",
         (("sft/loss", "train"), ("sft/eval_loss", "held-out")), "nats per token"),
    Plot("sft_perplexity", "Perplexity", (("sft/perplexity", "train"), ("sft/eval_perplexity", "held-out")),
         "perplexity"),
    Plot("sft_throughput", "Padding and speed", (("sft/padding_frac", "padding"),), "share of positions computed",
         (("tokens_per_s", "tokens per second"),), "tokens per second"),
)


def plots_for(metrics: list[dict]) -> list[Plot]:
    """The figures this run's metrics can fill (a critic-free run has no value plot)."""
    keys = {k for m in metrics for k in m}
    objectives = tuple((k, k.removeprefix("objective/")) for k in sorted(keys) if k.startswith("objective/")
                       and k not in ("objective/scores", "objective/raw_scores", "objective/shaped_scores",
                                     "objective/kl", "objective/kl_coef", "objective/non_score_reward",
                                     "objective/rlhf_reward"))
    plots = [
        Plot("score", "Score: the reward and the metrics beside it",
             (("objective/scores", "score (reward)"), *objectives), "mean per response"),
        Plot("kl", "KL to the reference, and its coefficient", (("objective/kl", "KL"),), "nats per response",
             (("objective/kl_coef", "kl_coef"),), "kl_coef"),
        Plot("entropy", "Policy entropy", (("policy/entropy", "entropy"),), "nats per token"),
        Plot("clipping", "Clipping and approximate KL of each update", (("policy/clipfrac", "clip fraction"),),
             "share of tokens", (("policy/approxkl", "approx KL"),), "approx KL"),
        Plot("selfcheck", "Logprob self-check: the update's first forward against the rollout's logprobs",
             (("check/logprob_mean_diff", "mean |diff|"), ("check/logprob_max_diff", "largest |diff|")),
             "nats per token"),
        Plot("value", "The critic: value loss and explained variance", (("loss/value", "value loss"),), "loss",
             (("value/explained_var", "explained variance"),), "explained variance"),
        Plot("length", "Response length and how many stop", (("response/length", "length"),), "tokens",
             (("response/stopped_frac", "stopped"),), "share stopped"),
        # Episodes (rollout.environment / rollout.tools).
        Plot("episode_return", "Episode return: the score plus the environment's rewards",
             (("episode/return", "return"), ("episode/env_reward", "environment reward")), "mean per episode"),
        Plot("episode", "Episodes: turns, tool calls and their errors, truncation",
             (("episode/turns", "turns"), ("episode/tool_calls", "tool calls"), ("episode/tool_errors", "tool errors")),
             "per episode", (("episode/truncated_frac", "truncated"),), "share truncated"),
        Plot("time", "Seconds per phase of a step", tuple((f"time/{p}", p) for p in PHASES), "seconds"),
        Plot("memory", "Peak memory per phase", tuple((f"memory/{p}_gb", p) for p in MEMORY_PHASES), "GB"),
        Plot("throughput", "Achieved matmul rate per phase (a slow setup shows here)",
             tuple((f"perf/{p}_tflops", p) for p in PERF_PHASES), "TFLOP/s",
             (("perf/generate_tokens_per_s", "decode tokens/s"),), "tokens/s"),
        Plot("padding", "Padding: the update's positions that held no token (ppo.trim_padding)",
             (("update/padding_frac", "update"),), "share of positions computed"),
        # A reward-model run (lora-ppo train-reward).
        Plot("reward_loss", "Pairwise loss", (("loss", "train"), ("eval/loss", "held-out")), "loss"),
        Plot("reward_accuracy", "Pairwise accuracy (chosen above rejected)",
             (("accuracy", "train"), ("eval/accuracy", "held-out")), "share of pairs",
             (("margin", "train margin"), ("eval/margin", "held-out margin")), "mean margin"),
    ]
    return [p for p in (*plots, *SFT_PLOTS) if any(k in keys for k, _ in p.left)]


def render_plot(plot: Plot, metrics: list[dict]) -> bytes:
    """The figure as PNG bytes."""
    import matplotlib

    matplotlib.use("Agg")  # headless
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    fig, ax = plt.subplots(figsize=(6.4, 3.4), dpi=110)
    lines = []
    for key, label in plot.left:
        steps = [m["step"] for m in metrics if key in m]
        if steps:
            lines += ax.plot(steps, [m[key] for m in metrics if key in m], marker="o", markersize=3, label=label)
    ax.set_xlabel("step")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at 1.5
    ax.set_ylabel(plot.left_label)
    ax.grid(True, alpha=0.3)
    if plot.right:
        twin = ax.twinx()
        for i, (key, label) in enumerate(plot.right):
            steps = [m["step"] for m in metrics if key in m]
            if steps:
                lines += twin.plot(steps, [m[key] for m in metrics if key in m], color=f"C{len(plot.left) + i + 2}",
                                   linestyle="--", marker="s", markersize=3, label=label)
        twin.set_ylabel(plot.right_label)
        twin.set_ylim(bottom=min(0.0, twin.get_ylim()[0]))  # a constant series otherwise gets a misleading offset axis
    ax.set_title(plot.title, fontsize=11)
    if lines:
        # Below the axes: inside, with two y axes, it covers one of them whatever "best" says.
        ax.legend(lines, [line.get_label() for line in lines], fontsize=8, loc="upper center",
                  bbox_to_anchor=(0.5, -0.2), ncol=min(len(lines), 4), frameon=False)
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png", bbox_inches="tight")
    plt.close(fig)
    return buffer.getvalue()


def write_report(run_dir: str | Path) -> Path:
    """Write RUN_DIR/report/ (index.html and plots/*.png) atomically; returns the HTML page.

    Raises RecipeError when the folder holds no run (no metrics.jsonl).
    """
    run = RunDir(run_dir)
    metrics = read_jsonl(run.metrics)
    if not metrics:
        raise RecipeError(f"report: {run.root} holds no run (no {run.metrics.name} with any step)")
    try:
        summary = json.loads(run.summary.read_text(encoding="utf-8")) if run.summary.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError) as err:  # a file edited by hand, or written by something else
        raise RecipeError(f"report: {run.summary} is not the JSON a run writes ({err})") from None
    plots = [(plot, render_plot(plot, metrics)) for plot in plots_for(metrics)]
    page = _page(run, metrics, summary, plots)
    with atomic_folder(run.root / REPORT_DIR) as staging:
        (staging / "plots").mkdir()
        for plot, png in plots:
            (staging / "plots" / f"{plot.name}.png").write_bytes(png)
        (staging / "index.html").write_text(page, encoding="utf-8")
    return run.root / REPORT_DIR / "index.html"


# ---- the page ---------------------------------------------------------------------------------

STYLE = """
body { font-family: system-ui, -apple-system, Segoe UI, sans-serif; margin: 2rem auto; max-width: 1200px;
       color: #1d2430; padding: 0 1rem; }
h1 { font-size: 1.6rem; margin-bottom: .2rem; } h2 { font-size: 1.2rem; margin-top: 2rem; border-bottom: 1px solid #dde; }
.sub { color: #5a6270; margin-top: 0; }
table { border-collapse: collapse; margin: .5rem 0; font-size: .92rem; }
th, td { border: 1px solid #dde; padding: .35rem .6rem; text-align: left; vertical-align: top; }
th { background: #f2f4f8; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.up { color: #11733b; } .down { color: #b3261e; }
.plots { display: grid; grid-template-columns: repeat(auto-fill, minmax(520px, 1fr)); gap: 1rem; }
.plots img { width: 100%; border: 1px solid #e3e6ec; border-radius: 4px; }
.alarm { background: #fff4e5; border-left: 4px solid #e08a00; padding: .4rem .7rem; margin: .4rem 0; }
pre { background: #f6f8fa; padding: .8rem; overflow-x: auto; font-size: .85rem; }
td.text { max-width: 420px; white-space: pre-wrap; }
"""


def _page(run: RunDir, metrics: list[dict], summary: dict, plots: list[tuple[Plot, bytes]]) -> str:
    recipe = run.recipe.read_text(encoding="utf-8") if run.recipe.is_file() else ""
    last = metrics[-1]
    subtitle = f"{len(metrics)} steps"
    if "objective/kl" in last:
        subtitle += f"; final KL {last['objective/kl']:.2f} nats per response"
    if summary:
        subtitle += f"; {summary['wall_time_s']:.0f} s, peak memory {summary['peak_memory_gb']:.2f} GB"
    else:
        subtitle += "; not finished (no summary.json yet)"
    parts = [
        "<!doctype html><html><head><meta charset='utf-8'>",
        f"<title>lora_ppo report: {html.escape(run.root.name)}</title><style>{STYLE}</style></head><body>",
        f"<h1>{html.escape(run.root.name)}</h1><p class='sub'>{html.escape(subtitle)}</p>",
        "<h2>Held-out scores</h2>", _heldout_table(summary),
        "<h2>Training</h2>", _alarms(metrics),
        "<div class='plots'>",
        *(f"<figure><img alt='{html.escape(p.title, quote=True)}' data-file='plots/{p.name}.png' "
          f"src='data:image/png;base64,{base64.b64encode(png).decode()}'></figure>" for p, png in plots),
        "</div>",
        "<h2>Held-out completions, before and after training</h2>", _completions(run),
        "<h2>Recipe</h2>", f"<pre>{html.escape(recipe)}</pre>",
        "</body></html>",
    ]
    return "\n".join(parts)


def _number(value: Optional[float]) -> str:
    return "n/a" if value is None else f"{value:.3f}"


def _heldout_table(summary: dict) -> str:
    names = [k[len("heldout_"):-len("_before")] for k in summary
             if k.startswith("heldout_") and k.endswith("_before") and not k.endswith("_se_before")]
    if not names:
        return "<p>No held-out evaluation (train.eval was off, or the run has not finished).</p>"
    rows = []
    for name in names:
        before, after = summary.get(f"heldout_{name}_before"), summary.get(f"heldout_{name}_after")
        se_b, se_a = summary.get(f"heldout_{name}_se_before"), summary.get(f"heldout_{name}_se_after")
        change = "" if before is None or after is None else f"{after - before:+.3f}"
        css = "up" if change.startswith("+") else "down" if change.startswith("-") else ""
        label = "score (reward)" if name == "score" else name
        rows.append(f"<tr><td>{html.escape(label)}</td><td class='num'>{_number(before)} ± {_number(se_b)}</td>"
                    f"<td class='num'>{_number(after)} ± {_number(se_a)}</td><td class='num {css}'>{change}</td></tr>")
    return ("<table><tr><th>metric</th><th>before</th><th>after</th><th>change</th></tr>" + "".join(rows)
            + "</table><p class='sub'>Means over the held-out prompts of each prompt's mean; ± is the standard "
              "error across prompts.</p>")


def _alarms(metrics: list[dict]) -> str:
    raised = {}
    for m in metrics:
        for key, value in m.items():
            if key.startswith("alarm/") and value:
                raised.setdefault(key.removeprefix("alarm/"), []).append(m["step"])
    if not raised:
        return "<p>No alarm was raised.</p>"
    return "".join(f"<div class='alarm'><b>{html.escape(name)}</b> at steps {', '.join(map(str, steps))}</div>"
                   for name, steps in raised.items())


def _prompt_text(prompt) -> str:
    return prompt if isinstance(prompt, str) else "\n".join(f"[{m['role']}] {m['content']}" for m in prompt)


def _response_text(record: dict) -> str:
    """A completion, or an episode's turns after its prompt (`transcript_text`)."""
    return transcript_text(record["transcript"]) if record.get("transcript") else record["completion"]


def _completions(run: RunDir) -> str:
    before, after = read_jsonl(run.eval_before), read_jsonl(run.eval_after)
    if not before:
        return "<p>No held-out completions saved (they are written at the evaluations before and after training).</p>"
    first = [r for r in before if r.get("sample", 0) == 0][:COMPLETIONS_SHOWN]
    later = {json.dumps(r["prompt"]): r for r in after if r.get("sample", 0) == 0}
    # An SFT run's samples carry the dataset's answer and no score: that column instead.
    with_reference = any("reference" in r for r in first)
    scored = any(r.get("score") is not None for r in [*before, *after])
    rows = []
    for b in first:
        a = later.get(json.dumps(b["prompt"]), {"completion": "(not evaluated yet)"})
        cells = [_text_cell(_prompt_text(b["prompt"]))]
        cells += [_text_cell(str(b.get("reference", "")))] if with_reference else []
        for record in (b, a):
            cells.append(_text_cell(_response_text(record)))
            cells += [f"<td class='num'>{_number(record.get('score'))}</td>"] if scored else []
        rows.append("<tr>" + "".join(cells) + "</tr>")
    header = ["prompt", *(["reference"] if with_reference else []),
              *(["before", "score", "after", "score"] if scored else ["before", "after"])]
    return ("<table><tr>" + "".join(f"<th>{name}</th>" for name in header) + "</tr>" + "".join(rows) + "</table>")


def _text_cell(text: str) -> str:
    return f"<td class='text'>{html.escape(text)}</td>"
