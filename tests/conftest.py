"""Shared fixtures: a tiny random Llama and its tokenizer, built from configs and saved to a
temp folder, so every test loads them through the real loading path (4-bit included)."""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
from pathlib import Path

import pytest

# Tests never reach a hub, and leave no datasets cache behind, in the user's home or in the temp
# folder (the processes the tests start inherit this one's and leave it alone).
os.environ.setdefault("HF_HUB_OFFLINE", "1")
if "HF_DATASETS_CACHE" not in os.environ:
    os.environ["HF_DATASETS_CACHE"] = tempfile.mkdtemp(prefix="lora_ppo-tests-datasets-")
    atexit.register(shutil.rmtree, os.environ["HF_DATASETS_CACHE"], ignore_errors=True)
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Run in parallel (pytest-xdist, `-n` in pyproject.toml), each worker gets its share of the cores:
# two processes of two threads on two cores make each other several times slower (OpenMP spins).
# Set before torch is imported, and inherited by the processes the tests start.
if "PYTEST_XDIST_WORKER_COUNT" in os.environ and "OMP_NUM_THREADS" not in os.environ:
    os.environ["OMP_NUM_THREADS"] = str(max(1, (os.cpu_count() or 1) // int(os.environ["PYTEST_XDIST_WORKER_COUNT"])))

import torch  # noqa: E402 - after OMP_NUM_THREADS

# Triton kernels (model.fused_4bit_decode) run on CPU tensors only in Triton's interpreter, chosen when
# triton is first imported, so before anything imports it. Not where there is a GPU: torch.compile's
# own Triton kernels would run interpreted too.
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
CORPUS = [
    "This movie was great and the acting was wonderful.",
    "I hated the plot, the pacing was terrible and boring.",
    "The film is a masterpiece of light and sound.",
    "A dull sequel with bad dialogue and worse jokes.",
    "My family loved the comedy, we laughed all night.",
    "The ending made no sense but the music was lovely.",
]


def build_tiny_tokenizer(folder: Path):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<|endoftext|>", "<|im_start|>", "<|im_end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(CORPUS * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|im_end|>", bos_token="<|endoftext|>"
    )
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(folder)
    return fast


def build_tiny_llama(folder: Path, vocab_size: int, seed: int = 0, tied: bool = True):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=tied,
        eos_token_id=2,
        pad_token_id=2,
        bos_token_id=0,
        initializer_range=0.2,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder)
    return model


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A folder holding a tiny random Llama (about 100k parameters) and its tokenizer."""
    folder = tmp_path_factory.mktemp("tiny-llama")
    tokenizer = build_tiny_tokenizer(folder)
    build_tiny_llama(folder, len(tokenizer))
    return folder


@pytest.fixture(scope="session")
def tiny_untied_model_dir(tmp_path_factory) -> Path:
    """The tiny Llama with an LM head of its own (as most large models have): what the embedding
    and LM head memory levers need."""
    folder = tmp_path_factory.mktemp("tiny-llama-untied")
    tokenizer = build_tiny_tokenizer(folder)
    build_tiny_llama(folder, len(tokenizer), tied=False)
    return folder


def tiny_recipe_dict(model_dir: Path, output_dir: Path, **sections) -> dict:
    """A recipe for the tiny model that runs a PPO step in seconds."""
    recipe = {
        "model": {"name": str(model_dir), "quantization": "4bit"},
        "adapters": {"policy": {"r": 4, "alpha": 8}, "value": {"r": 4, "alpha": 8}},
        "reward": {"kind": "function", "function": "tests.reward_fns:count_letter_e"},
        "data": {"source": "builtin:movie_review_openers", "eval_source": None, "eval_size": 4,
                 "max_prompt_tokens": 64},
        "rollout": {"batch_size": 4, "max_new_tokens": 6, "forward_batch_size": 2},
        "ppo": {"num_epochs": 1, "num_minibatches": 2, "learning_rate": 1e-2},
        "train": {"steps": 2, "output_dir": str(output_dir), "sample_every": 1},
    }
    for name, values in sections.items():
        recipe.setdefault(name, {}).update(values)
    return recipe


# Wall-clock measurements (and rates made from them) differ between any two runs; everything else in
# metrics must match exactly.
TIMING_PREFIXES = ("time/", "tokens_per_s", "memory/", "perf/")


# A share of tokens past a clipping bound is a count: where a token's ratio or value change lies within
# float32 rounding of the bound, two runs that agree to rounding can differ by that whole token. On an
# AVX-512 CPU one value/clipfrac of the tiny recipe's second step did (1 of its 4 x 6 response tokens)
# while every loss agreed to 1e-6.
CLIP_COUNTS = ("policy/clipfrac", "policy/dual_clipfrac", "value/clipfrac")
TINY_RESPONSE_TOKENS = 4 * 6  # tiny_recipe_dict's batch x response budget


def clip_counts_within_a_token(got: dict, expected: dict, tokens: int = TINY_RESPONSE_TOKENS) -> dict:
    """Assert `got`'s clip counts within one of `tokens` response tokens of `expected`'s; return
    `expected` without them, for the caller's comparison of the rest."""
    for key in CLIP_COUNTS:
        if key in expected:
            assert abs(got[key] - expected[key]) <= 1 / tokens + 1e-6, (key, got[key], expected[key])
    return {k: v for k, v in expected.items() if k not in CLIP_COUNTS}


def write_recipe(path: Path, model_dir: Path, output_dir: Path, **train) -> Path:
    """A tiny recipe file that saves a checkpoint every step (4 steps unless `train` says otherwise)."""
    import yaml

    recipe = tiny_recipe_dict(model_dir, output_dir, train={"save_every": 1, "steps": 4, **train})
    path.write_text(yaml.safe_dump(recipe), encoding="utf-8")
    return path


def deterministic_metrics(run_dir: Path) -> list[dict]:
    import json

    lines = (run_dir / "metrics.jsonl").read_text(encoding="utf-8").splitlines()
    return [
        {k: v for k, v in json.loads(line).items() if not k.startswith(TIMING_PREFIXES)} for line in lines
    ]


def adapter_tensors(folder: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(folder / "adapter_model.safetensors"))


def perturb_lora_b(roles, adapter: str, seed: int, scale: float) -> None:
    """Give an adapter's LoRA B matrices random values: PEFT starts B at zero, so a fresh adapter
    equals the base model and ratios, KLs and role differences would be trivially 0."""
    import torch

    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in roles.peft.named_parameters():
            if f"lora_B.{adapter}." in name:
                p.copy_(torch.randn(p.shape, generator=g) * scale)


@pytest.fixture(scope="session")
def make_roles(tiny_model_dir):
    """Build a RoleModel (r=4 policy and value adapters) on the tiny 4-bit model computing in
    `compute_dtype`, with the LoRA B matrices of `perturbed` adapters randomised (seed, seed + 1, ...)."""
    from lora_ppo.config import AdaptersConfig, ModelConfig
    from lora_ppo.model import load_base_model
    from lora_ppo.roles import RoleModel

    def make(seed: int = 0, scale: float = 0.3, perturbed=("policy", "value"), compute_dtype: str = "auto", **adapters):
        settings = {"policy": {"r": 4, "alpha": 8}, "value": {"r": 4, "alpha": 8}, **adapters}
        base = load_base_model(ModelConfig(name=str(tiny_model_dir), compute_dtype=compute_dtype))
        roles = RoleModel(base, AdaptersConfig(**settings))
        for offset, adapter in enumerate(perturbed):
            perturb_lora_b(roles, adapter, seed + offset, scale)
        return roles

    return make


@pytest.fixture(scope="session")
def tiny_tokenizer(tiny_model_dir):
    """The tiny model's tokenizer as lora_ppo loads it (left padding, pad token set)."""
    from lora_ppo.config import ModelConfig
    from lora_ppo.model import load_tokenizer

    return load_tokenizer(ModelConfig(name=str(tiny_model_dir)))


def prompt_and_random_response(tokenizer, prompts, response_len=5, seed=0):
    """(input_ids, attention_mask, response_start): left-padded prompts followed by a random
    response of `response_len` real tokens each."""
    import torch

    enc = tokenizer(prompts, return_tensors="pt", padding=True)
    g = torch.Generator().manual_seed(seed)
    response = torch.randint(3, len(tokenizer), (len(prompts), response_len), generator=g)
    ids = torch.cat([enc["input_ids"], response], dim=1)
    mask = torch.cat([enc["attention_mask"], torch.ones_like(response)], dim=1)
    return ids, mask, enc["input_ids"].shape[1]


def forward_and_grads(roles, tokenizer, role: str = "policy"):
    """(hidden states, response logprobs, gradients) of one forward and backward as `role` on two
    prompts with a random response: the backward of the response logprobs' sum (the values' sum as
    the value). The gradients are those of the trainable parameters that got one, in order; none
    for the reference (no backward)."""
    ids, mask, start = prompt_and_random_response(tokenizer, ["the film was", "a"], response_len=5)
    with roles.as_role(role):
        hidden = roles.hidden_states(ids, mask)
        logprobs, _ = roles.logprobs_from_hidden(hidden, ids, start, temperature=1.0)
        loss = roles.values_from_hidden(hidden, start).sum() if role == "value" else logprobs[mask[:, start:].bool()].sum()
        if loss.requires_grad:
            loss.backward()
    params = roles.policy_parameters() + roles.value_parameters()
    grads = [p.grad.clone() for p in params if p.grad is not None]
    for p in params:
        p.grad = None
    return hidden.detach(), logprobs.detach(), grads


def scored_rollout(roles, ids, mask, start: int, rows=(), forward_batch_size: int = 2):
    """A Rollout of left-padded prompts followed by right-padded responses (`ids`, `mask`: [4, T], the
    responses from column `start`), scored by `roles`, with the scores 1, -1, 0.5, 2: what an update
    test needs without sampling. A response whose last column is padding stopped."""
    import torch

    from lora_ppo.rollout import Rollout, score_passes

    response_mask = mask[:, start:].bool()
    old, ref, values = score_passes(roles, ids, mask, start, 1.0, forward_batch_size=forward_batch_size)
    scores = torch.tensor([1.0, -1.0, 0.5, 2.0])
    return Rollout(
        rows=list(rows), completions=[""] * len(ids), query_ids=ids[:, :start], query_mask=mask[:, :start],
        response_ids=ids[:, start:], response_mask=response_mask, old_logprobs=old, ref_logprobs=ref,
        values=values, raw_scores=scores, scores=scores, stopped=~response_mask[:, -1],
    )


def rollout_for_update(roles, tokenizer):
    """`scored_rollout` of 4 prompts and random responses of 6 tokens (one stopped after 4)."""
    prompts = ["This movie was", "The acting in this film", "Honestly", "I"]
    ids, mask, start = prompt_and_random_response(tokenizer, prompts, 6)
    mask[1, start + 4 :] = 0  # a response that stopped early
    return scored_rollout(roles, ids, mask, start, prompt_rows(tokenizer, prompts))


def count_nf4_kernel_launches(monkeypatch) -> list:
    """The grids `model.fused_4bit_decode`'s kernel is launched with from now on in this test."""
    from lora_ppo import _nf4_kernel

    launches, launch = [], _nf4_kernel.nf4_linear_kernel

    class Counting:
        def __getitem__(self, grid):
            launches.append(grid)
            return launch[grid]

    monkeypatch.setattr(_nf4_kernel, "nf4_linear_kernel", Counting())
    return launches


def bnb_4bit_layers(roles) -> list:
    import bitsandbytes as bnb

    return [m for m in roles.peft.modules() if isinstance(m, bnb.nn.Linear4bit)]


def tokenizer_copy(tokenizer):
    """A fresh copy of a loaded tokenizer (left padding, its pad token), to change without touching it."""
    copy = tokenizer.__class__.from_pretrained(tokenizer.name_or_path)
    copy.pad_token, copy.padding_side = tokenizer.pad_token, "left"
    return copy


def bos_first(tokenizer):
    """A copy of `tokenizer` that puts its BOS token first on a plain call, as Llama's tokenizers do."""
    from tokenizers import processors

    copy = tokenizer_copy(tokenizer)
    copy._tokenizer.post_processor = processors.TemplateProcessing(
        single=f"{copy.bos_token} $A", special_tokens=[(copy.bos_token, copy.bos_token_id)])
    assert copy("x")["input_ids"][0] == copy.bos_token_id
    return copy


def prompt_rows(tokenizer, texts, chat_template: bool = False, **columns):
    """PromptRows for plain text prompts, as the data loader makes them (columns: one list each)."""
    from lora_ppo.data import PromptFormat

    fmt = PromptFormat(tokenizer, chat_template)
    return [fmt.row(text, {name: values[i] for name, values in columns.items()}) for i, text in enumerate(texts)]


@pytest.fixture(scope="session")
def tiny_classifier_dir(tmp_path_factory):
    """A tiny random sequence classifier (2 labels) with its own word-level tokenizer."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import (
        LlamaConfig,
        LlamaForSequenceClassification,
        PreTrainedTokenizerFast,
    )

    folder = tmp_path_factory.mktemp("tiny-classifier")
    # Its own word-level tokenizer, unlike the policy's byte-level BPE: text is re-tokenized.
    words = ["[PAD]", "[UNK]", "good", "bad", "film", "a", "the", "great", "awful"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="[PAD]", unk_token="[UNK]").save_pretrained(folder)
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(words), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2, num_labels=2, pad_token_id=0)
    LlamaForSequenceClassification(config).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def finished_run(tmp_path_factory, tiny_model_dir) -> Path:
    """A finished 3-step tiny run (side metric textblob, held-out evaluations before and after,
    checkpoints/step-2).
    Read-only: a test that writes into a run folder copies it first."""
    from lora_ppo.config import Recipe
    from lora_ppo.trainer import PPOTrainer

    out = tmp_path_factory.mktemp("finished") / "run"
    recipe = tiny_recipe_dict(tiny_model_dir, out, reward={"also_log": ["textblob"]},
                              train={"steps": 3, "sample_every": 1, "save_every": 2})
    PPOTrainer(Recipe(**recipe), progress=False).train()
    return out
