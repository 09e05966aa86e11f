"""Step 2, the plan: where every token row goes, as a pure function of routing.

Notation (one shard of the expert axis, i.e. one EP rank `me`):
  T tokens on this shard, K slots (top-k), E experts, R = EP degree (size of the
  expert mesh axis), El = E / R local experts; rank r owns experts
  [r*El, (r+1)*El). An *assignment* a = t*K + k is (token t, slot k) and goes to
  expert topk_experts[t, k].

1. Send order (on each source rank). The T*K assignments are ordered by ONE
   stable sort on the key (expert, token, slot): `sort_order[p]` is the
   assignment at sorted position p. Because a = t*K + k already increases with
   (token, slot), a stable argsort of the expert ids alone realises the key.
   Experts of one destination rank are contiguous, so the rows for rank d are
   the slice [send_offsets[d], send_offsets[d] + send_counts[d]) of the sorted
   rows, in (local expert, token, slot) order.

2. The count matrix C[s, e] (int32 [R, E]): assignments of source rank s to
   expert e, all-gathered over the expert axis. Every rank derives all offsets
   from C alone, so all ranks agree without further communication.

3. Receive layout (on each destination rank `me`), the layout the expert GEMMs
   read and that the Pallas kernels write into, is ordered by
       (local expert le, source rank s, source token t, slot k):
   rows for (le, s) start at
       expert_offsets[le] + sum_{s' < s} C[s', me*El + le]
   where expert_offsets = exclusive cumsum over le of recv_group_sizes, and
   recv_group_sizes[le] = sum_s C[s, me*El + le]. Inside a (le, s) block, rows
   keep the source's (token, slot) order. Rows past sum(recv_group_sizes) are
   padding (zero after dispatch). The buffer holds R*T*K rows: the dropless
   worst case (every assignment of every rank to this rank).

4. Source-major view. A transport that delivers one contiguous block per
   source (all_to_all, ragged_all_to_all) delivers rows in (s, le, t, k) order:
   the block from s starts at recv_offsets[s] (packed, = exclusive cumsum of
   recv_counts) or s * T*K (padded, one fixed-size slot per source).
   `recv_source[p]`, `recv_index_in_source[p]` give, for every receive-layout
   row p, the source rank and the row's index inside that source's block.

5. Optional receive bound (`recv_rows` < R*T*K): receive rows at layout
   positions >= recv_rows are dropped, deterministically (they are the tail of
   the (le, s, t, k) order) and counted in `dropped`. Kept rows keep their
   positions, and the kept rows of each (source, destination) block are a
   prefix of that block, so every transport just sends shorter blocks
   (`kept_counts`). Dropped assignments come back as zeros.

6. De-duplication (`DedupPlan`, the "uniep" backend's dispatch): a token's K experts
   often share an owner (K=8 over R=4 ranks: ~3.6 distinct ranks per token), and every
   expert of one owner gets the same row x[t]. The dispatch then moves one copy per
   (token, destination rank), and the owner copies it to the receive-layout rows of its
   experts: the receive layout, and so every later step, is unchanged, row for row.
   Unique send order (source): pairs (token t, destination d) with at least one of t's
   experts on d, ordered by (d, t). U[s, d] (int32 [R, R]): rows source s sends to d,
   all-gathered with every sorted row's position inside its (token, destination) block
   and its slot's routing weight (float32 bits), in the same int32 all_gather as the
   count matrix (`plan_with_dedup`: [E + R + 2*T*K] per rank). Unique receive buffer
   (owner): source-major, packed (the block of s at sum_{s'<s} U[s', me]), rows from s
   in token order. Expansion: receive-layout row p (local expert le, source s, token t,
   slot k) copies unique row (s, expand_position[p]); the backward's weighted expansion
   multiplies the copy by recv_weights[p] = w_s[t, k].

Everything is int32 and computed with sorts, cumsums and searchsorted: no
atomics, nothing that depends on arrival order, so every transport and every
schedule lands each row at the same place.
"""

from __future__ import annotations

import math

import flax.struct
import jax
import jax.numpy as jnp

from pallas_kernels.ragged import enumerate_runs


@flax.struct.dataclass
class DispatchPlan:
  # --- source side (this rank's own tokens) ---
  sort_order: jax.Array          # [T*K] int32: assignment (t*K+k) at sorted position p
  sorted_position: jax.Array     # [T*K] int32: inverse of sort_order
  sorted_experts: jax.Array      # [T*K] int32: expert of sorted position p (non-decreasing)
  group_sizes: jax.Array         # [E] int32: this rank's assignments per expert
  send_counts: jax.Array         # [R] int32: rows sent to each destination rank
  send_offsets: jax.Array        # [R] int32: start of rank d's rows in the sorted order
  # --- global ---
  count_matrix: jax.Array        # [R, E] int32: C[s, e]
  # --- destination side (rows this rank receives) ---
  recv_counts: jax.Array         # [R] int32: rows received from each source rank
  recv_offsets: jax.Array        # [R] int32: packed source-major offsets
  recv_group_sizes: jax.Array    # [El] int32: rows per local expert
  output_offsets: jax.Array      # [R] int32: where this rank's block lands in rank d's
                                 #   packed source-major buffer (ragged_all_to_all)
  return_offsets: jax.Array      # [R] int32: where rank s's returned rows land in s's
                                 #   sorted order (= s's send_offsets[me])
  # The receive layout has recv_rows rows (R*T*K unless bounded):
  recv_source: jax.Array         # [recv_rows] int32: source rank of receive row p (0 if padding)
  recv_index_in_source: jax.Array  # [recv_rows] int32: index inside the source's block
  recv_valid: jax.Array          # [recv_rows] bool: p < sum(recv_group_sizes)
  kept_counts: jax.Array         # [R, R, El] int32: rows (src, dst, le) that are sent;
                                 #   = C without a receive bound
  dropped: jax.Array             # int32: rows this rank did not receive (receive bound)
  top_k: int = flax.struct.field(pytree_node=False)   # K (static)

  @property
  def num_received(self) -> jax.Array:
    return jnp.sum(self.recv_group_sizes)

  @property
  def sorted_tokens(self) -> jax.Array:
    """[T*K] int32: the token of each sorted row."""
    return self.sort_order // self.top_k

  @property
  def num_local_experts(self) -> int:
    return self.recv_group_sizes.shape[0]


def _exclusive_cumsum(v: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(v, axis=axis) - v


def sort_assignments(topk_experts: jax.Array, num_experts: int):
  """Stable sort of the T*K assignments by (expert, token, slot).

  Returns (sort_order, sorted_position, sorted_experts, group_sizes).
  """
  flat = topk_experts.reshape(-1).astype(jnp.int32)                # [T*K]
  n = flat.shape[0]
  sort_order = jnp.argsort(flat, stable=True).astype(jnp.int32)    # [T*K]
  sorted_experts = flat[sort_order]
  sorted_position = jnp.zeros((n,), jnp.int32).at[sort_order].set(
      jnp.arange(n, dtype=jnp.int32), unique_indices=True)
  group_sizes = jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)
  return sort_order, sorted_position, sorted_experts, group_sizes


def local_group_sizes(topk_experts: jax.Array, num_experts: int) -> jax.Array:
  """[E] int32 assignments per expert (what the count-matrix all-gather sends)."""
  flat = topk_experts.reshape(-1).astype(jnp.int32)
  return jnp.zeros((num_experts,), jnp.int32).at[flat].add(1)


def kept_counts(count_matrix: jax.Array, recv_rows: int | None) -> jax.Array:
  """[R(src), R(dst), El] rows kept under a receive bound of `recv_rows` rows.

  Block (le, s) of destination d starts at expert_off[d, le] + sum_{s'<s} C[s', d, le];
  rows at positions >= recv_rows are dropped. Without a bound: C itself."""
  r, e = count_matrix.shape
  per = count_matrix.reshape(r, r, e // r)                          # [src, dst, le]
  if recv_rows is None:
    return per
  received = jnp.sum(per, axis=0)                                   # [dst, le]
  start = _exclusive_cumsum(received, axis=1)[None] + _exclusive_cumsum(per, axis=0)
  return jnp.clip(recv_rows - start, 0, per).astype(per.dtype)


def make_plan(topk_experts: jax.Array, count_matrix: jax.Array, rank,
              recv_rows: int | None = None, sort=None) -> DispatchPlan:
  """Builds the plan of EP rank `rank` from its routing and the gathered counts.

  topk_experts: [T, K] int32 of this rank; count_matrix: [R, E] int32 (row s =
  `local_group_sizes` of rank s); rank: this rank's index on the expert axis
  (a traced scalar inside shard_map is fine); recv_rows: the receive buffer's
  rows (default R*T*K, the dropless worst case; fewer drops the overflow);
  sort: `sort_assignments(topk_experts, E)` when the caller already has it.
  """
  t, k = topk_experts.shape
  r, e = count_matrix.shape
  el = e // r
  rows = t * k
  if recv_rows is not None and recv_rows >= r * rows:
    recv_rows = None                                                # cannot overflow
  sort_order, sorted_position, sorted_experts, group_sizes = (
      sort if sort is not None else sort_assignments(topk_experts, e))

  per_rank = count_matrix.reshape(r, r, el)                         # [src, dst, le]
  kept = kept_counts(count_matrix, recv_rows)                       # [src, dst, le]
  send_offsets = _exclusive_cumsum(jnp.sum(group_sizes.reshape(r, el), axis=1))  # full order

  rank = jnp.asarray(rank, jnp.int32)
  send_counts = jnp.sum(jax.lax.dynamic_index_in_dim(kept, rank, axis=0, keepdims=False),
                        axis=1)                                     # [R] (dst)
  mine = jax.lax.dynamic_index_in_dim(per_rank, rank, axis=1, keepdims=False)  # [src, le]
  mine_kept = jax.lax.dynamic_index_in_dim(kept, rank, axis=1, keepdims=False)
  recv_counts = jnp.sum(mine_kept, axis=1)                          # [R] (src)
  recv_offsets = _exclusive_cumsum(recv_counts)
  recv_group_sizes = jnp.sum(mine_kept, axis=0)                     # [El]
  dropped = jnp.sum(mine) - jnp.sum(mine_kept)

  # Rows each (src, dst) pair exchanges, and prefix sums used for offsets.
  pair_rows = jnp.sum(kept, axis=2)                                 # [src, dst]
  # Where my block lands in dst's packed source-major buffer: rows that sources
  # before me send to dst.
  output_offsets = jnp.sum(jnp.where(jnp.arange(r)[:, None] < rank, pair_rows, 0), axis=0)
  # Where the rows I return to src land in src's sorted order (the full order):
  # rows src has for ranks before me.
  full_pairs = jnp.sum(per_rank, axis=2)
  return_offsets = jnp.sum(jnp.where(jnp.arange(r)[None, :] < rank, full_pairs, 0), axis=1)

  # Receive layout: for each row p, its (local expert, source, index in source block).
  cap = r * rows if recv_rows is None else recv_rows
  # Block (le, s) sizes in (le, s) order, flattened; their starts in the layout.
  block_sizes = mine.T.reshape(-1)                                  # [El*R], index le*R + s
  block, within, valid = enumerate_runs(block_sizes, cap)           # within: index inside (le, s)
  le = block // r
  src = block % r
  # Inside src's block the rows are ordered (le, t, k): add rows of src for le' < le.
  src_le_start = _exclusive_cumsum(mine, axis=1)                    # [src, le]
  index_in_source = src_le_start[src, le] + within
  recv_source = jnp.where(valid, src, 0).astype(jnp.int32)
  recv_index_in_source = jnp.where(valid, index_in_source, 0).astype(jnp.int32)

  return DispatchPlan(
      sort_order=sort_order, sorted_position=sorted_position,
      sorted_experts=sorted_experts, group_sizes=group_sizes,
      send_counts=send_counts.astype(jnp.int32), send_offsets=send_offsets.astype(jnp.int32),
      count_matrix=count_matrix,
      recv_counts=recv_counts.astype(jnp.int32), recv_offsets=recv_offsets.astype(jnp.int32),
      recv_group_sizes=recv_group_sizes.astype(jnp.int32),
      output_offsets=output_offsets.astype(jnp.int32),
      return_offsets=return_offsets.astype(jnp.int32),
      recv_source=recv_source, recv_index_in_source=recv_index_in_source,
      recv_valid=valid, kept_counts=kept.astype(jnp.int32), dropped=dropped.astype(jnp.int32),
      top_k=k)


# ---------------------------------------------------------------------------
# Segment tables for transports that write straight into peers' buffers.
# A segment is a run of rows that is contiguous both at the source and at the
# destination: one (destination rank, local expert) block of a dispatch, or one
# (source rank, local expert) block of a return. All [R, El] int32, indexed by
# (peer, local expert).
# ---------------------------------------------------------------------------
@flax.struct.dataclass
class Segments:
  src_start: jax.Array   # first row in this rank's source buffer
  dst_start: jax.Array   # first row in the peer's destination buffer
  rows: jax.Array        # number of rows (0 allowed)


def dispatch_segments(plan: DispatchPlan, rank) -> Segments:
  """This rank's sorted rows -> the owners' receive layouts, per (dst, le)."""
  cm = plan.count_matrix
  r, e = cm.shape
  el = e // r
  rank = jnp.asarray(rank, jnp.int32)
  per = cm.reshape(r, r, el)                                        # [src, dst, le]
  mine = jax.lax.dynamic_index_in_dim(per, rank, 0, keepdims=False)  # [dst, le]
  src_start = plan.send_offsets[:, None] + _exclusive_cumsum(mine, axis=1)
  sent = jax.lax.dynamic_index_in_dim(plan.kept_counts, rank, 0, keepdims=False)
  received = jnp.sum(per, axis=0)                                   # [dst, le]
  expert_off = _exclusive_cumsum(received, axis=1)                  # [dst, le]
  before_me = jnp.sum(jnp.where(jnp.arange(r)[:, None, None] < rank, per, 0), axis=0)
  return Segments(src_start=src_start.astype(jnp.int32),
                  dst_start=(expert_off + before_me).astype(jnp.int32),
                  rows=sent.astype(jnp.int32))


def return_segments(plan: DispatchPlan, rank) -> Segments:
  """This rank's receive layout -> the sources' sorted rows, per (src, le)."""
  cm = plan.count_matrix
  r, e = cm.shape
  el = e // r
  rank = jnp.asarray(rank, jnp.int32)
  per = cm.reshape(r, r, el)                                        # [src, dst, le]
  incoming = jax.lax.dynamic_index_in_dim(per, rank, 1, keepdims=False)  # [src, le]
  expert_off = _exclusive_cumsum(jnp.sum(incoming, axis=0))         # [le]
  src_start = expert_off[None, :] + _exclusive_cumsum(incoming, axis=0)
  # at source s, rows for my experts start after its rows for ranks < me
  before = jnp.sum(jnp.where(jnp.arange(r)[None, :, None] < rank, per, 0), axis=(1, 2))  # [src]
  dst_start = before[:, None] + _exclusive_cumsum(incoming, axis=1)
  returned = jax.lax.dynamic_index_in_dim(plan.kept_counts, rank, 1, keepdims=False)
  return Segments(src_start=src_start.astype(jnp.int32),
                  dst_start=dst_start.astype(jnp.int32),
                  rows=returned.astype(jnp.int32))


# ---------------------------------------------------------------------------
# Receive buffer sizes
# ---------------------------------------------------------------------------
def receive_rows(tokens_per_shard: int, top_k: int, ep: int,
                 receive_capacity_factor: float | None) -> int | None:
  """Rows of a rank's receive buffer: None (= R*T*K, the dropless worst case) unless
  `receive_capacity_factor` bounds it (`UniEPConfig.receive_capacity_factor`)."""
  worst = ep * tokens_per_shard * top_k
  if receive_capacity_factor is None:
    return None
  need = math.ceil(receive_capacity_factor * tokens_per_shard * top_k)
  granule = 128 if need >= 1024 else 8          # whole GEMM row tiles at real sizes
  rows = -(-need // granule) * granule
  return None if rows >= worst else rows


def receive_buffer_bytes(tokens_per_shard: int, top_k: int, hidden: int, ep: int,
                         itemsize: int = 2, receive_capacity_factor: float | None = None) -> int:
  """Bytes of one rank's receive buffer (one [rows, H] activation buffer)."""
  rows = (receive_rows(tokens_per_shard, top_k, ep, receive_capacity_factor)
          or ep * tokens_per_shard * top_k)
  return rows * hidden * itemsize


def unique_receive_bytes(tokens_per_shard: int, hidden: int, ep: int, itemsize: int = 2) -> int:
  """Bytes of the unique receive buffer that de-duplication ("uniep") adds per rank (R*T
  rows of H: every token of every rank, once; dropless), besides the receive layout's
  buffer (`receive_buffer_bytes`)."""
  return ep * tokens_per_shard * hidden * itemsize


# ---------------------------------------------------------------------------
# De-duplication (module docstring, 6.)
# ---------------------------------------------------------------------------
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
  expand_position: jax.Array      # [recv_rows] int32: receive row p -> index inside its
                                  #   source's unique block (0 for dead rows)
  recv_weights: jax.Array         # [recv_rows] f32: routing weight of receive row p's
                                  #   slot at its source (0 for dead rows)

  def packed_index(self, plan: DispatchPlan) -> jax.Array:
    """[recv_rows] int32: receive row p's row in the packed unique receive buffer (source
    s's rows from unique_recv_offsets[s]); 0-based garbage past the live rows."""
    return self.unique_recv_offsets[plan.recv_source] + self.expand_position


def unique_send_rows(num_tokens: int, top_k: int, num_ranks: int) -> int:
  """Static size of the unique send order: a token has at most min(R, K) owners."""
  return num_tokens * min(num_ranks, top_k)


def token_destinations(topk_experts: jax.Array, num_ranks: int, num_local_experts: int):
  """(present [T, R] bool: token t has an expert on rank d; position [T, R] int32: t's
  row in d's unique block, in token order)."""
  dest = topk_experts.astype(jnp.int32) // num_local_experts                   # [T, K]
  on_rank = dest[:, :, None] == jnp.arange(num_ranks, dtype=jnp.int32)          # [T, K, R]
  present = jnp.any(on_rank, axis=1)
  position = jnp.cumsum(present, axis=0, dtype=jnp.int32) - present            # exclusive
  return present, position


def sorted_weight_bits(topk_weights: jax.Array, sort_order: jax.Array) -> jax.Array:
  """[T*K] int32: each sorted row's routing weight (float32 bits; no gradient flows
  through it: the weights' gradient is the combine's, at the source)."""
  w = jax.lax.stop_gradient(topk_weights).astype(jnp.float32).reshape(-1)[sort_order]
  return jax.lax.bitcast_convert_type(w, jnp.int32)


def make_dedup_plan(present: jax.Array, gathered: jax.Array, plan: DispatchPlan,
                    rank) -> DedupPlan:
  """The `DedupPlan` of EP rank `rank` from `present` (`token_destinations`) and
  `gathered` [R, R + 2*T*K] (every rank's unique counts U[s, :], the unique position of
  each of its sorted rows, and `sorted_weight_bits`, all-gathered over the expert axis)."""
  t, r = present.shape
  n = plan.sort_order.shape[0]
  el = plan.num_local_experts
  rank = jnp.asarray(rank, jnp.int32)
  u = gathered[:, :r]                                                         # [src, dst]
  unique_position = gathered[:, r:r + n]                                      # [src, T*K]
  weight_bits = gathered[:, r + n:]                                           # [src, T*K]
  counts = present.sum(axis=0, dtype=jnp.int32)
  send_offsets = _exclusive_cumsum(counts)
  # unique_tokens: each sorted row q writes its token at its (token, destination) pair's
  # slot (this rank's own gathered positions); the rows of one pair write the same token
  size = unique_send_rows(t, plan.top_k, r)
  own_position = jax.lax.dynamic_index_in_dim(unique_position, rank, axis=0, keepdims=False)
  slot = send_offsets[plan.sorted_experts // el] + own_position
  unique_tokens = jnp.zeros((size,), jnp.int32).at[slot].set(plan.sorted_tokens, mode="drop")
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
  return DedupPlan(unique_tokens=unique_tokens, unique_send_counts=counts,
                   unique_send_offsets=send_offsets.astype(jnp.int32),
                   unique_counts=u.astype(jnp.int32),
                   unique_recv_offsets=recv_offsets.astype(jnp.int32),
                   unique_output_offsets=before_me.astype(jnp.int32),
                   expand_position=expand_position, recv_weights=recv_weights)


def plan_with_dedup(topk_experts: jax.Array, topk_weights: jax.Array, *, num_experts: int,
                    axis_name, recv_rows: int | None = None):
  """(DispatchPlan, DedupPlan) inside a shard_map over `axis_name`, from ONE int32
  all_gather of [E + R + 2*T*K] per rank: the count matrix's row, this rank's unique
  counts, the unique position of each sorted row, and the sorted rows' weights."""
  r = jax.lax.axis_size(axis_name)
  rank = jax.lax.axis_index(axis_name)
  k = topk_experts.shape[1]
  sort = sort_assignments(topk_experts, num_experts)
  sort_order, _, sorted_experts, group_sizes = sort
  present, position = token_destinations(topk_experts, r, num_experts // r)
  unique_position = position[sort_order // k, sorted_experts // (num_experts // r)]  # [T*K]
  gathered = jax.lax.all_gather(
      jnp.concatenate([group_sizes, jnp.sum(present, axis=0, dtype=jnp.int32), unique_position,
                       sorted_weight_bits(topk_weights, sort_order)]),
      axis_name)                                                             # [R, E + R + 2TK]
  plan = make_plan(topk_experts, gathered[:, :num_experts], rank, recv_rows=recv_rows,
                   sort=sort)
  return plan, make_dedup_plan(present, gathered[:, num_experts:], plan, rank)
