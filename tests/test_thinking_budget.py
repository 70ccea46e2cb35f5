"""The thinking budget inside speculation: the span closes after exactly `budget` tokens (its end
marker forced), speculative output equals plain decoding under the same budget (greedy), a
sampled reply obeys it on every draw, and a grammar starts where the span closes."""

import json

import numpy as np
import pytest

from dflash2_mlx import SamplingParams, generate
from dflash2_mlx.core.constraint import GrammarConstraint, json_schema_grammar, regex_grammar
from dflash2_mlx.core.interfaces import Constraint
from dflash2_mlx.core.thinking_budget import ThinkingBudget

from tiny import VOCAB, tiny_drafter, tiny_target

PROMPT = [1, 5, 6, 7]
START, END = [30], [40, 41]  # a two-token end marker: the budget must force both, in order
V = 64


def _allowed(row) -> list[int] | str:
    return "all" if row.all() else np.nonzero(row)[0].tolist()


def test_the_walk_forces_the_end_marker_once_the_budget_is_spent():
    budget = ThinkingBudget(START, END, V, budget=2, inside=True)
    assert isinstance(budget, Constraint)
    drafts, rows = budget.walk([3, 4, 5, 6, 7])
    assert drafts == [3, 4, 40, 41, 7]  # greedy: a forbidden draft becomes the forced token
    assert [_allowed(r) for r in rows] == ["all", "all", [40], [41], "all", "all"]
    _, unrepaired = budget.walk([3, 4, 5, 6], repair=False)  # sampled: the verify rejects draft 5
    assert [_allowed(r) for r in unrepaired] == ["all", "all", [40], "all", "all"]
    budget.consume([3, 4])  # the walks above left the state alone; consuming moves it
    assert _allowed(budget.masks([])[0]) == [40]
    budget.consume([40, 41])
    assert (budget.forced, budget.state.inside, budget.done) == (2, False, False)


def test_a_span_the_reply_opens_itself_is_counted_from_its_start_marker():
    budget = ThinkingBudget(START, END, V, budget=1, inside=False)
    drafts, rows = budget.walk([9, 30, 5, 6, 7, 30, 8])
    assert drafts == [9, 30, 5, 40, 41, 30, 8]  # one span only: a later start marker is text
    assert [_allowed(r) for r in rows] == ["all", "all", "all", [40], [41], "all", "all", "all"]


def test_a_model_that_closes_its_span_early_is_left_alone():
    budget = ThinkingBudget(START, END, V, budget=5, inside=True)
    drafts, rows = budget.walk([3, 40, 41, 5, 6, 7, 8])
    assert drafts == [3, 40, 41, 5, 6, 7, 8] and all(r.all() for r in rows)


def test_bad_budgets_and_markers_are_refused_naming_the_value():
    with pytest.raises(ValueError, match="-1"):
        ThinkingBudget(START, END, V, budget=-1, inside=True)
    with pytest.raises(ValueError, match="end marker"):
        ThinkingBudget(START, [], V, budget=3, inside=True)


@pytest.mark.parametrize("family", ["llama", "qwen3_5", "gemma3_text"])
@pytest.mark.parametrize("block", [2, 4])
def test_greedy_speculation_under_a_budget_equals_plain_decoding_under_it(family, block):
    target = tiny_target(family)
    vocab = target.info.vocab_size
    plain = generate(target, PROMPT, max_tokens=24,
                     constraint=ThinkingBudget(START, END, vocab, budget=7, inside=True))
    drafter = tiny_drafter(target, "dflash2", block_size=block)
    spec = generate(target, PROMPT, drafter=drafter, max_tokens=24, block_size=block,
                    constraint=ThinkingBudget(START, END, vocab, budget=7, inside=True))
    assert spec.tokens == plain.tokens
    assert plain.tokens[7:9] == END and END[0] not in plain.tokens[:7]
    assert generate(target, PROMPT, max_tokens=24).tokens[7:9] != END  # the budget did change the output
    assert any(c.n_drafted for c in spec.cycles)


def test_every_sampled_reply_closes_its_span_at_the_budget():
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", block_size=4)
    for seed in range(6):
        out = generate(target, PROMPT, drafter=drafter, max_tokens=16, block_size=4,
                       sampling=SamplingParams(temperature=1.0, seed=seed),
                       constraint=ThinkingBudget(START, END, target.info.vocab_size, budget=5, inside=True))
        head = out.tokens[:7]
        closed = next((i for i in range(len(head) - 1) if head[i : i + 2] == END), None)
        assert closed is not None and closed <= 5, (seed, out.tokens)


@pytest.mark.parametrize("block", [2, 4])
def test_a_grammar_starts_where_the_span_closes(block):
    target = tiny_target("llama", byte_level=True, eos=(2,))
    schema = {"type": "object", "properties": {"a": {"type": "boolean"}}, "required": ["a"],
              "additionalProperties": False}
    grammar = json_schema_grammar(schema, compact=True)

    def constraint():
        inner = GrammarConstraint(target.tokenizer, target.info.vocab_size, target.eos_token_ids, grammar)
        return ThinkingBudget(START, END, target.info.vocab_size, budget=6, inside=True, then=inner)

    plain = generate(target, PROMPT, max_tokens=40, constraint=constraint())
    spec = generate(target, PROMPT, drafter=tiny_drafter(target, "dflash2", block_size=block), max_tokens=40,
                    block_size=block, constraint=constraint())
    assert spec.tokens == plain.tokens and plain.finish_reason == "stop"
    assert plain.tokens[6:8] == END
    answer = target.tokenizer.decode([t for t in plain.tokens[8:] if t != 2])
    assert json.loads(answer) in ({"a": True}, {"a": False})


def test_the_server_wraps_only_where_a_budget_can_bind_or_a_grammar_must_wait():
    from mlx_lm.tokenizer_utils import TokenizerWrapper

    from dflash2_mlx.server.reasoning import thinking_constraint

    from tool_model import tool_tokenizer

    tokenizer = TokenizerWrapper(tool_tokenizer(thinking=True))
    opened, plain = [93, 94], [93]  # the prompt opened the span / the reply may open it
    grammar = GrammarConstraint(tokenizer, VOCAB, {2}, regex_grammar("ok"))
    assert thinking_constraint(tokenizer, plain, V, None, 16) is None  # the fast path is kept
    assert thinking_constraint(tokenizer, plain, V, 16, 16) is None  # a budget that cannot bind
    assert thinking_constraint(tokenizer, plain, V, None, 16, grammar) is grammar
    capped = thinking_constraint(tokenizer, plain, V, 4, 16)
    assert isinstance(capped, ThinkingBudget) and (capped.budget, capped.state.inside) == (4, False)
    waiting = thinking_constraint(tokenizer, opened, V, None, 16, grammar)
    assert (waiting.budget, waiting.state.inside, waiting.then) == (None, True, grammar)
    no_thinking = TokenizerWrapper(tool_tokenizer(thinking=False))
    assert thinking_constraint(no_thinking, opened, V, 4, 16, grammar) is grammar
