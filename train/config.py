"""`TrainConfig`: every knob of a training run, and its command-line parser.

Flags are checked here (ValueError naming the flag, before anything compiles); what
needs the model config or the data is checked by `train.loop` before the first compile.
`train.cli` parses the flags and sizes the virtual device pool before JAX starts its
backends.
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
  replica_slots: int = 0  # dropless backends: exact-load replica slots per EP rank (UniEPConfig)
  fp8: bool = False  # pallas/uniep: FP8 expert GEMMs (UniEPConfig.precision = "fp8")
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
  resume: bool = False  # continue from the newest usable checkpoint; error if there is none
  resume_or_start: bool = False  # the same, but start from step 0 if there is none
  out: str = "runs/default"
  overwrite: bool = False  # a new run may replace the metrics of an earlier one in `out`
  max_skipped_steps: int = 3  # consecutive non-finite steps (not applied) before stopping
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
    if not self.clip > 0:
      raise ValueError(f"--clip={self.clip} must be > 0 (the global gradient-norm bound)")
    if not self.capacity_factor > 0:
      raise ValueError(f"--capacity-factor={self.capacity_factor} must be > 0")
    if self.max_skipped_steps < 1:
      raise ValueError(f"--max-skipped-steps={self.max_skipped_steps} must be >= 1")
    if not 0 <= self.min_lr_ratio <= 1:
      raise ValueError(f"--min-lr-ratio={self.min_lr_ratio} must be in [0, 1]")
    if self.weight_decay < 0:
      raise ValueError(f"--weight-decay={self.weight_decay} must be >= 0")
    if self.lb_weight < 0 or self.z_weight < 0:
      raise ValueError(f"--lb-weight={self.lb_weight} and --z-weight={self.z_weight} must be "
                       f">= 0")
    if self.data_bytes < 1:
      raise ValueError(f"--data-bytes={self.data_bytes} must be >= 1")
    if self.overlap and self.backend != "uniep":
      raise ValueError(f"--overlap (transfers inside GEMM launches) is only for --backend "
                       f"uniep, got backend={self.backend!r}")
    if self.replica_slots < 0:
      raise ValueError(f"--replica-slots={self.replica_slots} must be >= 0 (0: off)")
    if self.replica_slots and self.backend not in ("xla_dropless", "pallas", "uniep"):
      raise ValueError(f"--replica-slots balances the dropless backends, not "
                       f"--backend {self.backend}")
    if self.replica_slots and self.overlap:
      raise ValueError("--replica-slots with --overlap: the overlapped launches take no "
                       "replica weights; drop one of them")
    if self.fp8 and self.backend not in ("pallas", "uniep"):
      raise ValueError(f"--fp8 runs the Pallas backends' FP8 expert GEMMs (pallas, uniep), not "
                       f"--backend {self.backend}")
    if self.fp8 and self.overlap:
      raise ValueError("--fp8 with --overlap: the overlapped launches run the bf16 kernels; "
                       "drop one of them")
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
    if (self.resume or self.resume_or_start) and not self.ckpt_dir:
      raise ValueError(f"--{'resume' if self.resume else 'resume-or-start'} needs --ckpt-dir")
    if self.resume and self.resume_or_start:
      raise ValueError("--resume and --resume-or-start exclude each other (the second also "
                       "starts from step 0 when there is no checkpoint)")
    if not 0 < self.heldout_fraction < 1:
      raise ValueError(f"heldout_fraction={self.heldout_fraction} must be in (0, 1)")

  @property
  def resuming(self) -> bool:
    return self.resume or self.resume_or_start

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


def model_names() -> list[str]:
  """The model configs `--config` takes (models/config.py)."""
  from models.config import CONFIGS   # imports jax: its backends start later, on first use
  return sorted(CONFIGS)


def build_parser() -> argparse.ArgumentParser:
  d = TrainConfig()
  p = argparse.ArgumentParser(
      prog="uniep-train",
      formatter_class=argparse.ArgumentDefaultsHelpFormatter,
      description="Train a decoder-only MoE transformer with UniEP-JAX expert parallelism. "
                  "With no flags: the 'tiny' model on 8 virtual CPU devices (mesh data=2,expert=4) "
                  "on byte-level Python standard-library sources.")
  a = p.add_argument
  a("--config", default=d.config, choices=model_names(), metavar="NAME",
    help=f"model config: one of {', '.join(model_names())} (models/config.py)")
  a("--n-layers", type=int, default=None,
    help="override the model config's number of transformer blocks (e.g. a 1-block smoke run)")
  a("--mesh", default=d.mesh, help="mesh axes, e.g. data=2,expert=4; the product must equal the "
                                  "device count (CPU: that many virtual devices are created)")
  a("--backend", default=d.backend, choices=BACKEND_CHOICES,
    help="moe_ffn backend (uniep needs GPUs; pallas on the CPU runs its kernels in JAX's "
         "interpret mode: correct, slow)")
  a("--capacity-factor", type=float, default=d.capacity_factor,
    help="--backend xla_capacity: each expert takes at most this factor times its fair share "
         "of assignments; the rest are dropped and counted")
  a("--kernel-stages", type=int, default=None,
    help="pallas/uniep: the grouped GEMM's TMA pipeline depth (KernelConfig.max_concurrent_steps; "
         "default: its default)")
  a("--overlap", action="store_true",
    help="uniep: the down GEMM's return and the backward's dX return run inside GEMM launches "
         "(UniEPConfig.overlap = OverlapConfig(); the same bits; gradients are then summed "
         "after the whole backward pass unless --grad-buckets says otherwise)")
  a("--replica-slots", type=int, default=d.replica_slots,
    help="xla_dropless/pallas/uniep at EP > 1: replica slots per rank for exact-load "
         "balancing (UniEPConfig.replica_slots; at most the experts per rank; 0: off): hot "
         "experts are copied to other ranks per layer call so every rank computes the same "
         "rows; metrics.jsonl shows the ranks' row imbalance")
  a("--fp8", action="store_true",
    help="pallas/uniep: FP8 expert GEMMs (UniEPConfig.precision='fp8': e4m3 operands with "
         "power-of-two block scales, float32 accumulation; weight gradients in bf16; needs "
         "FP8 tensor cores on GPUs)")
  a("--steps", type=int, default=d.steps, help="schedule length / number of steps")
  a("--stop-after", type=int, default=None,
    help="stop after this many steps (the schedule still spans --steps)")
  a("--batch", type=int, default=d.batch, help="global batch in sequences")
  a("--seq", type=int, default=d.seq, help="sequence length (at most the model's max_seq_len)")
  a("--lr", type=float, default=d.lr, help="peak learning rate (AdamW, warmup + cosine; default: "
    "the model config's, 3e-3 for tiny, 3e-4 for the GPU-sized configs)")
  a("--min-lr-ratio", type=float, default=d.min_lr_ratio,
    help="the cosine schedule ends at this fraction of the peak learning rate")
  a("--warmup", type=int, default=None, help="warmup steps (default min(30, steps // 10))")
  a("--weight-decay", type=float, default=d.weight_decay,
    help="AdamW weight decay (not on norm scales)")
  a("--clip", type=float, default=d.clip, help="global gradient-norm clip (> 0)")
  a("--max-skipped-steps", type=int, default=d.max_skipped_steps,
    help="a step whose loss or gradient norm is not finite is not applied (counted as "
         "skipped); this many in a row stop the run with a non-zero exit")
  a("--seed", type=int, default=d.seed, help="seeds the parameters and the batches")
  a("--data", default=None, help="text file, folder of text files, or .npy of token ids "
                                 "(default: the Python standard library's sources); text is "
                                 "tokenised as bytes for a vocabulary of 256, else by a "
                                 "word-level tokenizer built from its training split "
                                 "(train/data.py)")
  a("--data-bytes", type=int, default=d.data_bytes, help="cap on the default corpus size")
  a("--lb-weight", type=float, default=d.lb_weight, help="load-balance loss weight")
  a("--z-weight", type=float, default=d.z_weight, help="router z-loss weight")
  a("--aux-free-bias-rate", type=float, default=None,
    help="expert-bias update rate (default 1e-3 for models with expert biases, else off)")
  a("--eval-every", type=int, default=d.eval_every, help="held-out loss every N steps")
  a("--eval-batches", type=int, default=d.eval_batches,
    help="held-out batches per evaluation (fixed windows of the held-out split)")
  a("--ckpt-dir", default=None, help="Orbax checkpoint directory (checksummed checkpoints)")
  a("--ckpt-every", type=int, default=d.ckpt_every, help="checkpoint every N steps (and at the end)")
  a("--resume", action="store_true",
    help="continue from the newest checkpoint in --ckpt-dir that loads and verifies (an error "
         "if there is none)")
  a("--resume-or-start", action="store_true",
    help="as --resume, but start from step 0 when --ckpt-dir holds no usable checkpoint")
  a("--out", default=d.out, help="metrics.jsonl, expert_counts.jsonl, summary.json, loss.png and "
                                 "expert_load.png go here")
  a("--overwrite", action="store_true",
    help="let a new run replace the metrics an earlier run left in --out")
  a("--no-progress", dest="progress", action="store_false", help="no tqdm bar")
  a("--no-plot", dest="plot", action="store_false", help="no loss.png or expert_load.png")
  a("--no-xla-deterministic", dest="xla_deterministic", action="store_false",
    help="let XLA autotune its GEMMs on GPUs (faster dense layers; the same bits run after "
         "run, but no longer across compilations, e.g. across --backend choices)")
  a("--grad-buckets", type=int, default=d.grad_buckets,
    help="with --grad-reduction ordered: sum the gradients in this many buckets, in the order "
         "the backward pass produces them (the LM head's first, the embedding's last), each "
         "bucket's collectives after the previous one's, so that the first ones can overlap "
         f"the rest of the backward pass; the same bits for any count (default "
         f"{DEFAULT_GRAD_BUCKETS}; 1 sums them after the whole backward pass)")
  a("--grad-reduction", default=d.grad_reduction, choices=GRAD_REDUCTIONS,
    help="how gradients are summed over the mesh: 'ordered' (per-shard gradients summed in "
         "rank order in float32, the same bits in every program, e.g. with any --backend) or "
         "'xla' (XLA's all-reduces; their float order is up to NCCL and to each program's "
         "schedule)")
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
