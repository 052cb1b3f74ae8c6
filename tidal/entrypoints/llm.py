"""LLM: the offline API, as in vLLM.

    >>> from tidal import LLM, SamplingParams
    >>> llm = LLM()                                   # the default model, SmolLM2-135M-Instruct
    >>> out = llm.generate(["The capital of France is"], SamplingParams(max_tokens=16))
    >>> print(out[0].outputs[0].text)
"""
from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from tidal.config import EngineConfig
from tidal.engine.llm_engine import LLMEngine
from tidal.outputs import RequestOutput
from tidal.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class LLM:
    def __init__(self, model: str | None = None, **kwargs) -> None:
        self.config = EngineConfig.from_kwargs(model=model, **kwargs)
        self.llm_engine = LLMEngine(self.config, offline=True)

    def get_tokenizer(self):
        return self.llm_engine.get_tokenizer()

    def reset_prefix_cache(self) -> bool:
        return self.llm_engine.reset_prefix_cache()

    def generate(self, prompts, sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True, cache_salt: str | None = None) -> list[RequestOutput]:
        """Generate for one prompt or a list (strings, token-id lists, or {"prompt": ...} /
        {"prompt_token_ids": [...]} dicts). Returns RequestOutputs in input order."""
        if isinstance(prompts, (str, dict)) or (isinstance(prompts, list) and prompts
                                                 and isinstance(prompts[0], int)):
            prompts = [prompts]
        prompts = list(prompts)
        if sampling_params is None:
            sampling_params = SamplingParams()
        params = list(sampling_params) if isinstance(sampling_params, (list, tuple)) else \
            [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        engine = self.llm_engine
        # Validate everything before queueing anything: a bad prompt leaves the engine untouched.
        for p in prompts:
            engine.process_prompt(p)
        for sp in params:
            engine.check_params(sp)
        ids = []
        for prompt, sp in zip(prompts, params):
            rid = engine.next_request_id()
            salt = prompt.get("cache_salt", cache_salt) if isinstance(prompt, dict) else cache_salt
            engine.add_request(rid, prompt, sp.clone(output_kind="final"), cache_salt=salt)
            ids.append(rid)
        return self._run(ids, use_tqdm)

    def chat(self, messages, sampling_params=None, use_tqdm: bool = True, chat_template: str | None = None,
             add_generation_prompt: bool = True, chat_template_kwargs: dict | None = None,
             tools: list[dict] | None = None) -> list[RequestOutput]:
        """Apply the model's chat template to one conversation (a list of {"role", "content"}) or a
        list of conversations, and generate. `tools` (OpenAI's function definitions) go to the template."""
        conversations = [messages] if messages and isinstance(messages[0], dict) else list(messages)
        tok = self.get_tokenizer()
        prompts = []
        for conv in conversations:
            ids = tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=add_generation_prompt,
                                          chat_template=chat_template, tools=tools, **(chat_template_kwargs or {}))
            if isinstance(ids, dict) or hasattr(ids, "input_ids"):
                ids = ids["input_ids"]
            prompts.append({"prompt_token_ids": list(ids), "prompt": tok.decode(ids)})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    def _run(self, request_ids: list[str], use_tqdm: bool) -> list[RequestOutput]:
        engine = self.llm_engine
        results: dict[str, RequestOutput] = {}
        bar = None
        if use_tqdm and len(request_ids) > 1:
            from tqdm.auto import tqdm
            bar = tqdm(total=len(request_ids), desc="Processed prompts", dynamic_ncols=True,
                       postfix="output: 0 toks/s")
        t0, out_tokens = time.perf_counter(), 0
        try:
            with torch.inference_mode():  # once for all the steps, not entered by each (ModelRunner.execute)
                while engine.has_unfinished_requests():
                    for out in engine.step():
                        if not out.finished:
                            continue
                        results[out.request_id] = out
                        if bar is not None:
                            out_tokens += sum(len(o.token_ids) for o in out.outputs)
                            bar.set_postfix_str(f"output: {out_tokens / (time.perf_counter() - t0):.1f} toks/s",
                                                refresh=False)
                            bar.update(1)
        except BaseException:
            engine.abort_request([r for r in request_ids if r not in results])
            raise
        finally:
            if bar is not None:
                bar.close()
        return [results[r] for r in request_ids]
