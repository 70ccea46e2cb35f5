"""Error types. Every user-facing failure is a `DFlashError` with a one-line message
that names the offending values; the CLI prints it and exits with code 2."""


class DFlashError(Exception):
    """Base class for errors a user can fix (bad input, missing files, mismatches)."""


class ConfigError(DFlashError, ValueError):
    """A config file or parameter is malformed or unsupported."""


class WeightsError(DFlashError):
    """A checkpoint is missing tensors, has extra tensors, or has wrong shapes."""


class IncompatibleDrafterError(DFlashError):
    """The drafter does not fit the target (hidden size, layers, vocab, mask id)."""


class UnsupportedCacheError(DFlashError):
    """The target uses a cache kind that cannot be rolled back exactly."""


class ResolveError(DFlashError):
    """A model name could not be resolved to files (unknown alias, offline, missing path)."""


class KernelUnavailableError(DFlashError):
    """A custom kernel was requested explicitly where it cannot run."""
