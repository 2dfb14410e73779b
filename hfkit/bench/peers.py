"""Peers the benchmarks compare against, imported only if present: the kernel libraries trifast,
cuEquivariance and FlashRNN, and OpenFold's own modules.

None is a dependency of hfkit. Each loader returns `(functions, None)` when the library imports and
can run on the device, else `(None, reason)` with a reason fit for a log line and a results file
("not installed", "needs a CUDA device", the import error). All need a CUDA device: trifast reads the
GPU's name when it is imported, and cuEquivariance's and FlashRNN's kernels are CUDA code.

- trifast (PyPI `trifast`): `triangle_attention(q, k, v, b, mask)` with q/k/v [B, H, N, N, D], bias
  [B, H, N, N] and a boolean mask [B, N, N] whose True entries are *masked* (its kernels do
  `where(mask, -inf, scores)`); the query-row count must equal N (its grid walks N rows).
- cuEquivariance (PyPI `cuequivariance-torch` + `cuequivariance-ops-torch-cu13`):
  `triangle_attention(q, k, v, bias, mask, scale)` with q/k/v [B, S, H, Q, D], bias [B, 1, H, Q, K]
  (float32 for the Hopper kernels), boolean mask [B, S, 1, 1, K] with True = *keep*; and
  `triangle_multiplicative_update(x, direction, mask, norm_in_weight, ...)`.
- FlashRNN (PyPI `flashrnn`): `flashrnn(Wx, R, b, function="lstm", backend=..., dtype=...)` with the
  input projection Wx [B, T, 4, heads, D], R [4, heads, D, D] and b [4, heads, D], gates in torch's
  order (its i, f, z, o); it returns the states [2 (h, c), B, T, heads, D]. Its CUDA backends compile
  their kernels on first use (nvcc through torch's extension builder).
- OpenFold (`load_openfold`): its `openfold` package read from a peers folder (one that holds
  `openfold/`): the `peers_dir` argument, else the environment variable `HFKIT_OPENFOLD_PEERS`, else
  `shared/peers` beside or above the repository (see `shared/peers/NOTICE.md`: its code is never
  copied into hfkit). Its package `__init__` files import its CUDA extension, so the packages are made
  by hand and the extension (`attn_core_inplace_cuda`) gets an empty module; `scipy` (only OpenFold's
  weight initialisers' `truncnorm`) gets a stand-in while OpenFold is imported where it is not
  installed. `openfold_evoformer_block`/`openfold_evoformer_stack` build its Evoformer at a
  `ModelConfig`'s sizes, `openfold_training_kwargs` are the keywords its training calls them with.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
import os
import sys
import types
from collections.abc import Callable
from functools import cache
from pathlib import Path
from typing import Any, NamedTuple

import torch
from torch import nn

from hfkit.model import ModelConfig

__all__ = [
    "OPENFOLD_PEERS_ENV",
    "PEERS",
    "CueqFunctions",
    "find_openfold_peers",
    "load_cuequivariance",
    "load_flashrnn",
    "load_openfold",
    "load_trifast",
    "openfold_evoformer_block",
    "openfold_evoformer_stack",
    "openfold_training_kwargs",
    "peer_status",
]

PEERS = ("trifast", "cuequivariance", "flashrnn")


class CueqFunctions(NamedTuple):
    """cuEquivariance's two Evoformer ops."""

    triangle_attention: Callable[..., torch.Tensor]
    triangle_multiplicative_update: Callable[..., torch.Tensor]


def _device_reason(device: torch.device | str) -> str | None:
    device = torch.device(device)
    if device.type != "cuda" or not torch.cuda.is_available():
        return f"needs a CUDA device (running on {device.type})"
    return None


def _import_reason(err: BaseException, package: str, pip_name: str) -> str:
    if isinstance(err, ModuleNotFoundError) and err.name == package:  # the package itself, not a part of it
        return f"not installed (pip install {pip_name})"
    text = " ".join(str(err).split())[:200]
    return f"import failed ({type(err).__name__}: {text})"


@cache
def _import_function(package: str, name: str) -> tuple[Callable[..., Any] | None, str | None]:
    """`package.name` of a package whose PyPI name is its own, or None and why it does not import."""
    try:
        module = importlib.import_module(package)
    except Exception as err:  # noqa: BLE001 - any import failure (a missing dependency too) is a reason
        return None, _import_reason(err, package, package)
    return getattr(module, name), None


# cuEquivariance's two PyPI distributions: its Python API and its compiled ops.
_CUEQ_API, _CUEQ_OPS = "cuequivariance-torch", "cuequivariance-ops-torch-cu13"


@cache
def _cueq() -> tuple[CueqFunctions | None, str | None]:
    try:
        importlib.import_module("cuequivariance_ops_torch")
        module = importlib.import_module("cuequivariance_torch")
    except Exception as err:  # noqa: BLE001 - any import failure (a missing CUDA library too) is a reason
        package = getattr(err, "name", None) or "cuequivariance_torch"
        pip_name = _CUEQ_OPS if package.startswith("cuequivariance_ops") else _CUEQ_API
        return None, _import_reason(err, package.split(".")[0], pip_name)
    return CueqFunctions(module.triangle_attention, module.triangle_multiplicative_update), None


def load_trifast(device: torch.device | str) -> tuple[Callable[..., torch.Tensor] | None, str | None]:
    """trifast's `triangle_attention`, or None and why it cannot run on `device`."""
    reason = _device_reason(device)
    return (None, reason) if reason else _import_function("trifast", "triangle_attention")


def load_cuequivariance(device: torch.device | str) -> tuple[CueqFunctions | None, str | None]:
    """cuEquivariance's triangle attention and triangle multiplication, or None and why not."""
    reason = _device_reason(device)
    return (None, reason) if reason else _cueq()


def load_flashrnn(device: torch.device | str) -> tuple[Callable[..., Any] | None, str | None]:
    """FlashRNN's `flashrnn`, or None and why it cannot run on `device`."""
    reason = _device_reason(device)
    return (None, reason) if reason else _import_function("flashrnn", "flashrnn")


# The distributions whose versions say which release of a peer a results file measured.
_DISTRIBUTIONS = {
    "trifast": ("trifast",),
    "cuequivariance": (_CUEQ_API, _CUEQ_OPS),
    "flashrnn": ("flashrnn",),
}


def _versions(distributions: tuple[str, ...]) -> str:
    """Each installed distribution as "name version", joined by commas ("" where none is found)."""
    found = []
    for dist in distributions:
        try:
            found.append(f"{dist} {importlib.metadata.version(dist)}")
        except importlib.metadata.PackageNotFoundError:
            continue
    return ", ".join(found)


def peer_status(device: torch.device | str) -> dict[str, str]:
    """Each peer's state on `device` for results files: "available (its distributions' versions)" or
    the reason it is not."""
    status = {}
    loaders = {"trifast": load_trifast, "cuequivariance": load_cuequivariance, "flashrnn": load_flashrnn}
    for name, load in loaders.items():
        fn, reason = load(device)
        if fn is None:
            status[name] = str(reason)
            continue
        versions = _versions(_DISTRIBUTIONS[name])
        status[name] = f"available ({versions})" if versions else "available"
    return status


OPENFOLD_PEERS_ENV = "HFKIT_OPENFOLD_PEERS"
_PACKAGES = ("openfold", "openfold.model", "openfold.utils", "openfold.np", "openfold.data")
_MARKER = Path("openfold") / "model" / "evoformer.py"


def _holds_openfold(folder: Path) -> bool:
    return (folder / _MARKER).is_file()


def find_openfold_peers(peers_dir: str | Path | None = None) -> tuple[Path | None, str]:
    """The peers folder holding OpenFold's `openfold/` package -> (folder, where it came from), or
    (None, why not). Looks in `peers_dir` when given, else in `$HFKIT_OPENFOLD_PEERS` when set, else
    in `shared/peers` beside or above the repository root."""
    if peers_dir is not None:
        folder = Path(peers_dir)
        if _holds_openfold(folder):
            return folder, f"peers_dir {folder}"
        return None, f"peers_dir: expected a folder holding {_MARKER}, got {folder}"
    env = os.environ.get(OPENFOLD_PEERS_ENV)
    if env:
        folder = Path(env)
        if _holds_openfold(folder):
            return folder, f"${OPENFOLD_PEERS_ENV} {folder}"
        return None, f"${OPENFOLD_PEERS_ENV}: expected a folder holding {_MARKER}, got {folder}"
    root = Path(__file__).resolve().parents[2]
    for folder in (root, *root.parents):
        if _holds_openfold(folder / "shared" / "peers"):
            return folder / "shared" / "peers", f"shared/peers at {folder}"
    return None, (
        f"OpenFold's source not found: no shared/peers/{_MARKER.as_posix()} beside or above {root}, "
        f"and ${OPENFOLD_PEERS_ENV} is not set"
    )


class _TruncNorm:
    """Stand-in for `scipy.stats.truncnorm` (OpenFold's initialisers: `std` and `rvs` only)."""

    @staticmethod
    def std(a: float, b: float, loc: float = 0.0, scale: float = 1.0) -> float:
        pdf = lambda x: math.exp(-x * x / 2) / math.sqrt(2 * math.pi)
        cdf = lambda x: 0.5 * (1 + math.erf(x / math.sqrt(2)))
        z = cdf(b) - cdf(a)
        var = 1 + (a * pdf(a) - b * pdf(b)) / z - ((pdf(a) - pdf(b)) / z) ** 2
        return scale * math.sqrt(var)

    @staticmethod
    def rvs(a: float, b: float, loc: float = 0.0, scale: float = 1.0, size: int = 1) -> Any:
        t = torch.empty(size, dtype=torch.float64)
        torch.nn.init.trunc_normal_(t, mean=loc, std=scale, a=loc + a * scale, b=loc + b * scale)
        return t.numpy()


def _scipy_stand_in() -> dict[str, types.ModuleType]:
    """Modules to put in `sys.modules` while OpenFold imports: {} where scipy is installed."""
    try:
        import scipy.stats  # noqa: F401
    except ImportError:
        scipy, stats = types.ModuleType("scipy"), types.ModuleType("scipy.stats")
        stats.truncnorm = _TruncNorm()
        scipy.stats = stats
        return {"scipy": scipy, "scipy.stats": stats}
    return {}


def _import_openfold(peers: Path) -> types.SimpleNamespace:
    """OpenFold's `evoformer` and `primitives` modules from `peers/openfold`, without its extension."""
    sys.modules.setdefault("attn_core_inplace_cuda", types.ModuleType("attn_core_inplace_cuda"))
    for name in _PACKAGES:
        if name not in sys.modules:
            package = types.ModuleType(name)
            package.__path__ = [str(peers / name.replace(".", "/"))]
            sys.modules[name] = package
    stand_in = _scipy_stand_in()
    sys.modules.update(stand_in)
    try:
        import openfold.model.evoformer as evoformer
        import openfold.model.primitives as primitives
    finally:
        # OpenFold's modules hold `truncnorm` by now; later `import scipy` elsewhere fails as usual.
        for name in stand_in:
            sys.modules.pop(name, None)
    return types.SimpleNamespace(evoformer=evoformer, primitives=primitives)


def load_openfold(peers_dir: str | Path | None = None) -> tuple[types.SimpleNamespace | None, str | None]:
    """OpenFold's model modules -> (namespace with `.evoformer` and `.primitives`, None), or (None,
    the reason) where its source is not found (see `find_openfold_peers`), fails to import, or was
    already imported in this process from another folder."""
    peers, where = find_openfold_peers(peers_dir)
    if peers is None:
        return None, where
    loaded = sys.modules.get("openfold")
    if loaded is not None:
        paths = [Path(p).resolve() for p in getattr(loaded, "__path__", [])]
        if (peers / "openfold").resolve() not in paths:
            return None, f"openfold is already imported from {paths}, not from {peers / 'openfold'}"
    try:
        return _import_openfold(peers), None
    except Exception as err:  # noqa: BLE001 - any import failure is a reason to skip, with its message
        return None, f"importing OpenFold from {where} failed: {type(err).__name__}: {err}"


def _sizes(config: ModelConfig, dropout: bool) -> dict[str, Any]:
    """OpenFold's Evoformer keywords for `config`'s sizes (OpenFold's AlphaFold settings: MSA
    transition before the outer product mean, column attention on, unfused triangle projections)."""
    return dict(
        c_m=config.c_m,
        c_z=config.c_z,
        c_hidden_msa_att=config.c_hidden_msa_att,
        c_hidden_opm=config.c_hidden_opm,
        c_hidden_mul=config.c_hidden_mul,
        c_hidden_pair_att=config.c_hidden_pair_att,
        no_heads_msa=config.no_heads_msa,
        no_heads_pair=config.no_heads_pair,
        transition_n=config.transition_n,
        msa_dropout=config.msa_dropout if dropout else 0.0,
        pair_dropout=config.pair_dropout if dropout else 0.0,
        no_column_attention=False,
        opm_first=False,
        fuse_projection_weights=False,
        inf=config.inf,
        eps=1e-8,
    )


def openfold_evoformer_block(
    of: types.SimpleNamespace, config: ModelConfig, dropout: bool = False
) -> nn.Module:
    """OpenFold's `EvoformerBlock` with `config`'s sizes (hfkit's `make_block` counterpart); dropout
    rates 0 unless `dropout`. `of`: what `load_openfold` returns."""
    return of.evoformer.EvoformerBlock(**_sizes(config, dropout))


def openfold_evoformer_stack(
    of: types.SimpleNamespace, config: ModelConfig, dropout: bool = False
) -> nn.Module:
    """OpenFold's `EvoformerStack` with `config`'s sizes and `no_blocks`; per-block checkpointing
    (`blocks_per_ckpt` 1) when `config.checkpoint`; dropout rates 0 unless `dropout`."""
    return of.evoformer.EvoformerStack(
        **_sizes(config, dropout),
        c_s=config.c_s,
        no_blocks=config.no_blocks,
        blocks_per_ckpt=1 if config.checkpoint else None,
    )


def openfold_training_kwargs(config: ModelConfig) -> dict[str, Any]:
    """The keywords OpenFold's own training passes to its Evoformer block and stack after (m, z,
    msa_mask, pair_mask): no chunking, no low-memory attention, not in place, `config._mask_trans`."""
    return {"chunk_size": None, "use_lma": False, "inplace_safe": False, "_mask_trans": config._mask_trans}
