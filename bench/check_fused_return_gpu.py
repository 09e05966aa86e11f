"""GPU bring-up of the EXPERIMENTAL fused down GEMM + return kernel (v2 Kernel B).

  PYTHONPATH=$PWD timeout 500 python3 -m bench.check_fused_return_gpu [--out DIR] [--cases small]

On all local GPUs (mesh data=1, expert=R), per case (shape x config):
  v1     y = grouped_gemm plain(a, w_down)          (launch 1), same KernelConfig
         y_sorted = dispatch._return_nvlink(y)      (ep_transfer, launch 2)
  fused  y_sorted = fused_gemm_return.fused_gemm_return(a, w_down, ...)  (one launch)
a is a random receive-layout activation [R*T*K (padded to block_m), F] per rank
(dead rows random too: both paths load the same blocks). Checks y_sorted
bitwise over all T*K sorted rows (no receive bound: every row is returned),
a second fused launch bitwise (no stale semaphore counts), then times both
(median ms). Writes check_fused_return_gpu_<device>.json to --out (default $OUT)
after every case (the driver: bench/fused_check.py). Exits 1 if any check fails.
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
from pallas_kernels import fused_gemm_return as fgr  # noqa: E402
from pallas_kernels import grouped_gemm as gg  # noqa: E402
from uniep_jax import layout  # noqa: E402
from uniep_jax.dispatch import _return_nvlink  # noqa: E402

# name: (tokens T, top_k K, local experts El, hidden H, ffn F, skew of expert 0)
CASES = {
    "small": (512, 4, 4, 512, 384, 0.0),
    "small-skew": (512, 4, 4, 512, 384, 8.0),
    "mid": (4096, 8, 8, 2048, 1024, 0.0),
    "mid-skew": (4096, 8, 8, 2048, 1024, 4.0),
}


def _fns(mesh, r, t, k, el, kernel, transfer):
  e = r * el

  def v1(a, topk, w_down):
    plan, _ = fused_check.plan_of(topk, e)
    (y,) = gg._row_tiled_call([a], [w_down], plan.recv_group_sizes, mode="plain",
                              transpose_b=False, out_dtype=a.dtype, save_hu=False, config=kernel,
                              interpret=False)                             # [M_p, H]
    return _return_nvlink(y, plan, "expert", el, transfer), plan.num_received[None]

  def fused_fn(a, topk, w_down):
    plan, rank = fused_check.plan_of(topk, e)
    seg = layout.return_segments(plan, rank)
    y = fgr.fused_gemm_return(a, w_down, seg.src_start, seg.dst_start, seg.rows,
                              out_rows=t * k, axis_name="expert", kernel=kernel)
    return y, plan.num_received[None]

  return fused_check.per_rank(v1, mesh, 3), fused_check.per_rank(fused_fn, mesh, 3)


def _inputs(mesh, r, t, k, el, h, f, skew, kernel, seed=0):
  e = r * el
  m_p = gg._round_up(r * t * k, kernel.block_m)
  topk = common.skewed_topk(np.random.default_rng(seed), e, r * t, k, skew)
  ks = jax.random.split(jax.random.key(seed), 2)
  a = jax.random.normal(ks[0], (r * m_p, f)).astype(jnp.bfloat16)        # receive layout per rank
  w_down = (jax.random.normal(ks[1], (e, f, h)) * f**-0.5).astype(jnp.bfloat16)
  sh = NamedSharding(mesh, P("expert"))
  return [jax.device_put(x, sh) for x in (a, jnp.asarray(topk), w_down)]


def _build(mesh, r, case, kernel, transfer):
  t, k, el, h, f, skew = case
  return (*_fns(mesh, r, t, k, el, kernel, transfer), _inputs(mesh, r, t, k, el, h, f, skew, kernel))


def _compare(ya, yb, yc, r) -> dict:
  """ya, yb, yc: (y_sorted, num_received) of v1, fused, fused again."""
  res = dict(num_received=[int(v) for v in np.asarray(ya[1])])
  res["y_bitwise"] = common.same_bits(ya[0], yb[0])
  res["fused_repeat_bitwise"] = common.same_bits(yb[0], yc[0])
  if not res["y_bitwise"]:
    x, y = np.asarray(ya[0]).view(np.uint16), np.asarray(yb[0]).view(np.uint16)
    res["y_bad_rows"] = int(np.sum(np.any(x != y, axis=1)))
  res["ok"] = res["y_bitwise"] and res["fused_repeat_bitwise"]
  return res


def main(argv=None):
  fields = lambda c: dict(T=c[0], K=c[1], El=c[2], H=c[3], F=c[4], skew=c[5])  # noqa: E731
  return fused_check.main(argv, name="check_fused_return_gpu", cases=CASES, case_fields=fields,
                          build=_build, compare=_compare)


if __name__ == "__main__":
  raise SystemExit(main())
