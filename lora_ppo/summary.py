"""The end-of-run summary: summary.json's record and the few lines printed after training."""

from __future__ import annotations

from typing import Optional

SE_SUFFIX = "_se"


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
    """Held-out scores before and after with their standard errors (the score first, then each
    source and side metric), the final KL, time, memory, and where the trained adapters are."""
    names = ["score", *[k for k in {**before, **after} if k != "score" and not k.endswith(SE_SUFFIX)]]
    heldout = {}
    for name in names:
        for when, values in (("before", before), ("after", after)):
            heldout[f"heldout_{name}_{when}"] = values.get(name)
        for when, values in (("before", before), ("after", after)):
            heldout[f"heldout_{name}_se_{when}"] = values.get(f"{name}{SE_SUFFIX}")
    return {
        "steps": steps,
        **heldout,
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

    def with_se(name: str, when: str) -> str:
        se = summary.get(f"heldout_{name}_se_{when}")
        return fmt(summary.get(f"heldout_{name}_{when}")) + ("" if se is None else f" (± {se:.3f})")

    names = [key[len("heldout_"):-len("_before")] for key in summary
             if key.startswith("heldout_") and key.endswith("_before") and not key.endswith(f"{SE_SUFFIX}_before")]
    lines = [f"held-out {'mean score' if name == 'score' else name}: {with_se(name, 'before')} -> {with_se(name, 'after')}"
             for name in names if (summary.get(f"heldout_{name}_before"), summary.get(f"heldout_{name}_after")) != (None, None)]
    if not lines:  # not "n/a -> n/a", which reads as a failed evaluation
        lines = ["held-out: not evaluated (train.eval: false, or no held-out prompts)"]
    adapters = " and ".join(f"final/{name}" for name in summary["adapters"])
    lines += [
        f"final KL: {fmt(summary.get('final_kl'))}",
        f"wall time: {summary['wall_time_s']:.0f} s, peak memory: {summary['peak_memory_gb']:.2f} GB",
        f"adapters: {summary['output_dir']}/{adapters}",
    ]
    return "\n".join(lines)
