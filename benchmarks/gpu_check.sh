#!/usr/bin/env bash
# Tidal on an NVIDIA GPU: the whole check in one run, for a bare GPU machine with no network.
#
#     OUT=/path/to/results bash benchmarks/gpu_check.sh       # $OUT defaults to ./gpu_out
#
# Run from anywhere in the repository (it works in the repository root and imports Tidal from there
# through PYTHONPATH: nothing is built or installed into the machine's Python). Each step runs even
# if an earlier one failed; the exit status is non-zero if any failed. Everything lands in $OUT:
#
#   env.txt       nvidia-smi, Python, torch / CUDA / transformers versions, carried wheels installed
#   pytest.txt    tests/test_cuda.py (GPU vs CPU vs transformers, bf16, preemption, seeds, memory)
#   generate.txt  `tidal generate --device cuda` on a random SmolLM2-135M-shaped model
#   bench.txt     `tidal bench throughput` on CUDA: that model, bf16, 128 random requests
#   bench.json    (32-512 prompt tokens, 16-256 output tokens, greedy, ignore_eos), all figures
#   summary.txt   one line per step, also printed last
#
# Missing Python packages travel as wheels in gpu_wheels/ (made by benchmarks/gpu_wheels.sh; not
# tracked by git, so a remote run must carry that folder). A wheel is installed, into a private
# folder on PYTHONPATH, only where the machine has no such package or an older one.
#
# Time: about 2-3 minutes expected on an H200. Each step has a timeout, and no step runs past
# TOTAL_TIMEOUT (540 s) from the start, so a remote command limit of 600 s always gets the summary.
#
# Knobs (environment): PYTHON (default /opt/torch/.venv/bin/python3 if present, else python3),
# TOTAL_TIMEOUT (540 s), PYTEST_TIMEOUT (300 s), BENCH_TIMEOUT (180 s), BENCH_DEVICE (cuda), BENCH_TINY=1 (a 2-layer model:
# a smoke test of this script on a CPU), BENCH_NUM_PROMPTS (128), BENCH_INPUT_LEN ("32 512"),
# BENCH_OUTPUT_LEN ("16 256"), BENCH_ARGS (extra engine flags), BENCH_COMPARE_HF=1 (also time
# transformers' generate on the same GPU: adds about a minute), SKIP_TESTS=1, SKIP_BENCH=1.
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
PYTEST_TIMEOUT=${PYTEST_TIMEOUT:-300}
BENCH_TIMEOUT=${BENCH_TIMEOUT:-180}
BENCH_DEVICE=${BENCH_DEVICE:-cuda}
BENCH_NUM_PROMPTS=${BENCH_NUM_PROMPTS:-128}
BENCH_INPUT_LEN=${BENCH_INPUT_LEN:-32 512}
BENCH_OUTPUT_LEN=${BENCH_OUTPUT_LEN:-16 256}
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
for name in ("transformers", "tokenizers", "safetensors", "numpy", "pytest", "psutil"):
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
grep -E "^(python|torch|gpu|transformers) " "$OUT/env.txt"

# -- 2. tests --------------------------------------------------------------------------------------
if [ "${SKIP_TESTS:-0}" != 1 ]; then
    echo "== pytest tests/test_cuda.py (timeout ${PYTEST_TIMEOUT}s)"
    # no -x: with one run on the machine, every failing test is worth seeing
    timeout -k 5 "$(limit "$PYTEST_TIMEOUT")" "$PYTHON" -m pytest -q -rfEs --durations=12 -p no:cacheprovider \
        tests/test_cuda.py > "$OUT/pytest.txt" 2>&1
    rc=$?
    tail -n 40 "$OUT/pytest.txt"
    step "tests/test_cuda.py: $(grep -E '(passed|failed|error)' "$OUT/pytest.txt" | tail -n 1) (pytest.txt)" $rc
fi

# -- 3. generate and throughput on a random SmolLM2-135M-shaped model --------------------------------
if [ "${SKIP_BENCH:-0}" != 1 ]; then
    MODEL="$WORK/smollm2-random"
    echo "== building the random model"
    size=$([ "${BENCH_TINY:-0}" = 1 ] && echo --tiny)
    # shellcheck disable=SC2086  # $size: no word when empty
    timeout -k 5 "$(limit 120)" "$PYTHON" benchmarks/random_smollm2.py "$MODEL" $size 2>&1 | tail -n 3
    step "random model built" "${PIPESTATUS[0]}"

    echo "== tidal generate --device $BENCH_DEVICE"
    # shellcheck disable=SC2086  # BENCH_ARGS: several flags
    timeout -k 5 "$(limit 120)" "$PYTHON" -m tidal.entrypoints.cli generate "t5 t6 t7 t8" --model "$MODEL" \
        --device "$BENCH_DEVICE" --dtype bfloat16 --max-tokens 8 --temperature 0 --show-stats \
        --gpu-memory-utilization 0.5 $BENCH_ARGS > "$OUT/generate.txt" 2>&1
    rc=$?
    tail -n 6 "$OUT/generate.txt"
    step "tidal generate --device $BENCH_DEVICE (generate.txt)" $rc

    echo "== tidal bench throughput --device $BENCH_DEVICE (timeout ${BENCH_TIMEOUT}s)"
    rm -f "$OUT/bench.json"
    compare=$([ "${BENCH_COMPARE_HF:-0}" = 1 ] && echo "--compare hf")
    # shellcheck disable=SC2086  # the length ranges, $compare and BENCH_ARGS split into words
    timeout -k 5 "$(limit "$BENCH_TIMEOUT")" "$PYTHON" -m tidal.entrypoints.cli bench throughput --model "$MODEL" \
        --device "$BENCH_DEVICE" --dtype bfloat16 --dataset random --num-prompts "$BENCH_NUM_PROMPTS" \
        --input-len-range $BENCH_INPUT_LEN --output-len-range $BENCH_OUTPUT_LEN --seed 0 \
        --output-json "$OUT/bench.json" $compare $BENCH_ARGS > "$OUT/bench.txt" 2>&1
    rc=$?
    tail -n 8 "$OUT/bench.txt"
    figures=$("$PYTHON" - "$OUT/bench.json" <<'EOF' 2>/dev/null
import json
import sys

r = json.load(open(sys.argv[1]))
t = r["tidal"]
print(f"{t['output_tokens_per_s']:.0f} output tok/s, {t['total_tokens_per_s']:.0f} total tok/s, "
      f"{t['num_requests']} requests in {t['elapsed_s']:.1f} s, {r['dtype']} on {r['machine'].get('gpu') or 'cpu'}")
EOF
    )
    step "bench throughput: ${figures:-no figures} (bench.txt, bench.json)" $rc
fi

note "total $(($(date +%s) - START)) s; $([ "$STATUS" -eq 0 ] && echo 'all steps passed' || echo 'SOME STEPS FAILED')"
echo "== summary ($OUT/summary.txt)"
cat "$OUT/summary.txt"
rm -rf "$WORK"
exit "$STATUS"
