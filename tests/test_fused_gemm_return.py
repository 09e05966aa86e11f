"""CPU tests of the EXPERIMENTAL fused down GEMM + return kernel
(pallas_kernels/fused_gemm_return.py, v2 "Kernel B").

What runs here: the tile plan (numpy-checked against `layout.return_segments`),
the whole kernel body in its local form (Mosaic GPU interpret mode, race
detector on; bitwise vs the grouped GEMM's plain mode + the return permutation
in numpy), the static validation, and the LOWERING of the communicating kernel
for the CUDA platform (remote refs and semaphores do not run in interpret mode;
executing it needs GPUs: `bench/check_fused_return_gpu.py`).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from pallas_kernels import fused_gemm_return as fgr
from pallas_kernels import grouped_gemm as gg
from uniep_jax import layout
from uniep_jax.config import KernelConfig
from pallas_testlib import INTERPRET, INTERPRET_RACES, ON_GPU, assert_no_races, fresh_interpret_state  # noqa: F401
from pallas_testlib import skewed_plans



def _check_plan(plan_flat, seg, *, rank, recv_rows, block_m):
  """Every returned row exactly once, no tile crosses a (le, s) block or a
  block_m block, tiles grouped by peer offset, dst rows as the segments say."""
  r, el = seg.rows.shape
  t_max = fgr.num_return_tiles(recv_rows, r, el, block_m)
  plan = np.asarray(plan_flat)
  assert plan.shape == (6 * t_max + r + 1,)
  group, load_row, lo, hi, kind, dst = plan[:6 * t_max].reshape(6, t_max)
  peer_start = plan[6 * t_max:]
  live = peer_start[-1]
  assert peer_start[0] == 0 and np.all(np.diff(peer_start) >= 0) and live <= t_max
  assert np.all(kind[:live] == gg._COMPUTE) and np.all(kind[live:] == gg._NONE)
  assert np.all(hi[live:] == lo[live:])                       # padding stores nothing
  s_src, s_dst, s_len = (np.asarray(x) for x in (seg.src_start, seg.dst_start, seg.rows))
  want = {}                                                   # receive row -> (peer, le, dst)
  for s in range(r):
    for le in range(el):
      for q in range(s_len[s, le]):
        want[s_src[s, le] + q] = (s, le, s_dst[s, le] + q)
  got = {}
  for j in range(r):
    peer = (rank + j) % r
    for ti in range(peer_start[j], peer_start[j + 1]):
      assert load_row[ti] % block_m == 0
      assert load_row[ti] <= lo[ti] < hi[ti] <= load_row[ti] + block_m <= recv_rows
      for q in range(lo[ti], hi[ti]):
        assert q not in got, "receive row stored twice"
        got[q] = (peer, group[ti], dst[ti] + q - lo[ti])
  assert got == want        # also: one (peer, le) per tile, since every row matches


_return_tile_plan = jax.jit(fgr.return_tile_plan, static_argnames=("recv_rows", "block_m"))


@pytest.mark.parametrize("r,el,t,k,block_m,skew,bound", [
    (4, 3, 64, 2, 64, 0.0, None), (2, 4, 96, 4, 128, 5.0, None), (3, 1, 40, 3, 16, 2.0, None),
    (4, 2, 48, 2, 32, 6.0, 200)])
def test_return_tile_plan_matches_return_segments(r, el, t, k, block_m, skew, bound):
  rng = np.random.default_rng(r * 10 + el)
  for rank, plan in enumerate(skewed_plans(rng, r, el, t, k, skew, recv_rows=bound)):
    seg = layout.return_segments(plan, rank)
    recv_rows = gg._round_up(plan.recv_valid.shape[0], block_m)
    # jitted, the rank traced (as in the kernel's wrapper): one program per shape, not an
    # op-by-op dispatch; test_return_tile_plan_traced_rank checks it equals the static rank's
    flat = _return_tile_plan(seg.src_start, seg.dst_start, seg.rows, rank=rank,
                             recv_rows=recv_rows, block_m=block_m)
    _check_plan(flat, seg, rank=rank, recv_rows=recv_rows, block_m=block_m)


def test_return_tile_plan_traced_rank():
  rng = np.random.default_rng(1)
  plans = skewed_plans(rng, 3, 2, 32, 2, 1.0)
  seg = layout.return_segments(plans[2], 2)
  f = jax.jit(lambda rk: fgr.return_tile_plan(seg.src_start, seg.dst_start, seg.rows, rank=rk,
                                              recv_rows=192, block_m=64))
  np.testing.assert_array_equal(f(jnp.int32(2)), fgr.return_tile_plan(
      seg.src_start, seg.dst_start, seg.rows, rank=2, recv_rows=192, block_m=64))


def test_local_form_is_bitwise_grouped_gemm_plus_return():
  """The kernel body (walk hook, per-offset lists, dst-row epilogue) in its local
  form equals the unfused path: grouped GEMM plain mode, then the v1 return
  permutation, bitwise; no row written twice (race detector)."""
  rng = np.random.default_rng(5)
  r, el, t, k, f, h = 3, 2, 24, 2, 128, 256
  rank = 1
  plan = skewed_plans(rng, r, el, t, k, 1.5)[rank]
  seg = layout.return_segments(plan, rank)
  cfg = KernelConfig(num_sms=2, max_concurrent_steps=2, block_m=64)
  m_p = gg._round_up(plan.recv_valid.shape[0], cfg.block_m)
  ks = jax.random.split(jax.random.key(0), 2)
  a = jax.random.normal(ks[0], (m_p, f)).astype(jnp.bfloat16)
  w_down = (jax.random.normal(ks[1], (el, f, h)) * f**-0.5).astype(jnp.bfloat16)
  # Local form: ONE buffer; source s gets its own window [s * t * k, ...) of it.
  window = t * k
  out_rows = r * window
  got = fgr.gemm_return_local(a, w_down, seg.src_start,
                              seg.dst_start + window * jnp.arange(r)[:, None], seg.rows,
                              out_rows=out_rows, rank=rank, kernel=cfg, interpret=INTERPRET_RACES)
  assert_no_races()
  (y,) = gg._row_tiled_call([a], [w_down], plan.recv_group_sizes, mode="plain",
                            transpose_b=False, out_dtype=jnp.bfloat16, save_hu=False,
                            config=cfg, interpret=INTERPRET)
  got16 = np.asarray(got).view(np.uint16)
  y16 = np.asarray(y).view(np.uint16)
  covered = np.zeros(out_rows, bool)
  s_src, s_dst, s_len = (np.asarray(x) for x in (seg.src_start, seg.dst_start, seg.rows))
  for s in range(r):
    for le in range(el):
      d = s * window + s_dst[s, le]
      n = s_len[s, le]
      np.testing.assert_array_equal(got16[d:d + n], y16[s_src[s, le]:s_src[s, le] + n])
      covered[d:d + n] = True
  assert covered.sum() == int(plan.num_received)
  if not ON_GPU:   # interpret mode fills unwritten output with NaN
    assert np.isnan(np.asarray(got.astype(jnp.float32))[~covered]).all()


def _lower(mesh, r, kernel, t=64, k=2, el=2, f=192, h=256):
  m_p = gg._round_up(r * t * k, kernel.block_m)

  def body(a, s, d, n, w):
    return fgr.fused_gemm_return(a, w, s[0], d[0], n[0], out_rows=t * k, axis_name="expert",
                                 kernel=kernel)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * 5, out_specs=P("expert"),
                     check_vma=False)
  sh = NamedSharding(mesh, P("expert"))
  s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  args = (s((r * m_p, 256), jnp.bfloat16), s((r, r, el)), s((r, r, el)), s((r, r, el)),
          s((r * el, f, h), jnp.bfloat16))
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def test_fused_kernel_lowers_for_cuda(mesh_factory):
  """The communicating kernel (remote-ref epilogue, semaphores) lowers to a
  Mosaic GPU custom call for CUDA on a CPU-only machine (runs: GPU script)."""
  r = 4
  lowered = _lower(mesh_factory(1, r), r, KernelConfig(num_sms=8, max_concurrent_steps=2))
  assert "mosaic_gpu" in lowered.as_text()
  assert plgpu.CompilerParams().skip_device_barrier is False   # SYNC.md: keep the barrier


@pytest.mark.parametrize("kw,match", [
    (dict(recv_rows=1000), "multiple of block_m"),
    (dict(k=200), "divisible by block_k"),
    (dict(ffn=512), "more than the k=256"),
    (dict(hidden=384), "CTA tile width"),
    (dict(kernel=KernelConfig(num_sms=8, block_m=256, block_n=256, block_k=256)),
     "does not fit in"),
])
def test_static_validation_errors(kw, match):
  args = dict(recv_rows=1024, k=256, ffn=192, hidden=512, num_local_experts=2, num_peers=4,
              dtype=jnp.bfloat16, kernel=KernelConfig(num_sms=8), smem=227 * 1024)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    fgr.validate(**args)


def test_valid_point_sizes():
  st = fgr.validate(recv_rows=1024, k=256, ffn=192, hidden=512, num_local_experts=2,
                    num_peers=4, dtype=jnp.bfloat16, kernel=KernelConfig(num_sms=8),
                    smem=227 * 1024)
  assert (st.num_sms, st.num_tiles) == (8, 1024 // 128 + 8)
  assert st.gemm_kw["mode"] == "plain"


def test_dtype_mismatch_raises():
  with pytest.raises(ValueError, match="share one dtype"):
    fgr.gemm_return_local(jnp.zeros((128, 64), jnp.bfloat16), jnp.zeros((1, 64, 256), jnp.float32),
                          *(jnp.zeros((1, 1), jnp.int32),) * 3, out_rows=128)
