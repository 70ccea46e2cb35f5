"""Rich progress bars for long work (downloads, conversions), drawn on stderr.

`rich_tqdm(progress)` adapts tqdm-driven code (huggingface_hub's downloads) onto one shared
`rich.progress.Progress`; `bar(...)` is a plain task for our own loops. Both do nothing when
`enabled` is False, so library calls stay quiet for `--json` and tests.
"""

from __future__ import annotations

import contextlib
import sys

from tqdm.std import tqdm as _std_tqdm


def make_progress(transient: bool = False):
    from rich.console import Console
    from rich.progress import (
        BarColumn,
        DownloadColumn,
        MofNCompleteColumn,
        Progress,
        ProgressColumn,
        TextColumn,
        TimeRemainingColumn,
    )

    class AmountColumn(ProgressColumn):
        """Bytes for byte-counting tasks (unit="B"), "m/n" for counting tasks."""

        bytes_column, count_column = DownloadColumn(), MofNCompleteColumn()

        def render(self, task):
            column = self.bytes_column if task.fields.get("unit") == "B" else self.count_column
            return column.render(task)

    return Progress(
        TextColumn("[progress.description]{task.description}"),
        BarColumn(),
        AmountColumn(),
        TimeRemainingColumn(),
        console=Console(file=sys.stderr),
        transient=transient,
    )


def rich_tqdm(progress):
    """A tqdm class whose bars are tasks of `progress` (huggingface_hub's `tqdm_class`)."""

    class RichTqdm(_std_tqdm):
        def __init__(self, *args, **kwargs):
            kwargs = dict(kwargs)
            kwargs.pop("name", None)
            kwargs["gui"] = True  # tqdm draws nothing itself; display() forwards to rich
            kwargs["disable"] = False
            super().__init__(*args, **kwargs)
            # huggingface_hub also reports "reconstruction" bytes; the transfer bar says it all.
            visible = not (self.desc or "").startswith("Reconstruct")
            self._task = progress.add_task(self.desc or "", total=self.total or None, visible=visible,
                                           unit=kwargs.get("unit", "it"))

        def display(self, *_, **__):
            if hasattr(self, "_task"):
                progress.update(self._task, completed=self.n, total=self.total or None, description=self.desc)

        def clear(self, *_, **__):
            pass

        def close(self):
            if self.disable:
                return
            self.display()
            super().close()

    return RichTqdm


@contextlib.contextmanager
def bar(description: str, total: float | None, enabled: bool = True, unit: str = "it"):
    """Yields `advance(n)` for a single rich task (unit "B" shows bytes); a no-op when disabled."""
    if not enabled:
        yield lambda n=1: None
        return
    with make_progress() as progress:
        task = progress.add_task(description, total=total, unit=unit)
        yield lambda n=1: progress.advance(task, n)
