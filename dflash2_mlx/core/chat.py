"""Prompts to token ids, in one place for the library, the CLI and the server.

A prompt is one of:

* chat messages, a list of `{"role": ..., "content": ...}` dicts: rendered by the model's chat
  template with the generation prompt (a model without a template gets a plain transcript, as
  mlx-lm's server does);
* a string: raw text, tokenized as mlx-lm does (BOS added unless the text starts with it);
* token ids, a list of ints or an `mx.array`: used as they are.

`dflash2 run TEXT` (and the server) send `[{"role": "user", "content": TEXT}]`, so
`generate(target, [{"role": "user", "content": TEXT}])` in the library gives the same text.
"""

from __future__ import annotations

from numbers import Integral

from ..errors import ConfigError


def is_messages(prompt) -> bool:
    return isinstance(prompt, (list, tuple)) and bool(prompt) and all(isinstance(m, dict) for m in prompt)


def encode_prompt(tokenizer, prompt, *, system: str | None = None,
                  chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids for a prompt (see the module docstring). `system` is put first in chat messages
    that have no system message; `chat_template_kwargs` are the template's variables (tools,
    enable_thinking, ...)."""
    if isinstance(prompt, str):
        bos = getattr(tokenizer, "bos_token", None)
        return tokenizer.encode(prompt, add_special_tokens=bos is None or not prompt.startswith(bos))
    if is_messages(prompt):
        return _chat_ids(tokenizer, list(prompt), system, chat_template_kwargs or {})
    ids = prompt.tolist() if hasattr(prompt, "tolist") else prompt
    if not isinstance(ids, (list, tuple)) or not all(isinstance(t, Integral) and not isinstance(t, bool) for t in ids):
        raise ConfigError(f"a prompt is text, chat messages or token ids, got {type(prompt).__name__}")
    return [int(t) for t in ids]


def _chat_ids(tokenizer, messages: list[dict], system: str | None, kwargs: dict) -> list[int]:
    for i, m in enumerate(messages):
        if "role" not in m:
            raise ConfigError(f"chat message {i} has no 'role': {m!r}")
    if system and not any(m.get("role") == "system" for m in messages):
        messages.insert(0, {"role": "system", "content": system})
    if not getattr(tokenizer, "chat_template", None):
        text = "\n".join(f"{m['role']}: {m.get('content') or ''}" for m in messages) + "\nassistant:"
        return tokenizer.encode(text)
    return list(tokenizer.apply_chat_template(messages, add_generation_prompt=True, **kwargs))
