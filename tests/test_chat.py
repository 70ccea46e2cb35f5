"""One way from a prompt to token ids: the library, the CLI's Session and the server agree."""

from types import SimpleNamespace

import mlx.core as mx
import numpy as np
import pytest

from dflash2_mlx import generate, stream_generate
from dflash2_mlx.core.chat import encode_prompt
from dflash2_mlx.errors import ConfigError
from dflash2_mlx.session import Session

from tiny import TinyTokenizer, tiny_target

TEMPLATE = ("{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<s>assistant: {% endif %}")


@pytest.fixture(scope="module")
def target():
    target = tiny_target("llama")
    target.tokenizer._tokenizer.chat_template = TEMPLATE
    return target


def test_messages_render_the_chat_template_as_the_session_does(target):
    messages = [{"role": "user", "content": "Hi there"}]
    session = Session(spec=SimpleNamespace(), target=target, drafter=None, block_size=None)
    ids = encode_prompt(target.tokenizer, messages, system="Be brief")
    assert ids == session.encode("Hi there", system="Be brief")
    assert target.tokenizer.decode(ids).startswith("<s>system: Be brief\n<s>user: Hi there\n<s>assistant: ")
    assert generate(target, messages, 6).tokens == session.generate("Hi there", max_tokens=6).tokens


def test_text_is_raw_and_ids_pass_through(target):
    tok = target.tokenizer
    assert encode_prompt(tok, "Hi") == tok.encode("Hi", add_special_tokens=True)
    assert encode_prompt(tok, "<s>Hi") == tok.encode("<s>Hi", add_special_tokens=False)  # one BOS, not two
    ids = [1, 5, 9]
    assert encode_prompt(tok, ids) == encode_prompt(tok, mx.array(ids)) == encode_prompt(tok, np.array(ids)) == ids


def test_no_template_gives_a_transcript():
    tok = TinyTokenizer.make()
    assert tok.decode(encode_prompt(tok, [{"role": "user", "content": "Hi"}])).endswith("user: Hi\nassistant:")


@pytest.mark.parametrize("bad,match", [(3.5, "got float"), ([{"content": "x"}], "no 'role'"),
                                       ([1, "a"], "got list")])
def test_a_bad_prompt_is_one_clear_error(target, bad, match):
    with pytest.raises(ConfigError, match=match):
        encode_prompt(target.tokenizer, bad)


def test_the_old_positional_drafter_is_refused_with_the_new_form(target):
    with pytest.raises(TypeError, match="drafter is a keyword"):
        stream_generate(target, None)
