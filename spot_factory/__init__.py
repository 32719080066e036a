"""The bundled-asset factory: the bundled tokenizer and corpus files, and the training and
evaluation of the bundled targets in `spot/builtin` (the corpus generator itself is
`spot_common.corpus`, which the drafter commands read too).

A tool for making and checking those assets, with its own command (`spot-factory`); nothing
that validates or runs a job imports it, and it imports nothing of `pipeline`.
"""
