"""An import-time stand-in for torch: xgrammar imports it at module level, but its CPU matcher
fills any DLPack array (numpy here). Any attribute is a harmless placeholder."""
import sys
import types


class _Any:
    def __init__(self, *a, **k):
        pass

    def __call__(self, *a, **k):
        return _Any()

    def __getattr__(self, name):
        return _Any()

    def __or__(self, other):
        return _Any()

    __ror__ = __or__

    def __getitem__(self, item):
        return _Any()

    def __mro_entries__(self, bases):
        return (object,)


def __getattr__(name):
    return _Any()


class Tensor:  # for isinstance checks
    pass


__version__ = "0.0.0-stub"
for sub in ("cuda", "nn", "nn.functional", "library", "_dynamo", "compiler", "utils", "utils.dlpack"):
    mod = types.ModuleType(f"torch.{sub}")
    mod.__getattr__ = lambda name: _Any()
    sys.modules[f"torch.{sub}"] = mod
