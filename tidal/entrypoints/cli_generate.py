"""`tidal generate` and `tidal chat`: text from the terminal, streamed as the engine produces it.

    tidal generate "The capital of France is" --max-tokens 32 --temperature 0
    tidal generate "Write a haiku about tides" --chat
    tidal chat --system "You are terse."          # /exit or Ctrl-D quits, /reset forgets the history

Both drive LLMEngine directly with output_kind="delta", so each step's new text is printed (and
flushed) the moment it is decoded; stop strings are held back by the engine until they can no
longer match, so a stop string never reaches the terminal. `tidal chat` reads one user turn per
line, from a terminal or a pipe, and keeps the whole conversation in the chat template's prompt.
"""
from __future__ import annotations

import argparse
import dataclasses
import sys
import time

from tidal.entrypoints.engine_args import add_engine_args, engine_config_from_args

EXIT_COMMANDS = ("/exit", "/quit")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int) -> None:
    g = parser.add_argument_group("sampling (the engine's --seed seeds random sampling)")
    g.add_argument("--max-tokens", type=int, default=max_tokens, help="most tokens to generate per reply")
    g.add_argument("--min-tokens", type=int, default=0, help="tokens to generate before EOS or a stop may end")
    g.add_argument("--temperature", type=float, default=0.7, help="0 = greedy")
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--top-k", type=int, default=0, help="0 or -1: disabled")
    g.add_argument("--min-p", type=float, default=0.0)
    g.add_argument("--repetition-penalty", type=float, default=1.0)
    g.add_argument("--presence-penalty", type=float, default=0.0)
    g.add_argument("--frequency-penalty", type=float, default=0.0)
    g.add_argument("--stop", action="append", default=None, metavar="STRING",
                   help="stop string (repeat the flag for several); not printed")
    g.add_argument("--stop-token-ids", type=int, nargs="+", default=None, metavar="ID")
    g.add_argument("--ignore-eos", action="store_true", help="keep generating past the end-of-sequence token")
    g.add_argument("--show-stats", action="store_true",
                   help="after each reply, print tokens, speed and finish reason to stderr")


def sampling_params_from_args(args: argparse.Namespace):
    from tidal.sampling_params import SamplingParams
    return SamplingParams(
        max_tokens=args.max_tokens, min_tokens=args.min_tokens, temperature=args.temperature, top_p=args.top_p,
        top_k=args.top_k, min_p=args.min_p, repetition_penalty=args.repetition_penalty,
        presence_penalty=args.presence_penalty, frequency_penalty=args.frequency_penalty, stop=args.stop,
        stop_token_ids=args.stop_token_ids, ignore_eos=args.ignore_eos, output_kind="delta")


def register(subparsers) -> None:
    p = subparsers.add_parser("generate", help="stream a completion of a prompt to the terminal",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("prompt", nargs="?", default=None, help="the prompt (default: read all of stdin)")
    p.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    p.add_argument("--system", default=None, help="system message (with --chat)")
    add_sampling_args(p, max_tokens=256)
    add_engine_args(p, disable_log_stats=True)
    p.set_defaults(func=run_generate)

    p = subparsers.add_parser("chat", help="interactive multi-turn chat on the model's chat template",
                              description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--system", default=None, help="system message that opens the conversation")
    add_sampling_args(p, max_tokens=512)
    add_engine_args(p, disable_log_stats=True)
    p.set_defaults(func=run_chat)


# -- shared helpers --------------------------------------------------------------------------------

def build_engine(args: argparse.Namespace):
    from tidal.engine.llm_engine import LLMEngine
    return LLMEngine(engine_config_from_args(args))


def chat_prompt(tokenizer, messages: list[dict]) -> dict:
    """The chat template applied to messages, ending with the assistant's turn opened."""
    if tokenizer is None or not getattr(tokenizer, "chat_template", None):
        raise ValueError("this model has no chat template: use `tidal generate` without --chat")
    ids = tokenizer.apply_chat_template(messages, tokenize=True, add_generation_prompt=True)
    if isinstance(ids, dict) or hasattr(ids, "input_ids"):
        ids = ids["input_ids"]
    return {"prompt_token_ids": list(ids)}


@dataclasses.dataclass
class Reply:
    text: str
    num_tokens: int
    finish_reason: str | None
    seconds: float


def stream(engine, prompt, params, out=None) -> Reply:
    """Run one request to the end, writing each new piece of text to out (default: stdout) as soon
    as it exists. params should have output_kind="delta"."""
    import torch  # loaded with the engine already; not at the top, so `--help` stays quick
    out = out if out is not None else sys.stdout
    request_id = engine.next_request_id()
    engine.add_request(request_id, prompt, params)
    pieces, num_tokens, finish_reason = [], 0, None
    t0 = time.perf_counter()
    try:
        with torch.inference_mode():  # once for all the steps (ModelRunner.execute)
            while engine.has_unfinished_requests():
                for output in engine.step():
                    if output.request_id != request_id:
                        continue
                    sample = output.outputs[0]
                    num_tokens += len(sample.token_ids)
                    if sample.text:
                        out.write(sample.text)
                        out.flush()
                        pieces.append(sample.text)
                    if output.finished:
                        finish_reason = sample.finish_reason
    except BaseException:
        engine.abort_request([request_id])  # leave the engine clean (Ctrl-C in chat keeps the session)
        raise
    return Reply("".join(pieces), num_tokens, finish_reason, time.perf_counter() - t0)


def _report(args, reply: Reply) -> None:
    if args.show_stats:
        rate = reply.num_tokens / reply.seconds if reply.seconds > 0 else 0.0
        print(f"[{reply.num_tokens} tokens in {reply.seconds:.2f} s, {rate:.1f} tokens/s, "
              f"finish reason: {reply.finish_reason}]", file=sys.stderr, flush=True)


# -- tidal generate --------------------------------------------------------------------------------

def _user_errors(name: str, run):
    """Bad input (flags, model path, prompt) ends with one clear line and exit status 2, not a traceback."""
    def wrapped(args: argparse.Namespace) -> int:
        try:
            return run(args)
        except ValueError as e:
            print(f"tidal {name}: error: {e}", file=sys.stderr, flush=True)
            return 2
    return wrapped


def _generate(args: argparse.Namespace) -> int:
    if args.system is not None and not args.chat:
        raise ValueError("--system needs --chat (a system message is part of the chat template)")
    params = sampling_params_from_args(args)  # bad values fail here, before the model loads
    text = args.prompt if args.prompt is not None else sys.stdin.read()
    if not text:
        print("error: the prompt is empty", file=sys.stderr)
        return 2
    engine = build_engine(args)
    if args.chat:
        messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
            [{"role": "user", "content": text}]
        prompt = chat_prompt(engine.get_tokenizer(), messages)
    else:
        prompt = text
    try:
        reply = stream(engine, prompt, params)
    except KeyboardInterrupt:
        print(file=sys.stdout, flush=True)
        return 130
    if not reply.text.endswith("\n"):
        print(flush=True)
    _report(args, reply)
    return 0


# -- tidal chat ------------------------------------------------------------------------------------

def _read_turn(interactive: bool) -> str | None:
    """The next user line, or None at end of input."""
    if interactive:
        try:
            return input(">>> ")
        except EOFError:
            print()
            return None
    line = sys.stdin.readline()
    return None if line == "" else line.rstrip("\n")


def _chat(args: argparse.Namespace) -> int:
    params = sampling_params_from_args(args)
    engine = build_engine(args)
    tokenizer = engine.get_tokenizer()
    system = [{"role": "system", "content": args.system}] if args.system else []
    history: list[dict] = []
    interactive = sys.stdin.isatty()
    if interactive:
        print(f"Chatting with {engine.model_name}. /exit or Ctrl-D quits, /reset starts over.", flush=True)
    while True:
        line = _read_turn(interactive)
        if line is None or line.strip() in EXIT_COMMANDS:
            return 0
        if not line.strip():
            continue
        if line.strip() == "/reset":
            history.clear()
            continue
        history.append({"role": "user", "content": line})
        prompt = chat_prompt(tokenizer, system + history)
        # A long conversation outgrows the context: forget the oldest exchanges until the prompt
        # leaves room for at least one reply token.
        while len(prompt["prompt_token_ids"]) >= engine.max_model_len and len(history) > 1:
            del history[:2]
            prompt = chat_prompt(tokenizer, system + history)
        if len(prompt["prompt_token_ids"]) >= engine.max_model_len:
            print(f"error: this message alone is longer than max_model_len ({engine.max_model_len} tokens)",
                  file=sys.stderr, flush=True)
            history.pop()
            continue
        try:
            reply = stream(engine, prompt, params)
        except KeyboardInterrupt:
            print(flush=True)
            history.pop()
            if not interactive:
                return 130
            continue
        except ValueError as e:  # a turn the engine refuses leaves the conversation as it was
            print(f"error: {e}", file=sys.stderr, flush=True)
            history.pop()
            continue
        print(flush=True)
        _report(args, reply)
        history.append({"role": "assistant", "content": reply.text})


run_generate = _user_errors("generate", _generate)
run_chat = _user_errors("chat", _chat)
