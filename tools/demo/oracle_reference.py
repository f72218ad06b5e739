"""Reference outputs of transformers for the demo model (needs the oracle extra and the float32
checkpoint that tools/demo/train.py saved).

    python -m tools.demo.oracle_reference HF_DIR [--out tests/oracle/demo_reference.npz]

Stores, for 32 held-out tokens (a chat prompt + a held-out document): logits of the original
float32 weights (``logits_orig``), of the weights exactly as the shipped int4 container
dequantizes them (``logits_q4``), and 20 greedy tokens of the latter after the first 8 ids
(``greedy_q4``). tests/test_demo.py checks the shipped container against them.
"""
from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

import numpy as np
import torch

from tests.oracle.generate import _greedy, _load_kwargs, _logits, _quantized_model


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("hf_dir")
    ap.add_argument("--corpus", default="/work/demo_train/corpus/heldout.jsonl")
    ap.add_argument("--out", default="tests/oracle/demo_reference.npz")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    from transformers import AutoTokenizer, Qwen3MoeForCausalLM
    tok = AutoTokenizer.from_pretrained(args.hf_dir)
    doc = json.loads(Path(args.corpus).read_text().splitlines()[0])
    text = doc.get("text") or doc.get("content") or str(doc)
    prompt = tok.apply_chat_template([{"role": "user", "content": "Tell me a fortune"}], tokenize=False,
                                      add_generation_prompt=True)
    ids = np.asarray(tok(prompt + text, add_special_tokens=False)["input_ids"][:32], dtype=np.int64)
    orig = Qwen3MoeForCausalLM.from_pretrained(args.hf_dir, **_load_kwargs()).eval()
    with tempfile.TemporaryDirectory() as work:
        q4, _ = _quantized_model(args.hf_dir, work, 4, Qwen3MoeForCausalLM)
        out = dict(ids=ids, logits_orig=_logits(orig, ids), logits_q4=_logits(q4, ids),
                   greedy_q4=_greedy(q4, ids[:8], 20)[0])
    np.savez_compressed(args.out, **out)
    agree = float((out["logits_q4"].argmax(1) == out["logits_orig"].argmax(1)).mean())
    print(f"wrote {args.out}: {len(ids)} ids, int4-vs-original argmax agreement {agree:.3f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
