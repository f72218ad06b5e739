import json

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


# --- headers are validated as the stock reader validates them (issue 16) -------------------------
def _two_tensor_file(tmp_path):
    p = tmp_path / "m.safetensors"
    _write(p, {"a": ("F32", np.arange(8, dtype=np.float32)), "b": ("F32", np.arange(8, 16, dtype=np.float32))})
    data = p.read_bytes()
    n = int.from_bytes(data[:8], "little")
    return p, json.loads(data[8: 8 + n]), data[8 + n:]


def _rewrite(p, header, body, pad_to=None, length_delta=0):
    blob = json.dumps(header).encode()
    if pad_to is not None:
        blob += b" " * (pad_to - len(blob))
    p.write_bytes((len(blob) + length_delta).to_bytes(8, "little") + blob + body)


def _stock_refuses(p) -> bool:
    try:
        with safe_open(p, "np") as f:
            for k in f.keys():
                f.get_tensor(k)
    except Exception:
        return True
    return False


@pytest.mark.parametrize("short", [1, 2, 3])
def test_a_header_length_a_few_bytes_short_is_refused(tmp_path, short):
    """The JSON's trailing spaces absorb a short length field; every tensor would read shifted."""
    p, header, body = _two_tensor_file(tmp_path)
    blob_len = len(json.dumps(header).encode())
    _rewrite(p, header, body, pad_to=blob_len + 8, length_delta=-short)
    assert _stock_refuses(p)
    with pytest.raises(ColiError, match="m.safetensors is corrupt"):
        SafetensorsFile(p)


@pytest.mark.parametrize("mutation, match", [
    (lambda h: h["b"].update(data_offsets=[0, 32]), "overlaps"),             # b aliases a
    (lambda h: h["a"].update(data_offsets=[8, 40]), "overlaps|gap|describes"),  # shifted into b
    (lambda h: (h["a"].update(data_offsets=[32, 64]), h["b"].update(data_offsets=[64, 96])), "gap"),
    (lambda h: h["a"].update(data_offsets=[0.0, 32.0]), "data_offsets"),
    (lambda h: h["a"].update(shape=["8"]), "shape"),
    (lambda h: h["a"].update(shape=[True] * 1), "shape"),
    (lambda h: h["a"].update(shape=[4]), "need"),
    (lambda h: h.pop("dtype", None) or h["a"].pop("data_offsets"), "needs dtype"),
    (lambda h: h.update(__metadata__=[1, 2]), "__metadata__"),
])
def test_bad_offsets_and_fields_are_refused(tmp_path, mutation, match):
    p, header, body = _two_tensor_file(tmp_path)
    mutation(header)
    _rewrite(p, header, body)
    with pytest.raises(ColiError, match=match):
        SafetensorsFile(p)


def test_nested_and_duplicate_headers_are_one_clear_error(tmp_path):
    p, header, body = _two_tensor_file(tmp_path)
    blob = b'{"x": ' + b"[" * 100000 + b"]" * 100000 + b"}"
    p.write_bytes(len(blob).to_bytes(8, "little") + blob + body)
    with pytest.raises(ColiError, match="not valid JSON"):
        SafetensorsFile(p)
    text = json.dumps(header)
    blob = (text[:-1] + ', "a": ' + json.dumps(header["a"]) + "}").encode()
    p.write_bytes(len(blob).to_bytes(8, "little") + blob + body)
    with pytest.raises(ColiError, match="names a twice"):
        SafetensorsFile(p)


def test_extra_bytes_after_the_data_are_refused(tmp_path):
    p, header, body = _two_tensor_file(tmp_path)
    _rewrite(p, header, body + b"\0" * 16)
    assert _stock_refuses(p)
    with pytest.raises(ColiError, match="describes"):
        SafetensorsFile(p)


def test_the_converter_refuses_a_source_with_a_shifted_header(tmp_path, capsys):
    """The converter's input reader is the same validated reader: one line, exit 1, no output."""
    from colibri_tui.cli import main as coli
    from tests.conftest import tiny_config, write_hf_model
    src = write_hf_model(tmp_path / "src", tiny_config())
    shard = sorted(src.glob("*.safetensors"))[0]
    data = shard.read_bytes()
    n = int.from_bytes(data[:8], "little")
    blob = data[8: 8 + n].rstrip(b" ")
    blob += b" " * 4
    shard.write_bytes((len(blob) - 2).to_bytes(8, "little") + blob + data[8 + n:])
    capsys.readouterr()
    assert coli(["convert", str(src), str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("coli: error:") and shard.name in err[0], err
    assert not (tmp_path / "out" / "colibri.json").exists()
