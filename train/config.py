"""`TrainConfig`: every knob of a training run, and its command-line parser.

No jax import here: `train.cli` parses flags, sizes the virtual device pool, and
only then imports jax (through `train.loop`).
"""

from __future__ import annotations

import argparse
import dataclasses
from typing import Optional, Sequence

from train.mesh import parse_mesh

BACKEND_CHOICES = ("xla_dropless", "xla_capacity", "dense_reference", "pallas", "uniep")
# "xla": gradients of replicated parameters summed over the mesh by XLA's all-reduces;
# "ordered": per-shard gradients summed in rank order by us (uniep_jax/ordered_reduce.py)
GRAD_REDUCTIONS = ("xla", "ordered")
# gradient buckets of the "ordered" sums by default (TrainConfig.grad_buckets)
DEFAULT_GRAD_BUCKETS = 3


@dataclasses.dataclass(frozen=True)
class TrainConfig:
  config: str = "tiny"  # model config name (models.CONFIGS)
  n_layers: Optional[int] = None  # overrides the model config's layer count
  mesh: str = "data=2,expert=4"
  backend: str = "xla_dropless"
  capacity_factor: float = 1.25
  kernel_stages: Optional[int] = None  # KernelConfig.max_concurrent_steps (pallas/uniep; None: its default)
  overlap: bool = False  # uniep: transfers inside GEMM launches (UniEPConfig.overlap = OverlapConfig())
  steps: int = 300  # length of the schedule (and of the run unless stop_after)
  stop_after: Optional[int] = None  # stop (and checkpoint) after this many steps
  batch: int = 8  # sequences per step (global)
  seq: int = 128
  lr: Optional[float] = None  # peak; None: the model config's learning_rate
  min_lr_ratio: float = 0.1
  warmup: Optional[int] = None  # None: min(30, steps // 10)
  weight_decay: float = 0.1
  clip: float = 1.0
  seed: int = 0
  data: Optional[str] = None  # None: the Python standard library's sources
  data_bytes: int = 4 << 20  # cap of the default corpus
  heldout_fraction: float = 0.05
  lb_weight: float = 0.01  # weight of the load-balance loss
  z_weight: float = 1e-3  # weight of the router z-loss
  aux_free_bias_rate: Optional[float] = None  # None: 1e-3 if the model has expert biases, else 0
  eval_every: int = 50
  eval_batches: int = 8
  ckpt_dir: Optional[str] = None
  ckpt_every: int = 100
  resume: bool = False
  out: str = "runs/default"
  progress: bool = True
  plot: bool = True
  # XLA:GPU deterministic mode (train.mesh.request_xla_determinism), set by the CLI
  xla_deterministic: bool = True
  grad_reduction: str = "ordered"  # GRAD_REDUCTIONS
  # "ordered": the gradients summed in this many chained buckets (backward order); None:
  # DEFAULT_GRAD_BUCKETS with "ordered" (0.3-7% more tokens/s than 1 bucket on 4x H100,
  # every backend, both meshes), 1 with "xla" and with --overlap (its launches keep every
  # CTA resident and wait on their peers: an NCCL kernel beside them holds an SM one of
  # their CTAs needs while it waits for peers whose SMs their own launch holds, a circular
  # wait; pallas_kernels/SYNC.md). The same bits for any count.
  grad_buckets: Optional[int] = None
  # multi-process runs (train/distributed.py); None: from the environment, else single-process
  coordinator: Optional[str] = None  # HOST:PORT of process 0's jax.distributed coordinator
  num_processes: Optional[int] = None
  process_id: Optional[int] = None
  local_devices: Optional[int] = None  # devices per process (default: mesh size / num_processes)

  def __post_init__(self):
    parse_mesh(self.mesh)
    if self.backend not in BACKEND_CHOICES:
      raise ValueError(f"backend={self.backend!r} is unknown; expected one of {BACKEND_CHOICES}")
    if self.overlap and self.backend != "uniep":
      raise ValueError(f"--overlap (transfers inside GEMM launches) is only for --backend "
                       f"uniep, got backend={self.backend!r}")
    if self.n_layers is not None and self.n_layers < 1:
      raise ValueError(f"n_layers={self.n_layers} must be >= 1")
    if self.kernel_stages is not None:
      if self.backend not in ("pallas", "uniep"):
        raise ValueError(f"kernel_stages is only for --backend pallas or uniep, got "
                         f"backend={self.backend!r}")
      if self.kernel_stages < 1:
        raise ValueError(f"kernel_stages={self.kernel_stages} must be >= 1")
    if self.grad_reduction not in GRAD_REDUCTIONS:
      raise ValueError(f"grad_reduction={self.grad_reduction!r} is unknown; expected one of {GRAD_REDUCTIONS}")
    if self.grad_buckets is not None and self.grad_buckets < 1:
      raise ValueError(f"grad_buckets={self.grad_buckets} must be >= 1")
    if self.grad_buckets is not None and self.grad_buckets > 1 and self.grad_reduction != "ordered":
      raise ValueError(f"grad_buckets={self.grad_buckets} is for --grad-reduction ordered, got "
                       f"grad_reduction={self.grad_reduction!r}")
    for name in ("steps", "batch", "seq", "eval_every", "eval_batches", "ckpt_every"):
      if getattr(self, name) < 1:
        raise ValueError(f"{name}={getattr(self, name)} must be >= 1")
    if self.stop_after is not None and not 0 < self.stop_after <= self.steps:
      raise ValueError(f"stop_after={self.stop_after} must be in [1, steps={self.steps}]")
    if self.warmup is not None and not 0 <= self.warmup < self.steps:
      raise ValueError(f"warmup={self.warmup} must be in [0, steps={self.steps})")
    if self.lr is not None and not self.lr > 0:
      raise ValueError(f"lr={self.lr} must be > 0")
    if self.resume and not self.ckpt_dir:
      raise ValueError("--resume needs --ckpt-dir")
    if not 0 < self.heldout_fraction < 1:
      raise ValueError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")

  @property
  def warmup_steps(self) -> int:
    return min(30, self.steps // 10) if self.warmup is None else self.warmup

  @property
  def num_grad_buckets(self) -> int:
    """The buckets the gradients are summed in: grad_buckets, or by default
    DEFAULT_GRAD_BUCKETS with the ordered sums and 1 with XLA's or with --overlap (one
    bucket: every gradient collective after the whole backward pass)."""
    if self.grad_buckets is not None:
      return self.grad_buckets
    return DEFAULT_GRAD_BUCKETS if self.grad_reduction == "ordered" and not self.overlap else 1

  @property
  def last_step(self) -> int:
    return self.steps if self.stop_after is None else self.stop_after


def build_parser() -> argparse.ArgumentParser:
  d = TrainConfig()
  p = argparse.ArgumentParser(
      prog="uniep-train",
      description="Train a decoder-only MoE transformer with UniEP-JAX expert parallelism. "
                  "With no flags: the 'tiny' model on 8 virtual CPU devices (mesh data=2,expert=4) "
                  "on byte-level Python standard-library sources.")
  a = p.add_argument
  a("--config", default=d.config, help="model config name (default %(default)s)")
  a("--n-layers", type=int, default=None,
    help="override the model config's number of transformer blocks (e.g. a 1-block smoke run)")
  a("--mesh", default=d.mesh, help="mesh axes, e.g. data=2,expert=4; the product must equal the "
                                  "device count (CPU: that many virtual devices are created)")
  a("--backend", default=d.backend, choices=BACKEND_CHOICES, help="moe_ffn backend")
  a("--capacity-factor", type=float, default=d.capacity_factor, help="for --backend xla_capacity")
  a("--kernel-stages", type=int, default=None,
    help="pallas/uniep: the grouped GEMM's TMA pipeline depth (KernelConfig.max_concurrent_steps)")
  a("--overlap", action="store_true",
    help="uniep: the down GEMM's return and the backward's dX return run inside GEMM launches "
         "(UniEPConfig.overlap = OverlapConfig(); the same bits; gradients are then summed "
         "after the whole backward pass unless --grad-buckets says otherwise)")
  a("--steps", type=int, default=d.steps, help="schedule length / number of steps")
  a("--stop-after", type=int, default=None, help="stop after this many steps (the schedule still spans --steps)")
  a("--batch", type=int, default=d.batch, help="global batch in sequences")
  a("--seq", type=int, default=d.seq, help="sequence length")
  a("--lr", type=float, default=d.lr, help="peak learning rate (AdamW, warmup + cosine; default: "
    "the model config's, 3e-3 for tiny, 3e-4 for the GPU-sized configs)")
  a("--min-lr-ratio", type=float, default=d.min_lr_ratio)
  a("--warmup", type=int, default=None, help="warmup steps (default min(30, steps // 10))")
  a("--weight-decay", type=float, default=d.weight_decay)
  a("--clip", type=float, default=d.clip, help="global gradient-norm clip")
  a("--seed", type=int, default=d.seed, help="seeds the parameters and the batches")
  a("--data", default=None, help="text file, folder of text files, or .npy of token ids "
                                 "(default: the Python standard library's sources)")
  a("--data-bytes", type=int, default=d.data_bytes, help="cap on the default corpus size")
  a("--lb-weight", type=float, default=d.lb_weight, help="load-balance loss weight")
  a("--z-weight", type=float, default=d.z_weight, help="router z-loss weight")
  a("--aux-free-bias-rate", type=float, default=None,
    help="expert-bias update rate (default 1e-3 for models with expert biases, else off)")
  a("--eval-every", type=int, default=d.eval_every, help="held-out loss every N steps")
  a("--eval-batches", type=int, default=d.eval_batches)
  a("--ckpt-dir", default=None, help="Orbax checkpoint directory")
  a("--ckpt-every", type=int, default=d.ckpt_every)
  a("--resume", action="store_true", help="continue from the latest checkpoint in --ckpt-dir")
  a("--out", default=d.out, help="metrics.jsonl, loss.png and summary.json go here")
  a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
  a("--no-plot", dest="plot", action="store_false", help="no loss.png")
  a("--no-xla-deterministic", dest="xla_deterministic", action="store_false",
    help="let XLA autotune its GEMMs on GPUs (faster dense layers; the same bits run after "
         "run, but no longer across compilations, e.g. across --backend choices)")
  a("--grad-buckets", type=int, default=d.grad_buckets,
    help="with --grad-reduction ordered: sum the gradients in this many buckets, in the order "
         "the backward pass produces them (the LM head's first, the embedding's last), each "
         "bucket's collectives after the previous one's, so that the first ones can overlap "
         "the rest of the backward pass; the same bits for any count (default "
         f"{DEFAULT_GRAD_BUCKETS}: 0.3-7%% more tokens/s than 1 on 4x H100; 1 sums them after "
         "the whole backward pass)")
  a("--grad-reduction", default=d.grad_reduction, choices=GRAD_REDUCTIONS,
    help="how gradients are summed over the mesh: 'ordered' (default: per-shard gradients "
         "summed in rank order in float32, the same bits in every program, e.g. with any "
         "--backend; about 7%% slower per step on 4 H200s) or 'xla' (XLA's all-reduces; their "
         "float order is up to NCCL and to each program's schedule)")
  g = p.add_argument_group("multi-process (jax.distributed; `python -m train.launch` sets these)")
  g.add_argument("--coordinator", default=None, metavar="HOST:PORT",
                 help="process 0's coordinator address (default: $JAX_COORDINATOR_ADDRESS)")
  g.add_argument("--num-processes", type=int, default=None,
                 help="number of processes (default: $JAX_NUM_PROCESSES, else single-process)")
  g.add_argument("--process-id", type=int, default=None, help="this process's id (default: $JAX_PROCESS_ID)")
  g.add_argument("--local-devices", type=int, default=None,
                 help="devices per process (default: $JAX_LOCAL_DEVICES, else mesh size / processes)")
  return p


def parse_args(argv: Optional[Sequence[str]] = None) -> TrainConfig:
  """Flags -> TrainConfig; invalid values exit through argparse with the reason."""
  p = build_parser()
  ns = p.parse_args(argv)
  try:
    return TrainConfig(**vars(ns))
  except ValueError as e:
    p.error(str(e))
