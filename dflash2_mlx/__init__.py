"""DFlash 2 speculative decoding on MLX.

Public API:
    load_target(path_or_repo) -> Target
    load_drafter(path_or_repo, target) -> Drafter
    stream_generate(target, prompt, max_tokens, *, drafter=None, sampling=None, prompt_cache=None, ...)
        -> iterator of GenerationEvent; prompt: chat messages, raw text or token ids (chat.py)
    generate(...) -> GenerationResult (same arguments)
    PromptCache(target, drafter) -> a reusable cache for multi-turn generation
"""

from ._version import __version__

# Lazy exports: importing the package (e.g. for `dflash2 --help`) must not load MLX/mlx-lm.
_EXPORTS = {
    "load_target": ".target", "Target": ".target", "load_drafter": ".hub",
    "stream_generate": ".core.generate", "generate": ".core.generate", "GenerationEvent": ".core.events",
    "GenerationResult": ".core.events", "SamplingParams": ".core.sampling", "PromptCache": ".core.prompt_cache",
}

__all__ = ["__version__", *_EXPORTS]


def __getattr__(name):
    if name in _EXPORTS:
        import importlib

        return getattr(importlib.import_module(_EXPORTS[name], __name__), name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
