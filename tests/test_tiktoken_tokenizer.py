"""Kimi's tokenizer (tiktoken.model + tokenization_kimi.py + tokenizer_config.json) through
core/tiktoken_bpe.py, against the real ``tiktoken`` package as the oracle: the split pattern code
point by code point, encode / decode of many strings (CJK, emoji, digits, whitespace runs, code,
special tokens) on real BPE ranks (the demo model's, and ranks trained here on a multilingual
corpus with Kimi's split), the special slots, bad files; then a Kimi-style model directory
(kimi_linear, and kimi_k2 read as deepseek_v3) converted with `coli convert` and chatting through
the engine with Kimi's real chat templates."""
from __future__ import annotations

import base64
import functools
import json
import os
import random
import shutil
from pathlib import Path

import pytest

tiktoken = pytest.importorskip("tiktoken")
from tokenizers import Regex, Tokenizer, models, pre_tokenizers, trainers  # noqa: E402

from core.errors import ColiError  # noqa: E402
from core.tiktoken_bpe import KIMI_PATTERN, bytes_to_unicode, read_module_settings, special_slots  # noqa: E402
from core.tokenizer import ChatTokenizer, load_tokenizer  # noqa: E402
from tests.conftest import COMMITTED, ROOT, one_error_line  # noqa: E402

DEMO_TOKENIZER = ROOT / "models" / "demo" / "qwen3-moe-demo" / "tokenizer.json"
TEMPLATES = ROOT / "tests" / "templates"

# Kimi-K2-Instruct's named slots (offsets from the first special id, 163584 there)
K2_NAMES = {0: "[BOS]", 1: "[EOS]", 2: "<|im_end|>", 3: "<|im_user|>", 4: "<|im_assistant|>",
            6: "<|start_header_id|>", 7: "<|end_header_id|>", 9: "[EOT]", 10: "<|im_system|>",
            11: "<|tool_calls_section_begin|>", 12: "<|tool_calls_section_end|>", 13: "<|tool_call_begin|>",
            14: "<|tool_call_argument_begin|>", 15: "<|tool_call_end|>", 17: "<|im_middle|>"}

# a tokenization module shaped like Moonshot's: read for its pat_str, never imported
KIMI_MODULE = '''raise SystemExit("this module must never be executed")
import tiktoken
from transformers import PreTrainedTokenizer


class TikTokenTokenizer(PreTrainedTokenizer):
    vocab_files_names = {"vocab_file": "tiktoken.model"}
    special_tokens: dict
    num_reserved_special_tokens = %(reserved)d

    pat_str = "|".join(
        [
            r"""[\\p{Han}]+""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""[^\\r\\n\\p{L}\\p{N}]?[\\p{Lu}\\p{Lt}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]+[\\p{Ll}\\p{Lm}\\p{Lo}\\p{M}&&[^\\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
            r"""\\p{N}{1,3}""",
            r""" ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*""",
            r"""\\s*[\\r\\n]+""",
            r"""\\s+(?!\\S)""",
            r"""\\s+""",
        ]
    )
'''

CORPUS = [
    "Hello world, this is a small corpus for a byte-level BPE tokenizer. Don't stop; we'll see.",
    "我喜欢学习中文。你好，世界！今天天气很好。中华人民共和国成立于一九四九年。北京是中国的首都。",
    "日本語のテキストです。東京は日本の首都です。カタカナとひらがな、漢字。",
    "한국어 텍스트도 시험합니다. 서울은 한국의 수도입니다.",
    "Ciao! Perché la città è così bella? Però non è più caro del caffè. Ελληνικά, Русский язык.",
    "The weather is nice 🌞🌈 and the pizza 🍕 is great 👍🏽. Family: 👨‍👩‍👧‍👦, flags 🇮🇹🇯🇵.",
    "def f(x):\n    return x * 2  # code too\n\tif (a != b) { return 0x1F; }\n",
    "Numbers 1234567890, 3.14159, 1,000,000 and 2026-12-01 12:30:45.",
    "    indented\n\n\n   blank lines  \r\n  windows\r\n",
] * 3

STRINGS = [
    "", " ", "  ", "\n", "\r\n", "\t\t", "   \n   ", "a  b   c    d", "trailing   ", "\n\n\nx\n\n",
    "Hello world", "Hello, world!", "你好世界", "1234567890", "中文English混合", "汉字abc", "北京市 Pascal",
    "I'M you're THEY'LL don't We'Re it's", "HELLO world CamelCase snake_case SCREAMING_CASE",
    "日本語のテキスト, 中文字符, Ελληνικά, Русский, العربية, עברית, हिन्दी, ไทย",
    "한국어 텍스트도 시험합니다.", "e\u0301 a\u0300\u0323 \u0301alone", "emoji 🙂🚀!! 👍🏽 👨‍👩‍👧‍👦 🇮🇹",
    "def f(x):\n    return x*2  # ok\n", "if (a<=b && c||d) { x += 1; }\n\treturn;",
    "1,000,000.50 and 3.14159 and 0xDEADBEEF and 1e-10", "١٢٣ ٤٥٦ (Arabic-Indic digits) ½ ² Ⅻ",
    "nbsp\u00a0here, ideographic\u3000space, line\u2028sep, para\u2029sep, zero\u200bwidth",
    "\x00\x01\x7f control \x1b[0m", "tabs\tand\vvertical\ffeed", "!!!???...,,,;;;", "...\n\n",
    "<|im_end|>", "a<|im_end|>b", "<|im_user|>user<|im_middle|>ciao<|im_end|>", "<|im_end", "[BOS]x[EOS]",
    "<|reserved_token_%(r)d|> mid", "<<|im_end|>>",
] + CORPUS[:9]


_BYTE_OF = {c: b for b, c in bytes_to_unicode().items()}


def _utf8_of(tokens_text: str) -> bytes:
    return bytes(_BYTE_OF[c] for c in tokens_text)


@functools.lru_cache(maxsize=1)
def _demo_ranks_cached() -> tuple:
    spec = json.loads(DEMO_TOKENIZER.read_text())
    ranks = {bytes([b]): b for b in range(256)}
    for merge in spec["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(_utf8_of(a) + _utf8_of(b), len(ranks))
    return tuple(ranks.items())


def _demo_ranks() -> dict[bytes, int]:
    """The demo model's byte-level BPE as tiktoken ranks: the 256 bytes, then each merge's result."""
    return dict(_demo_ranks_cached())


def _trained_ranks(vocab_size: int = 1500) -> dict[bytes, int]:
    """A byte-level BPE trained here with Kimi's split, as tiktoken ranks (merge order)."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(CORPUS, trainer=trainer)
    ranks = {bytes([b]): b for b in range(256)}
    for merge in json.loads(tok.to_str())["model"]["merges"]:
        a, b = merge.split(" ") if isinstance(merge, str) else merge
        ranks.setdefault(_utf8_of(a) + _utf8_of(b), len(ranks))
    return ranks


def write_tiktoken(path: Path, ranks: dict[bytes, int]) -> None:
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda kv: kv[1]):
            f.write(base64.b64encode(token) + b" %d\n" % rank)


def kimi_dir(d: Path, ranks: dict[bytes, int], reserved: int = 256, names: dict[int, str] = K2_NAMES,
             template: str | None = None, module: bool = True, extra: dict | None = None) -> Path:
    """A Kimi-style tokenizer directory: tiktoken.model, tokenization_kimi.py, tokenizer_config.json."""
    d.mkdir(parents=True, exist_ok=True)
    write_tiktoken(d / "tiktoken.model", ranks)
    if module:
        (d / "tokenization_kimi.py").write_text(KIMI_MODULE % {"reserved": reserved})
    n = len(ranks)
    config = {
        "added_tokens_decoder": {str(n + k): {"content": v, "lstrip": False, "normalized": False, "rstrip": False,
                                              "single_word": False, "special": True} for k, v in names.items()},
        "auto_map": {"AutoTokenizer": ["tokenization_kimi.TikTokenTokenizer", None]},
        "bos_token": "[BOS]", "eos_token": "[EOS]", "pad_token": "[PAD]" if reserved > 255 else None,
        "unk_token": "[UNK]" if reserved > 255 else None,
        "tokenizer_class": "TikTokenTokenizer", "model_max_length": 1048576,
    }
    if reserved > 255:
        config["added_tokens_decoder"][str(n + 254)] = {"content": "[UNK]", "special": True}
        config["added_tokens_decoder"][str(n + 255)] = {"content": "[PAD]", "special": True}
    if template is not None:
        config["chat_template"] = template
    config.update(extra or {})
    (d / "tokenizer_config.json").write_text(json.dumps(config, indent=1, ensure_ascii=False))
    return d


def oracle(d: Path, ranks: dict[bytes, int]) -> "tiktoken.Encoding":
    """tiktoken.Encoding as tokenization_kimi.py builds it from the same files."""
    config = json.loads((d / "tokenizer_config.json").read_text())
    _, reserved = read_module_settings(d / "tokenization_kimi.py")
    named = {int(k): v["content"] for k, v in config["added_tokens_decoder"].items()}
    n = len(ranks)
    specials = {named.get(i, f"<|reserved_token_{i}|>"): i for i in range(n, n + reserved)}
    return tiktoken.Encoding(name="kimi-test", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens=specials)


@pytest.fixture(scope="module", params=["demo", "trained"])
def case(request, tmp_path_factory):
    ranks = _demo_ranks() if request.param == "demo" else _trained_ranks()
    d = kimi_dir(tmp_path_factory.mktemp(request.param), ranks)
    return ChatTokenizer.from_dir(d), oracle(d, ranks), ranks


def _random_strings(seed: int, n: int) -> list[str]:
    """Mixtures of the classes the pattern tells apart, as runs of random length."""
    rng = random.Random(seed)
    pools = ["abcXYZ", "ÀéßØñ", "中文字符汉", "ひらカタ", "한국어", "0123456789", "١٢٣", "  ", "\t", "\n", "\r\n",
             "'s'T're", "!?.,;:-_()[]{}<>/\\|@#$%^&*+=~`\"", "🙂🚀👍🏽🇮🇹", "\u0301\u0300", "\u00a0\u3000\u2028"]
    out = []
    for _ in range(n):
        out.append("".join(rng.choice(rng.choice(pools)) * rng.randint(1, 4) for _ in range(rng.randint(1, 30))))
    return out


# --- the split pattern in tokenizers' engine against tiktoken's ------------------------------------
_SPLIT = pre_tokenizers.Split(Regex(KIMI_PATTERN), behavior="isolated", invert=False)


def _pieces_agree(text: str) -> bool:
    """Whether tiktoken splits ``text`` into the pieces the Split pre-tokenizer does: with every
    piece, and every two adjacent pieces joined, made a token (prefixes too), tiktoken returns
    one token per piece exactly when its pieces are the same (a piece of its own that is a part
    of one of ours, or spans two of ours, comes out as some other token)."""
    pieces = [p.encode() for p, _ in _SPLIT.pre_tokenize_str(text)]
    ranks = {bytes([b]): b for b in range(256)}
    for p in pieces + [a + b for a, b in zip(pieces, pieces[1:])]:
        for k in range(2, len(p) + 1):
            ranks.setdefault(p[:k], len(ranks))
    enc = tiktoken.Encoding(name="probe", pat_str=KIMI_PATTERN, mergeable_ranks=ranks, special_tokens={})
    return enc.encode_ordinary(text) == [ranks[p] for p in pieces]


def _contexts(c: str) -> str:
    return f"{c}a{c} {c}1{c}\n{c}A'S{c}'t{c}{c}  {c}\t.{c}\r\n"


def _code_points_agree(cps: list[int]) -> list[int]:
    bad = []
    for i in range(0, len(cps), 2048):
        chunk = cps[i:i + 2048]
        if not _pieces_agree("".join(_contexts(chr(c)) for c in chunk)):
            bad += [c for c in chunk if not _pieces_agree(_contexts(chr(c)))]
    return bad


def test_kimis_pattern_splits_as_tiktoken_does_code_point_by_code_point():
    """Every code point below U+3000 and every 97th above, in letter / digit / space / punctuation
    contexts. COLI_TIKTOKEN_SWEEP=1 checks all 1,112,064 (about 3 minutes here: none differs)."""
    every = os.environ.get("COLI_TIKTOKEN_SWEEP") == "1"
    cps = [c for c in range(0x110000) if not 0xD800 <= c < 0xE000 and (every or c < 0x3000 or c % 97 == 0)]
    assert _code_points_agree(cps) == []


def test_a_different_pattern_is_seen_by_the_probe(monkeypatch):
    import tests.test_tiktoken_tokenizer as me
    other = KIMI_PATTERN.replace(r"[\p{Han}]+|", "", 1).replace(r"&&[^\p{Han}]", "")   # o200k's: Han is a letter
    monkeypatch.setattr(me, "_SPLIT", pre_tokenizers.Split(Regex(other), behavior="isolated", invert=False))
    assert me._code_points_agree([0x4E2D, 0x6587, 0x61, 0x20]) == [0x4E2D, 0x6587]


# --- encode / decode against tiktoken ------------------------------------------------------------
def test_encode_equals_tiktoken(case):
    tok, enc, ranks = case
    strings = [s % {"r": len(ranks) + 40} if "%(r)" in s else s for s in STRINGS] + _random_strings(1, 400)
    for s in strings:
        want = enc.encode(s, allowed_special="all")          # tokenization_kimi.py's default
        assert tok.encode(s, add_special_tokens=False) == want, s
        assert tok.encode(s) == want, s                       # Kimi adds no BOS of its own
        assert tok.decode(want, skip_special_tokens=False) == enc.decode(want), s


def test_the_whole_corpus_in_one_text(case):
    tok, enc, _ = case
    text = "\n".join(CORPUS) * 4
    assert tok.encode(text) == enc.encode(text, allowed_special="all")


def test_decode_of_any_ids_equals_tiktoken(case):
    # random ids: broken UTF-8 sequences become U+FFFD the same way
    tok, enc, ranks = case
    rng = random.Random(2)
    n = len(ranks) + 256
    for _ in range(300):
        ids = [rng.randrange(n) for _ in range(rng.randint(1, 12))]
        assert tok.decode(ids, skip_special_tokens=False) == enc.decode(ids)
        plain = [i for i in ids if i < len(ranks)]
        assert tok.decode(ids) == enc.decode(plain)           # every slot is special here
        stream = tok.stream_decoder()
        text = "".join(stream.push(i) for i in ids) + stream.flush()
        assert text == tok.decode(ids)


def test_special_slots_and_names(case):
    tok, enc, ranks = case
    n = len(ranks)
    assert len(tok) == n + 256 == enc.n_vocab
    assert tok.token_to_id("[BOS]") == n and tok.token_to_id("<|im_middle|>") == n + 17
    assert tok.token_to_id("[PAD]") == n + 255 and tok.id_to_token(n + 5) == f"<|reserved_token_{n + 5}|>"
    assert tok.bos_token_id == n and tok.eos_token_id == n + 1 and tok.pad_token_id == n + 255


def test_a_special_token_that_is_also_a_vocabulary_entry_keeps_its_slot(tmp_path):
    ranks = {bytes([b]): b for b in range(256)}
    for t in (b"[B", b"[BO", b"[BOS", b"[BOS]", b"<|", b"<|im"):
        ranks[t] = len(ranks)
    d = kimi_dir(tmp_path / "k", ranks)
    tok, enc = ChatTokenizer.from_dir(d), oracle(d, ranks)
    assert tok.token_to_id("[BOS]") == len(ranks)
    for s in ("[BOS]", "x[BOS]y", "[BOS", "<|im_end|><|im"):
        assert tok.encode(s) == enc.encode(s, allowed_special="all")
        assert tok.encode(s, add_special_tokens=False) == enc.encode(s, allowed_special="all")
    ordinary = [ranks[b"[BOS]"], ranks[b"<|im"], len(ranks)]
    assert tok.decode(ordinary, skip_special_tokens=False) == enc.decode(ordinary) == "[BOS]<|im[BOS]"
    assert tok.decode(ordinary) == "[BOS]<|im"


def test_a_non_special_added_token_is_kept_in_decode(tmp_path):
    ranks = _demo_ranks()
    d = kimi_dir(tmp_path / "k", ranks, names={**K2_NAMES, 20: "<think>"})
    config = json.loads((d / "tokenizer_config.json").read_text())
    config["added_tokens_decoder"][str(len(ranks) + 20)]["special"] = False
    (d / "tokenizer_config.json").write_text(json.dumps(config))
    tok, enc = ChatTokenizer.from_dir(d), oracle(d, ranks)
    ids = tok.encode("<think>hm</think><|im_end|>")
    assert ids == enc.encode("<think>hm</think><|im_end|>", allowed_special="all")
    assert tok.decode(ids) == "<think>hm</think>"


# --- the module, the config, bad files ---------------------------------------------------------------
def test_the_pattern_is_read_from_the_module_without_running_it(tmp_path):
    (tmp_path / "tokenization_kimi.py").write_text(KIMI_MODULE % {"reserved": 256})
    assert read_module_settings(tmp_path / "tokenization_kimi.py") == (KIMI_PATTERN, 256)


def test_the_modules_own_pattern_and_slot_count_are_used(tmp_path):
    ranks = _demo_ranks()
    d = kimi_dir(tmp_path / "k", ranks, reserved=20)
    other = r"""\p{N}| ?\p{L}+| ?[^\s\p{L}\p{N}]+|\s+"""
    text = (d / "tokenization_kimi.py").read_text()
    start, end = text.index('    pat_str = "|".join('), text.index("    )\n", text.index('    pat_str = "|".join(')) + 6
    (d / "tokenization_kimi.py").write_text(text[:start] + f"    pat_str = r'''{other}'''\n" + text[end:])
    tok = ChatTokenizer.from_dir(d)
    enc = tiktoken.Encoding(name="o", pat_str=other, mergeable_ranks=ranks,
                            special_tokens={t: len(ranks) + k for k, t in K2_NAMES.items()})
    assert len(tok) == len(ranks) + 20
    for s in ("Hello 123 world", "中文English 45", "<|im_end|>x"):
        assert tok.encode(s) == enc.encode(s, allowed_special="all")


def test_without_the_module_moonshots_class_means_kimis_pattern(tmp_path, case):
    _, enc, ranks = case
    d = kimi_dir(tmp_path / "k", ranks, module=False)
    tok = ChatTokenizer.from_dir(d)
    for s in STRINGS[10:25]:
        assert tok.encode(s) == enc.encode(s, allowed_special="all")


@pytest.mark.parametrize("damage, message", [
    (lambda d: (d / "tiktoken.model").write_bytes(b"YQ== 0\nnot-base64! 1\n"), r"tiktoken.model: line 2 is not"),
    (lambda d: (d / "tiktoken.model").write_bytes(
        b"".join(base64.b64encode(bytes([b])) + b" %d\n" % (b * 2) for b in range(256))), r"are not 0\.\.255"),
    (lambda d: (d / "tiktoken.model").write_bytes(
        b"".join(base64.b64encode(bytes([b, b])) + b" %d\n" % b for b in range(256))), r"not a byte-level BPE"),
    (lambda d: ((d / "tokenization_kimi.py").unlink(),
                (d / "tokenizer_config.json").write_text(json.dumps({"auto_map": {}}))),
     r"tiktoken.model without its split pattern \(no tokenization module"),
    (lambda d: (d / "tokenization_kimi.py").write_text("pat_str = compute()\n"),
     r"without its split pattern \(.*tokenization_kimi.py assigns no literal pat_str"),
    (lambda d: (d / "tokenization_kimi.py").write_text("pat_str = (\n"), r"tokenization_kimi.py: cannot read its pat_str"),
    (lambda d: (d / "tokenization_kimi.py").write_text("pat_str = '(unclosed'\n"),
     r"the tokenizer files do not load"),
])
def test_bad_files_are_one_clear_error(tmp_path, damage, message):
    d = kimi_dir(tmp_path / "k", _demo_ranks())
    damage(d)
    with pytest.raises(ColiError, match=message) as e:
        load_tokenizer(d)
    assert "\n" not in str(e.value)


def test_named_ids_past_the_slots_must_leave_no_gap():
    assert [t["content"] for t in special_slots(4, {"6": {"content": "<x>"}}, 2)] == [
        "<|reserved_token_4|>", "<|reserved_token_5|>", "<x>"]
    with pytest.raises(ColiError, match="leaving unnamed ids"):
        special_slots(4, {"9": {"content": "<x>"}}, 2)
    with pytest.raises(ColiError, match="one token for two ids"):
        special_slots(4, {"4": {"content": "<x>"}, "5": {"content": "<x>"}}, 2)


def test_tokenizer_json_wins_over_tiktoken(tmp_path):
    ranks = _demo_ranks()
    d = kimi_dir(tmp_path / "k", ranks)
    shutil.copy(DEMO_TOKENIZER, d / "tokenizer.json")
    assert len(ChatTokenizer.from_dir(d)) == Tokenizer.from_file(str(DEMO_TOKENIZER)).get_vocab_size(True)


# --- a Kimi-style model: coli convert, then chat through the engine -----------------------------------
def _kimi_model(tmp_path: Path, fixture: str, model_type: str | None, template: str) -> Path:
    """The oracle fixture's checkpoint with a Kimi tokenizer sized to its vocabulary: the 256
    bytes, the demo's first merges, 18 special slots (K2's names, K3's where the template needs them)."""
    src = tmp_path / "hf"
    shutil.copytree(COMMITTED / fixture / "model", src)
    config = json.loads((src / "config.json").read_text())
    config["model_type"] = model_type or config["model_type"]      # Kimi-K2's config.json says kimi_k2
    for key in ("model_max_length", "max_position_embeddings"):     # room for K3's system prompt
        if key in config:
            config[key] = 2048
    (src / "config.json").write_text(json.dumps(config))
    reserved = 18
    ranks = dict(list(_demo_ranks().items())[: config["vocab_size"] - reserved])
    names = {**K2_NAMES, 5: "<|end_of_msg|>", 8: "<|open|>", 16: "<|sep|>"}
    if "k3" in template:
        names.update({6: "<|close|>"})
    kimi_dir(src, ranks, reserved=reserved, names=names, template=(TEMPLATES / template).read_text(),
             extra={"eos_token": "<|im_end|>"})
    out = tmp_path / "c"
    from colibri_tui.cli import main as coli
    assert coli(["convert", str(src), str(out), "--bits", "16"]) == 0
    return out


@pytest.mark.parametrize("fixture, model_type, template, marker", [
    ("kimilinear-a", None, "kimi_k3.jinja", "<|open|>"),
    ("deepseekv3-a", "kimi_k2", "kimi_k2_thinking.jinja", "<|im_user|>"),
])
def test_a_kimi_model_converts_and_chats(tmp_path, fixture, model_type, template, marker):
    from core.sampling import SamplingParams
    from tests.conftest import open_engine
    out = _kimi_model(tmp_path, fixture, model_type, template)
    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"):
        assert (out / name).is_file()
    engine = open_engine(out)
    tok = engine.tokenizer
    chat = [{"role": "user", "content": "Ciao! 你好 🙂"}]
    prompt = tok.apply_chat_template(chat, add_generation_prompt=True)
    ids = engine.prompt_ids(chat)
    assert marker in prompt and ids == tok.encode(prompt, add_special_tokens=False)
    assert tok.token_to_id(marker) in ids and max(ids) < json.loads((out / "config.json").read_text())["vocab_size"]
    events = list(engine.generate(chat, SamplingParams(greedy=True), max_new_tokens=6))
    final = [e for e in events if type(e).__name__ == "Stats"][-1].extra
    pieces = "".join(e.text for e in events if type(e).__name__ == "Token")
    assert len(final["ids"]) == 6 or final["reason"] == "eos"
    assert pieces == final["text"] == tok.decode(final["ids"])


def test_convert_refuses_a_damaged_tiktoken_model_in_one_line(tmp_path, capsys):
    src = tmp_path / "hf"
    shutil.copytree(COMMITTED / "kimilinear-a" / "model", src)
    kimi_dir(src, _demo_ranks())
    (src / "tiktoken.model").write_bytes(b"!!!! 0\n")
    err = one_error_line(capsys, ["convert", str(src), str(tmp_path / "c"), "--bits", "16"])
    assert "tiktoken.model: line 1 is not '<base64 token> <rank>'" in err
    assert not (tmp_path / "c").exists()


def test_download_and_convert_carry_kimis_tokenizer_files():
    from core.converter import COPIED_FILES
    from core.downloader import wanted
    for name in ("tiktoken.model", "tokenization_kimi.py", "tokenizer_config.json"):
        assert wanted(name) and name in COPIED_FILES
    assert not wanted("modeling_kimi.py") and not wanted("sub/tiktoken.model")


def test_coli_serve_answers_with_the_kimi_tokenizer(tmp_path, tmp_path_factory):
    """The OpenAI client against `coli serve` on a Kimi-K2-style model: the reply is the engine's
    greedy text, and the logprobs' bytes are the tokens' bytes (the byte-level table applies)."""
    pytest.importorskip("openai")
    from core.sampling import SamplingParams
    from tests.conftest import open_engine, server_env
    from tests.test_serve import Served
    env = server_env(tmp_path_factory, "kimi-serve")
    next(env)
    try:
        engine = open_engine(_kimi_model(tmp_path, "deepseekv3-a", "kimi_k2", "kimi_k2_thinking.jinja"))
        chat = [{"role": "user", "content": "Ciao! 你好 🙂"}]
        events = list(engine.generate(chat, SamplingParams(greedy=True), max_new_tokens=8))
        final = [e for e in events if type(e).__name__ == "Stats"][-1].extra
        want = final["text"]
        s = Served(engine)
        try:
            r = s.openai().chat.completions.create(model="c", messages=chat, max_tokens=8, temperature=0,
                                                   logprobs=True)
        finally:
            s.close()
        msg = r.choices[0].message
        text = (getattr(msg, "reasoning_content", None) or "") + (msg.content or "")
        assert text == want and r.usage.prompt_tokens == len(engine.prompt_ids(chat))
        got = b"".join(bytes(t.bytes) for t in r.choices[0].logprobs.content)
        # the special tokens a random model emits are in the logprobs (their text), not the reply
        assert got.decode("utf-8", errors="replace") == engine.tokenizer.decode(final["ids"], skip_special_tokens=False)
    finally:
        env.close()
