"""The engine's side of speculative decoding: set up the proposer and draft policy from
`speculative_config`, give running requests their drafts before a step is scheduled, and record what
the step accepted. LLMEngine.step() calls propose_drafts and record_drafts around schedule -> execute
-> update when it has a proposer (tests may set `engine.proposer` to any object with propose(request);
without a draft policy every draft found runs).
"""
from __future__ import annotations

import logging

from tidal.engine.proposer import NgramProposer
from tidal.spec_decode.config import SpeculativeConfig
from tidal.spec_decode.policy import DraftPolicy

logger = logging.getLogger(__name__)


def start(spec: SpeculativeConfig, engine) -> tuple[object, DraftPolicy]:
    """(proposer, draft policy) for an engine whose model, KV cache and scheduler are set up. Raises
    ValueError naming the field for what this engine cannot speculate with."""
    if engine.scheduler.state_pool is not None:
        raise ValueError("speculative_config: speculative decoding is not supported on models with Mamba layers "
                         "(a rejected draft would leave the recurrent state advanced past the last accepted "
                         "token); run this model without speculative_config")
    if spec.method == "draft_model":
        proposer = _load_draft_model(spec, engine)
        what = f"draft model {spec.model or 'the target'}"
    else:
        proposer = NgramProposer(spec.num_speculative_tokens, spec.prompt_lookup_min, spec.prompt_lookup_max)
        what = f"n-grams of {spec.prompt_lookup_min}-{spec.prompt_lookup_max} tokens"
    policy = DraftPolicy(spec.num_speculative_tokens, adaptive=spec.adaptive,
                         disable_by_batch_size=spec.disable_by_batch_size)
    logger.info("Speculative decoding: %s, up to %d draft tokens per request and step (%s), %s", spec.method,
                spec.num_speculative_tokens, what, "as many as pay off by measured acceptance and step cost"
                if spec.adaptive else "all found")
    return proposer, policy


def _load_draft_model(spec: SpeculativeConfig, engine):
    from tidal.loader import load_model
    from tidal.spec_decode.draft_model import DraftModelProposer
    config = engine.config
    try:
        loaded = load_model(spec.model or config.model, config.dtype, config_overrides=spec.hf_overrides,
                            quantization=spec.quantization, device=config.device)
    except ValueError as e:
        raise ValueError(f"speculative_config.model: {e}") from None
    if loaded.config.vocab_size != engine.vocab_size:
        raise ValueError(f"speculative_config.model: the draft's vocabulary ({loaded.config.vocab_size} tokens) is "
                         f"not the target's ({engine.vocab_size}): it must share the target's tokenizer")
    return DraftModelProposer(loaded, spec.num_speculative_tokens, config.block_size, engine.max_model_len,
                              config.max_num_seqs, engine.max_num_batched_tokens, engine.kv_plan.num_tokens,
                              config.seed)


def propose_drafts(engine) -> float:
    """Draft tokens for running requests that are decoding, no more than their max_tokens can use, as
    many as the draft policy says pay off. Not for requests with a grammar (their drafts would need the
    grammar's state at each draft) nor on models with Mamba layers (a rejected draft would have advanced
    the recurrent state). Returns the wall seconds of a draft model's forwards (0 otherwise), which the
    step's cost for the policy leaves out."""
    scheduler, policy, proposer = engine.scheduler, engine.draft_policy, engine.proposer
    if scheduler.state_pool is not None or (policy is not None and not policy.wants_drafts(scheduler.num_running)):
        return 0.0
    batched = hasattr(proposer, "propose_batch")  # a draft model: decide first, then draft
    proposals = []
    for request in scheduler.running:
        if request.structured is None and request.num_computed_tokens == request.num_tokens - 1:
            max_tokens = request.sampling_params.max_tokens
            room = engine.max_model_len if max_tokens is None else max_tokens - request.num_output_tokens - 1
            if room <= 0:
                continue
            drafts = [0] * min(room, proposer.k) if batched else list(proposer.propose(request))[:room]
            if drafts:
                proposals.append((request, drafts))
    if not proposals:
        return 0.0
    counts = [len(d) for _, d in proposals]
    if policy is not None:
        catch_up = [proposer.pending_tokens(r) for r, _ in proposals] if batched else None
        counts = policy.choose(proposals, scheduler.num_running, _tokens_without_drafts(engine), catch_up)
    if batched:
        wanted = [(r, n) for (r, _), n in zip(proposals, counts) if n]
        proposals = list(zip([r for r, _ in wanted], proposer.propose_batch(wanted, scheduler.requests)))
        counts = [len(d) for _, d in proposals]
        forwards, proposer.forwards = proposer.forwards, []
        if policy is not None:
            for num_tokens, seconds in forwards:
                policy.observe_draft_forward(num_tokens, seconds)
    for (request, drafts), n in zip(proposals, counts):
        request.spec_token_ids = drafts[:n]
    return sum(seconds for _, seconds in forwards) if batched else 0.0


def _tokens_without_drafts(engine) -> int:
    """About how many tokens the next step computes without drafts: what running requests have left to
    compute, and waiting prompts, up to the token budget."""
    scheduler, budget = engine.scheduler, engine.max_num_batched_tokens
    n = sum(r.num_tokens - r.num_computed_tokens for r in scheduler.running)
    if n < budget and scheduler.num_running < engine.config.max_num_seqs:
        n += sum(r.num_tokens for r in scheduler.waiting)
    return min(n, budget)


def record_drafts(engine, batch, sampled: dict[str, list[int]], seconds: float) -> None:
    """Acceptance of a step's drafts (engine stats, the draft policy) and the step's cost (seconds, without
    the draft model's forwards: those are costed apart)."""
    policy = engine.draft_policy
    drafts = []  # (drafts run, drafts accepted) per request that ran any
    for sr in batch.scheduled:
        tokens = sampled.get(sr.request_id)
        if sr.spec_token_ids and tokens:
            drafts.append((len(sr.spec_token_ids), len(tokens) - 1))
            if policy is not None:  # (a request that finished has no stats to keep)
                policy.observe_drafts(engine.scheduler.requests.get(sr.request_id), *drafts[-1])
    engine.stats.record_drafts(drafts)
    if policy is not None and batch.scheduled:  # the target's share (seconds without a draft model's forwards)
        policy.observe_step(batch.num_batched_tokens, seconds)
