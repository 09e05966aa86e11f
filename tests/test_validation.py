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
  with pytest.raises(ValueError, match="swiglu_grad_in_kernel.*backend='xla_dropless'"):
    UniEPConfig(backend="xla_dropless", swiglu_grad_in_kernel=True)
  with pytest.raises(ValueError, match="swiglu_grad_in_kernel must be None, True or False"):
    UniEPConfig(backend="uniep", swiglu_grad_in_kernel="yes")
  # None (the default): on for the Pallas backends, off for the XLA ones
  assert UniEPConfig(backend="pallas").use_swiglu_grad_in_kernel
  assert UniEPConfig(backend="uniep").use_swiglu_grad_in_kernel
  assert not UniEPConfig(backend="uniep", swiglu_grad_in_kernel=False).use_swiglu_grad_in_kernel
  assert not UniEPConfig(backend="xla_capacity").use_swiglu_grad_in_kernel


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
  """Between processes lax.ragged_all_to_all hung (NCCL fallback, jaxlib 0.11.2, 4x H200):
  asking for it there is an error, and the default picks the padded all_to_all."""
  from uniep_jax.dispatch import default_transport
  assert default_transport("gpu") == "ragged"
  assert default_transport("gpu", process_count=4) == "padded"
  assert default_transport("cpu") == "padded"
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
  from uniep_jax.moe import check_kernel_dtypes
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


def test_fused_config_only_for_uniep():
  fused = uniep_jax.FusedConfig(n_comm=8, recv_chunk_rows=256)
  assert UniEPConfig(backend="uniep", fused=fused).fused == fused
  for backend in ("pallas", "xla_dropless", "xla_capacity"):
    with pytest.raises(ValueError, match=r"fused .* only for backend='uniep'"):
      UniEPConfig(backend=backend, fused=fused)
  with pytest.raises(ValueError, match="fused must be a FusedConfig"):
    UniEPConfig(backend="uniep", fused=(8, 256))
  with pytest.raises(ValueError, match="n_comm=0 must be >= 1"):
    uniep_jax.FusedConfig(n_comm=0)
  # the fused backward's GEMM is the da launch with the dswiglu epilogue
  bwd = uniep_jax.FusedConfig(backward=True)
  assert UniEPConfig(backend="uniep", fused=bwd).use_swiglu_grad_in_kernel
  with pytest.raises(ValueError, match="fused.backward .* needs swiglu_grad_in_kernel"):
    UniEPConfig(backend="uniep", fused=bwd, swiglu_grad_in_kernel=False)
  # the forward's dispatch de-duplicated outside the fused launches needs the unique plan
  unique = uniep_jax.FusedConfig(dispatch_in_kernel=False, return_in_kernel=False,
                                 down_return_ctas=16)
  assert UniEPConfig(backend="uniep", fused=unique).use_dedup_tokens
  with pytest.raises(ValueError, match="dispatch_in_kernel=False .* needs dedup_tokens"):
    UniEPConfig(backend="uniep", fused=unique, dedup_tokens=False)
  with pytest.raises(ValueError, match="dispatch_in_kernel=False .* set backward=False"):
    uniep_jax.FusedConfig(dispatch_in_kernel=False, backward=True)
  with pytest.raises(ValueError, match="dispatch_in_kernel must be True or False"):
    uniep_jax.FusedConfig(dispatch_in_kernel=0)
