"""The commit rules each kind of drafter drafts for: its class declares them and the registry
lists them, both from here, so a job is checked against them (`pipeline.job`) without
importing the drafters, or torch."""

from __future__ import annotations

from spot.config import CommitRule

SPOT_RULES = (CommitRule.STATIC,)
SPOT_SETS_RULES = (CommitRule.THRESHOLD, CommitRule.SDAR_DYNAMIC)
SPIFFY_RULES = (CommitRule.STATIC, CommitRule.THRESHOLD)  # a graph is calibrated for one
