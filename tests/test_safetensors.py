import numpy as np
import pytest
from safetensors import safe_open

from core.errors import ColiError
from core.safetensors_io import SafetensorsFile, SafetensorsWriter, bf16_from_float32, to_float32


def _write(path, tensors, metadata=None):
    w = SafetensorsWriter(path, [(n, d, a.shape) for n, (d, a) in tensors.items()], metadata)
    for n, (_, a) in tensors.items():
        w.write(n, a)
    w.commit()


def test_our_files_open_with_the_stock_reader_in_our_order(tmp_path):
    rng = np.random.default_rng(0)
    t = {"b.weight": ("U8", rng.integers(0, 255, (3, 5), dtype=np.uint8)),
         "b.weight.qs": ("F32", rng.standard_normal((3, 1)).astype(np.float32)),
         "a.vec": ("F32", rng.standard_normal(7).astype(np.float32))}
    p = tmp_path / "x.safetensors"
    _write(p, t, {"format": "colibri"})
    with safe_open(p, "np") as f:
        assert f.metadata() == {"format": "colibri"}
        for n, (_, a) in t.items():
            np.testing.assert_array_equal(f.get_tensor(n), a)
    ours = SafetensorsFile(p)
    starts = [ours.tensors[n].start for n in t]
    assert starts == sorted(starts), "tensors must be laid out in the order given"
    np.testing.assert_array_equal(ours.raw("b.weight", 1, 3), t["b.weight"][1][1:3])


def test_row_blocks_written_at_offsets(tmp_path):
    a = np.arange(20, dtype=np.float32).reshape(5, 4)
    w = SafetensorsWriter(tmp_path / "y.safetensors", [("m", "F32", a.shape)])
    w.write("m", a[3:], 3 * 16)
    w.write("m", a[:3])
    w.commit()
    np.testing.assert_array_equal(SafetensorsFile(tmp_path / "y.safetensors").float32("m"), a)


def test_bf16_round_trip_and_fp8_values():
    x = np.array([1.0, -2.5, 3.14159, 1e-3], dtype=np.float32)
    back = to_float32(bf16_from_float32(x), "BF16")
    assert np.allclose(back, x, rtol=1 / 128)
    fp8 = np.array([0x38, 0xB8, 0x7E, 0x01, 0x00, 0x40], dtype=np.uint8)
    np.testing.assert_array_equal(to_float32(fp8, "F8_E4M3"), [1.0, -1.0, 448.0, 2.0 ** -9, 0.0, 2.0])
    assert np.isnan(to_float32(np.array([0x7F], np.uint8), "F8_E4M3"))[0]


def test_truncated_and_corrupt_files_are_named(tmp_path):
    p = tmp_path / "model-00002-of-00002.safetensors"
    _write(p, {"w": ("F32", np.ones((64, 64), np.float32))})
    data = p.read_bytes()
    p.write_bytes(data[:-100])
    with pytest.raises(ColiError, match="model-00002-of-00002.safetensors is truncated"):
        SafetensorsFile(p)
    p.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json!!!!!!}" + data[100:])
    with pytest.raises(ColiError, match="not valid JSON"):
        SafetensorsFile(p)
    p.write_bytes(b"abc")
    with pytest.raises(ColiError, match="truncated or not a safetensors file"):
        SafetensorsFile(p)
