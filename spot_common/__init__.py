"""What the pipeline and the asset factory both use, below both of them: the bundled corpus
(its seeded generator: the factory builds the shipped files from it, the drafter commands read
its train split), a checkpoint's tokenizer, and the command group whose commands are imported
on first use.

Imports `spot` and libraries, never `pipeline` or `spot_factory` (tests/test_layering.py).
"""
