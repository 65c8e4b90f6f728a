"""model.fused_lora: each LoRA linear layer as its base output plus one addmm of the adapter's product
in the compute dtype. Checked on CPU against PEFT's own forward on the same weights: the same numbers
in float32 (within rounding), as close to a float32 computation as PEFT's path in bfloat16, no float32
copies of activations kept for the backward, the layers PEFT must handle left to it, and a PPO run."""

from __future__ import annotations

import logging
import math

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import lora_ppo
from lora_ppo.alarms import LOGPROB_TOLERANCE
from lora_ppo.config import recipe_from_dict
from lora_ppo.fused_lora import CAST_COPIES, fuse_lora_layers, pefts_forward, unfuse_lora_layers
from lora_ppo.quantization import AdapterNumerics
from lora_ppo.roles import POLICY, REFERENCE, VALUE
from lora_ppo.rollout import score_passes
from tests.conftest import forward_and_grads, prompt_and_random_response, tiny_recipe_dict


def both_ways(roles, tokenizer, role):
    """`forward_and_grads` with PEFT's forward, then with the fused one, on the same weights."""
    with pefts_forward(roles.peft):
        peft = forward_and_grads(roles, tokenizer, role)
    fuse_lora_layers(roles.peft)
    try:
        return peft, forward_and_grads(roles, tokenizer, role)
    finally:
        unfuse_lora_layers(roles.peft)


@pytest.fixture(scope="module")
def float32_roles(make_roles):
    return make_roles(seed=0, scale=0.5, compute_dtype="float32")


@pytest.mark.parametrize("role", [POLICY, VALUE, REFERENCE])
def test_float32_gives_pefts_numbers(float32_roles, tiny_tokenizer, role):
    (peft_hidden, peft_logprobs, peft_grads), (hidden, logprobs, grads) = both_ways(float32_roles, tiny_tokenizer, role)
    if role == REFERENCE:  # adapters disabled: PEFT's forward runs, the base alone
        assert torch.equal(hidden, peft_hidden)
        return
    assert not torch.equal(peft_hidden, forward_and_grads(float32_roles, tiny_tokenizer, REFERENCE)[0])  # adapters matter
    torch.testing.assert_close(hidden, peft_hidden, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(logprobs, peft_logprobs, rtol=1e-5, atol=1e-5)
    assert len(grads) == len(peft_grads) > 0  # the same parameters got gradients
    for g, e in zip(grads, peft_grads):
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_bfloat16_is_as_close_to_float32_as_pefts_path(make_roles, tiny_tokenizer):
    """Against the same policy computed wholly in float32, the fused path's logprobs and gradients in
    bfloat16 are within 1.25x the distance of PEFT's bfloat16 path (bfloat16 base, float32 adapters),
    the bound `model.adapter_autocast` keeps: on this tiny random model 0.125 against 0.117 nats per
    token, and 35% against 33% of the gradient's norm (autocast: 0.117 and 35%). A regression check at
    this seed and size, not a law: a bfloat16 adapter rounds where PEFT's float32 one does not, and over
    other sizes and adapter scales fused_lora measured 1.0-1.7x (bench/update_numerics.py, README)."""
    roles = make_roles(seed=0, scale=0.5, perturbed=(POLICY,), compute_dtype="bfloat16")
    exact = make_roles(perturbed=(), compute_dtype="float32")
    with torch.no_grad():
        for mine, theirs in zip(exact.policy_parameters(), roles.policy_parameters()):
            mine.copy_(theirs)
    (_, peft_logprobs, peft_grads), (_, logprobs, grads) = both_ways(roles, tiny_tokenizer, POLICY)
    _, exact_logprobs, exact_grads = forward_and_grads(exact, tiny_tokenizer, POLICY)
    assert not torch.equal(logprobs, peft_logprobs)  # the adapters really ran in another dtype

    def distance(logprobs, grads) -> tuple[float, float]:
        return (float((logprobs - exact_logprobs).abs().mean()),
                max(float((g - e).norm() / e.norm()) for g, e in zip(grads, exact_grads, strict=True)))

    fused, peft = distance(logprobs, grads), distance(peft_logprobs, peft_grads)
    assert fused[0] <= 1.25 * peft[0] and fused[1] <= 1.25 * peft[1], (fused, peft)


def float32_saved_inside_lora_layers(roles, tokenizer) -> tuple[int, int]:
    """(bytes of float32 tensors that autograd keeps for the backward from inside the LoRA layers'
    forwards, the bytes PEFT's path keeps there by hand: each layer's input cast to float32 and the
    adapter's rank-wide product, saved by its two matmuls with their float32 weights; A's weight only
    where the input needs a gradient, not in the first layer), as the policy."""
    from peft.tuners.lora import LoraLayer

    layers = [m for m in roles.peft.modules() if isinstance(m, LoraLayer)]
    inside, saved, expected = [], [], []

    def enter(module, args):
        inside.append(module)
        tokens = args[0].numel() // module.in_features
        rank = module.r[POLICY]
        a_weight = rank * module.in_features if args[0].requires_grad else 0
        expected.append(4 * (tokens * module.in_features + tokens * rank + a_weight + module.out_features * rank))

    def leave(module, args, output) -> None:
        inside.pop()

    def pack(t: torch.Tensor) -> torch.Tensor:
        if inside and t.dtype == torch.float32:
            saved.append(t.numel() * t.element_size())
        return t

    handles = [h for m in layers for h in (m.register_forward_pre_hook(enter),
                                           m.register_forward_hook(leave))]
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            forward_and_grads(roles, tokenizer, POLICY)
    finally:
        for h in handles:
            h.remove()
    return sum(saved), sum(expected)


def test_bfloat16_keeps_no_float32_copies_of_activations(make_roles, tiny_tokenizer):
    roles = make_roles(seed=0, scale=0.5, perturbed=(POLICY,), compute_dtype="bfloat16")
    with pefts_forward(roles.peft):
        peft_saved, by_hand = float32_saved_inside_lora_layers(roles, tiny_tokenizer)
    assert peft_saved == by_hand > 0  # what is counted is what PEFT's path keeps
    fuse_lora_layers(roles.peft)
    try:
        assert float32_saved_inside_lora_layers(roles, tiny_tokenizer)[0] == 0
    finally:
        unfuse_lora_layers(roles.peft)


class AdapterWeightCasts(TorchDispatchMode):
    """Counts the casts of the LoRA adapters' own weights, one by one or batched (`_foreach_copy_`)."""

    def __init__(self, roles):
        super().__init__()
        self.pointers = {p.data_ptr() for n, p in roles.peft.named_parameters() if "lora_" in n}
        self.single = self.batched = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._to_copy.default and args[0].data_ptr() in self.pointers:
            self.single += 1
        if func is torch.ops.aten._foreach_copy_.default and any(t.data_ptr() in self.pointers for t in args[1]):
            self.batched += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("rows", ["policy", "policy-and-value-stacked"])
@pytest.mark.parametrize("checkpointing", [True, False])
def test_adapters_cast_once_are_each_layers_own_casts(make_roles, tiny_tokenizer, rows, checkpointing):
    """In bfloat16 with float32 adapters, one batched cast per pass (`adapters_cast_once`, around each
    of the update's forward-and-backward) gives every layer the copies its own cast would: the same
    hidden states and float32 gradients, bit for bit, checkpointed layers recomputing from them too. Inside, no layer casts an adapter's weight; after, no copy is left on a layer."""
    roles = make_roles(seed=0, scale=0.5, perturbed=(POLICY, VALUE), compute_dtype="bfloat16")
    fuse_lora_layers(roles.peft)
    ids, mask, start = prompt_and_random_response(tiny_tokenizer, ["the film was", "a"], response_len=5)

    def forward_and_grads_of(names):
        """Hidden states and trainable gradients of a forward and backward as the roles `names`."""
        if len(names) == 1:
            return forward_and_grads(roles, tiny_tokenizer, names[0])[::2]
        with roles.rows_as_roles(names, ids.shape[0]):  # the recomputation too
            hidden = roles.stacked_hidden_states(ids, mask, len(names))
            sum(h.float().sum() for h in hidden).backward()
        params = roles.policy_parameters() + roles.value_parameters()
        grads = [p.grad.clone() for p in params if p.grad is not None]
        for p in params:
            p.grad = None
        return torch.cat(hidden).detach(), grads

    names = [POLICY] if rows == "policy" else [POLICY, VALUE]
    try:
        with roles.gradient_checkpointing(checkpointing):
            with AdapterWeightCasts(roles) as per_call:
                hidden, grads = forward_and_grads_of(names)
            with AdapterWeightCasts(roles) as once, roles.adapters_cast_once(names):
                once_hidden, once_grads = forward_and_grads_of(names)
    finally:
        unfuse_lora_layers(roles.peft)
    assert per_call.single > 0 and per_call.batched == 0  # each layer cast its weights
    assert once.single == 0 and once.batched == 1  # one batched cast for every layer and role
    assert torch.equal(once_hidden, hidden)
    assert len(once_grads) == len(grads) > 0 and all(g.dtype == torch.float32 for g in once_grads)
    for g, e in zip(once_grads, grads, strict=True):
        assert torch.equal(g, e)
    assert not any(CAST_COPIES in module.__dict__ for module in roles.peft.modules())


@pytest.mark.parametrize("together", [False, True], ids=["one-role-a-pass", "roles-together"])
def test_the_update_casts_each_passs_adapters_once(make_roles, tiny_tokenizer, together):
    """`ppo_update` in bfloat16 with fused layers: one batched cast per micro-batch and pass, none per
    layer. (That its update is the one of casts per layer, bit for bit, test_compiled_update.py checks:
    the compiled layers cast per layer.)"""
    from lora_ppo.config import PPOConfig
    from lora_ppo.update import UpdateSettings, compute_advantages, ppo_update
    from tests.conftest import rollout_for_update

    roles = make_roles(seed=1, scale=0.5, compute_dtype="bfloat16")
    fuse_lora_layers(roles.peft)
    rollout = rollout_for_update(roles, tiny_tokenizer)
    cfg = PPOConfig(num_epochs=2, num_minibatches=2, grad_accum_steps=2)  # 8 micro-batches of 1 row
    optimizer = torch.optim.AdamW(roles.policy_parameters() + roles.value_parameters(), lr=1e-3)
    settings = UpdateSettings(2, 1, 1.0, gradient_checkpointing=True, roles_together=together)
    try:
        with AdapterWeightCasts(roles) as casts:
            ppo_update(roles, optimizer, None, rollout, compute_advantages(rollout, cfg, cfg.kl_coef, rollout.scores),
                       cfg, settings, cfg.kl_coef, torch.Generator().manual_seed(0))
    finally:
        unfuse_lora_layers(roles.peft)
    assert roles.mixed_batches[True]  # stacked rows run here
    assert casts.single == 0 and casts.batched == (8 if together else 16)


def test_an_sft_step_casts_the_adapter_once_per_micro_batch(tmp_path, tiny_model_dir):
    """`train-sft` (and `train-reward`, through the same `AdapterTrainer.micro_batch`) in bfloat16 with
    fused layers and gradient checkpointing: one batched cast per micro-batch, none per layer."""
    from lora_ppo.config import SFTRecipe
    from lora_ppo.sft.trainer import SFTTrainer
    from tests.sft_helpers import demonstration_rows, sft_recipe_dict, write_jsonl

    data = write_jsonl(tmp_path / "train.jsonl", demonstration_rows(8))
    recipe = sft_recipe_dict(tiny_model_dir, data, data, tmp_path / "run", batch_size=4, grad_accum_steps=2)
    recipe["model"].update(compute_dtype="bfloat16", fused_lora=True, gradient_checkpointing=True)
    trainer = SFTTrainer(recipe_from_dict(recipe, schema=SFTRecipe), progress=False)
    with AdapterWeightCasts(trainer.model) as casts:
        loss = trainer.train_step()["sft/loss"]
    assert casts.single == 0 and casts.batched == 2
    assert math.isfinite(loss) and loss > 0


def test_adapters_cast_once_leaves_no_copies_after_an_error(make_roles):
    roles = make_roles(seed=0, compute_dtype="bfloat16")
    fuse_lora_layers(roles.peft)
    try:
        with pytest.raises(RuntimeError, match="inside"), roles.adapters_cast_once([POLICY]):
            assert sum(CAST_COPIES in module.__dict__ for module in roles.peft.modules()) == 14
            raise RuntimeError("inside")
    finally:
        unfuse_lora_layers(roles.peft)
    assert not any(CAST_COPIES in module.__dict__ for module in roles.peft.modules())


def test_lora_dropout_draws_pefts_masks(tiny_model_dir, caplog):
    """`train-sft` (and `train-reward`) with LoRA dropout: in a training step the fused layers drop
    what PEFT's drop, from the same random draws (float32)."""
    from lora_ppo.config import ModelConfig, SFTAdapterSettings
    from lora_ppo.model import load_base_model
    from lora_ppo.sft.batches import Batch
    from lora_ppo.sft.model import SFTModel
    from tests.conftest import perturb_lora_b

    with caplog.at_level(logging.INFO, logger="lora_ppo.fused_lora"):
        model = SFTModel(load_base_model(ModelConfig(name=str(tiny_model_dir))), SFTAdapterSettings(r=4, dropout=0.5),
                         numerics=AdapterNumerics(fused=True))
    assert caplog.messages == ["model.fused_lora: 14 LoRA layers add their adapters by one addmm in the compute dtype"]
    perturb_lora_b(model, POLICY, seed=1, scale=0.3)
    ids = torch.tensor([[5, 9, 17, 33, 60, 7]])
    batch = Batch(ids, torch.arange(6).unsqueeze(0), torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))

    def dropped(seed: int) -> torch.Tensor:
        torch.manual_seed(seed)
        with torch.no_grad(), model.training_mode():
            return model.target_logprobs(batch)

    fused = dropped(0)
    assert not torch.equal(fused, dropped(1))  # dropout acts
    with pefts_forward(model.peft):
        torch.testing.assert_close(fused, dropped(0), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("grad", [False, True], ids=["no-grad", "grad"])
def test_rows_of_roles_in_any_order_get_their_own_adapters(float32_roles, grad):
    """One fused layer over rows named policy, value, policy (PEFT's per-row adapter names, a name
    coming back after another): each row is its base output plus its own adapter's scaled product,
    computed here by hand, with autograd (blocks joined) and without (added in place); with autograd
    the gradients of the adapters and of the input are those of PEFT's own forward of the same rows."""
    layer = next(m for m in float32_roles.peft.modules() if hasattr(m, "lora_A") and VALUE in m.lora_A)
    names = [POLICY, VALUE, POLICY]
    x = torch.randn(3, 4, layer.in_features, generator=torch.Generator().manual_seed(0)).requires_grad_(grad)
    weights = [layer.lora_A[n].weight for n in (POLICY, VALUE)] + [layer.lora_B[n].weight for n in (POLICY, VALUE)]
    weights += [x] if grad else []

    def rows_and_grads():
        with torch.set_grad_enabled(grad):
            out = layer(x, adapter_names=names)
        if not grad:
            return out, []
        out.square().sum().backward()
        grads = [w.grad.clone() for w in weights]
        for w in weights:
            w.grad = None
        return out.detach(), grads

    fuse_lora_layers(float32_roles.peft)
    try:
        fused, fused_grads = rows_and_grads()
    finally:
        unfuse_lora_layers(float32_roles.peft)
    pefts, peft_grads = rows_and_grads()
    with torch.no_grad():
        by_hand = torch.stack([layer.base_layer(x[row]) + layer.scaling[name] * (
            x[row] @ layer.lora_A[name].weight.t() @ layer.lora_B[name].weight.t()) for row, name in enumerate(names)])
    assert not torch.allclose(by_hand[0], by_hand[1]), "policy and value must differ for the check to mean anything"
    torch.testing.assert_close(fused, by_hand, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(pefts, by_hand, rtol=1e-5, atol=1e-5)
    for g, e in zip(fused_grads, peft_grads, strict=True):
        assert e.abs().sum() > 0
        torch.testing.assert_close(g, e, rtol=1e-4, atol=1e-6)


def test_a_decode_step_adds_the_adapter_to_every_row(float32_roles):
    """Generation's decode step: one new token for each of several rows ([rows, 1, in], more rows than
    tokens), without autograd (the in-place path). Every row is its base output plus the adapter's
    scaled product, computed by hand, not the first row alone."""
    layer = next(m for m in float32_roles.peft.modules() if hasattr(m, "lora_A") and POLICY in m.lora_A)
    x = torch.randn(4, 1, layer.in_features, generator=torch.Generator().manual_seed(1))
    fuse_lora_layers(float32_roles.peft)
    try:
        with torch.no_grad(), float32_roles.as_role(POLICY):
            fused = layer(x)
    finally:
        unfuse_lora_layers(float32_roles.peft)
    with torch.no_grad():
        base = layer.base_layer(x)
        by_hand = base + layer.scaling[POLICY] * (x @ layer.lora_A[POLICY].weight.t() @ layer.lora_B[POLICY].weight.t())
    assert not torch.allclose(by_hand[1:], base[1:]), "the adapter must change the rows for the check to mean anything"
    torch.testing.assert_close(fused, by_hand, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_stacked_scoring_gives_each_roles_own_forward(make_roles, tiny_tokenizer, dtype):
    """Scoring every role in one stacked forward (PEFT's per-row adapter names) runs each block of rows
    through the fused layers as that role's own forward: the same logprobs and values, so the PPO ratio
    starts at 1 against the update's forward."""
    roles = make_roles(seed=0, scale=0.5, compute_dtype=dtype)
    ids, mask, start = prompt_and_random_response(tiny_tokenizer, ["the film was", "a", "it"], response_len=5)
    fuse_lora_layers(roles.peft)
    assert roles.mixed_batches[False]
    together = score_passes(roles, ids, mask, start, 1.0, 3, together=True)
    apart = score_passes(roles, ids, mask, start, 1.0, 3, together=False)
    unfuse_lora_layers(roles.peft)
    pefts = score_passes(roles, ids, mask, start, 1.0, 3, together=False)
    for stacked, alone, peft in zip(together, apart, pefts):
        assert torch.equal(stacked, alone)
        if dtype == "float32":
            torch.testing.assert_close(alone, peft, rtol=1e-5, atol=1e-5)


def test_a_ppo_run_with_fused_lora_samples_scores_and_updates_one_policy(tmp_path, tiny_model_dir):
    """bfloat16, gradient checkpointing: the update's first forward gives the scoring pass's logprobs
    (the self-check), generation's are within bfloat16 rounding of them, and the policy trains."""
    recipe = recipe_from_dict(tiny_recipe_dict(
        tiny_model_dir, tmp_path / "run", model={"compute_dtype": "bfloat16", "fused_lora": True,
                                                  "gradient_checkpointing": True},
        rollout={"logprobs_from_generation": False}, train={"steps": 2, "eval": False}))
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    q_proj = next(m for name, m in trainer.roles.peft.named_modules() if name.endswith("self_attn.q_proj"))
    assert "forward" in q_proj.__dict__  # routed
    before = [p.detach().clone() for p in trainer.roles.policy_parameters()]
    metrics, _ = trainer.train_step()
    assert metrics["check/logprob_mean_diff"] <= LOGPROB_TOLERANCE["bfloat16"]
    assert metrics["check/generation_logprob_diff"] <= LOGPROB_TOLERANCE["bfloat16"]
    after = trainer.roles.policy_parameters()
    assert all(p.dtype == torch.float32 for p in after)
    assert any(not torch.equal(b, a) for b, a in zip(before, after))


def test_a_dora_adapter_is_left_to_pefts_forward(tiny_model_dir, tmp_path):
    """An adapter PEFT computes another way (DoRA, started from with `init_from`) keeps PEFT's forward
    in every fused layer: the same numbers as without the setting, bit for bit."""
    from peft import LoraConfig, get_peft_model

    from lora_ppo.config import ModelConfig, SFTAdapterSettings
    from lora_ppo.model import load_base_model
    from lora_ppo.sft.batches import Batch
    from lora_ppo.sft.model import SFTModel

    dora = get_peft_model(load_base_model(ModelConfig(name=str(tiny_model_dir))),
                          LoraConfig(r=4, lora_alpha=8, target_modules="all-linear", use_dora=True))
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():  # PEFT starts B at zero: the adapter would change nothing
        for name, p in dora.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    dora.save_pretrained(tmp_path / "dora")
    model = SFTModel(load_base_model(ModelConfig(name=str(tiny_model_dir))),
                     SFTAdapterSettings(init_from=str(tmp_path / "dora")), numerics=AdapterNumerics(fused=True))
    assert any(POLICY in m.lora_variant for m in model.peft.modules() if hasattr(m, "lora_variant"))
    ids = torch.tensor([[5, 9, 17, 33, 60, 7]])
    batch = Batch(ids, torch.arange(6).unsqueeze(0), torch.ones_like(ids), torch.ones_like(ids, dtype=torch.bool))
    with torch.no_grad():
        fused = model.target_logprobs(batch)
        unfuse_lora_layers(model.peft)
        assert torch.equal(fused, model.target_logprobs(batch))
