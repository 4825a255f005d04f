"""What the adaptive controller believes before any measurement, when its replica has no
speculation profile (none named, or the file not written yet: a profiling Job still running).

A profile improves the start; it never gates it. Without one, the controller starts from a
step-time model of the usual shape for the device's kind and the proposer, in relative units
(the controller learns the scale from the first steps it times), and a middling acceptance,
then learns both online from every step: the acceptance of each position from what is
verified, the step times from its own steps and its plain and deeper probes
(``AdaptiveController``). The prior is deliberately weak (``PRIOR_WEIGHT``), so a few dozen
timed steps outweigh it.
"""

from __future__ import annotations

from cluster.spec_decode.latency_model import LatencyModel

PRIOR_ACCEPTANCE = 0.5  # per draft position, until verified tokens say otherwise
PRIOR_WEIGHT = 1.0  # the prior's coefficients count as this many timed steps (a profile's: 10)

# A target pass: a fixed cost (reading the weights), a little per sequence and per token computed;
# on a CPU a token computed costs a larger share of the pass than on a GPU.
_TARGET = {"cpu": [1.0, 0.01, 0.02], "cuda": [1.0, 0.01, 0.002]}
# A draft pass, relative to the target's: n-gram and suffix-tree lookups are host work; a model or head reads its own weights.
_DRAFT = {"ngram": [0.02, 0.0005], "suffix": [0.02, 0.0005], "draft": [0.15, 0.002],
          "eagle3": [0.08, 0.001]}


def prior_model(method: str, device_type: str) -> LatencyModel:
    """The step-time model a replica without a profile starts from (``device_type``: cpu or cuda)."""
    target = _TARGET["cpu" if device_type == "cpu" else "cuda"]
    return LatencyModel(list(target), list(_DRAFT.get(method, _DRAFT["draft"])))
