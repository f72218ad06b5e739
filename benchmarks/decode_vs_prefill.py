"""Decode through the caches (recurrent state, KV) against prefill of the same positions.

    python benchmarks/decode_vs_prefill.py [FIXTURE ...] [--bits 16,4]

Each committed oracle fixture (tests/oracle/fixtures/<name>; default: the linear-attention
hybrids qwen35moe-a/-b and kimilinear-a/-b) is converted with `coli convert` into a temporary
folder, and the logits of one prefill of all its ids are compared with a prefill of the first 5
then one-token decode steps: the max |delta logit| and where, next to the logits' scale. The
difference is float32 rounding of products computed for one row against many (issue 18; the
bits-16 products are row-invariant since cython_kernels/dense.h). Prints numbers; asserts nothing.
"""
from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
FIXTURES = ROOT / "tests" / "oracle" / "fixtures"
DEFAULT = ("qwen35moe-a", "qwen35moe-b", "kimilinear-a", "kimilinear-b")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="decode_vs_prefill.py", description=__doc__.splitlines()[0])
    ap.add_argument("fixtures", nargs="*", default=list(DEFAULT))
    ap.add_argument("--bits", default="16,4")
    a = ap.parse_args(argv)
    import numpy as np

    from colibri_tui.cli import main as coli
    from core import kernels
    from models import open_model
    print(f"kernels: {kernels.backend()} {kernels.simd_level()}; dense products: "
          f"{'dense.h' if kernels._dense_compiled() else 'numpy'}")
    with tempfile.TemporaryDirectory() as tmp:
        for name in a.fixtures:
            src = FIXTURES / name / "model"
            if not src.is_dir():
                raise SystemExit(f"decode_vs_prefill.py: error: no fixture {name} under {FIXTURES}")
            ids = np.load(FIXTURES / name / "reference.npz")["ids"].tolist()
            for bits in (int(b) for b in a.bits.split(",")):
                out = Path(tmp) / f"{name}-{bits}"
                if coli(["convert", str(src), str(out), "--bits", str(bits)]) != 0:
                    raise SystemExit(f"decode_vs_prefill.py: error: {name} did not convert")
                engine = open_model(out)
                full = engine.logits(ids)
                cache = engine.new_cache()
                step = [engine.forward(ids[:5], cache)[-1]] + [engine.forward([t], cache)[-1] for t in ids[5:]]
                d = np.abs(np.stack(step) - full[4:])
                print(f"{name:14s} bits {bits:2d}: max |delta logit| {d.max():.3g} at position "
                      f"{int(d.max(1).argmax()) + 4} of {len(ids)} (logits up to {np.abs(full).max():.3g})", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
