"""Grammar constraints inside speculation: greedy output equals constrained plain decoding,
sampled output follows the masked target distribution, and the draft-path walk leaves the
matcher's state alone (llguidance)."""

import json

import mlx.core as mx
import numpy as np
import pytest
from scipy import stats

from dflash2_mlx import SamplingParams, generate
from dflash2_mlx.core.constraint import GrammarConstraint, json_schema_grammar, regex_grammar
from dflash2_mlx.core.sampling import target_probs
from dflash2_mlx.errors import ConfigError

from tiny import tiny_drafter, tiny_target

pytest.importorskip("llguidance")

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "string"}},
          "required": ["a", "b"]}
PROMPT = [1, 5, 6, 7]


def _constraint(target, grammar):
    return GrammarConstraint(target.tokenizer, target.info.vocab_size, target.eos_token_ids, grammar)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
@pytest.mark.parametrize("block", [2, 4])
def test_greedy_constrained_speculation_equals_constrained_plain_decoding(family, block):
    target = tiny_target(family, byte_level=True)
    grammar = json_schema_grammar(SCHEMA)
    plain = generate(target, PROMPT, max_tokens=40, constraint=_constraint(target, grammar))
    drafter = tiny_drafter(target, "dflash2", block_size=block)
    spec = generate(target, PROMPT, drafter=drafter, max_tokens=40, block_size=block,
                    constraint=_constraint(target, grammar))
    assert spec.tokens == plain.tokens
    unconstrained = generate(target, PROMPT, max_tokens=40).tokens
    assert unconstrained != plain.tokens  # the grammar did change the output
    check = _constraint(target, grammar)
    check.consume(plain.tokens)  # raises if any emitted token broke the grammar
    assert any(c.n_drafted for c in spec.cycles) and any(c.grammar_s > 0 for c in spec.cycles)


def test_a_completed_grammar_ends_generation_with_valid_json():
    target = tiny_target("llama", byte_level=True, eos=(2,))
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    grammar = json_schema_grammar(schema, compact=True)
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    out = generate(target, PROMPT, drafter=drafter, max_tokens=30, block_size=4,
                   constraint=_constraint(target, grammar))
    text = target.tokenizer.decode([t for t in out.tokens if t != 2])
    assert json.loads(text) in ({"a": True}, {"a": False})
    assert out.finish_reason == "stop" and len(out.tokens) < 30


def test_masks_walk_the_draft_path_and_roll_back():
    target = tiny_target("llama", byte_level=True)
    tok = target.tokenizer
    c = _constraint(target, regex_grammar("ab+c"))
    a, b, c_id, x = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    rows = c.masks([a, b, x, b])
    assert rows.shape == (5, target.info.vocab_size)
    assert np.nonzero(rows[0])[0].tolist() == [a]
    assert sorted(np.nonzero(rows[1])[0].tolist()) == [b]
    assert sorted(np.nonzero(rows[2])[0].tolist()) == sorted([b, c_id])
    assert rows[3].all() and rows[4].all()  # past the forbidden draft x: never used
    assert np.nonzero(c.masks([])[0])[0].tolist() == [a]  # rolled back to the start
    assert (c.walks, c.forbidden_at) == (1, [2])  # the walk above met x at position 2
    c.masks([a, b, b])
    assert (c.walks, c.forbidden_at) == (2, [2])  # an allowed path counts no forbidden draft
    c.consume([a, b])
    assert sorted(np.nonzero(c.masks([])[0])[0].tolist()) == sorted([b, c_id])


def test_the_walk_replaces_forbidden_drafts_by_the_best_allowed_candidate():
    target = tiny_target("llama", byte_level=True)
    tok = target.tokenizer
    c = _constraint(target, regex_grammar("ab+c"))
    a, b, c_id, x = (tok.encode(ch, add_special_tokens=False)[0] for ch in "abcx")
    out, rows = c.walk([a, x, x], lambda: [[a], [x, c_id, b], [x, b]])
    assert out == [a, b, b]  # c is not allowed after a: b is
    assert (rows == c.masks([a, b, b])).all()  # the masks of the repaired path, walked once
    assert c.walk([a, x, b], lambda: [[a], [x], [b]])[0] == [a, x, b]  # no allowed candidate: left for the verify
    assert c.walk([x, b], lambda: [[b, a], [b]])[0] == [a, b] and c.repaired == 3  # 2 above, 1 here
    asked = []
    assert c.walk([a, b], lambda: asked.append(1))[0] == [a, b] and not asked  # nothing forbidden: never asked
    assert np.nonzero(c.masks([])[0])[0].tolist() == [a]  # the matcher itself did not move


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
def test_masked_drafts_change_acceptance_not_output(arch):
    target = tiny_target("llama", byte_level=True)
    grammar = json_schema_grammar(SCHEMA)
    drafter = tiny_drafter(target, arch, block_size=4)
    runs = {}
    for mask in (False, True):
        constraint = GrammarConstraint(target.tokenizer, target.info.vocab_size, target.eos_token_ids, grammar,
                                       mask_drafts=mask)
        runs[mask] = (generate(target, PROMPT, drafter=drafter, max_tokens=40, block_size=4, constraint=constraint),
                      constraint)
    assert runs[True][0].tokens == runs[False][0].tokens
    assert runs[True][1].repaired > 0 and runs[False][1].repaired == 0
    assert len(runs[True][1].forbidden_at) < len(runs[False][1].forbidden_at)


def test_invalid_schemas_are_config_errors():
    with pytest.raises(ConfigError, match="invalid JSON schema"):
        json_schema_grammar({"type": "object", "properties": {"a": {"type": "nonsense"}}})
    with pytest.raises(ConfigError, match="invalid regex"):
        regex_grammar("a(b")


# -- T > 0: the first three tokens follow the grammar-masked target ----------------------------

PATTERN = "[a-h]{3}[a-z]*"
PARAMS = dict(temperature=1.0, top_k=4)


def _masked_joint(target, n=3):
    joint = {(): 1.0}
    c = _constraint(target, regex_grammar(PATTERN))
    for _ in range(n):
        nxt = {}
        for prefix, prob in joint.items():
            logits, _ = target.forward(mx.array([PROMPT + list(prefix)]), target.make_cache(), logits="last")
            c.consume(list(prefix))
            rows = c.apply(logits[0], [])
            c.matcher.rollback(len(prefix))
            p = np.array(target_probs(rows, SamplingParams(**PARAMS))[0], dtype=np.float64)
            for x in np.nonzero(p)[0]:
                nxt[prefix + (int(x),)] = prob * p[x]
        joint = nxt
    return joint


def _pvalue(counts, joint):
    assert set(counts) <= set(joint), f"tokens outside the masked support: {set(counts) - set(joint)}"
    keys = sorted(joint)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([joint[k] for k in keys])
    return stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue


@pytest.mark.slow
def test_sampled_constrained_speculation_follows_the_masked_target():
    target = tiny_target("qwen3", byte_level=True)
    drafter = tiny_drafter(target, "dflash2", block_size=3, top_k=8)
    grammar = regex_grammar(PATTERN)
    counts = {}
    for i in range(1500):
        out = generate(target, PROMPT, drafter=drafter, max_tokens=3, block_size=3,
                       sampling=SamplingParams(seed=i, **PARAMS), constraint=_constraint(target, grammar))
        assert out.cycles[0].n_drafted == 1
        counts[tuple(out.tokens)] = counts.get(tuple(out.tokens), 0) + 1
    assert _pvalue(counts, _masked_joint(target)) > 1e-4


@pytest.mark.slow
def test_power_check_unmasked_verify_rows_are_caught(monkeypatch):
    """Masking only the first verify row (the classic bug: the grammar state is not walked
    along the drafts) lets forbidden drafts through; the support check must see them."""
    real = GrammarConstraint.masks

    def first_row_only(self, drafts):
        rows = real(self, drafts)
        rows[1:] = True
        return rows

    monkeypatch.setattr(GrammarConstraint, "masks", first_row_only)
    target = tiny_target("qwen3", byte_level=True)
    drafter = tiny_drafter(target, "dflash2", block_size=3, top_k=8)
    grammar = regex_grammar(PATTERN)
    joint = _masked_joint(target)
    outside = 0
    for i in range(300):
        try:
            out = generate(target, PROMPT, drafter=drafter, max_tokens=3, block_size=3,
                           sampling=SamplingParams(seed=i, **PARAMS), constraint=_constraint(target, grammar))
        except RuntimeError:  # the commit noticed the broken grammar state
            outside += 1
            continue
        outside += tuple(out.tokens) not in joint
    assert outside > 0


def test_digit_runs_are_capped_so_a_number_always_ends():
    target = tiny_target("llama", byte_level=True)
    tok, V = target.tokenizer, target.info.vocab_size
    grammar = json_schema_grammar({"type": "object", "properties": {"x": {"type": "number"}}, "required": ["x"]})
    capped = GrammarConstraint(tok, V, target.eos_token_ids, grammar, digit_cap=5)
    free = _constraint(target, grammar)
    for c in (capped, free):
        c.consume(tok.encode('{"x": 12345', add_special_tokens=False))
    digit = tok.encode("7", add_special_tokens=False)[0]
    comma_or_close = [tok.encode(ch, add_special_tokens=False)[0] for ch in "}."]
    assert free.masks([])[0][digit] and not capped.masks([])[0][digit]
    assert all(capped.masks([])[0][t] for t in comma_or_close)
    after_dot = GrammarConstraint(tok, V, target.eos_token_ids, grammar, digit_cap=5)
    after_dot.consume(tok.encode('{"x": 12345.', add_special_tokens=False))  # a new run starts after "."
    assert after_dot.masks([])[0][digit]
    # along a draft path the run is counted too, and speculation still equals plain decoding
    _, rows = capped.walk([tok.encode(".", add_special_tokens=False)[0]] + [digit] * 6)
    assert rows[5][digit] and not rows[6][digit]
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    plain = generate(target, PROMPT, max_tokens=40,
                     constraint=GrammarConstraint(tok, V, target.eos_token_ids, grammar, digit_cap=3))
    spec = generate(target, PROMPT, drafter=drafter, max_tokens=40, block_size=4,
                    constraint=GrammarConstraint(tok, V, target.eos_token_ids, grammar, digit_cap=3))
    assert spec.tokens == plain.tokens
