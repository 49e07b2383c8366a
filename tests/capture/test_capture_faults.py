"""Capture faults: grad-mode blocks in the forward, and forwards that never return."""

from __future__ import annotations

import ctypes
import importlib
import math
import os
import queue
import signal
import threading
import time
from types import SimpleNamespace

import pytest
import torch
from torch import nn

import explorer as ex
from explorer.cli.commands import main
from explorer.core.errors import CaptureError, CaptureTimeout

# the module, not the ``ex.capture`` function of the same name
deadline = importlib.import_module("explorer.capture.deadline")

KINDS = ("no_grad", "set_grad_enabled", "decorated", "enable_grad_inside")


class GradBlockNet(nn.Module):
    """A forward with a block that takes no gradient: a scale from the activations and a
    weight read from a parameter (``kind`` says how the block is written)."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 16)
        self.c = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        if self.kind == "no_grad":
            with torch.no_grad():
                scale = h.abs().mean(dim=-1, keepdim=True) + 1
                w = self.b.weight * 0.5
        elif self.kind == "set_grad_enabled":
            with torch.set_grad_enabled(False):
                scale = h.abs().mean(dim=-1, keepdim=True) + 1
                w = self.b.weight * 0.5
        elif self.kind == "decorated":
            scale, w = self.stats(h)
        else:  # enable_grad_inside: gradients flow into w, not into w2
            with torch.no_grad():
                scale = h.abs().mean(dim=-1, keepdim=True) + 1
                with torch.enable_grad():
                    w = self.b.weight * 0.5
                w2 = w * 1.0
            w = w + w2
        h = h / scale
        return self.c(self.b(h) + h @ w.t())

    @torch.no_grad()
    def stats(self, h: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return h.abs().mean(dim=-1, keepdim=True) + 1, self.b.weight * 0.5


class EmaNet(nn.Module):
    """A running mean kept in a buffer, updated in place under no_grad (as BatchNorm does)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.c = nn.Linear(16, 4)
        self.register_buffer("ema", torch.zeros(16))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = torch.relu(self.a(x))
        with torch.no_grad():
            self.ema.mul_(0.9).add_(0.1 * h.mean(0))
        return self.c(h - self.ema)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.fc = nn.Linear(8, 8)

    def forward(self, h: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            scale = h.abs().mean(dim=-1, keepdim=True) + 1
        return torch.relu(self.fc(h / scale)) + h


class BlocksNet(nn.Module):
    """Six identical blocks, each with a no-grad region, read straight from the input."""

    def __init__(self) -> None:
        super().__init__()
        self.blocks = nn.ModuleList(Block() for _ in range(6))
        self.head = nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _batch() -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(0)
    return torch.randn(8, 8, generator=gen), torch.randn(8, 4, generator=gen)


def _model(cls: type[nn.Module], *args) -> nn.Module:
    torch.manual_seed(0)
    return cls(*args)


def _capture(model: nn.Module, **kw) -> ex.OpGraph:
    x, y = _batch()
    return ex.capture(model, x, loss_fn=nn.functional.mse_loss, targets=y, **kw)


def _eager_step(model: nn.Module) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    x, y = _batch()
    model.zero_grad(set_to_none=True)
    loss = nn.functional.mse_loss(model(x), y)
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in model.named_parameters() if p.grad is not None}


def _graph_step(graph: ex.OpGraph) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """One training step of the captured graph, op by op with autograd on (as a rank runs it
    on one device): the loss and each parameter's gradient."""
    rt = graph.runtime
    env: dict[str, object] = {}
    params: dict[str, torch.Tensor] = {}
    user = iter(rt.args)
    for nm, fx in rt.fx_nodes.items():
        if fx.op == "placeholder":
            if nm in rt.state:
                t = rt.state[nm].detach().clone()
                if graph[nm].requires_grad:
                    params[nm] = t.requires_grad_(True)
                env[nm] = t
            else:
                env[nm] = next(user).clone()
        else:
            args, kwargs = rt.resolve(fx, env)
            env[nm] = fx.target(*args, **kwargs)
    loss = env[graph.loss]
    loss.backward()
    return loss.detach(), {k: p.grad for k, p in params.items() if p.grad is not None}


def _assert_same_step(got, want) -> None:
    torch.testing.assert_close(got[0], want[0], rtol=1e-6, atol=1e-7)
    assert set(got[1]) == set(want[1])
    for k, g in want[1].items():
        torch.testing.assert_close(got[1][k], g, rtol=1e-6, atol=1e-7, msg=k)


class TestGradModeBlocks:
    @pytest.mark.parametrize("kind", KINDS)
    def test_captured_by_export_and_steps_like_eager(self, kind):
        graph = _capture(_model(GradBlockNet, kind))
        assert graph.source == "export" and graph.notes == ()
        _assert_same_step(_graph_step(graph), _eager_step(_model(GradBlockNet, kind)))

    def test_the_blocks_ops_are_in_the_graph_and_take_no_gradient(self):
        graph = _capture(_model(GradBlockNet, "no_grad"))
        abs_op = next(n for n in graph.ops if n.op == "aten.abs.default")
        assert abs_op.module_path == "" and not abs_op.requires_grad
        assert abs_op.bwd_flops == 0 and abs_op.saves == ()
        entries = [n for n in graph.ops if n.op == "aten.detach.default"]
        assert {p for n in entries for p in n.inputs} == {"relu", "b.weight"}
        assert [graph[p].requires_grad for p in abs_op.inputs] == [False]

    def test_without_the_block_gradients_would_differ(self):
        # the check above can fail: the same net with the block's gradients let through
        # trains differently
        class Through(GradBlockNet):
            def forward(self, x):
                h = torch.relu(self.a(x))
                h = h / (h.abs().mean(dim=-1, keepdim=True) + 1)
                return self.c(self.b(h) + h @ (self.b.weight * 0.5).t())

        eager = _eager_step(_model(GradBlockNet, "no_grad"))
        through = _eager_step(_model(Through, "no_grad"))
        assert not torch.allclose(through[1]["a.weight"], eager[1]["a.weight"])

    def test_a_buffer_updated_under_no_grad_steps_like_eager(self):
        model = _model(EmaNet)
        ema = model.ema.clone()
        graph = _capture(model)
        assert torch.equal(model.ema, ema)  # capture leaves the model's buffers as they were
        _assert_same_step(_graph_step(graph), _eager_step(_model(EmaNet)))

    def test_a_capture_inside_no_grad_gives_the_same_graph(self):
        alone = _capture(_model(GradBlockNet, "enable_grad_inside"))
        with torch.no_grad():
            inside = _capture(_model(GradBlockNet, "enable_grad_inside"))
        assert inside.fingerprint == alone.fingerprint
        _assert_same_step(_graph_step(inside), _graph_step(alone))

    def test_real_and_fake_captures_give_the_same_graph(self):
        real = _capture(_model(GradBlockNet, "no_grad"))
        fake = _capture(_model(GradBlockNet, "no_grad"), fake=True)
        assert fake.fingerprint == real.fingerprint

    def test_repeated_blocks_with_a_no_grad_region_are_captured_once(self):
        model = _model(BlocksNet)
        grown = _capture(model, fake=True)
        assert any(note.startswith("traced 3 of the 6 identical blocks") for note in grown.notes)
        assert grown.fingerprint == _capture(model, fake=True, reuse_blocks=False).fingerprint
        real = _capture(model)
        assert real.fingerprint == grown.fingerprint
        _assert_same_step(_graph_step(real), _eager_step(_model(BlocksNet)))

    @pytest.mark.parametrize("fake", [False, True])
    def test_inference_mode_in_the_forward_is_refused(self, fake):
        class Inference(GradBlockNet):
            def forward(self, x):
                h = torch.relu(self.a(x))
                with torch.inference_mode():
                    scale = h.abs().mean(dim=-1, keepdim=True) + 1
                return self.c(h / scale.clone())

        with pytest.raises(CaptureError, match=r"inference_mode.*torch\.no_grad\(\)"):
            _capture(_model(Inference, "no_grad"), fake=fake)

    def test_autocast_in_the_forward_falls_back_to_modules(self):
        class Autocast(GradBlockNet):
            def forward(self, x):
                h = torch.relu(self.a(x))
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    h = self.b(h).float()
                return self.c(h)

        graph = _capture(_model(Autocast, "no_grad"))
        assert graph.source == "hooks"
        assert "torch.autocast" in graph.notes[0]


def _run_vs_reference(plan_of, shards: int) -> None:
    graph = _capture(_model(GradBlockNet, "no_grad"))
    plan = plan_of(graph)
    meas = ex.run(graph, plan=plan, steps=2, warmup=1, progress=False, record=True,
                  timeout_s=180)
    x, y = _batch()
    ref = ex.reference(_model(GradBlockNet, "no_grad"), 3, shards, optimizer=plan.optimizer,
                       example_inputs=x, targets=y, loss_fn=nn.functional.mse_loss)
    torch.testing.assert_close(torch.tensor(meas.losses), torch.tensor(ref.losses),
                               rtol=1e-5, atol=1e-6)
    assert set(meas.grads) == set(ref.grads)
    for k, g in ref.grads.items():
        torch.testing.assert_close(meas.grads[k], g, rtol=1e-5, atol=1e-6, msg=k)


@pytest.mark.slow
class TestGradModeBlocksRun:
    def test_one_device_trains_like_eager(self):
        _run_vs_reference(lambda g: ex.Plan.single(g, "cpu:0"), 1)

    def test_a_pipeline_over_two_cpu_ranks_trains_like_eager(self):
        def pipeline(g):  # the first half of the ops on one rank, the rest on the other
            n = len(g.nodes)
            return ex.Plan.from_assignment(g, [("cpu:0",), ("cpu:1",)],
                                           {i: int(i >= n // 2) for i in range(n)})
        _run_vs_reference(pipeline, 1)

    def test_two_data_parallel_cpu_ranks_train_like_eager(self):
        _run_vs_reference(lambda g: ex.Plan.from_assignment(
            g, [("cpu:0", "cpu:1")], {i: 0 for i in range(len(g.nodes))}), 2)


class Spin(nn.Module):
    """A forward that loops for ever in Python code."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        while True:
            x = x + 0


class _SpinsWhenFreed:
    def __del__(self) -> None:
        while True:
            pass


class SpinsInAFinalizerFirst(nn.Module):
    """A forward that loops for ever, first in a finalizer: Python drops an exception raised
    there (torch's weakref callbacks, run as tensors are freed, are finalizers too)."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        _SpinsWhenFreed()
        while True:
            x = x + 0


class Waits(nn.Module):
    """A forward blocked in ``queue.get()`` until the test puts something in the queue."""

    def __init__(self) -> None:
        super().__init__()
        self.a = nn.Linear(4, 4)
        self.items: queue.Queue = queue.Queue()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.a(x) * self.items.get()


def spinning_model() -> SimpleNamespace:
    """A model factory for the command line (``--factory test_capture_faults:spinning_model``):
    the model with its example batch, as ``ex.builtin_model`` gives it."""
    return SimpleNamespace(module=Spin(), example_inputs=(torch.randn(2, 4),),
                           targets=(torch.randn(2, 4),), loss_fn=nn.functional.mse_loss)


def _capture_in_thread(model: nn.Module, **kw) -> BaseException | ex.OpGraph | None:
    """``ex.capture`` on a thread of its own, joined with a generous bound, so a capture that
    never ends fails this test instead of hanging the suite."""
    got: list = [None]

    def go() -> None:
        try:
            got[0] = ex.capture(model, torch.randn(2, 4), **kw)
        except BaseException as exc:  # handed to the test
            got[0] = exc

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(120)
    assert not t.is_alive(), "capture did not end"
    return got[0]


def _capture_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("capture ")]


class TestTimeLimit:
    @pytest.mark.parametrize("fake", [False, True])
    def test_a_forward_that_loops_for_ever_ends_with_a_clear_error(self, fake):
        model = Spin()
        weight = model.a.weight
        err = _capture_in_thread(model, timeout_s=1, fake=fake)
        assert isinstance(err, CaptureTimeout), err
        msg = str(err)
        assert "did not finish within 1 s" in msg and "it was stopped" in msg
        assert "test_capture_faults.py" in msg and "x = x + 0" in msg  # where it looped
        assert "timeout_s=" in msg and deadline.TIMEOUT_ENV in msg  # how to raise the limit
        assert model.a.weight is weight and model.training
        assert _capture_threads() == []  # the looping forward was stopped, not left running

    @pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
    def test_a_stop_dropped_by_a_finalizer_is_made_again(self):
        err = _capture_in_thread(SpinsInAFinalizerFirst(), timeout_s=1)
        assert isinstance(err, CaptureTimeout) and "it was stopped" in str(err), err
        assert _capture_threads() == []

    @pytest.mark.parametrize("fake", [False, True])
    def test_a_forward_blocked_in_a_call_ends_with_a_clear_error(self, fake):
        model = Waits()
        weight = model.a.weight
        try:
            err = _capture_in_thread(model, timeout_s=1, fake=fake)
            assert isinstance(err, CaptureTimeout), err
            assert "self.items.get()" in str(err) and "could not be stopped" in str(err)
            # the model is whole again (a fake capture had swapped in fake parameters)
            assert model.a.weight is weight
            assert not isinstance(model.a.weight.data, torch._subclasses.FakeTensor)
            # and the next capture is not stuck behind the blocked one
            assert _capture_in_thread(nn.Linear(4, 4), timeout_s=120).source == "export"
        finally:
            model.items.put(1.0)
        for t in _capture_threads():  # the blocked thread ends once its call returns
            t.join(60)
        assert _capture_threads() == []
        assert model.a.weight is weight

    def test_the_environment_sets_the_limit(self, monkeypatch):
        monkeypatch.setenv(deadline.TIMEOUT_ENV, "1")
        err = _capture_in_thread(Spin())
        assert isinstance(err, CaptureTimeout) and "within 1 s" in str(err)

    @pytest.mark.parametrize("value", ["soon", "0", "-5", "nan"])
    def test_a_bad_limit_in_the_environment_is_refused(self, monkeypatch, value):
        monkeypatch.setenv(deadline.TIMEOUT_ENV, value)
        with pytest.raises(CaptureError, match=deadline.TIMEOUT_ENV):
            ex.capture(nn.Linear(4, 4), torch.randn(2, 4))

    @pytest.mark.parametrize("value", [0, -1.0, math.nan, True])
    def test_a_bad_timeout_is_refused(self, value):
        with pytest.raises(CaptureError, match="positive number of seconds"):
            ex.capture(nn.Linear(4, 4), torch.randn(2, 4), timeout_s=value)

    def test_the_default_limit_grows_with_the_model(self, monkeypatch):
        monkeypatch.delenv(deadline.TIMEOUT_ENV, raising=False)
        x = torch.randn(2, 64)
        small = deadline.capture_limit_s(nn.Linear(64, 64), (x,), None)
        large = deadline.capture_limit_s(nn.Sequential(*[nn.Linear(64, 1024)] * 1,
                                                       nn.Linear(1024, 4096)), (x,), None)
        assert deadline.BASE_LIMIT_S < small < large
        assert deadline.capture_limit_s(nn.Linear(64, 64), (x,), math.inf) == math.inf

    def test_an_interrupt_while_waiting_stops_the_forward(self):
        # a real SIGINT (what Jupyter's interrupt sends), so the waiting caller is woken
        timer = threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGINT))
        timer.start()
        try:
            with pytest.raises(KeyboardInterrupt):
                ex.capture(Spin(), torch.randn(2, 4), timeout_s=120)
        finally:
            timer.cancel()
        for t in _capture_threads():
            t.join(10)
        assert _capture_threads() == []

    def test_an_exception_injected_into_the_waiting_caller_ends_the_capture(self):
        # as a notebook's stop of its background measuring does (PyThreadState_SetAsyncExc);
        # into the calling thread only: the capture stops its worker itself
        class Stopped(BaseException):
            pass

        got: list = []

        def go() -> None:
            try:
                ex.capture(Spin(), torch.randn(2, 4), timeout_s=300)
            except BaseException as exc:  # handed to the test
                got.append(exc)

        caller = threading.Thread(target=go, daemon=True)
        caller.start()
        while not _capture_threads():
            time.sleep(0.01)
        time.sleep(0.2)
        ctypes.pythonapi.PyThreadState_SetAsyncExc(ctypes.c_ulong(caller.ident),
                                                   ctypes.py_object(Stopped))
        caller.join(60)  # well before the capture's own limit
        assert not caller.is_alive() and isinstance(got[0], Stopped)
        for t in _capture_threads():
            t.join(10)
        assert _capture_threads() == []

    def test_the_command_line_prints_the_error(self, monkeypatch, capsys):
        monkeypatch.setenv(deadline.TIMEOUT_ENV, "1")
        code = main(["run", "--factory", "test_capture_faults:spinning_model", "--devices",
                     "cpu:1", "--quiet"])
        err = capsys.readouterr().err
        assert code == 2 and err.startswith("error: capturing Spin did not finish within 1 s")
        assert "Traceback" not in err
        for t in _capture_threads():  # stopped, it ends (in the whole suite its unwinding
            t.join(30)                # has outlasted the capture's own 2 s wait for it)
        assert _capture_threads() == []

    def test_a_capture_in_time_gives_its_graph(self):
        graph = _capture_in_thread(nn.Linear(4, 4), timeout_s=120)
        assert isinstance(graph, ex.OpGraph) and graph.source == "export"
