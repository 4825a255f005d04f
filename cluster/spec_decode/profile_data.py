"""A speculation profile: what ``tandem profile`` measured on a device, as JSON."""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from cluster.spec_decode.latency_model import LatencyModel
from cluster.spec_decode.pass_grid import PassGrid

logger = logging.getLogger(__name__)


class SpeculationProfile(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # "native": target_grid times the target's verifying pass alone and draft_grid the draft's
    # pass. "vllm" (cluster/profiling/vllm_profile.py): vLLM runs drafting inside its step, so
    # target_grid holds whole steps (b, k + 1, seconds of drafting + verifying) and
    # draft_grid is empty; the coefficients are fitted with LatencyModel.fit_steps.
    engine: Literal["native", "vllm"] = "native"
    device: str  # e.g. "cpu: Intel(R) Xeon(R) Processor (2 threads)" or a CUDA device name
    target_model: str
    draft: str  # "ngram" or the draft model
    dtype: str
    tensor_parallel_size: int = 1
    max_k: int
    batch_sizes: list[int]
    target_grid: list[tuple[int, int, float]]  # (batch size, tokens per request, seconds per pass)
    draft_grid: list[tuple[int, float]]  # (batch size, seconds per draft pass)
    acceptance: list[float]  # per draft position, conditional on the previous ones accepted (effective: a
    # position asked for but not proposed counts as rejected; see cluster.spec_decode.latency_model)
    coverage: list[float] | None = None  # per draft position: share of requests proposed a token (None: all)
    acceptance_prompts: str = "calibration"  # the prompt set acceptance was measured on (cluster.profiling.calibration)
    target_coef: list[float]
    draft_coef: list[float]
    table: dict[int, int]  # batch size -> best k
    fit_error: float  # mean relative error of the fitted step times on the grid
    measured_tpot: list[tuple[int, int, float]] = []  # (b, k, seconds per output token), measured (vllm)

    @property
    def latency_model(self) -> LatencyModel:
        return LatencyModel(list(self.target_coef), list(self.draft_coef))

    def best_k(self, batch_size: int, max_k: int | None = None) -> int:
        """The best k at ``batch_size`` under the profile's acceptance and coverage: read from
        the measured grid where it holds that batch size and every k up to ``max_k`` (the
        paper's lookup), else from the fitted latency model. The fit's one per-token cost
        cannot follow a CPU whose extra token is nearly free at batch 1 and costs 0.5 ms at
        batch 32; its table said k = 0 at batch 32 on the edit prompts where k = 4-8 was best
        by 26% (bench paper), the grid says 8 (1% from the best)."""
        max_k = self.max_k if max_k is None else max_k
        grid = self.pass_grid(max_k)
        model = self.latency_model if grid is None or batch_size not in grid.sizes else measured_model(grid)
        return model.best_k(batch_size, self.acceptance, max_k, self.coverage)

    def measured_time_per_token(self, batch_size: int, k: int) -> float:
        """TPOT(b, k) from the grid: the verifying pass of 1 + expected_drafted(coverage, k) tokens
        per request (linear between the measured token counts), k draft passes, over E(k)."""
        grid = self.pass_grid(k)
        if grid is None or batch_size not in grid.sizes:
            raise ValueError(f"the profile's grid has no batch size {batch_size} with {k + 1} tokens per request")
        return measured_model(grid).time_per_token(batch_size, k, self.acceptance, self.coverage)

    def pass_grid(self, max_k: int | None = None) -> PassGrid | None:
        """The measured passes, read between the measured points (:class:`PassGrid`); None unless
        every batch size was measured at 1..max_k + 1 tokens per request."""
        max_k = self.max_k if max_k is None else max_k
        try:
            return PassGrid(self.target_grid, self.draft_grid, max_k + 1)
        except ValueError:
            return None

    def vllm_schedule(self) -> list[list[int]]:
        """The table as vLLM's ``num_speculative_tokens_per_batch_size``: [[start, end, k], ...]."""
        return batch_size_ranges(self.table)

    def save(self, path: str | Path) -> None:
        Path(path).write_text(self.model_dump_json(indent=1))

    @classmethod
    def load(cls, path: str | Path) -> "SpeculationProfile":
        path = Path(path)
        if not path.is_file():
            raise ValueError(f"speculation profile {path} does not exist; make one with `tandem profile`")
        try:
            return cls.model_validate_json(path.read_text())
        except ValidationError as err:
            raise ValueError(f"{path} is not a speculation profile: {err}") from None


def load_profile_if_present(path: str | None) -> SpeculationProfile | None:
    """The profile at ``path``; None, with a warning, when it is not written yet (a profiling Job
    may still be running: replicas started later read it), and None when no path is named."""
    if not path:
        return None
    if not Path(path).is_file():
        logger.warning("speculation profile %s does not exist (yet): starting without it; replicas started "
                       "after it is written (`tandem profile`) read it", path)
        return None
    return SpeculationProfile.load(path)


def measured_model(grid: PassGrid) -> LatencyModel:
    """The grid's pass times as they were measured (no correction)."""
    return LatencyModel([0.0, 0.0, 0.0], [0.0, 0.0], grid)


def batch_size_ranges(table: dict[int, int]) -> list[list[int]]:
    """``{1: 4, 4: 3, 16: 1}`` -> ``[[1, 3, 4], [4, 15, 3], [16, 16, 1]]``: vLLM's inclusive ranges
    for the k the native table controller picks (``TableController``: the largest entry not above
    the batch size, the first entry below it). vLLM carries the last k on past the end."""
    sizes = sorted(int(b) for b in table)
    ranges = []
    for i, b in enumerate(sizes):
        start = 1 if i == 0 else b
        end = sizes[i + 1] - 1 if i + 1 < len(sizes) else b
        ranges.append([start, max(start, end), int(table[b])])
    return ranges
