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
  out = jnp.full((out_rows, h), _garbage(garbage, src.dtype), src.dtype)
  return out.at[got_dst].set(got, mode="drop")


def _garbage(value, dtype):
  """What unwritten rows hold: `value` (NaN) for floats; for byte rows (the FP8
  dispatch's packed e4m3 rows and scales) all ones, e4m3 NaN and a NaN scale."""
  if jnp.issubdtype(dtype, jnp.integer):
    return jnp.asarray(jnp.iinfo(dtype).max, dtype)
  return jnp.asarray(value, dtype)


def gather_live_rows(src, index, live, *, out_rows, scale=None, garbage=jnp.nan, **_):
  """`row_gather.gather_live_rows`: rows past `live` hold garbage (the kernel leaves
  them unwritten); with `scale`, each row times its f32 scale, rounded once."""
  p = jnp.arange(out_rows)
  rows = jnp.take(src, jnp.pad(index, (0, out_rows - index.shape[0])), axis=0, mode="clip")
  if scale is not None:
    w = jnp.pad(scale, (0, out_rows - index.shape[0]))
    rows = (rows.astype(jnp.float32) * w[:, None]).astype(src.dtype)
  return jnp.where((p < live)[:, None], rows, _garbage(garbage, src.dtype))


def xla_experts(x, w_gate_up, w_down, group_sizes, *, kernel_config, zero_dead_rows=True,
                precision="bf16", x_quantised=None):
  """`experts.swiglu_pallas` with `lax.ragged_dot` (the same math; the Pallas grouped
  GEMM has its own bitwise tests): lets the layer's plumbing run at EP > 1 on the CPU.
  bf16 only (the FP8 FFN has its own tests, tests/test_fp8.py)."""
  if precision != "bf16" or x_quantised is not None:
    raise NotImplementedError(f"simulated experts with {precision=}")
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


# ---------------------------------------------------------------------------
# The grouped GEMM's launches (pallas_kernels/grouped_gemm.py) in XLA: `lax.ragged_dot`
# with the kernels' casts, and their row contract (rows past the groups' end up to the
# zero window come back zero, the rows after it are undefined: NaN here). Both the
# layer's plain path (`grouped_swiglu_ffn`, whose custom VJP calls these module
# functions) and the overlapped one call them, so the two can be compared bit for bit
# at EP > 1 on the CPU. F and H must need no padding (multiples of 256 at the default
# tiling): the simulations check it.
# ---------------------------------------------------------------------------
def _with_row_contract(out, group_sizes, zero_window):
  m = out.shape[0]
  total = jnp.sum(group_sizes)
  rows = jnp.arange(m)[:, None]
  out = jnp.where(rows < total, out, jnp.zeros((), out.dtype))
  if zero_window is None:
    return out
  defined = -(-total // zero_window) * zero_window
  return jnp.where(rows < defined, out, jnp.asarray(jnp.nan, out.dtype))


def _ragged(lhs, rhs, group_sizes):
  return jax.lax.ragged_dot(lhs, rhs, group_sizes.astype(jnp.int32),
                            preferred_element_type=jnp.float32)


def _unpadded(config, f=None, h=None):
  from pallas_kernels import grouped_gemm as gg
  if f is not None and gg._swiglu_padded_f(f, config) != f:
    raise ValueError(f"simulated grouped GEMM: F={f} would be padded; pick a multiple of 256")
  if h is not None and h % (2 * config.block_n):
    raise ValueError(f"simulated grouped GEMM: H={h} would be padded; pick a multiple of 256")


def gate_up_projection(x, w_gate_up, group_sizes, *, config, interpret=None, save_hu=True,
                       zero_window=None):
  f = w_gate_up.shape[2] // 2
  _unpadded(config, f=f)
  hu = _ragged(x, w_gate_up, group_sizes)
  h, u = hu[:, :f], hu[:, f:]
  outs = ((jax.nn.silu(h) * u).astype(x.dtype),) + ((h.astype(x.dtype), u.astype(x.dtype))
                                                    if save_hu else ())
  return tuple(_with_row_contract(o, group_sizes, zero_window) for o in outs)


def down_projection(a, w_down, group_sizes, *, config, interpret=None, zero_window=None):
  _unpadded(config, h=w_down.shape[2])
  return _with_row_contract(_ragged(a, w_down, group_sizes).astype(a.dtype), group_sizes,
                            zero_window)


def swiglu_dhu(x, w_down, group_sizes, h, u, dy, *, config, interpret=None, zero_window=None):
  from pallas_kernels.grouped_gemm import swiglu_grad
  m_p = h.shape[0]
  dy_p = jnp.pad(dy.astype(x.dtype), ((0, m_p - dy.shape[0]), (0, 0)))
  da = _ragged(dy_p, jnp.swapaxes(w_down, 1, 2), group_sizes)
  dh, du = swiglu_grad(da, h.astype(jnp.float32), u.astype(jnp.float32))
  return _with_row_contract(jnp.concatenate([dh, du], axis=1).astype(x.dtype), group_sizes,
                            zero_window)


def swiglu_dx_from_dhu(x, w_gate_up, group_sizes, dhu, *, config, interpret=None,
                       zero_window=None):
  m, h = x.shape
  _unpadded(config, h=h)
  dx = _ragged(dhu, jnp.swapaxes(w_gate_up, 1, 2), group_sizes).astype(x.dtype)
  return _with_row_contract(dx, group_sizes, zero_window)[:m]


def gmm_wgrad(lhs, dout, group_sizes, *, out_dtype=None, config=None, interpret=None):
  """drhs[g] = lhs[rows g]^T dout[rows g]; the kernel masks the lhs rows outside the
  groups (a select) and needs the dout rows there finite, which this checks."""
  m = lhs.shape[0]
  live = (jnp.arange(m) < jnp.sum(group_sizes))[:, None]
  lhs = jnp.where(live, lhs, jnp.zeros((), lhs.dtype))
  dout = jnp.where(live | jnp.isfinite(dout), dout, jnp.asarray(jnp.nan, dout.dtype))
  dims = jax.lax.RaggedDotDimensionNumbers(
      dot_dimension_numbers=(((0,), (0,)), ((), ())), lhs_ragged_dimensions=[0],
      rhs_group_dimensions=[])
  out = jax.lax.ragged_dot_general(lhs, jnp.where(live, dout, jnp.zeros((), dout.dtype)),
                                   group_sizes.astype(jnp.int32), dims,
                                   preferred_element_type=jnp.float32)
  return out.astype(out_dtype or lhs.dtype)


def swiglu_dw_down(a, dy, w_down, group_sizes, *, config, interpret=None, out_dtype=None):
  dy_p = jnp.pad(dy.astype(a.dtype), ((0, a.shape[0] - dy.shape[0]), (0, 0)))
  return gmm_wgrad(a, dy_p, group_sizes,
                   out_dtype=out_dtype or w_down.dtype)[:, :w_down.shape[1], :]


def down_gemm_return(a, w_down, group_sizes, seg_src, seg_dst, seg_len, *, out_rows, live_rows,
                     axis_name, kernel, transfer, chunk_rows, n_comm, zero_window=None):
  """`down_gemm_return`'s contract: the down GEMM's rows, and their return."""
  y = down_projection(a, w_down, group_sizes, config=kernel, zero_window=zero_window)
  back = globals()["transfer"](y[:, :w_down.shape[2]], seg_src, seg_dst, seg_len,
                               out_rows=out_rows, config=transfer, axis_name=axis_name,
                               garbage=jnp.nan)
  return y, back


def gmm_wgrad_with_return(lhs, dout, group_sizes, rows, seg_src, seg_dst, seg_len, *, out_rows,
                          axis_name, out_dtype=None, config, transfer, n_comm):
  """`gmm_wgrad_with_return`'s contract: the wgrad, and the return of `rows`."""
  back = globals()["transfer"](rows, seg_src, seg_dst, seg_len, out_rows=out_rows,
                               config=transfer, axis_name=axis_name, garbage=jnp.nan)
  return gmm_wgrad(lhs, dout, group_sizes, out_dtype=out_dtype), back


def patch_grouped_gemm(monkeypatch) -> None:
  """The grouped GEMM's launches and the two overlapped launches replaced by their XLA
  contracts (the layer's plumbing at EP > 1 on the CPU; the kernels themselves have their
  own tests in the interpret mode)."""
  import pallas_kernels.grouped_gemm as gg
  import uniep_jax.overlap as overlap
  for name in ("gate_up_projection", "down_projection", "swiglu_dhu", "swiglu_dx_from_dhu",
               "gmm_wgrad", "swiglu_dw_down"):
    monkeypatch.setattr(gg, name, globals()[name])
  monkeypatch.setattr(overlap, "down_gemm_return", down_gemm_return)
  monkeypatch.setattr(overlap, "gmm_wgrad_with_return", gmm_wgrad_with_return)
