"""What a suffix proposer's trees hold and how its drafts matched (``/metrics`` reads it; no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

MATCH_LEN_BUCKETS = (0, 1, 2, 4, 8, 16, 32, 64)  # upper bounds of the match-length histogram


@dataclass
class SuffixTreeStats:
    """What the trees hold and how drafts matched, for ``/metrics``."""

    num_cached_requests: int = 0  # responses in the replica-wide tree
    num_cached_tokens: int = 0  # their tokens
    num_evicted_requests: int = 0  # responses evicted past max_cached_requests (cumulative)
    num_active_requests: int = 0  # prompt trees alive
    # match length of each speculation asked for -> count, bucketed by MATCH_LEN_BUCKETS (cumulative)
    match_len_counts: list[int] = field(default_factory=lambda: [0] * (len(MATCH_LEN_BUCKETS) + 1))
    # what the trees cost (cumulative): proposals (one per drafting step), the seconds they took
    # (bringing the trees up to date included), and the tokens added to the trees
    num_proposals: int = 0
    propose_seconds: float = 0.0
    num_tokens_added: int = 0

    @staticmethod
    def match_len_ranges() -> list[str]:
        """The histogram's buckets as ranges of tokens: "0", "1", "2", "3-4", ..., "65+"."""
        names, low = [], 0
        for bound in MATCH_LEN_BUCKETS:
            names.append(str(bound) if bound <= low else f"{low}-{bound}")
            low = bound + 1
        return names + [f"{low}+"]

    def record_match(self, match_len: int) -> None:
        for i, bound in enumerate(MATCH_LEN_BUCKETS):
            if match_len <= bound:
                self.match_len_counts[i] += 1
                return
        self.match_len_counts[-1] += 1
