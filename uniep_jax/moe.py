"""`moe_ffn`: the expert-parallel MoE FFN, wiring the steps.

Global form: `moe_ffn(x, params, *, mesh, top_k, config, expert_axis)` wraps the
per-shard form `moe_ffn_shard` in `jax.shard_map`:
  x       [N, H]   tokens sharded over every mesh axis: P((axes...), None)
  router  [H, E]   replicated
  w_*     [E, ...] experts sharded over `expert_axis`
  y       [N, H]   sharded like x
  aux     replicated scalars and [E] counts (global)

Per shard (one EP rank of one data replica), the data flow:
  1 route     (routing.py)      x -> top-k experts and weights, aux sums
  2 plan      (layout.py)       stable sort + one all_gather of the counts -> DispatchPlan
  2a balance  (balance.py)      with replica_slots: replicas of hot experts, the routing
                                relabelled onto virtual experts (El own + S slots per rank)
  3 dispatch  (dispatch.py)     x -> the owners' receive layout (transport.py moves rows)
  4 experts   (experts.py)      grouped SwiGLU over the receive layout (replicas.py: the
                                replica slots' weights from their owners, gradients back)
  5 combine   (combine.py)      expert outputs back home, weighted top-k sum
"xla_capacity" runs its own dispatch (capacity.py); "uniep" with `overlap` runs steps
3-5 with transfers inside GEMM launches (overlap.py).
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from uniep_jax import balance
from uniep_jax import routing as routing_lib
from uniep_jax import tuning
from uniep_jax.capacity import capacity_moe_shard
from uniep_jax.combine import combine, combine_sorted_rows, combine_unique, weighted_topk_sum
from uniep_jax.config import PALLAS_BACKENDS, UniEPConfig
from uniep_jax.determinism import warn_if_nondeterministic
from uniep_jax.dispatch import compiled_row_kernels, dispatch, dispatch_fp8, dispatch_unique
from uniep_jax.experts import swiglu_pallas, swiglu_ragged_dot
from uniep_jax.layout import make_plan, plan_with_dedup, receive_rows, sort_assignments
from uniep_jax.ordered_reduce import ordered_allsum, stack_replicas, stacked_spec
from uniep_jax.overlap import overlapped_moe_experts
from uniep_jax.params import MoEParams, place
from uniep_jax.reference import dense_reference_moe
from uniep_jax.replicas import expert_bytes, replicated_swiglu
from uniep_jax.transport import resolve_transport
from uniep_jax.validate import check_kernel_inputs, check_replica_slots, validate_inputs

AUX_KEYS = ("expert_counts", "load_balance_loss", "router_z_loss", "dropped", "nonfinite_tokens",
            "rank_rows", "replica_weight_bytes")


def _shard_transport(config: UniEPConfig, ep: int) -> str:
  """The transport of a per-shard caller that names none (`moe_ffn` resolves it with
  the devices' platform, `transport.resolve_transport`)."""
  if ep == 1:
    return "local"
  if config.backend == "uniep":
    return "nvlink"
  return config.transport or "padded"


def moe_ffn_shard(x, params: MoEParams, *, top_k: int, config: UniEPConfig = UniEPConfig(),
                  expert_axis: str = "expert", token_axes: Sequence[str] = ("expert",),
                  transport: str | None = None):
  """The MoE FFN on one shard, for callers already inside a `shard_map`.

  x: [T, H] this shard's tokens; params: router [H, E] (full), w_* [E/R, ...] (this
  rank's experts); token_axes: every mesh axis the tokens are sharded over (the aux
  values are reduced over them); transport: None picks "local" at one rank, "nvlink"
  for "uniep", else config.transport or "padded". Returns (y [T, H], aux).
  """
  token_axes = tuple(token_axes)
  t, _ = x.shape
  num_experts = params.router.shape[1]
  ep = jax.lax.axis_size(expert_axis)
  if config.backend in PALLAS_BACKENDS and (config.kernel is None or config.transfer is None):
    config = tuning.resolve_config(config, tokens=t, hidden=x.shape[1], ffn=params.ffn,
                                   experts=num_experts, top_k=top_k, ep=ep, dtype=x.dtype)
  if ep == 1:   # every expert here: nothing to send (UniEPConfig.one_rank_form)
    config = config.one_rank_form()
  transport = transport or _shard_transport(config, ep)

  # 1 route
  out = routing_lib.route(x, params.router, top_k, config.routing, params.expert_bias)
  counts, prob_sum, z_sum = routing_lib.local_aux_sums(out, num_experts, config.routing)
  counts = jax.lax.psum(counts, token_axes)   # integers: exact in any order
  # float sums in a fixed order (not NCCL's), forward and backward; one collective
  sums = ordered_allsum(jnp.concatenate([prob_sum, z_sum[None]]), token_axes)
  prob_sum, z_sum = sums[:num_experts], sums[num_experts]
  num_tokens = t * math.prod(jax.lax.axis_size(a) for a in token_axes)
  lb, z = routing_lib.aux_losses(counts, prob_sum, z_sum, num_tokens, top_k)

  if config.backend == "xla_capacity":
    y_assign, dropped = capacity_moe_shard(x, out.topk_experts, params, top_k=top_k,
                                           capacity_factor=config.capacity_factor,
                                           axis_name=expert_axis)
    y = weighted_topk_sum(y_assign, out.topk_weights, out_dtype=x.dtype)
    rank_rows = jnp.sum(counts.reshape(ep, -1), axis=1, dtype=jnp.int32)
    copies = jnp.zeros((), jnp.int32)
  elif config.backend == "dense_reference":
    raise ValueError("backend 'dense_reference' has no per-shard form: call moe_ffn")
  else:
    y, dropped, computed, copies = _dropless_shard(x, params, out, top_k=top_k, config=config,
                                                   expert_axis=expert_axis, transport=transport)
    # each rank's own entry, summed over the data replicas (integers: any order)
    mine = jnp.arange(ep) == jax.lax.axis_index(expert_axis)
    rank_rows = jax.lax.psum(jnp.where(mine, computed, 0).astype(jnp.int32), token_axes)
  nonfinite = jnp.sum(~routing_lib.finite_tokens(out.logits), dtype=jnp.int32)
  per_copy = expert_bytes(x.shape[1], params.ffn, jnp.dtype(params.w_gate_up.dtype).itemsize)
  aux = dict(expert_counts=counts, load_balance_loss=lb, router_z_loss=z,
             dropped=jax.lax.psum(dropped, token_axes),
             nonfinite_tokens=jax.lax.psum(nonfinite, token_axes),
             rank_rows=rank_rows,
             replica_weight_bytes=jax.lax.psum(copies, token_axes).astype(jnp.float32)
             * jnp.float32(per_copy))
  return y, aux


def _dropless_shard(x, params: MoEParams, out, *, top_k, config: UniEPConfig, expert_axis,
                    transport):
  """Steps 2-5 of the dropless backends: (y [T, H], rows this rank dropped, rows this
  rank computes, expert weight copies this rank received)."""
  t = x.shape[0]
  num_experts = params.router.shape[1]
  el = params.w_gate_up.shape[0]
  ep = num_experts // el
  slots = config.replica_slots if ep > 1 else 0
  check_replica_slots(slots, num_experts, ep)
  rank = jax.lax.axis_index(expert_axis)
  recv_rows = receive_rows(t, top_k, ep, config.receive_capacity_factor)
  weights = out.topk_weights
  topk = out.topk_experts
  sort = count_matrix = slot_expert = None
  copies = jnp.zeros((), jnp.int32)
  if slots or transport != "nvlink":
    sort = sort_assignments(topk, num_experts)
    count_matrix = jax.lax.all_gather(sort[3], expert_axis)   # [R, E]: every rank's group sizes
  if slots:   # 2a: relabel onto virtual experts (El own + S replica slots per rank)
    rplan = balance.plan_replicas(count_matrix, slots)
    topk, count_matrix = balance.virtual_routing(topk, count_matrix, rplan, rank, sort=sort)
    num_experts, sort, slot_expert = count_matrix.shape[1], None, rplan.slot_expert
    copies = jnp.sum(slot_expert[rank] >= 0, dtype=jnp.int32)

  # precision "fp8": the experts compute on each token's quantised row, sent as e4m3
  # and scales (dispatch.py)
  fp8_dispatch = config.precision == "fp8"

  def experts(recv, group_sizes, kernel_config, x_quantised=None):
    """Step 4 (kernel_config None: `lax.ragged_dot`); with replicas, the slots' weights
    come from their owners and their gradients go back (replicas.py)."""
    if slots:
      return replicated_swiglu(recv, params.w_gate_up, params.w_down, slot_expert,
                               group_sizes, kernel_config, kernel_config is None, expert_axis,
                               transport, config.transfer, config.precision, x_quantised)
    if kernel_config is None:
      return swiglu_ragged_dot(recv, params.w_gate_up, params.w_down, group_sizes)
    return swiglu_pallas(recv, params.w_gate_up, params.w_down, group_sizes,
                         kernel_config=kernel_config, zero_dead_rows=False,
                         precision=config.precision, x_quantised=x_quantised)

  if transport == "nvlink":   # "uniep": each (token, owner) row sent once
    plan, dplan = plan_with_dedup(topk, weights, num_experts=num_experts,
                                  axis_name=expert_axis, recv_rows=recv_rows)
    if config.overlap is not None:   # no replicas (UniEPConfig refuses both)
      y = overlapped_moe_experts(x, params.w_gate_up, params.w_down, weights, plan, dplan,
                                 axis_name=expert_axis, kernel=config.kernel,
                                 transfer=config.transfer, overlap=config.overlap,
                                 out_dtype=x.dtype)
      return y, plan.dropped, plan.num_received, copies
    x_quantised = None
    if fp8_dispatch:   # e4m3 rows and scales, each (token, owner) pair once
      recv, q, s = dispatch_fp8(x, plan, expert_axis, "nvlink", config.transfer, dplan)
      x_quantised = (q, s)
    else:
      recv = dispatch_unique(x, plan, dplan, expert_axis, config.transfer)   # [recv_rows, H]
    y_recv = experts(recv, plan.recv_group_sizes, config.kernel, x_quantised)
    y = combine_unique(y_recv, weights, plan, dplan, expert_axis, config.transfer, x.dtype)
    return y, plan.dropped, plan.num_received, copies

  plan = make_plan(topk, count_matrix, rank, recv_rows=recv_rows, sort=sort)
  pallas = config.backend in PALLAS_BACKENDS
  # the Pallas backends move rows with the live-rows copy where kernels compile
  row_kernel = pallas and compiled_row_kernels(x.shape[1], x.dtype)
  x_quantised = None
  if fp8_dispatch:   # e4m3 rows and their scales: [recv_rows, Hp], [recv_rows, Hp/128]
    recv, q, s = dispatch_fp8(x, plan, expert_axis, transport)
    x_quantised = (q, s)
  else:
    recv = dispatch(x, plan, axis_name=expert_axis, transport=transport,
                    row_kernel=row_kernel)                           # [recv_rows, H]
  # the receive layout holds the worst case (R*T*K rows); its dead rows are never read
  # back (the combine takes the live rows only): the Pallas kernels skip them
  y_recv = experts(recv, plan.recv_group_sizes, config.kernel if pallas else None,
                   x_quantised)
  if transport == "local" and row_kernel and recv_rows is None:
    y = combine_sorted_rows(y_recv, weights, plan, x.dtype)   # its backward: one row copy
  else:
    y = combine(y_recv, weights, plan, axis_name=expert_axis, transport=transport,
                out_dtype=x.dtype)                               # [T, K, H] -> [T, H]
  return y, plan.dropped, plan.num_received, copies


# ---------------------------------------------------------------------------
# Global form.
# ---------------------------------------------------------------------------
def param_specs(params: MoEParams, expert_axis: str = "expert") -> MoEParams:
  """PartitionSpecs of `MoEParams`: experts over `expert_axis`, the rest replicated."""
  return MoEParams(router=P(), w_gate_up=P(expert_axis), w_down=P(expert_axis),
                   expert_bias=None if params.expert_bias is None else P())


def shard_map_type_checked(backend: str) -> bool:
  """Whether a shard_map around this backend can check its values' varying mesh axes
  (`check_vma`): the Pallas kernels' calls carry no such types, so "pallas" and "uniep"
  run unchecked."""
  return backend not in PALLAS_BACKENDS


def _checked_transport(config: UniEPConfig, mesh, x, params: MoEParams, ep: int) -> str:
  platform = mesh.devices.flat[0].platform
  transport = resolve_transport(config, platform=platform, ep=ep,
                                process_count=jax.process_count())
  check_kernel_inputs(config, platform, transport, x, params)
  warn_if_nondeterministic(platform)
  return transport


def _moe_ffn_in_shard_map(x, params: MoEParams, *, mesh, manual: set, top_k: int,
                          config: UniEPConfig, expert_axis: str):
  """`moe_ffn` called inside a shard_map over all of `mesh`'s axes (e.g. the training
  step's per-shard gradients, `train/loop.py`): x is this shard's tokens and the w_*
  this rank's experts, so it is `moe_ffn_shard` with the mesh's axes as token axes."""
  if not set(mesh.axis_names) <= manual:
    raise ValueError(f"moe_ffn inside a shard_map needs every axis of mesh {tuple(mesh.axis_names)} "
                     f"manual; manual axes here: {tuple(sorted(manual))}")
  ep = jax.lax.axis_size(expert_axis)
  whole = lambda a: jax.ShapeDtypeStruct((a.shape[0] * ep,) + a.shape[1:], a.dtype)  # noqa: E731
  validate_inputs(x, params.replace(w_gate_up=whole(params.w_gate_up),
                                    w_down=whole(params.w_down)),
                  top_k=top_k, config=config, expert_axis=expert_axis)
  transport = _checked_transport(config, mesh, x, params, ep)
  return moe_ffn_shard(x, params, top_k=top_k, config=config, expert_axis=expert_axis,
                       token_axes=tuple(mesh.axis_names), transport=transport)


def moe_ffn(x, params: MoEParams, *, mesh, top_k: int, config: UniEPConfig = UniEPConfig(),
            expert_axis: str = "expert"):
  """The MoE FFN over a mesh. Returns (y [N, H] in x.dtype, aux dict):

  aux["expert_counts"]     [E] int32  assignments per expert, global
  aux["load_balance_loss"] f32        Switch-style E * sum_e f_e P_e
  aux["router_z_loss"]     f32        mean_t logsumexp(logits_t)^2
  aux["dropped"]           int32      dropped assignments (0 unless "xla_capacity"
                                      or a receive_capacity_factor bound overflows)
  aux["nonfinite_tokens"]  int32      tokens with a non-finite router logit (NaN or inf
                                      in x): routed to experts 0..K-1, see routing.py
  aux["rank_rows"]         [R] int32  rows each EP rank computes (summed over the data
                                      replicas); max / mean is the imbalance the layer
                                      waits for ("xla_capacity": rows its experts are
                                      sent before the capacity cut; "dense_reference": [1])
  aux["replica_weight_bytes"] f32     bytes of expert weights copied to replica slots
                                      (`UniEPConfig.replica_slots`; one direction)
  """
  if config.backend == "dense_reference":
    validate_inputs(x, params, top_k=top_k, config=config)
    return dense_reference_moe(x, params, top_k=top_k, config=config)
  if mesh is None:
    raise ValueError(f"mesh is required for backend={config.backend!r}")
  manual = set(jax.sharding.get_abstract_mesh().manual_axes)
  if manual:
    return _moe_ffn_in_shard_map(x, params, mesh=mesh, manual=manual, top_k=top_k, config=config,
                                 expert_axis=expert_axis)
  validate_inputs(x, params, top_k=top_k, config=config, expert_axis=expert_axis, mesh=mesh)
  transport = _checked_transport(config, mesh, x, params, mesh.shape[expert_axis])
  token_axes = tuple(mesh.axis_names)
  x_spec = P(token_axes, None)
  p_specs = param_specs(params, expert_axis)
  x = place(x, NamedSharding(mesh, x_spec))
  params = jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), params, p_specs)
  # A parameter replicated over mesh axes (the router; the experts over "data") goes
  # in as one copy per shard, so that its gradient is the copies' cotangents summed by
  # us in rank order (`stack_replicas`) rather than the psum shard_map's transpose
  # would add, whose float order NCCL picks per program.
  leaves, treedef = jax.tree.flatten(params)
  leaf_specs = tuple(jax.tree.leaves(p_specs, is_leaf=lambda s: isinstance(s, P)))
  stacked = treedef.unflatten(stack_replicas(tuple(leaves), mesh, leaf_specs))
  stacked_specs = treedef.unflatten([stacked_spec(mesh, s) for s in leaf_specs])

  def body(x_local, stacked_local):
    params_local = jax.tree.map(lambda a: a[0], stacked_local)
    return moe_ffn_shard(x_local, params_local, top_k=top_k, config=config,
                         expert_axis=expert_axis, token_axes=token_axes, transport=transport)

  aux_specs = {k: P() for k in AUX_KEYS}
  fn = jax.shard_map(body, mesh=mesh, in_specs=(x_spec, stacked_specs),
                     out_specs=(x_spec, aux_specs),
                     check_vma=shard_map_type_checked(config.backend))
  return fn(x, stacked)
