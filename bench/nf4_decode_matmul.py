"""A decode step's 4-bit linear layers, one at a time: `model.fused_4bit_decode`'s Triton kernel
against what bitsandbytes does, at a config's layer shapes (Llama-3.1-8B's by default) and a decode
step's row counts. Per shape and rows, microseconds per call of

- `bnb`: bitsandbytes' no-grad `matmul_4bit` (what a decode step runs today: its own dispatch picks
  its fused `gemm_4bit` kernel or dequantize + linear, per GPU and shape),
- `dequantize_linear`: dequantize the whole weight, then a linear,
- `fused`: the kernel at its launch defaults, and at `--sweep-rows` `fused_best`: the best of a
  sweep of its launch settings (output columns per program and programs per multiprocessor, then
  from the best of those quantization blocks per loop iteration and warps, then pipelining stages),
- `copy`: a linear on a dequantized copy (`model.dequantize_per_step`: 4x the memory; the bound),

each timed on a GPU inside a CUDA graph of `--calls` calls (as the compiled decode step runs them),
and the kernel's largest difference from dequantize + linear (same bf16 weight, other summation
order). Then the sums over the model's layers: a decode step's linear layers in milliseconds.

    python bench/nf4_decode_matmul.py --out bench/results/nf4_decode_matmul_h100.json   # CUDA GPU, ~2-3 min
    python bench/nf4_decode_matmul.py --config <folder> --rows 1,16 --no-sweep          # CPU smoke run

On CPU the kernel runs in Triton's interpreter (set here), for a smoke run only: its times mean nothing.
"""

from __future__ import annotations

import argparse
import itertools
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
import lora_ppo.fused_4bit_decode as fused  # noqa: E402  (imports triton only when the kernel first runs)

CONFIGS = Path(__file__).parent / "model_configs"
# The sweep's settings (`fused_4bit_decode.LAUNCH_SETTINGS`), in three rounds, each from the best of
# the one before: 9 + 9 + 10 launches of the kernel per shape. One stage: no software pipelining, so
# the code table's lookups are plain loads (with more, Triton stages them through shared memory).
SWEEP_ROUNDS = (
    {"BLOCK_N": (32, 64, 128), "PROGRAMS_PER_SM": (2, 4, 8)},
    {"BLOCKS_PER_ITERATION": (1, 2, 4), "NUM_WARPS": (2, 4, 8)},
    {"NUM_STAGES": (1, 2, 3, 4, 5), "PAIRED_CODES": (False, True)},
)


def layer_shapes(config: dict) -> dict[str, tuple[int, int, int]]:
    """name -> (out_features, in_features, layers of the model with that shape) for one decoder layer's
    linear layers, the same shapes merged (an 8B model's k and v)."""
    hidden, inner = config["hidden_size"], config["intermediate_size"]
    head = config.get("head_dim") or hidden // config["num_attention_heads"]
    q, kv = config["num_attention_heads"] * head, config.get("num_key_value_heads", config["num_attention_heads"]) * head
    shapes: dict[tuple[int, int], list[str]] = {}
    for name, shape in (("q", (q, hidden)), ("k", (kv, hidden)), ("v", (kv, hidden)), ("o", (hidden, q)),
                        ("gate", (inner, hidden)), ("up", (inner, hidden)), ("down", (hidden, inner))):
        shapes.setdefault(shape, []).append(name)
    layers = config["num_hidden_layers"]
    return {"/".join(names): (n, k, layers * len(names)) for (n, k), names in shapes.items()}


def rows_list(text: str) -> list[int]:
    try:
        rows = [int(r) for r in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected row counts separated by commas, got {text!r}") from None
    if any(r < 1 or r > fused.MAX_ROWS for r in rows):
        raise argparse.ArgumentTypeError(f"row counts run from 1 to {fused.MAX_ROWS} (the kernel's), got {text!r}")
    return rows


def timed_us(fn, calls: int, repeats: int, device: torch.device) -> float:
    """Median microseconds per call: on a GPU `calls` calls captured in a CUDA graph, replayed."""
    fn()
    if device.type != "cuda":
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        return (time.perf_counter() - t0) / calls * 1e6
    torch.cuda.synchronize()
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end) * 1e3 / calls)
    return statistics.median(times)


def timed_or_error(fn, args, device):
    """`timed_us`, or the first line of what stopped it: one path failing (a capture a kernel does not
    allow) must not cost the call's other numbers."""
    try:
        return timed_us(fn, args.calls, args.repeats, device)
    except Exception as error:  # noqa: BLE001 - recorded in the JSON
        return f"error: {type(error).__name__}: {str(error).splitlines()[0] if str(error) else ''}"


def one_shape(out_features: int, in_features: int, row_counts, args, device) -> dict:
    import bitsandbytes as bnb
    import bitsandbytes.functional as F

    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    torch.manual_seed(0)
    weight = torch.randn(out_features, in_features, dtype=dtype, device=device) * 0.02
    packed, state = F.quantize_4bit(weight, blocksize=64, compress_statistics=True, quant_type="nf4")
    state.dtype = dtype
    del weight
    copy = F.dequantize_4bit(packed, state)

    def kernel(x):
        return fused.quantized_linear(x, packed, state)

    results = {}
    for rows in row_counts:
        x = torch.randn(rows, in_features, dtype=dtype, device=device)
        with torch.no_grad():
            paths = {
                "bnb": lambda: bnb.matmul_4bit(x, packed, quant_state=state),
                "dequantize_linear": lambda: torch.nn.functional.linear(x, F.dequantize_4bit(packed, state)),
                "fused": lambda: kernel(x),
                "copy": lambda: torch.nn.functional.linear(x, copy),
            }
            row = {f"{name}_us": timed_or_error(fn, args, device) for name, fn in paths.items()}
            expected, got = paths["dequantize_linear"]().float(), kernel(x).float()
            row["max_abs_diff"] = (got - expected).abs().max().item()
            row["max_abs"] = expected.abs().max().item()
            row["bnb_max_abs_diff"] = (paths["bnb"]().float() - expected).abs().max().item()
            if args.sweep and rows in args.sweep_rows:
                # A setting counts only if it computes the product: within twice bitsandbytes' own
                # difference plus a rounding of the largest output (bf16's half unit; float32: 1e-5).
                rounding = 1e-5 if dtype == torch.float32 else 2.0 ** -8
                row["sweep_tolerance"] = 2 * row["bnb_max_abs_diff"] + rounding * row["max_abs"]
                row["fused_sweep"] = sweep(lambda: kernel(x), expected, row["sweep_tolerance"],
                                           (out_features, in_features), args, device)
                best = fastest_correct(row["fused_sweep"])
                row["fused_best_us"] = best["us"] if best else None
                row["fused_best"] = {k: v for k, v in best.items() if k not in ("us", "max_abs_diff", "correct")} \
                    if best else None
        results[str(rows)] = row
        print(json.dumps({"shape": [out_features, in_features], "rows": rows,
                          **{k: v for k, v in row.items() if k != "fused_sweep"}}), flush=True)
    return results


def fastest_correct(entries: list[dict]) -> Optional[dict]:
    """The fastest sweep entry that ran and computed the product (None if none did): a launch setting
    that is fast and wrong (a miscompile) must never become a tuned default."""
    usable = [entry for entry in entries if isinstance(entry["us"], float) and entry.get("correct")]
    return min(usable, key=lambda entry: entry["us"]) if usable else None


def sweep(call, expected: torch.Tensor, tolerance: float, shape: tuple[int, int], args, device) -> list[dict]:
    """The kernel timed at each setting of SWEEP_ROUNDS for weights of `shape` (`TUNED_LAUNCH`), a
    round's untried names at the fastest correct so far: one entry per launch setting tried, with its
    largest difference from `expected` (dequantize + linear) and whether that is within `tolerance`;
    the shape's entry restored after."""
    before = fused.TUNED_LAUNCH.get(shape)
    best, entries = fused.launch_settings(*shape), []
    try:
        for settings in SWEEP_ROUNDS:
            tried = []
            for values in itertools.product(*settings.values()):
                entry = {**best, **{name.lower(): value for name, value in zip(settings, values)}}
                fused.TUNED_LAUNCH[shape] = dict(entry)
                entry["us"] = timed_or_error(call, args, device)
                if isinstance(entry["us"], float):
                    entry["max_abs_diff"] = (call().float() - expected).abs().max().item()
                    entry["correct"] = entry["max_abs_diff"] <= tolerance
                tried.append(entry)
            entries += tried
            fastest = fastest_correct(tried)
            if fastest:
                best.update({name.lower(): fastest[name.lower()] for name in settings})
    finally:
        if before is None:
            fused.TUNED_LAUNCH.pop(shape, None)
        else:
            fused.TUNED_LAUNCH[shape] = before
    return entries


def tuned_launch_from(path: str, rows: int = 16) -> tuple[dict[tuple[int, int], dict], set[tuple[int, int]]]:
    """From this script's JSON, at `rows` rows: `fused_4bit_decode.TUNED_LAUNCH` (each shape's best
    launch settings, where they beat the kernel's defaults) and `BITSANDBYTES_FASTER` (the shapes
    where bitsandbytes beat the kernel at its best)."""
    tuned, slower = {}, set()
    for shape in json.loads(Path(path).read_text())["shapes"].values():
        row, key = shape["rows"].get(str(rows), {}), (shape["out_features"], shape["in_features"])
        best, default, bnb = (row.get(f"{name}_us") for name in ("fused_best", "fused", "bnb"))
        if isinstance(best, float) and (not isinstance(default, float) or best < default):
            tuned[key] = row["fused_best"]
        kernel = min(us for us in (best, default, float("inf")) if isinstance(us, float))
        if isinstance(bnb, float) and bnb < kernel:
            slower.add(key)
    return tuned, slower


def use_tuned_launch(path: str) -> dict:
    """For another script's `--nf4-launch-from`: put `tuned_launch_from(path)` into
    `fused_4bit_decode` for this process; returns both for that script's JSON. A file that is not
    this script's JSON stops the run with one line, before it builds anything."""
    try:
        tuned, slower = tuned_launch_from(path)
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as error:
        raise SystemExit(f"--nf4-launch-from {path}: not a bench/nf4_decode_matmul.py JSON "
                         f"({type(error).__name__}: {error})") from None
    fused.TUNED_LAUNCH.update(tuned)
    fused.BITSANDBYTES_FASTER.update(slower)
    return {"tuned": {f"{n}x{k}": settings for (n, k), settings in fused.TUNED_LAUNCH.items()},
            "bitsandbytes_faster": sorted(f"{n}x{k}" for n, k in fused.BITSANDBYTES_FASTER)}


def step_ms(shapes: dict, rows: int, path: str):
    """A decode step's linear layers by `path`: each shape's time x its layers (None where one failed
    or was not timed)."""
    times = [(shape["rows"][str(rows)].get(f"{path}_us"), shape["layers"]) for shape in shapes.values()]
    if not all(isinstance(us, float) for us, _ in times):
        return None
    return sum(us * layers for us, layers in times) / 1e3


def add_launch_argument(parser: argparse.ArgumentParser) -> None:
    """`--nf4-launch-from`, for the scripts that run model.fused_4bit_decode (`use_tuned_launch` reads it)."""
    parser.add_argument("--nf4-launch-from", default=None, metavar="JSON",
                        help="with model.fused_4bit_decode: from this bench/nf4_decode_matmul.py JSON, each "
                             "shape's best launch settings where they beat the defaults, and bitsandbytes "
                             "for the shapes where it beat the kernel")


def main() -> None:
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")  # the kernel on CPU tensors, before triton is imported
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--config", default=str(CONFIGS / "llama-3.1-8b"), help="a folder with config.json")
    parser.add_argument("--rows", type=rows_list, default=[1, 4, 8, 16, 32, 64],
                        help="decode batch sizes, comma-separated")
    parser.add_argument("--calls", type=int, default=20, help="calls per CUDA graph")
    parser.add_argument("--repeats", type=int, default=10, help="graph replays; the median is kept")
    parser.add_argument("--no-sweep", dest="sweep", action="store_false", help="the kernel's launch defaults only")
    parser.add_argument("--sweep-rows", type=rows_list, default=[16],
                        help="the row counts at which to sweep the kernel's launch settings (default: 16)")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()
    import bitsandbytes
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    why_not = fused.fused_decode_unavailable(device)
    if why_not:
        raise SystemExit(f"nf4_decode_matmul: {why_not}")
    config = json.loads((Path(args.config) / "config.json").read_text())
    result = {
        "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu (Triton interpreter)",
        "versions": {"torch": torch.__version__, "bitsandbytes": bitsandbytes.__version__, "triton": triton.__version__},
        "config": Path(args.config).name,
        "defaults": {name.lower(): getattr(fused, name) for name in fused.LAUNCH_SETTINGS},
        "calls_per_graph": args.calls, "shapes": {},
    }

    def save() -> None:  # after each shape: a call cut short keeps the shapes done
        if args.out:
            Path(args.out).write_text(json.dumps(result, indent=1) + "\n")

    shapes = layer_shapes(config)
    for name, (n, k, count) in shapes.items():
        result["shapes"][name] = {"out_features": n, "in_features": k, "layers": count,
                                  "rows": one_shape(n, k, args.rows, args, device)}
        save()
    # A decode step's linear layers: each shape's time x the layers of that shape.
    result["decode_step_ms"] = {
        str(rows): {path: step_ms(result["shapes"], rows, path)
                    for path in ("bnb", "dequantize_linear", "fused", "copy",
                                 *(("fused_best",) if args.sweep and rows in args.sweep_rows else ()))}
        for rows in args.rows
    }
    print(json.dumps({"decode_step_ms": result["decode_step_ms"]}, indent=1))
    save()


if __name__ == "__main__":
    main()
