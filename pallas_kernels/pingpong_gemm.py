"""EXPERIMENTAL: the row-tiled grouped GEMM with "ping-pong" compute warpgroups.

Why. In `grouped_gemm`'s row-tiled kernel both compute warpgroups share one CTA tile
(block_m x 2 block_n, the same rows): they run their mainloops together, then their
epilogues together, and the tensor cores idle through every epilogue. Measured on one
H200 (bench/epilogue_probe.py, NOTES_grouped_gemm.md): the epilogue is 9-28% of the
short-K launches (qwen3-like da 28%, mixtral-like gate/up 12%, deepseek-like da 17%),
~0.5 / 1.3 / 1.4 ms per FFN forward+backward on qwen3- / mixtral- / deepseek-like.

What. Each compute warpgroup owns whole tiles of block_m x block_n (the CTA's tiles
alternate between them: its j-th tile of the schedule goes to warpgroup j % 2), and
their mainloops take turns: warpgroup w runs its tile's MMAs, hands the turn to the
other, then runs its epilogue while the other's MMAs run. So the tensor cores see the
mainloops back to back and every epilogue is hidden behind the other warpgroup's
mainloop (as long as it is shorter).

Scope (the A/B probe, not yet a backend): mode "plain" (forward and dgrad), no fused
epilogues, no hooks for the fused kernels. Same work list as `grouped_gemm`
(`_row_tile_plan`, group-aligned or block-aligned row tiles), same schedule order
(`_raster` bands over the persistent grid), same epilogue (`_store_epilogue`, the TMA
ladder for partial tiles). A row's result depends only on that row, its group's
weights and block_k (K walked in order, one wgmma per k-step), so the bits equal
`grouped_gemm.gmm`'s (tests/test_pingpong_gemm.py).

Tiling and SMEM (bf16, block_m = block_n = 128, block_k = 64):
  ring w     per compute warpgroup w, `stages` slots of A [block_m, block_k] (16 KiB) and
             B [block_k, block_n] ([block_n, block_k] transposed; 16 KiB), 128B
             swizzle: 3 stages x 32 KiB x 2 rings = 192 KiB
  epilogue   [2 warpgroups, 1 slot, block_m, 64] unswizzled (32 KiB), as in grouped_gemm
Synchronisation (per CTA; every barrier's completions are each waited exactly once, in
order, by one warpgroup, so the implicit phase tracking holds):
  produced[w, s]  arrivals 2 (the A and B TMA of a step): producer the memory
                  warpgroup, consumer compute warpgroup w before that step's wgmma.
  consumed[w, s]  arrivals 1: producer compute warpgroup w once the step's MMAs are
                  done (`wgmma_wait(1)` after the next step's are issued, or the
                  tile's final `wgmma_wait(0)`), consumer the memory warpgroup before it refills
                  slot s of ring w (and, at the end, for the last `stages` steps).
  turn[w]         arrivals 1: producer the other compute warpgroup when its mainloop
                  is done, consumer warpgroup w before each of its mainloops (but
                  warpgroup 0's first). The memory warpgroup issues the steps in
                  schedule order (tile j's steps into ring j % 2), which is the
                  order the turns consume them in: a ring's first `stages` steps of
                  the next tile load while the other ring's tile is still computed.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from uniep_jax.config import KernelConfig


def _stages(config: KernelConfig, itemsize: int, smem: int) -> int:
  ring_stage = 2 * itemsize * (config.block_m * config.block_k + config.block_k * config.block_n)
  epilogue = gg._NUM_COMPUTE_WGS * config.block_m * gg._EPI_N * itemsize
  fit = (smem - gg._SMEM_RESERVE - epilogue) // ring_stage
  stages = min(config.max_concurrent_steps, fit)
  if stages < 1:
    raise ValueError(f"ping-pong tile does not fit in {smem} bytes of shared memory")
  return int(stages)


def _kernel(plan_gmem, a_gmem, b_gmem, out_gmem, *, transpose_b: bool, k: int, n: int,
            num_tiles: int, block_m: int, block_n: int, block_k: int, stages: int,
            load_align: int, raster_rows: int, num_ctas: int):
  n_tiles = n // block_n
  k_iters = k // block_k
  total = num_tiles * n_tiles
  sm = lax.axis_index("sm")
  steps = jnp.maximum(total - sm + num_ctas - 1, 0) // num_ctas   # this CTA's schedule
  a_transforms = gg._swizzle_transforms(a_gmem.dtype, block_k)
  b_transforms = gg._swizzle_transforms(b_gmem.dtype, block_k if transpose_b else block_n)
  b_tile = (block_n, block_k) if transpose_b else (block_k, block_n)

  def tile_of(j):
    lin = gg._raster(sm + j * num_ctas, num_tiles, n_tiles, raster_rows)
    t, nt = lin // n_tiles, lin % n_tiles
    kind = jnp.where(j < steps, plan_gmem[4 * num_tiles + t], gg._NONE)
    return dict(group=plan_gmem[t], load_row=pl.multiple_of(plan_gmem[num_tiles + t], load_align),
                lo=plan_gmem[2 * num_tiles + t], hi=plan_gmem[3 * num_tiles + t], kind=kind,
                nt=nt, k_steps=jnp.where(kind == gg._COMPUTE, k_iters, 0))

  @functools.partial(
      pl.run_scoped,
      a_ring=plgpu.SMEM((gg._NUM_COMPUTE_WGS, stages, block_m, block_k), a_gmem.dtype,
                        transforms=a_transforms),
      b_ring=plgpu.SMEM((gg._NUM_COMPUTE_WGS, stages, *b_tile), b_gmem.dtype,
                        transforms=b_transforms),
      produced=plgpu.Barrier(num_arrivals=2, num_barriers=gg._NUM_COMPUTE_WGS * stages),
      consumed=plgpu.Barrier(num_arrivals=1, num_barriers=gg._NUM_COMPUTE_WGS * stages),
      turn=plgpu.Barrier(num_arrivals=1, num_barriers=gg._NUM_COMPUTE_WGS),
      epi_smem=plgpu.SMEM((gg._NUM_COMPUTE_WGS, 1, block_m, gg._EPI_N), out_gmem.dtype),
      collective_axes="wg",
  )
  def _scope(a_ring, b_ring, produced, consumed, turn, epi_smem):
    wg = lax.axis_index("wg")

    @pl.when(wg == gg._NUM_COMPUTE_WGS)
    def _memory():
      plgpu.set_max_registers(gg._MEMORY_REGISTERS, action="decrease")

      def tile_body(j, counters):
        w = j % 2
        tile = tile_of(j)

        def step(kk, counters):
          c = jnp.where(w == 0, counters[0], counters[1])
          slot = c % stages
          bar = w * stages + slot

          @pl.when(c >= stages)
          def _wait_free():
            plgpu.barrier_wait(consumed.at[bar])

          plgpu.copy_gmem_to_smem(
              a_gmem.at[pl.ds(tile["load_row"], block_m), pl.ds(kk * block_k, block_k)],
              a_ring.at[w, slot], produced.at[bar])
          cols = pl.ds(tile["nt"] * block_n, block_n)
          b_src = (b_gmem.at[tile["group"], cols, pl.ds(kk * block_k, block_k)] if transpose_b
                   else b_gmem.at[tile["group"], pl.ds(kk * block_k, block_k), cols])
          plgpu.copy_gmem_to_smem(b_src, b_ring.at[w, slot], produced.at[bar])
          return (counters[0] + (w == 0).astype(jnp.int32),
                  counters[1] + (w == 1).astype(jnp.int32))

        return lax.fori_loop(0, tile["k_steps"], step, counters)

      counters = lax.fori_loop(0, steps, tile_body, (jnp.int32(0), jnp.int32(0)))
      for w in range(gg._NUM_COMPUTE_WGS):   # the last steps' releases, waited once each
        c_end = counters[w]

        def drain(c, _, w=w):
          plgpu.barrier_wait(consumed.at[w * stages + c % stages])
          return _

        lax.fori_loop(jnp.maximum(c_end - stages, 0), c_end, drain, None)

    @pl.when(wg < gg._NUM_COMPUTE_WGS)
    def _compute():
      plgpu.set_max_registers(
          int(min(256, (512 - gg._MEMORY_REGISTERS) // gg._NUM_COMPUTE_WGS) // 8 * 8),
          action="increase")
      mine = (steps - wg + 1) // 2   # tiles j = wg, wg + 2, ...

      def tile_body(i, c):
        j = 2 * i + wg
        tile = tile_of(j)

        @pl.when((wg == 1) | (i > 0))
        def _wait_turn():
          plgpu.barrier_wait(turn.at[wg])

        def acc_scope(acc):
          # one k-step's MMAs stay in flight: step kk's are issued before step kk - 1's
          # are waited for and its slot released (a single warpgroup keeps the tensor
          # cores busy only if it never drains them between steps)
          def step(kk, c):
            slot = c % stages
            bar = wg * stages + slot
            plgpu.barrier_wait(produced.at[bar])
            b = b_ring.at[wg, slot]
            plgpu.wgmma(acc, a_ring.at[wg, slot], b.T if transpose_b else b)
            plgpu.wgmma_wait(1)

            @pl.when(kk > 0)
            def _release_previous():
              plgpu.barrier_arrive(consumed.at[wg * stages + (c - 1) % stages])
            return c + 1

          c_next = lax.fori_loop(0, tile["k_steps"], step, c)
          # the other warpgroup's MMAs may start: they queue behind this tile's last ones
          plgpu.barrier_arrive(turn.at[1 - wg])
          plgpu.wgmma_wait(0)

          @pl.when(tile["k_steps"] > 0)
          def _release_last():
            plgpu.barrier_arrive(consumed.at[wg * stages + (c_next - 1) % stages])

          @pl.when(tile["kind"] != gg._NONE)
          def _epilogue():
            lo, hi = tile["lo"], tile["hi"]
            gg._store_epilogue([acc[...]], [out_gmem], epi_smem, smem_row=lo - tile["load_row"],
                               gmem_row=lo, count=hi - lo, rows=block_m,
                               col0=tile["nt"] * block_n, ragged=True)
          return c_next

        return pl.run_scoped(acc_scope, plgpu.ACC((block_m, block_n), jnp.float32))

      lax.fori_loop(0, mine, tile_body, jnp.int32(0))
      # every turn handed over is taken: the other warpgroup's last hand-over, if this
      # one had no tile after it (arrivals into turn[wg] minus the waits above)
      theirs = steps - mine
      unseen = jnp.where(wg == 0, theirs - jnp.maximum(mine - 1, 0), theirs - mine)

      @pl.when(unseen > 0)
      def _last_turn():
        plgpu.barrier_wait(turn.at[wg])

      plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def pingpong_gmm(lhs, rhs, group_sizes, *, transpose_b: bool = False, out_dtype=None,
                 config: KernelConfig = KernelConfig(), zero_window=None, interpret=None):
  """`grouped_gemm._row_tiled_call(mode="plain")` by the ping-pong kernel, on operands
  already padded to the tile grid: lhs [M, K]; rhs [G, K, N] (or [G, N, K] with
  transpose_b). Returns [M, N]. Bitwise the same as the row-tiled kernel's."""
  m, k = lhs.shape
  g = rhs.shape[0]
  n = rhs.shape[1] if transpose_b else rhs.shape[2]
  block_m, block_n, block_k = config.block_m, config.block_n, config.block_k
  if k % block_k or n % block_n or m % block_m:
    raise ValueError(f"lhs {lhs.shape} / rhs {rhs.shape} must be padded to the tile grid "
                     f"({block_m}, {block_n}, {block_k})")
  out_dtype = out_dtype or lhs.dtype
  stages = _stages(config, jnp.dtype(lhs.dtype).itemsize, device_lib.HOPPER_SMEM_BYTES)
  aligned = config.group_aligned_tiles
  plan = gg._row_tile_plan(group_sizes, m, block_m, zero_window, group_aligned=aligned)
  raster = config.raster_rows
  if raster is None:
    raster = (gg.RASTER_AUTO_ROWS if k * n * jnp.dtype(lhs.dtype).itemsize
              >= gg.RASTER_AUTO_MIN_BYTES else 1)
  num_ctas = device_lib.num_sms(config.num_sms)
  body = functools.partial(
      _kernel, transpose_b=transpose_b, k=k, n=n, num_tiles=gg.num_row_tiles(m, g, block_m, aligned),
      block_m=block_m, block_n=block_n, block_k=block_k, stages=stages,
      load_align=gg.GROUP_TILE_ALIGN if aligned else block_m, raster_rows=raster,
      num_ctas=num_ctas)
  kernel = plgpu.kernel(
      body,
      kernel_name=f"pingpong_gemm{'_t' if transpose_b else ''}",
      out_type=jax.ShapeDtypeStruct((m, n), out_dtype),
      grid=(num_ctas,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=gg.resolve_interpret(interpret),
  )
  return kernel(plan, lhs, rhs)
