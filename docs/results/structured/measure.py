"""Structured output under speculation: tok/s and τ with and without a JSON-schema constraint.

Greedy, chat template, the demo pair; modes interleaved per prompt after a warm-up: mlx-lm's
own `stream_generate` (the reference every ratio is to), plain, plain + schema, DFlash 2 at
block WIDTH, DFlash 2 + schema with drafts unmasked and masked. Plain must equal mlx-lm; every constrained
speculative output is checked token for token against constrained plain decoding, and the
grammar's own cost per cycle (mask walk along the drafts) is reported separately.

    python docs/results/structured/measure.py --width 4 --max-tokens 96 --json out.json
(run through `dflash2`'s interpreter with OpenBLAS preloaded on Linux, on a quiet machine)
"""

import argparse
import json
import time

from dflash2_mlx.core.constraint import GrammarConstraint, json_schema_grammar
from dflash2_mlx.core.events import collect
from dflash2_mlx.core.generate import stream_generate
from dflash2_mlx.session import Session

SCHEMA = {"type": "object", "additionalProperties": False, "required": ["name", "age", "city", "hobbies"],
          "properties": {"name": {"type": "string"}, "age": {"type": "integer"}, "city": {"type": "string"},
                         "hobbies": {"type": "array", "items": {"type": "string"}, "maxItems": 4}}}
PROMPTS = [
    "Invent a fictional person and describe them as a JSON object with name, age, city and hobbies.",
    "Create a JSON profile (name, age, city, hobbies) for a retired sailor.",
    "Give me a JSON object describing a young painter: name, age, city, hobbies.",
    "Describe a chess champion as JSON with the fields name, age, city and hobbies.",
    "Write a JSON record for a baker in Lyon with name, age, city and hobbies.",
    "Return JSON (name, age, city, hobbies) for a teenage programmer.",
]


def run_mlx_lm(session, ids, max_tokens):
    """The reference: mlx-lm's own greedy `stream_generate` on the same target and ids."""
    from mlx_lm import stream_generate as mlx_stream
    from mlx_lm.sample_utils import make_sampler

    target = session.target
    t0 = time.perf_counter()
    tokens = [r.token for r in mlx_stream(target.model, target.tokenizer, ids, max_tokens=max_tokens,
                                          sampler=make_sampler(0.0))]
    tokens = tokens[: next((i for i, t in enumerate(tokens) if t in target.eos_token_ids), len(tokens))]  # as ours
    return {"tokens": tokens, "n": len(tokens), "wall_s": time.perf_counter() - t0, "tau": None, "grammar_s": 0.0,
            "cycles": len(tokens), "spec_cycles": 0, "rejections": 0, "forbidden_at": [], "repaired": 0,
            "grammar_ms_per_cycle": 0.0}


def run(session, ids, drafter, width, max_tokens, grammar=None, mask_drafts=True):
    if drafter == "mlx_lm":
        return run_mlx_lm(session, ids, max_tokens)
    target = session.target
    constraint = None if grammar is None else GrammarConstraint(target.tokenizer, target.info.vocab_size,
                                                                target.eos_token_ids, grammar, mask_drafts)
    t0 = time.perf_counter()
    res = collect(stream_generate(target, ids, drafter=drafter, max_tokens=max_tokens, block_size=width if drafter else None,
                                  constraint=constraint))
    wall = time.perf_counter() - t0
    spec = [c for c in res.cycles if c.n_drafted]
    grammar_s = constraint.seconds if constraint else 0.0  # mask walks and commits, plain steps included
    return {"tokens": res.tokens, "n": len(res.tokens), "wall_s": wall, "tau": res.tau if spec else None,
            "grammar_s": grammar_s, "cycles": len(res.cycles), "spec_cycles": len(spec),
            "rejections": sum(c.n_accepted < c.n_drafted for c in spec),
            "forbidden_at": constraint.forbidden_at if constraint else [],
            "repaired": constraint.repaired if constraint else 0,
            "grammar_ms_per_cycle": 1e3 * grammar_s / max(len(res.cycles), 1)}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", default="smollm2-demo")
    ap.add_argument("--width", type=int, default=4)
    ap.add_argument("--max-tokens", type=int, default=96)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    session = Session.open(args.model)
    grammar = json_schema_grammar(SCHEMA)
    w = args.width
    modes = {"mlx_lm": ("mlx_lm",), "plain": (None, None), "plain+schema": (None, grammar), f"dflash2@{w}": (session.drafter, None),
             f"dflash2@{w}+schema, drafts unmasked": (session.drafter, grammar, False),
             f"dflash2@{w}+schema": (session.drafter, grammar)}
    warm = session.encode(PROMPTS[0])
    for mode in modes.values():
        run(session, warm, mode[0], args.width, 16, *mode[1:])
    rows = {m: [] for m in modes}
    for prompt in PROMPTS:
        ids = session.encode(prompt)
        for m, mode in modes.items():
            rows[m].append(run(session, ids, mode[0], args.width, args.max_tokens, *mode[1:]))
        assert rows["mlx_lm"][-1]["tokens"] == rows["plain"][-1]["tokens"], f"plain differs from mlx-lm on {prompt!r}"
        plain = rows["plain+schema"][-1]
        for m in (f"dflash2@{w}+schema", f"dflash2@{w}+schema, drafts unmasked"):
            assert rows[m][-1]["tokens"] == plain["tokens"], f"{m} diverged on {prompt!r}"
        text = session.target.tokenizer.decode([t for t in plain["tokens"] if t not in session.target.eos_token_ids])
        rows["plain+schema"][-1]["valid_json"] = _valid(text)
    base = sum(r["n"] for r in rows["mlx_lm"]) / sum(r["wall_s"] for r in rows["mlx_lm"])
    print("| mode | tok/s | × mlx-lm | τ | grammar ms/cycle | grammar share |")
    print("|---|---|---|---|---|---|")
    summary = {}
    for m, rs in rows.items():
        n, wall = sum(r["n"] for r in rs), sum(r["wall_s"] for r in rs)
        taus = [r["tau"] for r in rs if r["tau"] is not None]
        g = sum(r["grammar_s"] for r in rs)
        summary[m] = {"tok_s": n / wall, "x_mlx_lm": n / wall / base, "tau": sum(taus) / len(taus) if taus else None,
                      "grammar_ms_per_cycle": 1e3 * g / sum(r["cycles"] for r in rs), "grammar_share": g / wall}
        s = summary[m]
        tau = "–" if s["tau"] is None else f"{s['tau']:.2f}"
        print(f"| {m} | {s['tok_s']:.1f} | {s['x_mlx_lm']:.2f} | {tau} | {s['grammar_ms_per_cycle']:.2f} "
              f"| {100 * s['grammar_share']:.1f} % |")
    for m in (f"dflash2@{w}+schema, drafts unmasked", f"dflash2@{w}+schema"):
        _print_forbidden(m, rows[m], summary[m])
    valid = sum(r.get("valid_json", False) for r in rows["plain+schema"])
    print(f"constrained outputs that parse and validate: {valid}/{len(PROMPTS)}; every constrained speculative "
          "output equalled constrained plain decoding")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"args": vars(args), "schema": SCHEMA, "summary": summary,
                       "rows": {m: [{k: v for k, v in r.items() if k != "tokens"} for r in rs] for m, rs in rows.items()}},
                      f, indent=1)


def _print_forbidden(mode: str, rs: list[dict], summary: dict) -> None:
    """How many rejections the grammar caused: drafts it forbids (which masking the drafts
    replaces by the drafter's best allowed candidate, where it has one)."""
    cycles, rejected = sum(r["spec_cycles"] for r in rs), sum(r["rejections"] for r in rs)
    at = [i for r in rs for i in r["forbidden_at"]]
    by_position = {i: at.count(i) for i in sorted(set(at))}
    repaired = sum(r["repaired"] for r in rs)
    summary["forbidden_drafts"] = {"spec_cycles": cycles, "rejections": rejected, "at_forbidden_draft": len(at),
                                   "by_position": by_position, "repaired": repaired}
    print(f"{mode}: {cycles} cycles, {rejected} with a rejection; {len(at)} of them "
          f"({100 * len(at) / max(rejected, 1):.0f} %) at a draft the grammar forbids (by position "
          f"{by_position}); {repaired} drafts replaced by an allowed candidate")


def _valid(text: str) -> bool:
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return False
    return set(obj) == set(SCHEMA["required"]) and isinstance(obj["age"], int)


if __name__ == "__main__":
    main()
