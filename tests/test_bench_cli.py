"""`dflash2 bench` and `dflash2 diagnose` end to end on a tiny pair saved to disk."""

import json

import pytest
from typer.testing import CliRunner

from dflash2_mlx.cli import app


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    from tiny import save_tiny_pair

    root = tmp_path_factory.mktemp("pair")
    target, v2 = save_tiny_pair(root, arch="dflash2", block_size=4)
    _, v1 = save_tiny_pair(root, arch="dflash", block_size=4)
    return target, v2, v1


@pytest.fixture()
def runner(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / "cache" / "dflash2"))
    return CliRunner()


def test_bench_json_has_every_field(pair, runner, tmp_path):
    target, v2, v1 = pair
    out = tmp_path / "bench.json"
    res = runner.invoke(app, ["bench", str(target), "--drafter", str(v2), "--drafter-v1", str(v1),
                              "--suite", "gsm8k,humaneval", "--n", "1", "--max-tokens", "12", "--bundled",
                              "--modes", "ar,dflash,dflash2,dflash2@auto", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    assert [m["name"] for m in data["modes"]] == ["ar", "dflash", "dflash2", "dflash2@auto"]
    assert data["modes"][1]["drafter"] == str(v1) and data["modes"][2]["drafter"] == str(v2)
    assert data["settings"]["target"] == str(target) and data["settings"]["n_prompts"] == 2
    assert [s["name"] for s in data["suites"]] == ["gsm8k", "humaneval"]
    assert all("bundled" in s["source"] for s in data["suites"])
    assert len(data["runs"]) == 8
    for run in data["runs"]:
        for key in ("prompt_tps", "ttft_s", "decode_tps", "tau", "cycles", "peak_memory_gb", "loop_period",
                    "matches_ar", "tokens", "text"):
            assert key in run
    overall = data["summary"]["overall"]
    for figures in overall.values():
        for key in ("prompt_tps", "decode_tps", "ttft_s", "tau", "acceptance_by_position", "speedup",
                    "peak_memory_gb", "n_loops"):
            assert key in figures
    assert overall["dflash"]["speedup"] > 0 and len(overall["dflash2"]["acceptance_by_position"]) == 3
    assert "summary_without_loops" in data and "loops" in data
    assert "decode tok/s" in res.output and "P(draft accepted" in res.output  # the tables
    logged = [line for line in res.output.splitlines() if line.startswith("run ")]  # not a terminal: one line a run
    assert len(logged) == 8 and logged[-1].startswith("run 8/8 ")
    assert all("prefill" in line and "decode" in line for line in logged)
    assert any("dflash2 (repeat 0)" in line and "τ" in line for line in logged)


def test_bench_json_to_stdout_and_plain_modes(pair, runner):
    target, v2, _ = pair
    res = runner.invoke(app, ["bench", str(target), "--drafter", str(v2), "--suite", "mtbench", "--n", "1",
                              "--max-tokens", "6", "--bundled", "--no-warmup", "--json", "-"])
    assert res.exit_code == 0, res.output
    data = json.loads(res.stdout[res.stdout.index("{"):])
    # default modes: ar and the drafter it has (no v1 drafter for a local target: skipped with a note)
    assert [m["name"] for m in data["modes"]] == ["ar", "dflash2"]
    assert any("dflash skipped" in n for n in data["notes"])


def test_bench_errors_are_one_line(pair, runner):
    target, v2, _ = pair
    res = runner.invoke(app, ["bench", str(target), "--drafter", str(v2), "--modes", "ar,dflash", "--n", "1"])
    assert res.exit_code == 2 and "needs a dflash drafter; pass --drafter-v1" in res.output
    res = runner.invoke(app, ["bench", str(target), "--suite", "gsm9k"])
    assert res.exit_code == 2 and "unknown suite 'gsm9k'" in res.output
    res = runner.invoke(app, ["bench", str(target), "--modes", "ar,eagle"])
    assert res.exit_code == 2 and "unknown mode 'eagle'" in res.output


def test_bench_calibrate_prints_costs(pair, runner):
    target, v2, _ = pair
    res = runner.invoke(app, ["bench", str(target), "--drafter", str(v2), "--calibrate"])
    assert res.exit_code == 0, res.output
    assert "break-even acceptance" in res.output


def test_diagnose_json(pair, runner, tmp_path):
    target, v2, _ = pair
    out = tmp_path / "diag.json"
    res = runner.invoke(app, ["diagnose", str(target), "--drafter", str(v2), "--suite", "gsm8k", "--n", "1",
                              "--max-tokens", "16", "--bundled", "--json", str(out)])
    assert res.exit_code == 0, res.output
    data = json.loads(out.read_text())
    overall = data["overall"]
    assert overall["n_anchors"] == 16 - 3 and overall["block_positions"] == 3
    assert set(overall["tau"]) == {"actual", "top1", "selector", "oracle"}
    assert "Recall@1" in res.output and "oracle" in res.output
    res = runner.invoke(app, ["diagnose", str(target), "--drafter", "none"])
    assert res.exit_code == 2 and "no drafter" in res.output


def test_bench_context_suites_with_quantized_kv(runner, tmp_path):
    from tiny import save_tiny_pair

    target, v2 = save_tiny_pair(tmp_path / "pair", block_size=4, target_overrides={"head_dim": 32})
    reports = {}
    for kv in ([], ["--kv-bits", "8", "--repeats", "2"]):
        out = tmp_path / f"bench{len(kv)}.json"
        res = runner.invoke(app, ["bench", str(target), "--drafter", str(v2), "--context", "300,600", "--n", "2",
                                  "--max-tokens", "8", "--modes", "mlx_lm,ar,dflash2@4", "--no-warmup",
                                  "--json", str(out), *kv])
        assert res.exit_code == 0, res.output
        assert "KiB per token of context" in res.output
        reports[len(kv)] = json.loads(out.read_text())
    data = reports[4]
    assert [s["name"] for s in data["suites"]] == ["context-300", "context-600"]
    assert data["settings"]["repeats"] == 2 and len(data["runs"]) == 2 * 2 * 3 * 2  # suites x prompts x modes x repeats
    assert [r["repeat"] for r in data["runs"]].count(1) == 12
    assert data["settings"]["kv_bits"] == 8 and data["settings"]["kv_group_size"] == 32
    lengths = {r["suite"]: r["n_prompt_tokens"] for r in data["runs"]}
    assert abs(lengths["context-300"] - 300) <= 4 and abs(lengths["context-600"] - 600) <= 4, lengths
    texts = {r["prompt_id"]: r["n_prompt_tokens"] for r in data["runs"] if r["suite"] == "context-600"}
    assert len(texts) == 2
    # exact under the same quantization; mlx_lm's reference gets the same quantized cache from the first
    # token; a repeat decodes again from each mode's trimmed cache
    assert all(r["matches_ar"] for r in data["runs"] if r["mode"] in ("dflash2@4", "mlx_lm") or r["repeat"])
    full, quantized = (reports[k]["settings"]["kv_cache_bytes_per_token"] for k in (0, 4))
    assert quantized < 0.6 * full, (quantized, full)
    res = runner.invoke(app, ["bench", str(target), "--context", "100"])
    assert res.exit_code == 2 and "--context must be at least 256 tokens, got 100" in res.output
    res = runner.invoke(app, ["bench", str(target), "--context", "4k"])
    assert res.exit_code == 2 and "--context takes token counts like 4096,16384, got '4k'" in res.output
    res = runner.invoke(app, ["bench", str(target), "--repeats", "0"])
    assert res.exit_code == 2 and "--repeats" in res.output


def test_bench_turn_tokens_with_quantized_kv(runner, tmp_path):
    from tiny import save_tiny_pair

    target, v2 = save_tiny_pair(tmp_path / "pair", block_size=4, target_overrides={"head_dim": 32})
    out = tmp_path / "turn.json"
    res = runner.invoke(app, ["bench", str(target), "--drafter", str(v2), "--context", "300", "--n", "1",
                              "--max-tokens", "8", "--modes", "mlx_lm,ar,dflash2@4", "--no-warmup", "--kv-bits", "8",
                              "--turn-tokens", "40", "--json", str(out)])
    assert res.exit_code == 0, res.output
    assert "last 40 tokens after a cached prefix" in res.output
    data = json.loads(out.read_text())
    assert data["settings"]["turn_tokens"] == 40 and len(data["runs"]) == 3
    assert all(r["n_prefilled"] == 40 and r["n_cached"] == r["n_prompt_tokens"] - 40 for r in data["runs"])
    # exact under the same quantization: mlx-lm extends the same prefilled 8-bit caches
    assert all(r["matches_ar"] for r in data["runs"] if r["mode"] != "ar")
    res = runner.invoke(app, ["bench", str(target), "--context", "300", "--n", "1", "--modes", "ar",
                              "--turn-tokens", "5000"])
    assert res.exit_code == 2 and "--turn-tokens 5000 leaves no cached prefix in a" in res.output
