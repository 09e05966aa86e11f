"""Token de-duplication: the dispatch sends each token once per destination rank.

A token's K experts often share an owner (K=8 over R=4 ranks: ~3.6 distinct
ranks per token), and every expert of one owner gets the same row x[t]. With
`UniEPConfig.dedup_tokens` the dispatch moves one copy per (token, destination
rank), and the owner copies it to the receive layout rows of its experts
(`expand`): the dispatch's bytes drop from T*K rows to sum_d U[me, d] <= T*min(R, K)
rows per rank. The receive layout, and so every later step, is unchanged, row for
row: the bits are those of the plain dispatch (rows are copied, never summed).

The backward pass's dy dispatch (the transpose of the combine) is de-duplicated
the same way (`combine_unique`): the plain combine's backward sends, for every slot,
the row dy_k = dtype(w[t, k] * f32(dy[t])); here each (token, owner) pair's dy[t]
crosses the network once, and the owner forms dy_k for each of its slots itself
with the slot's weight, which the plan's all_gather delivered: the same multiply
and the same rounding, so the same bits. The dispatch's backward (the return of each
slot's dX row, then the sum over the K slots at home in slot order) is the plain
dispatch's: a pre-sum on the owner would change the sum order that the determinism
contract fixes. Except under `UniEPConfig.slot_reduction="owner_partials"`, whose sum
order IS the pre-sum's (combine.py): there each owner folds a token's slot rows (its
receive rows, in local-expert order; `owner_partials`) and returns one row per (token,
owner) over the forward's unique segments reversed (`_PARTIAL_RETURN`, "padded" and
"nvlink"; "ragged" returns every slot row and folds at home, the same bits), and home
folds the partials in rank order (`home_fold`): at K 8 over 4 ranks ~2.7 off-rank rows
per token cross back instead of 6. (Not with a receive bound: the home-side sum adds
its dropped slots as zeros, which can turn a -0.0 partial into +0.0.)

Notation as in `layout.py` (this rank `me`, R ranks, T tokens, K slots, El local
experts). Orders:

1. Unique send order (source): pairs (token t, destination d) with at least one
   of t's experts on d, ordered by (d, t). Rows for d are the slice
   [unique_send_offsets[d], + unique_send_counts[d]) of `unique_tokens`.
2. U[s, d] (int32 [R, R]): rows source s sends to d, all-gathered together with
   every sorted row's position inside its (token, destination) block
   (`unique_position`) and its slot's routing weight (f32 bits), in the same int32
   all_gather as the count matrix (`plan_with_dedup`): [E + R + 2*T*K] per rank.
3. Unique receive buffer (owner): source-major, rows from s in token order;
   packed (block of s at sum_{s'<s} U[s', me]) for "ragged"/"nvlink", one slot of
   T rows per source for "padded".
4. Expand: receive layout row p (local expert le, source s, token t, slot k)
   copies unique row (s, expand_position[p]). Rows of one (le, s) block are
   distinct tokens, so the copy is one read per receive row. The backward's
   weighted expand multiplies the copy by recv_weights[p] = w_s[t, k].

A receive bound (`receive_capacity_factor`) still applies to the receive layout;
the unique receive buffer is dropless (R*T rows) and rows it holds for dropped
assignments are simply not copied.
"""

from __future__ import annotations

import functools

import flax.struct
import jax
import jax.numpy as jnp

from uniep_jax.combine import (combine_cotangent, fold_present, round_cotangent, round_to, weighted_topk_sum,
                               weighted_topk_sum_vjp)
from uniep_jax.dispatch import (_RETURN, _take_rows, _zero_plan_cotangent, _zeros_varying_like,
                                as_received, collect, sort_rows_transpose, sum_to_type_of,
                                varying_axes)
from uniep_jax.layout import (DispatchPlan, _exclusive_cumsum, make_plan, return_segments,
                              sort_assignments)
from uniep_jax.ragged import SEARCH_METHOD


@flax.struct.dataclass
class DedupPlan:
  # --- source side ---
  unique_tokens: jax.Array        # [T*min(R,K)] int32: token of unique send row u (0 past the live)
  unique_send_counts: jax.Array   # [R] int32: unique rows sent to each destination (U[me, :])
  unique_send_offsets: jax.Array  # [R] int32: start of destination d's rows in unique_tokens
  # --- global ---
  unique_counts: jax.Array        # [R, R] int32: U[src, dst]
  # --- destination side ---
  unique_recv_offsets: jax.Array  # [R] int32: packed start of source s's rows (sum_{s'<s} U[s', me])
  unique_output_offsets: jax.Array  # [R] int32: where my rows land in d's packed buffer
  unique_group_ends: jax.Array    # [R(src), G] int32: end of the rows of expert groups
                                  #   0..g inside source s's unique block for me (send_groups)
  unique_send_group_ends: jax.Array  # [R(dst), G] int32: the same for the rows I send owner d
                                  #   (all of them: >= d's unique_group_ends[me] where a
                                  #   receive bound drops rows d does not read)
  expand_position: jax.Array      # [recv_rows] int32: receive row p -> index inside its
                                  #   source's unique block (0 for dead rows)
  recv_weights: jax.Array         # [recv_rows] f32: routing weight of receive row p's
                                  #   slot at its source (0 for dead rows)
  send_groups: int = flax.struct.field(pytree_node=False, default=1)   # see token_destinations


def unique_send_rows(num_tokens: int, top_k: int, num_ranks: int) -> int:
  """Static size of the unique send order: a token has at most min(R, K) owners."""
  return num_tokens * min(num_ranks, top_k)


def unique_receive_bytes(tokens_per_shard: int, hidden: int, ep: int, itemsize: int = 2) -> int:
  """Bytes of the unique receive buffer that de-duplication adds per rank (R*T rows of
  H: every token of every rank, once; dropless), besides the receive layout's buffer
  (`moe.receive_buffer_bytes`)."""
  return ep * tokens_per_shard * hidden * itemsize


def expert_group(local_expert, num_local_experts: int, send_groups: int):
  """The send group (`UniEPConfig.dedup_send_groups`) of a local expert index: G
  contiguous groups of El / G experts. One definition for the senders' order, the owners'
  and senders' group ends and Kernel D's chunk waits, which must agree."""
  return jnp.minimum(local_expert // (num_local_experts // send_groups), send_groups - 1)


def token_destinations(topk_experts: jax.Array, num_ranks: int, num_local_experts: int,
                       send_groups: int = 1):
  """(present [T, R] bool: token t has an expert on rank d; position [T, R] int32: t's
  row in d's unique block). send_groups = 1: the block is in token order. G > 1: the
  owner's local experts are cut into G contiguous groups and the block is in (group of
  t's smallest expert on d, token) order, so that the rows every expert of the first g
  groups needs come first (`UniEPConfig.dedup_send_groups`)."""
  el = num_local_experts
  if send_groups < 1 or el % send_groups:
    raise ValueError(f"send_groups={send_groups} must divide the {el} local experts")
  experts = topk_experts.astype(jnp.int32)
  dest = experts // el                                                         # [T, K]
  on_rank = dest[:, :, None] == jnp.arange(num_ranks, dtype=jnp.int32)          # [T, K, R]
  present = jnp.any(on_rank, axis=1)
  if send_groups == 1:
    position = jnp.cumsum(present, axis=0, dtype=jnp.int32) - present          # exclusive
    return present, position
  smallest = jnp.min(jnp.where(on_rank, (experts % el)[:, :, None], el), axis=1)   # [T, R]
  group = expert_group(smallest, el, send_groups)
  member = present[:, :, None] & (group[:, :, None] == jnp.arange(send_groups))  # [T, R, G]
  before = jnp.cumsum(member, axis=0, dtype=jnp.int32) - member                 # same group
  totals = jnp.sum(member, axis=0, dtype=jnp.int32)                             # [R, G]
  group_start = jnp.cumsum(totals, axis=1, dtype=jnp.int32) - totals            # [R, G]
  position = (jnp.take_along_axis(before, group[:, :, None], axis=2)[:, :, 0]
              + jnp.take_along_axis(group_start[None], group[:, :, None], axis=2)[:, :, 0])
  return present, jnp.where(present, position, 0).astype(jnp.int32)


def local_unique_routing(topk_experts: jax.Array, sort_order: jax.Array,
                         sorted_experts: jax.Array, num_ranks: int, num_local_experts: int,
                         send_groups: int = 1):
  """This rank's part of the de-duplication, before the all_gather.

  sort_order, sorted_experts: this rank's stable sort (`layout.sort_assignments`).
  Returns (present [T, R] bool: token t has an expert on rank d; payload [R + T*K]
  int32 for the all_gather: U[me, :] then, for every sorted row q, the position of
  its (token, destination) pair inside the destination's unique block, in the order of
  `token_destinations(..., send_groups)`)."""
  k = topk_experts.shape[1]
  present, position = token_destinations(topk_experts, num_ranks, num_local_experts,
                                         send_groups)
  counts = jnp.sum(present, axis=0, dtype=jnp.int32)                          # [R]
  token_of_sorted = sort_order // k
  dest_of_sorted = sorted_experts // num_local_experts
  unique_position = position[token_of_sorted, dest_of_sorted]                 # [T*K]
  return present, jnp.concatenate([counts, unique_position])


def sorted_weight_bits(topk_weights: jax.Array, sort_order: jax.Array) -> jax.Array:
  """[T*K] int32: each sorted row's routing weight (f32 bits; no gradient flows
  through it: the weights' gradient is `combine_unique`'s, at the source)."""
  w = jax.lax.stop_gradient(topk_weights).astype(jnp.float32).reshape(-1)[sort_order]
  return jax.lax.bitcast_convert_type(w, jnp.int32)


def make_dedup_plan(present: jax.Array, gathered: jax.Array, plan: DispatchPlan, rank,
                    top_k: int, send_groups: int = 1) -> DedupPlan:
  """The `DedupPlan` of EP rank `rank` from `present` (`local_unique_routing`) and
  `gathered` [R, R + 2*T*K] (every rank's `local_unique_routing` payload followed by
  its `sorted_weight_bits`, all-gathered over the expert axis); send_groups as given
  to `local_unique_routing`."""
  t, r = present.shape
  n = plan.sort_order.shape[0]
  el = plan.recv_group_sizes.shape[0]
  rank = jnp.asarray(rank, jnp.int32)
  u = gathered[:, :r]                                                         # [src, dst]
  unique_position = gathered[:, r:r + n]                                      # [src, T*K]
  weight_bits = gathered[:, r + n:]                                           # [src, T*K]
  counts = present.sum(axis=0, dtype=jnp.int32)
  send_offsets = _exclusive_cumsum(counts)
  # unique_tokens: each sorted row q writes its token at its (token, destination) pair's
  # slot (this rank's own gathered positions); the rows of one pair write the same token
  size = unique_send_rows(t, top_k, r)
  own_position = jax.lax.dynamic_index_in_dim(unique_position, rank, axis=0, keepdims=False)
  slot = send_offsets[plan.sorted_experts // el] + own_position
  unique_tokens = jnp.zeros((size,), jnp.int32).at[slot].set(
      (plan.sort_order // top_k).astype(jnp.int32), mode="drop")
  # unique_send_group_ends[d, g]: a unique row's group is that of its token's smallest
  # expert on d, so the sorted rows of experts in groups 0..g touch exactly the unique
  # rows of groups 0..g, which the group order puts first: the end is their max + 1
  send_group_ends = jax.lax.cummax(jnp.zeros((r, send_groups), jnp.int32).at[
      plan.sorted_experts // el, expert_group(plan.sorted_experts % el, el, send_groups)].max(
          own_position + 1), axis=1)
  # owner side
  incoming = jax.lax.dynamic_index_in_dim(u, rank, axis=1, keepdims=False)    # [src]
  recv_offsets = _exclusive_cumsum(incoming)
  before_me = jnp.sum(jnp.where(jnp.arange(r)[:, None] < rank, u, 0), axis=0)  # [dst]
  # receive row p from source s, index i in s's block for me: s's sorted row
  # (s's rows for ranks < me, = plan.return_offsets[s]) + i; its unique position
  # was gathered
  sorted_row = jnp.clip(plan.return_offsets[plan.recv_source] + plan.recv_index_in_source,
                        0, n - 1)
  expand_position = jnp.where(plan.recv_valid, unique_position[plan.recv_source, sorted_row],
                              0).astype(jnp.int32)
  recv_weights = jnp.where(
      plan.recv_valid,
      jax.lax.bitcast_convert_type(weight_bits[plan.recv_source, sorted_row], jnp.float32),
      jnp.float32(0))
  # unique_group_ends[s, g]: every unique row from s that a receive row of a local expert
  # in groups 0..g reads lies below it (the group order puts those rows first)
  expert_ends = jnp.cumsum(plan.recv_group_sizes, dtype=jnp.int32)
  recv_expert = jnp.searchsorted(expert_ends, jnp.arange(expand_position.shape[0],
                                                         dtype=jnp.int32),
                                 side="right", method=SEARCH_METHOD)
  recv_group = expert_group(recv_expert, el, send_groups)
  group_ends = jnp.zeros((r, send_groups), jnp.int32).at[plan.recv_source, recv_group].max(
      jnp.where(plan.recv_valid, expand_position + 1, 0), mode="drop")
  group_ends = jax.lax.cummax(group_ends, axis=1)
  return DedupPlan(unique_tokens=unique_tokens, unique_send_counts=counts,
                   unique_send_offsets=send_offsets.astype(jnp.int32),
                   unique_counts=u.astype(jnp.int32),
                   unique_recv_offsets=recv_offsets.astype(jnp.int32),
                   unique_output_offsets=before_me.astype(jnp.int32),
                   unique_group_ends=group_ends, unique_send_group_ends=send_group_ends,
                   expand_position=expand_position, recv_weights=recv_weights,
                   send_groups=send_groups)


# ---------------------------------------------------------------------------
# Transports: unique rows -> the owners' unique receive buffers -> receive layout.
# ---------------------------------------------------------------------------
def packed_unique_index(plan: DispatchPlan, dplan: DedupPlan) -> jax.Array:
  """[recv_rows] int32: receive row p's row in the packed unique buffer (source s's
  rows from unique_recv_offsets[s], in its unique send order); 0-based garbage past the
  live rows (expand_position is 0 there)."""
  return dplan.unique_recv_offsets[plan.recv_source] + dplan.expand_position


def _scale_rows(rows, scale):
  """The plain combine's backward, per slot: dtype(w * f32(dy)), one multiply and one
  rounding (XLA's transpose of `weighted_topk_sum`'s product)."""
  return (rows.astype(jnp.float32) * scale[:, None]).astype(rows.dtype)


def _dedup_padded(x, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer, scale=None):
  t, h = x.shape
  r = plan.send_counts.shape[0]
  q = jnp.arange(t, dtype=jnp.int32)
  at = dplan.unique_send_offsets[:, None] + q[None, :]                       # [R, T]
  valid = q[None, :] < dplan.unique_send_counts[:, None]
  tokens = dplan.unique_tokens[jnp.minimum(at, dplan.unique_tokens.shape[0] - 1)]
  buf = _take_rows(x, tokens.reshape(-1), valid.reshape(-1)).reshape(r, t, h)
  got = jax.lax.all_to_all(buf, axis_name, 0, 0, tiled=True)                 # [R(src), T, H]
  flat = plan.recv_source * t + dplan.expand_position
  rows = _take_rows(got.reshape(r * t, h), flat, plan.recv_valid)
  return rows if scale is None else _scale_rows(rows, scale)


def _dedup_ragged(x, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer, scale=None):
  t, h = x.shape
  r = plan.send_counts.shape[0]
  rows = jnp.take(x, dplan.unique_tokens, axis=0)                            # [T*min(R,K), H]
  incoming = dplan.unique_counts[:, jax.lax.axis_index(axis_name)]
  packed = jax.lax.ragged_all_to_all(
      rows, _zeros_varying_like(rows, (r * t, h)), dplan.unique_send_offsets,
      dplan.unique_send_counts, dplan.unique_output_offsets, incoming, axis_name=axis_name)
  rows = _take_rows(packed, packed_unique_index(plan, dplan), plan.recv_valid)
  return rows if scale is None else _scale_rows(rows, scale)


def _dedup_nvlink(x, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer, scale=None):
  from pallas_kernels.ep_transfer import transfer_segments  # GPU kernels, lazy
  from pallas_kernels.row_gather import gather_live_rows
  t, h = x.shape
  r = plan.send_counts.shape[0]
  column = lambda a: a[:, None]  # noqa: E731  one segment per destination
  segments = (column(dplan.unique_send_offsets), column(dplan.unique_output_offsets),
              column(dplan.unique_send_counts))
  index = packed_unique_index(plan, dplan)
  if transfer.expand_in_transfer:   # transfer and expansion in one launch
    from pallas_kernels.transfer_expand import transfer_expand
    blocks = return_segments(plan, jax.lax.axis_index(axis_name))   # [source, le] mine
    recv = transfer_expand(x, *segments, blocks.src_start, blocks.rows, index,
                           src_index=dplan.unique_tokens, unique_rows=r * t,
                           out_rows=plan.recv_valid.shape[0], scale=scale, config=transfer,
                           axis_name=axis_name)
    return as_received(recv, plan)
  if transfer.gather_rows:   # the transfer's loads read x[unique_tokens[i]] themselves
    unique = transfer_segments(x, *segments, out_rows=r * t, config=transfer,
                               axis_name=axis_name, src_index=dplan.unique_tokens)
  else:
    # the unique send rows, packed by destination: only the live ones written (a take
    # wrote all T*min(R,K): 4x H200, qwen3-like EP 4, 0.28 ms for 2.72 live rows per token
    # of 4; the transfer reads only the live segments)
    rows = gather_live_rows(x, dplan.unique_tokens, jnp.sum(dplan.unique_send_counts),
                            out_rows=dplan.unique_tokens.shape[0])           # [T*min(R,K), H]
    unique = transfer_segments(rows, *segments, out_rows=r * t, config=transfer,
                               axis_name=axis_name)                          # [R*T, H] packed
  recv = gather_live_rows(unique, index, plan.num_received, out_rows=plan.recv_valid.shape[0],
                          scale=scale)   # the weighted copy: the same multiply as _scale_rows
  return as_received(recv, plan)


_DEDUP = {"padded": _dedup_padded, "ragged": _dedup_ragged, "nvlink": _dedup_nvlink}


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def dispatch_unique(x, plan: DispatchPlan, dplan: DedupPlan, top_k, axis_name,
                    num_local_experts, transport, transfer):
  """x [T, H] -> receive layout [recv_rows, H], each (token, owner) pair sent once;
  the same rows as `dispatch.dispatch`, and its backward pass."""
  return _DEDUP[transport](x, plan, dplan, axis_name, transfer)


def _dispatch_unique_fwd(x, plan, dplan, top_k, axis_name, num_local_experts, transport,
                         transfer):
  out = _DEDUP[transport](x, plan, dplan, axis_name, transfer)
  return out, (plan, dplan, x[:0])


def _dispatch_unique_bwd(top_k, axis_name, num_local_experts, transport, transfer, res, ct):
  plan, dplan, x_like = res
  owners = plan.slot_owners
  # (the plain path sums a cotangent over mesh axes x does not vary over BEFORE its fold,
  # `sort_rows_transpose`; none in the meshes moe_ffn builds, else the plain path)
  if (owners is not None and owners.presum_on_owner and transport in _PARTIAL_RETURN
      and not varying_axes(ct) - varying_axes(x_like)):
    # "owner_partials": each owner sums its slots of a token (its own receive rows, in
    # local-expert order) and returns one row per (token, owner); home folds them in
    # rank order: the bits of the home-side two-level sum (combine.owner_partial_sum)
    partials = owner_partials(ct, plan, dplan, axis_name)
    back = _PARTIAL_RETURN[transport](partials, plan, dplan, axis_name, transfer)
    dx = sum_to_type_of(home_fold(back, dplan, owners, axis_name), x_like)
  else:
    # The plain dispatch's backward pass, op for op: the return of every slot's row
    # (`send_rows`' transpose), the inverse permutation (`sort_rows`' `permute_rows`),
    # then the K slots of a token summed (`replicate_slots`: in slot order, or by owner).
    rows_sorted = _RETURN[transport](ct, plan, axis_name, num_local_experts, transfer)
    dx = sort_rows_transpose(rows_sorted, plan, top_k, x_like)
  return (dx, _zero_plan_cotangent(plan), _zero_plan_cotangent(dplan))


dispatch_unique.defvjp(_dispatch_unique_fwd, _dispatch_unique_bwd)


# ---------------------------------------------------------------------------
# "owner_partials": the dispatch's backward returns one row per (token, owner).
# ---------------------------------------------------------------------------
def owner_partials(ct, plan: DispatchPlan, dplan: DedupPlan, axis_name) -> jax.Array:
  """[R*T, H] in ct's dtype, packed like the forward's unique receive buffer (source
  s's rows from unique_recv_offsets[s], in its unique send order): row g = round(float32
  fold of the cotangent rows ct[p] of g's receive rows p, in receive-layout order =
  ascending local expert), the owner's half of `combine.owner_partial_sum`. Rows past
  the live ones are garbage (never returned). XLA's form over [R*T, J] entries (J =
  min(K, El), a token's rows on one owner): an unused entry reads its group's first row
  again (masked out; a cache hit on a GPU, as in bench/fold_check.py's XLA form), so the
  HBM traffic follows the live rows."""
  t, k = plan.slot_owners.experts.shape
  rows = jax.lax.axis_size(axis_name) * t
  j_max = min(k, plan.recv_group_sizes.shape[0])
  group = jnp.where(plan.recv_valid, packed_unique_index(plan, dplan),
                    jnp.int32(rows))                               # dead rows: past every g
  order = jnp.argsort(group, stable=True).astype(jnp.int32)     # each group in p order
  sorted_group = group[order]
  g = jnp.arange(rows, dtype=jnp.int32)
  # (unrolled bisection, ragged.SEARCH_METHOD: the default "scan" is a host-driven while
  # loop on XLA:GPU; 4x H200, qwen3-like EP 4: +0.77 ms of idle GPU per fwd+bwd)
  start = jnp.searchsorted(sorted_group, g, side="left", method=SEARCH_METHOD).astype(jnp.int32)
  count = (jnp.searchsorted(sorted_group, g, side="right", method=SEARCH_METHOD)
           .astype(jnp.int32) - start)
  acc = None
  for j in range(j_max):
    used = j < count
    term = jnp.take(ct, order[jnp.minimum(start + jnp.where(used, j, 0), order.shape[0] - 1)],
                    axis=0).astype(jnp.float32)
    acc = term if j == 0 else jnp.where(used[:, None], acc + term, acc)
  return round_to(acc, ct.dtype).astype(ct.dtype)   # the home-side sum's rounding


def _partial_return_padded(partials, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer):
  """Owner -> home, `_dedup_padded` reversed: source s's block of partials (U[s, me] rows
  from unique_recv_offsets[s]) goes back to s in one fixed slot of T rows; home lays
  owner d's rows at its unique send offset for d ([T*min(R,K), H], the unique send order)."""
  t = plan.slot_owners.experts.shape[0]
  r, me = jax.lax.axis_size(axis_name), jax.lax.axis_index(axis_name)
  q = jnp.arange(t, dtype=jnp.int32)
  incoming = jax.lax.dynamic_index_in_dim(dplan.unique_counts, me, axis=1, keepdims=False)
  at = dplan.unique_recv_offsets[:, None] + q[None, :]                        # [R, T]
  buf = _take_rows(partials, at.reshape(-1), (q[None, :] < incoming[:, None]).reshape(-1))
  got = jax.lax.all_to_all(buf.reshape(r, t, -1), axis_name, 0, 0, tiled=True)  # [R(owner), T, H]
  u = dplan.unique_tokens.shape[0]
  slot = jnp.arange(u, dtype=jnp.int32)
  d = jnp.clip(jnp.searchsorted(dplan.unique_send_offsets, slot, side="right",
                                method=SEARCH_METHOD) - 1, 0, r - 1)
  return got.reshape(r * t, -1)[d * t + (slot - dplan.unique_send_offsets[d])]


def _partial_return_nvlink(partials, plan: DispatchPlan, dplan: DedupPlan, axis_name, transfer):
  """Owner -> home over NVLink: `_dedup_nvlink`'s segments reversed (source s's packed
  block of partials to s's unique send offset for this rank, sum_{d < me} U[s, d])."""
  from pallas_kernels.ep_transfer import transfer_segments  # GPU kernels, lazy
  me = jax.lax.axis_index(axis_name)
  u = dplan.unique_counts                                                     # [src, dst]
  column = lambda a: a[:, None]  # noqa: E731  one segment per source
  before_me = jnp.sum(jnp.where(jnp.arange(u.shape[1])[None, :] < me, u, 0), axis=1)
  incoming = jax.lax.dynamic_index_in_dim(u, me, axis=1, keepdims=False)
  return transfer_segments(partials, column(dplan.unique_recv_offsets), column(before_me),
                           column(incoming), out_rows=dplan.unique_tokens.shape[0],
                           config=transfer, axis_name=axis_name)


_PARTIAL_RETURN = {"padded": _partial_return_padded, "nvlink": _partial_return_nvlink}


def home_fold(back, dplan: DedupPlan, owners, axis_name) -> jax.Array:
  """[T, H]: each token's partials (back: [T*min(R,K), H] in the unique send order, the
  partial from owner d of token t at unique_send_offsets[d] + its position among d's
  tokens) folded in ascending owner order in float32, rounded to back's dtype: the
  outer fold of `combine.owner_partial_sum`."""
  r = jax.lax.axis_size(axis_name)
  present, position = token_destinations(owners.experts, r, owners.experts_per_owner,
                                         dplan.send_groups)
  acc = have = None
  for d in range(r):
    term = jnp.take(back, dplan.unique_send_offsets[d] + position[:, d], axis=0,
                    mode="clip").astype(jnp.float32)
    acc, have = fold_present(acc, have, term, present[:, d:d + 1])
  return acc.astype(back.dtype)


def plan_with_dedup(topk_experts: jax.Array, topk_weights: jax.Array, *, num_experts: int,
                    axis_name, top_k: int, recv_rows: int | None = None, send_groups: int = 1):
  """(DispatchPlan, DedupPlan) inside a shard_map over `axis_name`, from ONE int32
  all_gather of [E + R + 2*T*K] per rank: the count matrix's row, then the
  de-duplication payload (`local_unique_routing`, `sorted_weight_bits`). send_groups:
  `UniEPConfig.dedup_send_groups`."""
  r = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  sort = sort_assignments(topk_experts, num_experts)
  sort_order, _, sorted_experts, group_sizes = sort
  present, payload = local_unique_routing(topk_experts, sort_order, sorted_experts, r,
                                          num_experts // r, send_groups)
  gathered = jax.lax.all_gather(
      jnp.concatenate([group_sizes, payload, sorted_weight_bits(topk_weights, sort_order)]),
      axis_name)                                                             # [R, E + R + 2TK]
  plan = make_plan(topk_experts, gathered[:, :num_experts], rank, recv_rows=recv_rows,
                   sort=sort)
  return plan, make_dedup_plan(present, gathered[:, num_experts:], plan, rank, top_k,
                               send_groups)


# ---------------------------------------------------------------------------
# The combine whose backward pass de-duplicates the dy dispatch.
# ---------------------------------------------------------------------------
def unique_dy_rows(dy, y_assign, weights, plan: DispatchPlan, dplan: DedupPlan, *, axis_name,
                   transport, transfer, out_dtype, rows_dtype):
  """The backward of the combine (collect + `weighted_topk_sum`) with the dy dispatch
  de-duplicated: (d_recv [recv_rows, H] in rows_dtype, each slot's row dtype(w * f32(dy))
  on its owner; d_weights [T, K], the plain combine's). dy goes through
  `round_cotangent` first, as in the plain combine's backward."""
  dy, d_weights = combine_cotangent(dy, y_assign, weights, out_dtype)
  d_recv = _DEDUP[transport](dy.astype(rows_dtype), plan, dplan, axis_name, transfer,
                             scale=dplan.recv_weights)
  return d_recv, d_weights


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5, 6, 7, 8, 9))
def combine_unique(y_recv, weights, plan: DispatchPlan, dplan: DedupPlan, top_k, axis_name,
                   num_local_experts, transport, transfer, out_dtype):
  """Receive layout [recv_rows, H] -> y [T, H] in out_dtype: the plain combine
  (`dispatch.collect`, then `weighted_topk_sum`), whose backward pass sends each
  (token, owner) pair's dy row once and lets the owner form every slot's row
  dtype(w * f32(dy)) (module docstring): the plain combine's bits, both ways."""
  return _combine_unique_fwd(y_recv, weights, plan, dplan, top_k, axis_name, num_local_experts,
                             transport, transfer, out_dtype)[0]


def _combine_unique_fwd(y_recv, weights, plan, dplan, top_k, axis_name, num_local_experts,
                        transport, transfer, out_dtype):
  y_assign = collect(y_recv, plan, top_k=top_k, axis_name=axis_name,
                     num_local_experts=num_local_experts, transport=transport, transfer=transfer)
  y = weighted_topk_sum(y_assign, weights, out_dtype=out_dtype, owners=plan.slot_owners)
  return y, (y_assign, weights, plan, dplan, y_recv[:0])


def _combine_unique_bwd(top_k, axis_name, num_local_experts, transport, transfer, out_dtype,
                        res, dy):
  y_assign, weights, plan, dplan, y_recv_like = res
  d_recv, d_weights = unique_dy_rows(dy, y_assign, weights, plan, dplan, axis_name=axis_name,
                                     transport=transport, transfer=transfer,
                                     out_dtype=out_dtype, rows_dtype=y_recv_like.dtype)
  return (sum_to_type_of(d_recv, y_recv_like), d_weights, _zero_plan_cotangent(plan),
          _zero_plan_cotangent(dplan))


combine_unique.defvjp(_combine_unique_fwd, _combine_unique_bwd)
