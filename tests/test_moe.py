"""Top-k routed experts: routing, expert-batched compute against a per-token reference and against
transformers' Mixtral/Jamba MoE blocks, and weight loading from per-expert and stacked checkpoints."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tidal.layers.moe import FusedMoE, SparseMoeBlock, route, split_expert_weights

E, H, INTER, K = 4, 16, 24, 2


def test_route_renormalizes_only_when_asked():
    logits = torch.randn(10, E, generator=torch.Generator().manual_seed(0))
    probs = torch.softmax(logits, -1)
    w, ids = route(logits, K, renormalize=False)
    assert torch.equal(ids, probs.topk(K, -1).indices)
    torch.testing.assert_close(w, probs.topk(K, -1).values)
    w, _ = route(logits, K, renormalize=True)
    torch.testing.assert_close(w.sum(-1), torch.ones(10))


def _random_moe(seed: int = 0) -> FusedMoE:
    g = torch.Generator().manual_seed(seed)
    moe = FusedMoE(E, H, INTER)
    moe.w13_weight.data.copy_(torch.randn(moe.w13_weight.shape, generator=g) * 0.2)
    moe.w2_weight.data.copy_(torch.randn(moe.w2_weight.shape, generator=g) * 0.2)
    return moe


def test_expert_batched_compute_matches_per_token_reference():
    moe = _random_moe()
    g = torch.Generator().manual_seed(1)
    x = torch.randn(13, H, generator=g)
    w, ids = route(torch.randn(13, E, generator=g), K, renormalize=False)
    out = moe(x, w, ids)
    for t in range(13):
        ref = torch.zeros(H)
        for j in range(K):
            e = ids[t, j]
            gate, up = (moe.w13_weight[e] @ x[t]).chunk(2)
            ref += w[t, j] * (moe.w2_weight[e] @ (F.silu(gate) * up))
        torch.testing.assert_close(out[t], ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("arch", ["mixtral", "jamba"])
def test_moe_block_matches_transformers(arch):
    import transformers
    if arch == "mixtral":
        from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock as Block
        cfg = transformers.MixtralConfig(hidden_size=H, intermediate_size=INTER, num_local_experts=E,
                                         num_experts_per_tok=K)
    else:
        from transformers.models.jamba.modeling_jamba import JambaSparseMoeBlock as Block
        cfg = transformers.JambaConfig(hidden_size=H, intermediate_size=INTER, num_experts=E, num_experts_per_tok=K)
    torch.manual_seed(0)
    ref = Block(cfg).eval()
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0, 0.3)
    router = "gate" if arch == "mixtral" else "router"
    ours = SparseMoeBlock(H, INTER, E, K, renormalize=arch == "mixtral", router_name=router)
    sd = ref.state_dict()  # stacked layout: experts.gate_up_proj [E, 2I, H], experts.down_proj [E, H, I]
    names = [(f"moe.{k}", v) for k, v in sd.items() if k.startswith("experts.")]
    rest = list(split_expert_weights(torch.nn.ModuleDict({"moe": ours}), names))
    assert rest == []
    getattr(ours, router).weight.data.copy_(sd[f"{router}.weight"])
    x = torch.randn(2, 7, H)
    with torch.no_grad():
        expected = ref(x)
        expected = expected[0] if isinstance(expected, tuple) else expected
    torch.testing.assert_close(ours(x.view(-1, H)), expected.reshape(-1, H), rtol=1e-5, atol=1e-6)


def test_per_expert_and_stacked_checkpoints_load_the_same_weights():
    g = torch.Generator().manual_seed(2)
    gate = torch.randn(E, INTER, H, generator=g)
    up = torch.randn(E, INTER, H, generator=g)
    down = torch.randn(E, H, INTER, generator=g)
    per_expert = [(f"m.experts.{e}.{n}.weight", t[e]) for e in range(E)
                  for n, t in (("w1", gate), ("w3", up), ("w2", down))]
    stacked = [("m.experts.gate_up_proj", torch.cat([gate, up], dim=1)), ("m.experts.down_proj", down)]
    models = []
    for weights in (per_expert, stacked):
        m = torch.nn.ModuleDict({"m": torch.nn.Module()})
        m["m"].experts = FusedMoE(E, H, INTER)
        assert list(split_expert_weights(m, weights + [("other.weight", torch.zeros(1))])) == \
            [("other.weight", torch.zeros(1))]
        models.append(m["m"].experts)
    assert torch.equal(models[0].w13_weight, models[1].w13_weight)
    assert torch.equal(models[0].w2_weight, models[1].w2_weight)
    assert torch.equal(models[0].w13_weight[:, :INTER], gate)


def test_missing_expert_weight_is_refused():
    m = torch.nn.ModuleDict({"m": torch.nn.Module()})
    m["m"].experts = FusedMoE(E, H, INTER)
    weights = [(f"m.experts.{e}.w1.weight", torch.zeros(INTER, H)) for e in range(E)]
    with pytest.raises(ValueError, match="missing expert weights"):
        list(split_expert_weights(m, weights))
