"""The training loop: init on the mesh, jitted train step, eval, checkpoints, metrics.

State is kept as flat dicts {"layers.0.attn.wq": array, ...} (easy to checkpoint
and to hand to optax); `nnx.merge` rebuilds the model inside the jitted step.
  params  nnx.Param arrays, sharded by their `out_sharding` metadata
  rest    the other variables (the `ExpertBias` of each MoE layer)
  opt     optax state (clip -> AdamW with warmup + cosine decay)
Batches are split over every mesh axis; the experts over "expert".

Multi-process runs (after `train.distributed.initialize`): the mesh spans every
process's devices, each process builds only its own rows of every batch, all of them
take part in checkpoints and in the checksum's gathers, and process 0 alone prints and
writes the run folder's files.

The run folder (--out): metrics.jsonl (one small line per step: losses, gradient norm,
the routing's max load overall and per MoE layer, the expert-parallel ranks' row
imbalance per layer; the held-out loss in nats per token and bits per byte at
evaluations), expert_counts.jsonl (per step, each MoE layer's expert counts: the data of
expert_load.png), summary.json, loss.png and expert_load.png.
"""

from __future__ import annotations

import dataclasses
import fcntl
import hashlib
import importlib.metadata
import json
import os
import pathlib
import platform
import re
import time
import uuid
from typing import Any, Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec as P

from models.config import ModelConfig, get_config
from models.report import format_report, model_report
from models.transformer import Transformer
from train.checkpoint import Checkpointer
from train.config import TrainConfig
from train.data import Dataset, make_dataset, unigram_entropy
from train.distributed import from_local_rows, host_value, is_main_process, local_rows
from train.mesh import MESH_AXES, ConfigError, make_mesh, parse_mesh, validate_mesh
from uniep_jax.ordered_reduce import ordered_psum, ordered_psum_buckets, ordered_psum_many
from uniep_jax.moe import shard_map_type_checked

LN2 = float(np.log(2.0))


# ----------------------------------------------------------------------------- state as flat dicts

def _key(path) -> str:
  return ".".join(str(p) for p in path)


def flat_arrays(state: nnx.State) -> dict[str, jax.Array]:
  return {_key(path): var.get_value() for path, var in nnx.to_flat_state(state)}


def unflatten(template: nnx.State, arrays: dict[str, jax.Array]) -> nnx.State:
  """The inverse of `flat_arrays`, given a state of the same structure (abstract is fine)."""
  return nnx.from_flat_state([(path, var.replace(arrays[_key(path)]))
                              for path, var in nnx.to_flat_state(template)])


def flat_shardings(state: nnx.State, mesh) -> dict[str, NamedSharding]:
  return flat_arrays(nnx.get_named_sharding(state, mesh))


# ----------------------------------------------------------------------------- setup

@dataclasses.dataclass
class Setup:
  cfg: TrainConfig
  model_cfg: ModelConfig
  mesh: Any
  graphdef: Any
  params_tmpl: nnx.State
  rest_tmpl: nnx.State
  param_sh: dict
  rest_sh: dict
  batch_sh: NamedSharding
  tx: optax.GradientTransformation
  schedule: Any  # step -> learning rate
  bias_rate: float
  lr: float  # peak learning rate (cfg.lr, else the model config's)


def moe_options(cfg: TrainConfig, expert_ranks: Optional[int] = None) -> dict:
  """The Pallas expert FFN's options this run resolves to (defaults included), for
  the log and summary.json: a resumed or compared run shows what produced its bits.
  expert_ranks: the mesh's expert axis size; with one rank the layer runs its one-rank
  form (`UniEPConfig.one_rank_form`: no transfer, no de-duplication, no overlap)."""
  if cfg.backend not in ("pallas", "uniep"):
    return {}
  from uniep_jax.config import KernelConfig, OverlapConfig, UniEPConfig
  stages = KernelConfig().max_concurrent_steps if cfg.kernel_stages is None else cfg.kernel_stages
  c = UniEPConfig(backend=cfg.backend, overlap=OverlapConfig() if cfg.overlap else None)
  one_rank = expert_ranks == 1
  if one_rank:
    c = c.one_rank_form()
  out = dict(kernel_stages=stages, overlap=c.overlap is not None,
             dedup_tokens=c.backend == "uniep")
  if one_rank:
    out["one_rank"] = True   # the local transport: nothing moves between GPUs
  return out


def build_model(cfg: TrainConfig, model_cfg: ModelConfig, mesh) -> Transformer:
  """The model that `cfg` trains (its MoE options), initialised from cfg.seed."""
  return Transformer(model_cfg, mesh=mesh, backend=cfg.backend, capacity_factor=cfg.capacity_factor,
                     kernel_stages=cfg.kernel_stages, overlap=cfg.overlap,
                     replica_slots=cfg.replica_slots,
                     precision="fp8" if cfg.fp8 else "bf16", rngs=nnx.Rngs(cfg.seed))


class Diverged(RuntimeError):
  """The run stopped: `max_skipped_steps` steps in a row had a non-finite loss or
  gradient norm (none of them was applied)."""


def check_backend_platform(cfg: TrainConfig) -> None:
  """--backend uniep needs GPUs (a ConfigError before anything compiles); --backend pallas
  on the CPU runs its kernels in JAX's interpret mode (a note)."""
  platform_ = jax.devices()[0].platform
  if cfg.backend == "uniep" and platform_ != "gpu" and parse_mesh(cfg.mesh).get("expert", 1) > 1:
    raise ConfigError(f"--backend uniep moves rows between GPUs over NVLink; this run has "
                      f"{platform_} devices: use --backend pallas (the same bits; its kernels "
                      f"run in JAX's interpret mode here, slowly) or --backend xla_dropless")
  if cfg.backend in ("pallas", "uniep") and platform_ == "cpu":
    _log(f"note: --backend {cfg.backend} on the CPU runs the Pallas kernels in JAX's interpret "
         f"mode: correct, but minutes per step at this size; --backend xla_dropless is the fast "
         f"path here")


def make_setup(cfg: TrainConfig) -> Setup:
  shape = parse_mesh(cfg.mesh)
  try:
    layers = {} if cfg.n_layers is None else dict(n_layers=cfg.n_layers)
    declared = get_config(cfg.config).max_seq_len
    if cfg.seq > declared:
      raise ConfigError(f"--seq {cfg.seq} exceeds model {cfg.config!r}'s max_seq_len {declared}")
    model_cfg = get_config(cfg.config, max_seq_len=cfg.seq, **layers)
  except ValueError as e:
    raise ConfigError(str(e)) from e
  validate_mesh(shape, num_devices=len(jax.devices()), num_experts=model_cfg.n_experts, batch=cfg.batch)
  mesh = make_mesh(shape)

  graphdef, params_tmpl, rest_tmpl = nnx.split(
      nnx.eval_shape(lambda: build_model(cfg, model_cfg, mesh)), nnx.Param, ...)
  bias_rate = cfg.aux_free_bias_rate
  if bias_rate is None:
    bias_rate = 1e-3 if model_cfg.use_expert_bias else 0.0
  if bias_rate and not model_cfg.use_expert_bias:
    raise ConfigError(f"--aux-free-bias-rate={bias_rate} but model {model_cfg.name!r} has no expert biases")

  lr = model_cfg.learning_rate if cfg.lr is None else cfg.lr
  schedule = optax.warmup_cosine_decay_schedule(
      init_value=0.0, peak_value=lr, warmup_steps=cfg.warmup_steps, decay_steps=cfg.steps,
      end_value=lr * cfg.min_lr_ratio)
  decay_mask = {k: v.ndim >= 2 for k, v in flat_arrays(params_tmpl).items()}  # no decay on norm scales
  # "ordered" clips inside the per-shard gradient step, on its ordered norm (the chain
  # keeps its shape, so checkpoints load in either mode)
  clip = optax.identity() if cfg.grad_reduction == "ordered" else optax.clip_by_global_norm(cfg.clip)
  tx = optax.chain(clip,
                   optax.adamw(schedule, b1=0.9, b2=0.95, weight_decay=cfg.weight_decay, mask=decay_mask))
  return Setup(cfg=cfg, model_cfg=model_cfg, mesh=mesh, graphdef=graphdef, params_tmpl=params_tmpl, lr=lr,
               rest_tmpl=rest_tmpl, param_sh=flat_shardings(params_tmpl, mesh),
               rest_sh=flat_shardings(rest_tmpl, mesh),
               batch_sh=NamedSharding(mesh, P(MESH_AXES, None)), tx=tx, schedule=schedule,
               bias_rate=float(bias_rate))


def init_state(s: Setup) -> tuple[dict, dict, Any]:
  """Fresh (params, rest, opt_state), created directly on their shardings."""
  def init():
    _, params, rest = nnx.split(build_model(s.cfg, s.model_cfg, s.mesh), nnx.Param, ...)
    return flat_arrays(params), flat_arrays(rest)

  params, rest = jax.jit(init, out_shardings=(s.param_sh, s.rest_sh))()
  opt_sh = optimizer_shardings(s, jax.eval_shape(s.tx.init, params))
  opt_state = jax.jit(s.tx.init, out_shardings=opt_sh)(params)
  return params, rest, opt_state


def optimizer_shardings(s: Setup, abstract_opt_state):
  """The optimizer state's shardings: a leaf under a parameter's name (optax keeps the
  moments as trees shaped like the params: {name: array}) with that parameter's shape
  is sharded as the parameter; anything else (step counts) is replicated.

  Set explicitly: `jax.jit(tx.init)(params)` alone leaves the placement of zeros_like
  to XLA, which replicates the expert weights' moments over the expert axis; every
  step then all-gathers them after the (sharded) update: 6 all-gathers of 4.25-5.5 ms
  in a mixtral-like step of 81 ms, 4x H200, and 4x the moments' memory."""
  rep = NamedSharding(s.mesh, P())
  shapes = {k: tuple(v.shape) for k, v in flat_arrays(s.params_tmpl).items()}

  def for_leaf(path, leaf):
    name = getattr(path[-1], "key", None) if path else None
    if name in shapes and tuple(leaf.shape) == shapes[name]:
      return s.param_sh[name]
    return rep
  return jax.tree_util.tree_map_with_path(for_leaf, abstract_opt_state)


# ----------------------------------------------------------------------------- steps

def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
  """Mean next-token cross entropy in nats. logits [B, S, V] f32, targets [B, S]."""
  logp = jax.nn.log_softmax(logits, axis=-1)
  # a select, not a gather: its backward is a select too (XLA transposes a gather
  # into a scatter-add, atomics on the GPU)
  hit = jnp.arange(logits.shape[-1], dtype=targets.dtype) == targets[..., None]
  return -jnp.mean(jnp.sum(jnp.where(hit, logp, 0.0), axis=-1))


def _model(s: Setup, params: dict, rest: dict) -> Transformer:
  return nnx.merge(s.graphdef, unflatten(s.params_tmpl, params), unflatten(s.rest_tmpl, rest))


def total_loss(cfg: TrainConfig, ce, lb, z):
  """Training loss = cross entropy + the weighted MoE aux losses."""
  return ce + cfg.lb_weight * lb + cfg.z_weight * z


def loss_fn(s: Setup, params: dict, rest: dict, inputs, targets):
  """(training loss, (ce, lb, z, aux)); lb and z are means over the MoE layers."""
  logits, aux = _model(s, params, rest)(inputs)
  ce = cross_entropy(logits, targets)
  lb = jnp.mean(aux["load_balance_loss"])
  z = jnp.mean(aux["router_z_loss"])
  return total_loss(s.cfg, ce, lb, z), (ce, lb, z, aux)


def _spec_axes(spec) -> set:
  """Mesh axes a PartitionSpec shards over."""
  out = set()
  for entry in spec:
    out |= set(entry) if isinstance(entry, tuple) else ({entry} if entry is not None else set())
  return out


def _per_shard(s: Setup, body, out_specs):
  """`body(params, rest, inputs, targets)` under a shard_map over the whole mesh, with
  the setup's shardings as in_specs; type-checked where moe_ffn's shard_map is."""
  specs = lambda shardings: {k: v.spec for k, v in shardings.items()}  # noqa: E731
  return jax.shard_map(body, mesh=s.mesh,
                       in_specs=(specs(s.param_sh), specs(s.rest_sh), s.batch_sh.spec, s.batch_sh.spec),
                       out_specs=out_specs, check_vma=shard_map_type_checked(s.cfg.backend))


def backward_order(names: Sequence[str]) -> list[str]:
  """The Transformer's parameter names in about the order the backward pass finishes
  their gradients: the LM head and final norm first, then the layers from the last to
  the first, then the embedding (and anything unknown) last."""
  def key(name):
    if name.startswith(("head", "final_norm")):
      return (0, 0, name)
    m = re.match(r"layers\.(\d+)\.", name)
    if m:
      return (1, -int(m.group(1)), name)
    return (2, 0, name)
  return sorted(names, key=key)


def ordered_grads(s: Setup):
  """(params, rest, inputs, targets) -> (grads, ce, lb, z, aux, grad_norm), grads clipped.

  Each shard differentiates its part of the loss, (its mean cross entropy + the weighted
  aux losses) / shards; replicated parameters' gradients are then summed over the mesh
  axes they are replicated on with `ordered_psum` (rank order, float32), and the
  global norm (for clipping and the metric) is summed the same way, leaves in name
  order. No float sum over devices is left to XLA or NCCL. The sums go in a few
  buffers, one after the other (`ordered_psum_many`), after the whole backward pass:
  one collective in flight at a time (2 per leaf, free to overlap, hung on 4x H200).
  With cfg.num_grad_buckets > 1 (the default: 3) they go in that many buckets in
  `backward_order`, chained (`ordered_psum_buckets`), so that the early ones may overlap
  the rest of the backward pass (a gradient collective may then be in flight beside the
  MoE layer's own; 0.3-7% more tokens/s on 4x H100, docs/performance.md). Same bits
  either way.
  The aux losses are computed from statistics summed over the mesh inside the MoE
  layer (`uniep_jax.ordered_reduce.ordered_allsum`): each shard's gradient holds 1/shards of their derivative per shard, so the
  sum holds it once.
  """
  axes = tuple(s.mesh.axis_names)
  shards = s.mesh.size
  pspec = {k: sh.spec for k, sh in s.param_sh.items()}
  reduce_axes = {k: tuple(a for a in axes if a not in _spec_axes(spec)) for k, spec in pspec.items()}
  typed = shard_map_type_checked(s.cfg.backend)

  def body(params, rest, inputs, targets):
    if typed:  # differentiate per-shard copies: no psum in the transpose
      params = {k: jax.lax.pcast(v, reduce_axes[k], to="varying") if reduce_axes[k] else v
                for k, v in params.items()}

    def local_loss(p):  # ce: this shard's mean
      loss, stats = loss_fn(s, p, rest, inputs, targets)
      return loss / shards, stats

    (_, (ce, lb, z, aux)), grads = jax.value_and_grad(local_loss, has_aux=True)(params)
    names = sorted(grads)
    # one chain of collectives: the gradients (and ce) in buffers (in backward order when
    # bucketed), then the norm's parts
    order = backward_order(names) if s.cfg.num_grad_buckets > 1 else names
    *summed, ce = ordered_psum_buckets([(grads[k], reduce_axes[k]) for k in order] + [(ce, axes)],
                                       s.cfg.num_grad_buckets)
    grads = dict(zip(order, summed))
    parts = ordered_psum_many([(jnp.sum(jnp.square(grads[k].astype(jnp.float32))),
                                tuple(a for a in axes if a in _spec_axes(pspec[k]))) for k in names],
                              after=summed)
    sq = jnp.zeros((), jnp.float32)
    for part in parts:  # leaves in name order
      sq = sq + part
    norm = jnp.sqrt(sq)
    # optax.clip_by_global_norm's rule
    grads = {k: jnp.where(norm < s.cfg.clip, g, (g / norm.astype(g.dtype)) * s.cfg.clip).astype(g.dtype)
             for k, g in grads.items()}
    return grads, ce / shards, lb, z, aux, norm

  scalar = P()
  aux_spec = P()  # per-layer arrays of global statistics, replicated
  return _per_shard(s, body, out_specs=(pspec, scalar, scalar, scalar, aux_spec, scalar))


def make_train_step(s: Setup, opt_sh):
  grad_fn = ordered_grads(s) if s.cfg.grad_reduction == "ordered" else None

  def train_step(params, rest, opt_state, inputs, targets):
    if grad_fn is None:
      (loss, (ce, lb, z, aux)), grads = jax.value_and_grad(
          lambda p: loss_fn(s, p, rest, inputs, targets), has_aux=True)(params)
      grad_norm = optax.tree.norm(grads)
    else:
      grads, ce, lb, z, aux, grad_norm = grad_fn(params, rest, inputs, targets)
      loss = total_loss(s.cfg, ce, lb, z)
    updates, new_opt = s.tx.update(grads, opt_state, params)
    new_params = optax.apply_updates(params, updates)
    new_rest = rest
    if s.bias_rate:
      model = _model(s, new_params, rest)
      for moe, counts in zip(model.moe_modules(), aux["expert_counts"]):
        moe.update_expert_bias(counts, s.bias_rate)
      new_rest = flat_arrays(nnx.split(model, nnx.Param, ...)[2])
    # a step with a non-finite loss or gradient norm is not applied: parameters, biases
    # and optimizer state (its step count too) stay as they were, bit for bit
    finite = jnp.isfinite(loss) & jnp.isfinite(grad_norm)
    keep = lambda new, old: jax.tree.map(lambda a, b: jnp.where(finite, a, b), new, old)  # noqa: E731
    params, rest, opt_state = keep((new_params, new_rest, new_opt), (params, rest, opt_state))
    metrics = dict(loss=loss, ce=ce, load_balance_loss=lb, router_z_loss=z,
                   grad_norm=grad_norm, dropped=jnp.sum(aux["dropped"]),
                   nonfinite_tokens=jnp.max(aux["nonfinite_tokens"]),
                   skipped=(~finite).astype(jnp.int32),
                   **routing_metrics(aux, s.mesh.shape["expert"]))
    return params, rest, opt_state, metrics

  rep = NamedSharding(s.mesh, P())
  return jax.jit(train_step,
                 in_shardings=(s.param_sh, s.rest_sh, opt_sh, s.batch_sh, s.batch_sh),
                 out_shardings=(s.param_sh, s.rest_sh, opt_sh, rep),
                 donate_argnums=(0, 1, 2))


def routing_metrics(aux: dict, expert_ranks: int) -> dict:
  """The step's routing statistics from the MoE layers' stacked aux.

    max_load                  [] max over layers and experts of count / mean count
    max_load_per_layer        [L_moe] the same per layer (1: balanced, E/K: every token
                              picks the same K experts)
    rank_imbalance_per_layer  [L_moe] max / mean over the expert-parallel ranks of the
                              rows each rank computes (what a dropless step waits for)
    expert_counts             [L_moe, E] int32 (expert_counts.jsonl, not metrics.jsonl)

  The rows per rank are aux["rank_rows"] [L_moe, R] when the layer reports them, else
  the counts of the experts each rank owns (experts [r*E/R, (r+1)*E/R) on rank r).
  """
  counts = aux["expert_counts"]  # [L_moe, E] int32
  load = counts.astype(jnp.float32) / jnp.mean(counts.astype(jnp.float32), axis=-1, keepdims=True)
  rank_rows = aux.get("rank_rows")
  if rank_rows is None:
    n_layers, n_experts = counts.shape
    rank_rows = jnp.sum(counts.reshape(n_layers, expert_ranks, n_experts // expert_ranks), axis=-1)
  rows = rank_rows.astype(jnp.float32)  # [L_moe, R]
  per_layer = jnp.max(load, axis=-1)
  return dict(max_load=jnp.max(per_layer), max_load_per_layer=per_layer,
              rank_imbalance_per_layer=jnp.max(rows, axis=-1) / jnp.mean(rows, axis=-1),
              expert_counts=counts.astype(jnp.int32))


def make_eval_step(s: Setup):
  def eval_step(params, rest, inputs, targets):
    logits, _ = _model(s, params, rest)(inputs)
    return cross_entropy(logits, targets)

  if s.cfg.grad_reduction == "ordered":  # the mean over shards in rank order, as the train step
    local = lambda *a: ordered_psum(eval_step(*a), tuple(s.mesh.axis_names)) / s.mesh.size
    fn = _per_shard(s, local, out_specs=P())
  else:
    fn = eval_step
  return jax.jit(fn, in_shardings=(s.param_sh, s.rest_sh, s.batch_sh, s.batch_sh),
                 out_shardings=NamedSharding(s.mesh, P()))


# ----------------------------------------------------------------------------- reporting

def checksum(params: dict, rest: dict) -> dict:
  """Sum (float64) of every parameter and a sha256 over the bytes of params and rest, in key order."""
  h = hashlib.sha256()
  total = 0.0
  for name, tree in (("params", params), ("rest", rest)):
    for k in sorted(tree):
      a = host_value(tree[k])  # a gather across processes when sharded over several
      if name == "params":
        total += float(a.astype(np.float64).sum())
      h.update(f"{name}/{k}:{a.dtype}{a.shape}".encode())
      h.update(np.ascontiguousarray(a).tobytes())
  return dict(param_sum=total, sha256=h.hexdigest())


def _read_metrics(path: pathlib.Path) -> list[dict]:
  return [json.loads(l) for l in path.read_text().splitlines() if l.strip()] if path.exists() else []


def matplotlib_available() -> bool:
  """Whether the plots can be drawn; a run without matplotlib writes none (one note)."""
  try:
    import matplotlib  # noqa: F401
  except ImportError:
    return False
  return True


def _pyplot():
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  return plt


def plot_losses(records: list[dict], unigram_nats: float, path: pathlib.Path, title: str) -> None:
  plt = _pyplot()
  train = sorted((r["step"], r["ce"]) for r in records if "ce" in r)
  held = sorted((r["step"], r["heldout_loss"]) for r in records if "heldout_loss" in r)
  fig, ax = plt.subplots(figsize=(7, 4.5))
  if train:
    ax.plot(*zip(*train), lw=0.8, alpha=0.7, label="train cross entropy")
  if held:
    ax.plot(*zip(*held), "o-", label="held-out cross entropy")
  ax.axhline(unigram_nats, color="gray", ls="--", label=f"unigram entropy {unigram_nats:.3f}")
  ax.set_xlabel("step")
  ax.set_ylabel("nats / token")
  ax.set_title(title)
  ax.grid(alpha=0.3)
  ax.legend()
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


HEATMAP_COLUMNS = 600  # at most this many step columns; longer runs average consecutive steps


def plot_expert_load(records: list[dict], path: pathlib.Path, title: str,
                     layer_names: Sequence[int]) -> None:
  """A heat map of each MoE layer's expert load over the steps: one panel per layer,
  x = step, y = expert, colour = count / mean count (white 1, red hotter, blue colder).

  records: expert_counts.jsonl's lines, {"step": s, "counts": [L_moe][E]}, in step order.
  """
  from matplotlib.colors import TwoSlopeNorm
  plt = _pyplot()
  steps = [r["step"] for r in records]
  counts = np.asarray([r["counts"] for r in records], np.float64)  # [T, L_moe, E]
  load = counts / counts.mean(axis=-1, keepdims=True)
  edges = np.linspace(0, len(steps), min(len(steps), HEATMAP_COLUMNS) + 1).astype(int)
  load = np.stack([load[a:b].mean(axis=0) for a, b in zip(edges[:-1], edges[1:])])  # [cols, L, E]
  n_layers, n_experts = load.shape[1:]
  norm = TwoSlopeNorm(vmin=0.0, vcenter=1.0, vmax=max(2.0, float(load.max())))
  extent = (steps[0] - 0.5, steps[-1] + 0.5, n_experts - 0.5, -0.5)
  fig, axes = plt.subplots(n_layers, 1, figsize=(9, 1.0 + 2.2 * n_layers), sharex=True,
                           squeeze=False)
  for i, ax in enumerate(axes[:, 0]):
    image = ax.imshow(load[:, i, :].T, aspect="auto", interpolation="nearest", cmap="RdBu_r",
                      norm=norm, extent=extent)
    ax.set_ylabel(f"layer {layer_names[i]}\nexpert")
  axes[-1, 0].set_xlabel("step")
  fig.colorbar(image, ax=list(axes[:, 0]), label="count / mean count")
  fig.suptitle(title)
  fig.savefig(path, dpi=110)
  plt.close(fig)


def write_plots(out: pathlib.Path, unigram_nats: float, title: str,
                layer_names: Sequence[int]) -> list[pathlib.Path]:
  """loss.png from metrics.jsonl and expert_load.png from expert_counts.jsonl (the whole
  run's, a resumed run's earlier steps too); returns the files written."""
  written = []
  records = _read_metrics(out / "metrics.jsonl")
  if records:
    plot_losses(records, unigram_nats, out / "loss.png", title)
    written.append(out / "loss.png")
  counts = _read_metrics(out / "expert_counts.jsonl")
  if counts:
    plot_expert_load(counts, out / "expert_load.png", title, layer_names)
    written.append(out / "expert_load.png")
  return written


# ----------------------------------------------------------------------------- the run

def _log(msg: str) -> None:
  if is_main_process():
    print(msg, flush=True)


def environment() -> dict:
  """What a run's bits may depend on besides the code and the flags, recorded in
  summary.json: the package versions and, on the CPU, the widest vector ISA that
  XLA:CPU may compile for. The same 300-step main job, same code and jax, gave sha256
  be29b67b... on one 2-core machine (not recorded) and 0c39cac5... on another, an
  AVX2-only AMD EPYC (train/README.md)."""
  flags = model = ""
  try:
    with open("/proc/cpuinfo") as f:
      for line in f:
        key, _, value = line.partition(":")
        key = key.strip()
        if key == "model name" and not model:
          model = value.strip()
        elif key == "flags" and not flags:
          flags = value
  except OSError:
    pass
  isa = ("avx512" if "avx512f" in flags.split() else "avx2" if "avx2" in flags.split()
         else "unknown" if not flags else "below avx2")
  versions = {}
  for name in ("jax", "jaxlib", "flax", "optax", "numpy", "orbax-checkpoint"):
    try:
      versions[name] = importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      versions[name] = None
  return dict(cpu=model or platform.processor() or platform.machine(), cpu_vector_isa=isa,
              python=platform.python_version(), packages=versions)


class RunLock:
  """An exclusive lock on a run folder (`fcntl.flock` on OUT/.lock, held for the run and
  released by the OS when the process ends, a killed one too): a second live run into
  the same --out is refused instead of interleaving its metrics with the first's."""

  def __init__(self, out: pathlib.Path):
    self.path = out / ".lock"
    self.file = open(self.path, "a+")
    try:
      fcntl.flock(self.file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
      self.file.seek(0)
      holder = self.file.read().strip() or "another process"
      self.file.close()
      raise ConfigError(f"--out {out} is in use by a live run ({holder} holds {self.path}); "
                        f"wait for it or pass another --out") from None
    self.file.seek(0)
    self.file.truncate()
    self.file.write(f"pid {os.getpid()} on {platform.node()}\n")
    self.file.flush()

  def release(self) -> None:
    if not self.file.closed:
      fcntl.flock(self.file, fcntl.LOCK_UN)
      self.file.close()


def truncate_metrics(path: pathlib.Path, last_step: int) -> None:
  """Keeps the lines of metrics.jsonl up to `last_step` (a resumed run then appends the
  steps after it, so the file reads as one run)."""
  if path.exists():
    kept = [l for l in path.read_text().splitlines()
            if l.strip() and json.loads(l).get("step", 0) <= last_step]
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(l + "\n" for l in kept))
    tmp.replace(path)


def check_data(cfg: TrainConfig, data: Dataset) -> None:
  """The flags against the data, before anything compiles."""
  for split, tokens in (("training", data.train), ("held-out", data.heldout)):
    if len(tokens) < cfg.seq + 2:
      raise ConfigError(f"--seq {cfg.seq} needs windows of {cfg.seq + 1} tokens; the {split} "
                        f"split has {len(tokens)} (a larger --data or --data-bytes, or a "
                        f"smaller --seq)")


def train(cfg: TrainConfig, *, data: Optional[Dataset] = None) -> dict:
  """Run training; returns per-step losses, held-out losses, checksum and timings.
  Raises ConfigError for a configuration that cannot run (before anything compiles)
  and Diverged when `cfg.max_skipped_steps` steps in a row were not finite."""
  t_start = time.perf_counter()
  main = is_main_process()
  out = pathlib.Path(cfg.out)
  lock = None
  if main:
    out.mkdir(parents=True, exist_ok=True)
    lock = RunLock(out)
  try:
    return _train(cfg, data, out, main, t_start)
  finally:
    if lock is not None:
      lock.release()


def _train(cfg: TrainConfig, data: Optional[Dataset], out: pathlib.Path, main: bool,
           t_start: float) -> dict:
  metrics_path = out / "metrics.jsonl"
  if (main and not cfg.resuming and not cfg.overwrite and metrics_path.exists()
      and metrics_path.stat().st_size):
    raise ConfigError(f"--out {out} holds the metrics of an earlier run; pass --overwrite to "
                      f"replace them, --resume to continue that run, or another --out")
  check_backend_platform(cfg)
  s = make_setup(cfg)
  if data is None:
    data = make_dataset(cfg.data, max_bytes=cfg.data_bytes, heldout_fraction=cfg.heldout_fraction,
                        seq=cfg.seq, vocab_size=s.model_cfg.vocab_size)
  if data.vocab_needed > s.model_cfg.vocab_size:
    raise ConfigError(f"the data has token ids up to {data.vocab_needed - 1}, "
                     f"beyond model {s.model_cfg.name!r}'s vocab_size={s.model_cfg.vocab_size}")
  check_data(cfg, data)
  h_uni = unigram_entropy(data.train)
  run_id = uuid.uuid4().hex[:12]
  _log(format_report(model_report(s.model_cfg, cfg.seq)))
  procs = f" of {jax.process_count()} processes" if jax.process_count() > 1 else ""
  _log(f"mesh {dict(s.mesh.shape)} on {len(s.mesh.devices.flat)} {jax.devices()[0].platform} devices{procs}; "
       f"backend {cfg.backend}; batch {cfg.batch}x{cfg.seq} tokens; aux-free bias rate {s.bias_rate}; "
       f"run {run_id}")
  moe = moe_options(cfg, s.mesh.shape.get("expert"))
  if moe:
    _log("expert FFN: " + ", ".join(f"{k} {v}" for k, v in moe.items()))
  _log(f"data: {data.description}; train {len(data.train)} / held-out {len(data.heldout)} tokens; "
       f"unigram entropy {h_uni:.4f} nats/token = {h_uni / LN2:.4f} bits/token")

  params, rest, opt_state = init_state(s)
  opt_sh = jax.tree.map(lambda x: x.sharding, opt_state)
  start = 0
  ckpt = Checkpointer(cfg.ckpt_dir) if cfg.ckpt_dir else None
  try:
    if ckpt and not cfg.resuming and ckpt.latest_step() is not None:
      raise ConfigError(f"{cfg.ckpt_dir} already holds checkpoints (latest step "
                        f"{ckpt.latest_step()}); pass --resume to continue, or another --ckpt-dir")
    if cfg.resuming:
      found = ckpt.restore_latest(dict(params=params, rest=rest, opt_state=opt_state), log=_log)
      if found is None:
        if not cfg.resume_or_start:
          raise ConfigError(f"--resume: no usable checkpoint in {ckpt.directory}; pass "
                            f"--resume-or-start to start from step 0 when there is none")
        _log(f"--resume-or-start: no usable checkpoint in {ckpt.directory}; starting from step 0")
      else:
        start, restored = found
        params, rest, opt_state = restored["params"], restored["rest"], restored["opt_state"]
        _log(f"resumed from {ckpt.directory} at step {start} (checksums verified)")
    if start >= cfg.last_step:
      raise ConfigError(f"nothing to do: the checkpoint is at step {start} >= {cfg.last_step}")
    if main:
      for path in (metrics_path, out / "expert_counts.jsonl"):
        if start:
          truncate_metrics(path, start)
        else:
          path.write_text("")
    return _loop(cfg, s, data, out, main, t_start, run_id, ckpt, start, params, rest,
                 opt_state, opt_sh, h_uni, moe, metrics_path)
  finally:
    if ckpt:
      ckpt.close()


def _loop(cfg, s, data, out, main, t_start, run_id, ckpt, start, params, rest, opt_state,
          opt_sh, h_uni, moe, metrics_path) -> dict:
  train_step = make_train_step(s, opt_sh)
  eval_step = make_eval_step(s)
  # this process builds only its rows of each global [batch, seq] batch (all rows in one process)
  rows = local_rows(s.batch_sh, (cfg.batch, cfg.seq))
  put = lambda a: from_local_rows(s.batch_sh, a, (cfg.batch, cfg.seq))
  held_batches = [(put(x), put(y)) for x, y in data.heldout_batches(cfg.eval_batches, cfg.batch, cfg.seq, rows)]

  # bits per byte = nats per token / ln 2 / bytes per token: compares across tokenizers
  bytes_per_token = data.heldout_bytes_per_token(cfg.eval_batches, cfg.batch, cfg.seq)

  def heldout_loss() -> float:
    vals = [np.float32(eval_step(params, rest, x, y)) for x, y in held_batches]
    return float(np.mean(np.asarray(vals, np.float64)))

  def heldout_record(nats: float) -> dict:
    if bytes_per_token is None:   # ids of unknown text
      return dict(heldout_loss=nats)
    return dict(heldout_loss=nats, heldout_bpb=nats / LN2 / bytes_per_token)

  mf = metrics_path.open("a") if main else None
  cf = (out / "expert_counts.jsonl").open("a") if main else None
  records_here: list[dict] = []  # this run's records (every process)
  plots = cfg.plot and main
  if plots and not matplotlib_available():
    _log("note: matplotlib is not installed: no loss.png or expert_load.png")
    plots = False
  title = f"{cfg.config} / {cfg.backend} / mesh {cfg.mesh}"

  def emit(rec: dict) -> None:
    rec = dict(rec, run=run_id)
    records_here.append(rec)
    if mf is not None:
      mf.write(json.dumps(rec) + "\n")
      mf.flush()

  losses: dict[int, float] = {}
  heldout: dict[int, float] = {}
  if start == 0:
    heldout[0] = heldout_loss()
    emit(dict(step=0, **heldout_record(heldout[0])))

  from tqdm.auto import tqdm
  bar = tqdm(total=cfg.last_step, initial=start, disable=not (cfg.progress and main), dynamic_ncols=True, desc="train")
  tokens_per_step = cfg.batch * cfg.seq
  t_loop = time.perf_counter()
  step_times = []
  skipped_in_a_row = skipped_total = 0
  try:
    for step in range(start, cfg.last_step):
      t0 = time.perf_counter()
      x, y = data.batch(cfg.seed, step, cfg.batch, cfg.seq, rows)
      params, rest, opt_state, m = train_step(params, rest, opt_state, put(x), put(y))
      m = jax.device_get(m)  # waits for the step
      counts = np.asarray(m.pop("expert_counts"))  # [L_moe, E]
      # per-layer lists rounded: metrics.jsonl keeps one short line per step
      per_layer = {k: [round(float(v), 4) for v in np.asarray(m.pop(k))]
                   for k in ("max_load_per_layer", "rank_imbalance_per_layer")}
      m = {k: float(np.asarray(v)) for k, v in m.items()}
      m["skipped"] = int(m["skipped"])
      dt = time.perf_counter() - t0
      step_times.append(dt)
      done = step + 1
      losses[done] = m["loss"]
      rec = dict(step=done, **m, **per_layer, lr=float(s.schedule(step)), step_s=dt,
                 tokens_per_s=tokens_per_step / dt)
      if cf is not None:
        cf.write(json.dumps(dict(step=done, counts=counts.tolist(), run=run_id)) + "\n")
        cf.flush()
      if m["skipped"]:
        skipped_in_a_row += 1
        skipped_total += 1
        bar.clear()
        _log(f"step {done}: loss {m['loss']}, gradient norm {m['grad_norm']}: not finite, the "
             f"update is not applied ({skipped_in_a_row} in a row)")
      else:
        skipped_in_a_row = 0
      if done % cfg.eval_every == 0 or done == cfg.last_step:
        heldout[done] = heldout_loss()
        rec.update(heldout_record(heldout[done]))
      emit(rec)
      if skipped_in_a_row >= cfg.max_skipped_steps:
        raise Diverged(f"step {done}: {skipped_in_a_row} steps in a row with a non-finite loss or "
                       f"gradient norm (--max-skipped-steps {cfg.max_skipped_steps}); the "
                       f"parameters are those after step {done - skipped_in_a_row}"
                       + (f", the newest checkpoint step {ckpt.latest_step()}"
                          if ckpt and ckpt.latest_step() else ""))
      bar.update(1)
      post = dict(loss=f"{m['ce']:.3f}", tok_s=f"{tokens_per_step / dt:,.0f}")
      if done in heldout:
        post["heldout"] = f"{heldout[done]:.3f}"
      bar.set_postfix(post, refresh=False)
      if ckpt and (done % cfg.ckpt_every == 0 or done == cfg.last_step):
        ckpt.save(done, dict(params=params, rest=rest, opt_state=opt_state))
        if plots and done != cfg.last_step:   # a run stopped later keeps a recent picture
          write_plots(out, h_uni, title, s.model_cfg.moe_layers)
  finally:
    bar.close()
    for f in (mf, cf):
      if f is not None:
        f.close()
  t_end = time.perf_counter()

  cs = checksum(params, rest)
  # process 0 reads the whole file (a resumed run's too); the others have this run's records
  records = _read_metrics(metrics_path) if main else records_here
  tail = [r["ce"] for r in records if "ce" in r and not r.get("skipped")][-20:]
  final_train = float(np.mean(tail))
  final_held = heldout[cfg.last_step]
  # steady-state throughput: skip the first step (compilation)
  steady = step_times[1:] or step_times
  summary = dict(
      run=run_id, config=cfg.config, mesh=dict(s.mesh.shape), backend=cfg.backend,
      steps=cfg.last_step, peak_lr=s.lr, grad_reduction=cfg.grad_reduction,
      grad_buckets=cfg.num_grad_buckets, moe=moe, start_step=start,
      skipped_steps=skipped_total, unigram_entropy_nats=h_uni, unigram_entropy_bits=h_uni / LN2,
      final_train_loss_nats=final_train, final_heldout_loss_nats=final_held,
      final_train_loss_bits=final_train / LN2, final_heldout_loss_bits=final_held / LN2,
      tokenizer=None if data.tokenizer is None else data.tokenizer.describe(),
      heldout_bytes_per_token=bytes_per_token,
      final_heldout_loss_bits_per_byte=heldout_record(final_held).get("heldout_bpb"),
      tokens_per_s=tokens_per_step / float(np.mean(steady)), loop_s=t_end - t_loop,
      wall_s=t_end - t_start, environment=environment(), **cs)
  if main:
    (out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")
  plotted = write_plots(out, h_uni, title, s.model_cfg.moe_layers) if plots else []
  _log(f"unigram entropy of the training tokens: {h_uni:.4f} nats = {h_uni / LN2:.4f} bits per token")
  _log(f"final train loss (mean of the last {len(tail)} applied steps): {final_train:.4f} nats = "
       f"{final_train / LN2:.4f} bits per token" + (f"; {skipped_total} steps skipped (not finite)"
                                                    if skipped_total else ""))
  _log(f"final held-out loss: {final_held:.4f} nats = {final_held / LN2:.4f} bits per token"
       + ("" if bytes_per_token is None else
          f" = {summary['final_heldout_loss_bits_per_byte']:.4f} bits per byte "
          f"({bytes_per_token:.3f} bytes per held-out token)"))
  _log(f"throughput {summary['tokens_per_s']:,.0f} tokens/s; wall {summary['wall_s']:.1f} s")
  _log(f"param checksum: sum={cs['param_sum']!r} sha256={cs['sha256']} "
       f"(cpu {summary['environment']['cpu']}, vector ISA {summary['environment']['cpu_vector_isa']})")
  _log(f"wrote {', '.join(str(p) for p in [metrics_path, out / 'expert_counts.jsonl', out / 'summary.json', *plotted])}")
  return dict(summary=summary, losses=losses, heldout=heldout, params=params, rest=rest)
