"""The `lora-ppo` command line: parsing and wiring only; the work lives in the modules."""

from __future__ import annotations

import errno
import logging
import math
import os
import sys
from pathlib import Path
from typing import List, Optional

import typer

from lora_ppo.errors import EXIT_BAD_INPUT, EXIT_INTERRUPTED, RecipeError, first_line, user_frames
from lora_ppo.library_notices import quiet_hub_kernel_notices


class _Commands(typer.core.TyperGroup):
    """The `lora-ppo` commands, whose usage errors (an unknown command or option, a value that does
    not parse, a missing argument) are one line and exit 2, as every other bad input, where typer
    draws a box under the usage."""

    def main(self, args=None, prog_name=None, complete_var=None, standalone_mode=True, **extra):
        if not standalone_mode or not (sys.argv[1:] if args is None else args):  # no arguments: the help
            return super().main(args, prog_name, complete_var, standalone_mode, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except _CLICK_ERROR as err:  # not standalone, click's own errors come here
            usage = isinstance(err, _USAGE_ERROR) and err.ctx is not None
            typer.echo("error: " + first_line(err.format_message()) +
                       (f" ({err.ctx.command_path} --help)" if usage else ""), err=True)
            sys.exit(err.exit_code)
        except typer.Abort:
            typer.echo("Aborted!", err=True)
            sys.exit(1)
        sys.exit(code if isinstance(code, int) else 0)  # not standalone, an Exit's code comes back


# typer's click (vendored in typer 0.2x, click itself before): BadParameter derives from its UsageError.
_USAGE_ERROR = typer.BadParameter.__mro__[1]
_CLICK_ERROR = _USAGE_ERROR.__mro__[1]
app = typer.Typer(add_completion=False, no_args_is_help=True, help="RLHF with PPO on one 4-bit backbone.",
                  cls=_Commands)


def _fail(message: str, code: int = EXIT_BAD_INPUT, frames: str = "") -> None:
    # One line whatever the message holds (a user's value may carry a line break); `frames`, the
    # user's own traceback lines, follow it.
    typer.echo("error: " + (" ".join(message.splitlines()) or message), err=True)
    if frames:
        typer.echo(frames, err=True)
    raise typer.Exit(code)


def _in_moved_run(recipe: Path, overrides: Optional[List[str]], resume: Optional[str]) -> list[str]:
    """The overrides, plus `train.output_dir` set to the run folder when resuming with a run's own
    recipe.yaml (a run folder that was moved, or copied to another machine, resumes where it is
    now, not where its recipe says it was)."""
    from lora_ppo.run_dir import RECIPE_FILE, RunDir

    overrides = list(overrides or [])
    folder = recipe.resolve().parent
    if (resume is not None and recipe.name == RECIPE_FILE and RunDir(folder).has_checkpoint()
            and not any(o.startswith("train.output_dir=") for o in overrides)):
        overrides.append(f"train.output_dir={folder}")
    return overrides


def _load_recipe(recipe: Path, overrides: Optional[List[str]], schema="ppo"):
    """The validated recipe (a PPO `Recipe`, the `schema` given, or with None whichever the file
    is), or a one-line error and exit 2."""
    from lora_ppo.config import Recipe, load_recipe

    try:
        return load_recipe(recipe, overrides or [], Recipe if schema == "ppo" else schema)
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
    quiet_hub_kernel_notices()
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
    num_processes: int = typer.Option(
        1, "--num-processes", help="Data-parallel processes, one per GPU, started with accelerate launch."
    ),
) -> None:
    """Run PPO as the recipe says."""
    from lora_ppo.config import with_absolute_paths
    from lora_ppo.distributed import join_world, launched_processes, leave_world

    cfg = with_absolute_paths(_load_recipe(recipe, _in_moved_run(recipe, overrides, resume)), recipe.resolve().parent)
    if num_processes < 1:
        _fail(f"--num-processes must be >= 1, got {num_processes}")
    if num_processes > 1 and launched_processes() == 1:
        _launch(cfg, num_processes, resume, [str(recipe), *(overrides or []), *(["--resume", resume] if resume else []),
                                            *(["--no-progress"] if no_progress else [])])
    world = join_world()
    logging.basicConfig(level=logging.INFO if world.is_main else logging.ERROR, format="%(message)s")
    _quiet_libraries()
    from lora_ppo.summary import format_summary
    from lora_ppo.trainer import PPOTrainer

    def start(progress: bool):
        trainer = PPOTrainer(cfg, progress=progress, resume=resume, world=world)
        if world.is_main:
            on = f" on {world.size} processes" if world.size > 1 else ""
            typer.echo(f"training {cfg.model.name} ({cfg.model.quantization}) for {cfg.train.steps} steps"
                       f"{_resumed(trainer)} on {len(trainer.parts.train_prompts.rows)} prompts{on} -> "
                       f"{cfg.train.output_dir}", err=True)
        return trainer

    try:
        _run("train", recipe, overrides, start, format_summary if world.is_main else None,
             progress=not no_progress, extra_args=("--num-processes", str(world.size)) if world.size > 1 else ())
        # Every process past its last collective before any tears its group down: a gloo peer that
        # exits while another still waits on it can abort that one (seen once in the suite).
        world.barrier()
    finally:
        leave_world(world)


def _launch(cfg, num_processes: int, resume: Optional[str], command: list[str]) -> None:
    """Check what can be checked here, then run `lora-ppo train <command>` in `num_processes`
    processes with accelerate's launcher (torchrun underneath), in this process, and exit as they
    did: 0, the first failed process's exit code (a signal: 1), or 130 after Ctrl-C."""
    from lora_ppo.checkpoint import open_run
    from lora_ppo.distributed import launch
    from lora_ppo.trainer import check_splits

    try:
        check_splits(cfg, num_processes)
        open_run(cfg, resume, processes=num_processes)
    except RecipeError as err:
        _fail(str(err))
    code, message = launch(["-m", "lora_ppo", "train", *command], num_processes)
    if message:
        typer.echo(f"error: {message}", err=True)
    raise typer.Exit(code)


@app.command("train-reward")
def train_reward(
    recipe: Path = typer.Argument(..., help="YAML reward-model recipe file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like train.learning_rate=5e-5."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Print a log line every few steps instead of a bar."),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Continue a run: 'auto' (its newest checkpoint) or a checkpoint folder."
    ),
) -> None:
    """Train a reward adapter on preference pairs, on the base model PPO will use."""
    from lora_ppo.config import RewardRecipe

    def trainer_and_summary():
        from lora_ppo.reward_training import RewardTrainer, format_reward_summary

        return RewardTrainer, format_reward_summary

    _one_adapter_stage("train-reward", recipe, overrides, no_progress, resume, RewardRecipe, trainer_and_summary)


@app.command("train-sft")
def train_sft(
    recipe: Path = typer.Argument(..., help="YAML SFT recipe file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like train.epochs=2 sft.packing=true."),
    no_progress: bool = typer.Option(False, "--no-progress", help="Print a log line every few steps instead of a bar."),
    resume: Optional[str] = typer.Option(
        None, "--resume", help="Continue a run: 'auto' (its newest checkpoint) or a checkpoint folder."
    ),
) -> None:
    """Train a policy adapter on demonstrations (supervised), on the base model PPO will start from."""
    from lora_ppo.config import SFTRecipe

    def trainer_and_summary():
        from lora_ppo.sft.trainer import SFTTrainer, format_sft_summary

        return SFTTrainer, format_sft_summary

    _one_adapter_stage("train-sft", recipe, overrides, no_progress, resume, SFTRecipe, trainer_and_summary)


def _one_adapter_stage(command: str, recipe: Path, overrides: Optional[List[str]], no_progress: bool,
                       resume: Optional[str], schema, trainer_and_summary) -> None:
    """`train-reward` and `train-sft`: one process, the recipe resolved, then the stage's trainer
    (imported by `trainer_and_summary` once the recipe is good) built and run."""
    from lora_ppo.config import with_absolute_paths
    from lora_ppo.distributed import launched_processes

    if launched_processes() > 1:  # every process would write the same run folder
        _fail(f"{command} runs in one process; it was launched in {launched_processes()}")

    logging.basicConfig(level=logging.INFO, format="%(message)s")
    cfg = with_absolute_paths(_load_recipe(recipe, _in_moved_run(recipe, overrides, resume), schema),
                              recipe.resolve().parent)
    _quiet_libraries()
    trainer_type, summarise = trainer_and_summary()

    def start(progress: bool):
        trainer = trainer_type(cfg, progress=progress, resume=resume)
        typer.echo(f"training {trainer.what} on {cfg.model.name} ({cfg.model.quantization}) for "
                   f"{trainer.total_steps} steps{_resumed(trainer)} on {len(trainer.stream.rows)} {trainer.unit} "
                   f"-> {cfg.train.output_dir}", err=True)
        return trainer

    _run(command, recipe, overrides, start, summarise, progress=not no_progress)


def _resumed(trainer) -> str:
    return f" from step {trainer.state.step} ({trainer.resume_from})" if trainer.resume_from else ""


def _run(command: str, recipe: Path, overrides: Optional[List[str]], start, summarise, progress: bool,
         extra_args: tuple[str, ...] = ()) -> None:
    """Build a trainer and train, mapping failures to one line: bad input exits 2, a failure at
    run time (reward, NaN halt, checkpoint) 1, Ctrl-C 130 with the command that resumes (with
    `extra_args`). `summarise` None: print no summary or hint (a process other than the main one)."""
    from lora_ppo.checkpoint import OUT_OF_SPACE, CheckpointError, DiskFullError
    from lora_ppo.rewards import RewardError
    from lora_ppo.trainer import TrainingHalted

    trainer = None
    try:
        trainer = start(progress and sys.stderr.isatty())
        summary = trainer.train()
    except RecipeError as err:
        _fail(str(err))
    except RewardError as err:
        # The user's own frames (their file and line) follow the one line, never lora_ppo's.
        _fail(str(err), code=1, frames=user_frames(err, str(Path(__file__).parent)))
    except DiskFullError as err:  # the user frees space and resumes, as with bad input
        _fail(str(err))
    except (TrainingHalted, CheckpointError) as err:
        _fail(str(err), code=1)
    except OSError as err:  # the run's logs on a device that filled up or became read-only
        if err.errno not in (*OUT_OF_SPACE, errno.EROFS):
            raise
        where = err.filename or (trainer.run.root if trainer is not None else "the run folder")
        saved = trainer is not None and trainer.run.has_checkpoint()
        after = ("the checkpoints saved so far are intact (resume with --resume auto once the folder can be "
                 "written)") if saved else "no checkpoint was saved yet (run again once the folder can be written)"
        _fail(f"cannot write {where}: {err.strerror}; {after}")
    except KeyboardInterrupt:
        # Stopped before its first checkpoint, a run has nothing to resume: rerunning starts over.
        again = " ".join([str(recipe), *(overrides or []), *extra_args])
        if summarise is not None and trainer is not None and trainer.run.has_checkpoint():
            typer.echo(f"resume with: lora-ppo {command} {again} --resume auto", err=True)
        elif summarise is not None:  # else Ctrl-C in the model's load or the first evaluation ended in silence
            typer.echo(f"interrupted before the first checkpoint: nothing to resume; lora-ppo {command} {again} "
                       "starts over", err=True)
        raise typer.Exit(EXIT_INTERRUPTED)
    if summarise is not None:  # None: a data-parallel process other than the main one, which prints
        typer.echo(summarise(summary))


@app.command()
def validate(recipe: Path = typer.Argument(..., help="YAML recipe file."),
             overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like ppo.kl_coef=0.1.")) -> None:
    """Check a recipe (PPO, reward model or SFT) without loading anything; print the resolved recipe."""
    from lora_ppo.config import recipe_to_yaml

    typer.echo(recipe_to_yaml(_load_recipe(recipe, overrides, schema=None)), nl=False)


@app.command()
def estimate(
    recipe: Path = typer.Argument(..., help="YAML recipe file."),
    overrides: Optional[List[str]] = typer.Argument(None, help="Overrides like model.name=Qwen/Qwen2.5-7B."),
    gpu_gb: Optional[float] = typer.Option(
        None, "--gpu-gb", help="Memory budget in GB: say whether it fits, choose `auto` sizes (default: train.memory_budget_gb)."),
    device: str = typer.Option("cuda", "--device", help="cuda (bf16 compute by default) or cpu (fp32)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    num_processes: int = typer.Option(1, "--num-processes", help="Data-parallel processes: memory per process."),
) -> None:
    """Predict peak memory per phase from the model config and the recipe (no weights loaded)."""
    import json

    if device not in ("cuda", "cpu"):
        _fail(f"--device must be cuda or cpu, got {device!r}")
    if gpu_gb is not None and not 0 < gpu_gb < math.inf:  # nan too
        _fail(f"--gpu-gb must be a number of GB > 0, got {gpu_gb:g}")
    if num_processes < 1:
        _fail(f"--num-processes must be >= 1, got {num_processes}")
    cfg = _load_recipe(recipe, overrides, schema=None)
    _quiet_libraries()
    from lora_ppo import estimate as est_mod
    from lora_ppo.config import Recipe, SFTRecipe
    from lora_ppo.trainer import check_splits

    if isinstance(cfg, SFTRecipe):
        _estimate_sft(cfg, device, gpu_gb, as_json, num_processes)
        return
    if not isinstance(cfg, Recipe):
        _fail(f"estimate: {recipe} is a reward-model recipe; estimate answers for PPO (train) and SFT (train-sft) "
              "recipes")
    try:
        check_splits(cfg, num_processes)
        budget = gpu_gb if gpu_gb is not None else cfg.train.memory_budget_gb
        est = est_mod.estimate_recipe(cfg, device=device, budget_gb=budget, processes=num_processes)
    except RecipeError as err:
        _fail(str(err))
    if as_json:
        typer.echo(json.dumps(est_mod.as_json(est)))
    else:
        typer.echo(est_mod.format_estimate(est, cfg, device))
    if est.fits is False:
        raise typer.Exit(1)


def _estimate_sft(cfg, device: str, gpu_gb: Optional[float], as_json: bool, num_processes: int) -> None:
    import json

    from lora_ppo import estimate as est_mod
    from lora_ppo.model_shape import load_shape

    if num_processes != 1:
        _fail("--num-processes: train-sft runs in one process")
    try:
        est = est_mod.estimate_sft(load_shape(cfg.model.name, cfg.model.trust_remote_code), cfg, device, gpu_gb)
    except RecipeError as err:
        _fail(str(err))
    typer.echo(json.dumps(est_mod.as_json(est)) if as_json else est_mod.format_sft_estimate(est, cfg, device))
    if est.fits is False:
        raise typer.Exit(1)


@app.command()
def report(run_dir: Path = typer.Argument(..., help="A run folder (it holds metrics.jsonl).")) -> None:
    """Plot a run's metrics and write RUN_DIR/report/index.html: plots, held-out scores and
    completions before and after, alarms, recipe. Works on a finished, interrupted or running run."""
    from lora_ppo.report import write_report

    try:
        page = write_report(run_dir)
    except RecipeError as err:
        _fail(str(err))
    typer.echo(str(page))


def _load_trained(source: Path, with_prompts: bool = True, with_rewards: bool = True):
    from lora_ppo.trained import load_trained

    try:
        return load_trained(source, with_prompts, with_rewards)
    except RecipeError as err:
        _fail(str(err))


@app.command("eval")
def eval_command(
    source: Path = typer.Argument(..., help="A run folder (its final/ checkpoint) or a checkpoint folder."),
    prompts: Optional[Path] = typer.Option(
        None, "--prompts", help="Prompts to use instead of the run's held-out ones (any file data.source takes)."
    ),
    samples: Optional[int] = typer.Option(None, "--samples", help="Completions per prompt (default: the recipe's)."),
    out: Optional[Path] = typer.Option(None, "--out", help="Also write every completion and its scores (JSONL)."),
    as_json: bool = typer.Option(False, "--json", help="Print JSON instead of a table."),
    no_progress: bool = typer.Option(False, "--no-progress", help="No progress bar."),
) -> None:
    """Score a trained policy: reward, KL to the reference, response length, distinct-1/2."""
    import json

    if samples is not None and samples < 1:
        _fail(f"--samples must be >= 1, got {samples}")
    _quiet_libraries()
    from tqdm.auto import tqdm

    from lora_ppo.evaluation import format_evaluation
    from lora_ppo.rewards import RewardError
    from lora_ppo.run_dir import write_jsonl
    from lora_ppo.trained import check_records_file, evaluate_trained, prompts_from_file

    if out is not None:
        try:
            check_records_file(out, source)
        except RecipeError as err:
            _fail(str(err))
    trained = _load_trained(source, with_prompts=prompts is None)
    try:
        rows = prompts_from_file(trained, str(prompts)) if prompts is not None else None
        count = len(rows if rows is not None else trained.parts.eval_prompts.rows)
        with tqdm(total=count, desc="eval", unit="prompt", disable=no_progress or not sys.stderr.isatty(),
                  dynamic_ncols=True, file=sys.stderr) as bar:
            evaluation = evaluate_trained(trained, rows, samples, progress=bar)
    except RecipeError as err:
        _fail(str(err))
    except RewardError as err:
        _fail(str(err), code=1)
    if out is not None:
        try:
            write_jsonl(out, evaluation.records)
        except OSError as err:
            _fail(f"--out: cannot write {out}: {err.strerror or first_line(err)}")
    if as_json:
        typer.echo(json.dumps({"checkpoint": str(trained.folder), "step": trained.step, **evaluation.scores}))
    else:
        typer.echo(format_evaluation(evaluation, f"{trained.folder} (step {trained.step})"))


@app.command()
def generate(
    source: Path = typer.Argument(..., help="A run folder (its final/ checkpoint) or a checkpoint folder."),
    prompts: List[str] = typer.Argument(..., help="One or more prompts."),
    compare_reference: bool = typer.Option(
        False, "--compare-reference", help="Also sample the reference policy on the same prompts."
    ),
    max_new_tokens: Optional[int] = typer.Option(None, "--max-new-tokens", help="Default: the recipe's."),
    seed: Optional[int] = typer.Option(None, "--seed", help="Sampling seed (default: the recipe's train.seed)."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object per prompt."),
) -> None:
    """Sample the trained policy (as the run samples; an SFT run's adapter greedily) on prompts given on the command line."""
    import json

    if max_new_tokens is not None and max_new_tokens < 1:
        _fail(f"--max-new-tokens must be >= 1, got {max_new_tokens}")
    if seed is not None and not 0 <= seed < 2**63:  # as train.seed; torch takes no more
        _fail(f"--seed must be in [0, 2**63), got {seed}")
    _quiet_libraries()
    from lora_ppo.rewards import RewardError
    from lora_ppo.trained import generate as sample_trained

    trained = _load_trained(source, with_prompts=False, with_rewards=False)
    try:
        records = sample_trained(trained, prompts, compare_reference, max_new_tokens, seed)
    except RecipeError as err:
        _fail(str(err))
    except RewardError as err:  # an environment that raised
        _fail(str(err), code=1, frames=user_frames(err, str(Path(__file__).parent)))
    for record in records:
        if as_json:
            typer.echo(json.dumps(record))
            continue
        typer.echo(f"prompt: {record['prompt']}")
        for role in ("policy", "reference"):
            if role in record:
                # A completion's own line breaks stay, indented, so each role's text reads as one block.
                text = record[role].replace("\n", "\n" + " " * (len(role) + 4))
                typer.echo(f"  {role}: {text}")


@app.command("merge-and-export")
def merge_and_export(
    source: Path = typer.Argument(..., help="A run folder (its final/ checkpoint) or a checkpoint folder."),
    out: Path = typer.Option(..., "--out", help="The folder to write (written beside it, then renamed)."),
    dtype: str = typer.Option("fp32", "--dtype", help="Merged weights: bf16, fp16 or fp32."),
    base: str = typer.Option(
        "original", "--base", help="original (reloaded unquantized) or dequantized (the 4-bit weights trained on)."
    ),
    adapter: str = typer.Option("policy", "--adapter", help="policy, value or reward."),
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
