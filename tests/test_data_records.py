"""Tests of the record store (hfkit.data.records): format, checksums, atomic writes, multi-file datasets."""

from __future__ import annotations

import contextlib
import json
import os
import struct
import zlib
from pathlib import Path

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from hfkit.data.records import (
    CorruptRecordError,
    RecordDataset,
    RecordReader,
    RecordWriter,
    decode_sample,
    encode_sample,
    read_num_samples,
    validate,
    validate_dir,
)

DTYPES = [
    np.bool_,
    np.int8,
    np.uint8,
    np.int16,
    np.int32,
    np.int64,
    np.uint64,
    np.float16,
    np.float32,
    np.float64,
]


def _random_sample(rng: np.random.Generator, i: int) -> dict[str, np.ndarray]:
    sample: dict[str, np.ndarray] = {}
    for dtype in DTYPES:
        shape = tuple(int(s) for s in rng.integers(0, 5, size=rng.integers(0, 4)))
        if np.dtype(dtype).kind == "f":
            sample[np.dtype(dtype).name] = rng.normal(size=shape).astype(dtype)
        else:
            sample[np.dtype(dtype).name] = rng.integers(
                0, 2 if dtype is np.bool_ else 100, size=shape
            ).astype(dtype)
    sample["index"] = np.array(i, dtype=np.int64)
    sample["big"] = rng.normal(size=(64, 37, 3)).astype(np.float32)
    sample["fortran"] = np.asfortranarray(rng.normal(size=(3, 5)))
    return sample


def _assert_same(a: dict[str, np.ndarray], b: dict[str, np.ndarray]) -> None:
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert a[key].shape == b[key].shape, key
        np.testing.assert_array_equal(a[key], b[key], err_msg=key)


@pytest.mark.parametrize("num_samples", [None, 7])
def test_round_trip(tmp_path: Path, num_samples: int | None) -> None:
    rng = np.random.default_rng(0)
    samples = [_random_sample(rng, i) for i in range(7)]
    path = tmp_path / "a.ffr"
    with RecordWriter(path, num_samples=num_samples) as writer:
        for s in samples:
            writer.write(s)
    assert sorted(os.listdir(tmp_path)) == ["a.ffr"]  # no temp files left
    with RecordReader(path) as reader:
        assert len(reader) == 7
        for i, s in enumerate(samples):
            _assert_same(reader[i], s)
        _assert_same(reader[-1], samples[-1])
        batch = reader.read_batch([5, 0, 5])
        for got, i in zip(batch, [5, 0, 5], strict=True):
            _assert_same(got, samples[i])
        with pytest.raises(IndexError, match="a.ffr"):
            reader[7]
    assert validate(path).ok


def test_file_layout_is_ffrecord(tmp_path: Path) -> None:
    """Header = <meta crc u32><N u64><crc u32 x N><offset u64 x N>, payloads packed after it."""
    path = tmp_path / "a.ffr"
    payloads = [encode_sample({"x": np.arange(i + 1)}) for i in range(3)]
    with RecordWriter(path) as writer:
        for p in payloads:
            writer.write_bytes(p)
    raw = path.read_bytes()
    meta_crc, n = struct.unpack_from("<IQ", raw, 0)
    assert n == 3
    crcs = struct.unpack_from("<3I", raw, 12)
    offsets = struct.unpack_from("<3Q", raw, 24)
    assert meta_crc == zlib.crc32(raw[4 : 12 + 12 * n])
    assert list(crcs) == [zlib.crc32(p) for p in payloads]
    assert offsets[0] == 12 + 12 * n
    assert raw[offsets[0] :] == b"".join(payloads)


def test_strings_and_scalars(tmp_path: Path) -> None:
    sample = {
        "chain_id": "2q2k_A",
        "description": "héllo wörld",
        "names": np.array(["a", "", "ccc"]),
        "raw": np.array(b"bytes"),
        "n": 5,
        "res": 2.5,
        "flag": True,
        "np_scalar": np.float32(1.5),
    }
    got = decode_sample(encode_sample(sample))
    assert str(got["chain_id"]) == "2q2k_A" and got["chain_id"].shape == ()
    assert str(got["description"]) == "héllo wörld"
    assert got["names"].tolist() == ["a", "", "ccc"]
    assert str(got["raw"]) == "bytes"
    assert got["n"].dtype == np.int64 and got["n"].shape == () and int(got["n"]) == 5
    assert got["res"].dtype == np.float64 and float(got["res"]) == 2.5
    assert got["flag"].dtype == np.bool_ and bool(got["flag"])
    assert got["np_scalar"].dtype == np.float32 and got["np_scalar"].shape == ()


def test_payload_corruption_names_record(tmp_path: Path) -> None:
    path = tmp_path / "a.ffr"
    with RecordWriter(path) as writer:
        for i in range(4):
            writer.write({"x": np.full(100, i, dtype=np.int32)})
    with RecordReader(path) as reader:
        start, end = int(reader.offsets[2]), int(reader.ends[2])
    raw = bytearray(path.read_bytes())
    raw[(start + end) // 2] ^= 0xFF
    path.write_bytes(bytes(raw))

    reader = RecordReader(path)  # the header is intact, so it opens
    np.testing.assert_array_equal(reader[1]["x"], np.full(100, 1))
    with pytest.raises(CorruptRecordError, match=r"a\.ffr: record 2") as info:
        reader[2]
    assert info.value.index == 2 and info.value.path == str(path)
    assert isinstance(info.value, ValueError)
    with pytest.raises(CorruptRecordError):
        reader.read_batch([0, 2])
    reader.close()
    # Without verification the flipped byte goes unnoticed by the reader (but decoding may still fail).
    RecordReader(path, verify=False).read_bytes(2)

    report = validate(path)
    assert not report.ok and report.header_ok and report.bad_records == [2]
    assert "record 2" in str(report)


@pytest.mark.parametrize("where", ["count", "checksums", "offsets", "meta_crc"])
def test_header_corruption_detected(tmp_path: Path, where: str) -> None:
    path = tmp_path / "a.ffr"
    with RecordWriter(path) as writer:
        for i in range(3):
            writer.write({"x": np.arange(10 + i)})
    raw = bytearray(path.read_bytes())
    pos = {"meta_crc": 1, "count": 4, "checksums": 12 + 5, "offsets": 12 + 12 + 9}[where]
    raw[pos] ^= 0x01
    path.write_bytes(bytes(raw))
    with pytest.raises(CorruptRecordError, match="a.ffr") as info:
        RecordReader(path)
    assert info.value.index is None or where in ("count", "offsets")
    report = validate(path)  # never raises
    assert not report.ok and not report.header_ok


def test_truncated_and_missing_files(tmp_path: Path) -> None:
    path = tmp_path / "short.ffr"
    path.write_bytes(b"\x00" * 5)
    with pytest.raises(CorruptRecordError, match="shorter than the header"):
        RecordReader(path)
    assert not validate(path).ok
    assert not validate(tmp_path / "missing.ffr").ok
    with pytest.raises(FileNotFoundError):
        RecordReader(tmp_path / "missing.ffr")


class _Boom(Exception):
    pass


@pytest.mark.parametrize("num_samples", [None, 3])
@pytest.mark.parametrize("error", [_Boom, KeyboardInterrupt])
def test_interrupted_write_leaves_nothing(tmp_path: Path, num_samples: int | None, error: type) -> None:
    path = tmp_path / "a.ffr"
    with pytest.raises(error), RecordWriter(path, num_samples=num_samples) as writer:
        writer.write({"x": np.arange(3)})
        assert writer.tmp_path.exists()
        raise error()
    assert os.listdir(tmp_path) == []


def test_rewrite_keeps_old_file_until_complete(tmp_path: Path) -> None:
    path = tmp_path / "a.ffr"
    with RecordWriter(path) as writer:
        writer.write({"v": np.array(1)})
    with pytest.raises(_Boom), RecordWriter(path) as writer:
        writer.write({"v": np.array(2)})
        raise _Boom()
    assert int(RecordReader(path)[0]["v"]) == 1  # the old complete file is untouched


def test_wrong_sample_count(tmp_path: Path) -> None:
    path = tmp_path / "a.ffr"
    with pytest.raises(ValueError, match="num_samples=3"), RecordWriter(path, num_samples=3) as writer:
        writer.write({"x": np.arange(2)})
    assert os.listdir(tmp_path) == []
    with pytest.raises(ValueError, match="one more"), RecordWriter(path, num_samples=1) as writer:
        writer.write({"x": np.arange(2)})
        writer.write({"x": np.arange(2)})
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize(
    "value, match",
    [
        (np.array([object(), 1], dtype=object), "'bad'.*dtype object"),
        (np.array([1 + 2j]), "'bad'.*complex128"),
        ([1, 2, 3], "'bad'.*list"),
        (np.array([["a"]]), "'bad'.*0-d or 1-d"),
    ],
)
def test_unsupported_values_rejected(tmp_path: Path, value: object, match: str) -> None:
    path = tmp_path / "a.ffr"
    with pytest.raises(ValueError, match=match), RecordWriter(path) as writer:
        writer.write({"ok": np.arange(3), "bad": value})
    assert os.listdir(tmp_path) == []


def test_empty_store(tmp_path: Path) -> None:
    path = tmp_path / "empty.ffr"
    with RecordWriter(path):
        pass
    assert path.stat().st_size == 12
    reader = RecordReader(path)
    assert len(reader) == 0 and list(reader) == [] and reader.read_batch([]) == []
    with pytest.raises(IndexError):
        reader[0]
    report = validate(path)
    assert report.ok and report.num_samples == 0
    with RecordWriter(tmp_path / "empty0.ffr", num_samples=0):
        pass
    assert len(RecordReader(tmp_path / "empty0.ffr")) == 0


def _write_files(tmp_path: Path, counts: list[int]) -> list[Path]:
    paths, k = [], 0
    for f, count in enumerate(counts):
        path = tmp_path / f"records-{f:05d}.ffr"
        with RecordWriter(path) as writer:
            for _ in range(count):
                writer.write(
                    {"global": np.array(k), "file": np.array(f), "x": np.full((2, 3), k, np.float32)}
                )
                k += 1
        paths.append(path)
    return paths


def test_many_files_dataset(tmp_path: Path) -> None:
    counts = [3, 0, 1, 5, 2]
    paths = _write_files(tmp_path, counts)
    ds = RecordDataset(paths)
    assert len(ds) == sum(counts)
    for k in range(len(ds)):
        assert int(ds[k]["global"]) == k
    assert ds.locate(3) == (2, 0) and ds.locate(-1) == (4, 1)
    assert int(ds[-1]["global"]) == len(ds) - 1
    with pytest.raises(IndexError):
        ds[len(ds)]
    # A directory means its *.ffr files in name order.
    assert len(RecordDataset(tmp_path)) == len(ds)
    assert [r.ok for r in validate_dir(tmp_path)] == [True] * len(counts)


@pytest.mark.parametrize("workers", [0, 2])
def test_dataset_through_dataloader(tmp_path: Path, workers: int) -> None:
    paths = _write_files(tmp_path, [4, 3, 5])
    ds = RecordDataset(paths)
    ds[0]  # opens a reader (an mmap) in the parent before workers fork
    loader = DataLoader(ds, batch_size=3, num_workers=workers, shuffle=False)
    seen = torch.cat([batch["global"] for batch in loader])
    assert seen.tolist() == list(range(12))


def test_reader_after_fork_and_pickle(tmp_path: Path) -> None:
    import pickle

    (path,) = _write_files(tmp_path, [3])
    reader = RecordReader(path)
    clone = pickle.loads(pickle.dumps(reader))
    assert int(clone[2]["global"]) == 2
    ds = pickle.loads(pickle.dumps(RecordDataset([path])))
    assert int(ds[1]["global"]) == 1


def test_decode_without_copy_gives_read_only_views() -> None:
    """copy=False: the same arrays as the copying decoder, as views of the payload bytes."""
    rng = np.random.default_rng(5)
    for i in range(4):
        sample = _random_sample(rng, i)
        sample["name"] = f"chain_{i}"
        payload = encode_sample(sample)
        copied, views = decode_sample(payload), decode_sample(payload, copy=False)
        _assert_same(copied, views)
        for key, value in views.items():
            if value.dtype.kind not in "US":
                assert not value.flags.writeable, key
                assert value.base is not None, key  # a view, not a copy
        # A writable buffer gives writable views.
        assert all(v.flags.writeable for v in decode_sample(bytearray(payload), copy=False).values())


def _with_header(header: dict[str, object], data: bytes) -> bytes:
    raw = json.dumps(header).encode()
    return struct.pack("<Q", len(raw)) + raw + data


@pytest.mark.parametrize(
    "header",
    [
        {"a": {"dtype": "F32", "shape": [2], "data_offsets": [0, 4]}},  # size does not match shape
        {"a": {"dtype": "F32", "shape": [1], "data_offsets": [4, 8]}},  # a gap before it
        {
            "a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]},
            "b": {"dtype": "U8", "shape": [4], "data_offsets": [2, 6]},
        },
        {"a": {"dtype": "BF16", "shape": [4], "data_offsets": [0, 8]}},  # no numpy dtype
        {"a": {"dtype": "U8", "shape": [-8], "data_offsets": [0, 8]}},
        {"a": {"dtype": "U8", "shape": [4], "data_offsets": [0, 4]}},  # 4 trailing bytes
        {"a": {"dtype": "U8", "shape": [16], "data_offsets": [0, 16]}},  # runs past the end
        {"a": [1, 2]},
        {"__metadata__": [1]},
    ],
)
def test_decode_without_copy_rejects_what_safetensors_rejects(header: dict[str, object]) -> None:
    payload = _with_header(header, bytes(8))
    with pytest.raises(ValueError):
        decode_sample(payload)
    with pytest.raises(ValueError):
        decode_sample(payload, copy=False)


def test_decode_without_copy_of_damaged_payloads_raises_only_value_error() -> None:
    payload = encode_sample(_random_sample(np.random.default_rng(6), 0))
    rng = np.random.default_rng(7)
    for _ in range(300):
        damaged = bytearray(payload)
        if rng.random() < 0.5:
            damaged = damaged[: int(rng.integers(0, len(damaged)))]
        else:
            at = int(rng.integers(0, min(len(damaged), 400)))  # the header, mostly
            damaged[at] = int(rng.integers(0, 256))
        with contextlib.suppress(ValueError):  # anything else fails the test
            decode_sample(bytes(damaged), copy=False)


def test_read_view_is_checked_and_outlives_close(tmp_path: Path) -> None:
    """read_view: the payload without a copy, CRC-checked; views stay valid after close()."""
    path = tmp_path / "v.ffr"
    with RecordWriter(path) as writer:
        for i in range(3):
            writer.write({"x": np.arange(i, i + 33, dtype=np.int16)})
    reader = RecordReader(path)
    view = reader.read_view(1)
    assert isinstance(view, memoryview) and view.readonly and bytes(view) == reader.read_bytes(1)
    arrays = decode_sample(view, copy=False)
    reader.close()  # the live view keeps the mapping: no BufferError, data intact
    np.testing.assert_array_equal(arrays["x"], np.arange(1, 34))
    assert not arrays["x"].flags.writeable
    np.testing.assert_array_equal(reader[2]["x"], np.arange(2, 35))  # maps the file again
    reader.close()

    start, end = int(reader.offsets[0]), int(reader.ends[0])
    raw = bytearray(path.read_bytes())
    raw[end - 1] ^= 0x01
    path.write_bytes(bytes(raw))
    with RecordReader(path) as damaged, pytest.raises(CorruptRecordError, match="record 0"):
        damaged.read_view(0)
    assert start < end


# --------------------------------------------------------------------------------------------------
# hostile records: crafted by the writer (valid CRCs), with hfkit's own metadata or the count patched
# --------------------------------------------------------------------------------------------------

_STRING_SAMPLE = {"name": "abc", "names": np.array(["ab", "", "cde"]), "x": np.arange(4, dtype=np.int32)}


def _with_metadata(payload: bytes, metadata: object) -> bytes:
    """`payload` (from encode_sample) with its safetensors `__metadata__` replaced by `metadata`."""
    (n,) = struct.unpack_from("<Q", payload, 0)
    header = json.loads(payload[8 : 8 + n])
    header["__metadata__"] = metadata
    return _with_header(header, payload[8 + n :])


def _crafted_file(path: Path, payload: bytes) -> Path:
    """A record file of a good sample and `payload` (record 1), written by RecordWriter: CRCs valid."""
    with RecordWriter(path) as writer:
        writer.write(_STRING_SAMPLE)
        writer.write_bytes(payload)
    return path


_BOMB_ITEMS = 2_500  # empty strings beside one of 20 000 bytes: a 2501 x 20000 str array (200 MB)

_STRING_ATTACKS = {
    "names-no-tensor": '{"missing": 3}',
    "not-an-object": "[1, 2]",
    "names-an-int32-tensor": '{"x": 16}',
    "length-a-string": '{"name": "3"}',
    "length-null": '{"names": [2, null, 3]}',
    "length-float": '{"names": 2.5}',
    "length-bool": '{"names": [true, true, 3]}',
    "length-overflows-int64": '{"names": [2, 18446744073709551616, 3]}',
    "length-negative": '{"names": [2, -2, 5]}',
    "lengths-sum-short": '{"names": [2, 0, 2]}',
    "lengths-sum-long": '{"names": [2, 0, 4]}',
    "0d-length-mismatch": '{"name": 5}',
    "nested-too-deep": "[" * 100_000,
}


def _string_attack(name: str) -> bytes:
    if name == "not-a-string":
        return _with_metadata(encode_sample(_STRING_SAMPLE), {"hfkit.strings": {"name": 3}})
    if name == "decode-bomb":
        long = "a" * 20_000
        payload = encode_sample({"names": np.array([long, "b"])})
        lengths = [0] * _BOMB_ITEMS + [20_001]
        return _with_metadata(payload, {"hfkit.strings": json.dumps({"names": lengths})})
    return _with_metadata(encode_sample(_STRING_SAMPLE), {"hfkit.strings": _STRING_ATTACKS[name]})


@pytest.mark.parametrize("attack", [*_STRING_ATTACKS, "not-a-string", "decode-bomb"])
def test_hostile_string_metadata_is_corruption(tmp_path: Path, attack: str) -> None:
    """Every inconsistency in hfkit's metadata is a CorruptRecordError naming the record, in both decode
    paths alike, and a not-ok verdict from validate (which raises nothing)."""
    payload = _string_attack(attack)
    with pytest.raises(ValueError):
        decode_sample(payload)
    with pytest.raises(ValueError):
        decode_sample(payload, copy=False)
    path = _crafted_file(tmp_path / "a.ffr", payload)
    with RecordReader(path) as reader:
        assert str(reader[0]["name"]) == "abc"
        with pytest.raises(CorruptRecordError, match=r"a\.ffr: record 1") as info:
            reader[1]
        assert info.value.index == 1
    report = validate(path)
    assert not report.ok and report.header_ok and report.bad_records == [1]


def test_string_arrays_the_decoder_would_refuse_are_not_written() -> None:
    """encode_sample refuses string arrays too wide to decode within the payload's memory budget; the
    same strings in a compact shape (one 0-d string) are fine."""
    uneven = np.array(["a" * 20_000] + [""] * _BOMB_ITEMS)
    with pytest.raises(ValueError, match="decode to"):
        encode_sample({"names": uneven})
    assert str(decode_sample(encode_sample({"text": "a" * 20_000}))["text"]) == "a" * 20_000


def _patched_count(path: Path, count: int, fix_crc: bool) -> None:
    raw = bytearray(path.read_bytes())
    struct.pack_into("<Q", raw, 4, count)
    if fix_crc:
        end = min(12 + 12 * count, len(raw))
        struct.pack_into("<I", raw, 0, zlib.crc32(raw[4:end]))
    path.write_bytes(bytes(raw))


@pytest.mark.parametrize(
    "count, fix_crc",
    [(3 ^ (1 << 24), False), (3 ^ (1 << 63), False), (2, False), (2, True), (4, True)],
    ids=["bit24", "bit63", "fewer", "fewer-crc-fixed", "more-crc-fixed"],
)
def test_damaged_count_refused_wherever_a_file_opens(tmp_path: Path, count: int, fix_crc: bool) -> None:
    (path,) = _write_files(tmp_path, [3])
    _patched_count(path, count, fix_crc)
    with pytest.raises(CorruptRecordError, match="records-00000.ffr: (header|record)"):
        read_num_samples(path)
    with pytest.raises(CorruptRecordError):
        RecordDataset([path])
    with pytest.raises(CorruptRecordError):
        RecordDataset(tmp_path)
    with pytest.raises(CorruptRecordError):
        RecordReader(path)
    assert not validate(path).ok


def test_preprocessed_folder_without_index_checks_counts(tmp_path: Path) -> None:
    """A folder of record files (no index.json) with a flipped count bit is refused, not a huge dataset."""
    from hfkit.data.dataset import PreprocessedDataset
    from hfkit.data.msa_sampling import FeatureConfig

    (path,) = _write_files(tmp_path, [3])
    _patched_count(path, 3 ^ (1 << 20), fix_crc=False)
    with pytest.raises(CorruptRecordError, match="records-00000.ffr: header: header claims 1048579 samples"):
        PreprocessedDataset(tmp_path, FeatureConfig.tiny())


def test_entry_points_name_the_argument_for_wrong_kinds_of_path(tmp_path: Path) -> None:
    (path,) = _write_files(tmp_path, [2])
    folder = tmp_path
    with pytest.raises(ValueError, match=r"path: .* is a directory, expected a record file.*validate_dir"):
        validate(folder)
    with pytest.raises(ValueError, match="path: .* is a directory"):
        RecordReader(folder)
    with pytest.raises(ValueError, match="path: .* is a directory"):
        read_num_samples(folder)
    with pytest.raises(ValueError, match="path: .* is a directory"):
        RecordWriter(folder)
    with pytest.raises(ValueError, match="paths: .* is a directory"):
        RecordDataset([folder])
    with pytest.raises(ValueError, match="directory: .* is a file"):
        validate_dir(path)
    with pytest.raises(FileNotFoundError, match="directory: .* does not exist"):
        validate_dir(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="path: .* does not exist"):
        RecordReader(tmp_path / "nope.ffr")
    with pytest.raises(FileNotFoundError, match="paths: .* does not exist"):
        RecordDataset(tmp_path / "nope.ffr")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"paths: no \*\.ffr files"):
        RecordDataset(tmp_path / "empty")
    assert os.listdir(tmp_path / "empty") == []  # the refused writer made nothing


def test_random_string_metadata_same_verdict_with_and_without_copy() -> None:
    """Random hfkit.strings values: both decode paths either give the same arrays or both raise
    ValueError (nothing else), and what they accept decodes to exactly the tensor's bytes."""
    payload = encode_sample(_STRING_SAMPLE)
    rng = np.random.default_rng(11)
    atoms = [0, 1, 2, 3, 5, -1, -3, 2**64, True, None, 1.5, "2", [], [1], {}]

    def value() -> object:
        if rng.random() < 0.6:
            return [atoms[int(i)] for i in rng.integers(0, len(atoms), size=int(rng.integers(0, 5)))]
        return atoms[int(rng.integers(0, len(atoms)))]

    accepted = 0
    for _ in range(400):
        keys = rng.choice(["name", "names", "x", "missing"], size=int(rng.integers(1, 3)), replace=False)
        strings = {str(k): value() for k in keys}
        crafted = _with_metadata(payload, {"hfkit.strings": json.dumps(strings)})
        verdicts = []
        for copy in (True, False):
            try:
                verdicts.append(decode_sample(crafted, copy=copy))
            except ValueError:
                verdicts.append(None)
        assert (verdicts[0] is None) == (verdicts[1] is None), strings
        if verdicts[0] is not None:
            accepted += 1
            _assert_same(verdicts[0], verdicts[1])
            for key, lengths in strings.items():
                decoded = verdicts[0][key]
                items = [str(decoded)] if decoded.ndim == 0 else decoded.tolist()
                assert "".join(items).encode() == {"name": b"abc", "names": b"abcde"}[key], strings
                assert [len(s.encode()) for s in items] == ([lengths] if decoded.ndim == 0 else lengths)
    assert accepted > 0
