"""`dflash2`: DFlash 2 speculative decoding on MLX.

Each command lives in its own module here and registers itself on the Typer app; modules
import MLX inside command bodies so `dflash2 --help` stays fast. User errors
(`DFlashError`) print one line and exit with code 2.
"""

from __future__ import annotations

import importlib
import importlib.util

import typer

app = typer.Typer(
    name="dflash2",
    help=(
        "DFlash 2 speculative decoding on MLX: the target model's exact output, faster.\n\n"
        "Examples:\n\n"
        "  dflash2 run \"Why is the sky blue?\"          # the built-in demo pair, offline\n\n"
        "  dflash2 run Qwen3.8-27B \"Explain DFlash 2\"   # a registry alias\n\n"
        "  dflash2 serve Qwen3.8-27B --port 8000          # OpenAI + Ollama compatible server\n\n"
        "  dflash2 bench --suite gsm8k --n 8              # measured speedup vs plain decoding"
    ),
    no_args_is_help=True,
    rich_markup_mode="rich",
    pretty_exceptions_enable=False,
)

# Command modules, in --help order; each defines register(app).
COMMANDS = ["run", "models", "download", "convert", "doctor", "serve", "bench", "diagnose", "train"]


def _register() -> None:
    for name in COMMANDS:
        module_name = f"{__name__}.{name}"
        if importlib.util.find_spec(module_name) is not None:
            importlib.import_module(module_name).register(app)


_register()


def main() -> None:
    from .common import prepare_process

    prepare_process()
    app(prog_name="dflash2")
