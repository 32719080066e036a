"""Failures injected into the replicas of a real run (tests of the engine's failure handling).

Python imports this module at start-up in every process with this folder on its path: the
driver and the Ray workers it starts (they inherit its environment). With
SPOT_TEST_GENERATION_FAULTS holding a plan as JSON (see tests/faulty_target.py), every
target forward of the native transformer fails as the plan says.
"""

import json
import os

PLAN = os.environ.get("SPOT_TEST_GENERATION_FAULTS")

if PLAN:
    from spot.models.target import DiffusionTarget
    from tests.faulty_target import injected_failure

    _score = DiffusionTarget.score

    def _failing_score(self, contexts, windows, block_length, output_hidden=False):
        failure = injected_failure(json.loads(PLAN), contexts)
        if failure is not None:
            raise failure
        return _score(self, contexts, windows, block_length, output_hidden)

    DiffusionTarget.score = _failing_score
