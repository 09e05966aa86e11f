"""`UniEPConfig`: the MoE layer's configuration, and the backend registry.

One frozen dataclass, one `backend` value chosen from one registry (`BACKENDS`).
Routing options live in `RoutingConfig`. The parameter space of the Pallas backends is
three small configs, each owned by the code it tunes: `KernelConfig` (the grouped
GEMM's tiling, pallas_kernels/grouped_gemm.py), `TransferConfig` (the NVLink row
transfer, pallas_kernels/ep_transfer.py) and `OverlapConfig` (which transfers of
"uniep" run inside a GEMM's launch). Shape-free checks run in `__post_init__`;
shape-dependent checks run in `uniep_jax.validate` before anything is traced.
"""

from __future__ import annotations

import dataclasses
from typing import Optional

from pallas_kernels.ep_transfer import TransferConfig
from pallas_kernels.grouped_gemm import KernelConfig

# backend -> what it is (UniEPConfig's docstring has the details)
BACKENDS = {
    "xla_dropless": "sort-based dispatch over XLA collectives, lax.ragged_dot experts",
    "xla_capacity": "GShard: fixed capacity per expert, overflow dropped and counted",
    "dense_reference": "one device, float32, every expert on every token: the oracle",
    "pallas": "XLA collectives + the Pallas grouped GEMM",
    "uniep": "de-duplicated NVLink transfers from Pallas kernels + the Pallas grouped GEMM",
}
DROPLESS_BACKENDS = ("xla_dropless", "pallas", "uniep")
PALLAS_BACKENDS = ("pallas", "uniep")
PRECISIONS = ("bf16", "fp8")
SCORE_FUNCTIONS = ("softmax", "sigmoid")
# transport -> the backends it serves (uniep_jax/transport.py implements them)
TRANSPORTS = {
    "ragged": ("xla_dropless", "pallas"),
    "padded": ("xla_dropless", "pallas"),
    "local": ("xla_dropless", "pallas", "uniep"),
    "nvlink": ("uniep",),
}


@dataclasses.dataclass(frozen=True)
class RoutingConfig:
  """How tokens choose experts (uniep_jax/routing.py).

  score_fn: "softmax" (over all experts) or "sigmoid" (independent per expert).
  normalize_topk: renormalise the chosen top-k weights to sum to 1.
  scale: multiplies the final top-k weights (DeepSeek-V3 `routed_scaling_factor`).
  n_groups / topk_groups: group-limited routing (DeepSeek-V3). Experts are split into
    `n_groups` contiguous groups; a group's score is the sum of its best two expert
    scores (the best one if a group has one expert); only the `topk_groups` best groups
    are eligible. `n_groups=1` disables it.
  """

  score_fn: str = "softmax"
  normalize_topk: bool = True
  scale: float = 1.0
  n_groups: int = 1
  topk_groups: int = 1

  def __post_init__(self):
    if self.score_fn not in SCORE_FUNCTIONS:
      raise ValueError(f"score_fn={self.score_fn!r} is unknown; expected one of {SCORE_FUNCTIONS}")
    if not isinstance(self.n_groups, int) or self.n_groups < 1:
      raise ValueError(f"n_groups={self.n_groups} must be an int >= 1")
    if not isinstance(self.topk_groups, int) or not 1 <= self.topk_groups <= self.n_groups:
      raise ValueError(f"topk_groups={self.topk_groups} must be in [1, n_groups={self.n_groups}]")


@dataclasses.dataclass(frozen=True)
class OverlapConfig:
  """Transfers of backend "uniep" that run inside a GEMM's launch, on a few of its CTAs
  (uniep_jax/overlap.py). The bits never depend on it.

  down_return_ctas: > 0: the forward's down GEMM and the return of its output to the
    source ranks in one launch (pallas_kernels/down_gemm_return.py): this many CTAs
    push each finished chunk of `chunk_rows` rows back while the rest compute the next
    chunks. 0: the down GEMM, then the return.
  wgrad_return_ctas: > 0: the backward's return of dx to the source ranks on this many
    CTAs of the dw_gate_up wgrad's launch (pallas_kernels/wgrad_return.py). 0: the
    wgrad, then the return.
  chunk_rows: the unit of the down GEMM's return (a multiple of KernelConfig.block_m).
  The overlapped launches take every SM and spin on cross-rank semaphores, so all of
  their CTAs must be resident at once (pallas_kernels/SYNC.md): a collective that
  another stream runs beside them (gradient all-reduces overlapping the backward) can
  keep CTAs out. The training CLI therefore sums gradients after the backward pass when
  an overlap is on.
  """

  down_return_ctas: int = 16
  wgrad_return_ctas: int = 16
  chunk_rows: int = 2048

  def __post_init__(self):
    for name in ("down_return_ctas", "wgrad_return_ctas"):
      v = getattr(self, name)
      if not isinstance(v, int) or v < 0:
        raise ValueError(f"{name}={v!r} must be an int >= 0 (0: off)")
    if not self.down_return_ctas and not self.wgrad_return_ctas:
      raise ValueError("OverlapConfig with down_return_ctas=0 and wgrad_return_ctas=0 overlaps "
                       "nothing: use overlap=None")
    if not isinstance(self.chunk_rows, int) or self.chunk_rows < 1:
      raise ValueError(f"chunk_rows={self.chunk_rows!r} must be an int >= 1")


@dataclasses.dataclass(frozen=True)
class UniEPConfig:
  """Configuration of `uniep_jax.moe_ffn`.

  backend: one of `BACKENDS`:
    "xla_dropless"    sort-based dispatch ("ragged" or "padded" transport), `lax.ragged_dot`
                      experts, combine. Never drops.
    "xla_capacity"    GShard: each expert takes at most
                      ceil(capacity_factor * tokens * top_k / experts) assignments per
                      source shard; the overflow is dropped and counted in aux["dropped"].
    "dense_reference" single device, float32, every expert on every token: the oracle.
    "pallas"          the dropless dispatch over XLA collectives + the Pallas Mosaic GPU
                      grouped GEMM (pallas_kernels/grouped_gemm.py).
    "uniep"           Pallas kernels push each token once per owner rank over NVLink
                      straight into the owners' receive layout and the expert outputs
                      back, and the same grouped GEMM; bitwise equal to "pallas" by
                      construction (same layout, same GEMM). GPU only, one process.
  routing: see `RoutingConfig`.
  capacity_factor: "xla_capacity" only.
  receive_capacity_factor: the dropless backends size each rank's receive buffer for
    the worst case, R*T*K rows (every assignment of every rank to one rank;
    `receive_buffer_bytes` reports it). A factor f bounds it to min(R*T*K, ceil(f*T*K))
    rows, rounded up to a multiple of 128 (of 8 under 1024 rows); rows past the bound
    are dropped deterministically (the tail of the receive layout) and counted in
    aux["dropped"]. None: dropless.
  transport: how "xla_dropless" and "pallas" move rows between ranks: "ragged"
    (`lax.ragged_all_to_all`), "padded" (`lax.all_to_all` of per-peer worst-case
    buffers) or "local" (an expert axis of one rank: nothing moves). None picks
    "local" at one rank, "ragged" on GPUs driven by one process, "padded" elsewhere
    (uniep_jax/transport.py). "uniep" always uses "nvlink" ("local" at one rank, where
    it runs as "pallas"). Every transport lands every row at the same place.
  kernel: `KernelConfig`, the grouped GEMM's tiling ("pallas", "uniep"). None: auto,
    the tuned entry for this device and shape from the tune cache, else a heuristic
    (`uniep_jax.tuning.resolve_config`). A given config is used exactly as given.
  transfer: `TransferConfig`, the NVLink transfer's knobs ("uniep"). None: auto.
  overlap: `OverlapConfig` ("uniep"): transfers inside GEMM launches. None: every
    transfer and GEMM its own launch. With kernel and transfer both None, a tuned
    cache entry's overlap point is used too.
  replica_slots: exact-load balancing (the dropless backends; uniep_jax/balance.py):
    S > 0 gives every EP rank S replica slots, which per layer call take the weights
    of hot experts and a contiguous range of their rows, so that every rank computes
    the same number of rows under any routing (as far as S slots allow; aux["rank_rows"]
    shows what was reached). 0: off. At most the experts per rank. The output and dx
    do not change with it on "pallas" and "uniep" (bit for bit); weight gradients of
    replicated experts are summed at the owner in a fixed order. Off at one rank.
  precision: the expert GEMMs' operand format ("pallas", "uniep"). "bf16": x.dtype
    operands. "fp8": the four row GEMMs (gate/up, down and their dgrads) take e4m3
    operands with power-of-two block scales (1 x 128 for activations, 128 x 128 for
    weights) and accumulate in float32 (pallas_kernels/fp8_gemm.py); the weight
    gradients stay bf16 GEMMs; weights keep their dtype (quantised copies per call).
    Needs FP8 tensor cores (compute capability >= 8.9) on GPUs.
  """

  backend: str = "xla_dropless"
  routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
  capacity_factor: float = 1.25
  receive_capacity_factor: Optional[float] = None
  transport: Optional[str] = None
  kernel: Optional[KernelConfig] = dataclasses.field(default_factory=KernelConfig)
  transfer: Optional[TransferConfig] = dataclasses.field(default_factory=TransferConfig)
  overlap: Optional[OverlapConfig] = None
  replica_slots: int = 0
  precision: str = "bf16"

  def __post_init__(self):
    if self.backend not in BACKENDS:
      raise ValueError(f"backend={self.backend!r} is unknown; expected one of {tuple(BACKENDS)}")
    if not isinstance(self.routing, RoutingConfig):
      raise ValueError(f"routing must be a RoutingConfig, got {type(self.routing).__name__}")
    if not self.capacity_factor > 0:
      raise ValueError(f"capacity_factor={self.capacity_factor} must be > 0")
    if self.receive_capacity_factor is not None and not self.receive_capacity_factor > 0:
      raise ValueError(f"receive_capacity_factor={self.receive_capacity_factor} must be > 0 "
                       f"or None")
    if self.receive_capacity_factor is not None and self.backend not in DROPLESS_BACKENDS:
      raise ValueError(f"receive_capacity_factor bounds the dropless backends' receive buffer "
                       f"({DROPLESS_BACKENDS}), not backend={self.backend!r}")
    if self.transport is not None:
      if self.transport not in TRANSPORTS:
        raise ValueError(f"transport={self.transport!r} is unknown; expected one of "
                         f"{tuple(TRANSPORTS)} or None")
      if self.backend not in TRANSPORTS[self.transport]:
        raise ValueError(f"transport={self.transport!r} serves backends "
                         f"{TRANSPORTS[self.transport]}, not backend={self.backend!r}")
    if self.kernel is not None and not isinstance(self.kernel, KernelConfig):
      raise ValueError(f"kernel must be a KernelConfig or None (auto), "
                       f"got {type(self.kernel).__name__}")
    if self.transfer is not None and not isinstance(self.transfer, TransferConfig):
      raise ValueError(f"transfer must be a TransferConfig or None (auto), "
                       f"got {type(self.transfer).__name__}")
    if isinstance(self.replica_slots, bool) or not isinstance(self.replica_slots, int) \
        or self.replica_slots < 0:
      raise ValueError(f"replica_slots={self.replica_slots!r} must be an int >= 0 (0: off)")
    if self.replica_slots and self.backend not in DROPLESS_BACKENDS:
      raise ValueError(f"replica_slots={self.replica_slots} balances the dropless backends "
                       f"{DROPLESS_BACKENDS}, not backend={self.backend!r}")
    if self.precision not in PRECISIONS:
      raise ValueError(f"precision={self.precision!r} is unknown; expected one of {PRECISIONS}")
    if self.precision == "fp8" and self.backend not in PALLAS_BACKENDS:
      raise ValueError(f"precision='fp8' runs on the Pallas backends {PALLAS_BACKENDS}, not "
                       f"backend={self.backend!r}")
    if self.precision == "fp8" and self.overlap is not None:
      raise ValueError("precision='fp8' with overlap: the overlapped launches run the bf16 "
                       "kernels; set overlap=None")
    if self.overlap is not None:
      if not isinstance(self.overlap, OverlapConfig):
        raise ValueError(f"overlap must be an OverlapConfig or None, "
                         f"got {type(self.overlap).__name__}")
      if self.backend != "uniep":
        raise ValueError(f"overlap (transfers inside GEMM launches) is for backend 'uniep', "
                         f"got backend={self.backend!r}")
      if self.replica_slots:
        raise ValueError(f"replica_slots={self.replica_slots} with overlap: the overlapped "
                         f"launches take no replica weights; set overlap=None (replicas "
                         f"run with the plain 'uniep' launches)")

  def one_rank_form(self) -> "UniEPConfig":
    """This config where the expert axis has one rank (every expert local): nothing
    moves between ranks, so the rows reach the experts with the "local" transport (no
    collective, no copy), without the overlapped launches (whose roles move rows
    between GPUs) and without replicas (no other rank to share the rows); backend "uniep" becomes "pallas" (the same layout and grouped GEMM:
    the same bits). An explicit transport other than "local" is kept for
    "xla_dropless" and "pallas"."""
    if self.backend not in PALLAS_BACKENDS + ("xla_dropless",):
      return self
    if self.backend != "uniep" and self.transport not in (None, "local"):
      return self
    return dataclasses.replace(self, backend="pallas" if self.backend == "uniep" else self.backend,
                               transport="local", overlap=None, replica_slots=0)
