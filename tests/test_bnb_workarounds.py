"""bitsandbytes workarounds on the real 4-bit tiny model: one dequantized copy gives the same numbers
as dequantizing in every pass, is undone on exit, errors included, is made once for a run's steps,
and `auto` holds it only where it fits."""

from __future__ import annotations

import pytest
import torch

import lora_ppo.model as model_module
from lora_ppo.bnb_workarounds import (KEPT_COPY, dequantized_4bit_bytes, dequantized_4bit_layers,
                                      release_dequantized_copies)
from lora_ppo.config import AUTO_DEQUANTIZE_SHARE, ModelConfig
from lora_ppo.model import dequantized_once
from lora_ppo.roles import POLICY, VALUE
from tests.conftest import bnb_4bit_layers, prompt_and_random_response, tiny_recipe_dict


@pytest.fixture(scope="module")
def tokenizer(tiny_tokenizer):
    return tiny_tokenizer


@pytest.fixture()
def roles(make_roles):
    return make_roles(seed=1, scale=0.5)


def test_dequantized_once_gives_same_logprobs_values_and_gradients(roles, tokenizer):
    # model.dequantize_per_step computes each 4-bit layer from one dequantized copy: what
    # bitsandbytes computes per pass, so logprobs, values and adapter gradients must not move.
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was", "The acting in the remake"])

    def run():
        for p in roles.policy_parameters() + roles.value_parameters():
            p.grad = None
        with roles.as_role(POLICY):
            lp, ent = roles.response_logprobs(ids, mask, start, 0.7)
            lp.sum().backward()
        with roles.as_role(VALUE):
            values = roles.values(ids, mask, start)
            values.sum().backward()
        grads = [p.grad.clone() for p in roles.policy_parameters() + roles.value_parameters()]
        return lp.detach(), ent.detach(), values.detach(), grads

    plain = run()
    with dequantized_4bit_layers(roles.peft, torch.float32) as held_bytes:
        assert held_bytes > 0
        assert all("forward" in vars(m) for m in bnb_4bit_layers(roles))
        cached = run()
    for a, b in zip(plain[:3], cached[:3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-5)
    for a, b in zip(plain[3], cached[3]):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)
    # On exit every layer computes from its 4 bits again, and the base is unchanged.
    assert bnb_4bit_layers(roles)
    assert not any("forward" in vars(m) for m in bnb_4bit_layers(roles))
    torch.testing.assert_close(run()[0], plain[0], atol=0, rtol=0)


def test_dequantized_once_is_undone_after_an_error(roles):
    with pytest.raises(KeyboardInterrupt):
        with dequantized_4bit_layers(roles.peft, torch.float32):
            raise KeyboardInterrupt
    assert not any("forward" in vars(m) for m in bnb_4bit_layers(roles))


@pytest.mark.parametrize("free_bytes, held", [(10**12, True), (1, False), (None, False)])
def test_dequantize_auto_holds_the_copy_only_when_it_takes_half_the_free_memory_or_less(
        make_roles, monkeypatch, free_bytes, held):
    # model.dequantize_per_step: auto decides once per model, from the memory free at its first step.
    roles = make_roles(seed=1, scale=0.5)
    monkeypatch.setattr(model_module, "free_memory_bytes", lambda device: free_bytes)
    cfg = ModelConfig(name="tiny", dequantize_per_step="auto")
    assert dequantized_4bit_bytes(roles.peft, torch.float32) == sum(m.weight.quant_state.shape.numel() * 4
                                                                      for m in bnb_4bit_layers(roles))
    with dequantized_once(roles.peft, cfg):
        assert all("forward" in vars(m) for m in bnb_4bit_layers(roles)) is held
    monkeypatch.setattr(model_module, "free_memory_bytes", lambda device: 10**12 if not held else 1)
    with dequantized_once(roles.peft, cfg):  # the first decision stands for the run
        assert all("forward" in vars(m) for m in bnb_4bit_layers(roles)) is held


@pytest.mark.parametrize("budget_of_copy, free_of_copy, held", [
    (10.0, 2.2, True),  # a budget above the whole copy: the copy is what must fit, and it does
    (10.0, 2.0, True),  # exactly half the free memory is still a fit
    (0.25, 1.0, True),  # a budget below it: only the budget's layers are held, and they fit
    (0.25, 0.4, False),  # those do not fit either
])
def test_dequantize_auto_with_a_budget_asks_only_what_the_budget_holds_to_fit(
        make_roles, monkeypatch, budget_of_copy, free_of_copy, held):
    roles = make_roles(seed=1, scale=0.5)  # a model of its own: auto decides once per model
    copy = dequantized_4bit_bytes(roles.peft, torch.float32)
    assert AUTO_DEQUANTIZE_SHARE == 0.5  # the free memory a copy may take
    monkeypatch.setattr(model_module, "free_memory_bytes", lambda device: int(free_of_copy * copy))
    cfg = ModelConfig(name="tiny", dequantize_per_step="auto", dequantize_budget_gb=budget_of_copy * copy / 1e9)
    with dequantized_once(roles.peft, cfg):
        assert any("forward" in vars(m) for m in bnb_4bit_layers(roles)) is held


def test_a_dequantization_budget_holds_the_layers_that_fit_and_keeps_the_numbers(roles, tokenizer):
    """`model.dequantize_budget_gb`: the layers whose copies fit, in the model's order, a layer too
    large for what is left skipped; the others compute from 4 bits; logprobs as without it."""
    ids, mask, start = prompt_and_random_response(tokenizer, ["This movie was"])
    layers = bnb_4bit_layers(roles)
    sizes = [m.weight.quant_state.shape.numel() * 4 for m in layers]  # fp32 copies
    budget = sizes[0] + sizes[1] + 1  # the first two layers, and no third (none is 1 byte)
    with roles.as_role(POLICY):
        plain = roles.response_logprobs(ids, mask, start, 1.0)[0]
        with dequantized_4bit_layers(roles.peft, torch.float32, max_bytes=budget) as held:
            patched = ["forward" in vars(m) for m in layers]
            partial = roles.response_logprobs(ids, mask, start, 1.0)[0]
    assert held == sizes[0] + sizes[1] and patched == [True, True] + [False] * (len(layers) - 2)
    torch.testing.assert_close(partial, plain, atol=1e-5, rtol=1e-5)
    # A budget below the first layer's copy, where a later smaller one fits: the smaller one is held.
    smallest = min(range(len(sizes)), key=sizes.__getitem__)
    if sizes[smallest] < sizes[0]:
        with dequantized_4bit_layers(roles.peft, torch.float32, max_bytes=sizes[smallest]) as held:
            assert held == sizes[smallest] and "forward" in vars(layers[smallest]) and "forward" not in vars(layers[0])
    with dequantized_once(roles.peft, ModelConfig(name="tiny", dequantize_per_step=True,
                                                  dequantize_budget_gb=budget / 1e9)) as held:
        assert held == sizes[0] + sizes[1]


def test_a_runs_copy_is_made_once_and_kept_at_its_addresses_until_released(roles, monkeypatch):
    """`dequantized_once` (each step of a run): the copy made by the first step is the one every later
    step computes from, the same tensors at the same addresses (a compiled decode step's CUDA graphs
    read them there), dequantized no more; between steps the layers compute from their 4 bits; after
    `release_dequantized_copies` a step makes a new copy."""
    import bitsandbytes.functional as bnb_functional

    made = []
    dequantize = bnb_functional.dequantize_4bit
    monkeypatch.setattr(bnb_functional, "dequantize_4bit", lambda *a, **k: made.append(1) or dequantize(*a, **k))
    layers = bnb_4bit_layers(roles)
    cfg = ModelConfig(name="tiny", dequantize_per_step=True)

    def step() -> list[int]:
        with dequantized_once(roles.peft, cfg):
            return [m._lora_ppo_dequantized[0].data_ptr() for m in layers]

    first = step()
    assert len(made) == len(layers)
    assert not any("forward" in vars(m) for m in layers)  # between steps: 4 bits
    assert step() == first and len(made) == len(layers)
    for m in layers:  # the kept copy is bitsandbytes' dequantization of the layer's weight
        kept = vars(m)[KEPT_COPY][0]
        torch.testing.assert_close(kept, dequantize(m.weight.data, m.weight.quant_state).to(kept.dtype), atol=0, rtol=0)
    release_dequantized_copies(roles.peft)
    assert not any(KEPT_COPY in vars(m) for m in layers)
    step()
    assert len(made) == 2 * len(layers)


def test_a_context_inside_another_leaves_the_outer_ones_copies(roles):
    layers = bnb_4bit_layers(roles)
    with dequantized_4bit_layers(roles.peft, torch.float32) as outer_bytes:
        weights = [m._lora_ppo_dequantized[0] for m in layers]
        with dequantized_4bit_layers(roles.peft, torch.float32) as inner_bytes:
            assert inner_bytes == outer_bytes
        assert [m._lora_ppo_dequantized[0] for m in layers] == weights
        assert all("forward" in vars(m) for m in layers)
    assert not any("forward" in vars(m) for m in layers)


def test_a_ppo_run_computes_every_step_from_one_copy_and_lets_it_go_at_the_end(tmp_path, tiny_model_dir):
    import lora_ppo

    recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(tiny_model_dir, tmp_path / "run"),
                                       ["model.dequantize_per_step=true", "train.steps=2", "train.eval=false"])
    trainer = lora_ppo.PPOTrainer(recipe, progress=False)
    layers = bnb_4bit_layers(trainer.roles)
    kept, one_step = [], trainer._train_step

    def step_then_look():
        result = one_step()
        kept.append([vars(m)[KEPT_COPY][0].data_ptr() for m in layers])
        return result

    trainer._train_step = step_then_look
    trainer.train()
    assert len(kept) == 2 and kept[0] == kept[1]
    assert not any(KEPT_COPY in vars(m) for m in layers)


def test_copies_are_in_each_layers_compute_dtype_and_let_go_after_the_context(roles):
    """bitsandbytes dequantizes to the layer's compute dtype (float32 here on CPU), whatever dtype
    the caller names for layers without one: the bytes counted and the copies made are float32,
    and a context that does not ask to keep them leaves none behind."""
    layers = bnb_4bit_layers(roles)
    assert {m.compute_dtype for m in layers} == {torch.float32}
    elements = sum(m.weight.quant_state.shape.numel() for m in layers)
    assert dequantized_4bit_bytes(roles.peft, torch.bfloat16) == 4 * elements
    with dequantized_4bit_layers(roles.peft, torch.bfloat16) as held:
        assert held == 4 * elements
        assert {m._lora_ppo_dequantized[0].dtype for m in layers} == {torch.float32}
    assert not any(KEPT_COPY in vars(m) or "_lora_ppo_dequantized" in vars(m) for m in layers)


def test_evaluating_keeps_the_4bit_layers_on_the_training_kernel_and_the_first_is_found(roles):
    """`eval()` resets every module's training flag, which on AVX512-BF16 CPUs sends bitsandbytes to
    a kernel without a backward (keep_4bit_weights_differentiable): eval_on_training_kernel sets it
    back on every 4-bit layer and leaves the rest in eval mode."""
    from lora_ppo.bnb_workarounds import eval_on_training_kernel, first_4bit_layer

    eval_on_training_kernel(roles.peft)
    layers = bnb_4bit_layers(roles)
    assert all(m.training for m in layers)
    assert not any(m.training for m in roles.peft.modules() if m not in layers)
    assert first_4bit_layer(roles.peft) is layers[0]
    assert first_4bit_layer(torch.nn.Linear(2, 2)) is None
