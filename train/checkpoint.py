"""Orbax checkpoints of the training state: {params, rest (expert biases), opt_state} at a step.

Arrays are restored onto the shardings of a template (the freshly initialised
state), so a resumed run continues with bit-identical values on the same layout.
"""

from __future__ import annotations

import pathlib
from typing import Any, Optional

import jax
import orbax.checkpoint as ocp


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
    return self.manager.restore(step, args=ocp.args.StandardRestore(abstract))

  def close(self) -> None:
    self.manager.wait_until_finished()
    self.manager.close()
