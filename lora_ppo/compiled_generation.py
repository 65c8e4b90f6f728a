"""Generation with a static KV cache and a compiled decode step (`rollout.compile`).

transformers' `generate()` grows its KV cache every token and runs the whole model through
Python for each one: thousands of operator calls per generated token with LoRA layers, most of
them overhead. Here the prompt is prefilled eagerly into a preallocated cache, and every later
token comes from one decode step compiled once per batch shape: the cache, the input token, its
position and the attention mask have the same shapes at every step, and the LoRA weights change
values between PPO steps, never shapes, so the compiled graph is reused for the whole run.

Sampling is the loop `generate()` runs (the same logits processors in the same order, then
softmax and `torch.multinomial` on the global generator, or the caller's per-row sampler), so
with equal logits it draws the same tokens from the same seeds. Compiled kernels may round
differently; the recorded logprobs stay within the logprob self-check (docs/performance.md).
"""

from __future__ import annotations

import inspect
import logging
import time
from typing import Optional

import torch

from lora_ppo.bnb_workarounds import first_4bit_layer, is_dequantized
from lora_ppo.compiled_update import unique_graphs
from lora_ppo.config import RolloutConfig
from lora_ppo.devices import device_rng_states, model_device, restore_device_rng_states
from lora_ppo.errors import named_first_line
from lora_ppo.model import CpuEmbedding
from lora_ppo.model_checks import base_forward, cache_keyword

log = logging.getLogger(__name__)


def compiled_generation_on(cfg: RolloutConfig, device: torch.device, decode_steps: int) -> bool:
    """`rollout.compile` decided for `device` and a job of `decode_steps`, and the path logged:
    `auto` is on for a CUDA GPU when the job is long enough to pay the compile back, where
    decoding is overhead-bound and CUDA graphs remove most of it; on a CPU matrix multiplies
    dominate and the compile outweighs what it saves (docs/performance.md)."""
    on = cfg.compiles_on(device.type, decode_steps)
    how = f"rollout.compile {cfg.compile}"
    if cfg.compile == "auto":
        how += f" on {device.type}, {decode_steps} decode steps"
    log.info("generation: %s (%s)", "static KV cache + compiled decode step" if on else "generate()", how)
    return on


def bucket(rows: int) -> int:
    """The batch a decode graph is compiled for: the next power of two, so shrinking batches
    (the last chunk of an evaluation, an episode's later turns) reuse a few graphs."""
    return 1 << max(0, rows - 1).bit_length()


class CompileFailed(RuntimeError):
    """The compiled path could not run for this model or platform; the caller falls back."""


class StaticDecoder:
    """The compiled decode step of one model, its static caches, and what compiling cost. A graph
    is compiled per batch bucket, role and whether the 4-bit layers run dequantized
    (`model.dequantize_per_step`); any other compile is a recompile, logged as a bug.

    `cache_tokens`: the longest prompt plus response it serves (the recipe's limits); longer
    calls go to `generate()` instead. The static cache stays allocated between calls (CUDA graphs
    need fixed addresses), through scoring and the update: `lora-ppo estimate` counts it.
    """

    def __init__(self, model: torch.nn.Module, cache_tokens: int) -> None:
        self.model = model
        self.cache_tokens = cache_tokens
        self.compile_s = 0.0  # the first call of each graph: compiling it, then generating
        self.graphs = 0  # graphs compiled: one per key (batch bucket, role, dequantized or not)
        self.recompiles = 0  # graphs compiled again for a key already compiled: a bug
        self.disabled: Optional[str] = None  # why the compiled path is off, after a failure
        self._warm: set[tuple] = set()
        self._caches: dict[int, object] = {}
        device = model_device(model)
        mode = "reduce-overhead" if device.type == "cuda" else None  # CUDA graphs on a GPU
        # On a GPU "every row has stopped" is read 2 steps late: waiting for it each token cost 27% of
        # the tokens/s (bench/README.md). On CPU it is free to read, and reading it at once keeps
        # the random draws generate()'s: none past the last stop.
        self.stop_check_lag = 2 if device.type == "cuda" else 0
        self._step = torch.compile(self._decode_step, dynamic=False, mode=mode)
        self._keep_one = "logits_to_keep" in inspect.signature(base_forward(model)).parameters
        self._cache_keyword = cache_keyword(model)
        self._4bit_layer = first_4bit_layer(model)  # dequantized per step or not: another graph
        # Embeddings in CPU memory (`model.offload_embeddings`): a CUDA graph holds device work only,
        # so each step's lookup runs before the graph, which takes the rows looked up.
        embedding = model.get_input_embeddings()
        self._host_embedding = embedding if isinstance(embedding, CpuEmbedding) else None

    def fits(self, prompt_tokens: int, max_new_tokens: int) -> bool:
        return self.disabled is None and prompt_tokens + max_new_tokens <= self.cache_tokens

    def _decode_step(self, cache, tokens, position_ids, attention_mask) -> torch.Tensor:
        """`tokens`: the input ids [rows, 1], or their embeddings [rows, 1, H] where the lookup is on the host."""
        given = {"input_ids": tokens} if self._host_embedding is None else {"inputs_embeds": tokens}
        out = self.model(**given, position_ids=position_ids, attention_mask=attention_mask, use_cache=True,
                         **{self._cache_keyword: cache})
        return out.logits[:, -1].float()

    def _cache(self, rows: int):
        """The static cache for `rows`; only one is held: another batch bucket (an evaluation's)
        replaces it, so the memory held is one cache's (with CUDA graphs, a replaced cache costs
        a re-recording of the graph, not a recompile)."""
        from transformers import StaticCache

        cache = self._caches.get(rows)
        if cache is None:
            self._caches.clear()
            cache = StaticCache(config=self.model.config, max_cache_len=self.cache_tokens)
            self._caches[rows] = cache
        else:
            cache.reset()
        return cache

    @torch.no_grad()
    def generate(self, query_ids: torch.Tensor, query_mask: torch.Tensor, gen_config, processors,
                 role_key: object) -> torch.Tensor:
        """New tokens [B, T_gen] for left-padded prompts, as `generate()` samples them with
        `gen_config` and the logits `processors`. Raises CompileFailed (the RNG restored) when the
        first call for a batch bucket and role cannot compile or run."""
        key = (bucket(query_ids.shape[0]), role_key, is_dequantized(self._4bit_layer))
        graphs_before = unique_graphs()
        if key in self._warm:
            tokens = self._generate(query_ids, query_mask, gen_config, processors, key[0])
            if unique_graphs() > graphs_before:
                self.recompiles += unique_graphs() - graphs_before
                log.warning("generation: the decode step was compiled again for %d rows (a guard failed); "
                            "this costs time every step and is a bug worth reporting", key[0])
            return tokens
        rng = torch.random.get_rng_state(), device_rng_states()
        t0 = time.perf_counter()
        try:
            tokens = self._generate(query_ids, query_mask, gen_config, processors, key[0], check_cache=True)
        except torch.OutOfMemoryError:
            raise
        except Exception as error:  # noqa: BLE001 - any failure to compile means "use generate()"
            torch.random.set_rng_state(rng[0])
            restore_device_rng_states(rng[1])
            self.disabled = named_first_line(error)
            self._caches.clear()
            raise CompileFailed(self.disabled) from error
        seconds = time.perf_counter() - t0
        self.compile_s += seconds
        self.graphs += max(0, unique_graphs() - graphs_before)
        self._warm.add(key)
        log.info("generation: compiled the decode step for %d rows x %d tokens (static cache); the first call "
                 "took %.1f s", key[0], self.cache_tokens, seconds)
        return tokens

    def _generate(self, query_ids, query_mask, gen_config, processors, rows: int,
                  check_cache: bool = False) -> torch.Tensor:
        B, P = query_ids.shape
        device = query_ids.device
        if rows > B:  # filler rows (copies of row 0) keep the compiled shape; their tokens are dropped
            filler = rows - B
            query_ids = torch.cat([query_ids, query_ids[:1].expand(filler, P)])
            query_mask = torch.cat([query_mask, query_mask[:1].expand(filler, P)])
        cache = self._cache(rows)
        mask = torch.zeros((rows, self.cache_tokens), dtype=query_mask.dtype, device=device)
        mask[:, :P] = query_mask
        positions = (query_mask.long().cumsum(-1) - 1).masked_fill(query_mask == 0, 1)  # as generate() does
        extra = {"logits_to_keep": 1} if self._keep_one else {}
        logits = self.model(input_ids=query_ids, position_ids=positions, attention_mask=query_mask,
                            use_cache=True, **{self._cache_keyword: cache}, **extra).logits[:, -1].float()
        if check_cache and cache.get_seq_length() == 0:
            # The forward did not write the prompt into the cache: the decode steps would see no context.
            # Checked on a graph's first call only: reading the length waits for the GPU.
            raise RuntimeError(f"the model's forward did not fill the static cache passed as `{self._cache_keyword}`")
        position = positions[:, -1:]

        stops, pad_id = gen_config.eos_token_id, gen_config.pad_token_id
        stop_ids = None if stops is None else torch.tensor(stops, device=device)  # an id or a list of them
        sequence = query_ids[:B]
        unfinished = torch.ones(B, dtype=torch.bool, device=device)
        stop_check = _StopCheck(self.stop_check_lag, device) if stop_ids is not None else None
        new_tokens = []
        for t in range(gen_config.max_new_tokens):
            scores = processors(sequence, logits[:B].clone())
            if gen_config.do_sample:
                chosen = torch.multinomial(torch.softmax(scores, dim=-1), num_samples=1).squeeze(1)
            else:
                chosen = torch.argmax(scores, dim=-1)
            if stop_ids is not None:
                chosen = torch.where(unfinished, chosen, torch.full_like(chosen, pad_id))
                unfinished &= ~torch.isin(chosen, stop_ids)
            new_tokens.append(chosen)
            sequence = torch.cat([sequence, chosen[:, None]], dim=1)
            if t + 1 == gen_config.max_new_tokens:
                break
            # Without a stop token nothing finishes early. Steps sampled past the last stop hold the
            # pad token: `truncate_at_stop` cuts them off with the rest of the padding.
            if stop_check is not None and stop_check.all_stopped(t, unfinished):
                break
            fed = chosen if rows == B else torch.cat([chosen, chosen.new_full((rows - B,), pad_id)])
            mask[:, P + t] = 1
            position = position + 1
            tokens = fed[:, None] if self._host_embedding is None else self._host_embedding(fed[:, None])
            logits = self._step(cache, tokens, position, mask)
        return torch.stack(new_tokens, dim=1) if new_tokens else query_ids.new_zeros((B, 0))


class _StopCheck:
    """Whether every row has stopped, read `lag` steps late: each step's flag is copied to pinned
    host memory without waiting, and the one from `lag` steps before is read, by then computed
    while the GPU still has the steps after it queued. `lag` 0 reads the flag at once (on CPU a
    lag changes when the loop ends, not what it waits for: the tests' way to run it)."""

    def __init__(self, lag: int, device: torch.device) -> None:
        self.lag = lag
        cuda = device.type == "cuda"
        self.flags = torch.ones(lag + 1, dtype=torch.bool, pin_memory=cuda)
        self.events = [torch.cuda.Event() if cuda else None for _ in range(lag + 1)]

    def all_stopped(self, step: int, unfinished: torch.Tensor) -> bool:
        if not self.lag:
            return not bool(unfinished.any())
        slot = step % (self.lag + 1)
        self.flags[slot].copy_(unfinished.any(), non_blocking=True)
        if self.events[slot] is not None:
            self.events[slot].record()
        if step < self.lag:
            return False
        slot = (step - self.lag) % (self.lag + 1)
        if self.events[slot] is not None:
            self.events[slot].synchronize()
        return not bool(self.flags[slot])
