"""Alarms: the known signs of a failing PPO run, read off the metrics history (pure Python). Each
says what is wrong, what usually causes it, and which recipe fields to look at.

    alarm                 fires when
    kl_runaway            the KL grew 4 steps in a row to over 8 nats per response, or is far above ppo.target_kl
    negative_kl           the mean KL is clearly negative 2 steps in a row
    entropy_collapse      the policy's entropy fell near 0, or under a tenth of where it started
    overclipping          the clip fraction is above 0.3, or the mean ratio far from 1
    empty_responses       responses that used to have tokens shrank to (nearly) nothing
    pinned_length         responses that used to stop now run to rollout.max_new_tokens
    reward_gaming         the reward rose over 5 steps while an independent side metric fell
    logprob_mismatch      the update's first forward disagrees with the rollout's old logprobs (same weights)
    sampling_mismatch     generation's logprobs of the sampled tokens are far from the scoring pass's
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

ALARMS = ("kl_runaway", "negative_kl", "entropy_collapse", "overclipping", "empty_responses", "pinned_length",
          "reward_gaming", "logprob_mismatch", "sampling_mismatch")
KL_WINDOW = 4  # steps of growth before the KL counts as running away
KL_HIGH = 8.0  # nats per response: early growth below this is the policy learning, not drifting
TARGET_KL_FACTOR = 3.0  # "far above ppo.target_kl"
NEGATIVE_KL = -0.2  # nats per response: k1 is unbiased but noisy; below this twice is a mismatch
ENTROPY_FLOOR = 0.05  # nats per token
ENTROPY_FRACTION = 0.1
MAX_CLIPFRAC = 0.3
MAX_RATIO_DRIFT = 0.2
EMPTY_LENGTH = 1.5  # tokens
PINNED_FRACTION = 0.98  # of rollout.max_new_tokens
STOPPED_BEFORE = 0.2  # a run "used to stop" when at least this share of its first responses did
GAMING_WINDOW = 5
GAMING_DROP = 0.05  # how far the side metric must fall over the window
# The logprob self-check (check/logprob_mean_diff, nats per token) by compute dtype: a float32
# recomputation agrees to ~5e-6; bf16's limit leaves room for GPU kernels that round by batch
# size, below the 0.04 nats of bf16 KV-cached decoding (bench/README.md). A wrong logit path is
# off by 0.1 to several nats. Past STOP_FACTOR times the limit at a run's first step, the run stops.
LOGPROB_TOLERANCE = {"float32": 1e-3, "bfloat16": 2e-2, "float16": 2e-2}
LOGPROB_STOP_FACTOR = 10.0
# check/generation_logprob_diff (mean |generation - scoring| logprob of the sampled tokens, nats)
# by compute dtype: bf16 KV-cached decoding rounds 0.04-0.05 apart from a full forward on the
# embedded model, float32 ~1e-5 (bench/README.md); ten times that is a sampler reading other logits.
SAMPLING_GAP_LIMIT = {"float32": 1e-2, "bfloat16": 0.5, "float16": 0.5}


@dataclass(frozen=True)
class Alarm:
    name: str
    message: str


@dataclass(frozen=True)
class AlarmSettings:
    """What the alarms need from the recipe."""

    max_new_tokens: int
    target_kl: Optional[float] = None
    side_metrics: tuple[str, ...] = ()  # objective/<name> of the scores logged beside the reward
    logprob_tolerance: float = LOGPROB_TOLERANCE["float32"]
    sampling_gap_limit: float = SAMPLING_GAP_LIMIT["float32"]

    @classmethod
    def for_dtype(cls, dtype: str, max_new_tokens: int, target_kl: Optional[float] = None,
                  side_metrics: tuple[str, ...] = ()) -> "AlarmSettings":
        """The settings with the limits of a compute dtype ("float32", "bfloat16", "float16")."""
        return cls(max_new_tokens, target_kl, side_metrics, LOGPROB_TOLERANCE[dtype], SAMPLING_GAP_LIMIT[dtype])


def check_alarms(history: Sequence[dict], settings: AlarmSettings) -> list[Alarm]:
    """The alarms the metrics history (oldest first, the newest step last) raises now."""
    if not history:
        return []
    checks = (_kl_runaway, _negative_kl, _entropy_collapse, _overclipping, _empty_responses, _pinned_length,
              _reward_gaming, _logprob_mismatch, _sampling_mismatch)
    return [alarm for check in checks for alarm in check(history, settings)]


def _series(history: Sequence[dict], key: str) -> list[float]:
    return [float(m[key]) for m in history if key in m and not m.get("guard/skipped")]


def _kl_runaway(history, settings) -> list[Alarm]:
    kl = _series(history, "objective/kl")
    if not kl:
        return []
    growing = (len(kl) >= KL_WINDOW and all(a < b for a, b in zip(kl[-KL_WINDOW:], kl[-KL_WINDOW + 1:]))
               and kl[-1] > KL_HIGH)
    far = settings.target_kl is not None and kl[-1] > TARGET_KL_FACTOR * settings.target_kl
    if not (growing or far):
        return []
    how = (f"far above ppo.target_kl ({settings.target_kl:g})" if far else f"growing {KL_WINDOW} steps in a row")
    return [Alarm("kl_runaway", f"KL to the reference is {kl[-1]:.2f} nats per response, {how}: the policy is "
                  "drifting from the reference faster than the reward justifies. Raise ppo.kl_coef, lower "
                  "ppo.learning_rate, or set ppo.target_kl to adapt the coefficient.")]


def _negative_kl(history, settings) -> list[Alarm]:
    kl = _series(history, "objective/kl")
    if len(kl) < 2 or not (kl[-1] < NEGATIVE_KL and kl[-2] < NEGATIVE_KL):
        return []
    floor = history[-1].get("check/kl_noise_floor")
    noise = (f" (sampling and scoring round apart by about {floor:.2f} nats a response here: check/kl_noise_floor)"
             if floor is not None else "")
    return [Alarm("negative_kl", f"the mean KL is {kl[-1]:.2f}, negative two steps in a row{noise}: the responses were "
                  "sampled from another distribution than the one scored. Check rollout.temperature, rollout.top_k "
                  "and rollout.top_p, and whether the reference (adapters.reference) is what the policy started from.")]


def _entropy_collapse(history, settings) -> list[Alarm]:
    entropy = _series(history, "policy/entropy")
    if not entropy or not (entropy[-1] < ENTROPY_FLOOR or entropy[-1] < ENTROPY_FRACTION * entropy[0]):
        return []
    if entropy[-1] < entropy[0]:
        seen = f"fell to {entropy[-1]:.3f} nats per token (from {entropy[0]:.3f})"
    else:  # low from the first step: a nearly deterministic model (or sampling settings) to start with
        seen = f"is {entropy[-1]:.3f} nats per token, under {ENTROPY_FLOOR:g} since the first step"
    return [Alarm("entropy_collapse", f"the policy's entropy {seen}: it has become nearly deterministic and stops "
                  "exploring. Raise ppo.entropy_coef or ppo.kl_coef, or lower ppo.learning_rate.")]


def _overclipping(history, settings) -> list[Alarm]:
    clipfrac, ratio = _series(history, "policy/clipfrac"), _series(history, "policy/ratio")
    too_clipped = bool(clipfrac) and clipfrac[-1] > MAX_CLIPFRAC
    drifted = bool(ratio) and abs(ratio[-1] - 1.0) > MAX_RATIO_DRIFT
    if not (too_clipped or drifted):
        return []
    seen = f"clip fraction {clipfrac[-1]:.2f}" if too_clipped else f"mean ratio {ratio[-1]:.2f}"
    return [Alarm("overclipping", f"{seen}: each update moves the policy too far from the one that sampled. Lower "
                  "ppo.learning_rate or ppo.num_epochs, or raise ppo.num_minibatches; ppo.ratio_threshold skips "
                  "such minibatches.")]


def _empty_responses(history, settings) -> list[Alarm]:
    length = _series(history, "response/length")
    if len(length) < 2 or not (length[-1] < EMPTY_LENGTH <= length[0]):
        return []
    return [Alarm("empty_responses", f"responses shrank to {length[-1]:.1f} tokens on average (from "
                  f"{length[0]:.1f}): the reward may favour saying nothing. Check the reward, ppo.length_penalty "
                  "and the stop token (rollout.stop_token).")]


def _pinned_length(history, settings) -> list[Alarm]:
    length, stopped = _series(history, "response/length"), _series(history, "response/stopped_frac")
    if len(length) < 2 or not stopped:
        return []
    pinned = length[-1] >= PINNED_FRACTION * settings.max_new_tokens and stopped[-1] < 0.05
    if not (pinned and stopped[0] >= STOPPED_BEFORE):
        return []
    return [Alarm("pinned_length", f"responses now run to rollout.max_new_tokens ({settings.max_new_tokens}) "
                  f"without stopping ({stopped[-1]:.0%} stop, {stopped[0]:.0%} did at first): the reward may favour "
                  "length. Set rollout.missing_eos_penalty, or a ppo.length_penalty per token.")]


def _slope(values: Sequence[float]) -> float:
    """Least-squares slope per step."""
    n = len(values)
    mean_x, mean_y = (n - 1) / 2, sum(values) / n
    denominator = sum((x - mean_x) ** 2 for x in range(n))
    return sum((x - mean_x) * (y - mean_y) for x, y in enumerate(values)) / denominator if denominator else 0.0


def _reward_gaming(history, settings) -> list[Alarm]:
    scores = _series(history, "objective/scores")
    if len(scores) < GAMING_WINDOW:
        return []
    window = scores[-GAMING_WINDOW:]
    alarms = []
    for name in settings.side_metrics:
        side = _series(history, f"objective/{name}")[-GAMING_WINDOW:]
        if len(side) == GAMING_WINDOW and _slope(window) > 0 and _slope(side) < 0 and max(side) - side[-1] > GAMING_DROP:
            alarms.append(Alarm("reward_gaming", f"the reward rose ({window[0]:.3f} -> {window[-1]:.3f}) over "
                                f"{GAMING_WINDOW} steps while {name}, which the policy never sees, fell "
                                f"({side[0]:.3f} -> {side[-1]:.3f}): the policy may be gaming the reward. Read "
                                "samples.jsonl; raise ppo.kl_coef, or fix the reward."))
    return alarms[:1]


def _logprob_mismatch(history, settings) -> list[Alarm]:
    diff = _series(history, "check/logprob_mean_diff")
    if not diff or diff[-1] <= settings.logprob_tolerance:
        return []
    if "update/compiled_graphs" in history[-1]:  # ppo.compile_update ran this step's update
        advice = ("ppo.compile_update is on: on a GPU its compiled layers round apart from the eager scoring pass "
                  "past this limit in bfloat16 (docs/performance.md); set it to false.")
    else:
        advice = ("Try rollout.logprobs_from_generation: false and rollout.score_roles_together: false; if it stays, "
                  "report the model (docs/models.md).")
    return [Alarm("logprob_mismatch", f"the update's first forward gives logprobs {diff[-1]:.2g} nats per token away "
                  f"from the rollout's (limit {settings.logprob_tolerance:g}) with the same weights: the policy "
                  f"that samples is not the one being optimised. {advice}")]


def _sampling_mismatch(history, settings) -> list[Alarm]:
    gap = _series(history, "check/generation_logprob_diff")
    if not gap or gap[-1] <= settings.sampling_gap_limit:
        return []
    return [Alarm("sampling_mismatch", f"generation gave the sampled tokens logprobs {gap[-1]:.2g} nats per token away "
                  f"from the scoring pass's (limit {settings.sampling_gap_limit:g}): the responses come from another "
                  "distribution than the policy scored and trained, which PPO's ratios assume they share. Try "
                  "rollout.compile: false; if it stays, report the model and the device (docs/models.md).")]


def first_step_logprob_error(metrics: dict, tolerance: float) -> Optional[str]:
    """The one-line reason to stop a run at its first step, when the self-check is far past its
    limit (a model whose distribution lora_ppo does not reproduce), else None."""
    diff = metrics.get("check/logprob_mean_diff")
    if diff is None or diff <= LOGPROB_STOP_FACTOR * tolerance:
        return None
    return (f"logprob self-check failed at the first step: the update's forward is {diff:.3g} nats per token "
            f"(largest {metrics.get('check/logprob_max_diff', float('nan')):.3g}) away from the logprobs the "
            f"rollout recorded with the same weights (limit {tolerance:g}): training would optimise another "
            "distribution than the one sampled (docs/models.md)")
