"""Each alarm fires on a synthetic metrics stream showing its failure, says which recipe fields to
look at, and a healthy run raises none."""

from __future__ import annotations

import pytest

from lora_ppo.alarms import (ALARMS, LOGPROB_TOLERANCE, AlarmSettings, _slope, check_alarms,
                             first_step_logprob_error)

SETTINGS = AlarmSettings(max_new_tokens=20, target_kl=None, side_metrics=("textblob",))
BF16, FP16 = AlarmSettings.for_dtype("bfloat16", 20), AlarmSettings.for_dtype("float16", 20)


def healthy(steps: int = 8) -> list[dict]:
    """A run like the quickstart's: score and side metric rise together, KL moderate, clipping low."""
    return [{"step": i + 1, "objective/scores": 0.2 + 0.05 * i, "objective/textblob": 0.1 + 0.04 * i,
             "objective/kl": [0.0, 0.9, 1.0, 1.0, 2.3, 3.0, 4.8, 4.9][i % 8], "policy/entropy": 1.2 - 0.05 * i,
             "policy/clipfrac": 0.05, "policy/ratio": 1.01, "response/length": 15.0, "response/stopped_frac": 0.4}
            for i in range(steps)]


def with_values(key: str, values: list[float], base=None) -> list[dict]:
    rows = base or healthy(len(values))
    return [{**row, key: value} for row, value in zip(rows, values)]


def names(history, settings=SETTINGS) -> list[str]:
    return [alarm.name for alarm in check_alarms(history, settings)]


def test_a_healthy_run_raises_nothing():
    assert names(healthy()) == [] and names([]) == []


@pytest.mark.parametrize("history, settings, expected, field", [
    (with_values("objective/kl", [3.0, 5.0, 7.0, 9.0, 12.0]), SETTINGS, "kl_runaway", "ppo.kl_coef"),
    (with_values("objective/kl", [1.0, 2.0, 9.0]), AlarmSettings(20, target_kl=2.0), "kl_runaway", "ppo.target_kl"),
    (with_values("objective/kl", [0.0, -0.5, -0.6]), SETTINGS, "negative_kl", "rollout.temperature"),
    (with_values("policy/entropy", [1.2, 0.8, 0.04]), SETTINGS, "entropy_collapse", "ppo.entropy_coef"),
    (with_values("policy/clipfrac", [0.05, 0.1, 0.45]), SETTINGS, "overclipping", "ppo.learning_rate"),
    (with_values("policy/ratio", [1.0, 1.05, 1.6]), SETTINGS, "overclipping", "ppo.num_epochs"),
    (with_values("response/length", [12.0, 6.0, 1.0]), SETTINGS, "empty_responses", "rollout.stop_token"),
    (with_values("response/stopped_frac", [0.5, 0.2, 0.0], with_values("response/length", [14, 18, 20])), SETTINGS,
     "pinned_length", "rollout.missing_eos_penalty"),
    (with_values("objective/textblob", [0.40, 0.38, 0.33, 0.30, 0.25]), SETTINGS, "reward_gaming", "ppo.kl_coef"),
    (with_values("check/logprob_mean_diff", [1e-6, 2e-6, 5e-3]), SETTINGS, "logprob_mismatch",
     "rollout.logprobs_from_generation"),
    (with_values("check/generation_logprob_diff", [1e-5, 2e-5, 0.03]), SETTINGS, "sampling_mismatch",
     "rollout.compile"),
])
def test_each_alarm_fires_on_its_failure_and_names_what_to_change(history, settings, expected, field):
    alarms = check_alarms(history, settings)
    assert [a.name for a in alarms] == [expected]
    assert field in alarms[0].message and "\n" not in alarms[0].message


def test_entropy_low_from_the_first_step_is_not_said_to_have_fallen():
    (started_low,) = check_alarms([{"step": 1, "policy/entropy": 0.037}], SETTINGS)
    assert "entropy is 0.037 nats per token, under 0.05 since the first step" in started_low.message
    assert "from" not in started_low.message.split(":")[0]
    (fell,) = check_alarms(with_values("policy/entropy", [1.2, 0.8, 0.04]), SETTINGS)
    assert "entropy fell to 0.040 nats per token (from 1.200)" in fell.message


def test_entropy_collapse_counts_a_fall_below_a_tenth_of_the_start():
    # Above the 0.05-nat floor all along: a fall to under a tenth of the first step's entropy is the
    # alarm, a fall to an eighth is not.
    assert "entropy_collapse" in names(with_values("policy/entropy", [2.0, 1.0, 0.15]))
    assert "entropy_collapse" not in names(with_values("policy/entropy", [2.0, 1.0, 0.25]))


def test_the_reward_gaming_trend_is_a_least_squares_slope():
    assert _slope([1.0, 3.0, 5.0, 7.0]) == pytest.approx(2.0)
    assert _slope([2.0, 0.0, 4.0]) == pytest.approx(1.0)  # (-1 * 0 + 0 * -2 + 1 * 2) / 2
    assert _slope([5.0]) == 0.0  # one point: no trend


def test_alarms_need_a_trend_not_a_single_value():
    # Pinned from the first step (the quickstart's openers run to the limit by design): no collapse.
    assert "pinned_length" not in names(with_values("response/stopped_frac", [0.0, 0.0, 0.0],
                                                    with_values("response/length", [20, 20, 20])))
    # Short from the first step: not a collapse either.
    assert "empty_responses" not in names(with_values("response/length", [1.0, 1.0, 1.0]))
    # KL growing as the policy learns, but not high.
    assert "kl_runaway" not in names(with_values("objective/kl", [1.0, 2.3, 3.0, 4.8, 4.9]))
    # One negative step is noise.
    assert "negative_kl" not in names(with_values("objective/kl", [0.5, 0.4, -0.5]))
    # The side metric falls while the reward falls too: not gaming.
    falling = with_values("objective/scores", [0.5, 0.4, 0.3, 0.2, 0.1],
                          with_values("objective/textblob", [0.40, 0.38, 0.33, 0.30, 0.25]))
    assert "reward_gaming" not in names(falling)


def test_skipped_steps_are_not_read():
    history = with_values("objective/kl", [6.0, 5.0, 7.0, 9.0, 12.0])
    assert "kl_runaway" in names(history)
    history[-1]["guard/skipped"] = 1.0
    assert "kl_runaway" not in names(history)


def test_every_alarm_is_documented():
    from pathlib import Path

    monitoring = (Path(__file__).resolve().parents[1] / "docs" / "monitoring.md").read_text(encoding="utf-8")
    assert [name for name in ALARMS if f"| `{name}` |" not in monitoring] == []


def test_logprob_mismatch_follows_the_compute_dtype():
    # bf16 recomputation noise (1e-3 per token) is no alarm there, and is one in float32.
    history = with_values("check/logprob_mean_diff", [1e-3, 1.5e-3, 5e-3])
    assert "logprob_mismatch" in names(history)
    assert "logprob_mismatch" not in names(history, BF16)


def test_logprob_mismatch_under_a_compiled_update_says_to_turn_it_off():
    """What an H200 measured with ppo.compile_update (0.040 nats per token in bfloat16): the alarm names
    the setting, not the scoring switches it names otherwise."""
    history = with_values("check/logprob_mean_diff", [0.0, 0.0398])
    (plain,) = [a for a in check_alarms(history, BF16) if a.name == "logprob_mismatch"]
    history[-1]["update/compiled_graphs"] = 2.0
    (compiled,) = [a for a in check_alarms(history, BF16) if a.name == "logprob_mismatch"]
    assert "ppo.compile_update is on" in compiled.message and "score_roles_together" not in compiled.message
    assert "ppo.compile_update" not in plain.message and "score_roles_together" in plain.message


def test_the_first_step_stops_only_far_past_the_limit():
    limit = LOGPROB_TOLERANCE["float32"]
    assert first_step_logprob_error({}, limit) is None  # no update ran (guard): nothing to judge
    assert first_step_logprob_error({"check/logprob_mean_diff": 5 * limit}, limit) is None  # an alarm only
    assert first_step_logprob_error({"check/logprob_mean_diff": 10 * limit}, limit) is None  # ten times: not past
    assert first_step_logprob_error({"check/logprob_mean_diff": 15 * limit}, limit) is not None
    error = first_step_logprob_error({"check/logprob_mean_diff": 0.3, "check/logprob_max_diff": 2.0}, limit)
    assert error is not None and "0.3 nats per token" in error and "largest 2" in error and "\n" not in error


def test_sampling_mismatch_follows_the_compute_dtype():
    # bf16's KV-cached decoding rounds ~0.045 nats a token off a full forward on the embedded model
    # (docs/monitoring.md): that is not an alarm in bf16; the H100's compiled 4-bit decode of a
    # random 8B read 3.5 (bench/README.md), which is.
    assert (BF16.logprob_tolerance, BF16.sampling_gap_limit) == (2e-2, 0.5)
    assert "sampling_mismatch" not in names(with_values("check/generation_logprob_diff", [0.045, 0.05]), BF16)
    assert names(with_values("check/generation_logprob_diff", [0.045, 3.5]), BF16) == ["sampling_mismatch"]
    assert "sampling_mismatch" in names(with_values("check/generation_logprob_diff", [0.045, 0.05]),
                                        AlarmSettings.for_dtype("float32", 20))


@pytest.mark.parametrize("alarm, key, values, settings, fires", [
    # "grew 4 steps in a row to over 8 nats": four rising values are enough, the four after a fall
    # too; 8.0 itself is not over, and a flat KL is not growing.
    ("kl_runaway", "objective/kl", [5.0, 6.0, 7.0, 8.5], SETTINGS, True),
    ("kl_runaway", "objective/kl", [6.0, 20.0, 1.0, 2.0, 3.0, 9.0], SETTINGS, True),
    ("kl_runaway", "objective/kl", [5.0, 6.0, 7.0, 8.0], SETTINGS, False),
    ("kl_runaway", "objective/kl", [9.0, 9.0, 9.0, 9.0], SETTINGS, False),
    # "over 3x ppo.target_kl": 3 x 6.0 = 18 is the line (a flat KL, so only that rule can fire).
    ("kl_runaway", "objective/kl", [18.5, 18.5], AlarmSettings(20, target_kl=6.0), True),
    ("kl_runaway", "objective/kl", [18.0, 18.0], AlarmSettings(20, target_kl=6.0), False),
    ("kl_runaway", "objective/kl", [10.0, 10.0], AlarmSettings(20, target_kl=6.0), False),
    # "below -0.2 two steps in a row": two steps are enough, -0.2 itself is not below, -0.3 is.
    ("negative_kl", "objective/kl", [-0.3, -0.3], SETTINGS, True),
    ("negative_kl", "objective/kl", [-0.2, -0.5], SETTINGS, False),
    ("negative_kl", "objective/kl", [-0.5, -0.2], SETTINGS, False),
    ("negative_kl", "objective/kl", [-0.5, -0.5, 0.1], SETTINGS, False),  # it recovered: the newest step reads
    # "under 0.05 nats per token, or under a tenth of the first step's": neither limit itself is under,
    # and an entropy that recovered from a low start is no collapse.
    ("entropy_collapse", "policy/entropy", [0.05, 0.05], SETTINGS, False),
    ("entropy_collapse", "policy/entropy", [2.0, 0.2], SETTINGS, False),
    ("entropy_collapse", "policy/entropy", [0.04, 0.5], SETTINGS, False),
    # "clip fraction above 0.3, or the mean ratio more than 0.2 from 1".
    ("overclipping", "policy/clipfrac", [0.05, 0.3], SETTINGS, False),
    ("overclipping", "policy/clipfrac", [0.05, 0.31], SETTINGS, True),
    ("overclipping", "policy/ratio", [1.0, 1.3], SETTINGS, True),
    ("overclipping", "policy/ratio", [1.0, 0.7], SETTINGS, True),
    ("overclipping", "policy/ratio", [1.0, 1.19], SETTINGS, False),
    # "shrank under 1.5 tokens on average", from 1.5 or more: 2 tokens are short, not empty.
    ("empty_responses", "response/length", [12.0, 2.0], SETTINGS, False),
    ("empty_responses", "response/length", [12.0, 1.5], SETTINGS, False),
    ("empty_responses", "response/length", [12.0, 1.4], SETTINGS, True),
    ("empty_responses", "response/length", [1.5, 1.0], SETTINGS, True),
    # "past its limit" (the limit by compute dtype), for the self-check and the sampling gap.
    ("logprob_mismatch", "check/logprob_mean_diff", [0.0, 1e-3], SETTINGS, False),
    ("logprob_mismatch", "check/logprob_mean_diff", [0.0, 1.5e-3], SETTINGS, True),
    ("logprob_mismatch", "check/logprob_mean_diff", [0.0, 2e-2], BF16, False),
    ("logprob_mismatch", "check/logprob_mean_diff", [0.0, 3e-2], BF16, True),
    ("logprob_mismatch", "check/logprob_mean_diff", [0.0, 3e-2], FP16, True),
    ("sampling_mismatch", "check/generation_logprob_diff", [0.0, 1e-2], SETTINGS, False),
    ("sampling_mismatch", "check/generation_logprob_diff", [0.0, 1.5e-2], SETTINGS, True),
    ("sampling_mismatch", "check/generation_logprob_diff", [0.0, 0.5], BF16, False),
    ("sampling_mismatch", "check/generation_logprob_diff", [0.0, 0.75], BF16, True),
    ("sampling_mismatch", "check/generation_logprob_diff", [0.0, 0.75], FP16, True),
])
def test_each_threshold_is_where_the_docs_put_it(alarm, key, values, settings, fires):
    raised = names(with_values(key, values), settings)
    assert (alarm in raised) is fires, (key, values, raised)


def test_alarm_messages_read_the_newest_step():
    history = with_values("objective/kl", [-0.5, -0.5, -0.5])
    for row, floor in zip(history, [0.11, 0.22, 0.33]):
        row["check/kl_noise_floor"] = floor
    (negative,) = check_alarms(history, SETTINGS)
    assert "about 0.33 nats a response" in negative.message
    # An earlier step's compiled update says nothing of this one's.
    bf16_history = with_values("check/logprob_mean_diff", [0.0, 0.0, 0.0398])
    bf16_history[1]["update/compiled_graphs"] = 2.0
    (mismatch,) = [a for a in check_alarms(bf16_history, BF16) if a.name == "logprob_mismatch"]
    assert "ppo.compile_update is on" not in mismatch.message


def pinned_names(lengths, stopped, max_new_tokens=50):
    history = with_values("response/stopped_frac", stopped, with_values("response/length", lengths))
    return names(history, AlarmSettings(max_new_tokens=max_new_tokens))


def test_pinned_length_needs_runs_to_the_limit_that_no_longer_stop():
    # 98% of rollout.max_new_tokens (49 of 50) or more, under 5% stopping, where 20% or more stopped at
    # the first step (the baseline, not the step after it): the alarm.
    assert "pinned_length" in pinned_names([20.0, 49.0], [0.3, 0.0])
    assert "pinned_length" in pinned_names([20.0, 45.0, 50.0], [0.3, 0.1, 0.0])
    assert "pinned_length" in pinned_names([20.0, 49.0], [0.2, 0.0])  # 20% is "20% or more"
    assert "pinned_length" not in pinned_names([20.0, 48.9], [0.3, 0.0])  # short of 98%
    assert "pinned_length" not in pinned_names([20.0, 50.0], [0.3, 0.05])  # 5% still stop
    assert "pinned_length" not in pinned_names([20.0, 50.0], [0.3, 0.3])  # long, but they stop as before
    # A history without response/stopped_frac (a metrics.jsonl of another tool): nothing to judge.
    assert names([{"step": 1, "response/length": 20.0}, {"step": 2, "response/length": 50.0}]) == []


def test_reward_gaming_reads_the_last_five_steps_and_falling_trends():
    history = healthy(7)  # scores 0.20 .. 0.50; the side metric falls over the last five steps only
    for row, value in zip(history[2:], [0.40, 0.38, 0.33, 0.30, 0.25]):
        row["objective/textblob"] = value
    (alarm,) = check_alarms(history, SETTINGS)
    assert "the reward rose (0.300 -> 0.500) over 5 steps" in alarm.message
    # A side metric that spiked and came back has no trend (slope exactly 0), though it fell from its top.
    spiked = with_values("objective/textblob", [0.5, 0.5, 3.0, 0.5, 0.5])
    assert _slope([0.5, 0.5, 3.0, 0.5, 0.5]) == 0.0 and names(spiked) == []
    # A flat reward (slope exactly 0) is not rising.
    flat = with_values("objective/scores", [0.5] * 5, with_values("objective/textblob", [0.40, 0.38, 0.33, 0.30, 0.25]))
    assert names(flat) == []
    # The side metric must end more than 0.05 below its top: 0.05 exactly is not more, 0.08 is.
    assert names(with_values("objective/textblob", [0.05, 0.04, 0.03, 0.02, 0.0])) == []
    assert names(with_values("objective/textblob", [0.08, 0.06, 0.04, 0.02, 0.0])) == ["reward_gaming"]
    # In negative numbers (a sentiment score below 0) a fall is still a fall.
    assert names(with_values("objective/textblob", [-0.2, -0.3, -0.4, -0.5, -0.6])) == ["reward_gaming"]


def test_two_side_metrics_falling_give_one_alarm():
    settings = AlarmSettings(20, side_metrics=("textblob", "vader"))
    falling = [0.40, 0.38, 0.33, 0.30, 0.25]
    history = with_values("objective/vader", falling, with_values("objective/textblob", falling))
    (alarm,) = check_alarms(history, settings)
    assert alarm.name == "reward_gaming" and "while textblob," in alarm.message
