"""EXPERIMENTAL: the de-duplicated dispatch's NVLink transfer and the owner's expansion
of the unique rows into the receive layout, in one launch.

The de-duplicated dispatch (`uniep_jax/dedup.py`, `_dedup_nvlink`) runs two launches:

  unique = ep_transfer.transfer_segments(src -> owners, src_index=unique_tokens)
           each (token, owner) row once into the owner's unique buffer [R*T, H],
           source s's rows packed at unique_recv_offsets[s]
  recv   = row_gather.gather_live_rows(unique, index, live[, scale])
           recv[p] = unique[index[p]] (weighted in the backward) for p < live

The second is serial after the first (4x H200, qwen3-like EP 4, profile run 33: 0.27 ms
forward, 0.29-0.35 ms backward; 3.5x that at H 7168). Here both run in one launch, and
the expansion of source s's rows starts as soon as every transfer CTA of s has stored
them, while the other sources' rows are still in flight: only the last source's
expansion is exposed. Bits: the same rows moved and the same weighted copy expression
as the two launches (`move_items`, `scale`), so the same output bit for bit.

Status (2026-11-28, NOTES_transfer_expand.md): bit for bit on GPUs (EP 2 and 4), off by
default (`TransferConfig.expand_in_transfer`): slower than the two launches at EP 2
(2x H200, qwen3-like fwd+bwd 8.80 -> 9.39 ms: the forward's launch costs what the two
did, the weighted backward's 0.2 ms more); EP 4 not yet timed.

Roles (by CTA index c on "cta")
-------------------------------
  c <  num_ctas            transfer CTAs: `ep_transfer`'s gathered transfer, one peer
                           offset j at a time (order `EXPAND_ORDER`: its own rows first,
                           so their expansion overlaps every remote offset), then a
                           signal to the receiving peer.
  num_ctas <= c < +n_copy  copy CTAs: per offset j (the rows of source me - j), wait
                           until they have landed, then copy them into the receive
                           layout (items of up to GATHER_ITEM_ROWS rows of one
                           (local expert, source) block, loaded by index from the
                           unique buffer, weighted if `scale`, one store ladder each).
  `TransferConfig.expand_last_on_all`: the last offset's copy items (the exposed ones)
  are dealt over all num_ctas + n_copy CTAs; the transfer CTAs join after their last
  signal (`copy_walks`).

Work lists (plain JAX, before the launch; one int32 array)
----------------------------------------------------------
  [R, 3 * Wt + 1] the transfer's (`ep_transfer.work_lists`, row j: peer me + j)
  [R, 3 * Wc + 1] the copies' (`work_lists(sign=-1)`, row j: source me - j; items
                  (p, p, rows) over the (local expert, source) blocks of the receive
                  layout, `layout.return_segments`)
  [Ni]            src_index (the transfer's gathered loads: unique_tokens)
  [N]             index (the copies' loads: the unique-buffer row of receive row p)

Buffers
-------
  unique [R*T, H/ct, ct]  kernel output; PEERS write into it (remote TMA stores).
  recv   [out_rows, H/ct, ct] kernel output, this rank only; rows no copy item covers
                          (>= the live rows) are undefined, as gather_live_rows'.
  SMEM, per role (`pl.run_scoped` in each branch, so the roles share it): 2 stages of
  [16, nb, ct] (`row_gather.column_blocking`, 160 KiB budget) + 2 barriers; the copy
  role `TransferConfig.copy_stages` stages of [16, nb', ct] (nb' the most boxes that fit
  them). The copy role with `scale` reads each row's weight as a scalar from GMEM
  (`move_items`; a TMA box of weights at an item's unaligned first row faulted, NOTES
  2026-11-28).

Synchronisation contract
------------------------
  Launch ordering: as `ep_transfer` (Mosaic GPU's cross-device barrier before the
      launch, skip_device_barrier=False kept): every peer is inside this launch, its
      unique output and zero-filled semaphores exist, before any remote store or signal.
      Semaphores do not persist across launches. Reset: none.
  load_barrier[s] (each role its own): as `ep_transfer`'s gathered form (item rows
      arrivals); stage reuse as `two_stage_copy_loop`.
  arrived[j] (`pl.get_global` REGULAR, [R]): after its items of offset j,
      `wait_smem_to_gmem(0)` (its stores landed), each transfer CTA of rank s signals
      arrived[j] on rank s + j, once per launch, empty or not (a signal orders the
      NVLink writes issued before it):  expected(arrived[j]) = num_ctas, all from
      source me - j.  Consumers: every copy CTA of this rank, before its items of
      offset j (with expand_last_on_all also every transfer CTA, for the last offset,
      after all of its own signals), decrement=False (many waiters; a decrementing
      wait would take the count from the others). Invariant when the wait returns:
      every row of source me - j is in this rank's unique buffer.
  Kernel end: every copy CTA has waited every offset, so every peer's stores into
      this rank's unique buffer have landed, and the copy CTAs' own stores
      (`wait_smem_to_gmem(0)`): recv is complete for the next XLA op.
  Deadlock freedom: transfer CTAs never wait on anything but their own TMA; copy CTAs
      wait only on signals every transfer CTA of every rank sends unconditionally. All
      num_ctas + n_copy CTAs must be resident at once (1 per SM; kernels on other
      streams must leave room: the default 64 + 64 of 132 SMs).
  Open point for the bring-up (as Kernel A's): the copies read the unique buffer with
      TMA loads (async proxy) after an acquire in the generic proxy (the semaphore
      wait); `bench/check_moe_gpu.py` (`_te`) checks the bits on GPUs.

CPU coverage: the local form (`axis_name=None`) runs the two roles as two launches of
the same role bodies (no semaphores; interpret mode): the work lists, both pipelines
and the weighted copy, bit for bit against transfer_segments + gather_live_rows
(tests/test_transfer_expand.py); the communicating kernel's lowering for CUDA.
"""

from __future__ import annotations

import functools

import jax
from jax import lax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from pallas_kernels import device as device_lib
from pallas_kernels.ep_transfer import GATHER_ITEM_ROWS, move_items, peer_ref, work_lists
from pallas_kernels.row_gather import STAGE_BUDGET_BYTES, column_blocking, stage_budget
from uniep_jax.config import TransferConfig


# Bring-up bisection only (bench/transfer_expand_probe.py sets it in a process of its
# own; empty everywhere else): parts of the communicating kernel switched off, to find
# which one faults on a GPU. "no_wait": the copies do not wait for `arrived`;
# "no_signal": the transfer CTAs do not signal (with "no_wait" only); "no_copy": the copy
# CTAs do nothing; "no_moves": the transfer CTAs only signal; "local_stores": every offset's
# rows land in this rank's own buffer (the signals still go to the peers).
BRINGUP: frozenset[str] = frozenset()
BRINGUP_PARTS = ("no_wait", "no_signal", "no_copy", "no_moves", "local_stores")


def check_resident(num_ctas: int, copy_ctas: int, num_sms: int) -> None:
  """Raises ValueError unless the transfer's and the copies' CTAs can all be resident
  (the copies wait on the transfer CTAs' signals: SYNC.md's deadlock argument)."""
  if num_ctas + copy_ctas > num_sms:
    raise ValueError(f"num_ctas={num_ctas} + copy_ctas={copy_ctas} CTAs must all be resident "
                     f"(at most {num_sms} SMs)")


def expand_order(num_peers: int) -> list[int]:
  """The peer offsets in the order both roles walk them: own rows (0) first, so that
  their expansion overlaps every remote offset's transfer."""
  return list(range(num_peers))


def _transfer_role(work_gmem, src_gmem, unique_gmem, arrived, *, t_w: int, item_rows: int,
                   nb: int, num_ctas: int, index_base: int, axis_name, num_peers: int):
  c = lax.axis_index("cta")
  stride = 3 * t_w + 1
  me = lax.axis_index(axis_name) if axis_name is not None else None

  @functools.partial(pl.run_scoped,
                     stage_smem=plgpu.SMEM((2, item_rows, nb, src_gmem.shape[2]),
                                           src_gmem.dtype),
                     load_barrier=plgpu.Barrier(num_arrivals=item_rows, num_barriers=2))
  def _(stage_smem, load_barrier):
    for j in expand_order(num_peers):   # static: the TMA peer id must be host-computable
      base = j * stride
      dst_gmem = peer_ref(unique_gmem, 0 if "local_stores" in BRINGUP else j, me=me,
                          axis_name=axis_name, num_peers=num_peers)
      if "no_moves" not in BRINGUP:
        move_items(work_gmem, src_gmem, dst_gmem, stage_smem, load_barrier, base=base,
                   first_item=0, count=work_gmem[base + 3 * t_w], w=t_w, cta=c,
                   num_ctas=num_ctas, item_rows=item_rows, col_tile=nb, index_base=index_base)
      plgpu.wait_smem_to_gmem(0)   # this CTA's rows of offset j landed
      if axis_name is not None and "no_signal" not in BRINGUP:
        pl.semaphore_signal(arrived.at[j], device_id={axis_name: lax.rem(me + j, num_peers)})


def copy_walks(cta: int, *, role: str, n_copy: int, num_ctas: int, num_peers: int,
               last_on_all: bool):
  """A CTA's share of the copies, as ((first offset, end offset, its index, CTAs dealt
  over), ...): items i, i + n, ... of each offset's copy list. role "copy": CTA `cta` of
  the n_copy copy CTAs, every offset; with last_on_all the last offset (the source whose
  rows land last: its copy is the one left exposed) is dealt over the transfer CTAs too,
  which join it after their transfer (role "transfer", CTA `cta` of num_ctas)."""
  everyone = n_copy + num_ctas
  if role == "transfer":
    return ((num_peers - 1, num_peers, n_copy + cta, everyone),) if last_on_all else ()
  if not last_on_all:
    return ((0, num_peers, cta, n_copy),)
  return ((0, num_peers - 1, cta, n_copy), (num_peers - 1, num_peers, cta, everyone))


def _copy_role(work_gmem, unique_gmem, scale_gmem, recv_gmem, arrived, *, walks, c_base: int,
               c_w: int, item_rows: int, nb: int, index_base: int, expected: int,
               num_peers: int, stages: int = 2):
  """The copies of `walks` (`copy_walks`), in order: per offset j, wait until every row
  of source me - j has landed (`arrived` None: the local form, no wait), then this CTA's
  items of offset j's list."""
  stride = 3 * c_w + 1
  # the weights (with `scale`) are read from GMEM by the copy itself: no SMEM for them
  scratch = dict(stage_smem=plgpu.SMEM((stages, item_rows, nb, unique_gmem.shape[2]),
                                       unique_gmem.dtype),
                 load_barrier=plgpu.Barrier(num_arrivals=item_rows, num_barriers=stages))

  assert expand_order(num_peers) == list(range(num_peers))   # the loops walk j = 0, 1, ..

  @functools.partial(pl.run_scoped, **scratch)
  def _(stage_smem, load_barrier):
    for first, end, cta, dealt in walks:
      def offset(j, carry, cta=cta, dealt=dealt):   # a loop: the copies need no static peer id
        if arrived is not None and "no_wait" not in BRINGUP:   # source me - j's rows landed
          plgpu.semaphore_wait(arrived.at[j], expected, decrement=False)
        base = c_base + j * stride
        move_items(work_gmem, unique_gmem, recv_gmem, stage_smem, load_barrier, base=base,
                   first_item=0, count=work_gmem[base + 3 * c_w], w=c_w, cta=cta,
                   num_ctas=dealt, item_rows=item_rows, col_tile=nb, index_base=index_base,
                   scale=scale_gmem, stages=stages)
        return carry

      lax.fori_loop(first, end, offset, 0)
    plgpu.wait_smem_to_gmem(0)


def _both_roles(work_gmem, src_gmem, *refs, scaled: bool, transfer_kw: dict, copy_kw: dict,
                num_ctas: int, n_copy: int, last_on_all: bool, axis_name, num_peers: int):
  scale_gmem, (unique_gmem, recv_gmem) = (refs[0], refs[1:]) if scaled else (None, refs)
  arrived = pl.get_global(plgpu.SemaphoreType.REGULAR((num_peers,)))
  c = lax.axis_index("cta")
  walks = functools.partial(copy_walks, n_copy=n_copy, num_ctas=num_ctas, num_peers=num_peers,
                            last_on_all=last_on_all)

  @pl.when(c < num_ctas)
  def _():
    _transfer_role(work_gmem, src_gmem, unique_gmem, arrived, num_ctas=num_ctas,
                   axis_name=axis_name, num_peers=num_peers, **transfer_kw)
    if last_on_all:   # after every signal of this CTA: it waits only on other CTAs' signals
      _copy_role(work_gmem, unique_gmem, scale_gmem, recv_gmem, arrived,
                 walks=walks(c, role="transfer"), expected=num_ctas, num_peers=num_peers,
                 **copy_kw)

  @pl.when((c >= num_ctas) & ("no_copy" not in BRINGUP))
  def _():
    _copy_role(work_gmem, unique_gmem, scale_gmem, recv_gmem, arrived,
               walks=walks(c - num_ctas, role="copy"), expected=num_ctas, num_peers=num_peers,
               **copy_kw)


def transfer_expand(src, seg_src, seg_dst, seg_len, copy_start, copy_len, index, *,
                    src_index, unique_rows: int, out_rows: int, scale=None,
                    config: TransferConfig = TransferConfig(), axis_name=None, rank=0,
                    interpret=None):
  """recv [out_rows, H]: the transfer of `src[src_index]`'s segments into the peers'
  [unique_rows, H] buffers, then recv[p] = unique[index[p]] (times scale[p] in float32,
  rounded, if `scale`) for every receive row p a copy segment covers; other rows
  undefined. The same as

    unique = transfer_segments(src, seg_src, seg_dst, seg_len, out_rows=unique_rows,
                               src_index=src_index, ...)
    recv = gather_live_rows(unique, index, live, out_rows=out_rows, scale=scale)

  when the copy segments cover exactly the rows p < live.

  seg_*: [R, S] int32, the transfer's segments for peer p in row p (positions into
  src_index). copy_start/copy_len: [R, El] int32, the receive-layout blocks of the rows
  FROM source s in row s (`layout.return_segments`: src_start, rows). index [N] int32
  (unique-buffer rows), scale [N] float32. config: the transfer's knobs and the copy's
  (copy_ctas, expand_last_on_all). axis_name=None: the local form (every segment
  lands in this device's buffer, `rank` only rotates the order; two launches; runs in
  the CPU interpret mode); otherwise inside a `shard_map` over `axis_name` (GPU only).
  """
  ns, hidden = src.shape
  n = index.shape[0]
  num_peers = seg_len.shape[0]
  if (copy_start.ndim != 2 or copy_start.shape != copy_len.shape
      or copy_start.shape[0] != num_peers):
    raise ValueError(f"copy_start {copy_start.shape} and copy_len {copy_len.shape} must be "
                     f"[R={num_peers}, El] (one row per source rank)")
  if index.ndim != 1 or n > out_rows:
    raise ValueError(f"index must be [N] with N <= out_rows={out_rows}, got {index.shape}")
  if scale is not None and (scale.shape != (n,) or scale.dtype != jnp.float32):
    raise ValueError(f"scale must be float32 [{n}] like index, got {scale.dtype} {scale.shape}")
  itemsize = jnp.dtype(src.dtype).itemsize
  item_rows = min(config.chunk_rows, GATHER_ITEM_ROWS)
  ct, nb = column_blocking(hidden, itemsize, item_rows,
                           min(STAGE_BUDGET_BYTES, device_lib.smem_capacity()),
                           max_col_tile=config.col_tile)
  # the copy role's column blocks: config.copy_stages stages of its own (the same ct)
  stages = config.copy_stages
  _, nb_copy = column_blocking(hidden, itemsize, item_rows,
                               stage_budget(stages, device_lib.smem_capacity()),
                               max_col_tile=config.col_tile, stages=stages)
  boxes = hidden // ct
  num_ctas = min(config.num_ctas, device_lib.num_sms())
  n_copy = min(config.copy_ctas, device_lib.num_sms())
  if axis_name is not None:
    rank = lax.axis_index(axis_name)
    check_resident(num_ctas, n_copy, device_lib.num_sms())
  t_lists = work_lists(seg_src, seg_dst, seg_len, rank=rank, src_rows=src_index.shape[0],
                       chunk_rows=item_rows)
  c_lists = work_lists(copy_start, copy_start, copy_len, rank=rank, src_rows=n,
                       chunk_rows=item_rows, sign=-1)
  t_w, c_w = (t_lists.shape[1] - 1) // 3, (c_lists.shape[1] - 1) // 3
  c_base = t_lists.size
  t_index_base = c_base + c_lists.size
  c_index_base = t_index_base + src_index.shape[0]
  work = jnp.concatenate([t_lists.reshape(-1), c_lists.reshape(-1),
                          src_index.astype(jnp.int32), index.astype(jnp.int32)])
  src3 = src.reshape(ns, boxes, ct)
  scaled = scale is not None
  # an item's weights are read for all item_rows stage rows, past its end too
  scale_in = (jnp.pad(scale, (0, item_rows)),) if scaled else ()
  transfer_kw = dict(t_w=t_w, item_rows=item_rows, nb=nb, index_base=t_index_base)
  copy_kw = dict(c_base=c_base, c_w=c_w, item_rows=item_rows, nb=nb_copy,
                 index_base=c_index_base, stages=stages)
  last_on_all = config.expand_last_on_all
  unique_type = jax.ShapeDtypeStruct((unique_rows, boxes, ct), src.dtype)
  recv_type = jax.ShapeDtypeStruct((out_rows, boxes, ct), src.dtype)
  name = "transfer_expand" + ("_scaled" if scaled else "")
  if interpret is None:
    interpret = device_lib.default_interpret()

  if axis_name is None:   # two launches of the role bodies, no semaphores
    def transfer_body(work_gmem, src_gmem, unique_gmem):
      _transfer_role(work_gmem, src_gmem, unique_gmem, None, num_ctas=num_ctas,
                     axis_name=None, num_peers=num_peers, **transfer_kw)

    def copy_body(work_gmem, unique_gmem, *refs):
      # the communicating form's dealing: CTAs [0, n_copy) as its copy CTAs, the rest
      # (with last_on_all) as its transfer CTAs joining the last offset
      scale_gmem, (recv_gmem,) = (refs[0], refs[1:]) if scaled else (None, refs)
      c = lax.axis_index("cta")
      for role, lo, hi in (("copy", 0, n_copy), ("transfer", n_copy, n_copy + num_ctas)):
        @pl.when((c >= lo) & (c < hi))
        def _(role=role, lo=lo):
          _copy_role(work_gmem, unique_gmem, scale_gmem, recv_gmem, None,
                     walks=copy_walks(c - lo, role=role, n_copy=n_copy, num_ctas=num_ctas,
                                      num_peers=num_peers, last_on_all=last_on_all),
                     expected=0, num_peers=num_peers, **copy_kw)

    unique = plgpu.kernel(transfer_body, kernel_name=name + "_transfer", out_type=unique_type,
                          grid=(num_ctas,), grid_names=("cta",), interpret=interpret)(work, src3)
    recv = plgpu.kernel(copy_body, kernel_name=name + "_copy", out_type=recv_type,
                        grid=(n_copy + (num_ctas if last_on_all else 0),), grid_names=("cta",),
                        interpret=interpret)(work, unique, *scale_in)
    return recv.reshape(out_rows, hidden)

  if interpret:
    raise ValueError("the communicating transfer_expand needs a GPU (remote refs and "
                     "semaphores do not run in the interpret mode); use axis_name=None")
  body = functools.partial(_both_roles, scaled=scaled, transfer_kw=transfer_kw,
                           copy_kw=copy_kw, num_ctas=num_ctas, n_copy=n_copy,
                           last_on_all=last_on_all, axis_name=axis_name, num_peers=num_peers)
  _, recv = plgpu.kernel(body, kernel_name=name, out_type=(unique_type, recv_type),
                         grid=(num_ctas + n_copy,), grid_names=("cta",),
                         interpret=interpret)(work, src3, *scale_in)
  return recv.reshape(out_rows, hidden)
