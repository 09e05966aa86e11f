"""EXPERIMENTAL ("Kernel D"): the de-duplicated dispatch, the owner's expansion and the
gate/up GEMM (forward) or the da GEMM (backward) in one launch, each overlapping the next.

Today (`FusedConfig.dispatch_in_kernel=False` with `UniEPConfig.dedup_tokens`) these run
one after another (4x H200, qwen3-like EP 4, profile run 53, ms per call):

  forward   transfer of x's unique rows 0.59 -> expansion 0.27 -> gate/up 1.24
  backward  transfer of dy's unique rows 0.61 -> weighted expansion 0.30 -> da 0.78

Here one launch per rank does all three, with three roles on disjoint CTAs; the GEMM's
row tiles of receive-layout chunk k start as soon as chunk k has been expanded, which
needs only the unique rows of the expert groups up to chunk k's last expert. Sized in
pallas_kernels/NOTES_fused.md at 1ef9d76 ("The dispatch overlap re-sized"): ~-0.5 ms at best on
qwen3-like at EP 4. Status (NOTES_dedup_dispatch_gemm.md): bit for bit on 2x H200
(`bench/check_moe_gpu.py --backends uniep_dd,uniep_dd_ov`, and the layer's checksums);
slower there than the launches it replaces (EP 2, qwen3-like: +0.36 ms forward, +0.31
backward); EP 4 not yet timed. Off by default (`FusedConfig.overlap_copy_ctas[_bwd]`).

Bits: the same rows moved (`ep_transfer.move_items`: gathered loads of x[unique_tokens],
the same weighted copy expression as `row_gather.gather_live_rows`), the same GEMM body
on the same tile plan as Kernel A (`grouped_gemm._row_tiled_kernel`, block-aligned row
tiles, same block_k): recv and the GEMM outputs equal the three launches' bit for bit.

Send order (`UniEPConfig.dedup_send_groups` = G, `uniep_jax/dedup.py`): each source
sends an owner its unique rows in (group of the token's smallest expert on that owner,
token) order, the owner's El local experts cut into G contiguous groups. A unique row is
read by the receive rows of its token's experts on the owner, each in a group >= the
group of its smallest: so once every source has sent its rows of groups 0..g, every
receive row of an expert in groups 0..g can be expanded.

Roles (by CTA index c on "sm", 3 warpgroups each; warpgroup 0 works in roles 1 and 2)
------------------------------------------------------------------------------------
  c < n_comm                 transfer: for g = 0..G-1, for each peer offset j (static,
                             `transfer_order`): this CTA's share of the items of (j, g)
                             (dealt round robin over the whole walk, as Kernel A's); then
                             `wait_smem_to_gmem(0)` and arrived[g] signalled on every
                             rank. ONE drain per group, not one per (peer, group).
  n_comm <= c < n_comm+n_copy  copy (the expansion): for each live receive chunk k
                             (B = recv_chunk_rows rows): wait arrived[group_of_chunk[k]],
                             copy this CTA's share of chunk k's rows, recv[p] =
                             unique[index[p]] (times scale[p] in the backward), one item of
                             16 rows at a time; `wait_smem_to_gmem(0)`, signal chunk_sem[k]
                             on this rank.
  c >= n_comm + n_copy       GEMM: Kernel A's GEMM body on the remaining CTAs; before each
                             compute tile, wait chunk_sem[load_row // B].
  `FusedConfig.overlap_join_percent` p > 0: after their sends (before their final sweep)
  the transfer CTAs copy too, the chunks from join_chunk = live_chunks * p // 100 on,
  whose items are then dealt over the n_copy + n_comm copiers (`copiers`); chunk_sem of
  those chunks counts them all. A chunk's items are dealt round robin from copier
  (first item mod copiers), continuing the walk of the chunks before it.

Work lists (plain JAX, one int32 array)
---------------------------------------
  [R, 3 * Wt + 2 * G + 1] transfer (`group_work_lists`, row j: peer me + j):
                          src_row[Wt] | dst_row[Wt] | rows[Wt] | group_start[G + 1] |
                          deal_start[G]; src_row indexes unique_tokens (gathered loads)
  [3 * Wc]                copy (`copy_work_list`): item i covers receive rows
                          [16 i, 16 i + rows_i), rows_i = clip(live - 16 i, 0, 16);
                          chunk k's items are [k B / 16, (k + 1) B / 16)
  [C]                     group_of_chunk[k]: the group of the expert of chunk k's last
                          live row (what the copy of chunk k waits for)
  [1]                     live_chunks = cdiv(live, B) (this rank's own receive rows)
  [Nu]                    unique_tokens (the transfer's loads)
  [N]                     index (the copies' loads: the packed unique row of receive row p)

Buffers
-------
  x       [T, H/ct, ct]      input (3-D view: one TMA box of a whole column block per row)
  unique  [R*T, H/ct, ct]    output, written by PEERS (remote TMA stores); the owner's
                             packed unique buffer (`dedup.packed_unique_index`)
  recv    [M_p, H/ct, ct]    output, this rank only: the copy role stores whole rows as
                             one box, the GEMM role reads its [block_m, block_k] blocks as
                             squeezed [block_m, 1, block_k] boxes of the same view
                             (`grouped_gemm._row_tiled_kernel(lhs_col_tile=ct)`; a GMEM ref
                             cannot be reshaped inside the kernel); rows >= live undefined;
                             returned as [M_p, H]
  a, h, u [M_p, F_p] (forward) or dhu [M_p, 2 F_p] (backward): the GEMM's outputs, as
                             Kernel A's (dead rows as its zero_window says)
  SMEM    each role its own `pl.run_scoped` in its branch (they share the space): transfer
          2 stages of [16, nb, ct] (`row_gather.column_blocking`), copy
          `FusedConfig.overlap_copy_stages` stages of [16, nb', ct] (nb' the most boxes
          that fit them), the GEMM its stages and epilogue.
  arrived [G], chunk_sem [C]  `pl.get_global` REGULAR semaphores (GMEM, zero-filled per launch).

Synchronisation contract
------------------------
  Launch ordering: as Kernel A (Mosaic GPU's cross-device barrier before the launch,
      skip_device_barrier=False): every peer has entered this launch, its unique output
      and zero-filled semaphores exist, before the first remote store or signal.
  load_barrier[s] (transfer and copy roles, each its own): `move_items`' gathered form
      (16 arrivals per stage), stage reuse as `tma.two_stage_copy_loop`.
  arrived[g]: producers every transfer CTA of every rank, once per launch each, after
      `wait_smem_to_gmem(0)` of all its stores of groups <= g (a signal orders the NVLink
      writes issued before it): expected(arrived[g]) = R * n_comm. Consumers: the copy
      CTAs (before chunk k, g = group_of_chunk[k]) and the transfer CTAs' final sweep,
      decrement=False (many waiters). Invariant when a wait returns: every source's
      unique rows of groups 0..g are in this rank's unique buffer (each CTA signals the
      groups in order, so arrived[g] complete implies every earlier group complete).
  chunk_sem[k]: producers the copiers of chunk k on this rank (the n_copy copy CTAs, and
      from join_chunk on the n_comm transfer CTAs too), once each per live chunk, after
      `wait_smem_to_gmem(0)` of their copies of chunk k: expected = `copiers(k)`.
      Consumers: the GEMM CTAs before a compute tile of chunk k (decrement=False).
      Invariant: every live row of chunk k of recv is written.
  Kernel end: the transfer CTAs' final sweep waits every arrived[g], so no peer writes
      into this rank's unique buffer or signals after the launch; the GEMM CTAs waited
      every chunk holding a compute tile and the copy CTAs drained their stores, so recv
      and the GEMM outputs are complete for the next XLA op.
  Deadlock freedom: transfer CTAs wait only on transfer CTAs' signals (their sweep,
      after all of their own; joining, the same arrived counts as the copies); copy CTAs
      only on transfer signals; GEMM CTAs only on copiers' signals; each producer signals
      unconditionally. All num_sms CTAs resident (1 per SM).
  Open point (as Kernel A's): the GEMM's TMA loads of recv (async proxy) after an acquire
      in the generic proxy (the semaphore wait) of rows the copy CTAs stored with TMA.

CPU coverage: the work lists (numpy), the transfer and copy roles in their local form
(`transfer_copy_local`: every source's rows land in this device's unique buffer, two
launches, the CPU interpret mode; the GEMM is v1's launch on its output) against the
de-duplicated dispatch's own rows, and the LOWERING of the communicating kernel for CUDA; the layer's plumbing with this
kernel's contract simulated (tests/test_moe.py).
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
from pallas_kernels import fused_dispatch_gemm as fdg
from pallas_kernels import grouped_gemm as gg
from pallas_kernels.ep_transfer import GATHER_ITEM_ROWS, move_items
from pallas_kernels.row_gather import STAGE_BUDGET_BYTES, column_blocking, stage_budget
from uniep_jax.config import FusedConfig, KernelConfig, TransferConfig
from uniep_jax.dedup import expert_group
from uniep_jax.ragged import SEARCH_METHOD, enumerate_runs

ITEM_ROWS = GATHER_ITEM_ROWS   # rows per item of both roles (gathered loads: one TMA per row)


# ----------------------------------------------------------------------------
# Work lists (plain JAX, before the launch)
# ----------------------------------------------------------------------------


def group_items(src_rows: int, num_groups: int) -> int:
  """Wt: static bound on the items of one peer offset (a destination's unique rows are
  at most T = src_rows, cut into G group segments of items)."""
  return -(-src_rows // ITEM_ROWS) + num_groups


def transfer_row_length(w: int, num_groups: int) -> int:
  return 3 * w + 2 * num_groups + 1


def group_work_lists(seg_src, seg_dst, seg_len, *, rank, src_rows: int):
  """Per peer offset j (row j: peer (rank + j) mod R), the transfer's items group by group.

  seg_*: [R, G] int32 indexed by (peer, group): group g's unique rows for peer p are
  unique_tokens positions [seg_src, + seg_len), landing at rows [seg_dst, + seg_len) of
  p's unique buffer. Returns int32 [R, 3 Wt + 2 G + 1] (`transfer_row_length`):
    src_row[Wt], dst_row[Wt], rows[Wt]   items of <= ITEM_ROWS rows, group by group
    group_start[G + 1]                   items of group g: [group_start[g], [g + 1])
    deal_start[G]                        the rank of group g's first item of offset j in
                                         the sender's whole walk (group-major, offsets in
                                         `fused_dispatch_gemm.transfer_order` inside a
                                         group): items are dealt round robin over it."""
  r, g = seg_len.shape
  w = group_items(src_rows, g)
  rot = lambda a: jnp.roll(a.astype(jnp.int32), -rank, axis=0)  # noqa: E731  row j: peer rank+j
  seg_src, seg_dst, seg_len = rot(seg_src), rot(seg_dst), rot(seg_len)

  def one(src, dst, length):                                        # [G] each
    items = (length + ITEM_ROWS - 1) // ITEM_ROWS
    seg, j, valid = enumerate_runs(items, w)
    z = lambda a: jnp.where(valid, a, 0).astype(jnp.int32)  # noqa: E731
    rows = z(jnp.minimum(ITEM_ROWS, length[seg] - j * ITEM_ROWS))
    start = jnp.concatenate([jnp.zeros((1,), jnp.int32), jnp.cumsum(items).astype(jnp.int32)])
    return jnp.concatenate([z(src[seg] + j * ITEM_ROWS), z(dst[seg] + j * ITEM_ROWS), rows,
                            start])

  lists = jax.vmap(one)(seg_src, seg_dst, seg_len)                  # [R, 3W + G + 1]
  starts = lists[:, 3 * w:]
  counts = starts[:, 1:] - starts[:, :-1]                           # [R, G]
  walk = jnp.array(fdg.transfer_order(r), jnp.int32)
  in_walk = counts[walk].T.reshape(-1)                              # (g, position in walk)
  dealt = (jnp.cumsum(in_walk) - in_walk).reshape(g, r).T           # [walk position, G]
  deal_start = jnp.zeros_like(dealt).at[walk].set(dealt)
  return jnp.concatenate([lists, deal_start.astype(jnp.int32)], axis=1)


def copy_work_list(live, out_rows: int):
  """[3 * Wc] int32, Wc = cdiv(out_rows, ITEM_ROWS): item i = (src_row 16 i, dst_row 16 i,
  rows clip(live - 16 i, 0, 16)), src_row indexing the copies' index array."""
  wc = -(-out_rows // ITEM_ROWS)
  p = jnp.arange(wc, dtype=jnp.int32) * ITEM_ROWS
  rows = jnp.clip(jnp.asarray(live, jnp.int32) - p, 0, ITEM_ROWS)
  return jnp.concatenate([p, p, rows])


def group_of_chunks(group_sizes, live, *, num_groups: int, recv_chunk_rows: int,
                    num_chunks: int):
  """[C] int32: the expert group that receive chunk k's last live row belongs to (0 for
  chunks with no live row: never waited on). group_sizes [El]: rows per local expert."""
  el = group_sizes.shape[0]
  ends = jnp.cumsum(group_sizes.astype(jnp.int32))
  last = jnp.minimum((jnp.arange(num_chunks, dtype=jnp.int32) + 1) * recv_chunk_rows,
                     jnp.asarray(live, jnp.int32)) - 1
  expert = jnp.searchsorted(ends, jnp.maximum(last, 0), side="right", method=SEARCH_METHOD)
  group = expert_group(jnp.minimum(expert, el - 1), el, num_groups)
  return jnp.where(last >= 0, group, 0).astype(jnp.int32)


def column_blockings(hidden: int, itemsize: int, copy_stages: int, smem: int):
  """(ct, nb of the transfer role, nb of the copy role): the rows' TMA box width (the same
  for x, the unique buffer and recv, all [rows, H / ct, ct]) and each role's boxes per
  step, the transfer's on 2 stages, the copy's on `copy_stages`."""
  ct, nb = column_blocking(hidden, itemsize, ITEM_ROWS, min(STAGE_BUDGET_BYTES, smem))
  _, nb_copy = column_blocking(hidden, itemsize, ITEM_ROWS, stage_budget(copy_stages, smem),
                               stages=copy_stages)
  return ct, nb, nb_copy


def send_segments(dplan):
  """The transfer's segments [R(dst), G] (src, dst, len) from a `DedupPlan` (its
  send_groups G): this rank's unique rows for owner d in group g are unique_tokens
  positions unique_send_offsets[d] + [ends[g - 1], ends[g]) and land in d's packed buffer
  at unique_output_offsets[d] + the same. ends = dplan.unique_send_group_ends[d]."""
  ends = dplan.unique_send_group_ends                               # [R, G]
  start = jnp.concatenate([jnp.zeros_like(ends[:, :1]), ends[:, :-1]], axis=1)
  return (dplan.unique_send_offsets[:, None] + start, dplan.unique_output_offsets[:, None] + start,
          ends - start)


# ----------------------------------------------------------------------------
# Roles
# ----------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class _Layout:
  """Where each part of the flat int32 work array starts (module doc, "Work lists")."""

  num_groups: int      # G
  t_w: int             # transfer items per peer offset (bound)
  c_base: int          # the copy list
  c_w: int             # copy items (bound): cdiv(M_p, ITEM_ROWS)
  chunk_items: int     # copy items per receive chunk: B / ITEM_ROWS
  group_base: int      # group_of_chunk[C]
  live_chunks_at: int  # live_chunks, then live_items, then join_chunk
  t_index_base: int    # unique_tokens
  c_index_base: int    # index


def _scoped(fn, dtype, nb: int, ct: int, stages: int = 2):
  """Runs fn(stage_smem, load_barrier) on warpgroup 0, the SMEM (`stages` stages of
  [ITEM_ROWS, nb, ct]) allocated collectively over the CTA's warpgroups (the kernel runs
  3 for the GEMM role)."""
  @functools.partial(pl.run_scoped,
                     stage_smem=plgpu.SMEM((stages, ITEM_ROWS, nb, ct), dtype),
                     load_barrier=plgpu.Barrier(num_arrivals=ITEM_ROWS, num_barriers=stages),
                     collective_axes="wg")
  def _(stage_smem, load_barrier):
    @pl.when(lax.axis_index("wg") == 0)
    def _():
      fn(stage_smem, load_barrier)


def _transfer_role(work_gmem, x_gmem, unique_gmem, arrived, stage_smem, load_barrier, *,
                   lay: _Layout, nb: int, n_comm: int, axis_name, num_peers: int,
                   sweep: bool = True):
  """Transfer CTA c: the groups in order, each ending in one drain and R signals
  (Kernel A's walk, `fused_dispatch_gemm.walk_units_and_signal`, over groups instead of
  chunks, with gathered loads of x[unique_tokens]); then the final sweep (sweep=False:
  the caller's, after the joined copies). axis_name=None: the local form (every offset
  lands in this device's buffer, no semaphores)."""
  g_count = lay.num_groups
  fdg.walk_units_and_signal(
      work_gmem, x_gmem, unique_gmem, stage_smem, load_barrier, arrived, units=g_count,
      stride=transfer_row_length(lay.t_w, g_count), starts=3 * lay.t_w,
      deals=3 * lay.t_w + g_count + 1, w=lay.t_w, item_rows=ITEM_ROWS, col_tile=nb,
      n_comm=n_comm, axis_name=axis_name, num_peers=num_peers, index_base=lay.t_index_base,
      sweep=sweep)


def copiers(k, join_chunk, n_copy: int, n_join: int):
  """The CTAs that copy receive chunk k: the n_copy copy CTAs, and from join_chunk on the
  n_join transfer CTAs too (`FusedConfig.overlap_join_percent`)."""
  return n_copy + jnp.where(k >= join_chunk, n_join, 0)


def _copy_role(work_gmem, unique_gmem, scale_gmem, recv3_gmem, arrived, chunk_sem, stage_smem,
               load_barrier, *, cc, lay: _Layout, nb: int, n_copy: int, n_join: int,
               joining: bool, expected: int, axis_name, stages: int = 2):
  """Copier cc of a chunk's copiers (`copiers`): copy CTA cc < n_copy walks every live
  chunk; with joining, transfer CTA cc - n_copy walks the chunks from join_chunk on (after
  its transfer). Each chunk after the groups it reads arrived, then a signal on this
  rank. arrived/chunk_sem None: the local form (no waits, no signals)."""
  live_chunks = work_gmem[lay.live_chunks_at]
  live_items = work_gmem[lay.live_chunks_at + 1]
  join_chunk = work_gmem[lay.live_chunks_at + 2]

  def chunk_body(k, carry):
    if arrived is not None:   # every source's rows of groups <= the chunk's last landed
      plgpu.semaphore_wait(arrived.at[work_gmem[lay.group_base + k]], expected, decrement=False)
    first = k * lay.chunk_items
    n = copiers(k, join_chunk, n_copy, n_join)
    # round robin over the whole walk (item i of chunk k to copier (first + i) mod n), not
    # from copier 0 in every chunk: a chunk of few items still reaches every copier
    move_items(work_gmem, unique_gmem, recv3_gmem, stage_smem, load_barrier, base=lay.c_base,
               first_item=first, count=jnp.clip(live_items - first, 0, lay.chunk_items),
               w=lay.c_w, cta=lax.rem(cc - lax.rem(first, n) + n, n), num_ctas=n,
               item_rows=ITEM_ROWS, col_tile=nb, index_base=lay.c_index_base,
               scale=scale_gmem, stages=stages)
    plgpu.wait_smem_to_gmem(0)                  # this CTA's rows of chunk k written
    if chunk_sem is not None:
      pl.semaphore_signal(chunk_sem.at[k], device_id={axis_name: lax.axis_index(axis_name)})
    return carry

  lax.fori_loop(jnp.minimum(join_chunk, live_chunks) if joining else 0, live_chunks,
                chunk_body, 0)


def build_work(unique_tokens, seg_src, seg_dst, seg_len, index, live, group_sizes, *, rank,
               tokens: int, out_rows: int, recv_chunk_rows: int, join_percent: int = 0):
  """(flat int32 work array, _Layout): the module doc's "Work lists". seg_*: [R, G] the
  transfer's segments (`send_segments`); index [N]: the packed unique row of every receive
  row (`dedup.packed_unique_index`); live: this rank's live receive rows; group_sizes
  [El]; out_rows: M_p (the receive layout padded to block_m, a multiple of B);
  join_percent: the transfer CTAs copy the live chunks from join_chunk = live_chunks *
  join_percent // 100 on (0: never, join_chunk = C)."""
  num_groups = seg_len.shape[1]
  b = recv_chunk_rows
  num_chunks = -(-out_rows // b)
  t_lists = group_work_lists(seg_src, seg_dst, seg_len, rank=rank, src_rows=tokens)
  c_list = copy_work_list(live, out_rows)
  groups = group_of_chunks(group_sizes, live, num_groups=num_groups, recv_chunk_rows=b,
                           num_chunks=num_chunks)
  live = jnp.asarray(live, jnp.int32)
  live_chunks = (live + b - 1) // b
  join_chunk = live_chunks * join_percent // 100 if join_percent else jnp.int32(num_chunks)
  counts = jnp.stack([live_chunks, (live + ITEM_ROWS - 1) // ITEM_ROWS, join_chunk])
  parts = [t_lists.reshape(-1), c_list, groups, counts.astype(jnp.int32),
           unique_tokens.astype(jnp.int32), index.astype(jnp.int32)]
  offsets = [0]
  for part in parts[:-1]:
    offsets.append(offsets[-1] + part.shape[0])
  lay = _Layout(num_groups=num_groups, t_w=group_items(tokens, num_groups), c_base=offsets[1],
                c_w=c_list.shape[0] // 3, chunk_items=b // ITEM_ROWS, group_base=offsets[2],
                live_chunks_at=offsets[3], t_index_base=offsets[4], c_index_base=offsets[5])
  return jnp.concatenate(parts), lay


# ----------------------------------------------------------------------------
# The fused kernel
# ----------------------------------------------------------------------------


def _kernel(work_gmem, plan_gmem, x_gmem, *refs, scaled: bool, num_in: int, gemm_in: tuple,
            lay: _Layout, nb: int, nb_copy: int, copy_stages: int, gemm_kw: dict, n_comm: int,
            n_copy: int, n_join: int, num_sms: int, num_chunks: int, recv_chunk_rows: int,
            axis_name, num_peers: int):
  """refs: [scale], the GEMM's other inputs (num_in), then the outputs: unique (peers
  write into it), recv (the GEMM's lhs) and the GEMM's outputs."""
  scale_gmem, refs = (refs[0], refs[1:]) if scaled else (None, refs)
  inputs, (unique_gmem, recv_gmem), gemm_outs = (refs[:num_in], refs[num_in:num_in + 2],
                                                 refs[num_in + 2:])
  c = lax.axis_index("sm")
  arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((lay.num_groups,)))
  chunk_sem = pl.get_global(plgpu.SemaphoreType.REGULAR((num_chunks,)))
  ct = x_gmem.shape[2]

  copy = functools.partial(_copy_role, work_gmem, unique_gmem, scale_gmem, recv_gmem, arrived,
                           chunk_sem, lay=lay, nb=nb_copy, n_copy=n_copy, n_join=n_join,
                           expected=num_peers * n_comm, axis_name=axis_name,
                           stages=copy_stages)

  @pl.when(c < n_comm)
  def _transfer():
    _scoped(functools.partial(_transfer_role, work_gmem, x_gmem, unique_gmem, arrived,
                              lay=lay, nb=nb, n_comm=n_comm, axis_name=axis_name,
                              num_peers=num_peers, sweep=not n_join), x_gmem.dtype, nb, ct)
    if n_join:
      # then the copies of the chunks from join_chunk on (their own SMEM scope), before
      # the sweep: each waits only for its groups, signalled by every transfer CTA before
      # its own copies or sweep; the sweep last
      _scoped(functools.partial(copy, cc=n_copy + c, joining=True), x_gmem.dtype, nb_copy, ct,
              copy_stages)

      @pl.when(lax.axis_index("wg") == 0)
      def _():
        fdg.final_sweep(arrived, units=lay.num_groups, n_comm=n_comm, num_peers=num_peers)

  @pl.when((c >= n_comm) & (c < n_comm + n_copy))
  def _copy():
    _scoped(functools.partial(copy, cc=c - n_comm, joining=False), x_gmem.dtype, nb_copy, ct,
            copy_stages)

  @pl.when(c >= n_comm + n_copy)
  def _gemm():
    join_chunk = work_gmem[lay.live_chunks_at + 2]

    def wait_rows(load_row):   # invariant on return: rows of chunk load_row // B written
      k = load_row // recv_chunk_rows
      plgpu.semaphore_wait(chunk_sem.at[k], copiers(k, join_chunk, n_copy, n_join),
                           decrement=False)

    gg._row_tiled_kernel(plan_gmem, recv_gmem, *(inputs[i] for i in gemm_in), *gemm_outs,
                         cta_offset=n_comm + n_copy, num_ctas=num_sms - n_comm - n_copy,
                         before_tile=wait_rows, lhs_col_tile=ct, **gemm_kw)


def validate(*, out_rows: int, hidden: int, ffn: int, num_local_experts: int, num_groups: int,
             dtype, kernel: KernelConfig, fused: FusedConfig, n_copy: int,
             smem: Optional[int] = None, mode: str = "swiglu"):
  """Static checks of one launch with the derived sizes: (Kernel A's `_Static` for the
  GEMM role, ct, (nb of the transfer role, nb of the copy role)). Raises ValueError."""
  num_sms = device_lib.num_sms(kernel.num_sms)
  if n_copy < 1:
    raise ValueError(f"the expansion needs at least one copy CTA, got {n_copy}")
  if fused.n_comm + n_copy >= num_sms:
    raise ValueError(f"n_comm={fused.n_comm} transfer + {n_copy} copy CTAs must leave GEMM "
                     f"CTAs on the {num_sms} SMs")
  if num_groups < 1 or num_local_experts % num_groups:
    raise ValueError(f"{num_groups} send groups must divide the {num_local_experts} local "
                     f"experts (UniEPConfig.dedup_send_groups)")
  # the GEMM role: Kernel A's checks (block_m | B, H | block_k, SMEM) on the CTAs left;
  # block_m is a multiple of 64, so B is one of the copy's ITEM_ROWS too
  st = fdg.validate(out_rows=out_rows, hidden=hidden, ffn=ffn,
                    num_local_experts=num_local_experts, dtype=dtype, kernel=kernel,
                    transfer=TransferConfig(),
                    fused=FusedConfig(n_comm=fused.n_comm + n_copy,
                                      recv_chunk_rows=fused.recv_chunk_rows),
                    smem=smem, mode=mode)
  ct, nb, nb_copy = column_blockings(
      hidden, jnp.dtype(dtype).itemsize, fused.overlap_copy_stages,
      device_lib.smem_capacity() if smem is None else smem)
  if ct % kernel.block_k:
    raise ValueError(f"the rows' TMA box width {ct} (H={hidden}) must be a multiple of "
                     f"block_k={kernel.block_k}: the GEMM reads the receive layout through it")
  return st, ct, (nb, nb_copy)


def _launch(x, dplan, index, live, group_sizes, inputs: tuple, *, scale, gemm_in: tuple,
            out_shapes: tuple, name: str, st, ct: int, nb: tuple, axis_name: str,
            kernel: KernelConfig, fused: FusedConfig, n_copy: int, zero_window):
  t, hidden = x.shape
  r = dplan.unique_counts.shape[0]
  rank = lax.axis_index(axis_name)
  seg = send_segments(dplan)
  work, lay = build_work(dplan.unique_tokens, *seg, index, live, group_sizes, rank=rank,
                         tokens=t, out_rows=st.m_p, recv_chunk_rows=fused.recv_chunk_rows,
                         join_percent=fused.overlap_join_percent)
  plan = gg._row_tile_plan(group_sizes, st.m_p, kernel.block_m, zero_window)
  scaled = scale is not None
  # (slack: the items are 16-row aligned inside M_p, so no weight past M_p is read)
  scale_in = (jnp.pad(scale, (0, st.m_p + ITEM_ROWS - scale.shape[0])),) if scaled else ()
  body = functools.partial(
      _kernel, scaled=scaled, num_in=len(inputs), gemm_in=gemm_in, lay=lay, nb=nb[0],
      nb_copy=nb[1], copy_stages=fused.overlap_copy_stages, gemm_kw=st.gemm_kw,
      n_join=fused.n_comm if fused.overlap_join_percent else 0, n_comm=fused.n_comm,
      n_copy=n_copy, num_sms=st.num_sms,
      num_chunks=st.num_chunks, recv_chunk_rows=fused.recv_chunk_rows, axis_name=axis_name,
      num_peers=r)
  # unique and recv as [rows, H / ct, ct]: the copies store whole rows as one box each,
  # the GEMM reads recv's [block_m, block_k] blocks through the same view (lhs_col_tile)
  (m_p, _), *gemm_shapes = out_shapes
  out_type = ((jax.ShapeDtypeStruct((r * t, hidden // ct, ct), x.dtype),
               jax.ShapeDtypeStruct((m_p, hidden // ct, ct), x.dtype))
              + tuple(jax.ShapeDtypeStruct(shape, x.dtype) for shape in gemm_shapes))
  kernel_fn = plgpu.kernel(
      body, kernel_name=name, out_type=out_type, grid=(st.num_sms,), grid_names=("sm",),
      num_threads=gg._NUM_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup))
  _, recv, *outs = kernel_fn(work, plan, x.reshape(t, hidden // ct, ct), *scale_in, *inputs)
  return (recv.reshape(m_p, hidden), *outs)


def _checked(x, dplan, index, group_sizes, *, out_rows: int, ffn: int, kernel, fused, n_copy,
             mode: str):
  t, hidden = x.shape
  if dplan.unique_send_group_ends.shape[1] != dplan.send_groups:
    raise ValueError(f"dplan has {dplan.unique_send_group_ends.shape[1]} send-group ends for "
                     f"send_groups={dplan.send_groups}")
  if index.shape != (out_rows,):
    raise ValueError(f"index must be [{out_rows}] (a packed unique row per receive row), got "
                     f"{index.shape}")
  return validate(out_rows=out_rows, hidden=hidden, ffn=ffn,
                  num_local_experts=group_sizes.shape[0], num_groups=dplan.send_groups,
                  dtype=x.dtype, kernel=kernel, fused=fused, n_copy=n_copy, mode=mode)


def dedup_dispatch_gate_up(x, dplan, index, live, group_sizes, w_gate_up, *, out_rows: int,
                           axis_name: str, kernel: KernelConfig = KernelConfig(),
                           fused: FusedConfig = FusedConfig(), n_copy: int = 16,
                           zero_window: Optional[int] = None):
  """The forward's de-duplicated dispatch, expansion and gate/up GEMM in one launch. Inside
  `shard_map` over `axis_name` (size R); GPU only.

  x [T, H]: this rank's tokens; dplan: its `DedupPlan` (send_groups G); index [out_rows]:
  `dedup.packed_unique_index`; live: this rank's live receive rows (plan.num_received);
  group_sizes [El]: rows per local expert of this rank's receive layout; w_gate_up
  [El, H, 2F]. Returns (recv [M_p, H], a, h, u [M_p, F_p]) as Kernel A
  (`fused_dispatch_gemm.fused_dispatch_gate_up`): recv rows >= live undefined."""
  el, w_hidden, two_f = w_gate_up.shape
  if two_f % 2 or w_hidden != x.shape[1] or el != group_sizes.shape[0]:
    raise ValueError(f"w_gate_up {w_gate_up.shape} must be [El={group_sizes.shape[0]}, "
                     f"H={x.shape[1]}, 2F]")
  if w_gate_up.dtype != x.dtype:
    raise ValueError(f"x {x.dtype} and w_gate_up {w_gate_up.dtype} must share one dtype")
  st, ct, nb = _checked(x, dplan, index, group_sizes, out_rows=out_rows, ffn=two_f // 2,
                        kernel=kernel, fused=fused, n_copy=n_copy, mode="swiglu")
  outs = ((st.m_p, x.shape[1]),) + ((st.m_p, st.f_p),) * 3
  return _launch(x, dplan, gg._pad_axis(index, 0, st.m_p), live, group_sizes,
                 (gg._pad_gate_up(w_gate_up, st.f_p),), scale=None, gemm_in=(0, 0),
                 out_shapes=outs, name="dedup_dispatch_gate_up", st=st, ct=ct, nb=nb,
                 axis_name=axis_name, kernel=kernel, fused=fused, n_copy=n_copy,
                 zero_window=zero_window)


def dedup_dispatch_dswiglu(dy, dplan, index, scale, live, group_sizes, w_down, h, u, *,
                           out_rows: int, axis_name: str, kernel: KernelConfig = KernelConfig(),
                           fused: FusedConfig = FusedConfig(), n_copy: int = 16,
                           zero_window: Optional[int] = None):
  """The backward's twin: dy's de-duplicated dispatch, the weighted expansion (receive row
  p = dtype(scale[p] * f32(dy row)), `dedup.recv_weights`) and da = dy_recv @ w_down^T with
  the SwiGLU derivative in its epilogue ("dswiglu"), one launch. Returns (dy_recv [M_p, H],
  dhu [M_p, 2 F_p]) as `fused_dispatch_gemm.fused_dispatch_dswiglu`. GPU only."""
  el, ffn, w_hidden = w_down.shape
  if w_hidden != dy.shape[1] or el != group_sizes.shape[0]:
    raise ValueError(f"w_down {w_down.shape} must be [El={group_sizes.shape[0]}, F, "
                     f"H={dy.shape[1]}]")
  if scale.shape != (out_rows,) or scale.dtype != jnp.float32:
    raise ValueError(f"scale must be float32 [{out_rows}], got {scale.dtype} {scale.shape}")
  if any(a.dtype != dy.dtype for a in (w_down, h, u)):
    raise ValueError(f"dy, w_down, h, u must share one dtype, got {dy.dtype}, {w_down.dtype}, "
                     f"{h.dtype}, {u.dtype}")
  st, ct, nb = _checked(dy, dplan, index, group_sizes, out_rows=out_rows, ffn=ffn,
                        kernel=kernel, fused=fused, n_copy=n_copy, mode="dswiglu")
  if h.shape != (st.m_p, st.f_p) or u.shape != (st.m_p, st.f_p):
    raise ValueError(f"h {h.shape} and u {u.shape} must be [M_p, F_p] = {(st.m_p, st.f_p)}")
  outs = ((st.m_p, dy.shape[1]), (st.m_p, 2 * st.f_p))
  return _launch(dy, dplan, gg._pad_axis(index, 0, st.m_p), live, group_sizes,
                 (gg._pad_axis(w_down, 1, st.f_p), h, u), scale=scale, gemm_in=(0, 1, 2),
                 out_shapes=outs, name="dedup_dispatch_dswiglu", st=st, ct=ct, nb=nb,
                 axis_name=axis_name, kernel=kernel, fused=fused, n_copy=n_copy,
                 zero_window=zero_window)


# ----------------------------------------------------------------------------
# Local form (CPU interpret mode): the transfer and copy roles as two launches
# ----------------------------------------------------------------------------


def transfer_copy_local(src, unique_tokens, seg_src, seg_dst, seg_len, index, live, group_sizes,
                        *, unique_rows: int, out_rows: int, recv_chunk_rows: int, rank: int = 0,
                        scale=None, n_comm: int = 2, n_copy: int = 2, copy_stages: int = 2,
                        join_percent: int = 0, interpret=None):
  """The two data-moving roles in the fused kernel's launch shape, every peer offset's
  rows landing in this device's [unique_rows, H] buffer (launch 1, the transfer role),
  then recv [out_rows, H] = that buffer's rows by `index`, weighted if `scale` (launch 2,
  the copy role), chunk by chunk; no semaphores, so both run in the CPU interpret mode.
  join_percent: the transfer CTAs' share of the later chunks' copies (CTAs n_copy ..
  n_copy + n_comm - 1 of launch 2 play them). Returns (unique, recv); recv rows >= live
  undefined."""
  ns, hidden = src.shape
  ct, nb, nb_copy = column_blockings(hidden, jnp.dtype(src.dtype).itemsize, copy_stages,
                                     device_lib.smem_capacity())
  work, lay = build_work(unique_tokens, seg_src, seg_dst, seg_len, index, live, group_sizes,
                         rank=rank, tokens=ns, out_rows=out_rows,
                         recv_chunk_rows=recv_chunk_rows, join_percent=join_percent)
  num_peers = seg_len.shape[0]
  interpret = gg.resolve_interpret(interpret)
  launch = functools.partial(
      plgpu.kernel, num_threads=gg._NUM_COMPUTE_WGS + 1, thread_name="wg",
      compiler_params=plgpu.CompilerParams(lowering_semantics=plgpu.LoweringSemantics.Warpgroup),
      interpret=interpret)

  def transfer_body(work_gmem, src_gmem, unique_gmem):
    _scoped(functools.partial(_transfer_role, work_gmem, src_gmem, unique_gmem, None,
                              lay=lay, nb=nb, n_comm=n_comm,
                              axis_name=None, num_peers=num_peers), src_gmem.dtype, nb, ct)

  unique = launch(transfer_body, kernel_name="dedup_transfer_local", grid=(n_comm,),
                  grid_names=("sm",),
                  out_type=jax.ShapeDtypeStruct((unique_rows, hidden // ct, ct), src.dtype))(
      work, src.reshape(ns, hidden // ct, ct))
  scaled = scale is not None
  scale_in = (jnp.pad(scale, (0, out_rows + ITEM_ROWS - scale.shape[0])),) if scaled else ()

  n_join = n_comm if join_percent else 0

  def copy_body(work_gmem, unique_gmem, *refs):
    scale_gmem, (recv_gmem,) = (refs[0], refs[1:]) if scaled else (None, refs)
    c = lax.axis_index("sm")
    for joining, lo, hi in ((False, 0, n_copy), (True, n_copy, n_copy + n_join)):
      @pl.when((c >= lo) & (c < hi))
      def _(joining=joining):
        _scoped(functools.partial(_copy_role, work_gmem, unique_gmem, scale_gmem, recv_gmem,
                                  None, None, cc=c, lay=lay, nb=nb_copy, n_copy=n_copy,
                                  n_join=n_join, joining=joining, expected=0, axis_name=None,
                                  stages=copy_stages),
                src.dtype, nb_copy, ct, copy_stages)

  recv = launch(copy_body, kernel_name="dedup_copy_local", grid=(n_copy + n_join,),
                grid_names=("sm",),
                out_type=jax.ShapeDtypeStruct((out_rows, hidden // ct, ct), src.dtype))(
      work, unique, *scale_in)
  return unique.reshape(unique_rows, hidden), recv.reshape(out_rows, hidden)
