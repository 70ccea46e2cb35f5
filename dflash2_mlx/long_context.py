"""Long prompts for `dflash2 bench --context N`: real text that every install has (this
project's own Python sources), cut to about N tokens by the target's tokenizer, followed by a
question about it, as an agent sends a large file and asks about it."""

from __future__ import annotations

from pathlib import Path

from .errors import ConfigError
from .prompts import Prompt, SuitePrompts

QUESTIONS = (
    "Which functions in the code above raise an error, and on what condition? List three.",
    "Summarize what the code above does, module by module, in a few sentences each.",
    "Find one place in the code above that could be simplified and show the simpler version.",
    "Which classes does the code above define? Give each one's purpose in one line.",
)
MIN_CONTEXT = 256


def source_files() -> list[Path]:
    """The package's own modules, in a fixed order."""
    root = Path(__file__).resolve().parent
    return sorted(p for p in root.rglob("*.py") if "__pycache__" not in p.parts)


def document(tokenizer, n_tokens: int, start: int = 0) -> str:
    """About `n_tokens` tokens of source text, files taken in order from the `start`-th on."""
    files = source_files()
    parts, ids = [], []
    for k in range(len(files)):
        path = files[(start + k) % len(files)]
        text = f"# file: {path.name}\n{path.read_text(encoding='utf-8')}\n"
        parts.append(text)
        ids += tokenizer.encode(text, add_special_tokens=False)
        if len(ids) >= n_tokens:
            return tokenizer.decode(ids[:n_tokens])
    raise ConfigError(f"--context {n_tokens}: the package's sources hold only {len(ids)} tokens for this tokenizer")


def context_suite(tokenizer, encode, n_tokens: int, n_prompts: int) -> SuitePrompts:
    """`n_prompts` prompts of about `n_tokens` tokens each as `encode` (Prompt -> ids, the chat
    template) makes them: document + question, each from another file so no two share a prefix."""
    if n_tokens < MIN_CONTEXT:
        raise ConfigError(f"--context must be at least {MIN_CONTEXT} tokens, got {n_tokens}")
    name, n_files = f"context-{n_tokens}", len(source_files())
    prompts = []
    for j in range(n_prompts):
        question = "\n\n" + QUESTIONS[j % len(QUESTIONS)]
        around = len(encode(Prompt(suite=name, id=str(j), text=question)))  # template + question
        body = document(tokenizer, n_tokens - around, start=(j * 7) % n_files)
        prompts.append(Prompt(suite=name, id=str(j), text=body + question))
    return SuitePrompts(name=name, source="package sources", available=len(prompts), prompts=prompts)
