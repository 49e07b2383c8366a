"""Predicted against measured: a side-by-side report, and calibration of the cost model."""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, replace
from typing import Any

from explorer.core.errors import ExplorerError
from explorer.core.units import MiB, table
from explorer.costs.model import CostModel
from explorer.runtime.launch import Measurement
from explorer.simulate.simulator import Prediction, simulate


@dataclass(frozen=True)
class Row:
    """One figure, predicted and measured. ``error`` is (predicted - measured) / measured."""

    what: str
    device: str
    unit: str
    predicted: float
    measured: float

    @property
    def error(self) -> float:
        return (self.predicted - self.measured) / self.measured if self.measured else math.nan


@dataclass(frozen=True)
class Report:
    """Predicted and measured side by side, for the whole step and per device."""

    rows: tuple[Row, ...]
    algorithm: str
    memory_source: str
    #: how the ranks ran their ops (:attr:`Measurement.runtime`, ``compiled``)
    runtime: str = "segments"
    compiled: bool = False

    @property
    def ran_as(self) -> str:
        """How the ranks ran, in words: "as generated segments (compiled)", "one op at a
        time"."""
        return ("as generated segments" + (" (compiled)" if self.compiled else "")
                if self.runtime == "segments" else "one op at a time")

    def row(self, what: str, device: str = "") -> Row:
        for r in self.rows:
            if r.what == what and r.device == device:
                return r
        raise KeyError(f"no row {what!r} for {device!r}")

    @property
    def step_error(self) -> float:
        return self.row("step time").error

    @property
    def memory_errors(self) -> dict[str, float]:
        return {r.device: r.error for r in self.rows if r.what == "peak memory"}

    def to_dict(self) -> dict[str, Any]:
        return {"algorithm": self.algorithm, "memory_source": self.memory_source,
                "runtime": self.runtime, "compiled": self.compiled,
                "rows": [{"what": r.what, "device": r.device, "unit": r.unit,
                          "predicted": r.predicted, "measured": r.measured, "error": r.error}
                         for r in self.rows]}

    def __str__(self) -> str:
        def fmt(r: Row, v: float) -> str:
            if r.unit == "s":
                return f"{v * 1e3:.2f} ms"
            if r.unit == "bytes":
                return f"{v / MiB:.2f} MiB"
            return f"{v:.3g} J"

        rows = [(r.what, r.device or "all", fmt(r, r.predicted), fmt(r, r.measured),
                 f"{r.error * 100:+.1f}%") for r in self.rows]
        return table(("figure", "device", "predicted", "measured", "error"), rows) + \
            f"\n(memory measured by {self.memory_source}; the ranks ran {self.ran_as})"

    def _repr_html_(self) -> str:  # a table in notebooks
        cells = "".join(
            f"<tr><td>{r.what}</td><td>{r.device or 'all'}</td><td>{r.predicted:.4g}</td>"
            f"<td>{r.measured:.4g}</td><td>{r.error * 100:+.1f}%</td></tr>" for r in self.rows)
        return ("<table><tr><th>figure</th><th>device</th><th>predicted</th><th>measured</th>"
                f"<th>error</th></tr>{cells}</table>")


def compare(pred: Prediction, meas: Measurement) -> Report:
    """Line up a prediction and a measurement of the same plan."""
    if set(pred.busy_s) != set(meas.busy_s):
        raise ExplorerError("the prediction and the measurement are of different plans "
                            f"(devices {sorted(pred.busy_s)} vs {sorted(meas.busy_s)})")
    rows = [Row("step time", "", "s", pred.step_s, meas.step_s)]
    for d in pred.busy_s:
        rows.append(Row("busy time", d, "s", pred.busy_s[d], meas.busy_s[d]))
    for d in pred.busy_s:
        rows.append(Row("peak memory", d, "bytes", pred.peak_bytes[d], meas.peak_bytes[d]))
    if meas.energy_j is not None:
        rows.append(Row("energy", "", "J", pred.energy_j, meas.energy_j))
    return Report(tuple(rows), meas.algorithm, meas.memory_source, runtime=meas.runtime,
                  compiled=meas.compiled)


def calibrate(costs: CostModel, measurements: Measurement | Iterable[Measurement],
              others: Iterable[CostModel] = ()) -> CostModel:
    """Fit the cost model to measured runs: compute scale, per-op cost, per-message cost,
    link scale.

    Per device, measured busy time = a x predicted compute + b x ops run + c x tensors sent
    and received (least squares, a, b, c >= 0); then the link scale minimises the squared log
    error of the step times, with the fitted compute. Each measurement must carry its plan
    and graph (``ex.run`` sets them). The factors describe the devices and the runtime, not
    one graph: measurements of other models may join the fit when ``others`` holds their
    cost models (profiled on the same devices), and the result is ``costs`` with the fitted
    factors, so it predicts a model that was never run.
    """
    meas = [measurements] if isinstance(measurements, Measurement) else list(measurements)
    if not meas:
        raise ExplorerError("calibrate needs at least one measurement from ex.run")
    pool = {c.graph_fingerprint: replace(c, compute_scale=1.0, extra_op_s=0.0,
                                         link_scale=1.0, message_s=0.0)
            for c in [costs, *others]}
    xs: list[tuple[float, ...]] = []
    ys: list[float] = []
    cases = []
    for m in meas:
        if m.plan is None or m.graph is None:
            raise ExplorerError("this measurement does not carry its plan and graph; use the "
                                "one ex.run returned")
        base = pool.get(m.graph.fingerprint)
        if base is None:
            raise ExplorerError(f"a measurement of {m.graph.name or 'a graph'} "
                                f"({m.graph.fingerprint}) has no cost model here: pass that "
                                "graph's costs in others=[...]")
        pred = simulate(m.graph, m.plan, base)
        ops = {d: sum(1 for iv in pred.timeline if iv.device == d and iv.lane == "compute"
                      and iv.kind in ("fwd", "bwd")) for d in pred.busy_s}
        # busy with 1 ms per message minus busy without = 1 ms x messages
        msgs = simulate(m.graph, m.plan, replace(base, message_s=1e-3)).busy_s
        for d, b in pred.busy_s.items():
            xs.append((b, float(ops[d]), round((msgs[d] - b) / 1e-3)))
            ys.append(m.busy_s[d])
        cases.append((m, base))
    a, b, c = _nnls(xs, ys)
    factors = {"compute_scale": a, "extra_op_s": b, "message_s": c}

    def loss(log_scale: float) -> float:
        return sum(math.log(simulate(m.graph, m.plan, replace(
            base, link_scale=10 ** log_scale, **factors)).step_s / m.step_s) ** 2
            for m, base in cases)

    from scipy.optimize import minimize_scalar

    best = minimize_scalar(loss, bounds=(-1.0, 2.0), method="bounded",
                           options={"xatol": 0.01})
    return replace(costs, link_scale=10 ** float(best.x), **factors)


def _nnls(xs: Sequence[tuple[float, ...]], ys: Sequence[float]) -> tuple[float, ...]:
    """Least squares y = a x0 + b x1 + ... with every coefficient >= 0 (a > 0)."""
    import numpy as np
    from scipy.optimize import nnls

    A = np.array(xs, dtype=float)
    y = np.array(ys, dtype=float)
    scale = A.max(axis=0)
    scale[scale == 0] = 1.0
    coef, _ = nnls(A / scale, y)
    coef = coef / scale
    if coef[0] <= 0:
        return (float(y.sum() / max(A[:, 0].sum(), 1e-12)),) + (0.0,) * (A.shape[1] - 1)
    return tuple(float(x) for x in coef)
