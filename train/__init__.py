"""Training entry point for the UniEP MoE transformers (`python -m train`, `uniep-train`).

Importing `train` does not import jax: the CLI must set XLA_FLAGS (virtual CPU
devices) first. `train.loop` imports jax.
"""
