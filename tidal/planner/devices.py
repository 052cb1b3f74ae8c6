"""Devices the planner can cost a step on: peak dense FLOP/s by arithmetic, memory bandwidth and capacity,
the interconnect between tensor-parallel ranks, and the host overhead of an engine step.

The GPU rows are the vendors' datasheet figures (dense, no sparsity; SXM parts) with achieved fractions
of peak that large GEMMs and streaming reads commonly reach; their overheads are estimates for an eager
(no CUDA graphs) engine. The `cpu` row is the calibration of the project's reference CPU, a 2-core AMD
EPYC Zen 4 with AVX-512 BF16 (24 GB; SmolLM2-135M in bf16, 2 torch threads; docs/planner.md, "Measured:
2026-12-01 (20:07-20:10 UTC)"): its figures are achieved rates, so its efficiencies are 1. Another machine
is measured by `tidal plan calibrate` (tidal/planner/calibrate.py), whose file `--calibration` reads over
this row.
"""
from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass, field, fields

GB = 1e9


@dataclass
class Device:
    name: str
    memory_bytes: float
    peak_flops: dict[str, float]          # dense FLOP/s by arithmetic: bf16, fp32, int8, fp8
    memory_bandwidth: float               # B/s
    vector_flops: float                   # FLOP/s of elementwise work (the Mamba scan): fp32 without tensor cores
    interconnect_bandwidth: float = 0.0   # B/s per direction per device (NVLink, PCIe)
    interconnect_latency: float = 10e-6   # s per collective
    gemm_efficiency: float = 0.7          # achieved share of peak_flops by large GEMMs
    bandwidth_efficiency: float = 0.8     # achieved share of memory_bandwidth by streaming reads
    # host and launch overhead of one engine step: fixed, per decoder layer, per scheduled request
    step_overhead: float = 2e-3
    layer_overhead: float = 40e-6
    request_overhead: float = 20e-6
    token_overhead: float = 0.0          # per token of the step: elementwise work and inputs (measured on CPU)
    # under `tidal serve`: the server's own work (HTTP, detokenization, streaming) per step and per request
    serve_step_overhead: float = 0.0
    serve_request_overhead: float = 0.0
    # ... and more per step whose linear products leave the skinny kernel (a prompt, or a decode of more than
    # skinny_max_rows requests): on CPU such a step loses more to the server's threads sharing its cores
    serve_wide_step_overhead: float = 0.0
    skinny_max_rows: int = 0              # decodes of up to this many requests: the skinny GEMM (CPU: 4); 0: none
    # under `tidal serve`: a request's time in the server outside the engine's steps before its first token
    # reaches the client (HTTP parsing, validation and tokenization on the way in, the first chunk on the way
    # out, and the host time its handling takes from the step running meanwhile); charged once per request
    serve_first_token_latency: float = 0.0
    # measured (calibration file): achieved GEMM FLOP/s at a number of rows, and attention time per KV byte read
    gemm_flops_by_rows: dict[int, float] = field(default_factory=dict)
    attention_seconds_per_kv_byte: float | None = None
    attention_seconds_per_cached_kv_byte: float | None = None  # a block another request of the step read
    attention_flops: float | None = None  # achieved FLOP/s of attention's query-key products (prompts); None: GEMM peak
    kv_cache_memory_bytes: float | None = None  # the engine's cache budget where it is fixed (CPU: 4 GiB)
    source: str = "table"
    kind: str = "gpu"                     # "cpu": the engine's CPU defaults apply (EngineSettings.for_device)

    def __post_init__(self) -> None:
        for name in ("memory_bytes", "memory_bandwidth", "vector_flops"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or not v > 0:
                raise ValueError(f"device {self.name}: {name} must be a positive number, got {v!r}")
        if "bf16" not in self.peak_flops:
            raise ValueError(f"device {self.name}: peak_flops needs a bf16 entry, got {sorted(self.peak_flops)}")
        self.gemm_flops_by_rows = {int(k): float(v) for k, v in self.gemm_flops_by_rows.items()}

    def gemm_rate(self, rows: int, kind: str = "bf16") -> float:
        """Achieved FLOP/s of a product with `rows` rows: measured (interpolated in log rows) when a
        calibration gave figures, else the efficiency share of peak."""
        peak = self.peak_flops.get(kind, self.peak_flops["bf16"])
        if not self.gemm_flops_by_rows:
            return peak * self.gemm_efficiency
        scale = peak / self.peak_flops["bf16"]  # measured in bf16: other arithmetic scales by its peak ratio
        pts = sorted(self.gemm_flops_by_rows.items())
        if rows <= pts[0][0]:
            return pts[0][1] * scale
        for (m0, r0), (m1, r1) in zip(pts, pts[1:]):
            if rows <= m1:
                w = (math.log(rows) - math.log(m0)) / (math.log(m1) - math.log(m0))
                return (r0 + w * (r1 - r0)) * scale
        return pts[-1][1] * scale

    @property
    def achieved_bandwidth(self) -> float:
        return self.memory_bandwidth * self.bandwidth_efficiency

    @property
    def peak_gemm_rate(self) -> float:
        return max(self.gemm_flops_by_rows.values()) if self.gemm_flops_by_rows else \
            self.peak_flops["bf16"] * self.gemm_efficiency

    def as_dict(self) -> dict:
        return asdict(self)


DEVICES = {
    "H100-80GB": Device("H100-80GB", 80 * GB, {"bf16": 989e12, "fp32": 494e12, "int8": 1979e12, "fp8": 1979e12},
                        3.35e12, 67e12, interconnect_bandwidth=450e9),
    "H200": Device("H200", 141 * GB, {"bf16": 989e12, "fp32": 494e12, "int8": 1979e12, "fp8": 1979e12},
                   4.8e12, 67e12, interconnect_bandwidth=450e9),
    "A100-80GB": Device("A100-80GB", 80 * GB, {"bf16": 312e12, "fp32": 156e12, "int8": 624e12},
                        2.039e12, 19.5e12, interconnect_bandwidth=300e9),
    "L40S": Device("L40S", 48 * GB, {"bf16": 362e12, "fp32": 183e12, "int8": 733e12, "fp8": 733e12},
                   0.864e12, 91.6e12, interconnect_bandwidth=32e9, interconnect_latency=20e-6),
    # the reference CPU's calibration (`tidal plan calibrate --serve-result`, docs/planner.md "Measured:
    # 2026-12-01 (20:07-20:10 UTC)"); a figure the calibration does not measure says so
    "cpu": Device(
        "cpu (2-core AMD EPYC Zen 4, AVX-512 BF16)",
        24 * GB,                       # the host's memory (lscpu / psutil: 24 GB)
        # the calibration's peak: the largest measured GEMM rate; fp32 and int8 at half and twice it (not measured)
        {"bf16": 883e9, "fp32": 883e9 / 2, "int8": 2 * 883e9},
        34.5e9,                        # B/s: the one-row GEMM pass over the weights
        20e9,                          # elementwise fp32 FLOP/s (the Mamba scan): not measured
        interconnect_bandwidth=5e9, interconnect_latency=50e-6,  # one host, no tensor parallelism: not measured
        gemm_efficiency=1.0, bandwidth_efficiency=1.0,          # the figures are achieved rates
        step_overhead=0.0,             # the fit left no fixed part per step beyond the costs below
        layer_overhead=0.0,            # not fitted (the calibration's launches are in the costs below)
        request_overhead=25e-6, token_overhead=47.5e-6,
        # `tidal serve` (fitted on 0.5 and 6 req/s): nothing per step, 2.49 ms more per step off the skinny
        # GEMM, 11.3 ms to each request's first token
        serve_step_overhead=0.0, serve_request_overhead=0.0, serve_wide_step_overhead=2.49e-3,
        serve_first_token_latency=11.3e-3,
        skinny_max_rows=4,             # decodes of 1-4 requests run on the skinny bf16 GEMM
        # achieved bf16 GEMM FLOP/s by rows (one pass over every linear layer); from 256 rows on the calibration
        # printed 837-883 GFLOP/s: the 1024-row figure is not recorded on its own, taken inside that range
        gemm_flops_by_rows={1: 34.5e9, 4: 150e9, 16: 503e9, 64: 732e9, 256: 837e9, 1024: 860e9, 2048: 883e9},
        attention_seconds_per_kv_byte=36.5e-12,         # from memory
        attention_seconds_per_cached_kv_byte=6.1e-12,   # re-read from the caches (a shared prefix)
        attention_flops=445e9,                          # query-key products of prompts
        kv_cache_memory_bytes=4 * 2**30,                # the engine's fixed CPU cache budget
        kind="cpu"),
}


def get_device(name: str) -> Device:
    for key, dev in DEVICES.items():
        if name.lower() in (key.lower(), dev.name.lower()):
            return Device(**asdict(dev))
    raise ValueError(f"unknown device {name!r}; the table has {', '.join(DEVICES)} (or give --calibration FILE)")


def load_calibration(path: str) -> Device:
    """A device from a calibration file (tidal plan calibrate): its fields override the table's row
    for the device it names (`base`, default cpu)."""
    with open(path) as f:
        data = json.load(f)
    base = get_device(data.pop("base", "cpu"))
    known = {f.name for f in fields(Device)}
    unknown = sorted(set(data) - known - {"measured", "notes"})
    if unknown:
        raise ValueError(f"{path}: unknown field(s) {', '.join(unknown)}")
    merged = {**asdict(base), **{k: v for k, v in data.items() if k in known}, "source": path}
    return Device(**merged)
