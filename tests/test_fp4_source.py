"""A release's FP4 / FP8 tensors with DeepSeek's ``.scale`` companions (F8_E8M0), malformed: each
refused by ``coli convert`` in one line naming the tensor, nothing written."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest

from tests.conftest import COMMITTED, one_error_line

HUB = COMMITTED / "dsv4-a" / "hub"
EXPERT = "layers.1.ffn.experts.0.w1"
DENSE = "layers.1.attn.wq_b"


def _edited(tmp_path: Path, edit) -> Path:
    """A copy of the dsv4-a Hub checkpoint with one file's tensors changed by ``edit(tensors)``
    (written back with the original dtypes: F8_E8M0 / F8_E4M3 bytes as raw U8 re-labelled)."""
    from tests.oracle.hub_formats import read_raw
    src = tmp_path / "hub"
    shutil.copytree(HUB, src)
    tensors = {n: (dt, np.array(a)) for n, (dt, a) in read_raw(str(src)).items()}
    edit(tensors)
    _write_raw(src / "model.safetensors", tensors)
    return src


def _write_raw(path: Path, tensors: dict) -> None:
    """A safetensors file of (dtype label, stored array) pairs, labels as given (F8_E8M0 ...)."""
    header, blobs, at = {}, [], 0
    for name, (dtype, a) in tensors.items():
        b = np.ascontiguousarray(a).tobytes()
        header[name] = {"dtype": dtype, "shape": list(a.shape), "data_offsets": [at, at + len(b)]}
        blobs.append(b)
        at += len(b)
    head = json.dumps(header).encode()
    head += b" " * (-len(head) % 8)
    path.write_bytes(len(head).to_bytes(8, "little") + head + b"".join(blobs))


def _convert_error(capsys, tmp_path, src) -> str:
    out = tmp_path / "out"
    line = one_error_line(capsys, ["convert", str(src), str(out)])
    assert not (out / "colibri.json").exists()
    return line


def test_nan_scale_is_refused_at_convert(capsys, tmp_path):
    def nan(t):
        t[EXPERT + ".scale"][1][0, 0] = 255
    line = _convert_error(capsys, tmp_path, _edited(tmp_path, nan))
    assert EXPERT in line and "NaN" in line


def test_fp4_scale_of_the_wrong_shape_is_refused(capsys, tmp_path):
    def short(t):
        dtype, a = t[EXPERT + ".scale"]
        t[EXPERT + ".scale"] = (dtype, np.ascontiguousarray(a[:-1]))
    line = _convert_error(capsys, tmp_path, _edited(tmp_path, short))
    assert EXPERT + ".scale" in line and "groups of 32" in line


def test_fp4_codes_of_the_wrong_byte_count_are_refused(capsys, tmp_path):
    def narrow(t):
        dtype, a = t[EXPERT + ".weight"]
        t[EXPERT + ".weight"] = (dtype, np.ascontiguousarray(a[:, :-1]))
    line = _convert_error(capsys, tmp_path, _edited(tmp_path, narrow))
    assert "w1" in line


def test_fp8_block_scale_of_the_wrong_shape_is_refused(capsys, tmp_path):
    def short(t):
        dtype, a = t[DENSE + ".scale"]
        t[DENSE + ".scale"] = (dtype, np.concatenate([a, a], axis=0))
    line = _convert_error(capsys, tmp_path, _edited(tmp_path, short))
    assert DENSE + ".scale" in line and "blocks" in line
