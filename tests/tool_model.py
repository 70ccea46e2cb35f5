"""A tiny target that answers every chat prompt with one tool call, for end-to-end tool tests
(and, with `thinking=True`, one that thinks first, for the reasoning split).

A real mlx-lm llama model whose weights are set by hand: its layers add nothing (o_proj and
down_proj are zero), embeddings are one-hot, and the head maps each token to a fixed successor.
After the generation prompt's last token it writes `<tool_call>`, the call's JSON (one added
token), `</tool_call>`, then EOS. The chat template renders tools, tool calls and tool results
in the Qwen style mlx-lm infers the `json_tools` parser from. A random drafter of the same
width goes with it, so speculation runs (and rejects) for real.

The thinking variant adds `<think>` / `</think>` (so mlx-lm sees a thinking mode) and a template
with `enable_thinking` that, when thinking is off, closes an empty thinking block in the prompt
(as Qwen3's does). After the generation prompt it writes `<think>hm</think>ok` then EOS.
"""

from __future__ import annotations

import json
from pathlib import Path

import mlx.core as mx
import numpy as np
from mlx.utils import tree_flatten, tree_unflatten

from tiny import VOCAB, TinyTokenizer

HIDDEN = 128  # >= the vocab, so embeddings can be one-hot and the successor map exact
CALL = {"name": "weather", "arguments": {"city": "Paris"}}  # "_" is not in the tiny vocab
CALL_TEXT = json.dumps(CALL)
SPECIAL = {90: "<tool_call>", 91: "</tool_call>", 92: CALL_TEXT, 93: "<|assistant|>"}
EOS = 2
NL = "{{ '\\n' }}"  # HF renders templates with trim_blocks, which eats a newline after a tag
TEMPLATE = (
    "{% if tools %}Tools:{% for t in tools %} {{ t.function.name }}{% endfor %}" + NL + "{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'assistant' %}<|assistant|>{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}{% set tool_call = tc.function %}"
    "<tool_call>{\"name\": \"{{ tool_call.name }}\", \"arguments\": {{ tool_call.arguments | tojson }}}</tool_call>"
    "{% endfor %}" + NL +
    "{% elif m.role == 'tool' %}Result: {{ m.content }}" + NL +
    "{% else %}{{ m.role }}: {{ m.content }}" + NL + "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>{% endif %}"
)
CONFIG = dict(model_type="llama", vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=128, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
              max_position_embeddings=4096, tie_word_embeddings=False, rope_theta=10000.0)


THINK = {94: "<think>", 95: "</think>"}
THINK_TEMPLATE = TEMPLATE.replace(
    "{% if add_generation_prompt %}<|assistant|>{% endif %}",
    "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and not enable_thinking %}"
    "<think></think>{% endif %}{% endif %}")
THOUGHT, ANSWER = "hm", "ok"


def successor(token: int, chain: dict | None = None) -> int:
    return (chain or {93: 90, 90: 92, 92: 91}).get(token, EOS)


def _think_chain(tokenizer) -> dict:
    """<|assistant|> -> <think> -> h -> m -> </think> -> o -> k -> EOS."""
    vocab = tokenizer.get_vocab()
    seq = [93, 94, *(vocab[c] for c in THOUGHT), 95, *(vocab[c] for c in ANSWER)]
    return dict(zip(seq, seq[1:]))


def tool_tokenizer(thinking: bool = False):
    """The byte-level tiny tokenizer (grammar libraries read it) with the call's tokens added."""
    fast = TinyTokenizer.make(byte_level=True, added={**SPECIAL, **(THINK if thinking else {})}, wrap=False)
    fast.chat_template = THINK_TEMPLATE if thinking else TEMPLATE
    return fast


def tool_model(chain: dict | None = None):
    from mlx_lm.models import llama

    model = llama.Model(llama.ModelArgs.from_dict(CONFIG))
    params = dict(tree_flatten(model.parameters()))
    rng = np.random.default_rng(0)
    for name, p in params.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            params[name] = mx.zeros_like(p)
        elif name.endswith("norm.weight"):
            params[name] = mx.ones_like(p)
        else:
            params[name] = mx.array(rng.normal(0, 0.05, p.shape).astype(np.float32))
    params["model.embed_tokens.weight"] = mx.array(np.eye(VOCAB, HIDDEN, dtype=np.float32))
    head = np.zeros((VOCAB, HIDDEN), np.float32)
    for v in range(VOCAB):
        head[successor(v, chain), v] = 2.0  # logit 2·sqrt(HIDDEN) ≈ 22.6 for the successor, 0 elsewhere
    params["lm_head.weight"] = mx.array(head)
    model.update(tree_unflatten(list(params.items())))
    mx.eval(model.parameters())
    return model


def save_tool_pair(root, thinking: bool = False) -> tuple[Path, Path]:
    """(target_dir, drafter_dir) for `dflash2 serve`; `thinking`: the model that thinks first."""
    from mlx_lm.utils import save_model

    from dflash2_mlx.drafter.config import parse_config
    from dflash2_mlx.drafter.load import save_drafter
    from dflash2_mlx.drafter.model import Drafter

    from tiny import drafter_config_dict

    root = Path(root)
    target_dir, drafter_dir = root / "tool-target", root / "tool-drafter"
    target_dir.mkdir(parents=True, exist_ok=True)
    tokenizer = tool_tokenizer(thinking)
    save_model(target_dir, tool_model(_think_chain(tokenizer) if thinking else None))
    (target_dir / "config.json").write_text(json.dumps(CONFIG))
    tokenizer.save_pretrained(str(target_dir))
    cfg = drafter_config_dict("dflash2", block_size=4)
    cfg.update(hidden_size=HIDDEN, head_dim=32)
    mx.random.seed(1)  # the same drafter whatever ran before in this process
    drafter = Drafter(parse_config(cfg))
    mx.eval(drafter.parameters())
    save_drafter(drafter, drafter_dir)
    return target_dir, drafter_dir
