#!/usr/bin/env bash
# Tidal on an NVIDIA GPU: the whole check in one run, for a bare GPU machine with no network.
#
#     OUT=/path/to/results bash benchmarks/gpu_check.sh       # $OUT defaults to ./gpu_out
#
# Run from anywhere in the repository (it works in the repository root and imports Tidal from there
# through PYTHONPATH: nothing is built or installed into the machine's Python). Each step runs even
# if an earlier one failed; the exit status is non-zero if any failed. Everything lands in $OUT:
#
#   env.txt       nvidia-smi, Python, torch / CUDA / triton / transformers versions, carried wheels installed
#   pytest.txt    tests/test_cuda.py (GPU vs CPU vs transformers, bf16, preemption, seeds, memory) and
#                 tests/test_triton_kernels.py compiled for the GPU (no interpreter: the Triton paged
#                 attention, fused norm / rotary + KV write / silu-and-mul against torch, the Triton
#                 backend against torch_sdpa in the engine)
#   offline_smollm2.json/.txt          benchmarks/gpu_bench.py --case offline on a SmolLM2-135M-shaped
#                                      model (bundled config, load_format dummy, bf16, the engine's defaults
#                                      on CUDA: CUDA graphs, asynchronous scheduling, 2,048-token steps):
#                                      output tok/s, per-step wall, GPU span of the model and host time
#   decode_llama3_8b.json/.txt         --case decode on a Llama-3-8B-shaped dummy model (bf16): one request,
#                                      128 prompt -> 256 output tokens; time per output token against weight
#                                      bytes / 4.8 TB/s
#   serve_llama3_8b.json/.txt          --case serve on the Llama-3-8B shape: `tidal serve` (dummy weights, bf16,
#                                      max_num_seqs 256), then `tidal bench serve` with 256 requests of
#                                      1,024 -> 256 tokens at once: output tok/s, TTFT / TPOT / ITL / E2E
#                                      percentiles
#   offline_smollm2_cprofile.json/.txt the offline run again under cProfile (--cprofile 40): the host's
#                                      costliest functions per step (slower than without)
#   decode_llama3_8b_kernels.json/.txt the decode run again eagerly, then under torch.profiler: its 30
#                                      costliest GPU kernels (--torch-profile 30)
#   offline_smollm2_sync.json          the offline run again with --no-async-scheduling (A/B)
#   decode_llama3_8b_sync.json         the decode run again with --no-async-scheduling
#   offline_smollm2_mbt16384.json      the offline run again with 16,384-token steps (A/B of the step budget)
#   offline_smollm2_eager.json         the offline run again with --enforce-eager (no CUDA graphs: A/B)
#   offline_smollm2_torch_sdpa.json    the offline run again with TIDAL_ATTENTION_BACKEND=torch_sdpa (A/B of
#                                      the attention path; SKIP_BASELINE=1 skips the A/B runs)
#   summary.txt   one line per step, also printed last
#
# Missing Python packages travel as wheels in gpu_wheels/ (made by benchmarks/gpu_wheels.sh; not
# tracked by git, so a remote run must carry that folder). A wheel is installed, into a private
# folder on PYTHONPATH, only where the machine has no such package or an older one.
#
# Time: 356 s on an H200 (2026-12-04: the tests 112 s with their Triton compiles, each benchmark 15-45 s
# with the engine's start-up). Each step has a timeout, and no step runs past
# TOTAL_TIMEOUT (540 s) from the start, so a remote command limit of 600 s always gets the summary.
#
# Knobs (environment): PYTHON (default /opt/torch/.venv/bin/python3 if present, else python3),
# TOTAL_TIMEOUT (540 s), PYTEST_TIMEOUT (240 s), BENCH_TIMEOUT (120 s per benchmark), SERVE_TIMEOUT (180 s:
# the server's start with its graph capture and the serving run), BENCH_DEVICE (cuda),
# BENCH_TINY=1 (a 2-layer config and a few requests: a smoke test of this script on a CPU, with
# BENCH_DEVICE=cpu SKIP_TESTS=1), BENCH_ARGS (extra flags of gpu_bench.py), SKIP_TESTS=1, SKIP_BENCH=1,
# SKIP_BASELINE=1, PYTEST_K (pytest's -k: only the tests it selects), ONLY (the names of the benchmark
# runs to run, space-separated: the others are skipped).
set -u

ROOT=$(cd "$(dirname "$0")/.." && pwd)
cd "$ROOT" || exit 1
OUT=${OUT:-./gpu_out}
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
if [ -z "${PYTHON:-}" ]; then
    if [ -x /opt/torch/.venv/bin/python3 ]; then PYTHON=/opt/torch/.venv/bin/python3; else PYTHON=python3; fi
fi
TOTAL_TIMEOUT=${TOTAL_TIMEOUT:-540}
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-240}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-120}
SERVE_TIMEOUT=${SERVE_TIMEOUT:-180}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}
BENCH_ARGS=${BENCH_ARGS:-}

WORK=$(mktemp -d "${TMPDIR:-/tmp}/tidal-gpu-check.XXXXXX")
SITE="$WORK/site"
mkdir -p "$SITE"
export PYTHONPATH="$ROOT:$SITE${PYTHONPATH:+:$PYTHONPATH}"
export PYTHONUNBUFFERED=1 HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 TOKENIZERS_PARALLELISM=false
export TIDAL_CACHE_DIR="$WORK/cache"
: > "$OUT/summary.txt"
STATUS=0
START=$(date +%s)

limit() {  # limit SECONDS: a step's timeout, cut to what is left of TOTAL_TIMEOUT (at least 1 s)
    local left=$((TOTAL_TIMEOUT - ($(date +%s) - START) - 5))
    if [ "$left" -lt "$1" ]; then echo $((left > 1 ? left : 1)); else echo "$1"; fi
}

note() {  # a summary line: printed now, and again at the end
    echo "$*" | tee -a "$OUT/summary.txt"
}

step() {  # step NAME RC: record a step's outcome
    local elapsed=$(($(date +%s) - START))
    if [ "$2" -eq 0 ]; then note "[ok]   $1 (t=${elapsed}s)"; else note "[FAIL] $1: exit $2 (t=${elapsed}s)"; STATUS=1; fi
}

echo "== Tidal GPU check: $ROOT -> $OUT"

# -- 1. environment and carried wheels -------------------------------------------------------------
{
    echo "date: $(date -u +%Y-%m-%dT%H:%M:%SZ)"
    echo "git: $(git -C "$ROOT" log -1 --oneline 2>/dev/null || echo 'not a git checkout')"
    echo "python: $PYTHON"
    timeout 30 nvidia-smi 2>&1 || echo "nvidia-smi: not available"
    timeout 120 "$PYTHON" - <<'EOF'
import platform
import torch
print("python", platform.python_version())
print("torch", torch.__version__, "cuda", torch.version.cuda, "available", torch.cuda.is_available())
if torch.cuda.is_available():
    p = torch.cuda.get_device_properties(0)
    print("gpu", torch.cuda.get_device_name(0), f"capability {p.major}.{p.minor}", f"{p.total_memory / 2**30:.1f} GiB",
          "count", torch.cuda.device_count())
for name in ("triton", "transformers", "tokenizers", "safetensors", "numpy", "pytest", "psutil"):
    try:
        print(name, __import__(name).__version__)
    except Exception as e:  # noqa: BLE001
        print(name, "MISSING", e)
EOF
    if ls gpu_wheels/*.whl >/dev/null 2>&1; then
        wheels=$("$PYTHON" - <<'EOF'
import glob
import os
import sys
from importlib import metadata

from packaging.tags import sys_tags
from packaging.utils import parse_wheel_filename
from packaging.version import Version

supported = set(sys_tags())
for whl in sorted(glob.glob("gpu_wheels/*.whl")):
    name, version, _, tags = parse_wheel_filename(os.path.basename(whl))
    try:
        have = metadata.version(name)
    except metadata.PackageNotFoundError:
        have = None
    need = have is None or Version(have) < version
    fits = bool(tags & supported)
    action = (" -> install" if fits else " -> cannot install: built for another Python/platform") if need else ""
    print(f"  {name} {version}: machine has {have or 'none'}{action}", file=sys.stderr)
    if need and fits:
        print(whl)
EOF
        )
        if [ -n "$wheels" ]; then
            # shellcheck disable=SC2086  # one wheel path per word
            if ! "$PYTHON" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --find-links gpu_wheels \
                    --target "$SITE" $wheels; then
                echo "pip install failed: unpacking the wheels instead"
                for whl in $wheels; do "$PYTHON" -m zipfile -e "$whl" "$SITE"; done
            fi
            echo "installed into $SITE: $(echo $wheels | tr '\n' ' ')"
        fi
    else
        echo "no gpu_wheels/ folder: using the machine's packages only"
    fi
} > "$OUT/env.txt" 2>&1
step "environment (env.txt)" $?
grep -E "^(python|torch|gpu|triton|transformers) " "$OUT/env.txt"

# -- 2. tests --------------------------------------------------------------------------------------
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== pytest tests/test_cuda.py tests/test_triton_kernels.py (timeout ${PYTEST_TIMEOUT}s)"
    # no -x: with one run on the machine, every failing test is worth seeing; one test that hangs is cut
    # after 90 s where pytest-timeout is installed (the GPU image has it), so the others still run
    per_test=""
    if "$PYTHON" -c "import pytest_timeout" 2>/dev/null; then per_test="--timeout=90"; fi
    # shellcheck disable=SC2086  # per_test: empty or one flag
    timeout -k 5 "$(limit "$PYTEST_TIMEOUT")" "$PYTHON" -m pytest -q -rfEs --durations=12 -p no:cacheprovider \
        $per_test ${PYTEST_K:+-k "$PYTEST_K"} tests/test_cuda.py tests/test_triton_kernels.py > "$OUT/pytest.txt" 2>&1
    rc=$?
    tail -n 40 "$OUT/pytest.txt"
    step "tests/test_cuda.py + test_triton_kernels.py: $(grep -E '(passed|failed|error)' "$OUT/pytest.txt" | tail -n 1) (pytest.txt)" $rc
fi

# -- 3. benchmarks on dummy weights (no checkpoint: bundled configs, load_format "dummy") ----------
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    SMALL=smollm2-135m
    LARGE=llama-3-8b
    offline_args=""
    decode_args="--prompt-len 128 --output-len 256"
    serve_args="--num-prompts 256 --prompt-len 1024 --output-len 256"
    if [ "${BENCH_TINY:-0}" = 1 ]; then  # a smoke test of this script on a CPU: a 2-layer config, a few requests
        SMALL="$WORK/tiny-config"
        LARGE="$SMALL"
        mkdir -p "$SMALL"
        "$PYTHON" - "$SMALL/config.json" <<'EOF'
import json
import sys

json.dump({"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 64, "intermediate_size": 128,
           "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16,
           "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "vocab_size": 49152, "tie_word_embeddings": True},
          open(sys.argv[1], "w"))
EOF
        offline_args="--num-prompts 4 --max-tokens 8"
        decode_args="--prompt-len 16 --output-len 8"
        serve_args="--num-prompts 8 --prompt-len 64 --output-len 8"
    fi

    bench() {  # bench NAME TIMEOUT ARGS...: one benchmarks/gpu_bench.py run, its RESULT line into NAME.json
        local name=$1 secs=$2
        shift 2
        if [ -n "${ONLY:-}" ] && [[ " $ONLY " != *" $name "* ]]; then return 0; fi
        echo "== gpu_bench $name: $* (timeout ${secs}s)"
        rm -f "$OUT/$name.json"
        # shellcheck disable=SC2086  # BENCH_ARGS: several flags
        timeout -k 5 "$(limit "$secs")" "$PYTHON" benchmarks/gpu_bench.py --device "$BENCH_DEVICE" --dtype bfloat16 \
            --output-json "$OUT/$name.json" "$@" $BENCH_ARGS > "$OUT/$name.txt" 2>&1
        local rc=$?
        tail -n 4 "$OUT/$name.txt"
        step "$name: $(cat "$OUT/$name.json" 2>/dev/null || echo 'no result') ($name.txt)" $rc
    }

    # shellcheck disable=SC2086  # the argument lists split into words
    bench offline_smollm2 "$BENCH_TIMEOUT" --case offline --model "$SMALL" $offline_args
    # shellcheck disable=SC2086
    bench decode_llama3_8b "$BENCH_TIMEOUT" --case decode --model "$LARGE" $decode_args
    # shellcheck disable=SC2086
    bench serve_llama3_8b "$SERVE_TIMEOUT" --case serve --model "$LARGE" $serve_args
    # shellcheck disable=SC2086
    bench offline_smollm2_cprofile "$BENCH_TIMEOUT" --case offline --model "$SMALL" --cprofile 40 $offline_args
    # shellcheck disable=SC2086
    bench decode_llama3_8b_kernels "$BENCH_TIMEOUT" --case decode --model "$LARGE" --enforce-eager \
        --torch-profile 30 $decode_args
    if [ "${SKIP_BASELINE:-0}" != 1 ]; then  # A/B: synchronous steps, the smaller step budget, no CUDA graphs,
        # torch's attention path
        # shellcheck disable=SC2086
        bench offline_smollm2_sync "$BENCH_TIMEOUT" --case offline --model "$SMALL" --no-async-scheduling $offline_args
        # shellcheck disable=SC2086
        bench decode_llama3_8b_sync "$BENCH_TIMEOUT" --case decode --model "$LARGE" --no-async-scheduling $decode_args
        # shellcheck disable=SC2086
        bench offline_smollm2_mbt16384 "$BENCH_TIMEOUT" --case offline --model "$SMALL" --max-num-batched-tokens 16384 \
            $offline_args
        # shellcheck disable=SC2086
        bench offline_smollm2_eager "$BENCH_TIMEOUT" --case offline --model "$SMALL" --enforce-eager $offline_args
        # shellcheck disable=SC2086
        TIDAL_ATTENTION_BACKEND=torch_sdpa bench offline_smollm2_torch_sdpa "$BENCH_TIMEOUT" --case offline \
            --model "$SMALL" $offline_args
    fi
fi

note "total $(($(date +%s) - START)) s; $([ "$STATUS" -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
rm -rf "$WORK"
exit "$STATUS"
