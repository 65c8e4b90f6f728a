"""Compiling the decode step with each decoder layer as one region, against the whole step.

`rollout.compile` compiles one decode step through every decoder layer: its compile time grows
with the depth (64-85 s for Llama-3.1-8B's 32 layers on an H100 or H200, bench/README.md).
`torch.compiler.nested_compile_region` traces a function once and reuses the traced region for
every call with inputs of the same kind, so each decoder layer's forward is compiled once, not
32 times. This times both on a random transformers Llama (`--lora-4bit`: its projections in NF4
under a PEFT LoRA adapter, as lora_ppo decodes), each in a process of its own with an empty
Inductor cache: the first call (compile and one step), the warm decode step, and whether both
greedy-decode the same tokens.

    python bench/regional_decode_compile.py                                   # CPU, 16 layers
    python bench/regional_decode_compile.py --lora-4bit                       # CPU, bitsandbytes' CPU path
    python bench/regional_decode_compile.py --device cuda --dtype bfloat16 --layers 32 --hidden 4096 \
        --vocab 128256 --rows 16 --lora-4bit

On CUDA the step runs as lora_ppo runs it, with CUDA graphs (`mode="reduce-overhead"`).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # lora_ppo, where it is not installed (a device)


def measure(args: argparse.Namespace, regional: bool) -> dict:
    """Compile, then time the decode step of a random Llama; greedy tokens for the comparison."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    from lora_ppo.compiled_update import layer_forward  # a decoder layer's own forward

    torch.manual_seed(0)
    # Llama-3.1-8B's proportions: heads 128 wide (4 heads at a toy width), a quarter of them for keys
    # and values, an MLP 3.5x the width.
    heads = max(1, args.hidden // 128) if args.hidden >= 512 else 4
    config = LlamaConfig(hidden_size=args.hidden, intermediate_size=args.hidden * 7 // 2, num_hidden_layers=args.layers,
                         num_attention_heads=heads, num_key_value_heads=max(1, heads // 4), vocab_size=args.vocab)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    torch.set_default_dtype(dtype)  # built where it runs, in its dtype: no float32 copy of an 8B model
    with device:
        model = LlamaForCausalLM(config).eval()
    torch.set_default_dtype(torch.float32)
    layers = model.model.layers
    if args.lora_4bit:
        model = with_lora_on_4bit(model, device, dtype)
    if regional:
        layer_region = torch.compiler.nested_compile_region(layer_forward)
        for layer in layers:
            layer.forward = functools.partial(layer_region, layer)

    def decode_step(cache, tokens, positions, mask):
        out = model(input_ids=tokens, position_ids=positions, attention_mask=mask, past_key_values=cache, use_cache=True)
        return out.logits[:, -1].float()

    step = torch.compile(decode_step, dynamic=False, mode="reduce-overhead" if device.type == "cuda" else None)
    rows, prompt, length = args.rows, 8, 8 + args.tokens
    cache = StaticCache(config=config, max_cache_len=length)
    ids = torch.randint(3, args.vocab, (rows, prompt), device=device)
    mask = torch.ones(rows, length, dtype=torch.long, device=device)
    positions = torch.arange(prompt, device=device)[None].expand(rows, prompt)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize()

    with torch.no_grad():
        logits = model(input_ids=ids, past_key_values=cache, use_cache=True, position_ids=positions).logits[:, -1]
        token, tokens, warm_from = logits.argmax(-1, keepdim=True), [], None
        t0 = time.perf_counter()
        for i in range(args.tokens):
            token = step(cache, token, torch.full((rows, 1), prompt + i, device=device), mask).argmax(-1, keepdim=True)
            tokens.append(token)
            if i == 0:
                sync()
                first_call_s = time.perf_counter() - t0
            if i == 2:  # CUDA graphs record on the second and third calls
                sync()
                warm_from = time.perf_counter()
        sync()
    warm_steps = args.tokens - 3
    return {"first_call_s": round(first_call_s, 2),
            "ms_per_step": round((time.perf_counter() - warm_from) / warm_steps * 1000, 3),
            "tokens": torch.cat(tokens, 1).tolist()}


def with_lora_on_4bit(model, device, dtype):
    """`model` as lora_ppo decodes with it: every decoder projection in bitsandbytes' NF4 (quantized
    on the device, one at a time), under a PEFT LoRA adapter of rank 16 (float32 weights)."""
    import bitsandbytes as bnb
    import torch
    from peft import LoraConfig, get_peft_model

    projections = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, linear in list(parent.named_children()):
                if name in projections:
                    quantized = bnb.nn.Linear4bit(linear.in_features, linear.out_features, bias=False,
                                                  compute_dtype=dtype, quant_type="nf4")
                    quantized.weight = bnb.nn.Params4bit(linear.weight.data, requires_grad=False, quant_type="nf4")
                    setattr(parent, name, quantized.to(device))  # quantizes; the full weight is dropped
    model.is_loaded_in_4bit = True  # so PEFT wraps the 4-bit layers with its bitsandbytes LoRA layers
    torch.manual_seed(1)
    model = get_peft_model(model, LoraConfig(r=16, lora_alpha=32, lora_dropout=0.0, target_modules=projections,
                                             init_lora_weights=False))  # random B: the adapter changes the logits
    return model.eval()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=16)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=128)
    parser.add_argument("--rows", type=int, default=2)
    parser.add_argument("--tokens", type=int, default=43, help="decode steps (the first 3 are not timed)")
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--lora-4bit", action="store_true",
                        help="the projections in NF4 under a rank-16 PEFT adapter, as lora_ppo decodes")
    parser.add_argument("--variant", choices=("whole", "regional"), help=argparse.SUPPRESS)  # one child process
    args = parser.parse_args()
    if args.variant is not None:
        print(json.dumps(measure(args, args.variant == "regional")))
        return
    result = {"shape": {k: v for k, v in vars(args).items() if k != "variant"}}
    for variant in ("whole", "regional"):
        with tempfile.TemporaryDirectory() as cache_dir:  # an empty Inductor cache: a first run's compile
            env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": cache_dir}
            child = subprocess.run([sys.executable, __file__, *sys.argv[1:], "--variant", variant],
                                   env=env, capture_output=True, text=True)
        if child.returncode != 0:
            result[variant] = {"error": child.stderr.strip().splitlines()[-1][:300]}
        else:
            result[variant] = json.loads(child.stdout.strip().splitlines()[-1])
        print(json.dumps({variant: {k: v for k, v in result[variant].items() if k != "tokens"}}), file=sys.stderr)
    if all("tokens" in result[v] for v in ("whole", "regional")):
        result["same_tokens"] = result["whole"].pop("tokens") == result["regional"].pop("tokens")
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
