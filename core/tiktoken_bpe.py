"""A tiktoken BPE vocabulary (``tiktoken.model``) as a ``tokenizers.Tokenizer``, built in memory.

Kimi (Kimi-K2, Kimi-Linear, Kimi K3) ships no ``tokenizer.json``: its tokenizer is
``tiktoken.model`` (one ``<base64 token bytes> <rank>`` line per token, ranks 0..n-1),
``tokenization_kimi.py`` (a transformers remote-code class over ``tiktoken.Encoding`` with a
split pattern ``pat_str`` and ``num_reserved_special_tokens`` special slots after the ranks) and
``tokenizer_config.json`` (``added_tokens_decoder`` names some of those slots). This module turns
them into the same ``tokenizers.Tokenizer`` a ``tokenizer.json`` would give, so the chat template,
the streaming detokenizer and the server work unchanged:

* the BPE: tiktoken merges the adjacent pair whose concatenation has the lowest rank, and takes a
  whole pre-token that is itself a token as is. The equivalent ``tokenizers`` BPE (transformers'
  ``TikTokenConverter``) has every token as a vocabulary entry with id = rank, the merges
  ``(left, right)`` of every split of every token into two tokens, ordered by the merged token's
  rank, and ``ignore_merges`` (the whole-word shortcut). Bytes become characters by GPT-2's
  byte-to-unicode table (a ``ByteLevel`` pre-tokenizer without its own regex, and its decoder);
* the split: ``pat_str`` as a ``Split`` pre-tokenizer (``isolated``), read from the tokenization
  module named by ``tokenizer_config.json``'s ``auto_map`` with ``ast`` (never imported or run);
  without that file, Kimi's published pattern when the config names Moonshot's class. Its
  ``[...&&[^\\p{Han}]]`` class intersections and ``\\p{Han}`` work in the Oniguruma engine
  ``tokenizers`` uses (tested against tiktoken's own engine, code point by code point);
* the special slots: ids ``n .. n + num_reserved_special_tokens - 1`` (256 by default), named from
  ``added_tokens_decoder`` or ``<|reserved_token_{id}|>`` as ``tokenization_kimi.py`` names them.
  All are matched in text (tiktoken's ``allowed_special="all"``, Kimi's default) and skipped by
  ``decode(skip_special_tokens=True)`` unless their entry says ``"special": false``.

Built at every open rather than written out as a ``tokenizer.json``: the checkpoint's own files stay
the only source (nothing derived to go stale, nothing that other tools would read in place of
Moonshot's class), at a cost of ~2.3 s for 163,840 tokens on a busy 2-core VM, where loading a
written tokenizer.json takes ~1 s (benchmarks/tiktoken_load.py, benchmarks/README.md).

Not reproduced: ``tokenization_kimi.py`` cuts texts into pieces of at most 400,000 characters and
runs of at most 25,000 whitespace or non-whitespace characters before encoding (to bound tiktoken's
regex work); only texts with such runs can tokenize differently.
"""
from __future__ import annotations

import ast
import base64
import binascii
import os
from collections.abc import Mapping
from typing import Any

from tokenizers import AddedToken, Regex, Tokenizer, decoders, models, pre_tokenizers

from .errors import ColiError

TIKTOKEN_FILE = "tiktoken.model"
MOONSHOT_CLASS = "TikTokenTokenizer"     # tokenizer_config.json's tokenizer_class for Kimi
DEFAULT_RESERVED = 256                   # tokenization_kimi.py's num_reserved_special_tokens

# pat_str of Moonshot's tokenization_kimi.py (Kimi-K2, Kimi-Linear and Kimi K3 ship the same):
# o200k's pattern with Han runs as their own pieces (and Han taken out of the letter classes).
KIMI_PATTERN = "|".join([
    r"""[\p{Han}]+""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]+[\p{Ll}\p{Lm}\p{Lo}\p{M}&&[^\p{Han}]]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
    r"""\p{N}{1,3}""",
    r""" ?[^\s\p{L}\p{N}]+[\r\n]*""",
    r"""\s*[\r\n]+""",
    r"""\s+(?!\S)""",
    r"""\s+""",
])


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character table (the ByteLevel pre-tokenizer's)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(0xA1, 0xAC + 1)) + list(range(0xAE, 0xFF + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def read_ranks(path: str | os.PathLike) -> dict[bytes, int]:
    """``tiktoken.model`` as {token bytes: rank}; ranks must be 0..n-1, each once, every byte a token."""
    ranks: dict[bytes, int] = {}
    with open(path, "rb") as f:
        for lineno, line in enumerate(f, 1):
            parts = line.split()
            if not parts:
                continue
            try:
                token, rank = base64.b64decode(parts[0], validate=True), int(parts[1])
                if len(parts) != 2:
                    raise ValueError
            except (binascii.Error, ValueError, IndexError):
                raise ColiError(f"{path}: line {lineno} is not '<base64 token> <rank>'") from None
            if token in ranks:
                raise ColiError(f"{path}: line {lineno} repeats a token")
            ranks[token] = rank
    if sorted(ranks.values()) != list(range(len(ranks))):
        raise ColiError(f"{path}: the ranks are not 0..{len(ranks) - 1}, each once")
    if any(bytes([b]) not in ranks for b in range(256)):
        raise ColiError(f"{path}: not a byte-level BPE (some single bytes are not tokens)")
    return ranks


def _literal_pattern(node: ast.AST) -> str | None:
    """A string literal, or ``"|".join([literals])``, as the string it evaluates to."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return node.value
    if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "join"
            and isinstance(node.func.value, ast.Constant) and isinstance(node.func.value.value, str)
            and len(node.args) == 1 and not node.keywords and isinstance(node.args[0], (ast.List, ast.Tuple))
            and all(isinstance(e, ast.Constant) and isinstance(e.value, str) for e in node.args[0].elts)):
        return node.func.value.value.join(e.value for e in node.args[0].elts)
    return None


def read_module_settings(path: str | os.PathLike) -> tuple[str | None, int | None]:
    """``pat_str`` and ``num_reserved_special_tokens`` assigned in a tokenization module, read
    from its syntax tree (the module is never imported); None for what it does not assign."""
    try:
        with open(path, encoding="utf-8") as f:
            tree = ast.parse(f.read(), filename=os.fspath(path))
    except (OSError, SyntaxError, UnicodeDecodeError, ValueError) as e:
        raise ColiError(f"{path}: cannot read its pat_str ({e.__class__.__name__})") from None
    pattern, reserved = None, None
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets, value = node.targets, node.value
        elif isinstance(node, ast.AnnAssign) and node.value is not None:
            targets, value = [node.target], node.value
        else:
            continue
        for t in targets:
            if not isinstance(t, ast.Name):
                continue
            if t.id == "pat_str" and pattern is None:
                pattern = _literal_pattern(value)
            elif (t.id == "num_reserved_special_tokens" and reserved is None and isinstance(value, ast.Constant)
                  and type(value.value) is int):
                reserved = value.value
    return pattern, reserved


def _module_file(path: str, config: Mapping[str, Any]) -> str | None:
    """The tokenization module ``auto_map`` names (``"tokenization_kimi.TikTokenTokenizer"`` ->
    ``tokenization_kimi.py``), if it is in the directory."""
    auto = config.get("auto_map")
    entry = auto.get("AutoTokenizer") if isinstance(auto, Mapping) else None
    names = entry if isinstance(entry, (list, tuple)) else [entry]
    for name in names:
        if isinstance(name, str) and "." in name:
            module = name.split("--")[-1].rsplit(".", 1)[0]    # "repo--module.Class" form too
            candidate = os.path.join(path, module.replace(".", os.sep) + ".py")
            if os.path.isfile(candidate):
                return candidate
    return None


def split_settings(path: str, config: Mapping[str, Any]) -> tuple[str, int]:
    """The split pattern and the number of special slots for the tiktoken files in ``path``."""
    module = _module_file(path, config)
    pattern, reserved = read_module_settings(module) if module else (None, None)
    if module and pattern is None:
        raise ColiError(f"{path}: {TIKTOKEN_FILE} without its split pattern ({module} assigns no literal pat_str)")
    if pattern is None:
        if config.get("tokenizer_class") != MOONSHOT_CLASS:
            raise ColiError(f"{path}: {TIKTOKEN_FILE} without its split pattern (no tokenization module "
                            f"named by tokenizer_config.json's auto_map, and not Moonshot's {MOONSHOT_CLASS})")
        pattern = KIMI_PATTERN
    return pattern, DEFAULT_RESERVED if reserved is None else reserved


def special_slots(num_base: int, added_tokens_decoder: Any, reserved: int, where: str = "") -> list[dict]:
    """tokenizers' ``added_tokens`` entries for the special slots after the ranks: every id of
    ``num_base .. num_base + reserved - 1`` and any id ``added_tokens_decoder`` names beyond."""
    named: dict[int, Mapping] = {}
    if isinstance(added_tokens_decoder, Mapping):
        for key, entry in added_tokens_decoder.items():
            try:
                i = int(key)
            except (TypeError, ValueError):
                continue
            if isinstance(entry, Mapping) and isinstance(entry.get("content"), str) and i >= num_base:
                named[i] = entry
    ids = sorted(set(range(num_base, num_base + reserved)) | set(named))
    if ids and ids[-1] != num_base + len(ids) - 1:
        raise ColiError(f"{where}added_tokens_decoder names id {ids[-1]}, leaving unnamed ids between "
                        f"{num_base + reserved} and it")
    out = []
    for i in ids:
        e = named.get(i, {})
        out.append({"id": i, "content": e.get("content", f"<|reserved_token_{i}|>"),
                    "single_word": bool(e.get("single_word", False)), "lstrip": bool(e.get("lstrip", False)),
                    "rstrip": bool(e.get("rstrip", False)), "normalized": False,
                    "special": bool(e.get("special", True))})
    contents = [t["content"] for t in out]
    if len(set(contents)) != len(contents):
        raise ColiError(f"{where}added_tokens_decoder names one token for two ids")
    return out


def bpe_vocab_merges(ranks: Mapping[bytes, int]) -> tuple[dict[str, int], list[tuple[str, str]]]:
    """tokenizers' BPE vocab and merges equivalent to tiktoken's ranks (see the module docstring)."""
    table = bytes_to_unicode()          # str.translate: byte value -> character
    text = {t: t.decode("latin-1").translate(table) for t in ranks}
    get = ranks.get
    merges = []
    for token, rank in ranks.items():
        for k in range(1, len(token)):
            left = get(token[:k])
            if left is not None:
                right = get(token[k:])
                if right is not None:
                    merges.append((rank, left, right, k, token))
    merges.sort()       # by the merged token's rank, then its splits by (left rank, right rank)
    return {s: ranks[t] for t, s in text.items()}, [(text[t[:k]], text[t[k:]]) for _, _, _, k, t in merges]


# marks a vocabulary entry whose text is also a special token's (see tokenizer_from_ranks); never a
# character of GPT-2's byte alphabet (U+0021..U+0143), so no merge produces it
_SHADOWED = "\u2400"


def tokenizer_from_ranks(ranks: Mapping[bytes, int], pattern: str, added_tokens: list[dict]) -> Tokenizer:
    """The ``tokenizers.Tokenizer`` for tiktoken ``ranks`` split by ``pattern``, with ``added_tokens``
    (tokenizer.json's entries, ids from ``len(ranks)`` on without gaps)."""
    vocab, merges = bpe_vocab_merges(ranks)
    # A special token whose text is also an ordinary token's (b"[PAD]" among the ranks, say):
    # tokenizers would give the special token the ordinary id. Both tiktoken (allowed_special="all")
    # and tokenizers cut special tokens out of the text before the BPE sees it, so the ordinary
    # token, and every merge into or out of it, can never be reached by encoding: its entry is
    # renamed (the decoder strips the mark, so decoding its id still gives its text) and those
    # merges dropped, which leaves every encoding as it was.
    shadowed = {t["content"] for t in added_tokens} & vocab.keys()
    if shadowed:
        for text in shadowed:
            vocab[_SHADOWED + text] = vocab.pop(text)
        merges = [(a, b) for a, b in merges if a not in shadowed and b not in shadowed and a + b not in shadowed]
    tok = Tokenizer(models.BPE(vocab, merges, fuse_unk=False, ignore_merges=True))
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
    ])
    tok.decoder = (decoders.Sequence([decoders.Replace(_SHADOWED, ""), decoders.ByteLevel()]) if shadowed
                   else decoders.ByteLevel())
    tok.add_tokens([AddedToken(t["content"], single_word=t["single_word"], lstrip=t["lstrip"], rstrip=t["rstrip"],
                               normalized=False, special=t["special"]) for t in added_tokens])
    wrong = [t for t in added_tokens if tok.token_to_id(t["content"]) != t["id"]]
    if wrong:       # cannot happen with ids from len(ranks) on, no gaps and no shadowing: a guard
        raise ColiError(f"special token {wrong[0]['content']!r} did not get id {wrong[0]['id']}")
    return tok


def has_tiktoken(path: str | os.PathLike) -> bool:
    return os.path.isfile(os.path.join(path, TIKTOKEN_FILE))


def load_tiktoken_tokenizer(path: str | os.PathLike, config: Mapping[str, Any]) -> Tokenizer:
    """The directory's ``tiktoken.model`` (with ``config``, its tokenizer_config.json) as a Tokenizer."""
    path = os.fspath(path)
    pattern, reserved = split_settings(path, config)
    ranks = read_ranks(os.path.join(path, TIKTOKEN_FILE))
    added = special_slots(len(ranks), config.get("added_tokens_decoder"), reserved,
                          where=os.path.join(path, "tokenizer_config.json") + ": ")
    return tokenizer_from_ranks(ranks, pattern, added)


__all__ = ["KIMI_PATTERN", "TIKTOKEN_FILE", "bpe_vocab_merges", "has_tiktoken", "load_tiktoken_tokenizer",
           "read_module_settings", "read_ranks", "special_slots", "tokenizer_from_ranks"]
