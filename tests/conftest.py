import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import mlx.core as mx  # noqa: E402

mx.set_default_device(mx.cpu)


import pytest  # noqa: E402


@pytest.fixture
def isolated(tmp_path, monkeypatch):
    """An empty dflash2 cache and HF cache, and no network."""
    monkeypatch.setenv("DFLASH2_HOME", str(tmp_path / "home"))
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hf"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return tmp_path


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    """A tiny llama target and a tiny DFlash 2 drafter on disk: (target_dir, drafter_dir)."""
    from tiny import save_tiny_pair

    return save_tiny_pair(tmp_path_factory.mktemp("pair"))
