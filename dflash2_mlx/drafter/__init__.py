"""The DFlash / DFlash 2 drafter: config, backbone, convolution, selector, checkpoints."""

from .config import DrafterConfig, parse_config
from .model import Drafter

__all__ = ["DrafterConfig", "Drafter", "parse_config"]
