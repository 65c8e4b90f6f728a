"""The parity check: does an exported model reproduce the adapter-on-base model? Both are run
on a few probe prompts and compared position by position (KL, logit differences, greedy tokens).
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Optional

import torch

from lora_ppo.config import DataConfig
from lora_ppo.data import text_prompt_format
from lora_ppo.devices import model_device
from lora_ppo.model_checks import cache_keyword, returned_cache

# Probe prompts for the parity check: short, mixed text any tokenizer can encode. With
# data.chat_template (and data.system_prompt) they are formatted as the policy saw its prompts.
PROBE_PROMPTS = (
    "The movie started slowly, but",
    "Write one sentence about the sea.",
    "Q: What is 12 plus 30?\nA:",
    "def add(a, b):\n    return",
    "My favourite part of the film was",
    "Honestly, the acting in this sequel",
    "Here is a short list of fruits: apple,",
    "The weather today is",
)
PROBE_NEW_TOKENS = 16  # greedy continuation length per probe


@dataclass(frozen=True)
class Tolerance:
    """Parity limits: mean KL(reference || exported) per position in nats, the largest absolute
    logit difference, and the share of greedy next tokens that must agree."""

    max_kl: float
    max_logit_diff: float
    min_greedy_agreement: float


# Limits by the coarsest float format on either side of the comparison (the export dtype, or the
# reference's compute dtype, which is bf16 for a 4-bit base on most GPUs). A correct fp32 merge
# differs from adapter-on-base only by summation order, so the fp32 limits sit about 100x above
# what a correct merge gives and still far below any real merge error. Casting the weights to
# fp16 (11-bit mantissa) or bf16 (8-bit) is a much larger, legitimate change that can flip
# near-tied argmaxes; their limits sit a few times above what correct casts gave (bench/README.md
# and docs/export.md have the measured values). Because they are this loose, the merge itself is
# always checked first in fp32, before the cast (see lora_ppo.export).
TOLERANCES: dict[torch.dtype, Tolerance] = {
    torch.float32: Tolerance(max_kl=1e-5, max_logit_diff=1e-2, min_greedy_agreement=0.98),
    torch.float16: Tolerance(max_kl=1e-2, max_logit_diff=1.0, min_greedy_agreement=0.9),
    torch.bfloat16: Tolerance(max_kl=5e-2, max_logit_diff=4.0, min_greedy_agreement=0.85),
}
_COARSENESS = {torch.float32: 0, torch.float16: 1, torch.bfloat16: 2}


def tolerance_for(export_dtype: torch.dtype, reference_dtype: torch.dtype) -> Tolerance:
    """The parity limits for the coarser of the two float formats being compared."""
    coarser = max((export_dtype, reference_dtype), key=lambda d: _COARSENESS.get(d, 0))
    return TOLERANCES[coarser]


@dataclass(frozen=True)
class ParityReport:
    """How closely the exported model reproduces the adapter-on-base model on the probe prompts.

    kl_mean / kl_max: KL(reference || exported) of next-token distributions, per position (nats).
    max_logit_diff: the largest absolute logit difference over every position and vocabulary entry.
    greedy_agreement: the share of positions along the reference's greedy continuations where
        both models pick the same next token.
    tokenizer_matches: the exported tokenizer encodes every probe as the run's tokenizer does
        (None when no tokenizer was exported yet, as for the merged weights before the cast).
    """

    reference: str
    exported: str
    n_prompts: int
    n_positions: int
    kl_mean: float
    kl_max: float
    max_logit_diff: float
    greedy_agreement: float
    tokenizer_matches: Optional[bool]
    tolerance: Tolerance

    def failures(self) -> list[str]:
        """One phrase per limit that was passed (empty when the check passed)."""
        tol, out = self.tolerance, []
        if not self.kl_mean <= tol.max_kl:  # written so that NaN fails
            out.append(f"mean KL {self.kl_mean:.2e} > {tol.max_kl:g}")
        if not self.max_logit_diff <= tol.max_logit_diff:
            out.append(f"max |logit diff| {self.max_logit_diff:.2e} > {tol.max_logit_diff:g}")
        if not self.greedy_agreement >= tol.min_greedy_agreement:
            out.append(f"greedy agreement {self.greedy_agreement:.1%} < {tol.min_greedy_agreement:.0%}")
        if self.tokenizer_matches is False:
            out.append("the exported tokenizer encodes the probe prompts differently")
        return out

    @property
    def passed(self) -> bool:
        return not self.failures()

    def format(self) -> str:
        tol = self.tolerance
        lines = [
            f"parity: {self.exported} vs {self.reference} ({self.n_prompts} probe prompts, "
            f"{self.n_positions} positions)",
            f"  {'mean KL':<18}{self.kl_mean:<10.2e}(max {self.kl_max:.2e})  limit {tol.max_kl:g}",
            f"  {'max |logit diff|':<18}{self.max_logit_diff:<26.2e}limit {tol.max_logit_diff:g}",
            f"  {'greedy agreement':<18}{self.greedy_agreement:<26.1%}limit {tol.min_greedy_agreement:.0%}",
        ]
        if self.tokenizer_matches is not None:
            lines.append(f"  {'tokenizer':<18}{'same ids' if self.tokenizer_matches else 'DIFFERENT ids'}")
        lines.append(f"  {'passed' if self.passed else 'FAILED'}")
        return "\n".join(lines)


@dataclass(frozen=True)
class ProbeReference:
    """One probe: the prompt ids plus the reference's greedy continuation, and the reference's
    logits at every position of that sequence."""

    ids: torch.Tensor  # [T] prompt followed by PROBE_NEW_TOKENS greedy tokens
    prompt_len: int
    logits: torch.Tensor  # [T, V] float32, on CPU


def probe_ids(tokenizer, data: DataConfig, conversational: bool = False) -> list[torch.Tensor]:
    """The probe prompts as token ids ([T] each), formatted as the run formatted its prompts
    (`conversational`: it trained on conversations, so in the chat template)."""
    fmt = text_prompt_format(tokenizer, data, conversational)
    return [torch.tensor(fmt.render(p)[1]) for p in PROBE_PROMPTS]


@torch.no_grad()
def reference_outputs(model, prompts: list[torch.Tensor]) -> list[ProbeReference]:
    """Greedy-continue each probe with the reference model, then record its logits on each whole
    sequence, one unpadded sequence at a time, so no padding can differ between the two models."""
    sequences = _greedy_continuations(model, prompts, PROBE_NEW_TOKENS)
    return [ProbeReference(ids=seq, prompt_len=len(prompt), logits=_full_logits(model, seq))
            for prompt, seq in zip(prompts, sequences)]


def compare(model, refs: list[ProbeReference], tolerance: Tolerance, reference: str, exported: str,
            tokenizer_matches: Optional[bool] = None) -> ParityReport:
    """Measure the exported `model` against the reference outputs (see ParityReport)."""
    kls, max_diff, agree, total = [], 0.0, 0, 0
    for ref in refs:
        logits = _full_logits(model, ref.ids)  # [T, V]
        ref_logp = torch.log_softmax(ref.logits, dim=-1)
        logp = torch.log_softmax(logits, dim=-1)
        kls.append((ref_logp.exp() * (ref_logp - logp)).sum(-1).clamp(min=0.0))  # [T]
        diff = float((logits - ref.logits).abs().max())
        # max() would drop a NaN (every comparison with it is False); NaN/inf logits must fail.
        max_diff = max(max_diff, diff if math.isfinite(diff) else math.inf)
        # Positions that predict the greedy continuation: from the last prompt token on.
        cont = slice(ref.prompt_len - 1, len(ref.ids) - 1)
        agree += int((logits[cont].argmax(-1) == ref.logits[cont].argmax(-1)).sum())
        total += cont.stop - cont.start
    kl = torch.cat(kls)
    return ParityReport(
        reference=reference, exported=exported, n_prompts=len(refs), n_positions=int(kl.numel()),
        kl_mean=float(kl.mean()), kl_max=float(kl.max()), max_logit_diff=max_diff,
        greedy_agreement=agree / max(total, 1), tokenizer_matches=tokenizer_matches, tolerance=tolerance,
    )


# ---- running the models ----------------------------------------------------------------------


@torch.no_grad()
def _full_logits(model, ids: torch.Tensor) -> torch.Tensor:
    out = model(input_ids=ids[None].to(model_device(model)), use_cache=False)
    return out.logits[0].float().cpu()  # [T, V]


@torch.no_grad()
def _greedy_continuations(model, prompts: list[torch.Tensor], new_tokens: int) -> list[torch.Tensor]:
    """Greedy-continue every prompt by `new_tokens` tokens in one left-padded batch with a KV
    cache (a 4-bit forward costs a dequantization per layer, so calls, not tokens, set the time)."""
    from lora_ppo.roles import position_ids_for

    dev = model_device(model)
    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T]; pad id is masked out
    mask = torch.zeros(len(prompts), width, dtype=torch.long)  # [B, T], 1 on real tokens
    for row, prompt in enumerate(prompts):
        ids[row, width - len(prompt):] = prompt
        mask[row, width - len(prompt):] = 1
    ids, mask = ids.to(dev), mask.to(dev)
    positions = position_ids_for(mask)
    out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True)
    keyword = cache_keyword(model)
    new = []
    for i in range(new_tokens):
        next_id = out.logits[:, -1].argmax(-1, keepdim=True)  # [B, 1]
        new.append(next_id)
        if i + 1 < new_tokens:
            mask = torch.cat([mask, torch.ones_like(next_id)], dim=1)
            positions = positions[:, -1:] + 1
            out = model(input_ids=next_id, attention_mask=mask, position_ids=positions, use_cache=True,
                        **{keyword: returned_cache(out)})
    continuations = torch.cat(new, dim=1).cpu()  # [B, new_tokens]
    return [torch.cat([prompt, continuations[row]]) for row, prompt in enumerate(prompts)]
