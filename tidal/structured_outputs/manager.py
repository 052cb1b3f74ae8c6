"""StructuredOutputManager: the engine side of constrained decoding.

- `validate` turns a request's constraint into an xgrammar Grammar before anything is queued (an
  invalid schema is a ValueError naming the field); Grammars are kept by constraint.
- `start` gives each sequence a GrammarState whose CompiledGrammar comes from a cache keyed by the
  constraint: compiled once, on a background thread, never on the engine loop. The scheduler leaves a
  waiting request whose grammar is still compiling in the queue and admits the ones behind it.
- `bitmask` fills, for the scheduled rows that sample and carry a grammar, the allowed-token bitmask
  (int32 words, bit t of word t // 32 = token t allowed) on the host. It travels with the batch to
  wherever the sampler runs (rank 0 under tensor parallelism), so workers need no grammar state.
- `accept` advances each sequence's matcher by its sampled token after the step.

Matchers only move forward with tokens that stay in the output, so preemption (recompute) needs no
rollback, and n > 1 samples each have their own matcher over the shared compiled grammar.
"""
from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor, wait

import torch

from tidal.structured_outputs import backend_xgrammar as backend
from tidal.structured_outputs.params import StructuredOutputsParams

logger = logging.getLogger(__name__)

CACHE_SIZE = 256  # compiled grammars kept (each a few hundred KB for a 49k vocabulary)


class GrammarState:
    """One sequence's grammar: ready once its grammar has compiled; the matcher is made on first use."""

    def __init__(self, future: Future) -> None:
        self.future = future
        self.matcher = None
        self.failed = False

    @property
    def ready(self) -> bool:
        return self.future.done()

    def get_matcher(self):
        if self.matcher is None:
            self.matcher = backend.new_matcher(self.future.result())
        return self.matcher


class StructuredOutputManager:
    def __init__(self, tokenizer, vocab_size: int, stop_token_ids: list[int]) -> None:
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.words = backend.bitmask_words(vocab_size)
        self._compiler = backend.XGrammarCompiler(tokenizer, vocab_size, stop_token_ids) if tokenizer else None
        self._pool: ThreadPoolExecutor | None = None
        self._grammars: OrderedDict[tuple, object] = OrderedDict()
        self._compiled: OrderedDict[tuple, Future] = OrderedDict()
        self._lock = threading.Lock()  # validate runs on server threads, start on the engine thread
        self.num_compiles = 0

    # -- before queueing -------------------------------------------------------------------------
    def validate(self, params: StructuredOutputsParams) -> None:
        if self._compiler is None:
            raise ValueError("structured_outputs needs the model's tokenizer, and this model has none")
        self._grammar(params)

    def _grammar(self, params: StructuredOutputsParams):
        key = params.key()
        with self._lock:
            grammar = self._grammars.get(key)
            if grammar is not None:
                self._grammars.move_to_end(key)
                return grammar
        grammar = backend.build_grammar(params)
        with self._lock:
            self._grammars[key] = grammar
            while len(self._grammars) > CACHE_SIZE:
                self._grammars.popitem(last=False)
        return grammar

    # -- per request -----------------------------------------------------------------------------
    def start(self, params: StructuredOutputsParams) -> GrammarState:
        """A GrammarState for one sequence; compiles the constraint on the background thread unless
        it is already compiled or compiling."""
        key = params.key()
        with self._lock:
            future = self._compiled.get(key)
            if future is not None and not (future.done() and future.exception() is not None):
                self._compiled.move_to_end(key)
                return GrammarState(future)
        grammar = self._grammar(params)
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tidal-grammar")
        future = self._pool.submit(self._compile, grammar)
        with self._lock:
            self._compiled[key] = future
            while len(self._compiled) > CACHE_SIZE:
                self._compiled.popitem(last=False)
        return GrammarState(future)

    def _compile(self, grammar):
        self.num_compiles += 1
        return self._compiler.compile(grammar)

    @staticmethod
    def wait_any(states: list[GrammarState], timeout: float = 1.0) -> None:
        """Block until one of these grammars has compiled (when nothing else can run)."""
        wait([s.future for s in states], timeout=timeout, return_when="FIRST_COMPLETED")

    # -- per step --------------------------------------------------------------------------------
    def bitmask(self, states: list[GrammarState]) -> torch.Tensor:
        """[len(states), words] int32 masks of the next allowed tokens, one row per state."""
        mask = torch.full((len(states), self.words), -1, dtype=torch.int32)
        for i, state in enumerate(states):
            if state.failed:
                continue
            try:
                matcher = state.get_matcher()
            except Exception:  # a compile error validation did not catch: never take the engine down
                logger.exception("a grammar failed to compile; its request's output is not constrained")
                state.failed = True
                continue
            if not matcher.is_terminated():  # past its end (ignore_eos): unconstrained
                matcher.fill_next_token_bitmask(mask, i)
        return mask

    def accept(self, request_id: str, state: GrammarState, token: int) -> None:
        if state.failed:
            return
        matcher = state.get_matcher()
        if matcher.is_terminated():
            return
        if not matcher.accept_token(token):
            # only reachable when something overrode the mask (e.g. min_tokens forbidding the stop
            # token the grammar required): the rest of the sequence is left unconstrained
            logger.warning("request %s: token %d does not fit its grammar; the rest of its output is not "
                           "constrained", request_id, token)
            state.failed = True

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
