#!/usr/bin/env bash
# The wheels bench/gpu.py needs on a GPU machine without network, fetched here into .whl/ (repo root, git-ignored
# through .git/info/exclude). The GPU image has torch, transformers, safetensors, tokenizers, numpy, pyarrow,
# msgpack, xxhash, uvloop, rich, prometheus-client, huggingface-hub, matplotlib, pandas, pyyaml (and what torch and
# huggingface-hub pull: filelock, fsspec, sympy, tqdm, packaging, typing-extensions); these are what dora imports
# beyond them, at pyproject.toml's pins, for CPython 3.12 on manylinux x86_64:
#
#   pyzmq msgspec structlog               the wire, the codec, logging
#   datasets dill multiprocess            task.dataset (datasets' Requires-Dist beyond the image: dill, multiprocess)
#   math-verify latex2sympy2_extended     task.reward = "math" (optional; small)
#   antlr4-python3-runtime
#   pytest-asyncio                        .ci/gpu (the image has pytest, pytest-timeout and hypothesis)
#
#   bench/gpu_wheels.sh          # then, on the GPU machine (the device tool: carry [".whl"]):
#   python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site .whl/*.whl
#   export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
py=${PYTHON:-python3}
WHEELS=(
  pyzmq==27.3.0
  msgspec==0.19.0
  structlog==26.1.0
  datasets==5.2.0
  dill==0.4.1                    # datasets 5.2.0: dill>=0.4.1,<0.4.2
  multiprocess==0.70.19          # datasets 5.2.0: multiprocess<0.70.20
  math-verify==0.9.0
  latex2sympy2_extended==1.11.0  # math-verify 0.9.0 pins it
  antlr4-python3-runtime==4.13.2 # latex2sympy2_extended: >=4.9.3,<=4.13.2
  pytest-asyncio==1.5.0          # .ci/gpu: pyproject's asyncio_mode needs it
)
mkdir -p .whl .git/info
grep -qxF /.whl/ .git/info/exclude 2>/dev/null || echo /.whl/ >> .git/info/exclude
for w in "${WHEELS[@]}"; do
  "$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
    --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
    -d .whl "$w"
done
# what each wheel asks for, to compare with the image's list above (extras' requirements left out)
for f in .whl/*.whl; do
  reqs=$(unzip -p "$f" '*.dist-info/METADATA' | { grep ^Requires-Dist || true; } | { grep -v 'extra ==' || true; } | cut -d' ' -f2- | tr '\n' ' ')
  echo "$(basename "$f"): ${reqs:-(none)}"
done
du -sh .whl
