"""The down GEMM with the return of finished chunks beside it, in one launch.

In `moe_ffn` as the "uniep" backend's overlap point
`UniEPConfig(overlap=OverlapConfig(down_return_ctas=N))` (uniep_jax/overlap.py). Without
it the forward's tail is two launches:

  y = grouped_gemm plain(a, w_down)                       (launch 1)
  y_sorted = ep_transfer.transfer_segments(y -> sources)   (launch 2)

Here one launch computes y and pushes chunk k of it to the sources as soon as every
tile of chunk k is stored, while the GEMM CTAs compute later chunks.

Roles (by CTA index c on "sm", grid = num_sms, 3 warpgroups each)
------------------------------------------------------------------
  c >= n_comm   GEMM CTAs: `grouped_gemm._row_tiled_kernel`, mode "plain" (the down
                GEMM's own body, same tile plan and block_k, so y has its bits) on CTAs
                [n_comm, num_sms); after each tile's epilogue stores, each compute
                warpgroup waits for its stores and signals done[k] (local) for the
                chunk k of its rows [lo, hi) (k = lo // B; a tile's rows may span two
                chunks: then it signals both).
  c <  n_comm   transfer CTAs, warpgroup 0:
                  for k in range(own_live_chunks):          # dynamic
                    wait done[k] >= expected[k]              (no decrement: many waiters)
                    for j in 1, ..., R-1, 0:                 # STATIC peer offsets
                      this CTA's items of (k, j), dealt round robin over the walk:
                        GMEM y --TMA load--> SMEM stage --TMA store ladder--> peer y_sorted
                  wait_smem_to_gmem(0); signal done_sem[c] on every rank; wait R

Chunks and work lists
---------------------
y (this rank's receive layout) is cut into C = cdiv(M_p, B) chunks of B = chunk_rows
rows (a multiple of block_m: a row tile lies in at most two chunks). The return
segments (receive rows -> the sources' sorted rows) are cut at the SOURCE's (this
rank's) chunk boundaries (`source_chunk_work_lists`: `chunk_work_lists` with the roles
of the two row columns swapped). Items are dealt round robin over the whole walk
(chunk-major, peer offsets in `transfer_order` inside a chunk), so every transfer CTA
has work whatever a chunk holds. expected[k] = 2 x n_tiles x (row tiles of the plan
that run, compute or zero, with rows in chunk k), the signals of chunk k's tiles
(`chunk_signals`). own_live_chunks = cdiv(rows this rank received, B): later chunks
return nothing.

Buffers
-------
  a [M_p, K], w_down [El, K, H]   the GEMM's operands (as the down GEMM's)
  y [M_p, H]                      output (local; the transfer's source)
  y_sorted [out_rows, H]          output; PEERS write into it. Rows no peer returns
                                  (dropped by a receive bound) are undefined.
  SMEM: the transfer role's 2 stages and the GEMM's pipeline + epilogue, `run_scoped`
  in sibling branches; each must fit alone.
  done [C] (local), done_sem [n_comm] (cross-rank): `pl.get_global` REGULAR semaphores.

Synchronisation contract
------------------------
  Launch ordering: as every communicating kernel here, Mosaic GPU's cross-device
      barrier before the launch (skip_device_barrier=False, kept): every peer has
      entered the launch (its y_sorted exists, its semaphores are zero-filled) before
      any remote store.
  done[k]: producers the GEMM CTAs' compute warpgroups, one signal per warpgroup per
      tile of chunk k, each after `wait_smem_to_gmem(0)` (its stores of that tile are
      complete). Consumers: transfer CTAs, `decrement=False`. Invariant when the wait
      returns: every row of chunk k that a running tile covers (every live row) is
      written; rows past the dead-row window are never written (and never sent).
  Open point: the transfer reads chunk k with TMA loads (async proxy) after an acquire
      in the generic proxy (`fence.acquire.sys` in the semaphore wait), with no proxy
      fence between them; bench/check_moe_gpu.py's bitwise comparison with the
      two-launch form is what tests that this ordering suffices.
  done_sem[c]: as ep_transfer's (one waiter each): when every transfer CTA is past its
      wait, every peer's writes into this rank's y_sorted have landed.
  Deadlock freedom: GEMM CTAs never wait; transfer CTAs wait only on local GEMM tiles
      (which always complete) and on peers' transfer CTAs (which only wait on their
      own GEMM tiles). All num_sms CTAs must be resident at once (1 CTA per SM).
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels import ep_transfer
from pallas_kernels import grouped_gemm as gg
from pallas_kernels.ep_transfer import TransferConfig
from pallas_kernels.grouped_gemm import KernelConfig
from pallas_kernels.ragged import SEARCH_METHOD, block_pieces, enumerate_runs


# ----------------------------------------------------------------------------
# Work lists (plain JAX, before the launch)
# ----------------------------------------------------------------------------


def num_items(src_rows: int, num_local_experts: int, num_chunks: int, item_rows: int) -> int:
  """W: static bound on the items of one peer offset (see the module doc)."""
  return -(-src_rows // item_rows) + num_local_experts + num_chunks


def transfer_order(num_peers: int) -> list:
  """The static order in which a transfer CTA visits the peer offsets inside a chunk:
  remote peers first, its own rows last."""
  return list(range(1, num_peers)) + [0]


def work_row_length(w: int, num_chunks: int) -> int:
  """Entries of one peer offset's row of the work table (see `chunk_work_lists`)."""
  return 3 * w + 2 * num_chunks + 2


def chunk_work_lists(seg_src, seg_dst, seg_len, *, rank, src_rows: int, item_rows: int,
                     chunk_rows: int, num_chunks: int, live_rows=None):
  """Per peer offset j (row j: peer (rank + j) mod R), the items in chunk order.

  seg_*: [R, El] int32 indexed by (peer, local expert); segment e of peer p
  copies src[seg_src : + seg_len] to peer p's recv[seg_dst : + seg_len].
  live_rows: the most live receive-layout rows any rank has (the same value on every
  rank, from the count matrix; None: all C chunks). Returns int32
  [R, 3 * W + 2 * C + 2] (`work_row_length`):
    src_row[W], dst_row[W], rows[W]   the items, chunk by chunk
    chunk_start[C + 1]                items of destination chunk k are
                                      [chunk_start[k], chunk_start[k + 1]); no item
                                      crosses a chunk boundary; chunk_start[C] = live
                                      item count
    deal_start[C]                     the rank of item chunk_start[k] in the sender's
                                      whole walk (chunk-major, peer offsets in
                                      `transfer_order` inside a chunk): items are dealt
                                      to the transfer CTAs round robin over that walk,
                                      so every CTA has work whatever a chunk holds
    live_chunks[1]                    cdiv(live_rows, B): chunks any rank can wait on
  """
  _, el = seg_len.shape
  b = chunk_rows
  w = num_items(src_rows, el, num_chunks, item_rows)
  num_pieces = el + num_chunks
  rot = lambda a: jnp.roll(a.astype(jnp.int32), -rank, axis=0)  # noqa: E731  row j: peer rank+j
  seg_src, seg_dst, seg_len = rot(seg_src), rot(seg_dst), rot(seg_len)

  def one(src, dst, length):                                        # [El] each
    # segments -> pieces cut at destination chunk boundaries
    first, pieces = block_pieces(dst, length, b)                    # [El]
    seg, piece, p_valid = enumerate_runs(pieces, num_pieces)
    p_chunk = first[seg] + piece                                    # [P]
    d_lo = jnp.maximum(dst[seg], p_chunk * b)
    d_hi = jnp.minimum(dst[seg] + length[seg], (p_chunk + 1) * b)
    p_len = jnp.where(p_valid, d_hi - d_lo, 0)
    s_lo = src[seg] + (d_lo - dst[seg])
    # pieces -> items of at most item_rows rows
    items = (p_len + item_rows - 1) // item_rows                    # [P]
    pc, jj, i_valid = enumerate_runs(items, w)
    z = lambda a: jnp.where(i_valid, a, 0).astype(jnp.int32)  # noqa: E731
    rows = z(jnp.minimum(item_rows, p_len[pc] - jj * item_rows))
    i_src = z(s_lo[pc] + jj * item_rows)
    i_dst = z(d_lo[pc] + jj * item_rows)
    i_chunk = jnp.where(i_valid, p_chunk[pc], num_chunks).astype(jnp.int32)
    order = jnp.argsort(i_chunk, stable=True)                       # chunk k before k + 1
    i_chunk = i_chunk[order]
    chunk_start = jnp.searchsorted(i_chunk, jnp.arange(num_chunks + 1, dtype=jnp.int32),
                                   side="left", method=SEARCH_METHOD).astype(jnp.int32)  # [C + 1]
    return jnp.concatenate([i_src[order], i_dst[order], rows[order], chunk_start])

  lists = jax.vmap(one)(seg_src, seg_dst, seg_len)                  # [R, 3W + C + 1]
  r = seg_len.shape[0]
  starts = lists[:, 3 * w:]
  counts = starts[:, 1:] - starts[:, :-1]                           # [R, C] items per (j, k)
  walk = jnp.array(transfer_order(r), jnp.int32)
  in_walk = counts[walk].T.reshape(-1)                              # (k, position in walk)
  dealt = (jnp.cumsum(in_walk) - in_walk).reshape(num_chunks, r).T  # [R (walk position), C]
  deal_start = jnp.zeros_like(dealt).at[walk].set(dealt)            # back to rows j
  if live_rows is None:
    live = jnp.int32(num_chunks)
  else:
    live = jnp.minimum((jnp.asarray(live_rows, jnp.int32) + b - 1) // b, num_chunks)
  live = jnp.broadcast_to(live, (r, 1)).astype(jnp.int32)
  return jnp.concatenate([lists, deal_start.astype(jnp.int32), live], axis=1)




def source_chunk_work_lists(seg_src, seg_dst, seg_len, *, rank, rows: int, item_rows: int,
                            chunk_rows: int, num_chunks: int, live_rows=None):
  """`chunk_work_lists`' table, but the items cut and ordered by the chunks of the
  SOURCE rows (seg_src), not the destination's. rows: a bound on the rows of either
  side (sizes the table). Same layout: src_row[W] | dst_row[W] | rows[W] |
  chunk_start[C + 1] | deal_start[C] | live_chunks."""
  work = chunk_work_lists(seg_dst, seg_src, seg_len, rank=rank, src_rows=rows,
                              item_rows=item_rows, chunk_rows=chunk_rows,
                              num_chunks=num_chunks, live_rows=live_rows)
  w = num_items(rows, seg_len.shape[1], num_chunks, item_rows)
  return jnp.concatenate([work[:, w:2 * w], work[:, :w], work[:, 2 * w:]], axis=1)


def tile_chunks(lo, hi, chunk_rows: int):
  """(first, last) chunk of a tile's rows [lo, hi): one chunk for a block-aligned tile
  (B is a multiple of block_m), up to two for one that starts inside a block."""
  return lo // chunk_rows, (hi - 1) // chunk_rows


def chunk_signals(plan, *, num_tiles: int, n_tiles: int, chunk_rows: int, num_chunks: int):
  """expected[k] (int32 [C]): the done[k] signals of chunk k, 2 per (row tile, column
  tile) that runs (compute or zero) with rows in chunk k (a tile whose rows span two
  chunks signals both)."""
  lo = plan[2 * num_tiles:3 * num_tiles]
  hi = plan[3 * num_tiles:4 * num_tiles]
  kind = plan[4 * num_tiles:5 * num_tiles]
  first, last = tile_chunks(lo, hi, chunk_rows)
  runs = kind != gg._NONE
  per_chunk = (jnp.zeros((num_chunks + 1,), jnp.int32)
               .at[jnp.where(runs, first, num_chunks)].add(1)
               .at[jnp.where(runs & (last != first), last, num_chunks)].add(1))
  return per_chunk[:num_chunks] * (gg._NUM_COMPUTE_WGS * n_tiles)


def _kernel(plan_gmem, work_gmem, expected_gmem, a_gmem, w_gmem, y_gmem, back_gmem, *,
            gemm_kw: dict, n_comm: int, num_sms: int, chunk_rows: int, num_chunks: int,
            w: int, item_rows: int, col_tile: int, axis_name, num_peers: int):
  c = lax.axis_index("sm")
  done = pl.get_global(plgpu.SemaphoreType.REGULAR((num_chunks,)))
  _, done_sem = ep_transfer.transfer_semaphores(n_comm)

  @pl.when(c < n_comm)
  def _transfer():
    @functools.partial(pl.run_scoped,
                       stage_smem=plgpu.SMEM((2, item_rows, col_tile), y_gmem.dtype),
                       load_barrier=plgpu.Barrier(num_barriers=2),
                       collective_axes="wg")
    def _(stage_smem, load_barrier):
      @pl.when(lax.axis_index("wg") == 0)
      def _():
        stride = work_row_length(w, num_chunks)
        starts, deals = 3 * w, 3 * w + num_chunks + 1
        me = lax.axis_index(axis_name)

        def chunk_body(kc, carry):
          plgpu.semaphore_wait(done.at[kc], expected_gmem[kc], decrement=False)
          for j in transfer_order(num_peers):   # static: host-computable TMA peer id
            base = j * stride
            dst = back_gmem if j == 0 else plgpu.remote_ref(
                back_gmem, {axis_name: lax.rem(me + j, num_peers)})
            first = work_gmem[base + starts + kc]
            dealt = lax.rem(work_gmem[base + deals + kc], n_comm)
            ep_transfer.move_items(
                work_gmem, y_gmem, dst, stage_smem, load_barrier, base=base, first_item=first,
                count=work_gmem[base + starts + kc + 1] - first, w=w,
                cta=lax.rem(c - dealt + n_comm, n_comm), num_ctas=n_comm,
                item_rows=item_rows, col_tile=col_tile)
          return carry

        lax.fori_loop(0, work_gmem[stride - 1], chunk_body, 0)
        plgpu.wait_smem_to_gmem(0)               # this CTA's remote stores landed
        for p in range(num_peers):
          pl.semaphore_signal(done_sem.at[c], device_id={axis_name: p})
        pl.semaphore_wait(done_sem.at[c], num_peers)

  @pl.when(c >= n_comm)
  def _gemm():
    def signal(lo, hi):   # this warpgroup's stores of the tile are complete
      plgpu.wait_smem_to_gmem(0)
      first, last = tile_chunks(lo, hi, chunk_rows)
      pl.semaphore_signal(done.at[first])

      @pl.when(last != first)
      def _():
        pl.semaphore_signal(done.at[last])

    gg._row_tiled_kernel(plan_gmem, a_gmem, w_gmem, y_gmem, cta_offset=n_comm,
                         num_ctas=num_sms - n_comm, after_tile=signal, **gemm_kw)


def down_gemm_return(a, w_down, group_sizes, seg_src, seg_dst, seg_len, *, out_rows: int,
                     live_rows, axis_name: str, kernel: KernelConfig = KernelConfig(),
                     transfer: TransferConfig = TransferConfig(), chunk_rows: int = 2048,
                     n_comm: int = 16, zero_window=None):
  """(y, y_sorted): y = `grouped_gemm.down_projection(a, w_down, group_sizes, ...)` (its
  bits) and y_sorted = the return of y's first H columns (`ep_transfer.transfer_segments`
  with the return segments seg_*, [R, El]), in one launch, each chunk of B = chunk_rows
  rows sent as soon as it is computed. a [M_p, F_p] (the gate/up output), w_down
  [El, F, H], live_rows: rows this rank received (int32 scalar). Inside `shard_map` over
  `axis_name`; GPU only (remote refs and semaphores)."""
  m_p, k = a.shape
  el, ffn, hidden = w_down.shape
  num_peers = seg_len.shape[0]
  if w_down.dtype != a.dtype:
    raise ValueError(f"a and w_down must share one dtype, got {a.dtype} and {w_down.dtype}")
  cta_n = gg._NUM_COMPUTE_WGS * kernel.block_n
  if hidden % cta_n:
    raise ValueError(f"{hidden=} must be divisible by the CTA tile width 2 * block_n = "
                     f"{cta_n} (the transfer sends y's columns as they are: no padding)")
  if chunk_rows % kernel.block_m:
    raise ValueError(f"chunk_rows={chunk_rows} must be a multiple of block_m="
                     f"{kernel.block_m} (a GEMM row tile must lie in at most two chunks)")
  if m_p < transfer.chunk_rows:
    raise ValueError(f"a has {m_p} rows, fewer than one transfer item (TransferConfig."
                     f"chunk_rows={transfer.chunk_rows}): the transfer's load box must fit "
                     f"inside the GEMM's output")
  num_sms = device_lib.num_sms(kernel.num_sms)
  if not 1 <= n_comm < num_sms:
    raise ValueError(f"down_return_ctas={n_comm} must be in [1, num_sms={num_sms}) (at "
                     f"least one GEMM CTA)")
  smem = device_lib.smem_capacity()
  gemm_kw = gg.row_tiled_params(m_p, k, hidden, el, mode="plain", transpose_b=False,
                                out_dtype=a.dtype, in_dtype=a.dtype, save_hu=False,
                                config=kernel, smem=smem)
  col_tile = transfer.col_tile_for(hidden, itemsize=jnp.dtype(a.dtype).itemsize,
                                   smem_bytes=smem - gg._SMEM_RESERVE)
  item_rows = transfer.chunk_rows
  num_chunks = -(-m_p // chunk_rows)
  rows = max(m_p, out_rows, item_rows)
  work = source_chunk_work_lists(seg_src, seg_dst, seg_len, rank=lax.axis_index(axis_name),
                                 rows=rows, item_rows=item_rows, chunk_rows=chunk_rows,
                                 num_chunks=num_chunks, live_rows=live_rows)
  w = num_items(rows, el, num_chunks, item_rows)
  plan = gg._row_tile_plan(group_sizes, m_p, kernel.block_m, zero_window)
  expected = chunk_signals(plan, num_tiles=gemm_kw["num_tiles"],
                           n_tiles=hidden // cta_n, chunk_rows=chunk_rows,
                           num_chunks=num_chunks)
  out_p = max(out_rows, item_rows)   # a ladder step's TMA box must fit inside y_sorted
  body = functools.partial(
      _kernel, gemm_kw=gemm_kw, n_comm=n_comm, num_sms=num_sms, chunk_rows=chunk_rows,
      num_chunks=num_chunks, w=w, item_rows=item_rows, col_tile=col_tile,
      axis_name=axis_name, num_peers=num_peers)
  kernel_fn = plgpu.kernel(
      body,
      kernel_name="down_gemm_return",
      out_type=(jax.ShapeDtypeStruct((m_p, hidden), a.dtype),
                jax.ShapeDtypeStruct((out_p, hidden), a.dtype)),
      grid=(num_sms,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  y, back = kernel_fn(plan, work.reshape(-1), expected, a, gg._pad_axis(w_down, 1, k))
  return y, (back[:out_rows] if out_p != out_rows else back)
