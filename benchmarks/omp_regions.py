"""Where an engine's OpenMP threads wait: every parallel region the native kernels open, timed per thread.

    python benchmarks/omp_regions.py                          # the saturation point offline (bf16, 64 x 256 -> 128)
    python benchmarks/omp_regions.py --output-len 400 --dtype auto
    python benchmarks/omp_regions.py --command python my_script.py   # any command: its regions in total

A small library (compiled here with gcc, loaded with LD_PRELOAD) stands in for libgomp's `GOMP_parallel`,
`GOMP_loop_end` and `GOMP_barrier`: it runs each top-level region's body on every thread between two clock
reads and passes the calls on. Per kernel (the region's outlined function, named with addr2line), it reports
the calls, the region's wall time on the thread that opened it, and per thread that ran its body: the time in it
(`busy`), how late the thread started it (`late`), how long it waited at the region's end for the others
(`end wait`), and how long it waited inside the body at the end of a `for` or at a barrier (`loop wait`:
counted in `busy` too). Between regions: how long the opening thread spent outside any region, in three
bands (under 10 us: the kernels' own set-up between regions; up to 5 ms: the host's work between steps,
while the other threads wait in libgomp; longer: start-up and the like).

The default workload is `LLM.generate` on --num-prompts random prompts with the server's step budget,
reported in three phases: start-up, the steps with prompt tokens to compute and the steps of decodes alone
(the workload tells the library which, before each step, through its `omp_regions_phase`). Run with the
machine otherwise idle; name the CPU (lscpu) beside the figures.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

SHIM = r"""
#define _GNU_SOURCE
#include <dlfcn.h>
#include <omp.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <time.h>

#define MAX_FN 512
#define MAX_TH 64
#define PHASES 3
typedef void (*body_fn)(void*);
struct stat {
  void* fn;
  int phase;
  uint64_t calls, wall, busy[MAX_TH], late[MAX_TH], end_wait[MAX_TH], loop_wait[MAX_TH];
};
static struct stat stats[MAX_FN];
static int n_stats, phase;
static uint64_t last_end, gap_ns[PHASES][3], gap_n[PHASES][3];

/* the phase the next regions count in (0 at start): called by the workload (ctypes, from this library) */
void omp_regions_phase(int p) { if (p >= 0 && p < PHASES) phase = p; }
static __thread int depth;
static __thread struct stat* current;
static struct stat* volatile opening;
static void (*real_parallel)(body_fn, void*, unsigned, unsigned);
static void (*real_loop_end)(void);
static void (*real_barrier)(void);

static inline uint64_t now(void) {
  struct timespec t;
  clock_gettime(CLOCK_MONOTONIC, &t);
  return (uint64_t)t.tv_sec * 1000000000u + t.tv_nsec;
}
struct call { body_fn fn; void* data; uint64_t t0, start[MAX_TH], end[MAX_TH]; };
static void body(void* p) {
  struct call* c = p;
  int t = omp_get_thread_num();
  current = opening;
  uint64_t s = now();
  c->fn(c->data);
  if (t < MAX_TH) { c->start[t] = s; c->end[t] = now(); }
}
static struct stat* find(void* fn) {
  for (int i = 0; i < n_stats; ++i) if (stats[i].fn == fn && stats[i].phase == phase) return &stats[i];
  if (n_stats == MAX_FN) return NULL;
  stats[n_stats].fn = fn;
  stats[n_stats].phase = phase;
  return &stats[n_stats++];
}
void GOMP_parallel(body_fn fn, void* data, unsigned num_threads, unsigned flags) {
  if (!real_parallel) real_parallel = dlsym(RTLD_NEXT, "GOMP_parallel");
  if (depth) { real_parallel(fn, data, num_threads, flags); return; }  /* nested: part of the outer body */
  struct call c = {fn, data, now(), {0}, {0}};
  if (last_end) {
    uint64_t g = c.t0 - last_end;
    int band = g < 10000 ? 0 : g < 5000000 ? 1 : 2;
    gap_ns[phase][band] += g;
    gap_n[phase][band]++;
  }
  struct stat* s = find((void*)fn);
  opening = s;
  depth = 1;
  real_parallel(body, &c, num_threads, flags);
  depth = 0;
  uint64_t t1 = now();
  last_end = t1;
  if (!s) return;
  s->calls++;
  s->wall += t1 - c.t0;
  for (int t = 0; t < MAX_TH; ++t)
    if (c.end[t]) {
      s->busy[t] += c.end[t] - c.start[t];
      s->late[t] += c.start[t] - c.t0;
      s->end_wait[t] += t1 - c.end[t];
    }
}
static void timed(void (*f)(void)) {
  int t = omp_get_thread_num();
  uint64_t a = now();
  f();
  if (current && t < MAX_TH) current->loop_wait[t] += now() - a;
}
void GOMP_loop_end(void) {
  if (!real_loop_end) real_loop_end = dlsym(RTLD_NEXT, "GOMP_loop_end");
  timed(real_loop_end);
}
void GOMP_barrier(void) {
  if (!real_barrier) real_barrier = dlsym(RTLD_NEXT, "GOMP_barrier");
  timed(real_barrier);
}

__attribute__((destructor)) static void report(void) {
  const char* path = getenv("OMP_REGIONS_OUT");
  FILE* f = path ? fopen(path, "w") : NULL;
  if (!f) return;
  fprintf(f, "{\"gaps\": [");
  for (int p = 0; p < PHASES; ++p)
    fprintf(f, "%s[[%llu, %llu], [%llu, %llu], [%llu, %llu]]", p ? ", " : "", (unsigned long long)gap_n[p][0],
            (unsigned long long)gap_ns[p][0], (unsigned long long)gap_n[p][1], (unsigned long long)gap_ns[p][1],
            (unsigned long long)gap_n[p][2], (unsigned long long)gap_ns[p][2]);
  fprintf(f, "], \"regions\": [");
  for (int i = 0; i < n_stats; ++i) {
    Dl_info d;
    const char* lib = "?";
    unsigned long off = (unsigned long)stats[i].fn;
    if (dladdr(stats[i].fn, &d) && d.dli_fname) {
      lib = d.dli_fname;
      off = (unsigned long)((char*)stats[i].fn - (char*)d.dli_fbase);
    }
    fprintf(f, "%s{\"lib\": \"%s\", \"offset\": %lu, \"phase\": %d, \"calls\": %llu, \"wall\": %llu, \"threads\": [",
            i ? ", " : "", lib, off, stats[i].phase, (unsigned long long)stats[i].calls,
            (unsigned long long)stats[i].wall);
    int first = 1;
    for (int t = 0; t < MAX_TH; ++t)
      if (stats[i].busy[t] || stats[i].late[t] || stats[i].end_wait[t]) {
        fprintf(f, "%s[%llu, %llu, %llu, %llu]", first ? "" : ", ", (unsigned long long)stats[i].busy[t],
                (unsigned long long)stats[i].late[t], (unsigned long long)stats[i].end_wait[t],
                (unsigned long long)stats[i].loop_wait[t]);
        first = 0;
      }
    fprintf(f, "]}");
  }
  fprintf(f, "]}\n");
  fclose(f);
}
"""

WORKLOAD = r"""
import ctypes, random, sys
from tidal import LLM, SamplingParams
model, dtype = sys.argv[1], sys.argv[2]
budget, n, inp, out = (int(a) for a in sys.argv[3:7])
mark = ctypes.CDLL(None).omp_regions_phase  # the shim's (LD_PRELOAD)
llm = LLM(model=model, dtype=dtype, max_num_batched_tokens=budget, max_model_len=2048)
engine = llm.llm_engine
scheduler, step = engine.scheduler, engine.step
def marked_step():  # 1: a step with prompt tokens to compute, 2: decodes alone
    prompts = scheduler.waiting or any(r.num_computed_tokens < r.num_prompt_tokens for r in scheduler.running)
    mark(1 if prompts else 2)
    return step()
engine.step = marked_step
rng = random.Random(0)
prompts = [{"prompt_token_ids": [rng.randrange(100, 40000) for _ in range(inp)]} for _ in range(n)]
llm.generate(prompts, SamplingParams(max_tokens=out, ignore_eos=True, temperature=0), use_tqdm=False)
"""

PHASES = ("start-up (loading the model, making the engine)", "steps with prompt tokens", "steps of decodes alone")


def build(tmp: str) -> str:
    src, lib = os.path.join(tmp, "omp_regions.c"), os.path.join(tmp, "omp_regions.so")
    with open(src, "w") as f:
        f.write(SHIM)
    subprocess.run(["gcc", "-O2", "-shared", "-fPIC", "-fopenmp", src, "-o", lib, "-ldl"], check=True)
    return lib


def run(shim: str, command: list[str], tmp: str, tag: str) -> dict:
    out = os.path.join(tmp, f"{tag}.json")
    env = dict(os.environ, LD_PRELOAD=shim, OMP_REGIONS_OUT=out)
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL)
    with open(out) as f:
        return json.load(f)


def short_name(demangled: str) -> str:
    """'void decode<1, 1>(void const*, ...) [clone ._omp_fn.1]' -> 'decode<1, 1>': the function's name without
    its return type, parameters and clone suffix."""
    head, depth, cut = demangled.split("(")[0], 0, -1
    for i, ch in enumerate(head):
        depth += (ch == "<") - (ch == ">")
        if ch == " " and depth == 0:
            cut = i
    return head[cut + 1:]


def name_of(lib: str, offset: int, cache: dict) -> str:
    key = (lib, offset)
    if key not in cache:
        name = f"{os.path.basename(lib)}+{offset:#x}"
        if shutil.which("addr2line") and os.path.exists(lib):
            r = subprocess.run(["addr2line", "-f", "-C", "-e", lib, hex(offset)], capture_output=True, text=True)
            fn = r.stdout.splitlines()[0] if r.stdout else "??"
            if fn != "??":
                name = f"{short_name(fn)} ({os.path.basename(lib).split('-')[0]})"
        cache[key] = name
    return cache[key]


def table(data: dict, phase: int, title: str, names: dict) -> None:
    ms = 1e-6
    print(f"\n{title}")
    print(f"  {'region':36s} {'calls':>7s} {'wall ms':>9s}   per thread: busy / late / end wait / loop wait (ms)")
    rows = sorted((r for r in data["regions"] if r["phase"] == phase), key=lambda r: -r["wall"])
    for r in rows:
        if r["wall"] * ms < 0.05:
            continue
        threads = "  ".join(f"{b * ms:.1f}/{late * ms:.1f}/{e * ms:.1f}/{w * ms:.1f}" for b, late, e, w in r["threads"])
        print(f"  {name_of(r['lib'], r['offset'], names)[:36]:36s} {r['calls']:7d} {r['wall'] * ms:9.1f}   {threads}")
    labels = ("under 10 us", "10 us - 5 ms", "5 ms and more")
    gaps = ", ".join(f"{lab}: {n} ({t * ms:.1f} ms)" for lab, (n, t) in zip(labels, data["gaps"][phase]))
    print(f"  between regions, on the thread that opens them: {gaps}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=os.path.expanduser("~/.cache/tidal-peers/smollm2-135m-instruct"),
                    help="a model folder (default: the peers' SmolLM2 folder, benchmarks/peers/setup_vllm_cpu.sh)")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--max-num-batched-tokens", type=int, default=2048)
    ap.add_argument("--num-prompts", type=int, default=64)
    ap.add_argument("--input-len", type=int, default=256)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--command", nargs=argparse.REMAINDER, help="run this command instead (its regions in total)")
    args = ap.parse_args()
    if not shutil.which("gcc"):
        print("omp_regions.py needs gcc to build its libgomp shim", file=sys.stderr)
        return 1
    names: dict = {}
    with tempfile.TemporaryDirectory() as tmp:
        shim = build(tmp)
        if args.command:
            data = run(shim, args.command, tmp, "command")
            for phase in range(len(PHASES)):
                if any(r["phase"] == phase for r in data["regions"]):
                    table(data, phase, f"the command's parallel regions (phase {phase})", names)
            return 0
        workload = [sys.executable, "-c", WORKLOAD, args.model, args.dtype, str(args.max_num_batched_tokens),
                    str(args.num_prompts), str(args.input_len), str(args.output_len)]
        data = run(shim, workload, tmp, "run")
    print(f"{args.num_prompts} prompts of {args.input_len} tokens, {args.output_len} out, {args.dtype}, "
          f"{args.max_num_batched_tokens}-token steps")
    for phase, title in enumerate(PHASES):
        table(data, phase, title, names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
