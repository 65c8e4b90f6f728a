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
