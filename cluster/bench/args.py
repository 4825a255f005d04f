"""Argument types and small helpers the ``tandem bench`` commands share."""

from __future__ import annotations

import argparse
import time

MAX_K = 16  # the config's bound on num_speculative_tokens


def positive_int(text: str) -> int:
    if not text.strip().isdigit() or int(text) < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return int(text)


def int_list(text: str) -> list[int]:
    if not all(s.strip().isdigit() and int(s) > 0 for s in text.split(",")):
        raise argparse.ArgumentTypeError(f"expected positive integers like 1,8,32, got {text!r}")
    return [int(s) for s in text.split(",")]


def k_list(text: str) -> list[int]:
    parts = [s.strip() for s in text.split(",")]
    if not all(p.isdigit() and int(p) <= MAX_K for p in parts):
        raise argparse.ArgumentTypeError(f"expected integers in 0..{MAX_K} like 0,2,4, got {text!r}")
    return [int(p) for p in parts]


def ratio_or_none(text: str) -> float | None:
    if text.strip().lower() == "none":
        return None
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise argparse.ArgumentTypeError(f"expected a number >= 0 or none, got {text!r}")
    return value


def timed(fn, *args):
    """``fn(*args)`` and the seconds it took."""
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start
