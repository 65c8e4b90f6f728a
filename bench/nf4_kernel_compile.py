"""`model.fused_4bit_decode`'s Triton kernel compiled ahead of time for CUDA GPUs, on any machine (no
GPU needed: Triton's own compiler and ptxas): per architecture, input dtype, row tile and launch
setting, whether it compiles, its registers per thread, the bytes it spills to local memory, and
its shared memory per block against the architecture's. Triton's interpreter, which runs the
kernel's arithmetic on CPU in the tests, never lowers it to a GPU: this does. Prints JSON.

    python bench/nf4_kernel_compile.py                              # defaults and paired lookups, 6 targets
    python bench/nf4_kernel_compile.py --targets 90:bf16:16 --sweep   # every setting the sweep can reach

Targets are ARCH:DTYPE:ROWS (sm_75 a T4, sm_86 an RTX 3090, sm_89 an RTX 4090, sm_80 an A100, sm_90 an
H100 or H200). Integer arguments and pointers are taken as multiples of 16, as Triton specializes
them at a launch when they are (an 8B model's widths and torch's allocations).
"""

from __future__ import annotations

import argparse
import importlib.util
import itertools
import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

os.environ.pop("TRITON_INTERPRET", None)  # the real compiler, whatever the caller runs the kernel with
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

# The shared memory one block may use, by compute capability (the CUDA C++ Programming Guide's table).
SHARED_MEMORY_PER_BLOCK = {75: 64 * 1024, 80: 163 * 1024, 86: 99 * 1024, 89: 99 * 1024, 90: 227 * 1024}
DTYPES = {"bf16": "*bf16", "fp16": "*fp16", "fp32": "*fp32"}
DEFAULT_TARGETS = "75:fp16:64,86:bf16:64,89:bf16:16,90:bf16:16,90:bf16:64,90:fp32:64"


def target(text: str) -> tuple[int, str, int]:
    try:
        arch, dtype, rows = text.split(":")
        parsed = int(arch), dtype, int(rows)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected ARCH:DTYPE:ROWS such as 90:bf16:16, got {text!r}") from None
    if parsed[0] not in SHARED_MEMORY_PER_BLOCK or dtype not in DTYPES or not 1 <= parsed[2] <= 64:
        raise argparse.ArgumentTypeError(f"{text!r}: ARCH one of {sorted(SHARED_MEMORY_PER_BLOCK)}, DTYPE one of "
                                         f"{sorted(DTYPES)}, ROWS 1-64")
    return parsed


def compiled(arch: int, dtype: str, rows: int, launch: dict) -> dict:
    """One compile: its resources, or the last line of its error (where Triton names the cause)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource
    from triton.runtime.jit import JITFunction

    from lora_ppo._nf4_kernel import nf4_linear_kernel

    # The function itself, compiled: imported under Triton's interpreter (nf4_decode_matmul.py sets it
    # on a machine without a GPU), the module holds the interpreter's wrapper of it.
    kernel = JITFunction(nf4_linear_kernel.fn)
    pointers = {"x_ptr": DTYPES[dtype], "packed_ptr": "*u8", "absmax_ptr": "*u8", "code_ptr": "*fp32",
                "pairs_ptr": "*i64", "absmax2_ptr": "*fp32", "code2_ptr": "*fp32", "offset_ptr": "*fp32",
                "partial_ptr": "*fp32"}
    integers = dict.fromkeys(("M", "N", "K", "slice_width"), "i32")
    constants = {"NESTED": True, "QBLOCK": 64, "BLOCKS": launch["blocks_per_iteration"],
                 "BLOCK_M": max(16, 1 << (rows - 1).bit_length()), "BLOCK_N": launch["block_n"],
                 "IEEE": dtype == "fp32", "PAIRED": launch["paired_codes"]}
    signature = {**pointers, **integers, **dict.fromkeys(constants, "constexpr")}
    aligned = {(i,): [["tt.divisibility", 16]] for i in range(len(pointers) + len(integers))}
    options = {"num_warps": launch["num_warps"], **({} if launch["num_stages"] is None else
                                                    {"num_stages": launch["num_stages"]})}
    entry = {"arch": arch, "dtype": dtype, "rows": rows, "launch": launch}
    try:
        binary = triton.compile(ASTSource(fn=kernel, signature=signature, constexprs=constants,
                                          attrs=aligned), target=GPUTarget("cuda", arch, 32), options=options)
    except Exception as error:  # noqa: BLE001 - recorded in the JSON
        return {**entry, "error": f"{type(error).__name__}: {str(error).strip().splitlines()[-1][:200]}"}
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    with tempfile.NamedTemporaryFile(suffix=".cubin") as cubin:
        cubin.write(binary.asm["cubin"])
        cubin.flush()
        usage = subprocess.run([str(cuobjdump), "--dump-resource-usage", cubin.name], capture_output=True,
                               text=True, check=True).stdout
    registers, local = re.search(r"REG:(\d+) .*LOCAL:(\d+)", usage).groups()
    shared = binary.metadata.shared
    return {**entry, "registers": int(registers), "spilled_bytes": int(local), "shared_bytes": shared,
            "shared_fits": shared <= SHARED_MEMORY_PER_BLOCK[arch]}


def launches(sweep: bool) -> list[dict]:
    """The defaults, with paired lookups, and every tuned shape's settings; with `sweep`, every
    combination of the settings bench/nf4_decode_matmul.py sweeps."""
    import lora_ppo.fused_4bit_decode as fused

    defaults = fused.launch_settings(0, 0)  # no weight has the shape 0 x 0
    found = [defaults, {**defaults, "paired_codes": True}, *(fused.launch_settings(*s) for s in fused.TUNED_LAUNCH)]
    if sweep:  # (programs per multiprocessor sets the grid, not the binary)
        from nf4_decode_matmul import SWEEP_ROUNDS

        swept = {name.lower(): values for settings in SWEEP_ROUNDS for name, values in settings.items()
                 if name != "PROGRAMS_PER_SM"}
        for values in itertools.product(*swept.values()):
            found.append({**defaults, **dict(zip(swept, values))})
    return list({tuple(sorted(launch.items(), key=str)): launch for launch in found}.values())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--targets", type=lambda text: [target(t) for t in text.split(",")],
                        default=[target(t) for t in DEFAULT_TARGETS.split(",")], help="ARCH:DTYPE:ROWS,...")
    parser.add_argument("--sweep", action="store_true", help="every setting nf4_decode_matmul.py's sweep can reach")
    parser.add_argument("--out", default=None, help="write the JSON here too")
    args = parser.parse_args()
    if importlib.util.find_spec("triton") is None or importlib.util.find_spec("triton.backends.nvidia") is None:
        raise SystemExit("nf4_kernel_compile: needs Triton with its CUDA backend (pip install triton)")
    results = [compiled(arch, dtype, rows, launch)
               for arch, dtype, rows in args.targets for launch in launches(args.sweep)]
    text = json.dumps(results, indent=1)
    print(text)
    if args.out:
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
