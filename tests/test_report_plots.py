"""What each plot of `lora-ppo report` draws, read off the figure itself: every series at its steps
with its label (the right axis dashed and starting at 0), the axis labels and the title, whole
steps on the x axis; and the plots a reward-model run gets."""

from __future__ import annotations

import pytest

from lora_ppo.report import Plot, plots_for, render_plot

# Metrics as a run writes them: a held-out series only every other step, margins well above 0.
METRICS = [{"step": s, "loss": 0.7 - 0.1 * s, "accuracy": 0.5 + 0.1 * s, "margin": 0.5 + 0.25 * s,
            **({"eval/loss": 0.65 - 0.1 * s, "eval/accuracy": 0.55 + 0.1 * s, "eval/margin": 0.6 + 0.2 * s}
               if s % 2 == 0 else {})} for s in range(1, 5)]


@pytest.fixture
def drawn(monkeypatch):
    """The figure render_plot draws, kept from being closed."""
    import matplotlib.pyplot as plt

    figures = []
    real_close = plt.close
    monkeypatch.setattr(plt, "close", lambda fig=None: figures.append(fig))
    yield figures
    for fig in figures:
        real_close(fig)


def _series(axes) -> list[tuple[str, list, list, str]]:
    return [(line.get_label(), list(line.get_xdata()), list(line.get_ydata()), line.get_linestyle())
            for line in axes.get_lines()]


def test_each_series_is_drawn_at_its_steps_with_its_label_and_the_right_axis_dashed_from_0(drawn):
    plot = next(p for p in plots_for(METRICS) if p.name == "reward_accuracy")
    png = render_plot(plot, METRICS)
    assert png.startswith(b"\x89PNG")
    (fig,) = drawn
    ax, twin = fig.axes
    assert _series(ax) == [("train", [1, 2, 3, 4], [m["accuracy"] for m in METRICS], "-"),
                           ("held-out", [2, 4], [METRICS[1]["eval/accuracy"], METRICS[3]["eval/accuracy"]], "-")]
    assert _series(twin) == [("train margin", [1, 2, 3, 4], [m["margin"] for m in METRICS], "--"),
                             ("held-out margin", [2, 4], [METRICS[1]["eval/margin"], METRICS[3]["eval/margin"]], "--")]
    assert (ax.get_xlabel(), ax.get_ylabel(), twin.get_ylabel()) == ("step", "share of pairs", "mean margin")
    assert ax.get_title() == "Pairwise accuracy (chosen above rejected)"
    # The margins (0.75 to 1.5) on an axis from 0, not from an offset that makes them look far apart.
    assert twin.get_ylim()[0] == 0.0 and twin.get_ylim()[1] >= 1.5
    assert [t.get_text() for t in ax.get_legend().get_texts()] == \
        ["train", "held-out", "train margin", "held-out margin"]
    # Steps are whole: no tick at 1.5.
    assert all(float(tick).is_integer() for tick in ax.get_xticks())


def test_a_plot_without_a_right_axis_has_one_and_a_series_the_run_lacks_is_left_out(drawn):
    render_plot(Plot("x", "Title", (("loss", "train"), ("absent", "never")), "loss"), METRICS)
    (fig,) = drawn
    assert len(fig.axes) == 1 and [label for label, *_ in _series(fig.axes[0])] == ["train"]


def test_a_reward_model_run_gets_its_loss_and_accuracy_plots():
    plots = {p.name: p for p in plots_for(METRICS)}
    assert list(plots) == ["reward_loss", "reward_accuracy"]
    assert (plots["reward_loss"].title, plots["reward_loss"].left, plots["reward_loss"].left_label) == \
        ("Pairwise loss", (("loss", "train"), ("eval/loss", "held-out")), "loss")
    accuracy = plots["reward_accuracy"]
    assert accuracy.right == (("margin", "train margin"), ("eval/margin", "held-out margin"))
    assert accuracy.right_label == "mean margin"


def test_the_page_shows_the_first_12_held_out_prompts_before_and_after(tmp_path):
    import json

    from lora_ppo.report import write_report

    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 1, "objective/scores": 0.5}) + "\n")
    for name, word in (("eval_before.jsonl", "old"), ("eval_after.jsonl", "new")):
        records = [{"prompt": f"prompt {i}", "completion": f"{word} {i}", "score": 0.1 * i, "sample": s}
                   for i in range(14) for s in (0, 1)]
        (tmp_path / name).write_text("".join(json.dumps(r) + "\n" for r in records))
    page = write_report(tmp_path).read_text()
    table = page.split("Held-out completions, before and after training")[1]
    assert table.count("<tr>") == 1 + 12  # the header, then one row per prompt (its first sample)
    assert "<td class='text'>prompt 11</td><td class='text'>old 11</td>" in table and "prompt 12" not in table
    assert "<td class='text'>new 11</td>" in table


def test_a_right_axis_with_negative_values_keeps_them_in_view(drawn):
    """The right axis starts at 0 only where its values are positive: an explained variance below 0
    (a critic worse than its mean) stays on the plot."""
    metrics = [{"step": s, "loss/value": 1.0 / s, "value/explained_var": -0.5 + 0.2 * s} for s in range(1, 4)]
    render_plot(next(p for p in plots_for(metrics) if p.name == "value"), metrics)
    (fig,) = drawn
    assert fig.axes[1].get_ylim()[0] <= -0.3


def test_each_figure_is_drawn_headless_and_closed(monkeypatch):
    """A report draws a dozen figures: each is closed (pyplot warns past 20 open, and holds their
    memory), and on the headless Agg backend whatever backend the session had."""
    import matplotlib
    import matplotlib.pyplot as plt

    matplotlib.use("svg")
    open_before = plt.get_fignums()
    render_plot(plots_for(METRICS)[0], METRICS)
    assert plt.get_fignums() == open_before and matplotlib.get_backend().lower() == "agg"


def _fake_run(tmp_path, metrics, summary=None):
    import json

    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(m) + "\n" for m in metrics))
    if summary is not None:
        (tmp_path / "summary.json").write_text(json.dumps(summary))
    return tmp_path


def test_the_page_names_the_last_steps_kl_each_alarm_and_its_steps(tmp_path):
    from lora_ppo.report import write_report

    metrics = [{"step": 1, "objective/kl": 0.5, "alarm/kl_runaway": 0.0},
               {"step": 2, "objective/kl": 4.25, "alarm/kl_runaway": 1.0, "alarm/entropy_collapse": 0.0},
               {"step": 3, "objective/kl": 7.5, "alarm/kl_runaway": 1.0, "alarm/entropy_collapse": 1.0}]
    page = write_report(_fake_run(tmp_path, metrics)).read_text()
    assert "3 steps; final KL 7.50 nats per response; not finished (no summary.json yet)" in page
    assert "<div class='alarm'><b>kl_runaway</b> at steps 2, 3</div>" in page
    assert "<div class='alarm'><b>entropy_collapse</b> at steps 3</div>" in page
    assert page.count("class='alarm'") == 2 and "No alarm was raised." not in page
    quiet = write_report(_fake_run(tmp_path, metrics[:1])).read_text()
    assert "No alarm was raised." in quiet and "class='alarm'" not in quiet


def test_the_held_out_table_has_a_row_per_score_and_no_change_where_one_side_is_missing(tmp_path):
    from lora_ppo.report import write_report

    summary = {"steps": 3, "heldout_score_before": 0.25, "heldout_score_after": 0.5,
               "heldout_score_se_before": 0.03, "heldout_score_se_after": 0.04,
               "heldout_textblob_before": 0.125, "heldout_textblob_after": None,
               "heldout_textblob_se_before": None, "heldout_textblob_se_after": None,
               "final_kl": 1.0, "wall_time_s": 12.0, "peak_memory_gb": 1.5}
    page = write_report(_fake_run(tmp_path, [{"step": 1}], summary)).read_text()
    table = page.split("<h2>Held-out scores</h2>")[1].split("</table>")[0]
    assert table.count("<tr>") == 3  # the header, score, textblob: no row for a standard error
    assert ("<tr><td>score (reward)</td><td class='num'>0.250 ± 0.030</td><td class='num'>0.500 ± 0.040</td>"
            "<td class='num up'>+0.250</td></tr>") in table
    assert ("<tr><td>textblob</td><td class='num'>0.125 ± n/a</td><td class='num'>n/a ± n/a</td>"
            "<td class='num '></td></tr>") in table


def test_completions_without_a_sample_number_are_each_prompts_first(tmp_path):
    """Records written before `sample` was recorded (one completion per prompt) still show."""
    import json

    from lora_ppo.report import write_report

    run = _fake_run(tmp_path, [{"step": 1}])
    (run / "eval_before.jsonl").write_text(json.dumps({"prompt": "p", "completion": "old", "score": 0.0}) + "\n")
    (run / "eval_after.jsonl").write_text(json.dumps({"prompt": "p", "completion": "new", "score": 1.0}) + "\n")
    page = write_report(run).read_text()
    assert ("<td class='text'>p</td><td class='text'>old</td><td class='num'>0.000</td><td class='text'>new</td>"
            "<td class='num'>1.000</td>") in page


def test_a_summary_that_is_not_json_is_one_line_naming_it(tmp_path):
    from lora_ppo.errors import RecipeError
    from lora_ppo.report import write_report

    run = _fake_run(tmp_path, [{"step": 1}])
    (run / "summary.json").write_text("{bad")
    with pytest.raises(RecipeError) as err:
        write_report(run)
    assert str(err.value).startswith(f"report: {run / 'summary.json'} is not the JSON a run writes (Expecting ")
    assert not (run / "report").exists()
