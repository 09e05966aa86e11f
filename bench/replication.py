"""Exact-load replication (`UniEPConfig.replica_slots`) measured on ONE GPU: the planner's
cost, the replica weight bytes, and the EP critical path in simulation.

  python -m bench.replication [--out DIR] [--shapes a,b] [--eps 4,8] [--slots 1,2]
                              [--routings balanced,zipf,all_to_one] [--nvlink-gbps 312]

For each target shape (per-rank tokens T, H, F, E, K of `uniep_jax.measure.SHAPES`), each
EP degree R and each routing of R*T tokens (numpy, fixed seeds):
  balanced     K distinct experts per token, uniformly
  zipf         K distinct experts per token with probability ~ 1 / rank^1.2 over a fixed
               random permutation of the experts (hot experts spread over ranks by id)
  all_to_one   expert 0 in every top-k, the other K-1 uniform
the count matrix C [R, E] is planned on the GPU (`balance.plan_replicas`, jitted; with
`virtual_routing` of one rank's T*K assignments: the planner's per-call cost), and then
every rank's grouped FFN (our Pallas grouped GEMM, forward + backward, bf16) runs on
this one GPU with that rank's group sizes, without replication (its El experts) and with
S slots (El + S virtual experts): the slowest rank is the layer's critical path, up to
the communication. Predicted expert phase per rank = its FFN time + the bytes it
receives for its replica slots (weights, bf16) and returns (their float32 gradients) at
`--nvlink-gbps` (default: the in-kernel transfer's rate on 4x H200, two qwen3-like
dispatches of ~181 MB each in 1.16 ms, pallas_kernels/ep_transfer.py), not overlapped.
Reported per case: the slowest rank's FFN ms with and without replicas, the balanced
routing's slowest rank (the "force-balanced ideal") and the ratios; the rows of every
rank; the replica weight bytes; the receive buffer bytes of the worst case (R*T*K
rows) against the plan's bound (T*K rows, the exact load, plus one 128-row tile per
slot). Also checks on the GPU that the grouped GEMM computes a hot expert's rows cut
at the planner's ranges bit for bit as the whole group (forward and dx).
Writes replication_<device>.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np

from bench.common import (SHAPES, SMOKE_SHAPES, dump_stacks_on_usr1, run_metadata, same_bits,
                          time_ms, zipf_popularity)
from pallas_kernels import grouped_gemm as gg
from uniep_jax import KernelConfig
from uniep_jax.balance import plan_replicas, virtual_routing
from uniep_jax.replicas import expert_bytes

ROUTINGS = ("balanced", "zipf", "all_to_one")
TILE_ROWS = 128


def routing(kind: str, experts: int, tokens: int, top_k: int, seed: int) -> np.ndarray:
  """[tokens, top_k] int32, distinct experts per token (Gumbel top-k: sampling without
  replacement in proportion to the popularity)."""
  rng = np.random.default_rng(seed)
  if kind == "balanced":
    logp = np.zeros(experts)
  elif kind == "zipf":
    logp = np.log(zipf_popularity(experts))
  elif kind == "all_to_one":
    logp = np.zeros(experts)
    logp[0] = 1e9
  else:
    raise ValueError(f"routing {kind!r} is unknown; expected one of {ROUTINGS}")
  out = np.empty((tokens, top_k), np.int32)
  step = 8192
  for s in range(0, tokens, step):
    g = rng.gumbel(size=(min(step, tokens - s), experts)) + logp
    out[s:s + step] = np.argsort(-g, axis=1, kind="stable")[:, :top_k]
  return out


def counts(topk: np.ndarray, ranks: int, experts: int) -> np.ndarray:
  per = topk.reshape(ranks, -1)
  return np.stack([np.bincount(p, minlength=experts) for p in per]).astype(np.int32)


def plan_cost_ms(c: np.ndarray, topk_rank0: np.ndarray, slots: int) -> dict:
  """Median ms of the planner and of the planner + rank 0's virtual routing, jitted."""
  cm = jnp.asarray(c)
  tk = jnp.asarray(topk_rank0)
  plan_fn = jax.jit(lambda cm: plan_replicas(cm, slots))
  both_fn = jax.jit(lambda cm, tk: virtual_routing(tk, cm, plan_replicas(cm, slots), 0))
  return dict(plan_ms=time_ms(plan_fn, cm)["median_ms"],
              plan_and_relabel_ms=time_ms(both_fn, cm, tk)["median_ms"])


def rank_groups(c: np.ndarray, slots: int):
  """(group sizes [R, El + S] of every rank, rank_rows [R], slot_expert [R, S], rows_on
  [E, R]) from the plan (slots 0: the owners' own experts)."""
  r, e = c.shape
  el = e // r
  if slots == 0:
    n = c.sum(0)
    return n.reshape(r, el), n.reshape(r, el).sum(1), np.full((r, 0), -1), None
  plan = jax.jit(lambda cm: plan_replicas(cm, slots))(jnp.asarray(c))
  rows_on = np.asarray(plan.rows_on)
  slot_expert = np.asarray(plan.slot_expert)
  groups = np.zeros((r, el + slots), np.int64)
  for q in range(r):
    groups[q, :el] = rows_on[q * el:(q + 1) * el, q]
    for j in range(slots):
      if slot_expert[q, j] >= 0:
        groups[q, el + j] = rows_on[slot_expert[q, j], q]
  return groups, np.asarray(plan.rank_rows), slot_expert, rows_on


class FFN:
  """The grouped FFN forward + backward of one shape with G groups and M buffer rows,
  compiled once; `time(group_sizes)` times one rank's call."""

  def __init__(self, shape, groups: int, rows: int, kernel: KernelConfig):
    key = jax.random.key(0)
    kx, kg, kd, ky = jax.random.split(key, 4)
    h, f = shape.hidden, shape.ffn
    self.x = jax.random.normal(kx, (rows, h), jnp.float32).astype(jnp.bfloat16)
    self.dy = jax.random.normal(ky, (rows, h), jnp.float32).astype(jnp.bfloat16)
    self.wgu = (jax.random.normal(kg, (groups, h, 2 * f), jnp.float32) * h ** -0.5).astype(jnp.bfloat16)
    self.wd = (jax.random.normal(kd, (groups, f, h), jnp.float32) * f ** -0.5).astype(jnp.bfloat16)
    self.groups = groups

    def step(x, wgu, wd, gs, dy):
      y, vjp = jax.vjp(lambda x, a, b: gg.grouped_swiglu_ffn(x, a, b, gs, config=kernel,
                                                             zero_dead_rows=False), x, wgu, wd)
      return y, vjp(dy)

    self.fn = jax.jit(step)

  def run(self, group_sizes):
    gs = np.zeros(self.groups, np.int32)
    gs[:len(group_sizes)] = group_sizes
    return self.fn(self.x, self.wgu, self.wd, jnp.asarray(gs), self.dy)

  def time(self, group_sizes, trials: int) -> float:
    gs = np.zeros(self.groups, np.int32)
    gs[:len(group_sizes)] = group_sizes
    args = (self.x, self.wgu, self.wd, jnp.asarray(gs), self.dy)
    return time_ms(self.fn, *args, trials=trials, min_batch_s=0.02, max_reps=20)["median_ms"]


def split_check(shape, kernel: KernelConfig, pieces: list[int]) -> dict:
  """The rows of one expert as one group and cut into `pieces` (same weights): output and
  dx bit for bit (the grouped GEMM's row-split invariance at the planner's cuts)."""
  n = sum(pieces)
  ffn = FFN(shape, len(pieces), -(-n // TILE_ROWS) * TILE_ROWS, kernel)
  ffn.wgu = jnp.broadcast_to(ffn.wgu[:1], ffn.wgu.shape)
  ffn.wd = jnp.broadcast_to(ffn.wd[:1], ffn.wd.shape)
  y1, (dx1, _, _) = ffn.run([n])
  y2, (dx2, _, _) = ffn.run(pieces)
  return dict(pieces=pieces, y_bitwise=same_bits(y1[:n], y2[:n]),
              dx_bitwise=same_bits(dx1[:n], dx2[:n]))


def run_shape(shape, eps, slots_list, kinds, *, nvlink_gbps: float, trials: int,
              kernel: KernelConfig, log) -> dict:
  e, t, k = shape.experts, shape.tokens, shape.top_k
  per_copy = expert_bytes(shape.hidden, shape.ffn, 2)
  plans = {}
  max_rows, max_groups = TILE_ROWS, 1
  for r in eps:
    if e % r:
      continue
    for kind in kinds:
      topk = routing(kind, e, r * t, k, seed=r)
      c = counts(topk, r, e)
      for s in [0] + [s for s in slots_list if s <= e // r]:
        groups, rows, slot_expert, rows_on = rank_groups(c, s)
        plans[(r, kind, s)] = (c, topk[:t], groups, rows, slot_expert, rows_on)
        max_rows = max(max_rows, int(rows.max()))
        max_groups = max(max_groups, groups.shape[1])
  ffn = FFN(shape, max_groups, -(-max_rows // TILE_ROWS) * TILE_ROWS, kernel)
  cases = []
  for (r, kind, s), (c, topk0, groups, rows, slot_expert, rows_on) in sorted(plans.items()):
    times = [ffn.time(groups[q], trials) for q in range(r)]
    recv_copies = (slot_expert >= 0).sum(1) if s else np.zeros(r, int)
    # weights in (bf16) and float32 gradients back: 3x the bf16 bytes per slot in use
    comm_ms = recv_copies * per_copy * 3 / (nvlink_gbps * 1e9) * 1e3
    case = dict(ep=r, routing=kind, slots=s, rank_rows=rows.tolist(),
                rank_ffn_ms=times, slowest_ffn_ms=max(times),
                replica_copies=int(recv_copies.sum()),
                replica_weight_bytes=int(recv_copies.sum()) * per_copy,
                predicted_rank_ms=(np.asarray(times) + comm_ms).tolist(),
                predicted_slowest_ms=float(max(np.asarray(times) + comm_ms)),
                receive_buffer_bytes_worst=r * t * k * shape.hidden * 2,
                receive_buffer_bytes_plan=(t * k + s * TILE_ROWS) * shape.hidden * 2)
    if s:
      case.update(plan_cost_ms(c, topk0, s))
      hot = int(np.argmax(rows_on.sum(1)))
      case["hot_expert_pieces"] = [int(v) for v in rows_on[hot] if v]
    cases.append(case)
    log(f"{shape.name} EP{r} {kind:10s} S={s}: rows max/mean "
        f"{max(rows)}/{np.mean(rows):.0f}, slowest FFN {max(times):.3f} ms, "
        f"predicted {case['predicted_slowest_ms']:.3f} ms"
        + (f", plan {case['plan_ms']:.3f} ms" if s else ""))
  # ratios against the balanced routing's slowest rank without replicas (same EP)
  for case in cases:
    base = [c for c in cases if c["ep"] == case["ep"] and c["routing"] == "balanced"
            and c["slots"] == 0]
    if base:
      ideal = base[0]["slowest_ffn_ms"]
      case["vs_balanced"] = case["predicted_slowest_ms"] / ideal
      case["of_force_balanced_ideal"] = ideal / case["predicted_slowest_ms"]
  pieces = next((c["hot_expert_pieces"] for c in cases
                 if c.get("hot_expert_pieces") and len(c["hot_expert_pieces"]) > 2), None)
  check = split_check(shape, kernel, pieces) if pieces else None
  return dict(shape=shape.name, tokens=t, hidden=shape.hidden, ffn=shape.ffn, experts=e,
              top_k=k, expert_bytes=per_copy, cases=cases, row_split_check=check)


def main(argv=None) -> None:
  p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                              formatter_class=argparse.RawDescriptionHelpFormatter,
                              epilog=__doc__.split("\n", 2)[2])
  p.add_argument("--out", default=os.environ.get("OUT", "."))
  p.add_argument("--shapes", default=",".join(SHAPES))
  p.add_argument("--eps", default="4,8")
  p.add_argument("--slots", default="1,2")
  p.add_argument("--routings", default=",".join(ROUTINGS))
  p.add_argument("--nvlink-gbps", type=float, default=312.0)
  p.add_argument("--trials", type=int, default=5)
  a = p.parse_args(argv)
  dump_stacks_on_usr1()
  shapes = {**SHAPES, **SMOKE_SHAPES}
  names = a.shapes.split(",")
  for n in names:
    if n not in shapes:
      p.error(f"--shapes: {n!r} is unknown; expected some of {sorted(shapes)}")
  kinds = a.routings.split(",")
  for kind in kinds:
    if kind not in ROUTINGS:
      p.error(f"--routings: {kind!r} is unknown; expected some of {ROUTINGS}")
  eps = [int(v) for v in a.eps.split(",")]
  slots = [int(v) for v in a.slots.split(",")]
  on_gpu = jax.devices()[0].platform == "gpu"
  kernel = KernelConfig() if on_gpu else KernelConfig(num_sms=2)
  os.makedirs(a.out, exist_ok=True)
  meta = run_metadata()
  path = os.path.join(a.out, f"replication_{meta['device_kind'].replace(' ', '_')}.json")
  result = dict(benchmark="replication", **meta, nvlink_gbps=a.nvlink_gbps, shapes=[])
  for n in names:
    result["shapes"].append(run_shape(shapes[n], eps, slots, kinds, nvlink_gbps=a.nvlink_gbps,
                                      trials=a.trials, kernel=kernel,
                                      log=lambda s: print(s, flush=True)))
    with open(path, "w") as f:   # rewritten as each shape completes
      json.dump(result, f, indent=1)
  print(f"wrote {path}", file=sys.stderr)


if __name__ == "__main__":
  main()
