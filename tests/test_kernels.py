"""The fused selector kernel (metal/selector_*.metal) against its MLX-ops twin.

Without a Mac the kernel source runs through tests/metal_emu: the exact text MLX would
compile, built with g++ against a Metal shim, each threadgroup's threads as std::threads.
The `metal` tests run the real kernel on Apple Silicon with the same cases.
"""

import shutil
from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from metal_emu import emu
from reference import np_ops

from dflash2_mlx import SamplingParams, generate
from dflash2_mlx.drafter.selector import greedy_walk_ops, lattice_ops, sampled_walk_ops, select
from dflash2_mlx.errors import KernelUnavailableError
from dflash2_mlx.kernels import selector as ksel

from tiny import tiny_drafter, tiny_target

needs_gxx = pytest.mark.skipif(shutil.which("g++") is None,
                               reason="g++ (C++20) not found: the Metal emulation compiles kernels with it")
needs_metal = pytest.mark.skipif(not mx.metal.is_available(),
                                 reason="needs a Metal GPU (Apple Silicon); the emulated kernel covers this "
                                        "source here")
ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    B: int
    L: int
    V: int
    R: int
    temperature: float = 0.0
    dtype: mx.Dtype = mx.float32
    gate_dtype: mx.Dtype | None = None
    K: int = 16
    ties: bool = False
    seed: int = 0

    def __str__(self):
        t = "greedy" if self.temperature <= 0 else f"T{self.temperature}"
        d = str(self.dtype).split(".")[-1]
        return f"B{self.B}-L{self.L}-V{self.V}-r{self.R}-K{self.K}-{t}-{d}" + ("-ties" if self.ties else "")


CASES = [
    Case(1, 4, 1000, 256),
    Case(2, 16, 997, 256, temperature=0.7),
    Case(2, 1, 1000, 256),  # L = 1
    Case(1, 1, 999, 256, temperature=1.3),
    Case(2, 6, 4099, 300),  # r spans two slices, the second partial
    Case(1, 7, 997, 40, temperature=0.5, seed=3),
    Case(1, 8, 2003, 256, dtype=mx.bfloat16),
    Case(2, 8, 1000, 256, temperature=0.8, dtype=mx.bfloat16),
    Case(1, 8, 1000, 256, dtype=mx.float16, seed=5),
    Case(2, 5, 1000, 256, temperature=0.9, dtype=mx.float16),
    Case(1, 6, 1000, 256, dtype=mx.bfloat16, gate_dtype=mx.float32),
    Case(2, 8, 999, 256, ties=True),
    Case(2, 8, 999, 256, temperature=0.6, ties=True),
    Case(1, 5, 997, 256, dtype=mx.bfloat16, ties=True),
    Case(2, 4, 97, 16, temperature=0.7, K=8),
]


def make_inputs(case: Case) -> dict:
    """Random selector inputs; with `ties`, exact dyadic values and duplicated top slots."""
    rng = np.random.default_rng(case.seed)
    B, L, K, V, R = case.B, case.L, case.K, case.V, case.R
    cands = np.stack([np.stack([rng.choice(V, K, replace=False) for _ in range(L)]) for _ in range(B)])
    if case.ties:
        # Multiples of 1/4 and 1/2: every score is exact in any summation order, so the
        # duplicated best slot ties exactly and only the tie-break rule decides.
        A = rng.integers(-2, 3, (V, R)) / 4
        Bc = rng.integers(-2, 3, (V, R)) / 4
        gate = rng.integers(-1, 3, (B, L, R)) / 2
        unary = rng.integers(-8, 8, (B, L, K)) / 2
        lo, hi = np.sort(rng.choice(K, 2, replace=False))
        cands[:, :, hi] = cands[:, :, lo]
        unary[:, :, lo] = unary[:, :, hi] = 40.0
    else:
        # Pair terms (std ~ sqrt(r) / 16) as large as the unary ones: the walk must follow them.
        A = rng.normal(size=(V, R)) * 0.25
        Bc = rng.normal(size=(V, R)) * 0.25
        gate = rng.normal(size=(B, L, R))
        unary = rng.normal(size=(B, L, K))
    return dict(
        candidates=mx.array(cands, dtype=mx.int32), unary=mx.array(unary, dtype=mx.float32),
        gate=mx.array(gate, dtype=case.gate_dtype or case.dtype), pred_codebook=mx.array(A, dtype=case.dtype),
        succ_codebook=mx.array(Bc, dtype=case.dtype), anchor=mx.array(rng.integers(0, V, B), dtype=mx.int32),
        uniforms=mx.array(rng.uniform(size=(B, L)), dtype=mx.float32),
    )


def run_kernel(kernel, case: Case, inputs: dict):
    job = ksel.plan(temperature=case.temperature, **inputs)
    return ksel.launch(job, kernel)


def parity_failures(case: Case, inputs: dict, outputs) -> list[str]:
    """Every way the kernel's (lattice, path, q) differ from the ops twin; empty = parity."""
    lattice, path, q = outputs
    args = {k: v for k, v in inputs.items() if k != "uniforms"}
    ref = lattice_ops(**args)
    failures = []
    err = float(mx.abs(lattice - ref).max())
    if not err <= ATOL:  # also catches NaN (unwritten cells)
        failures.append(f"lattice max abs error {err:.3g} > {ATOL}")
    if case.temperature <= 0:
        ref_path = greedy_walk_ops(ref)
    else:
        ref_path, ref_q = sampled_walk_ops(ref, case.temperature, inputs["uniforms"])
        q_err = float(mx.abs(q - ref_q).max())
        if not q_err <= ATOL:
            failures.append(f"q max abs error {q_err:.3g}")
        sums = float(mx.abs(q.sum(axis=-1) - 1).max())
        if not sums <= ATOL:
            failures.append(f"q rows sum to 1 +- {sums:.3g}")
    if path.tolist() != ref_path.tolist():
        failures.append(f"path {path.tolist()} != ops path {ref_path.tolist()}")
    return failures


def float64_lattice(inputs: dict) -> np.ndarray:
    host = {k: np.array(v.astype(mx.float32) if v.dtype != mx.int32 else v).astype(
        np.float64 if v.dtype != mx.int32 else np.int64) for k, v in inputs.items()}
    return np.stack([np_ops.selector_lattice(host["candidates"][b], host["unary"][b], host["gate"][b],
                                             host["pred_codebook"], host["succ_codebook"], int(host["anchor"][b]))
                     for b in range(host["anchor"].shape[0])])


@pytest.fixture(scope="module")
def emu_kernel():
    return ksel.build(emu.metal_kernel)


# ----------------------------------------------------------------------------- emulated parity

@needs_gxx
@pytest.mark.parametrize("case", CASES, ids=str)
def test_emulated_kernel_matches_ops_twin(emu_kernel, case):
    inputs = make_inputs(case)
    outputs = run_kernel(emu_kernel, case, inputs)
    assert parity_failures(case, inputs, outputs) == []
    lattice = np.array(outputs[0])
    np.testing.assert_allclose(lattice, float64_lattice(inputs), rtol=1e-5, atol=1e-5)
    if case.ties:  # the tie is real: the best score occurs at least twice in every row
        rows = lattice[np.arange(case.B)[:, None], np.arange(case.L)[None], 0]
        assert ((rows == rows.max(-1, keepdims=True)).sum(-1) >= 2).all()


@needs_gxx
def test_select_kernel_has_the_ops_contract(emu_kernel):
    case = Case(2, 5, 1000, 64, temperature=0.7)
    inputs = make_inputs(case)
    idx, q = ksel.select_kernel(temperature=0.7, kernel=emu_kernel, **inputs)
    assert idx.dtype == mx.int32 and idx.shape == (2, 5) and q.dtype == mx.float32 and q.shape == (2, 5, 16)
    greedy_idx, greedy_q = ksel.select_kernel(temperature=0.0, kernel=emu_kernel, **inputs)
    assert greedy_q is None and greedy_idx.tolist() == greedy_walk_ops(
        lattice_ops(**{k: v for k, v in inputs.items() if k != "uniforms"})).tolist()


# Rows whose float32 cdf ends just below 1 (0.99999994) while the last candidate has q = 0.
ZERO_TAIL_ROWS = [[-1.2654215, -0.6232744, 0.041325979, -1e4], [1.4934311, -1.2590655, 1.5139238, -1e4],
                  [0.16100958, -0.58552885, -1.3412197, -1e4], [0.69417197, -0.75836974, 1.420982, -1e4]]


def zero_tail_inputs() -> dict:
    """One-step walks (gate 0, so the lattice row is the unary row) with u = the largest float < 1."""
    B, K = len(ZERO_TAIL_ROWS), 4
    return dict(candidates=mx.arange(B * K, dtype=mx.int32).reshape(B, 1, K),
                unary=mx.array(ZERO_TAIL_ROWS, dtype=mx.float32)[:, None], gate=mx.zeros((B, 1, 8)),
                pred_codebook=mx.ones((B * K, 8)), succ_codebook=mx.ones((B * K, 8)),
                anchor=mx.zeros((B,), dtype=mx.int32),
                uniforms=mx.full((B, 1), float(np.nextafter(np.float32(1), np.float32(0)))))


def assert_picks_have_mass(idx, q, inputs):
    cdf_end = mx.cumsum(q, axis=-1)[..., -1]
    assert bool((cdf_end <= inputs["uniforms"]).any()), "the crafted rows no longer reach the clamp"
    picked = mx.take_along_axis(q, idx[..., None], axis=-1)[..., 0]
    assert bool((picked > 0).all()), f"picked {idx.tolist()} with q {picked.tolist()}"


def test_sampled_walk_ops_never_picks_a_zero_mass_candidate():
    inputs = zero_tail_inputs()
    lattice = lattice_ops(**{k: v for k, v in inputs.items() if k != "uniforms"})
    assert_picks_have_mass(*sampled_walk_ops(lattice, 1.0, inputs["uniforms"]), inputs)


@needs_gxx
def test_emulated_kernel_never_picks_a_zero_mass_candidate(emu_kernel):
    inputs = zero_tail_inputs()
    assert_picks_have_mass(*ksel.select_kernel(temperature=1.0, kernel=emu_kernel, **inputs), inputs)


# Each mutant changes one line of the real source; the parity check must catch every one.
MUTANTS = {
    "tie-break keeps the last maximum": (ksel.HEADER_FILE, "if (row[c] > row[best])", "if (row[c] >= row[best])"),
    "predecessor taken from the same step": (
        ksel.BODY_FILE, "candidates[(bt - 1) * K + row]", "candidates[bt * K + row]"),
    "walk ignores the previous choice": (ksel.BODY_FILE, "row[c] = scores[prev][c];", "row[c] = scores[0][c];"),
    "softmax without normalization": (ksel.HEADER_FILE, "q[c] *= norm;", "q[c] *= 1.0f;"),
}
# Cases from CASES (so the intact kernel is known to pass them): ties, random greedy, sampled.
MUTANT_CASES = [Case(2, 8, 999, 256, ties=True), Case(1, 4, 1000, 256), Case(2, 16, 997, 256, temperature=0.7)]


@needs_gxx
@pytest.mark.parametrize("mutant", sorted(MUTANTS))
def test_parity_check_fails_for_a_broken_kernel_line(emu_kernel, mutant):
    assert set(MUTANT_CASES) <= set(CASES)
    file, old, new = MUTANTS[mutant]
    text = ksel.metal_source(file)
    assert text.count(old) == 1, f"mutation target {old!r} must occur once in {file}"
    mutated = text.replace(old, new)
    broken = ksel.build(emu.metal_kernel, **{"header" if file == ksel.HEADER_FILE else "source": mutated})
    for case in MUTANT_CASES:
        inputs = make_inputs(case)
        if parity_failures(case, inputs, run_kernel(broken, case, inputs)):
            return
    pytest.fail(f"mutant '{mutant}' went unnoticed")


# ----------------------------------------------------------------------------- the drafter, end to end

PROMPT = [1, 40, 41, 42, 7, 19, 33, 60, 61, 5, 8]


@needs_gxx
def test_drafter_proposals_identical_on_emulated_kernel_and_ops(emu_kernel):
    target = tiny_target("qwen3")
    drafter = tiny_drafter(target, "dflash2", top_k=16, rank=32)
    _, hidden = target.forward(mx.array([PROMPT]), target.make_cache(), tuple(drafter.config.target_layer_ids),
                               "none")
    anchor = mx.array([PROMPT[-1]])
    for temperature in (0.0, 0.8):
        key = mx.random.key(11) if temperature > 0 else None
        ops = drafter.draft_from(anchor, hidden, drafter.make_cache(), 8, temperature, key, use_kernel=False)
        before = emu_kernel.launches
        with ksel.routed(emu_kernel):
            ker = drafter.draft_from(anchor, hidden, drafter.make_cache(), 8, temperature, key)
        assert emu_kernel.launches == before + 1
        assert ker.tokens.tolist() == ops.tokens.tolist()
        assert ker.candidates.tolist() == ops.candidates.tolist()
        if temperature > 0:
            np.testing.assert_allclose(np.array(ker.q), np.array(ops.q), atol=ATOL)
        else:
            assert ker.q is None and ops.q is None


@needs_gxx
@pytest.mark.parametrize("sampling", [SamplingParams(), SamplingParams(temperature=0.8, seed=3)],
                         ids=["greedy", "sampled"])
def test_generation_identical_on_emulated_kernel_and_ops(emu_kernel, sampling):
    target = tiny_target("llama")
    drafter = tiny_drafter(target, "dflash2", top_k=16)
    ops = generate(target, PROMPT, drafter=drafter, max_tokens=24, sampling=sampling)
    before = emu_kernel.launches
    with ksel.routed(emu_kernel):
        ker = generate(target, PROMPT, drafter=drafter, max_tokens=24, sampling=sampling)
    assert emu_kernel.launches - before == len(ker.speculative_cycles) > 0
    assert ker.tokens == ops.tokens
    assert [c.n_accepted for c in ker.cycles] == [c.n_accepted for c in ops.cycles]


# ----------------------------------------------------------------------------- bench

@needs_gxx
def test_bench_rows_time_both_paths_when_a_kernel_runs(emu_kernel):
    from dflash2_mlx.kernels import bench

    plain = bench.run(lengths=[2], vocabs=[500], iters=1, warmup=0, progress=False)
    with ksel.routed(emu_kernel):
        routed = bench.run(lengths=[2], vocabs=[500], iters=1, warmup=0, progress=False)
    assert [(r["L"], r["V"], r["walk"]) for r in routed["rows"]] == [(2, 500, "greedy"), (2, 500, "sampled")]
    assert all(r["kernel_ms"] > 0 and r["speedup"] > 0 for r in routed["rows"])
    if not mx.metal.is_available():
        assert not plain["kernel_available"] and "n/a" in plain["note"]
        assert all(r["kernel_ms"] is None and r["ops_ms"] > 0 for r in plain["rows"])


# ----------------------------------------------------------------------------- dispatch

def test_dispatch_follows_parameter_and_environment(monkeypatch, emu_kernel):
    monkeypatch.delenv(ksel.ENV_DISABLE, raising=False)
    with ksel.routed(emu_kernel):
        assert ksel.should_use(None) and ksel.should_use(True)
        assert not ksel.should_use(False)
        assert ksel.status()["selector"] == "kernel"
        monkeypatch.setenv(ksel.ENV_DISABLE, "1")
        assert not ksel.should_use(None) and not ksel.should_use(True)
        assert ksel.status()["selector"] == "ops"
        assert ksel.status()["reason"] == "disabled by DFLASH2_NO_KERNELS=1"


@pytest.mark.skipif(mx.metal.is_available(), reason="checks the behaviour where Metal is missing")
def test_without_metal_the_ops_twin_runs_and_status_says_why(monkeypatch):
    monkeypatch.delenv(ksel.ENV_DISABLE, raising=False)
    assert not ksel.available() and not ksel.should_use(None)
    status = ksel.status()
    assert status["selector"] == "ops" and "no Metal" in status["reason"] and status["sources"]
    with pytest.raises(ksel.KernelUnavailableError, match="use_kernel=True"):
        ksel.should_use(True)


def test_unsupported_inputs_take_the_ops_path(emu_kernel):
    inputs = make_inputs(Case(1, 3, 200, 16, K=4))
    c, g, a, b = (inputs[k] for k in ("candidates", "gate", "pred_codebook", "succ_codebook"))
    assert ksel.fits(c, g, a, b)
    wide = mx.zeros((1, 3, ksel.MAX_K + 1), dtype=mx.int32)
    assert not ksel.fits(wide, g, a, b)
    assert not ksel.fits(c, g.astype(mx.float64), a, b)
    assert not ksel.fits(c, g, a, nn.Embedding(200, 16))
    with pytest.raises(KernelUnavailableError, match=f"{ksel.MAX_K + 1} candidates"):
        ksel.select_kernel(wide, mx.zeros(wide.shape), g, a, b, inputs["anchor"], 0.0, kernel=emu_kernel)
    before = emu_kernel.launches
    with ksel.routed(emu_kernel):  # the kernel counts as available; `select` still takes the ops path
        idx, q = select(wide, mx.zeros(wide.shape), g, a, b, inputs["anchor"], 0.0)
    assert emu_kernel.launches == before and idx.shape == (1, 3) and q is None


def test_shape_mismatch_names_both_shapes():
    inputs = make_inputs(Case(1, 3, 200, 16))
    inputs["gate"] = inputs["gate"][..., :8]
    with pytest.raises(ValueError, match=r"pred_codebook has shape \(16,\), expected \(8,\)"):
        ksel.plan(temperature=0.0, **inputs)


def test_sources_ship_with_a_layout_header():
    for name in (ksel.BODY_FILE, ksel.HEADER_FILE):
        assert ksel.metal_source(name).startswith(f"// {name}:")
    body = ksel.metal_source(ksel.BODY_FILE)
    for word in ("Inputs", "Outputs", "Grid", "threadgroup"):
        assert word in body


def test_generated_signature_follows_mlx_documentation():
    """The emulator writes the source the way MLX's docs show for their `myexp` example."""
    source = ("\n        uint elem = thread_position_in_grid.x;\n        T tmp = inp[elem];"
              "\n        out[elem] = metal::exp(tmp);\n")
    a = mx.zeros((4, 16), dtype=mx.float16)
    name = emu.kernel_name("myexp", [("T", mx.float32)], [a], [mx.float16])
    text = emu.kernel_source(name, "", source, ["inp"], [a], ["out"], [mx.float16], [("T", mx.float32)])
    # docs/src/dev/custom_metal_kernels.rst (mlx 846d176), with the name MLX's code generates
    expected = (
        "template <typename T>\n"
        f"[[kernel]] void {name}(\n"
        "  const device float16_t* inp [[buffer(0)]],\n"
        "  device float16_t* out [[buffer(1)]],\n"
        "  uint3 thread_position_in_grid [[thread_position_in_grid]]) {\n"
        f"{source}\n}}\n\n"
        f'template [[host_name("{name}")]] [[kernel]] decltype({name}<float>) {name}<float>;\n'
    )
    assert name == "custom_kernel_myexp__float_float16_t_float16_t"
    assert text == expected


# ----------------------------------------------------------------------------- real Metal

@pytest.fixture
def on_gpu():
    previous = mx.default_device()
    mx.set_default_device(mx.gpu)
    yield
    mx.set_default_device(previous)


@pytest.mark.metal
@needs_metal
@pytest.mark.parametrize("case", CASES, ids=str)
def test_metal_kernel_matches_ops_twin(on_gpu, case):
    inputs = make_inputs(case)
    outputs = run_kernel(None, case, inputs)
    assert parity_failures(case, inputs, outputs) == []


@pytest.mark.metal
@needs_metal
def test_metal_kernel_never_picks_a_zero_mass_candidate(on_gpu):
    inputs = zero_tail_inputs()
    assert_picks_have_mass(*ksel.select_kernel(temperature=1.0, **inputs), inputs)


@pytest.mark.metal
@needs_metal
def test_metal_selector_dispatch_uses_the_kernel(on_gpu, monkeypatch):
    monkeypatch.delenv(ksel.ENV_DISABLE, raising=False)
    assert ksel.status()["selector"] == "kernel" and ksel.should_use(None)
