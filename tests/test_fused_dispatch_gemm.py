"""CPU tests of the EXPERIMENTAL fused dispatch + gate/up kernel
(pallas_kernels/fused_dispatch_gemm.py).

What runs here: the chunked work lists (numpy-checked), the transfer role in its
local form and the hooked grouped-GEMM body on a CTA subset (Mosaic GPU
interpret mode, race detector on), the static validation, and the LOWERING of
the whole communicating kernel for the CUDA platform (remote refs and
semaphores do not run in interpret mode; executing it needs GPUs:
`bench/check_fused_gpu.py`).
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import mosaic_gpu as plgpu
from jax.sharding import NamedSharding, PartitionSpec as P
from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks
from jax._src.pallas.mosaic_gpu.interpret import interpret_pallas_call

from pallas_kernels import fused_dispatch_gemm as fdg
from pallas_kernels import grouped_gemm as gg
from uniep_jax import layout
from uniep_jax.config import KernelConfig, TransferConfig
from pallas_testlib import INTERPRET, INTERPRET_RACES, ON_GPU, assert_no_races, fresh_interpret_state  # noqa: F401
from pallas_testlib import skewed_plans

# The work-list builders jitted, the rank traced (as in the kernels' wrappers, where it is
# the axis index): one program per shape instead of an op-by-op dispatch that compiled
# each primitive (~600 small compiles in this file's list tests); integer outputs, exact
_chunk_work_lists = jax.jit(fdg.chunk_work_lists, static_argnames=(
    "src_rows", "item_rows", "recv_chunk_rows", "num_chunks"))


def _dispatch_segments(rng, r, el, t, k, skew):
  """Real dispatch segments of every rank from random (skewed) routing."""
  return [(layout.dispatch_segments(plan, rank), plan)
          for rank, plan in enumerate(skewed_plans(rng, r, el, t, k, skew))]


def _check_work(work, seg_src, seg_dst, seg_len, *, rank, src_rows, item_rows, b, num_chunks,
                live_chunks=None):
  """Every segment row covered exactly once; items inside one chunk; chunk order; the
  deal ranks follow the sender's chunk-major walk; no item past the live chunks."""
  r, el = seg_len.shape
  w = fdg.num_items(src_rows, el, num_chunks, item_rows)
  work = np.asarray(work)
  assert work.shape == (r, fdg.work_row_length(w, num_chunks))
  starts = work[:, 3 * w:3 * w + num_chunks + 1]
  deals = work[:, 3 * w + num_chunks + 1:-1]
  assert np.all(work[:, -1] == (num_chunks if live_chunks is None else live_chunks))
  walked = 0
  for kc in range(num_chunks):
    for j in fdg.transfer_order(r):
      assert deals[j, kc] == walked, (kc, j)
      walked += starts[j, kc + 1] - starts[j, kc]
  for j in range(r):
    assert starts[j, -1] == starts[j, work[j, -1]], "items past the live chunks"
  for j in range(r):
    peer = (rank + j) % r
    src, dst, rows = work[j, :w], work[j, w:2 * w], work[j, 2 * w:3 * w]
    cs = starts[j]
    live = cs[-1]
    assert cs[0] == 0 and np.all(np.diff(cs) >= 0) and live <= w
    assert np.all(rows[:live] >= 1) and np.all(rows[:live] <= item_rows)
    assert np.all(rows[live:] == 0)
    for kc in range(num_chunks):           # items of chunk kc lie in chunk kc
      for it in range(cs[kc], cs[kc + 1]):
        assert kc * b <= dst[it] and dst[it] + rows[it] <= (kc + 1) * b, (j, kc, it)
    got = {}
    for it in range(live):
      for q in range(rows[it]):
        assert dst[it] + q not in got, "destination row written twice"
        got[dst[it] + q] = src[it] + q
    want = {}
    for s, d, n in zip(np.asarray(seg_src[peer]), np.asarray(seg_dst[peer]),
                       np.asarray(seg_len[peer])):
      for q in range(n):
        want[d + q] = s + q
    assert got == want


@pytest.mark.parametrize("r,el,t,k,item_rows,b,skew", [
    (4, 3, 64, 2, 16, 64, 0.0), (2, 4, 96, 4, 32, 128, 5.0), (3, 1, 40, 3, 8, 16, 2.0)])
def test_chunk_work_lists_cover_every_row_once(r, el, t, k, item_rows, b, skew):
  rng = np.random.default_rng(r * 100 + el)
  for rank, (seg, plan) in enumerate(_dispatch_segments(rng, r, el, t, k, skew)):
    src_rows = t * k
    out_rows = plan.recv_valid.shape[0]
    num_chunks = -(-out_rows // b)
    live = layout.max_received_rows(plan)
    live_chunks = min(-(-int(live) // b), num_chunks)
    for bound, want in ((None, None), (live, live_chunks)):
      work = _chunk_work_lists(seg.src_start, seg.dst_start, seg.rows, rank=rank,
                                  src_rows=src_rows, item_rows=item_rows, recv_chunk_rows=b,
                                  num_chunks=num_chunks, live_rows=bound)
      _check_work(work, seg.src_start, seg.dst_start, seg.rows, rank=rank, src_rows=src_rows,
                  item_rows=item_rows, b=b, num_chunks=num_chunks, live_chunks=want)


def test_max_received_rows_is_the_largest_receive_count():
  rng = np.random.default_rng(5)
  plans = skewed_plans(rng, 4, 3, 64, 2, 4.0)
  got = {int(layout.max_received_rows(p)) for p in plans}
  assert got == {max(int(p.num_received) for p in plans)}    # every rank computes the same


def test_round_robin_deal_keeps_every_transfer_cta_busy():
  """Each CTA's share of the sender's walk differs from any other's by at most one
  item, however the items fall into chunks (dealing each (chunk, offset) list from
  CTA 0 gave CTA 0 every chunk's first item)."""
  rng = np.random.default_rng(11)
  r, el, t, k, item_rows, b = 4, 8, 256, 4, 16, 64
  for rank, (seg, plan) in enumerate(_dispatch_segments(rng, r, el, t, k, 2.0)):
    num_chunks = -(-plan.recv_valid.shape[0] // b)
    work = np.asarray(_chunk_work_lists(seg.src_start, seg.dst_start, seg.rows, rank=rank,
                                           src_rows=t * k, item_rows=item_rows,
                                           recv_chunk_rows=b, num_chunks=num_chunks))
    w = fdg.num_items(t * k, el, num_chunks, item_rows)
    starts = work[:, 3 * w:3 * w + num_chunks + 1]
    deals = work[:, 3 * w + num_chunks + 1:-1]
    for n_comm in (3, 16):
      share = np.zeros(n_comm, int)
      for kc in range(num_chunks):
        for j in fdg.transfer_order(r):
          count = starts[j, kc + 1] - starts[j, kc]
          cta_rank = (np.arange(n_comm) - deals[j, kc] % n_comm) % n_comm   # the kernel's
          share += np.maximum(count - cta_rank + n_comm - 1, 0) // n_comm    # move_items steps
      assert share.sum() == starts[:, -1].sum()
      assert share.max() - share.min() <= 1, (n_comm, share)


def test_chunk_work_lists_generic_segments():
  # unordered, empty and chunk-straddling segments (not from a plan)
  seg_src = jnp.array([[30, 0, 10], [50, 45, 70]], jnp.int32)
  seg_dst = jnp.array([[5, 60, 40], [0, 90, 33]], jnp.int32)
  seg_len = jnp.array([[15, 0, 20], [30, 5, 40]], jnp.int32)
  work = _chunk_work_lists(seg_src, seg_dst, seg_len, rank=1, src_rows=110, item_rows=8,
                              recv_chunk_rows=16, num_chunks=7)
  _check_work(work, seg_src, seg_dst, seg_len, rank=1, src_rows=110, item_rows=8, b=16,
              num_chunks=7)


def test_transfer_role_local_form_matches_numpy():
  """The chunked transfer role in a kernel (local form, interpret mode)."""
  rng = np.random.default_rng(7)
  r, el, t, k, h = 3, 2, 24, 2, 128
  (seg, plan), *_ = _dispatch_segments(rng, r, el, t, k, 1.0)
  # The local form lands every peer's rows in ONE buffer: give peer p its own
  # window [p * rows_per_peer, ...) of it (the real layouts of two peers overlap).
  rows_per_peer = plan.recv_valid.shape[0]
  out_rows = r * rows_per_peer
  seg = layout.Segments(src_start=seg.src_start, rows=seg.rows,
                        dst_start=seg.dst_start + rows_per_peer * jnp.arange(r)[:, None])
  x = jax.random.normal(jax.random.key(0), (t * k, h), jnp.float32).astype(jnp.bfloat16)
  cfg = TransferConfig(chunk_rows=8, col_tile=64)
  # live_rows: the whole window buffer (every segment lies below it); 3 CTAs over
  # chunks of few items exercise the round-robin deal
  out = fdg.transfer_chunks_local(x, seg.src_start, seg.dst_start, seg.rows, out_rows=out_rows,
                                  rank=0, transfer=cfg, recv_chunk_rows=32, n_comm=3,
                                  live_rows=int(jnp.max(seg.dst_start + seg.rows)),
                                  interpret=INTERPRET_RACES)
  assert_no_races()
  out, xs = np.asarray(out.astype(jnp.float32)), np.asarray(x.astype(jnp.float32))
  covered = np.zeros(out_rows, bool)
  for s, d, n in zip(*(np.asarray(a).ravel() for a in (seg.src_start, seg.dst_start, seg.rows))):
    np.testing.assert_array_equal(out[d:d + n], xs[s:s + n])
    covered[d:d + n] = True
  assert covered.any()
  if not ON_GPU:   # interpret mode fills unwritten output with NaN
    assert np.isnan(out[~covered]).all()


def _swiglu_reference(m, kdim, n, seed, cfg):
  """(group sizes, x, w_gate_up, the standalone "swiglu" launch's (a, h, u)) over 3 groups
  (one empty, dead rows after the last): what the hooked bodies must reproduce."""
  ks = jax.random.split(jax.random.key(seed), 3)
  gs = jnp.array([100, 0, 170], jnp.int32)                 # empty group, dead rows
  x = jax.random.normal(ks[0], (m, kdim)).astype(jnp.bfloat16)
  w_gate_up = (jax.random.normal(ks[1], (3, kdim, 2 * n)) * kdim**-0.5).astype(jnp.bfloat16)
  ref = gg._row_tiled_call([x], [w_gate_up, w_gate_up], gs, mode="swiglu", transpose_b=False,
                           out_dtype=jnp.bfloat16, save_hu=True, config=cfg, interpret=INTERPRET,
                           b_col_offsets=(0, n))
  return gs, x, w_gate_up, ref


def test_gemm_body_on_cta_subset_with_hook_is_bitwise_equal():
  """The hooks the fused kernels use (CTA subset walk in bands of 2 row tiles, before_tile
  as Kernel A, after_tile as Kernel C) change no bit against the standalone launch's
  row-major walk: 2 column tiles, so the bands reorder the tiles."""
  m, kdim, n, g = 384, 128, 256, 3
  cfg = KernelConfig(num_sms=2, max_concurrent_steps=2)
  gs, x, w_gate_up, ref = _swiglu_reference(m, kdim, n, 3, cfg)
  banded = dataclasses.replace(cfg, raster_rows=2)
  params = gg.row_tiled_params(m, kdim, n, g, mode="swiglu", transpose_b=False,
                               out_dtype=jnp.bfloat16, in_dtype=jnp.bfloat16, save_hu=True,
                               config=banded, b_col_offsets=(0, n))
  assert params["raster_rows"] == 2 and m // cfg.block_m > 2
  offset, count = 1, 2          # CTA 0 idles (stands for a transfer CTA)

  def body(plan_gmem, x_gmem, wg_gmem, wu_gmem, a_gmem, h_gmem, u_gmem):
    @jax.experimental.pallas.when(jax.lax.axis_index("sm") >= offset)
    def _():
      gg._row_tiled_kernel(plan_gmem, x_gmem, wg_gmem, wu_gmem, a_gmem, h_gmem, u_gmem,
                           cta_offset=offset, num_ctas=count,
                           before_tile=lambda load_row: plgpu.commit_smem(),
                           after_tile=lambda lo, hi: plgpu.wait_smem_to_gmem(0), **params)

  kernel = plgpu.kernel(
      body, out_type=tuple(jax.ShapeDtypeStruct((m, n), jnp.bfloat16) for _ in range(3)),
      grid=(offset + count,), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=gg.resolve_interpret(INTERPRET_RACES))
  got = kernel(gg._row_tile_plan(gs, m, cfg.block_m), x, w_gate_up, w_gate_up)
  assert_no_races()
  for a, b in zip(got, ref):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))


def test_dswiglu_body_on_cta_subset_with_hook_is_bitwise_equal():
  """The backward's fused launch runs the "dswiglu" body with the same hooks: no bit
  changes against the standalone launch (empty group, dead rows)."""
  m, kdim, n, g = 384, 128, 256, 3
  ks = jax.random.split(jax.random.key(4), 4)
  gs = jnp.array([100, 0, 170], jnp.int32)
  dy = jax.random.normal(ks[0], (m, kdim)).astype(jnp.bfloat16)
  w_down = (jax.random.normal(ks[1], (g, n, kdim)) * n**-0.5).astype(jnp.bfloat16)
  h = jax.random.normal(ks[2], (m, n)).astype(jnp.bfloat16)
  u = jax.random.normal(ks[3], (m, n)).astype(jnp.bfloat16)
  cfg = KernelConfig(num_sms=2, max_concurrent_steps=2)
  (ref,) = gg._row_tiled_call([dy], [w_down], gs, mode="dswiglu", transpose_b=True,
                              out_dtype=jnp.bfloat16, save_hu=False, config=cfg,
                              interpret=INTERPRET, epi_inputs=(h, u))
  st = fdg.validate(out_rows=m, hidden=kdim, ffn=n, num_local_experts=g, dtype=jnp.bfloat16,
                    kernel=cfg, transfer=TransferConfig(), mode="dswiglu",
                    fused=fdg.FusedConfig(n_comm=1, recv_chunk_rows=128), smem=227 * 1024)
  assert (st.m_p, st.f_p) == (m, n)
  offset, count = 1, 2

  def body(plan_gmem, dy_gmem, wd_gmem, h_gmem, u_gmem, dhu_gmem):
    @jax.experimental.pallas.when(jax.lax.axis_index("sm") >= offset)
    def _():
      gg._row_tiled_kernel(plan_gmem, dy_gmem, wd_gmem, h_gmem, u_gmem, dhu_gmem,
                           cta_offset=offset, num_ctas=count,
                           before_tile=lambda load_row: plgpu.commit_smem(), **st.gemm_kw)

  kernel = plgpu.kernel(
      body, out_type=jax.ShapeDtypeStruct((m, 2 * n), jnp.bfloat16),
      grid=(offset + count,), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=gg.resolve_interpret(INTERPRET_RACES))
  got = kernel(gg._row_tile_plan(gs, m, cfg.block_m), dy, w_down, h, u)
  assert_no_races()
  np.testing.assert_array_equal(np.asarray(got).view(np.uint16), np.asarray(ref).view(np.uint16))


def _lower_fused_dswiglu(mesh, r, kernel, transfer, fused, ns=256, h=256, f=192, el=2):
  st = fdg.validate(out_rows=r * ns, hidden=h, ffn=f, num_local_experts=el, dtype=jnp.bfloat16,
                    kernel=kernel, transfer=transfer, fused=fused, mode="dswiglu")
  return _lower_launch(fdg.fused_dispatch_dswiglu, mesh, r, kernel, transfer, fused, ns, h, el,
                       [(el, f, h), (st.m_p, st.f_p), (st.m_p, st.f_p)])   # w_down, h, u


def test_fused_backward_kernel_lowers_for_cuda(mesh_factory):
  """The backward's fused launch (dy dispatch + da with the dswiglu epilogue) lowers to
  a Mosaic GPU custom call for CUDA on a CPU-only machine (runs: GPU sweep)."""
  r = 4
  lowered = _lower_fused_dswiglu(mesh_factory(1, r), r,
                                 KernelConfig(num_sms=8, max_concurrent_steps=2),
                                 TransferConfig(chunk_rows=64),
                                 fdg.FusedConfig(n_comm=3, recv_chunk_rows=256, backward=True))
  assert "mosaic_gpu" in lowered.as_text()


def test_fused_backward_checks_its_operands():
  kw = dict(out_rows=512, axis_name="expert", kernel=KernelConfig(num_sms=8),
            fused=fdg.FusedConfig(n_comm=3, recv_chunk_rows=256))
  dy = jnp.zeros((128, 256), jnp.bfloat16)
  seg = jnp.zeros((2, 2), jnp.int32)
  gs = jnp.zeros((2,), jnp.int32)
  hu = jnp.zeros((512, 256), jnp.bfloat16)
  with pytest.raises(ValueError, match=r"w_down \(2, 192, 128\) must be \[El=2, F, H=256\]"):
    fdg.fused_dispatch_dswiglu(dy, seg, seg, seg, gs, jnp.zeros((2, 192, 128), jnp.bfloat16),
                               hu, hu, **kw)
  with pytest.raises(ValueError, match=r"h \(512, 192\) and u .* must be \[M_p, F_p\]"):
    fdg.fused_dispatch_dswiglu(dy, seg, seg, seg, gs, jnp.zeros((2, 192, 256), jnp.bfloat16),
                               hu[:, :192], hu, **kw)


def _lower_launch(launch, mesh, r, kernel, transfer, fused, ns, h, el, operands):
  """Lowers one fused launch for CUDA inside a shard_map over `r` ranks: `launch(rows,
  segments, group sizes, *operands)`, operands bf16 of the per-rank `operands` shapes."""
  def body(x, s, d, l, gs, *ops):
    return launch(x, s[0], d[0], l[0], gs[0], *ops, out_rows=r * ns, axis_name="expert",
                  kernel=kernel, transfer=transfer, fused=fused)
  fn = jax.shard_map(body, mesh=mesh, in_specs=(P("expert"),) * (5 + len(operands)),
                     out_specs=P("expert"), check_vma=False)
  sh = NamedSharding(mesh, P("expert"))
  s = lambda shape, dt=jnp.int32: jax.ShapeDtypeStruct(shape, dt, sharding=sh)  # noqa: E731
  args = (s((r * ns, h), jnp.bfloat16), s((r, r, el)), s((r, r, el)), s((r, r, el)),
          s((r, el))) + tuple(s((r * a, *rest), jnp.bfloat16) for a, *rest in operands)
  return jax.jit(fn).trace(*args).lower(lowering_platforms=("cuda",))


def _lower_fused(mesh, r, kernel, transfer, fused, ns=256, h=256, f=192, el=2):
  return _lower_launch(fdg.fused_dispatch_gate_up, mesh, r, kernel, transfer, fused, ns, h, el,
                       [(el, h, 2 * f)])   # w_gate_up


def test_fused_kernel_lowers_for_cuda(mesh_factory):
  """The communicating kernel (remote refs, semaphores, both roles) lowers to a
  Mosaic GPU custom call for CUDA on a CPU-only machine (runs: GPU script)."""
  r = 4
  mesh = mesh_factory(1, r)
  lowered = _lower_fused(mesh, r, KernelConfig(num_sms=8, max_concurrent_steps=2),
                         TransferConfig(chunk_rows=64), fdg.FusedConfig(n_comm=3,
                                                                        recv_chunk_rows=256))
  assert "mosaic_gpu" in lowered.as_text()
  # the fused kernel keeps Mosaic GPU's pre-launch cross-device barrier (SYNC.md)
  assert plgpu.CompilerParams().skip_device_barrier is False


@pytest.mark.parametrize("kw,match", [
    (dict(fused=fdg.FusedConfig(recv_chunk_rows=200)), "multiple of block_m"),
    (dict(fused=fdg.FusedConfig(n_comm=8)), "n_comm=8 must be < num_sms=8"),
    (dict(kernel=KernelConfig(num_sms=8, block_m=256, block_n=256, block_k=256)),
     "does not fit in"),
    (dict(transfer=TransferConfig(chunk_rows=8192)), "no column tile fits"),
    (dict(hidden=200), "divisible by block_k"),
])
def test_static_validation_errors(kw, match):
  args = dict(out_rows=1024, hidden=256, ffn=192, num_local_experts=2, dtype=jnp.bfloat16,
              kernel=KernelConfig(num_sms=8), transfer=TransferConfig(),
              fused=fdg.FusedConfig(n_comm=3, recv_chunk_rows=256), smem=227 * 1024)
  args.update(kw)
  with pytest.raises(ValueError, match=match):
    fdg.validate(**args)


def test_valid_point_sizes():
  st = fdg.validate(out_rows=1000, hidden=256, ffn=192, num_local_experts=2, dtype=jnp.bfloat16,
                    kernel=KernelConfig(num_sms=8), transfer=TransferConfig(),
                    fused=fdg.FusedConfig(n_comm=3, recv_chunk_rows=256), smem=227 * 1024)
  assert (st.m_p, st.f_p, st.num_chunks, st.num_sms, st.col_tile) == (1024, 256, 4, 8, 256)
  with pytest.raises(ValueError, match="n_comm"):
    fdg.FusedConfig(n_comm=0)


def test_kernel_c_source_chunked_work_lists_and_signal_counts():
  """Kernel C (pallas_kernels/down_gemm_return.py): the return's items cut and ordered
  by the SOURCE's chunks (every segment row once, each item inside one source chunk),
  and expected[k] = 2 x column tiles x the running row tiles of chunk k."""
  from pallas_kernels import down_gemm_return as dgr
  rng = np.random.default_rng(17)
  r, el, t, k, item_rows, b, block_m = 4, 3, 64, 2, 16, 64, 32
  spanning = 0   # group-aligned tiles whose rows span two chunks
  for rank, plan in enumerate(skewed_plans(rng, r, el, t, k, 3.0)):
    seg = layout.return_segments(plan, rank)
    recv_rows = plan.recv_valid.shape[0]
    num_chunks = -(-recv_rows // b)
    rows = max(recv_rows, t * k)
    work = np.asarray(jax.jit(dgr.source_chunk_work_lists, static_argnames=(
        "rows", "item_rows", "chunk_rows", "num_chunks"))(
        seg.src_start, seg.dst_start, seg.rows, rank=rank, rows=rows, item_rows=item_rows,
        chunk_rows=b, num_chunks=num_chunks, live_rows=plan.num_received))
    w = fdg.num_items(rows, el, num_chunks, item_rows)
    starts = work[:, 3 * w:3 * w + num_chunks + 1]
    assert np.all(work[:, -1] == -(-int(plan.num_received) // b))
    for j in range(r):
      peer = (rank + j) % r
      src, dst, n = work[j, :w], work[j, w:2 * w], work[j, 2 * w:3 * w]
      got = {}
      for kc in range(num_chunks):
        for it in range(starts[j, kc], starts[j, kc + 1]):
          assert kc * b <= src[it] and src[it] + n[it] <= (kc + 1) * b
          for q in range(n[it]):
            got[int(dst[it]) + q] = int(src[it]) + q
      want = {int(d) + q: int(s) + q for s, d, m in zip(np.asarray(seg.src_start[peer]),
                                                        np.asarray(seg.dst_start[peer]),
                                                        np.asarray(seg.rows[peer]))
              for q in range(m)}
      assert got == want
    m_p = -(-recv_rows // block_m) * block_m
    for group_aligned in (False, True):   # KernelConfig.group_aligned_tiles
      tile_plan = gg._row_tile_plan(plan.recv_group_sizes, m_p, block_m, zero_window=16,
                                    group_aligned=group_aligned)
      nt = gg.num_row_tiles(m_p, el, block_m, group_aligned)
      expected = np.asarray(dgr.chunk_signals(tile_plan, num_tiles=nt, n_tiles=3,
                                              chunk_rows=b, num_chunks=num_chunks))
      tp = np.asarray(tile_plan).reshape(5, nt)
      want = np.zeros(num_chunks, int)
      covered = np.zeros(m_p, bool)
      for lo, hi, kind in zip(tp[2], tp[3], tp[4]):
        if kind != gg._NONE:   # one signal per chunk its rows touch, per warpgroup and column tile
          for kc in sorted({lo // b, (hi - 1) // b}):
            want[kc] += 2 * 3
          spanning += lo // b != (hi - 1) // b
          covered[lo:hi] = True
      np.testing.assert_array_equal(expected, want)
      live_chunks = -(-int(plan.num_received) // b)
      assert np.all(expected[:live_chunks] > 0)    # every live chunk has tiles to wait for
      assert covered[:int(plan.num_received)].all()  # and they store every live row
  assert spanning > 0


@pytest.mark.parametrize("recv_rows,block_m,b", [(None, 32, 64), (200, 32, 64), (256, 16, 32)])
def test_every_compute_tile_waits_on_a_live_chunk(recv_rows, block_m, b):
  """Kernel A's deadlock invariant: the chunk of every COMPUTE tile of every rank (the
  only tiles that wait) is < live_chunks = cdiv(max_received_rows, B), the chunks every
  rank signals; with and without a receive bound, ranks receiving nothing included."""
  rng = np.random.default_rng(23)
  r, el, t, k = 4, 3, 64, 2
  plans = skewed_plans(rng, r, el, t, k, 6.0, recv_rows=recv_rows)
  live = {int(layout.max_received_rows(p)) for p in plans}
  assert len(live) == 1                          # the same on every rank
  live_chunks = -(-live.pop() // b)
  assert live_chunks <= -(-plans[0].recv_valid.shape[0] // b)
  for plan in plans:
    m_p = -(-plan.recv_valid.shape[0] // block_m) * block_m
    nt = gg.num_row_tiles(m_p, el, block_m)
    tp = np.asarray(gg._row_tile_plan(plan.recv_group_sizes, m_p, block_m,
                                      zero_window=64)).reshape(5, nt)
    compute = tp[4] == gg._COMPUTE
    assert np.all(tp[1][compute] // b < live_chunks)
    assert int(plan.num_received) <= live_chunks * b


def test_max_received_rows_within_a_receive_bound():
  rng = np.random.default_rng(29)
  plans = skewed_plans(rng, 4, 3, 64, 2, 8.0, recv_rows=96)
  got = {int(layout.max_received_rows(p)) for p in plans}
  assert got == {max(int(p.num_received) for p in plans)} and got.pop() <= 96


def test_gemm_body_reads_a_3d_lhs_view_bitwise():
  """lhs_col_tile (Kernel D's receive layout as [rows, H / ct, ct] boxes): the squeezed
  [block_m, 1, block_k] blocks of the 3-D view give the 2-D launch's bits."""
  m, kdim, n, g, ct = 384, 256, 256, 3, 128
  cfg = KernelConfig(num_sms=2, max_concurrent_steps=2)
  gs, x, w_gate_up, ref = _swiglu_reference(m, kdim, n, 5, cfg)
  params = gg.row_tiled_params(m, kdim, n, g, mode="swiglu", transpose_b=False,
                               out_dtype=jnp.bfloat16, in_dtype=jnp.bfloat16, save_hu=True,
                               config=cfg, b_col_offsets=(0, n))

  def body(plan_gmem, x_gmem, wg_gmem, wu_gmem, a_gmem, h_gmem, u_gmem):
    gg._row_tiled_kernel(plan_gmem, x_gmem, wg_gmem, wu_gmem, a_gmem, h_gmem, u_gmem,
                         lhs_col_tile=ct, **params)

  kernel = plgpu.kernel(
      body, out_type=tuple(jax.ShapeDtypeStruct((m, n), jnp.bfloat16) for _ in range(3)),
      grid=(2,), grid_names=("sm",), num_threads=3, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=gg.resolve_interpret(INTERPRET))
  got = kernel(gg._row_tile_plan(gs, m, cfg.block_m), x.reshape(m, kdim // ct, ct), w_gate_up,
               w_gate_up)
  for a, b in zip(got, ref):
    np.testing.assert_array_equal(np.asarray(a).view(np.uint16), np.asarray(b).view(np.uint16))
  with pytest.raises(ValueError, match="lhs_col_tile=96 must be a multiple of block_k=64"):
    gg._row_tiled_kernel(None, lhs_col_tile=96, **params)
