"""rollout.compile: the static-cache, compiled decode path samples what generate() samples (same
seeds, same tokens; logprobs within float rounding), is compiled once for a run whatever the
adapters' values and the prompts' lengths, and hands over to generate() when it cannot run.

Compiling costs seconds per graph on CPU, so the tests share one model and one decoder and keep
to one batch bucket (3 rows run as 4)."""

from __future__ import annotations

import logging
import os

import pytest
import torch

from lora_ppo.alarms import LOGPROB_TOLERANCE
from lora_ppo.bnb_workarounds import dequantized_4bit_layers, linear_4bit_layers, release_dequantized_copies
from lora_ppo.compiled_generation import StaticDecoder, bucket, compiled_generation_on
from lora_ppo.config import ModelConfig, RolloutConfig
from lora_ppo.model import dequantized_once
from lora_ppo.model_checks import cache_keyword
from lora_ppo.roles import position_ids_for
from lora_ppo.rollout import Sampler, row_seeds
from tests.conftest import count_nf4_kernel_launches, perturb_lora_b, prompt_rows

PROMPTS = ["a much longer prompt than the others, padded the least", "short", "the film was"]
OTHER_PROMPTS = ["my family loved the comedy", "the ending made no sense but the music was lovely", "bad"]
SAMPLING = {"max_new_tokens": 10, "temperature": 0.7, "top_k": 40, "top_p": 0.9}


@pytest.fixture(scope="module")
def roles(make_roles):
    torch.manual_seed(0)  # the fresh adapters' random init: the same whichever tests ran before
    return make_roles(seed=3)


@pytest.fixture(scope="module")
def decoder(roles):
    return StaticDecoder(roles.peft, cache_tokens=64)


def both_paths(roles, tokenizer, decoder, cfg, prompts, seed=0, seeds=None):
    """What today's path and the compiled one sample from the same global seed (or row seeds)."""
    rows = prompt_rows(tokenizer, prompts)
    out = []
    for path_decoder in (None, decoder):
        torch.manual_seed(seed)
        out.append(Sampler(roles, tokenizer, cfg, path_decoder).sample(rows, record_logprobs=True, seeds=seeds))
    return out


# Compiled kernels fuse and reorder float reductions (norms, softmax): logprobs of about -2 came out
# up to 1.0e-5 apart. The requirement is the logprob self-check's float32 tolerance (the update's
# first forward against the recorded logprobs); the test holds them to a tenth of it.
LOGPROB_ATOL = LOGPROB_TOLERANCE["float32"] / 10


def assert_same_samples(today, compiled):
    assert torch.equal(today.response_ids, compiled.response_ids)
    assert torch.equal(today.response_mask, compiled.response_mask)
    assert torch.equal(today.stopped, compiled.stopped)
    assert today.completions == compiled.completions
    torch.testing.assert_close(compiled.logprobs, today.logprobs, rtol=0, atol=LOGPROB_ATOL)


def a_token_it_says(roles, tokenizer, decoder, seed: int) -> str:
    """The token today's path samples third in the first row from `seed`: as the stop token, the
    same draws from the same seed end that row early."""
    today, _ = both_paths(roles, tokenizer, decoder, RolloutConfig(**SAMPLING, stop_token=None), PROMPTS, seed)
    return tokenizer.convert_ids_to_tokens(int(today.response_ids[0, 2]))


def test_the_same_tokens_and_logprobs_as_generate(roles, tiny_tokenizer, decoder):
    stop = a_token_it_says(roles, tiny_tokenizer, decoder, seed=5)
    cfg = RolloutConfig(**SAMPLING, stop_token=stop)
    today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=5)
    assert_same_samples(today, compiled)
    # What makes the comparison worth something: left padding, a row that stopped early, one that did not.
    assert compiled.query_mask[1, 0] == 0
    assert compiled.stopped.any() and not compiled.stopped.all()
    assert compiled.response_mask.sum(dim=1).min() < SAMPLING["max_new_tokens"]
    assert decoder.disabled is None and decoder.graphs == 1 and decoder.recompiles == 0
    assert (bucket(3), "policy", False) in decoder._warm


def test_the_compiled_path_leaves_the_random_stream_where_generate_leaves_it(roles, tiny_tokenizer, decoder):
    """Rows that stop early: on CPU "every row has stopped" is read at once, so the compiled loop draws
    no token past the last stop, as generate() draws none, and the next batch samples alike. One
    prompt three times with top-k 1 makes every row stop at the same early step."""
    prompts = [PROMPTS[2]] * 3
    cfg = RolloutConfig(max_new_tokens=10, temperature=0.7, top_k=1, stop_token=None)
    greedy, _ = both_paths(roles, tiny_tokenizer, decoder, cfg, prompts)
    cfg = cfg.model_copy(update={"stop_token": tiny_tokenizer.convert_ids_to_tokens(int(greedy.response_ids[0, 2]))})
    rows = prompt_rows(tiny_tokenizer, prompts)
    states = []
    for path_decoder in (None, decoder):
        torch.manual_seed(5)
        first = Sampler(roles, tiny_tokenizer, cfg, path_decoder).sample(rows)
        states.append(torch.random.get_rng_state())
    assert first.stopped.all() and first.response_ids.shape[1] <= 3
    assert torch.equal(states[0], states[1])


def test_the_models_end_tokens_stop_both_paths_and_its_sampling_preferences_neither(roles, tiny_tokenizer, decoder,
                                                                                    monkeypatch):
    """`rollout.stop_token: eos` with a generation config that names an end-of-turn token beside the
    eos (and asks for no repeated token, which generate() would otherwise apply): both paths cut each
    row after its first of either, and sample the same tokens."""
    from transformers import GenerationConfig

    eos = tiny_tokenizer.eos_token_id
    end = tiny_tokenizer.convert_tokens_to_ids(a_token_it_says(roles, tiny_tokenizer, decoder, seed=5))
    monkeypatch.setattr(roles.peft.get_base_model(), "generation_config",
                        GenerationConfig(eos_token_id=[eos, end], no_repeat_ngram_size=1, repetition_penalty=5.0))
    today, compiled = both_paths(roles, tiny_tokenizer, decoder, RolloutConfig(**SAMPLING), PROMPTS, seed=5)
    assert_same_samples(today, compiled)
    assert compiled.stopped[0] and compiled.response_ids[0, 2] == end and int(compiled.response_mask[0].sum()) == 3
    last = [row[mask].tolist()[-1] for row, mask in zip(compiled.response_ids, compiled.response_mask)]
    assert compiled.stopped.tolist() == [token in (eos, end) for token in last]


@pytest.mark.parametrize("staged", [False, True])
def test_embeddings_in_cpu_memory_are_looked_up_before_each_compiled_step(make_roles, tiny_tokenizer, staged):
    """model.offload_embeddings with rollout.compile: true. The step's graph takes each token's
    embedding, looked up before it (in the table, or in generation's copy of it where the memory
    plan staged one), and samples what generate() samples with the same table."""
    from lora_ppo.model import CpuEmbedding

    torch.manual_seed(0)
    roles = make_roles(seed=3)
    base = roles.peft.get_base_model()
    embedding = CpuEmbedding(base.get_input_embeddings(), torch.device("cpu"))
    embedding.staged_for_generation = staged
    base.set_input_embeddings(embedding)
    decoder = StaticDecoder(roles.peft, cache_tokens=64)
    step, given = decoder._step, []
    decoder._step = lambda cache, tokens, *rest: \
        given.append((tuple(tokens.shape), embedding._staged is not None)) or step(cache, tokens, *rest)
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=5)
    assert_same_samples(today, compiled)
    hidden = base.config.hidden_size
    assert given == [((bucket(3), 1, hidden), staged)] * (SAMPLING["max_new_tokens"] - 1)  # embeddings, not ids
    assert embedding._staged is None
    # One graph; the second case reuses the first's (dynamo guards on shapes, not on the module).
    assert decoder.disabled is None and decoder.graphs <= 1 and decoder.recompiles == 0


def test_fused_lora_layers_compile_and_sample_what_generate_samples(make_roles, tiny_tokenizer):
    """model.fused_lora with rollout.compile: the decode step's graph holds the fused layers (their
    products added in place, no autograd) and samples what generate() samples through them."""
    from lora_ppo.fused_lora import fuse_lora_layers

    torch.manual_seed(0)
    roles = make_roles(seed=3)
    assert fuse_lora_layers(roles.peft)["fused"] == 14  # 2 layers x 7 linear layers (each with both adapters)
    decoder = StaticDecoder(roles.peft, cache_tokens=64)
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=5)
    assert_same_samples(today, compiled)
    assert decoder.disabled is None and decoder.graphs == 1 and decoder.recompiles == 0


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="Triton's interpreter runs the kernel on CPU")
def test_the_fused_4bit_decode_kernel_compiles_into_the_step_and_samples_what_generate_samples(make_roles,
                                                                                             tiny_tokenizer,
                                                                                             monkeypatch):
    """model.fused_4bit_decode with rollout.compile: the decode step's graph calls the kernel as one
    opaque op (its fake gives the output's shape) and samples what generate() samples through it."""
    pytest.importorskip("triton")
    from lora_ppo.fused_4bit_decode import MAX_ROWS, fuse_4bit_decode

    torch.manual_seed(0)
    roles = make_roles(seed=3)
    assert fuse_4bit_decode(roles.peft, torch.device("cpu")) == 14  # 2 layers x 7 linear layers
    decoder = StaticDecoder(roles.peft, cache_tokens=64)
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=5)
    assert_same_samples(today, compiled)
    assert decoder.disabled is None and decoder.graphs == 1 and decoder.recompiles == 0
    # The compiled steps launch it, 14 layers for each of the 9 steps after the first token; the
    # prefill's 4 x (longest prompt) rows are more than MAX_ROWS, computed by bitsandbytes.
    rows = prompt_rows(tiny_tokenizer, PROMPTS)
    assert bucket(3) * max(len(row.ids) for row in rows) > MAX_ROWS
    launches = count_nf4_kernel_launches(monkeypatch)
    torch.manual_seed(5)
    Sampler(roles, tiny_tokenizer, cfg, decoder).sample(rows)
    assert len(launches) == 14 * (SAMPLING["max_new_tokens"] - 1)


def test_a_stop_check_read_late_returns_the_tokens_generate_samples(roles, tiny_tokenizer, decoder):
    """On a GPU "every row has stopped" is read two steps late (`stop_check_lag`), so the loop runs
    past the last stop: those steps must come out as padding, cut off with the rest. One prompt
    three times with top-k 1 makes every row stop at the same step."""
    prompts = [PROMPTS[2]] * 3
    cfg = RolloutConfig(max_new_tokens=10, temperature=0.7, top_k=1, stop_token=None)
    greedy, _ = both_paths(roles, tiny_tokenizer, decoder, cfg, prompts)
    cfg = cfg.model_copy(update={"stop_token": tiny_tokenizer.convert_ids_to_tokens(int(greedy.response_ids[0, 2]))})
    step, steps = decoder._step, []
    decoder._step = lambda *args: steps.append(1) or step(*args)
    decoder.stop_check_lag = 2
    try:
        today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, prompts)
    finally:
        decoder._step, decoder.stop_check_lag = step, 0
    assert_same_samples(today, compiled)
    width = compiled.response_ids.shape[1]
    assert compiled.stopped.all() and width <= 3
    assert len(steps) == width - 1 + 2  # two decode steps past the last stop, then the late read ended it


def test_per_row_seeds_sample_the_same_tokens(roles, tiny_tokenizer, decoder):
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seeds=row_seeds(0, (0, 0), range(3)))
    assert_same_samples(today, compiled)


def test_no_recompile_as_adapters_and_prompt_lengths_change(roles, tiny_tokenizer, decoder):
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS)  # warm, if this test runs alone
    graphs = decoder.graphs
    for step, prompts in enumerate([OTHER_PROMPTS, PROMPTS, ["one", "two words", "and now three"]]):
        perturb_lora_b(roles, "policy", seed=100 + step, scale=0.3)  # an optimizer step: new values
        today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, prompts, seed=step)
        assert_same_samples(today, compiled)
    assert decoder.graphs == graphs and decoder.recompiles == 0


def test_dequantized_layers_compile_once_for_every_step(roles, tiny_tokenizer, decoder):
    """model.dequantize_per_step: dequantized layers are one more graph; each step's new
    dequantized weights are not."""
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS)  # the 4-bit graph, if this test runs alone
    graphs = [decoder.graphs]
    for step in range(3):
        perturb_lora_b(roles, "policy", seed=200 + step, scale=0.3)
        with dequantized_4bit_layers(roles.peft, torch.float32):
            today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=step)
        assert_same_samples(today, compiled)
        graphs.append(decoder.graphs)
    assert graphs[1] == graphs[0] + 1 and graphs[3] == graphs[2] == graphs[1] and decoder.recompiles == 0


def test_a_runs_dequantized_copies_are_read_at_the_same_addresses_every_step(roles, tiny_tokenizer, decoder):
    """Dynamo makes a module's tensors static inputs of the compiled decode step, and with CUDA graphs
    a static input at a new address records the graphs again: the copies a run's steps compute from
    (`dequantized_once`) are the same tensors every step, and compile nothing again."""
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    layers = linear_4bit_layers(roles.peft)
    addresses, recompiles = [], decoder.recompiles
    try:
        for step in range(2):
            perturb_lora_b(roles, "policy", seed=300 + step, scale=0.3)
            with dequantized_once(roles.peft, ModelConfig(name="tiny", dequantize_per_step=True)):
                today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=step)
                weights = [m._lora_ppo_dequantized[0] for m in layers]
            assert_same_samples(today, compiled)
            addresses.append([w.data_ptr() for w in weights])
    finally:
        release_dequantized_copies(roles.peft)
    assert addresses[1] == addresses[0] and decoder.recompiles == recompiles


def test_a_recompile_is_counted_and_logged_as_a_bug(roles, tiny_tokenizer, decoder, caplog):
    """What the counter is there for: a value the graph was compiled with changed (here one LoRA
    layer's scaling, a Python float dynamo bakes in), so the decode step compiles again for a batch
    bucket already warm. The tokens stay generate()'s; the recompile is counted and logged."""
    from peft.tuners.lora import LoraLayer

    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS)  # warm, if this test runs alone
    graphs, recompiles = decoder.graphs, decoder.recompiles
    layer = next(m for m in roles.peft.modules() if isinstance(m, LoraLayer) and "policy" in m.scaling)
    scaling = layer.scaling["policy"]
    layer.scaling["policy"] = scaling * 3
    try:
        with caplog.at_level(logging.WARNING, logger="lora_ppo.compiled_generation"):
            today, compiled = both_paths(roles, tiny_tokenizer, decoder, cfg, PROMPTS, seed=4)
    finally:
        layer.scaling["policy"] = scaling
    assert_same_samples(today, compiled)
    assert decoder.recompiles == recompiles + 1 and decoder.graphs == graphs
    assert [r.getMessage() for r in caplog.records if r.name == "lora_ppo.compiled_generation"] == [
        f"generation: the decode step was compiled again for {bucket(3)} rows (a guard failed); this costs "
        "time every step and is a bug worth reporting"]


def test_a_failed_compile_falls_back_to_generate_with_one_log_line(roles, tiny_tokenizer, caplog):
    failing = StaticDecoder(roles.peft, cache_tokens=64)
    calls = []

    def cannot_compile(*args):
        calls.append(1)
        raise RuntimeError("inductor: no C++ compiler found\nmore detail")

    failing._step = cannot_compile
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    with caplog.at_level(logging.WARNING, logger="lora_ppo.rollout"):
        today, fallback = both_paths(roles, tiny_tokenizer, failing, cfg, PROMPTS, seed=9)
        assert_same_samples(today, fallback)  # the RNG the failed attempt used was restored
        both_paths(roles, tiny_tokenizer, failing, cfg, PROMPTS)
    assert calls == [1]  # tried once, then generate() for good
    assert failing.disabled == "RuntimeError: inductor: no C++ compiler found"
    lines = [r.getMessage() for r in caplog.records if "compiled path" in r.getMessage()]
    assert lines == ["generation: the compiled path cannot run here (RuntimeError: inductor: no C++ compiler "
                     "found); using generate() from now on"]


def plain_forward_logprobs(roles, samples, temperature: float) -> torch.Tensor:
    """The sampled tokens' logprobs from one forward of the policy over prompt + response (no
    cache): what the scoring pass computes, independently of either generation path. [B, T_resp]"""
    ids, mask = samples.model_input()
    with roles.as_role("policy"), torch.no_grad():
        logits = roles.peft(input_ids=ids, attention_mask=mask, position_ids=position_ids_for(mask)).logits
    P = samples.query_ids.shape[1]
    logprobs = torch.log_softmax(logits[:, P - 1 : -1].float() / temperature, dim=-1)
    return logprobs.gather(-1, samples.response_ids[..., None]).squeeze(-1)


def test_a_forward_that_takes_its_cache_as_past_key_values_decodes_with_its_context(roles, tiny_tokenizer):
    """transformers before 5.24 names the forward's KV cache `past_key_values` and drops a `cache`
    keyword into **kwargs: passed there, every decode step saw one token and no context (3.5 nats
    per token from the scoring pass on an H100, transformers 5.17). The keyword follows the forward."""
    base = roles.peft.get_base_model()
    forward, installed_keyword = base.forward, cache_keyword(roles.peft)

    def forward_before_5_24(input_ids=None, attention_mask=None, position_ids=None, past_key_values=None,
                            use_cache=None, logits_to_keep=0, **kwargs):
        kwargs.pop("cache", None)  # a keyword this forward does not know
        return forward(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                       use_cache=use_cache, logits_to_keep=logits_to_keep, **{installed_keyword: past_key_values},
                       **kwargs)

    base.forward = forward_before_5_24
    try:
        old = StaticDecoder(roles.peft, cache_tokens=64)
        cfg = RolloutConfig(**SAMPLING, stop_token=None)
        torch.manual_seed(0)
        samples = Sampler(roles, tiny_tokenizer, cfg, old).sample(prompt_rows(tiny_tokenizer, PROMPTS),
                                                                  record_logprobs=True)
    finally:
        del base.forward
    assert old.disabled is None and old.graphs == 1  # the compiled path ran
    scored = plain_forward_logprobs(roles, samples, cfg.temperature)
    m = samples.response_mask
    torch.testing.assert_close(samples.logprobs[m], scored[m], rtol=0, atol=LOGPROB_TOLERANCE["float32"])


def test_a_cache_the_forward_does_not_fill_falls_back_to_generate(roles, tiny_tokenizer, caplog):
    """A keyword the forward does not know (a future rename) leaves the static cache empty after the
    prompt: the compiled path stops there, before sampling anything, and generate() samples."""
    unknown = StaticDecoder(roles.peft, cache_tokens=64)
    unknown._cache_keyword = "kv_cache"
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    with caplog.at_level(logging.WARNING, logger="lora_ppo.rollout"):
        today, fallback = both_paths(roles, tiny_tokenizer, unknown, cfg, PROMPTS, seed=4)
    assert_same_samples(today, fallback)
    assert unknown.disabled == "RuntimeError: the model's forward did not fill the static cache passed as `kv_cache`"
    assert [r.getMessage() for r in caplog.records if "compiled path" in r.getMessage()] == [
        f"generation: the compiled path cannot run here ({unknown.disabled}); using generate() from now on"]


def test_a_call_longer_than_the_static_cache_uses_generate(roles, tiny_tokenizer):
    short = StaticDecoder(roles.peft, cache_tokens=8)  # prompts (4+ tokens) + 10 new tokens do not fit
    short._step = None  # calling it would fail the test
    cfg = RolloutConfig(**SAMPLING, stop_token=None)
    today, other = both_paths(roles, tiny_tokenizer, short, cfg, PROMPTS)
    assert_same_samples(today, other)
    assert short.graphs == 0 and short.disabled is None


def test_auto_compiles_for_a_long_job_on_a_cuda_gpu_only(caplog):
    cpu, cuda = torch.device("cpu"), torch.device("cuda")
    cases = [("auto", cpu, 10**6), ("auto", cuda, 2000), ("auto", cuda, 1999), (True, cpu, 0), (False, cuda, 10**6)]
    with caplog.at_level(logging.INFO, logger="lora_ppo.compiled_generation"):
        assert [compiled_generation_on(RolloutConfig(compile=s), d, n) for s, d, n in cases] \
            == [False, True, False, True, False]
    assert [r.getMessage() for r in caplog.records] == [
        "generation: generate() (rollout.compile auto on cpu, 1000000 decode steps)",
        "generation: static KV cache + compiled decode step (rollout.compile auto on cuda, 2000 decode steps)",
        "generation: generate() (rollout.compile auto on cuda, 1999 decode steps)",
        "generation: static KV cache + compiled decode step (rollout.compile True)",
        "generation: generate() (rollout.compile False)",
    ]


def test_batches_run_in_power_of_two_buckets():
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 16, 17, 32)] == [1, 2, 4, 4, 8, 16, 32, 32]


def test_a_run_with_compile_on_trains_on_the_tokens_a_run_without_it_samples(tiny_model_dir, tmp_path):
    """Three PPO steps with rollout.compile true and false from the same seed: the same responses
    at every step (the adapters change in between), the same step metrics within float rounding of
    the recorded logprobs, and nothing compiled after the first step."""
    import lora_ppo
    from tests.conftest import tiny_recipe_dict

    steps = {}
    for setting in (False, True):
        recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
            tiny_model_dir, tmp_path / f"compile-{setting}", rollout={"compile": setting}, train={"steps": 3}))
        trainer = lora_ppo.PPOTrainer(recipe, progress=False)
        steps[setting] = [trainer.train_step() for _ in range(3)]
        assert (trainer.parts.decoder is not None) == setting
    for (plain, plain_rollout), (compiled, compiled_rollout) in zip(steps[False], steps[True]):
        assert torch.equal(plain_rollout.response_ids, compiled_rollout.response_ids)
        assert compiled["objective/raw_scores"] == plain["objective/raw_scores"]  # the same completions
        # The runs differ only by the rounding of the recorded logprobs (LOGPROB_ATOL a token at
        # most): a response's KL sums 6 of them; the losses are held to the same bound.
        assert compiled["objective/kl"] == pytest.approx(plain["objective/kl"], abs=6 * LOGPROB_ATOL)
        for key in ("loss/policy", "loss/value"):
            assert compiled[key] == pytest.approx(plain[key], abs=6 * LOGPROB_ATOL), key
        assert "time/compile" not in plain and compiled["generation/recompiles"] == 0
    compile_s = [metrics["time/compile"] for metrics, _ in steps[True]]
    assert compile_s[0] > 0 and compile_s[2] == compile_s[1] == compile_s[0]
