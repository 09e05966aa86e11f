"""GPU bring-up of the EXPERIMENTAL fused dispatch + gate/up kernel (v2 Kernel A).

  PYTHONPATH=$PWD timeout 500 python3 -m bench.check_fused_gpu [--out DIR] [--cases small,mid]

On all local GPUs (mesh data=1, expert=R), per case (shape x config):
  v1     recv = dispatch._send_nvlink(rows)  (ep_transfer, launch 1)
         a, h, u = grouped_gemm swiglu(recv)  (launch 2), same KernelConfig
  fused  recv, a, h, u = fused_dispatch_gemm.fused_dispatch_gate_up(...)  (one launch)
checks (a, h, u) bitwise over all rows, recv bitwise over the rows v1 defines
(live rows + the zeroed window), a second fused launch bitwise, then times both
(median ms). Writes check_fused_gpu_<device>.json to --out (default $OUT) after
every case (the driver: bench/fused_check.py). Exits 1 if any check fails.
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")          # no NVLink multicast, ever
os.environ.setdefault("NVSHMEM_DISABLE_NVLS", "1")
os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from bench import common, fused_check  # noqa: E402
from pallas_kernels import fused_dispatch_gemm as fdg  # noqa: E402
from pallas_kernels import grouped_gemm as gg  # noqa: E402
from uniep_jax import layout  # noqa: E402
from uniep_jax.dispatch import ZERO_WINDOW_ROWS, _send_nvlink, as_received  # noqa: E402

# name: (tokens T, top_k K, local experts El, hidden H, ffn F, skew of expert 0, FusedConfig)
CASES = {
    "small": (512, 4, 4, 512, 384, 0.0, fdg.FusedConfig(n_comm=16, recv_chunk_rows=512)),
    "small-skew": (512, 4, 4, 512, 384, 8.0, fdg.FusedConfig(n_comm=16, recv_chunk_rows=256)),
    "mid": (4096, 8, 8, 2048, 1024, 0.0, fdg.FusedConfig(n_comm=32, recv_chunk_rows=2048)),
    "mid-n64": (4096, 8, 8, 2048, 1024, 0.0, fdg.FusedConfig(n_comm=64, recv_chunk_rows=4096)),
}


def _fns(mesh, r, t, k, el, kernel, transfer, fused):
  e = r * el
  out_rows = r * t * k
  m_p = gg._round_up(out_rows, kernel.block_m)

  def v1(rows, topk, w_gate_up):
    plan, _ = fused_check.plan_of(topk, e)
    recv = _send_nvlink(rows, plan, "expert", el, transfer)                  # [R*T*K, H]
    a, h, u = gg.gate_up_projection(gg._pad_axis(recv, 0, m_p), w_gate_up,
                                    plan.recv_group_sizes, config=kernel, interpret=False)
    return recv, a, h, u, plan.num_received[None]

  def fused_fn(rows, topk, w_gate_up):
    plan, rank = fused_check.plan_of(topk, e)
    seg = layout.dispatch_segments(plan, rank)
    recv, a, h, u = fdg.fused_dispatch_gate_up(
        rows, seg.src_start, seg.dst_start, seg.rows, plan.recv_group_sizes, w_gate_up,
        out_rows=out_rows, axis_name="expert", kernel=kernel, transfer=transfer, fused=fused)
    recv = as_received(recv, plan)  # as v1
    return recv, a, h, u, plan.num_received[None]

  return fused_check.per_rank(v1, mesh, 3), fused_check.per_rank(fused_fn, mesh, 3)


def _inputs(mesh, r, t, k, el, h, f, skew, seed=0):
  e = r * el
  topk = common.skewed_topk(np.random.default_rng(seed), e, r * t, k, skew)
  ks = jax.random.split(jax.random.key(seed), 3)
  rows = jax.random.normal(ks[0], (r * t * k, h)).astype(jnp.bfloat16)   # sorted rows per rank
  w_gate_up = (jax.random.normal(ks[1], (e, h, 2 * f)) * h**-0.5).astype(jnp.bfloat16)
  sh = NamedSharding(mesh, P("expert"))
  return [jax.device_put(x, sh) for x in (rows, jnp.asarray(topk), w_gate_up)]


def _recv_defined_equal(ra, rb, num_received, r) -> tuple[bool, int]:
  """recv rows v1 defines (live + zero window), per rank. Returns (ok, bad rows)."""
  ra = np.asarray(ra).reshape(r, -1, ra.shape[-1])
  rb = np.asarray(rb).reshape(r, -1, rb.shape[-1])
  num_received = np.asarray(num_received)   # on the host: indexing a sharded array is a gather
  bad = 0
  for q in range(r):
    n = min(int(num_received[q]) + ZERO_WINDOW_ROWS, ra.shape[1])
    x, y = ra[q, :n].view(np.uint16), rb[q, :n].view(np.uint16)
    bad += int(np.sum(np.any(x != y, axis=1)))
  return bad == 0, bad


def _build(mesh, r, case, kernel, transfer):
  t, k, el, h, f, skew, fused = case
  return (*_fns(mesh, r, t, k, el, kernel, transfer, fused), _inputs(mesh, r, t, k, el, h, f, skew))


def _compare(ya, yb, yc, r) -> dict:
  """ya, yb, yc: (recv, a, h, u, num_received) of v1, fused, fused again."""
  res = dict(num_received=[int(v) for v in np.asarray(ya[4])])
  res["a_h_u_bitwise"] = all(common.same_bits(p, q) for p, q in zip(ya[1:4], yb[1:4]))
  res["recv_bitwise"], res["recv_bad_rows"] = _recv_defined_equal(ya[0], yb[0], ya[4], r)
  res["fused_repeat_bitwise"] = all(common.same_bits(p, q) for p, q in zip(yb[1:4], yc[1:4]))
  if not res["a_h_u_bitwise"]:
    res["a_h_u_bad_rows"] = [int(np.sum(np.any(np.asarray(p) != np.asarray(q), axis=1)))
                             for p, q in zip(ya[1:4], yb[1:4])]
  res["ok"] = res["a_h_u_bitwise"] and res["recv_bitwise"] and res["fused_repeat_bitwise"]
  return res


def main(argv=None):
  fields = lambda c: dict(T=c[0], K=c[1], El=c[2], H=c[3], F=c[4], skew=c[5],  # noqa: E731
                          n_comm=c[6].n_comm, recv_chunk_rows=c[6].recv_chunk_rows)
  return fused_check.main(argv, name="check_fused_gpu", cases=CASES, case_fields=fields,
                          build=_build, compare=_compare)


if __name__ == "__main__":
  raise SystemExit(main())
