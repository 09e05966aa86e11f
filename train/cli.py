"""Command line: `python -m train [flags]` / `uniep-train [flags]`.

Parses the flags first, then asks XLA for as many virtual CPU devices as the mesh
has (XLA_FLAGS must be set before jax is imported) -- in a multi-process run, this
process's share of them, after which it joins the group (`train.distributed`) --
then imports the loop.
"""

from __future__ import annotations

import sys
from typing import Optional, Sequence

from train import distributed
from train.config import parse_args
from train.mesh import (ConfigError, mesh_size, parse_mesh, request_host_devices,
                        request_xla_determinism, request_nccl_group_launch)


def run(argv: Optional[Sequence[str]] = None) -> dict:
  """Parse flags, size the device pool, train; returns `train.loop.train`'s result."""
  cfg = parse_args(argv)
  n = mesh_size(parse_mesh(cfg.mesh))
  try:
    spec = distributed.resolve(coordinator=cfg.coordinator, num_processes=cfg.num_processes,
                               process_id=cfg.process_id, local_devices=cfg.local_devices,
                               mesh_devices=n)
  except ConfigError as e:
    print(f"uniep-train: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  # every process asks for its own share of the mesh's devices
  request_host_devices(n if spec is None else (spec.local_devices or n))
  if cfg.xla_deterministic:
    request_xla_determinism()
  request_nccl_group_launch()
  if spec is not None:
    distributed.initialize(spec)  # imports jax
  from train.loop import Diverged, train  # imports jax

  try:
    return train(cfg)
  except (ConfigError, FileNotFoundError) as e:  # found once the devices and the data are known
    print(f"uniep-train: error: {e}", file=sys.stderr)
    raise SystemExit(2)
  except Diverged as e:
    print(f"uniep-train: stopped: {e}", file=sys.stderr)
    raise SystemExit(3)


def main(argv: Optional[Sequence[str]] = None) -> None:
  """Console script `uniep-train` (returns None: `sys.exit(main())` exits 0)."""
  run(argv)


if __name__ == "__main__":
  main()
