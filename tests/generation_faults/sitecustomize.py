"""Failures injected into the replicas of a real run (tests of the engine's failure handling).

Python imports this module at start-up in every process with this folder on its path: the
driver and the Ray processes it starts (they inherit its environment). With
SPOT_TEST_GENERATION_FAULTS holding a plan as JSON (see tests/faulty_target.py), every
target forward of the native transformer fails as the plan says. The target module is
patched when a process imports it, so Ray's own processes (which never do) start as usual.
"""

import importlib.abc
import importlib.util
import json
import os
import sys

PLAN = os.environ.get("SPOT_TEST_GENERATION_FAULTS")
MODULE = "spot.models.target"


def _patch(module) -> None:
    from tests.faulty_target import injected_failure

    score = module.DiffusionTarget.score

    def failing_score(self, contexts, windows, block_length, output_hidden=False):
        failure = injected_failure(json.loads(PLAN), contexts)
        if failure is not None:
            raise failure
        return score(self, contexts, windows, block_length, output_hidden)

    module.DiffusionTarget.score = failing_score


class _PatchOnImport(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds the target module as usual, then patches it once it has run."""

    def find_spec(self, name, path, target=None):
        if name != MODULE:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        self.loader = spec.loader
        spec.loader = self
        return spec

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _patch(module)


if PLAN:
    sys.meta_path.insert(0, _PatchOnImport())
