"""Record store: ffrecord-compatible files of checksummed samples, each a safetensors dict of arrays.

File layout (all integers little-endian; the same as High-Flyer's ffrecord, so its readers can open our
files and ours theirs)::

    offset 0          uint32   meta_crc     CRC32 of the bytes [4, 12 + 12 * N): N, checksums, offsets
    offset 4          uint64   N            number of samples
    offset 12         uint32   checksums[N] CRC32 (zlib) of each sample's payload
    offset 12 + 4N    uint64   offsets[N]   absolute file offset of each payload
    offset 12 + 12N   payload 0, payload 1, ..., payload N-1   (packed, no padding)

A payload runs from its offset to the next one (the last to the end of the file). Every payload is
the bytes of a safetensors file (`safetensors.numpy.save`) holding one sample `dict[str, np.ndarray]`;
never a pickle, so a record file can be read without trusting whoever wrote it.

Values that safetensors cannot hold are stored as follows (see `encode_sample`):

- Python `int`, `float`, `bool` → 0-d arrays of int64, float64, bool (read back as 0-d arrays;
  use `int(x)` / `x.item()`).
- `str` and 0-d/1-d arrays of str (numpy dtype `U`) or bytes (`S`) → a uint8 array of the UTF-8
  bytes of all items, concatenated; the safetensors metadata entry `hfkit.strings` (JSON) records,
  per such key, the item lengths (an int for a 0-d string, a list for a 1-d one). They are read back
  as numpy `str` arrays of the same shape (`str(x)` gives the Python string of a 0-d one). numpy
  str arrays are fixed-width (every item as wide as the longest, 4 bytes a character), so the
  string arrays of one sample may take at most `_STRING_GROWTH` times its payload size plus
  `_STRING_ALLOWANCE` bytes once decoded: `encode_sample` refuses more, `decode_sample` too.
- object, complex and other dtypes are refused with a `ValueError` naming the key.

Decoding trusts nothing in a payload: the safetensors header and hfkit's own metadata are checked
(types, lengths, their sums against the data, the memory a decode may allocate) before an array is
made, the same way with and without copying, and a bad payload is a `ValueError`.

`RecordWriter` writes to `<path>.tmp-<pid>` and renames onto `<path>` only when closed cleanly, so a
record file that exists is complete. `RecordReader` memory-maps a file, checks the header CRC when it
opens and each payload's CRC when it reads, and raises `CorruptRecordError` naming the file and the
record. `RecordDataset` joins several files into one indexable dataset that opens its readers lazily
in each process (DataLoader workers never share a parent's mmap).
"""

from __future__ import annotations

import bisect
import contextlib
import itertools
import json
import math
import mmap
import os
import shutil
import struct
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
from safetensors.numpy import save as _st_save

__all__ = [
    "RECORD_SUFFIX",
    "CorruptRecordError",
    "RecordDataset",
    "RecordReader",
    "RecordWriter",
    "ValidationReport",
    "decode_sample",
    "encode_sample",
    "read_num_samples",
    "validate",
    "validate_dir",
]

RECORD_SUFFIX = ".ffr"
_HEAD = struct.Struct("<IQ")  # meta_crc, N
_HEAD_SIZE = _HEAD.size  # 12
_PER_SAMPLE = 4 + 8  # one uint32 checksum + one uint64 offset
_STRINGS_KEY = "hfkit.strings"
# Decoded str arrays of one sample may take _STRING_GROWTH x its payload bytes + _STRING_ALLOWANCE.
_STRING_GROWTH = 64
_STRING_ALLOWANCE = 1 << 20
_MAX_DIM = 2**63 - 1  # numpy's largest array dimension
# dtypes that safetensors stores and numpy has natively (bfloat16/float8 have no numpy dtype).
_SUPPORTED_DTYPES = frozenset(
    np.dtype(t).str.lstrip("<>|=")
    for t in (
        np.bool_,
        np.int8,
        np.int16,
        np.int32,
        np.int64,
        np.uint8,
        np.uint16,
        np.uint32,
        np.uint64,
        np.float16,
        np.float32,
        np.float64,
    )
)

Sample = dict[str, np.ndarray]


class CorruptRecordError(ValueError):
    """A record file whose header or one of whose payloads fails its checksum or cannot be decoded.

    `path` is the file; `index` the bad record (None when the header itself is bad).
    """

    def __init__(self, path: str | os.PathLike[str], index: int | None, reason: str) -> None:
        self.path = str(path)
        self.index = index
        self.reason = reason
        where = "header" if index is None else f"record {index}"
        super().__init__(f"{self.path}: {where}: {reason}")


# --------------------------------------------------------------------------------------------------
# payload encoding
# --------------------------------------------------------------------------------------------------


def _encode_strings(key: str, value: Any) -> tuple[np.ndarray, int | list[int]]:
    """UTF-8 bytes of a str or 0-d/1-d str/bytes array, concatenated, and the item lengths."""
    if isinstance(value, str):
        raw = value.encode("utf-8")
        return np.frombuffer(raw, dtype=np.uint8).copy(), len(raw)
    arr = np.asarray(value)
    if arr.ndim > 1:
        raise ValueError(f"sample[{key!r}]: string arrays must be 0-d or 1-d, got shape {arr.shape}")
    items = [x.encode("utf-8") if isinstance(x, str) else bytes(x) for x in arr.reshape(-1).tolist()]
    data = np.frombuffer(b"".join(items), dtype=np.uint8).copy()
    lengths = [len(x) for x in items]
    return data, (lengths[0] if arr.ndim == 0 else lengths)


def encode_sample(sample: Mapping[str, Any]) -> bytes:
    """Serialize one sample (`{name: array | str | int | float | bool}`) to safetensors bytes.

    Arrays keep dtype and shape (made C-contiguous and little-endian); Python scalars become 0-d
    arrays; strings become UTF-8 uint8 arrays with their lengths in the safetensors metadata (see the
    module docstring). Raises `ValueError` naming the key for object, complex or other dtypes that
    safetensors and numpy cannot both hold, and for keys that are not non-empty strings; and for
    string arrays that would decode to more memory than `decode_sample` allows the payload.
    """
    if not isinstance(sample, Mapping):
        raise ValueError(f"sample: expected a dict of arrays, got {type(sample).__name__}")
    tensors: dict[str, np.ndarray] = {}
    strings: dict[str, int | list[int]] = {}
    for key, value in sample.items():
        if not isinstance(key, str) or not key:
            raise ValueError(f"sample: keys must be non-empty str, got {key!r}")
        if isinstance(value, str) or (isinstance(value, np.ndarray) and value.dtype.kind in "US"):
            tensors[key], strings[key] = _encode_strings(key, value)
            continue
        if isinstance(value, bool | int | float | np.generic):
            value = np.asarray(value)
            if value.dtype.kind == "i":
                value = value.astype(np.int64)
        if not isinstance(value, np.ndarray):
            raise ValueError(
                f"sample[{key!r}]: expected a numpy array, str, int, float or bool, "
                f"got {type(value).__name__}"
            )
        if value.dtype.kind in "US":
            tensors[key], strings[key] = _encode_strings(key, value)
            continue
        if value.dtype.str.lstrip("<>|=") not in _SUPPORTED_DTYPES:
            raise ValueError(
                f"sample[{key!r}]: dtype {value.dtype} cannot be stored; supported: bool, (u)int8-64, "
                "float16/32/64 arrays, str, int, float, bool"
            )
        # safetensors is little-endian by definition; a big-endian array would be read back byte-swapped.
        # (np.asarray, not ascontiguousarray, which would turn a 0-d array into a 1-d one.)
        tensors[key] = np.asarray(value, dtype=value.dtype.newbyteorder("<"), order="C")
    metadata = {_STRINGS_KEY: json.dumps(strings)} if strings else None
    payload = _st_save(tensors, metadata=metadata)
    need = sum(_decoded_string_nbytes(lengths) for lengths in strings.values())
    if need > _string_budget(len(payload)):
        raise ValueError(
            f"sample: its string arrays would decode to {need:,} bytes (numpy str arrays are as wide as "
            f"their longest item), more than the {_string_budget(len(payload)):,} a {len(payload):,}-byte "
            "payload may; store long strings of very uneven lengths as uint8 arrays"
        )
    return payload


# safetensors dtype names -> numpy (little-endian); BF16 and F8 have no numpy dtype.
_ST_DTYPES = {
    "BOOL": np.dtype(np.bool_),
    "U8": np.dtype("u1"),
    "I8": np.dtype("i1"),
    "I16": np.dtype("<i2"),
    "U16": np.dtype("<u2"),
    "F16": np.dtype("<f2"),
    "I32": np.dtype("<i4"),
    "U32": np.dtype("<u4"),
    "F32": np.dtype("<f4"),
    "I64": np.dtype("<i8"),
    "U64": np.dtype("<u8"),
    "F64": np.dtype("<f8"),
}


def _json(text: str | bytes, what: str) -> Any:
    """`json.loads(text)`, raising only `ValueError` (a deeply nested document raises RecursionError)."""
    try:
        return json.loads(text)
    except RecursionError:
        raise ValueError(f"{what}: JSON nested too deeply") from None
    except ValueError as err:
        raise ValueError(f"{what}: not JSON ({err})") from None


def _is_int(value: object) -> bool:
    return type(value) is int  # not bool, which JSON's true/false become


def _st_views(data: bytes | bytearray | memoryview) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """Arrays of a safetensors payload as views of `data` (no copy), and its metadata.

    Checks what safetensors' own loader checks: a UTF-8 JSON object header, known dtypes, shapes of
    non-negative ints, tensors that tile the data region exactly, in order, without overlap, and
    metadata of str values. Raises `ValueError` for anything else.
    """
    size = len(data)
    if size < 8:
        raise ValueError(f"payload of {size} bytes is shorter than the 8-byte header length")
    (n,) = struct.unpack_from("<Q", data, 0)
    if n > size - 8:
        raise ValueError(f"header length {n} runs past the payload end ({size} bytes)")
    header = _json(bytes(memoryview(data)[8 : 8 + n]).decode("utf-8"), "header")
    if not isinstance(header, dict):
        raise ValueError("header is not a JSON object")
    meta = header.pop("__metadata__", None) or {}
    if not isinstance(meta, dict) or not all(isinstance(v, str) for v in meta.values()):
        raise ValueError("__metadata__ is not a JSON object of strings")
    start = 8 + n
    spans = []
    for key, info in header.items():
        if not isinstance(info, dict) or info.get("dtype") not in _ST_DTYPES:
            raise ValueError(f"tensor {key!r}: bad entry or unsupported dtype")
        shape, offsets = info.get("shape"), info.get("data_offsets")
        if not isinstance(shape, list) or not all(_is_int(d) and 0 <= d <= _MAX_DIM for d in shape):
            raise ValueError(f"tensor {key!r}: bad shape {shape!r}")
        if not (isinstance(offsets, list) and len(offsets) == 2 and all(_is_int(o) for o in offsets)):
            raise ValueError(f"tensor {key!r}: bad data_offsets {offsets!r}")
        dtype = _ST_DTYPES[info["dtype"]]
        if offsets[1] - offsets[0] != math.prod(shape) * dtype.itemsize:
            raise ValueError(f"tensor {key!r}: data_offsets {offsets} do not match shape {shape}")
        spans.append((offsets[0], offsets[1], key, dtype, shape))
    spans.sort(key=lambda span: span[:2])
    end = 0
    for begin, stop, key, _, _ in spans:
        if begin != end:
            raise ValueError(f"tensor {key!r}: data_offsets leave a gap or overlap at byte {end}")
        end = stop
    if start + end != size:
        raise ValueError(f"tensors cover {end} data bytes, the payload holds {size - start}")
    arrays = {}
    for begin, stop, key, dtype, shape in spans:
        flat = np.frombuffer(data, dtype=dtype, count=(stop - begin) // dtype.itemsize, offset=start + begin)
        try:
            arrays[key] = flat.reshape(shape)
        except (ValueError, OverflowError) as err:  # e.g. more dimensions than numpy's 32
            raise ValueError(f"tensor {key!r}: shape {shape}: {err}") from None
    return arrays, meta


def _decoded_string_nbytes(lengths: int | list[int]) -> int:
    """Bytes of the numpy str array of items of these UTF-8 lengths: fixed-width UCS-4, as wide as
    the longest item (a UTF-8 byte is at most one character, so this is an upper bound)."""
    if isinstance(lengths, int):
        return 4 * lengths
    return 4 * len(lengths) * max(lengths, default=0)


def _string_budget(payload_nbytes: int) -> int:
    """The most bytes the decoded string arrays of a payload of `payload_nbytes` may take."""
    return _STRING_GROWTH * payload_nbytes + _STRING_ALLOWANCE


def _string_lengths(
    meta: Mapping[str, str], arrays: Mapping[str, np.ndarray], payload_nbytes: int
) -> dict[str, int | list[int]]:
    """The `hfkit.strings` metadata of a payload, checked against its arrays: key -> item lengths.

    Every key must name a 1-d uint8 tensor; its lengths must be an int (a 0-d string) or a list of
    ints, none negative, summing to the tensor's size; and the str arrays they decode to must fit in
    `_string_budget(payload_nbytes)`. Raises `ValueError` saying which check failed.
    """
    if _STRINGS_KEY not in meta:
        return {}
    strings = _json(meta[_STRINGS_KEY], _STRINGS_KEY)
    if not isinstance(strings, dict):
        raise ValueError(f"{_STRINGS_KEY}: expected a JSON object, got {type(strings).__name__}")
    need = 0
    for key, lengths in strings.items():
        where = f"{_STRINGS_KEY}[{key!r}]"
        array = arrays.get(key)
        if array is None:
            raise ValueError(f"{where}: no tensor of that name")
        if array.dtype != np.uint8 or array.ndim != 1:
            raise ValueError(
                f"{where}: expected a 1-d uint8 tensor, got {array.dtype} of shape {array.shape}"
            )
        items = [lengths] if _is_int(lengths) else lengths
        if not isinstance(items, list) or not all(_is_int(x) for x in items):
            raise ValueError(f"{where}: expected an int or a list of ints, got {str(lengths)[:80]}")
        if any(x < 0 for x in items):
            raise ValueError(f"{where}: negative length in {str(lengths)[:80]}")
        if sum(items) != array.size:
            raise ValueError(f"{where}: lengths sum to {sum(items)}, the tensor holds {array.size} bytes")
        need += _decoded_string_nbytes(lengths)
    if need > _string_budget(payload_nbytes):
        raise ValueError(
            f"{_STRINGS_KEY}: the string arrays would decode to {need:,} bytes, more than the "
            f"{_string_budget(payload_nbytes):,} a {payload_nbytes:,}-byte payload may"
        )
    return strings


def _decode_strings(key: str, raw: bytes, lengths: int | list[int]) -> np.ndarray:
    """The numpy str array (0-d for an int `lengths`, else 1-d) of the UTF-8 items in `raw`."""
    try:
        if isinstance(lengths, int):
            return np.array(raw.decode("utf-8"))
        bounds = list(itertools.accumulate(lengths, initial=0))
        items = [raw[a:b].decode("utf-8") for a, b in itertools.pairwise(bounds)]
    except UnicodeDecodeError as err:
        raise ValueError(f"{_STRINGS_KEY}[{key!r}]: not UTF-8 ({err})") from None
    return np.array(items, dtype=str) if items else np.array([], dtype="<U1")


def decode_sample(data: bytes | bytearray | memoryview, copy: bool = True) -> Sample:
    """Deserialize bytes written by `encode_sample` back to `{name: np.ndarray}`.

    Arrays come back with their dtype and shape; string keys come back as numpy `str` arrays (0-d or
    1-d). With `copy` (the default) arrays are writable copies; without, numeric arrays are views of
    `data` (read-only when `data` is `bytes`), which saves one pass over the payload. Both accept and
    refuse exactly the same payloads: raises `ValueError` when the bytes are not a valid safetensors
    payload or their `hfkit.strings` metadata does not match the arrays (see the module docstring).
    """
    arrays, meta = _st_views(data)
    strings = _string_lengths(meta, arrays, len(data))
    for key, lengths in strings.items():
        arrays[key] = _decode_strings(key, arrays[key].tobytes(), lengths)
    if copy:
        return {key: np.array(a) if key not in strings else a for key, a in arrays.items()}
    return arrays


# --------------------------------------------------------------------------------------------------
# writer
# --------------------------------------------------------------------------------------------------


def _meta_crc(n: int, checksums: np.ndarray, offsets: np.ndarray) -> int:
    crc = zlib.crc32(struct.pack("<Q", n))
    crc = zlib.crc32(checksums.astype("<u4").tobytes(), crc)
    return zlib.crc32(offsets.astype("<u8").tobytes(), crc)


class RecordWriter:
    """Write samples to a record file; the file appears at `path` only when the writer closes cleanly.

    Use as a context manager: `with RecordWriter(path) as w: w.write(sample)`. Payloads go to
    `<path>.tmp-<pid>` (with `num_samples` known, straight after a reserved header, as ffrecord does;
    without it, to a side file `<path>.tmp-<pid>.payloads` that is appended to the header at close).
    On a clean exit the header is written, the file fsync'ed and `os.replace`d onto `path`. An
    exception (KeyboardInterrupt included) inside the `with`, or `abort()`, deletes the temp files and
    leaves `path` untouched. Writing more or fewer than `num_samples` samples is a `ValueError`.
    """

    def __init__(self, path: str | os.PathLike[str], num_samples: int | None = None) -> None:
        if num_samples is not None and (not isinstance(num_samples, int) or num_samples < 0):
            raise ValueError(f"num_samples: expected None or an int >= 0, got {num_samples!r}")
        self.path = Path(path)
        if self.path.is_dir():
            raise ValueError(f"path: {self.path} is a directory, expected the record file to write")
        self.num_samples = num_samples
        self.tmp_path = Path(f"{self.path}.tmp-{os.getpid()}")
        self._spill_path = Path(f"{self.tmp_path}.payloads") if num_samples is None else None
        self._checksums: list[int] = []
        self._sizes: list[int] = []
        self._closed = False
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = open(self.tmp_path, "wb")  # noqa: SIM115 (closed in close()/abort())
        try:
            if num_samples is None:
                assert self._spill_path is not None
                self._payloads = open(self._spill_path, "wb")  # noqa: SIM115
            else:
                # Reserve the header; it is filled in at close when the checksums are known.
                self._file.seek(_HEAD_SIZE + _PER_SAMPLE * num_samples)
                self._payloads = self._file
        except BaseException:
            self._file.close()
            self.tmp_path.unlink(missing_ok=True)
            raise

    def __len__(self) -> int:
        return len(self._sizes)

    def write(self, sample: Mapping[str, Any]) -> int:
        """Append one sample (see `encode_sample` for what it may hold) and return its index."""
        return self.write_bytes(encode_sample(sample))

    def write_bytes(self, payload: bytes) -> int:
        """Append one already-encoded payload (bytes) and return its index."""
        if self._closed:
            raise ValueError(f"{self.path}: write to a closed RecordWriter")
        if self.num_samples is not None and len(self._sizes) >= self.num_samples:
            raise ValueError(f"{self.path}: num_samples={self.num_samples} given, tried to write one more")
        self._payloads.write(payload)
        self._checksums.append(zlib.crc32(payload))
        self._sizes.append(len(payload))
        return len(self._sizes) - 1

    def close(self) -> Path:
        """Write the header, fsync and rename the temp file onto `path`; return `path`."""
        if self._closed:
            return self.path
        n = len(self._sizes)
        try:
            if self.num_samples is not None and n != self.num_samples:
                raise ValueError(f"{self.path}: num_samples={self.num_samples} given, but {n} were written")
            header_end = _HEAD_SIZE + _PER_SAMPLE * n
            sizes = np.asarray(self._sizes, dtype=np.uint64)
            offsets = np.uint64(header_end) + np.cumsum(sizes, dtype=np.uint64) - sizes
            checksums = np.asarray(self._checksums, dtype=np.uint32)
            if self._spill_path is not None:
                self._payloads.close()
                self._file.seek(header_end)
                with open(self._spill_path, "rb") as src:
                    shutil.copyfileobj(src, self._file, 16 << 20)
            self._file.seek(0)
            self._file.write(_HEAD.pack(_meta_crc(n, checksums, offsets), n))
            self._file.write(checksums.astype("<u4").tobytes())
            self._file.write(offsets.astype("<u8").tobytes())
            self._file.flush()
            os.fsync(self._file.fileno())
            self._file.close()
            os.replace(self.tmp_path, self.path)
        except BaseException:
            self.abort()
            raise
        finally:
            if self._spill_path is not None:
                self._spill_path.unlink(missing_ok=True)
        self._closed = True
        return self.path

    def abort(self) -> None:
        """Discard everything written: close and delete the temp files; `path` is left untouched."""
        self._closed = True
        for f in (getattr(self, "_payloads", None), getattr(self, "_file", None)):  # None: __init__ failed
            if f is not None:
                f.close()
        self.tmp_path.unlink(missing_ok=True)
        if self._spill_path is not None:
            self._spill_path.unlink(missing_ok=True)

    def __enter__(self) -> RecordWriter:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if exc_type is None:
            self.close()
        else:
            self.abort()

    def __del__(self) -> None:
        # A writer dropped without close() (e.g. a crash outside a `with`) must not leave a temp file.
        if not getattr(self, "_closed", True):
            self.abort()


# --------------------------------------------------------------------------------------------------
# reader
# --------------------------------------------------------------------------------------------------


def _require_file(path: Path, argument: str) -> None:
    """Raise naming `argument` when `path` is a directory or does not exist (a record file expected)."""
    if path.is_dir():
        raise ValueError(
            f"{argument}: {path} is a directory, expected a record file (for a folder: validate_dir, "
            "RecordDataset)"
        )
    if not path.exists():
        raise FileNotFoundError(f"{argument}: {path} does not exist, expected a record file")


@dataclass(frozen=True)
class _Header:
    """A record file's checked header: per-record CRCs, payload starts and ends (absolute offsets)."""

    checksums: np.ndarray
    offsets: np.ndarray
    ends: np.ndarray


def _header_end(path: Path, head: bytes | mmap.mmap, size: int) -> tuple[int, int, int]:
    """`(meta_crc, N, header bytes)` from a file's first 12 bytes, with N checked against its size."""
    if size < _HEAD_SIZE or len(head) < _HEAD_SIZE:
        raise CorruptRecordError(path, None, f"file is {size} bytes, shorter than the 12-byte header")
    meta_crc, n = _HEAD.unpack_from(head, 0)
    header_end = _HEAD_SIZE + _PER_SAMPLE * n
    if header_end > size:
        raise CorruptRecordError(
            path, None, f"header claims {n} samples ({header_end} bytes of header) in {size} bytes"
        )
    return meta_crc, n, header_end


def _check_header(
    path: Path, header: bytes | mmap.mmap, meta_crc: int, n: int, size: int, verify: bool
) -> _Header:
    """The header of a file of `size` bytes whose first `12 + 12 N` bytes are `header`: its CRC
    checked (with `verify`) and its offsets checked to lie in the file, in order."""
    header_end = _HEAD_SIZE + _PER_SAMPLE * n
    if verify:
        actual = zlib.crc32(header[4:header_end])
        if actual != meta_crc:
            raise CorruptRecordError(
                path, None, f"metadata checksum mismatch (stored {meta_crc:#010x}, got {actual:#010x})"
            )
    checksums = np.frombuffer(header, dtype="<u4", count=n, offset=_HEAD_SIZE).copy()
    offsets = np.frombuffer(header, dtype="<u8", count=n, offset=_HEAD_SIZE + 4 * n).copy()
    # ends[i] = offsets[i + 1], and the file size for the last record (ffrecord's convention).
    ends = np.append(offsets[1:], np.uint64(size)).astype(np.uint64)
    bad = np.flatnonzero((offsets < header_end) | (ends < offsets) | (ends > size))
    if bad.size:
        raise CorruptRecordError(
            path, int(bad[0]), f"offset out of bounds ({int(offsets[bad[0]])} in {size} bytes)"
        )
    return _Header(checksums, offsets, ends)


def read_num_samples(path: str | os.PathLike[str], verify: bool = True) -> int:
    """Return the number of samples in a record file, read from its header.

    The count is checked against the file size and the offsets against the payload region, and
    with `verify` the header's CRC too (reading `12 + 12 N` bytes, not the payloads), so a damaged
    count never yields a dataset of the wrong size. Raises `CorruptRecordError` for a bad header,
    `FileNotFoundError`/`ValueError` naming `path` when it is missing or a directory.
    """
    path = Path(path)
    _require_file(path, "path")
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        meta_crc, n, header_end = _header_end(path, f.read(_HEAD_SIZE), size)
        f.seek(0)
        header = f.read(header_end)
    _check_header(path, header, meta_crc, n, size, verify)
    return n


class RecordReader:
    """Random access to the samples of one record file through a read-only memory map.

    `verify=True` checks the header CRC when the file is opened and each payload's CRC when it is
    read; bounds (offsets inside the file, increasing) are always checked. `reader[i]` returns the
    sample `dict[str, np.ndarray]` (negative `i` counts from the end); `read_batch(indices)` a list of
    them; `read_bytes(i)` the raw payload. The map is re-made lazily after a fork (the pid is checked
    on each read), so a reader created before DataLoader workers start is safe to use in them; it also
    pickles as its path. Raises `CorruptRecordError` (a ValueError) naming the file and the record;
    `FileNotFoundError`/`ValueError` naming `path` when it is missing or a directory.
    """

    def __init__(self, path: str | os.PathLike[str], verify: bool = True) -> None:
        self.path = Path(path)
        _require_file(self.path, "path")
        self.verify = verify
        self._mm: mmap.mmap | None = None
        self._pid = -1
        self._open()

    def _open(self) -> None:
        self.close()
        with open(self.path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size < _HEAD_SIZE:
                raise CorruptRecordError(self.path, None, f"file is {size} bytes, shorter than the header")
            self._mm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
        self._pid = os.getpid()
        self.nbytes = size
        try:
            meta_crc, n, _ = _header_end(self.path, self._mm, size)
            header = _check_header(self.path, self._mm, meta_crc, n, size, self.verify)
        except CorruptRecordError:
            self.close()
            raise
        self.checksums, self.offsets, self.ends = header.checksums, header.offsets, header.ends
        self.num_samples = int(n)

    def _map(self) -> mmap.mmap:
        if self._mm is None or self._pid != os.getpid():
            # Closed, or inherited through fork: map the file anew in this process.
            self._mm = None
            self._open()
        assert self._mm is not None
        return self._mm

    def __len__(self) -> int:
        return self.num_samples

    def _check_index(self, index: int) -> int:
        i = int(index)
        if not -self.num_samples <= i < self.num_samples:
            raise IndexError(f"{self.path}: index {index} out of range for {self.num_samples} records")
        return i % self.num_samples if self.num_samples else i

    def read_bytes(self, index: int) -> bytes:
        """Return the raw payload of record `index`, its CRC checked when `verify` is on."""
        return bytes(self.read_view(index))

    def read_view(self, index: int) -> memoryview:
        """Record `index`'s payload as a read-only view of the mapped file: no copy.

        Its CRC is checked when `verify` is on. A view (and arrays decoded from it with
        `decode_sample(view, copy=False)`) keeps the mapping alive; `close` then leaves the
        mapping to be unmapped when the last view is gone.
        """
        i = self._check_index(index)
        mm = self._map()
        data = memoryview(mm)[int(self.offsets[i]) : int(self.ends[i])]
        if self.verify:
            crc = zlib.crc32(data)
            if crc != int(self.checksums[i]):
                raise CorruptRecordError(
                    self.path,
                    i,
                    f"payload checksum mismatch (stored {int(self.checksums[i]):#010x}, got {crc:#010x})",
                )
        return data

    def __getitem__(self, index: int) -> Sample:
        """Return record `index` as `{name: np.ndarray}` (see `decode_sample`)."""
        data = self.read_view(index)
        try:
            return decode_sample(data)  # copies the arrays out of the mapping
        except ValueError as err:
            raise CorruptRecordError(self.path, self._check_index(index), str(err)) from err

    def read_batch(self, indices: Iterable[int]) -> list[Sample]:
        """Return the records at `indices`, in that order (read in file order to keep reads sequential)."""
        idx = [self._check_index(i) for i in indices]
        out: dict[int, Sample] = {i: self[i] for i in sorted(set(idx))}
        return [out[i] for i in idx]

    def __iter__(self) -> Iterator[Sample]:
        for i in range(self.num_samples):
            yield self[i]

    def close(self) -> None:
        """Unmap the file; a later read maps it again."""
        if self._mm is not None:
            if self._pid == os.getpid():
                # Views from `read_view` still alive: the mapping goes when the last one does.
                with contextlib.suppress(BufferError):
                    self._mm.close()
            self._mm = None

    def __enter__(self) -> RecordReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __getstate__(self) -> dict[str, Any]:
        return {"path": self.path, "verify": self.verify}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__init__(state["path"], state["verify"])  # type: ignore[misc]

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # interpreter shutdown may have torn down mmap already
            self.close()


# --------------------------------------------------------------------------------------------------
# validation
# --------------------------------------------------------------------------------------------------


@dataclass
class ValidationReport:
    """What `validate` found in one record file: `ok` is True when the header and every record check out."""

    path: str
    ok: bool
    num_samples: int = 0
    nbytes: int = 0
    header_ok: bool = True
    bad_records: list[int] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)

    def __str__(self) -> str:
        state = "ok" if self.ok else f"CORRUPT ({len(self.bad_records)} bad records)"
        lines = [f"{self.path}: {self.num_samples} records, {self.nbytes:,} bytes, {state}"]
        return "\n".join(lines + [f"  {e}" for e in self.errors])


def validate(path: str | os.PathLike[str]) -> ValidationReport:
    """Check a record file completely and report; never raises on corruption.

    Checks the header CRC and bounds, then every payload's CRC and that it decodes as a sample. With a
    bad header the per-record checks are still attempted (offsets permitting), so that the report can
    say which payloads are intact. A missing or unreadable file is reported as not ok. Raises
    `ValueError` naming `path` when it is a directory (`validate_dir` checks a folder).
    """
    if Path(path).is_dir():
        raise ValueError(
            f"path: {path} is a directory, expected a record file (validate_dir checks a folder)"
        )
    report = ValidationReport(path=str(path), ok=True)
    try:
        report.nbytes = os.path.getsize(path)
        try:
            reader = RecordReader(path, verify=True)
        except CorruptRecordError as err:
            report.header_ok = False
            report.errors.append(str(err))
            if err.index is not None:  # bounds error: no record can be located safely
                report.ok = False
                return report
            reader = RecordReader(path, verify=False)
            reader.verify = True  # per-record CRCs are still worth checking
    except (OSError, CorruptRecordError) as err:
        report.ok = False
        report.header_ok = False
        report.errors.append(f"{path}: {err}")
        return report
    with reader:
        report.num_samples = len(reader)
        for i in range(len(reader)):
            try:
                reader[i]
            except CorruptRecordError as err:
                report.bad_records.append(i)
                report.errors.append(str(err))
            except Exception as err:  # a verdict whatever a damaged record provokes, never a crash
                report.bad_records.append(i)
                report.errors.append(f"{path}: record {i}: {type(err).__name__}: {err}")
    report.ok = report.header_ok and not report.bad_records
    return report


def validate_dir(
    directory: str | os.PathLike[str], pattern: str = f"*{RECORD_SUFFIX}"
) -> list[ValidationReport]:
    """`validate` every record file matching `pattern` in `directory` (sorted by name).

    Raises `FileNotFoundError` when `directory` does not exist and `ValueError` when it is a file
    (`validate` checks one file).
    """
    directory = Path(directory)
    if not directory.exists():
        raise FileNotFoundError(f"directory: {directory} does not exist, expected a folder of record files")
    if not directory.is_dir():
        raise ValueError(f"directory: {directory} is a file, expected a folder (validate checks one file)")
    return [validate(p) for p in sorted(directory.glob(pattern))]


# --------------------------------------------------------------------------------------------------
# several files as one dataset
# --------------------------------------------------------------------------------------------------


class RecordDataset:
    """Several record files read as one indexable dataset: global index → (file, local index).

    `paths` is a list of record files, one file, or a folder (its `*.ffr` files by name; none is a
    `FileNotFoundError`). Only the headers are read at construction (`read_num_samples`: 12 + 12 N
    bytes a file, checked); readers are opened on first use in each process and re-opened after a
    fork, so the dataset is safe to hand to DataLoader workers (fork or spawn; it pickles as its
    paths). `dataset[i]` returns the sample dict; `locate(i)` the `(path, local index)`.
    """

    def __init__(
        self, paths: Sequence[str | os.PathLike[str]] | str | os.PathLike[str], verify: bool = True
    ) -> None:
        if isinstance(paths, str | os.PathLike):
            folder = Path(paths)
            paths = sorted(folder.glob(f"*{RECORD_SUFFIX}")) if folder.is_dir() else [folder]
            if not paths:
                raise FileNotFoundError(f"paths: no *{RECORD_SUFFIX} files in the folder {folder}")
        self.paths = [Path(p) for p in paths]
        for path in self.paths:
            _require_file(path, "paths")
        self.verify = verify
        # Each header checked (size, offsets; with `verify` its CRC): a flipped bit in a count would
        # otherwise make a dataset of billions of samples.
        self.counts = [read_num_samples(p, verify) for p in self.paths]
        self.cumulative = np.cumsum([0, *self.counts]).tolist()
        self._readers: dict[int, RecordReader] = {}
        self._pid = os.getpid()

    def __len__(self) -> int:
        return int(self.cumulative[-1])

    def locate(self, index: int) -> tuple[int, int]:
        """Return `(file number, local index)` of global record `index` (negative counts from the end)."""
        n = len(self)
        i = int(index)
        if not -n <= i < n:
            raise IndexError(f"RecordDataset: index {index} out of range for {n} records")
        i %= n
        f = bisect.bisect_right(self.cumulative, i) - 1
        return f, i - int(self.cumulative[f])

    def reader(self, file_number: int) -> RecordReader:
        """The reader of file `file_number`, opened in this process on first use."""
        if self._pid != os.getpid():
            # Forked: the parent's readers hold its mmaps; drop them (without closing theirs).
            self._readers = {}
            self._pid = os.getpid()
        if file_number not in self._readers:
            self._readers[file_number] = RecordReader(self.paths[file_number], verify=self.verify)
        return self._readers[file_number]

    def __getitem__(self, index: int) -> Sample:
        f, i = self.locate(index)
        return self.reader(f)[i]

    def close(self) -> None:
        """Close every reader opened in this process."""
        if self._pid == os.getpid():
            for r in self._readers.values():
                r.close()
        self._readers = {}

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        state["_readers"] = {}
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._pid = os.getpid()
