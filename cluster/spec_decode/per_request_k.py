"""k per request: within the step's ``k``, each request drafts as deep as its own acceptance pays.

The batch's controller picks the step's ``k`` (the number of draft passes); here each request
``r`` then keeps the first ``k_r <= k`` of its positions. Draft position ``j`` of request ``r``
adds ``g_rj = a_r1 ... a_rj`` expected tokens and one verified token to the step; over the
batch, a step gains ``E = b + sum g`` tokens in ``T(D) = T_target(b, 1 + D / b) + k T_draft(b)``
(``D`` the draft tokens verified), so a position pays when ``g_rj > (T(D + 1) - T(D)) E / T``:
the threshold is found by a few fixed-point rounds from ``k_r = k``. A request asked for drafts
keeps at least one (the cheapest probe: without it a request whose first drafts were rejected
would never be measured again). A request's acceptance
``a_rj`` is its own count of hits over tries at position ``j``, blended with the controller's
batch-wide estimate as ``prior_weight`` pseudo-tries (new requests follow the batch).
"""

from __future__ import annotations

from cluster.shared.request import Request
from cluster.spec_decode.latency_model import LatencyModel

PRIOR_WEIGHT = 4.0


def request_acceptance(request: Request, batch: list[float], prior_weight: float = PRIOR_WEIGHT) -> list[float]:
    """Per position, the request's own acceptance blended with the batch's."""
    tries, hits = request.spec_tries, request.spec_hits
    return [(hits[j] + prior_weight * a) / (tries[j] + prior_weight) if j < len(tries) else a
            for j, a in enumerate(batch)]


def record_verified(request: Request, asked: int, accepted: int) -> None:
    """One verification of ``asked`` positions with ``accepted`` drafts accepted: positions up to
    the first rejection were tried, the accepted ones hit."""
    for j in range(min(accepted + 1, asked)):
        while len(request.spec_tries) <= j:
            request.spec_tries.append(0)
            request.spec_hits.append(0)
        request.spec_tries[j] += 1
        request.spec_hits[j] += j < accepted


def split_k(model: LatencyModel, k: int, asked: list[int], acceptance: list[list[float]], rounds: int = 3) -> list[int]:
    """Each request's draft length: ``asked[r]`` (at most ``k``) cut where its positions stop paying."""
    b = len(asked)
    if b == 0 or k == 0:
        return list(asked)
    gains = []
    for a, n in zip(acceptance, asked):
        g, row = 1.0, []
        for j in range(n):
            g *= a[min(j, len(a) - 1)]
            row.append(g)
        gains.append(row)
    ks = list(asked)
    draft = k * model.draft_time(b)
    for _ in range(rounds):
        drafted = sum(ks)
        step = model.target_time(b, 1 + drafted / b) + draft
        if step <= 0:
            return list(asked)
        expected = b + sum(sum(row[:n]) for row, n in zip(gains, ks))
        marginal = model.target_time(b, 1 + (drafted + 1) / b) + draft - step
        threshold = max(marginal, 0.0) * expected / step
        new = [min(n, max(1, sum(1 for g in row if g > threshold))) for row, n in zip(gains, asked)]
        if new == ks:
            break
        ks = new
    return ks
