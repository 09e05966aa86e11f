"""Orbax checkpoints of the training state: {params, rest (expert biases), opt_state} at a step.

Arrays are restored onto the shardings of a template (the freshly initialised
state), so a resumed run continues with bit-identical values on the same layout.

Checkpoints with the experts' gate and up weights as two arrays (`*.w_gate` and
`*.w_up` leaves, [E, H, F] each, where the model holds one `*.w_gate_up` [E, H, 2F]) are
restored too: read with a template in that split layout, then joined (`join_gate_up`),
in the parameters and in every optimizer-state copy of them (Adam's moments).
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp

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


class Checkpointer:
  def __init__(self, directory: str, *, max_to_keep: int = 2):
    self.directory = pathlib.Path(directory).absolute()
    self.manager = ocp.CheckpointManager(
        self.directory, options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep, create=True))

  def latest_step(self) -> Optional[int]:
    return self.manager.latest_step()

  def save(self, step: int, state: dict[str, Any]) -> None:
    self.manager.save(step, args=ocp.args.StandardSave(state))

  def restore(self, step: int, template: dict[str, Any]) -> dict[str, Any]:
    abstract = jax.tree.map(
        lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), template)
    if self._written_before_gate_up(step, abstract):
      old = self.manager.restore(step, args=ocp.args.StandardRestore(_split_layout(abstract)))
      return _join_layout(old, abstract)
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

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
