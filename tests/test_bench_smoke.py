"""The GPU scripts of bench/ on tiny CPU shapes: a script that breaks here would
waste a device call (one did: train_throughput --det-only on 2026-11-26)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import moe_layer, train_step_diff, train_throughput


def test_moe_layer_rejects_a_bad_backend_before_running_any(tmp_path, monkeypatch):
  """A bad suffix combination (owner_partials is not built into the fused kernels) fails
  before the first backend compiles (on 4x H200 it failed after three had run)."""
  monkeypatch.setattr(moe_layer.common, "dense_matmul_tflops",
                      lambda: pytest.fail("ran before the backends were checked"))
  with pytest.raises(ValueError, match="slot_reduction"):
    moe_layer.main(["--shapes", "tiny", "--backends", "xla_capacity,uniep_dc_rbw_dd@op",
                    "--out", str(tmp_path)])
  assert not list(tmp_path.iterdir())
  # @gx / @sb: the transfer's gathered loads (the default) or the send buffer
  assert moe_layer.backend_config("uniep_dd@sb").transfer.gather_rows is False
  assert moe_layer.backend_config("uniep_dd@sb@gx").transfer.gather_rows is True
  assert moe_layer.backend_config("uniep_dd@tel").transfer.expand_last_on_all is True
  assert moe_layer.backend_config("uniep_dc_rbw_dd@bt").kernel.group_aligned_tiles is False
  assert moe_layer.backend_config("uniep_dc_rbw_dd@bt@ga").kernel.group_aligned_tiles is True
  assert moe_layer.backend_config("uniep_dd@wr1").kernel.wgrad_raster == 1
  assert moe_layer.backend_config("uniep_dd@rr4@wr8").kernel.raster_rows == 4
  assert moe_layer.backend_config("uniep_dd@rr4@wr8").kernel.wgrad_raster == 8
  assert moe_layer.backend_config("uniep_dd@inflight1").kernel.mma_in_flight == 1
  assert moe_layer.backend_config("uniep_dd@inflight1@inflight0").kernel.mma_in_flight == 0
  # @ctas / @dr / @wrc: the v1 transfers' CTAs, the fused points' return CTAs
  cfg = moe_layer.backend_config("uniep_dc_rbw_dd@dr32@wrc24@ctas96")
  assert (cfg.fused.down_return_ctas, cfg.fused.wgrad_return_ctas) == (32, 24)
  assert cfg.transfer.num_ctas == 96
  with pytest.raises(ValueError, match="no fused config"):
    moe_layer.backend_config("uniep_dd@dr32")
  # Kernel D's knobs, and a field of UniEPConfig itself (@sg)
  cfg = moe_layer.backend_config("uniep_dc_rbw_dd_ov@ov24@ovb0@ovs3@sg4")
  assert (cfg.fused.overlap_copy_ctas, cfg.fused.overlap_copy_ctas_bwd,
          cfg.fused.overlap_copy_stages, cfg.dedup_send_groups) == (24, 0, 3, 4)
  assert moe_layer.backend_config("uniep_dc_rbw_dd@te@tes3").transfer.copy_stages == 3
  assert moe_layer.backend_config("uniep_dc_rbw_dd_ov@ovj40").fused.overlap_join_percent == 40


def test_moe_layer_compiled_ahead_gives_the_same_bits(tmp_path):
  """--compile-workers 2: every program of a shape compiled ahead, then timed; the same
  checksums as compiled at the first call, and the skewed routing reuses the
  executable."""
  def run(workers, out):
    moe_layer.main(["--shapes", "tiny", "--backends", "xla_dropless_padded",
                    "--directions", "fwd", "--routings", "balanced,skewed",
                    "--out", str(out), "--min-batch-s", "0.01", "--max-reps", "1",
                    "--compile-workers", str(workers)])
    (path,) = [q for q in out.glob("moe_layer_*_ep*.json") if ".partial" not in q.name]
    return json.loads(path.read_text())["results"]
  serial, ahead = run(1, tmp_path / "serial"), run(2, tmp_path / "ahead")
  assert [r["checksum"] for r in ahead] == [r["checksum"] for r in serial]
  assert [r.get("compiled_ahead", False) for r in ahead] == [True, False]
  assert [r["executable_reused"] for r in ahead] == [False, True]
  with pytest.raises(ValueError, match="compile-workers"):
    moe_layer.main(["--shapes", "tiny", "--compile-workers", "0", "--out", str(tmp_path)])


def test_compile_ahead_compiles_the_xla_backends_first_and_alone():
  """The xla_* programs are lowered and compiled before any other is submitted (their
  GEMM autotuning on an idle GPU); the others in the pool; every result runs as the
  jitted function does."""
  import threading
  traced = []

  def make(name, scale):
    def f(x, p):
      traced.append((name, threading.current_thread().name.startswith("moe-layer-compile")))
      return x * scale + p
    return jax.jit(f)

  fns = {"other": (make("other/fwd", 2.0), make("other/fwdbwd", 3.0)),
         "xla_a": (make("xla_a/fwd", 4.0), make("xla_a/fwdbwd", 5.0))}
  pairs = [(b, d) for b in fns for d in ("fwd", "fwdbwd")]
  x, p = jnp.arange(4.0), jnp.float32(1.0)
  got = moe_layer.compile_ahead(fns, pairs, x, p, workers=2)
  # the xla_* ones first, on this thread; the others in the pool's threads
  assert sorted(traced[:2]) == [("xla_a/fwd", False), ("xla_a/fwdbwd", False)]
  assert sorted(traced[2:]) == [("other/fwd", True), ("other/fwdbwd", True)]
  for (b, d), future in got.items():
    compiled, seconds = future.result()
    assert seconds >= 0
    np.testing.assert_array_equal(compiled(x, p), fns[b][d != "fwd"](x, p))


def test_moe_layer_records_times_and_checksums(tmp_path):
  moe_layer.main(["--shapes", "tiny", "--backends", "xla_capacity,xla_dropless_padded",
                  "--directions", "fwd", "--routings", "balanced,skewed", "--out", str(tmp_path),
                  "--min-batch-s", "0.01", "--max-reps", "2"])
  (path,) = [p for p in tmp_path.glob("moe_layer_*_ep*.json") if ".partial" not in p.name]
  all_rows = json.loads(path.read_text())["results"]
  rows = [r for r in all_rows if r["routing"] == "balanced"]
  skewed = {r["backend"]: r for r in all_rows if r["routing"] == "skewed"}
  assert {r["backend"] for r in rows} == {"xla_capacity", "xla_dropless_padded"} == set(skewed)
  for r in all_rows:
    assert r["median_ms"] > 0 and len(r["checksum"]) == 2 and "error" not in r
    # both backends of a case timed again, interleaved round robin
    assert r["interleaved_median_ms"] > 0 and r["interleaved_min_ms"] <= r["interleaved_median_ms"]
    assert r["short_batch_median_ms"] > 0 and r["reps"] <= 2
    # the skewed routing runs the executable the balanced one compiled, on other data
    assert r["executable_reused"] == (r["routing"] == "skewed")
  for r in all_rows:   # every assignment counted once in the [src][dst] rows
    assert sum(map(sum, r["rank_rows"])) == 8 * 256 * 2 and len(r["rank_rows"]) == 8
    assert r["hot_rank_compute_floor_ms"] >= r["compute_floor_ms"]   # max >= mean
  for r in rows:
    assert skewed[r["backend"]]["checksum"] != r["checksum"]
    # expert 0 (rank 0) is in every token's top 2: rank 0 gets 8*256 + its share of the rest
    hot = skewed[r["backend"]]
    assert 8 * 256 <= max(sum(hot["rank_rows"][s][d] for s in range(8)) for d in range(8))
    assert hot["hot_rank_compute_floor_ms"] > 1.5 * hot["compute_floor_ms"]
    assert hot["x_over_hot_rank_floor"] < hot["x_over_floor"]
  # expert 0 takes every token: the capacity backend drops more than when balanced
  cap, free = sorted(rows, key=lambda r: r["backend"] != "xla_capacity")
  assert skewed["xla_capacity"]["dropped"] > cap["dropped"] and skewed["xla_dropless_padded"]["dropped"] == 0
  assert free["dropped"] == 0 and cap["dropped"] > 0     # 8 ranks of 256 tokens overflow
  assert cap["checksum"] != free["checksum"] and cap["bitwise_equal_to"] == []


@pytest.mark.parametrize("grad_reduction", ["xla", "ordered"])
def test_train_step_diff_compares_every_leaf(tmp_path, grad_reduction):
  # --layers 1 (the script's default; 0 took tiny's own 4 layers): every leaf of the
  # model is still compared, at half the compile time (each backend compiles its step).
  # --grad-reduction only changes how each backend's step is built (_one_backend); the
  # pair comparison after it is the same code on the same per-leaf dicts, so "ordered"
  # runs one backend (each compiles its step: one fewer) and checks that backend's
  # run-to-run comparison covers every leaf; "xla" checks the pair's
  backends = ("xla_dropless", "xla_capacity") if grad_reduction == "xla" else ("xla_dropless",)
  train_step_diff.main(["--model", "tiny", "--layers", "1", "--mesh", "data=2,expert=4",
                        "--backends", ",".join(backends), "--batch", "8", "--seq", "32",
                        "--grad-reduction", grad_reduction, "--tag", "smoke", "--out", str(tmp_path)])
  report = json.loads(next(tmp_path.glob("train_step_diff_*_smoke.json")).read_text())
  for backend in backends:
    assert report["backends"][backend]["repeatable"] and report["backends"][backend]["same_init"]
    assert set(report["backends"][backend]["repeat_grads"]) >= {"embed", "layers.0.ffn.w_gate_up"}
  if grad_reduction == "xla":
    pair = report["pairs"]["xla_dropless_vs_xla_capacity"]
    assert set(pair["grads"]) >= {"embed", "layers.0.ffn.w_gate_up"}


def test_compare_reports_bits_and_size():
  a = dict(x=np.array([1.0, 2.0], np.float32))
  assert train_step_diff.compare(a, a)["x"] == dict(bitwise=True, max_abs_diff=0.0,
                                                    max_rel_diff=0.0)
  b = dict(x=np.array([1.0, 2.5], np.float32))
  assert train_step_diff.compare(a, b)["x"]["max_rel_diff"] == pytest.approx(0.25)


def test_throughput_variants_are_registered_and_sized():
  from models.config import get_config
  name = train_throughput._register_variant("deepseek-like", 1, 64)
  c = get_config(name)
  assert name == "deepseek-like-L1-E64" and (c.n_layers, c.n_experts, c.top_k) == (1, 64, 8)
  assert train_throughput._register_variant("mixtral-like", 1, 64) == "mixtral-like-L1"
  assert train_throughput._register_variant("tiny", None, None) == "tiny"


def test_uniform_tokens_are_a_pure_dataset():
  d = train_throughput.uniform_tokens(vocab=256, n=4096)
  x, y = d.batch(0, 3, 4, 16)
  assert x.shape == y.shape == (4, 16) and x.max() < 256 and d.vocab_needed <= 256
  np.testing.assert_array_equal(x, train_throughput.uniform_tokens(vocab=256, n=4096).batch(0, 3, 4, 16)[0])
  np.testing.assert_array_equal(x[:, 1:], y[:, :-1])


def test_determinism_sweep_covers_every_tiling_first():
  from bench.determinism_sweep import TILINGS, sweep_order
  order = sweep_order(TILINGS, ["default", "other"])
  assert [p for _, p in order[:len(TILINGS)]] == ["default"] * len(TILINGS)
  assert [t for t, _ in order[:len(TILINGS)]] == TILINGS


def _fake_sweep(monkeypatch, checksum_of):
  """The sweep's scheduling on the CPU: compiling and running a point is faked (the
  uniep backend's transfer kernels need GPUs); `checksum_of(cfg)` gives its bits."""
  from bench import common, determinism_sweep
  monkeypatch.setitem(determinism_sweep.SWEEP_SHAPES, "cpu-tiny",
                      common.MoEShape("cpu-tiny", 64, 128, 128, 8, 2))
  monkeypatch.setattr(determinism_sweep, "_compile", lambda mesh, shape, cfg, x, p: cfg)
  monkeypatch.setattr(determinism_sweep, "_checksums", lambda cfg, x, p: checksum_of(cfg))
  return determinism_sweep


def test_determinism_sweep_runs_every_point_and_reports_a_mismatch(tmp_path, monkeypatch):
  sweep = _fake_sweep(monkeypatch, lambda cfg: ("same",))
  assert sweep.main(["--shape", "cpu-tiny", "--ep", "2", "--out", str(tmp_path)]) == 0
  got = json.loads(next(tmp_path.glob("determinism_sweep_*_ep2.json")).read_text())
  # per tiling: the default transfer de-duplicated and not, the fused points, the send
  # buffer, the expansion in the transfer's launch (its last source on every CTA or
  # not), the others
  assert got["swept"] == len(sweep.TILINGS) * (5 + len(sweep.FUSED) + len(sweep.TRANSFERS) - 1)
  assert sum(r["expand_in_transfer"] for r in got["points"]) == 2 * len(sweep.TILINGS)
  assert sum(r["expand_last_on_all"] for r in got["points"]) == len(sweep.TILINGS)
  assert sum(not r["gather_rows"] for r in got["points"]) == len(sweep.TILINGS)
  dedup = [r["dedup_tokens"] for r in got["points"] if r["fused"] is None
           and r["gather_rows"] and not r["expand_in_transfer"]
           and (r["chunk_rows"], r["num_ctas"], r["col_tile"]) == (128, 64, 256)]
  assert sorted(dedup) == [False] * len(sweep.TILINGS) + [True] * len(sweep.TILINGS)
  assert not got["mismatches"] and not got["skipped"]
  # rewritten after every point (a hang later keeps what ran): the last one has them all
  partial = json.loads(next(tmp_path.glob("determinism_sweep_*_ep2.partial.json")).read_text())
  assert partial["partial"] and partial["points"] == got["points"]
  # a point whose bits differ from its "pallas" reference is reported and fails the run
  bad = lambda cfg: ("other",) if cfg.backend == "uniep" and cfg.fused is not None else ("same",)  # noqa: E731
  sweep = _fake_sweep(monkeypatch, bad)
  assert sweep.main(["--shape", "cpu-tiny", "--ep", "2", "--start", "5",
                     "--out", str(tmp_path)]) == 1
  got = json.loads(next(tmp_path.glob("determinism_sweep_*_ep2_from5.json")).read_text())
  assert len(got["mismatches"]) == len(sweep.TILINGS) * len(sweep.FUSED)
  assert all(m["fused"] is not None for m in got["mismatches"])


def test_train_throughput_backend_options():
  assert train_throughput.parse_backend("uniep") == dict(backend="uniep")
  assert train_throughput.parse_backend("uniep+xla_dswiglu+s3+b4") == dict(
      backend="uniep", swiglu_grad_in_kernel=False, kernel_stages=3, grad_buckets=4)
  assert train_throughput.parse_backend("pallas+dswiglu") == dict(backend="pallas",
                                                                  swiglu_grad_in_kernel=True)
  assert train_throughput.parse_backend("uniep+fused") == dict(backend="uniep", fused=True)
  assert train_throughput.parse_backend("uniep+nodd") == dict(backend="uniep", dedup_tokens=False)
  assert train_throughput.parse_backend("pallas+dd") == dict(backend="pallas", dedup_tokens=True)
  with pytest.raises(ValueError, match="the options are"):
    train_throughput.parse_backend("uniep+fast")


def test_train_throughput_times_a_case(tmp_path):
  train_throughput.main(["--models", "tiny", "--layers", "1", "--meshes", "data=2,expert=4",
                         "--backends", "xla_dropless", "--batch", "8", "--seq", "32",
                         "--steps", "2", "--warmup", "1", "--det-steps", "0",
                         "--grad-reduction", "ordered", "--out", str(tmp_path)])
  payload = json.loads(next(tmp_path.glob("train_throughput_*_x8.json")).read_text())
  (row,) = payload["results"]
  assert row["tokens_per_s"] > 0 and row["dropped"] == 0 and "error" not in row
  assert row["grad_reduction"] == "ordered"
  assert payload["settings"]["tokens"] == "uniform"
  assert row["lr"] == train_throughput.TIMING_LR and row["dropped_fraction"] == 0
  assert row["max_load"] >= 1 and np.isfinite(row["loss_last"])


def test_fused_check_driver_writes_every_case_and_fails_loudly(tmp_path):
  """bench/fused_check.py (the driver of the v1-vs-fused GPU checks) on the CPU with
  stand-in functions: one passing case, one whose build raises."""
  from bench import check_fused_gpu, check_fused_return_gpu, fused_check  # noqa: F401 (import on CPU)
  import jax.numpy as jnp

  def build(mesh, r, case, kernel, transfer):
    if case == "broken":
      raise RuntimeError("no kernel here")
    return (lambda x: x + 1.0), (lambda x: x + 1.0), [jnp.arange(4.0)]

  compare = lambda ya, yb, yc, r: dict(ok=bool(jnp.all(ya == yb) and jnp.all(yb == yc)))  # noqa: E731
  fields = lambda case: dict(which=case)  # noqa: E731
  rc = fused_check.main(["--out", str(tmp_path), "--cases", "good", "--no-time"], name="smoke",
                        cases={"good": "good", "broken": "broken"}, case_fields=fields,
                        build=build, compare=compare)
  assert rc == 0
  rc = fused_check.main(["--out", str(tmp_path), "--no-time"], name="smoke",
                        cases={"good": "good", "broken": "broken"}, case_fields=fields,
                        build=build, compare=compare)
  assert rc == 1
  (path,) = tmp_path.glob("smoke_*.json")
  good, broken = json.loads(path.read_text())["results"]
  assert good["ok"] and good["which"] == "good" and good["R"] == 8
  assert not broken["ok"] and "no kernel here" in broken["error"]


@pytest.mark.parametrize("script", ["check_fused_gpu", "check_fused_return_gpu"])
def test_fused_check_scripts_lower_for_cuda(script):
  """The GPU checks' v1 and fused per-rank functions, on their small case, lower to
  Mosaic GPU (they cannot run here)."""
  import importlib

  from pallas_kernels import device as device_lib
  from uniep_jax.config import KernelConfig, TransferConfig

  mod = importlib.import_module(f"bench.{script}")
  mesh = jax.make_mesh((1, 4), ("data", "expert"), devices=jax.devices()[:4])
  v1, fused, xs = mod._build(mesh, 4, mod.CASES["small"], KernelConfig(), TransferConfig())
  for fn in (v1, fused):
    with device_lib.lowering_for_gpu():
      assert "mosaic_gpu" in fn.trace(*xs).lower(lowering_platforms=("cuda",)).as_text()


def test_profile_summary_counts_time_and_cross_stream_overlap():
  from bench.profile_layer import summarize
  pnames = {1: "/device:GPU:0"}
  ev = [dict(pid=1, tid=10, ts=0.0, dur=10.0, name="gemm"),      # stream 10
        dict(pid=1, tid=11, ts=5.0, dur=10.0, name="send"),      # stream 11: overlaps 5
        dict(pid=1, tid=10, ts=20.0, dur=4.0, name="gemm"),
        dict(pid=2, tid=1, ts=0.0, dur=99.0, name="host")]      # not a device
  (dev,) = summarize(ev, pnames, calls=2).values()
  rows = {r["name"]: r for r in dev["kernels"]}
  assert dev["span_us"] == 24.0 and dev["busy_us"] == 19.0 and dev["span_per_call_us"] == 12.0
  assert rows["gemm"]["count"] == 2 and rows["gemm"]["total_us"] == 14.0
  assert rows["gemm"]["overlap_us"] == 5.0 and rows["send"]["overlap_us"] == 5.0
  assert rows["gemm"]["per_call_us"] == 7.0


def test_profile_timeline_and_mosaic_kernel_names():
  from bench.profile_layer import summarize
  pnames = {1: "/device:GPU:0"}
  details = "regs:168 static_shared:1 dynamic_shared:229440 grid:132,1,1 block:384,1,1"
  ev = [dict(pid=1, tid=10, ts=100.0, dur=50.0, name="anonymous_mosaic_gpu_kernel",
             args=dict(kernel_details=details)),
        dict(pid=1, tid=10, ts=160.0, dur=5.0, name="tiny_fusion"),        # under min_us
        dict(pid=1, tid=11, ts=170.0, dur=30.0, name="ncclDevKernel_SendRecv")]
  (dev,) = summarize(ev, pnames, calls=1, min_us=20.0).values()
  assert [k["name"] for k in dev["kernels"]][0] == "mosaic grid 132 block 384 smem 229440"
  assert dev["timeline"] == [
      dict(start_ms=0.0, ms=0.05, stream=10, name="mosaic grid 132 block 384 smem 229440"),
      dict(start_ms=0.07, ms=0.03, stream=11, name="ncclDevKernel_SendRecv")]


def test_profile_of_a_training_step_on_cpu(tmp_path, monkeypatch):
  """--train-model: the real train step (tiny model, 8 virtual CPU devices) under the
  profiler, reduced to the same table (CPU ops stand in for GPU kernels)."""
  import os
  from bench import profile_layer
  for var in ("XLA_FLAGS", "NCCL_LAUNCH_MODE"):   # the bench sets them; restore after
    monkeypatch.setenv(var, os.environ.get(var, ""))
  # one profiled call: summarize() compares every trace event with every other one (the
  # overlap column), and the 8 CPU devices' trace of 2 calls took 20 of the test's 30 s;
  # the per-call division is checked on fixed events by the summary tests above
  rc = profile_layer.main(["--train-model", "tiny", "--backend", "xla_dropless",
                           "--mesh", "data=2,expert=4", "--batch", "8", "--seq", "32",
                           "--reps", "1", "--out", os.fspath(tmp_path)])
  assert rc == 0
  (path,) = tmp_path.glob("profile_train_tiny-L1_data2_expert4_xla_dropless.json")
  payload = json.loads(path.read_text())
  dev = next(iter(payload["devices"].values()))
  assert dev["kernels"] and dev["span_per_call_us"] > 0
  assert payload["settings"]["train_model"] == "tiny"


def test_device_session_phases_are_unique_and_documented():
  """bench/device_session.sh dispatches on the phase name with a bash `case`: a second
  label of the same name never runs (the SMEM-scalar probe, once named "probe" beside the
  training-loop probe, did not run on 4x H200, 2026-11-28). Every label is in the header."""
  import pathlib
  import re
  text = (pathlib.Path(__file__).parent.parent / "bench" / "device_session.sh").read_text()
  body = text[text.index('case "$name" in'):text.index("    *)")]   # to the catch-all
  labels = re.findall(r"^    ([a-z_]+)\)", body, flags=re.M)
  assert len(labels) > 10 and len(labels) == len(set(labels)), labels
  header = {m for m in re.findall(r"^#   ([a-z_]+) ", text, flags=re.M)}
  assert set(labels) <= header, set(labels) - header


def test_transfer_check_runs_both_sides_on_cpu(tmp_path, monkeypatch):
  """bench/transfer_check.py (the device session's `xfer` phase) on a tiny shape in the
  interpret mode, each timed function called once: the send side's two forms and the
  owner side's expansion (gather_live_rows on 64 CTAs, plain and weighted,
  transfer_expand's local form) run, and both comparisons are bit for bit."""
  from bench import common, transfer_check
  monkeypatch.setattr(common, "time_ms", lambda fn, *a, **k: (jax.block_until_ready(fn(*a)), 1.0)[1])
  transfer_check.main(["--tokens", "24", "--hidden", "128", "--expand-ctas", "64",
                       "--out", str(tmp_path)])
  (path,) = tmp_path.glob("transfer_check_*.json")
  (row,) = json.loads(path.read_text())["rows"]
  assert row["bitwise_equal"] and row["expand_bitwise_equal"]
  assert row["recv_rows"] > row["live_rows"]    # ~2.94 receive rows per unique row
  assert {"expand_64ctas", "expand_64ctas_weighted", "transfer_expand_local"} <= set(row)


def test_probe_variants_run_isolated(tmp_path):
  """bench.common.run_variant_isolated, as the GPU probes use it (smem_scalar_probe,
  transfer_expand_probe): each variant in a process of its own; a variant that dies
  leaves a row with its return code and the end of its error, and the others still run."""
  import json
  from bench import smem_scalar_probe
  rc = smem_scalar_probe.main(["--variants", "static_f32,no_such_variant", "--out", str(tmp_path)])
  assert rc == 1   # one variant failed
  (path,) = tmp_path.glob("smem_scalar_probe_*.json")
  ok, bad = json.loads(path.read_text())["results"]
  assert ok["variant"] == "static_f32" and ok["returncode"] == 0 and ok["equal"] is True
  assert bad["returncode"] not in (0, None) and "no_such_variant" in bad["error_tail"]


def test_time_interleaved_goes_round_robin():
  """bench.common.time_interleaved_ms: trial by trial, one batch of `reps` calls per
  name in turn (so a drift of the machine reaches every name alike), and each name's
  median over its own batches."""
  from bench import common
  calls = []
  fns = {name: ((lambda name=name: calls.append(name) or 0), reps)
         for name, reps in (("a", 2), ("b", 1), ("c", 3))}
  out = common.time_interleaved_ms(fns, trials=2)
  assert calls == ["a", "a", "b", "c", "c", "c"] * 2
  assert set(out) == {"a", "b", "c"}
  assert all(v["trials"] == 2 and v["min_ms"] <= v["median_ms"] <= v["max_ms"]
             for v in out.values())
  assert [out[n]["reps"] for n in "abc"] == [2, 1, 3]


def test_epilogue_probe_variants_change_the_kernel_and_restore():
  """bench/epilogue_probe.py's variants each lower another Mosaic GPU program (the names
  it swaps are the ones the kernel body looks up), and the module is whole again after."""
  import jax
  import jax.numpy as jnp
  from bench import epilogue_probe as ep
  from pallas_kernels import grouped_gemm as gg
  from uniep_jax.config import KernelConfig
  bf, s = jnp.bfloat16, jax.ShapeDtypeStruct
  m, h, f, g = 1024, 256, 256, 2
  fn = lambda dy, w, gs, hh, uu: gg._row_tiled_call(  # noqa: E731
      [dy], [w], gs, mode="dswiglu", transpose_b=True, out_dtype=bf, save_hu=False,
      epi_inputs=(hh, uu), config=KernelConfig(), interpret=False, zero_window=64)
  args = (s((m, h), bf), s((g, f, h), bf), s((g,), jnp.int32), s((m, f), bf), s((m, f), bf))
  sizes = {}   # the serialized kernel varies by a few bytes between lowerings: compare sizes
  for v in ("as_is", "no_tma_store", "no_hu_loads", "no_epilogue", "as_is"):
    with ep._variant(v):
      sizes.setdefault(v, []).append(len(jax.jit(lambda *xs: fn(*xs)).trace(*args).lower(
          lowering_platforms=("cuda",)).as_text()))
  assert abs(sizes["as_is"][0] - sizes["as_is"][1]) < 100
  first = sorted(n[0] for n in sizes.values())
  assert all(b - a > 1000 for a, b in zip(first, first[1:])), sizes
  with pytest.raises(ValueError):
    with ep._variant("bogus"):
      pass
  assert gg.ladder_store.__name__ == "ladder_store" and gg.plgpu.__name__.endswith("mosaic_gpu")


def test_epilogue_probe_full_tile_tma_keeps_the_bits():
  """The probe's candidate fix `full_tile_tma` (one TMA for a full tile's chunk, the
  ladder for partial ones) stores the same bits, in the interpret mode, on groups with
  full and partial tiles and dead rows (plain and dswiglu launches)."""
  import chex
  import jax
  import jax.numpy as jnp
  import numpy as np
  from bench import epilogue_probe as ep
  from pallas_kernels import grouped_gemm as gg
  from pallas_testlib import INTERPRET
  from uniep_jax.config import KernelConfig
  bf = jnp.bfloat16
  gs = jnp.asarray(np.array([0, 300, 37, 200, 0, 127], np.int32))
  m, k, n, g = 768, 128, 256, 6
  ks = jax.random.split(jax.random.key(7), 4)
  a = jax.random.normal(ks[0], (m, k), jnp.float32).astype(bf)
  w = (jax.random.normal(ks[1], (g, n, k), jnp.float32) * k ** -0.5).astype(bf)
  hh, uu = (jax.random.normal(kk, (m, n), jnp.float32).astype(bf) for kk in ks[2:])
  cfg = KernelConfig(num_sms=2, max_concurrent_steps=2)

  def launches(a, w, s, hh, uu):
    kw = dict(transpose_b=True, out_dtype=bf, save_hu=False, config=cfg, interpret=INTERPRET)
    return (gg._row_tiled_call([a], [w], s, mode="plain", **kw)[0],
            gg._row_tiled_call([a], [w], s, mode="dswiglu", epi_inputs=(hh, uu), **kw)[0])

  out = {}
  for v in ("as_is", "full_tile_tma"):
    with ep._variant(v):
      out[v] = jax.jit(lambda *xs: launches(*xs)).lower(a, w, gs, hh, uu).compile()(
          a, w, gs, hh, uu)
  chex.assert_trees_all_equal(out["full_tile_tma"], out["as_is"])


def test_epilogue_probe_loop_checks_bits_and_interleaves(monkeypatch):
  """bench/epilogue_probe.py's loop on the CPU, with the two kernel entry points swapped
  for XLA stand-ins (the real ones compile only for a GPU): every requested variant is
  timed, one after another and then in interleaved rounds; a same-bits variant is
  compared with as_is on the live rows only (a stand-in that writes garbage into the
  dead rows still passes) and a variant whose live rows differ is reported unequal."""
  import jax.numpy as jnp
  from bench import epilogue_probe as ep
  from bench.grouped_gemm import MoeShape
  from pallas_kernels import grouped_gemm as gg

  def row_tiled(a_list, b_list, gs, *, mode, config, **kw):
    a, b = a_list[0], b_list[0]
    w = b[0].T if kw.get("transpose_b") else b[0]
    out = (a @ w[:a.shape[1]]).astype(a.dtype)
    dead = jnp.arange(out.shape[0])[:, None] >= gs.sum()
    out = jnp.where(dead, jnp.asarray(config.raster_rows or -1, out.dtype), out)   # garbage
    if config.raster_rows == 16:
      out = out.at[0, 0].add(1)                                  # a live bit differs
    return (out,)

  monkeypatch.setattr(gg, "_row_tiled_call", row_tiled)
  monkeypatch.setattr(gg, "_wgrad_call", lambda x, d, s, **kw: (x.T @ d)[None])
  shape = MoeShape("tiny", 64, 128, 128, 8, 2)
  row = ep.run_shape(shape, reps=1, trials=1, only={"as_is", "rows4", "rows16"},
                     only_launches={"down_plain", "dw_down_wgrad"})
  assert set(row["median_ms"]) == {"down_plain/as_is", "down_plain/rows4",
                                   "down_plain/rows16", "dw_down_wgrad/as_is"}
  assert row["bits_equal_to_as_is"] == {"down_plain/rows4": True, "down_plain/rows16": False}
  assert set(row["interleaved_median_ms"]) == {"down_plain/as_is", "down_plain/rows4",
                                               "down_plain/rows16"}   # one variant: no rounds


def test_chunk_readiness_is_a_monotone_prefix():
  """bench/chunk_readiness.py: the unique rows a chunk needs grow with the chunk, the
  last chunk needs all of them, the first only those whose smallest expert is the first
  (about 1/El of the slots times the slots per unique row: ~7% at qwen3-like EP 4)."""
  from bench import chunk_readiness
  rows = chunk_readiness.readiness(tokens=4096, experts=128, top_k=8, ep=4, chunk_rows=512)
  needed = [r[3] for r in rows]
  assert needed == sorted(needed) and needed[-1] == 1.0
  assert 0.03 < needed[0] < 0.12
  assert [r[2] for r in rows] == sorted(r[2] for r in rows) and rows[-1][2] == 31
