"""The simulator's step times against the engine's: a ``tandem bench paper`` JSON.

``tandem bench paper`` times whole decoding steps of the real engine for every (batch
size ``b``, speculation length ``k``) of its sweep (``tpot_vs_k.cells[].decode_step_ms``:
``b`` requests decoding, none prefilling). A simulated group predicts the same step as
``StepModel.step_seconds(b, k, 0, 0)``. For every group of the sim config this gives,
per cell, error = simulated / measured - 1, and per batch size the ``k`` each side would
pick: argmin over the sweep's ks of step time / E(k), E(k) from the group's acceptance
(the measured side from the step times too, so both picks rest on the same acceptance).

For a group whose step times are derived (the roofline of :mod:`device_model`), the same
form is also fitted to the measured steps: its three unknowns (1 / effective bandwidth,
1 / effective FLOPs, the fixed cost of a pass) enter linearly, so a relative least-squares
fit gives the figures that would make the form fit best. The gap between the table's
figures and the fitted ones is what the device table gets wrong for this machine; the
error left after the fit is what the form itself cannot describe.
"""

from __future__ import annotations

from dataclasses import dataclass

from cluster.sim.config import ModelFigures, SimConfig
from cluster.sim.device_model import StepModel
from cluster.spec_decode.latency_model import expected_tokens, fit_linear


def is_paper_result(data: dict) -> bool:
    return isinstance(data.get("tpot_vs_k"), dict) and "cells" in data["tpot_vs_k"]


def roofline_features(target: ModelFigures, draft: ModelFigures | None, context_len: int,
                      batch_size: int, k: int) -> list[float]:
    """Bytes read, FLOPs done and passes started by a decoding step of the derived model
    (:func:`cluster.sim.device_model.derive_latency_model`): its time is
    ``bytes / bandwidth + flops / flops_per_s + passes * step_overhead_s``. A draft pass
    starts half a target pass's overhead, as there."""
    def per_pass(model: ModelFigures, tokens_per_request: int) -> tuple[float, float]:
        weights = model.num_params_b * 1e9 * model.bytes_per_param
        reads = weights + batch_size * model.kv_bytes_per_token * context_len
        flops = 2 * model.num_params_b * 1e9 * batch_size * tokens_per_request
        return reads, flops

    reads, flops = per_pass(target, 1 + k)
    passes = 1.0
    if k and draft is not None:
        draft_reads, draft_flops = per_pass(draft, 1)
        reads, flops, passes = reads + k * draft_reads, flops + k * draft_flops, 1.0 + k / 2
    return [reads, flops, passes]


@dataclass(frozen=True)
class FittedFigures:
    bandwidth_gb_s: float | None  # None: the fit found no cost per byte
    tflops: float | None  # None: the fit found no cost per FLOP
    step_overhead_ms: float

    def step_ms(self, features: list[float]) -> float:
        reads, flops, passes = features
        seconds = passes * self.step_overhead_ms / 1e3
        if self.bandwidth_gb_s:
            seconds += reads / (self.bandwidth_gb_s * 1e9)
        if self.tflops:
            seconds += flops / (self.tflops * 1e12)
        return seconds * 1e3


def fit_figures(features: list[list[float]], measured_ms: list[float]) -> FittedFigures:
    per_byte, per_flop, overhead = fit_linear(features, [t / 1e3 for t in measured_ms])
    return FittedFigures(1 / per_byte / 1e9 if per_byte else None, 1 / per_flop / 1e12 if per_flop else None,
                         overhead * 1e3)


def _best_k(step_ms: dict[int, float], acceptance: list[float]) -> int:
    return min(step_ms, key=lambda k: step_ms[k] / expected_tokens(acceptance, k))


def _mean_abs(values: list[float]) -> float | None:
    return sum(abs(v) for v in values) / len(values) if values else None


def compare_steps(measured: dict, config: SimConfig, models: dict[str, StepModel]) -> dict[str, dict]:
    """Per group: rows per sweep cell (b, k, measured, simulated, error, and the fitted
    roofline's where the group is derived), per batch size the mean |error| and the k each
    side picks, and the fitted figures."""
    cells = [c for c in measured["tpot_vs_k"]["cells"] if c.get("decode_step_ms")]
    if not cells:
        raise ValueError("the bench paper JSON has no measured decoding steps (tpot_vs_k.cells[].decode_step_ms)")
    context_len = measured.get("settings", {}).get("profile_context_len") or config.mean_context_len
    result = {}
    for name, model in models.items():
        fitted = None
        features = None
        if model.derived:
            features = [roofline_features(config.target, config.draft, context_len, c["batch_size"], c["k"])
                        for c in cells]
            fitted = fit_figures(features, [c["decode_step_ms"] for c in cells])
        rows = []
        for i, c in enumerate(cells):
            b, k, real = c["batch_size"], c["k"], c["decode_step_ms"]
            simulated = model.step_seconds(b, k, 0, 0) * 1e3
            row = {"batch_size": b, "k": k, "measured_ms": real, "simulated_ms": simulated,
                   "error": simulated / real - 1}
            if fitted is not None:
                row["fitted_ms"] = fitted.step_ms(features[i])
                row["fitted_error"] = row["fitted_ms"] / real - 1
            rows.append(row)
        acceptance = list(model.acceptance)
        per_batch = []
        for b in sorted({r["batch_size"] for r in rows}):
            mine = [r for r in rows if r["batch_size"] == b]
            entry = {"batch_size": b,
                     "mean_abs_error": _mean_abs([r["error"] for r in mine]),
                     "measured_k": _best_k({r["k"]: r["measured_ms"] for r in mine}, acceptance),
                     "simulated_k": _best_k({r["k"]: r["simulated_ms"] for r in mine}, acceptance)}
            if fitted is not None:
                entry["mean_abs_fitted_error"] = _mean_abs([r["fitted_error"] for r in mine])
                entry["fitted_k"] = _best_k({r["k"]: r["fitted_ms"] for r in mine}, acceptance)
            per_batch.append(entry)
        result[name] = {
            "source": model.source, "context_len": context_len, "acceptance": acceptance, "rows": rows,
            "per_batch": per_batch, "mean_abs_error": _mean_abs([r["error"] for r in rows]),
            "mean_abs_fitted_error": None if fitted is None else _mean_abs([r["fitted_error"] for r in rows]),
            "fitted_figures": None if fitted is None else {"bandwidth_gb_s": fitted.bandwidth_gb_s,
                                                           "tflops": fitted.tflops,
                                                           "step_overhead_ms": fitted.step_overhead_ms},
        }
    return result


def _controller_of(policy: str) -> str:
    """The sim's name of a bench paper policy: ``k=3`` is ``fixed:3``."""
    return f"fixed:{policy.removeprefix('k=')}" if policy.startswith("k=") else policy


def compare_traffic(measured: dict, config: SimConfig, summaries: list[dict]) -> dict | None:
    """Mean TPOT per policy, measured (the bench's median run) and simulated, each with its
    gap to its own best fixed k: does the simulator rank the policies as the engine did?
    The measured workload is the phased one when the sim's workload has phases, else the
    uniform one at the sim's rate; None when the bench ran no such workload."""
    workloads = measured.get("traffic", {}).get("workloads", [])
    if config.workload.phases:
        chosen = next((w for w in workloads if w["kind"] == "phased"), None)
    else:
        rate = config.workload.rate
        chosen = next((w for w in workloads if w["kind"] == "uniform" and rate is not None
                       and abs(w["phases"][0]["rate"] - rate) <= 0.01 * rate), None)
    if chosen is None:
        return None
    simulated = {s["controller"]: s["mean_tpot_ms"] for s in summaries
                 if s["router"] == config.baseline_router and s.get("mean_tpot_ms") is not None}
    real = {_controller_of(r["policy"]): r["mean_tpot_ms"] for r in chosen["runs"]}
    both = [c for c in real if c in simulated]
    if not both:
        return None

    def gaps(times: dict[str, float]) -> dict[str, float]:
        fixed = [times[c] for c in both if c.startswith("fixed:")]
        best = min(fixed) if fixed else None
        return {c: times[c] / best - 1 for c in both} if best else {}

    real_gaps, sim_gaps = gaps(real), gaps(simulated)
    rows = [{"controller": c, "measured_ms": real[c], "simulated_ms": simulated[c],
             "error": simulated[c] / real[c] - 1, "measured_gap": real_gaps.get(c), "simulated_gap": sim_gaps.get(c)}
            for c in both]
    return {"workload": chosen["name"], "rows": rows}


def print_step_comparison(console, steps: dict[str, dict], traffic: dict | None) -> None:
    from rich import box
    from rich.table import Table

    for name, group in steps.items():
        fitted = group["fitted_figures"]
        caption = (f"error = simulated / measured - 1 over the sweep's decoding steps; k: argmin of step / E(k) "
                   f"with the group's acceptance ({', '.join(f'{a:.2f}' for a in group['acceptance'])}); mean "
                   f"|error| {_pct(group['mean_abs_error'])}")
        if fitted is not None:
            caption += ("; fitted: the same roofline with the figures that fit these steps best ("
                        + (f"{fitted['bandwidth_gb_s']:.1f} GB/s" if fitted["bandwidth_gb_s"] else "no cost per byte")
                        + ", " + (f"{fitted['tflops'] * 1e3:.0f} GFLOPS" if fitted["tflops"] else "no cost per FLOP")
                        + f", {fitted['step_overhead_ms']:.2f} ms a pass), mean |error| "
                        + _pct(group["mean_abs_fitted_error"]))
        table = Table(title=f"Simulated step times against the engine's, group {name} ({group['source']})",
                      caption=caption, box=box.SIMPLE_HEAD, show_edge=False)
        headers = ["batch", "mean |error|", "k measured", "k simulated"]
        if fitted is not None:
            headers += ["fitted |error|", "k fitted"]
        for header in headers:
            table.add_column(header, justify="right")
        for p in group["per_batch"]:
            row = [str(p["batch_size"]), _pct(p["mean_abs_error"]), str(p["measured_k"]), str(p["simulated_k"])]
            if fitted is not None:
                row += [_pct(p["mean_abs_fitted_error"]), str(p["fitted_k"])]
            table.add_row(*row)
        console.print(table)
    if traffic is not None:
        table = Table(title=f"Mean TPOT per policy on {traffic['workload']}, measured (median run) and simulated",
                      caption="gap: against the best fixed k of the same side (- is faster)",
                      box=box.SIMPLE_HEAD, show_edge=False)
        for header in ("controller", "measured ms", "simulated ms", "error", "measured gap", "simulated gap"):
            table.add_column(header, justify="left" if header == "controller" else "right")
        for r in traffic["rows"]:
            table.add_row(r["controller"], f"{r['measured_ms']:.1f}", f"{r['simulated_ms']:.1f}",
                          _pct(r["error"], True), _pct(r["measured_gap"], True), _pct(r["simulated_gap"], True))
        console.print(table)


def _pct(value: float | None, signed: bool = False) -> str:
    return "-" if value is None else format(value, "+.1%" if signed else ".1%")
