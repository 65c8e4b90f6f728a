"""The parity verdict on its own: limits follow the coarser dtype, and NaN never passes."""

from __future__ import annotations

import math

import pytest
import torch

from lora_ppo.parity import TOLERANCES, ParityReport, tolerance_for


def _report(**changes) -> ParityReport:
    values = dict(reference="ref", exported="exp", n_prompts=8, n_positions=100, kl_mean=1e-8, kl_max=1e-7,
                  max_logit_diff=1e-5, greedy_agreement=1.0, tokenizer_matches=True,
                  tolerance=TOLERANCES[torch.float32])
    values.update(changes)
    return ParityReport(**values)


def test_limits_follow_the_coarser_dtype():
    assert tolerance_for(torch.float32, torch.float32) == TOLERANCES[torch.float32]
    assert tolerance_for(torch.float32, torch.bfloat16) == TOLERANCES[torch.bfloat16]
    assert tolerance_for(torch.float16, torch.float32) == TOLERANCES[torch.float16]
    assert tolerance_for(torch.float16, torch.bfloat16) == TOLERANCES[torch.bfloat16]
    # The order of the two does not matter.
    assert tolerance_for(torch.float32, torch.float16) == TOLERANCES[torch.float16]
    assert tolerance_for(torch.bfloat16, torch.float16) == TOLERANCES[torch.bfloat16]
    assert tolerance_for(torch.bfloat16, torch.float32) == TOLERANCES[torch.bfloat16]


@pytest.mark.parametrize("changes, phrase", [
    ({"kl_mean": math.nan}, "mean KL"),
    ({"kl_mean": 2e-5}, "mean KL"),
    ({"max_logit_diff": math.inf}, "max |logit diff|"),
    ({"greedy_agreement": 0.97}, "greedy agreement"),
    ({"tokenizer_matches": False}, "tokenizer"),
])
def test_each_limit_fails_on_its_own(changes, phrase):
    report = _report(**changes)
    assert not report.passed and len(report.failures()) == 1 and phrase in report.failures()[0]
    assert "FAILED" in report.format()


def test_a_clean_report_passes():
    assert _report().passed and _report(tokenizer_matches=None).passed
