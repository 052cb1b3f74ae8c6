"""The Mamba mixer on its own: the batched scan against a per-token recurrence, the layer against
transformers' Jamba mixer, and chunked prefill + decode of interleaved requests equal to one
full-sequence pass (conv inputs and SSM state carried per slot, fresh chunks starting from zero)."""
from __future__ import annotations

import pytest
import torch

import tidal.layers.mamba as mamba_mod
from tidal.forward_context import ForwardContext, set_forward_context
from tidal.layers import mamba_native
from tidal.layers.mamba import MambaMixer, selective_scan

H, D_INNER, N, K, RANK = 16, 32, 4, 4, 4


def _reference_scan(dt, dtx, A, B, C, h):
    ys = []
    for t in range(dt.shape[0]):
        h = torch.exp(dt[t, :, :, None] * A) * h + dtx[t, :, :, None] * B[t, :, None, :]
        ys.append((h * C[t, :, None, :]).sum(-1))
    return torch.stack(ys), h


@pytest.mark.parametrize(("native", "block_elems"), [(False, 1 << 22), (False, 3 * 2 * D_INNER * N), (True, 0)])
def test_batched_scan_matches_per_token_recurrence(monkeypatch, native, block_elems):
    """The torch scan in one time block and in blocks of 3 steps, and the native kernel."""
    monkeypatch.setattr(mamba_mod, "_SCAN_BLOCK_ELEMS", block_elems)
    g = torch.Generator().manual_seed(0)
    L, R = 10, 2
    dt = torch.rand(L, R, D_INNER, generator=g) * 0.5
    dt[7:, 1] = 0  # padding of the shorter request: state must pass through unchanged
    dtx = dt * torch.randn(L, R, D_INNER, generator=g)
    A = -torch.rand(D_INNER, N, generator=g) * 3
    B, C = torch.randn(L, R, N, generator=g), torch.randn(L, R, N, generator=g)
    h0 = torch.randn(R, D_INNER, N, generator=g)
    ref_y, ref_h = _reference_scan(dt, dtx, A, B, C, h0)
    _, h_at_7 = _reference_scan(dt[:7], dtx[:7], A, B[:7], C[:7], h0)
    _, h_at_4 = _reference_scan(dt[:4], dtx[:4], A, B[:4], C[:4], h0)
    h = h0.clone()
    if native:
        assert mamba_native.selective_scan_native(dt, dtx, A, B, C, h.clone(), []) is not None, "no kernel"
    y, (snap_4, snap_7) = selective_scan(dt, dtx, A, B, C, h, [(3, 0), (6, 1)], native=native)
    torch.testing.assert_close(y, ref_y, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h, ref_h, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(h[1], h_at_7[1], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(snap_4, h_at_4[0], rtol=1e-5, atol=1e-5)  # states mid-chunk, for checkpoints
    torch.testing.assert_close(snap_7, h_at_7[1], rtol=1e-5, atol=1e-5)


def _mixer(jamba_norms: bool = True) -> MambaMixer:
    torch.manual_seed(0)
    m = MambaMixer(H, D_INNER, N, K, RANK, bcdt_rms_eps=1e-6 if jamba_norms else None)
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.normal_(0, 0.3)
        m.A_log.copy_(torch.log(torch.rand(D_INNER, N) * 3 + 0.5))
        m.dt_proj.bias.uniform_(-3, -1)
    return m


def _meta(lens: list[int], slots: list[int], fresh: list[bool]) -> ForwardContext:
    """Batch layout for the Mamba layer only (decodes, i.e. 1-token requests, first)."""
    qsl = [0]
    for n in lens:
        qsl.append(qsl[-1] + n)
    nd = sum(1 for n in lens if n == 1)
    return ForwardContext(num_tokens=qsl[-1], num_decodes=nd, query_start_loc=qsl,
                          state_slots=torch.tensor(slots), has_initial_state=torch.tensor([not f for f in fresh]),
                          fresh_decodes=any(fresh[:nd]))


def test_mixer_matches_transformers_jamba_mixer():
    import transformers
    from transformers.models.jamba.modeling_jamba import JambaMambaMixer
    cfg = transformers.JambaConfig(hidden_size=H, mamba_expand=D_INNER // H, mamba_d_state=N, mamba_d_conv=K,
                                   mamba_dt_rank=RANK, use_mamba_kernels=False)
    ours = _mixer()
    ref = JambaMambaMixer(cfg, layer_idx=0).eval()
    ref.load_state_dict(ours.state_dict())  # same parameter names as the checkpoint
    x = torch.randn(1, 23, H)
    ours.allocate_state(2)
    with torch.no_grad(), set_forward_context(_meta([23], [1], [True])):
        got = ours(x[0])
    torch.testing.assert_close(got, ref(x)[0].detach(), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("jamba_norms", [True, False])
def test_interleaved_chunks_and_decodes_equal_full_sequence(jamba_norms):
    """Two requests: A's prompt in chunks of 5, 1 (a one-token chunk takes the decode path) and 6
    tokens then decodes, B fresh in a later step sharing steps with A; outputs and states equal one
    pass over each whole sequence."""
    m = _mixer(jamba_norms)
    x_a, x_b = torch.randn(15, H), torch.randn(9, H)
    m.allocate_state(4)
    with torch.no_grad():
        with set_forward_context(_meta([15, 9], [0, 1], [True, True])):
            full = m(torch.cat([x_a, x_b]))
        full_conv, full_ssm = m.conv_state[:2].clone(), m.ssm_state[:2].clone()
        m.ssm_state.fill_(float("nan"))  # stale garbage in the slots must not leak into fresh chunks
        m.conv_state.fill_(float("nan"))
        steps = [  # (tokens of A, tokens of B) per step; slot of A = 3, of B = 2
            ((0, 5), None), ((5, 6), (0, 4)), ((6, 12), (4, 8)), ((12, 13), (8, 9)), ((13, 14), None),
            ((14, 15), None)]
        out_a, out_b = [], []
        for i, (a, b) in enumerate(steps):
            reqs = [(x_a[a[0]:a[1]], 3, a[0] == 0, out_a)]
            if b is not None:
                reqs.append((x_b[b[0]:b[1]], 2, b[0] == 0, out_b))
            reqs.sort(key=lambda r: r[0].shape[0] > 1)  # decodes first, as the model runner orders them
            meta = _meta([r[0].shape[0] for r in reqs], [r[1] for r in reqs], [r[2] for r in reqs])
            with set_forward_context(meta):
                y = m(torch.cat([r[0] for r in reqs]))
            for r, s, e in zip(reqs, meta.query_start_loc[:-1], meta.query_start_loc[1:]):
                r[3].append(y[s:e])
    torch.testing.assert_close(torch.cat(out_a), full[:15], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(torch.cat(out_b), full[15:], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.ssm_state[3], full_ssm[0], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(m.conv_state[2], full_conv[1], rtol=1e-5, atol=1e-5)


def test_one_token_prompt_in_a_reused_slot_starts_from_zero_state():
    """A one-token prompt takes the decode path; its slot holds an old request's state (NaN here),
    which must not leak in."""
    m = _mixer()
    m.allocate_state(2)
    x = torch.randn(3, H)
    with torch.no_grad():
        with set_forward_context(_meta([1], [1], [True])):
            alone = m(x[:1])
        m.ssm_state.fill_(float("nan"))
        m.conv_state.fill_(float("nan"))
        with set_forward_context(_meta([1, 2], [1, 0], [True, True])):  # with a fresh 2-token chunk beside it
            y = m(x)
    torch.testing.assert_close(y[:1], alone, rtol=1e-6, atol=1e-6)
    assert not torch.isnan(y).any()
