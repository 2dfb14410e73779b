"""Distributed training: `DistributedDataParallel` (backends nccl | gloo | hfreduce), `HostReduce`
(host-staged all-reduce), the one-call `allreduce` used by the comms benchmark, and launch helpers
(`init_distributed`, `run_worker` for torchrun workers, `spawn_local` for tests).
"""

from hfkit.parallel.dap import (
    DAPEvoformerBlock,
    DAPEvoformerStack,
    DAPExtraMSAStack,
    DAPGroups,
    dap_groups,
    to_dap,
)
from hfkit.parallel.ddp import DistributedDataParallel, check_same_model
from hfkit.parallel.hfreduce import HostReduce, allreduce, close_cached
from hfkit.parallel.launch import RankError, free_port, init_distributed, run_worker, spawn_local

__all__ = [
    "DAPEvoformerBlock",
    "DAPEvoformerStack",
    "DAPExtraMSAStack",
    "DAPGroups",
    "DistributedDataParallel",
    "HostReduce",
    "RankError",
    "allreduce",
    "check_same_model",
    "close_cached",
    "dap_groups",
    "free_port",
    "init_distributed",
    "run_worker",
    "spawn_local",
    "to_dap",
]
