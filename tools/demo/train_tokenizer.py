"""Train the demo model's tokenizer: byte-level BPE, 4096 tokens, ChatML special tokens.

Reads the ``train.jsonl`` written by build_corpus.py and writes ``tokenizer.json``,
``tokenizer_config.json`` (with the ChatML chat template, eos ``<|im_end|>``, no bos) and
``special_tokens_map.json`` to ``--out``. Deterministic for a given corpus.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

os.environ.setdefault("RAYON_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]  # ids 0, 1, 2
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def corpus_texts(path: str):
    with open(path, encoding="utf-8") as f:
        for line in f:
            text = json.loads(line)["text"]
            for tok in SPECIAL:  # the markers are added tokens, not something to learn merges from
                text = text.replace(tok, "\n")
            yield text


def build(train_jsonl: str, vocab_size: int = 4096) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=SPECIAL,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus_texts(train_jsonl), trainer=trainer)
    return tok


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="/work/demo_train/corpus")
    ap.add_argument("--out", default="/work/demo_train/tokenizer")
    ap.add_argument("--vocab-size", type=int, default=4096)
    args = ap.parse_args(argv)

    tok = build(os.path.join(args.corpus, "train.jsonl"), args.vocab_size)
    for i, s in enumerate(SPECIAL):
        assert tok.token_to_id(s) == i, (s, tok.token_to_id(s))
    os.makedirs(args.out, exist_ok=True)
    tok.save(os.path.join(args.out, "tokenizer.json"))
    added = {
        str(i): {"content": s, "lstrip": False, "normalized": False, "rstrip": False, "single_word": False,
                 "special": True}
        for i, s in enumerate(SPECIAL)
    }
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "added_tokens_decoder": added,
        "additional_special_tokens": ["<|im_start|>", "<|im_end|>"],
        "bos_token": None,
        "eos_token": "<|im_end|>",
        "pad_token": "<|endoftext|>",
        "unk_token": None,
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": 1024,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(args.out, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")
    with open(os.path.join(args.out, "special_tokens_map.json"), "w", encoding="utf-8") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>",
                   "additional_special_tokens": ["<|im_start|>", "<|im_end|>"]}, f, indent=2)
        f.write("\n")
    print(f"vocab {tok.get_vocab_size()} -> {args.out}", file=sys.stderr)


if __name__ == "__main__":
    main()
