"""Logprob `bytes` are a token's own bytes, also for a token that holds part of a character."""

from mlx_lm.tokenizer_utils import BPEStreamingDetokenizer, SPMStreamingDetokenizer, TokenizerWrapper, _byte_decoder
from tokenizers import Tokenizer, decoders, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from dflash2_mlx.server.openai_api import token_bytes


def _wrap(tok: Tokenizer, detokenizer) -> TokenizerWrapper:
    hf = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    return TokenizerWrapper(hf, detokenizer_class=detokenizer)


def test_byte_level_pieces_give_their_bytes():
    to_char = {b: c for c, b in _byte_decoder().items()}
    e_acute = "é".encode()  # two bytes, two tokens
    vocab = {"<unk>": 0, "a": 1, to_char[e_acute[0]]: 2, to_char[e_acute[1]]: 3, to_char[32] + "b": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    wrapper = _wrap(tok, BPEStreamingDetokenizer)
    assert wrapper.decode([2]) == "\ufffd"  # the text alone has lost the byte
    assert token_bytes(wrapper, 2) == e_acute[:1] and token_bytes(wrapper, 3) == e_acute[1:]
    assert token_bytes(wrapper, 2) + token_bytes(wrapper, 3) == e_acute
    assert token_bytes(wrapper, 4) == b" b" and token_bytes(wrapper, 1) == b"a"


def test_sentencepiece_byte_fallback_pieces_give_their_bytes():
    vocab = {"<unk>": 0, "\u2581hi": 1, "<0xE2>": 2, "<0x82>": 3, "<0xAC>": 4}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse()])
    wrapper = _wrap(tok, SPMStreamingDetokenizer)
    assert b"".join(token_bytes(wrapper, t) for t in (2, 3, 4)) == "€".encode()
    assert token_bytes(wrapper, 1) == b" hi"
