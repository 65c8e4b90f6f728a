"""The parity check's numbers against ones worked out by hand, its greedy probes against a plain
token-by-token loop, and its limits as docs/export.md states them."""

from __future__ import annotations

import math
import re
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from lora_ppo.parity import TOLERANCES, ParityReport, ProbeReference, Tolerance, compare, reference_outputs

DOCS = Path(__file__).resolve().parents[2] / "docs" / "export.md"
DOC_DTYPES = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}


class FixedLogits(torch.nn.Module):
    """A 'model' whose logits for a whole sequence are given by hand, keyed by its token ids."""

    def __init__(self, logits_by_ids: dict[tuple[int, ...], list[list[float]]]):
        super().__init__()
        self.device_anchor = torch.nn.Parameter(torch.zeros(1))
        self.logits_by_ids = logits_by_ids

    def forward(self, input_ids, use_cache=False):
        return SimpleNamespace(logits=torch.tensor([self.logits_by_ids[tuple(input_ids[0].tolist())]]))


def _kl(ref_logits: list[float], logits: list[float]) -> float:
    """KL(softmax(ref) || softmax(logits)) in plain Python."""
    def log_softmax(xs):
        top = max(xs)
        log_total = top + math.log(sum(math.exp(x - top) for x in xs))
        return [x - log_total for x in xs]

    ref_logp, logp = log_softmax(ref_logits), log_softmax(logits)
    return sum(math.exp(r) * (r - e) for r, e in zip(ref_logp, logp))


def test_compare_reports_the_numbers_worked_out_by_hand():
    # Probe A: 2 prompt tokens + 2 greedy ones; the positions predicting the greedy tokens are 1 and 2.
    ref_a = [[0, 0, 0], [2, 0, 0], [0, 1, 0], [0, 0, 5]]
    exp_a = [[0, 0, 0], [0, 2, 0], [0, 1, 0], [0, 0, 2]]  # disagrees at 1, agrees at 2; |diff| up to 3 at 3
    # Probe B: 1 prompt token + 2 greedy ones; positions 0 and 1 predict them; the last differs but is no prediction.
    ref_b = [[1, 0, 0], [0, 0, 1], [0, 0, 0]]
    exp_b = [[1, 0, 0], [0, 0, 1], [0, 1, 0]]
    refs = [ProbeReference(ids=torch.tensor([5, 6, 7, 8]), prompt_len=2, logits=torch.tensor(ref_a, dtype=torch.float)),
            ProbeReference(ids=torch.tensor([1, 2, 3]), prompt_len=1, logits=torch.tensor(ref_b, dtype=torch.float))]
    model = FixedLogits({(5, 6, 7, 8): exp_a, (1, 2, 3): exp_b})
    tolerance = Tolerance(max_kl=1.0, max_logit_diff=10.0, min_greedy_agreement=0.5)

    report = compare(model, refs, tolerance, "reference", "exported", tokenizer_matches=True)

    kls = [_kl(r, e) for r, e in zip(ref_a + ref_b, exp_a + exp_b)]
    assert report.n_prompts == 2 and report.n_positions == 7
    assert report.kl_mean == pytest.approx(sum(kls) / 7, rel=1e-5)
    assert report.kl_max == pytest.approx(max(kls), rel=1e-5)
    assert report.max_logit_diff == 3.0
    assert report.greedy_agreement == 3 / 4  # A: 1 of 2, B: 2 of 2
    assert report.passed and report.tolerance == tolerance


# Llama returns the cache it was handed whatever use_cache says, Qwen2 only with use_cache=True;
# GPT-2 adds learned positions, so a wrong position id changes its tokens.
@pytest.mark.parametrize("architecture", ["llama", "qwen2", "gpt2"])
def test_reference_probes_are_greedy_continuations_of_a_plain_forward(architecture, tmp_path):
    from tests.architectures import build_model

    model = build_model(architecture, tmp_path, vocab=64).eval()
    prompts = [torch.tensor([5, 9, 11, 3]), torch.tensor([7, 2]), torch.tensor([4, 4, 8])]  # unequal: padding

    refs = reference_outputs(model, prompts)

    with torch.no_grad():
        for prompt, ref in zip(prompts, refs):
            ids = prompt.clone()
            for _ in range(16):  # docs/export.md: "greedily continues each prompt by 16 tokens"
                ids = torch.cat([ids, model(input_ids=ids[None]).logits[0, -1].argmax()[None]])
            assert ref.prompt_len == len(prompt) and torch.equal(ref.ids, ids)
            torch.testing.assert_close(ref.logits, model(input_ids=ids[None]).logits[0], rtol=0, atol=1e-5)


def _documented_limits() -> dict[torch.dtype, Tolerance]:
    rows = re.findall(r"^\| (fp32|fp16|bf16) \| ≤ ([\d.e-]+) \| ≤ ([\d.]+) \| ≥ (\d+)% \|$",
                      DOCS.read_text(encoding="utf-8"), re.M)
    assert len(rows) == 3, rows
    return {DOC_DTYPES[name]: Tolerance(max_kl=float(kl), max_logit_diff=float(diff),
                                        min_greedy_agreement=int(agree) / 100)
            for name, kl, diff, agree in rows}


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=["fp32", "fp16", "bf16"])
def test_the_documented_limits_pass_at_the_limit_and_fail_past_it(dtype):
    limits = _documented_limits()[dtype]
    at_limit = dict(reference="ref", exported="exp", n_prompts=8, n_positions=100, kl_mean=limits.max_kl,
                    kl_max=1.0, max_logit_diff=limits.max_logit_diff,
                    greedy_agreement=limits.min_greedy_agreement, tokenizer_matches=True, tolerance=TOLERANCES[dtype])
    assert ParityReport(**at_limit).passed
    for field, past in [("kl_mean", limits.max_kl * 1.01), ("max_logit_diff", limits.max_logit_diff * 1.01),
                        ("greedy_agreement", limits.min_greedy_agreement - 0.01)]:
        assert not ParityReport(**{**at_limit, field: past}).passed, field


@pytest.mark.parametrize("matches, line", [(True, "same ids"), (False, "DIFFERENT ids"), (None, None)])
def test_the_report_says_whether_the_tokenizer_matched(matches, line):
    report = ParityReport(reference="ref", exported="exp", n_prompts=8, n_positions=100, kl_mean=0.0, kl_max=0.0,
                          max_logit_diff=0.0, greedy_agreement=1.0, tokenizer_matches=matches,
                          tolerance=TOLERANCES[torch.float32])
    tokenizer_lines = [ln.split() for ln in report.format().splitlines() if ln.strip().startswith("tokenizer")]
    assert tokenizer_lines == ([] if line is None else [["tokenizer", *line.split()]])
