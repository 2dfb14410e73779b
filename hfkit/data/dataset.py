"""Training datasets: on-the-fly (parse + featurize per sample) and preprocessed (read a record).

Both return one fixed-size sample per index: the tensors of `process_features` (shapes
`feature_shapes(config)`: crop_size residues, max_msa_clusters rows, max_extra_msa extra rows), so
that `collate_fixed` can stack them. They are the two sides of the data-cost comparison of High-Flyer's
AlphaFold work:

- `OnTheFlyDataset` parses the chain's mmCIF and every alignment file, builds the raw features and
  samples them, all inside `__getitem__` (what OpenFold's dataset does per sample);
- `PreprocessedDataset` reads the raw features of the chain from a record file written by
  `hfkit preprocess` (one mmap read, a CRC and a safetensors decode) and only samples them.

Randomness (crop, block deletion, MSA sampling, masking) comes from `sample_seed(seed, epoch,
index)`, so a sample is reproducible whatever the worker that makes it; `set_epoch` changes it
between epochs, also in persistent DataLoader workers (the epoch lives in shared memory). With
`timings=True` each sample also holds `time.<stage>` 0-d float64 tensors (seconds);
`profile_sample` times the stages of one sample in this process, for the data-cost notebook.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import time
import warnings
from collections.abc import Callable, Mapping, Sequence
from multiprocessing.context import get_spawning_popen
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from hfkit.data.msa_sampling import FeatureConfig, process_features
from hfkit.data.preprocess import INDEX_NAME, chain_raw_features, find_mmcifs, load_index, mmcif_entry_id
from hfkit.data.records import RECORD_SUFFIX, CorruptRecordError, RecordDataset, decode_sample

__all__ = [
    "TIMING_PREFIX",
    "OnTheFlyDataset",
    "PreprocessedDataset",
    "collate_fixed",
    "make_dataloader",
    "profile_sample",
    "sample_seed",
    "tune_malloc",
]

TIMING_PREFIX = "time."


def sample_seed(seed: int, epoch: int, index: int) -> int:
    """A 63-bit seed for sample `index` of `epoch`, independent of worker and order (numpy SeedSequence)."""
    state = np.random.SeedSequence([int(seed), int(epoch), int(index)]).generate_state(1, dtype=np.uint64)
    return int(state[0] & np.uint64(0x7FFF_FFFF_FFFF_FFFF))


class _EpochMixin:
    """An epoch counter in shared memory, so that `set_epoch` reaches forked or spawned workers."""

    def _init_epoch(self) -> None:
        self._epoch = multiprocessing.RawValue("q", 0)

    @property
    def epoch(self) -> int:
        return int(self._epoch.value)

    def _sample(self, index: int) -> dict[str, torch.Tensor]:
        """Raw features of chain `index`, then `process_features` with this epoch's seed; stage times kept."""
        timings: dict[str, float] = {}
        raw = self.raw_features(index, timings)  # type: ignore[attr-defined]
        t0 = time.perf_counter()
        sample = process_features(
            raw,
            self.config,  # type: ignore[attr-defined]
            sample_seed(self.seed, self.epoch, index),  # type: ignore[attr-defined]
            train=self.train,  # type: ignore[attr-defined]
        )
        timings["process_features"] = time.perf_counter() - t0
        self.last_timings = timings
        return _with_timings(sample, timings) if self.timings else sample  # type: ignore[attr-defined]

    def set_epoch(self, epoch: int) -> None:
        """Use `epoch` in the seeds of the following samples (call before each epoch's iteration)."""
        self._epoch.value = int(epoch)

    def __getstate__(self) -> dict[str, Any]:
        state = self.__dict__.copy()
        # A shared value may only travel to a process being started; a plain copy gets the number.
        if get_spawning_popen() is None:
            state["_epoch"] = int(self._epoch.value)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        if isinstance(self._epoch, int):
            value = self._epoch
            self._init_epoch()
            self._epoch.value = value


def _with_timings(sample: dict[str, torch.Tensor], timings: Mapping[str, float]) -> dict[str, torch.Tensor]:
    for stage, seconds in timings.items():
        sample[TIMING_PREFIX + stage] = torch.tensor(seconds, dtype=torch.float64)
    return sample


def _split_chain_id(chain_id: str) -> tuple[str, str]:
    entry, sep, chain = chain_id.rpartition("_")
    if not sep or not entry or not chain:
        raise ValueError(f"chain id: expected '<pdbid>_<chain>', got {chain_id!r}")
    return entry.lower(), chain


class OnTheFlyDataset(_EpochMixin, Dataset):
    """Chains parsed and featurized in `__getitem__`: mmCIF + alignments → raw features → sample.

    `chain_ids` (`<pdbid>_<chain>`) default to the folders of `alignment_dir` whose mmCIF
    (`mmcif_dir/<pdbid>.cif`, any case, or `.cif.gz`/`.mmcif`) exists, as OpenFold's training set
    does; without `alignment_dir`, every chain of every mmCIF (each file is parsed once here to list
    them). A chain without alignments is featurized with its sequence alone. `train=False` samples
    without cropping (N_res = L, so samples of different chains do not stack). Each item is a dict
    of tensors shaped `feature_shapes(config)`; see the module docstring for seeds and timings.
    """

    def __init__(
        self,
        mmcif_dir: str | os.PathLike[str],
        alignment_dir: str | os.PathLike[str] | None,
        config: FeatureConfig,
        chain_ids: Sequence[str] | None = None,
        seed: int = 0,
        max_msa_depth: int | None = None,
        train: bool = True,
        timings: bool = False,
    ) -> None:
        self.mmcif_dir = Path(mmcif_dir)
        self.alignment_dir = None if alignment_dir is None else Path(alignment_dir)
        if self.alignment_dir is not None and not self.alignment_dir.is_dir():
            # Not silently ignored: every chain would get a single-sequence MSA.
            raise FileNotFoundError(f"alignment_dir: {self.alignment_dir} is not a directory")
        self.config = config
        self.seed = int(seed)
        self.max_msa_depth = max_msa_depth
        self.train = train
        self.timings = timings
        self.mmcifs = {mmcif_entry_id(p): p for p in find_mmcifs(self.mmcif_dir)}
        if chain_ids is None:
            chain_ids = self._discover_chains()
        self.chain_ids = list(chain_ids)
        for chain_id in self.chain_ids:
            entry, _ = _split_chain_id(chain_id)
            if entry not in self.mmcifs:
                raise FileNotFoundError(f"chain_ids: no mmCIF for {chain_id!r} in {self.mmcif_dir}")
        self._init_epoch()
        self.last_timings: dict[str, float] = {}

    def _discover_chains(self) -> list[str]:
        if self.alignment_dir is not None:
            folders = sorted(p.name for p in self.alignment_dir.iterdir() if p.is_dir() and "_" in p.name)
            return [c for c in folders if _split_chain_id(c)[0] in self.mmcifs]
        from hfkit.data.mmcif import parse_mmcif

        return [f"{entry}_{c}" for entry, path in self.mmcifs.items() for c in parse_mmcif(path).chains]

    def __len__(self) -> int:
        return len(self.chain_ids)

    def raw_features(self, index: int, timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """Parse and featurize chain `index` (no sampling); `timings` receives per-stage seconds."""
        from hfkit.data.mmcif import parse_mmcif

        chain_id = self.chain_ids[index]
        entry, chain = _split_chain_id(chain_id)
        t0 = time.perf_counter()
        structure = parse_mmcif(self.mmcifs[entry])
        if timings is not None:
            timings["parse_mmcif"] = time.perf_counter() - t0
        raw, _ = chain_raw_features(
            structure, chain, chain_id, self.alignment_dir, self.max_msa_depth, timings
        )
        return raw

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        return self._sample(index)


class PreprocessedDataset(_EpochMixin, Dataset):
    """Chains read from `hfkit preprocess` record files, then sampled with `process_features`.

    `records` is a preprocessed folder (its `index.json` lists the chains and where they are; record
    files the index does not name are ignored), a folder of `*.ffr` files without an index (every
    record), or a list of record files. Readers are opened lazily in each process
    (`RecordDataset`), so the dataset is safe in DataLoader workers. `verify` checks each record's
    CRC32 on read (record headers are checked either way). Raises `CorruptRecordError` when a record
    file's header is damaged or its sample count differs from the index's. Each item is a dict of
    tensors shaped `feature_shapes(config)`.
    """

    def __init__(
        self,
        records: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
        config: FeatureConfig,
        seed: int = 0,
        train: bool = True,
        timings: bool = False,
        verify: bool = True,
    ) -> None:
        self.config = config
        self.seed = int(seed)
        self.train = train
        self.timings = timings
        self.chain_ids: list[str] | None = None
        if isinstance(records, str | os.PathLike) and (Path(records) / INDEX_NAME).exists():
            folder = Path(records)
            index = load_index(folder)
            entries = sorted(index["chains"].items(), key=lambda kv: (kv[1]["file"], kv[1]["index"]))
            files = sorted({e["file"] for _, e in entries})
            self.records = RecordDataset([folder / f for f in files], verify=verify)
            for name, count in zip(files, self.records.counts, strict=True):
                listed = index["files"].get(name, {}).get("num_samples")
                if listed != count:
                    raise CorruptRecordError(
                        folder / name, None, f"{count} samples, but {folder / INDEX_NAME} lists {listed}"
                    )
            counts = dict(zip(files, self.records.counts, strict=True))
            for chain_id, e in entries:
                if not (type(e["index"]) is int and 0 <= e["index"] < counts[e["file"]]):
                    raise ValueError(
                        f"{folder / INDEX_NAME}: chain {chain_id}: index {e['index']!r} is not a record of "
                        f"{e['file']} ({counts[e['file']]} samples)"
                    )
            start = dict(zip(files, self.records.cumulative, strict=False))
            self._rows: Sequence[int] = [start[e["file"]] + e["index"] for _, e in entries]
            self.chain_ids = [c for c, _ in entries]
        else:
            if isinstance(records, str | os.PathLike):
                path = Path(records)
                if not path.exists():
                    raise FileNotFoundError(f"records: {records} does not exist")
                if path.is_file() and not path.name.endswith(RECORD_SUFFIX):
                    raise ValueError(
                        f"records: {records} is not a record file (*{RECORD_SUFFIX}); expected a "
                        f"preprocessed folder, a folder of *{RECORD_SUFFIX} files, or record files"
                    )
                if path.is_dir():
                    records = sorted(path.glob(f"*{RECORD_SUFFIX}"))
                    if not records:
                        raise FileNotFoundError(f"records: no {INDEX_NAME} and no *{RECORD_SUFFIX} in {path}")
            self.records = RecordDataset(records, verify=verify)
            self._rows = range(len(self.records))
        self._init_epoch()
        self.last_timings: dict[str, float] = {}

    def __len__(self) -> int:
        return len(self._rows)

    def raw_features(self, index: int, timings: dict[str, float] | None = None) -> dict[str, np.ndarray]:
        """The raw features of sample `index` from its record; `timings` gets `read` and `decode` seconds.

        The arrays are read-only views of the memory-mapped record file (the payload is never copied).
        """
        t0 = time.perf_counter()
        file_number, local = self.records.locate(self._rows[index])
        data = self.records.reader(file_number).read_view(local)  # CRC32 of the mapped payload, no copy
        t1 = time.perf_counter()
        raw = decode_sample(data, copy=False)  # read-only views of the mapping: process_features never writes
        if timings is not None:
            timings["read"] = t1 - t0
            timings["decode"] = time.perf_counter() - t1
        return raw

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if not -len(self) <= index < len(self):
            raise IndexError(f"PreprocessedDataset: index {index} out of range for {len(self)} chains")
        return self._sample(index % len(self))


def collate_fixed(batch: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """Stack fixed-size samples into a batch: each tensor [*S] → [B, *S]; other values into lists.

    Raises `ValueError` naming the key when samples disagree on keys or on a tensor's shape (e.g.
    samples made with `train=False`, which are not padded to a common size).
    """
    if not batch:
        raise ValueError("batch: expected at least one sample, got none")
    keys = list(batch[0])
    out: dict[str, Any] = {}
    for i, sample in enumerate(batch[1:], start=1):
        if set(sample) != set(keys):
            raise ValueError(f"batch[{i}]: keys {sorted(sample)} differ from batch[0]'s {sorted(keys)}")
    for key in keys:
        values = [sample[key] for sample in batch]
        if isinstance(values[0], torch.Tensor):
            shapes = {tuple(v.shape) for v in values}
            if len(shapes) > 1:
                raise ValueError(f"batch[*][{key!r}]: samples differ in shape {sorted(shapes)}; cannot stack")
            out[key] = torch.stack(values)
        else:
            out[key] = values
    return out


_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3  # glibc <malloc.h> mallopt parameters
_MAX_MMAP_THRESHOLD = 32 * 2**20  # glibc's ceiling on 64-bit


def tune_malloc(mmap_threshold: int = _MAX_MMAP_THRESHOLD, trim_threshold: int = 256 * 2**20) -> bool:
    """Let this process reuse freed sample-sized blocks (glibc): True when applied, else False.

    Every sample is a set of fresh output tensors (~12 MB at af2_initial sizes, msa_feat 6.4 MB of
    it). With glibc's defaults, blocks above its adaptive mmap threshold are mapped afresh for each
    sample and freed heap tops are returned to the OS, so each 4 KiB page of a new sample costs a
    page fault (~1.5 us on a VM: up to ~3 ms per sample at depth 5k). Blocks below `mmap_threshold`
    come from the heap, which keeps up to `trim_threshold` bytes of free memory instead of
    trimming it. Process-wide and permanent: `make_dataloader`'s workers call it at start, and the
    data-cost benchmark calls it so that it measures what a worker does. Does nothing (False) where
    the C library has no glibc `mallopt`.
    """
    if not 0 <= mmap_threshold <= _MAX_MMAP_THRESHOLD:
        raise ValueError(f"mmap_threshold: expected 0..{_MAX_MMAP_THRESHOLD} bytes, got {mmap_threshold}")
    if trim_threshold < 0:
        raise ValueError(f"trim_threshold: expected >= 0 bytes, got {trim_threshold}")
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    return bool(mallopt(_M_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(_M_TRIM_THRESHOLD, trim_threshold)
    )


def _worker_init(worker_id: int) -> None:
    # Each worker makes one sample at a time; torch's intra-op threads would only fight each other.
    torch.set_num_threads(1)
    tune_malloc()


def make_dataloader(
    dataset: Dataset,
    batch_size: int = 1,
    workers: int = 0,
    shuffle: bool = False,
    seed: int = 0,
    pin_memory: bool = False,
    persistent_workers: bool = False,
    prefetch_factor: int | None = None,
    drop_last: bool = False,
    worker_init_fn: Callable[[int], None] | None = None,
    multiprocessing_context: str | None = None,
) -> DataLoader:
    """A DataLoader that batches fixed-size samples with `collate_fixed`.

    `workers` processes make samples (0: in this process); each runs torch with one thread and
    `tune_malloc` (freed sample buffers are reused, not faulted in afresh).
    `shuffle` draws the order from a generator seeded with `seed` (set_epoch on the dataset changes
    the samples' randomness, not this order). `prefetch_factor` (samples a worker keeps ready)
    applies only with workers; `multiprocessing_context` ("fork", "spawn", "forkserver") picks how
    workers start (spawn when the parent holds CUDA state). Readers are opened in each worker either
    way.
    """
    generator = torch.Generator().manual_seed(int(seed)) if shuffle else None
    kwargs: dict[str, Any] = {}
    if workers > 0:
        kwargs["persistent_workers"] = persistent_workers
        if prefetch_factor is not None:
            kwargs["prefetch_factor"] = prefetch_factor
        if multiprocessing_context is not None:
            kwargs["multiprocessing_context"] = multiprocessing_context
    return DataLoader(
        dataset,
        batch_size=batch_size,
        shuffle=shuffle,
        num_workers=workers,
        collate_fn=collate_fixed,
        pin_memory=pin_memory,
        drop_last=drop_last,
        generator=generator,
        worker_init_fn=worker_init_fn or (_worker_init if workers > 0 else None),
        **kwargs,
    )


def profile_sample(
    dataset: OnTheFlyDataset | PreprocessedDataset, index: int = 0, repeats: int = 3
) -> dict[str, float]:
    """Seconds per stage of making sample `index` in this process (median of `repeats` runs).

    Stages: on-the-fly `parse_mmcif`, `read_msas`, `features`; preprocessed `read` (CRC32 of the
    memory-mapped payload), `decode` (safetensors views, no copy); both `crop` and
    `process_features` (MSA sampling, masking, clustering, cropping and padding; `crop` is timed
    separately on the same inputs and is included in `process_features`), and `total` (all stages
    but `crop`). Label results measured on
    synthetic inputs as synthetic.
    """
    from hfkit.data.crop import choose_crop

    runs: list[dict[str, float]] = []
    config = dataset.config
    for _ in range(max(1, repeats)):
        timings: dict[str, float] = {}
        raw = dataset.raw_features(index, timings)
        seed = sample_seed(dataset.seed, dataset.epoch, index)
        t0 = time.perf_counter()
        if "all_atom_positions" in raw:
            with warnings.catch_warnings():  # read-only record views; choose_crop never writes
                warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
                positions = torch.as_tensor(raw["all_atom_positions"])
                mask = torch.as_tensor(raw["all_atom_mask"])
        else:
            positions = mask = None
        choose_crop(
            int(raw["aatype"].shape[0]),
            config.crop_size,
            torch.Generator().manual_seed(seed),
            config.spatial_crop_prob,
            positions,
            mask,
            config.interface_threshold,
            uniform_start=config.uniform_crop_start,
        )
        timings["crop"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        process_features(raw, config, seed, train=dataset.train)
        timings["process_features"] = time.perf_counter() - t0
        timings["total"] = sum(v for k, v in timings.items() if k != "crop")
        runs.append(timings)
    return {k: float(np.median([r[k] for r in runs])) for k in runs[0]}
