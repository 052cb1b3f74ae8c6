"""Stop checking: the one place that decides where a request's output ends.

A step gives each sampling request a list of tokens (one today; several once speculative decoding
proposes drafts). `append_tokens` appends them one at a time and cuts at the first token that ends
the output, whatever the reason; the tokens after it are dropped: never appended, detokenized,
accepted by a grammar or streamed.

On one token the reasons are checked in this order, so the reported stop is the same whether the
token came alone or in a run of k:

    any of the request's EOS ids (unless ignore_eos)   stop, stop_reason None
    one of stop_token_ids                               stop, stop_reason = the id
    a stop string completed by the token's text         stop, stop_reason = the string
    max_tokens reached                                  length
    max_model_len reached                               length

The first three are held back until the output has min_tokens tokens (the sampler also masks the
stop ids below min_tokens; this is the check that does not depend on it). A stop string completed
by the token that also reaches max_tokens reports the stop string, as vLLM does. The text is cut at
a completed stop string (after it with include_stop_str_in_output) whichever reason is reported.

Pure Python over integers and strings: the detokenizer comes in with the sample's text state, so
the scheduler can call this without knowing about tokenizers.

    >>> from tidal.request import Request
    >>> from tidal.sampling_params import SamplingParams
    >>> r = Request("r", [1, 2], SamplingParams(max_tokens=8), eos_token_ids=(0, 7))
    >>> append_tokens(r, [5, 7, 9], max_model_len=64)   # 7 is an EOS id: 9 is dropped
    [5, 7]
    >>> r.output_token_ids, r.finish_reason
    ([5, 7], 'stop')
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Protocol

from tidal.request import Request, RequestStatus
from tidal.tokenizer import check_stop_strings

if TYPE_CHECKING:
    from tidal.tokenizer import IncrementalDetokenizer


class SampleText(Protocol):
    """A sample's text as its tokens arrive (the output processor's SampleState)."""
    detok: IncrementalDetokenizer | None
    text: str


Stop = tuple[RequestStatus, int | str | None]  # (finished status, stop_reason)


def append_tokens(request: Request, token_ids: list[int], max_model_len: int,
                  text: SampleText | None = None) -> list[int]:
    """Append a step's tokens to `request` up to and including the first one that ends its output,
    and return the tokens appended (a prefix of token_ids). When one ends it, request.status becomes
    FINISHED_STOPPED or FINISHED_LENGTH and request.stop_reason is set; the caller frees it.
    `text`, when given, receives the text of each appended token and is cut at a stop string."""
    for i, token in enumerate(token_ids):
        request.append_output_token(token)
        stop = check_stop(request, token, max_model_len, text)
        if stop is not None:
            request.status, request.stop_reason = stop
            return list(token_ids[:i + 1])
    return list(token_ids)


def check_stop(request: Request, token: int, max_model_len: int, text: SampleText | None = None) -> Stop | None:
    """Whether `token`, just appended as the request's newest output token, ends the output."""
    params = request.sampling_params
    may_stop = request.num_output_tokens >= params.min_tokens
    stop_string = None
    if text is not None and text.detok is not None:
        piece = text.detok.add(token)
        text.text += piece
        hit = check_stop_strings(text.text, len(piece), params.stop, params.include_stop_str_in_output) \
            if may_stop else None
        if hit is not None:
            stop_string, cut = hit
            text.text = text.text[:cut]
    if may_stop:
        if not params.ignore_eos and token in request.eos_token_ids:
            return RequestStatus.FINISHED_STOPPED, None
        if token in params.stop_token_ids:
            return RequestStatus.FINISHED_STOPPED, token
        if stop_string is not None:
            return RequestStatus.FINISHED_STOPPED, stop_string
    if params.max_tokens is not None and request.num_output_tokens >= params.max_tokens:
        return RequestStatus.FINISHED_LENGTH, None
    if request.num_tokens >= max_model_len:
        return RequestStatus.FINISHED_LENGTH, None
    return None
