import os
import sys
from pathlib import Path

os.environ.setdefault("MLX_ENABLE_TF32", "0")
os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))

import mlx.core as mx  # noqa: E402

mx.set_default_device(mx.cpu)
