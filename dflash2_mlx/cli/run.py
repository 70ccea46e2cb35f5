"""`dflash2 run`: one-shot generation streamed to the terminal, or an interactive chat."""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated, Optional

import typer

from .common import (
    BlockSizeOpt,
    DraftBitsOpt,
    DrafterOpt,
    DraftVocabOpt,
    JsonOpt,
    KvBitsOpt,
    KvGroupSizeOpt,
    MaxTokensOpt,
    ModelArg,
    SeedOpt,
    ShardOpt,
    TempOpt,
    TopKOpt,
    TopPOpt,
    print_json,
    user_errors,
    warn_slow_blas,
)

EXAMPLES = """
Examples:

  dflash2 run "Why is the sky blue?"                      # demo pair, offline

  dflash2 run Qwen3.8-27B "Prove that sqrt(2) is irrational" --temp 0.7

  dflash2 run ./my-model "Hi" --drafter ./my-drafter --block-size 5 --json

  dflash2 run Qwen3.8-27B                                  # interactive chat on a TTY

  dflash2 run Qwen3.8-27B "Summarize:" --kv-bits 8          # 8-bit K/V for a long prompt
"""


def register(app: typer.Typer) -> None:
    app.command("run", help="Generate text with speculative decoding (or chat when no PROMPT is given)."
                + EXAMPLES)(run)


@user_errors
def run(
    model: ModelArg = None,
    prompt: Annotated[Optional[str], typer.Argument(help="The prompt. Omit on a TTY for a chat.")] = None,
    drafter: DrafterOpt = None,
    max_tokens: MaxTokensOpt = 256,
    temp: TempOpt = 0.0,
    top_p: TopPOpt = 1.0,
    top_k: TopKOpt = 0,
    seed: SeedOpt = None,
    block_size: BlockSizeOpt = None,
    draft_bits: DraftBitsOpt = None,
    draft_vocab: DraftVocabOpt = None,
    kv_bits: KvBitsOpt = None,
    kv_group_size: KvGroupSizeOpt = None,
    shard: ShardOpt = "tensor",
    system: Annotated[Optional[str], typer.Option("--system", help="System prompt for the chat template.")] = None,
    no_chat_template: Annotated[bool, typer.Option("--no-chat-template", help="Feed PROMPT as raw text.")] = False,
    think: Annotated[Optional[bool], typer.Option("--think/--no-think", help="Thinking mode for models that "
                                                                             "have one.")] = None,
    prompt_cache: Annotated[Optional[Path], typer.Option(
        "--prompt-cache", metavar="FILE", help="Start from the caches saved in FILE for the prefix the prompt "
                                               "shares with them (a long system prompt, a document) and save "
                                               "them back after the reply; made when absent.")] = None,
    json_out: JsonOpt = False,
) -> None:
    from .. import hub
    from ..session import Session, render_stats_line, result_to_json

    if prompt is None and model is not None and not hub.looks_like_model(model):
        prompt, model = model, None  # `dflash2 run "a prompt"` uses the default pair
    session = Session.open(model, drafter=drafter, draft_bits=draft_bits, block_size=block_size,
                           progress=not json_out, draft_vocab=draft_vocab, kv_bits=kv_bits,
                           kv_group_size=kv_group_size, shard=shard)
    sampling = session.sampling(temperature=temp, top_p=top_p, top_k=top_k, seed=seed)
    warn_slow_blas()
    ready = session.prepare()
    if ready and not json_out:
        typer.echo(f"note: {ready}", err=True)
    template = dict(system=system, raw=no_chat_template, think=think)
    if session.lockstep is not None:
        return _run_sharded(session, prompt, sampling, max_tokens, template, json_out, prompt_cache)
    cache = _open_cache(session, prompt_cache)
    if prompt is None:
        if json_out or not sys.stdin.isatty():
            prompt = sys.stdin.read()
        else:
            return _chat(session, sampling, max_tokens, template, cache)
    if json_out:
        result = session.generate(prompt, sampling=sampling, max_tokens=max_tokens, prompt_cache=cache, **template)
    else:
        result = session.generate(prompt, sampling=sampling, max_tokens=max_tokens, on_text=_write,
                                  prompt_cache=cache, **template)
    if prompt_cache is not None:
        from ..core.prompt_cache import save_prompt_cache

        save_prompt_cache(prompt_cache, cache)
    if json_out:
        print_json(result_to_json(session, result))
        return
    sys.stdout.write("\n")
    typer.echo(render_stats_line(session, result), err=True)


def _run_sharded(session, prompt, sampling, max_tokens, template, json_out, prompt_cache) -> None:
    """Under `mlx.launch`: every rank decodes in lockstep; rank 0 alone prints."""
    from ..errors import ConfigError
    from ..session import render_stats_line, result_to_json

    if prompt is None:
        raise ConfigError("a target sharded with mlx.launch needs PROMPT on the command line (every rank reads it)")
    if prompt_cache is not None:
        raise ConfigError(f"--prompt-cache {prompt_cache}: a sharded target decodes without a prompt cache")
    lead = session.lockstep.leader
    on_text = _write if lead and not json_out else None
    result = session.generate(prompt, sampling=sampling, max_tokens=max_tokens, on_text=on_text, **template)
    if not lead:
        return
    if json_out:
        print_json(result_to_json(session, result))
        return
    sys.stdout.write("\n")
    typer.echo(render_stats_line(session, result), err=True)


def _open_cache(session, path):
    """The --prompt-cache file's cache (a fresh one when absent), else a fresh one for a chat."""
    if path is not None and path.exists():
        from ..core.prompt_cache import load_prompt_cache

        return load_prompt_cache(path, session.target, session.drafter)
    return session.prompt_cache()


def _write(text: str) -> None:
    sys.stdout.write(text)
    sys.stdout.flush()


def _chat(session, sampling, max_tokens, template, cache) -> None:
    from ..session import render_stats_line

    typer.echo(f"Chatting with {session.describe()}. /reset clears the history, /exit quits.", err=True)
    history: list[dict] = []
    while True:
        try:
            line = input("> ").strip()
        except EOFError:
            break
        if line in ("/exit", "/quit"):
            break
        if line == "/reset":
            history.clear()
            cache.reset()
            typer.echo("(history cleared)", err=True)
            continue
        if not line:
            continue
        history.append({"role": "user", "content": line})
        # the cache keeps the conversation's caches: each turn prefills only the new message
        result = session.generate(history, sampling=sampling, max_tokens=max_tokens, on_text=_write,
                                  prompt_cache=cache, **template)
        sys.stdout.write("\n")
        typer.echo(render_stats_line(session, result), err=True)
        history.append({"role": "assistant", "content": result.text})
