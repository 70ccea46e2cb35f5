"""DFlash 2 speculative decoding on MLX.

Public API:
    load_target(path_or_repo) -> Target
    load_drafter(path_or_repo, target) -> Drafter
    stream_generate(target, drafter | None, prompt, **sampling) -> iterator of GenerationEvent
    generate(target, drafter | None, prompt, **sampling) -> GenerationResult
"""

from ._version import __version__
from .drafter.load import load_drafter
from .engine import GenerationEvent, GenerationResult, generate, stream_generate
from .sampling import SamplingParams
from .target import Target, load_target

__all__ = [
    "__version__", "load_target", "load_drafter", "stream_generate", "generate",
    "SamplingParams", "Target", "GenerationEvent", "GenerationResult",
]
