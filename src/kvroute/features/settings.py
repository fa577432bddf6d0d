"""Which production features are on, and their settings: one frozen settings object per feature.

Each feature's own settings class lives with the feature (:mod:`.hotspot`, :mod:`.coldstart`, ...);
:class:`FeatureConfig` only says which are on (``None``: off). Pure: no argparse, no YAML, no I/O
(flag and YAML parsing live in :mod:`kvroute.commands.settings`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from kvroute.features.classes import ClassConfig
from kvroute.features.coldstart import ColdStartConfig
from kvroute.features.hotspot import HotspotConfig
from kvroute.features.limits import LimitsConfig, QuotaConfig
from kvroute.features.loadadapt import LoadAdaptiveConfig
from kvroute.features.monitor import ScoreMonitorConfig

__all__ = ["FeatureConfig"]


@dataclass(frozen=True, slots=True)
class FeatureConfig:
    """Which features are on (``None``: off) and their settings."""

    hotspot: HotspotConfig | None = None
    cold_start: ColdStartConfig | None = None
    monitor: ScoreMonitorConfig | None = None
    load_adaptive: LoadAdaptiveConfig | None = None
    classes: ClassConfig | None = None
    limits: LimitsConfig | None = None
    quota: QuotaConfig | None = None

    def names(self) -> list[str]:
        """Short names of the features that are on, in a fixed order."""
        out = [f.name for f in dataclasses.fields(self) if getattr(self, f.name) is not None]
        if self.limits is not None and not self.limits.active:
            out.remove("limits")
        return out

    @property
    def any(self) -> bool:
        return bool(self.names())

    def check(self) -> FeatureConfig:
        """Return self; raise :class:`UserError` for a bad setting."""
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is not None:
                value.check()
        return self
