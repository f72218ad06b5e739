"""core.tokenizer.StreamDecoder decodes a short window per token, not the whole reply (which made
a reply's detokenizing quadratic), and its pieces still add up to decode(all ids)."""
from __future__ import annotations

from pathlib import Path

import pytest

from core.tokenizer import StreamDecoder, load_tokenizer

DEMO = Path(__file__).resolve().parents[1] / "models" / "demo" / "qwen3-moe-demo"


class Counting:
    """A tokenizer that records how many ids each decode call was given."""

    def __init__(self, tok):
        self.tok, self.sizes = tok, []

    def decode(self, ids, skip_special_tokens=True):
        self.sizes.append(len(ids))
        return self.tok.decode(ids, skip_special_tokens=skip_special_tokens)


@pytest.fixture(scope="module")
def demo_tokenizer():
    if not (DEMO / "tokenizer.json").is_file():
        pytest.skip("no embedded demo model in this checkout")
    return load_tokenizer(DEMO)


def stream(dec, ids):
    return "".join(dec.push(t) for t in ids) + dec.flush()


def test_a_long_reply_decodes_short_windows(demo_tokenizer):
    text = "Grüße aus Köln, 日本語のテキスト 🙂 and plain words. " * 120
    ids = demo_tokenizer.encode(text)
    assert len(ids) > 2000
    counting = Counting(demo_tokenizer)
    dec = StreamDecoder(counting)
    assert stream(dec, ids) == demo_tokenizer.decode(ids)
    assert dec.text == demo_tokenizer.decode(ids)
    assert max(counting.sizes) <= 16          # was len(ids) at the last token: all of them
    assert len(counting.sizes) <= 2 * len(ids) + 1


def test_split_multibyte_characters_come_out_whole(demo_tokenizer):
    ids = demo_tokenizer.encode("🙂🙃 ü 日本")
    dec = StreamDecoder(demo_tokenizer)
    pieces = [dec.push(t) for t in ids]
    assert all("\ufffd" not in p for p in pieces)
    assert "".join(pieces) + dec.flush() == "🙂🙃 ü 日本"


def test_sentencepiece_style_leading_spaces_survive_the_window():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "!": 3}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Metaspace()
    tok.decoder = decoders.Metaspace()
    ids = [1, 2, 3, 1, 2, 2, 3] * 20
    assert tok.decode([2]) == "world"            # alone, the first token loses its space
    assert stream(StreamDecoder(tok), ids) == tok.decode(ids)
