"""The communicating kernels' contracts in plain JAX, for the CPU tests of the "uniep"
path's XLA side (plans, segment tables, zeroed windows, receive bounds, the custom VJPs).

The NVLink kernels cannot run on the CPU (remote refs and semaphores fail in the
interpret mode), so the tests replace them by these simulations of what they promise
(`monkeypatch.setattr` on the kernel modules' attributes, which the layer looks up at
call time) and check the layer bit for bit against the padded XLA transport. Rows a
kernel leaves unwritten hold garbage here (a large finite value or NaN), so plumbing
that reads them changes the result.
"""

import jax
import jax.numpy as jnp
from jax.sharding import NamedSharding, PartitionSpec as P

import uniep_jax
from conftest import make_mesh
from moe_testlib import make_params, make_x


def transfer(src, seg_src, seg_dst, seg_len, *, out_rows, config, axis_name, rank=0,
             src_index=None, interpret=None, garbage=1e4):
  """`ep_transfer.transfer_segments`: row p's segments of `src` (of src[src_index] when
  given) land in rank p's output; rows no segment covers hold garbage."""
  if src_index is not None:
    src = jnp.take(src, src_index, axis=0)
  r, el = seg_len.shape
  ns, h = src.shape
  i = jnp.arange(ns, dtype=jnp.int32)
  ends = jnp.cumsum(seg_len, axis=1)                                  # [R, El]

  def rows_for(p):
    seg = jnp.searchsorted(ends[p], i, side="right")
    valid = seg < el
    seg = jnp.minimum(seg, el - 1)
    within = i - (ends[p] - seg_len[p])[seg]
    src_row = jnp.clip(seg_src[p][seg] + within, 0, ns - 1)
    dst_row = jnp.where(valid, seg_dst[p][seg] + within, out_rows)   # out of range: dropped
    return jnp.where(valid[:, None], src[src_row], 0), dst_row

  bufs, dsts = jax.vmap(rows_for)(jnp.arange(r))                      # [R, ns, H], [R, ns]
  got = jax.lax.all_to_all(bufs, axis_name, 0, 0, tiled=True).reshape(r * ns, h)
  got_dst = jax.lax.all_to_all(dsts, axis_name, 0, 0, tiled=True).reshape(r * ns)
  out = jnp.full((out_rows, h), garbage, src.dtype)
  return out.at[got_dst].set(got, mode="drop")


def gather_live_rows(src, index, live, *, out_rows, scale=None, garbage=jnp.nan, **_):
  """`row_gather.gather_live_rows`: rows past `live` hold garbage (the kernel leaves
  them unwritten); with `scale`, each row times its f32 scale, rounded once."""
  p = jnp.arange(out_rows)
  rows = jnp.take(src, jnp.pad(index, (0, out_rows - index.shape[0])), axis=0, mode="clip")
  if scale is not None:
    w = jnp.pad(scale, (0, out_rows - index.shape[0]))
    rows = (rows.astype(jnp.float32) * w[:, None]).astype(src.dtype)
  return jnp.where((p < live)[:, None], rows, jnp.asarray(garbage, src.dtype))


def xla_experts(x, w_gate_up, w_down, group_sizes, *, kernel_config, zero_dead_rows=True):
  """`experts.swiglu_pallas` with `lax.ragged_dot` (the same math; the Pallas grouped
  GEMM has its own bitwise tests): lets the layer's plumbing run at EP > 1 on the CPU."""
  from uniep_jax.experts import swiglu_ragged_dot
  return swiglu_ragged_dot(x, w_gate_up, w_down, group_sizes)


def patch_nvlink(monkeypatch) -> None:
  """The NVLink transfer and the live-rows copy replaced by their contracts, the Pallas
  experts by `xla_experts`."""
  import pallas_kernels.ep_transfer as ep
  import pallas_kernels.row_gather as rg
  import uniep_jax.moe as moe
  monkeypatch.setattr(ep, "transfer_segments", transfer)
  monkeypatch.setattr(rg, "gather_live_rows", gather_live_rows)
  monkeypatch.setattr(moe, "swiglu_pallas", xla_experts)


def layer_runner(seed: int, *, data=1, ep=4, experts=8, hidden=32, ffn=48, top_k=3,
                 tokens=64, bias=None, dtype=jnp.bfloat16):
  """run(config, transport=None) -> ((y, dropped), gradients of x and the params) of
  `moe_ffn_shard` on a data x ep mesh: one program per call, its loss sum(sin(y)).
  bfloat16 by default, the kernels' dtype: with float32 activations XLA on the CPU
  recomputes the f32 top-k sum y inside the loss's backward fusions, differently
  contracted in two programs, so dy itself may differ by an ulp before any dispatch."""
  mesh = make_mesh(data, ep)
  axes = ("data", "expert")
  kx, kp = jax.random.split(jax.random.key(seed))
  p = make_params(kp, experts=experts, hidden=hidden, ffn=ffn, dtype=dtype, bias=bias)
  x = make_x(kx, tokens, hidden, dtype)
  specs = uniep_jax.param_specs(p)
  x = jax.device_put(x, NamedSharding(mesh, P(axes)))
  p = jax.tree.map(lambda a, s: jax.device_put(a, NamedSharding(mesh, s)), p, specs)

  def run(cfg, transport=None):
    def body(xl, pl):
      y, aux = uniep_jax.moe_ffn_shard(xl, pl, top_k=top_k, config=cfg, token_axes=axes,
                                       transport=transport)
      return y, aux["dropped"]

    fn = jax.shard_map(body, mesh=mesh, in_specs=(P(axes), specs), out_specs=(P(axes), P()),
                       check_vma=False)

    def loss(x, p):   # the outputs ride along as aux: one program
      y, dropped = fn(x, p)
      return jnp.sum(jnp.sin(y.astype(jnp.float32))), (y, dropped)

    g, out = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(x, p)
    return out, g

  return run
