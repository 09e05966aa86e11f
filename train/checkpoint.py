"""Orbax checkpoints of the training state: {params, rest (expert biases), opt_state} at a step.

Arrays are restored onto the shardings of a template (the freshly initialised
state), so a resumed run continues with bit-identical values on the same layout.

Verified: each checkpoint stores, beside the arrays (the Orbax item "default"), the
bit checksums of its state (item "meta": `state_checksums`, computed on the devices), and
a restore recomputes and compares them. `restore_latest` walks the checkpoints from the
newest: one that fails to load or to verify is reported in one line and moved aside
(renamed `damaged-<step>`, kept for inspection, out of Orbax's way), and the next older
one is tried. No checkpoint is written from a state with a non-finite value.

Checkpoints with the experts' gate and up weights as two arrays (`*.w_gate` and
`*.w_up` leaves, [E, H, F] each, where the model holds one `*.w_gate_up` [E, H, 2F]) are
restored too: read with a template in that split layout, then joined (`join_gate_up`),
in the parameters and in every optimizer-state copy of them (Adam's moments).
"""

from __future__ import annotations

import pathlib
from typing import Any, Callable, Optional

import jax
import jax.numpy as jnp
import orbax.checkpoint as ocp

from uniep_jax.measure import tree_checksum
from uniep_jax.params import join_gate_up

_JOINED, _GATE, _UP = "w_gate_up", "w_gate", "w_up"


def _dict_keys(tree) -> list:
  """The string keys of every leaf's innermost dict (e.g. 'layers.0.ffn.w_gate_up')."""
  return [p[-1].key for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]
          if p and isinstance(p[-1], jax.tree_util.DictKey) and isinstance(p[-1].key, str)]


def _has_joined(d) -> bool:
  return isinstance(d, dict) and any(isinstance(k, str) and k.endswith(_JOINED) for k in d)


def _split_layout(tree):
  """The template in the layout before w_gate_up: each flat-dict entry `<x>w_gate_up`
  [..., 2F] becomes `<x>w_gate` and `<x>w_up` [..., F] (same sharding)."""
  def split(d):
    out = {}
    for k, v in d.items():
      if isinstance(k, str) and k.endswith(_JOINED):
        half = jax.ShapeDtypeStruct(v.shape[:-1] + (v.shape[-1] // 2,), v.dtype,
                                    sharding=v.sharding)
        base = k[:-len(_JOINED)]
        out[base + _GATE], out[base + _UP] = half, half
      else:
        out[k] = v
    return out
  return jax.tree.map(lambda d: split(d) if _has_joined(d) else d, tree, is_leaf=_has_joined)


def _join_layout(tree, template):
  """The inverse of `_split_layout` on restored arrays, placed on the template's shardings."""
  def join(d, t):
    out = {}
    for k, v in t.items():
      if isinstance(k, str) and k.endswith(_JOINED):
        base = k[:-len(_JOINED)]
        out[k] = jax.device_put(join_gate_up(d[base + _GATE], d[base + _UP]), v.sharding)
      else:
        out[k] = d[k]
    return out
  return jax.tree.map(lambda t, d: join(d, t) if _has_joined(t) else d, template, tree,
                      is_leaf=_has_joined)


def state_checksums(state: dict[str, Any]) -> dict[str, list]:
  """{part: bit checksums of its leaves in key order} for each top-level part of the
  state (params, rest, opt_state): `uniep_jax.measure.tree_checksum`, on the devices,
  leaf by leaf (the leaves may live on different devices)."""
  return {k: [tree_checksum(leaf)[0] for leaf in jax.tree.leaves(v)]
          for k, v in sorted(state.items())}


_finite = jax.jit(lambda a: jnp.all(jnp.isfinite(a)))


def all_finite(state) -> bool:
  """Whether every float in the state is finite (leaf by leaf: the leaves may live on
  different devices)."""
  return all(bool(_finite(a)) for a in jax.tree.leaves(state)
             if jnp.issubdtype(a.dtype, jnp.inexact))


class CheckpointDamaged(RuntimeError):
  """A checkpoint that fails to load or to verify."""


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self.max_to_keep = max_to_keep
    self.manager = self._manager()

  def _manager(self):
    return ocp.CheckpointManager(
        self.directory, item_names=("default", "meta"),
        options=ocp.CheckpointManagerOptions(max_to_keep=self.max_to_keep, create=True))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def steps(self) -> list[int]:
    return sorted(self.manager.all_steps())

  def save(self, step: int, state: dict[str, Any]) -> None:
    """Saves `state` with its checksums; ValueError if any value is not finite."""
    if not all_finite(state):
      raise ValueError(f"not writing checkpoint {step}: the state holds a non-finite value")
    meta = dict(step=step, checksums=state_checksums(state))
    self.manager.save(step, args=ocp.args.Composite(default=ocp.args.StandardSave(state),
                                                    meta=ocp.args.JsonSave(meta)))

  def restore(self, step: int, template: dict[str, Any]) -> dict[str, Any]:
    """The state at `step` on the template's shardings, its checksums verified where it
    has them (checkpoints written before checksums have none). CheckpointDamaged if it
    does not load or verify."""
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
    has_meta = (self.directory / str(step) / "meta").exists()
    try:
      if self._written_before_gate_up(step, abstract):
        old = self.manager.restore(step, args=ocp.args.Composite(
            default=ocp.args.StandardRestore(_split_layout(abstract))))["default"]
        state = _join_layout(old, abstract)
      else:
        args = dict(default=ocp.args.StandardRestore(abstract))
        if has_meta:
          args["meta"] = ocp.args.JsonRestore()
        restored = self.manager.restore(step, args=ocp.args.Composite(**args))
        state = restored["default"]
        if has_meta:
          want = restored["meta"]["checksums"]
          got = state_checksums(state)
          bad = sorted(k for k in got if got[k] != want.get(k))
          if bad:
            raise CheckpointDamaged(f"checksum mismatch in {', '.join(bad)}")
    except CheckpointDamaged:
      raise
    except Exception as e:  # noqa: BLE001 - any failure to read makes it unusable
      first = (str(e).strip().splitlines() or [""])[0][:200]
      raise CheckpointDamaged(f"{type(e).__name__}: {first}") from e
    return state

  def restore_latest(self, template: dict[str, Any],
                     log: Callable[[str], None] = print) -> Optional[tuple[int, dict]]:
    """(step, state) of the newest checkpoint that loads and verifies, or None if none
    does; each one that does not is reported in one line and moved aside (process 0
    renames it; the others see the same failure)."""
    for step in reversed(self.steps()):
      try:
        return step, self.restore(step, template)
      except CheckpointDamaged as e:
        log(f"checkpoint {self.directory / str(step)} is unusable ({e}); trying the one before")
        self._move_aside(step)
    return None

  def _move_aside(self, step: int) -> None:
    self.manager.wait_until_finished()
    if jax.process_index() == 0:
      src = self.directory / str(step)
      dst = self.directory / f"damaged-{step}"
      n = 1
      while dst.exists():
        n += 1
        dst = self.directory / f"damaged-{step}-{n}"
      src.rename(dst)
    if jax.process_count() > 1:   # every process reopens the directory after the rename
      from jax.experimental import multihost_utils
      multihost_utils.sync_global_devices(f"uniep_checkpoint_moved_{step}")
    self.manager.close()
    self.manager = self._manager()

  def _written_before_gate_up(self, step: int, abstract) -> bool:
    """Whether the checkpoint at `step` holds `<x>w_gate` and `<x>w_up` where the
    template has `<x>w_gate_up` (dense SwiGLUs keep their w_gate / w_up today)."""
    joined = [k for k in _dict_keys(abstract) if k.endswith(_JOINED)]
    if not joined:
      return False
    reader = ocp.StandardCheckpointer()
    try:
      meta = reader.metadata(self.directory / str(step) / "default")
    finally:
      reader.close()
    stored = set(_dict_keys(getattr(meta, "item_metadata", meta)))
    bases = [k[:-len(_JOINED)] for k in joined if k not in stored]
    return any(b + _GATE in stored and b + _UP in stored for b in bases)

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
