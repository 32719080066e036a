"""The bundled-asset factory: the synthetic corpus, the bundled tokenizer, and the training
and evaluation of the bundled targets in `spot/builtin`.

A tool for making and checking those assets, with its own command (`spot-factory`); nothing
that validates or runs a job imports it.
"""
