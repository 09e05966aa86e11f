"""Input checks of `moe_ffn`: every bad input gets a ValueError naming the argument, before
anything is traced or compiled."""

from __future__ import annotations

import math
import operator

import jax.numpy as jnp

from pallas_kernels import fp8_gemm
from pallas_kernels.row_gather import ROW_ALIGN_BYTES
from uniep_jax.config import BACKENDS, PALLAS_BACKENDS, TransferConfig, UniEPConfig
from uniep_jax.params import MoEParams
from uniep_jax.transport import ZERO_WINDOW_ROWS


def validate_inputs(x, params: MoEParams, *, top_k, config: UniEPConfig,
                    expert_axis: str | None = None, mesh=None):
  """Checks x [N, H], params and top_k against each other, config and the mesh."""
  if not isinstance(config, UniEPConfig):
    raise ValueError(f"config must be a UniEPConfig, got {type(config).__name__}")
  if config.backend not in BACKENDS:
    raise ValueError(f"config.backend={config.backend!r} is unknown; expected one of "
                     f"{tuple(BACKENDS)}")
  if not isinstance(params, MoEParams):
    raise ValueError(f"params must be a uniep_jax.MoEParams, got {type(params).__name__}")
  if x.ndim != 2:
    raise ValueError(f"x must be rank 2 [tokens, hidden], got shape {x.shape}")
  if x.shape[0] == 0:
    raise ValueError("x has 0 tokens: the layer needs at least one token per shard")
  if not jnp.issubdtype(x.dtype, jnp.floating):
    raise ValueError(f"x must be a floating-point array, got dtype {x.dtype}")
  if params.router.ndim != 2:
    raise ValueError(f"params.router must be [hidden, experts], got shape {params.router.shape}")
  hidden, num_experts = params.router.shape
  if x.shape[1] != hidden:
    raise ValueError(f"x hidden size {x.shape[1]} does not match params.router hidden size {hidden}")
  if params.router.dtype != jnp.float32:
    raise ValueError(f"params.router must be float32, got {params.router.dtype}")
  for name in ("w_gate_up", "w_down"):
    w = getattr(params, name)
    if w.ndim != 3:
      raise ValueError(f"params.{name} must be rank 3, got shape {w.shape}")
    if w.dtype != x.dtype:
      raise ValueError(f"params.{name} dtype {w.dtype} differs from x dtype {x.dtype}")
  e, h, two_f = params.w_gate_up.shape
  if two_f % 2:
    raise ValueError(f"params.w_gate_up shape {params.w_gate_up.shape}: the last axis must be "
                     f"even, [w_gate | w_up] of F columns each")
  f = two_f // 2
  if params.w_down.shape != (e, f, h):
    raise ValueError(f"params.w_down shape {params.w_down.shape} must be {(e, f, h)} "
                     f"(params.w_gate_up is {params.w_gate_up.shape} = [E, H, 2F])")
  if e != num_experts or h != hidden:
    raise ValueError(f"params.w_gate_up shape {params.w_gate_up.shape} does not match "
                     f"params.router [hidden={hidden}, experts={num_experts}]")
  if params.expert_bias is not None and params.expert_bias.shape != (num_experts,):
    raise ValueError(f"params.expert_bias must have shape ({num_experts},), got {params.expert_bias.shape}")
  if params.expert_bias is not None and not jnp.issubdtype(params.expert_bias.dtype, jnp.floating):
    raise ValueError(f"params.expert_bias must be floating point, got {params.expert_bias.dtype}")
  try:
    top_k = operator.index(top_k)
  except TypeError:
    raise ValueError(f"top_k={top_k!r} must be an integer") from None
  if not 1 <= top_k <= num_experts:
    raise ValueError(f"top_k={top_k} must be an int in [1, num_experts={num_experts}]")
  if (config.backend == "uniep" and config.kernel is not None
      and config.kernel.block_k > ZERO_WINDOW_ROWS):
    raise ValueError(f"config.kernel.block_k={config.kernel.block_k} exceeds the "
                     f"{ZERO_WINDOW_ROWS} zeroed rows after the live ones that the NVLink "
                     f"transport guarantees (the wgrad reads up to block_k - 1 rows past a group)")
  if config.routing.n_groups > 1:
    if num_experts % config.routing.n_groups:
      raise ValueError(f"config.routing.n_groups={config.routing.n_groups} must divide "
                       f"num_experts={num_experts}")
    eligible = config.routing.topk_groups * (num_experts // config.routing.n_groups)
    if top_k > eligible:
      raise ValueError(f"top_k={top_k} exceeds the experts of the topk_groups="
                       f"{config.routing.topk_groups} eligible groups ({eligible})")
  if mesh is not None:
    if expert_axis not in mesh.axis_names:
      raise ValueError(f"mesh axes {tuple(mesh.axis_names)} lack expert_axis={expert_axis!r}")
    ep = mesh.shape[expert_axis]
    if num_experts % ep:
      raise ValueError(f"num_experts={num_experts} is not divisible by the size of "
                       f"expert_axis {expert_axis!r} ({ep})")
    check_replica_slots(config.replica_slots, num_experts, ep)
    shards = math.prod(mesh.shape.values())
    if x.shape[0] % shards:
      raise ValueError(f"x has {x.shape[0]} tokens, not divisible by the {shards} token shards "
                       f"of mesh {dict(mesh.shape)}")


def check_replica_slots(replica_slots: int, num_experts: int, ep: int) -> None:
  """A rank holds at most as many replica slots as it has experts (more would only ever
  hold pieces of experts it could already take)."""
  if ep > 1 and replica_slots > num_experts // ep:
    raise ValueError(f"config.replica_slots={replica_slots} exceeds the {num_experts // ep} "
                     f"experts per rank (num_experts={num_experts} over {ep} ranks)")


def check_kernel_inputs(config: UniEPConfig, platform: str, transport: str, x,
                        params: MoEParams) -> None:
  """What the Pallas backends' GPU kernels need of the inputs, checked before tracing:
  16-bit operands (wgmma), and for the NVLink transport rows whose TMA boxes meet the
  row alignment (`TransferConfig.rows_fit`: a hidden size of a multiple of 128 16-bit
  elements; smaller rows fault on the GPU). "pallas" runs any hidden size (its row
  copies fall back to XLA's gather where the kernel's alignment does not hold)."""
  backend = config.backend
  if backend not in PALLAS_BACKENDS or platform != "gpu":
    return
  check_kernel_dtypes(backend, platform, x, params)
  if config.precision == "fp8":
    check_fp8_hardware(backend)
  transfer = config.transfer or TransferConfig()
  if transport == "nvlink" and config.replica_slots:
    # replica weights move as rows of 2F (gate/up) and H (down) elements
    two_f = params.w_gate_up.shape[2]
    if not transfer.rows_fit(two_f, jnp.dtype(x.dtype).itemsize):
      raise ValueError(f"config.replica_slots={config.replica_slots} on backend 'uniep' moves "
                       f"gate/up weights as rows of 2F={two_f} elements, which the TMA boxes "
                       f"cannot hold (rows of a multiple of {ROW_ALIGN_BYTES} bytes); use "
                       f"backend 'pallas'")
  if transport == "nvlink" and not transfer.rows_fit(x.shape[1], jnp.dtype(x.dtype).itemsize):
    raise ValueError(f"backend='uniep' moves rows of hidden={x.shape[1]} {jnp.dtype(x.dtype)} "
                     f"elements with TMA boxes that need rows (and column tiles) of a multiple "
                     f"of {ROW_ALIGN_BYTES} bytes on GPUs (a hidden size of a multiple of "
                     f"{ROW_ALIGN_BYTES // jnp.dtype(x.dtype).itemsize}); use backend 'pallas' "
                     f"(the same bits over XLA collectives)")


def check_fp8_hardware(backend: str, device=None) -> None:
  """precision='fp8' needs e4m3 tensor cores: compute capability 8.9 (Ada) or newer."""
  try:
    fp8_gemm.check_fp8_hardware(device)
  except ValueError as e:
    raise ValueError(f"precision='fp8' on backend={backend!r}: {e}") from None


def check_kernel_dtypes(backend: str, platform: str, x, params: MoEParams) -> None:
  """The Pallas backends' GPU kernels (wgmma) take 16-bit operands: a clear error before
  tracing instead of Mosaic's "Only f16 WGMMA supports transposes" from the backward."""
  if backend not in PALLAS_BACKENDS or platform != "gpu":
    return
  wide = [f"{name} is {jnp.dtype(a.dtype)}" for name, a in
          (("x", x), ("params.w_gate_up", params.w_gate_up), ("params.w_down", params.w_down))
          if jnp.dtype(a.dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))]
  if wide:
    raise ValueError(f"backend={backend!r} runs 16-bit wgmma kernels on GPUs, which take "
                     f"bfloat16 or float16 operands: {', '.join(wide)}; cast them, or use "
                     f"backend 'xla_dropless' for float32")
