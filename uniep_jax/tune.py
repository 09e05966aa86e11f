"""Autotuner of the `"uniep"` backend: tiling and transfer knobs per shape, with a cache.

What is tuned
-------------
A candidate is one `Candidate(kernel: KernelConfig, transfer: TransferConfig,
fused: FusedConfig | None)`:
  KernelConfig    block_m, block_n, block_k, max_concurrent_steps, epilogue_slots,
                  raster_rows (grouped GEMM)
  TransferConfig  chunk_rows, num_ctas, col_tile                 (NVLink rows)
  FusedConfig     n_comm, recv_chunk_rows, return_in_kernel, backward,
                  wgrad_return_ctas, down_return_ctas, dispatch_in_kernel and
                  Kernel D's overlap_copy_ctas[_bwd], overlap_copy_stages,
                  overlap_join_percent  (the v2 fused kernels; None: v1; Kernel D's
                  points only where --fused-points names them, each with
                  UniEPConfig.dedup_send_groups by `overlap_send_groups`' rule)
`SearchSpace` lists the values of each knob; the product of the kernel and
transfer knobs is the enumerated space; its `fused` points are stage 3.
`KernelConfig.num_sms` is not tuned (the persistent grid takes every SM).

Problem = the per-rank MoE shape and run: `TuneProblem(tokens T, hidden H, ffn F,
experts E, top_k K, ep R, dtype, direction)`, direction "fwd" (forward only) or
"bwd" (forward + backward: `value_and_grad` of the layer).

Pruning, before anything is compiled (`check_candidate`, raises
`InvalidCandidate` with the reason; `enumerate_candidates` collects them):
  * the dataclasses' own shape-free checks (multiples of 64, powers of two, ...);
  * block_m a power of two (the grouped GEMM's ragged TMA store ladder);
  * block_n a multiple of 128 (the fused SwiGLU kernel gives each compute
    warpgroup block_n / 2 columns, which must be a multiple of the 64-column
    epilogue);
  * shared memory: for every launch the layer makes (gate/up "swiglu", down
    "plain", and for "bwd" da "dswiglu" (the default) and the XLA-pass variant's
    "plain" with a float32 output (swiglu_grad_in_kernel=False: with 2 epilogue
    slots it needs more SMEM than dswiglu), dx "plain" and the two wgrads), the
    kernel's own `grouped_gemm.smem_bytes` (row-tiled) and
    `grouped_gemm._Launch` (wgrad) at ONE stage must fit the device's capacity
    (`pallas_kernels.device.smem_capacity`), else the kernel cannot run. Above
    one stage the kernel clamps its stage count to what fits (and to the
    reduction steps), so two candidates whose per-launch stage counts come out
    equal compile the same kernels: the later one is rejected as a duplicate;
  * transfer: H divisible by col_tile (else the kernel silently takes a
    narrower tile: a duplicate), its 2 stage buffers within shared memory, and
    num_ctas <= the SM count (all CTAs must be resident for the kernel's
    cross-rank barrier; the kernel would clamp it);
  * backends without the NVLink transport ("pallas") ignore TransferConfig:
    every transfer point but the default is a duplicate there.

Verification. Every timed candidate's output ("fwd": y; "bwd": the loss and all
gradients) is reduced to a position-sensitive bit checksum on the device and
compared with the checksum of backend "pallas" (XLA collectives, the sequential
path) with the SAME KernelConfig but for raster_rows and wgrad_raster (the reference
walks its row tiles and its wgrad tiles row-major: the tile order must change no bit): a different block_k changes the
accumulation order, so each tiling has its own reference. Transfer knobs only move rows, so
all candidates sharing a KernelConfig must also agree with each other
(`transfer_consistency` in the report). A mismatch is a bug: it is printed to
stderr, listed under "mismatches" in the JSON, never picked, and a run with any
mismatch writes no cache entry.

Search. "staged" (default): stage 1 times every valid KernelConfig with the
default TransferConfig; stage 2 times every valid TransferConfig with the best
verified KernelConfig of stage 1; stage 3 times the best verified candidate so
far with each `SearchSpace.fused` point (the v2 kernels; pruned by the kernels'
own static checks, `check_fused`) and, if it runs v1, with token de-duplication
(`SearchSpace.dedup_tokens`), and every de-duplicated candidate again with the
expansion inside the transfer's launch (`SearchSpace.expand_in_transfer`), verified
like the rest. "grid": the whole
kernel x transfer product, no stage 3. Within a stage the
default comes first, then candidates by the number of knobs that differ from
the default (one-knob neighbours first). Compile failures are recorded and
counted, not fatal. A wall-clock budget (stage 1 gets `stage1_fraction` of it
when a stage 2 follows) skips what is left when it is spent; skipped
candidates are listed. `--resume` reloads a previous report of the same
problem and device and re-times only what it lacks (device calls are limited
to 10 minutes; a full search takes several).

Cache and "auto". `UniEPConfig(kernel=None)` and/or `transfer=None` means auto:
`moe_ffn` fills the None fields with `resolve_config`, which looks up the key
(device kind, T, H, F, E, K, dtype, EP, direction) - "bwd" first (training),
then "fwd" - in the user cache (`UNIEP_TUNE_CACHE`, or an explicit path), then
in the cache shipped with the package (`uniep_jax/tuned_configs.json`), and
otherwise uses `heuristic_config`. Explicit dataclasses (the defaults
included) are used exactly as given. A cached winner with the v2 fused kernels
is applied only when kernel, transfer and fused are all None (and the backend
is "uniep"). Cache entries are written only by this tuner, from measurements.
Entries recorded before KernelConfig.raster_rows existed (their kernel has no
raster_rows) were timed with the tiles walked row-major; they load as raster_rows
None (auto), which bands the tiles of launches with weights >= 16 MiB (measured
faster on the expert FFN: pallas_kernels/NOTES_grouped_gemm.md), so their
median_ms is that of the row-major order. Likewise entries recorded before
KernelConfig.wgrad_raster (2026-11-28) timed row-major wgrads and load as wgrad_raster
None (bands of 4 k tiles): the same bits, their median_ms that of the old order.

Filling the shipped cache. The device machines take commands of at most 10
minutes and return only what is written under $OUT, so one call tunes one shape
and direction for ~450 s, and calls are repeated (continuing from the reports
carried back into bench/results/tune/) until a report has no "time budget"
skips. One call on the device, from the repository root (4 GPUs: --ep 4 on a
4-GPU machine; 2 GPUs: --ep 2 on a 2-GPU machine):

  mkdir -p $OUT && cp uniep_jax/tuned_configs.json $OUT/ && \
  XLA_FLAGS=--xla_gpu_deterministic_ops=true PYTHONPATH=$PWD python -m uniep_jax.tune \
      --moe-config deepseek-like --ep 4 --direction bwd --compile-workers 8 \
      --budget-s 450 --cache $OUT/tuned_configs.json --out $OUT/tune --resume bench/results/tune

(or `TUNE_SHAPE=deepseek-like TUNE_DIRECTION=bwd bash bench/device_session.sh tune:500`)

then, back in the checkout: copy $OUT/tuned_configs.json over
uniep_jax/tuned_configs.json and $OUT/tune/* into bench/results/tune/, and
repeat for --direction fwd and for mixtral-like, qwen3-like, small-experts.
On a machine without a time limit the same for everything at once:

  for s in deepseek-like mixtral-like qwen3-like small-experts; do
    python -m uniep_jax.tune --moe-config $s --ep 4 --direction fwd,bwd --budget-s 3600 \
        --cache uniep_jax/tuned_configs.json --out bench/results/tune --resume bench/results/tune
  done

Cost: each timed candidate is one compile of the layer (~16 s fwd, ~38 s
fwd+bwd at the target shapes on H200, bench/results/moe_layer_*_run3.json) and
each new tiling one more for its "pallas" reference (shared by the tile orders);
stage 1 has 29 (fwd) or 35 (bwd) tilings at the target shapes, twice that with
raster_rows (None, 16), so a full staged search of one shape and direction takes
several ten-minute calls, about 10 for "bwd" when compiled one at a
time (measured 2026-11-26, 4x H200: 11 fwd candidates in 306 s). --compile-workers N
compiles the next 2N candidates in N threads while one is timed. Measured with 8
workers: 27-32 fwd candidates in ~205 s at EP 2 (2x H200); at EP 4 fwd+bwd
(qwen3-like, 4x H200) one layer compile took 50 s for v1 and ~130 s for a fused
point, so a "bwd" call times only a handful of fused points: name them with
--fused-points and use --stages fused. A report records XLA_FLAGS; --resume ignores a
report made with other flags.

The report (`--out`): tune_<device>_<shape>_ep<R>_<direction>.json (every trial,
rejections with reasons, top 5, best vs default spread, mismatches) and a PNG of
time against the main knobs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import functools
import itertools
import json
import math
import os
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterable, Optional, Protocol, Sequence

from uniep_jax.config import FusedConfig, KernelConfig, TransferConfig, UniEPConfig

DIRECTIONS = ("fwd", "bwd")
STAGES = ("kernel", "transfer", "fused")   # the "staged" search's stages, in order
CACHE_ENV = "UNIEP_TUNE_CACHE"
SHIPPED_CACHE = Path(__file__).with_name("tuned_configs.json")
CACHE_FORMAT = 1
_TRANSFER_STAGES = 2  # ep_transfer.py: 2 SMEM stage buffers
_TRANSFER_SMEM_SLACK = 1024  # barriers and alignment


class InvalidCandidate(ValueError):
  """A point of the space that cannot run (or would duplicate another) for a problem."""


# ---------------------------------------------------------------------------
# Problem, device, candidates
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TuneProblem:
  """One tuning problem. Shapes are per EP rank (as in bench/common.py SHAPES):

  tokens T (this rank's tokens), hidden H, ffn F, experts E (global), top_k K,
  ep R (ranks of the expert axis), dtype (a numpy dtype name), direction "fwd"
  or "bwd" (forward + backward)."""

  tokens: int
  hidden: int
  ffn: int
  experts: int
  top_k: int
  ep: int
  dtype: str = "bfloat16"
  direction: str = "bwd"

  def __post_init__(self):
    for name in ("tokens", "hidden", "ffn", "experts", "top_k", "ep"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 1:
        raise ValueError(f"{name}={v!r} must be a positive int")
    if self.direction not in DIRECTIONS:
      raise ValueError(f"direction={self.direction!r} must be one of {DIRECTIONS}")
    if self.experts % self.ep:
      raise ValueError(f"experts={self.experts} must be divisible by ep={self.ep}")
    if self.top_k > self.experts:
      raise ValueError(f"top_k={self.top_k} exceeds experts={self.experts}")
    import numpy as np
    object.__setattr__(self, "dtype", np.dtype(_dtype_name(self.dtype)).name)

  @property
  def itemsize(self) -> int:
    import jax.numpy as jnp
    return jnp.dtype(self.dtype).itemsize

  @property
  def recv_rows(self) -> int:
    """Rows of the receive buffer the grouped GEMM runs on: R * T * K."""
    return self.ep * self.tokens * self.top_k


def _dtype_name(dtype) -> str:
  import jax.numpy as jnp
  return jnp.dtype(dtype).name


def cache_key(device_kind: str, problem: TuneProblem) -> str:
  """The cache key: device kind, per-rank shapes, dtype, EP degree, direction."""
  p = problem
  return (f"{device_kind}|T={p.tokens}|H={p.hidden}|F={p.ffn}|E={p.experts}|K={p.top_k}"
          f"|{p.dtype}|ep={p.ep}|{p.direction}")


@dataclasses.dataclass(frozen=True)
class DeviceFacts:
  """What pruning needs to know about the device (from pallas_kernels.device)."""

  kind: str
  smem_bytes: int
  num_sms: int

  @classmethod
  def from_device(cls, device=None, num_sms: Optional[int] = None) -> "DeviceFacts":
    import jax
    from pallas_kernels import device as device_lib
    device = device or jax.devices()[0]
    return cls(kind=device.device_kind, smem_bytes=device_lib.smem_capacity(device),
               num_sms=device_lib.num_sms(num_sms, device))


@dataclasses.dataclass(frozen=True)
class Candidate:
  kernel: KernelConfig
  transfer: TransferConfig
  fused: Optional[FusedConfig] = None   # the v2 fused kernels (stage 3); None: v1
  dedup_tokens: bool = False            # v1 with token de-duplication (stage 3)
  send_groups: int = 1                  # UniEPConfig.dedup_send_groups (Kernel D points)

  def label(self) -> str:
    k, t = self.kernel, self.transfer
    label = (f"m{k.block_m}_n{k.block_n}_k{k.block_k}_s{k.max_concurrent_steps}"
             + (f"_e{k.epilogue_slots}" if k.epilogue_slots != 1 else "")
             + (f"_r{k.raster_rows}" if k.raster_rows is not None else "")
             + (f"_w{k.wgrad_raster}" if k.wgrad_raster is not None else "")
             + (f"_f{k.mma_in_flight}" if k.mma_in_flight else "")
             + f"|c{t.chunk_rows}_x{t.num_ctas}_t{t.col_tile}"
             + ("_te" if t.expand_in_transfer else ""))
    if self.fused is not None:
      f = self.fused
      label += (f"|f{f.n_comm}_b{f.recv_chunk_rows}" + ("" if f.return_in_kernel else "_v1ret")
                + ("_fbwd" if f.backward else "")
                + (f"_dr{f.down_return_ctas}" if f.down_return_ctas else "")
                + (f"_rbw{f.wgrad_return_ctas}" if f.wgrad_return_ctas else "")
                + ("" if f.dispatch_in_kernel else "_noA")
                + (f"_ov{f.overlap_copy_ctas}" if f.overlap_copy_ctas else "")
                + (f"_ovb{f.overlap_copy_ctas_bwd}" if f.overlap_copy_ctas_bwd else "")
                + (f"_ovs{f.overlap_copy_stages}" if f.overlap_copy_stages != 2 else "")
                + (f"_ovj{f.overlap_join_percent}" if f.overlap_join_percent else ""))
    if self.dedup_tokens:
      label += "|dd"
    if self.send_groups != 1:
      label += f"|sg{self.send_groups}"
    return label

  def knobs(self) -> dict:
    knobs = {**{n: getattr(self.kernel, n) for n in KERNEL_KNOBS},
             **{n: getattr(self.transfer, n) for n in TRANSFER_KNOBS}}
    if self.fused is not None:
      knobs.update(dataclasses.asdict(self.fused))   # FUSED_KNOBS
    if self.dedup_tokens:
      knobs["dedup_tokens"] = True
    if self.transfer.expand_in_transfer:
      knobs["expand_in_transfer"] = True
    if self.send_groups != 1:
      knobs["dedup_send_groups"] = self.send_groups
    return knobs


KERNEL_KNOBS = ("block_m", "block_n", "block_k", "max_concurrent_steps", "epilogue_slots",
                "raster_rows", "wgrad_raster", "mma_in_flight")
TRANSFER_KNOBS = ("chunk_rows", "num_ctas", "col_tile")
# Knobs added after reports were first written; a report whose trials lack one timed
# the order before it (row-major), which the same labels no longer mean.
TILE_ORDER_KNOBS = ("raster_rows", "wgrad_raster")
FUSED_KNOBS = ("n_comm", "recv_chunk_rows", "return_in_kernel", "backward",
               "wgrad_return_ctas", "down_return_ctas", "dispatch_in_kernel",
               "overlap_copy_ctas", "overlap_copy_ctas_bwd", "overlap_copy_stages",
               "overlap_join_percent")
DEFAULT_CANDIDATE = Candidate(KernelConfig(), TransferConfig())


def reference_kernel(kernel: KernelConfig) -> KernelConfig:
  """The KernelConfig of a candidate's "pallas" reference: the same but for the tile
  order (raster_rows 1, wgrad_raster 1) and the MMA waits (mma_in_flight 0), which by
  contract change no bit; so a raster or in-flight variant is checked against the
  row-major, wait-every-step kernel's bits, not only against itself."""
  return dataclasses.replace(kernel, raster_rows=1, wgrad_raster=1, mma_in_flight=0)


def kernel_label(kernel: KernelConfig) -> str:
  return Candidate(kernel, TransferConfig()).label().split("|")[0]


def candidate_from_knobs(knobs: dict) -> Candidate:
  """Builds a candidate; the dataclasses' own checks raise InvalidCandidate."""
  try:
    # reports from before a knob existed lack it: the dataclass default then
    kernel = KernelConfig(**{k: knobs[k] for k in KERNEL_KNOBS if k in knobs})
  except ValueError as e:
    raise InvalidCandidate(f"KernelConfig: {e}") from None
  try:
    transfer = TransferConfig(**{k: knobs[k] for k in TRANSFER_KNOBS},
                              expand_in_transfer=bool(knobs.get("expand_in_transfer", False)))
  except ValueError as e:
    raise InvalidCandidate(f"TransferConfig: {e}") from None
  fused = None
  if knobs.get("n_comm"):
    try:
      fused = FusedConfig(**{k: knobs[k] for k in FUSED_KNOBS if k in knobs})
    except ValueError as e:
      raise InvalidCandidate(f"FusedConfig: {e}") from None
  dedup = bool(knobs.get("dedup_tokens", False))
  if dedup and fused is not None and fused.backward:
    raise InvalidCandidate("dedup_tokens with fused de-duplicates the dy dispatch, which the "
                           "fused backward moves inside its da launch")
  if fused is not None and not fused.dispatch_in_kernel and not dedup:
    raise InvalidCandidate("fused.dispatch_in_kernel=False sends the forward's rows "
                           "de-duplicated: it needs dedup_tokens")
  if transfer.expand_in_transfer and not dedup:
    raise InvalidCandidate("expand_in_transfer is the de-duplicated dispatches' expansion: it "
                           "needs dedup_tokens")
  send_groups = int(knobs.get("dedup_send_groups", 1))
  if send_groups < 1:
    raise InvalidCandidate(f"dedup_send_groups={send_groups} must be >= 1")
  return Candidate(kernel, transfer, fused, dedup, send_groups)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
  """Values per knob; the product is enumerated (before pruning)."""

  block_m: Sequence[int] = (64, 128, 256)
  block_n: Sequence[int] = (64, 128, 256)
  block_k: Sequence[int] = (64, 128)
  max_concurrent_steps: Sequence[int] = (2, 3, 4, 5, 6)
  epilogue_slots: Sequence[int] = (1, 2)
  raster_rows: Sequence[Optional[int]] = (None, 16)   # None: the per-launch auto rule
  wgrad_raster: Sequence[Optional[int]] = (None,)     # None: bands of 4 k tiles
  mma_in_flight: Sequence[int] = (0,)                 # 1: level at the layer on 4x H200 (config.py)
  chunk_rows: Sequence[int] = (32, 64, 128, 256)
  # At most 96 of 132 SMs: the transfer's cross-rank wait needs all its CTAs
  # resident while other streams' kernels (NCCL) run (ep_transfer.py).
  num_ctas: Sequence[int] = (16, 32, 48, 64, 96)
  col_tile: Sequence[int] = (64, 128, 256)
  # Stage 3 (not in `points`): the v2 fused kernels as (n_comm, recv_chunk_rows[,
  # return_in_kernel, backward]) (FusedConfig's fields in order), tried on the best
  # verified v1 candidate; points with backward=True only when the backward is timed.
  # () turns stage 3 off. The fused backward with fewer transfer CTAs too: at n_comm 32
  # its GEMM lost more than the transfer it hid (deepseek-like, 4x H200: 44.04 ms vs
  # v1's 43.02, bench/results/moe_layer_NVIDIA_H200_ep4_run7.json).
  # v2.2 (Kernel A's items dealt round robin, the dX return beside the dw_gate_up wgrad:
  # 5th field wgrad_return_ctas) was the fastest point of the layer run on 4x H200
  # (moe_layer_NVIDIA_H200_ep4_run9_v22.json): (16, 2048, False, False, 16).
  fused: Sequence[tuple] = ((16, 2048), (32, 2048), (64, 2048), (32, 1024), (32, 4096),
                            (32, 2048, False, False), (32, 2048, False, True),
                            (16, 2048, False, True), (8, 2048, False, True),
                            (32, 2048, True, True), (16, 2048, False, False, 16),
                            (16, 2048, False, True, 16), (16, 1024, False, False, 16),
                            (16, 2048, False, False, 16, 16, False),
                            # ... with 4 return CTAs in each launch: the GEMMs keep 128 SMs
                            # where the returns are short next to them (mixtral-like, EP 4:
                            # 1.1 ms faster than uniep_dd on 4x H100, run 27; on 4x H200
                            # the two swap places between runs 56 and 57, NOTES_fused.md)
                            (16, 2048, False, False, 4, 4, False))
  # Stage 3 also times the best v1 candidate with token de-duplication, and each fused
  # point without a fused backward with its dy dispatch de-duplicated (the same bits,
  # fewer dispatched rows; 2x H200 fwd+bwd, qwen3-like: v1 11.88 -> 10.27 ms, fa_rbw
  # 10.75 -> 9.83, moe_layer_NVIDIA_H200_ep2_run15_dedup_bwd_barrier.json). (): off.
  # A point with dispatch_in_kernel=False (7th field; no Kernel A: the forward's dispatch
  # de-duplicated too) is timed with de-duplication only.
  dedup_tokens: Sequence[bool] = (True,)
  # ... and each de-duplicated candidate of stage 3 again with the owner's expansion of
  # the unique rows inside the transfer's launch (TransferConfig.expand_in_transfer; the
  # same bits). It depends on the shape and the EP degree (4x H200, fwd+bwd,
  # uniep_dc_rbw_dd: qwen3-like EP 4 -0.14 / -0.28 ms, runs 58-59; deepseek-like EP 4
  # +0.11, run 60; qwen3-like EP 2 +0.59, run 39). (): off.
  expand_in_transfer: Sequence[bool] = (True,)

  def points(self) -> Iterable[dict]:
    names = KERNEL_KNOBS + TRANSFER_KNOBS
    for values in itertools.product(*(getattr(self, n) for n in names)):
      yield dict(zip(names, values))

  def size(self) -> int:
    return math.prod(len(getattr(self, n)) for n in KERNEL_KNOBS + TRANSFER_KNOBS)


# ---------------------------------------------------------------------------
# Pruning
# ---------------------------------------------------------------------------
def _round_up(x: int, m: int) -> int:
  return -(-x // m) * m


def _fit_stages(bytes_at: Callable[[int], int], requested: int, k_iters: int, capacity: int,
                what: str) -> int:
  """The kernel's stage count: min(requested, k_iters, what fits). Raises if 1 does not fit."""
  if bytes_at(1) > capacity:
    raise InvalidCandidate(f"shared memory: {what} needs {bytes_at(1)} B at one stage, "
                           f"over the device's {capacity} B")
  fit = 1
  while fit < requested and bytes_at(fit + 1) <= capacity:
    fit += 1
  return int(min(fit, max(k_iters, 1)))


def _fit_stages_in_flight(bytes_at: Callable[[int], int], kernel: KernelConfig, k_iters: int,
                          capacity: int, what: str) -> tuple[int, int]:
  """(stages, wgmma groups in flight) of one launch, as grouped_gemm._stages_and_in_flight
  decides them: KernelConfig.mma_in_flight asks for that many stages more than
  max_concurrent_steps and is kept only where they are given, else 0 in flight."""
  mcs, extra = kernel.max_concurrent_steps, kernel.mma_in_flight
  if extra:
    stages = _fit_stages(bytes_at, mcs + extra, k_iters, capacity, what)
    if stages > mcs:
      return stages, extra
  return _fit_stages(bytes_at, mcs, k_iters, capacity, what), 0


def kernel_launch_stages(kernel: KernelConfig, problem: TuneProblem, smem_capacity: int) -> tuple:
  """Per launch of the layer's grouped GEMMs, the stage count the kernel will use
  (`kernel_launch_plan` without the MMAs in flight)."""
  return tuple(stages for stages, _ in kernel_launch_plan(kernel, problem, smem_capacity))


def kernel_launch_plan(kernel: KernelConfig, problem: TuneProblem, smem_capacity: int) -> tuple:
  """Per launch of the layer's grouped GEMMs, (stages, wgmma groups kept in flight) as
  the kernel will run it: two candidates with the same plan (and the same other knobs)
  compile the same kernels.

  Mirrors grouped_gemm's padding (F to lcm(2 block_n, 2 block_m, block_k), H to
  block_k as a contraction, M to block_m, and to block_k for wgrad) and sizes
  each launch with the kernel's own smem functions. Raises InvalidCandidate."""
  from pallas_kernels import grouped_gemm as gg
  import jax.numpy as jnp
  if kernel.block_m & (kernel.block_m - 1):
    raise InvalidCandidate(f"block_m={kernel.block_m} must be a power of two "
                           "(ragged TMA store ladder of the grouped GEMM)")
  if (kernel.block_n // 2) % 64:
    raise InvalidCandidate(f"block_n={kernel.block_n} must be a multiple of 128: the SwiGLU "
                           "kernel gives each warpgroup block_n/2 columns, a multiple of the "
                           "64-column epilogue")
  p, bm, bn, bk = problem, kernel.block_m, kernel.block_n, kernel.block_k
  dt = jnp.dtype(p.dtype)
  f_p = gg._swiglu_padded_f(p.ffn, kernel)   # as the FFN pads it
  h_k = _round_up(p.hidden, bk)
  launches = [("fwd gate/up (swiglu)", "swiglu", dt, h_k // bk),
              ("fwd down (plain)", "plain", dt, f_p // bk)]
  if p.direction == "bwd":
    # da: "dswiglu" (bf16 h/u/dh/du buffers, 2 x 16 KiB per warpgroup, one slot) and the
    # XLA-pass variant's "plain" launch with a float32 output (32 KiB per warpgroup and
    # epilogue slot: with 2 slots, more than dswiglu), either may run (a cached config
    # serves swiglu_grad_in_kernel=False too)
    launches += [("bwd da (dswiglu)", "dswiglu", dt, h_k // bk),
                 ("bwd da (plain, float32 out)", "plain", jnp.dtype(jnp.float32), h_k // bk),
                 ("bwd dx (plain over K = 2F)", "plain", dt, 2 * f_p // bk)]
  stages = []
  for what, mode, out_dt, k_iters in launches:
    def bytes_at(s, mode=mode, out_dt=out_dt):
      return gg.smem_bytes(dataclasses.replace(kernel, max_concurrent_steps=s), dt, out_dt, mode)
    stages.append(_fit_stages_in_flight(bytes_at, kernel, k_iters, smem_capacity,
                                        f"{what} with block_m={bm} block_n={bn} block_k={bk}"))
  if p.direction == "bwd":
    # The wgrad kernel has no public smem function: the same _Launch it builds in _wgrad_call.
    launch = gg.wgrad_launch(kernel, dt, dt)
    m_w = _round_up(_round_up(p.recv_rows, bm), bk)

    def wgrad_bytes(s):
      return s * launch.stage_bytes() + launch.epilogue_bytes(bm) + gg._SMEM_RESERVE
    stages.append(_fit_stages_in_flight(wgrad_bytes, kernel, m_w // bk, smem_capacity,
                                        f"bwd wgrad with block_m={bm} block_n={bn} block_k={bk}"))
  return tuple(stages)


def check_transfer(transfer: TransferConfig, problem: TuneProblem, device: DeviceFacts) -> None:
  """Raises InvalidCandidate if the transfer kernel cannot run as configured."""
  h = problem.hidden
  if h % transfer.col_tile:
    raise InvalidCandidate(f"H={h} is not divisible by col_tile={transfer.col_tile} (the kernel "
                           f"would use col_tile={_safe_col_tile(transfer, h)}: a duplicate)")
  smem = transfer.smem_bytes(problem.itemsize) + _TRANSFER_SMEM_SLACK
  if smem > device.smem_bytes:
    raise InvalidCandidate(f"shared memory: transfer stages {_TRANSFER_STAGES} x "
                           f"{transfer.chunk_rows} x {transfer.col_tile} need {smem} B, over "
                           f"the device's {device.smem_bytes} B")
  if transfer.num_ctas > device.num_sms:
    raise InvalidCandidate(f"num_ctas={transfer.num_ctas} exceeds the {device.num_sms} SMs "
                           "(CTAs of the cross-rank barrier must all be resident; the kernel "
                           "would clamp it: a duplicate)")


def check_fused(cand: Candidate, problem: TuneProblem, device: DeviceFacts) -> None:
  """Raises InvalidCandidate if the v2 kernels cannot run `cand.fused` for `problem`:
  the kernels' own static checks (chunk rows vs block_m, n_comm vs SMs, shared
  memory of each role, H vs the tiles) on this device's SM count and SMEM. Kernel A's
  only where it runs (dispatch_in_kernel): without it the forward's gate/up is v1's
  launch, which the v1 stages check."""
  from pallas_kernels import fused_dispatch_gemm as fdg
  from pallas_kernels import fused_gemm_return as fgr
  from pallas_kernels import grouped_gemm as gg
  import jax.numpy as jnp
  p = problem
  kernel = dataclasses.replace(cand.kernel, num_sms=device.num_sms)
  el = p.experts // p.ep
  try:
    kw = dict(out_rows=p.recv_rows, hidden=p.hidden, ffn=p.ffn, num_local_experts=el,
              dtype=jnp.dtype(p.dtype), kernel=kernel, transfer=cand.transfer,
              fused=cand.fused, smem=device.smem_bytes)
    if cand.fused.dispatch_in_kernel:
      a = fdg.validate(**kw)
      m_p, f_p = a.m_p, a.f_p
    else:   # v1's gate/up launch writes a: rows padded to block_m, F as it pads it
      m_p, f_p = gg._round_up(p.recv_rows, kernel.block_m), gg._swiglu_padded_f(p.ffn, kernel)
    if cand.fused.backward:     # the backward's fused launch (dy dispatch + dswiglu da)
      fdg.validate(**kw, mode="dswiglu")
    if cand.fused.return_in_kernel:
      fgr.validate(recv_rows=m_p, k=f_p, ffn=p.ffn, hidden=p.hidden, num_local_experts=el,
                   num_peers=p.ep, dtype=jnp.dtype(p.dtype), kernel=kernel,
                   smem=device.smem_bytes)
    for name in ("wgrad_return_ctas", "down_return_ctas"):   # CTAs of a split launch
      ctas = getattr(cand.fused, name)
      if ctas and not ctas < device.num_sms:
        raise ValueError(f"{name}={ctas} must be < num_sms={device.num_sms}")
    for n_copy, mode in ((cand.fused.overlap_copy_ctas, "swiglu"),
                         (cand.fused.overlap_copy_ctas_bwd if p.direction == "bwd" else 0,
                          "dswiglu")):
      if n_copy:   # Kernel D's checks (CTA split, send groups, SMEM, the 3-D view's tiles)
        from pallas_kernels import dedup_dispatch_gemm as ddg
        ddg.validate(out_rows=p.recv_rows, hidden=p.hidden, ffn=p.ffn, num_local_experts=el,
                     num_groups=cand.send_groups, dtype=jnp.dtype(p.dtype), kernel=kernel,
                     fused=cand.fused, n_copy=n_copy, smem=device.smem_bytes, mode=mode)
    cta_n = 2 * kernel.block_n
    if cand.fused.down_return_ctas and p.hidden % cta_n:
      raise ValueError(f"hidden={p.hidden} must be divisible by the CTA tile width "
                       f"2 * block_n = {cta_n} (Kernel C sends the down GEMM's columns as they are)")
  except ValueError as e:
    raise InvalidCandidate(f"fused kernels: {e}") from None


# Kernel D's send groups (UniEPConfig.dedup_send_groups) for a tuned point: the most of
# these that divides the local experts (8 groups of 4 at qwen3-like EP 4, as the layer
# bench's uniep_dc_rbw_dd_ov). A rule, not tuned.
OVERLAP_SEND_GROUPS = (8, 4, 2, 1)


def overlap_send_groups(local_experts: int) -> int:
  return next(g for g in OVERLAP_SEND_GROUPS if local_experts % g == 0)


def _has_v1_dedup_dispatch(cand: Candidate, direction: str) -> bool:
  """Whether a de-duplicated candidate runs a v1 de-duplicated dispatch (transfer, then
  the owner's copy) that expand_in_transfer would change: not where Kernel D moves every
  dispatch the run times."""
  f = cand.fused
  if f is None or not f.overlap_copy_ctas:
    return True
  return direction == "bwd" and not f.overlap_copy_ctas_bwd


def fused_candidates(space: SearchSpace, base: Candidate, problem: TuneProblem,
                     device: DeviceFacts) -> tuple[list, list]:
  """Stage 3: `base` with each fused point of `space`, and (v1 bases) with token
  de-duplication; (valid, rejected with reasons)."""
  valid, rejected = [], []
  for point in space.fused:
    knobs = dict(base.knobs(), **dict(zip(FUSED_KNOBS, point)))
    if knobs.get("dispatch_in_kernel") is False:
      knobs["dedup_tokens"] = True   # the point's forward dispatch is the unique one
    if knobs.get("overlap_copy_ctas") or knobs.get("overlap_copy_ctas_bwd"):
      # Kernel D: the unique rows sent in expert groups (OVERLAP_SEND_GROUPS' rule)
      knobs["dedup_send_groups"] = overlap_send_groups(problem.experts // problem.ep)
    if knobs.get("backward") and problem.direction == "fwd":
      continue   # the fused backward: the same forward as its point without it
    if problem.direction == "fwd":
      knobs["overlap_copy_ctas_bwd"] = 0   # a forward run times no backward launch
    try:
      cand = candidate_from_knobs(knobs)
      check_fused(cand, problem, device)
    except InvalidCandidate as e:
      rejected.append(dict(knobs=knobs, reason=str(e)))
      continue
    valid.append(cand)
    if True in space.dedup_tokens and not cand.fused.backward and not cand.dedup_tokens:
      # + the de-duplicated dy dispatch
      valid.append(dataclasses.replace(cand, dedup_tokens=True))
  if True in space.dedup_tokens and base.fused is None and not base.dedup_tokens:
    valid.append(dataclasses.replace(base, dedup_tokens=True))
  if True in space.expand_in_transfer:
    # + the expansion inside the transfer's launch, for every de-duplicated candidate
    from pallas_kernels.transfer_expand import check_resident   # the kernel's own check
    for cand in [c for c in valid if c.dedup_tokens and not c.transfer.expand_in_transfer
                 and _has_v1_dedup_dispatch(c, problem.direction)]:
      t = cand.transfer
      if not t.gather_rows:
        continue
      try:
        check_resident(t.num_ctas, t.copy_ctas, device.num_sms)
      except ValueError as e:
        rejected.append(dict(knobs=dict(cand.knobs(), expand_in_transfer=True),
                             reason=f"expand_in_transfer: {e}"))
        continue
      valid.append(dataclasses.replace(cand, transfer=dataclasses.replace(
          t, expand_in_transfer=True)))
  return valid, rejected


def _safe_col_tile(transfer: TransferConfig, h: int):
  try:
    return transfer.col_tile_for(h)
  except ValueError:
    return None


def check_candidate(cand: Candidate, problem: TuneProblem, device: DeviceFacts,
                    uses_transfer: bool = True) -> tuple:
  """Raises InvalidCandidate (with the reason) if `cand` cannot run for `problem`.

  Returns the candidate's signature: what the compiled kernels depend on (the
  per-launch stage counts rather than the requested max_concurrent_steps)."""
  plan = kernel_launch_plan(cand.kernel, problem, device.smem_bytes)   # (stages, in flight)
  k = cand.kernel
  sig = (k.block_m, k.block_n, k.block_k, plan, k.epilogue_slots, k.raster_rows,
         k.wgrad_raster)
  if uses_transfer:
    from uniep_jax.dispatch import ZERO_WINDOW_ROWS
    if k.block_k > ZERO_WINDOW_ROWS:
      raise InvalidCandidate(f"block_k={k.block_k} exceeds the {ZERO_WINDOW_ROWS} zeroed rows "
                             "after the live ones that the NVLink transport guarantees")
    check_transfer(cand.transfer, problem, device)
    t = cand.transfer
    sig += (t.chunk_rows, t.num_ctas, t.col_tile)
  return sig


@dataclasses.dataclass
class Enumeration:
  candidates: list          # valid, unique, in search order
  rejected: list            # dict(knobs, reason)
  enumerated: int


def _order_key(cand: Candidate):
  """Default first, then by how many knobs differ from the default (neighbours first)."""
  d = DEFAULT_CANDIDATE.knobs()
  c = cand.knobs()
  diffs = [k for k in d if c[k] != d[k]]
  dist = sum(abs(math.log2(c[k] / d[k])) if None not in (c[k], d[k]) else 1.0 for k in diffs)
  return (len(diffs), dist)


def enumerate_candidates(space: SearchSpace, problem: TuneProblem, device: DeviceFacts,
                         uses_transfer: bool = True) -> Enumeration:
  """Every point of `space`, pruned (reasons kept), deduplicated, in search order."""
  valid, rejected, seen = [], [], {}
  default_t = DEFAULT_CANDIDATE.transfer
  points = list(space.points())
  # The default is considered first so that it represents its duplicates.
  points.sort(key=lambda kn: 0 if kn == DEFAULT_CANDIDATE.knobs() else 1)
  for knobs in points:
    try:
      cand = candidate_from_knobs(knobs)
      if not uses_transfer and cand.transfer != default_t:
        raise InvalidCandidate("TransferConfig is unused by this backend: a duplicate")
      sig = check_candidate(cand, problem, device, uses_transfer)
      if sig in seen:
        raise InvalidCandidate(f"duplicate of {seen[sig]}: the kernel clamps (stages, MMAs "
                               f"in flight) to {sig[3]} per launch")
    except InvalidCandidate as e:
      rejected.append(dict(knobs=knobs, reason=str(e)))
      continue
    seen[sig] = cand.label()
    valid.append(cand)
  valid.sort(key=_order_key)
  return Enumeration(valid, rejected, len(points))


# ---------------------------------------------------------------------------
# Measuring: the Runner interface and the real layer runner
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measurement:
  median_ms: float
  compile_s: float
  checksum: tuple           # hex strings, one per output leaf
  timing: dict = dataclasses.field(default_factory=dict)


class Runner(Protocol):
  """What the search loop needs; tests inject fakes.

  reference(kernel) -> checksum of backend "pallas" with this KernelConfig
  measure(candidate) -> Measurement of the tuned backend; both raise on failure.
  Optional: prefetch_window (int) and prefetch(cands, kernels): start compiling
  the next candidates and the references of `kernels` in the background (the
  search calls it before each candidate; results and errors surface in
  measure / reference)."""

  backend: str
  uses_transfer: bool

  def reference(self, kernel: KernelConfig) -> tuple: ...

  def measure(self, cand: Candidate) -> Measurement: ...


def tree_checksum(tree) -> tuple:
  """Position-sensitive checksum of the bits of every leaf, computed on the device.

  Per leaf, with u = the bits as uint32, i = the flat index (uint32, wrapping)
  and f = MurmurHash3's fmix32 (a bijection of uint32 that spreads every bit):
  (sum f(u ^ f(i)), sum f(u + 2654435769 i)) mod 2^32. For a fixed i both terms
  are bijective in u, so any change of one element changes both sums; the mixing
  keeps changes of several elements (e.g. sign bits) from cancelling."""
  import jax
  sums = _checksum_fn()(jax.tree.leaves(tree))
  return tuple(f"{int(s[0]):08x}{int(s[1]):08x}" for s in jax.device_get(sums))


@functools.lru_cache(maxsize=1)
def _checksum_fn():
  import jax
  import jax.numpy as jnp

  def leaf(a):
    if a.dtype == jnp.bool_:
      u = a.astype(jnp.uint32)
    elif a.dtype.itemsize > 4:   # 64-bit: two uint32 words per element (extra minor dim)
      u = jax.lax.bitcast_convert_type(a, jnp.uint32)
    else:
      u = jax.lax.bitcast_convert_type(a, jnp.dtype(f"uint{a.dtype.itemsize * 8}"))
      u = u.astype(jnp.uint32)
    idx = jnp.zeros(u.shape, jnp.uint32)
    stride = 1
    for d in reversed(range(u.ndim)):
      idx = idx + jax.lax.broadcasted_iota(jnp.uint32, u.shape, d) * jnp.uint32(stride % 2**32)
      stride *= u.shape[d]
    h1 = jnp.sum(fmix32(u ^ fmix32(idx)), dtype=jnp.uint32)
    h2 = jnp.sum(fmix32(u + idx * jnp.uint32(2654435769)), dtype=jnp.uint32)
    return jnp.stack([h1, h2])

  def fmix32(h):
    h = h ^ (h >> 16)
    h = h * jnp.uint32(0x85EBCA6B)
    h = h ^ (h >> 13)
    h = h * jnp.uint32(0xC2B2AE35)
    return h ^ (h >> 16)

  return jax.jit(lambda leaves: [leaf(a) for a in leaves])


class LayerRunner:
  """Times `moe_ffn` on a data=1, expert=R mesh with random balanced routing.

  backend: the tuned backend ("uniep" on GPUs; "pallas" runs in the CPU
  interpret mode, where it checks the machinery). num_sms overrides
  KernelConfig.num_sms (small in the interpret mode). The reference is backend
  "pallas" with transport "padded" and the candidate's KernelConfig.

  compile_workers > 1: the next 2 x compile_workers candidates (and the references
  they need) are compiled ahead in that many threads while the current one is
  timed; timing stays one candidate at a time, and no Python lowering runs during
  it (the lowering lock). A compile is most of a candidate's
  cost (~16-38 s at the target shapes, against ~2 s of timing). XLA:GPU's own GEMM
  autotuning would then time kernels while other compiles run: run it with
  XLA_FLAGS=--xla_gpu_deterministic_ops=true (no autotuning; the training CLI's
  default), as bench/device_session.sh's tune phase does."""

  def __init__(self, problem: TuneProblem, *, backend: str = "uniep", mesh=None,
               num_sms: Optional[int] = None, seed: int = 0, trials: int = 5,
               min_batch_s: float = 0.1, max_reps: int = 10, compile_workers: int = 1):
    import jax
    if backend not in ("uniep", "pallas"):
      raise ValueError(f"backend={backend!r}: the tuner times 'uniep' (or 'pallas')")
    if compile_workers < 1:
      raise ValueError(f"compile_workers={compile_workers} must be >= 1")
    self.prefetch_window = 2 * compile_workers if compile_workers > 1 else 0
    self._pool = (concurrent.futures.ThreadPoolExecutor(compile_workers, "uniep-tune-compile")
                  if compile_workers > 1 else None)
    self._pending: dict = {}   # UniEPConfig -> Future of (compiled, compile_s)
    # Mosaic GPU's Python lowering keeps module-global state (its single-thread
    # emission scope): lowerings run one at a time, XLA's compiles in parallel
    self._lower_lock = threading.Lock()
    self.problem, self.backend, self.num_sms = problem, backend, num_sms
    self.uses_transfer = backend == "uniep"
    self.timing = dict(trials=trials, min_batch_s=min_batch_s, max_reps=max_reps)
    r = problem.ep
    if mesh is None:
      devs = jax.devices()
      if len(devs) < r:
        raise ValueError(f"ep={r} needs {r} devices, found {len(devs)}")
      mesh = jax.make_mesh((1, r), ("data", "expert"), devices=devs[:r])
    self.mesh = mesh
    self.inputs = self._make_inputs(seed)

  def _make_inputs(self, seed: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from uniep_jax.params import MoEParams, join_gate_up
    p, mesh = self.problem, self.mesh
    e, h, f, dt = p.experts, p.hidden, p.ffn, jnp.dtype(p.dtype)
    n = p.tokens * mesh.size
    specs = MoEParams(router=P(), w_gate_up=P("expert"), w_down=P("expert"), expert_bias=None)
    tok = P(tuple(mesh.axis_names), None)

    def init(key):
      k = jax.random.split(key, 6)
      params = MoEParams(
          router=jax.random.normal(k[0], (h, e), jnp.float32) * h ** -0.5,
          w_gate_up=join_gate_up(
              (jax.random.normal(k[1], (e, h, f), jnp.float32) * h ** -0.5).astype(dt),
              (jax.random.normal(k[2], (e, h, f), jnp.float32) * h ** -0.5).astype(dt)),
          w_down=(jax.random.normal(k[3], (e, f, h), jnp.float32) * f ** -0.5).astype(dt))
      x = jax.random.normal(k[4], (n, h), jnp.float32).astype(dt)
      ct = jax.random.normal(k[5], (n, h), jnp.float32).astype(dt)  # cotangent of y
      return x, params, ct

    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    out = (shard(tok), jax.tree.map(shard, specs), shard(tok))
    return jax.jit(init, out_shardings=out)(jax.random.key(seed))

  def _config(self, backend: str, kernel: KernelConfig, transfer: TransferConfig,
              fused: Optional[FusedConfig] = None, dedup_tokens: bool = False,
              send_groups: int = 1) -> UniEPConfig:
    if self.num_sms is not None:
      kernel = dataclasses.replace(kernel, num_sms=self.num_sms)
    transport = "padded" if backend == "pallas" else None
    return UniEPConfig(backend=backend, kernel=kernel, transfer=transfer, transport=transport,
                       fused=fused if backend == "uniep" else None,
                       dedup_tokens=dedup_tokens and backend == "uniep",
                       dedup_send_groups=send_groups if backend == "uniep" else 1)

  def _jitted(self, cfg: UniEPConfig):
    """The jitted layer for `cfg`: forward, or loss value and gradients for "bwd"."""
    import jax
    import jax.numpy as jnp
    from uniep_jax.moe import moe_ffn
    mesh, k = self.mesh, self.problem.top_k

    def fwd(x, p, ct):
      del ct
      return moe_ffn(x, p, mesh=mesh, top_k=k, config=cfg)[0]

    def loss(x, p, ct):
      y, aux = moe_ffn(x, p, mesh=mesh, top_k=k, config=cfg)
      return (jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
              + 1e-2 * aux["load_balance_loss"])

    return jax.jit(fwd if self.problem.direction == "fwd"
                   else jax.value_and_grad(loss, argnums=(0, 1)))

  def _candidate_config(self, cand: Candidate) -> UniEPConfig:
    return self._config(self.backend, cand.kernel, cand.transfer, cand.fused, cand.dedup_tokens,
                        cand.send_groups)

  def _compile(self, cfg: UniEPConfig):
    t0 = time.perf_counter()
    with self._lower_lock:
      lowered = self._jitted(cfg).lower(*self.inputs)
    return lowered.compile(), time.perf_counter() - t0

  def _compiled(self, cfg: UniEPConfig):
    """(executable, compile seconds): the prefetched one if any (its compile error,
    if it failed, is raised here), else compiled now."""
    future = self._pending.pop(cfg, None)
    return future.result() if future is not None else self._compile(cfg)

  def prefetch(self, cands: Sequence[Candidate], kernels: Sequence[KernelConfig]) -> None:
    if self._pool is None:
      return
    cfgs = ([self._config("pallas", kn, TransferConfig()) for kn in kernels]
            + [self._candidate_config(c) for c in cands])
    for cfg in cfgs:
      if cfg not in self._pending:
        self._pending[cfg] = self._pool.submit(self._compile, cfg)

  def discard(self, cands: Sequence[Candidate]) -> None:
    """Forgets prefetched compiles of `cands` (not run: past a stage's deadline, or
    their reference failed); queued ones are cancelled."""
    for c in cands:
      future = self._pending.pop(self._candidate_config(c), None)
      if future is not None:
        future.cancel()

  def close(self, wait: bool = True) -> None:
    """Drops what was prefetched and not used (queued compiles are cancelled; with
    wait=False, compiles already running are not waited for)."""
    if self._pool is not None:
      self._pool.shutdown(wait=wait, cancel_futures=True)
      self._pending.clear()

  def reference(self, kernel: KernelConfig) -> tuple:
    compiled, _ = self._compiled(self._config("pallas", kernel, TransferConfig()))
    return tree_checksum(compiled(*self.inputs))

  def measure(self, cand: Candidate) -> Measurement:
    """compile_s: the compile alone (in a worker thread when prefetched)."""
    from bench.common import block, time_ms  # the benchmarks' timing method (METHOD.md)
    compiled, compile_s = self._compiled(self._candidate_config(cand))
    # holding the lowering lock keeps the workers' Python lowering (which holds the
    # GIL) out of the timed loop; their XLA compiles (C++, no GIL) go on
    with self._lower_lock:
      out = block(compiled(*self.inputs))
      checksum = tree_checksum(out)
      del out
      t = time_ms(compiled, *self.inputs, **self.timing)
    return Measurement(median_ms=t["median_ms"], compile_s=compile_s, checksum=checksum,
                       timing=t)


# ---------------------------------------------------------------------------
# The search loop
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Trial:
  candidate: Candidate
  stage: str
  status: str    # ok | mismatch | failed | reference_failed | skipped (| running: checkpoints)
  median_ms: Optional[float] = None
  compile_s: Optional[float] = None
  checksum: Optional[tuple] = None
  reference_checksum: Optional[tuple] = None
  error: Optional[str] = None
  timing: Optional[dict] = None

  def to_json(self) -> dict:
    d = dict(label=self.candidate.label(), knobs=self.candidate.knobs(), stage=self.stage,
             status=self.status, median_ms=self.median_ms, compile_s=self.compile_s,
             checksum=list(self.checksum) if self.checksum else None,
             reference_checksum=list(self.reference_checksum) if self.reference_checksum else None,
             bitwise_equal_to_reference=(None if self.checksum is None
                                         or self.reference_checksum is None
                                         else self.checksum == self.reference_checksum),
             error=self.error, timing=self.timing)
    return d

  @classmethod
  def from_json(cls, d: dict) -> "Trial":
    return cls(candidate=candidate_from_knobs(d["knobs"]), stage=d["stage"], status=d["status"],
               median_ms=d.get("median_ms"), compile_s=d.get("compile_s"),
               checksum=tuple(d["checksum"]) if d.get("checksum") else None,
               reference_checksum=(tuple(d["reference_checksum"])
                                   if d.get("reference_checksum") else None),
               error=d.get("error"), timing=d.get("timing"))


def _loud(msg: str) -> None:
  bar = "!" * 78
  print(f"{bar}\n{msg}\n{bar}", file=sys.stderr, flush=True)


class _Search:
  """Runs candidates against the budget, verifying each against its reference."""

  def __init__(self, runner: Runner, deadline: float, clock, progress: bool,
               references: dict, previous: dict, on_trial: Optional[Callable] = None):
    self.runner, self.deadline, self.clock, self.progress = runner, deadline, clock, progress
    self.on_trial = on_trial
    self.references = references    # kernel label -> ("ok", checksum) | ("failed", error)
    self.previous = previous        # candidate label -> Trial (resume)
    self.trials: list[Trial] = []
    # A run killed while a candidate was "running" may have died in another one's
    # background compile: after such a run, compile one at a time to find out.
    self.prefetch = not any(t.status == "running" for t in previous.values())
    if not self.prefetch and getattr(runner, "prefetch_window", 0):
      _loud("tune: the resumed report ends in a killed candidate; compiling one candidate "
            "at a time in this run (a background compile may have been the culprit)")

  def _reference(self, kernel: KernelConfig):
    kernel = reference_kernel(kernel)
    label = kernel_label(kernel)
    if label not in self.references:
      try:
        self.references[label] = ("ok", tuple(self.runner.reference(kernel)))
      except Exception as e:  # noqa: BLE001 - recorded, the candidate is not verified
        self.references[label] = ("failed", repr(e)[:500])
    return self.references[label]

  def run(self, cands: Sequence[Candidate], stage: str, deadline: Optional[float] = None):
    from tqdm import tqdm
    deadline = self.deadline if deadline is None else min(deadline, self.deadline)
    bar = tqdm(cands, desc=f"tune {stage}", disable=not self.progress, file=sys.stderr,
               dynamic_ncols=True)
    window = getattr(self.runner, "prefetch_window", 0) if self.prefetch else 0
    for i, cand in enumerate(bar):
      if window and self.clock() < deadline:
        self._prefetch(cands[i:i + window])
      prev = self.previous.get(cand.label())
      if prev is not None and prev.status == "running":
        # The checkpoint was written before this candidate ran and never updated.
        prev = Trial(cand, stage, "failed", error="did not finish in an earlier run (killed at "
                     "the time limit or hung); not retried")
      if prev is not None and prev.status != "skipped":
        prev.stage = stage
        self.trials.append(prev)
        continue
      if self.clock() >= deadline:
        self.trials.append(Trial(cand, stage, "skipped", error="time budget"))
        continue
      if self.on_trial is not None:   # checkpoint "running": a kill or hang is not retried
        self.trials.append(Trial(cand, stage, "running"))
        self.on_trial(self)
        self.trials.pop()
      self.trials.append(self._one(cand, stage))
      if self.on_trial is not None:
        self.on_trial(self)
      best = best_trial(self.trials)
      if best is not None:
        bar.set_postfix_str(f"best {best.median_ms:.3f} ms {best.candidate.label()}")
    bar.close()
    if window:   # compiled ahead and not run (deadline, failed reference): drop them
      measured = {t.candidate.label() for t in self.trials if t.median_ms is not None}
      self.runner.discard([c for c in cands if c.label() not in measured])

  def _prefetch(self, cands: Sequence[Candidate]) -> None:
    """Asks the runner to compile ahead what these candidates will run: the ones not
    reused from a resumed report, and the references not yet computed."""
    todo = [c for c in cands
            if self.previous.get(c.label()) is None or self.previous[c.label()].status == "skipped"]
    refs = [reference_kernel(c.kernel) for c in todo]
    kernels = {kernel_label(k): k for k in refs if kernel_label(k) not in self.references}
    self.runner.prefetch(todo, list(kernels.values()))

  def _one(self, cand: Candidate, stage: str) -> Trial:
    ref_status, ref = self._reference(cand.kernel)
    if ref_status != "ok":
      return Trial(cand, stage, "reference_failed", error=f"reference (pallas) failed: {ref}")
    try:
      m = self.runner.measure(cand)
    except Exception as e:  # noqa: BLE001 - compile/run failures are counted, not fatal
      return Trial(cand, stage, "failed", reference_checksum=ref, error=repr(e)[:500])
    checksum = tuple(m.checksum)
    status = "ok" if checksum == ref else "mismatch"
    if status == "mismatch":
      _loud(f"BITWISE MISMATCH (a bug; never picked): {cand.label()} backend "
            f"{self.runner.backend} vs pallas with the same tiling, walked row-major:\n"
            f"  candidate {checksum}\n  reference {ref}")
    return Trial(cand, stage, status, median_ms=m.median_ms, compile_s=m.compile_s,
                 checksum=checksum, reference_checksum=ref, timing=m.timing)


def best_trial(trials: Sequence[Trial]) -> Optional[Trial]:
  """The fastest verified trial: status "ok" only (mismatches are never picked)."""
  ok = [t for t in trials if t.status == "ok" and t.median_ms is not None]
  return min(ok, key=lambda t: t.median_ms) if ok else None


@dataclasses.dataclass
class TuneResult:
  problem: TuneProblem
  device: DeviceFacts
  backend: str
  strategy: str
  budget_s: float
  elapsed_s: float
  enumeration: Enumeration
  trials: list
  references: dict
  default: Candidate
  stages: tuple = STAGES   # the staged search's stages this run searched
  fused_points: tuple = ()  # the space's stage-3 points (SearchSpace.fused) this run had
  dedup_points: tuple = ()  # the space's SearchSpace.dedup_tokens this run had

  @property
  def best(self) -> Optional[Trial]:
    return best_trial(self.trials)

  @property
  def mismatches(self) -> list:
    return [t for t in self.trials if t.status == "mismatch"]

  def top(self, n: int = 5) -> list:
    ok = sorted((t for t in self.trials if t.status == "ok"), key=lambda t: t.median_ms)
    return ok[:n]

  def default_trial(self) -> Optional[Trial]:
    for t in self.trials:
      if t.candidate == self.default and t.median_ms is not None:
        return t
    return None

  def counts(self) -> dict:
    c = dict(enumerated=self.enumeration.enumerated, rejected=len(self.enumeration.rejected),
             valid=len(self.enumeration.candidates))
    for s in ("ok", "mismatch", "failed", "reference_failed", "skipped"):
      c[s] = sum(t.status == s for t in self.trials)
    c["timed"] = c["ok"] + c["mismatch"]
    return c

  def transfer_consistency(self) -> list:
    """Per KernelConfig: do all its timed candidates (any TransferConfig) agree bitwise?"""
    groups: dict = {}   # by tiling: neither the transfer nor the tile order may change a bit
    for t in self.trials:
      if t.checksum is not None:
        groups.setdefault(kernel_label(reference_kernel(t.candidate.kernel)), []).append(t)
    return [dict(kernel=k, candidates=len(ts), transfers=sorted({t.candidate.label() for t in ts}),
                 distinct_checksums=len({t.checksum for t in ts}),
                 consistent=len({t.checksum for t in ts}) == 1)
            for k, ts in groups.items()]

  def spread(self) -> Optional[dict]:
    best, dflt = self.best, self.default_trial()
    if best is None or dflt is None or dflt.status != "ok":
      return None
    return dict(default_ms=dflt.median_ms, best_ms=best.median_ms,
                default_over_best=dflt.median_ms / best.median_ms,
                saved_ms=dflt.median_ms - best.median_ms)

  def to_json(self) -> dict:
    best = self.best
    consistency = self.transfer_consistency()
    return dict(
        tuner="uniep_jax.tune", format=CACHE_FORMAT, key=cache_key(self.device.kind, self.problem),
        problem=dataclasses.asdict(self.problem), device=dataclasses.asdict(self.device),
        backend=self.backend, strategy=self.strategy, stages=list(self.stages),
        fused_points=[list(p) for p in self.fused_points],
        dedup_tokens=list(self.dedup_points),
        budget_s=self.budget_s,
        elapsed_s=self.elapsed_s, counts=self.counts(),
        default=self.default.label(),
        best=None if best is None else best.to_json(),
        top5=[t.to_json() for t in self.top(5)], spread=self.spread(),
        mismatches=[t.to_json() for t in self.mismatches],
        transfer_consistency=consistency,
        transfer_consistent=all(g["consistent"] for g in consistency),
        references={k: dict(status=s, value=list(v) if s == "ok" else v)
                    for k, (s, v) in self.references.items()},
        trials=[t.to_json() for t in self.trials],
        rejected=self.enumeration.rejected)


def _default_candidate(enum: Enumeration, problem: TuneProblem, device: DeviceFacts) -> Candidate:
  """What an untuned user gets: the dataclass defaults if they can run here,
  else the heuristic, else the first valid candidate."""
  if DEFAULT_CANDIDATE in enum.candidates:
    return DEFAULT_CANDIDATE
  try:
    h = heuristic_config(problem, device)
  except ValueError:
    h = None
  for c in enum.candidates:
    if h is not None and (c == h or (c.kernel == h.kernel and c.transfer == DEFAULT_CANDIDATE.transfer)):
      return c
  return enum.candidates[0] if enum.candidates else DEFAULT_CANDIDATE


def tune(problem: TuneProblem, runner: Runner, *, device: Optional[DeviceFacts] = None,
         space: SearchSpace = SearchSpace(), budget_s: float = 480.0, strategy: str = "staged",
         stage1_fraction: float = 0.6, max_candidates: Optional[int] = None,
         stages: Sequence[str] = STAGES,
         resume: Optional[dict] = None, progress: bool = True,
         on_trial: Optional[Callable[[TuneResult], None]] = None,
         clock: Callable[[], float] = time.monotonic) -> TuneResult:
  """Enumerates, prunes, then times and verifies candidates within `budget_s`.

  runner: a `Runner` (`LayerRunner` on GPUs; tests inject fakes). resume: a
  previous report (`TuneResult.to_json()`) of the same key; its timed trials and
  references are reused. max_candidates caps the candidates of each stage.
  stages ("staged" only): which of "kernel", "transfer", "fused" to search; without
  "kernel", stage 1 times the default alone (the baseline every report has), so
  `stages=("fused",)` compares the v2 fused points with the default v1 candidate
  in one short call (a later `resume` can add the other stages).
  on_trial(partial result): called after every timed candidate (checkpoints).
  The budget is checked before each candidate: one started just before the
  deadline runs to its end (a compile and a timing: up to ~1 min at full size)."""
  if strategy not in ("staged", "grid"):
    raise ValueError(f"strategy={strategy!r} must be 'staged' or 'grid'")
  unknown = [st for st in stages if st not in STAGES]
  if unknown or not stages:
    raise ValueError(f"stages={tuple(stages)!r}: each must be one of {STAGES}, at least one")
  device = device or DeviceFacts.from_device()
  start = clock()
  enum = enumerate_candidates(space, problem, device, runner.uses_transfer)
  previous, references = {}, {}
  if resume:
    if resume.get("key") != cache_key(device.kind, problem):
      raise ValueError(f"resume report key {resume.get('key')!r} differs from "
                       f"{cache_key(device.kind, problem)!r}")
    previous = {d["label"]: Trial.from_json(d) for d in resume.get("trials", [])}
    references = {k: (v["status"], tuple(v["value"]) if v["status"] == "ok" else v["value"])
                  for k, v in resume.get("references", {}).items()}
  default = _default_candidate(enum, problem, device)
  deadline = start + budget_s

  def carried(search):
    """Resumed trials this run has not visited (e.g. a `--stages fused` run resuming a
    full search): kept in the report and in the choice of the best, never dropped."""
    seen = {t.candidate.label() for t in search.trials}
    return [t for label, t in previous.items()
            if label not in seen and t.status not in ("running", "skipped")]

  def result_now(search):
    return TuneResult(problem, device, runner.backend, strategy, budget_s, clock() - start,
                      enum, list(search.trials) + carried(search), search.references, default,
                      tuple(stages), tuple(tuple(p) for p in space.fused),
                      tuple(space.dedup_tokens))

  search = _Search(runner, deadline, clock, progress, references, previous,
                   on_trial=None if on_trial is None else (lambda s: on_trial(result_now(s))))
  cap = (lambda cs: cs[:max_candidates]) if max_candidates else (lambda cs: cs)
  if strategy == "grid":
    search.run(cap(enum.candidates), "grid")
  else:
    dt = default.transfer
    stage1 = ([c for c in enum.candidates if c.transfer == dt] if "kernel" in stages
              else [default])
    later = runner.uses_transfer and ("transfer" in stages or "fused" in stages)
    search.run(cap(stage1), "kernel",
               deadline=start + budget_s * (stage1_fraction if later else 1.0))
    best = best_trial(search.trials + carried(search))

    def run_fused(base: Candidate):   # stage 3: the fused points on `base`
      stage3, rejected = fused_candidates(space, base, problem, device)
      enum.rejected.extend(rejected)
      search.run(cap(stage3), "fused")

    if not later:
      pass
    elif "transfer" not in stages:
      if (space.fused or True in space.dedup_tokens) and best is not None:
        run_fused(best.candidate)
    else:
      if best is None:
        _loud("tune: no verified KernelConfig in stage 1; stages 2 and 3 skipped")
      else:
        bk = best.candidate.kernel
        stage2 = [c for c in enum.candidates
                  if c.kernel == bk and c.transfer != dt]
        # stage 3 (fused kernels) gets half of what is left after stage 1
        fused_next = bool(space.fused or True in space.dedup_tokens) and "fused" in stages
        search.run(cap(stage2), "transfer", deadline=(
            None if not fused_next else start + budget_s * (1 + stage1_fraction) / 2))
        best = best_trial(search.trials + carried(search))
        if fused_next and best is not None:
          run_fused(best.candidate)
  result = result_now(search)
  for g in result.transfer_consistency():
    if not g["consistent"]:
      _loud(f"TRANSFER INCONSISTENCY (a bug): KernelConfig {g['kernel']} gives "
            f"{g['distinct_checksums']} different checksums over transfers {g['transfers']}")
  return result


# ---------------------------------------------------------------------------
# Cache, heuristic, resolution of "auto"
# ---------------------------------------------------------------------------
@functools.lru_cache(maxsize=16)
def _read_cache(path: str, mtime_ns: int, size: int) -> dict:
  del mtime_ns, size  # part of the lru key only: a rewritten file is read again
  with open(path) as f:
    data = json.load(f)
  if not isinstance(data, dict) or not isinstance(data.get("entries", {}), dict):
    raise ValueError(f"{path}: not a uniep_jax tune cache (expected {{'entries': {{...}}}})")
  return data.get("entries", {})


def load_cache(path) -> dict:
  """The entries of a cache file ({} if the file does not exist)."""
  path = os.fspath(path)
  if not os.path.exists(path):
    return {}
  st = os.stat(path)
  return _read_cache(path, st.st_mtime_ns, st.st_size)


def user_cache_path(path=None) -> Optional[str]:
  """The user cache: `path` if given, else $UNIEP_TUNE_CACHE, else None."""
  if path is not None:
    return os.fspath(path)
  return os.environ.get(CACHE_ENV) or None


def _entry_candidate(entry: dict) -> Candidate:
  fused = entry.get("fused")
  return Candidate(KernelConfig(**entry["kernel"]), TransferConfig(**entry["transfer"]),
                   FusedConfig(**fused) if fused else None,
                   bool(entry.get("dedup_tokens", False)),   # older entries: False
                   int(entry.get("dedup_send_groups", 1)))


def lookup(problem: TuneProblem, device_kind: str, *, cache_path=None):
  """(Candidate, source) from the user cache, else the shipped one; None if no entry."""
  key = cache_key(device_kind, problem)
  sources = [p for p in (user_cache_path(cache_path), os.fspath(SHIPPED_CACHE)) if p]
  for src in sources:
    entry = load_cache(src).get(key)
    if entry is not None:
      return _entry_candidate(entry), src
  return None


def heuristic_config(problem: TuneProblem, device: DeviceFacts) -> Candidate:
  """The fallback when no cache entry matches. NOT measured per shape; the rules:

  kernel:   KernelConfig() (128/128/64, 3 stages: the v1 tiling of the bench
            results); if it cannot run for the shape/device, the first valid
            point of `SearchSpace()` in search order (fewest knobs changed).
  transfer: chunk_rows = the power of two <= the mean rows per (source rank,
            expert) segment T*K/E, clamped to [16, 128] (the load box is
            chunk_rows rows, so it should not be much longer than a segment);
            num_ctas = min(64, SMs / 2) (about half the SMs saturate NVLink,
            NOTES_ep_transfer.md); col_tile = the widest tile <= 256 dividing H.
  On the target shapes of bench/common.py this gives the defaults."""
  seg = max(1, problem.tokens * problem.top_k // problem.experts)
  chunk = min(128, max(16, 1 << (seg.bit_length() - 1)))
  t = TransferConfig(chunk_rows=chunk, num_ctas=max(1, min(64, device.num_sms // 2)))
  t = dataclasses.replace(t, col_tile=t.col_tile_for(problem.hidden))
  kernel = KernelConfig()
  try:
    kernel_launch_stages(kernel, problem, device.smem_bytes)
  except InvalidCandidate:
    enum = enumerate_candidates(SearchSpace(), problem, device, uses_transfer=False)
    if not enum.candidates:
      raise ValueError(f"no KernelConfig of SearchSpace() can run {problem} on {device}")
    kernel = enum.candidates[0].kernel
  return Candidate(kernel, t)


def resolve_config(config: UniEPConfig, *, tokens: int, hidden: int, ffn: int, experts: int,
                   top_k: int, ep: int, dtype, device=None, cache_path=None) -> UniEPConfig:
  """Fills `config.kernel` / `config.transfer` when None ("auto"); explicit ones are kept.

  Per-rank shapes (T = this shard's tokens). Lookup order: the "bwd" entry then
  the "fwd" entry of the user cache (`cache_path` or $UNIEP_TUNE_CACHE), then
  of the shipped cache; else `heuristic_config`."""
  if config.kernel is not None and config.transfer is not None:
    return config
  import jax
  device = device or jax.devices()[0]
  facts = DeviceFacts.from_device(device)
  found = None
  for direction in ("bwd", "fwd"):
    problem = TuneProblem(tokens, hidden, ffn, experts, top_k, ep, _dtype_name(dtype), direction)
    found = lookup(problem, facts.kind, cache_path=cache_path)
    if found is not None:
      break
  if found is not None:
    cand = found[0]
  else:   # the heuristic checks the kernel against the bwd launches (a superset of fwd)
    cand = heuristic_config(dataclasses.replace(problem, direction="bwd"), facts)
  # A tuned winner with the v2 fused kernels (verified bitwise against "pallas" by
  # the tuner) is taken only when the whole config is auto, for backend "uniep".
  fully_auto = config.kernel is None and config.transfer is None and config.fused is None
  take_tuned = fully_auto and config.backend == "uniep"
  # an explicit dedup_tokens=True takes a fused winner only if it has no fused backward
  # (which moves the dy dispatch itself), an explicit False only one with Kernel A (the
  # point without it de-duplicates its forward dispatch); otherwise v1's kernels
  # (slot_reduction="owner_partials" has no fused form: v1's kernels)
  f = cand.fused
  allowed = f is None or not ((config.dedup_tokens is True and f.backward)
                              or (config.dedup_tokens is False and not f.dispatch_in_kernel)
                              or config.slot_reduction != "slot_order")
  fused = f if take_tuned and allowed else config.fused
  # a tuned winner with de-duplication turns it on; otherwise an explicit choice stays,
  # and None stays auto (on for "uniep" unless its fused backward moves dy itself)
  dedup = True if (take_tuned and cand.dedup_tokens and config.dedup_tokens is None) \
      else config.dedup_tokens
  if fused is not None and fused.backward and config.swiglu_grad_in_kernel is False:
    # the fused backward computes dh, du in the da epilogue: the user asked for XLA's
    fused = dataclasses.replace(fused, backward=False)
  # Kernel D's send groups come with the tuned winner that needs them (unless set)
  groups = (cand.send_groups if fused is f and f is not None and config.dedup_send_groups == 1
            else config.dedup_send_groups)
  return dataclasses.replace(
      config,
      kernel=config.kernel if config.kernel is not None else cand.kernel,
      transfer=config.transfer if config.transfer is not None else cand.transfer,
      fused=fused, dedup_tokens=dedup, dedup_send_groups=groups)


def cache_entry(result: TuneResult, git_commit: Optional[str] = None,
                date: Optional[str] = None) -> dict:
  """The cache entry of a result's best verified candidate (measured numbers only);
  git_commit / date: the commit that ran them and when (default: this checkout's, now)."""
  if git_commit is None:
    from bench.common import git_commit as current_commit
    git_commit = current_commit()
  best = result.best
  if best is None:
    raise ValueError("no verified candidate: nothing to cache")
  k = dataclasses.asdict(best.candidate.kernel)
  k.pop("num_sms")
  spread = result.spread()
  fused = best.candidate.fused
  return dict(kernel=k, transfer=dataclasses.asdict(best.candidate.transfer),
              fused=dataclasses.asdict(fused) if fused is not None else None,
              dedup_tokens=best.candidate.dedup_tokens,
              dedup_send_groups=best.candidate.send_groups,
              median_ms=best.median_ms, default_ms=spread["default_ms"] if spread else None,
              backend=result.backend, strategy=result.strategy, counts=result.counts(),
              device_count=result.problem.ep, git_commit=git_commit,
              date=date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def update_cache(path, key: str, entry: dict) -> None:
  """Adds/replaces one entry of a cache file (atomic rewrite)."""
  path = os.fspath(path)
  data = dict(format=CACHE_FORMAT, entries={})
  if os.path.exists(path):
    with open(path) as f:
      data = json.load(f)
  data.setdefault("entries", {})[key] = entry
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def record(result: TuneResult, cache_path, git_commit: Optional[str] = None,
           date: Optional[str] = None) -> str:
  """Writes the best verified candidate into the cache file, unless the run saw
  any bitwise mismatch (then nothing is written). Returns what happened:
  "written", "mismatch" or "nothing" (no verified candidate)."""
  key = cache_key(result.device.kind, result.problem)
  if result.mismatches:
    _loud(f"{len(result.mismatches)} bitwise mismatch(es) for {key}: no cache entry written")
    return "mismatch"
  if result.best is None:
    print(f"no verified candidate for {key}: no cache entry written", file=sys.stderr)
    return "nothing"
  update_cache(cache_path, key, cache_entry(result, git_commit, date))
  print(f"cache {cache_path}: wrote {key}", flush=True)
  return "written"


class _ReplayRunner:
  """A Runner for `replay`: every trial and reference comes from the report."""
  prefetch_window = 0

  def __init__(self, backend: str):
    self.backend, self.uses_transfer = backend, backend == "uniep"

  def reference(self, kernel):
    raise RuntimeError(f"replay: the report has no reference for {kernel_label(kernel)}")

  def measure(self, cand):
    raise RuntimeError(f"replay: the report has no trial of {cand.label()}")


def _with_row_major_references(report: dict) -> dict:
  """A report made before KernelConfig.raster_rows keyed its references by the tiling
  alone, one made before KernelConfig.wgrad_raster by the tiling and "_r1"; they ran
  row-major, which is today's reference order: rename the keys to `reference_kernel`'s
  labels so that they are found."""
  if _tile_order_knob_missing(report) is None:
    return report
  refs = {kernel_label(reference_kernel(candidate_from_knobs(
      dict(DEFAULT_CANDIDATE.knobs(), **_kernel_knobs_of(label))).kernel)): v
      for label, v in report.get("references", {}).items()}
  return dict(report, references=refs)


def _tile_order_knob_missing(report: dict) -> Optional[str]:
  """The first of TILE_ORDER_KNOBS that some trial of `report` lacks, else None."""
  for knob in TILE_ORDER_KNOBS:
    if any(knob not in t.get("knobs", {}) for t in report.get("trials", [])):
      return knob
  return None


def _kernel_knobs_of(label: str) -> dict:
  """'m128_n128_k64_s3_e2' -> the KernelConfig knobs it names."""
  names = dict(m="block_m", n="block_n", k="block_k", s="max_concurrent_steps",
               e="epilogue_slots", r="raster_rows", w="wgrad_raster", f="mma_in_flight")
  return {names[part[0]]: int(part[1:]) for part in label.split("|")[0].split("_")}


def replay(report: dict, space: SearchSpace = SearchSpace()) -> TuneResult:
  """The TuneResult of a saved report (`TuneResult.to_json()`), rebuilt without a GPU:
  the tuner's own search (over `space`: pass the run's; its stage-3 points are the
  report's own when it names them) on the report's device facts,
  every timed trial taken from the report, nothing measured (what the budget did not
  reach stays skipped), and the report's own default candidate (the dataclass
  defaults may have changed since). For a run killed after its last checkpoint,
  before it recorded its cache entry."""
  problem = TuneProblem(**report["problem"])
  device = DeviceFacts(**report["device"])
  report = _with_row_major_references(report)
  if "fused_points" in report and space.fused:
    space = dataclasses.replace(space, fused=tuple(tuple(p) for p in report["fused_points"]))
  if "dedup_tokens" in report:
    space = dataclasses.replace(space, dedup_tokens=tuple(report["dedup_tokens"]))
  clock = iter(range(10 ** 9)).__next__   # the budget is spent at once: nothing new runs
  result = tune(problem, _ReplayRunner(report["backend"]), device=device, space=space,
                budget_s=0.0, strategy=report["strategy"], resume=report, progress=False,
                stages=tuple(report.get("stages", STAGES)),
                clock=lambda: float(clock()))
  result.budget_s, result.elapsed_s = report["budget_s"], report["elapsed_s"]
  ran = {t["label"]: t for t in report.get("trials", [])}
  if report.get("default") in ran:
    result.default = candidate_from_knobs(ran[report["default"]]["knobs"])
  elif report.get("default") != result.default.label():
    raise ValueError(f"the report's default {report.get('default')!r} is not among its trials "
                     f"and differs from today's {result.default.label()!r}")
  return result


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------
def report_stem(device_kind: str, shape_name: str, ep: int, direction: str) -> str:
  kind = "".join(c if c.isalnum() else "_" for c in device_kind).strip("_")
  return f"tune_{kind}_{shape_name}_ep{ep}_{direction}"


def plot(result: TuneResult, path: str) -> None:
  """Median ms against each knob (ok: dots; mismatch: red x; default: ring; best: star)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  knobs = KERNEL_KNOBS + TRANSFER_KNOBS
  rows = -(-len(knobs) // 3)
  fig, grid = plt.subplots(rows, 3, figsize=(11, 2.8 * rows), sharey=True)
  axes = list(grid.flat)
  auto_x = 0.5   # where a knob's None ("auto": raster_rows, wgrad_raster) is drawn on the log axis

  def at(t, knob):
    v = t.candidate.knobs()[knob]
    return auto_x if v is None else v

  ok = [t for t in result.trials if t.status == "ok"]
  bad = [t for t in result.trials if t.status == "mismatch"]
  best, dflt = result.best, result.default_trial()
  for ax, knob in zip(axes, knobs):
    ax.scatter([at(t, knob) for t in ok], [t.median_ms for t in ok], s=14,
               alpha=0.7, label="verified")
    if bad:
      ax.scatter([at(t, knob) for t in bad], [t.median_ms for t in bad],
                 marker="x", color="red", label="MISMATCH")
    if dflt is not None and dflt.median_ms is not None:
      ax.scatter([at(dflt, knob)], [dflt.median_ms], s=80, facecolors="none",
                 edgecolors="black", label="default")
    if best is not None:
      ax.scatter([at(best, knob)], [best.median_ms], marker="*", s=120,
                 color="gold", edgecolors="black", label="best")
    if knob != "mma_in_flight":   # its values are 0 and 1: a linear axis
      ax.set_xscale("log", base=2)
    ax.set_xlabel(knob + (f" ({auto_x} = auto)" if knob in ("raster_rows", "wgrad_raster")
                          else ""))
  for ax in axes[len(knobs):]:
    ax.set_visible(False)
  axes[0].set_ylabel("median ms per call")
  axes[0].legend(fontsize=7)
  p = result.problem
  fig.suptitle(f"{result.device.kind}, EP={p.ep}, T={p.tokens} H={p.hidden} F={p.ffn} "
               f"E={p.experts} K={p.top_k} {p.dtype}, {p.direction}, backend {result.backend}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary(result: TuneResult) -> str:
  lines = [f"key {cache_key(result.device.kind, result.problem)}",
           f"counts {result.counts()}  elapsed {result.elapsed_s:.1f} s"]
  for i, t in enumerate(result.top(5)):
    lines.append(f"  top{i + 1}: {t.median_ms:9.3f} ms  {t.candidate.label()}")
  s = result.spread()
  if s:
    lines.append(f"  default {s['default_ms']:.3f} ms, best {s['best_ms']:.3f} ms: "
                 f"default/best = {s['default_over_best']:.3f}x")
  if result.mismatches:
    lines.append(f"  MISMATCHES: {[t.candidate.label() for t in result.mismatches]}")
  return "\n".join(lines)


def write_report(result: TuneResult, out_dir: str, shape_name: str, with_plot: bool = True) -> dict:
  """Writes <stem>.json (and <stem>.png) under out_dir; returns the paths."""
  os.makedirs(out_dir, exist_ok=True)
  p = result.problem
  stem = os.path.join(out_dir, report_stem(result.device.kind, shape_name, p.ep, p.direction))
  payload = dict(result.to_json(), shape_name=shape_name)
  try:
    from bench.common import run_metadata
    payload["meta"] = run_metadata()
  except Exception as e:  # noqa: BLE001 - metadata only
    payload["meta"] = dict(error=repr(e)[:200])
  payload["meta"]["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  with open(stem + ".json", "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
  paths = dict(json=stem + ".json")
  if not with_plot:
    return paths
  try:
    plot(result, stem + ".png")
    paths["png"] = stem + ".png"
  except Exception as e:  # noqa: BLE001 - the JSON is the record
    print(f"plot failed: {e!r}", file=sys.stderr)
  return paths


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def _problem_shape(args):
  if args.shape:
    t, h, f, e, k = (int(v) for v in args.shape.split(","))
    return args.shape.replace(",", "x"), (t, h, f, e, k)
  from bench.common import SHAPES, SMOKE_SHAPES
  shapes = {**SHAPES, **SMOKE_SHAPES}
  if args.moe_config not in shapes:
    raise SystemExit(f"--moe-config {args.moe_config!r} unknown; one of {sorted(shapes)}")
  s = shapes[args.moe_config]
  return s.name, (s.tokens, s.hidden, s.ffn, s.experts, s.top_k)


# positions of FusedConfig's flags in FUSED_KNOBS (return_in_kernel, backward, dispatch_in_kernel)
_FUSED_BOOL_FIELDS = tuple(i for i, k in enumerate(FUSED_KNOBS)
                           if isinstance(getattr(FusedConfig(), k), bool))


def parse_fused_points(text: str) -> tuple:
  """'32,2048;16,2048,0,1' -> ((32, 2048), (16, 2048, False, True)): SearchSpace.fused.
  A point is 2 to 11 of FUSED_KNOBS in order, the flags as 0|1
  (e.g. '16,2048,0,0,16,16,0': no Kernel A, Kernel C and the return beside the wgrad;
  '16,2048,0,0,16,16,0,16,32': the same with Kernel D, 16 / 32 copy CTAs)."""
  points = []
  for item in (t.strip() for t in text.split(";")):
    if not item:
      continue
    fields = [f.strip() for f in item.split(",")]
    if not 2 <= len(fields) <= len(FUSED_KNOBS) or not all(f.isdigit() for f in fields) or any(
        fields[i] not in ("0", "1") for i in _FUSED_BOOL_FIELDS if i < len(fields)):
      raise ValueError(f"--fused-points: {item!r} must be n_comm,recv_chunk_rows[,0|1,0|1"
                       f"[,wgrad_return_ctas[,down_return_ctas[,0|1[,overlap_copy_ctas"
                       f"[,overlap_copy_ctas_bwd[,overlap_copy_stages"
                       f"[,overlap_join_percent]]]]]]]]")
    points.append(tuple((f == "1") if i in _FUSED_BOOL_FIELDS else int(f)
                        for i, f in enumerate(fields)))
  return tuple(points)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="uniep-tune", description="Autotune the uniep backend's KernelConfig/TransferConfig.",
      epilog="Filling the shipped cache" + __doc__.split("Filling the shipped cache")[1],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--moe-config", default="deepseek-like", help="a shape of bench/common.py")
  ap.add_argument("--shape", default=None, help="T,H,F,E,K per rank (overrides --moe-config)")
  ap.add_argument("--ep", type=int, default=0, help="EP degree (default: all local devices)")
  ap.add_argument("--direction", default="fwd,bwd", help="comma list of fwd, bwd")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--backend", default="uniep", choices=("uniep", "pallas"))
  ap.add_argument("--budget-s", type=float, default=450.0, help="total, split over directions")
  ap.add_argument("--strategy", default="staged", choices=("staged", "grid"))
  ap.add_argument("--max-candidates", type=int, default=None, help="cap per stage")
  ap.add_argument("--num-sms", type=int, default=None, help="override (CPU interpret mode)")
  ap.add_argument("--trials", type=int, default=5, help="timing trials per candidate")
  ap.add_argument("--cache", default=None,
                  help=f"cache file to update (default ${CACHE_ENV}, else <out>/tuned_configs.json;"
                       " uniep_jax/tuned_configs.json to ship)")
  ap.add_argument("--out", default=None, help="report dir (default $OUT/tune, else bench/results/tune)")
  ap.add_argument("--resume", default=None, metavar="DIR",
                  help="continue from the reports of the same problems in DIR")
  ap.add_argument("--no-fused", action="store_true",
                  help="skip stage 3 (the v2 fused kernels, EXPERIMENTAL)")
  ap.add_argument("--stages", default=",".join(STAGES),
                  help="comma list of the staged search's stages to run (kernel, transfer, "
                       "fused); without kernel, stage 1 is the default alone: "
                       "--stages fused times the fused points against the default")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--record-from", default=None, metavar="REPORT",
                  help="no tuning, no GPU: rebuild the result of a saved report (a run killed "
                       "before it wrote its cache entry) and record its best in --cache "
                       "(default: $UNIEP_TUNE_CACHE, else the shipped uniep_jax/tuned_configs.json)")
  ap.add_argument("--compile-workers", type=int, default=1,
                  help="compile the next candidates in this many threads while one is timed "
                       "(see LayerRunner; use with XLA_FLAGS=--xla_gpu_deterministic_ops=true)")
  ap.add_argument("--fused-points", default=None,
                  metavar="N,B[,RET,BWD[,RBW[,DR[,A[,OV[,OVB[,OVS[,OVJ]]]]]]]];...",
                  help="stage 3's points instead of SearchSpace().fused: FusedConfig fields "
                       "n_comm, recv_chunk_rows[, return_in_kernel, backward (0/1)[, "
                       "wgrad_return_ctas[, down_return_ctas[, dispatch_in_kernel (0/1)[, "
                       "overlap_copy_ctas[, overlap_copy_ctas_bwd[, overlap_copy_stages[, "
                       "overlap_join_percent]]]]]]]] (Kernel D: the unique rows in the most "
                       "of 8/4/2 groups dividing the local experts), ';' between points, e.g. "
                       "'8,2048,0,1;16,2048,0,0,16,16,0;16,2048,0,0,16,16,0,16,32'")
  args = ap.parse_args(argv)
  space = SearchSpace(fused=()) if args.no_fused else SearchSpace()
  if args.fused_points and not args.no_fused:
    space = dataclasses.replace(space, fused=parse_fused_points(args.fused_points))
  if args.record_from:
    with open(args.record_from) as fh:
      report = json.load(fh)
    meta = report.get("meta", {})
    if not meta.get("git_commit") or not meta.get("date"):
      raise SystemExit(f"{args.record_from}: no meta.git_commit / meta.date: not recording a "
                       f"measurement whose commit is unknown")
    result = replay(report, space)
    print(summary(result), flush=True)
    cache = user_cache_path(args.cache) or os.fspath(SHIPPED_CACHE)
    return 2 if record(result, cache, meta["git_commit"], meta["date"]) == "mismatch" else 0

  import jax
  directions = [d for d in args.direction.split(",") if d]
  for d in directions:
    if d not in DIRECTIONS:
      raise SystemExit(f"--direction {d!r} must be in {DIRECTIONS}")
  shape_name, (t, h, f, e, k) = _problem_shape(args)
  ep = args.ep or len(jax.devices())
  out = args.out or (os.path.join(os.environ["OUT"], "tune") if os.environ.get("OUT")
                     else os.path.join("bench", "results", "tune"))
  cache = user_cache_path(args.cache) or os.path.join(out, "tuned_configs.json")
  device = DeviceFacts.from_device(num_sms=args.num_sms)
  rc = 0
  per_direction = args.budget_s / len(directions)
  for direction in directions:
    problem = TuneProblem(t, h, f, e, k, ep, args.dtype, direction)
    resume = None
    if args.resume:
      prev = os.path.join(args.resume, report_stem(device.kind, shape_name, ep, direction) + ".json")
      if os.path.exists(prev):
        with open(prev) as fh:
          resume = json.load(fh)
        flags = os.environ.get("XLA_FLAGS", "")
        if (missing := _tile_order_knob_missing(resume)) is not None:
          # its candidates ran in the row-major tile order; the same labels now mean the
          # knob's None (auto), which may band the tiles
          print(f"NOT resuming from {prev}: made before KernelConfig.{missing} (its "
                f"times are of the row-major tile order)", flush=True)
          resume = None
        elif resume.get("meta", {}).get("xla_flags", "") != flags:
          # other XLA flags: other glue kernels, other times (and maybe other bits)
          print(f"NOT resuming from {prev}: it ran with XLA_FLAGS="
                f"{resume.get('meta', {}).get('xla_flags', '')!r}, this run has {flags!r}",
                flush=True)
          resume = None
        else:
          print(f"resuming from {prev}", flush=True)
    runner = LayerRunner(problem, backend=args.backend, num_sms=args.num_sms, trials=args.trials,
                         compile_workers=args.compile_workers)
    print(f"tuning {cache_key(device.kind, problem)} (budget {per_direction:.0f} s)", flush=True)
    checkpoint = lambda r: write_report(r, out, shape_name, with_plot=False)  # noqa: E731
    try:
      result = tune(problem, runner, device=device, budget_s=per_direction,
                    space=space,
                    strategy=args.strategy, max_candidates=args.max_candidates,
                    stages=tuple(st.strip() for st in args.stages.split(",") if st.strip()),
                    resume=resume,
                    progress=not args.no_progress, on_trial=checkpoint)
    except BaseException:
      runner.close()   # queued compiles cancelled
      raise
    # report and cache entry before waiting for background compiles still running (up
    # to a minute each; a run killed at the device's time limit while it waited lost
    # its entry, 4x H100, 2026-11-26); after the last direction, not waited for at all
    runner.close(wait=False)
    paths = write_report(result, out, shape_name)
    print(summary(result), flush=True)
    print(f"wrote {paths}", flush=True)
    if record(result, cache) == "mismatch":
      rc = 2
    if direction != directions[-1]:
      runner.close(wait=True)   # no compile of this direction runs beside the next one's timing
    del runner
  return rc


if __name__ == "__main__":
  sys.exit(main())
