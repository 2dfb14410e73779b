"""Dynamic Axial Parallelism (DAP) for the Evoformer: each rank of a DAP group holds one shard of the
MSA and pair representations along one axis and the ranks exchange shards where an operation needs the
other axis whole.

Layout (FastFold's): with P ranks, N residues and S MSA rows padded to multiples of P,

- the MSA representation m [*, S, N, C_m] is sharded by rows (S / P each) for row attention, and by
  columns (N / P each) after an all-to-all transpose for column attention, the MSA transition and the
  outer product mean; it goes back to rows at the end of the block;
- the pair representation z [*, N, N, C_z] is sharded by rows i (N / P each). Row attention's pair bias
  and the starting-node triangle bias are computed on the local rows and gathered (H channels, not
  C_z); outer product mean gathers the right projection b over all residues; triangle multiplication
  gathers b (outgoing), or transposes a and gathers b (incoming); z is transposed (all-to-all) to
  column shards for the ending-node attention and back before the pair transition.

Pieces:

- `dap_groups(dap_size)`: this rank's DAP group and data-parallel group of a dp x dap layout over the
  default group (consecutive ranks form one DAP group).
- Autograd collectives with derived backwards: `scatter` (backward: gather), `gather` (backward:
  reduce-scatter where each rank's downstream work is partial, split where it is replicated),
  `all_to_all` (backward: the inverse all-to-all), `reduce_grads` (identity; backward: one all-reduce
  sum of all the gradients, flattened together; used for a block's parameters, whose gradients each
  rank computes from its shard alone), and `pad_to_multiple`.
  Every collective runs under its group's timeout and a failure names the collective and the group.
- Asynchronous versions (duality async): `start_gather` and `start_all_to_all` launch the collective
  (`async_op=True`) and return a `Pending` whose `wait()` gives the result; backward launches the
  backward collective when the result's gradient arrives and waits for it where the input's gradient
  is needed (see `Pending`).
- `to_dap(module, group)`: an `EvoformerBlock` or `ExtraMSABlock` (-> `DAPEvoformerBlock`), an
  `EvoformerStack` or an `ExtraMSAStack` run with DAP, sharing the module's submodules (same
  state_dict). Called with full inputs on every rank it returns the single-process outputs, and after
  backward every rank holds the full parameter and input gradients. `forward_sharded` takes inputs
  already padded and sharded (stacks shard once, not per block). The submodules' own layers run on
  the shards, so modules swapped by `hfkit.nn.to_hfkit` run their fused kernels there (attention, layer
  norm, outer product, transitions, dropout-add, and triangle multiplication: its fused op with the
  contraction sharded, `_ShardedContraction`; the plain module runs its layers step by step around the
  gather). `chunk_size` chunks as in one process, and stacks honour their `checkpoint` switch (the
  collectives run again in backward).

Duality async (`to_dap(module, group, overlap=True)`, the default): each collective of the block is
launched as soon as its input exists and waited for just before its result is used, so that the
computation in between, which does not depend on it, overlaps it (gloo runs collectives on its own
threads, nccl on its own stream). In the block's order (`OVERLAPPED_WITH` has it by `dap_block_comm`'s
keys, for tables):

| collective                          | in flight while (forward)                              |
|-------------------------------------|--------------------------------------------------------|
| row attention's pair bias (gather)  | the MSA layer norm, the row mask bias                  |
| m rows -> columns (all_to_all)      | the column mask bias                                   |
| m columns -> rows (all_to_all)      | the outer product mean and the whole pair stack        |
| outer product mean's b (gather)     | a = linear_1, the normaliser                           |
| tri_mul_out's b (gather)            | a and the gate (plain modules; fused: nothing)         |
| tri_mul_in's b (gather)             | a, a's transpose (in flight too), the gate (fused: a's |
|                                     | transpose only)                                        |
| tri_att_start/end bias (gather)     | the pair mask bias                                     |
| z rows <-> columns (all_to_all, x2) | nothing: everything after needs z (waited at once)     |

Backward mirrors it: the backward collective of each (the partial gathers' reduce-scatter, the inverse
all-to-alls) is launched when its result's gradient arrives and waited for when its input's gradient
is needed; the autograd engine runs the backward of the computation listed beside it in between (the
m transpose's inverse, for one, overlaps the backward of the whole pair stack and the outer product
mean). `overlap=False` waits for every collective where it is launched: the same collectives on the
same buffers in the same order, hence bit-identical outputs and gradients.

Padding: padded residues and MSA rows are masked (mask 0) and, as attention keys, get a bias of -inf
on top of the mask's, so that a row whose real keys are all masked still attends uniformly to exactly
its real keys, as in one process. Dropout: the Evoformer's dropout masks are shared along the sharded
axis (row-wise dropout along rows, column-wise along columns), so every rank draws the same mask when
every rank seeds its generator alike; the masks then equal one process's when N and S divide by the
group size (padding changes the masks' shapes, hence the draws).
"""

from __future__ import annotations

import copy
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.func import functional_call
from torch.utils.checkpoint import set_checkpoint_early_stop

from hfkit.model.config import ModelConfig
from hfkit.model.evoformer import EvoformerBlock, EvoformerStack, ExtraMSAStack, run_blocks
from hfkit.model.model import AlphaFoldLite
from hfkit.model.msa import MSAColumnAttention, MSAColumnGlobalAttention
from hfkit.model.primitives import attend_rows, chunk_apply, mask_bias
from hfkit.nn.triangle_multiplication import (
    TriangleMultiplicationIncoming,
    TriangleMultiplicationOutgoing,
    fused_triangle_update,
)
from hfkit.ops.triangle_multiplication import Contraction, uses_triton

__all__ = [
    "DAPEvoformerBlock",
    "DAPEvoformerStack",
    "DAPExtraMSAStack",
    "DAPGroups",
    "OVERLAPPED_WITH",
    "Pending",
    "all_to_all",
    "dap_block_comm",
    "dap_groups",
    "gather",
    "pad_to_multiple",
    "reduce_grads",
    "scatter",
    "start_all_to_all",
    "start_gather",
    "to_dap",
]

ProcessGroup = Any  # torch.distributed.ProcessGroup, or None for the default group
FUSED_TRIANGLE_MULTIPLICATION = (TriangleMultiplicationOutgoing, TriangleMultiplicationIncoming)


@dataclass(frozen=True)
class DAPGroups:
    """This rank's groups in a dp x dap layout: `dap` shards one sample's activations, `dp` holds the
    ranks at the same DAP position across data-parallel replicas (all-reduce gradients over it)."""

    dap: ProcessGroup
    dp: ProcessGroup
    dap_rank: int
    dap_size: int
    dp_rank: int
    dp_size: int


def dap_groups(dap_size: int, timeout: timedelta | None = None) -> DAPGroups:
    """Split the default group (world size W) into W / dap_size DAP groups of consecutive ranks and
    dap_size data-parallel groups of ranks dap_size apart; return this rank's two.

    Every rank must call it (group creation is collective). `timeout` bounds every collective of the
    new groups (default: the default group's timeout).
    """
    if not dist.is_initialized():
        raise RuntimeError("dap_groups: the default process group is not initialized")
    world, rank = dist.get_world_size(), dist.get_rank()
    if not isinstance(dap_size, int) or dap_size < 1 or world % dap_size:
        raise ValueError(f"dap_size: expected a positive divisor of the world size {world}, got {dap_size!r}")
    dp_size = world // dap_size
    dap_group = dp_group = None
    for d in range(dp_size):  # every rank creates every group, in the same order
        ranks = list(range(d * dap_size, (d + 1) * dap_size))
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dap_group = g
    for a in range(dap_size):
        ranks = list(range(a, world, dap_size))
        g = dist.new_group(ranks, timeout=timeout)
        if rank in ranks:
            dp_group = g
    return DAPGroups(dap_group, dp_group, rank % dap_size, dap_size, rank // dap_size, dp_size)


def _collective_error(op: str, group: ProcessGroup, error: RuntimeError) -> RuntimeError:
    """The error of a failed collective, naming the collective and the group."""
    size, rank = dist.get_world_size(group), dist.get_rank(group)
    return RuntimeError(
        f"DAP {op} failed on rank {rank} of a group of {size} (a peer died, or the group's timeout "
        f"passed): {error}"
    )


def _run(op: str, group: ProcessGroup, fn: Any, *args: Any) -> None:
    """Run collective `fn(*args, group=group)`, naming the collective and the group when it fails."""
    try:
        fn(*args, group=group)
    except RuntimeError as e:
        raise _collective_error(op, group, e) from e


def _parts(x: torch.Tensor, dim: int, p: int) -> torch.Tensor:
    """x split evenly into p parts along `dim`, stacked first and contiguous: [P, .., D / P, ..] (part p
    for rank p; no copy where the dims before `dim` have size 1)."""
    d = dim % x.dim()
    return x.unflatten(d, (p, x.shape[d] // p)).movedim(d, 0).contiguous()


def _joined(parts: torch.Tensor, dim: int) -> torch.Tensor:
    """The parts [P, *shape] concatenated along `dim` of `shape` in order (`torch.cat(parts.unbind(0),
    dim)`): a view where the dims before `dim` have size 1, else one copy."""
    d = dim % (parts.dim() - 1)
    return parts.movedim(0, d).flatten(d, d + 1)


def _single(name: str) -> Any:
    """torch.distributed's one-buffer collective `name` ("all_gather" or "reduce_scatter"): its
    `<name>_single` (torch >= 2.13), else the older `<name>_into_tensor` / `_tensor` it replaced."""
    older = {"all_gather": "all_gather_into_tensor", "reduce_scatter": "reduce_scatter_tensor"}[name]
    return getattr(dist, f"{name}_single", None) or getattr(dist, older)


def _gather_buffer(x: torch.Tensor, p: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(recv [P, *x.shape], the same memory as [P * x.shape[0], ..]): the one-buffer all-gather writes the
    second (the layout nccl and gloo both take), the parts are the first's."""
    recv = x.new_empty((p, *x.shape))
    return recv, recv.flatten(0, 1)


def _all_gather(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    x = x.contiguous()
    recv, flat = _gather_buffer(x, dist.get_world_size(group))
    _run("all_gather", group, _single("all_gather"), flat, x)
    return _joined(recv, dim)


def _split(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[dim] % size:
        raise ValueError(f"x: expected dim {dim} divisible by the group size {size}, got {tuple(x.shape)}")
    return x.chunk(size, dim=dim)[dist.get_rank(group)].contiguous()


def _reduce_scatter(x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
    # gloo has no reduce-scatter: all-reduce, then keep this rank's part (nccl: one reduce-scatter).
    if dist.get_backend(group) == "nccl":
        size = dist.get_world_size(group)
        x = x.movedim(dim, 0).contiguous()
        out = x.new_empty((x.shape[0] // size, *x.shape[1:]))
        _run("reduce_scatter", group, _single("reduce_scatter"), out, x)
        return out.movedim(0, dim)
    x = x.contiguous()
    _run("all_reduce", group, dist.all_reduce, x)
    return _split(x, dim, group)


def _all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup) -> torch.Tensor:
    size = dist.get_world_size(group)
    if x.shape[split_dim] % size:
        raise ValueError(
            f"x: expected dim {split_dim} divisible by the group size {size}, got {tuple(x.shape)}"
        )
    send = _parts(x, split_dim, size)  # [P, ...]: part p goes to rank p
    recv = torch.empty_like(send)
    _run("all_to_all", group, dist.all_to_all_single, recv, send)
    return _joined(recv, cat_dim)


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.dim, ctx.group = dim, group
        return _split(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None]:
        return _all_gather(grad, ctx.dim, ctx.group), None, None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, dim: int, group: ProcessGroup, partial: bool) -> torch.Tensor:
        ctx.dim, ctx.group, ctx.partial = dim, group, partial
        return _all_gather(x, dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        if ctx.partial:
            return _reduce_scatter(grad, ctx.dim, ctx.group), None, None, None
        return _split(grad, ctx.dim, ctx.group), None, None, None


class _AllToAll(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup) -> torch.Tensor:
        ctx.split_dim, ctx.cat_dim, ctx.group = split_dim, cat_dim, group
        return _all_to_all(x, split_dim, cat_dim, group)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None, None, None]:
        return _all_to_all(grad, ctx.cat_dim, ctx.split_dim, ctx.group), None, None, None


class _ReduceGrads(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, group: ProcessGroup, *xs: torch.Tensor) -> tuple[torch.Tensor, ...]:
        ctx.group = group
        ctx.set_materialize_grads(False)  # an unused tensor's gradient stays None, as in one process
        return tuple(x.view_as(x) for x in xs)

    @staticmethod
    def backward(ctx: Any, *grads: torch.Tensor | None) -> tuple[torch.Tensor | None, ...]:
        # One flat buffer a dtype (a copy: autograd may share a gradient), one all-reduce each. Every rank
        # runs the same code, so the same gradients are None on every rank and the buffers match.
        out: list[torch.Tensor | None] = list(grads)
        for dtype in dict.fromkeys(g.dtype for g in grads if g is not None):
            index = [i for i, g in enumerate(grads) if g is not None and g.dtype == dtype]
            flat = torch.cat([grads[i].reshape(-1) for i in index])
            _run("all_reduce", ctx.group, dist.all_reduce, flat)
            for i, part in zip(index, flat.split([grads[i].numel() for i in index]), strict=True):
                out[i] = part.view(grads[i].shape)
        return (None, *out)


class Pending:
    """A DAP collective in flight (`start_gather`, `start_all_to_all`): `wait()` returns its result, as
    the synchronous `gather` / `all_to_all` would, and connects it to autograd.

    Autograd: the launch and the wait are two autograd nodes sharing this object. In backward the wait's
    node runs first (it is later in the graph): it launches the backward collective (the partial
    gather's reduce-scatter, the inverse all-to-all) asynchronously and hands the launch's node a
    placeholder of the receive buffer's shape; the launch's node waits for that collective and returns
    the input's gradient. The engine runs in between whatever backward work is ready, so the backward
    collective overlaps it as the forward one overlapped the forward's. With `overlap` False every
    collective is waited for where it is launched (forward and backward): the same collectives on the
    same buffers, hence bit-identical results.

    The backward collectives are the synchronous ones' (launching early changes when, not what): with
    y = gather(x) = [x_0, .., x_{P-1}] and a loss summed over the ranks, L = sum_q L_q(y) where rank q
    holds only dL_q/dy, dL/dx_r = sum_q (dL_q/dy)[part r] (a reduce-scatter) when each rank's use is
    partial, and (dL_r/dy)[part r] (a split) when every rank computes the same. An all-to-all only moves
    elements between ranks (a permutation P of the group's elements), so its adjoint is P's inverse,
    the all-to-all with split and concatenation dims exchanged. The gradient's layout (the whole
    tensor all-reduced on gloo, dim moved first for nccl's reduce-scatter) is the synchronous one's,
    so that the sums run in the same order.
    """

    def __init__(self, kind: str, group: ProcessGroup, overlap: bool, **how: Any) -> None:
        self.kind, self.group, self.overlap, self.how = kind, group, overlap, how
        self.size, self.rank = dist.get_world_size(group), dist.get_rank(group)
        self.work: Any = None
        self.grad_work: Any = None
        self.keep: tuple[torch.Tensor, ...] = ()  # buffers an asynchronous collective still reads
        self.recv: torch.Tensor | None = None  # the forward's receive buffer, until `finish`
        self.grad_recv: torch.Tensor | None = None
        self.recv_shape: tuple[int, ...] = ()
        self.launched: torch.Tensor | None = None  # the launch node's output, until `wait`
        self.waited = False

    @property
    def op(self) -> str:
        return "all_gather" if self.kind == "gather" else "all_to_all"

    def _launch(self, op: str, fn: Any, *args: Any) -> Any:
        try:
            work = fn(*args, group=self.group, async_op=True)
        except RuntimeError as e:
            raise _collective_error(op, self.group, e) from e
        if not self.overlap:
            self._finish(op, work)
            return None
        return work

    def _finish(self, op: str, work: Any) -> None:
        if work is None:
            return
        try:
            work.wait()
        except RuntimeError as e:
            raise _collective_error(op, self.group, e) from e

    # forward ----------------------------------------------------------------------------------------

    def start(self, x: torch.Tensor) -> torch.Tensor:
        """Launch the forward collective on x; return the receive buffer [P, *part]."""
        p = self.size
        if self.kind == "gather":
            x = x.contiguous()
            self.recv, flat = _gather_buffer(x, p)
            self.recv_shape = tuple(self.recv.shape)
            self.keep = (x,)
            self.work = self._launch("all_gather", _single("all_gather"), flat, x)
        else:
            split_dim = self.how["split_dim"]
            if x.shape[split_dim] % p:
                raise ValueError(
                    f"x: expected dim {split_dim} divisible by the group size {p}, got {tuple(x.shape)}"
                )
            send = _parts(x, split_dim, p)  # part p goes to rank p
            self.recv = torch.empty_like(send)
            self.recv_shape = tuple(send.shape)
            self.keep = (send,)
            self.work = self._launch("all_to_all", dist.all_to_all_single, self.recv, send)
        return self.recv

    def finish(self) -> torch.Tensor:
        """Wait for the forward collective; its result ([P, *part] joined along the output dim)."""
        self._finish(self.op, self.work)
        self.work, self.keep = None, ()
        dim = self.how["dim"] if self.kind == "gather" else self.how["cat_dim"]
        recv, self.recv = self.recv, None
        return _joined(recv, dim)

    # backward ---------------------------------------------------------------------------------------

    def start_backward(self, grad: torch.Tensor) -> torch.Tensor:
        """Launch the backward collective on the result's gradient (on the same layouts as `gather`'s
        and `all_to_all`'s backwards, so that sums run in the same order); return a stand-in shaped
        like the receive buffer (the launch's node reads the gradient from this object)."""
        p = self.size
        if self.kind == "all_to_all":
            send = _parts(grad, self.how["cat_dim"], p)
            self.grad_recv = torch.empty_like(send)
            self.keep = (send,)
            self.grad_work = self._launch("all_to_all", dist.all_to_all_single, self.grad_recv, send)
        elif not self.how["partial"]:  # replicated use: this rank's part of its own gradient
            self.grad_recv = _split(grad, self.how["dim"], self.group)
        elif dist.get_backend(self.group) == "nccl":
            whole = grad.movedim(self.how["dim"], 0).contiguous()
            self.grad_recv = whole.new_empty((whole.shape[0] // p, *whole.shape[1:]))
            self.keep = (whole,)
            self.grad_work = self._launch("reduce_scatter", _single("reduce_scatter"), self.grad_recv, whole)
        else:  # gloo has no reduce-scatter: all-reduce (a copy: grad may be shared), keep this rank's part
            whole = grad.contiguous()
            whole = whole.clone() if whole is grad else whole
            self.grad_recv = whole
            self.grad_work = self._launch("all_reduce", dist.all_reduce, whole)
        # The launch node ignores the gradient it is handed: a free stand-in of the right shape.
        return grad.new_zeros(()).expand(self.recv_shape)

    def finish_backward(self) -> torch.Tensor:
        """Wait for the backward collective; the input's gradient."""
        op = {"gather": "reduce_scatter", "all_to_all": "all_to_all"}[self.kind]
        self._finish(op, self.grad_work)
        grad, self.grad_work, self.grad_recv, self.keep = self.grad_recv, None, None, ()
        if self.kind == "all_to_all":
            return _joined(grad, self.how["split_dim"])
        if not self.how["partial"]:
            return grad
        if dist.get_backend(self.group) == "nccl":
            return grad.movedim(0, self.how["dim"])
        return _split(grad, self.how["dim"], self.group)

    def wait(self) -> torch.Tensor:
        """The collective's result (waiting for it if it is still in flight), connected to autograd."""
        if self.waited:
            raise RuntimeError(f"Pending.wait: this {self.op} was waited for already")
        launched, self.launched, self.waited = self.launched, None, True
        return _WaitCollective.apply(launched, self)


class _LaunchCollective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        return pending.start(x)

    @staticmethod
    def backward(ctx: Any, grad_recv: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.pending.finish_backward(), None


class _WaitCollective(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, recv: torch.Tensor, pending: Pending) -> torch.Tensor:
        ctx.pending = pending
        return pending.finish()

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> tuple[torch.Tensor, None]:
        return ctx.pending.start_backward(grad), None


def start_gather(
    x: torch.Tensor, dim: int, group: ProcessGroup = None, partial: bool = True, overlap: bool = True
) -> Pending:
    """Launch `gather(x, dim, group, partial)` asynchronously: [.., D, ..] -> (after `wait()`)
    [.., D * P, ..]. Work between this call and `wait()` that does not need the result overlaps the
    collective; its backward (reduce-scatter with `partial`) overlaps the backward work in between
    likewise. `overlap` False: waited for at once (the same result)."""
    pending = Pending("gather", group, overlap, dim=dim, partial=partial)
    pending.launched = _LaunchCollective.apply(x, pending)
    return pending


def start_all_to_all(
    x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup = None, overlap: bool = True
) -> Pending:
    """Launch `all_to_all(x, split_dim, cat_dim, group)` asynchronously (the row <-> column transpose);
    `wait()` returns the resharded tensor. Backward: the inverse all-to-all, launched when the result's
    gradient arrives and waited for where x's gradient is needed. `overlap` False: waited for at once."""
    pending = Pending("all_to_all", group, overlap, split_dim=split_dim, cat_dim=cat_dim)
    pending.launched = _LaunchCollective.apply(x, pending)
    return pending


def scatter(x: torch.Tensor, dim: int, group: ProcessGroup = None) -> torch.Tensor:
    """This rank's part of x (the same on every rank) split evenly along `dim`: [.., D, ..] ->
    [.., D / P, ..]. Backward: the parts' gradients gathered, i.e. the full gradient on every rank."""
    return _Scatter.apply(x, dim, group)


def gather(x: torch.Tensor, dim: int, group: ProcessGroup = None, partial: bool = True) -> torch.Tensor:
    """The ranks' parts concatenated along `dim` in rank order: [.., D, ..] -> [.., D * P, ..].

    Backward: with `partial` (each rank uses the result with its own shard of other data, so its
    gradient is one term of the sum) the gradients are summed over the ranks and this rank's part is
    kept (reduce-scatter); without (every rank computes the same from the result) this rank's part of
    its own gradient is kept.
    """
    return _Gather.apply(x, dim, group, partial)


def all_to_all(x: torch.Tensor, split_dim: int, cat_dim: int, group: ProcessGroup = None) -> torch.Tensor:
    """Reshard: x, sharded along `cat_dim` and whole along `split_dim`, becomes whole along `cat_dim` and
    sharded along `split_dim` (part p of `split_dim` goes to rank p). The row <-> column transpose of
    DAP; backward is the inverse all-to-all."""
    return _AllToAll.apply(x, split_dim, cat_dim, group)


def reduce_grads(xs: Sequence[torch.Tensor], group: ProcessGroup = None) -> tuple[torch.Tensor, ...]:
    """Identities whose backward sums the gradients over the group: for tensors every rank holds whole
    (a block's parameters) and uses with its own shard of the activations. The backward runs once every
    gradient is there, as one all-reduce of them all flattened together (one a dtype), not one each."""
    return _ReduceGrads.apply(group, *xs)


def pad_to_multiple(x: torch.Tensor, dim: int, multiple: int) -> torch.Tensor:
    """x zero-padded at the end of `dim` to the next multiple of `multiple` (itself if it divides)."""
    pad = -x.shape[dim] % multiple
    if pad == 0:
        return x
    shape = list(x.shape)
    shape[dim] = pad
    return torch.cat([x, x.new_zeros(shape)], dim=dim)


# What each collective of a DAP block's forward is in flight with (the module docstring's table), by
# `dap_block_comm`'s keys.
OVERLAPPED_WITH: dict[str, str] = {
    "msa_att_row pair bias (all_gather)": "the MSA layer norm, the row mask bias",
    "m rows -> columns (all_to_all)": "the column mask bias",
    "outer_product_mean b (all_gather)": "a = linear_1, the normaliser",
    "m columns -> rows (all_to_all)": "the outer product mean and the whole pair stack",
    "tri_mul_out b (all_gather)": "a and the gate (plain modules; hfkit's fused: nothing)",
    "tri_mul_in b (all_gather)": "a, a's transpose (in flight too), the gate (plain; fused: the transpose)",
    "tri_mul_in a (all_to_all)": "the gate, b's gather (in flight too) (plain; fused: the gather)",
    "tri_att_start bias (all_gather)": "the pair mask bias",
    "z rows -> columns (all_to_all)": "nothing (waited for at once)",
    "tri_att_end bias (all_gather)": "the pair mask bias",
    "z columns -> rows (all_to_all)": "nothing (waited for at once)",
}


def dap_block_comm(
    n_seq: int,
    n_res: int,
    config: ModelConfig,
    group_size: int,
    extra: bool = False,
) -> dict[str, int]:
    """Elements each rank receives in the forward of one DAP Evoformer block (`extra`: extra-MSA block,
    `c_e` channels) for an MSA of n_seq rows and n_res residues over `group_size` ranks, by collective
    (padding included; multiply by the element size for bytes). An all-gather of a local part of L
    elements receives (P - 1) L; an all-to-all, (P - 1) L / P. Backward moves as much again (the
    partial gathers' reduce-scatter, the inverse all-to-alls); `DAPEvoformerBlock.forward` also
    scatters and gathers m and z once, `forward_sharded` does not.
    """
    p = group_size
    s, n = -n_seq % p + n_seq, -n_res % p + n_res
    c_m = config.c_e if extra else config.c_m
    heads_msa = config.extra_no_heads_msa if extra else config.no_heads_msa
    gathered = lambda local: (p - 1) * local
    transposed = lambda local: (p - 1) * local // p
    return {
        "msa_att_row pair bias (all_gather)": gathered(n // p * n * heads_msa),
        "m rows -> columns (all_to_all)": transposed(s // p * n * c_m),
        "outer_product_mean b (all_gather)": gathered(s * (n // p) * config.c_hidden_opm),
        "m columns -> rows (all_to_all)": transposed(s * (n // p) * c_m),
        "tri_mul_out b (all_gather)": gathered(n // p * n * config.c_hidden_mul),
        "tri_mul_in b (all_gather)": gathered(n // p * n * config.c_hidden_mul),
        "tri_mul_in a (all_to_all)": transposed(n // p * n * config.c_hidden_mul),
        "tri_att_start bias (all_gather)": gathered(n // p * n * config.no_heads_pair),
        "z rows -> columns (all_to_all)": transposed(n // p * n * config.c_z),
        "tri_att_end bias (all_gather)": gathered(n // p * n * config.no_heads_pair),
        "z columns -> rows (all_to_all)": transposed(n // p * n * config.c_z),
    }


def _key_pad_bias(n_valid: int, n_padded: int, like: torch.Tensor, inf: float) -> torch.Tensor:
    """[n_padded]: 0 for the real positions, -inf for the padding (added to the mask's own bias)."""
    bias = like.new_zeros(n_padded)
    bias[n_valid:] = -inf
    return bias


def _attention_biases(
    mask: torch.Tensor, key_pad: torch.Tensor, inf: float, dtype: torch.dtype
) -> torch.Tensor:
    """The key bias [*, R, 1, 1, K] of mask [*, R, K] with the padding bias [K] added."""
    return mask_bias(mask.to(dtype), inf) + key_pad.to(dtype)


def _global_attention(ga: nn.Module, m: torch.Tensor, mask: torch.Tensor, pad: torch.Tensor) -> torch.Tensor:
    """`GlobalAttention.forward` (Algorithm 19) of `ga` on m [*, N_res, S, C], mask [*, N_res, S], with
    the padding bias pad [S] added to the key bias: its own bias cannot tell padded rows from masked
    ones, which matters for a column whose rows are all masked."""
    q = (m * mask[..., None]).sum(-2) / (mask.sum(-1)[..., None] + ga.eps)
    q = ga.linear_q(q).unflatten(-1, (ga.no_heads, ga.c_hidden)) * ga.c_hidden**-0.5
    k = ga.linear_k(m)
    v = ga.linear_v(m)
    a = torch.matmul(q, k.transpose(-1, -2)) + (ga.inf * (mask - 1.0) + pad)[..., None, :]
    o = torch.matmul(torch.softmax(a, dim=-1), v)
    g = torch.sigmoid(ga.linear_g(m)).unflatten(-1, (ga.no_heads, ga.c_hidden))
    return ga.linear_o((o.unsqueeze(-3) * g).flatten(-2))


class _ShardedEvoformerBlock(nn.Module):
    """The sharded computation of one Evoformer block over the block's own submodules."""

    def __init__(self, block: EvoformerBlock, group: ProcessGroup, overlap: bool) -> None:
        super().__init__()
        self.msa_att_row = block.msa_att_row
        self.msa_att_col = block.msa_att_col
        self.msa_dropout_layer = block.msa_dropout_layer
        self.core = block.core
        self.group = group
        self.overlap = overlap

    def _gather(self, x: torch.Tensor, dim: int) -> Pending:
        return start_gather(x, dim, self.group, partial=True, overlap=self.overlap)

    def _all_to_all(self, x: torch.Tensor, split_dim: int, cat_dim: int) -> Pending:
        return start_all_to_all(x, split_dim, cat_dim, self.group, overlap=self.overlap)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        n_seq: int,
        n_res: int,
        chunk_size: int | None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        g = self.group
        rank, size = dist.get_rank(g), dist.get_world_size(g)
        s_pad, n_pad = msa_mask.shape[-2], msa_mask.shape[-1]
        if s_pad % size or n_pad % size:
            raise ValueError(
                f"msa_mask: expected [*, S_p, N_p] with multiples of {size}, got {tuple(msa_mask.shape)}"
            )
        want_m = (s_pad // size, n_pad)
        want_z = (n_pad // size, n_pad)
        if tuple(m.shape[-3:-1]) != want_m or tuple(z.shape[-3:-1]) != want_z:
            raise ValueError(
                f"m, z: expected [*, {want_m[0]}, {n_pad}, C_m] and [*, {want_z[0]}, {n_pad}, C_z] for this "
                f"rank, got {tuple(m.shape)} and {tuple(z.shape)}"
            )
        if tuple(pair_mask.shape[-2:]) != (n_pad, n_pad):
            raise ValueError(f"pair_mask: expected [*, {n_pad}, {n_pad}], got {tuple(pair_mask.shape)}")
        rows_s = slice(rank * s_pad // size, (rank + 1) * s_pad // size)
        rows_n = slice(rank * n_pad // size, (rank + 1) * n_pad // size)
        dtype = m.dtype
        msa_mask = msa_mask.to(dtype)
        pair_mask = pair_mask.to(dtype)
        msa_mask_rows, msa_mask_cols = msa_mask[..., rows_s, :], msa_mask[..., rows_n]
        pair_mask_rows, pair_mask_cols = pair_mask[..., rows_n, :], pair_mask[..., rows_n]

        # MSA row attention with pair bias: m by rows of S; the bias [N, N, H] gathered over rows i
        # (in flight while m's layer norm and the mask bias are computed).
        att = self.msa_att_row
        pad_n = _key_pad_bias(n_res, n_pad, m, att.inf)
        pair_bias = self._gather(att.linear_z(att.layer_norm_z(z)), -3)
        m_normed = att.layer_norm_m(m)
        mask_bias_rows = _attention_biases(msa_mask_rows, pad_n, att.inf, dtype)
        biases = [mask_bias_rows, pair_bias.wait().movedim(-1, -3).unsqueeze(-4)]
        m = self.msa_dropout_layer.residual_add(m, attend_rows(att.mha, m_normed, biases, chunk_size))

        # MSA column attention: m to columns of N (whole S), attention along S within each column.
        m = self._all_to_all(m, -2, -3)
        m = self._column_attention(m, msa_mask_cols, n_seq, chunk_size)

        core = self.core
        m = core.msa_transition_step(m, msa_mask_cols, chunk_size)
        # m back to rows of S: in flight through the outer product mean and the whole pair stack.
        m_rows = self._all_to_all(m, -3, -2)
        z = z + self._outer_product_mean(m, msa_mask_cols, msa_mask, chunk_size)

        z = core.ps_dropout_row_layer.residual_add(z, self._tri_mul(core.tri_mul_out, z, pair_mask_rows))
        z = core.ps_dropout_row_layer.residual_add(z, self._tri_mul(core.tri_mul_in, z, pair_mask_rows))
        z = core.ps_dropout_row_layer.residual_add(
            z, self._tri_att(core.tri_att_start, z, pair_mask_rows, pad_n, chunk_size)
        )
        # Ending node: z to columns; in the transposed frame these are rows again. Nothing independent
        # of z is left to compute: these two transposes are waited for at once.
        z = self._all_to_all(z, -2, -3).wait()
        z_t = z.transpose(-2, -3)
        update = self._tri_att(core.tri_att_end, z_t, pair_mask_cols.transpose(-1, -2), pad_n, chunk_size)
        z = core.ps_dropout_col_layer.residual_add(z, update.transpose(-2, -3))
        z = self._all_to_all(z, -3, -2).wait()  # back to rows
        z = core.pair_transition_step(z, pair_mask_rows, chunk_size)
        return m_rows.wait(), z

    def _column_attention(
        self, m_cols: Pending, mask_cols: torch.Tensor, n_seq: int, chunk_size: int | None
    ) -> torch.Tensor:
        """m on its way to columns [*, S, N/P, C_m] (in flight while the mask bias is computed), its
        mask [*, S, N/P] -> m + column attention's update (gated self-attention, or the extra-MSA
        stack's global attention), S rows beyond n_seq padding."""
        mask_t = mask_cols.transpose(-1, -2)
        s_pad = mask_cols.shape[-2]
        if isinstance(self.msa_att_col, MSAColumnAttention):
            att = self.msa_att_col._msa_att
            pad_s = _key_pad_bias(n_seq, s_pad, mask_cols, att.inf)
            biases = [_attention_biases(mask_t, pad_s, att.inf, mask_cols.dtype)]
            m = m_cols.wait()
            update = attend_rows(att.mha, att.layer_norm_m(m.transpose(-2, -3)), biases, chunk_size)
            return m + update.transpose(-2, -3)
        ga = self.msa_att_col.global_attention
        pad_s = _key_pad_bias(n_seq, s_pad, mask_cols, ga.inf)
        m = m_cols.wait()
        x_t = self.msa_att_col.layer_norm_m(m.transpose(-2, -3))
        out = chunk_apply(
            lambda x_, mask_: _global_attention(ga, x_, mask_, pad_s), [x_t, mask_t], [-3, -2], -3, chunk_size
        )
        return m + out.transpose(-2, -3)

    def _outer_product_mean(
        self, m: torch.Tensor, mask_cols: torch.Tensor, mask: torch.Tensor, chunk_size: int | None
    ) -> torch.Tensor:
        """m by columns [*, S, N/P, C_m], its mask [*, S, N/P] and the whole mask [*, S, N] -> pair
        update for this rank's rows [*, N/P, N, C_z]."""
        opm = self.core.outer_product_mean
        mask_cols = mask_cols[..., None]
        ln = opm.layer_norm(m)
        # b gathered over all residues while a and the normaliser are computed.
        b = self._gather(opm.linear_2(ln) * mask_cols, -2)
        a = opm.linear_1(ln) * mask_cols
        norm = torch.einsum("...sia,...sja->...ija", mask_cols, mask[..., None])
        b = b.wait()
        outer = chunk_apply(lambda a_: opm._outer(a_, b), [a], [-2], -3, chunk_size)
        return outer / (opm.eps + norm)

    def _tri_mul(self, mod: nn.Module, z: torch.Tensor, mask_rows: torch.Tensor) -> torch.Tensor:
        """Triangle multiplication on rows i of z [*, N/P, N, C_z] -> update for the same rows: hfkit's
        fused op around `_ShardedContraction` where the module is hfkit's and the op's fused path runs,
        else the module's layers step by step with the gather in flight (below)."""
        if isinstance(mod, FUSED_TRIANGLE_MULTIPLICATION) and uses_triton(z, mod.linear_z.in_features):
            out = fused_triangle_update(mod, z, mask_rows, _ShardedContraction(self.group, self.overlap))
            if out is not None:
                return out
        mask_rows = mask_rows[..., None]
        zn = mod.layer_norm_in(z)
        # b gathered over all rows while a (and its transpose, incoming) and the gate are computed.
        b = self._gather(mask_rows * torch.sigmoid(mod.linear_b_g(zn)) * mod.linear_b_p(zn), -3)
        a = mask_rows * torch.sigmoid(mod.linear_a_g(zn)) * mod.linear_a_p(zn)
        a_cols = None if mod.outgoing else self._all_to_all(a, -2, -3)
        gate = torch.sigmoid(mod.linear_g(zn))
        b = b.wait().movedim(-1, -3)  # [*, C, N, N], all rows
        if a_cols is None:  # outgoing: x_ij = sum_k a_ik b_jk: a's own rows i, b's rows j from every rank
            x = torch.matmul(a.movedim(-1, -3), b.transpose(-1, -2))
        else:  # incoming: x_ij = sum_k a_ki b_kj: a's columns i (all k) through the transpose
            a = a_cols.wait().movedim(-1, -3)  # [*, C, N (k), N/P (i)]
            x = torch.matmul(a.transpose(-1, -2), b)
        x = mod.linear_z(mod.layer_norm_out(x.movedim(-3, -1)))
        return x * gate

    def _tri_att(
        self,
        mod: nn.Module,
        x: torch.Tensor,
        mask_rows: torch.Tensor,
        pad: torch.Tensor,
        chunk_size: int | None,
    ) -> torch.Tensor:
        """Starting-node triangle attention on rows of x [*, N/P, N, C_z] (the ending node's on the
        transposed pair representation) -> update for the same rows."""
        x = mod.layer_norm(x)
        triangle_bias = self._gather(mod.linear(x), -3)  # in flight while the mask bias is computed
        mask_bias = _attention_biases(mask_rows, pad, mod.inf, x.dtype)
        biases = [mask_bias, triangle_bias.wait().movedim(-1, -3).unsqueeze(-4)]
        return attend_rows(mod.mha, x, biases, chunk_size)


class _ShardedContraction(Contraction):
    """The fused triangle multiplication's contraction on this rank's rows i of the pair grid (a, b
    channel-first [*, C_h, N/P, N]). Outgoing, x_ij = sum_k a_ik b_jk: b's rows j gathered from every
    rank. Incoming, x_ij = sum_k a_ki b_kj: a's columns i for every k (all-to-all, in flight together
    with b's gather) and b's rows k gathered. Backward: the gathered operand's gradient is one term of
    a sum on each rank, reduce-scattered while the other operand's gradient is computed (and, incoming,
    sent back by the inverse all-to-all). The collectives are `Pending`s used without autograd (the op's
    backward calls them), so `overlap` False waits for each where it is launched: the same collectives
    on the same buffers as with it on."""

    def __init__(self, group: ProcessGroup, overlap: bool) -> None:
        self.group, self.overlap = group, overlap

    def _gather(self) -> Pending:  # rows (dim -2) of every rank; backward: reduce-scatter
        return Pending("gather", self.group, self.overlap, dim=-2, partial=True)

    def _transpose(self) -> Pending:  # this rank's rows, all columns -> all rows, this rank's columns
        return Pending("all_to_all", self.group, self.overlap, split_dim=-1, cat_dim=-2)

    def forward(self, a: torch.Tensor, b: torch.Tensor, outgoing: bool) -> tuple[torch.Tensor, tuple]:
        gather_b = self._gather()
        gather_b.start(b)
        if outgoing:
            b_all = gather_b.finish()  # [*, C_h, N, N]
            return torch.matmul(a, b_all.transpose(-1, -2)), (a, b_all)
        move_a = self._transpose()
        move_a.start(a)
        b_all, a_cols = gather_b.finish(), move_a.finish()  # a_cols [*, C_h, N (k), N/P (i)]
        return torch.matmul(a_cols.transpose(-1, -2), b_all), (a_cols, b_all)

    def backward(
        self, dx: torch.Tensor, outgoing: bool, a: torch.Tensor, b_all: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        reduce_b = self._gather()
        if outgoing:  # a: this rank's rows i
            reduce_b.start_backward(torch.matmul(dx.transpose(-1, -2), a))
            da = torch.matmul(dx, b_all)
        else:  # a: a_cols, every k for this rank's i
            reduce_b.start_backward(torch.matmul(a, dx))
            move_a = self._transpose()
            move_a.start_backward(torch.matmul(b_all, dx.transpose(-1, -2)))
            da = move_a.finish_backward()
        return da, reduce_b.finish_backward()


def _shard_inputs(
    m: torch.Tensor, z: torch.Tensor, msa_mask: torch.Tensor, pair_mask: torch.Tensor, group: ProcessGroup
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full inputs (the same on every rank) padded to multiples of the group size: this rank's MSA rows
    and pair rows, and the whole padded masks."""
    size = dist.get_world_size(group)
    n_seq, n_res = m.shape[-3], m.shape[-2]
    if z.shape[-3:-1] != (n_res, n_res) or msa_mask.shape[-2:] != (n_seq, n_res):
        raise ValueError(
            f"m, z, msa_mask: expected [*, S, N, C_m], [*, N, N, C_z], [*, S, N], got {tuple(m.shape)}, "
            f"{tuple(z.shape)}, {tuple(msa_mask.shape)}"
        )
    if pair_mask.shape[-2:] != (n_res, n_res):
        raise ValueError(f"pair_mask: expected [*, {n_res}, {n_res}], got {tuple(pair_mask.shape)}")
    m = pad_to_multiple(pad_to_multiple(m, -3, size), -2, size)
    z = pad_to_multiple(pad_to_multiple(z, -3, size), -2, size)
    msa_mask = pad_to_multiple(pad_to_multiple(msa_mask, -2, size), -1, size)
    pair_mask = pad_to_multiple(pad_to_multiple(pair_mask, -2, size), -1, size)
    return scatter(m, -3, group), scatter(z, -3, group), msa_mask, pair_mask


def _unshard(x: torch.Tensor, rows: int, cols: int, group: ProcessGroup) -> torch.Tensor:
    """This rank's rows of a padded [*, R_p, C_p, C] gathered whole on every rank and unpadded to
    [*, rows, cols, C]. Every rank then computes the same from it (backward: this rank's part)."""
    return gather(x, -3, group, partial=False)[..., :rows, :cols, :]


class _DAPModule(nn.Module):
    """What the DAP block and stacks share: `forward_sharded` on inputs already padded and sharded, and
    `forward` on the single-process module's full inputs. Subclasses give `_run_sharded(m, z, msa_mask,
    pair_mask, n_seq, n_res, chunk_size)` (the computation on shards -> (m, z) shards) and how its
    result is returned (`_sharded_result`, `_whole_result`)."""

    group: ProcessGroup

    def _sharded_result(self, m: torch.Tensor, z: torch.Tensor) -> Any:
        return m, z

    def _whole_result(self, m: torch.Tensor, z: torch.Tensor, n_seq: int, n_res: int) -> Any:
        """(m, z) shards -> (m, z) whole on every rank, unpadded."""
        return _unshard(m, n_seq, n_res, self.group), _unshard(z, n_res, n_res, self.group)

    def forward_sharded(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        n_seq: int | None = None,
        n_res: int | None = None,
        chunk_size: int | None = None,
    ) -> Any:
        """m: this rank's MSA rows [*, S_p / P, N_p, C_m], z: its pair rows [*, N_p / P, N_p, C_z],
        msa_mask [*, S_p, N_p] and pair_mask [*, N_p, N_p] whole (padded; small) -> (m, z) in the same
        layout (the extra-MSA stack: z only; the Evoformer stack leaves the single projection to the
        caller, as it needs MSA row 0, which rank 0 holds). S_p, N_p: the padded sizes (multiples of
        P); n_seq, n_res: the real ones (default: the padded ones), beyond which positions are padding.
        Parameter gradients are summed over the group in backward, so each rank ends with the full
        gradients."""
        s_pad, n_pad = msa_mask.shape[-2:]
        mz = self._run_sharded(m, z, msa_mask, pair_mask, n_seq or s_pad, n_res or n_pad, chunk_size)
        return self._sharded_result(*mz)

    def forward(
        self,
        m: torch.Tensor,
        z: torch.Tensor,
        msa_mask: torch.Tensor,
        pair_mask: torch.Tensor,
        chunk_size: int | None = None,
    ) -> Any:
        """The single-process module's signature and result, with the same full inputs on every rank:
        m [*, S, N, C_m] (the extra-MSA stack's a [*, S_extra, N, C_e]), z [*, N, N, C_z],
        msa_mask [*, S, N], pair_mask [*, N, N] -> its outputs whole on every rank. Pads to multiples of
        the group size and shards once, runs the blocks on shards, gathers and unpads once."""
        n_seq, n_res = m.shape[-3], m.shape[-2]
        m, z, msa_mask, pair_mask = _shard_inputs(m, z, msa_mask, pair_mask, self.group)
        m, z = self._run_sharded(m, z, msa_mask, pair_mask, n_seq, n_res, chunk_size)
        return self._whole_result(m, z, n_seq, n_res)


class DAPEvoformerBlock(_DAPModule):
    """An `EvoformerBlock` or `ExtraMSABlock` run with DAP over `group`; its submodules are the block's
    own (same parameters, same state_dict keys). See the module docstring for the layout and for what
    `overlap` overlaps; `forward` and `forward_sharded` as `_DAPModule`'s."""

    def __init__(self, block: EvoformerBlock, group: ProcessGroup = None, overlap: bool = True) -> None:
        super().__init__()
        if not isinstance(block.msa_att_col, (MSAColumnAttention, MSAColumnGlobalAttention)):
            raise TypeError(
                "block.msa_att_col: expected MSAColumnAttention or MSAColumnGlobalAttention, got "
                f"{type(block.msa_att_col).__name__}"
            )
        self.msa_att_row = block.msa_att_row
        self.msa_att_col = block.msa_att_col
        self.msa_dropout_layer = block.msa_dropout_layer
        self.core = block.core
        self.group = group
        self.overlap = overlap
        # Not a submodule (its parameters are these): keeps the state_dict the block's.
        object.__setattr__(self, "_sharded", _ShardedEvoformerBlock(block, group, overlap))

    def _run_sharded(self, *args: Any) -> tuple[torch.Tensor, torch.Tensor]:
        if dist.get_world_size(self.group) == 1:  # nothing to sum over
            return self._sharded(*args)
        names, params = zip(*self._sharded.named_parameters(), strict=True)
        summed = reduce_grads(params, self.group)  # one all-reduce of the block's gradients in backward
        return functional_call(self._sharded, dict(zip(names, summed, strict=True)), args)


class _DAPStack(_DAPModule):
    """The blocks of a stack as `DAPEvoformerBlock`s, run on shards in order; with the stack's
    `checkpoint` (and autograd on) each under a non-reentrant checkpoint (its collectives run again in
    backward, in the same order on every rank)."""

    def __init__(
        self, stack: EvoformerStack | ExtraMSAStack, group: ProcessGroup = None, overlap: bool = True
    ) -> None:
        super().__init__()
        self.checkpoint = stack.checkpoint
        self.blocks = nn.ModuleList(DAPEvoformerBlock(b, group, overlap) for b in stack.blocks)
        self.group = group

    def _run_sharded(self, m: torch.Tensor, z: torch.Tensor, *rest: Any) -> tuple[torch.Tensor, torch.Tensor]:
        # Recomputation runs each block's forward to its end. Stopped early (torch's default, once the
        # last saved tensor is back), it abandons collectives launched and not yet waited for, whose
        # `Pending` sits in a reference cycle (the launch node's output on it, it on the node's ctx)
        # that holds their buffers and the recomputed activations until Python's garbage collector
        # runs: measured, the checkpointed stack's peak rose above one process's and memory stayed
        # allocated after backward. The block's tail after its last saved tensor is a few additions.
        blocks = (b.forward_sharded for b in self.blocks)
        with set_checkpoint_early_stop(False):
            return run_blocks(blocks, m, z, *rest, recompute=self.checkpoint)


class DAPEvoformerStack(_DAPStack):
    """An `EvoformerStack` run with DAP over `group`: its blocks as `DAPEvoformerBlock`s and its own
    `linear` (same parameters, same state_dict keys). The inputs are padded and sharded once, the blocks
    run on shards, and the outputs are gathered once; s = linear(m[0]) is computed whole on every rank:
    `forward` -> (m, z, s [*, N, C_s]) as `EvoformerStack.forward`; `forward_sharded` -> (m, z) shards."""

    def __init__(self, stack: EvoformerStack, group: ProcessGroup = None, overlap: bool = True) -> None:
        super().__init__(stack, group, overlap)
        self.linear = stack.linear

    def _whole_result(
        self, m: torch.Tensor, z: torch.Tensor, n_seq: int, n_res: int
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        m, z = super()._whole_result(m, z, n_seq, n_res)
        return m, z, self.linear(m[..., 0, :, :])


class DAPExtraMSAStack(_DAPStack):
    """An `ExtraMSAStack` run with DAP over `group` (its blocks as `DAPEvoformerBlock`s with global
    column attention; same parameters, same state_dict keys): `forward` (a [*, S_extra, N, C_e], ...)
    returns z [*, N, N, C_z] whole on every rank as `ExtraMSAStack.forward`, `forward_sharded` this
    rank's z rows."""

    def _sharded_result(self, m: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        return z

    def _whole_result(self, m: torch.Tensor, z: torch.Tensor, n_seq: int, n_res: int) -> torch.Tensor:
        return _unshard(z, n_res, n_res, self.group)


def _dap_alphafold(model: AlphaFoldLite, group: ProcessGroup, overlap: bool) -> AlphaFoldLite:
    """A shallow copy of `model` whose `evoformer` and `extra_msa_stack` run with DAP; every other
    submodule (embedders, heads) is the model's own and runs whole on every rank."""
    dap = copy.copy(model)
    # Own registries, so that setting the stacks below leaves `model`'s untouched.
    dap._modules = dict(model._modules)
    dap._parameters = dict(model._parameters)
    dap._buffers = dict(model._buffers)
    dap.evoformer = DAPEvoformerStack(model.evoformer, group, overlap)
    if model.extra_msa_stack is not None:
        dap.extra_msa_stack = DAPExtraMSAStack(model.extra_msa_stack, group, overlap)
    return dap


def to_dap(module: nn.Module, group: ProcessGroup = None, overlap: bool = True) -> nn.Module:
    """`module` run with Dynamic Axial Parallelism over `group` (default: the default group), sharing
    its parameters (same state_dict): an `EvoformerBlock` or `ExtraMSABlock` (-> `DAPEvoformerBlock`),
    an `EvoformerStack` (-> `DAPEvoformerStack`), an `ExtraMSAStack` (-> `DAPExtraMSAStack`) or an
    `AlphaFoldLite` (-> an `AlphaFoldLite` whose two stacks are those; embedders and heads run whole
    on every rank). `overlap` (duality async): collectives are launched asynchronously and waited for
    where their result is needed (the module docstring's table); False waits for each where it is
    launched. The results are bit-identical either way."""
    if isinstance(module, AlphaFoldLite):
        return _dap_alphafold(module, group, overlap)
    if isinstance(module, EvoformerBlock):
        return DAPEvoformerBlock(module, group, overlap)
    if isinstance(module, EvoformerStack):
        return DAPEvoformerStack(module, group, overlap)
    if isinstance(module, ExtraMSAStack):
        return DAPExtraMSAStack(module, group, overlap)
    raise TypeError(
        "module: expected an EvoformerBlock, ExtraMSABlock, EvoformerStack, ExtraMSAStack or "
        f"AlphaFoldLite, got {type(module).__name__}"
    )
