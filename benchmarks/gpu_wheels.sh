#!/usr/bin/env bash
# Download into gpu_wheels/ (repository root, git-ignored) the wheels of Tidal's runtime dependencies
# that the GPU machine's image lacks, for benchmarks/gpu_check.sh to install there without a network.
#
#     PYTHON=.venv/bin/python bash benchmarks/gpu_wheels.sh
#
# Run it on a machine that reaches PyPI, from anywhere in the repository. Each package is pinned to
# the version installed in $PYTHON's environment (Tidal's development environment), for the GPU
# image's Python ($GPU_PYTHON_VERSION, default 3.12) on x86-64 Linux. gpu_check.sh installs a carried
# wheel only where the image has no such package or an older one.
#
# The GPU image ('cuda': torch, transformers, tokenizers, safetensors, numpy, tqdm, jinja2, psutil,
# prometheus-client, anyio, click, h11, httpx, requests, pyyaml, pytest, hypothesis, ...) lacks gguf
# (GGUF loading), the server's fastapi / uvicorn / pydantic stack and the engine-core process's pyzmq and
# msgspec (`tidal serve` runs its engine core in a process of its own by default); typing-extensions is
# carried too because pydantic needs a recent one. The engine, the tests of tests/test_cuda.py and the
# throughput benchmark need none of them.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-.venv/bin/python}
[ -x "$PYTHON" ] || PYTHON=python3
GPU_PYTHON_VERSION=${GPU_PYTHON_VERSION:-3.12}
DEST=gpu_wheels
PACKAGES=(gguf fastapi starlette uvicorn pydantic pydantic-core annotated-types annotated-doc typing-inspection
          typing-extensions opentelemetry-api sniffio pyzmq msgspec)

mkdir -p "$DEST"
specs=$("$PYTHON" - "${PACKAGES[@]}" <<'EOF'
import sys
from importlib import metadata

specs = []
for name in sys.argv[1:]:
    try:
        specs.append(f"{name}=={metadata.version(name)}")
    except metadata.PackageNotFoundError:
        sys.exit(f"{name} is not installed in {sys.executable}: install Tidal's dependencies there first")
print(" ".join(specs))
EOF
)
echo "downloading for Python $GPU_PYTHON_VERSION, manylinux x86-64: $specs"
# shellcheck disable=SC2086  # one argument per spec
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$GPU_PYTHON_VERSION" \
    --implementation cp --platform manylinux2014_x86_64 --platform manylinux_2_17_x86_64 \
    --platform manylinux_2_28_x86_64 --platform any -d "$DEST" $specs
ls -l "$DEST"
du -sh "$DEST"
