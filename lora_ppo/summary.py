"""The end-of-run summary: summary.json's record and the few lines printed after training."""

from __future__ import annotations

from typing import Optional

SCORE_KEYS = ("score", "score_se")


def build_summary(
    steps: int,
    before: dict[str, float],
    after: dict[str, float],
    final_kl: Optional[float],
    wall_time_s: float,
    peak_memory_gb: float,
    output_dir: str,
    adapters: list[str],
) -> dict:
    """Held-out scores before and after (with standard errors and side metrics), the final KL,
    time, memory, and where the trained adapters are."""
    return {
        "steps": steps,
        "heldout_score_before": before.get("score"),
        "heldout_score_after": after.get("score"),
        "heldout_score_se_before": before.get("score_se"),
        "heldout_score_se_after": after.get("score_se"),
        **{f"heldout_{k}_before": v for k, v in before.items() if k not in SCORE_KEYS},
        **{f"heldout_{k}_after": v for k, v in after.items() if k not in SCORE_KEYS},
        "final_kl": final_kl,
        "wall_time_s": wall_time_s,
        "peak_memory_gb": peak_memory_gb,
        "output_dir": output_dir,
        "adapters": adapters,
    }


def format_summary(summary: dict) -> str:
    """A few human lines for the end of a run."""
    def fmt(x):
        return "n/a" if x is None else f"{x:.3f}"

    def with_se(when: str) -> str:
        se = summary.get(f"heldout_score_se_{when}")
        return fmt(summary.get(f"heldout_score_{when}")) + ("" if se is None else f" (± {se:.3f})")

    lines = [f"held-out mean score: {with_se('before')} -> {with_se('after')}"]
    for key in summary:
        if (key.startswith("heldout_") and key.endswith("_before")
                and key not in ("heldout_score_before", "heldout_score_se_before")):
            name = key[len("heldout_") : -len("_before")]
            lines.append(f"held-out {name}: {fmt(summary[key])} -> {fmt(summary.get(f'heldout_{name}_after'))}")
    adapters = " and ".join(f"final/{name}" for name in summary["adapters"])
    lines += [
        f"final KL: {fmt(summary.get('final_kl'))}",
        f"wall time: {summary['wall_time_s']:.0f} s, peak memory: {summary['peak_memory_gb']:.2f} GB",
        f"adapters: {summary['output_dir']}/{adapters}",
    ]
    return "\n".join(lines)
