"""Part 1 of ``tandem bench paper``: TPOT against k per batch size (:mod:`paper`), the
latency model's predictions beside the measurements, and the capacity the traffic rates
are fractions of."""

from __future__ import annotations

from dataclasses import asdict

from cluster.bench.spec import run_closed_loop
from cluster.bench.spec_cells import SpecCounts, make_cell
from cluster.spec_decode.controller import FixedController
from cluster.spec_decode.profile_data import measured_model

WARMUP_LEN = 8
WORKLOAD_PROMPTS = "bench paper sweep"  # a profile's acceptance_prompts once the sweep's acceptance replaced it


def sweep(engine, args, prompt_ids, progress, task) -> list[dict]:
    cells = []
    for b in args.batch_sizes:
        engine.controller = FixedController(max(args.ks))
        run_closed_loop(engine, prompt_ids[:b], min(WARMUP_LEN, args.output_len), b)
        rounds = -(-len(prompt_ids) // b)
        for k in args.ks:
            progress.update(task, description=f"TPOT vs k: batch {b}, k={k}")
            engine.controller = FixedController(k)
            engine.spec_stats = type(engine.spec_stats)()
            timings, seconds, steps = [], 0.0, []
            for r in range(rounds):
                batch = [prompt_ids[(r * b + i) % len(prompt_ids)] for i in range(b)]
                round_timings, round_seconds = run_closed_loop(engine, batch, args.output_len, b, steps_out=steps)
                timings += round_timings
                seconds += round_seconds
            stats = engine.spec_stats
            cell = asdict(make_cell("tandem", args.method, b, k, args.output_len, timings, seconds,
                                    SpecCounts.of(stats)))
            cell["conditional_acceptance"] = stats.conditional_acceptance[:k]  # vLLM's meaning: over proposed
            acceptance, coverage = stats.effective_acceptance[:k], stats.coverage[:k]  # over asked for
            cell["effective_acceptance"], cell["coverage"] = acceptance, coverage
            # The steps the latency model describes: b requests decoding, none prefilling (the
            # request TPOT above also carries the steps where others' prompts were prefilled).
            decoding = [s.seconds for s in steps if s.num_seqs == b and s.num_prefill_tokens == 0]
            cell["decode_steps"] = len(decoding)
            cell["decode_step_ms"] = sum(decoding) / len(decoding) * 1e3 if decoding else None
            cells.append(cell)
            progress.advance(task)
    return cells


def add_predictions(cells: list[dict], profile) -> None:
    """Each cell's TPOT as the latency model predicts it: with the acceptance and coverage
    the controllers start from (``profile``'s), and with the cell's own measured ones; and
    its full-batch decoding step time as the fitted model and the measured grid (what the
    table and adaptive read) predict it, with the coverage the cell drafted at."""
    model = profile.latency_model
    grid = profile.pass_grid()
    step_models = (("fit", model), ("grid", measured_model(grid) if grid is not None else None))
    for cell in cells:
        b, k = cell["batch_size"], cell["k"]
        acceptance, coverage = cell["effective_acceptance"], cell["coverage"]
        measured = cell.get("decode_step_ms")
        for name, source in step_models:
            predicted = source.step_time(b, k, coverage if k else None) * 1e3 if source is not None else None
            cell[f"predicted_step_ms_{name}"] = predicted
            cell[f"step_error_{name}"] = predicted / measured - 1 if predicted is not None and measured else None
        cell["predicted_tpot_ms"] = model.time_per_token(b, k, profile.acceptance, profile.coverage) * 1e3
        cell["predicted_tpot_ms_measured_acceptance"] = (
            model.time_per_token(b, k, acceptance, coverage) * 1e3 if k == 0 or acceptance else None)
        for suffix in ("", "_measured_acceptance"):
            predicted = cell[f"predicted_tpot_ms{suffix}"]
            cell[f"prediction_error{suffix}"] = (predicted / cell["tpot_ms"] - 1
                                                 if predicted is not None and cell["tpot_ms"] else None)


def with_workload_acceptance(profile, cells: list[dict]):
    """``profile`` with the effective acceptance and coverage the sweep measured on this
    benchmark's prompts: per position, the mean over batch sizes of the cells at the sweep's
    largest k (extended to the profile's max_k with its last value), and the table
    re-solved with them."""
    top = [c for c in cells if c["k"] == max(c["k"] for c in cells) and c["effective_acceptance"]]
    if not top:
        return profile

    def mean_per_position(key: str) -> list[float]:
        rows = [c[key] for c in top]
        measured = [sum(r[j] for r in rows) / len(rows) for j in range(min(map(len, rows)))]
        return (measured + [measured[-1]] * profile.max_k)[:profile.max_k]

    updated = profile.model_copy(update={"acceptance": mean_per_position("effective_acceptance"),
                                         "coverage": mean_per_position("coverage"),
                                         "acceptance_prompts": WORKLOAD_PROMPTS})
    return updated.model_copy(update={"table": {b: updated.best_k(b) for b in profile.batch_sizes}})


def _argmin(cells: list[dict], key: str) -> dict | None:
    usable = [c for c in cells if c[key] is not None]
    return min(usable, key=lambda c: c[key]) if usable else None


def sweep_summary(cells: list[dict], args, table: dict[int, int] | None = None) -> dict:
    """Per batch size: the best measured k, the fitted model's pick and, with ``table`` (the
    profile's, read from its grid), the table's pick; a pick's regret is its measured TPOT over
    the best's, minus 1 (None for a k the sweep did not run)."""
    per_batch = []
    for b in args.batch_sizes:
        row = [c for c in cells if c["batch_size"] == b]
        best, model_pick = _argmin(row, "tpot_ms"), _argmin(row, "predicted_tpot_ms")
        table_k = table.get(b) if table else None
        table_pick = next((c for c in row if c["k"] == table_k), None)
        model_pick_acc = _argmin(row, "predicted_tpot_ms_measured_acceptance")
        k0 = next((c for c in row if c["k"] == 0), None)
        top = max(row, key=lambda c: c["k"])
        per_batch.append({
            "batch_size": b, "best_k": best["k"], "best_tpot_ms": best["tpot_ms"],
            "k0_tpot_ms": k0["tpot_ms"] if k0 else None,
            "speedup_vs_k0": k0["tpot_ms"] / best["tpot_ms"] if k0 else None,
            "model_k": model_pick["k"], "model_k_tpot_ms": model_pick["tpot_ms"],
            "model_k_regret": model_pick["tpot_ms"] / best["tpot_ms"] - 1,
            "model_k_measured_acceptance": model_pick_acc["k"] if model_pick_acc else None,
            "table_k": table_k,
            "table_k_regret": table_pick["tpot_ms"] / best["tpot_ms"] - 1 if table_pick else None,
            "acceptance_rate_at_top_k": top["acceptance_rate"],
            "mean_abs_prediction_error": _mean_abs(row, "prediction_error"),
            "mean_abs_step_error_fit": _mean_abs(row, "step_error_fit"),
            "mean_abs_step_error_grid": _mean_abs(row, "step_error_grid"),
        })
    best_ks = [p["best_k"] for p in per_batch]
    return {
        "cells": cells, "per_batch": per_batch,
        "best_k_non_increasing": all(a >= b for a, b in zip(best_ks, best_ks[1:])),
        "best_k_falls": len(best_ks) > 1 and best_ks[-1] < best_ks[0],
        "mean_abs_prediction_error": _mean_abs(cells, "prediction_error"),
        "mean_abs_prediction_error_measured_acceptance": _mean_abs(cells, "prediction_error_measured_acceptance"),
        "mean_abs_step_error_fit": _mean_abs(cells, "step_error_fit"),
        "mean_abs_step_error_grid": _mean_abs(cells, "step_error_grid"),
    }


def _mean_abs(cells: list[dict], key: str) -> float | None:
    values = [abs(c[key]) for c in cells if c.get(key) is not None]
    return sum(values) / len(values) if values else None


def measured_capacity(cells: list[dict], args) -> dict:
    """Requests/s of the largest batch at its best k: all submitted at once, prefill and tail included."""
    b = max(args.batch_sizes)
    best = max((c for c in cells if c["batch_size"] == b), key=lambda c: c["num_requests"] / c["seconds"])
    measured = best["num_requests"] / best["seconds"]
    return {"requests_per_s": measured, "batch_size": b, "k": best["k"],
            "source": "given by --rates (not used)" if args.rates else "measured"}
