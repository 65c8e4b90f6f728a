"""The lines printed at the end of a run name only the adapters the run has."""

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
