"""llguidance against xgrammar on this CPU: the work the engine asks of a grammar per verify cycle.

For the structured-output benchmark's JSON schema and the demo target's tokenizer (SmolLM2),
both libraries walk the same valid JSON token sequence as speculation does: per cycle of
width W, one mask per row along the W - 1 drafts (fill the bitmask, check the draft's bit,
accept it), then back to the cycle's start (llguidance: the walk ran on a `deep_copy`;
xgrammar: `rollback`), then commit the cycle's tokens. Reported: compile time, µs per mask +
accept on the plain path (W = 1), and ms per speculative cycle at W = 4 and 8.

xgrammar's wheel requires torch and triton (several GB on Linux), which this project does not
ship; its CPU matcher fills any DLPack array, so for this measurement only it is imported with
`torch_stub/` (a placeholder module) on the path and numpy bitmasks:

    pip download --no-deps xgrammar==0.2.9 apache-tvm-ffi -d /tmp/xgw
    mkdir /tmp/xg && (cd /tmp/xg && for w in /tmp/xgw/*.whl; do unzip -qo $w; done)
    PYTHONPATH=/tmp/xg:docs/results/structured/torch_stub .venv/bin/python \\
        docs/results/structured/grammar_libs.py --json docs/results/structured/grammar_libs.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
TEXT = '{"name":"Ada Lovelace","age":36,"city":"London","hobbies":["mathematics","poetry","horses"]}'  # compact JSON


class LLGuidance:
    name = "llguidance"

    def __init__(self, hf, vocab_size, eos):
        import llguidance
        import llguidance.hf
        import llguidance.numpy

        from dflash2_mlx.core.constraint import json_schema_grammar

        t0 = time.perf_counter()
        tok = llguidance.hf.from_tokenizer(hf, n_vocab=vocab_size, eos_token=eos)
        self.matcher = llguidance.LLMatcher(tok, json_schema_grammar(SCHEMA, compact=True), log_level=0)
        self.compile_s = time.perf_counter() - t0
        self.bits = llguidance.numpy.allocate_token_bitmask(1, vocab_size)
        self.fill = llguidance.numpy.fill_next_token_bitmask

    def allowed(self, m, token) -> bool:
        self.fill(m, self.bits)
        return bool((self.bits[0, token // 32] >> (token % 32)) & 1)

    def walk(self, drafts):
        walker = self.matcher.deep_copy()
        for t in drafts:
            if not (self.allowed(walker, t) and walker.consume_token(t)):
                raise RuntimeError(f"llguidance refused token {t}")

    def commit(self, tokens):
        for t in tokens:
            if not self.matcher.consume_token(t):
                raise RuntimeError(f"llguidance refused token {t}")

    def step(self, t):
        if not (self.allowed(self.matcher, t) and self.matcher.consume_token(t)):
            raise RuntimeError(f"llguidance refused token {t}")


class XGrammar:
    name = "xgrammar"

    def __init__(self, hf, vocab_size, eos):
        import xgrammar as xgr

        t0 = time.perf_counter()
        info = xgr.TokenizerInfo.from_huggingface(hf, vocab_size=vocab_size, stop_token_ids=eos)
        compiled = xgr.GrammarCompiler(info).compile_json_schema(json.dumps(SCHEMA), any_whitespace=False,
                                                                 separators=(",", ":"))
        self.matcher = xgr.GrammarMatcher(compiled, max_rollback_tokens=16)
        self.compile_s = time.perf_counter() - t0
        self.bits = np.full((1, (vocab_size + 31) // 32), -1, dtype=np.int32)

    def allowed(self, t) -> bool:
        self.matcher.fill_next_token_bitmask(self.bits)
        return bool((int(self.bits[0, t // 32]) >> (t % 32)) & 1)

    def walk(self, drafts):
        for t in drafts:
            if not (self.allowed(t) and self.matcher.accept_token(t)):
                raise RuntimeError(f"xgrammar refused token {t}")
        self.matcher.rollback(len(drafts))

    def commit(self, tokens):
        for t in tokens:
            if not self.matcher.accept_token(t):
                raise RuntimeError(f"xgrammar refused token {t}")

    def step(self, t):
        if not (self.allowed(t) and self.matcher.accept_token(t)):
            raise RuntimeError(f"xgrammar refused token {t}")


def time_plain(make, tokens, repeats):
    per = []
    for _ in range(repeats):
        lib = make()
        t0 = time.perf_counter()
        for t in tokens:
            lib.step(t)
        per.append((time.perf_counter() - t0) / len(tokens))
    return statistics.median(per)


def time_cycles(make, tokens, width, repeats):
    """Per cycle: the draft walk (width - 1 drafts, all accepted) and the commit of them."""
    per = []
    for _ in range(repeats):
        lib = make()
        n, t0 = 0, time.perf_counter()
        for start in range(0, len(tokens) - width + 1, width - 1):
            drafts = tokens[start : start + width - 1]
            lib.walk(drafts)
            lib.commit(drafts)
            n += 1
        per.append((time.perf_counter() - t0) / n)
    return statistics.median(per)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-demo")
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    from transformers import AutoTokenizer

    from dflash2_mlx import hub

    path = hub.target_dir(args.model)
    hf = AutoTokenizer.from_pretrained(str(path))
    vocab = len(hf)
    eos = [hf.eos_token_id]
    tokens = hf.encode(TEXT, add_special_tokens=False) + eos
    rows = []
    for cls in (LLGuidance, XGrammar):
        make = lambda cls=cls: cls(hf, vocab, eos)  # noqa: E731
        probe = make()
        row = {"library": cls.name, "compile_ms": 1e3 * probe.compile_s, "tokens": len(tokens),
               "us_per_token_plain": 1e6 * time_plain(make, tokens, args.repeats)}
        for w in (4, 8):
            row[f"ms_per_cycle_w{w}"] = 1e3 * time_cycles(make, tokens, w, args.repeats)
        rows.append(row)
    print(f"{'library':12} {'compile ms':>10} {'µs/token plain':>15} {'ms/cycle W=4':>13} {'ms/cycle W=8':>13}")
    for r in rows:
        print(f"{r['library']:12} {r['compile_ms']:>10.1f} {r['us_per_token_plain']:>15.1f} "
              f"{r['ms_per_cycle_w4']:>13.3f} {r['ms_per_cycle_w8']:>13.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"schema": SCHEMA, "text": TEXT, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
