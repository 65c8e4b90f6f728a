"""The end of a run: summary.json's held-out scores with their standard errors, and the lines printed,
which name only the adapters the run has."""

from __future__ import annotations

from lora_ppo.summary import build_summary, format_summary


def _summary(adapters):
    return build_summary(10, {"score": 0.2, "score_se": 0.03, "textblob": 0.1},
                         {"score": 0.6, "score_se": 0.04, "textblob": 0.4}, 3.0, 200.0, 2.5, "runs/x", adapters)


def test_ppo_run_names_policy_and_value():
    lines = format_summary(_summary(["policy", "value"])).splitlines()
    assert lines[0] == "held-out mean score: 0.200 (± 0.030) -> 0.600 (± 0.040)"
    assert "held-out textblob: 0.100 -> 0.400" in lines
    assert lines[-1] == "adapters: runs/x/final/policy and final/value"


def test_critic_free_run_names_no_value_adapter():
    assert format_summary(_summary(["policy"])).splitlines()[-1] == "adapters: runs/x/final/policy"


def test_summary_json_holds_each_held_out_score_before_and_after_with_its_standard_error():
    """The score first, then each other score; a standard error is a field of its score, never a
    score of its own (no `heldout_score_se_se_*`)."""
    summary = _summary(["policy", "value"])
    assert summary == {
        "steps": 10,
        "heldout_score_before": 0.2, "heldout_score_after": 0.6,
        "heldout_score_se_before": 0.03, "heldout_score_se_after": 0.04,
        "heldout_textblob_before": 0.1, "heldout_textblob_after": 0.4,
        "heldout_textblob_se_before": None, "heldout_textblob_se_after": None,
        "final_kl": 3.0, "wall_time_s": 200.0, "peak_memory_gb": 2.5, "output_dir": "runs/x",
        "adapters": ["policy", "value"],
    }
    assert list(summary)[1:3] == ["heldout_score_before", "heldout_score_after"]


def test_a_run_without_a_held_out_evaluation_says_so_instead_of_n_a():
    """train.eval: false printed "held-out mean score: n/a -> n/a", which reads as a failed evaluation."""
    lines = format_summary(build_summary(2, {}, {}, 0.5, 8.0, 1.5, "runs/x", ["policy"])).splitlines()
    assert lines[0] == "held-out: not evaluated (train.eval: false, or no held-out prompts)"
    assert lines[1] == "final KL: 0.500"
    # A score measured only before (a run stopped in its last evaluation) still shows what there is.
    half = build_summary(2, {"score": 0.25}, {}, None, 8.0, 1.5, "runs/x", ["policy"])
    assert format_summary(half).splitlines()[:2] == ["held-out mean score: 0.250 -> n/a", "final KL: n/a"]
