"""Train the demo Qwen3-MoE from scratch on the corpus of build_corpus.py (CPU, fixed seed).

    python tools/demo/train.py --minutes 55 --threads 1

Model: transformers ``Qwen3MoeForCausalLM``, 8 layers x 32 experts (top-4), hidden 256, expert
FFN 128, 4 query / 2 key-value heads of 64, vocab 4096, untied embeddings, float32 (~28 M
parameters, ~7 M active per token).

Data: every training document (and dialogue) tokenized and followed by ``<|endoftext|>``; the
documents are shuffled with the seed (reshuffled each epoch) and the stream is cut into windows
of ``--seq-len`` + 1 tokens. Held-out: the held-out split, same packing, in file order.

Optimisation: AdamW (betas 0.9/0.95, weight decay 0.1 on matrices), linear warm-up then cosine
decay to ``--min-lr-frac`` of the peak, gradient clipping at 1.0, next-token cross-entropy plus
``--aux-coef`` x the Switch-style load-balancing loss of transformers (``output_router_logits``).
The schedule runs on progress = max(step / --steps, elapsed / --minutes), so a run that the wall
clock stops has still annealed; the run stops at whichever limit comes first, evaluates on the
whole held-out split and saves (``save_pretrained`` + tokenizer + generation_config) to ``--out``.
"""
from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAYON_NUM_THREADS", "1")

import argparse
import json
import math
import shutil
import sys
import time

import numpy as np
import torch


def log(msg: str):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def model_config(vocab_size: int, aux_coef: float):
    from transformers import Qwen3MoeConfig

    return Qwen3MoeConfig(
        vocab_size=vocab_size,
        hidden_size=256,
        intermediate_size=512,  # dense MLP size; unused (every layer is MoE)
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        num_experts=32,
        num_experts_per_tok=4,
        moe_intermediate_size=128,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        tie_word_embeddings=False,
        max_position_embeddings=1024,
        rope_parameters={"rope_type": "default", "rope_theta": 10000.0},
        rms_norm_eps=1e-6,
        hidden_act="silu",
        attention_bias=False,
        use_sliding_window=False,
        initializer_range=0.02,
        output_router_logits=False,
        router_aux_loss_coef=aux_coef,
        bos_token_id=None,
        eos_token_id=[2, 0],
        pad_token_id=0,
        dtype="float32",
    )


def load_split(path: str, tokenizer, eot: int) -> list[np.ndarray]:
    texts = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            texts.append(json.loads(line)["text"])
    docs = []
    for i in range(0, len(texts), 2048):
        for enc in tokenizer.encode_batch(texts[i:i + 2048], add_special_tokens=False):
            docs.append(np.asarray(enc.ids + [eot], dtype=np.int32))
    return docs


def windows(docs: list[np.ndarray], order, seq_len: int) -> np.ndarray:
    stream = np.concatenate([docs[i] for i in order])
    n = (len(stream) - 1) // seq_len
    idx = np.arange(n)[:, None] * seq_len + np.arange(seq_len + 1)[None, :]
    return stream[idx]


@torch.no_grad()
def evaluate(model, data: np.ndarray, batch: int) -> float:
    model.eval()
    total, count = 0.0, 0
    for i in range(0, len(data), batch):
        x = torch.from_numpy(data[i:i + batch].astype(np.int64))
        logits = model(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1),
                                                 reduction="sum")
        total += loss.item()
        count += x[:, 1:].numel()
    model.train()
    return total / max(count, 1)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--corpus", default="/work/demo_train/corpus")
    ap.add_argument("--tokenizer", default="/work/demo_train/tokenizer")
    ap.add_argument("--out", default="/work/demo_train/hf")
    ap.add_argument("--seed", type=int, default=1234)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--minutes", type=float, default=55.0, help="wall-clock limit for the training loop")
    ap.add_argument("--steps", type=int, default=1300, help="step limit (also the schedule's length)")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=256)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--min-lr-frac", type=float, default=0.05)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--aux-coef", type=float, default=0.01)
    ap.add_argument("--eval-every", type=int, default=200)
    ap.add_argument("--eval-windows", type=int, default=64, help="held-out windows for periodic evals")
    ap.add_argument("--log-every", type=int, default=25)
    ap.add_argument("--experts-implementation", default="eager")
    args = ap.parse_args(argv)

    t_start = time.time()
    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    np.random.seed(args.seed)
    rng = np.random.default_rng(args.seed)

    from tokenizers import Tokenizer
    from transformers import GenerationConfig, Qwen3MoeForCausalLM

    tok = Tokenizer.from_file(os.path.join(args.tokenizer, "tokenizer.json"))
    eot, im_end = tok.token_to_id("<|endoftext|>"), tok.token_to_id("<|im_end|>")
    train_docs = load_split(os.path.join(args.corpus, "train.jsonl"), tok, eot)
    held_docs = load_split(os.path.join(args.corpus, "heldout.jsonl"), tok, eot)
    held = windows(held_docs, range(len(held_docs)), args.seq_len)
    sub = held[np.linspace(0, len(held) - 1, min(args.eval_windows, len(held))).astype(int)]
    n_train_tok = sum(len(d) for d in train_docs)
    log(f"tokenized in {time.time() - t_start:.0f}s: train {len(train_docs)} docs {n_train_tok} tokens, "
        f"held-out {len(held_docs)} docs {len(held) * args.seq_len} tokens in {len(held)} windows")

    config = model_config(tok.get_vocab_size(), args.aux_coef)
    model = Qwen3MoeForCausalLM._from_config(config, experts_implementation=args.experts_implementation)
    model.float().train()
    n_params = sum(p.numel() for p in model.parameters())
    n_expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    active = n_params - n_expert + n_expert * config.num_experts_per_tok // config.num_experts
    log(f"model: {n_params / 1e6:.2f} M parameters ({n_expert / 1e6:.2f} M in experts, "
        f"{active / 1e6:.2f} M active per token); experts implementation {args.experts_implementation}")

    decay = [p for n, p in model.named_parameters() if p.ndim >= 2 and "norm" not in n]
    no_decay = [p for n, p in model.named_parameters() if not (p.ndim >= 2 and "norm" not in n)]
    opt = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                             {"params": no_decay, "weight_decay": 0.0}],
                            lr=args.lr, betas=(0.9, 0.95), eps=1e-8)

    def lr_at(step: int, progress: float) -> float:
        if step < args.warmup:
            return args.lr * (step + 1) / args.warmup
        p = min(1.0, progress)
        return args.lr * (args.min_lr_frac + (1 - args.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))

    budget = args.minutes * 60.0
    t0 = time.time()
    epoch, data, pos = 0, None, 0
    step, tokens_seen = 0, 0
    ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
    stop_reason = "steps"
    while step < args.steps:
        elapsed = time.time() - t0
        if elapsed >= budget:
            stop_reason = "time"
            break
        if data is None or pos + args.batch > len(data):
            data = windows(train_docs, rng.permutation(len(train_docs)), args.seq_len)
            pos = 0
            epoch += 1
            log(f"epoch {epoch}: {len(data)} windows")
        progress = max(step / args.steps, elapsed / budget)
        lr = lr_at(step, progress)
        for g in opt.param_groups:
            g["lr"] = lr
        x = torch.from_numpy(data[pos:pos + args.batch].astype(np.int64))
        pos += args.batch
        out = model(input_ids=x[:, :-1], output_router_logits=True)
        logits = out.logits
        ce = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), x[:, 1:].reshape(-1))
        loss = ce + args.aux_coef * out.aux_loss
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        step += 1
        tokens_seen += x[:, 1:].numel()
        ce_acc += ce.item()
        aux_acc += out.aux_loss.item()
        n_acc += 1
        if step % args.log_every == 0:
            el = time.time() - t0
            log(f"step {step} epoch {epoch} lr {lr:.2e} loss {ce_acc / n_acc:.4f} aux {aux_acc / n_acc:.4f} "
                f"tokens {tokens_seen} ({tokens_seen / el:.0f} tok/s) elapsed {el / 60:.1f} min")
            ce_acc, aux_acc, n_acc = 0.0, 0.0, 0
        if step % args.eval_every == 0:
            hl = evaluate(model, sub, args.batch)
            log(f"eval step {step}: held-out loss {hl:.4f} ppl {math.exp(hl):.2f} (subset of {len(sub)} windows)")

    train_s = time.time() - t0
    log(f"stopped by {stop_reason} after {step} steps, {tokens_seen} tokens, {train_s / 60:.1f} min")
    hl = evaluate(model, held, args.batch)
    log(f"final held-out loss {hl:.4f} ppl {math.exp(hl):.2f} on {len(held) * args.seq_len} tokens "
        f"({len(held)} windows of {args.seq_len})")

    # save: model, tokenizer files, generation config, training summary
    os.makedirs(args.out, exist_ok=True)
    model.config.output_router_logits = False
    model.save_pretrained(args.out)
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        shutil.copyfile(os.path.join(args.tokenizer, name), os.path.join(args.out, name))
    GenerationConfig(eos_token_id=[im_end, eot], pad_token_id=eot, bos_token_id=None, do_sample=True,
                     temperature=0.8, top_p=0.95).save_pretrained(args.out)
    summary = {"stop_reason": stop_reason, "steps": step, "tokens": tokens_seen, "epochs_started": epoch,
               "train_tokens_per_epoch": n_train_tok, "train_minutes": round(train_s / 60, 2),
               "total_minutes": round((time.time() - t_start) / 60, 2), "heldout_loss": round(hl, 4),
               "heldout_ppl": round(math.exp(hl), 3), "heldout_tokens": int(len(held) * args.seq_len),
               "parameters": n_params, "active_parameters": active, "args": vars(args),
               "torch": torch.__version__}
    with open(os.path.join(args.out, "training_summary.json"), "w") as f:
        json.dump(summary, f, indent=1)
    log(f"saved to {args.out}: {json.dumps(summary)}")


if __name__ == "__main__":
    sys.exit(main())
