"""Why drafts get rejected: Recall@1 vs Recall@k per block position, the selector's picks, and
the acceptance length (τ) each way of walking the candidates would reach.

Ground truth is the target's own greedy continuation of each prompt. One teacher-forced target
pass gives the hidden states of every position; then every generated position t (every
`stride`-th) is taken as an anchor: the drafter sees the target states before t and the block
`[x_t, MASK...]`, exactly as in decoding after a fully accepted history. Per anchor and block
position i (predicting x_{t+i}):

* Recall@1: the drafter's top-1 is the truth; Recall@k: the truth is among its top k (k = the
  selector's top-k, 16 in published checkpoints);
* selector pick: given the true predecessor x_{t+i-1}, the selector scores the k candidates
  and picks the truth (DFlash 2 only);
* τ of a walk = 1 + the number of leading positions it gets right: top-1 walk (DFlash v1's
  proposal), the selector's greedy walk (DFlash 2's proposal), and the oracle, which picks the
  truth whenever it is among the k (the ceiling of any selector over these candidates).
* τ actual: the engine's own speculative decoding of the same prompt (anchors where cycles
  actually start), with its output checked against the ground truth.

"Recall@1 low, Recall@16 high" means the right token was there but not ranked first: the
selector's job. "Recall@16 low" means the drafter never proposed it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

from .errors import ConfigError
from .prompts import Prompt, SuitePrompts

DEFAULT_TOP_K = 16
DEFAULT_MAX_TOKENS = 128
SCHEMA = "dflash2.diagnose/1"
_EVAL_EVERY = 16  # anchors per evaluation batch (keeps the lazy graph small)


@dataclass
class AnchorRecord:
    """The drafter at one anchor: per block position i = 1..L (lists of length L).

    truth: the target's tokens; top: the drafter's top-k ids (best first);
    walk: the selector's greedy path and pick: its choice given the true predecessor
    (both None for a v1 drafter).
    """

    truth: list[int]
    top: list[list[int]]
    walk: list[int] | None = None
    pick: list[int] | None = None


def accept_length(correct: Sequence[bool]) -> int:
    """Tokens a cycle emits when drafts are accepted up to the first wrong one (bonus included)."""
    n = 0
    while n < len(correct) and correct[n]:
        n += 1
    return n + 1


def _conditional(lengths: list[int], depth: int) -> list[float | None]:
    """P(position i right | positions before it right) from accept lengths."""
    out = []
    for i in range(depth):
        reached = sum(1 for n in lengths if n - 1 >= i)
        out.append(sum(1 for n in lengths if n - 1 > i) / reached if reached else None)
    return out


def position_stats(records: list[AnchorRecord], top_k: int = DEFAULT_TOP_K) -> dict:
    """Per-position Recall@1, Recall@k, selector pick accuracy and the τ of each walk."""
    if not records:
        return {"n_anchors": 0}
    depth = len(records[0].truth)
    has_selector = records[0].walk is not None

    def mean(values):
        values = list(values)
        return sum(values) / len(values) if values else None

    top1 = [[r.top[i][0] == r.truth[i] for i in range(depth)] for r in records]
    in_k = [[r.truth[i] in r.top[i][:top_k] for i in range(depth)] for r in records]
    lengths = {"top1": [accept_length(m) for m in top1], "oracle": [accept_length(m) for m in in_k]}
    out = {
        "n_anchors": len(records), "block_positions": depth, "top_k": top_k,
        "recall_at_1": [mean(m[i] for m in top1) for i in range(depth)],
        "recall_at_k": [mean(m[i] for m in in_k) for i in range(depth)],
        "selector_pick": None, "selector_pick_when_recalled": None,
    }
    if has_selector:
        walk = [[r.walk[i] == r.truth[i] for i in range(depth)] for r in records]
        lengths["selector"] = [accept_length(m) for m in walk]
        out["selector_pick"] = [mean(r.pick[i] == r.truth[i] for r in records) for i in range(depth)]
        out["selector_pick_when_recalled"] = [
            mean(r.pick[i] == r.truth[i] for r, m in zip(records, in_k) if m[i]) for i in range(depth)]
    out["tau"] = {name: mean(ls) for name, ls in lengths.items()}
    out["conditional_acceptance"] = {name: _conditional(ls, depth) for name, ls in lengths.items()}
    return out


# -- collecting anchors (mlx) -----------------------------------------------------------


def target_states(target, ids: list[int], taps: tuple[int, ...], chunk: int = 2048):
    """Tapped target hidden states of every position of `ids`: [1, N, n_taps * H]."""
    import mlx.core as mx

    cache = target.make_cache()
    parts = []
    for start in range(0, len(ids), chunk):
        _, hidden = target.forward(mx.array([ids[start : start + chunk]]), cache, taps, "none")
        mx.eval(hidden)
        parts.append(hidden)
    return mx.concatenate(parts, axis=1) if len(parts) > 1 else parts[0]


def _selector_picks(selector, hidden, candidates, unary, predecessors):
    """The selector's choice among `candidates` given explicit predecessors.

    Shapes: hidden [1, L, H], candidates/unary [1, L, k], predecessors [1, L] -> [1, L] ids.
    """
    import mlx.core as mx

    gate = selector.hidden_projection(hidden).astype(mx.float32)
    pred = selector.predecessor_codebook(predecessors).astype(mx.float32) * gate  # [1, L, r]
    succ = selector.successor_codebook(candidates).astype(mx.float32)  # [1, L, k, r]
    scores = unary + (succ @ pred[..., None])[..., 0]
    best = mx.argmax(scores, axis=-1)
    return mx.take_along_axis(candidates, best[..., None], axis=-1)[..., 0]


def collect_anchors(target, drafter, ids: list[int], n_prompt: int, block_size: int, stride: int = 1,
                    top_k: int | None = None) -> list[AnchorRecord]:
    """Teacher-forced drafter outputs at anchors n_prompt, n_prompt + stride, ... of `ids`.

    `ids` = prompt + ground truth; an anchor needs `block_size - 1` truth tokens after it.
    """
    import mlx.core as mx

    from .drafter.selector import topk_candidates

    L = block_size - 1
    c = drafter.config
    k = min(top_k or (c.selector_top_k if c.is_v2 else DEFAULT_TOP_K), target.info.vocab_size)
    hidden = target_states(target, ids, tuple(c.target_layer_ids))
    anchors = list(range(n_prompt, len(ids) - L, stride))
    cache, fed, pending, records = drafter.make_cache(), 0, [], []
    for n, t in enumerate(anchors):
        block = mx.array([[ids[t]] + [c.mask_token_id] * L])
        h = drafter.hidden_states(block, hidden[:, fed:t], cache)[:, 1:]
        fed = t
        logits = drafter.logits(h)
        candidates, unary = topk_candidates(logits, k)
        outs = [candidates]
        if c.is_v2:
            anchor = mx.array([ids[t]])
            outs.append(drafter.candidate_selector(h, logits, anchor, 0.0).tokens)
            outs.append(_selector_picks(drafter.candidate_selector, h, candidates, unary,
                                        mx.array([ids[t : t + L]])))
        pending.append((t, outs))
        if len(pending) == _EVAL_EVERY or n == len(anchors) - 1:
            mx.eval([o for _, outs_ in pending for o in outs_])
            records += [_record(ids, t, L, outs_) for t, outs_ in pending]
            pending = []
    return records


def _record(ids: list[int], t: int, L: int, outs) -> AnchorRecord:
    top = outs[0][0].tolist()
    walk = outs[1][0].tolist() if len(outs) > 1 else None
    pick = outs[2][0].tolist() if len(outs) > 2 else None
    return AnchorRecord(truth=ids[t + 1 : t + 1 + L], top=top, walk=walk, pick=pick)


# -- the command's library part ---------------------------------------------------------


@dataclass
class PromptDiagnosis:
    suite: str
    prompt_id: str
    n_prompt_tokens: int
    n_truth_tokens: int
    records: list[AnchorRecord]
    actual_cycles: list[list] = field(default_factory=list)  # [width, n_drafted, n_accepted, ...]
    actual_matches_truth: bool | None = None


@dataclass
class DiagnoseReport:
    settings: dict
    suites: list[dict]
    prompts: list[PromptDiagnosis]
    notes: list[str] = field(default_factory=list)

    def stats(self, suite: str | None = None) -> dict:
        chosen = [p for p in self.prompts if suite is None or p.suite == suite]
        out = position_stats([r for p in chosen for r in p.records], self.settings["top_k"])
        from .core import stats
        from .core.events import CycleStats

        cycles = [CycleStats(*c) for p in chosen for c in p.actual_cycles]
        if out.get("n_anchors"):
            out["tau"]["actual"] = stats.tau(cycles, empty=None)
            out["conditional_acceptance"]["actual"] = stats.rates(stats.acceptance_counts(cycles))
        out["n_prompts"] = len(chosen)
        out["actual_mismatches"] = sum(p.actual_matches_truth is False for p in chosen)
        return out

    def to_json(self) -> dict:
        import time

        return {
            "schema": SCHEMA, "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "settings": self.settings,
            "suites": self.suites, "notes": self.notes, "overall": self.stats(),
            "by_suite": {s["name"]: self.stats(s["name"]) for s in self.suites},
            "prompts": [{"suite": p.suite, "prompt_id": p.prompt_id, "n_prompt_tokens": p.n_prompt_tokens,
                         "n_truth_tokens": p.n_truth_tokens, "n_anchors": len(p.records),
                         "actual_cycles": p.actual_cycles, "actual_matches_truth": p.actual_matches_truth}
                        for p in self.prompts],
        }


def diagnose_prompt(target, drafter, prompt: Prompt, ids: list[int], max_tokens: int, block_size: int,
                    stride: int = 1, top_k: int | None = None, actual: bool = True) -> PromptDiagnosis:
    """Ground truth by plain greedy decoding, the teacher-forced anchors, and the real run."""
    from .core.generate import generate

    truth = generate(target, ids, max_tokens=max_tokens).tokens
    records = collect_anchors(target, drafter, ids + truth, len(ids), block_size, stride, top_k)
    out = PromptDiagnosis(prompt.suite, prompt.id, len(ids), len(truth), records)
    if actual:
        run = generate(target, ids, drafter=drafter, max_tokens=max_tokens, block_size=block_size)
        out.actual_cycles = [[c.width, c.n_drafted, c.n_accepted, c.n_emitted, c.draft_s, c.verify_s]
                             for c in run.cycles]
        out.actual_matches_truth = run.tokens == truth
    return out


def run_diagnose(target, drafter, suites: list[SuitePrompts], max_tokens: int = DEFAULT_MAX_TOKENS,
                 block_size: int | None = None, stride: int = 1, top_k: int | None = None,
                 encode: Callable[[Prompt], list[int]] | None = None, actual: bool = True,
                 on_prompt: Callable[[PromptDiagnosis], None] | None = None) -> DiagnoseReport:
    """Diagnose `drafter` on every prompt of `suites` (greedy ground truth from `target`).

    Args:
        block_size: block width (drafts + 1); default the drafter's trained block size.
        stride: take every `stride`-th generated position as an anchor (1 = all).
        top_k: candidates per position for Recall@k and the oracle (default the selector's, or 16).
        actual: also run real speculative decoding for τ actual.
    """
    if drafter is None:
        raise ConfigError("diagnose needs a drafter (pass --drafter)")
    width = block_size or drafter.config.block_size
    if width < 2:
        raise ConfigError(f"block_size must be >= 2, got {width}")
    if stride < 1 or max_tokens < 2:
        raise ConfigError(f"stride must be >= 1 and max_tokens >= 2, got stride={stride} max_tokens={max_tokens}")
    if encode is None:
        from .bench import default_encoder

        encode = default_encoder(target)
    c = drafter.config
    k = min(top_k or (c.selector_top_k if c.is_v2 else DEFAULT_TOP_K), target.info.vocab_size)
    prompts = []
    for s in suites:
        for prompt in s.prompts:
            diag = diagnose_prompt(target, drafter, prompt, encode(prompt), max_tokens, width, stride, k, actual)
            prompts.append(diag)
            if on_prompt is not None:
                on_prompt(diag)
    settings = {"max_tokens": max_tokens, "block_size": width, "stride": stride, "top_k": k,
                "drafter_arch": c.arch, "n_prompts": len(prompts)}
    suites_info = [{"name": s.name, "source": s.source, "n": len(s.prompts)} for s in suites]
    return DiagnoseReport(settings=settings, suites=suites_info, prompts=prompts)
