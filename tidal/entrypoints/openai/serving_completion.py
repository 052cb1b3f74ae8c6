"""POST /v1/completions: one engine request per prompt, n samples each; choice index is
prompt_index * n + sample_index, as in OpenAI's API."""
from __future__ import annotations

import json
import time

from tidal.engine.async_llm import EngineDeadError
from tidal.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
    UsageInfo,
    random_id,
)
from tidal.entrypoints.openai.serving_base import (
    APIError,
    EngineEvents,
    ServingContext,
    bad_request,
    engine_error,
    merge_async_iterators,
    sse,
)
from tidal.outputs import RequestOutput

_json_str = json.encoder.encode_basestring  # a str as JSON, non-ASCII kept (as pydantic writes it)
_json_value = json.JSONEncoder(ensure_ascii=False).encode


def _prompts(request: CompletionRequest) -> list:
    p = request.prompt
    if isinstance(p, str):
        return [p]
    if not p:
        raise APIError(400, "prompt must not be empty", "prompt")
    if isinstance(p[0], int):
        return [p]
    return list(p)


class _LogprobsBuilder:
    """Completions-style logprobs (tokens, token_logprobs, top_logprobs, text_offset) for one choice."""

    def __init__(self) -> None:
        self.offset = 0

    def add(self, lp: CompletionLogProbs, token_ids, entries, tokenizer) -> None:
        for token_id, entry in zip(token_ids, entries):
            if entry is None:  # the first prompt token has no logprob
                text = tokenizer.decode([token_id]) if tokenizer is not None else str(token_id)
                lp.tokens.append(text)
                lp.token_logprobs.append(None)
                lp.top_logprobs.append(None)
            else:
                chosen = entry[token_id]
                text = chosen.decoded_token if chosen.decoded_token is not None else str(token_id)
                lp.tokens.append(text)
                lp.token_logprobs.append(max(chosen.logprob, -9999.0))  # JSON has no -inf
                lp.top_logprobs.append({(v.decoded_token if v.decoded_token is not None else str(k)):
                                        max(v.logprob, -9999.0) for k, v in entry.items()})
            lp.text_offset.append(self.offset)
            self.offset += len(text)


class CompletionHandler:
    def __init__(self, ctx: ServingContext) -> None:
        self.ctx = ctx

    async def create(self, request: CompletionRequest):
        """Validate everything, then return a response dict or an SSE async generator."""
        ctx = self.ctx
        ctx.check_alive()
        ctx.check_model(request.model)
        ctx.check_limits(request)
        try:
            request.check_unsupported()
            structured = request.structured_outputs_params()
        except ValueError as e:
            raise bad_request(e) from e
        prompts = []
        for p in _prompts(request):
            ctx.check_text_length([p], "prompt")
            try:
                prompts.append(ctx.async_llm.process_prompt(p))
            except ValueError as e:
                raise bad_request(e, "prompt") from e
        want_logprobs = request.logprobs is not None
        params = []
        for text, ids in prompts:
            max_tokens = ctx.max_tokens_for(len(ids), request.max_tokens)
            try:
                params.append(request.sampling_params(
                    max_tokens, request.logprobs,
                    request.prompt_logprobs if request.prompt_logprobs is not None else
                    (request.logprobs if request.echo and want_logprobs else None), structured))
            except ValueError as e:
                raise bad_request(e) from e
            ctx.check_params(params[-1], request.structured_field())
        request_id = random_id("cmpl")
        if request.stream:
            return _CompletionEvents(self, request, request_id, prompts, params)
        streams = []
        for i, ((text, ids), sp) in enumerate(zip(prompts, params)):
            rid = f"{request_id}-{i}"
            ctx.log_request(rid, text, ids, sp)
            streams.append(ctx.async_llm.generate({"prompt": text, "prompt_token_ids": ids}, sp, rid,
                                                  request.cache_salt))
        return await self._full(request, request_id, prompts, merge_async_iterators(*streams))

    def _echo_text(self, prompt) -> str:
        text, ids = prompt
        if text is not None:
            return text
        return self.ctx.tokenizer.decode(ids) if self.ctx.tokenizer is not None else ""

    async def _full(self, request: CompletionRequest, request_id: str, prompts, merged) -> dict:
        n = request.n
        texts = [""] * (len(prompts) * n)
        token_counts = [0] * len(texts)
        finish = [None] * len(texts)
        stop_reasons = [None] * len(texts)
        lps = [CompletionLogProbs() if request.logprobs is not None else None for _ in texts]
        builders = [_LogprobsBuilder() for _ in texts]
        prompt_lps: list = [None] * len(prompts)
        try:
            async for i, out in merged:
                self._first_output(request, i, out, prompts, texts, lps, builders, prompt_lps)
                for o in out.outputs:
                    k = i * n + o.index
                    texts[k] += o.text
                    token_counts[k] += len(o.token_ids)
                    if lps[k] is not None and o.logprobs is not None:
                        builders[k].add(lps[k], o.token_ids, o.logprobs, self.ctx.tokenizer)
                    if o.finish_reason is not None:
                        finish[k], stop_reasons[k] = o.finish_reason, o.stop_reason
        except (EngineDeadError, RuntimeError) as e:
            raise engine_error(e) from e
        choices = [CompletionChoice(index=k, text=texts[k], logprobs=lps[k], finish_reason=finish[k],
                                    stop_reason=stop_reasons[k],
                                    prompt_logprobs=prompt_lps[k // n] if request.prompt_logprobs is not None
                                    else None) for k in range(len(texts))]
        num_prompt = sum(len(ids) for _, ids in prompts)
        num_gen = sum(token_counts)
        return CompletionResponse(id=request_id, model=self.ctx.served_model_name, choices=choices,
                                  usage=UsageInfo(prompt_tokens=num_prompt, completion_tokens=num_gen,
                                                  total_tokens=num_prompt + num_gen)).model_dump()

    def _first_output(self, request, i: int, out: RequestOutput, prompts, texts, lps, builders,
                      prompt_lps) -> None:
        """On a prompt's first output: keep its prompt logprobs and echo it into all its n choices."""
        if prompt_lps[i] is not None:
            return
        prompt_lps[i] = _prompt_logprobs_json(out.prompt_logprobs) if out.prompt_logprobs is not None else []
        if request.echo:
            for j in range(request.n):
                k = i * request.n + j
                texts[k] += self._echo_text(prompts[i])
                if lps[k] is not None and out.prompt_logprobs is not None:
                    builders[k].add(lps[k], prompts[i][1], out.prompt_logprobs, self.ctx.tokenizer)


def _prompt_logprobs_json(prompt_logprobs) -> list:
    """vLLM's prompt_logprobs field: per position {token_id: {logprob, rank, decoded_token}} or None."""
    return [None if d is None else {k: {"logprob": max(v.logprob, -9999.0), "rank": v.rank,
                                        "decoded_token": v.decoded_token} for k, v in d.items()}
            for d in prompt_logprobs]


class _CompletionEvents(EngineEvents):
    """A streamed completion's events: each prompt's request runs through AsyncLLM.stream_to, and each output
    becomes its chunk as the step delivers it (an EventStream's source). The plain chunk (no logprobs, echo
    or prompt logprobs: the usual one) is written from a template, the bytes pydantic writes (5 µs less an
    event); the others are built as CompletionResponse models."""

    def __init__(self, handler: CompletionHandler, request: CompletionRequest, request_id: str, prompts,
                 params) -> None:
        super().__init__(handler.ctx, request, request_id, sum(len(ids) for _, ids in prompts))
        self.handler, self.prompts, self.params = handler, prompts, params
        self.created = int(time.time())
        self.builders = [_LogprobsBuilder() for _ in range(len(prompts) * request.n)]
        self.echoed: set[int] = set()  # choices whose prompt echo went out (each sample may start later)
        self.sent_prompt_lps: set[int] = set()
        self.plain = request.logprobs is None and not request.echo and request.prompt_logprobs is None
        self.head = (f'data: {{"id":{_json_str(request_id)},"object":"text_completion","created":{self.created},'
                     f'"model":{_json_str(self.ctx.served_model_name)},"choices":[{{"index":')

    def begin(self) -> None:
        for i, ((text, ids), sp) in enumerate(zip(self.prompts, self.params)):
            rid = f"{self.request_id}-{i}"
            self.ctx.log_request(rid, text, ids, sp)
            self.run(rid, {"prompt": text, "prompt_token_ids": ids}, sp, self.request.cache_salt, i)

    def on_output(self, i: int, out: RequestOutput) -> None:
        request, n = self.request, self.request.n
        for o in out.outputs:
            k = i * n + o.index
            self.num_gen += len(o.token_ids)
            if self.plain:
                stop = "null" if o.stop_reason is None else _json_value(o.stop_reason)
                self.emit(f'{self.head}{k},"text":{_json_str(o.text)},"logprobs":null,"finish_reason":'
                          f'{"null" if o.finish_reason is None else _json_str(o.finish_reason)},"stop_reason":{stop},'
                          f'"prompt_logprobs":null}}],"usage":null}}\n\n')
                continue
            text = ""
            lp = CompletionLogProbs() if request.logprobs is not None else None
            if request.echo and k not in self.echoed:
                self.echoed.add(k)
                text = self.handler._echo_text(self.prompts[i])
                if lp is not None and out.prompt_logprobs is not None:
                    self.builders[k].add(lp, self.prompts[i][1], out.prompt_logprobs, self.ctx.tokenizer)
            if lp is not None and o.logprobs is not None:
                self.builders[k].add(lp, o.token_ids, o.logprobs, self.ctx.tokenizer)
            choice = CompletionChoice(index=k, text=text + o.text, logprobs=lp, finish_reason=o.finish_reason,
                                      stop_reason=o.stop_reason)
            if request.prompt_logprobs is not None and i not in self.sent_prompt_lps:
                self.sent_prompt_lps.add(i)
                choice.prompt_logprobs = _prompt_logprobs_json(out.prompt_logprobs or [])
            self.emit(self.chunk([choice]))

    def chunk(self, choices, usage: UsageInfo | None = None) -> str:
        return sse(CompletionResponse(id=self.request_id, created=self.created, model=self.ctx.served_model_name,
                                      choices=choices, usage=usage))
