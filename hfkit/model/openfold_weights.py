"""OpenFold checkpoints into hfkit models: `load_openfold_state_dict(model, checkpoint) -> LoadReport`.

OpenFold saves its weights in several containers: a plain state_dict, a training checkpoint whose
`ema` entry holds the exponential moving average (`{"ema": {"params": state_dict, ...}}`, what
OpenFold's own inference script loads), a PyTorch Lightning checkpoint (`{"state_dict": ...}` with
keys under `model.`), and DDP / DeepSpeed prefixes (`module.`, `_forward_module.`). Its key layout
changed in OpenFold 2.0 (`blocks.i.msa_transition`, `blocks.i.pair_stack.tri_*`); hfkit keeps the
released v1 layout (`blocks.i.core.*`), so v2 keys are renamed (`openfold_v2_to_v1_keys`). Parts of
AlphaFold that hfkit does not have (templates, recycling embedder, structure module, the pLDDT /
experimentally-resolved / TM heads) are ignored and listed in the report.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import nn

from hfkit.model.evoformer import openfold_v2_to_v1_keys

__all__ = ["LoadReport", "load_openfold_state_dict"]

# Wrappers whose names prefix every key: DDP, DeepSpeed, and OpenFold's Lightning module (`model`).
_WRAPPER_PREFIXES = ("module.", "_forward_module.", "model.")

# Top-level parts of OpenFold's AlphaFold that hfkit does not implement.
OPENFOLD_ONLY_PARTS = (
    "template_embedder.",
    "template_angle_embedder.",
    "template_single_embedder.",
    "template_pair_embedder.",
    "template_pair_stack.",
    "template_pointwise_att.",
    "recycling_embedder.",
    "structure_module.",
    "aux_heads.plddt.",
    "aux_heads.experimentally_resolved.",
    "aux_heads.tm.",
)


@dataclass
class LoadReport:
    """What `load_openfold_state_dict` did, by key (hfkit's names, after unwrapping and renaming).

    `loaded`: the model's keys filled from the checkpoint; `ignored`: checkpoint keys of parts hfkit
    does not have (or outside `prefix`); `missing`: model keys the checkpoint lacks; `unexpected`:
    checkpoint keys inside the parts hfkit has that match no model key (both empty after a strict
    load); `container`: where the weights came from ("ema", "state_dict" or "plain"); `renamed`: the
    number of keys renamed from OpenFold's v2 layout.
    """

    loaded: list[str] = field(default_factory=list)
    ignored: list[str] = field(default_factory=list)
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    container: str = "plain"
    renamed: int = 0

    def __str__(self) -> str:
        lines = [
            f"loaded {len(self.loaded)} tensors from the {self.container} weights "
            f"({self.renamed} keys renamed from OpenFold's v2 layout)"
        ]
        for name in ("ignored", "missing", "unexpected"):
            keys = getattr(self, name)
            if keys:
                parts = sorted({k.split(".")[0] for k in keys})
                lines.append(f"{name} {len(keys)} keys under {', '.join(parts)}")
        return "\n".join(lines)


def _unwrap(checkpoint: Mapping[str, object], use_ema: bool) -> tuple[Mapping[str, object], str]:
    ema = checkpoint.get("ema")
    if use_ema and isinstance(ema, Mapping) and isinstance(ema.get("params"), Mapping):
        return ema["params"], "ema"
    if isinstance(checkpoint.get("state_dict"), Mapping):
        return checkpoint["state_dict"], "state_dict"
    return checkpoint, "plain"


def _strip_wrappers(key: str) -> str:
    stripped = True
    while stripped:
        stripped = False
        for p in _WRAPPER_PREFIXES:
            if key.startswith(p):
                key, stripped = key[len(p) :], True
    return key


def load_openfold_state_dict(
    model: nn.Module,
    checkpoint: Mapping[str, object],
    *,
    strict: bool = True,
    prefix: str = "",
    use_ema: bool = True,
) -> LoadReport:
    """Load an OpenFold checkpoint into `model` (an `AlphaFoldLite`, or with `prefix` one of its parts).

    checkpoint: a state_dict of OpenFold's `AlphaFold` in the v1 or v2 key layout, plain, under
    `module.` / `model.` / `_forward_module.` prefixes, or inside a training checkpoint
    (`{"ema": {"params": ...}}`, used when `use_ema`, else `{"state_dict": ...}`). prefix: the part of
    the checkpoint to load into `model`, e.g. "evoformer." for an `EvoformerStack` (keys outside it are
    ignored). With `strict`, every model key must be loaded and no key inside the parts hfkit has may
    be left over (ValueError listing them); shapes must always match. Returns a `LoadReport`.
    """
    if not isinstance(model, nn.Module):
        raise TypeError(f"model: expected a torch.nn.Module, got {type(model).__name__}")
    if not isinstance(checkpoint, Mapping):
        raise TypeError(f"checkpoint: expected a mapping of names to tensors, got {type(checkpoint)}")
    weights, container = _unwrap(checkpoint, use_ema)
    bad = [k for k, v in weights.items() if not isinstance(v, torch.Tensor)]
    if bad:
        raise ValueError(f"checkpoint: expected tensors only, got non-tensor values at {bad[:5]}")
    stripped = {_strip_wrappers(k): v for k, v in weights.items()}
    if len(stripped) != len(weights):
        raise ValueError("checkpoint: keys collide once the module./model. prefixes are removed")
    renamed_dict = openfold_v2_to_v1_keys(stripped)
    report = LoadReport(container=container)
    report.renamed = sum(a != b for a, b in zip(stripped, renamed_dict, strict=True))

    own = model.state_dict()
    selected: dict[str, torch.Tensor] = {}
    for key, value in renamed_dict.items():
        if not key.startswith(prefix) or key.startswith(OPENFOLD_ONLY_PARTS):
            report.ignored.append(key)
            continue
        name = key[len(prefix) :]
        if name in own:
            selected[name] = value
        else:
            report.unexpected.append(key)
    report.missing = [k for k in own if k not in selected]
    wrong = [
        f"{k}: expected {list(own[k].shape)}, got {list(v.shape)}"
        for k, v in selected.items()
        if v.shape != own[k].shape
    ]
    if wrong:
        raise ValueError("checkpoint: shapes differ from the model's: " + "; ".join(wrong[:10]))
    if strict and (report.missing or report.unexpected):
        raise ValueError(
            f"checkpoint: strict load failed: missing {len(report.missing)} keys {report.missing[:10]}, "
            f"unexpected {len(report.unexpected)} keys {report.unexpected[:10]} (strict=False loads the rest)"
        )
    model.load_state_dict(selected, strict=False)
    report.loaded = list(selected)
    return report
