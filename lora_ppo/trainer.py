"""The PPO loop: build the parts from a recipe, then step (rollout, scores, advantages, guard,
update, KL controller, metrics), log, checkpoint, and evaluate before and after.
"""

from __future__ import annotations

import logging
import sys
import time
from pathlib import Path
from typing import Any, Callable, Optional, Sequence, Union

import torch

from lora_ppo import checkpoint, ppo_math
from lora_ppo.agents.episodes import EpisodeBatch, collect_episode_rollout, run_episodes
from lora_ppo.agents.given import rollout_from_tokens
from lora_ppo.alarms import LOGPROB_TOLERANCE, first_step_logprob_error
from lora_ppo.bnb_workarounds import release_dequantized_copies
from lora_ppo.compiled_update import CompiledLayers
from lora_ppo.config import Recipe, as_recipe, recipe_from_dict, recipe_to_yaml, with_absolute_paths
from lora_ppo.data import PromptFormat, PromptProblem, PromptStream, count_summary
from lora_ppo.distributed import World, join_world
from lora_ppo.errors import RecipeError
from lora_ppo.memory import PhasePeaks, run_peak_gb
from lora_ppo.metrics import step_metrics, step_work
from lora_ppo.model import dequantized_once
from lora_ppo.parts import build, evaluate_policy
from lora_ppo.progress import LineProgress
from lora_ppo.perf import StepShape
from lora_ppo.quantization import compute_dtype
from lora_ppo.rewards import recorded_reward
from lora_ppo.roles import POLICY, REWARD, VALUE, RoleModel
from lora_ppo.rollout import Rollout, Samples, collect_rollout, gather_rollout, row_seeds
from lora_ppo.run_dir import write_jsonl
from lora_ppo.signals import StopRequest, stop_on_signals
from lora_ppo.sizing import stage_embeddings_as_planned, with_auto_sizes
from lora_ppo.state import TrainState
from lora_ppo.step_log import StepLog
from lora_ppo.summary import build_summary
from lora_ppo.tracking import check_installed
from lora_ppo.update import UpdateSettings, UpdateStats, compute_advantages, first_nonfinite, ppo_update

log = logging.getLogger(__name__)

class TrainingHalted(RuntimeError):
    """Too many updates in a row were skipped for NaN/inf; a checkpoint was saved first."""


# What generate(**settings) may change of the recipe's sampling for one call.
GENERATE_SETTINGS = ("max_new_tokens", "temperature", "top_k", "top_p", "stop_token")


class PPOTrainer:
    """Build every part of a PPO run from a recipe, then `train()`.

    Args:
        recipe: a validated `Recipe`, a dict of its sections (`recipe_from_dict`) or a recipe file's path.
        reward_fn: optional Python reward `f(prompts, completions) -> list[float]`; overrides
            the recipe's reward section (handy from Python).
        progress: show a progress bar.
        resume: "auto" (the newest complete checkpoint of output_dir, final/ included) or a
            checkpoint folder, to continue a run exactly where that checkpoint left it.
        world: this process among the data-parallel ones (default: as launched; alone, one).
    """

    def __init__(
        self, recipe: Recipe | dict | str | Path, reward_fn: Optional[Callable] = None, progress: bool = True,
        resume: Optional[str | Path] = None, world: Optional[World] = None,
    ):
        recipe = as_recipe(recipe, Recipe, "PPOTrainer")
        # What the run trains on is what its recipe.yaml says: a reward_fn by its importable name,
        # or `reward.kind: python`, never the recipe's own reward section it replaced.
        recipe = recipe.model_copy(update={"reward": recorded_reward(recipe.reward, reward_fn)})
        recipe = with_absolute_paths(recipe)  # recipe.yaml works from any folder (eval, export, resume)
        self.world = world if world is not None else join_world()
        recipe = with_auto_sizes(recipe, resume, self.world)  # recorded in recipe.yaml as chosen
        self.recipe = recipe
        self.recipe_yaml = recipe_to_yaml(recipe)
        check_splits(recipe, self.world.size)
        self.progress = progress and self.world.is_main
        self.run, self.resume_from = checkpoint.open_run(recipe, resume, check_taken=self.world.is_main,
                                                         processes=self.world.size)
        check_installed(recipe.train.report_to)  # before minutes of loading
        self.parts = build(recipe, reward_fn)
        stage_embeddings_as_planned(self.roles.peft, recipe, self.world.size)
        if self.world.rank > 0:  # the same adapters everywhere (built above), a sampling stream per process
            torch.manual_seed(row_seeds(recipe.train.seed, ("process",), range(self.world.rank, self.world.rank + 1))[0])
        self.stream = PromptStream(self.parts.train_prompts.rows, recipe.train.seed)
        self.sampler = self.parts.sampler(recipe, decode_steps=recipe.decode_steps)
        self.generator = torch.Generator().manual_seed(recipe.train.seed)  # minibatch order
        self.update_settings = UpdateSettings(
            recipe.minibatch_size, recipe.micro_batch_size, recipe.rollout.temperature,
            recipe.model.gradient_checkpointing, recipe.ppo.update_roles_together,
            CompiledLayers() if recipe.ppo.compile_update else None,
        )
        self.state = TrainState(kl_coef=recipe.ppo.kl_coef)
        self.work = step_work(recipe, self.roles, self.sampler.cfg.logprobs_from_generation is True, self.world.size)
        dtype = str(compute_dtype(recipe.model)).removeprefix("torch.")
        self.logprob_tolerance = LOGPROB_TOLERANCE[dtype]
        self.logprobs_checked = False  # the first step this process runs stops the run on a failed self-check
        self._opened = False  # the run folder and step log, opened by train() or the first step()
        self._closed = False  # final/ written by train() or close(): a later step() would not reach it
        self.step_log = StepLog(recipe, self.run, self.progress, tuple(self.parts.rewards.side), dtype)
        if self.resume_from is not None:
            self.resume_from, self.state = checkpoint.load_newest(self.run, self.resume_from, str(resume) == "auto",
                                                                  self._trainables(), TrainState, self.world)
            log.info("resuming from %s (step %d)", self.resume_from, self.state.step)

    @property
    def roles(self) -> RoleModel:
        """The one backbone with every role: `with trainer.roles.as_role("policy"): ...`."""
        return self.parts.roles

    @property
    def steps_done(self) -> int:
        """PPO steps taken so far (a resumed run counts its earlier ones)."""
        return self.state.step

    # ---- the loop ---------------------------------------------------------------------------

    def train(self) -> dict:
        """Run the whole recipe; returns the summary (also written to summary.json)."""
        r, state, main = self.recipe, self.state, self.world.is_main
        if main:
            self._open_run_dir()
        self._opened = True
        self.world.barrier()  # the folder is ready (an old run moved away) before anyone goes on
        t0 = time.perf_counter()
        dropped = count_summary(self.parts.train_prompts)
        if dropped and main:
            log.warning("dropped prompts from %s: %s", r.data.source, dropped)
        if main:
            self.step_log.start_trackers()
        try:
            if state.eval_before is None:
                # A resumed run reuses the evaluation its first part made, so its summary matches.
                state.eval_before = self.evaluate(self.run.eval_before)
            if main:
                self.step_log.open(state)
            last_rollout = None
            with stop_on_signals(announce=main) as stop:
                while state.step < r.train.steps:
                    last_rollout = self._one_step(stop)
            if main and last_rollout is not None:
                self.step_log.record_last_samples(state, last_rollout)
        finally:
            if main:
                self.step_log.close()
        self.save_checkpoint(self.run.final)
        self._closed = True
        after = self.evaluate(self.run.eval_after)
        release_dequantized_copies(self.roles.peft)  # the run's last use of them
        summary = build_summary(
            state.step, state.eval_before, after, state.last_metrics.get("objective/kl"),
            time.perf_counter() - t0, run_peak_gb(), str(self.run.root),
            [POLICY, VALUE] if self.roles.has_value else [POLICY],
        )
        if main:
            self.run.write_summary(summary)
        return summary

    def train_step(self) -> tuple[dict[str, float], Rollout]:
        """One PPO iteration: rollout, advantages, update. Returns (metrics, rollout)."""
        with dequantized_once(self.roles.peft, self.recipe.model):
            return self._train_step()

    def _train_step(self) -> tuple[dict[str, float], Rollout]:
        r, state, parts = self.recipe, self.state, self.parts
        t_start = time.perf_counter()
        peaks = PhasePeaks()
        # 1. Rollout: sample with the policy; old and reference logprobs, values, rewards. Each
        #    prompt k times in a row: group baselines (RLOO / GRPO) rely on the grouping. With
        #    several processes each takes its share of the prompts, then all hold the whole batch.
        k, world, position = r.rollout.samples_per_prompt, self.world, state.prompt_position
        prompts, state.prompt_position = self.stream.take(r.rollout.batch_size // k, position)
        rows = [p for p in world.share(prompts) for _ in range(k)]
        seeds = None
        if r.rollout.seed_per_row:
            seeds = row_seeds(r.train.seed, position, range(world.rank * len(rows), (world.rank + 1) * len(rows)))
        if parts.episodes is None:
            rollout = collect_rollout(
                self.sampler, rows, parts.rewards, with_values=r.uses_critic,
                with_reference=r.adapters.reference_enabled, peaks=peaks, seeds=seeds,
            )
        else:  # multi-turn: the policy's turns and the environment's (or tools') answers
            rollout = collect_episode_rollout(
                self.sampler, rows, parts.rewards, parts.episodes, with_values=r.uses_critic,
                with_reference=r.adapters.reference_enabled, peaks=peaks, seeds=seeds,
                first_index=world.rank * len(rows),
            )
        rollout = gather_rollout(world, rollout, parts.tokenizer.pad_token_id)
        return self._learn(rollout, peaks, t_start), rollout

    def _learn(self, rollout: Rollout, peaks: PhasePeaks, t_start: float) -> dict[str, float]:
        """Steps 2-7 of a PPO iteration on a scored rollout; returns the step's metrics."""
        r, state, parts, world = self.recipe, self.state, self.parts, self.world
        k = r.rollout.samples_per_prompt
        # 2. Scores as the optimiser sees them: running normalisation, clipping, length penalty.
        moments_before = (state.score_moments, dict(state.source_moments))
        scores = self._shape_scores(rollout)
        # 3. Advantages: KL-shaped rewards, then GAE with the critic or group baselines.
        kl_coef = self._kl_coef()
        adv = compute_advantages(rollout, r.ppo, kl_coef, scores, k)
        # 4. Guard: a NaN/inf on any real token skips the whole update.
        bad = first_nonfinite(rollout, adv)
        # 5. Update: clipped policy and value losses over epochs x minibatches x micro-batches.
        t_update = time.perf_counter()
        if bad is None:
            with peaks.phase("update"):
                update = ppo_update(parts.roles, parts.optimizer, parts.scheduler, rollout, adv, r.ppo,
                                    self.update_settings, kl_coef, self.generator, world)
            bad = update.nonfinite
        else:
            state.score_moments, state.source_moments = moments_before  # no trace but its metrics
            update = self._skip_update()
        t_end = time.perf_counter()
        state.step += 1
        self._count_skip(bad)
        # 6. KL controller: move kl_coef toward ppo.target_kl (Ziegler et al. 2019).
        if r.ppo.target_kl is not None and bad is None:
            state.kl_coef = ppo_math.adaptive_kl_coef(
                state.kl_coef, adv.kl.sum(dim=1).mean().item(), r.ppo.target_kl, r.ppo.kl_horizon, len(rollout.rows),
                r.ppo.kl_coef_min or 0.0,
            )
        # 7. Metrics.
        metrics = step_metrics(
            state.step, rollout, adv, update, kl_coef=kl_coef, skipped=bad is not None,
            consecutive_skips=state.consecutive_skips, lr=parts.optimizer.param_groups[0]["lr"],
            update_s=t_end - t_update, step_s=t_end - t_start, phase_peaks_gb=peaks.peaks_gb,
            perf=self._throughput(rollout, t_end - t_update if bad is None else 0.0),
        )
        if world.size > 1:
            metrics["dist/adapter_spread"] = self._adapter_spread()
        if parts.decoder is not None:  # rollout.compile: what compiling has cost so far, and any recompile
            metrics["time/compile"] = parts.decoder.compile_s
            metrics["generation/recompiles"] = float(parts.decoder.recompiles)
        compiled = self.update_settings.compiled_layers
        if compiled is not None:  # ppo.compile_update: its compiling so far, and the graphs it made
            metrics["time/compile"] = metrics.get("time/compile", 0.0) + compiled.compile_s
            metrics["update/compiled_graphs"] = float(compiled.graphs)
        return metrics

    def _throughput(self, rollout: Rollout, update_s: float) -> dict[str, float]:
        """`perf/*`: each phase's achieved TFLOP/s (and share of the device's peak), decode tokens/s."""
        seconds = {"generate": rollout.timings.get("generate", 0.0), "score": rollout.timings.get("score_forward", 0.0),
                   "update": update_s}
        return self.work.metrics(StepShape.of(rollout.query_mask, rollout.response_mask, rollout.context_mask),
                                 seconds)

    def _adapter_spread(self) -> float:
        """How far apart the processes' trained weights are (max - min of a float64 checksum):
        0 unless the data-parallel update went wrong, which stops the run."""
        params = self.roles.policy_parameters() + self.roles.value_parameters()
        checksum = float(sum(p.detach().double().sum() for p in params))
        checksums = self.world.gather(checksum)
        spread = max(checksums) - min(checksums)
        if spread != 0:
            raise TrainingHalted(f"step {self.state.step}: the processes' adapters differ (checksums {checksums})")
        return spread

    def _kl_coef(self) -> float:
        """The KL coefficient the step uses: none without a reference (adapters.reference: none),
        where the "reference" logprobs are the rollout's own and a KL loss would pull the policy
        back toward its last rollout instead."""
        return self.state.kl_coef if self.recipe.adapters.reference_enabled else 0.0

    def _shape_scores(self, rollout: Rollout) -> torch.Tensor:
        """Running normalisation, clipping and length penalty, as the recipe asks."""
        ppo, state = self.recipe.ppo, self.state
        scores = self._combined_scores(rollout)
        mean = std = None
        if ppo.score_norm:
            state.score_moments = ppo_math.update_running_moments(*state.score_moments, scores)
            mean, std = state.score_moments[0], state.score_moments[1] ** 0.5
        lengths = rollout.response_mask.sum(dim=1)
        return ppo_math.shape_scores(scores, lengths, ppo.length_penalty, mean, std, ppo.score_clip)

    def _combined_scores(self, rollout: Rollout) -> torch.Tensor:
        """The rollout's scores, or, when a source asks for normalisation, the weighted sum of the
        sources with each such source scaled by its running mean and standard deviation
        (missing_eos_penalty kept). [B]"""
        sources, state = self.parts.rewards.sources, self.state
        if not any(s.normalize for s in sources) or not rollout.source_scores:
            return rollout.scores  # (scores given to step() have no sources to normalise)
        total = torch.zeros_like(rollout.scores)
        for source in sources:
            values = torch.tensor(rollout.source_scores[source.name], dtype=total.dtype, device=total.device)
            if source.normalize:
                moments = ppo_math.update_running_moments(*state.source_moments.get(source.name, (0.0, 1.0, 0)), values)
                state.source_moments[source.name] = moments
                values = ppo_math.shape_scores(values, torch.zeros_like(values), 0.0, moments[0], moments[1] ** 0.5)
            total = total + source.weight * values
        return total - (rollout.raw_scores - rollout.scores)

    def _skip_update(self) -> UpdateStats:
        """The adapters and the optimizer stay as they were; the lr schedule still counts the updates."""
        updates = self.recipe.ppo.num_epochs * self.recipe.ppo.num_minibatches
        if self.parts.scheduler is not None:
            for _ in range(updates):
                self.parts.scheduler.step()
        return UpdateStats(skipped_minibatches=updates)

    def _count_skip(self, bad: Optional[str]) -> None:
        state = self.state
        if bad is None:
            state.consecutive_skips = 0
            return
        state.consecutive_skips += 1
        state.last_skip_reason = f"non-finite {bad} at step {state.step}"
        log.warning("step %d: non-finite %s, update skipped (%d in a row, limit %d)",
                    state.step, bad, state.consecutive_skips, self.recipe.train.max_consecutive_skips)

    def _one_step(self, stop: StopRequest) -> Rollout:
        """One step with its log, guard and checkpoint; returns the step's rollout."""
        metrics, rollout = self.train_step()
        self._after_step(metrics, rollout, stop.requested)
        return rollout

    def _after_step(self, metrics: dict[str, float], rollout: Rollout, stop_requested: bool) -> None:
        """The step's log, the first-step self-check, the NaN halt, the periodic checkpoint, and the
        checkpoint of a run asked to stop."""
        r, state = self.recipe, self.state
        if self.world.is_main:
            self.step_log.record(state, metrics, rollout)
        else:
            state.last_metrics = metrics
        if not self.logprobs_checked:
            self.logprobs_checked = True
            error = first_step_logprob_error(metrics, self.logprob_tolerance)
            if error is not None:
                raise TrainingHalted(f"step {state.step}: {error}")
        if state.consecutive_skips >= r.train.max_consecutive_skips:
            # Skipped updates left the adapters and optimizer moments at the last good update.
            folder = self.save_checkpoint()
            raise TrainingHalted(
                f"step {state.step}: {state.consecutive_skips} updates in a row skipped for NaN/inf "
                f"({state.last_skip_reason}); the last good state is saved in {folder}"
            )
        if r.train.save_every and state.step % r.train.save_every == 0 and state.step < r.train.steps:
            self.save_checkpoint()
        if self.world.any(stop_requested):  # every process stops after the same step
            folder = self.save_checkpoint()
            if self.world.is_main:
                print(f"interrupted at step {state.step}: checkpoint saved to {folder}", file=sys.stderr)
            raise KeyboardInterrupt

    # ---- rollouts made by the caller -----------------------------------------------------------

    def generate(self, prompts: Sequence[Union[str, list[dict]]], **settings: Any) -> Union[Samples, EpisodeBatch]:
        """Sample completions with the policy for `prompts` (text, or conversations, rendered as the
        recipe's data are: chat template, system prompt). `settings` change the recipe's rollout
        sampling for this call (`max_new_tokens`, `temperature`, `top_k`, `top_p`, `stop_token`).
        Returns `Samples`: `query_ids`, `response_ids`, `response_mask`, `completions` (text), ...;
        `trainer.step` takes `samples.queries()`, `samples.completion_ids()` and
        `samples.action_mask()` back. With `rollout.environment` or `rollout.tools` it plays the
        recipe's episodes (tools called, the environment stepped) and returns them as an
        `EpisodeBatch` with the same three methods (observations marked False in the mask) and
        `transcripts`, `env_rewards()`."""
        fmt = PromptFormat(self.parts.tokenizer, self.recipe.data.chat_template, self.recipe.data.system_prompt)
        try:
            rows = [fmt.row(prompt) for prompt in prompts]
        except PromptProblem as problem:
            raise ValueError(f"generate: a prompt cannot be used: {problem}") from None
        sampler = self.sampler.with_settings(**self._checked_settings(settings)) if settings else self.sampler
        with dequantized_once(self.roles.peft, self.recipe.model):
            if self.parts.episodes is not None:
                self.parts.episodes.check_columns([], "a prompt given to generate()")
                return run_episodes(sampler, rows, self.parts.episodes)
            return sampler.sample(rows)

    def _checked_settings(self, settings: dict[str, Any]) -> dict[str, Any]:
        """generate()'s sampling settings, checked as the recipe's rollout section is: a misspelt
        name or a temperature of 0 was taken as given (`model_copy` validates nothing)."""
        unknown = sorted(set(settings) - set(GENERATE_SETTINGS))
        if unknown:
            raise ValueError(f"generate: unknown setting {unknown[0]!r} (it takes {', '.join(GENERATE_SETTINGS)})")
        recipe = self.recipe.model_dump(mode="json")
        try:
            recipe_from_dict({**recipe, "rollout": {**recipe["rollout"], **settings}})
        except RecipeError as err:
            raise ValueError(f"generate: {err}") from None
        return settings

    def step(self, queries: Sequence[Sequence[int]], responses: Sequence[Sequence[int]],
             scores: Sequence[float], action_mask: Optional[Sequence[Sequence[bool]]] = None) -> dict[str, float]:
        """One PPO iteration on rollouts made by the caller (TRL's classic `ppo_trainer.step`):
        `queries` the prompts' token ids, `responses` what followed them, `scores` one number per
        response. `action_mask` (one list of booleans per response) marks the policy's own tokens;
        False marks observation tokens (a tool result, a user's reply) in a multi-turn response.

        The responses are scored as a `train()` rollout is (old and reference logprobs, values),
        then the same shaping, advantages, update, alarms, logging, trackers and checkpoints run.
        Returns the step's metrics (also written to metrics.jsonl). One process only."""
        if self.world.size > 1:
            raise RecipeError("step(): rollouts given from Python train in one process; use train() with "
                              "--num-processes")
        if self._closed:
            raise RuntimeError(f"step(): this trainer's run in {self.run.root} is closed (final/ written, its log "
                               "closed); to go on, make a new trainer with resume='auto'")
        if not self._opened:
            self._open_for_steps()
        t_start = time.perf_counter()
        peaks = PhasePeaks()
        with dequantized_once(self.roles.peft, self.recipe.model):
            rollout = rollout_from_tokens(self.sampler, queries, responses, scores, action_mask,
                                          with_values=self.recipe.uses_critic,
                                          with_reference=self.recipe.adapters.reference_enabled, peaks=peaks)
            metrics = self._learn(rollout, peaks, t_start)
        self._after_step(metrics, rollout, False)
        return metrics

    def _open_for_steps(self) -> None:
        if self.world.is_main:
            self._open_run_dir()
            self.step_log.open(self.state)
        self._opened = True

    def close(self) -> None:
        """After the last `step()`: the final checkpoint (final/) and the log closed."""
        if self._opened and self.world.is_main:
            self.step_log.close()
        self.save_checkpoint(self.run.final)
        self._closed = True
        release_dequantized_copies(self.roles.peft)

    # ---- evaluation, run folder and checkpoints ---------------------------------------------

    def evaluate(self, records_file: Optional[Path] = None) -> dict[str, float]:
        """Mean held-out score (side metrics, and the KL to the reference: how far the policy that
        was scored has moved) with standard errors, sampled with a fixed seed; {} with train.eval
        off. The completions go to `records_file`, for the report."""
        from tqdm.auto import tqdm

        if not self.recipe.train.eval:
            return {}
        rows = len(self.parts.eval_prompts.rows)
        bar = (tqdm(total=rows, desc="held-out", dynamic_ncols=True, file=sys.stderr) if self.progress
               else LineProgress(rows, "held-out", "prompts"))
        with bar:
            evaluation = evaluate_policy(self.parts, self.recipe, progress=bar, with_kl=True)
        if records_file is not None and self.world.is_main:
            write_jsonl(records_file, evaluation.records)
        return evaluation.scores

    def _open_run_dir(self) -> None:
        checkpoint.start_run_folder(self.run, self.recipe_yaml, self.resume_from,
                                    (self.state.metrics_lines, self.state.samples_lines))

    def _trainables(self) -> checkpoint.Trainables:
        p = self.parts
        roles = p.roles
        trained = (POLICY, VALUE) if roles.has_value else (POLICY,)
        frozen = (REWARD,) if roles.reward_adapter else ()
        return checkpoint.Trainables(roles, trained, p.optimizer, p.scheduler, self.generator, frozen)

    def save_checkpoint(self, folder: Optional[Path] = None) -> Path:
        """A full-state checkpoint, by default checkpoints/step-N/ (keeping the newest train.keep_last).
        Every process takes part (each one's random streams go in); the main one writes."""
        keep_last = None if folder is not None else self.recipe.train.keep_last
        folder = folder if folder is not None else self.run.step_checkpoint(self.state.step)
        process_rngs = self.world.gather(checkpoint.process_rng_state(self.generator))
        if self.world.is_main:
            checkpoint.save(folder, self._trainables(), self.state, self.recipe_yaml, keep_last, process_rngs)
        self.world.barrier()
        return folder


def check_splits(recipe: Recipe, processes: int) -> None:
    """With several processes, each takes an equal share of a step's prompts (whole groups of
    samples) and of every minibatch."""
    if processes == 1:
        return
    prompts = recipe.rollout.batch_size // recipe.rollout.samples_per_prompt
    if prompts % processes:
        raise RecipeError(f"rollout.batch_size: {recipe.rollout.batch_size} responses are {prompts} prompts per step "
                          f"(samples_per_prompt {recipe.rollout.samples_per_prompt}), which do not split over "
                          f"{processes} processes")
    if recipe.minibatch_size % processes:
        raise RecipeError(f"ppo.num_minibatches: minibatches of {recipe.minibatch_size} responses do not split over "
                          f"{processes} processes")
