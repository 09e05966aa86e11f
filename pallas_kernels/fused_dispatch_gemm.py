"""EXPERIMENTAL (v2 "Kernel A"): NVLink dispatch fused with the SwiGLU gate/up GEMM.

In `moe_ffn` as `UniEPConfig(backend="uniep", fused=FusedConfig(...))` (uniep_jax/fused.py);
bitwise = v1 on 4x H200 (bench/check_fused*_gpu.py small cases; layer checksums of runs 7-10);
times in NOTES_fused.md. Design and synchronisation: SYNC.md, "Kernel A".
Bring-up on GPUs: `bench/check_fused_gpu.py` (bitwise against v1).

Algorithm
---------
One `plgpu.kernel` launch per EP rank (inside `shard_map` over the expert axis,
collective metadata mode), grid = num_sms CTAs ("sm"), 3 warpgroups each ("wg").
It does in one launch what v1 does in two:

  v1:  recv = ep_transfer.transfer_segments(rows_sorted -> owners)   (launch 1)
       a, h, u = grouped_gemm swiglu(recv, w_gate_up)             (launch 2)
  v2:  one launch; GEMM tiles of receive-layout chunk k start as soon as every
       rank has pushed its rows of chunk k, while later chunks are in flight.

  h = x @ w_gate[g], u = x @ w_up[g] (f32 accumulators), a = silu(h) * u, each
  stored in the input dtype: exactly the "swiglu" mode of `grouped_gemm.py`,
  because the GEMM role IS that body (`grouped_gemm._row_tiled_kernel`, hooked,
  not copied): same tile plan, same block_k, same reduction order. Only WHEN a
  tile runs changes, so (a, h, u) are bitwise equal to v1's.

Roles (by CTA index c on "sm")
------------------------------
  c <  n_comm   transfer CTAs: warpgroup 0 pushes this rank's sorted rows into
                the owners' receive layouts (the v1 transfer pipeline); the
                other two warpgroups idle.
  c >= n_comm   GEMM CTAs: the grouped-GEMM body walks the row tiles x column
                tiles on CTAs [n_comm, num_sms) (local CTA i takes tiles i,
                i + (num_sms - n_comm), ...: nd_loop's order on a subset).

Chunks and work lists
---------------------
The receive layout [M_p, H] (M_p = R*T*K rounded up to block_m) is cut into
C = cdiv(M_p, B) chunks of B rows (B = `FusedConfig.recv_chunk_rows`, a multiple
of block_m, so every GEMM row tile lies inside one chunk: k = load_row // B).
Before the launch, plain JAX (`chunk_work_lists`) turns the dispatch segments
[R, El] (peer, local expert) into, per peer offset j (peer (me + j) mod R):

  segment --cut at the DESTINATION's chunk boundaries--> pieces
  piece   --cut into item_rows (= TransferConfig.chunk_rows) rows--> items
  items stably sorted by chunk; chunk_start[k] = first item of chunk k

  row j of the table: src_row[W] | dst_row[W] | rows[W] | chunk_start[C + 1]
                      | deal_start[C] | live_chunks
  W = cdiv(Ns, item_rows) + El + C (pieces <= El + C - 1: one peer's segments
  are disjoint in the destination, so at most C - 1 interior boundaries cut them).
  deal_start[k]: the rank of chunk k's first item of offset j in the sender's whole
  walk (chunk-major, offsets 1..R-1, 0 inside a chunk); live_chunks = cdiv(L, B),
  L the most live receive rows of any rank (from the count matrix: equal on all ranks).

Transfer CTA loop (warpgroup 0 of CTA c < n_comm):

  for k in range(live_chunks):               # dynamic; later chunks hold no rows anywhere
    for j in 1, ..., R-1, 0:                 # STATIC (TMA peer id must be host-computable)
      the items i of (k, j) with (deal_start[k] + i) mod n_comm == c:
        per column tile: GMEM src --TMA load--> SMEM stage --TMA store ladder--> peer recv
    wait_smem_to_gmem(0)                     # all of this CTA's stores landed
    signal chunk_sem[k] on every rank (itself included)
  for k in c, c + n_comm, ... < live_chunks: wait chunk_sem[k] >= R * n_comm (no decrement)

Items are dealt round robin over the whole walk, not per (k, j) list from CTA 0:
a chunk holds few items per source (qwen3-like at EP 4, B = 2048: 8 items of 128
rows from each of two sources), so dealing each list from CTA 0 left most transfer
CTAs idle and made the dispatch per-CTA bound (v2.2, NOTES_fused.md).

GEMM CTA: before the pipeline of each COMPUTE tile (all three warpgroups, via
the `before_tile` hook): wait chunk_sem[load_row // B] >= R * n_comm, no decrement.

Buffers
-------
  recv  [M_p, H]    kernel output; PEERS write into it (remote TMA stores): the
                    receive layout. Rows no segment covers are undefined; the
                    wrapper zeroes a window after the live rows as v1 does.
  a, h, u [M_p, F_p] kernel outputs, this rank only (dead rows zero, as v1).
  SMEM, transfer role: 2 stages [item_rows, col_tile] (128 KiB for 128 x 256
    bf16) + 2 barriers; GEMM role: the grouped GEMM's stages + epilogue. The two
    roles' `run_scoped` allocations are siblings (one per branch) and share the
    same SMEM; each must fit alone (checked before launch).
  chunk_sem [C]     `pl.get_global` REGULAR semaphores (GMEM scratch).

Synchronisation contract (invariants; copied from SYNC.md)
----------------------------------------------------------
  Launch ordering: `pl.get_global` semaphores are zero-filled by XLA right
      before every launch; they do not persist. Mosaic GPU's cross-device
      barrier before every communicating kernel (skip_device_barrier=False, the
      default, kept here) is what makes the first remote store or signal safe:
      every peer has entered this launch, so its recv output and zero-filled
      chunk_sem exist. No signal of launch L+1 can reach a rank before it has
      entered launch L+1, so counts never mix across launches. Reset: none.
  load_barrier[s] (transfer role, one per stage): producer the TMA load of
      step i into stage i % 2, consumer the same warpgroup's store of step i.
      Each load is waited exactly once (phases flip), so restarting at stage 0
      for every (k, j) keeps phases aligned. Stage reuse: before a load into a
      stage, `wait_smem_to_gmem(0, wait_read_only=True)`.
  chunk_sem[k]: producers every transfer CTA of every rank, once per launch
      each, after `wait_smem_to_gmem(0)` of all its stores of chunk k, empty or
      not (a signal orders the NVLink writes issued before it):
          expected(chunk_sem[k]) = R * n_comm.
      Only chunks k < live_chunks are signalled and waited on (every COMPUTE tile of
      every rank lies in one: it starts before its rank's live rows end; zero tiles of
      the dead-row window may lie past them but never wait).
      Consumers: GEMM CTAs of this rank (before a tile of chunk k) and the
      transfer CTAs' final sweep, all with decrement=False (many waiters on one
      semaphore; a decrementing wait would take the whole count and deadlock
      the others). Invariant when a wait returns: every row of chunk k of this
      rank's recv has landed.
  Kernel end: the final sweep waits every chunk, so when all CTAs are done
      every peer's writes into this rank's recv have landed (the next XLA op
      may read recv, as after v1's done_sem).
  Deadlock freedom: transfer CTAs never wait on GEMM CTAs (only on chunks,
      after signalling all of theirs); GEMM CTAs wait only on chunks that
      transfer CTAs of all ranks complete unconditionally; all num_sms CTAs
      must be resident at once (1 CTA per SM; other streams must leave room).
  v1's `ready_sem` round (redundant given the device barrier) is not repeated.
  Open point for the bring-up: the GEMM reads chunk k with TMA loads (async
  proxy) after an acquire in the generic proxy (`fence.acquire.sys` in the
  semaphore wait). The bitwise check of `bench/check_fused_gpu.py` is what
  tests that this ordering suffices on H100/H200.

CPU coverage: the work lists (numpy), the transfer role in its local form
(`transfer_chunks_local`, interpret mode, no semaphores), the hooked GEMM body
(tests/test_grouped_gemm.py + tests/test_fused_dispatch_gemm.py, interpret
mode) and the LOWERING of the whole communicating kernel for the CUDA platform
(remote refs and semaphores do not run in interpret mode).
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Optional

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from pallas_kernels.ep_transfer import move_items, peer_ref
from uniep_jax.config import FusedConfig, KernelConfig, TransferConfig  # noqa: F401 (FusedConfig re-exported)
from uniep_jax.ragged import SEARCH_METHOD, block_pieces, enumerate_runs


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
                     recv_chunk_rows: int, num_chunks: int, live_rows=None):
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
  b = recv_chunk_rows
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


# ----------------------------------------------------------------------------
# Transfer role
# ----------------------------------------------------------------------------


def _transfer_role(work_gmem, src_gmem, recv_gmem, stage_smem, load_barrier, chunk_sem, *,
                   w: int, num_chunks: int, item_rows: int, col_tile: int, n_comm: int,
                   axis_name, num_peers: int):
  """Warpgroup 0 of transfer CTA c: the live chunks' items, then the final sweep.
  axis_name=None: the local form (every offset lands in this device's recv, no
  semaphores; runs in the CPU interpret mode)."""
  stride = work_row_length(w, num_chunks)
  # Chunks past every rank's live rows hold no item and no compute tile (the only tiles
  # that wait): no rank sends, signals or waits on them.
  live_chunks = work_gmem[stride - 1]          # the same on every rank and every row
  walk_units_and_signal(work_gmem, src_gmem, recv_gmem, stage_smem, load_barrier, chunk_sem,
                        units=live_chunks, stride=stride, starts=3 * w,
                        deals=3 * w + num_chunks + 1, w=w, item_rows=item_rows,
                        col_tile=col_tile, n_comm=n_comm, axis_name=axis_name,
                        num_peers=num_peers)


def walk_units_and_signal(work_gmem, src_gmem, out_gmem, stage_smem, load_barrier, sem, *,
                          units, stride: int, starts: int, deals: int, w: int, item_rows: int,
                          col_tile: int, n_comm: int, axis_name, num_peers: int,
                          index_base: Optional[int] = None, sweep: bool = True):
  """A transfer CTA's walk over `units` (Kernel A: receive chunks; Kernel D: expert
  groups), shared by the two kernels. Work row j (peer offset j) at work_gmem[j * stride]
  holds src_row/dst_row/rows[w], then at `starts` the units' first items [units + 1] and
  at `deals` each unit's deal start (its first item's rank in the sender's whole walk).
  Per unit u: for each peer offset (static, `transfer_order`) this CTA's items of (j, u),
  dealt round robin over the walk; then `wait_smem_to_gmem(0)` (its stores landed) and
  sem[u] signalled on every rank. Then the final sweep: units c, c + n_comm, ... waited
  for R * n_comm signals (decrement=False), so that when every transfer CTA is past it
  every peer's stores and signals of this launch have reached this rank (sweep=False: the
  caller runs `final_sweep` itself, later). axis_name=None: the local form (every offset
  into this device's `out_gmem`, no semaphores)."""
  c = lax.axis_index("sm")
  me = lax.axis_index(axis_name) if axis_name is not None else None

  def unit_body(u, carry):
    for j in transfer_order(num_peers):         # static: the TMA peer id must be host-computable
      base = j * stride
      dst_gmem = peer_ref(out_gmem, j, me=me, axis_name=axis_name, num_peers=num_peers)
      first_item = work_gmem[base + starts + u]
      # round robin over the sender's whole walk: item i of this (u, j) list has walk
      # rank deal_start + i and goes to CTA (deal_start + i) mod n_comm
      dealt = lax.rem(work_gmem[base + deals + u], n_comm)
      move_items(work_gmem, src_gmem, dst_gmem, stage_smem, load_barrier, base=base,
                 first_item=first_item, count=work_gmem[base + starts + u + 1] - first_item,
                 w=w, cta=lax.rem(c - dealt + n_comm, n_comm), num_ctas=n_comm,
                 item_rows=item_rows, col_tile=col_tile, index_base=index_base)

    plgpu.wait_smem_to_gmem(0)                  # this CTA's stores of unit u landed
    if axis_name is not None:
      for p in range(num_peers):
        pl.semaphore_signal(sem.at[u], device_id={axis_name: p})
    return carry

  lax.fori_loop(0, units, unit_body, 0)

  if axis_name is not None and sweep:
    final_sweep(sem, units=units, n_comm=n_comm, num_peers=num_peers)


def final_sweep(sem, *, units, n_comm: int, num_peers: int):
  """Transfer CTA c waits units c, c + n_comm, ... of `sem` for all R * n_comm signals
  (decrement=False): when every transfer CTA is past it, every unit is complete on this
  rank, so no peer's store or signal of this launch arrives after it ends."""
  c = lax.axis_index("sm")

  def wait(i, carry):
    plgpu.semaphore_wait(sem.at[c + i * n_comm], num_peers * n_comm, decrement=False)
    return carry
  lax.fori_loop(0, (units - c + n_comm - 1) // n_comm, wait, 0)


def _transfer_scope(work_gmem, src_gmem, recv_gmem, chunk_sem, *, item_rows, col_tile, **kw):
  """SMEM of the transfer role (collective over "wg"); warpgroup 0 works."""
  @functools.partial(pl.run_scoped,
                     stage_smem=plgpu.SMEM((2, item_rows, col_tile), src_gmem.dtype),
                     load_barrier=plgpu.Barrier(num_barriers=2),
                     collective_axes="wg")
  def _(stage_smem, load_barrier):
    @pl.when(lax.axis_index("wg") == 0)
    def _():
      _transfer_role(work_gmem, src_gmem, recv_gmem, stage_smem, load_barrier, chunk_sem,
                     item_rows=item_rows, col_tile=col_tile, **kw)


# ----------------------------------------------------------------------------
# The fused kernel
# ----------------------------------------------------------------------------


def _fused_kernel(work_gmem, plan_gmem, rows_gmem, *refs, num_in: int, gemm_in: tuple,
                  transfer_kw: dict, gemm_kw: dict, n_comm: int, num_sms: int, num_chunks: int,
                  recv_chunk_rows: int, axis_name, num_peers: int):
  """refs: the GEMM's other inputs (num_in of them), then the outputs: recv (the
  GEMM's lhs, which peers write into) and the GEMM's outputs. gemm_in: the indices
  of the inputs the GEMM body takes after its lhs (its rhs operands, then its
  epilogue inputs): (0, 0) for "swiglu" (w_gate_up read twice, at column offsets 0
  and F), (0, 1, 2) for "dswiglu" (w_down, h, u)."""
  inputs, recv_gmem, gemm_outs = refs[:num_in], refs[num_in], refs[num_in + 1:]
  c = lax.axis_index("sm")
  chunk_sem = pl.get_global(plgpu.SemaphoreType.REGULAR((num_chunks,)))
  expected = num_peers * n_comm

  @pl.when(c < n_comm)
  def _transfer():
    _transfer_scope(work_gmem, rows_gmem, recv_gmem, chunk_sem, num_chunks=num_chunks,
                    n_comm=n_comm, axis_name=axis_name, num_peers=num_peers, **transfer_kw)

  @pl.when(c >= n_comm)
  def _gemm():
    def wait_rows(load_row):   # invariant on return: rows of chunk load_row // B landed
      plgpu.semaphore_wait(chunk_sem.at[load_row // recv_chunk_rows], expected,
                           decrement=False)

    gg._row_tiled_kernel(plan_gmem, recv_gmem, *(inputs[i] for i in gemm_in), *gemm_outs,
                         cta_offset=n_comm, num_ctas=num_sms - n_comm, before_tile=wait_rows,
                         **gemm_kw)


@dataclasses.dataclass(frozen=True)
class _Static:
  """Validated static shape of one fused launch."""

  m_p: int            # receive-layout rows, padded to block_m
  f_p: int            # F padded as grouped_gemm pads it
  num_sms: int
  num_chunks: int
  col_tile: int
  gemm_kw: dict


def validate(*, out_rows: int, hidden: int, ffn: int, num_local_experts: int, dtype,
             kernel: KernelConfig, transfer: TransferConfig, fused: FusedConfig,
             smem: int | None = None, mode: str = "swiglu") -> _Static:
  """All static checks of a fused launch, with the derived sizes. Raises
  ValueError before anything is traced (B vs block_m, n_comm vs num_sms, the
  SMEM of each role, H vs block_k). mode: the GEMM role's, "swiglu" (the forward's
  gate/up) or "dswiglu" (the backward's da = dy @ w_down^T with dh, du in its
  epilogue)."""
  if mode not in ("swiglu", "dswiglu"):
    raise ValueError(f"{mode=} must be 'swiglu' (forward) or 'dswiglu' (backward)")
  smem = device_lib.smem_capacity() if smem is None else smem
  num_sms = device_lib.num_sms(kernel.num_sms)
  b = fused.recv_chunk_rows
  if b % kernel.block_m:
    raise ValueError(f"recv_chunk_rows={b} must be a multiple of block_m={kernel.block_m} "
                     f"(a GEMM row tile must lie in one chunk)")
  if not fused.n_comm < num_sms:
    raise ValueError(f"n_comm={fused.n_comm} must be < num_sms={num_sms} "
                     f"(at least one GEMM CTA)")
  if hidden % kernel.block_k:
    raise ValueError(f"{hidden=} must be divisible by block_k={kernel.block_k} (the fused "
                     f"kernel does not pad the receive layout's columns)")
  itemsize = jnp.dtype(dtype).itemsize
  # transfer role SMEM: 2 stages of [chunk_rows, col_tile] (raises if none fits)
  col_tile = transfer.col_tile_for(hidden, itemsize=itemsize, smem_bytes=smem - gg._SMEM_RESERVE)
  # GEMM role SMEM: the grouped GEMM's own check (raises if one stage does not fit)
  m_p = gg._round_up(out_rows, kernel.block_m)
  f_p = gg._swiglu_padded_f(ffn, kernel)
  if mode == "swiglu":   # [rows | H] @ w_gate_up [H, 2F_p] at column offsets 0 and F_p
    gemm_kw = gg.row_tiled_params(m_p, hidden, f_p, num_local_experts, mode="swiglu",
                                  transpose_b=False, out_dtype=dtype, in_dtype=dtype,
                                  save_hu=True, config=kernel, smem=smem,
                                  b_col_offsets=(0, f_p))
  else:                  # [dy | H] @ w_down[F_p, H]^T, as grouped_gemm.swiglu_backward's da
    gemm_kw = gg.row_tiled_params(m_p, hidden, f_p, num_local_experts, mode="dswiglu",
                                  transpose_b=True, out_dtype=dtype, in_dtype=dtype,
                                  save_hu=False, config=kernel, smem=smem)
  return _Static(m_p=m_p, f_p=f_p, num_sms=num_sms, num_chunks=-(-m_p // b),
                 col_tile=col_tile, gemm_kw=gemm_kw)


def fused_dispatch_gate_up(rows_sorted, seg_src, seg_dst, seg_len, group_sizes, w_gate_up, *,
                           out_rows: int, axis_name: str,
                           kernel: KernelConfig = KernelConfig(),
                           transfer: TransferConfig = TransferConfig(),
                           fused: FusedConfig = FusedConfig(),
                           zero_window: Optional[int] = None, live_rows=None):
  """Dispatch + gate/up in one launch. Inside `shard_map` over `axis_name` (size R).

  rows_sorted [Ns, H]: this rank's sorted rows; seg_*: [R, El] dispatch segments
  (`layout.dispatch_segments`); group_sizes [El]: rows per local expert of THIS
  rank's receive layout (`plan.recv_group_sizes`); w_gate_up [El, H, 2F].
  Returns (recv [M_p, H], a, h, u [M_p, F_p]), M_p = out_rows rounded up to
  block_m, F_p as `grouped_gemm` pads F. recv rows that no segment covers are
  undefined (callers zero what they need, as `dispatch._send_nvlink`); dead rows
  of a, h, u are zero (zero_window=W: only those before round_up(live rows, W), the
  rest undefined and their tiles skipped, as `grouped_gemm._row_tile_plan`).
  live_rows: int32 scalar, the most live receive rows of any rank, the SAME on every
  rank (`layout.max_received_rows`): chunks past it are neither sent, signalled nor
  waited on (None: all of them). GPU only (remote refs and semaphores).
  """
  ns, hidden = rows_sorted.shape
  el, w_hidden, two_f = w_gate_up.shape
  if two_f % 2 or w_hidden != rows_sorted.shape[1] or el != group_sizes.shape[0]:
    raise ValueError(f"w_gate_up {w_gate_up.shape} must be [El={group_sizes.shape[0]}, "
                     f"H={rows_sorted.shape[1]}, 2F] ([w_gate | w_up])")
  ffn = two_f // 2
  dtype = rows_sorted.dtype
  if w_gate_up.dtype != dtype:
    raise ValueError(f"all operands must share one dtype, got {w_gate_up.dtype} and {dtype}")
  st = validate(out_rows=out_rows, hidden=hidden, ffn=ffn, num_local_experts=el, dtype=dtype,
                kernel=kernel, transfer=transfer, fused=fused)
  outs = ((st.m_p, hidden),) + ((st.m_p, st.f_p),) * 3
  return _launch(rows_sorted, seg_src, seg_dst, seg_len, group_sizes,
                 (gg._pad_gate_up(w_gate_up, st.f_p),), gemm_in=(0, 0), out_shapes=outs,
                 name="fused_dispatch_gate_up", st=st, axis_name=axis_name, kernel=kernel,
                 transfer=transfer, fused=fused, zero_window=zero_window, live_rows=live_rows)


def fused_dispatch_dswiglu(dy_sorted, seg_src, seg_dst, seg_len, group_sizes, w_down, h, u, *,
                           out_rows: int, axis_name: str,
                           kernel: KernelConfig = KernelConfig(),
                           transfer: TransferConfig = TransferConfig(),
                           fused: FusedConfig = FusedConfig(),
                           zero_window: Optional[int] = None, live_rows=None):
  """The backward's twin of `fused_dispatch_gate_up` (EXPERIMENTAL, `FusedConfig.backward`):
  the dispatch of dy (the transpose of the return: the same segments as the forward's
  dispatch) and da = dy @ w_down^T with the SwiGLU derivative in its epilogue (grouped
  GEMM mode "dswiglu"), in one launch, each GEMM tile waiting only for its chunk.

  dy_sorted [Ns, H]: this rank's sorted-order cotangent rows; seg_*, group_sizes: as
  for the forward; w_down [El, F, H]; h, u [M_p, F_p]: the forward's residuals (its
  gate/up launch's outputs). Returns (dy_recv [M_p, H], dhu [M_p, 2 F_p] = [dh | du]):
  dhu is what `grouped_gemm.swiglu_backward`'s "dswiglu" launch writes (same body,
  same tile plan, same block_k: only WHEN a tile runs changes); dy_recv rows that no
  segment covers are undefined (the caller zeroes the window the wgrad reads); dead
  rows of dhu as `fused_dispatch_gate_up`'s outputs (zero_window); live_rows as there.
  GPU only.
  """
  ns, hidden = dy_sorted.shape
  el, ffn, w_hidden = w_down.shape
  if w_hidden != hidden or el != group_sizes.shape[0]:
    raise ValueError(f"w_down {w_down.shape} must be [El={group_sizes.shape[0]}, F, "
                     f"H={hidden}]")
  dtype = dy_sorted.dtype
  if w_down.dtype != dtype or h.dtype != dtype or u.dtype != dtype:
    raise ValueError(f"all operands must share one dtype, got dy {dtype}, w_down "
                     f"{w_down.dtype}, h {h.dtype}, u {u.dtype}")
  st = validate(out_rows=out_rows, hidden=hidden, ffn=ffn, num_local_experts=el, dtype=dtype,
                kernel=kernel, transfer=transfer, fused=fused, mode="dswiglu")
  if h.shape != (st.m_p, st.f_p) or u.shape != (st.m_p, st.f_p):
    raise ValueError(f"h {h.shape} and u {u.shape} must be [M_p, F_p] = {(st.m_p, st.f_p)} "
                     f"(the forward's gate/up outputs)")
  outs = ((st.m_p, hidden), (st.m_p, 2 * st.f_p))
  return _launch(dy_sorted, seg_src, seg_dst, seg_len, group_sizes,
                 (gg._pad_axis(w_down, 1, st.f_p), h, u), gemm_in=(0, 1, 2), out_shapes=outs,
                 name="fused_dispatch_dswiglu", st=st, axis_name=axis_name, kernel=kernel,
                 transfer=transfer, fused=fused, zero_window=zero_window, live_rows=live_rows)


def _launch(rows_sorted, seg_src, seg_dst, seg_len, group_sizes, inputs: tuple, *,
            gemm_in: tuple, out_shapes: tuple, name: str, st: _Static, axis_name,
            kernel: KernelConfig, transfer: TransferConfig, fused: FusedConfig,
            zero_window: Optional[int], live_rows=None):
  """One fused launch: the transfer role pushes `rows_sorted` into the owners' first
  output (the GEMM's lhs), the GEMM role runs `st.gemm_kw`'s body on it."""
  ns, hidden = rows_sorted.shape
  num_peers = seg_len.shape[0]
  item_rows = transfer.chunk_rows
  if ns < item_rows:   # the transfer's load box must fit inside src (as v1)
    rows_sorted = jnp.pad(rows_sorted, ((0, item_rows - ns), (0, 0)))
  rank = lax.axis_index(axis_name)
  work = chunk_work_lists(seg_src, seg_dst, seg_len, rank=rank, src_rows=ns,
                          item_rows=item_rows, recv_chunk_rows=fused.recv_chunk_rows,
                          num_chunks=st.num_chunks, live_rows=live_rows)
  w = num_items(ns, seg_len.shape[1], st.num_chunks, item_rows)
  plan = gg._row_tile_plan(group_sizes, st.m_p, kernel.block_m, zero_window)
  body = functools.partial(
      _fused_kernel, num_in=len(inputs), gemm_in=gemm_in,
      transfer_kw=dict(w=w, item_rows=item_rows, col_tile=st.col_tile),
      gemm_kw=st.gemm_kw, n_comm=fused.n_comm, num_sms=st.num_sms, num_chunks=st.num_chunks,
      recv_chunk_rows=fused.recv_chunk_rows, axis_name=axis_name, num_peers=num_peers)
  kernel_fn = plgpu.kernel(
      body,
      kernel_name=name,
      out_type=tuple(jax.ShapeDtypeStruct(shape, rows_sorted.dtype) for shape in out_shapes),
      grid=(st.num_sms,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
  )
  return kernel_fn(work.reshape(-1), plan, rows_sorted, *inputs)


def transfer_chunks_local(src, seg_src, seg_dst, seg_len, *, out_rows: int, rank: int = 0,
                          transfer: TransferConfig = TransferConfig(),
                          recv_chunk_rows: int = 256, n_comm: int = 2, live_rows=None,
                          interpret=None):
  """The transfer role alone, local form: every peer offset's items land in this
  device's [out_rows, H] output, chunk by chunk, in the fused kernel's launch
  shape (3 warpgroups, Warpgroup semantics, grid n_comm). No semaphores, so it
  runs in the CPU interpret mode (the test of the chunked work lists in a kernel).
  Rows that no segment covers are undefined."""
  ns, hidden = src.shape
  item_rows = transfer.chunk_rows
  col_tile = transfer.col_tile_for(hidden, itemsize=jnp.dtype(src.dtype).itemsize,
                                   smem_bytes=device_lib.smem_capacity())
  if ns < item_rows:
    src = jnp.pad(src, ((0, item_rows - ns), (0, 0)))
  num_chunks = -(-out_rows // recv_chunk_rows)
  work = chunk_work_lists(seg_src, seg_dst, seg_len, rank=rank, src_rows=ns,
                          item_rows=item_rows, recv_chunk_rows=recv_chunk_rows,
                          num_chunks=num_chunks, live_rows=live_rows)
  w = num_items(ns, seg_len.shape[1], num_chunks, item_rows)

  def body(work_gmem, src_gmem, out_gmem):
    _transfer_scope(work_gmem, src_gmem, out_gmem, None, item_rows=item_rows, col_tile=col_tile,
                    w=w, num_chunks=num_chunks, n_comm=n_comm, axis_name=None,
                    num_peers=seg_len.shape[0])

  kernel_fn = plgpu.kernel(
      body,
      kernel_name="transfer_chunks_local",
      out_type=jax.ShapeDtypeStruct((out_rows, hidden), src.dtype),
      grid=(n_comm,),
      grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1,
      thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=gg.resolve_interpret(interpret),
  )
  return kernel_fn(work.reshape(-1), src)
