#!/usr/bin/env bash
# The wheels a device call carries: what lora_ppo and the device scripts import that the device
# image lacks (torch, transformers, peft, accelerate, nvidia-ml-py are there), for its Python 3.12
# on x86-64, at the versions this machine's venv runs. Written to .whl/ (git-ignored, about 46 MB of
# a call's 64). A call then names .whl in `carry` and starts with the line this prints last.
# A missing wheel cost a device call its start (95 s) once: bench/README.md, "gpu_step.py".
set -euo pipefail
cd "$(dirname "$0")/.."

PACKAGES=(bitsandbytes datasets pydantic pydantic_core annotated-types typing-inspection typing_extensions dill
          multiprocess vaderSentiment)
pinned=()
for name in "${PACKAGES[@]}"; do
  pinned+=("$name==$(python -c "import importlib.metadata as m, sys; print(m.version(sys.argv[1]))" "$name")")
done
rm -rf .whl && mkdir -p .whl
python -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_27_x86_64 --platform manylinux_2_24_x86_64 \
  --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 --platform manylinux1_x86_64 \
  -d .whl "${pinned[@]}"
count=$(ls .whl/*.whl | wc -l)
if [ "$count" -ne "${#PACKAGES[@]}" ]; then
  echo "error: ${count} wheels in .whl for ${#PACKAGES[@]} packages" >&2
  exit 1
fi
echo "${count} wheels, $(du -sm .whl | cut -f1) MB in .whl; begin each device command with:"
echo 'python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site || exit;'
