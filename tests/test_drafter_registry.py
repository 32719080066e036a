"""The drafter registry: each kind's drafter class drafts for the kind's rules, every bundled
drafter file is named as its kind names it and loads through the registry, and unknown kinds
are named."""

from __future__ import annotations

import pytest

from spot.builtin import builtin_root
from spot.config import CommitRule
from spot.drafters.registry import DRAFTERS, acceptance_curve, drafter_kind
from spot.drafters.spiffy import SpiffyDrafter
from spot.drafters.spot import SpotDrafter
from spot.drafters.spot_sets import SpotSetsDrafter


def test_drafter_classes_draft_for_their_kinds_rules():
    classes = {"spiffy": SpiffyDrafter, "spot": SpotDrafter, "spot-sets": SpotSetsDrafter}
    assert set(DRAFTERS) == set(classes)
    for name, cls in classes.items():
        assert DRAFTERS[name].drafter_class is cls
        assert cls.rules == DRAFTERS[name].rules
    served = {rule for kind in DRAFTERS.values() for rule in kind.rules}
    assert served == set(CommitRule)  # every rule has a drafter


def test_file_names_carry_kind_block_length_and_rule():
    assert drafter_kind("spot").file_name(32) == "spot-b32.safetensors"
    assert drafter_kind("spiffy").file_name(16, CommitRule.THRESHOLD) == (
        "spiffy-b16-threshold.json"
    )
    assert drafter_kind("spot-sets").file_name(32, "sdar_dynamic") == (
        "spot-sets-b32-sdar_dynamic.safetensors"
    )


def test_every_bundled_drafter_is_named_and_read_by_its_kind():
    bundled = sorted((builtin_root() / "drafters").glob("*/*.*"))
    assert bundled
    names = {
        kind.file_name(int(block), rule): kind
        for kind in DRAFTERS.values()
        for block in (16, 32)
        for rule in CommitRule
    }
    for path in bundled:
        kind = names[path.name]
        kind.check_file(path)
        curve = acceptance_curve(kind.name, path)
        assert curve.budgets[0] == 0 and curve.steps_per_forward[0] == 1.0


def test_a_file_of_another_kind_and_unknown_kinds_are_refused():
    spot_file = next((builtin_root() / "drafters").glob("*/spot-b32.safetensors"))
    with pytest.raises(ValueError, match="holds a 'spot' drafter, not 'spot-sets'"):
        drafter_kind("spot-sets").check_file(spot_file)
    with pytest.raises(ValueError, match="unknown drafter kind 'medusa'"):
        drafter_kind("medusa")
