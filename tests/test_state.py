"""TrainState survives its JSON round trip exactly (a resumed run continues from it)."""

from __future__ import annotations

import json

import pytest

from lora_ppo.state import PromptPosition, TrainState


def test_json_round_trip_is_exact():
    state = TrainState(step=7, kl_coef=0.0437, score_moments=(0.25, 1.5, 96), consecutive_skips=1,
                       last_skip_reason="non-finite advantages at step 6", eval_before={"score": 0.2},
                       last_metrics={"objective/kl": 3.0}, prompt_position=PromptPosition(2, 5),
                       metrics_lines=7, samples_lines=12)
    again = TrainState.from_json(json.loads(json.dumps(state.to_json())))
    assert again == state and isinstance(again.prompt_position, PromptPosition)


def test_a_record_missing_a_field_is_refused():
    record = TrainState().to_json()
    del record["kl_coef"]
    with pytest.raises(KeyError, match="kl_coef"):
        TrainState.from_json(record)


def test_a_fresh_state_is_a_run_that_has_not_started():
    """What a new run starts from (the trainer sets only the KL coefficient, from the recipe): no
    step, no skip, no line of metrics or samples written, the first prompt of the first pass, no
    score counted (the placeholder variance 1 carries no weight: count 0)."""
    from lora_ppo.state import AdapterTrainState

    state = TrainState()
    assert (state.step, state.kl_coef, state.consecutive_skips, state.metrics_lines, state.samples_lines) == \
        (0, 0.0, 0, 0, 0)
    assert state.prompt_position == PromptPosition(0, 0) == (0, 0)
    assert state.score_moments == (0.0, 1.0, 0) and state.source_moments == {}
    assert (state.eval_before, state.last_metrics, state.last_skip_reason) == (None, {}, "")
    stage = AdapterTrainState()
    assert (stage.step, stage.position, stage.metrics_lines, stage.eval_before, stage.last_metrics) == \
        (0, (0, 0), 0, None, {})


def test_each_normalised_sources_moments_survive_the_round_trip():
    state = TrainState(source_moments={"vader": (0.25, 1.5, 96), "length": (-3.0, 0.5, 7)})
    again = TrainState.from_json(json.loads(json.dumps(state.to_json())))
    assert again.source_moments == {"vader": (0.25, 1.5, 96), "length": (-3.0, 0.5, 7)}
    assert all(isinstance(m[2], int) for m in again.source_moments.values())
