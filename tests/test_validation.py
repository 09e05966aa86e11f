"""Bad input raises a ValueError that names the argument."""

import jax
import jax.numpy as jnp
import pytest

import uniep_jax
from uniep_jax import UniEPConfig
from conftest import make_mesh
from moe_testlib import make_params, make_x

E, H, F = 8, 16, 24


@pytest.fixture(scope="module")
def setup():
  p = make_params(jax.random.key(0), experts=E, hidden=H, ffn=F)
  x = make_x(jax.random.key(1), 32, H)
  return x, p, make_mesh(2, 4)


def _call(x, p, mesh, top_k=2, config=UniEPConfig(), expert_axis="expert"):
  return uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=top_k, config=config, expert_axis=expert_axis)


@pytest.mark.parametrize("k", [0, -1, E + 1])
def test_top_k_out_of_range(setup, k):
  x, p, mesh = setup
  with pytest.raises(ValueError, match="top_k"):
    _call(x, p, mesh, top_k=k)


def test_experts_not_divisible_by_expert_axis(setup):
  x, _, _ = setup
  p = make_params(jax.random.key(0), experts=6, hidden=H, ffn=F)
  with pytest.raises(ValueError, match="expert_axis"):
    _call(x, p, make_mesh(2, 4))


def test_x_rank_and_hidden(setup):
  x, p, mesh = setup
  with pytest.raises(ValueError, match="x must be rank 2"):
    _call(x[None], p, mesh)
  with pytest.raises(ValueError, match="x hidden size"):
    _call(x[:, :-1], p, mesh)


def test_tokens_not_divisible_by_shards(setup):
  x, p, mesh = setup
  with pytest.raises(ValueError, match="token shards"):
    _call(x[:30], p, mesh)


def test_unknown_backend_and_score_fn():
  with pytest.raises(ValueError, match="backend"):
    UniEPConfig(backend="magic")
  with pytest.raises(ValueError, match="score_fn"):
    uniep_jax.RoutingConfig(score_fn="tanh")
  with pytest.raises(ValueError, match="transport"):
    UniEPConfig(transport="pigeon")
  # each transport serves the backends that move rows that way
  with pytest.raises(ValueError, match=r"transport='nvlink' serves backends \('uniep',\), not "
                                       r"backend='pallas'"):
    UniEPConfig(backend="pallas", transport="nvlink")
  with pytest.raises(ValueError, match="transport='padded' serves .* not backend='uniep'"):
    UniEPConfig(backend="uniep", transport="padded")
  with pytest.raises(ValueError, match="transport='ragged' serves .* not backend='xla_capacity'"):
    UniEPConfig(backend="xla_capacity", transport="ragged")
  with pytest.raises(ValueError, match="receive_capacity_factor bounds the dropless"):
    UniEPConfig(backend="xla_capacity", receive_capacity_factor=1.5)
  with pytest.raises(ValueError, match="routing must be a RoutingConfig"):
    UniEPConfig(routing="softmax")


def test_dtype_mismatch(setup):
  x, p, mesh = setup
  with pytest.raises(ValueError, match="w_gate_up dtype"):
    _call(x.astype(jnp.bfloat16), p, mesh)


def test_mesh_without_expert_axis(setup):
  x, p, _ = setup
  mesh = jax.make_mesh((8,), ("data",))
  with pytest.raises(ValueError, match="expert_axis='expert'"):
    _call(x, p, mesh)
  with pytest.raises(ValueError, match="expert_axis='experts'"):
    _call(x, p, make_mesh(2, 4), expert_axis="experts")


def test_weight_shape_mismatch(setup):
  x, p, mesh = setup
  with pytest.raises(ValueError, match="w_down"):
    _call(x, p.replace(w_down=p.w_down[:, :-1]), mesh)
  with pytest.raises(ValueError, match=r"w_gate_up shape .*: the last axis must be even"):
    _call(x, p.replace(w_gate_up=p.w_gate_up[..., :-1]), mesh)
  with pytest.raises(ValueError, match=r"w_down shape .* must be .*w_gate_up is"):
    _call(x, p.replace(w_gate_up=p.w_gate_up[..., :-2]), mesh)   # F - 1 vs w_down's F
  with pytest.raises(ValueError, match="router must be float32"):
    _call(x, p.replace(router=p.router.astype(jnp.bfloat16)), mesh)
  with pytest.raises(ValueError, match="mesh is required"):
    _call(x, p, None)


def test_uniep_backend_needs_gpus(setup):
  x, p, mesh = setup
  with pytest.raises(ValueError, match="needs GPUs"):
    _call(x, p, mesh, config=UniEPConfig(backend="uniep"))


def test_more_bad_inputs(setup):
  x, p, mesh = setup
  import numpy as np
  with pytest.raises(ValueError, match="x must be a floating-point"):
    _call(x.astype(jnp.int32), p.replace(w_gate_up=p.w_gate_up.astype(jnp.int32),
                                         w_down=p.w_down.astype(jnp.int32)), mesh)
  with pytest.raises(ValueError, match="expert_bias must be floating"):
    _call(x, p.replace(expert_bias=jnp.zeros(E, jnp.int32)), mesh)
  with pytest.raises(ValueError, match="top_k"):
    _call(x, p, mesh, top_k=2.5)
  y, _ = jax.jit(lambda x, p: _call(x, p, mesh, top_k=np.int64(2)))(x, p)   # numpy ints are fine
  assert y.shape == x.shape
  with pytest.raises(ValueError, match="transport='ragged'"):
    _call(x, p, mesh, config=UniEPConfig(transport="ragged"))
  with pytest.raises(ValueError, match="transport='nvlink'"):
    _call(x, p, mesh, config=UniEPConfig(backend="xla_dropless", transport="nvlink"))
  with pytest.raises(ValueError, match="block_k"):
    _call(x, p, mesh, config=UniEPConfig(backend="uniep",
                                         kernel=uniep_jax.KernelConfig(block_k=320)))
  with pytest.raises(ValueError, match="col_tile"):
    uniep_jax.TransferConfig(col_tile=12)


def test_ragged_transport_refused_across_processes(setup, monkeypatch):
  """Between processes lax.ragged_all_to_all hangs (NCCL fallback, jaxlib 0.11.2, 4x H200):
  asking for it there is an error, and the default picks the padded all_to_all."""
  from uniep_jax.transport import resolve_transport
  default = UniEPConfig(backend="pallas")
  assert resolve_transport(default, platform="gpu", ep=4) == "ragged"
  assert resolve_transport(default, platform="gpu", ep=4, process_count=4) == "padded"
  assert resolve_transport(default, platform="cpu", ep=4) == "padded"
  assert resolve_transport(default, platform="gpu", ep=1) == "local"
  assert resolve_transport(UniEPConfig(backend="uniep"), platform="gpu", ep=4) == "nvlink"
  assert resolve_transport(UniEPConfig(backend="uniep"), platform="gpu", ep=1) == "local"
  with pytest.raises(ValueError, match="backend='uniep' .* needs GPUs; the mesh holds cpu"):
    resolve_transport(UniEPConfig(backend="uniep"), platform="cpu", ep=4)
  with pytest.raises(ValueError, match="backend='uniep' .* unsupported in multi-process runs"):
    resolve_transport(UniEPConfig(backend="uniep"), platform="gpu", ep=4, process_count=2)
  x, p, mesh = setup
  monkeypatch.setattr(jax, "process_count", lambda: 2)
  with pytest.raises(ValueError, match=r"transport='ragged' hangs in multi-process runs \(2 processes\)"):
    _call(x, p, mesh, config=UniEPConfig(transport="ragged"))


def test_route_rejects_top_k_beyond_eligible_groups():
  cfg = uniep_jax.RoutingConfig(n_groups=4, topk_groups=1)
  x = jnp.ones((4, H))
  with pytest.raises(ValueError, match="eligible groups"):
    uniep_jax.route(x, jnp.ones((H, E)), 4, cfg)


def test_pallas_backends_need_16bit_operands_on_gpu():
  from uniep_jax.validate import check_kernel_dtypes
  p32 = make_params(jax.random.key(0), experts=8, hidden=16, ffn=32)
  x32 = make_x(jax.random.key(1), 8, 16)
  p16 = jax.tree.map(lambda a: a.astype(jnp.bfloat16), p32)
  for backend in ("pallas", "uniep"):
    with pytest.raises(ValueError, match=r"bfloat16 or float16 operands: x is float32, params.w_gate_up is float32"):
      check_kernel_dtypes(backend, "gpu", x32, p32)
    with pytest.raises(ValueError, match=r"^(?!.*x is).*params.w_down is float32"):
      check_kernel_dtypes(backend, "gpu", x32.astype(jnp.bfloat16), p32)
    check_kernel_dtypes(backend, "gpu", x32.astype(jnp.bfloat16), p16)   # fine
    check_kernel_dtypes(backend, "cpu", x32, p32)   # the interpret mode takes float32
  check_kernel_dtypes("xla_dropless", "gpu", x32, p32)


def test_uniep_refuses_rows_its_transfer_cannot_move_on_gpus():
  """The NVLink transfer's TMA boxes need rows of a multiple of 256 bytes on a GPU (rows
  of 16-64 bf16 elements faulted there): "uniep" refuses smaller or odd hidden sizes
  before tracing and names "pallas", which runs them (its row copies fall back to XLA's
  gather); the kernels refuse them too when compiled."""
  import pallas_kernels.row_gather as rg
  from uniep_jax.validate import check_kernel_inputs
  uniep = UniEPConfig(backend="uniep")
  for hidden, ok in ((24, False), (64, False), (136, False), (128, True), (2048, True)):
    p = make_params(jax.random.key(0), experts=8, hidden=hidden, ffn=32, dtype=jnp.bfloat16)
    x = make_x(jax.random.key(1), 8, hidden, jnp.bfloat16)
    if ok:
      check_kernel_inputs(uniep, "gpu", "nvlink", x, p)
    else:
      with pytest.raises(ValueError, match=rf"backend='uniep' moves rows of hidden={hidden} .*"
                                           r"multiple of 256 bytes.*use backend 'pallas'"):
        check_kernel_inputs(uniep, "gpu", "nvlink", x, p)
    check_kernel_inputs(UniEPConfig(backend="pallas"), "gpu", "ragged", x, p)   # any hidden
    check_kernel_inputs(uniep, "gpu", "local", x, p)   # one rank: runs as pallas
  from pallas_kernels import device as device_lib
  with device_lib.lowering_for_gpu(), pytest.raises(ValueError, match="multiple of 256 B"):
    rg.gather_live_rows(jnp.zeros((8, 24), jnp.bfloat16), jnp.arange(8), jnp.int32(8), out_rows=8)


def test_overlap_config_only_for_uniep():
  overlap = uniep_jax.OverlapConfig()
  assert (overlap.down_return_ctas, overlap.wgrad_return_ctas, overlap.chunk_rows) == (16, 16, 2048)
  assert UniEPConfig(backend="uniep", overlap=overlap).overlap == overlap
  for backend in ("pallas", "xla_dropless", "xla_capacity"):
    with pytest.raises(ValueError, match=r"overlap .* is for backend 'uniep'"):
      UniEPConfig(backend=backend, overlap=overlap)
  with pytest.raises(ValueError, match="overlap must be an OverlapConfig"):
    UniEPConfig(backend="uniep", overlap=(16, 16))
  with pytest.raises(ValueError, match="down_return_ctas=-1 must be an int >= 0"):
    uniep_jax.OverlapConfig(down_return_ctas=-1)
  with pytest.raises(ValueError, match="overlaps nothing: use overlap=None"):
    uniep_jax.OverlapConfig(down_return_ctas=0, wgrad_return_ctas=0)
  with pytest.raises(ValueError, match="chunk_rows=0 must be an int >= 1"):
    uniep_jax.OverlapConfig(chunk_rows=0)
  # one rank on the expert axis: nothing moves, no overlapped launch
  one = UniEPConfig(backend="uniep", overlap=overlap).one_rank_form()
  assert (one.backend, one.transport, one.overlap) == ("pallas", "local", None)
