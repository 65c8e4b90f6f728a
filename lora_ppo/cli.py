"""The `lora-ppo` command line: parsing and wiring only; the work lives in the modules."""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from lora_ppo.errors import RecipeError, first_line

app = typer.Typer(add_completion=False, no_args_is_help=True, help="RLHF with PPO on one 4-bit backbone.")

EXIT_BAD_INPUT = 2
EXIT_INTERRUPTED = 130


def _fail(message: str, code: int = EXIT_BAD_INPUT) -> None:
    # One line whatever the message holds (a user's value may carry a line break).
    typer.echo("error: " + (" ".join(message.splitlines()) or message), err=True)
    raise typer.Exit(code)


def _load_recipe(recipe: Path, overrides: Optional[List[str]]):
    """The validated recipe, or a one-line error and exit 2."""
    from lora_ppo.config import load_recipe

    try:
        return load_recipe(recipe, overrides or [])
    except RecipeError as err:
        _fail(str(err))


def _version(value: bool) -> None:
    if value:
        from lora_ppo import __version__

        typer.echo(f"lora-ppo {__version__}")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", callback=_version, is_eager=True, help="Print the version."),
) -> None:
    """RLHF with PPO on one 4-bit backbone."""


def _quiet_libraries() -> None:
    # Library progress bars and warnings would bury the run's own output.
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
    os.environ.setdefault("HF_DATASETS_DISABLE_PROGRESS_BARS", "1")
    if "datasets" in sys.modules:  # imported already (e.g. from Python): the variable came too late
        sys.modules["datasets"].disable_progress_bars()
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    # bitsandbytes warns at import that an optional hub-downloaded CPU kernel is missing;
    # it falls back to its own kernel, and the hub is off limits anyway.
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    # Offline, the hub client logs each retry; the one-line error at the end says it all.
    logging.getLogger("huggingface_hub").setLevel(logging.ERROR)
    import warnings

    warnings.filterwarnings("ignore", category=UserWarning)
    warnings.filterwarnings("ignore", category=FutureWarning)


@app.command()
def train(
    recipe: Path = typer.Argument(..., help="YAML recipe file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like ppo.kl_coef=0.1 train.steps=20."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Print a log line per step instead of a bar."),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Continue a run: 'auto' (its newest checkpoint) or a checkpoint folder."
    ),
) -> None:
    """Run PPO as the recipe says."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = _load_recipe(recipe, overrides)
    _quiet_libraries()
    from lora_ppo.checkpoint import CheckpointError
    from lora_ppo.rewards import RewardError
    from lora_ppo.summary import format_summary
    from lora_ppo.trainer import PPOTrainer, TrainingHalted

    try:
        trainer = PPOTrainer(cfg, progress=not no_progress and sys.stderr.isatty(), resume=resume)
        start = f" from step {trainer.step} ({trainer.resume_from})" if trainer.resume_from else ""
        typer.echo(
            f"training {cfg.model.name} ({cfg.model.quantization}) for {cfg.train.steps} steps{start} "
            f"on {len(trainer.parts.train_prompts.rows)} prompts -> {cfg.train.output_dir}",
            err=True,
        )
        summary = trainer.train()
    except RecipeError as err:
        _fail(str(err))
    except (RewardError, TrainingHalted, CheckpointError) as err:
        _fail(str(err), code=1)
    except KeyboardInterrupt:
        again = " ".join([str(recipe), *(overrides or [])])
        typer.echo(f"resume with: lora-ppo train {again} --resume auto", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    typer.echo(format_summary(summary))


@app.command()
def validate(recipe: Path = typer.Argument(..., help="YAML recipe file."),
             overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like ppo.kl_coef=0.1.")) -> None:
    """Check a recipe without loading anything; print the resolved recipe."""
    from lora_ppo.config import recipe_to_yaml

    typer.echo(recipe_to_yaml(_load_recipe(recipe, overrides)), nl=False)


@app.command()
def estimate(
    recipe: Path = typer.Argument(..., help="YAML recipe file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like model.name=Qwen/Qwen2.5-7B."),
    gpu_gb: Optional[float] = typer.Option(None, "--gpu-gb", help="Memory budget in GB: say whether it fits."),
    device: str = typer.Option("cuda", "--device", help="cuda (bf16 compute by default) or cpu (fp32)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
) -> None:
    """Predict peak memory per phase from the model config and the recipe (no weights loaded)."""
    import json

    if device not in ("cuda", "cpu"):
        _fail(f"--device must be cuda or cpu, got {device!r}")
    if gpu_gb is not None and gpu_gb <= 0:
        _fail(f"--gpu-gb must be > 0, got {gpu_gb:g}")
    cfg = _load_recipe(recipe, overrides)
    _quiet_libraries()
    from lora_ppo import estimate as est_mod

    try:
        est = est_mod.estimate_recipe(cfg, device=device, budget_gb=gpu_gb)
    except RecipeError as err:
        _fail(str(err))
    if as_json:
        typer.echo(json.dumps(est_mod.as_json(est)))
    else:
        typer.echo(est_mod.format_estimate(est, cfg, device))
    if est.fits is False:
        raise typer.Exit(1)


@app.command("merge-and-export")
def merge_and_export(
    source: Path = typer.Argument(..., help="A run folder (its final/ checkpoint) or a checkpoint folder."),
    out: Path = typer.Option(..., "--out", help="The folder to write (written beside it, then renamed)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Merged weights: bf16, fp16 or fp32."),
    base: str = typer.Option(
        "original", "--base", help="original (reloaded unquantized) or dequantized (the 4-bit weights trained on)."
    ),
    adapter: str = typer.Option("policy", "--adapter", help="policy or value."),
    adapter_only: bool = typer.Option(
        False, "--adapter-only", help="Copy the adapter as a PEFT folder instead of merging."
    ),
    no_verify: bool = typer.Option(False, "--no-verify", help="Skip the parity check (for huge models)."),
    force: bool = typer.Option(False, "--force", help="Replace an existing --out folder."),
) -> None:
    """Merge the policy adapter into its base and write a standard Hugging Face model folder."""
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    _quiet_libraries()
    from lora_ppo import export

    try:
        report = export.merge_and_export(
            source, out, dtype=dtype, base=base, adapter=adapter, verify=not no_verify, force=force,
            adapter_only=adapter_only,
        )
    except RecipeError as err:
        _fail(str(err))
    except export.ParityError as err:
        typer.echo(err.report.format())
        _fail(str(err), code=1)
    except export.ExportError as err:
        _fail(str(err), code=1)
    except KeyboardInterrupt:
        raise typer.Exit(EXIT_INTERRUPTED)
    except Exception as err:  # a library failure mid-export: one line, and nothing was left at --out
        _fail(f"export failed ({type(err).__name__}): {first_line(err)}", code=1)
    typer.echo(report.format())


if __name__ == "__main__":
    app()
