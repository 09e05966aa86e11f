"""EXPERIMENTAL (v2 "Kernel B"): the down-projection GEMM whose epilogue returns rows.

In `moe_ffn` as `UniEPConfig(backend="uniep", fused=FusedConfig(...))` (uniep_jax/fused.py);
bitwise = v1 on 4x H200 (bench/check_fused*_gpu.py small cases); times in NOTES_fused.md
(slower than v1's down GEMM + return). Design and synchronisation: SYNC.md, "Kernel B".
Bring-up on GPUs: `bench/check_fused_return_gpu.py` (bitwise against v1).

Algorithm
---------
One `plgpu.kernel` launch per EP rank (inside `shard_map` over the expert axis,
collective metadata mode), grid = num_sms CTAs ("sm"), 3 warpgroups each ("wg").
It does in one launch what v1 does in two:

  v1:  y = grouped_gemm plain(a, w_down)                       (launch 1)
       y_sorted = ep_transfer.transfer_segments(y -> sources)  (launch 2, `_return_nvlink`)
  v2:  one launch; the epilogue of every GEMM tile TMA-stores its rows straight
       into the SOURCE rank's sorted-row buffer (`plgpu.remote_ref`).

  y = a @ w_down[le] (f32 accumulator, cast once to the input dtype): exactly the
  "plain" mode of `grouped_gemm.py`, because the GEMM IS that body
  (`grouped_gemm._row_tiled_kernel` with its `walk` hook): same block_m-aligned
  loads, same block_k, same reduction order. A row's result depends only on the
  row, its expert's weights and block_k, so cutting tiles differently changes no
  bit: y_sorted is bitwise equal to v1's on every row v1 returns.

Tiling (`return_tile_plan`, plain JAX before the launch)
--------------------------------------------------------
The receive layout [M_p, K] is ordered (local expert le, source s, ...): its
(le, s) blocks are the return segments (`layout.return_segments`, [R, El]:
src_start in the receive layout, dst_start in s's sorted rows, rows). A row tile
is the intersection of ONE (le, s) block with one block_m-aligned row block, so
its rows come from one source and land in a contiguous range of s's sorted rows:

  receive layout   |-- le0,s0 --|-- le0,s1 --|---- le1,s0 ----|- le1,s1 -|...
  block_m blocks   |      0      |      1      |      2      |      3      |
  tiles            |  t  | t' |  t'' |   ...                    (cut at both)

  tile fields: group (= le, selects w_down[le]), load_row (block start), lo, hi
  (receive rows stored), kind (1 compute, 0 list padding; dead rows make no
  tile: nothing is returned for them), dst_row (s's sorted row of receive row lo
  = dst_start + lo - src_start).
Tiles are listed per peer offset j (peer (me + j) mod R), receive-row order
inside j; peer_start[j] = first tile of offset j. Flat int32 plan:
  group[T] | load_row[T] | lo[T] | hi[T] | kind[T] | dst_row[T] | peer_start[R + 1]
  T = cdiv(M_p, block_m) + R * El  (each non-empty segment adds at most one cut).

GEMM CTAs (all num_sms of them), through the `walk` hook of the GEMM body:

  for j in 1, ..., R-1, 0:                     # STATIC (TMA peer id must be host-computable)
    out_remote = remote_ref(out, peer (me + j) mod R)   (j == 0: out itself)
    tiles peer_start[j] ... peer_start[j+1]-1 x column tiles, CTA c takes
      linear indices c, c + num_sms, ... (nd_loop's order on each offset's list):
      pipeline over K (block_k steps), epilogue: [block_m, 64] SMEM slot(s) per
      compute warpgroup (KernelConfig.epilogue_slots) --TMA store ladder (rows
      [lo, hi) only)--> out_remote[dst_row:]
  compute wgs: wait_smem_to_gmem(0); signal returned_sem[c] on every rank
  wg 0: wait returned_sem[c] == 2 R (decrement: one waiter per semaphore)

Buffers
-------
  a      [M_p, K]  input, this rank's receive layout (the gate/up activation;
                   K a multiple of block_k, M_p of block_m). Only live rows are read
                   into results (a tile loads its whole block_m block, as v1).
  w_down [El, F, H] input, F <= K padded with zeros to K.
  out    [Ns, H]   kernel output: this rank's sorted rows, written by PEERS
                   (remote TMA stores) and by itself (j = 0). Rows no peer
                   returns (dropped by a receive bound) are undefined: callers
                   zero them as `dispatch._return_nvlink` does. H must be a
                   multiple of the CTA tile width 2 block_n (no column padding).
  SMEM: the grouped GEMM's stages + epilogue slots (plain mode).
  returned_sem [num_sms]  `pl.get_global` REGULAR semaphores (GMEM scratch).

Synchronisation contract (invariants; see SYNC.md)
--------------------------------------------------
  Launch ordering: `pl.get_global` semaphores are zero-filled by XLA right
      before every launch. Mosaic GPU's cross-device barrier before every
      communicating kernel (skip_device_barrier=False, the default, kept here)
      makes the first remote store or signal safe: every peer has entered this
      launch, so its `out` and zero-filled returned_sem exist. No signal of
      launch L+1 reaches a rank before it has entered launch L+1. Reset: none.
  GEMM barriers (produced/consumed/epilogue slot): those of `grouped_gemm.py`,
      unchanged; the walk only changes which tiles run and where rows go.
  returned_sem[c]: producers the two compute warpgroups of CTA c of EVERY rank,
      once per launch each, after `wait_smem_to_gmem(0)` of all their stores for
      all offsets (a signal orders the NVLink writes issued before it):
          expected(returned_sem[c]) = 2 * R  (on every rank).
      Consumer: warpgroup 0 of CTA c of this rank only (decrement=True, one
      waiter per semaphore). Invariant when it returns: CTA c of every rank has
      finished every store into this rank's `out`. Kernel end (all CTAs past
      their wait) => every returned row has landed; the next XLA op (the
      weighted top-k combine) may read `out`.
  Deadlock freedom: every CTA signals before it waits, and its signal depends
      on nothing remote (the GEMM reads only local a and w_down); all num_sms
      CTAs must be resident at once (1 CTA per SM; other streams leave room).

CPU coverage: the tile plan (numpy, tests/test_fused_gemm_return.py), the whole
kernel body in its local form (`gemm_return_local`: every offset stores into
this device's buffer, no semaphores; interpret mode, race detector, bitwise vs
grouped GEMM + the numpy return permutation) and the LOWERING of the
communicating kernel for CUDA (remote refs and semaphores do not run in the
interpret mode).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from uniep_jax.config import KernelConfig
from uniep_jax.ragged import block_pieces, enumerate_runs

_FIELDS = 6  # group, load_row, lo, hi, kind, dst_row


# ----------------------------------------------------------------------------
# Tile plan (plain JAX, before the launch)
# ----------------------------------------------------------------------------


def num_return_tiles(recv_rows: int, num_peers: int, num_local_experts: int,
                     block_m: int) -> int:
  """T: static bound on the row tiles (see the module doc)."""
  return gg.num_row_tiles(recv_rows, num_peers * num_local_experts, block_m)


def return_tile_plan(seg_src, seg_dst, seg_len, *, rank, recv_rows: int, block_m: int):
  """Row tiles of the down GEMM, cut at (le, s) blocks, listed per peer offset.

  seg_*: [R, El] int32 return segments (`layout.return_segments`) indexed by
  (source s, local expert le): receive rows [seg_src, + seg_len) go to s's
  sorted rows [seg_dst, + seg_len). rank: this rank (may be traced). Returns the
  flat int32 plan [6 * T + R + 1] of the module doc (row j of the per-offset
  lists: peer (rank + j) mod R).
  """
  r, el = seg_len.shape
  t_max = num_return_tiles(recv_rows, r, el, block_m)
  rot = lambda x: jnp.roll(x.astype(jnp.int32), -rank, axis=0)  # noqa: E731  row j: peer rank+j
  src = rot(seg_src).reshape(-1)                                    # [R * El], index j * El + le
  dst = rot(seg_dst).reshape(-1)
  length = jnp.maximum(rot(seg_len).reshape(-1), 0)
  first, pieces = block_pieces(src, length, block_m)                # tiles per segment
  seg, piece, valid = enumerate_runs(pieces, t_max)
  row0 = (first[seg] + piece) * block_m
  lo = jnp.maximum(src[seg], row0)
  hi = jnp.minimum(src[seg] + length[seg], row0 + block_m)
  z = lambda x: jnp.where(valid, x, 0).astype(jnp.int32)  # noqa: E731
  p_end = jnp.cumsum(pieces)
  peer_start = jnp.concatenate([jnp.zeros((1,), jnp.int32), p_end[el - 1::el]])  # [R + 1]
  return jnp.concatenate([z(seg % el), z(row0), z(lo), z(hi),
                          jnp.where(valid, gg._COMPUTE, gg._NONE).astype(jnp.int32),
                          z(dst[seg] + lo - src[seg]), peer_start.astype(jnp.int32)])


# ----------------------------------------------------------------------------
# The kernel
# ----------------------------------------------------------------------------


def _gemm_return_kernel(plan_gmem, a_gmem, w_gmem, out_gmem, *, gemm_kw: dict, num_sms: int,
                        axis_name, num_peers: int):
  """axis_name=None: the local form (every offset stores into this device's
  `out`, no semaphores; runs in the CPU interpret mode)."""
  num_tiles = gemm_kw["num_tiles"]
  n_tiles = gemm_kw["n"] // (gg._NUM_COMPUTE_WGS * gemm_kw["wg_n"])
  dst_field = (_FIELDS - 1) * num_tiles
  peer_start = _FIELDS * num_tiles
  if axis_name is not None:
    me = lax.axis_index(axis_name)
    returned_sem = pl.get_global(plgpu.SemaphoreType.REGULAR((num_sms,)))

  def walk(tile):
    for j in list(range(1, num_peers)) + [0]:   # static: remote peers first, own rows last
      if axis_name is None or j == 0:
        out_ref = out_gmem
      else:
        out_ref = plgpu.remote_ref(out_gmem, {axis_name: lax.rem(me + j, num_peers)})
      first = plan_gmem[peer_start + j]
      count = plan_gmem[peer_start + j + 1] - first

      def run(lin_j, out_ref=out_ref, first=first):
        lin = first * n_tiles + lin_j
        tile(lin, out_gmems=(out_ref,), gmem_row=plan_gmem[dst_field + lin // n_tiles])

      gg._cta_subset_loop(count * n_tiles, 0, num_sms, run)

  gg._row_tiled_kernel(plan_gmem, a_gmem, w_gmem, out_gmem, walk=walk, **gemm_kw)

  if axis_name is not None:
    c = lax.axis_index("sm")
    wg = lax.axis_index("wg")

    @pl.when(wg < gg._NUM_COMPUTE_WGS)
    def _signal():
      plgpu.wait_smem_to_gmem(0)                 # this warpgroup's stores (all offsets) landed
      for p in range(num_peers):
        pl.semaphore_signal(returned_sem.at[c], device_id={axis_name: p})

    @pl.when(wg == 0)
    def _wait():   # invariant on return: CTA c of every rank is done writing into out
      plgpu.semaphore_wait(returned_sem.at[c], gg._NUM_COMPUTE_WGS * num_peers)


# ----------------------------------------------------------------------------
# Validation and launch
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Static:
  """Validated static shape of one launch."""

  num_sms: int
  num_tiles: int
  gemm_kw: dict


def validate(*, recv_rows: int, k: int, ffn: int, hidden: int, num_local_experts: int,
             num_peers: int, dtype, kernel: KernelConfig, smem: int | None = None) -> _Static:
  """All static checks of a launch, with the derived sizes. Raises ValueError
  before anything is traced."""
  smem = device_lib.smem_capacity() if smem is None else smem
  block_m, block_k = kernel.block_m, kernel.block_k
  cta_n = gg._NUM_COMPUTE_WGS * kernel.block_n
  if recv_rows % block_m:
    raise ValueError(f"{recv_rows=} (rows of a) must be a multiple of {block_m=} (the "
                     f"gate/up kernels pad the receive layout to it)")
  if k % block_k:
    raise ValueError(f"{k=} (columns of a) must be divisible by {block_k=}")
  if ffn > k:
    raise ValueError(f"w_down has {ffn=} rows, more than the {k=} columns of a")
  if hidden % cta_n:
    raise ValueError(f"{hidden=} must be divisible by the CTA tile width 2 * block_n = {cta_n} "
                     f"(the epilogue stores straight into the sources' [Ns, H] rows: no "
                     f"column padding)")
  gemm_kw = gg.row_tiled_params(recv_rows, k, hidden, num_peers * num_local_experts,
                                mode="plain", transpose_b=False, out_dtype=dtype, in_dtype=dtype,
                                save_hu=False, config=kernel, smem=smem)
  return _Static(num_sms=device_lib.num_sms(kernel.num_sms), num_tiles=gemm_kw["num_tiles"],
                 gemm_kw=gemm_kw)


def _launch(a, w_down, seg_src, seg_dst, seg_len, *, out_rows: int, rank, axis_name,
            kernel: KernelConfig, interpret):
  m_p, k = a.shape
  el, ffn, hidden = w_down.shape
  num_peers = seg_len.shape[0]
  if w_down.dtype != a.dtype:
    raise ValueError(f"a and w_down must share one dtype, got {a.dtype} and {w_down.dtype}")
  if seg_len.shape != (num_peers, el) or seg_src.shape != seg_len.shape \
     or seg_dst.shape != seg_len.shape:
    raise ValueError(f"segment tables must be [R, El] = [{num_peers}, {el}], got "
                     f"{seg_src.shape}, {seg_dst.shape}, {seg_len.shape}")
  st = validate(recv_rows=m_p, k=k, ffn=ffn, hidden=hidden, num_local_experts=el,
                num_peers=num_peers, dtype=a.dtype, kernel=kernel)
  w_down = gg._pad_axis(w_down, 1, k)
  # A ladder step's TMA box (up to block_m rows) must fit inside out.
  out_p = max(out_rows, kernel.block_m)
  plan = return_tile_plan(seg_src, seg_dst, seg_len, rank=rank, recv_rows=m_p,
                          block_m=kernel.block_m)
  body = functools.partial(_gemm_return_kernel, gemm_kw=st.gemm_kw, num_sms=st.num_sms,
                           axis_name=axis_name, num_peers=num_peers)
  kernel_fn = plgpu.kernel(
      body,
      kernel_name="fused_gemm_return",
      out_type=jax.ShapeDtypeStruct((out_p, hidden), a.dtype),
      grid=(st.num_sms,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret,
  )
  out = kernel_fn(plan, a, w_down)
  return out[:out_rows] if out_p != out_rows else out


def fused_gemm_return(a, w_down, seg_src, seg_dst, seg_len, *, out_rows: int, axis_name: str,
                      kernel: KernelConfig = KernelConfig()):
  """Down GEMM + return in one launch. Inside `shard_map` over `axis_name` (size R).

  a [M_p, K]: this rank's receive layout (gate/up activation; M_p a multiple of
  block_m, K of block_k); w_down [El, F, H] (F <= K, zero-padded to K); seg_*:
  [R, El] return segments (`layout.return_segments(plan, rank)`). Returns this
  rank's sorted rows y [out_rows, H] (out_rows = T*K): row p = a[q] @ w_down[le]
  of the receive row q on the owner that holds p, bitwise as v1 (grouped GEMM
  plain mode + `dispatch._return_nvlink`). Rows no peer returns (dropped by a
  receive bound) are undefined. GPU only (remote refs and semaphores).
  """
  return _launch(a, w_down, seg_src, seg_dst, seg_len, out_rows=out_rows,
                 rank=lax.axis_index(axis_name), axis_name=axis_name, kernel=kernel,
                 interpret=False)


def gemm_return_local(a, w_down, seg_src, seg_dst, seg_len, *, out_rows: int, rank: int = 0,
                      kernel: KernelConfig = KernelConfig(), interpret=None):
  """The kernel in its local form: the same body, but every peer offset's tiles
  store into this device's [out_rows, H] output and there are no semaphores, so
  it runs in the CPU interpret mode. Callers give the peers disjoint windows of
  out (seg_dst). Rows no segment covers are undefined."""
  return _launch(a, w_down, seg_src, seg_dst, seg_len, out_rows=out_rows, rank=rank,
                 axis_name=None, kernel=kernel, interpret=gg.resolve_interpret(interpret))
