"""TrainState: everything a PPO step changes besides the adapter weights, the optimizer and the
random number generators. The trainer owns one; checkpoints save and restore it as JSON."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, fields
from typing import Any, NamedTuple, Optional


class PromptPosition(NamedTuple):
    """Where the seeded prompt order stands: pass number and index within that pass."""

    epoch: int = 0
    cursor: int = 0


@dataclass
class TrainState:
    step: int = 0
    kl_coef: float = 0.0  # changes only under the adaptive KL controller (ppo.target_kl)
    score_moments: tuple[float, float, int] = (0.0, 1.0, 0)  # running (mean, var, count), ppo.score_norm
    source_moments: dict[str, tuple[float, float, int]] = field(default_factory=dict)  # per normalised source
    consecutive_skips: int = 0  # steps in a row whose update the NaN/inf guard skipped
    last_skip_reason: str = ""
    eval_before: Optional[dict[str, float]] = None  # the held-out evaluation before training
    last_metrics: dict[str, Any] = field(default_factory=dict)
    prompt_position: PromptPosition = PromptPosition()
    metrics_lines: int = 0  # lines in metrics.jsonl / samples.jsonl as of this state
    samples_lines: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "TrainState":
        """Raises KeyError or ValueError for a record that is not a TrainState."""
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise KeyError(f"trainer state lacks {', '.join(missing)}")
        return cls(
            step=int(data["step"]),
            kl_coef=float(data["kl_coef"]),
            score_moments=(float(data["score_moments"][0]), float(data["score_moments"][1]),
                           int(data["score_moments"][2])),
            source_moments={name: (float(m[0]), float(m[1]), int(m[2])) for name, m in data["source_moments"].items()},
            consecutive_skips=int(data["consecutive_skips"]),
            last_skip_reason=str(data["last_skip_reason"]),
            eval_before=data["eval_before"],
            last_metrics=dict(data["last_metrics"]),
            prompt_position=PromptPosition(*(int(x) for x in data["prompt_position"])),
            metrics_lines=int(data["metrics_lines"]),
            samples_lines=int(data["samples_lines"]),
        )


@dataclass
class AdapterTrainState:
    """What a step of a one-adapter stage (`train-reward`, `train-sft`) changes besides the weights,
    optimizer and RNGs."""

    step: int = 0
    position: PromptPosition = PromptPosition()  # where the seeded order of rows (pairs) stands
    eval_before: Optional[dict[str, float]] = None  # the held-out evaluation before training
    last_metrics: dict[str, Any] = field(default_factory=dict)
    metrics_lines: int = 0

    def to_json(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> "AdapterTrainState":
        missing = [f.name for f in fields(cls) if f.name not in data]
        if missing:
            raise KeyError(f"trainer state lacks {', '.join(missing)}")
        return cls(step=int(data["step"]), position=PromptPosition(*(int(x) for x in data["position"])),
                   eval_before=data["eval_before"], last_metrics=dict(data["last_metrics"]),
                   metrics_lines=int(data["metrics_lines"]))
