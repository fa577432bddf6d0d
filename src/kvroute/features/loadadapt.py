"""Load-adaptive weighting (design §5.3): above a cluster load threshold, lower the weight of BS.

**Cluster load** (a fraction, measurable by the router and the simulator alike) is the larger of

- mean KV usage over the candidate instances (``InstanceView.kv_usage``: used KV blocks / pool), and
- mean batch occupancy ``min(1, (running + waiting) / seq_capacity)`` with ``seq_capacity`` the
  engine's ``max_num_seqs`` (256 by default, vLLM's and the paper's setting).

When it exceeds ``threshold`` (default 0.7) the LMetric score becomes ``P-token × (BS + 1) ^ w`` with
``w = bs_weight`` (default 0.5) instead of 1. Off unless configured.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvroute.errors import UserError
from kvroute.views import InstanceView

__all__ = ["LoadAdaptiveConfig", "cluster_load", "load_bs_weight"]


@dataclass(frozen=True, slots=True)
class LoadAdaptiveConfig:
    threshold: float = 0.7
    bs_weight: float = 0.5
    seq_capacity: int = 256

    def check(self) -> LoadAdaptiveConfig:
        if not 0 <= self.threshold <= 1 or not self.bs_weight >= 0 or self.seq_capacity < 1:
            raise UserError("load-adaptive: threshold in [0, 1], bs_weight >= 0, seq_capacity >= 1")
        return self


def cluster_load(instances: Sequence[InstanceView], seq_capacity: int) -> float:
    """The cluster load defined in the module docstring (0 for an empty list)."""
    n = len(instances)
    if not n:
        return 0.0
    kv = sum(v.kv_usage for v in instances) / n
    occ = sum(min(1.0, (v.running + v.waiting) / seq_capacity) for v in instances) / n
    return max(kv, occ)


def load_bs_weight(load: float, config: LoadAdaptiveConfig) -> float:
    """The BS exponent at cluster load ``load``: ``config.bs_weight`` above the threshold, else 1."""
    return config.bs_weight if load > config.threshold else 1.0
