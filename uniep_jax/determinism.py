"""XLA's deterministic mode on GPUs, which the bitwise guarantee of a whole program needs.

The MoE layer decides every row's place and every reduction's order itself, so its own
bits repeat run after run. The rest of a program may not: XLA:GPU picks GEMM kernels by
timing candidates at compile time (two compilations of the same program can pick
differently, so a dense layer's bits may change from run to run) and runs scatter-adds
with atomics. `--xla_gpu_deterministic_ops=true` turns both off. The training CLI sets
it; a library user calls `enable_xla_determinism()` before JAX's first computation, and
`moe_ffn` warns once on a GPU without it.
"""

from __future__ import annotations

import os
import warnings

DETERMINISTIC_FLAG = "--xla_gpu_deterministic_ops"


class NondeterministicXLAWarning(UserWarning):
  """moe_ffn runs on GPUs without XLA's deterministic mode."""


def xla_deterministic() -> bool:
  """Whether XLA_FLAGS turns XLA:GPU's deterministic mode on."""
  flags = os.environ.get("XLA_FLAGS", "").split()
  return any(f in (DETERMINISTIC_FLAG, f"{DETERMINISTIC_FLAG}=true") for f in flags)


def enable_xla_determinism() -> None:
  """Turns XLA:GPU's deterministic mode on (`--xla_gpu_deterministic_ops=true` in
  XLA_FLAGS). XLA reads its flags when JAX starts its backends: call this before the
  first computation (or set the flag in the environment). Raises RuntimeError if the
  backends have started without it; an explicit setting in XLA_FLAGS is left alone."""
  if xla_deterministic():
    return
  from jax._src import xla_bridge
  if xla_bridge.backends_are_initialized():
    raise RuntimeError(f"enable_xla_determinism() after JAX started its backends has no "
                       f"effect: call it before the first computation, or run with "
                       f"XLA_FLAGS={DETERMINISTIC_FLAG}=true")
  flags = os.environ.get("XLA_FLAGS", "")
  if DETERMINISTIC_FLAG in flags:   # set to false explicitly: the user's choice
    return
  os.environ["XLA_FLAGS"] = f"{flags} {DETERMINISTIC_FLAG}=true".strip()


def warn_if_nondeterministic(platform: str) -> None:
  """A warning (once per call site, Python's default filter) when the layer runs on GPUs
  without XLA's deterministic mode."""
  if platform == "gpu" and not xla_deterministic():
    warnings.warn("uniep_jax.moe_ffn on GPUs without XLA's deterministic mode: the MoE "
                  "layer's own bits repeat, but XLA may pick other GEMM kernels for the rest "
                  "of the program in another compilation (other bits). Call "
                  "uniep_jax.enable_xla_determinism() before JAX's first computation, or set "
                  f"XLA_FLAGS={DETERMINISTIC_FLAG}=true", NondeterministicXLAWarning,
                  stacklevel=4)
