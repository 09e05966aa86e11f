"""The Pallas backends' parameter space and the tune cache: what `moe_ffn` uses at run time.

A point of the space is one `Candidate(kernel: KernelConfig, transfer: TransferConfig,
overlap: OverlapConfig | None, replica_slots: int)`:
  KernelConfig    block_m, block_n, block_k, max_concurrent_steps, raster_rows,
                  wgrad_raster                                  (the grouped GEMM)
  TransferConfig  chunk_rows, num_ctas, col_tile                (the NVLink transfer)
  OverlapConfig   down_return_ctas, wgrad_return_ctas, chunk_rows ("uniep": transfers
                  inside GEMM launches; None: every transfer its own launch)
  replica_slots   UniEPConfig.replica_slots (exact-load balancing; only a skewed routing
                  can make it win: the autotuner's --routing)
`SearchSpace` lists the values of each knob. No knob changes a bit but block_k (the
accumulation order): the autotuner (uniep_jax/autotune.py) checks every timed point
bitwise against backend "pallas" with the same tiling walked row-major.

Pruning, before anything is compiled (`check_candidate`, raising `InvalidCandidate`
with the reason): the dataclasses' own checks; block_m a power of two (the ragged TMA
store ladder); block_n a multiple of 128 (the SwiGLU launch gives each compute
warpgroup block_n / 2 columns); every launch the layer makes fits the device's shared
memory at one stage (the kernels' own SMEM functions; above one stage the kernel clamps
its stage count, so two candidates whose per-launch stage counts come out equal compile
the same kernels: the later one is a duplicate); block_k within the rows the NVLink
transport zeroes after the live ones; the transfer's col_tile divides H, its stages fit,
num_ctas <= SMs; an overlap point's CTA split, chunk rows and H (the overlapped
launches' own checks). A forward-only problem runs no wgrad: its overlap points keep
down_return_ctas only.

Cache and "auto". `UniEPConfig(kernel=None)` and/or `transfer=None` means auto:
`moe_ffn` fills the None fields with `resolve_config`, which looks up the key (device
kind, T, H, F, E, K, dtype, EP, direction) - "bwd" first (training), then "fwd" - in
the user cache ($UNIEP_TUNE_CACHE, or an explicit path), then in the cache shipped
with the package (uniep_jax/tuned_configs.json), and otherwise uses
`heuristic_config`. Explicit configs are used exactly as given. A cached winner's
overlap point is applied only when kernel and transfer are both None, the config names
no overlap nor replica slots and the backend is "uniep". A cache entry holds only measured numbers (the
autotuner writes them); a cache file of another `CACHE_FORMAT` is refused, not guessed at.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import json
import math
import os
from pathlib import Path
from typing import Callable, Iterable, Optional, Sequence

import jax
import jax.numpy as jnp

from pallas_kernels import device as device_lib
from pallas_kernels import grouped_gemm as gg
from uniep_jax.config import KernelConfig, OverlapConfig, TransferConfig, UniEPConfig
from uniep_jax.transport import ZERO_WINDOW_ROWS

DIRECTIONS = ("fwd", "bwd")
CACHE_ENV = "UNIEP_TUNE_CACHE"
SHIPPED_CACHE = Path(__file__).with_name("tuned_configs.json")
CACHE_FORMAT = 2
_TRANSFER_STAGES = 2  # ep_transfer.py: 2 SMEM stage buffers
_TRANSFER_SMEM_SLACK = 1024  # barriers and alignment


class InvalidCandidate(ValueError):
  """A point of the space that cannot run (or would duplicate another) for a problem."""


# ---------------------------------------------------------------------------
# Problem, device, candidates
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class TuneProblem:
  """One tuning problem. Shapes are per EP rank: tokens T (this rank's tokens), hidden
  H, ffn F, experts E (global), top_k K, ep R (ranks of the expert axis), dtype (a
  numpy dtype name), direction "fwd" or "bwd" (forward + backward)."""

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
    object.__setattr__(self, "dtype", jnp.dtype(self.dtype).name)

  @property
  def itemsize(self) -> int:
    return jnp.dtype(self.dtype).itemsize

  @property
  def recv_rows(self) -> int:
    """Rows of the receive buffer the grouped GEMM runs on: R * T * K."""
    return self.ep * self.tokens * self.top_k


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
    device = device or jax.devices()[0]
    return cls(kind=device.device_kind, smem_bytes=device_lib.smem_capacity(device),
               num_sms=device_lib.num_sms(num_sms, device))


KERNEL_KNOBS = ("block_m", "block_n", "block_k", "max_concurrent_steps", "raster_rows",
                "wgrad_raster")
TRANSFER_KNOBS = ("chunk_rows", "num_ctas", "col_tile")
OVERLAP_KNOBS = ("down_return_ctas", "wgrad_return_ctas", "overlap_chunk_rows")
REPLICA_KNOB = "replica_slots"


@dataclasses.dataclass(frozen=True)
class Candidate:
  """One point of the space. `knobs()` flattens it (the reports' form; the overlap's
  chunk_rows as overlap_chunk_rows, TransferConfig has a chunk_rows too);
  `candidate_from_knobs` builds it back. overlap None: every transfer its own launch.
  replica_slots > 0 (no overlap then: UniEPConfig refuses both)."""

  kernel: KernelConfig
  transfer: TransferConfig
  overlap: Optional[OverlapConfig] = None
  replica_slots: int = 0

  def label(self) -> str:
    k, t = self.kernel, self.transfer
    label = (f"m{k.block_m}_n{k.block_n}_k{k.block_k}_s{k.max_concurrent_steps}"
             + (f"_r{k.raster_rows}" if k.raster_rows is not None else "")
             + (f"_w{k.wgrad_raster}" if k.wgrad_raster is not None else "")
             + f"|c{t.chunk_rows}_x{t.num_ctas}_t{t.col_tile}")
    if self.overlap is not None:
      o = self.overlap
      label += f"|ov{o.down_return_ctas}_{o.wgrad_return_ctas}_b{o.chunk_rows}"
    if self.replica_slots:
      label += f"|rs{self.replica_slots}"
    return label

  def knobs(self) -> dict:
    knobs = {**{n: getattr(self.kernel, n) for n in KERNEL_KNOBS},
             **{n: getattr(self.transfer, n) for n in TRANSFER_KNOBS}}
    if self.overlap is not None:
      knobs.update(down_return_ctas=self.overlap.down_return_ctas,
                   wgrad_return_ctas=self.overlap.wgrad_return_ctas,
                   overlap_chunk_rows=self.overlap.chunk_rows)
    if self.replica_slots:
      knobs[REPLICA_KNOB] = self.replica_slots
    return knobs

  def apply(self, config: UniEPConfig) -> UniEPConfig:
    """`config` with this point's kernel, transfer and replica slots (and overlap, for
    "uniep")."""
    return dataclasses.replace(config, kernel=self.kernel, transfer=self.transfer,
                               overlap=self.overlap if config.backend == "uniep" else None,
                               replica_slots=self.replica_slots)


DEFAULT_CANDIDATE = Candidate(KernelConfig(), TransferConfig())


def reference_kernel(kernel: KernelConfig) -> KernelConfig:
  """The KernelConfig of a candidate's "pallas" reference: the same but for the tile
  orders (raster_rows 1, wgrad_raster 1), which by contract change no bit; so a raster
  variant is checked against the row-major kernel's bits, not only against itself."""
  return dataclasses.replace(kernel, raster_rows=1, wgrad_raster=1)


def kernel_label(kernel: KernelConfig) -> str:
  return Candidate(kernel, TransferConfig()).label().split("|")[0]


def candidate_from_knobs(knobs: dict) -> Candidate:
  """Builds a candidate (`Candidate.knobs()`'s inverse; a missing kernel or transfer
  knob takes the dataclass default, the overlap knobs make an overlap point); the
  dataclasses' own checks raise InvalidCandidate, as does a knob this space does not
  have."""
  unknown = set(knobs) - set(KERNEL_KNOBS + TRANSFER_KNOBS + OVERLAP_KNOBS + (REPLICA_KNOB,))
  if unknown:
    raise InvalidCandidate(f"knobs {sorted(unknown)} are not in the parameter space")
  try:
    kernel = KernelConfig(**{k: knobs[k] for k in KERNEL_KNOBS if k in knobs})
  except ValueError as e:
    raise InvalidCandidate(f"KernelConfig: {e}") from None
  try:
    transfer = TransferConfig(**{k: knobs[k] for k in TRANSFER_KNOBS if k in knobs})
  except ValueError as e:
    raise InvalidCandidate(f"TransferConfig: {e}") from None
  overlap = None
  if any(k in knobs for k in OVERLAP_KNOBS):   # (both CTA counts 0 is no point: raises)
    try:
      overlap = OverlapConfig(knobs.get("down_return_ctas", 0), knobs.get("wgrad_return_ctas", 0),
                              knobs.get("overlap_chunk_rows", OverlapConfig().chunk_rows))
    except ValueError as e:
      raise InvalidCandidate(f"OverlapConfig: {e}") from None
  slots = knobs.get(REPLICA_KNOB, 0)
  if isinstance(slots, bool) or not isinstance(slots, int) or slots < 0:
    raise InvalidCandidate(f"replica_slots={slots!r} must be an int >= 0")
  if slots and overlap is not None:
    raise InvalidCandidate(f"replica_slots={slots} with an overlap point: the overlapped "
                           f"launches take no replica weights")
  return Candidate(kernel, transfer, overlap, slots)


@dataclasses.dataclass(frozen=True)
class SearchSpace:
  """Values per knob; the product of the kernel and transfer knobs is enumerated (before
  pruning); `overlap` points (down_return_ctas, wgrad_return_ctas, chunk_rows) are tried
  on the best verified candidate ("uniep" only; () turns them off)."""

  block_m: Sequence[int] = (64, 128, 256)
  block_n: Sequence[int] = (64, 128, 256)
  block_k: Sequence[int] = (64, 128)
  max_concurrent_steps: Sequence[int] = (2, 3, 4, 5, 6)
  raster_rows: Sequence[Optional[int]] = (None, 16)   # None: the per-launch auto rule
  wgrad_raster: Sequence[Optional[int]] = (None,)     # None: bands of 4 k tiles
  chunk_rows: Sequence[int] = (32, 64, 128, 256)
  # At most 96 of 132 SMs: the transfer's cross-rank wait needs all its CTAs resident
  # while other streams' kernels (NCCL) run (ep_transfer.py).
  num_ctas: Sequence[int] = (16, 32, 48, 64, 96)
  col_tile: Sequence[int] = (64, 128, 256)
  # OverlapConfig(down_return_ctas, wgrad_return_ctas, chunk_rows) points: 16 CTAs each
  # (measured fastest where the transfers are long: qwen3-like, deepseek-like), fewer
  # where they are short next to the GEMMs (mixtral-like), and each overlap alone
  # (docs/decisions.md has the measurements of the overlap points)
  overlap: Sequence[tuple] = ((16, 16, 2048), (8, 8, 2048), (4, 4, 2048), (16, 0, 2048),
                              (0, 16, 2048))
  # replica slot counts (stage 4, `slot_candidates`): tried on the best verified point
  # without overlap; none by default (they win only under a skewed routing)
  replica_slots: Sequence[int] = ()

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


def kernel_launch_stages(kernel: KernelConfig, problem: TuneProblem, smem_capacity: int) -> tuple:
  """Per launch of the layer's grouped GEMMs, the stage count the kernel will use: two
  candidates with the same stages (and the same other knobs) compile the same kernels.

  Mirrors grouped_gemm's padding (F as the FFN pads it, H to block_k as a contraction,
  M to block_m, and to block_k for wgrad) and sizes each launch with the kernel's own
  smem functions. Raises InvalidCandidate."""
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
  launches = [("fwd gate/up (swiglu)", "swiglu", h_k // bk),
              ("fwd down (plain)", "plain", f_p // bk)]
  if p.direction == "bwd":
    launches += [("bwd da (dswiglu)", "dswiglu", h_k // bk),
                 ("bwd dx (plain over K = 2F)", "plain", 2 * f_p // bk)]
  stages = []
  for what, mode, k_iters in launches:
    def bytes_at(s, mode=mode):
      return gg.smem_bytes(dataclasses.replace(kernel, max_concurrent_steps=s), dt, dt, mode)
    stages.append(_fit_stages(bytes_at, kernel.max_concurrent_steps, k_iters, smem_capacity,
                              f"{what} with block_m={bm} block_n={bn} block_k={bk}"))
  if p.direction == "bwd":
    launch = gg.wgrad_launch(kernel, dt, dt)
    m_w = _round_up(_round_up(p.recv_rows, bm), bk)

    def wgrad_bytes(s):
      return s * launch.stage_bytes() + launch.epilogue_bytes(bm) + gg._SMEM_RESERVE
    stages.append(_fit_stages(wgrad_bytes, kernel.max_concurrent_steps, m_w // bk,
                              smem_capacity,
                              f"bwd wgrad with block_m={bm} block_n={bn} block_k={bk}"))
  return tuple(stages)


def check_transfer(transfer: TransferConfig, problem: TuneProblem, device: DeviceFacts) -> None:
  """Raises InvalidCandidate if the transfer kernel cannot run as configured."""
  h = problem.hidden
  if h % transfer.col_tile:
    raise InvalidCandidate(f"H={h} is not divisible by col_tile={transfer.col_tile} (the "
                           f"kernel would use a narrower tile: a duplicate)")
  smem = transfer.smem_bytes(problem.itemsize) + _TRANSFER_SMEM_SLACK
  if smem > device.smem_bytes:
    raise InvalidCandidate(f"shared memory: transfer stages {_TRANSFER_STAGES} x "
                           f"{transfer.chunk_rows} x {transfer.col_tile} need {smem} B, over "
                           f"the device's {device.smem_bytes} B")
  if transfer.num_ctas > device.num_sms:
    raise InvalidCandidate(f"num_ctas={transfer.num_ctas} exceeds the {device.num_sms} SMs "
                           "(CTAs of the cross-rank barrier must all be resident; the kernel "
                           "would clamp it: a duplicate)")


def check_overlap(cand: Candidate, problem: TuneProblem, device: DeviceFacts) -> None:
  """Raises InvalidCandidate if the overlapped launches cannot run `cand.overlap`: the
  kernels' own static checks (down_gemm_return.py, wgrad_return.py) on this device."""
  o, k, p = cand.overlap, cand.kernel, problem
  for name in ("down_return_ctas", "wgrad_return_ctas"):
    ctas = getattr(o, name)
    if ctas and not ctas < device.num_sms:
      raise InvalidCandidate(f"overlap: {name}={ctas} must be < num_sms={device.num_sms}")
  if o.down_return_ctas:
    if o.chunk_rows % k.block_m:
      raise InvalidCandidate(f"overlap: chunk_rows={o.chunk_rows} must be a multiple of "
                             f"block_m={k.block_m}")
    if p.hidden % (2 * k.block_n):
      raise InvalidCandidate(f"overlap: hidden={p.hidden} must be divisible by the CTA tile "
                             f"width 2 * block_n = {2 * k.block_n} (the down GEMM's columns are "
                             f"sent as they are)")
    if _round_up(p.recv_rows, k.block_m) < cand.transfer.chunk_rows:
      raise InvalidCandidate("overlap: the receive layout is shorter than one transfer item")


def check_candidate(cand: Candidate, problem: TuneProblem, device: DeviceFacts,
                    uses_transfer: bool = True) -> tuple:
  """Raises InvalidCandidate (with the reason) if `cand` cannot run for `problem`.

  Returns the candidate's signature: what the compiled kernels depend on (the
  per-launch stage counts rather than the requested max_concurrent_steps)."""
  k = cand.kernel
  sig = (k.block_m, k.block_n, k.block_k, kernel_launch_stages(k, problem, device.smem_bytes),
         k.raster_rows, k.wgrad_raster)
  if uses_transfer:
    if k.block_k > ZERO_WINDOW_ROWS:
      raise InvalidCandidate(f"block_k={k.block_k} exceeds the {ZERO_WINDOW_ROWS} zeroed rows "
                             "after the live ones that the NVLink transport guarantees")
    check_transfer(cand.transfer, problem, device)
    t = cand.transfer
    sig += (t.chunk_rows, t.num_ctas, t.col_tile)
  if cand.overlap is not None:
    check_overlap(cand, problem, device)
    sig += (cand.overlap,)
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
  """Every kernel x transfer point of `space`, pruned (reasons kept), deduplicated, in
  search order."""
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
        raise InvalidCandidate(f"duplicate of {seen[sig]}: the kernel clamps its stages to "
                               f"{sig[3]} per launch")
    except InvalidCandidate as e:
      rejected.append(dict(knobs=knobs, reason=str(e)))
      continue
    seen[sig] = cand.label()
    valid.append(cand)
  valid.sort(key=_order_key)
  return Enumeration(valid, rejected, len(points))


def overlap_candidates(space: SearchSpace, base: Candidate, problem: TuneProblem,
                       device: DeviceFacts) -> tuple[list, list]:
  """`base` with each overlap point of `space`: (valid, rejected with reasons).

  A forward-only problem runs no wgrad: a point's wgrad_return_ctas is set to 0 there
  (a cache entry names only what was timed), so a point without down_return_ctas
  overlaps nothing and points that differ only in wgrad_return_ctas are duplicates."""
  valid, rejected = [], []
  for down, wgrad, chunk in space.overlap:
    knobs = dict(base.knobs(), down_return_ctas=down, wgrad_return_ctas=wgrad,
                 overlap_chunk_rows=chunk)
    try:
      if problem.direction == "fwd":
        knobs["wgrad_return_ctas"] = 0
        if not down:
          raise InvalidCandidate("overlap: the forward runs no wgrad, and down_return_ctas=0 "
                                 "overlaps nothing there")
      cand = candidate_from_knobs(knobs)
      check_overlap(cand, problem, device)
      if cand in valid:
        raise InvalidCandidate(f"overlap: duplicate of {cand.label()}" + (
            " (the forward runs no wgrad)" if problem.direction == "fwd" else ""))
    except InvalidCandidate as e:
      rejected.append(dict(knobs=knobs, reason=str(e)))
      continue
    valid.append(cand)
  return valid, rejected


def slot_candidates(space: SearchSpace, base: Candidate,
                    problem: TuneProblem) -> tuple[list, list]:
  """`base` (its kernel and transfer, no overlap) with each replica slot count of
  `space`: (valid, rejected with reasons)."""
  valid, rejected = [], []
  for slots in space.replica_slots:
    knobs = dict(Candidate(base.kernel, base.transfer).knobs(), replica_slots=slots)
    try:
      cand = candidate_from_knobs(knobs)
      if not slots:
        raise InvalidCandidate("replica_slots=0: the stages before time it")
      if problem.ep < 2:
        raise InvalidCandidate(f"replica_slots={slots}: one rank (ep=1) has nobody to share with")
      if slots > problem.experts // problem.ep:
        raise InvalidCandidate(f"replica_slots={slots} exceeds the "
                               f"{problem.experts // problem.ep} experts per rank")
    except InvalidCandidate as e:
      rejected.append(dict(knobs=knobs, reason=str(e)))
      continue
    valid.append(cand)
  return valid, rejected


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
  if data.get("format") != CACHE_FORMAT:
    raise ValueError(f"{path}: tune cache format {data.get('format')}, this version reads "
                     f"{CACHE_FORMAT}: tune again (python -m uniep_jax.autotune)")
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


def entry_candidate(entry: dict) -> Candidate:
  """The candidate a cache entry names: kernel (`KERNEL_KNOBS`), transfer
  (`TRANSFER_KNOBS`), overlap (OverlapConfig's fields, or None). Raises ValueError on a
  field this version does not have."""
  overlap = entry.get("overlap")
  try:
    return Candidate(KernelConfig(**entry["kernel"]), TransferConfig(**entry["transfer"]),
                     OverlapConfig(**overlap) if overlap else None)
  except TypeError as e:   # an unknown field
    raise ValueError(f"tune cache entry: {e}") from None


def lookup(problem: TuneProblem, device_kind: str, *, cache_path=None):
  """(Candidate, source) from the user cache, else the shipped one; None if no entry."""
  key = cache_key(device_kind, problem)
  sources = [p for p in (user_cache_path(cache_path), os.fspath(SHIPPED_CACHE)) if p]
  for src in sources:
    entry = load_cache(src).get(key)
    if entry is not None:
      try:
        return entry_candidate(entry), src
      except ValueError as e:
        raise ValueError(f"{src}, entry {key!r}: {e}") from None
  return None


def heuristic_config(problem: TuneProblem, device: DeviceFacts) -> Candidate:
  """The fallback when no cache entry matches. NOT measured per shape; the rules:

  kernel:   KernelConfig() (128/128/64, 3 stages); if it cannot run for the shape and
            device, the first valid point of `SearchSpace()` in search order (fewest
            knobs changed).
  transfer: chunk_rows = the power of two <= the mean rows per (source rank, expert)
            segment T*K/E, clamped to [16, 128] (the load box is chunk_rows rows, so it
            should not be much longer than a segment); num_ctas = min(64, SMs / 2)
            (about half the SMs saturate NVLink); col_tile = the widest tile <= 256
            dividing H.
  No overlap. On the target shapes (uniep_jax.measure.SHAPES) this gives the defaults."""
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

  Per-rank shapes (T = this shard's tokens). Lookup order: the "bwd" entry then the
  "fwd" entry of the user cache (`cache_path` or $UNIEP_TUNE_CACHE), then of the
  shipped cache; else `heuristic_config`. A cached overlap point is taken when both are
  auto (and the backend is "uniep") and the config names none and no replica slots."""
  if config.kernel is not None and config.transfer is not None:
    return config
  device = device or jax.devices()[0]
  facts = DeviceFacts.from_device(device)
  found = None
  for direction in ("bwd", "fwd"):
    problem = TuneProblem(tokens, hidden, ffn, experts, top_k, ep, jnp.dtype(dtype).name,
                          direction)
    found = lookup(problem, facts.kind, cache_path=cache_path)
    if found is not None:
      break
  if found is not None:
    cand = found[0]
  else:   # the heuristic checks the kernel against the bwd launches (a superset of fwd)
    cand = heuristic_config(dataclasses.replace(problem, direction="bwd"), facts)
  fully_auto = config.kernel is None and config.transfer is None
  overlap = config.overlap
  if (fully_auto and overlap is None and config.backend == "uniep" and not config.replica_slots
      and config.precision == "bf16"):
    overlap = cand.overlap   # (the overlapped launches take no replica weights, run bf16)
  return dataclasses.replace(
      config,
      kernel=config.kernel if config.kernel is not None else cand.kernel,
      transfer=config.transfer if config.transfer is not None else cand.transfer,
      overlap=overlap)
