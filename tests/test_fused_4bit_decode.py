"""model.fused_4bit_decode: the Triton kernel computes what bitsandbytes' dequantize-then-multiply
computes (checked against bitsandbytes' own dequantization on CPU, under Triton's interpreter), the
model's decode-sized no-grad calls go through it and nothing else does, a dequantized copy takes
precedence and gives the kernel back on exit, and where it cannot run the layers stay as they were
with one log line."""

from __future__ import annotations

import json
import logging
import os
import struct
import subprocess
import sys
import weakref
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

import lora_ppo.fused_4bit_decode as fused
from lora_ppo.bnb_workarounds import dequantized_4bit_layers, linear_4bit_layers
from lora_ppo.config import AdaptersConfig, ModelConfig
from lora_ppo.fused_4bit_decode import MAX_ROWS, fuse_4bit_decode, layer_unsupported, quantized_linear, split_k
from lora_ppo.model import load_base_model
from lora_ppo.roles import RoleModel
from tests.conftest import count_nf4_kernel_launches

REPO = Path(__file__).resolve().parents[1]
pytest.importorskip("triton")  # the dev extra installs it; a GPU build of torch brings its own
bnb_functional = pytest.importorskip("bitsandbytes.functional")
# tests/conftest.py runs Triton's interpreter on a machine without a GPU: these tests use CPU tensors.
pytestmark = pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="needs Triton's interpreter")


def quantized(out_features: int, in_features: int, nested: bool, dtype: torch.dtype, seed: int = 0):
    """A random weight quantized to nf4 by bitsandbytes, and bitsandbytes' own dequantization of it."""
    torch.manual_seed(seed)
    weight = torch.randn(out_features, in_features)
    packed, state = bnb_functional.quantize_4bit(weight, blocksize=64, compress_statistics=nested, quant_type="nf4")
    state.dtype = dtype
    return packed, state, bnb_functional.dequantize_4bit(packed, state)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("rows,out_features,in_features", [(1, 64, 64), (5, 96, 128), (16, 200, 256), (64, 32, 512)])
def test_the_kernel_multiplies_by_the_weight_bitsandbytes_dequantizes(rows, out_features, in_features, nested):
    packed, state, weight = quantized(out_features, in_features, nested, torch.float32)
    x = torch.randn(rows, in_features)
    bias = torch.randn(out_features)
    # float32 throughout: only the order of the additions differs from torch's matmul.
    torch.testing.assert_close(quantized_linear(x, packed, state, bias), torch.nn.functional.linear(x, weight, bias),
                               rtol=1e-5, atol=1e-4)


def test_in_float16_the_weight_is_rounded_as_bitsandbytes_rounds_it():
    packed, state, weight = quantized(64, 256, nested=True, dtype=torch.float16)
    x = torch.randn(8, 256, dtype=torch.float16)
    got = quantized_linear(x, packed, state)
    assert got.dtype == torch.float16
    # The same float16 weight and inputs, products summed in float32: equal up to float16's rounding of the
    # output (half a unit in the last place of values up to ~60).
    expected = torch.nn.functional.linear(x.float(), weight.float())
    torch.testing.assert_close(got.float(), expected, rtol=1e-3, atol=0.02)


def test_split_k_fills_the_card_and_covers_the_inner_dimension_once():
    # Llama-3.1-8B's shapes on an H100's 132 multiprocessors, 64-value blocks, by hand:
    # q/o: 64 column tiles want ceil(528 / 64) = 9 slices of 64 blocks -> 8 blocks per slice -> 8 slices.
    assert split_k(4096, 4096, 64, 132) == (8, 512)
    # k/v: 16 tiles want 33 slices, capped at 64 / 4 = 16 (4 blocks each).
    assert split_k(1024, 4096, 64, 132) == (16, 256)
    # gate/up: 224 tiles want ceil(528 / 224) = 3 slices -> 22 blocks per slice (the last one 20).
    assert split_k(14336, 4096, 64, 132) == (3, 1408)
    # down: 64 tiles want 9 of 224 blocks -> 25 blocks per slice -> 9 slices, the last one shorter.
    assert split_k(4096, 14336, 64, 132) == (9, 1600)


def test_split_k_slices_hold_whole_iterations_of_blocks():
    # down (224 blocks) wants 9 slices of 25 blocks; at 2 blocks an iteration 26 each -> 9 slices (the
    # last of 16), at 4 -> 28 each -> 8 slices.
    assert split_k(4096, 14336, 64, 132, per_iteration=2) == (9, 26 * 64)
    assert split_k(4096, 14336, 64, 132, per_iteration=4) == (8, 28 * 64)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("per_iteration, slices", [(1, 5), (2, 4), (4, 3)])
def test_slices_of_the_inner_dimension_add_up_to_the_product(monkeypatch, per_iteration, slices, nested):
    """Split-K with 1, 2 or 4 blocks an iteration: 21 blocks in slices of 5 (the last of 1), 6 (the
    last of 3) or 8 (the last of 5). With 2 or 4 the last slice's last iteration runs past the end of
    the weight: those blocks must count as nothing."""
    monkeypatch.setattr(fused, "_multiprocessors", lambda device: 132)
    monkeypatch.setattr(fused, "BLOCKS_PER_ITERATION", per_iteration)
    packed, state, weight = quantized(64, 21 * 64, nested=nested, dtype=torch.float32)
    assert split_k(64, 21 * 64, 64, 132, per_iteration)[0] == slices
    x = torch.randn(3, 21 * 64)
    torch.testing.assert_close(quantized_linear(x, packed, state), torch.nn.functional.linear(x, weight),
                               rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("nested", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_paired_lookups_give_the_same_product_to_the_bit(monkeypatch, nested, dtype):
    """PAIRED_CODES looks a byte's two table values up in one 64-bit word: the same float32 values,
    so the same weights and the same sums."""
    packed, state, _ = quantized(96, 256, nested=nested, dtype=dtype)
    x = torch.randn(5, 256).to(dtype)
    singly = quantized_linear(x, packed, state)
    launches = count_nf4_kernel_launches(monkeypatch)
    monkeypatch.setattr(fused, "PAIRED_CODES", True)
    assert torch.equal(quantized_linear(x, packed, state), singly) and len(launches) == 1


def test_the_paired_table_holds_each_bytes_two_values():
    code = torch.linspace(-1.0, 1.0, 16)
    table = fused.paired_codes(code, torch.device("cpu"))
    assert table.dtype == torch.int64 and table.shape == (256,)
    # byte 0x3A: high nibble 3 in the low 32 bits, low nibble 10 in the high 32 bits
    word = int(table[0x3A]) & 0xFFFFFFFFFFFFFFFF  # as the 64 unsigned bits the kernel loads
    # Read by Python's struct: torch's int64 -> int32 cast of a value past 2**31 is undefined (it gave other
    # bits on an AMD EPYC, 2026-11-28)
    low, high = struct.unpack("<ff", word.to_bytes(8, "little"))
    assert low == code[3].item() and high == code[10].item()


def test_a_paired_table_is_not_reused_for_another_code_at_a_freed_codes_address(monkeypatch):
    """The tables are cached by the code's address: a code freed and another allocated in its place (a
    second model in one process, or a test's) gets its own table, not the freed one's (CI, 2026-11-28:
    a test read another code's values)."""
    code = torch.linspace(-1.0, 1.0, 16)
    freed = torch.zeros(1)
    stale = (weakref.ref(freed), torch.zeros(256, dtype=torch.int64))  # what a freed code left at this address
    del freed
    monkeypatch.setattr(fused, "_PAIRED_TABLES", {(code.data_ptr(), torch.device("cpu")): stale})
    table = fused.paired_codes(code, torch.device("cpu"))
    assert table is not stale[1] and torch.equal(table, fused.paired_codes(code, torch.device("cpu")))
    low, high = struct.unpack("<ff", (int(table[0x3A]) & 0xFFFFFFFFFFFFFFFF).to_bytes(8, "little"))
    assert (low, high) == (code[3].item(), code[10].item())
    assert fused.paired_codes(code, torch.device("cpu")) is table  # while the code lives, built once


def test_a_shapes_tuned_launch_settings_are_its_own(monkeypatch):
    """`TUNED_LAUNCH` (a device's best, bench/nf4_decode_matmul.py) for one weight shape changes that
    shape's launch alone, and the product stays the same."""
    monkeypatch.setattr(fused, "_multiprocessors", lambda device: 132)
    monkeypatch.setitem(fused.TUNED_LAUNCH, (64, 21 * 64), {"block_n": 32, "blocks_per_iteration": 4})
    launches = count_nf4_kernel_launches(monkeypatch)
    x = torch.randn(3, 21 * 64)
    for out_features in (64, 32):
        packed, state, weight = quantized(out_features, 21 * 64, nested=True, dtype=torch.float32)
        torch.testing.assert_close(quantized_linear(x, packed, state), torch.nn.functional.linear(x, weight),
                                   rtol=1e-5, atol=1e-4)
    # Tuned: 2 tiles of 32 columns; 21 blocks want 5 slices of 5, at 4 an iteration slices of 8: 3.
    # The other shape, by the defaults: 1 tile of 64 columns, 5 slices of 5 blocks.
    assert launches == [(2, 3), (1, 5)]


def test_the_kernel_compiles_for_the_gpus_users_have():
    """The interpreter runs the kernel's arithmetic, not its lowering to a GPU. bench/nf4_kernel_compile.py
    compiles it ahead of time (Triton's own ptxas, no GPU) for a T4 in float16, an RTX 3090 in bf16 and
    an H100 in bf16 and float32, at the launch defaults, with paired lookups and at each tuned setting,
    at 16 or 64 rows (the widest row tile): each must compile, spill no registers to local memory and
    fit the card's shared memory per block."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    done = subprocess.run([sys.executable, str(REPO / "bench" / "nf4_kernel_compile.py"), "--targets",
                           "75:fp16:64,86:bf16:64,90:bf16:16,90:fp32:64"], capture_output=True, text=True, env=env,
                          timeout=600)
    assert done.returncode == 0, done.stderr[-2000:]
    compiles = json.loads(done.stdout)
    assert len(compiles) >= 8 and {c["launch"]["paired_codes"] for c in compiles} == {False, True}
    for result in compiles:
        assert "error" not in result and result["spilled_bytes"] == 0 and result["shared_fits"], result


@pytest.fixture(scope="module")
def models(tiny_model_dir):
    """The tiny 4-bit model twice, with and without the fused decode, with the same random adapters."""
    def roles(fuse: bool):
        torch.manual_seed(0)
        base = load_base_model(ModelConfig(name=str(tiny_model_dir), fused_4bit_decode=fuse))
        return RoleModel(base, AdaptersConfig(policy={"r": 4, "alpha": 8}, value={"r": 4, "alpha": 8}))

    return roles(True), roles(False)


def test_decode_sized_no_grad_calls_take_the_kernel_and_give_the_models_logits(models, tiny_tokenizer, monkeypatch):
    fused_roles, plain_roles = models
    layers = linear_4bit_layers(fused_roles.peft)
    assert layers and all("forward" in vars(layer) for layer in layers)
    ids = torch.tensor([tiny_tokenizer.encode("the film was good")] * 2)
    calls = count_nf4_kernel_launches(monkeypatch)
    with torch.no_grad():
        got = fused_roles.peft(input_ids=ids).logits
        expected = plain_roles.peft(input_ids=ids).logits
    assert len(calls) == len(layers)  # every 4-bit layer, once
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)


def test_greedy_generation_picks_the_same_tokens(models, tiny_tokenizer):
    fused_roles, plain_roles = models
    ids = torch.tensor([tiny_tokenizer.encode("my family loved the")] * 3)
    settings = {"max_new_tokens": 8, "do_sample": False, "pad_token_id": tiny_tokenizer.pad_token_id}
    with torch.no_grad():
        got = fused_roles.peft.generate(input_ids=ids, **settings)
        expected = plain_roles.peft.generate(input_ids=ids, **settings)
    assert torch.equal(got, expected)


def test_calls_with_a_gradient_or_many_rows_keep_bitsandbytes_forward(models, tiny_tokenizer, monkeypatch):
    fused_roles, plain_roles = models
    calls = count_nf4_kernel_launches(monkeypatch)
    short = torch.tensor([tiny_tokenizer.encode("the film was good")])
    long_rows = torch.randint(3, len(tiny_tokenizer), (MAX_ROWS // 8 + 1, 8))  # MAX_ROWS + 8 rows
    with torch.no_grad():
        torch.testing.assert_close(fused_roles.peft(input_ids=long_rows).logits,
                                   plain_roles.peft(input_ids=long_rows).logits, rtol=0, atol=0)
    with torch.enable_grad():
        got = fused_roles.peft(input_ids=short).logits
        expected = plain_roles.peft(input_ids=short).logits
    torch.testing.assert_close(got, expected, rtol=0, atol=0)
    assert calls == []


def test_a_dequantized_copy_takes_precedence_and_gives_the_kernel_back(models, tiny_tokenizer, monkeypatch):
    fused_roles, _ = models
    layers = linear_4bit_layers(fused_roles.peft)
    fused_forward = [vars(layer)["forward"] for layer in layers]
    calls = count_nf4_kernel_launches(monkeypatch)
    ids = torch.tensor([tiny_tokenizer.encode("bad")])
    with dequantized_4bit_layers(fused_roles.peft, torch.float32, keep=False), torch.no_grad():
        fused_roles.peft(input_ids=ids)
    assert calls == []
    assert [vars(layer)["forward"] for layer in layers] == fused_forward
    with torch.no_grad():
        fused_roles.peft(input_ids=ids)
    assert len(calls) == len(layers)


def test_off_with_one_log_line_where_the_kernel_cannot_run(tiny_model_dir, monkeypatch, caplog):
    monkeypatch.delenv("TRITON_INTERPRET")
    model = load_base_model(ModelConfig(name=str(tiny_model_dir)))
    with caplog.at_level(logging.INFO, logger="lora_ppo.fused_4bit_decode"):
        assert fuse_4bit_decode(model, torch.device("cpu")) == 0
        monkeypatch.setitem(sys.modules, "triton", None)  # as if not installed
        assert fuse_4bit_decode(model, torch.device("cuda")) == 0
    assert [r.getMessage() for r in caplog.records] == [
        "model.fused_4bit_decode: off (Triton kernels need a CUDA GPU (this run is on cpu)); the 4-bit layers "
        "keep bitsandbytes' forward",
        "model.fused_4bit_decode: off (Triton is not installed); the 4-bit layers keep bitsandbytes' forward",
    ]
    assert not any("forward" in vars(layer) for layer in linear_4bit_layers(model))


def test_layers_the_kernel_does_not_read_are_left_and_named(tiny_model_dir, caplog):
    model = load_base_model(ModelConfig(name=str(tiny_model_dir)))
    layers = linear_4bit_layers(model)
    layers[0].weight.quant_state.quant_type = "fp4"  # what the kernel does not decode
    with caplog.at_level(logging.INFO, logger="lora_ppo.fused_4bit_decode"):
        assert fuse_4bit_decode(model, torch.device("cpu")) == len(layers) - 1
    assert "forward" not in vars(layers[0])
    assert caplog.records[-1].getMessage() == (
        f"model.fused_4bit_decode: {len(layers) - 1} of {len(layers)} 4-bit layers decode with the fused kernel "
        "(the others: its quant type is fp4 (the kernel reads nf4))")


@pytest.mark.parametrize("change,reason", [
    ({"quant_type": "fp4"}, "its quant type is fp4 (the kernel reads nf4)"),
    ({"shape": torch.Size([64, 96])}, "its input width 96 is not a multiple of its block size 64"),
    ({"shape": torch.Size([2**16, 2**15])}, "its 2147483648 values need 64-bit offsets (the kernel's are 32-bit)"),
    ({"nested": True, "state2": SimpleNamespace(blocksize=128)}, "its scales are quantized in blocks of 128, not 256"),
    ({"shape": torch.Size([32, 128])}, "bitsandbytes measured faster at its shape (32, 128) (BITSANDBYTES_FASTER)"),
])
def test_each_layer_the_kernel_cannot_read_or_should_not_says_why(change, reason, monkeypatch):
    monkeypatch.setattr(fused, "BITSANDBYTES_FASTER", {(32, 128)})
    state = SimpleNamespace(**{"quant_type": "nf4", "shape": torch.Size([64, 128]), "blocksize": 64, "nested": False,
                               **change})
    layer = SimpleNamespace(weight=SimpleNamespace(quant_state=state))
    assert layer_unsupported(layer) == reason
    state.__dict__.update(quant_type="nf4", shape=torch.Size([64, 128]), state2=SimpleNamespace(blocksize=256))
    assert layer_unsupported(layer) is None


@pytest.mark.parametrize("model", [{"quantization": "none"}, {"bnb_4bit_quant_type": "fp4"}])
def test_the_recipe_refuses_it_without_nf4_weights(model):
    with pytest.raises(ValueError, match="fused_4bit_decode: needs model.quantization 4bit with bnb_4bit_quant_type nf4"):
        ModelConfig(fused_4bit_decode=True, **model)


def test_a_run_with_it_on_samples_and_trains_as_one_without(tiny_model_dir, tmp_path, caplog):
    """Two PPO steps from the same seed with the setting on and off (4-bit layers computed from their 4
    bits, `model.dequantize_per_step` off): the same responses at every step, the same losses within
    float32 rounding, and the load's log line."""
    import lora_ppo
    from tests.conftest import tiny_recipe_dict

    steps = {}
    for setting in (False, True):
        recipe = lora_ppo.recipe_from_dict(tiny_recipe_dict(
            tiny_model_dir, tmp_path / f"fused-{setting}", model={"fused_4bit_decode": setting,
                                                                   "dequantize_per_step": False}))
        with caplog.at_level(logging.INFO, logger="lora_ppo.fused_4bit_decode"):
            trainer = lora_ppo.PPOTrainer(recipe, progress=False)
        steps[setting] = [trainer.train_step() for _ in range(2)]
    assert [r.getMessage() for r in caplog.records] == [
        "model.fused_4bit_decode: 14 of 14 4-bit layers decode with the fused kernel"]
    for (plain, plain_rollout), (fused_run, fused_rollout) in zip(steps[False], steps[True]):
        assert torch.equal(plain_rollout.response_ids, fused_rollout.response_ids)
        assert fused_run["objective/raw_scores"] == plain["objective/raw_scores"]
        for key in ("objective/kl", "loss/policy", "loss/value"):
            assert fused_run[key] == pytest.approx(plain[key], abs=1e-4), key
