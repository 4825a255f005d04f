"""Every simulated request's lengths and what happened to it, as arrays (one row each).

Times are seconds of simulated time; NaN until the event happens. A request preempted
by recomputation keeps the tokens it had generated (``generated``) and its first-token
time; it is prefilled again over prompt + generated tokens when re-admitted.
"""

from __future__ import annotations

import numpy as np

from cluster.sim.workload import Workload


class RequestTable:
    def __init__(self, workload: Workload) -> None:
        n = workload.num_requests
        self.arrival_s = workload.arrival_s
        self.prompt_len = workload.prompt_len
        self.output_len = workload.output_len
        self.prefix_id = workload.prefix_id
        self.shared_len = workload.shared_len
        self.first_token_s = np.full(n, np.nan)
        self.finish_s = np.full(n, np.nan)
        self.admitted_s = np.full(n, np.nan)
        self.replica = np.full(n, -1, dtype=np.int64)  # index of the replica it was routed to
        self.generated = np.zeros(n, dtype=np.int64)  # tokens generated before its latest preemption

    def __len__(self) -> int:
        return len(self.arrival_s)

    def num_generated(self, request: int) -> int:
        return int(self.generated[request])

    def admitted(self, request: int, now: float) -> None:
        if np.isnan(self.admitted_s[request]):
            self.admitted_s[request] = now

    def first_token(self, request: int, now: float) -> None:
        if np.isnan(self.first_token_s[request]):
            self.first_token_s[request] = now

    def finish(self, requests: np.ndarray, now: float) -> None:
        self.finish_s[requests] = now

    def generated_before_preemption(self, request: int, num_tokens: int) -> None:
        self.generated[request] = num_tokens

    @property
    def num_finished(self) -> int:
        return int(np.count_nonzero(~np.isnan(self.finish_s)))
