"""A target sharded over two local ranks (`mlx.launch --backend ring` on loopback): speculative
output equals the sharded target's plain output token for token, every rank emits the same ids,
and partial acceptance (recurrent rollback included) stays exact."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).resolve().parent / "distributed_worker.py"
LAUNCH = shutil.which("mlx.launch") or str(Path(sys.executable).parent / "mlx.launch")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def launch(*args, timeout: int = 240, env: dict | None = None) -> subprocess.CompletedProcess:
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(_free_port()), "--python", sys.executable,
           *map(str, args)]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


# qwen3's mlx-lm `shard` splits q/k/v/o and the MLP exactly as llama's does, so llama stands for
# both (each launch costs ~30 s of ring latency on 2 cores); qwen3_5 adds GatedDeltaNet heads, and
# is the tiny family mlx-lm can also pipeline (rank 1 layers 0-1, rank 0 layers 2-3: the drafter's
# taps come from both stages).
@pytest.mark.parametrize("family, mode", [("llama", "tensor"), ("qwen3_5", "tensor"), ("qwen3_5", "pipeline")])
def test_sharded_speculation_equals_sharded_plain_decoding(family, mode, tmp_path):
    calibrate = family == "qwen3_5" and mode == "tensor"  # one launch measures it (each costs ~30 s)
    proc = launch(WORKER, family, tmp_path, mode, *([tmp_path / "calibration"] if calibrate else []))
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    r0, r1 = (json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1))
    assert r0["info"] == {"size": 2, "rank": 0, "backend": "ring", "mode": mode}
    if mode == "pipeline":  # the same sums in the same order as one process: exact
        assert r0["taps_error"] == 0.0 and r0["plain"] == r0["single"]
    else:  # the heads' partial sums are added across ranks: fp32 rounding
        assert r0["taps_error"] < 1e-3
    for key in ("plain", "spec", "spec_accepted", "partial", "partial_accepted", "seeded", "seeded_plain", "varied",
                "varied_widths"):
        assert r0[key] == r1[key], key  # every rank emits what rank 0 decided
    assert len(r0["plain"]) == 24 and len(set(r0["plain"])) > 5
    assert r0["spec"] == r0["plain"]
    assert r0["partial"] == r0["plain"]
    assert set(r0["partial_accepted"]) == {0, 1, 2, 3}  # every acceptance depth, rolled back on both ranks
    assert r0["seeded"][0] == r0["seeded"][1] and len(r0["seeded"][0]) == 24
    assert r0["seeded"][0] != r0["plain"]  # sampling happened
    assert r0["varied"] == r0["plain"]  # rank 0's policy picked the widths, rank 1 followed each
    assert set(r0["varied_widths"]) == {1, 2, 3, 4}
    if calibrate:  # measured with both ranks in every pass, then cached on rank 0
        assert r0["calibrated"]["max_width"] == 4 and r0["calibrated"]["cached"]
        assert r0["calibrated"]["auto"] == r1["calibrated"]["auto"] == r0["plain"]


def test_dflash2_run_under_mlx_launch_prints_once_and_reports_the_group(tmp_path):
    from tiny import save_tiny_pair

    target, drafter = save_tiny_pair(tmp_path, "qwen3", block_size=4)
    cli = Path(sys.executable).parent / "dflash2"
    args = ["run", target, "--drafter", drafter, "--no-chat-template", "abc", "--max-tokens", "16", "--block-size", "4"]
    proc = launch(cli, *args, "--json")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    sharded = json.loads(proc.stdout[proc.stdout.index("{"):])  # one document: rank 0 alone prints
    assert sharded["distributed"] == {"size": 2, "rank": 0, "backend": "ring", "mode": "tensor"}
    plain = launch(cli, *args[:3], "none", *args[4:], "--json")
    assert plain.returncode == 0, plain.stderr[-3000:]
    assert json.loads(plain.stdout[plain.stdout.index("{"):])["token_ids"] == sharded["token_ids"]
    assert sharded["speculative_cycles"] > 0
    env = {**os.environ, "DFLASH2_HOME": str(tmp_path / "home")}  # a fresh calibration cache
    auto = launch(cli, *args[:-1], "auto", "--json", env=env)
    assert auto.returncode == 0, auto.stdout[-3000:] + auto.stderr[-3000:]
    auto = json.loads(auto.stdout[auto.stdout.index("{"):])
    assert auto["token_ids"] == sharded["token_ids"]
    assert any("block size auto over 2 ranks" in note for note in auto["notes"])
    alone = subprocess.run([str(cli), *map(str, args), "--json"], capture_output=True, text=True, timeout=120)
    assert alone.returncode == 0 and json.loads(alone.stdout)["distributed"] is None


def test_doctor_shows_each_rank_of_the_group(tmp_path):
    cli = Path(sys.executable).parent / "dflash2"
    proc = launch(cli, "doctor", "--json")
    assert proc.returncode == 0, proc.stderr[-3000:]
    docs, text = [], proc.stdout
    decoder = json.JSONDecoder()
    while "{" in text:
        doc, end = decoder.raw_decode(text[text.index("{"):])
        docs.append(doc)
        text = text[text.index("{") + end:]
    ranks = sorted((d["environment"]["distributed"]["rank"], d["environment"]["distributed"]["holds"]) for d in docs)
    assert [r for r, _ in ranks] == [0, 1] and "drafter" in ranks[0][1] and "drafter" not in ranks[1][1]


@pytest.mark.parametrize("family, mode", [("qwen3", "tensor"), ("qwen3_5", "pipeline")])
def test_dflash2_serve_under_mlx_launch_answers_with_both_ranks_and_stops_on_sigterm(tmp_path, family, mode):
    import os
    import signal
    import time
    import urllib.error
    import urllib.request

    from tiny import save_tiny_pair

    target, drafter = save_tiny_pair(tmp_path, family, block_size=4)
    cli = Path(sys.executable).parent / "dflash2"
    port = _free_port()
    cmd = [LAUNCH, "-n", "2", "--backend", "ring", "--starting-port", str(_free_port()), "--python", sys.executable,
           "--", str(cli), "serve", str(target), "--drafter", str(drafter), "--port", str(port), "--block-size", "4",
           "--shard", mode, "--json"]
    log = open(tmp_path / "serve.log", "w+")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        deadline = time.time() + 120
        while '"listening"' not in (tmp_path / "serve.log").read_text():
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-3000:]
            time.sleep(0.5)
        texts = []
        for _ in range(2):  # two requests: the other rank follows each one
            body = json.dumps({"prompt": "abc", "max_tokens": 12, "temperature": 0}).encode()
            req = urllib.request.Request(f"http://127.0.0.1:{port}/v1/completions", body,
                                         {"Content-Type": "application/json"})
            try:
                with urllib.request.urlopen(req, timeout=60) as reply:
                    texts.append(json.loads(reply.read())["choices"][0]["text"])
            except urllib.error.HTTPError as e:
                raise AssertionError(e.read().decode()) from None
        os.kill(_rank_pid(0, str(port)), signal.SIGTERM)  # rank 0 stops gracefully, then tells rank 1
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-3000:]  # the launcher: every rank exited 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    run = launch(cli, "run", target, "--drafter", drafter, "--no-chat-template", "abc", "--max-tokens", "12",
                 "--block-size", "4", "--shard", mode, "--json")
    assert run.returncode == 0, run.stderr[-3000:]
    assert texts == [json.loads(run.stdout[run.stdout.index("{"):])["text"]] * 2
    assert "Traceback" not in (tmp_path / "serve.log").read_text()


def _rank_pid(rank: int, marker: str) -> int:
    """The pid of the python process of `rank` whose command line holds `marker`."""
    for proc in Path("/proc").iterdir():
        try:
            cmdline = (proc / "cmdline").read_bytes().split(b"\0")
            env = (proc / "environ").read_bytes().split(b"\0")
        except (OSError, ValueError):
            continue
        if f"MLX_RANK={rank}".encode() in env and marker.encode() in cmdline and b"serve" in cmdline:
            if any(part.endswith(b"python") or b"python3" in part for part in cmdline[:1]):
                return int(proc.name)
    raise AssertionError(f"no rank {rank} process with {marker!r}")


def test_dflash2_run_pipelined_under_mlx_launch_equals_one_process(tmp_path):
    from tiny import save_tiny_pair

    target, drafter = save_tiny_pair(tmp_path, "qwen3_5", block_size=4)
    cli = Path(sys.executable).parent / "dflash2"
    args = ["run", target, "--drafter", drafter, "--no-chat-template", "abc", "--max-tokens", "16", "--block-size", "4",
            "--json"]
    proc = launch(cli, *args, "--shard", "pipeline")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    piped = json.loads(proc.stdout[proc.stdout.index("{"):])
    assert piped["distributed"] == {"size": 2, "rank": 0, "backend": "ring", "mode": "pipeline"}
    alone = subprocess.run([str(cli), *map(str, args), "--drafter", "none", "--shard", "pipeline"],
                           capture_output=True, text=True, timeout=240)
    assert alone.returncode == 0, alone.stderr[-3000:]
    single = json.loads(alone.stdout)
    assert single["token_ids"] == piped["token_ids"] and single["distributed"] is None
    assert any("--shard pipeline applies under mlx.launch only" in n for n in single["notes"])


def test_a_model_mlx_lm_cannot_pipeline_is_refused_by_name():
    from dflash2_mlx.core.distributed import Lockstep, split_model
    from dflash2_mlx.errors import ConfigError

    from tiny import tiny_model

    refusal = "mlx-lm cannot pipeline a llama model (no pipeline()); use --shard tensor"
    with pytest.raises(ConfigError, match=re.escape(refusal)):
        split_model(tiny_model("llama"), Lockstep(group=None, mode="pipeline"))
    with pytest.raises(ConfigError, match="--shard must be one of tensor, pipeline, got 'rows'"):
        split_model(tiny_model("llama"), Lockstep(group=None, mode="rows"))


def test_a_group_the_heads_cannot_be_split_over_is_refused_by_name():
    from types import SimpleNamespace

    from dflash2_mlx.core.distributed import check_shardable
    from dflash2_mlx.errors import ConfigError

    smollm2 = SimpleNamespace(num_attention_heads=9, num_key_value_heads=3)
    check_shardable(smollm2, 3)
    with pytest.raises(ConfigError, match="its 9 attention heads do not divide by 2 .9 attention heads, 3 KV heads."):
        check_shardable(smollm2, 2)
    hybrid = SimpleNamespace(text_config={"num_attention_heads": 4, "num_key_value_heads": 2})
    check_shardable(hybrid, 2)
    with pytest.raises(ConfigError, match="its 2 KV heads do not divide by 4"):
        check_shardable(SimpleNamespace(text_config={"num_attention_heads": 4, "num_key_value_heads": 2}), 4)
