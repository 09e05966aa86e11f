"""The benchmark scripts of bench/ on tiny CPU shapes, and bench/run_gpu.sh: a script
that breaks here would break on a GPU machine too, after its device time was spent."""

import importlib
import json
import pathlib
import re
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import uniep_jax
from bench import init_routing, moe_layer, train_step_diff, train_throughput
from conftest import subprocess_env

ROOT = pathlib.Path(__file__).resolve().parent.parent
RUN_GPU = ROOT / "bench" / "run_gpu.sh"


def test_moe_layer_rejects_a_bad_backend_before_running_any(tmp_path, monkeypatch):
  """A bad configuration name (overlap is for backend "uniep") fails before the first
  backend compiles, not after others ran."""
  monkeypatch.setattr(moe_layer.common, "dense_matmul_tflops",
                      lambda: pytest.fail("ran before the backends were checked"))
  with pytest.raises(ValueError, match="overlap"):
    moe_layer.main(["--shapes", "tiny", "--backends", "xla_capacity,pallas:overlap",
                    "--out", str(tmp_path)])
  assert not list(tmp_path.iterdir())
  # the one naming scheme (bench/common.py, layer_config)
  cfg = moe_layer.backend_config
  assert cfg("uniep") == uniep_jax.UniEPConfig(backend="uniep")
  assert cfg("uniep:overlap").overlap == uniep_jax.OverlapConfig()
  assert cfg("uniep:overlap=4").overlap == uniep_jax.OverlapConfig(4, 4)
  assert cfg("uniep:overlap=8,0").overlap == uniep_jax.OverlapConfig(8, 0)
  assert cfg("uniep:auto").kernel is None and cfg("uniep:auto").transfer is None
  assert cfg("xla_dropless:padded").transport == "padded" and cfg("pallas").transport is None
  assert cfg("xla_capacity:cf=2").capacity_factor == 2.0
  assert cfg("pallas:fp8").precision == "fp8" and cfg("pallas").precision == "bf16"
  with pytest.raises(ValueError, match="precision='fp8'"):
    cfg("xla_dropless:fp8")
  with pytest.raises(ValueError, match="unknown option"):
    cfg("uniep:dd")
  with pytest.raises(ValueError, match="unknown backend"):
    cfg("uniep_dd")


def test_moe_layer_compiled_ahead_gives_the_same_bits(tmp_path):
  """--compile-workers 2: every program of a shape compiled ahead, then timed; the same
  checksums as compiled at the first call, and the skewed routing reuses the
  executable."""
  def run(workers, out):
    moe_layer.main(["--shapes", "tiny", "--backends", "xla_dropless:padded",
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
  moe_layer.main(["--shapes", "tiny", "--backends", "xla_capacity,xla_dropless:padded",
                  "--directions", "fwd", "--out", str(tmp_path),
                  "--min-batch-s", "0.01", "--max-reps", "2"])   # every routing by default
  (path,) = [p for p in tmp_path.glob("moe_layer_*_ep*.json") if ".partial" not in p.name]
  all_rows = json.loads(path.read_text())["results"]
  rows = [r for r in all_rows if r["routing"] == "balanced"]
  skewed = {r["backend"]: r for r in all_rows if r["routing"] == "skewed"}
  zipf = {r["backend"]: r for r in all_rows if r["routing"] == "zipf"}
  assert {r["backend"] for r in rows} == {"xla_capacity", "xla_dropless:padded"} == set(skewed)
  assert set(zipf) == set(skewed)
  for r in all_rows:
    assert r["median_ms"] > 0 and len(r["checksum"]) == 2 and "error" not in r
    # both backends of a case timed again, interleaved round robin
    assert r["interleaved_median_ms"] > 0 and r["interleaved_min_ms"] <= r["interleaved_median_ms"]
    assert r["short_batch_median_ms"] > 0 and r["reps"] <= 2
    # the other routings run the executable the balanced one compiled, on other data
    assert r["executable_reused"] == (r["routing"] != "balanced")
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
  assert skewed["xla_capacity"]["dropped"] > cap["dropped"] and skewed["xla_dropless:padded"]["dropped"] == 0
  assert free["dropped"] == 0 and cap["dropped"] > 0     # 8 ranks of 256 tokens overflow
  assert cap["checksum"] != free["checksum"] and cap["bitwise_equal_to"] == []
  # Zipf(1.2) popularity: hotter than balanced, cooler than all-to-one (E/K = 4), its
  # hottest rank not rank 0 (the popularity order is a random permutation of the experts)
  for backend, z in zipf.items():
    balanced = next(r for r in rows if r["backend"] == backend)
    assert balanced["max_expert_load"] < 2 < z["max_expert_load"] < skewed[backend]["max_expert_load"] == 4
    received = [sum(z["rank_rows"][s][d] for s in range(8)) for d in range(8)]
    assert max(received) > 1.5 * 8 * 256 * 2 / 8 and received.index(max(received)) != 0
  assert zipf["xla_capacity"]["dropped"] > cap["dropped"] and zipf["xla_dropless:padded"]["dropped"] == 0


def test_zipf_popularity_is_a_fixed_permutation_of_the_zipf_law():
  p = moe_layer.zipf_popularity(128)
  ranks = np.arange(1, 129, dtype=np.float64)
  np.testing.assert_allclose(np.sort(p)[::-1], ranks ** -1.2 / np.sum(ranks ** -1.2))
  np.testing.assert_array_equal(p, moe_layer.zipf_popularity(128))      # deterministic
  hot = np.argsort(-p)[:8]
  assert len(set(hot // 32)) > 1          # the 8 hottest experts on more than one of 4 ranks
  with pytest.raises(ValueError, match="routing='uniform' is unknown"):
    moe_layer.make_inputs(moe_layer.common.SMOKE_SHAPES["tiny"], None, routing="uniform")
  with pytest.raises(ValueError, match="--routings"):
    moe_layer.main(["--shapes", "tiny", "--routings", "balanced,zipfian"])


def test_init_routing_probe_writes_its_json(tmp_path):
  """bench/init_routing.py on two narrowed configs, a byte one and a word-level one."""
  assert init_routing.main(["--configs", "tiny,small-experts", "--d-model", "128", "--batch", "2",
                            "--seq", "64", "--data-bytes", str(256 << 10), "--tag", "smoke",
                            "--out", str(tmp_path)]) == 0
  payload = json.loads((tmp_path / "init_routing_cpu_smoke.json").read_text())
  assert payload["benchmark"] == "init_routing" and payload["settings"]["d_model"] == 128
  tiny, small = payload["results"]
  assert tiny["tokenizer"] == "bytes (vocab 256)" and "word-level" in small["tokenizer"]
  for row, layers, k in ((tiny, 4, 2), (small, 4, 8)):
    counts = np.asarray(row["expert_counts"])
    assert counts.shape == (layers, row["n_experts"]) and np.all(counts.sum(axis=1) == 2 * 64 * k)
    load = counts / counts.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(row["max_load_per_layer"], load.max(axis=1), atol=1e-4)
    assert 1 <= row["max_load"] <= row["n_experts"] / row["top_k"]
    assert row["d_model"] == 128 and row["embed_scale"] == pytest.approx(128 ** 0.5)
  with pytest.raises(SystemExit):
    init_routing.main(["--configs", "tiny,nope", "--out", str(tmp_path)])


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


def test_train_step_diff_refuses_a_bad_configuration_first(tmp_path, monkeypatch):
  monkeypatch.setattr(train_step_diff, "_one_backend",
                      lambda *a, **k: pytest.fail("ran before the names were checked"))
  with pytest.raises(SystemExit):
    train_step_diff.main(["--model", "tiny", "--backends", "xla_dropless,pallas:padded",
                          "--out", str(tmp_path)])
  assert not list(tmp_path.iterdir())


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
  from bench.determinism_sweep import OVERLAPS, TILINGS, TRANSFERS, sweep_order, transfer_points
  order = sweep_order(TILINGS, ["default", "other"])
  assert [p for _, p in order[:len(TILINGS)]] == ["default"] * len(TILINGS)
  assert [t for t, _ in order[:len(TILINGS)]] == TILINGS
  # the transfer x overlap points: every pair once, the default transfer without overlap
  # first, then the default transfer with each overlap point
  points = transfer_points(TRANSFERS, OVERLAPS)
  assert len(points) == len(set(points)) == len(TRANSFERS) * len(OVERLAPS)
  assert TRANSFERS[0] == uniep_jax.TransferConfig() and OVERLAPS[0] is None
  assert points[:len(OVERLAPS)] == [(TRANSFERS[0], o) for o in OVERLAPS]


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
  # every tiling x transfer x overlap point, each once
  n_points = len(sweep.TILINGS) * len(sweep.TRANSFERS) * len(sweep.OVERLAPS)
  assert got["swept"] == n_points == len({r["point"] for r in got["points"]})
  assert sum(r["overlap"] is None for r in got["points"]) == len(sweep.TILINGS) * len(sweep.TRANSFERS)
  assert {r["kernel"] for r in got["points"]} == set(got["pallas_reference"])
  assert len(got["pallas_reference"]) == len(sweep.TILINGS)
  # first every tiling at the default transfer without overlap, then with each overlap
  default = uniep_jax.TransferConfig()
  first = got["points"][:len(sweep.TILINGS) * len(sweep.OVERLAPS)]
  assert all((r["chunk_rows"], r["num_ctas"], r["col_tile"]) ==
             (default.chunk_rows, default.num_ctas, default.col_tile) for r in first)
  assert all(r["overlap"] is None for r in first[:len(sweep.TILINGS)])
  assert not got["mismatches"] and not got["skipped"]
  # rewritten after every point (a hang later keeps what ran): the last one has them all
  partial = json.loads(next(tmp_path.glob("determinism_sweep_*_ep2.partial.json")).read_text())
  assert partial["partial"] and partial["points"] == got["points"]
  # a point whose bits differ from its "pallas" reference is reported and fails the run
  bad = lambda cfg: ("other",) if cfg.backend == "uniep" and cfg.overlap is not None else ("same",)  # noqa: E731
  sweep = _fake_sweep(monkeypatch, bad)
  assert sweep.main(["--shape", "cpu-tiny", "--ep", "2", "--start", "5",
                     "--out", str(tmp_path)]) == 1
  got = json.loads(next(tmp_path.glob("determinism_sweep_*_ep2_from5.json")).read_text())
  assert len(got["mismatches"]) == (len(sweep.TILINGS) * len(sweep.TRANSFERS)
                                    * (len(sweep.OVERLAPS) - 1))
  assert all(m["overlap"] is not None for m in got["mismatches"])
  # a subset of each list: the first few, named in the file
  sweep = _fake_sweep(monkeypatch, lambda cfg: ("same",))
  assert sweep.main(["--shape", "cpu-tiny", "--ep", "2", "--tilings", "1", "--transfers", "2",
                     "--overlaps", "2", "--out", str(tmp_path)]) == 0
  got = json.loads(next(tmp_path.glob(
      "determinism_sweep_*_ep2_tilings1_transfers2_overlaps2.json")).read_text())
  assert got["swept"] == 4 and len(got["pallas_reference"]) == 1


def test_train_throughput_backend_options():
  parse = train_throughput.parse_backend
  assert parse("uniep") == dict(backend="uniep")
  assert parse("uniep:overlap:stages=3:buckets=4") == dict(
      backend="uniep", overlap=True, kernel_stages=3, grad_buckets=4)
  assert parse("pallas:stages=4") == dict(backend="pallas", kernel_stages=4)
  assert parse("xla_capacity:cf=2") == dict(backend="xla_capacity", capacity_factor=2.0)
  assert parse("pallas:fp8:stages=3") == dict(backend="pallas", fp8=True, kernel_stages=3)
  # what TrainConfig cannot express, and bad names, fail with the reason
  for bad, match in [("uniep:fast", "the options overlap, cf=F, fp8, stages=N, buckets=N"),
                     ("uniep:overlap=4", "OverlapConfig"), ("pallas:padded", "no transport"),
                     ("uniep:auto", "no kernel"), ("uniep:stages=x", "integer"),
                     ("pallas:overlap", "overlap"), ("uniep_dd", "unknown backend")]:
    with pytest.raises(ValueError, match=match):
      parse(bad)
  # the TrainConfig it maps onto, with TrainConfig's own checks
  cfg = train_throughput.train_config("uniep:overlap:stages=4", mesh="data=1,expert=4")
  assert (cfg.backend, cfg.overlap, cfg.kernel_stages, cfg.grad_buckets) == ("uniep", True, 4, None)
  with pytest.raises(ValueError, match="kernel_stages"):
    train_throughput.train_config("xla_dropless:stages=3")


def test_train_throughput_determinism_runs_follow_the_backends(tmp_path, monkeypatch):
  """--det-only: the determinism runs (pallas vs uniep, and uniep:overlap vs uniep when
  it is among --backends) for each model, written to the JSON; a bad name fails first."""
  calls = []

  def fake(model, mesh, **kw):
    calls.append((model, mesh, kw))
    return dict(model=model, mesh=mesh, pallas_equals_uniep=True)

  monkeypatch.setattr(train_throughput, "determinism", fake)
  monkeypatch.setattr(train_throughput.common, "dense_matmul_tflops", lambda: 1.0)
  monkeypatch.setattr(train_throughput.common, "start_training_process", lambda det: None)
  with pytest.raises(SystemExit):
    train_throughput.main(["--models", "tiny", "--backends", "pallas,uniep:auto", "--det-only",
                           "--out", str(tmp_path)])
  assert not calls
  train_throughput.main(["--models", "tiny", "--meshes", "data=1,expert=8", "--det-only",
                         "--backends", "pallas,uniep,uniep:overlap", "--det-steps", "3",
                         "--seq", "32", "--out", str(tmp_path)])
  ((model, mesh, kw),) = calls
  assert (model, mesh, kw["steps"], kw["overlap"]) == ("tiny", "data=1,expert=8", 3, True)
  payload = json.loads(next(tmp_path.glob("train_throughput_*_det.json")).read_text())
  assert payload["determinism"] == [dict(model="tiny", mesh="data=1,expert=8",
                                         pallas_equals_uniep=True)]


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


def test_profile_file_names_of_configurations():
  from bench.profile_layer import file_part
  assert file_part("xla_dropless") == "xla_dropless"
  assert file_part("uniep:overlap=4,2") == "uniep_overlap4-2"


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


def test_check_moe_gpu_bitwise_partners():
  """bench/check_moe_gpu.py's bitwise guarantees: a transport option, an overlap option
  and the NVLink transport ("uniep" vs "pallas") change no bit."""
  from bench.check_moe_gpu import DEFAULT_CONFIGS, bitwise_partner, meshes_for
  assert bitwise_partner("uniep") == "pallas"
  assert bitwise_partner("uniep:overlap") == bitwise_partner("uniep:overlap=4,0") == "uniep"
  assert bitwise_partner("xla_dropless:padded") == "xla_dropless"
  assert bitwise_partner("pallas:ragged") == "pallas"
  assert bitwise_partner("uniep:overlap:auto") == "uniep:auto"
  for name in ("pallas", "xla_dropless", "xla_capacity:cf=100", "uniep:auto"):
    assert bitwise_partner(name) is None
  # the default list: every name valid, "uniep" = "pallas", "uniep:overlap" = "uniep"
  names = DEFAULT_CONFIGS.split(",")
  for name in names:
    moe_layer.backend_config(name)
  assert {(n, bitwise_partner(n)) for n in names} >= {("uniep", "pallas"), ("uniep:overlap", "uniep")}
  assert meshes_for(8, False, None) == [(8, 1), (4, 2), (2, 4), (1, 8)]
  assert meshes_for(8, True, None) == [(2, 4), (1, 8)]
  assert meshes_for(8, False, "1x8,2x4") == [(1, 8), (2, 4)]
  with pytest.raises(ValueError, match="does not cover"):
    meshes_for(8, False, "1x4")


@pytest.mark.parametrize("module", [
    "bench.moe_layer", "bench.check_moe_gpu", "bench.determinism_sweep", "bench.init_routing",
    "bench.train_throughput", "bench.profile_layer", "bench.train_step_diff",
    "bench.grouped_gemm", "bench.replication", "uniep_jax.autotune"])
def test_benchmarks_answer_help(module, capsys):
  """Every benchmark bench/run_gpu.sh runs imports on the CPU and answers --help."""
  with pytest.raises(SystemExit) as e:
    importlib.import_module(module).main(["--help"])
  assert e.value.code == 0 and "usage" in capsys.readouterr().out


def test_run_gpu_phases_are_documented_and_an_unknown_one_fails_first(tmp_path):
  """bench/run_gpu.sh: valid bash; each phase has its branch and its line (with its
  variable) in the header; an unknown phase or a bad limit stops it before anything
  runs, with the reason."""
  subprocess.run(["bash", "-n", str(RUN_GPU)], check=True)
  text = RUN_GPU.read_text()
  phases = re.search(r'^PHASES="([a-z ]+)"$', text, flags=re.M).group(1).split()
  assert phases == ["layer", "gemm", "check", "odd", "balance", "sweep", "train", "profile",
                    "stepdiff",
                    "tune", "mp"]
  header = text[:text.index("set -u")]
  for phase in phases:
    assert re.search(rf"^#   {phase} .*\${phase.upper()}_ARGS", header, flags=re.M), phase
    assert re.search(rf"^    {phase}\)", text, flags=re.M), phase
  out = tmp_path / "out"
  for args, why in [(["check:60", "bogus:10"], "unknown phase 'bogus'"),
                    (["check:soon"], "whole number of seconds"), ([], "usage")]:
    p = subprocess.run(["bash", str(RUN_GPU), str(out), *args], capture_output=True, text=True,
                       env=subprocess_env(PYTHON=sys.executable))
    assert p.returncode == 2 and why in p.stderr, (args, p.stderr)
    assert not out.exists()


def test_run_gpu_runs_phases_under_their_limits(tmp_path):
  """bench/run_gpu.sh end to end on the CPU: the check phase cut by a 1 s limit, then
  again (into check_2/) to its end with CHECK_ARGS; logs, the JSON and the summary in
  the folder; exit 1 since one phase did not exit 0."""
  out = tmp_path / "out"
  env = subprocess_env(PYTHON=sys.executable, KILL_GRACE_S="1",
                       CHECK_ARGS="--backends xla_dropless --dtypes float32")
  p = subprocess.run(["bash", str(RUN_GPU), str(out), "check:1", "check:300"], env=env,
                     capture_output=True, text=True, timeout=400)
  assert p.returncode == 1, p.stdout + p.stderr
  log = (out / "run_gpu.log").read_text()
  assert "== check: timed out" in log and "== check_2: ok (exit 0)" in log, log
  assert "--out " + str(out / "check_2") + " --backends xla_dropless --dtypes float32" in log
  assert (out / "check.log").exists() and "4 passed, 0 failed" in (out / "check_2.log").read_text()
  (path,) = (out / "check_2").glob("check_moe_gpu_*.json")
  report = json.loads(path.read_text())
  assert report["complete"] and (report["passed"], report["failed"]) == (4, 0)
  assert report["configurations"] == ["xla_dropless"]


def test_replication_bench_routings_and_rank_groups():
  """bench/replication.py's routings (distinct experts per token; all-to-one puts expert 0
  in every top-k; Zipf is skewed) and each rank's groups from the plan (every row once,
  the plan's rows per rank)."""
  import numpy as np
  from bench import replication as rb
  for kind in rb.ROUTINGS:
    tk = rb.routing(kind, 16, 512, 4, seed=0)
    assert all(len(set(row)) == 4 for row in tk)
  assert (rb.routing("all_to_one", 16, 64, 4, seed=1) == 0).any(axis=1).all()
  c = rb.counts(rb.routing("zipf", 16, 4 * 256, 4, seed=2), 4, 16)
  n = c.sum(0)
  assert n.max() > 3 * n.mean()
  for slots in (0, 1, 2):
    groups, rows, _, _ = rb.rank_groups(c, slots)
    assert groups.sum() == n.sum() and (groups.sum(1) == rows).all()
  assert rb.rank_groups(c, 2)[1].max() <= -(-n.sum() // 4)
