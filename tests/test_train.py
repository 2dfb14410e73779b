"""hfkit.train: synthetic batches match the feature schema, AlphaFold's lr schedule, gradient clipping,
timed phases, a few steps lowering the loss (synthetic features, and real 2q2k features where
OpenFold's test data is present), `graphed_step` (eager on CPU, a CUDA graph on a GPU) and `hfkit
train`."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

from hfkit.data.dataset import collate_fixed
from hfkit.data.msa_sampling import feature_shapes
from hfkit.model import AlphaFoldLite, ModelConfig
from hfkit.train import (
    PHASES,
    graphed_step,
    lr_schedule,
    make_optimizer,
    make_scheduler,
    synthetic_batch,
    train,
    train_step,
)

TINY = ModelConfig.tiny()


pytestmark = pytest.mark.usefixtures("one_thread")


def eval_loss(model: AlphaFoldLite, batch: dict) -> float:
    model.eval()
    with torch.no_grad():
        return float(model.loss(batch, model(batch))[0])


def test_synthetic_batch_matches_feature_schema() -> None:
    batch = synthetic_batch(TINY, batch_size=2, seed=3)
    shapes = feature_shapes(TINY.feature_config())
    assert set(batch) == set(shapes)
    for key, shape in shapes.items():
        assert batch[key].shape == (2, *shape), key
    assert batch["aatype"].dtype == torch.int64 and batch["msa_feat"].dtype == torch.float32
    assert torch.equal(batch["target_feat"].sum(-1), torch.ones(2, TINY.crop_size))
    again = synthetic_batch(TINY, batch_size=2, seed=3)
    assert all(torch.equal(batch[k], again[k]) for k in batch)
    with pytest.raises(ValueError, match="batch_size"):
        synthetic_batch(TINY, batch_size=0)


def test_lr_schedule_warmup_constant_decay() -> None:
    assert lr_schedule(0) == 0.0
    assert lr_schedule(500) == pytest.approx(5e-4)
    assert lr_schedule(1000) == pytest.approx(1e-3)
    assert lr_schedule(1001) == lr_schedule(50000) == pytest.approx(1e-3)
    assert lr_schedule(50001) == pytest.approx(0.95e-3)
    assert lr_schedule(100000) == pytest.approx(0.95e-3)
    assert lr_schedule(100001) == pytest.approx(0.95**2 * 1e-3)
    assert lr_schedule(10, base_lr=1.0, warmup=0) == 1.0
    with pytest.raises(ValueError, match="step"):
        lr_schedule(-1)
    model = torch.nn.Linear(2, 2)
    opt = make_optimizer(model, lr=2e-3)
    assert opt.defaults["betas"] == (0.9, 0.999) and opt.defaults["eps"] == 1e-6
    sched = make_scheduler(opt, warmup=4)
    lrs = []
    for _ in range(6):
        lrs.append(opt.param_groups[0]["lr"])
        opt.step()
        sched.step()
    assert lrs == pytest.approx([0.0, 5e-4, 1e-3, 1.5e-3, 2e-3, 2e-3])


def test_train_step_clips_global_grad_norm_and_times_phases() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY)
    opt = make_optimizer(model)
    out = train_step(model, batch, opt, clip=0.1)
    norm = torch.linalg.vector_norm(
        torch.stack([p.grad.norm() for p in model.parameters() if p.grad is not None])
    )
    assert out["grad_norm"] > 0.1  # the clip was active
    assert float(norm) <= 0.1 * (1 + 1e-4)
    assert set(out["parts"]) == {"distogram", "masked_msa"}
    assert math.isfinite(out["loss"])
    assert set(out["timings"]) == {"forward", "backward", "optimizer"}


def test_train_lowers_loss_on_synthetic_batch() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY, seed=1)
    first = eval_loss(model, batch)
    opt = make_optimizer(model, lr=3e-3)
    records = train(model, [batch], 6, optimizer=opt, scheduler=None, progress=False)
    last = eval_loss(model, batch)
    assert last < first - 0.05, (first, last)
    assert len(records) == 6
    for record in records:
        assert tuple(record["timings"]) == PHASES
        assert all(t > 0 for t in record["timings"].values()), record["timings"]
    assert records[-1]["loss"] < records[0]["loss"]


def test_train_defaults_synthetic_data_and_schedule() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    records = train(model, None, 2, progress=True)
    assert [r["lr"] for r in records] == pytest.approx([0.0, 1e-6])  # AlphaFold's warm-up
    with pytest.raises(ValueError, match="autocast_dtype"):
        train(model, None, 1, autocast_dtype=torch.float32, progress=False)


def test_train_bf16_autocast_runs() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    records = train(model, None, 1, autocast_dtype=torch.bfloat16, progress=False)
    assert math.isfinite(records[0]["loss"])


def test_real_2q2k_train_lowers_loss() -> None:
    from test_model import real_2q2k_sample

    sample = real_2q2k_sample()
    if sample is None:
        pytest.skip("OpenFold test data (2q2k) not found; see hfkit.data.openfold_test_data_dir")
    batch = collate_fixed([sample])
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    first = eval_loss(model, batch)
    records = train(model, [batch], 8, optimizer=make_optimizer(model, lr=3e-3), progress=False)
    last = eval_loss(model, batch)
    assert last < first - 0.05, (first, last)
    assert set(records[-1]["parts"]) == {"distogram", "masked_msa"}


def perturbed(model: AlphaFoldLite, scale: float = 0.1) -> AlphaFoldLite:
    """`model` with noise added to every parameter: the zero-initialised heads of a fresh model give
    the same loss for every batch and every dropout mask, which would hide a stale batch buffer or
    a repeated mask."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * scale)
    return model


def _three_batches() -> list[dict[str, torch.Tensor]]:
    return [synthetic_batch(TINY, seed=10 + i) for i in range(3)]


class CountCasts(TorchDispatchMode):
    """Counts aten._to_copy calls (autocast's casts among them)."""

    def __init__(self) -> None:
        super().__init__()
        self.casts = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.casts += func is torch.ops.aten._to_copy.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("checkpoint", [False, True])
def test_autocast_step_casts_linear_weights_in_one_copy(checkpoint: bool) -> None:
    """Under bf16 autocast, train_step hands the model its nn.Linear weights already in bf16 (one
    multi-tensor cast, gradients cast back in one): the loss and every gradient equal those of autocast
    casting each weight at each use, with far fewer casts, and the parameters are back afterwards."""
    config = TINY.replace(checkpoint=checkpoint, msa_dropout=0.0, pair_dropout=0.0)
    batch = synthetic_batch(config)
    torch.manual_seed(0)
    model = perturbed(AlphaFoldLite(config))
    reference = copy.deepcopy(model)
    with CountCasts() as plain:
        with torch.autocast("cpu", dtype=torch.bfloat16):
            total = reference.loss(batch, reference(batch))[0]
        total.backward()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)  # lr 0: the step leaves the weights as they are
    with CountCasts() as cast_once:
        record = train_step(model, batch, opt, clip=None, autocast_dtype=torch.bfloat16)
    assert record["loss"] == float(total.detach())
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert (p.grad is None) == (q.grad is None), name  # no gradient stays none (Adam skips it)
        if p.grad is not None:
            assert p.grad.dtype == torch.float32, name
            torch.testing.assert_close(p.grad, q.grad, rtol=0, atol=0, msg=name)
    linears = [m for m in model.modules() if isinstance(m, nn.Linear)]
    assert all(type(m.weight) is nn.Parameter for m in linears)
    assert cast_once.casts < plain.casts - len(linears)


def test_weight_casts_are_aligned_views_per_device() -> None:
    from hfkit.train import _ALIGN, _cast_into

    tensors = [torch.randn(3, 5), torch.randn(7), torch.randn(2, 65), torch.empty(4, 3, device="meta")]
    out = _cast_into(tensors, torch.bfloat16)
    for t, c in zip(tensors, out, strict=True):
        assert c.dtype == torch.bfloat16 and c.shape == t.shape and c.device == t.device
        assert c.storage_offset() % _ALIGN == 0  # each starts aligned, like a tensor of its own
    for t, c in zip(tensors[:3], out, strict=False):
        assert torch.equal(c, t.to(torch.bfloat16))
    assert out[0].untyped_storage().data_ptr() == out[2].untyped_storage().data_ptr()  # one buffer


def test_graphed_step_falls_back_eagerly_and_matches_train_step() -> None:
    batches = _three_batches()
    torch.manual_seed(0)
    reference = perturbed(AlphaFoldLite(TINY))
    model = copy.deepcopy(reference)
    ref_opt = make_optimizer(reference)
    ref_sched = make_scheduler(ref_opt, warmup=2)
    opt = make_optimizer(model)
    sched = make_scheduler(opt, warmup=2)
    step = graphed_step(model, opt, batches[0], scheduler=sched, timed=True)
    assert not step.graphed  # CPU: eager, the same call
    torch.manual_seed(1)
    expected = [train_step(reference, b, ref_opt, ref_sched, clip=0.1) for b in batches]
    torch.manual_seed(1)
    losses = [float(step(b)) for b in batches]
    assert losses == [r["loss"] for r in expected]  # the same math, step for step
    assert float(step.grad_norm) == expected[-1]["grad_norm"]
    assert {k: float(v) for k, v in step.parts.items()} == expected[-1]["parts"]
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        assert torch.equal(p, q), name
    assert opt.param_groups[0]["lr"] == ref_opt.param_groups[0]["lr"] == pytest.approx(1e-3)
    assert step.step_count == 3
    assert set(step.last_times) == {"copy", "forward", "backward", "optimizer"}
    assert len(set(losses)) == 3  # each batch was really used


def test_graphed_step_matches_hand_written_loop_with_dropout() -> None:
    """Forward, loss, backward, clip, Adam and AlphaFold's schedule written out by hand, dropout on:
    the same RNG seed gives the same losses and parameters."""
    batches = _three_batches()
    torch.manual_seed(0)
    reference = perturbed(AlphaFoldLite(TINY))
    model = copy.deepcopy(reference)
    ref_opt = torch.optim.Adam(reference.parameters(), lr=1e-3, betas=(0.9, 0.999), eps=1e-6)
    torch.manual_seed(5)
    reference.train()
    losses_by_hand = []
    for i, batch in enumerate(batches):
        for group in ref_opt.param_groups:
            group["lr"] = lr_schedule(i, warmup=2)
        total, _ = reference.loss(batch, reference(batch))
        ref_opt.zero_grad()
        total.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        ref_opt.step()
        losses_by_hand.append(float(total.detach()))
    opt = make_optimizer(model)
    step = graphed_step(model, opt, batches[0], clip_norm=0.5, scheduler=make_scheduler(opt, warmup=2))
    torch.manual_seed(5)
    losses = [step(b).item() for b in batches]
    assert losses == pytest.approx(losses_by_hand, rel=1e-6)
    for (name, p), q in zip(model.named_parameters(), reference.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=1e-6, msg=name)
    assert step.last_times == {}  # not timed


def test_graphed_step_rejects_other_batch_layouts() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY)
    step = graphed_step(model, make_optimizer(model), batch)
    before = [p.detach().clone() for p in model.parameters()]
    wrong_shape = dict(batch, msa_feat=batch["msa_feat"][:, :-1])
    with pytest.raises(ValueError, match=r"msa_feat.*expected shape \(1, 8, 32, 49\).*got \(1, 7, 32, 49\)"):
        step(wrong_shape)
    missing = {k: v for k, v in batch.items() if k != "bert_mask"}
    with pytest.raises(ValueError, match=r"missing features \['bert_mask'\]"):
        step(missing)
    with pytest.raises(ValueError, match=r"'aatype'.*expected dtype torch.int64.*got torch.int32"):
        step(dict(batch, aatype=batch["aatype"].int()))
    with pytest.raises(ValueError, match=r"\['extra_feature'\] are not in the example batch"):
        step(dict(batch, extra_feature=torch.zeros(1)))
    assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
    assert step.step_count == 0
    step(dict(batch, chain_id=["x_A"]))  # non-tensor values are not features
    assert step.step_count == 1


def test_graphed_step_checks_its_arguments() -> None:
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY)
    opt = make_optimizer(model)
    with pytest.raises(ValueError, match="graphed: a CUDA graph needs the model on a CUDA device, got cpu"):
        graphed_step(model, opt, batch, graphed=True)
    with pytest.raises(ValueError, match="clip_norm"):
        graphed_step(model, opt, batch, clip_norm=0.0)
    with pytest.raises(ValueError, match="autocast_dtype"):
        graphed_step(model, opt, batch, autocast_dtype=torch.float32)
    with pytest.raises(ValueError, match="warmup_steps"):
        graphed_step(model, opt, batch, warmup_steps=0)
    with pytest.raises(ValueError, match="example_batch"):
        graphed_step(model, opt, {"name": ["x"]})
    sgd = graphed_step(model, torch.optim.SGD(model.parameters(), lr=0.1), batch, clip_norm=None)
    assert math.isfinite(sgd(batch).item()) and float(sgd.grad_norm) > 0  # eager: any optimizer


def test_graphed_step_bf16_and_checkpointing_run_eagerly() -> None:
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY.replace(checkpoint=True))
    batch = synthetic_batch(TINY)
    step = graphed_step(model, make_optimizer(model, lr=3e-3), batch, autocast_dtype=torch.bfloat16)
    losses = [step(batch).item() for _ in range(3)]
    assert all(math.isfinite(x) for x in losses)
    assert losses[-1] < losses[0]


def test_graphed_step_undoes_its_warm_up() -> None:
    """What the CUDA path does around capture, checked on the CPU: after warm-up steps, parameters
    and the optimizer state are as before, in the same tensor objects (the graph holds them), and
    state the warm-up created is Adam's initial zeros."""
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY)
    opt = make_optimizer(model)
    step = graphed_step(model, opt, batch)
    for fresh in (True, False):
        before = [p.detach().clone() for p in model.parameters()]
        state_before = {p: {k: v.clone() for k, v in s.items()} for p, s in opt.state.items()}
        snapshot = step._snapshot()
        for _ in range(2):
            step(batch)
        tensors = {id(v) for s in opt.state.values() for v in s.values()}
        step._restore(snapshot)
        assert {id(v) for s in opt.state.values() for v in s.values()} == tensors
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        assert len(opt.state) > 0
        for p, state in opt.state.items():
            for key, value in state.items():
                expected = torch.zeros_like(value) if fresh else state_before[p][key]
                assert torch.equal(value, expected), key
        step(batch)  # the second round starts from existing state


def test_graphed_step_capture_flow_with_cuda_mocked(monkeypatch: pytest.MonkeyPatch) -> None:
    """The CUDA path's Python on the CPU, torch.cuda's streams and graphs mocked (the "capture" runs
    eagerly, a replay does nothing): the optimizer is made capturable with a tensor lr, the capture
    starts from the restored parameters and zeroed optimizer state, and a call refills the static
    buffers, replays once and fills the lr tensor from the schedule."""
    import contextlib
    import importlib

    adam_module = importlib.import_module("torch.optim.adam")  # torch.optim.adam names the function
    events: list[str] = []
    torch.manual_seed(0)
    model = AlphaFoldLite(TINY)
    batch = synthetic_batch(TINY)
    opt = make_optimizer(model)
    before = [p.detach().clone() for p in model.parameters()]

    class Stream:
        def __init__(self, *args: object) -> None: ...

        def wait_stream(self, other: object) -> None: ...

    class Graph:
        def replay(self) -> None:
            events.append("replay")

    @contextlib.contextmanager
    def capture(graph: Graph, capture_error_mode: str):
        assert all(torch.equal(p, q) for p, q in zip(model.parameters(), before, strict=True))
        assert opt.state and all(not v.any() for s in opt.state.values() for v in s.values())
        assert all(p.grad is None for p in model.parameters())
        events.append(f"capture {capture_error_mode}")
        yield

    monkeypatch.setattr(torch.cuda, "Stream", Stream)
    monkeypatch.setattr(torch.cuda, "current_stream", lambda *args: Stream())
    monkeypatch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    monkeypatch.setattr(torch.cuda, "CUDAGraph", Graph)
    monkeypatch.setattr(torch.cuda, "graph", capture)
    monkeypatch.setattr(adam_module, "_get_capturable_supported_devices", lambda *a, **k: ["cpu"])
    step = graphed_step(model, opt, batch, scheduler=make_scheduler(opt, warmup=2), graphed=False)
    step.graphed = True  # the model is on the CPU: take the CUDA path by hand
    step._capture(batch, warmup_steps=2)
    assert events == ["capture thread_local"]
    lr = opt.param_groups[0]["lr"]
    assert isinstance(lr, torch.Tensor) and float(lr) == 0.0
    assert opt.param_groups[0]["capturable"] and opt.param_groups[0]["foreach"]
    assert step.loss is not None and set(step.parts) == {"distogram", "masked_msa"}
    other = synthetic_batch(TINY, seed=7)
    loss = step(other)
    assert events[-1] == "replay" and loss is step.loss
    assert all(torch.equal(step._static[k], other[k]) for k in other)
    assert opt.param_groups[0]["lr"] is lr and float(lr) == pytest.approx(5e-4)
    with pytest.raises(ValueError, match="msa_feat"):
        step(dict(other, msa_feat=other["msa_feat"][..., :-1]))
    assert events.count("replay") == 1
    assert all(torch.isfinite(p).all() for p in model.parameters())


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@needs_cuda
@pytest.mark.parametrize("checkpoint", [False, True])
@pytest.mark.parametrize("autocast_dtype", [None, torch.bfloat16])
def test_graphed_step_matches_eager_cuda(checkpoint: bool, autocast_dtype: torch.dtype | None) -> None:
    """Dropout off (so both paths draw no random numbers): the graph replays give the eager losses
    and parameters within the dtype's tolerance, step after step."""
    config = TINY.replace(checkpoint=checkpoint, msa_dropout=0.0, pair_dropout=0.0)
    batches = [synthetic_batch(config, seed=20 + i, device="cuda") for i in range(3)]
    torch.manual_seed(0)
    eager_model = perturbed(AlphaFoldLite(config)).cuda()
    graph_model = copy.deepcopy(eager_model)
    eager_opt, graph_opt = make_optimizer(eager_model), make_optimizer(graph_model)
    eager = graphed_step(
        eager_model,
        eager_opt,
        batches[0],
        graphed=False,
        autocast_dtype=autocast_dtype,
        scheduler=make_scheduler(eager_opt, warmup=2),
    )
    graph = graphed_step(
        graph_model,
        graph_opt,
        batches[0],
        autocast_dtype=autocast_dtype,
        scheduler=make_scheduler(graph_opt, warmup=2),
    )
    assert graph.graphed and not eager.graphed
    tol = {"rtol": 2e-2, "atol": 2e-3} if autocast_dtype is not None else {"rtol": 1e-4, "atol": 1e-5}
    for batch in batches:
        eager_loss = eager(batch).item()
        graph_loss = graph(batch).item()
        assert graph_loss == pytest.approx(eager_loss, rel=tol["rtol"])
    for (name, p), q in zip(graph_model.named_parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, **tol, msg=name)
    assert graph_opt.param_groups[0]["lr"].device.type == "cuda"
    assert float(graph_opt.param_groups[0]["lr"]) == pytest.approx(1e-3)


@needs_cuda
def test_graphed_step_with_hfkit_ops_matches_eager_cuda() -> None:
    """The swapped model (hfkit's Triton kernels inside the graph), bf16 and checkpointed."""
    from hfkit.nn.convert import to_hfkit

    config = TINY.replace(checkpoint=True, msa_dropout=0.0, pair_dropout=0.0)
    batches = [synthetic_batch(config, seed=40 + i) for i in range(3)]
    torch.manual_seed(0)
    eager_model = to_hfkit(perturbed(AlphaFoldLite(config)).cuda())
    graph_model = copy.deepcopy(eager_model)
    steps = [
        graphed_step(m, make_optimizer(m), batches[0], autocast_dtype=torch.bfloat16, graphed=graphed)
        for m, graphed in ((eager_model, False), (graph_model, True))
    ]
    for batch in batches:
        eager_loss, graph_loss = (step(batch).item() for step in steps)
        assert graph_loss == pytest.approx(eager_loss, rel=2e-2)
    for (name, p), q in zip(graph_model.named_parameters(), eager_model.parameters(), strict=True):
        torch.testing.assert_close(p, q, rtol=2e-2, atol=2e-3, msg=name)


@needs_cuda
@pytest.mark.parametrize("ops", ["torch", "hfkit"])
def test_graphed_step_refills_buffers_and_redraws_dropout_cuda(ops: str) -> None:
    """lr 0 keeps the parameters fixed: another batch gives another loss (the static buffers are
    refilled), and with dropout on (torch's or hfkit's fused dropout, whose seed is drawn on the
    device), the same batch gives another loss each replay."""
    from hfkit.nn.convert import to_hfkit

    def build(config: ModelConfig) -> AlphaFoldLite:
        model = perturbed(AlphaFoldLite(config)).cuda()
        return to_hfkit(model) if ops == "hfkit" else model

    batches = [synthetic_batch(TINY, seed=30 + i) for i in range(2)]  # on the CPU: copied in
    torch.manual_seed(0)
    model = build(TINY.replace(msa_dropout=0.0, pair_dropout=0.0))
    step = graphed_step(model, make_optimizer(model, lr=0.0), batches[0])
    first, second, first_again = (step(b).item() for b in (batches[0], batches[1], batches[0]))
    assert first != second
    assert first_again == pytest.approx(first, rel=1e-6)
    loss = step(batches[1])
    assert loss.data_ptr() == step(batches[0]).data_ptr()  # the static output, overwritten

    torch.manual_seed(0)
    model = build(TINY)  # dropout 0.15 (MSA) and 0.25 (pair)
    step = graphed_step(model, make_optimizer(model, lr=0.0), batches[0])
    losses = {step(batches[0]).item() for _ in range(3)}
    assert len(losses) == 3


def test_cli_train_synthetic(capsys: pytest.CaptureFixture[str]) -> None:
    from hfkit.cli import main

    # --ops torch: hfkit's Triton kernels would run under the interpreter here (minutes)
    argv = ["train", "--synthetic", "--preset", "tiny", "--ops", "torch", "--device", "cpu"]
    assert main([*argv, "--steps", "2", "--batch-size", "2", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "tiny" in out and "eager" in out and "synthetic batches, batch size 2" in out
    assert "over 2 steps" in out
    for phase in ("data", "copy", "forward", "backward", "optimizer", "total"):
        assert f"\n  {phase} " in out, phase
    assert main([*argv, "--steps", "1", "--graphed"]) == 2
    assert "needs the model on a CUDA device" in capsys.readouterr().err


def test_cli_train_records(tmp_path, capsys: pytest.CaptureFixture[str]) -> None:
    from hfkit.cli import main
    from hfkit.data.preprocess import preprocess
    from hfkit.data.synthetic import write_synthetic_dataset

    src, records = tmp_path / "src", tmp_path / "records"
    write_synthetic_dataset(src, n_chains=2, length=40, depth=12, seed=1)
    summary = preprocess(src / "mmcifs", src / "alignments", records, workers=0, progress=False)
    assert summary.ok
    argv = ["train", "--records", str(records), "--preset", "tiny", "--steps", "2", "--ops", "torch"]
    assert main([*argv, "--bf16", "--checkpointing", "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert f"records {records}" in out and "checkpointing True, bf16" in out
    assert "over 2 steps" in out
    assert main(["train", "--records", str(tmp_path / "absent"), "--preset", "tiny", "--steps", "1"]) == 2
    assert "does not exist" in capsys.readouterr().err
