"""Step 2a, exact-load balancing: replicas of hot experts, planned per layer call.

Without balancing, EP rank r computes every row of its El own experts, and a dropless
layer waits for its most loaded rank. With `replica_slots = S`, every rank also holds S
replica slots: a slot takes a foreign expert's weights (copied from its owner,
`uniep_jax/replicas.py`) and computes one contiguous range of that expert's rows.

The plan is a pure function of the count matrix C [R, E] (rows of source s for expert
e), which every rank of the expert axis already holds, so every rank computes the same
plan without further communication:

  n_e   = sum_s C[s, e]              rows of expert e
  L     = ceil(sum_e n_e / R)        the exact-load target of every rank
  load  = rows each rank owns        (its experts' n_e)

  repeat R*S times (one placement per step; each uses one slot):
    donor    d = the most loaded rank                  (ties: lowest index)
               stop if load[d] <= L
    expert   e = d's expert with most rows still at d  (ties: lowest index)
    receiver r = the least loaded rank with a free slot that is not d and holds no
                 piece of e                            (ties: lowest index)
    move min(load[d] - L, L - load[r], rows of e still at d) rows of e from d to r's
    next free slot.

Every placement brings a donor to L, fills a receiver to L, or empties an expert, so
with enough slots every rank ends at most at L rows (exact load). With too few slots
the plan is the most balanced the greedy reaches; the rows each rank computes are
reported (aux["rank_rows"]), so the imbalance left is visible.

Rows of an expert, in the receive layout's global order (source rank, token, slot),
are cut into contiguous pieces: the owner computes the first piece, then the replicas
in rank order. The plan is then expressed as *virtual experts*: rank r has El + S
local groups, v = r*(El+S) + j, j < El its own experts, j >= El its replica slots.
Each assignment is relabelled with the virtual expert of the piece holding its row
(`virtual_routing`), and the virtual count matrix C' [R, R*(El+S)] follows from C and
the plan alone, so the unchanged dispatch plan (`layout.make_plan`), transports,
grouped GEMM and combine run on the virtual experts. A row is computed by the same
GEMM on the same weights wherever it lands, so the layer's output and dx do not
depend on the plan on row-split-invariant GEMMs (the Pallas kernels); the weight
gradient of a replicated expert is its pieces' sum, added at the owner in a fixed
order (`replicas.py`).

All int32, with argmax/argmin (first index on ties), cumsums and compares: no
atomics, nothing that depends on arrival order.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from uniep_jax.layout import sort_assignments
from uniep_jax.rows import varying_axes, widen_varying

_BIG = jnp.iinfo(jnp.int32).max


@flax.struct.dataclass
class ReplicaPlan:
  slot_expert: jax.Array   # [R, S] int32: expert held by rank r's slot j, -1 if unused
  slot_of: jax.Array       # [E, R] int32: the slot of expert e on rank r, -1 if none
  rows_on: jax.Array       # [E, R] int32: rows of e computed on rank r (owner included)
  start_on: jax.Array      # [E, R] int32: first row of that piece in e's global order
  rank_rows: jax.Array     # [R] int32: rows each rank computes

  @property
  def slots(self) -> int:
    return self.slot_expert.shape[1]

  @property
  def copies(self) -> jax.Array:
    """int32: expert weight copies the plan moves (used slots)."""
    return jnp.sum(self.slot_expert >= 0, dtype=jnp.int32)


def _exclusive_cumsum(v: jax.Array, axis: int = -1) -> jax.Array:
  return jnp.cumsum(v, axis=axis) - v


def plan_replicas(count_matrix: jax.Array, slots: int) -> ReplicaPlan:
  """The replica plan (module docstring) from the count matrix C [R, E] int32."""
  r, e = count_matrix.shape
  el = e // r
  n = jnp.sum(count_matrix, axis=0, dtype=jnp.int32)               # [E]
  owner = jnp.arange(e, dtype=jnp.int32) // el                      # [E]
  ranks = jnp.arange(r, dtype=jnp.int32)
  target = (jnp.sum(n) + r - 1) // r                                # L
  load0 = jnp.sum(n.reshape(r, el), axis=1)                         # [R]

  def step(_, state):
    remaining, load, free, slot_of, taken, slot_expert = state
    d = jnp.argmax(load).astype(jnp.int32)
    over = load[d] - target
    ex = jnp.argmax(jnp.where(owner == d, remaining, -1)).astype(jnp.int32)
    eligible = (free > 0) & (ranks != d) & (slot_of[ex] < 0)
    rcv = jnp.argmin(jnp.where(eligible, load, _BIG)).astype(jnp.int32)
    amount = jnp.minimum(jnp.minimum(over, target - load[rcv]), remaining[ex])
    amount = jnp.where(eligible[rcv], jnp.maximum(amount, 0), 0)
    go = amount > 0
    slot = jnp.minimum(slots - free[rcv], slots - 1)   # the next free slot (clipped if none)
    remaining = remaining.at[ex].add(-amount)
    load = load.at[d].add(-amount).at[rcv].add(amount)
    free = free.at[rcv].add(-go.astype(jnp.int32))
    slot_of = slot_of.at[ex, rcv].set(jnp.where(go, slot, slot_of[ex, rcv]))
    taken = taken.at[ex, rcv].add(amount)
    slot_expert = slot_expert.at[rcv, slot].set(jnp.where(go, ex, slot_expert[rcv, slot]))
    return remaining, load, free, slot_of, taken, slot_expert

  state = (n, load0, jnp.full((r,), slots, jnp.int32), jnp.full((e, r), -1, jnp.int32),
           jnp.zeros((e, r), jnp.int32), jnp.full((r, slots), -1, jnp.int32))
  # inside a shard_map the loop carry must keep one sharding type: the counts' one
  state = tuple(widen_varying(a, varying_axes(count_matrix)) for a in state)
  if slots > 0:
    state = jax.lax.fori_loop(0, r * slots, step, state)
  remaining, load, _, slot_of, taken, slot_expert = state
  # the owner computes the first `remaining` rows of its expert, then each replica its
  # piece, in rank order
  is_owner = owner[:, None] == ranks[None, :]                       # [E, R]
  rows_on = jnp.where(is_owner, remaining[:, None], taken)
  start_on = jnp.where(is_owner, 0, remaining[:, None] + _exclusive_cumsum(taken, axis=1))
  return ReplicaPlan(slot_expert=slot_expert, slot_of=slot_of, rows_on=rows_on.astype(jnp.int32),
                     start_on=start_on.astype(jnp.int32), rank_rows=load.astype(jnp.int32))


def virtual_routing(topk_experts: jax.Array, count_matrix: jax.Array, plan: ReplicaPlan,
                    rank, sort=None):
  """The routing relabelled onto virtual experts (module docstring).

  topk_experts [T, K] int32 of EP rank `rank`, count_matrix C [R, E]; sort: the
  `layout.sort_assignments(topk_experts, E)` the caller already has, if any. Returns
  (virtual_topk [T, K] int32, virtual count matrix C' [R, R*(El+S)] int32)."""
  t, k = topk_experts.shape
  r, e = count_matrix.shape
  el = e // r
  g = el + plan.slots
  sort_order, sorted_position, sorted_experts, group_sizes = (
      sort if sort is not None else sort_assignments(topk_experts, e))
  # each sorted row's position in its expert's global order (source, token, slot)
  before = _exclusive_cumsum(count_matrix, axis=0)                  # [R(src), E]
  mine_before = jax.lax.dynamic_index_in_dim(before, jnp.asarray(rank, jnp.int32), 0,
                                             keepdims=False)        # [E]
  local = jnp.arange(t * k, dtype=jnp.int32) - _exclusive_cumsum(group_sizes)[sorted_experts]
  gpos = mine_before[sorted_experts] + local                        # [T*K]
  start = plan.start_on[sorted_experts]                             # [T*K, R]
  inside = (gpos[:, None] >= start) & (gpos[:, None] < start + plan.rows_on[sorted_experts])
  rho = jnp.argmax(inside, axis=1).astype(jnp.int32)                # computing rank
  owner = sorted_experts // el
  slot = jnp.take_along_axis(plan.slot_of[sorted_experts], rho[:, None], axis=1)[:, 0]
  v_sorted = rho * g + jnp.where(rho == owner, sorted_experts - owner * el, el + slot)
  virtual_topk = v_sorted[sorted_position].reshape(t, k).astype(jnp.int32)

  # C'[s, v]: rows of source s inside virtual expert v's piece
  own = jnp.arange(r, dtype=jnp.int32)[:, None] * el + jnp.arange(el, dtype=jnp.int32)[None]
  v_expert = jnp.concatenate([own, plan.slot_expert], axis=1)       # [R, G]
  v_rank = jnp.broadcast_to(jnp.arange(r, dtype=jnp.int32)[:, None], (r, g))
  used = v_expert >= 0
  ve = jnp.maximum(v_expert, 0)
  a = plan.start_on[ve, v_rank]                                     # [R, G]
  b = plan.rows_on[ve, v_rank]
  lo = before[:, ve]                                                # [R(src), R, G]
  hi = lo + count_matrix[:, ve]
  overlap = jnp.minimum(a + b, hi) - jnp.maximum(a, lo)
  virtual_counts = jnp.where(used, jnp.maximum(overlap, 0), 0).reshape(r, r * g)
  return virtual_topk, virtual_counts.astype(jnp.int32)
