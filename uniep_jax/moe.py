"""`moe_ffn`: the expert-parallel MoE FFN, wiring routing, dispatch, experts, combine.

Global form: `moe_ffn(x, params, *, mesh, top_k, config, expert_axis)` wraps the
per-shard form `moe_ffn_shard` in `jax.shard_map`:
  x       [N, H]   tokens sharded over every mesh axis: P((axes...), None)
  router  [H, E]   replicated
  w_*     [E, ...] experts sharded over `expert_axis`
  y       [N, H]   sharded like x
  aux     replicated scalars and [E] counts (global)

Per shard (one EP rank of one data replica):
  route -> plan (stable sort + count matrix all-gather) -> dispatch -> grouped
  SwiGLU -> collect -> weighted top-k sum.
"""

from __future__ import annotations

import math
import operator
from typing import Sequence

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

from uniep_jax import routing as routing_lib
from uniep_jax.capacity import capacity_moe_shard
from uniep_jax.combine import SlotOwners, combine_sorted_rows, weighted_topk_sum
from uniep_jax.config import BACKENDS, SCORE_FUNCTIONS, UniEPConfig
from uniep_jax.config import TRANSPORTS
from uniep_jax.dedup import combine_unique, dispatch_unique, plan_with_dedup
from uniep_jax.dispatch import (ZERO_WINDOW_ROWS, collect, compiled_row_kernels,
                                default_transport, dispatch, sort_rows, unsort_rows)
from uniep_jax.experts import swiglu_pallas, swiglu_ragged_dot
from uniep_jax.layout import local_group_sizes, make_plan
from uniep_jax.ordered_reduce import ordered_allsum, stack_replicas, stacked_spec
from uniep_jax.params import MoEParams, place
from uniep_jax.reference import dense_reference_moe

AUX_KEYS = ("expert_counts", "load_balance_loss", "router_z_loss", "dropped")


# ---------------------------------------------------------------------------
# Validation: every bad input gets a ValueError naming the argument.
# ---------------------------------------------------------------------------
def validate_inputs(x, params: MoEParams, *, top_k, config: UniEPConfig,
                    expert_axis: str | None = None, mesh=None):
  if not isinstance(config, UniEPConfig):
    raise ValueError(f"config must be a UniEPConfig, got {type(config).__name__}")
  if config.backend not in BACKENDS:
    raise ValueError(f"config.backend={config.backend!r} is unknown; expected one of {BACKENDS}")
  if config.routing.score_fn not in SCORE_FUNCTIONS:
    raise ValueError(f"config.routing.score_fn={config.routing.score_fn!r} is unknown; "
                     f"expected one of {SCORE_FUNCTIONS}")
  if config.transport is not None and config.transport not in TRANSPORTS:
    raise ValueError(f"config.transport={config.transport!r} is unknown; expected one of {TRANSPORTS}")
  if not isinstance(params, MoEParams):
    raise ValueError(f"params must be a uniep_jax.MoEParams, got {type(params).__name__}")
  if x.ndim != 2:
    raise ValueError(f"x must be rank 2 [tokens, hidden], got shape {x.shape}")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
  if params.router.ndim != 2:
    raise ValueError(f"params.router must be [hidden, experts], got shape {params.router.shape}")
  hidden, num_experts = params.router.shape
  if x.shape[1] != hidden:
    raise ValueError(f"x hidden size {x.shape[1]} does not match params.router hidden size {hidden}")
  if params.router.dtype != jnp.float32:
    raise ValueError(f"params.router must be float32, got {params.router.dtype}")
  for name in ("w_gate_up", "w_down"):
    w = getattr(params, name)
    if w.ndim != 3:
      raise ValueError(f"params.{name} must be rank 3, got shape {w.shape}")
    if w.dtype != x.dtype:
      raise ValueError(f"params.{name} dtype {w.dtype} differs from x dtype {x.dtype}")
  e, h, two_f = params.w_gate_up.shape
  if two_f % 2:
    raise ValueError(f"params.w_gate_up shape {params.w_gate_up.shape}: the last axis must be "
                     f"even, [w_gate | w_up] of F columns each")
  f = two_f // 2
  if params.w_down.shape != (e, f, h):
    raise ValueError(f"params.w_down shape {params.w_down.shape} must be {(e, f, h)} "
                     f"(params.w_gate_up is {params.w_gate_up.shape} = [E, H, 2F])")
  if e != num_experts or h != hidden:
    raise ValueError(f"params.w_gate_up shape {params.w_gate_up.shape} does not match "
                     f"params.router [hidden={hidden}, experts={num_experts}]")
  if params.expert_bias is not None and params.expert_bias.shape != (num_experts,):
    raise ValueError(f"params.expert_bias must have shape ({num_experts},), got {params.expert_bias.shape}")
  if params.expert_bias is not None and not jnp.issubdtype(params.expert_bias.dtype, jnp.floating):
    raise ValueError(f"params.expert_bias must be floating point, got {params.expert_bias.dtype}")
  try:
    top_k = operator.index(top_k)
  except TypeError:
    raise ValueError(f"top_k={top_k!r} must be an integer") from None
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k={top_k} must be an int in [1, num_experts={num_experts}]")
  if config.transport == "nvlink" and config.backend not in ("pallas", "uniep"):
    raise ValueError(f"config.transport='nvlink' leaves padding rows of the receive buffer "
                     f"unwritten; only the Pallas experts (backend 'pallas' or 'uniep') are "
                     f"written for that, not backend={config.backend!r}")
  uses_nvlink = config.backend == "uniep" or config.transport == "nvlink"
  if uses_nvlink and config.kernel is not None and config.kernel.block_k > ZERO_WINDOW_ROWS:
    raise ValueError(f"config.kernel.block_k={config.kernel.block_k} exceeds the "
                     f"{ZERO_WINDOW_ROWS} zeroed rows after the live ones that the NVLink "
                     f"transport guarantees (the wgrad reads up to block_k - 1 rows past a group)")
  if config.routing.n_groups > 1:
    if num_experts % config.routing.n_groups:
      raise ValueError(f"config.routing.n_groups={config.routing.n_groups} must divide "
                       f"num_experts={num_experts}")
    eligible = config.routing.topk_groups * (num_experts // config.routing.n_groups)
    if top_k > eligible:
      raise ValueError(f"top_k={top_k} exceeds the experts of the topk_groups="
                       f"{config.routing.topk_groups} eligible groups ({eligible})")
  if mesh is not None:
    if expert_axis not in mesh.axis_names:
      raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack expert_axis={expert_axis!r}")
    ep = mesh.shape[expert_axis]
    if num_experts % ep:
      raise ValueError(f"num_experts={num_experts} is not divisible by the size of "
                       f"expert_axis {expert_axis!r} ({ep})")
    if config.dedup_send_groups > 1 and (num_experts // ep) % config.dedup_send_groups:
      raise ValueError(f"config.dedup_send_groups={config.dedup_send_groups} must divide the "
                       f"{num_experts // ep} local experts per rank")
    shards = math.prod(mesh.shape.values())
    if x.shape[0] % shards:
      raise ValueError(f"x has {x.shape[0]} tokens, not divisible by the {shards} token shards "
                       f"of mesh {dict(mesh.shape)}")


# ---------------------------------------------------------------------------
# Receive buffer size (dropless backends).
# ---------------------------------------------------------------------------
def receive_rows(tokens_per_shard: int, top_k: int, ep: int, config: UniEPConfig) -> int | None:
  """Rows of a rank's receive buffer: None (= R*T*K, the dropless worst case)
  unless `config.receive_capacity_factor` bounds it."""
  worst = ep * tokens_per_shard * top_k
  f = config.receive_capacity_factor
  if f is None:
    return None
  need = math.ceil(f * tokens_per_shard * top_k)
  granule = 128 if need >= 1024 else 8          # whole GEMM row tiles at real sizes
  rows = -(-need // granule) * granule
  return None if rows >= worst else rows


def receive_buffer_bytes(tokens_per_shard: int, top_k: int, hidden: int, ep: int,
                         itemsize: int = 2, config: UniEPConfig = UniEPConfig()) -> int:
  """Bytes of one rank's receive buffer (one [rows, H] activation buffer)."""
  rows = receive_rows(tokens_per_shard, top_k, ep, config) or ep * tokens_per_shard * top_k
  return rows * hidden * itemsize


# ---------------------------------------------------------------------------
# Per-shard form.
# ---------------------------------------------------------------------------
def moe_ffn_shard(x, params: MoEParams, *, top_k: int, config: UniEPConfig = UniEPConfig(),
                  expert_axis: str = "expert", token_axes: Sequence[str] = ("expert",),
                  transport: str | None = None):
  """The MoE FFN on one shard, for callers already inside a `shard_map`.

  x: [T, H] this shard's tokens; params: router [H, E] (full), w_* [E/R, ...]
  (this rank's experts); token_axes: every mesh axis the tokens are sharded over
  (the aux values are reduced over them). Returns (y [T, H], aux).
  """
  token_axes = tuple(token_axes)
  t, _ = x.shape
  num_experts = params.router.shape[1]
  el = params.w_gate_up.shape[0]
  ep = jax.lax.axis_size(expert_axis)
  uses_tuning = config.backend in ("pallas", "uniep") or config.transport == "nvlink"
  if uses_tuning and (config.kernel is None or config.transfer is None):   # "auto"
    from uniep_jax.tune import resolve_config  # tune cache, else the heuristic
    config = resolve_config(config, tokens=t, hidden=x.shape[1], ffn=params.ffn,
                            experts=num_experts, top_k=top_k, ep=ep, dtype=x.dtype)
  if ep == 1:   # every expert here: nothing to send (UniEPConfig.one_rank_form)
    config = config.one_rank_form()
  if config.transport == "local":
    transport = "local"
  out = routing_lib.route(x, params.router, top_k, config.routing, params.expert_bias)

  counts, prob_sum, z_sum = routing_lib.local_aux_sums(out, num_experts, config.routing)
  counts = jax.lax.psum(counts, token_axes)   # integers: exact in any order
  # float sums in a fixed order (not NCCL's), forward and backward; one collective
  sums = ordered_allsum(jnp.concatenate([prob_sum, z_sum[None]]), token_axes)
  prob_sum, z_sum = sums[:num_experts], sums[num_experts]
  num_tokens = t * math.prod(jax.lax.axis_size(a) for a in token_axes)
  lb, z = routing_lib.aux_losses(counts, prob_sum, z_sum, num_tokens, top_k)

  # "owner_partials": each slot's owner rank, for the two-level sums (combine.py)
  owners = (SlotOwners(out.topk_experts.astype(jnp.int32), el,
                       presum_on_owner=config.receive_capacity_factor is None)
            if config.slot_reduction == "owner_partials" else None)
  if config.backend == "xla_capacity":
    y_assign, dropped = capacity_moe_shard(
        x, out.topk_experts, params, top_k=top_k,
        capacity_factor=config.capacity_factor, axis_name=expert_axis, owners=owners)
    dropped = jax.lax.psum(dropped, token_axes)
    y = weighted_topk_sum(y_assign, out.topk_weights, out_dtype=x.dtype, owners=owners)
  elif config.backend in ("xla_dropless", "pallas", "uniep"):
    transport = transport or config.transport or "padded"
    if config.backend == "uniep":
      transport = "nvlink"
    dedup = config.use_dedup_tokens
    recv_rows = receive_rows(t, top_k, num_experts // el, config)
    # the Pallas backends move rows with the live-rows copy where kernels compile
    row_kernel = config.backend in ("pallas", "uniep") and compiled_row_kernels()
    kw = dict(top_k=top_k, axis_name=expert_axis, num_local_experts=el, transport=transport,
              transfer=config.transfer)
    if dedup:   # each (token, owner) pair sent once (uniep_jax/dedup.py)
      plan, dplan = plan_with_dedup(out.topk_experts, out.topk_weights, num_experts=num_experts,
                                    axis_name=expert_axis, top_k=top_k, recv_rows=recv_rows,
                                    send_groups=config.dedup_send_groups)
    else:
      count_matrix = jax.lax.all_gather(
          local_group_sizes(out.topk_experts, num_experts), expert_axis)   # [R, E]
      plan = make_plan(out.topk_experts, count_matrix, jax.lax.axis_index(expert_axis),
                       recv_rows=recv_rows)
    plan = plan.replace(slot_owners=owners)
    if config.fused is not None:   # "uniep" with the v2 fused kernels (uniep_jax/fused.py)
      from uniep_jax.fused import fused_expert_ffn, fused_expert_ffn_combine
      fkw = dict(axis_name=expert_axis, num_local_experts=el, kernel=config.kernel,
                 transfer=config.transfer, fused=config.fused,
                 grad_in_kernel=config.use_swiglu_grad_in_kernel)
      if dedup:   # the dy dispatch is unique; the forward's rows move in Kernel A, or
        # unique too (dispatch_in_kernel=False: x itself goes in)
        rows_in = sort_rows(x, plan, top_k) if config.fused.dispatch_in_kernel else x
        y = fused_expert_ffn_combine(rows_in, params.w_gate_up, params.w_down,
                                     out.topk_weights, plan, dplan, top_k=top_k,
                                     out_dtype=x.dtype, **fkw)
      else:
        y_sorted = fused_expert_ffn(sort_rows(x, plan, top_k), params.w_gate_up, params.w_down,
                                    plan, **fkw)
        y = weighted_topk_sum(unsort_rows(y_sorted, plan, top_k), out.topk_weights,
                              out_dtype=x.dtype)
    else:
      if dedup:
        recv = dispatch_unique(x, plan, dplan, top_k, expert_axis, el, transport,
                               config.transfer)                          # [R*T*K, H]
      else:
        recv = dispatch(x, plan, **kw, row_kernel=row_kernel)           # [R*T*K, H]
      if config.backend in ("pallas", "uniep"):
        # the receive layout holds the worst case (R*T*K rows); its dead rows are
        # never read back (collect takes the live rows only): the kernels skip them
        y_recv = swiglu_pallas(recv, params.w_gate_up, params.w_down,
                               plan.recv_group_sizes, kernel_config=config.kernel,
                               zero_dead_rows=False,
                               grad_in_kernel=config.use_swiglu_grad_in_kernel)
      else:
        y_recv = swiglu_ragged_dot(recv, params.w_gate_up, params.w_down,
                                   plan.recv_group_sizes)
      if dedup:   # its backward sends each (token, owner) pair's dy once
        y = combine_unique(y_recv, out.topk_weights, plan, dplan, top_k, expert_axis, el,
                           transport, config.transfer, x.dtype)
      elif (transport == "local" and row_kernel and owners is None
            and recv_rows is None):   # one rank: its backward in one weighted row copy
        y = combine_sorted_rows(y_recv, out.topk_weights, plan, top_k, x.dtype)
      else:
        y = weighted_topk_sum(collect(y_recv, plan, **kw), out.topk_weights,
                              out_dtype=x.dtype, owners=plan.slot_owners)  # [T, K, H] -> [T, H]
    dropped = jax.lax.psum(plan.dropped, token_axes)
  else:
    raise ValueError(f"config.backend={config.backend!r} has no per-shard form")

  aux = dict(expert_counts=counts, load_balance_loss=lb, router_z_loss=z, dropped=dropped)
  return y, aux


# ---------------------------------------------------------------------------
# Global form.
# ---------------------------------------------------------------------------
def check_kernel_dtypes(backend: str, platform: str, x, params: MoEParams) -> None:
  """The Pallas backends' GPU kernels (wgmma) take 16-bit operands: a clear error
  before tracing instead of Mosaic's "Only f16 WGMMA supports transposes" from the
  backward pass (seen with float32 on 4x H200, 2026-11-26)."""
  if backend not in ("pallas", "uniep") or platform != "gpu":
    return
  wide = [f"{name} is {jnp.dtype(a.dtype)}" for name, a in
          (("x", x), ("params.w_gate_up", params.w_gate_up), ("params.w_down", params.w_down))
          if jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))]
  if wide:
    raise ValueError(f"backend={backend!r} runs 16-bit wgmma kernels on GPUs, which take "
                     f"bfloat16 or float16 operands: {', '.join(wide)}; cast them, or use "
                     f"backend 'xla_dropless' for float32")


def param_specs(params: MoEParams, expert_axis: str = "expert") -> MoEParams:
  """PartitionSpecs of `MoEParams`: experts over `expert_axis`, the rest replicated."""
  return MoEParams(router=P(), w_gate_up=P(expert_axis), w_down=P(expert_axis),
                   expert_bias=None if params.expert_bias is None else P())


def shard_map_type_checked(backend: str) -> bool:
  """Whether a shard_map around this backend can check its values' varying mesh axes
  (`check_vma`): the Pallas kernels' calls carry no such types, so "pallas" and
  "uniep" run unchecked."""
  return backend not in ("pallas", "uniep")


def resolve_transport(config: UniEPConfig, platform: str, x, params: MoEParams,
                      ep: int | None = None) -> str:
  """The transport `moe_ffn` uses here, after checking what the backend and transport
  need of the devices and processes (ValueErrors). ep: the expert axis' size; with one
  rank nothing moves between devices (`UniEPConfig.one_rank_form`: "local")."""
  if ep == 1:
    config = config.one_rank_form()
  if config.transport == "local":
    if ep is not None and ep != 1:
      raise ValueError(f"config.transport='local' moves no row between ranks: it needs an "
                       f"expert axis of size 1, got {ep}")
    check_kernel_dtypes(config.backend, platform, x, params)
    return "local"
  if config.backend == "uniep" or config.transport == "nvlink":
    # The kernels address peer GPUs' buffers directly (one process drives every GPU it
    # addresses). Across processes that takes NVSHMEM, and jaxlib 0.11.2's XLA has no
    # NVSHMEM mode: it aborts on --xla_gpu_experimental_enable_nvshmem ("Unknown flag in
    # XLA_FLAGS", 4x H200, 2026-11-26).
    if jax.process_count() > 1:
      raise ValueError(f"backend={config.backend!r} (in-kernel NVLink transfers) is unsupported in "
                       f"multi-process runs ({jax.process_count()} processes): its kernels write "
                       f"into peer GPUs' memory, which across processes needs NVSHMEM, and this "
                       f"jaxlib ({jax.__version__}) has no NVSHMEM mode; use backend 'pallas' "
                       f"(same kernels and bits, XLA collectives between processes) or "
                       f"'xla_dropless'")
    if platform != "gpu":
      raise ValueError(f"backend={config.backend!r} with in-kernel NVLink transfers needs GPUs; "
                       f"the mesh holds {platform} devices")
  check_kernel_dtypes(config.backend, platform, x, params)
  if config.transport == "ragged" and jax.process_count() > 1:
    raise ValueError(f"config.transport='ragged' hangs in multi-process runs "
                     f"({jax.process_count()} processes): lax.ragged_all_to_all between processes "
                     f"goes through XLA's NCCL send/recv fallback, whose first call never returned "
                     f"with jaxlib 0.11.2 on 4 H200s; use 'padded' or None (None picks 'padded' "
                     f"across processes)")
  if config.transport == "ragged" and platform != "gpu":
    raise ValueError(f"config.transport='ragged' (lax.ragged_all_to_all) does not compile on "
                     f"{platform}; use 'padded' or None")
  return config.transport or default_transport(platform, jax.process_count())


def _moe_ffn_in_shard_map(x, params: MoEParams, *, mesh, manual: set, top_k: int,
                          config: UniEPConfig, expert_axis: str):
  """`moe_ffn` called inside a shard_map over all of `mesh`'s axes (e.g. the training
  step's per-shard gradients, `train/loop.py`): x is this shard's tokens and the w_*
  this rank's experts, so it is `moe_ffn_shard` with the mesh's axes as token axes."""
  if not set(mesh.axis_names) <= manual:
    raise ValueError(f"moe_ffn inside a shard_map needs every axis of mesh {tuple(mesh.axis_names)} "
                     f"manual; manual axes here: {tuple(sorted(manual))}")
  ep = jax.lax.axis_size(expert_axis)
  whole = lambda a: jax.ShapeDtypeStruct((a.shape[0] * ep,) + a.shape[1:], a.dtype)
  validate_inputs(x, params.replace(w_gate_up=whole(params.w_gate_up),
                                    w_down=whole(params.w_down)),
                  top_k=top_k, config=config, expert_axis=expert_axis)
  transport = resolve_transport(config, mesh.devices.flat[0].platform, x, params, ep=ep)
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
  transport = resolve_transport(config, mesh.devices.flat[0].platform, x, params,
                                ep=mesh.shape[expert_axis])
  token_axes = tuple(mesh.axis_names)
  x_spec = P(token_axes, None)
  p_specs = param_specs(params, expert_axis)
  x = place(x, NamedSharding(mesh, x_spec))
  params = jax.tree.map(lambda a, s: place(a, NamedSharding(mesh, s)), params, p_specs)
  # A parameter replicated over mesh axes (the router; the experts over "data") goes
  # in as one copy per shard, so that its gradient is the copies' cotangents summed by
  # us in rank order (`stack_replicas`) rather than the psum shard_map's transpose
  # would add, whose float order NCCL picks per program (4x H200, 2026-11-26: the
  # router's gradient differed between backends "pallas" and "uniep").
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
