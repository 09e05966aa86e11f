"""Measuring on a device: the target MoE shapes, the timing method, run metadata.

Used by the autotuner (uniep_jax/autotune.py) and the benchmarks (bench/).

Timing (docs/performance.md): jit, warm up, then `trials` batches of `reps`
back-to-back calls with `block_until_ready` on the last result; the per-call median
over trials is reported. `reps` adapts so that one batch lasts at least `min_batch_s`.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import platform
import statistics
import subprocess
import time

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class MoEShape:
  """Per EP rank: T tokens, hidden H, expert FFN F, E experts, top-k K (the target
  shapes of docs/performance.md)."""
  name: str
  tokens: int
  hidden: int
  ffn: int
  experts: int
  top_k: int

  def fwd_flops_per_rank(self) -> float:
    return 2.0 * self.tokens * self.top_k * self.hidden * self.ffn * 3

  def dispatch_bytes_per_rank(self, ranks: int, itemsize: int = 2) -> float:
    """Bytes one rank sends for one dispatch (no de-duplication); combine is the same."""
    return self.tokens * self.top_k * self.hidden * itemsize * (ranks - 1) / ranks


SHAPES = {
    "mixtral-like": MoEShape("mixtral-like", 8192, 4096, 14336, 8, 2),
    "deepseek-like": MoEShape("deepseek-like", 8192, 7168, 2048, 256, 8),
    "qwen3-like": MoEShape("qwen3-like", 16384, 2048, 768, 128, 8),
    "small-experts": MoEShape("small-experts", 8192, 1536, 480, 64, 8),
}
# Not a target: a shape small enough to smoke-test the benchmark scripts on the CPU.
SMOKE_SHAPES = {"tiny": MoEShape("tiny", 256, 64, 96, 8, 2)}

# The skewed routing of the benchmarks and the autotuner (a realistic skew)
ZIPF_EXPONENT = 1.2
ZIPF_SEED = 1234   # the experts' popularity order: fixed


def zipf_popularity(experts: int):
  """[E] float64 probabilities: expert e has weight (perm[e] + 1)^-ZIPF_EXPONENT,
  normalised, with perm a fixed random permutation (ZIPF_SEED), so that the hot experts
  are not all on the first ranks."""
  import numpy as np
  weights = np.arange(1, experts + 1, dtype=np.float64) ** -ZIPF_EXPONENT
  return weights[np.random.default_rng(ZIPF_SEED).permutation(experts)] / weights.sum()


def block(tree):
  return jax.tree.map(lambda a: a.block_until_ready() if hasattr(a, "block_until_ready") else a, tree)


def time_ms(fn, *args, trials: int = 7, min_batch_s: float = 0.05, max_reps: int = 50) -> dict:
  """Median ms per call of `fn(*args)` (already jitted).

  On the CPU every call is waited for: back-to-back collective programs over
  virtual CPU devices can starve XLA:CPU's rendezvous on a 2-core machine."""
  sync_each = jax.devices()[0].platform == "cpu"
  block(fn(*args))                      # compile + warm-up
  t0 = time.perf_counter()
  block(fn(*args))
  one = max(time.perf_counter() - t0, 1e-6)
  reps = int(min(max_reps, max(1, min_batch_s / one)))
  per_call = [_batch_ms(fn, args, reps, sync_each) for _ in range(trials)]
  return dict(median_ms=statistics.median(per_call), min_ms=min(per_call),
              max_ms=max(per_call), reps=reps, trials=trials)


def _batch_ms(fn, args, reps: int, sync_each: bool) -> float:
  """ms per call of one batch of `reps` back-to-back calls, waited for at its end (each
  call waited for with sync_each)."""
  t0 = time.perf_counter()
  out = None
  for _ in range(reps):
    out = fn(*args)
    if sync_each:
      block(out)
  block(out)
  return (time.perf_counter() - t0) / reps * 1e3


def git_commit() -> str:
  """The commit of the code that runs: $GIT_COMMIT, else the file BENCH_COMMIT at
  the repository root (written by bench/stamp_commit.sh before a device call,
  since .git does not travel), else `git rev-parse HEAD`."""
  if os.environ.get("GIT_COMMIT"):
    return os.environ["GIT_COMMIT"]
  stamp = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "BENCH_COMMIT")
  if os.path.exists(stamp):
    return open(stamp).read().strip()
  try:
    out = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                         cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"],
                           capture_output=True, text=True,
                           cwd=os.path.dirname(os.path.abspath(__file__)), timeout=10)
    if out.returncode == 0:
      return out.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
  except Exception:  # noqa: BLE001 - metadata only
    pass
  return "unknown"


def run_metadata() -> dict:
  devs = jax.devices()
  return dict(device_kind=devs[0].device_kind, device_count=len(devs),
              platform=devs[0].platform, jax_version=jax.__version__,
              git_commit=git_commit(), host=platform.node(),
              date=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def tree_checksum(tree) -> tuple:
  """Position-sensitive checksum of the bits of every leaf, computed on the device.

  Per leaf, with u = the bits as uint32, i = the flat index (uint32, wrapping)
  and f = MurmurHash3's fmix32 (a bijection of uint32 that spreads every bit):
  (sum f(u ^ f(i)), sum f(u + 2654435769 i)) mod 2^32. For a fixed i both terms
  are bijective in u, so any change of one element changes both sums; the mixing
  keeps changes of several elements (e.g. sign bits) from cancelling."""
  sums = _checksum_fn()(jax.tree.leaves(tree))
  return tuple(f"{int(s[0]):08x}{int(s[1]):08x}" for s in jax.device_get(sums))


@functools.lru_cache(maxsize=1)
def _checksum_fn():
  def leaf(a):
    if a.dtype == jnp.bool_:
      u = a.astype(jnp.uint32)
    elif a.dtype.itemsize > 4:   # 64-bit: two uint32 words per element (extra minor dim)
      u = jax.lax.bitcast_convert_type(a, jnp.uint32)
    else:
      u = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{a.dtype.itemsize * 8}"))
      u = u.astype(jnp.uint32)
    idx = jnp.zeros(u.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(u.ndim)):
      idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(stride % 2**32)
      stride *= u.shape[d]
    h1 = jnp.sum(fmix32(u ^ fmix32(idx)), dtype=jnp.uint32)
    h2 = jnp.sum(fmix32(u + idx * jnp.uint32(2654435769)), dtype=jnp.uint32)
    return jnp.stack([h1, h2])

  def fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)

  return jax.jit(lambda leaves: [leaf(a) for a in leaves])
