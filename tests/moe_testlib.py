"""Shared helpers for the MoE tests: random params and inputs."""

import re

import jax
import jax.extend
import jax.numpy as jnp
import numpy as np

import uniep_jax


def make_params(key, *, experts, hidden, ffn, dtype=jnp.float32, bias=None):
  k = jax.random.split(key, 4)
  s_in, s_ff = hidden ** -0.5, ffn ** -0.5
  return uniep_jax.MoEParams(
      router=jax.random.normal(k[0], (hidden, experts), jnp.float32),
      w_gate_up=uniep_jax.join_gate_up(
          (jax.random.normal(k[1], (experts, hidden, ffn)) * s_in).astype(dtype),
          (jax.random.normal(k[2], (experts, hidden, ffn)) * s_in).astype(dtype)),
      w_down=(jax.random.normal(k[3], (experts, ffn, hidden)) * s_ff).astype(dtype),
      expert_bias=bias)


def make_x(key, tokens, hidden, dtype=jnp.float32):
  return jax.random.normal(key, (tokens, hidden), jnp.float32).astype(dtype)


def rel_err(a, b):
  a = jnp.asarray(a, jnp.float32)
  b = jnp.asarray(b, jnp.float32)
  return float(jnp.linalg.norm((a - b).ravel()) / (jnp.linalg.norm(b.ravel()) + 1e-30))


def capacity_keep_mask(topk, shards: int, cap: int, experts: int):
  """[N, K] bool: the GShard capacity rule in numpy. Per token shard, an expert keeps
  its first `cap` assignments in (expert, token, slot) order; the rest are dropped."""
  topk = np.asarray(topk)
  per, top_k = topk.shape[0] // shards, topk.shape[1]
  keep = np.zeros_like(topk, bool)
  for s in range(shards):
    seen = np.zeros(experts, int)
    for e in range(experts):
      for t in range(per):
        for k in range(top_k):
          if topk[s * per + t, k] == e:
            keep[s * per + t, k] = seen[e] < cap
            seen[e] += 1
  return keep


def all_eqns(jaxpr):
  """Every equation of a closed jaxpr, sub-jaxprs (jit, custom_vjp, scan...) included."""
  def walk(jp):
    for eqn in jp.eqns:
      yield eqn
      for sub in jax.extend.core.jaxprs_in_params(eqn.params):
        yield from walk(sub)

  return list(walk(jaxpr.jaxpr))


def float_scatter_adds(jaxpr, width: int | None = None) -> list[str]:
  """Float scatter-adds (of [..., width] rows, or of any shape when width is None)
  anywhere in a closed jaxpr, sub-jaxprs included: XLA runs them with atomics on
  the GPU, whose order changes from run to run when indices collide."""
  found = []
  for eqn in all_eqns(jaxpr):
    aval = eqn.outvars[0].aval if eqn.outvars else None
    if (eqn.primitive.name == "scatter-add" and jnp.issubdtype(aval.dtype, jnp.floating)
        and (width is None or (aval.shape and aval.shape[-1] == width))):
      found.append(str(eqn.outvars[0].aval))
  return found


def host_stepped_loops(stablehlo_text: str) -> list[str]:
  """The while loops of a lowered program that run more than once, each as its loop line
  (XLA:GPU steps a while loop from the host: a round trip per step; jnp.searchsorted's
  default "scan" method is one, `pallas_kernels.ragged.SEARCH_METHOD` unrolls it). A loop whose
  condition is `counter < 1` (a scan of one step, e.g. a bisection over one entry, left
  to XLA's loop simplifier) is not one."""
  lines = stablehlo_text.split("\n")
  loops = []
  for i, line in enumerate(lines):
    if "stablehlo.while" not in line:
      continue
    cond = []
    for nxt in lines[i + 1:]:
      if "} do {" in nxt:
        break
      cond.append(nxt)
    bound = [int(m) for c in cond for m in re.findall(r"stablehlo\.constant dense<(\d+)> : tensor<i32>", c)]
    one_step = len(bound) == 1 and bound[0] <= 1 and any("compare  LT" in c or "compare LT" in c
                                                         for c in cond)
    if not one_step:
      loops.append(line.strip()[:200])
  return loops
