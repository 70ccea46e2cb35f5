"""Lossless verification: analytic, Monte-Carlo (chi-square, with a power check), greedy."""

import mlx.core as mx
import numpy as np
import pytest
from reference import np_ops
from scipy import stats

from dflash2_mlx.core import verify
from dflash2_mlx.core.verify import dense_q, greedy_accept, one_hot_q, rejection_sample, residual_distribution

rng = np.random.default_rng(1)


def _dist(V, support=None):
    x = rng.gamma(0.7, size=V)
    if support is not None:
        x = np.where(np.isin(np.arange(V), support), x, 0.0)
    return x / x.sum()


def _emitted_first(p, q):
    """Exact distribution of the first emitted token, using verify's own residual."""
    residual = np.array(residual_distribution(mx.array(p[None], dtype=mx.float32),
                                              mx.array(q[None], dtype=mx.float32))[0], dtype=np.float64)
    accept = np.minimum(p, q)
    return accept + (1 - accept.sum()) * residual


EDGE_CASES = {
    "random": lambda V: (_dist(V), _dist(V)),
    "p_equals_q": lambda V: (lambda d: (d, d.copy()))(_dist(V)),
    "disjoint": lambda V: (_dist(V, [0, 1, 2]), _dist(V, [5, 6])),
    "one_hot_p": lambda V: (np.eye(V)[3], _dist(V)),
    "q_zero_where_p_positive": lambda V: (_dist(V), _dist(V, [1, 4])),
    "sparse_q_on_candidates": lambda V: (_dist(V), _dist(V, rng.choice(V, 4, replace=False))),
}


@pytest.mark.parametrize("case", sorted(EDGE_CASES))
def test_emitted_distribution_equals_p(case):
    for _ in range(20):
        p, q = EDGE_CASES[case](11)
        np.testing.assert_allclose(_emitted_first(p, q), p, atol=2e-6)
        np.testing.assert_allclose(np_ops.exact_output_dist(p, q), p, atol=1e-12)


def test_dense_q_scatters_candidates():
    q_rows = mx.array([[0.5, 0.3, 0.2]])
    cands = mx.array([[7, 2, 4]])
    dense = np.array(dense_q(q_rows, cands, 9))
    assert dense[0].tolist() == pytest.approx([0, 0, 0.3, 0, 0.2, 0, 0, 0.5, 0])
    assert np.array(one_hot_q(mx.array([2, 0]), 4)).tolist() == [[0, 0, 1, 0], [1, 0, 0, 0]]


def test_greedy_accept():
    assert greedy_accept([5, 6, 7], [5, 6, 9, 1]) == (2, 9)
    assert greedy_accept([5, 6, 7], [5, 6, 7, 1]) == (3, 1)
    assert greedy_accept([5, 6, 7], [4, 6, 7, 1]) == (0, 4)
    with pytest.raises(ValueError, match="need 4 target rows"):
        greedy_accept([5, 6, 7], [5, 6])


# -- Monte Carlo on the real MLX verifier -----------------------------------------------
# A toy target p(x_t | x_{t-1}) and a toy drafter q(x_t | x_{t-1}) on a vocab of 8. Drafts
# are sampled from q one after another, each conditional on the previous draft, exactly as
# the selector's sampled walk does. The first two emitted tokens must follow p.

V, BLOCK, N_DRAWS, ALPHA = 8, 3, 12000, 1e-4
P_TABLE = np.array([_dist(V) for _ in range(V)])
Q_TABLE = np.array([_dist(V, rng.choice(V, 5, replace=False)) for _ in range(V)])
ANCHOR = 0


def _first_two_tokens(n_draws, seed):
    p_table = mx.array(P_TABLE, dtype=mx.float32)
    q_table = mx.array(Q_TABLE, dtype=mx.float32)
    key = mx.random.key(seed)
    counts = np.zeros((V, V))
    accepted_first = 0
    for _ in range(n_draws):
        emitted, anchor = [], ANCHOR
        while len(emitted) < 2:
            key, k_draft, k_verify = mx.random.split(key, 3)
            u = np.array(mx.random.uniform(shape=(BLOCK - 1,), key=k_draft))
            drafts, prev = [], anchor
            for i in range(BLOCK - 1):
                prev = min(int(np.sum(np.cumsum(Q_TABLE[prev]) <= u[i])), V - 1)
                drafts.append(prev)
            d = mx.array(drafts)
            p = p_table[mx.array([anchor] + drafts)]
            q = q_table[mx.array([anchor] + drafts[:-1])]
            n, nxt = rejection_sample(d, p, q, k_verify)
            n = int(n.item())
            if not emitted:
                accepted_first += n > 0
            emitted += drafts[:n] + [int(nxt.item())]
            anchor = emitted[-1]
        counts[emitted[0], emitted[1]] += 1
    return counts, accepted_first


def _joint_expected():
    return P_TABLE[ANCHOR][:, None] * P_TABLE


def _chi2_pvalue(counts, expected_probs):
    expected = expected_probs.ravel() * counts.sum()
    keep = expected > 0
    assert counts.ravel()[~keep].sum() == 0, "a token with zero target probability was emitted"
    return stats.chisquare(counts.ravel()[keep], expected[keep]).pvalue


@pytest.fixture(scope="module")
def monte_carlo():
    return _first_two_tokens(N_DRAWS, seed=1234)


def test_first_token_and_joint_follow_target(monte_carlo):
    counts, accepted_first = monte_carlo
    assert _chi2_pvalue(counts.sum(1), P_TABLE[ANCHOR]) > ALPHA
    assert _chi2_pvalue(counts, _joint_expected()) > ALPHA
    # First-position acceptance rate is sum_x min(p, q) (within 4 sigma).
    rate = np.minimum(P_TABLE[ANCHOR], Q_TABLE[ANCHOR]).sum()
    sigma = np.sqrt(rate * (1 - rate) / N_DRAWS)
    assert abs(accepted_first / N_DRAWS - rate) < 4 * sigma


def test_power_check_broken_verifier_fails(monkeypatch):
    """Resampling from p instead of the residual is a classic bug; the test must catch it."""
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    counts, _ = _first_two_tokens(N_DRAWS // 2, seed=99)
    assert _chi2_pvalue(counts, _joint_expected()) < ALPHA


# -- End to end: the engine at T > 0 -----------------------------------------------------
# The first three tokens emitted by `generate` (the first from prefill, then one cycle of width
# 2: a draft and the token after it, or a plain step after a rejection) must follow the
# target's exact joint distribution: with a real DFlash 2 drafter (its sampled selector walk gives q), and with a
# drafter whose q overlaps p strongly, which gives the power check its teeth (a random drafter
# overlaps p so little that resampling from p instead of the residual would go unnoticed).

E2E_PROMPT = [1, 40, 41, 42]
E2E_PARAMS = dict(temperature=1.0, top_k=4)


class OverlapDrafter:
    """Proposes from q = uniform over the target's 8 most likely next tokens (computed directly
    from the target after the tokens so far; half of them have p = 0 under top-k 4), returning
    sparse q like DFlash 2. Broken residuals then shift the output by a chi-square
    noncentrality of about 0.035 per draw on the first two tokens (70 at 2000 draws)."""

    def __init__(self, target, prompt):
        from dflash2_mlx.drafter.config import parse_config

        from tiny import drafter_config_dict

        self.config = parse_config(drafter_config_dict("dflash", block_size=3, target_layers=(1,)))
        self.target, self.history, self.last = target, list(prompt), []

    def begin(self, reserve=0):
        from dflash2_mlx.drafter.context import DraftContext

        return DraftContext([], None)

    def draft(self, anchor, context, block_size, temperature=0.0, key=None):
        from dflash2_mlx.drafter.selector import Proposal

        ctx = context.take()
        from dflash2_mlx.core.sampling import SamplingParams, target_probs

        n_rows = ctx.shape[1]
        if self.last is not None and len(self.history) != n_rows:  # not the first call
            self.history += self.last[: n_rows - 1]
        self.history.append(int(anchor[0]))
        tokens, cands, qs, seq = [], [], [], list(self.history)
        for i, k in enumerate(mx.random.split(key, block_size - 1)):
            logits, _ = self.target.forward(mx.array([seq]), self.target.make_cache(), logits="last")
            p = target_probs(logits[0], SamplingParams(**E2E_PARAMS))[0]
            top = mx.argsort(-p)[:8]
            q = mx.full((8,), 1 / 8)
            pick = int(mx.random.categorical(mx.log(q), key=k).item())
            tokens.append(int(top[pick]))
            cands.append(top)
            qs.append(q)
            seq.append(tokens[-1])
        self.last = tokens
        return Proposal(tokens=mx.array([tokens]), candidates=mx.stack(cands)[None], q=mx.stack(qs)[None])


def _engine_first_three(make_drafter, n_draws, seed0, fresh=False):
    """Counts of the first three tokens over `n_draws` seeded generations. A real drafter is
    built once and reused, as a session does (its per-generation state is its DraftContext);
    `fresh` builds one per draw, for drafters that keep state of their own."""
    from dflash2_mlx import SamplingParams, generate

    from tiny import tiny_target

    target = tiny_target("qwen3")
    counts = {}
    shared = None if fresh else make_drafter(target)
    for i in range(n_draws):
        drafter = make_drafter(target) if fresh else shared
        result = generate(target, E2E_PROMPT, drafter=drafter, max_tokens=3, block_size=3,
                          sampling=SamplingParams(seed=seed0 + i, **E2E_PARAMS))
        assert result.cycles[0].n_drafted == 1  # token 2 always comes out of a verify pass
        counts[tuple(result.tokens)] = counts.get(tuple(result.tokens), 0) + 1
    return target, counts


def _exact_joint(target, n=3):
    """{(x1..xn): probability} of the target's own first n tokens, by enumeration."""
    from dflash2_mlx.core.sampling import SamplingParams, target_probs

    sp = SamplingParams(**E2E_PARAMS)
    joint = {(): 1.0}
    for _ in range(n):
        nxt = {}
        for prefix, prob in joint.items():
            logits, _ = target.forward(mx.array([E2E_PROMPT + list(prefix)]), target.make_cache(), logits="last")
            p = np.array(target_probs(logits[0], sp)[0], dtype=np.float64)
            for x in np.nonzero(p)[0]:
                nxt[prefix + (int(x),)] = prob * p[x]
        joint = nxt
    return joint


def _marginal(dist, n):
    out = {}
    for k, v in dist.items():
        out[k[:n]] = out.get(k[:n], 0) + v
    return out


def _e2e_pvalue(counts, joint, n=3):
    """Chi-square p-value of the first n emitted tokens against the exact joint."""
    counts, joint = _marginal(counts, n), _marginal(joint, n)
    assert set(counts) <= set(joint), f"emitted tokens outside the target's support: {set(counts) - set(joint)}"
    keys = sorted(joint)
    observed = np.array([counts.get(k, 0) for k in keys], dtype=np.float64)
    expected = np.array([joint[k] for k in keys])
    return stats.chisquare(observed, expected / expected.sum() * observed.sum()).pvalue


def _real_v2(target):
    from tiny import tiny_drafter

    return tiny_drafter(target, "dflash2", block_size=3, top_k=8)


def _compact_v2(target):
    # Even ids only: the target's top-4 support straddles the subset, so q = 0 on part of it.
    from dflash2_mlx.drafter.vocab import ProposalVocab

    from tiny import VOCAB

    drafter = _real_v2(target)
    drafter.use_proposal_vocab(ProposalVocab(tuple(range(0, VOCAB, 2)), VOCAB, 49, 49))
    return drafter


@pytest.mark.slow
@pytest.mark.parametrize("make_drafter, fresh", [(_real_v2, False), (_compact_v2, False),
                                                 (lambda t: OverlapDrafter(t, E2E_PROMPT), True)],
                         ids=["dflash2", "dflash2-compact-head", "overlap"])
def test_engine_emits_the_target_distribution(make_drafter, fresh):
    target, counts = _engine_first_three(make_drafter, 2000, seed0=0, fresh=fresh)
    joint = _exact_joint(target)
    assert _e2e_pvalue(counts, joint, 2) > ALPHA and _e2e_pvalue(counts, joint, 3) > ALPHA


@pytest.mark.slow
def test_engine_power_check(monkeypatch):
    monkeypatch.setattr(verify, "residual_distribution", lambda p, q: p)
    target, counts = _engine_first_three(lambda t: OverlapDrafter(t, E2E_PROMPT), 2000, seed0=50_000, fresh=True)
    assert _e2e_pvalue(counts, _exact_joint(target), 2) < ALPHA
