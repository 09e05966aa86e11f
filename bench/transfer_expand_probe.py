"""Which part of the communicating `transfer_expand` kernel faults on GPUs.

4x H200, 2026-11-28 (e9eec78): the de-duplicated dispatch with
`TransferConfig(expand_in_transfer=True)` died with CUDA_ERROR_ILLEGAL_INSTRUCTION at
EP 4 (check_moe_gpu `uniep_dd_te`, the layer bench `@te`, `@tel`), while its local form
(one GPU, two launches of the same role bodies) ran bit for bit (bench/transfer_check.py).
Each variant below runs the nvlink de-duplicated dispatch (`dedup._dedup_nvlink`) at EP =
the GPU count in a process of its own (a fault takes the CUDA context with it), first
the two-launch path (`ref`: transfer_segments + gather_live_rows), then the variant,
and compares the live receive rows bit for bit:

  ref            the two launches only (a sanity check of the probe itself)
  te             transfer_expand as it ships
  te_small       with num_ctas = copy_ctas = 16
  te_tel         with expand_last_on_all
  te_scaled      the weighted copy (the backward's dy dispatch)
  te_scaled_small          with num_ctas = copy_ctas = 16
  local, local_scaled      the local form on one GPU (no communication), plain and
                 weighted, against the two launches (`run_local_variant`)

Findings (4x H200 / one H200, 2026-11-28; transfer_expand_probe_NVIDIA_H200*.json): at
cfad04b the plain communicating form ran bit for bit (te, te_small, te_tel) and so did
every bisection variant; te_scaled faulted (CUDA_ERROR_ILLEGAL_INSTRUCTION), and so did
local_scaled on one GPU: the weighted copy inside `move_items`, not the communication.
With each weight read as a scalar from GMEM instead of a TMA box of weights in SMEM
(then a bring-up part "gmem_weights", now the only form) local_scaled ran bit for bit;
with the scale input and its SMEM there but the plain copy ("no_multiply") it ran too.
Not isolated further; the likely cause (unverified): the box started at an item's first
row, any 4-byte offset, where gather_live_rows' boxes, which run, start at multiples of
64 bytes.

Run: `python -m bench.transfer_expand_probe [--out DIR] [--variants ...]` (GPUs only; the
device_session phase `teprobe`).
"""

from __future__ import annotations

import argparse
import functools
import json
import sys

import numpy as np

VARIANTS = ("ref", "te", "no_copy", "no_wait", "no_signal+no_wait", "local_stores", "no_moves",
            "te_small", "te_tel", "te_scaled", "te_scaled_small", "local", "local_scaled")
TOKENS, HIDDEN, EXPERTS, TOP_K = 256, 2048, 16, 4
LOCAL_TOKENS = 2048   # the local variants (one GPU)


def run_local_variant(variant: str) -> dict:
  """local*: the local form (axis_name=None, two launches, one GPU) against the transfer
  and gather_live_rows, bit for bit: does the weighted copy inside `move_items` fault
  without any communication?"""
  import jax
  import jax.numpy as jnp
  from bench import transfer_check as tc

  scaled = variant.startswith("local_scaled")
  tokens = LOCAL_TOKENS
  x, index, _, segments, counts = tc.make_inputs(tokens, HIDDEN)
  recv_index, scale, live, blocks = tc.expand_inputs(counts, tokens)
  w = scale if scaled else None
  out_rows = tc.PEERS * tokens
  want = jax.jit(functools.partial(tc.expand_two_launches, segments=segments, live=live,
                                   out_rows=out_rows))(x, index, recv_index, w)[:live]
  got = jax.jit(functools.partial(tc.expand_one_launch, segments=segments, copy_blocks=blocks,
                                  out_rows=out_rows))(x, index, recv_index, w)[:live]
  want, got = (np.asarray(a.view(jnp.uint16)) for a in (want, got))
  return dict(variant=variant, live_rows=live, equal=bool(np.array_equal(got, want)),
              rows_differing=int(np.sum(np.any(got != want, axis=1))))


def run_variant(variant: str) -> dict:
  from pallas_kernels import transfer_expand as te
  # the "+"-joined bring-up parts of the name switched off in this process only
  te.BRINGUP = frozenset(p for p in variant.split("+") if p in te.BRINGUP_PARTS)
  if variant.startswith("local"):
    return run_local_variant(variant)
  import jax
  import jax.numpy as jnp
  from jax.sharding import Mesh, PartitionSpec as P
  from uniep_jax import TransferConfig
  from uniep_jax.dedup import _dedup_nvlink, plan_with_dedup

  scaled = variant.startswith("te_scaled")
  kw = {}
  if variant in ("te_small", "te_scaled_small"):
    kw = dict(num_ctas=16, copy_ctas=16)
  if variant == "te_tel":
    kw = dict(expand_last_on_all=True)
  r = len(jax.devices())
  mesh = Mesh(np.array(jax.devices()), ("ep",))
  kx, ke, _, ks = jax.random.split(jax.random.key(0), 4)   # (the third: unused, kept for the recorded inputs)
  x = jax.random.normal(kx, (r * TOKENS, HIDDEN), jnp.float32).astype(jnp.bfloat16)
  logits = jax.random.normal(ke, (r * TOKENS, EXPERTS))
  weights, experts = jax.lax.top_k(logits, TOP_K)
  experts = experts.astype(jnp.int32)

  def body(xl, el, wl, key, *, config):
    plan, dplan = plan_with_dedup(el, wl, num_experts=EXPERTS, axis_name="ep", top_k=TOP_K)
    n = plan.recv_valid.shape[0]
    scale = jax.random.normal(key[0], (n,), jnp.float32) if scaled else None
    recv = _dedup_nvlink(xl, plan, dplan, "ep", config, scale=scale)
    live = jnp.arange(n) < plan.num_received
    return jnp.where(live[:, None], recv, jnp.zeros_like(recv)), plan.num_received[None]

  def program(config):
    f = jax.shard_map(lambda *a: body(*a, config=config), mesh=mesh,
                      in_specs=(P("ep"), P("ep"), P("ep"), P("ep")), out_specs=(P("ep"), P("ep")),
                      check_vma=False)
    return jax.jit(f)

  keys = jax.random.split(ks, r)
  args = (x, experts, weights, keys)
  want, live = program(TransferConfig())(*args)
  want = np.asarray(want.view(jnp.uint16))
  row = dict(variant=variant, live_rows=[int(v) for v in np.asarray(live)])
  if variant == "ref":
    return dict(row, equal=True, note="the two-launch path ran")
  got, _ = program(TransferConfig(expand_in_transfer=True, **kw))(*args)
  got = np.asarray(got.view(jnp.uint16))
  return dict(row, equal=bool(np.array_equal(got, want)),
              rows_differing=int(np.sum(np.any(got != want, axis=1))))


def main(argv=None):
  ap = argparse.ArgumentParser()
  ap.add_argument("--variants", default=",".join(VARIANTS))
  ap.add_argument("--out", default=None)
  ap.add_argument("--timeout-s", type=int, default=90)
  ap.add_argument("--one", default=None, help=argparse.SUPPRESS)   # child: run one variant
  args = ap.parse_args(argv)
  if args.one:
    print(json.dumps(run_variant(args.one)), flush=True)
    return 0
  from bench import common
  return common.run_probe("transfer_expand_probe", args.variants.split(","), args.out, args.timeout_s)


if __name__ == "__main__":
  sys.exit(main())
