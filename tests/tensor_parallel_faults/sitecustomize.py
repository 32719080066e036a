"""Failures injected into the tensor-parallel ranks of tests/test_tensor_parallel.py.

Python imports this module at start-up in every process with this folder on its path: the
test's rank 0, and the ranks it spawns (they inherit its path). With SPOT_TEST_TP_FAULTS
naming a JSON file {"<rank>": [n, ...]}, the n-th decoder-layer forward of that rank's
process raises MemoryError, as if the rank ran out of memory there. The file is read at every
layer, so the test changes the plan as it goes; `calls` counts this process's layers.
"""

import json
import os

FAULTS = os.environ.get("SPOT_TEST_TP_FAULTS")
calls = 0

if FAULTS:
    from spot.models import transformer

    _forward = transformer.DecoderLayer.forward

    def _failing_forward(self, *args, **kwargs):
        global calls
        calls += 1
        rank = os.environ.get("RANK", "0")
        with open(FAULTS) as plan:
            if calls in json.load(plan).get(rank, []):
                raise MemoryError(f"rank {rank} ran out of memory in layer call {calls}")
        return _forward(self, *args, **kwargs)

    transformer.DecoderLayer.forward = _failing_forward
