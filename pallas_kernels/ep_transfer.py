"""Row segments pushed over NVLink from inside a Pallas Mosaic GPU kernel.

The transport of the `"uniep"` backend: each EP rank writes its token rows
straight into the owner's buffer at the offsets of the deterministic receive
layout (computed by the caller from the routing), and the owners write the expert outputs straight
back. No staging buffer, no NCCL, and no atomics: every row's destination is
computed from the routing before the launch, so arrival order cannot change
where anything lands.

Problem
-------
  src       [Ns, H]  this rank's rows (sorted rows for a dispatch, the receive
                     layout for a return)
  segments  S of them: (src_start, dst_start, rows, peer): copy
            src[src_start : src_start + rows] to out[dst_start : ...] ON `peer`
  out       [Nd, H]  the kernel's output; peers write into it (collective
                     metadata mode: one process drives all local GPUs, and XLA
                     gives a kernel output the same address on every device).
Rows of `out` that no segment covers are left untouched (their contents are
undefined); callers that need zeros there write them (see `push_rows`).

Work list and tiling
--------------------
Segments come as [R, El] tables indexed by (peer, local expert). Before the
launch, plain JAX rotates them so that row j holds the segments for peer
(me + j) mod R, and cuts each row's segments into chunks of `chunk_rows` rows
(the last chunk of a segment may be shorter): per peer offset j at most
W = cdiv(Ns, chunk_rows) + El items of (src_row, dst_row, rows), plus the live
count. Nothing is unrolled over segments: compile time does not depend on El.

The kernel loops over the peer offsets j = 1, ..., R-1, 0 STATICALLY (the
remote peers first, its own rows last): a TMA descriptor for a peer's buffer is
built on the host, so the peer id must be an arithmetic function of the device
id, never a value loaded from memory. At offset j every rank r writes to rank
r + j, so every NVLink carries traffic in both directions at once.

Grid: `num_ctas` CTAs ("cta"), one warpgroup each. For each peer offset, CTA c
takes items c, c + num_ctas, ... of that offset's list. An item is moved column
tile by column tile
([chunk_rows, col_tile], col_tile <= 256, the TMA box limit):

    GMEM src --TMA load--> SMEM stage s --TMA store ladder--> (peer) GMEM out

SMEM: `stages` (= 2) buffers of [chunk_rows, col_tile] in the src dtype, no
swizzle (a store may start at any row of the buffer). 2 x 128 x 256 x 2 B =
128 KiB for the default bf16 config. (Gathered: 2 x [16, nb, ct], below.)

A chunk of `rows` < chunk_rows rows is stored with one TMA per set bit of
`rows` (largest first), so rows outside the segment are never written: two
sources write adjacent segments of one peer's buffer without overlap.

Gathered sources (`src_index`: the de-duplicated dispatch's rows): the segments
index positions of an int32 index (appended behind the work lists in the same GMEM
array) and item row i is src[index[src_row + i]]. Tiling: src and out viewed 3-D,
[rows, H / ct, ct] (ct <= col_tile, `row_gather.column_blocking`), items of
min(chunk_rows, GATHER_ITEM_ROWS = 16) rows x one column block of nb boxes (nb * ct = H
unless two stages of [16, nb, ct] would not fit in 160 KiB: bf16 H 2048 -> one block of
8 boxes, 64 KiB per stage; H 7168 -> 4 blocks of 7); one [1, nb, ct] TMA load per row
(GATHER_UNROLL per loop iteration; a short item loads its last row again into the
unused stage rows, which the ladder never stores), one ladder of [rows, nb, ct] stores.
A step's stores (one bulk-async group) are issued before the next step's loads
(`tma.two_stage_copy_loop(stores_first=True)`: the loads take long to issue; the stores
stay in flight meanwhile). It saves the de-duplicated dispatch's separate gather into a contiguous
send buffer (`row_gather.gather_live_rows`: one HBM write and read of every send row).
Why whole rows per box: gathered loads of [1, col_tile] boxes into the plain tiling's
[128, 256] stage take 8 TMA loads per row at H 2048 (28 at H 7168) and make the
transfer ~27% slower (qwen3-like EP 4, 4x H200: 1.16 -> 1.47 ms per call for the two
dispatches), more than the 0.25 ms the separate gather costs (docs/decisions.md).

Synchronisation contract
------------------------
  Launch ordering (what makes writing into a peer's output safe at all):
      `pl.get_global` semaphores are NOT persistent: Pallas allocates them as
      GMEM scratch that XLA zero-fills right before each launch. A peer's
      output buffer and semaphores exist only once the peer is inside this
      launch. Mosaic GPU's cross-device barrier before every communicating
      kernel (`CompilerParams.skip_device_barrier=False`, the default, which
      this kernel keeps; tests/test_ep_transfer.py checks the default) makes
      every rank enter the launch before any rank writes or signals. Without
      it the first remote signal or store could hit memory a slower peer has
      not yet zero-filled or still uses for something else.
  load_barrier[s]  (SMEM barrier, one per stage): producer the TMA load of
      step i into stage s = i % 2 (gathered: its item's 16 row loads, each one
      arrival; num_arrivals = the item rows); consumer the same CTA's store of step i,
      after `barrier_wait`. Every load is waited exactly once (phase flips).
  stage reuse: before loading step i + 1 into stage 1 - s, and before the
      first load of the next peer offset, the CTA waits
      `wait_smem_to_gmem(0, wait_read_only=True)`: earlier stores have
      finished reading the stage. (Gathered: step i's stores are issued first, as
      one group, and the wait is `wait_smem_to_gmem(1, wait_read_only=True)`:
      only step i's group may still read SMEM, not stage 1 - s.)
  ready_sem[c]  (per CTA index, communicating mode only): at entry CTA c
      signals ready_sem[c] on every rank (itself included) and waits for R
      with decrement. Given the device barrier this round is redundant; it is
      kept as the in-kernel statement of the invariant "every peer runs this
      launch" (cost: R signals per CTA).
  done_sem[c]  (per CTA index): after `wait_smem_to_gmem(0)` (all of CTA c's
      stores complete), CTA c signals done_sem[c] on every rank, then waits for
      R signals with decrement. A signal orders the NVLink writes issued before
      it. Invariant when the kernel ends (all CTAs past this wait): every
      peer's CTA c, for every c, has finished writing into this rank's `out`,
      so the next XLA op may read it.
  Each semaphore has exactly one waiter (CTA c waits only on index c), so no
  CTA can take another's count. All ranks launch the same num_ctas <= the SM
  count. The waits need all CTAs of all ranks resident at once: kernels that
  other streams run concurrently (NCCL, async collectives) must leave room,
  hence the default of 64 CTAs (about half the SMs).
The local (non-communicating) form has no semaphores and writes every peer
offset's segments into this device's `out`: it runs in the CPU interpret mode,
so the work lists, the pipelines and the store ladder are tested on the CPU.
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
from pallas_kernels.ragged import enumerate_runs
from pallas_kernels.row_gather import check_rows_fit, column_blocking, rows_fit, scale_stage_rows
from pallas_kernels.tma import copy_loop, ladder_store, load_rows_by_index


@dataclasses.dataclass(frozen=True)
class TransferConfig:
  """The in-kernel NVLink row transfer (the knobs the autotuner searches; no field
  changes a bit: rows are moved, not computed).

  chunk_rows: rows per work item, a power of two (the store ladder's largest step).
    Larger: fewer, bigger TMAs; smaller: finer load balance over CTAs. Gathered
    sources (`src_index`) take items of min(chunk_rows, GATHER_ITEM_ROWS) rows.
  col_tile: columns per TMA box (<= 256, the TMA box limit); the widest divisor of H
    that is at most this and fits the stages is used (`col_tile_for`).
  num_ctas: CTAs that move rows. About half the SMs saturate NVLink; all of them must
    be resident at once (the kernel's cross-rank waits), so leave room for kernels
    that other streams run beside it.
  """

  chunk_rows: int = 128
  col_tile: int = 256
  num_ctas: int = 64

  def __post_init__(self):
    if self.chunk_rows < 1 or self.chunk_rows & (self.chunk_rows - 1):
      raise ValueError(f"chunk_rows={self.chunk_rows} must be a power of two")
    if not 8 <= self.col_tile <= 256 or self.col_tile % 8:
      raise ValueError(f"col_tile={self.col_tile} must be a multiple of 8 in [8, 256] "
                       f"(the TMA box limit)")
    if self.num_ctas < 1:
      raise ValueError(f"num_ctas={self.num_ctas} must be >= 1")

  def rows_fit(self, hidden: int, itemsize: int = 2, smem_bytes: int | None = None) -> bool:
    """Whether the transfer runs rows of `hidden` elements on a GPU: whole rows and the
    column tile it picks meet `row_gather.ROW_ALIGN_BYTES`."""
    try:
      tile = self.col_tile_for(hidden, itemsize, smem_bytes)
    except ValueError:
      return False
    return rows_fit(hidden, itemsize) and rows_fit(tile, itemsize)

  def smem_bytes(self, itemsize: int = 2) -> int:
    return 2 * self.chunk_rows * self.col_tile * itemsize

  def col_tile_for(self, hidden: int, itemsize: int = 2, smem_bytes: int | None = None) -> int:
    """The widest column tile <= col_tile that divides `hidden`, is a multiple of 8 and,
    with 2 stages of chunk_rows rows, fits in `smem_bytes` of shared memory (e.g. float32
    rows get half the bf16 tile)."""
    t = self.col_tile
    while t >= 8:
      fits = smem_bytes is None or 2 * self.chunk_rows * t * itemsize <= smem_bytes
      if hidden % t == 0 and fits:
        return t
      t -= 8
    raise ValueError(
        f"no column tile fits: hidden={hidden} needs a divisor that is a multiple of 8 and "
        f"<= col_tile={self.col_tile}, and 2 * chunk_rows={self.chunk_rows} * tile * "
        f"{itemsize} B must fit in {smem_bytes} B of shared memory (lower chunk_rows)")


# Gathered loads (`src_index`): rows per work item (the store ladder's largest step;
# min(chunk_rows, this)), and row loads issued per loop iteration (the index reads of one
# iteration are independent, so their latencies overlap; a fully unrolled 128-row item
# takes 185 s to compile for the qwen3-like layer, against 76 s with this loop)
GATHER_ITEM_ROWS = 16
GATHER_UNROLL = 16


def work_lists(seg_src, seg_dst, seg_len, *, rank, src_rows: int, chunk_rows: int,
               sign: int = 1):
  """Per peer offset j (row j: peer (rank + sign * j) mod R), the chunk items.

  seg_*: [R, El] int32 indexed by (peer, local expert). Returns int32
  [R, 3 * W + 1]: src_row[W], dst_row[W], rows[W], live item count. sign -1: row j
  is the peer that sends to this rank at offset j (lists of what this rank receives).
  """
  r, el = seg_len.shape
  w = pl.cdiv(src_rows, chunk_rows) + el
  peer_of_row = lax.rem(rank + sign * jnp.arange(r, dtype=jnp.int32) + r * r, r)
  rot = lambda a: jnp.take(a.astype(jnp.int32), peer_of_row, axis=0)  # noqa: E731
  seg_src, seg_dst, seg_len = rot(seg_src), rot(seg_dst), rot(seg_len)

  def one(src, dst, length):
    chunks = (length + chunk_rows - 1) // chunk_rows                # [El]
    seg, j, valid = enumerate_runs(chunks, w)
    z = lambda a: jnp.where(valid, a, 0).astype(jnp.int32)  # noqa: E731
    rows = z(jnp.minimum(chunk_rows, length[seg] - j * chunk_rows))
    return jnp.concatenate([z(src[seg] + j * chunk_rows), z(dst[seg] + j * chunk_rows), rows,
                            jnp.sum(chunks, keepdims=True).astype(jnp.int32)])

  return jax.vmap(one)(seg_src, seg_dst, seg_len)


def move_items(work_gmem, src_gmem, dst_gmem, stage_smem, load_barrier, *, base, first_item,
               count, w: int, cta, num_ctas: int, item_rows: int, col_tile: int,
               index_base: int | None = None, scale=None, stages: int = 2):
  """One CTA's share of `count` items of a work list: items first_item + cta,
  first_item + cta + num_ctas, ... of the list at work_gmem[base:] (layout of
  `work_lists`: src_row at [base + i], dst_row at [base + w + i], rows at
  [base + 2w + i]), each moved column tile by column tile through the two SMEM
  stages into `dst_gmem` (local or a peer's `remote_ref`) with the store ladder.
  Shared by this kernel (and, through `_transfer_body`, `wgrad_return.py`) and by
  `down_gemm_return.py`'s chunk loop.

  index_base: None: an item's rows are src rows src_row .. src_row + rows - 1, one
  [item_rows, col_tile] TMA load (2-D refs; col_tile: columns per step). Else the rows
  are gathered (3-D refs: src/dst [rows, H / ct, ct], the stage [2, item_rows, nb, ct],
  `col_tile` = nb, boxes per step): item row i is src row
  work_gmem[index_base + src_row + i], one [1, nb, ct] TMA load per row (all nb * ct
  columns of a column block in one box), GATHER_UNROLL per loop iteration (item_rows
  loads per step; rows past the item's end load its last row again and are never
  stored; load_barrier must count item_rows arrivals).
  scale (gathered only; no kernel of this package passes it): None, or scale_gmem
  (float32 [N + item_rows], padded): item row i is stored as
  (scale[src_row + i] * f32(row)).astype(dtype), `row_gather.gather_live_rows`'s
  weighted copy, bit for bit (the same helper, `row_gather.scale_stage_rows`), each
  weight read as a scalar from GMEM. (Not a box of weights in SMEM by TMA, as
  gather_live_rows loads them: that faults with CUDA_ERROR_ILLEGAL_INSTRUCTION on an
  H200, because an item's first row is any position, so the box starts at any 4-byte
  offset, where gather_live_rows' tiles start at multiples of 16 rows.)
  stages: SMEM stages (stage_smem's and load_barrier's leading dimension; `tma.copy_loop`);
  every kernel here uses 2."""
  if scale is not None and index_base is None:
    raise ValueError("move_items: scale needs the gathered form (index_base)")
  ns, width = src_gmem.shape[:2]      # width: columns (2-D) or boxes (3-D) per row
  n_col = width // col_tile
  steps = (jnp.maximum(count - cta + num_ctas - 1, 0) // num_ctas) * n_col

  def item_col(s):
    it = first_item + cta + (s // n_col) * num_ctas
    return base + it, (s % n_col) * col_tile

  def load_row(at):
    # The load box never leaves src: near the end it starts earlier and the
    # item's rows sit further down the stage buffer.
    if index_base is not None:
      return work_gmem[at]        # gathered rows land at stage row 0 ..
    return jnp.minimum(work_gmem[at], ns - item_rows)

  def load(s, stage):
    at, col = item_col(s)
    if index_base is None:
      plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(load_row(at), item_rows), pl.ds(col, col_tile)],
                              stage_smem.at[stage], load_barrier.at[stage])
      return
    first, last = index_base + work_gmem[at], work_gmem[at + 2 * w] - 1
    load_rows_by_index(lambda i: work_gmem[first + jnp.minimum(i, last)], src_gmem,
                       stage_smem.at[stage], load_barrier.at[stage], rows=item_rows,
                       col=col, width=col_tile, unroll=GATHER_UNROLL)

  def store(s, stage):
    at, col = item_col(s)
    if scale is not None:   # the item's weights, scalars read from GMEM
      first = work_gmem[at]
      scale_stage_rows(stage_smem, stage, item_rows, lambda i: scale[first + i])
    ladder_store(stage_smem.at[stage], dst_gmem.at[:, pl.ds(col, col_tile)],
                 work_gmem[at] - load_row(at), work_gmem[at + w], work_gmem[at + 2 * w],
                 item_rows, commit_group=index_base is None)
    if index_base is not None:
      plgpu.commit_smem_to_gmem_group()

  # the gathered loads take long to issue: keep the previous stores in flight meanwhile
  copy_loop(steps, load, store, load_barrier, stages=stages,
            stores_first=index_base is not None)


def peer_ref(out_gmem, j: int, *, me, axis_name, num_peers: int):
  """The buffer that peer offset j writes into: peer (me + j)'s `out_gmem` (a remote
  ref), this device's own for j == 0 or in the local form (axis_name=None)."""
  if axis_name is None or j == 0:
    return out_gmem
  return plgpu.remote_ref(out_gmem, {axis_name: lax.rem(me + j, num_peers)})


def transfer_semaphores(num_ctas: int):
  """The (ready, done) semaphores of `_transfer_body`, one per transfer CTA each."""
  return (pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas,))),
          pl.get_global(plgpu.SemaphoreType.REGULAR((num_ctas,))))


def _transfer_body(work_gmem, src_gmem, out_gmem, stage_smem, load_barrier, *,
                   w: int, chunk_rows: int, col_tile: int, num_ctas: int,
                   axis_name, num_peers: int, cta_axis: str = "cta", sems=None,
                   index_base: int | None = None):
  """One CTA's share of every peer offset's work list. `axis_name=None`: the
  local form (every offset's rows land in this device's `out`). Kernels that embed
  it (`wgrad_return.py`) run it on CTAs [0, num_ctas) of their `cta_axis` and pass
  `sems` (`transfer_semaphores`, allocated at the kernel's top level)."""
  c = lax.axis_index(cta_axis)
  stride = 3 * w + 1
  me = lax.axis_index(axis_name) if axis_name is not None else None

  if axis_name is not None:
    ready_sem, done_sem = transfer_semaphores(num_ctas) if sems is None else sems
    for p in range(num_peers):
      pl.semaphore_signal(ready_sem.at[c], device_id={axis_name: p})
    pl.semaphore_wait(ready_sem.at[c], num_peers)

  for j in list(range(1, num_peers)) + [0]:   # static: remote peers first, own rows last
    base = j * stride
    dst_gmem = peer_ref(out_gmem, j, me=me, axis_name=axis_name, num_peers=num_peers)
    move_items(work_gmem, src_gmem, dst_gmem, stage_smem, load_barrier, base=base,
               first_item=0, count=work_gmem[base + 3 * w], w=w, cta=c, num_ctas=num_ctas,
               item_rows=chunk_rows, col_tile=col_tile, index_base=index_base)

  plgpu.wait_smem_to_gmem(0)

  if axis_name is not None:
    for p in range(num_peers):
      pl.semaphore_signal(done_sem.at[c], device_id={axis_name: p})
    pl.semaphore_wait(done_sem.at[c], num_peers)


def transfer_segments(src, seg_src, seg_dst, seg_len, *, out_rows: int,
                      config: TransferConfig = TransferConfig(), axis_name=None,
                      rank=0, src_index=None, interpret=None):
  """Copies row segments of `src` [Ns, H] into a new [out_rows, H] buffer.

  seg_src/seg_dst/seg_len: [R, El] int32, the segments for peer p in row p.
  axis_name=None: the local form, every segment lands in this device's output
  (`rank` only rotates the order; runs in the CPU interpret mode). Otherwise,
  inside a `shard_map` over `axis_name` (size R): row p's segments land in the
  output of rank p (collective metadata mode; GPU only). Rows that no segment
  covers are undefined.
  src_index: None, or [Ni] int32 in [0, Ns): the segments index the rows
  src[src_index] (a gather the kernel does in its loads, `move_items`) instead of src:
  the same output as `transfer_segments(src[src_index], ...)` without writing the
  gathered rows first.
  """
  ns, hidden = src.shape
  itemsize = jnp.dtype(src.dtype).itemsize
  num_peers = seg_len.shape[0]
  if src_index is None:
    chunk = config.chunk_rows
    col_tile = config.col_tile_for(hidden, itemsize=itemsize,
                                   smem_bytes=device_lib.smem_capacity())
    if ns < chunk:  # the load box must fit inside src
      src = jnp.pad(src, ((0, chunk - ns), (0, 0)))
    stage, step_width, arrivals = (chunk, col_tile), col_tile, 1
    out_shape = (out_rows, hidden)
  else:   # whole rows (or column blocks of nb boxes of ct) per TMA, 3-D views
    chunk = min(config.chunk_rows, GATHER_ITEM_ROWS)
    ct, nb = column_blocking(hidden, itemsize, chunk, max_col_tile=config.col_tile)
    src = src.reshape(ns, hidden // ct, ct)
    stage, step_width, arrivals = (chunk, nb, ct), nb, chunk
    out_shape = (out_rows, hidden // ct, ct)
  num_ctas = min(config.num_ctas, device_lib.num_sms())
  if axis_name is not None:
    rank = lax.axis_index(axis_name)
  src_rows = ns if src_index is None else src_index.shape[0]
  work = work_lists(seg_src, seg_dst, seg_len, rank=rank, src_rows=src_rows, chunk_rows=chunk)
  w = (work.shape[1] - 1) // 3
  work = work.reshape(-1)
  index_base = None
  if src_index is not None:   # the index rides behind the work lists in one int32 array
    index_base = work.shape[0]
    work = jnp.concatenate([work, src_index.astype(jnp.int32)])
  body = functools.partial(_transfer_body, w=w, chunk_rows=chunk, col_tile=step_width,
                           num_ctas=num_ctas, axis_name=axis_name, num_peers=num_peers,
                           index_base=index_base)
  if interpret is None:
    interpret = device_lib.default_interpret()
  if axis_name is not None and interpret:
    raise ValueError("the communicating transfer needs a GPU (remote refs and semaphores "
                     "do not run in the interpret mode); use axis_name=None on the CPU")
  if interpret is False:
    check_rows_fit(hidden, itemsize, "transfer_segments")
    check_rows_fit(stage[-1] * (stage[-2] if src_index is not None else 1), itemsize,
                   "transfer_segments (one TMA box's row)")
  kernel = plgpu.kernel(
      body,
      kernel_name="ep_transfer",
      out_type=jax.ShapeDtypeStruct(out_shape, src.dtype),
      scratch_types=[plgpu.SMEM((2, *stage), src.dtype),
                     plgpu.Barrier(num_arrivals=arrivals, num_barriers=2)],
      grid=(num_ctas,),
      grid_names=("cta",),
      interpret=interpret,
  )
  return kernel(work, src).reshape(out_rows, hidden)
