"""MambaMixer: the selective state-space layer of Mamba and Jamba, under continuous batching.

    in_proj -> causal depthwise conv1d -> x_proj -> (Jamba: RMSNorm on dt, B, C) -> dt_proj + softplus
            -> selective scan -> D skip -> SiLU(gate) -> out_proj

Each running request owns one state slot: `conv_state[slot]` holds the last d_conv - 1 conv inputs and
`ssm_state[slot]` the SSM state. The model runner binds both tensors (as it binds `Attention.kv_cache`)
and the layer reads the batch layout from the forward context: requests ordered decodes first
(`num_decodes` of them, one token each), then multi-token chunks; `state_slots` and
`has_initial_state` per request. A chunk that starts at position 0 starts from zero state; every other
chunk prepends its cached conv inputs and starts from its cached SSM state, so chunked prefill computes
exactly what one long prefill would.

Multi-token chunks of all requests run together: padded to the longest chunk, time-major, with dt = 0
on padding so padded steps carry the state through unchanged (exp(0 * A) = 1, no input). The scan
runs in a native CPU kernel (tidal/layers/mamba_native.py: one pass over time per block of channels,
the state kept in L1, exp vectorised; ~6x faster than the torch path at 2k tokens) when a compiler
is available. The torch fallback is a loop over time batched over requests, in time blocks whose
discretised A and B*x are computed vectorised, with the C read-out one batched matmul per block (on
CPU it beat a scan through cumulative sums of log-decays by ~3x, which also needs overflow guards
for fast-decaying channels).

Tensor-parallel ready: d_inner is split across ranks (in_proj, conv, dt_proj, A, D by rows; x_proj and
out_proj by columns, with x_proj's partial sums all-reduced so every rank sees whole dt, B, C).
"""
from __future__ import annotations

from itertools import pairwise

import torch
import torch.nn.functional as F
from torch import nn

from tidal.device import to_device
from tidal.distributed import get_tp_rank, get_tp_size
from tidal.forward_context import batch_invariant, get_forward_context
from tidal.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    RowParallelLinear,
    default_weight_loader,
)
from tidal.layers.mamba_native import selective_scan_native
from tidal.layers.norm import RMSNorm

# Elements of one [time, requests, d_inner, d_state] scan block (fp32): bounds the scan's working memory.
_SCAN_BLOCK_ELEMS = 1 << 22


def _row_sharded(param: nn.Parameter) -> nn.Parameter:
    """This rank's rows (dim 0) of a d_inner-indexed checkpoint tensor."""
    rank, size = get_tp_rank(), param.shape[0]

    def load(p, loaded, shard_id=None):
        default_weight_loader(p, loaded.narrow(0, rank * size, size))
    param.weight_loader = load
    return param


class _DepthwiseConv1d(nn.Module):
    """Holds the checkpoint's `conv1d.weight` [d_inner, 1, d_conv] and `conv1d.bias` [d_inner]."""

    def __init__(self, channels: int, kernel: int, bias: bool, dtype) -> None:
        super().__init__()
        self.weight = _row_sharded(nn.Parameter(torch.empty(channels, 1, kernel, dtype=dtype), requires_grad=False))
        self.bias = (_row_sharded(nn.Parameter(torch.zeros(channels, dtype=dtype), requires_grad=False))
                     if bias else None)


class MambaMixer(nn.Module):
    def __init__(self, hidden_size: int, intermediate_size: int, state_size: int, conv_kernel: int,
                 time_step_rank: int, use_conv_bias: bool = True, use_bias: bool = False,
                 bcdt_rms_eps: float | None = None, activation: str = "silu", dtype=torch.float32,
                 quant_method=None) -> None:
        """bcdt_rms_eps: Jamba's RMSNorms on dt, B and C (None: plain Mamba, no norms). quant_method
        applies to the two big projections (in_proj, out_proj); x_proj and dt_proj stay unquantized."""
        super().__init__()
        if activation not in ("silu", "swish"):
            raise ValueError(f"Mamba activation must be silu, got {activation!r}")
        tp = get_tp_size()
        if intermediate_size % tp:
            raise ValueError(f"mamba intermediate size {intermediate_size} is not divisible by "
                             f"tensor_parallel_size {tp}")
        self.d_inner = intermediate_size // tp  # this rank's channels
        self.d_state, self.d_conv, self.dt_rank = state_size, conv_kernel, time_step_rank
        self.dtype = dtype
        self.in_proj = MergedColumnParallelLinear(hidden_size, [intermediate_size] * 2, bias=use_bias, dtype=dtype,
                                                  quant_method=quant_method)
        for p in self.in_proj.parameters():  # the checkpoint stores [x; gate] as one tensor: each half is a shard
            p.weight_loader = self._load_in_proj
        self.conv1d = _DepthwiseConv1d(self.d_inner, conv_kernel, use_conv_bias, dtype)
        self.x_proj = RowParallelLinear(intermediate_size, time_step_rank + 2 * state_size, bias=False, dtype=dtype)
        self.dt_proj = ColumnParallelLinear(time_step_rank, intermediate_size, bias=True, dtype=dtype)
        self.A_log = _row_sharded(nn.Parameter(torch.empty(self.d_inner, state_size, dtype=dtype),
                                               requires_grad=False))
        self.D = _row_sharded(nn.Parameter(torch.ones(self.d_inner, dtype=dtype), requires_grad=False))
        self.out_proj = RowParallelLinear(intermediate_size, hidden_size, bias=use_bias, dtype=dtype,
                                          quant_method=quant_method)
        self.has_bcdt_norms = bcdt_rms_eps is not None
        if self.has_bcdt_norms:
            self.dt_layernorm = RMSNorm(time_step_rank, bcdt_rms_eps, dtype)
            self.b_layernorm = RMSNorm(state_size, bcdt_rms_eps, dtype)
            self.c_layernorm = RMSNorm(state_size, bcdt_rms_eps, dtype)
        # Bound by the model runner: [num_slots, d_inner, d_conv - 1] (model dtype) and
        # [num_slots, d_inner, d_state] (fp32: the state integrates over the whole sequence).
        self.conv_state: torch.Tensor | None = None
        self.ssm_state: torch.Tensor | None = None

    def _load_in_proj(self, param, loaded, shard_id=None) -> None:
        halves = (loaded, loaded) if loaded.numel() == 1 else loaded.chunk(2, dim=0)  # a per-tensor scale: both
        for i, half in enumerate(halves):
            MergedColumnParallelLinear.weight_loader(self.in_proj, param, half, i)

    # -- state -----------------------------------------------------------------------------------
    def state_shapes(self) -> tuple[tuple[int, int], tuple[int, int]]:
        """Per-slot shapes of (conv_state, ssm_state)."""
        return (self.d_inner, self.d_conv - 1), (self.d_inner, self.d_state)

    def state_bytes(self) -> int:
        conv, ssm = self.state_shapes()
        elem = torch.empty((), dtype=self.dtype).element_size()
        return conv[0] * conv[1] * elem + ssm[0] * ssm[1] * 4

    def allocate_state(self, num_slots: int) -> None:
        """State tensors on the device of the layer's weights."""
        conv, ssm = self.state_shapes()
        device = self.A_log.device
        self.conv_state = torch.zeros(num_slots, *conv, dtype=self.dtype, device=device)
        self.ssm_state = torch.zeros(num_slots, *ssm, dtype=torch.float32, device=device)

    # -- forward ---------------------------------------------------------------------------------
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden [num_tokens, hidden_size] -> [num_tokens, hidden_size]."""
        meta = get_forward_context()
        xs, gate = self.in_proj(hidden).chunk(2, dim=-1)  # [T, d_inner] each
        nd, T = meta.num_decodes, hidden.shape[0]
        slots, fresh = meta.state_slots, ~meta.has_initial_state
        y = torch.empty(T, self.d_inner, dtype=torch.float32, device=hidden.device)
        checkpoints = meta.state_checkpoints or ()
        if nd and meta.batch_invariant:
            # decodes as one-token chunks (a group of their own, so no padding to a prompt chunk's length):
            # a token's conv, scan and output come from the code that computes it when it is recomputed
            # inside a prompt chunk (a preempted request resumed); a checkpoint: the state after the token
            y[:nd] = self._prefill(xs[:nd], [1] * nd, slots[:nd], fresh[:nd],
                                   [(i, 1, index) for i, _, index in checkpoints if i < nd])
        elif nd:
            y[:nd] = self._decode(xs[:nd], slots[:nd], fresh[:nd], meta.fresh_decodes)
            for i, _, index in checkpoints:
                if i < nd:  # the state after this decode token
                    self.conv_state[index] = self.conv_state[slots[i]]
                    self.ssm_state[index] = self.ssm_state[slots[i]]
        if T > nd:
            starts = meta.query_start_loc[nd:]
            lens = [b - a for a, b in pairwise(starts)]
            y[nd:] = self._prefill(xs[nd:], lens, slots[nd:], fresh[nd:],
                                   [(i - nd, t, index) for i, t, index in checkpoints if i >= nd])
        y = y * F.silu(gate.float())
        return self.out_proj(y.to(hidden.dtype))

    def _ssm_inputs(self, xc: torch.Tensor):
        """Conv output [..., d_inner] -> dt [..., d_inner] (fp32, after softplus), B, C [..., d_state] fp32."""
        dt, B, C = self.x_proj(xc).split([self.dt_rank, self.d_state, self.d_state], dim=-1)
        if self.has_bcdt_norms:
            dt, B, C = self.dt_layernorm(dt), self.b_layernorm(B), self.c_layernorm(C)
        return F.softplus(self.dt_proj(dt).float()), B.float(), C.float()

    def _A(self) -> torch.Tensor:
        """-exp(A_log) [d_inner, d_state], computed once per weight version, not every step."""
        version = self.A_log._version
        if getattr(self, "_A_cache", None) is None or self._A_version != version:
            self._A_cache, self._A_version = -torch.exp(self.A_log.float()), version
        return self._A_cache

    def _decode(self, x: torch.Tensor, slots: torch.Tensor, fresh: torch.Tensor, any_fresh: bool) -> torch.Tensor:
        """One token per request: x [B, d_inner] -> scan output before gating [B, d_inner] fp32.
        any_fresh: some request is a one-token prompt, starting from zero state (rare in decodes)."""
        conv_prev = self.conv_state[slots]  # [B, d, K-1]
        if any_fresh:
            conv_prev = conv_prev.masked_fill(fresh[:, None, None], 0)
        window = torch.cat([conv_prev, x.unsqueeze(-1).to(conv_prev.dtype)], dim=-1)  # [B, d, K]
        self.conv_state[slots] = window[:, :, 1:]
        xc = (window * self.conv1d.weight[:, 0, :]).sum(-1)
        if self.conv1d.bias is not None:
            xc = xc + self.conv1d.bias
        xc = F.silu(xc)
        dt, B, C = self._ssm_inputs(xc)
        h = self.ssm_state[slots]  # [B, d, N]
        if any_fresh:
            h = h.masked_fill(fresh[:, None, None], 0)
        xf = xc.float()
        h = (h * torch.exp(dt.unsqueeze(-1) * self._A())).addcmul_((dt * xf).unsqueeze(-1), B.unsqueeze(1))
        self.ssm_state[slots] = h
        return torch.bmm(h, C.unsqueeze(-1)).squeeze(-1) + xf * self.D.float()

    def _conv_fixed_order(self, xpad: torch.Tensor, L: int) -> torch.Tensor:
        """The depthwise conv of xpad [R, d, K-1 + L] -> [R, d, L] as fp32 element-wise products summed tap
        by tap (then the bias), rounded once to the model dtype: each output's order is fixed, whatever
        the number of requests or the padded length (batch-invariant mode)."""
        w = self.conv1d.weight[:, 0, :].float()  # [d, K]
        acc = xpad[:, :, 0:L].float() * w[:, 0:1]
        for j in range(1, self.d_conv):
            acc += xpad[:, :, j:j + L].float() * w[:, j:j + 1]
        if self.conv1d.bias is not None:
            acc += self.conv1d.bias.float()[:, None]
        return acc.to(xpad.dtype)

    def _prefill(self, x: torch.Tensor, lens: list[int], slots: torch.Tensor, fresh: torch.Tensor,
                 checkpoints: list[tuple[int, int, int]] = ()) -> torch.Tensor:
        """Chunks of R requests, flat x [sum(lens), d_inner] -> scan output before gating, fp32.
        checkpoints: (request r, t, state index): also save r's state after its first t tokens there
        (prefix caching, see tidal/core/state_checkpoints.py)."""
        R, L, K1, d = len(lens), max(lens), self.d_conv - 1, self.d_inner
        # index tensors built on the host (repeat_interleave on a GPU would wait for it), then copied
        lens_t = torch.tensor(lens)
        req = torch.repeat_interleave(torch.arange(R), lens_t)                  # [Tp] request of each token
        off = torch.arange(x.shape[0]) - torch.repeat_interleave(lens_t.cumsum(0) - lens_t, lens_t)
        lens_t, req, off = (to_device(t, x.device) for t in (lens_t, req, off))

        # Causal depthwise conv over [cached K-1 inputs | this chunk], right-padded to the longest chunk.
        xpad = x.new_zeros(R, d, K1 + L)
        xpad[:, :, :K1] = self.conv_state[slots].masked_fill(fresh[:, None, None], 0)
        xpad[req, :, K1 + off] = x
        last = (lens_t[:, None] + torch.arange(K1, device=x.device)).unsqueeze(1).expand(R, d, K1)
        self.conv_state[slots] = xpad.gather(2, last)  # the chunk's last K-1 inputs (incl. cached ones)
        for r, t, index in checkpoints:
            self.conv_state[index] = xpad[r, :, t:t + K1]  # the K-1 inputs before token t
        if batch_invariant():
            conv = self._conv_fixed_order(xpad, L)
        else:
            conv = F.conv1d(xpad, self.conv1d.weight, self.conv1d.bias, groups=d)  # [R, d, L]
        xc = F.silu(conv)[req, :, off]  # [Tp, d] flat again
        dt, B, C = self._ssm_inputs(xc)
        xf = xc.float()

        # Time-major padded scan inputs; dt = 0 on padding carries the state through unchanged.
        dt_p = dt.new_zeros(L, R, d)
        dtx_p = dt.new_zeros(L, R, d)
        B_p, C_p = B.new_zeros(L, R, self.d_state), C.new_zeros(L, R, self.d_state)
        dt_p[off, req], dtx_p[off, req] = dt, dt * xf
        B_p[off, req], C_p[off, req] = B, C
        h = self.ssm_state[slots].masked_fill(fresh[:, None, None], 0)  # [R, d, N]
        y_p, snaps = selective_scan(dt_p, dtx_p, self._A(), B_p, C_p, h, [(t - 1, r) for r, t, _ in checkpoints])
        self.ssm_state[slots] = h
        for (_, _, index), state in zip(checkpoints, snaps):
            self.ssm_state[index] = state
        return y_p[off, req] + xf * self.D.float()


def selective_scan(dt: torch.Tensor, dtx: torch.Tensor, A: torch.Tensor, B: torch.Tensor, C: torch.Tensor,
                   h: torch.Tensor, snapshots: list[tuple[int, int]] = (), native: bool = True
                   ) -> tuple[torch.Tensor, list]:
    """h_t = exp(dt_t A) h_{t-1} + dt_t x_t B_t;  y_t = h_t . C_t, for R requests at once.

    dt, dtx [L, R, d]; A [d, N]; B, C [L, R, N]; h [R, d, N] fp32, updated in place to the final state.
    Returns y [L, R, d] and, for each (t, r) in snapshots, a copy of request r's state h_t [d, N].
    Runs the native CPU kernel when it is available (native=True), else the torch loop below."""
    if native:
        out = selective_scan_native(dt, dtx, A, B, C, h, snapshots)
        if out is not None:
            return out
    L, R, d = dt.shape
    N = A.shape[1]
    y = dt.new_empty(L, R, d)
    step = max(1, _SCAN_BLOCK_ELEMS // (R * d * N))
    state = h
    taken: list = [None] * len(snapshots)
    for s in range(0, L, step):
        e = min(L, s + step)
        dA = (dt[s:e].unsqueeze(-1) * A).exp_()                       # [t, R, d, N]
        states = dtx[s:e].unsqueeze(-1) * B[s:e].unsqueeze(2)         # [t, R, d, N]: dt x B, then h_t
        for t in range(e - s):  # in place, one fused multiply-add per step, batched over requests
            state = states[t].addcmul_(dA[t], state)
        # y[t, r, i] = sum_n states[t, r, i, n] * C[t, r, n]
        y[s:e] = torch.matmul(states, C[s:e].unsqueeze(-1)).squeeze(-1)
        for i, (t, r) in enumerate(snapshots):
            if s <= t < e:
                taken[i] = states[t - s, r].clone()
    h.copy_(state)
    return y, taken
