"""Suffix decoding (SuffixDecoding, arXiv 2411.04975): drafts from everything the replica has said.

The trees are ``arctic-inference``'s ``SuffixDecodingCache``, the one vLLM's ``method: suffix``
calls: a replica-wide suffix tree over the responses of every request (in-flight ones grow in
it as they decode, finished ones stay until evicted first-in-first-out past
``max_cached_requests``), and one tree per active request over its own prompt, dropped when the
request ends. For each request asked for drafts the last ``max_tree_depth`` tokens are matched
in both trees; the deeper-scoring match drafts its most frequent continuation while the product
of branch frequencies stays at least ``min_token_prob``, at most ``max_spec_factor`` x the match
length tokens and at most what the scheduler reserved (the batch's ``k``, the request's cap). So
each request drafts what its own evidence supports, often nothing.

The trees are brought up to date lazily: before each proposal every scheduled request's new
output tokens are appended (a step that asks for no drafts, past k included, adds nothing yet), and a
finished request's last tokens are appended when it is freed. Drafts are deterministic (one-hot
to the rejection sampler), so every verification mode keeps the target's distribution.

A warm start (:meth:`SuffixProposer.history`, :meth:`SuffixProposer.seed`): the proposer keeps
copies of its latest ``warm_start_requests`` finished responses, which a replica starting beside
it takes into its own replica-wide tree, oldest first, as if it had produced them (they are
evicted before anything it produces itself).
"""

from __future__ import annotations

import importlib.util
import itertools
import time
from array import array
from collections import OrderedDict, deque

from cluster.shared.draft_proposal import DraftProposal
from cluster.shared.request import Request
from cluster.shared.scheduled import ScheduledRequest
from cluster.spec_decode.suffix_stats import SuffixTreeStats

INSTALL_HINT = ("`make install` builds it; by hand: pip install cmake ninja nanobind==2.9.2 grpcio-tools, then "
                "pip install --no-build-isolation --no-deps arctic-inference==0.3.0")


def suffix_problem() -> str | None:
    """One line saying why ``method: suffix`` cannot run in this environment, or None when it can."""
    if importlib.util.find_spec("arctic_inference") is None:
        return f"speculative.method suffix needs the arctic-inference package, which is not installed ({INSTALL_HINT})"
    return None


def suffix_cache_class():
    """``arctic_inference``'s ``SuffixDecodingCache``; ImportError (saying how to install it) without it."""
    try:
        from arctic_inference.suffix_decoding import SuffixDecodingCache
    except ImportError as exc:
        raise ImportError(f"speculative.method suffix needs arctic-inference ({INSTALL_HINT}): {exc}") from exc
    return SuffixDecodingCache


class SuffixProposer:
    """The engine's proposer for ``speculative.method: suffix`` (vLLM's keys and defaults)."""

    free_lookahead = True  # one-hot drafts from the trees, no model pass

    def __init__(self, max_tree_depth: int = 24, max_cached_requests: int = 10000, max_spec_factor: float = 1.0,
                 min_token_prob: float = 0.1, warm_start_requests: int = 0) -> None:
        self.cache = suffix_cache_class()(max_tree_depth, max_cached_requests)
        self.max_tree_depth = max_tree_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self._active: dict[str, tuple[Request, int]] = {}  # request id -> (request, output tokens in the trees)
        self._cached_len: OrderedDict[str, int] = OrderedDict()  # responses in the global tree, oldest first
        # the latest finished responses, for a replica's warm start (none kept without a global tree)
        self._recent: deque[array] = deque(maxlen=min(warm_start_requests, max_cached_requests))
        self._seeded = itertools.count()
        self.tree_stats = SuffixTreeStats()

    def history(self, max_requests: int) -> list[list[int]]:
        """Up to ``max_requests`` of the latest finished responses (token ids), oldest first."""
        if max_requests <= 0:
            return []
        return [list(tokens) for tokens in list(self._recent)[-max_requests:]]

    def seed(self, responses: list[list[int]]) -> int:
        """Take ``responses`` (oldest first) into the replica-wide tree as finished responses of
        requests with ids of their own; returns how many went in (none without a global tree)."""
        if self.cache.max_cached_requests == 0:
            return 0
        taken = 0
        for tokens in responses:
            tokens = [int(t) for t in tokens]
            if not tokens:
                continue
            rid = f"warm-start-{next(self._seeded)}"
            self.cache.start_request(rid, [])
            self.cache.add_active_response(rid, tokens)
            self.cache.stop_request(rid)
            self._cached_len[rid] = len(tokens)
            self.tree_stats.num_cached_tokens += len(tokens)
            self.tree_stats.num_tokens_added += len(tokens)
            self._recent.append(array("l", tokens))
            self._forget_evicted()
            taken += 1
        return taken

    def record(self, aux_hidden: dict) -> None:
        pass

    def clear(self) -> None:
        """Forget every response and prompt (between benchmark runs: nothing may be in flight)."""
        if self._active:
            raise RuntimeError(f"{len(self._active)} requests are still active; clear the trees between runs")
        self.cache = suffix_cache_class()(self.max_tree_depth, self.cache.max_cached_requests)
        self._cached_len.clear()
        self._recent.clear()
        self.tree_stats = SuffixTreeStats()

    def timing_call(self, sequences: list[list[int]], num_draft_tokens: int):
        """A call that speculates for each of ``sequences`` with this proposer's settings, from
        fresh trees that hold them as prompts (for ``tandem profile``; the replica's trees are
        left alone)."""
        cache = suffix_cache_class()(self.max_tree_depth, 0)
        for i, seq in enumerate(sequences):
            cache.start_request(i, seq)

        def call() -> list[list[int]]:
            return [cache.speculate(i, seq[-self.max_tree_depth:], num_draft_tokens, self.max_spec_factor, 0.0,
                                    self.min_token_prob).token_ids for i, seq in enumerate(sequences)]
        return call

    def propose(self, scheduled: list[ScheduledRequest], block_tables: list[list[int]]) -> DraftProposal:
        started = time.perf_counter()
        drafts: dict[str, list[int]] = {}
        for s in scheduled:
            self._sync(s.request)
        for s in scheduled:
            if s.num_draft_tokens <= 0:
                continue
            request = s.request
            context = request.all_token_ids[-self.max_tree_depth:]
            draft = self.cache.speculate(request.request_id, context, max_spec_tokens=s.num_draft_tokens,
                                         max_spec_factor=self.max_spec_factor, min_token_prob=self.min_token_prob)
            self.tree_stats.record_match(draft.match_len)
            if draft.token_ids:
                drafts[request.request_id] = list(draft.token_ids[: s.num_draft_tokens])
        self.tree_stats.num_proposals += 1
        self.tree_stats.propose_seconds += time.perf_counter() - started
        return DraftProposal(drafts, None)

    def free(self, request_id: str) -> None:
        """The request ended: its last tokens join the replica-wide tree, its prompt tree goes."""
        entry = self._active.get(request_id)
        if entry is None:
            return
        self._sync(entry[0])
        del self._active[request_id]
        self.cache.stop_request(request_id)
        if self._recent.maxlen and entry[0].output_token_ids:
            self._recent.append(array("l", entry[0].output_token_ids))
        self.tree_stats.num_active_requests = len(self._active)

    def _sync(self, request: Request) -> None:
        """Start the request's trees at first sight, then append the output tokens not yet added."""
        rid = request.request_id
        entry = self._active.get(rid)
        if entry is None:
            self.cache.start_request(rid, request.prompt_token_ids)  # evicts the oldest past the cap
            # An id used before: start_request dropped its old response.
            self.tree_stats.num_cached_tokens -= self._cached_len.pop(rid, 0)
            if rid in self.cache.cached_requests:  # max_cached_requests 0: no replica-wide tree
                self._cached_len[rid] = 0
            self._forget_evicted()
            num_synced = 0
            self.tree_stats.num_active_requests = len(self._active) + 1
        else:
            num_synced = entry[1]
        output = request.output_token_ids
        if len(output) > num_synced:
            self.cache.add_active_response(rid, output[num_synced:])
            self.tree_stats.num_tokens_added += len(output) - num_synced
            if rid in self._cached_len:
                self._cached_len[rid] += len(output) - num_synced
                self.tree_stats.num_cached_tokens += len(output) - num_synced
        # A truncated output (a stop string) leaves its extra tokens in the trees: they only
        # shape later drafts, which the target verifies.
        self._active[rid] = (request, len(output))

    def _forget_evicted(self) -> None:
        """Drop the responses the cache evicted (first in, first out) from the counts."""
        cached = self.cache.cached_requests
        while self._cached_len:
            rid, num_tokens = next(iter(self._cached_len.items()))
            if rid in cached:
                break
            self._cached_len.popitem(last=False)
            self.tree_stats.num_cached_tokens -= num_tokens
            self.tree_stats.num_evicted_requests += 1
        self.tree_stats.num_cached_requests = len(self._cached_len)
