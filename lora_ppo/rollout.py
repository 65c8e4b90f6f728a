"""Collect a rollout: generate with the policy, truncate at the stop token, then score it
under no_grad (old logprobs, reference logprobs, values, rewards) into a frozen `Rollout`.
"""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass, field, replace
from typing import Any, Iterator, Optional, Sequence

import torch

from lora_ppo.compiled_generation import CompileFailed, StaticDecoder
from lora_ppo.config import RolloutConfig
from lora_ppo.data import PromptRow
from lora_ppo.distributed import World
from lora_ppo.memory import PhasePeaks
from lora_ppo.model import embeddings_on_device
from lora_ppo.padding import MicroBatch, micro_batches, pad_responses
from lora_ppo.rewards import RewardBatch, RewardSources
from lora_ppo.roles import POLICY, REFERENCE, VALUE, Role, RoleModel

log = logging.getLogger(__name__)


def masked_rows(values: torch.Tensor, mask: torch.Tensor) -> list[list]:
    """Each row of `values` [B, T] where `mask` is true, as lists (padding left out)."""
    return [row[keep.bool()].tolist() for row, keep in zip(values, mask)]


def join_prompt_response(
    query_ids: torch.Tensor, query_mask: torch.Tensor, response_ids: torch.Tensor, response_mask: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The left-padded prompt followed by the response, as model input:
    (input_ids, attention_mask), each [B, P + T_resp]; the response starts at column P.

        | [PAD] [PAD] prompt prompt | answer answer [EOS] [PAD] |
    """
    input_ids = torch.cat([query_ids, response_ids], dim=1)
    attention_mask = torch.cat([query_mask, response_mask.to(query_mask.dtype)], dim=1)
    return input_ids, attention_mask


@dataclass(frozen=True)
class Rollout:
    """One batch of experience. Per-token tensors are [B, T_resp]; `response_mask` is True on
    real response tokens (the stop token included)."""

    rows: list[PromptRow]  # the prompts, with the dataset columns that travel with them
    completions: list[str]
    query_ids: torch.Tensor  # [B, P] left-padded
    query_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, T_resp], pad after the stop token
    response_mask: torch.Tensor  # [B, T_resp] bool
    old_logprobs: torch.Tensor  # [B, T_resp]
    ref_logprobs: torch.Tensor  # [B, T_resp]
    values: Optional[torch.Tensor]  # [B, T_resp]
    raw_scores: torch.Tensor  # [B] the weighted sum of what the reward sources said
    scores: torch.Tensor  # [B] after missing_eos_penalty
    stopped: torch.Tensor  # [B] bool: the response ended with the stop token
    side_scores: dict[str, list[float]] = field(default_factory=dict)
    source_scores: dict[str, list[float]] = field(default_factory=dict)  # each reward source's own
    timings: dict[str, float] = field(default_factory=dict)
    # Multi-turn episodes (lora_ppo.agents): `response_mask` is True on action tokens only, and
    # these on the observation tokens between turns (context: attended to, never an action).
    observation_mask: Optional[torch.Tensor] = None  # [B, T_resp] bool
    turn_rewards: Optional[torch.Tensor] = None  # [B, T_resp] environment rewards on turns' last actions
    transcripts: Optional[list[list[dict]]] = None  # each episode's messages
    episode_metrics: dict[str, float] = field(default_factory=dict)
    # The sampled tokens' logprobs as generation computed them, where a scoring pass computed the
    # old ones (check/kl_noise_floor: how far the two numerical paths round apart). [B, T_resp]
    generation_logprobs: Optional[torch.Tensor] = None

    @property
    def input_ids(self) -> torch.Tensor:
        return join_prompt_response(self.query_ids, self.query_mask, self.response_ids, self.context_mask)[0]

    @property
    def attention_mask(self) -> torch.Tensor:
        return join_prompt_response(self.query_ids, self.query_mask, self.response_ids, self.context_mask)[1]

    @property
    def context_mask(self) -> torch.Tensor:
        """[B, T_resp] True on every real token after the prompt: actions and observations."""
        if self.observation_mask is None:
            return self.response_mask
        return self.response_mask | self.observation_mask

    @property
    def response_start(self) -> int:
        return self.query_ids.shape[1]


def model_end_tokens(model) -> tuple[int, ...]:
    """The token ids `model.generate()` stops at on its own: its generation config's
    `eos_token_id` (an id or a list; chat models often name their end-of-turn token there, which
    the tokenizer's eos is not: Gemma's `<end_of_turn>`, Phi-3's `<|end|>`), within its vocabulary."""
    config = getattr(model, "generation_config", None)
    named = getattr(config, "eos_token_id", None)
    named = [named] if isinstance(named, int) else list(named or [])
    vocab = model.get_input_embeddings().num_embeddings
    return tuple(dict.fromkeys(i for i in named if isinstance(i, int) and 0 <= i < vocab))


def stop_token_ids(tokenizer, stop_token: Optional[str], model_ends: Sequence[int] = ()) -> tuple[int, ...]:
    """The token ids that end a response: for "eos" the tokenizer's eos token and the model's own end
    tokens (`model_end_tokens`), the tokenizer's first; a named token alone; none for None."""
    if stop_token is None:
        return ()
    if stop_token == "eos":
        eos = () if tokenizer.eos_token_id is None else (tokenizer.eos_token_id,)
        return tuple(dict.fromkeys((*eos, *model_ends)))
    token_id = tokenizer.convert_tokens_to_ids(stop_token)
    if token_id is None or token_id == tokenizer.unk_token_id:
        ids = tokenizer(stop_token, add_special_tokens=False)["input_ids"]
        if len(ids) != 1:
            from lora_ppo.errors import RecipeError

            raise RecipeError(f"rollout.stop_token: {stop_token!r} is not a single token of this tokenizer")
        token_id = ids[0]
    return (token_id,)


def truncate_at_stop(
    response_ids: torch.Tensor, stop_ids: Sequence[int], pad_id: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Cut each response after its first stop token (any of `stop_ids`; none: never stopped).

    The stop token itself is a real token (it has a logprob and carries the score), even when
    pad == eos; only what follows it is padding.
    Returns:
        (response_ids with pad after the stop, response_mask [B, T] bool, stopped [B] bool),
        trimmed to the longest real response.
    """
    B, T = response_ids.shape
    positions = torch.arange(T, device=response_ids.device).expand(B, T)
    if not stop_ids:
        stopped = torch.zeros(B, dtype=torch.bool, device=response_ids.device)
        length = torch.full((B,), T, device=response_ids.device)
    else:
        is_stop = torch.isin(response_ids, torch.tensor(list(stop_ids), device=response_ids.device))
        stopped = is_stop.any(dim=1)
        first_stop = torch.where(stopped, is_stop.float().argmax(dim=1), torch.full_like(stopped, T, dtype=torch.long))
        length = torch.where(stopped, first_stop + 1, torch.full_like(first_stop, T))
    response_mask = positions < length.unsqueeze(1)
    response_ids = torch.where(response_mask, response_ids, torch.full_like(response_ids, pad_id))
    keep = int(length.max().item()) if B else 0
    return response_ids[:, :keep], response_mask[:, :keep], stopped


def generation_config(cfg: RolloutConfig, tokenizer, stop_ids: Sequence[int], sample_in_processor: bool = False):
    """Sampling settings built from the recipe alone: a model's own generation_config
    (repetition penalty, top_k=50, ...) would silently change the sampling distribution
    (`without_model_generation_defaults` keeps generate() from filling in what is unset here).
    `sample_in_processor`: a `RowSeededSampling` processor picks each token and generate() only
    takes its one-hot choice (greedy)."""
    from transformers import GenerationConfig

    sampling = {} if sample_in_processor else {"temperature": cfg.temperature, "top_k": cfg.top_k, "top_p": cfg.top_p}
    return GenerationConfig(
        do_sample=not sample_in_processor,
        max_new_tokens=cfg.max_new_tokens,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=list(stop_ids) or None,
        use_cache=True,
        **sampling,
    )


@contextlib.contextmanager
def without_model_generation_defaults(model) -> Iterator[None]:
    """Inside, `model.generate()` samples with the settings it is given and nothing else. It fills
    every setting a generation config leaves unset from the model's own generation config
    (`repetition_penalty`, `min_p`, `no_repeat_ngram_size`, ...: Qwen2.5-Instruct's sets a repetition
    penalty), so the responses would come from another distribution than the policy's, which scoring
    computes. For the call the model's generation config is a blank one; its end tokens come in
    through the settings given (`model_end_tokens`)."""
    from transformers import GenerationConfig

    base = model.get_base_model()
    saved = base.generation_config
    base.generation_config = GenerationConfig()
    try:
        yield
    finally:
        base.generation_config = saved


def row_seeds(run_seed: int, step_key: Sequence[object], rows: range) -> list[int]:
    """A seed for each response row of a step, from the run's seed, a key naming the step (where
    the prompt order stood) and the row's place in the step's whole batch."""
    import hashlib

    def seed(row: int) -> int:
        text = "/".join(str(x) for x in (run_seed, *step_key, row))
        return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "little") >> 1

    return [seed(row) for row in rows]


def sampling_warpers(temperature: float, top_k: Optional[int], top_p: Optional[float]):
    """The temperature, top-k and top-p warpers, in the order and under the conditions
    `generate()` applies them when it samples."""
    from transformers import LogitsProcessorList, TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    return LogitsProcessorList(
        ([TemperatureLogitsWarper(temperature)] if temperature is not None and temperature != 1.0 else [])
        + ([TopKLogitsWarper(top_k)] if top_k else [])
        + ([TopPLogitsWarper(top_p)] if top_p is not None and top_p < 1.0 else [])
    )


class RowSeededSampling:
    """A logits processor that samples every row's next token from the row's own seeded generator
    (the recipe's temperature, top-k and top-p applied as generate() would) and returns a one-hot
    choice that greedy decoding takes: a row's response then depends on its seed and logits, not on
    the batch around it (`rollout.seed_per_row`)."""

    def __init__(self, seeds: Sequence[int], cfg: RolloutConfig, device: torch.device) -> None:
        self.seeds = list(seeds)
        self.generators = [torch.Generator(device=device).manual_seed(s) for s in seeds]
        self.warpers = sampling_warpers(cfg.temperature, cfg.top_k, cfg.top_p)

    def restart(self) -> None:
        """Back to each row's first draw (a sampling attempt that failed is taken again)."""
        for generator, seed in zip(self.generators, self.seeds):
            generator.manual_seed(seed)

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        probs = torch.softmax(self.warpers(input_ids, scores.float()), dim=-1)
        chosen = torch.stack([torch.multinomial(row, 1, generator=g) for row, g in zip(probs, self.generators)])
        return torch.full_like(scores, float("-inf")).scatter_(1, chosen, 0.0)


def left_pad(rows: Sequence[PromptRow], pad_id: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """The prompts' token ids, left-padded to the longest: (ids, attention_mask), each [B, P]."""
    width = max((len(row.ids) for row in rows), default=0)
    ids = torch.full((len(rows), width), pad_id, dtype=torch.long)
    mask = torch.zeros((len(rows), width), dtype=torch.long)
    for i, row in enumerate(rows):
        if row.ids:
            ids[i, width - len(row.ids):] = torch.tensor(row.ids)
            mask[i, width - len(row.ids):] = 1
    return ids.to(device), mask.to(device)


class SampledTokenLogprobs:
    """A logits processor that reads log p(sampled token) off the logits generation computes anyway.

    `rollout.logprobs_from_generation` uses it in place of a separate scoring forward pass for the
    old logprobs. transformers runs custom processors before its temperature/top-k/top-p warpers,
    so the scores seen here are the raw logits: dividing by the temperature gives exactly the
    full-vocabulary distribution a scoring pass computes (tests pin this ordering). Holds one
    [B, V] row: at each step it takes the token chosen from the previous step's row.
    """

    def __init__(self, temperature: float) -> None:
        self.temperature = temperature
        self.restart()

    def restart(self) -> None:
        """Forget every step recorded (a sampling attempt that failed is taken again)."""
        self._previous: Optional[torch.Tensor] = None  # [B, V] log-softmax of the last step
        self._steps: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if self._previous is not None:
            self._steps.append(self._previous.gather(-1, input_ids[:, -1:]).squeeze(-1))
        self._previous = torch.log_softmax(scores.float() / self.temperature, dim=-1)
        return scores

    def logprobs(self, response_ids: torch.Tensor) -> torch.Tensor:
        """[B, T_gen] logprobs of `response_ids`, the tokens generate() returned."""
        steps = list(self._steps)
        if self._previous is not None:
            steps.append(self._previous.gather(-1, response_ids[:, len(steps) : len(steps) + 1]).squeeze(-1))
        if len(steps) != response_ids.shape[1]:
            raise RuntimeError(f"recorded {len(steps)} sampling steps for {response_ids.shape[1]} generated tokens")
        if not steps:
            return response_ids.new_zeros(response_ids.shape, dtype=torch.float32)
        return torch.stack(steps, dim=1)


@torch.no_grad()
def generate(
    roles: RoleModel,
    query_ids: torch.Tensor,
    query_mask: torch.Tensor,
    gen_config,
    recorder: Optional[SampledTokenLogprobs] = None,
    role: Role = POLICY,
    row_sampling: Optional[RowSeededSampling] = None,
    decoder: Optional[StaticDecoder] = None,
) -> torch.Tensor:
    """Sample responses as `role` (the policy; the reference, to compare); returns the new tokens
    only, [B, T_gen]. The recorder reads the raw logits before `row_sampling` replaces them. With
    a `decoder` (`rollout.compile`) the static-cache compiled path samples where the call fits
    its cache; `generate()` otherwise, and for good after the compiled path failed to start."""
    from transformers import LogitsProcessorList

    processors = LogitsProcessorList([p for p in (recorder, row_sampling) if p is not None])
    with roles.as_role(role), roles.adapter_compute(), embeddings_on_device(roles.peft):
        if decoder is not None and decoder.fits(query_ids.shape[1], gen_config.max_new_tokens):
            # generate() runs the caller's processors, then (when it samples) the warpers
            warpers = sampling_warpers(gen_config.temperature, gen_config.top_k, gen_config.top_p)
            all_processors = LogitsProcessorList([*processors, *(warpers if gen_config.do_sample else [])])
            try:
                return decoder.generate(query_ids, query_mask, gen_config, all_processors, role)
            except CompileFailed as error:
                log.warning("generation: the compiled path cannot run here (%s); using generate() from now on",
                            error)
                for processor in processors:
                    processor.restart()
        with without_model_generation_defaults(roles.peft):
            out = roles.peft.generate(input_ids=query_ids, attention_mask=query_mask, generation_config=gen_config,
                                      logits_processor=processors)
    return out[:, query_ids.shape[1] :]


@dataclass(frozen=True)
class Samples:
    """What sampling returns: the left-padded queries, the responses cut after their stop token,
    and (when asked for) the sampled tokens' logprobs under the policy at the sampling temperature."""

    query_ids: torch.Tensor  # [B, P]
    query_mask: torch.Tensor  # [B, P]
    response_ids: torch.Tensor  # [B, T_resp]
    response_mask: torch.Tensor  # [B, T_resp] bool
    stopped: torch.Tensor  # [B] bool
    completions: list[str]
    logprobs: Optional[torch.Tensor] = None  # [B, T_resp], 0 on padding

    def model_input(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(input_ids, attention_mask) of prompt + response, [B, P + T_resp]."""
        return join_prompt_response(self.query_ids, self.query_mask, self.response_ids, self.response_mask)

    def completion_ids(self) -> list[list[int]]:
        """Each response's real tokens (the stop token included), for reward functions."""
        return masked_rows(self.response_ids, self.response_mask)

    def queries(self) -> list[list[int]]:
        """Each prompt's tokens without its left padding, as `PPOTrainer.step` takes them."""
        return masked_rows(self.query_ids, self.query_mask)

    def action_mask(self) -> list[list[bool]]:
        """For `completion_ids()`: every token is the policy's (episodes mark their observations)."""
        return [[True] * int(n) for n in self.response_mask.sum(dim=1).tolist()]


@dataclass(frozen=True)
class Sampler:
    """How the policy samples: the roles, their tokenizer and the rollout settings."""

    roles: RoleModel
    tokenizer: Any
    cfg: RolloutConfig
    decoder: Optional[StaticDecoder] = None  # rollout.compile: the static-cache compiled path

    @property
    def stop_ids(self) -> tuple[int, ...]:
        """The tokens a response ends at (`rollout.stop_token`)."""
        return stop_token_ids(self.tokenizer, self.cfg.stop_token, model_end_tokens(self.roles.peft.get_base_model()))

    @torch.no_grad()
    def sample(self, rows: Sequence[PromptRow], record_logprobs: bool = False, role: Role = POLICY,
               seeds: Optional[Sequence[int]] = None) -> Samples:
        """Generate with the policy (or `role`; left-padded prompts, KV cache) and cut each response
        after its stop token; with `record_logprobs`, the sampled tokens' logprobs come along; with
        `seeds` (one per row), each row samples from its own seeded stream."""
        cfg, tokenizer = self.cfg, self.tokenizer
        stop_ids = self.stop_ids
        device = self.roles.lm_head.weight.device
        query_ids, query_mask = left_pad(rows, tokenizer.pad_token_id, device)
        recorder = SampledTokenLogprobs(cfg.temperature) if record_logprobs else None
        row_sampling = RowSeededSampling(seeds, cfg, device) if seeds is not None else None
        gen_config = generation_config(cfg, tokenizer, stop_ids, sample_in_processor=row_sampling is not None)
        raw_response = generate(self.roles, query_ids, query_mask, gen_config, recorder, role, row_sampling,
                                self.decoder)
        response_ids, response_mask, stopped = truncate_at_stop(raw_response, stop_ids, tokenizer.pad_token_id)
        logprobs = None
        if recorder is not None:
            logprobs = recorder.logprobs(raw_response)[:, : response_ids.shape[1]]
            logprobs = torch.where(response_mask, logprobs, torch.zeros_like(logprobs))
        # Decoded for the reward source, which may have a tokenizer of its own.
        completions = tokenizer.batch_decode(response_ids, skip_special_tokens=True)
        return Samples(query_ids, query_mask, response_ids, response_mask, stopped, completions, logprobs)

    def with_settings(self, **settings: Any) -> "Sampler":
        """The same sampler with some rollout settings changed (eval batch size, max_new_tokens)."""
        return replace(self, cfg=self.cfg.model_copy(update=settings))


@torch.no_grad()
def score_passes(
    roles: RoleModel,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    response_start: int,
    temperature: float,
    forward_batch_size: int,
    with_values: bool = True,
    with_reference: bool = True,
    old_logprobs: Optional[torch.Tensor] = None,
    together: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, Optional[torch.Tensor]]:
    """Old logprobs (policy), reference logprobs and values, in micro-batches of
    `forward_batch_size` sequences.

    Old logprobs already recorded during sampling are used as given (no policy pass). Without a
    reference the reference logprobs are the old ones, so every KL estimate is 0. `together`: the
    roles still needed share one forward per micro-batch (`RoleModel.hidden_states_as_roles`) where
    the model allows it (`RoleModel.mixed_batches`); otherwise each role has its own.
    With `ppo.trim_padding`, micro-batches of rows of similar length, each over the columns its rows
    use (the same numbers on real tokens; padded positions hold no meaningful number either way); with
    `ppo.packing`, micro-batches of `forward_batch_size` sequences of rows packed back to back (padded
    positions hold 0).
    """
    needed = [role for role, wanted in ((POLICY, old_logprobs is None), (REFERENCE, with_reference),
                                        (VALUE, with_values)) if wanted]
    out: dict[Role, list[torch.Tensor]] = {role: [] for role in needed}
    width = input_ids.shape[1] - response_start
    host_mask = attention_mask.cpu()  # read once (docs/performance.md#the-updates-reads)
    # every real response token is predicted: with packing, the response mask is the mask's columns
    parts = micro_batches(torch.arange(input_ids.shape[0]), host_mask, host_mask[:, response_start:].bool(), input_ids,
                          attention_mask, response_start, forward_batch_size, roles.packing, roles.trim_padding)

    def read(role: Role, hidden: torch.Tensor, part: MicroBatch) -> None:
        predicting = part.predicting(hidden)
        if role == VALUE:
            per_token = roles.values_at(predicting)
        else:
            per_token = roles.predicted_logprobs(predicting, part.targets, temperature)[0]
        out[role].append(pad_responses(part.laid_out(per_token), width))

    scored: list[torch.Tensor] = []  # the rows in the order their numbers come
    for part in parts:
        ids, mask, positions = part.input_ids, part.attention_mask, part.position_ids
        scored.append(part.host_rows)
        if together and len(needed) > 1 and roles.mixed_batches[False]:
            for role, hidden in zip(needed, roles.hidden_states_as_roles(ids, mask, needed, positions)):
                read(role, hidden, part)
        else:
            for role in needed:
                with roles.as_role(role):
                    read(role, roles.hidden_states(ids, mask, positions), part)
    unsorted = torch.argsort(torch.cat(scored)).to(input_ids.device)  # back to the rollout's row order
    old = old_logprobs if old_logprobs is not None else torch.cat(out[POLICY])[unsorted]
    ref = torch.cat(out[REFERENCE])[unsorted] if with_reference else old.clone()
    return old, ref, (torch.cat(out[VALUE])[unsorted] if with_values else None)


def collect_rollout(
    sampler: Sampler,
    rows: Sequence[PromptRow],
    rewards: RewardSources,
    with_values: bool = True,
    with_reference: bool = True,
    peaks: Optional[PhasePeaks] = None,
    seeds: Optional[Sequence[int]] = None,
) -> Rollout:
    """Generate responses to the prompts of `rows` and score them; everything under no_grad.

    For k samples per prompt, pass each prompt k times in a row (group methods rely on it).
    `seeds`: one per row, to sample each from its own stream (`rollout.seed_per_row`).
    """
    cfg = sampler.cfg
    timings: dict[str, float] = {}
    peaks = peaks if peaks is not None else PhasePeaks()

    # 1-2. Generate with the policy, truncate after the stop token (what follows is padding).
    t0 = time.perf_counter()
    with peaks.phase("generate"):
        # Recorded either way: as the old logprobs (`logprobs_from_generation`, decided where the
        # sampler is built), or beside a scoring pass's, to measure how far the two paths round apart.
        samples = sampler.sample(rows, record_logprobs=True, seeds=seeds)
    timings["generate"] = time.perf_counter() - t0
    from_generation = cfg.logprobs_from_generation is True

    # 3-4. Old logprobs (unless sampling recorded them), reference logprobs and values on the
    # exact tokens sampled; then the reward sources' scores.
    scored = score_and_reward(sampler, rows, rewards, samples.query_ids.shape[1], samples.model_input(),
                              samples.logprobs if from_generation else None, samples.completions,
                              samples.completion_ids(), samples.stopped, with_values, with_reference, peaks, timings)
    return Rollout(
        rows=list(rows), completions=samples.completions, query_ids=samples.query_ids,
        query_mask=samples.query_mask, response_ids=samples.response_ids, response_mask=samples.response_mask,
        stopped=samples.stopped, timings=timings, generation_logprobs=None if from_generation else samples.logprobs,
        **scored.as_fields(),
    )


@dataclass(frozen=True)
class Scored:
    """What scoring adds to sampled tokens: the roles' logprobs and values, and the scores."""

    old_logprobs: torch.Tensor
    ref_logprobs: torch.Tensor
    values: Optional[torch.Tensor]
    raw_scores: torch.Tensor
    scores: torch.Tensor
    side_scores: dict[str, list[float]]
    source_scores: dict[str, list[float]]

    def as_fields(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}


def score_and_reward(
    sampler: Sampler, rows: Sequence[PromptRow], rewards: RewardSources, response_start: int,
    model_input: tuple[torch.Tensor, torch.Tensor], recorded_logprobs: Optional[torch.Tensor],
    completions: list[str], completion_ids: list[list[int]], stopped: torch.Tensor, with_values: bool,
    with_reference: bool, peaks: PhasePeaks, timings: dict[str, float], columns: Optional[dict[str, list]] = None,
) -> Scored:
    """Old logprobs (unless recorded at sampling), reference logprobs and values on the sampled
    tokens, then the reward sources on the decoded completions (`columns` added to what they
    get), and `rollout.missing_eos_penalty` on the responses that did not stop."""
    roles, cfg = sampler.roles, sampler.cfg
    input_ids, attention_mask = model_input
    t0 = time.perf_counter()
    with peaks.phase("score"):
        old_logprobs, ref_logprobs, values = score_passes(
            roles, input_ids, attention_mask, response_start, cfg.temperature, cfg.forward_batch_size,
            with_values=with_values, with_reference=with_reference, old_logprobs=recorded_logprobs,
            together=cfg.score_roles_together,
        )
    timings["score_forward"] = time.perf_counter() - t0

    t0 = time.perf_counter()
    with peaks.phase("reward"):
        batch = RewardBatch.from_rows(rows, completions, completion_ids, model_input)
        batch.columns.update(columns or {})
        said = rewards.score(batch)
        raw_scores = torch.tensor(said.total, dtype=torch.float32, device=input_ids.device)
    scores = missing_eos_penalized(raw_scores, stopped, cfg)
    timings["reward"] = time.perf_counter() - t0
    return Scored(old_logprobs, ref_logprobs, values, raw_scores, scores, said.side, said.by_source)


def missing_eos_penalized(raw_scores: torch.Tensor, stopped: torch.Tensor, cfg: RolloutConfig) -> torch.Tensor:
    """The scores less `rollout.missing_eos_penalty` for the responses that never stopped."""
    if cfg.missing_eos_penalty is None or cfg.stop_token is None:
        return raw_scores
    return raw_scores - cfg.missing_eos_penalty * (~stopped).float()


def gather_rollout(world: World, rollout: Rollout, pad_id: int) -> Rollout:
    """The whole batch from every process's share, in rank order, on every process: prompts
    left-padded and responses right-padded to the widest share, as one process would have padded
    them. Timings are the slowest process's (the step waits for it)."""
    if world.size == 1:
        return rollout
    device = rollout.response_ids.device
    tensors = ("query_ids", "query_mask", "response_ids", "response_mask", "old_logprobs", "ref_logprobs",
               "values", "raw_scores", "scores", "stopped", "observation_mask", "turn_rewards", "generation_logprobs")
    shares = world.gather({
        **{name: None if getattr(rollout, name) is None else getattr(rollout, name).cpu() for name in tensors},
        "rows": rollout.rows, "completions": rollout.completions, "side_scores": rollout.side_scores,
        "source_scores": rollout.source_scores, "timings": rollout.timings, "transcripts": rollout.transcripts,
        "episode_metrics": rollout.episode_metrics,
    })
    prompt_width = max(s["query_ids"].shape[1] for s in shares)
    response_width = max(s["response_ids"].shape[1] for s in shares)

    def joined(name: str, width: int = 0, left: bool = False, fill: float = 0) -> Optional[torch.Tensor]:
        if shares[0][name] is None:
            return None
        parts = []
        for share in shares:
            t = share[name]
            if t.dim() == 2 and t.shape[1] < width:
                pad = torch.full((t.shape[0], width - t.shape[1]), fill, dtype=t.dtype)
                t = torch.cat([pad, t] if left else [t, pad], dim=1)
            parts.append(t)
        return torch.cat(parts).to(device)

    def concatenated(name: str) -> Any:
        if isinstance(shares[0][name], list):
            return [item for share in shares for item in share[name]]
        return {key: [v for share in shares for v in share[name][key]] for key in shares[0][name]}

    return Rollout(
        rows=concatenated("rows"), completions=concatenated("completions"),
        query_ids=joined("query_ids", prompt_width, left=True, fill=pad_id),
        query_mask=joined("query_mask", prompt_width, left=True),
        response_ids=joined("response_ids", response_width, fill=pad_id),
        response_mask=joined("response_mask", response_width),
        old_logprobs=joined("old_logprobs", response_width), ref_logprobs=joined("ref_logprobs", response_width),
        values=joined("values", response_width), raw_scores=joined("raw_scores"), scores=joined("scores"),
        stopped=joined("stopped"), side_scores=concatenated("side_scores"), source_scores=concatenated("source_scores"),
        timings={key: max(share["timings"][key] for share in shares) for key in rollout.timings},
        observation_mask=joined("observation_mask", response_width), turn_rewards=joined("turn_rewards", response_width),
        generation_logprobs=joined("generation_logprobs", response_width),
        transcripts=None if rollout.transcripts is None else concatenated("transcripts"),
        # every process plays the same number of episodes: their means average
        episode_metrics={key: sum(s["episode_metrics"][key] for s in shares) / len(shares)
                         for key in rollout.episode_metrics},
    )
