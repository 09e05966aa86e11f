"""The autotuner (uniep_jax/tune.py) on the CPU: enumeration and pruning, the
cache and "auto" resolution, the never-pick-a-mismatch rule, budget and skip
accounting (injected runners and clocks), and one end-to-end run of the CLI on
backend "pallas" in the Mosaic GPU interpret mode."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

import uniep_jax
from uniep_jax import KernelConfig, TransferConfig, UniEPConfig
from uniep_jax import tune as T
from conftest import make_mesh
from moe_testlib import make_params, make_x

HOPPER = T.DeviceFacts(kind="NVIDIA H200", smem_bytes=227 * 1024, num_sms=132)
DEEPSEEK_BWD = T.TuneProblem(8192, 7168, 2048, 256, 8, 4, "bfloat16", "bwd")


def _space(**kw):
  base = dict(block_m=(128,), block_n=(128,), block_k=(64,), max_concurrent_steps=(3,),
              epilogue_slots=(1,), raster_rows=(None,), chunk_rows=(128,), num_ctas=(64,),
              col_tile=(256,), fused=(), dedup_tokens=(), expand_in_transfer=())
  base.update(kw)
  return T.SearchSpace(**base)


def _reasons(enum):
  return [r["reason"] for r in enum.rejected]


# ---------------------------------------------------------------------------
# Enumeration and pruning
# ---------------------------------------------------------------------------
def test_default_tiling_stages_match_the_kernel_docstring():
  # grouped_gemm.py: a 128/128/64 stage is 48 KiB, epilogue 2 x 16 KiB (bf16),
  # 227 KiB per block: 4 stages fit; the da launches ("dswiglu": 2 x 2 x 16 KiB of h/u
  # buffers; the XLA-pass variant's float32-output da: 2 x 32 KiB) clamp to 3.
  s4 = KernelConfig(max_concurrent_steps=4)
  stages = T.kernel_launch_stages(s4, DEEPSEEK_BWD, HOPPER.smem_bytes)
  # swiglu, down, da (dswiglu), da (plain, f32 out), dx (plain, K = 2F), wgrad
  assert stages == (4, 4, 3, 3, 4, 4)
  # two epilogue slots: 16 KiB more per warpgroup in bf16, 32 in float32: the float32
  # da drops to 2 stages (dswiglu keeps its own buffers), the others keep 3
  e2 = KernelConfig(epilogue_slots=2)
  assert T.kernel_launch_stages(e2, DEEPSEEK_BWD, HOPPER.smem_bytes) == (3, 3, 3, 2, 3, 3)
  big = KernelConfig(block_m=256, epilogue_slots=2)   # float32 da epilogue alone: 256 KiB
  with pytest.raises(T.InvalidCandidate, match="bwd da \\(plain, float32 out\\)"):
    T.kernel_launch_stages(big, DEEPSEEK_BWD, HOPPER.smem_bytes)
  fwd = T.kernel_launch_stages(s4, T.TuneProblem(8192, 7168, 2048, 256, 8, 4,
                                                 direction="fwd"), HOPPER.smem_bytes)
  assert fwd == (4, 4)
  # the default (3 stages, measured faster) fits every launch unclamped
  assert T.kernel_launch_stages(KernelConfig(), DEEPSEEK_BWD, HOPPER.smem_bytes) == (3,) * 6


def test_launch_plan_counts_the_stage_the_mmas_in_flight_take():
  """KernelConfig.mma_in_flight asks for one stage more (grouped_gemm._stages_and_in_flight):
  where the SMEM gives it, the plan records it and the launch keeps its MMAs in flight;
  where it does not, the launch runs as mma_in_flight=0 and the candidate is a duplicate."""
  from pallas_kernels import grouped_gemm as gg
  s3 = KernelConfig()                          # 3 stages: the 4th fits everywhere but the da
  plan = T.kernel_launch_plan(dataclasses.replace(s3, mma_in_flight=1), DEEPSEEK_BWD,
                              HOPPER.smem_bytes)
  # swiglu, down, da (dswiglu), da (plain, f32 out), dx, wgrad
  assert plan == ((4, 1), (4, 1), (3, 0), (3, 0), (4, 1), (4, 1))
  assert T.kernel_launch_stages(dataclasses.replace(s3, mma_in_flight=1), DEEPSEEK_BWD,
                                HOPPER.smem_bytes) == (4, 4, 3, 3, 4, 4)
  # the kernel's own decision for the forward gate/up launch agrees
  launch = gg._launch_of(dataclasses.replace(s3, mma_in_flight=1), "swiglu", jnp.bfloat16,
                         jnp.bfloat16)
  assert gg._stages_and_in_flight(launch, dataclasses.replace(s3, mma_in_flight=1),
                                  DEEPSEEK_BWD.hidden // s3.block_k, s3.block_m,
                                  HOPPER.smem_bytes) == plan[0]
  # 4 stages asked, 5 do not fit anywhere: in flight is off in every launch, and the
  # candidate compiles what mma_in_flight=0 compiles
  s4 = KernelConfig(max_concurrent_steps=4)
  space = T.SearchSpace(block_m=(128,), block_n=(128,), block_k=(64,), max_concurrent_steps=(4,),
                        epilogue_slots=(1,), raster_rows=(None,), wgrad_raster=(None,),
                        mma_in_flight=(0, 1), chunk_rows=(128,), num_ctas=(64,),
                        col_tile=(256,))
  assert all(f == 0 for _, f in T.kernel_launch_plan(dataclasses.replace(s4, mma_in_flight=1),
                                                      DEEPSEEK_BWD, HOPPER.smem_bytes))
  enum = T.enumerate_candidates(space, DEEPSEEK_BWD, HOPPER)
  assert [c.kernel.mma_in_flight for c in enum.candidates] == [0]
  assert any("duplicate of" in r for r in _reasons(enum))

def test_pruning_rejects_with_reasons():
  space = T.SearchSpace(block_m=(96, 128, 192, 256), block_n=(64, 128, 256), block_k=(64, 128),
                        max_concurrent_steps=(3, 4, 6), chunk_rows=(48, 128, 256),
                        num_ctas=(64, 200), col_tile=(192, 256))
  enum = T.enumerate_candidates(space, DEEPSEEK_BWD, HOPPER)
  reasons = _reasons(enum)
  assert enum.enumerated == space.size() == len(enum.candidates) + len(enum.rejected)

  def some(fragment):
    return any(fragment in r for r in reasons)

  assert some("KernelConfig: block_m=96 must be a positive multiple of 64")
  assert some("block_m=192 must be a power of two")
  assert some("block_n=64 must be a multiple of 128")
  assert some("TransferConfig: chunk_rows=48 must be a power of two")
  assert some("shared memory: fwd gate/up (swiglu) with block_m=256 block_n=256 block_k=128")
  assert some("shared memory: transfer stages 2 x 256 x 256")
  assert some("H=7168 is not divisible by col_tile=192")
  assert some("num_ctas=200 exceeds the 132 SMs")
  assert some("duplicate of m128_n128_k64_s4|c128_x64_t256")   # 6 stages clamp to 4
  # the default comes first and represents its clamped duplicates
  assert enum.candidates[0] == T.DEFAULT_CANDIDATE
  for c in enum.candidates:
    T.check_candidate(c, DEEPSEEK_BWD, HOPPER)          # every survivor passes
    assert c.kernel.block_m & (c.kernel.block_m - 1) == 0
    assert DEEPSEEK_BWD.hidden % c.transfer.col_tile == 0


def test_check_candidate_raises_clear_errors():
  too_big = T.Candidate(KernelConfig(256, 256, 128), TransferConfig())
  with pytest.raises(T.InvalidCandidate, match="shared memory.*over the device's 232448 B"):
    T.check_candidate(too_big, DEEPSEEK_BWD, HOPPER)
  with pytest.raises(T.InvalidCandidate, match="not divisible by col_tile=256"):
    T.check_candidate(T.DEFAULT_CANDIDATE, T.TuneProblem(64, 64, 128, 4, 2, 1), HOPPER)
  # without the NVLink transport the transfer knobs are not checked
  T.check_candidate(T.DEFAULT_CANDIDATE, T.TuneProblem(64, 64, 128, 4, 2, 1), HOPPER,
                    uses_transfer=False)
  with pytest.raises(ValueError, match="direction"):
    T.TuneProblem(64, 64, 128, 4, 2, 1, direction="sideways")
  with pytest.raises(ValueError, match="divisible by ep"):
    T.TuneProblem(64, 64, 128, 6, 2, 4)


def test_transfer_points_collapse_without_the_nvlink_transport():
  space = _space(chunk_rows=(64, 128), num_ctas=(32, 64))
  enum = T.enumerate_candidates(space, DEEPSEEK_BWD, HOPPER, uses_transfer=False)
  assert enum.candidates == [T.DEFAULT_CANDIDATE]
  assert sum("unused by this backend" in r for r in _reasons(enum)) == 3


# ---------------------------------------------------------------------------
# The search loop with injected runners
# ---------------------------------------------------------------------------
class FakeClock:
  def __init__(self):
    self.t = 0.0

  def __call__(self):
    return self.t


class FakeRunner:
  """Times from a table; checksums equal to the reference unless told otherwise.

  Every reference or measurement advances the fake clock by `cost_s`."""

  backend, uses_transfer = "uniep", True

  def __init__(self, clock, times, *, bad=(), fail=(), bad_reference=(), cost_s=1.0):
    self.clock, self.times, self.cost_s = clock, times, cost_s
    self.bad, self.fail, self.bad_reference = set(bad), set(fail), set(bad_reference)
    self.measured, self.referenced = [], []

  def reference(self, kernel):
    self.clock.t += self.cost_s
    self.referenced.append(T.kernel_label(kernel))
    if T.kernel_label(kernel) in self.bad_reference:
      raise RuntimeError("reference compile failed")
    return ("ref-" + T.kernel_label(kernel),)

  def measure(self, cand):
    self.clock.t += self.cost_s
    label = cand.label()
    self.measured.append(label)
    if label in self.fail:
      raise RuntimeError("Mosaic GPU compile failed (fake)")
    # the bits depend on the tiling, not on the tile order (raster_rows, wgrad_raster)
    same = T.kernel_label(T.reference_kernel(cand.kernel))
    checksum = ("WRONG",) if label in self.bad else ("ref-" + same,)
    return T.Measurement(median_ms=self.times(cand), compile_s=0.5, checksum=checksum)


def _time_table(cand):
  # default 10 ms; block_m=64: 8 ms; with chunk_rows=128 and num_ctas=32: 7 ms
  t = 10.0
  if cand.kernel.block_m == 64:
    t -= 2.0
  if cand.transfer.num_ctas == 32 and cand.transfer.chunk_rows == 128:
    t -= 1.0
  return t


SPACE = _space(block_m=(64, 128), chunk_rows=(64, 128), num_ctas=(32, 64))


def test_staged_search_picks_fastest_verified():
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table)
  res = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
               clock=clock)
  assert res.best.candidate.label() == "m64_n128_k64_s3|c128_x32_t256"
  assert res.best.median_ms == 7.0
  assert [t.stage for t in res.trials].count("kernel") == 2
  assert res.spread()["default_over_best"] == pytest.approx(10.0 / 7.0)
  assert [t.median_ms for t in res.top(5)] == sorted(t.median_ms for t in res.top(5))
  js = res.to_json()
  assert js["transfer_consistent"] and js["mismatches"] == []
  assert js["counts"]["ok"] == len(res.trials) == 2 + 3   # 2 tilings, then 3 more transfers
  assert js["counts"]["valid"] == 8
  # one reference per KernelConfig, shared by its transfer variants
  # (walked row-major: the reference of every tile order)
  assert sorted(runner.referenced) == ["m128_n128_k64_s3_r1_w1", "m64_n128_k64_s3_r1_w1"]


class PrefetchingRunner(FakeRunner):
  """Records what the search asks to compile ahead, and in which order."""

  prefetch_window = 2

  def __init__(self, *a, **kw):
    super().__init__(*a, **kw)
    self.events = []

  def prefetch(self, cands, kernels):
    self.events.append(("prefetch", [c.label() for c in cands],
                        [T.kernel_label(k) for k in kernels]))

  def measure(self, cand):
    self.events.append(("measure", cand.label()))
    return super().measure(cand)

  def discard(self, cands):
    self.events.append(("discard", [c.label() for c in cands]))


def test_search_prefetches_the_next_candidates_and_missing_references():
  clock = FakeClock()
  runner = PrefetchingRunner(clock, _time_table)
  res = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
               clock=clock)
  assert res.best.candidate.label() == "m64_n128_k64_s3|c128_x32_t256"   # same result
  measured = [e[1] for e in runner.events if e[0] == "measure"]
  for i, e in enumerate(runner.events):
    if e[0] == "measure":   # every measured candidate was asked for just before
      assert runner.events[i - 1][0] == "prefetch" and e[1] == runner.events[i - 1][1][0]
  prefetches = [e for e in runner.events if e[0] == "prefetch"]
  assert all(len(p[1]) <= 2 for p in prefetches)
  # the first prefetch asks for both stage-1 tilings and both references; later ones
  # never ask again for a reference already computed
  assert prefetches[0][1] == measured[:2] and sorted(prefetches[0][2]) == sorted(
      ["m128_n128_k64_s3_r1_w1", "m64_n128_k64_s3_r1_w1"])
  assert all(p[2] == [] for p in prefetches[2:])
  # after each stage, what was compiled ahead and not measured is dropped (none here)
  assert [e for e in runner.events if e[0] == "discard"] == [("discard", [])] * 2


def test_after_a_killed_run_the_search_compiles_one_at_a_time(capsys):
  clock = FakeClock()
  first = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=SPACE,
                 budget_s=1e9, progress=False, clock=clock).to_json()
  first["trials"][1]["status"] = "running"        # as a kill during that candidate leaves it
  runner = PrefetchingRunner(clock, _time_table)
  T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
         clock=clock, resume=first)
  assert not [e for e in runner.events if e[0] in ("prefetch", "discard")]
  assert "compiling one candidate at a time" in capsys.readouterr().err


def test_layer_runner_rejects_bad_compile_workers():
  with pytest.raises(ValueError, match="compile_workers=0"):
    T.LayerRunner(T.TuneProblem(64, 64, 128, 4, 2, 1), backend="pallas", compile_workers=0)


def test_never_picks_a_mismatching_candidate(tmp_path, capsys):
  fastest = "m64_n128_k64_s3|c128_x32_t256"
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table, bad={fastest})
  res = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
               clock=clock)
  assert fastest in runner.measured
  assert res.best.candidate.label() != fastest
  assert res.best.median_ms == 8.0
  assert [t.candidate.label() for t in res.mismatches] == [fastest]
  err = capsys.readouterr().err
  assert "BITWISE MISMATCH" in err and fastest in err
  assert "TRANSFER INCONSISTENCY" in err          # same KernelConfig, other transfers agree
  js = res.to_json()
  assert [m["label"] for m in js["mismatches"]] == [fastest]
  assert js["mismatches"][0]["bitwise_equal_to_reference"] is False
  assert not js["transfer_consistent"]
  assert fastest not in [t["label"] for t in js["top5"]]
  # a run with a mismatch writes no cache entry
  cache = tmp_path / "cache.json"
  assert T.record(res, cache) == "mismatch"
  assert not cache.exists()


def test_budget_failures_and_skips_are_counted():
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table, fail={"m64_n128_k64_s3|c128_x64_t256"}, cost_s=10.0)
  space = _space(block_m=(64, 128, 256), chunk_rows=(64, 128), num_ctas=(32, 64))
  # Stage 1 ends at 0.6 * 45 = 27 s: the default (reference + measure: t = 20 s),
  # then m64 (started at 20 < 27: reference + failed measure: t = 40 s); m256 is
  # skipped. Stage 2 (the default tiling's 3 other transfers) ends at 45 s: one
  # runs (t = 50 s), two are skipped.
  res = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=45.0, progress=False,
               clock=clock)
  counts = res.counts()
  assert (counts["ok"], counts["failed"], counts["skipped"]) == (2, 1, 3)
  assert len(res.trials) == 6 and counts["valid"] == 12
  assert res.elapsed_s == 50.0
  failed = [t for t in res.trials if t.status == "failed"][0]
  assert "compile failed" in failed.error
  assert all(t.error == "time budget" for t in res.trials if t.status == "skipped")
  assert res.best.candidate == T.DEFAULT_CANDIDATE
  # reference failures: the candidate is not timed and never picked
  clock2 = FakeClock()
  runner2 = FakeRunner(clock2, _time_table, bad_reference={"m64_n128_k64_s3_r1_w1"})
  res2 = T.tune(DEEPSEEK_BWD, runner2, device=HOPPER, space=SPACE, budget_s=1e9,
                progress=False, clock=clock2)
  assert res2.counts()["reference_failed"] == 1
  assert all(t.candidate.kernel.block_m == 128 for t in res2.trials if t.status == "ok")


def test_resume_reuses_timed_trials():
  clock = FakeClock()
  first = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=SPACE,
                 budget_s=2.0, progress=False, clock=clock)   # the default only
  assert first.counts()["ok"] == 1
  report = json.loads(json.dumps(first.to_json()))
  clock2 = FakeClock()
  runner = FakeRunner(clock2, _time_table)
  second = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9,
                  progress=False, clock=clock2, resume=report)
  assert T.DEFAULT_CANDIDATE.label() not in runner.measured
  assert "m128_n128_k64_s3_r1_w1" not in runner.referenced
  assert second.counts()["ok"] == len(second.trials) == 5
  with pytest.raises(ValueError, match="resume report key"):
    T.tune(dataclasses_replace(DEEPSEEK_BWD, direction="fwd"), runner, device=HOPPER,
           space=SPACE, progress=False, resume=report)


def test_a_candidate_that_never_finished_is_not_retried():
  clock = FakeClock()
  checkpoints = []
  T.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=SPACE, budget_s=1e9,
         progress=False, clock=clock, on_trial=lambda r: checkpoints.append(r.to_json()))
  # the checkpoint written just before the second candidate ran: as if the process died there
  killed = json.loads(json.dumps(checkpoints[2]))
  assert [t["status"] for t in killed["trials"]] == ["ok", "running"]
  runner = FakeRunner(FakeClock(), _time_table)
  res = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
               clock=runner.clock, resume=killed)
  label = killed["trials"][1]["label"]
  assert label not in runner.measured
  t = [t for t in res.trials if t.candidate.label() == label][0]
  assert t.status == "failed" and "did not finish" in t.error


def dataclasses_replace(obj, **kw):
  import dataclasses
  return dataclasses.replace(obj, **kw)


def test_tree_checksum_is_bit_and_position_sensitive():
  a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4).astype(jnp.bfloat16)
  base = T.tree_checksum({"a": a, "b": jnp.ones((5,), jnp.float32)})
  assert base == T.tree_checksum({"a": a, "b": jnp.ones((5,), jnp.float32)})
  assert base != T.tree_checksum({"a": a.at[1, 2].set(-a[1, 2]), "b": jnp.ones((5,))})
  assert base != T.tree_checksum({"a": a[::-1], "b": jnp.ones((5,), jnp.float32)})
  zero, neg_zero = jnp.zeros((2,), jnp.float32), -jnp.zeros((2,), jnp.float32)
  assert T.tree_checksum(zero) != T.tree_checksum(neg_zero)   # bits, not values


# ---------------------------------------------------------------------------
# Cache, lookup, heuristic, "auto" in moe_ffn
# ---------------------------------------------------------------------------
def _entry(kernel, transfer):
  k = dict(block_m=kernel.block_m, block_n=kernel.block_n, block_k=kernel.block_k,
           max_concurrent_steps=kernel.max_concurrent_steps)
  return dict(kernel=k, transfer=dict(chunk_rows=transfer.chunk_rows, col_tile=transfer.col_tile,
                                      num_ctas=transfer.num_ctas), median_ms=1.0)


def test_shipped_cache_is_valid_and_has_no_unmeasured_entries():
  data = json.load(open(T.SHIPPED_CACHE))
  assert data["format"] == T.CACHE_FORMAT
  for key, e in data["entries"].items():
    assert isinstance(e["median_ms"], float) and e["git_commit"] and e["date"]
    T._entry_candidate(e)


def test_cache_key_lookup_user_overrides_shipped(tmp_path, monkeypatch):
  shipped, user = tmp_path / "shipped.json", tmp_path / "user.json"
  monkeypatch.setattr(T, "SHIPPED_CACHE", shipped)
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  p = DEEPSEEK_BWD
  key = T.cache_key("NVIDIA H200", p)
  assert key == "NVIDIA H200|T=8192|H=7168|F=2048|E=256|K=8|bfloat16|ep=4|bwd"
  assert T.lookup(p, "NVIDIA H200") is None
  a = T.Candidate(KernelConfig(64, 128, 64, 3), TransferConfig(64, 256, 32))
  b = T.Candidate(KernelConfig(128, 256, 64, 2), TransferConfig(128, 128, 96))
  T.update_cache(shipped, key, _entry(a.kernel, a.transfer))
  assert T.lookup(p, "NVIDIA H200") == (a, os.fspath(shipped))
  assert T.lookup(p, "NVIDIA H100 80GB HBM3") is None               # other device kind
  assert T.lookup(dataclasses_replace(p, ep=2, experts=256), "NVIDIA H200") is None
  T.update_cache(user, key, _entry(b.kernel, b.transfer))
  monkeypatch.setenv(T.CACHE_ENV, os.fspath(user))
  assert T.lookup(p, "NVIDIA H200") == (b, os.fspath(user))        # user file wins
  assert T.lookup(p, "NVIDIA H200", cache_path=tmp_path / "none.json")[0] == a
  # a rewritten file is read again (mtime/size-keyed reader)
  T.update_cache(user, key, _entry(a.kernel, b.transfer))
  assert T.lookup(p, "NVIDIA H200")[0] == T.Candidate(a.kernel, b.transfer)


@pytest.fixture
def no_shipped_cache(tmp_path, monkeypatch):
  """An empty shipped cache, no user cache in the environment; (device, deepseek shape)."""
  monkeypatch.setattr(T, "SHIPPED_CACHE", tmp_path / "shipped.json")
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  return jax.devices()[0], dict(tokens=8192, hidden=7168, ffn=2048, experts=256, top_k=8, ep=4,
                                dtype=jnp.bfloat16)


def test_resolve_config_auto_vs_explicit(tmp_path, no_shipped_cache):
  dev, shape = no_shipped_cache
  auto = UniEPConfig(backend="uniep", kernel=None, transfer=None)
  # no entry: the heuristic (the defaults on the target shapes)
  r = T.resolve_config(auto, device=dev, **shape)
  assert (r.kernel, r.transfer) == (KernelConfig(), TransferConfig(128, 256, 64))
  fwd_key = T.cache_key(dev.device_kind, dataclasses_replace(DEEPSEEK_BWD, direction="fwd"))
  bwd_key = T.cache_key(dev.device_kind, DEEPSEEK_BWD)
  fwd_c = T.Candidate(KernelConfig(64, 128, 64, 2), TransferConfig(32, 128, 16))
  bwd_c = T.Candidate(KernelConfig(128, 256, 64, 2), TransferConfig(64, 256, 96))
  user = tmp_path / "user.json"
  T.update_cache(user, fwd_key, _entry(fwd_c.kernel, fwd_c.transfer))
  r = T.resolve_config(auto, device=dev, cache_path=user, **shape)
  assert (r.kernel, r.transfer) == (fwd_c.kernel, fwd_c.transfer)
  T.update_cache(user, bwd_key, _entry(bwd_c.kernel, bwd_c.transfer))
  r = T.resolve_config(auto, device=dev, cache_path=user, **shape)   # "bwd" first
  assert (r.kernel, r.transfer) == (bwd_c.kernel, bwd_c.transfer)
  # explicit fields are kept; only the None ones are filled
  mine = KernelConfig(64, 256, 128, 3)
  r = T.resolve_config(UniEPConfig(backend="uniep", kernel=mine, transfer=None), device=dev,
                       cache_path=user, **shape)
  assert r.kernel is mine and r.transfer == bwd_c.transfer
  explicit = UniEPConfig(backend="uniep")
  assert T.resolve_config(explicit, device=dev, cache_path=user, **shape) is explicit
  with pytest.raises(ValueError, match="KernelConfig or None"):
    UniEPConfig(kernel=dict(block_m=64))


def test_heuristic_rules():
  tiny = T.TuneProblem(64, 64, 128, 4, 2, 1)
  h = T.heuristic_config(tiny, HOPPER)
  assert h.transfer == TransferConfig(chunk_rows=32, col_tile=64, num_ctas=64)
  assert T.heuristic_config(tiny, dataclasses_replace(HOPPER, num_sms=16)).transfer.num_ctas == 8
  # a device with too little shared memory for the default tiling gets a tiling that fits
  small = dataclasses_replace(HOPPER, smem_bytes=100 * 1024)   # da (f32 out) needs 113 KiB
  h = T.heuristic_config(DEEPSEEK_BWD, small)
  assert h.kernel != KernelConfig()
  T.kernel_launch_stages(h.kernel, DEEPSEEK_BWD, small.smem_bytes)


def test_moe_ffn_auto_uses_the_cache(tmp_path, monkeypatch):
  """kernel=None inside moe_ffn resolves from the user cache (EP = 1, CPU); the
  grouped GEMM is replaced by ragged_dot to keep the test fast."""
  from uniep_jax import moe as moe_lib
  seen = []

  def fake_swiglu(x, w_gate_up, w_down, group_sizes, *, kernel_config, **_):
    seen.append(kernel_config)
    return moe_lib.swiglu_ragged_dot(x, w_gate_up, w_down, group_sizes)

  monkeypatch.setattr(moe_lib, "swiglu_pallas", fake_swiglu)
  monkeypatch.setattr(T, "SHIPPED_CACHE", tmp_path / "shipped.json")
  mesh = make_mesh(1, 1)
  p = make_params(jax.random.key(0), experts=4, hidden=64, ffn=128, dtype=jnp.bfloat16)
  x = make_x(jax.random.key(1), 32, 64, jnp.bfloat16)
  problem = T.TuneProblem(32, 64, 128, 4, 2, 1, "bfloat16", "bwd")
  tuned = KernelConfig(64, 256, 128, 2)
  user = tmp_path / "user.json"
  T.update_cache(user, T.cache_key(jax.devices()[0].device_kind, problem),
                 _entry(tuned, TransferConfig(32, 64, 8)))
  monkeypatch.setenv(T.CACHE_ENV, os.fspath(user))
  # jitted: the config is resolved while tracing (op-by-op dispatch of the layer on 8
  # virtual devices took ~35 s of the suite)
  layer = lambda cfg: jax.jit(lambda x, p: uniep_jax.moe_ffn(x, p, mesh=mesh, top_k=2,  # noqa: E731
                                                             config=cfg)[0])(x, p)
  layer(UniEPConfig(backend="pallas", kernel=None, transfer=None))
  assert seen[-1] == tuned
  layer(UniEPConfig(backend="pallas", kernel=KernelConfig(num_sms=4)))
  assert seen[-1] == KernelConfig(num_sms=4)


# ---------------------------------------------------------------------------
# End to end: the CLI on backend "pallas" (Mosaic GPU interpret mode), tiny shape
# ---------------------------------------------------------------------------
def test_cli_end_to_end_interpret(tmp_path, monkeypatch):
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  out, cache = tmp_path / "out", tmp_path / "cache.json"
  rc = T.main(["--shape", "64,64,128,4,2", "--ep", "1", "--direction", "fwd",
               "--backend", "pallas", "--num-sms", "2", "--trials", "1", "--max-candidates", "1",
               "--budget-s", "300", "--out", os.fspath(out), "--cache", os.fspath(cache),
               "--no-progress", "--compile-workers", "2"])   # the threaded compile path
  assert rc == 0
  kind = jax.devices()[0].device_kind
  stem = out / (T.report_stem(kind, "64x64x128x4x2", 1, "fwd"))
  report = json.load(open(f"{stem}.json"))
  assert os.path.getsize(f"{stem}.png") > 0
  assert report["counts"]["ok"] == 1 and report["counts"]["mismatch"] == 0
  best = report["best"]
  assert best["bitwise_equal_to_reference"] is True and best["median_ms"] > 0
  assert best["label"] == T.DEFAULT_CANDIDATE.label()
  assert report["counts"]["skipped"] == 0
  problem = T.TuneProblem(64, 64, 128, 4, 2, 1, "bfloat16", "fwd")
  found = T.lookup(problem, kind, cache_path=cache)
  assert found is not None and found[0].kernel == KernelConfig()
  entry = json.load(open(cache))["entries"][T.cache_key(kind, problem)]
  assert entry["median_ms"] == best["median_ms"]


def _fused_times(cand):
  # v1 default 10 ms; fused n_comm=32: 6 ms, n_comm=16: 9 ms
  if cand.fused is None:
    return 10.0
  return 6.0 if cand.fused.n_comm == 32 else 9.0


def test_stage3_tries_the_fused_kernels_verified_and_pruned():
  space = _space(fused=((16, 2048), (32, 1024), (200, 2048), (32, 1000)))
  clock = FakeClock()
  res = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _fused_times), device=HOPPER, space=space,
               budget_s=1e9, progress=False, clock=clock)
  fused = [t for t in res.trials if t.stage == "fused"]
  assert [t.candidate.label() for t in fused] == [
      "m128_n128_k64_s3|c128_x64_t256|f16_b2048", "m128_n128_k64_s3|c128_x64_t256|f32_b1024"]
  reasons = _reasons(res.enumeration)
  assert any("n_comm=200 must be < num_sms=132" in r for r in reasons)
  assert any("recv_chunk_rows=1000 must be a multiple of block_m=128" in r for r in reasons)
  assert res.best.candidate.fused == uniep_jax.FusedConfig(n_comm=32, recv_chunk_rows=1024)
  entry = T.cache_entry(res)
  # every field of the winner's FusedConfig (the others at their defaults)
  assert entry["fused"] == dataclasses.asdict(
      uniep_jax.FusedConfig(n_comm=32, recv_chunk_rows=1024))
  assert entry["fused"]["n_comm"] == 32 and entry["fused"]["return_in_kernel"] is True
  assert T._entry_candidate(json.loads(json.dumps(entry))) == res.best.candidate
  # a fused candidate that does not give pallas's bits is never picked
  clock = FakeClock()
  bad = "m128_n128_k64_s3|c128_x64_t256|f32_b1024"
  res = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _fused_times, bad=(bad,)), device=HOPPER,
               space=space, budget_s=1e9, progress=False, clock=clock)
  assert [t.candidate.label() for t in res.mismatches] == [bad]
  assert res.best.candidate.label() == "m128_n128_k64_s3|c128_x64_t256|f16_b2048"


def test_stage3_points_with_returns_beside_the_gemms():
  """v2.2's fields (the dX return beside the wgrad, Kernel C) are stage-3 knobs: in the
  labels, cached, and pruned by their own checks (CTAs left for the GEMM)."""
  space = _space(fused=((16, 2048, False, False, 16), (16, 2048, False, False, 200),
                        (16, 2048, False, False, 16, 16), (16, 2048, False, False, 0, 132)))
  clock = FakeClock()
  res = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _fused_times), device=HOPPER, space=space,
               budget_s=1e9, progress=False, clock=clock)
  fused = [t for t in res.trials if t.stage == "fused"]
  assert [t.candidate.label() for t in fused] == [
      "m128_n128_k64_s3|c128_x64_t256|f16_b2048_v1ret_rbw16",
      "m128_n128_k64_s3|c128_x64_t256|f16_b2048_v1ret_dr16_rbw16"]
  reasons = _reasons(res.enumeration)
  assert any("wgrad_return_ctas=200 must be < num_sms=132" in r for r in reasons)
  assert any("down_return_ctas=132 must be < num_sms=132" in r for r in reasons)
  entry = T.cache_entry(res)
  assert T._entry_candidate(json.loads(json.dumps(entry))) == res.best.candidate
  assert res.best.candidate.fused.wgrad_return_ctas == 16


def test_stages_fused_only_times_the_default_then_the_fused_points():
  space = _space(block_m=(64, 128), num_ctas=(32, 64), fused=((16, 2048), (32, 1024)))
  clock = FakeClock()
  res = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _fused_times), device=HOPPER, space=space,
               budget_s=1e9, progress=False, clock=clock, stages=("fused",))
  timed = [(t.stage, t.candidate.label()) for t in res.trials]
  assert timed == [("kernel", T.DEFAULT_CANDIDATE.label()),
                   ("fused", "m128_n128_k64_s3|c128_x64_t256|f16_b2048"),
                   ("fused", "m128_n128_k64_s3|c128_x64_t256|f32_b1024")]
  assert res.spread()["default_over_best"] == 10.0 / 6.0
  report = json.loads(json.dumps(res.to_json()))
  assert report["stages"] == ["fused"]
  # the saved report replays to the same trials (no stage 1/2 candidates appear skipped),
  # with its own stage-3 points (not SearchSpace()'s)
  again = T.replay(report)
  assert [(t.stage, t.candidate.label(), t.status) for t in again.trials] == [
      (t.stage, t.candidate.label(), t.status) for t in res.trials]
  # a later full run resumes from it: only what it lacks is timed
  clock = FakeClock()
  runner = FakeRunner(clock, _fused_times)
  full = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9,
                progress=False, clock=clock, resume=report)
  assert T.DEFAULT_CANDIDATE.label() not in runner.measured
  assert sorted(runner.measured) == ["m128_n128_k64_s3|c128_x32_t256",
                                     "m64_n128_k64_s3|c128_x64_t256"]
  with pytest.raises(ValueError, match="stages"):
    T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9, progress=False,
           clock=clock, stages=("fusd",))


def test_resuming_with_fewer_stages_keeps_the_earlier_trials_and_best():
  """A `--stages fused` run resuming a full search keeps that search's trials in its
  report, builds stage 3 on its best tiling, and so never records a worse best."""
  space = dataclasses.replace(SPACE, fused=((16, 2048),))
  clock = FakeClock()
  full = T.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=space,
                budget_s=1e9, progress=False, clock=clock, stages=("kernel", "transfer"))
  report = json.loads(json.dumps(full.to_json()))
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table)
  again = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9,
                 progress=False, clock=clock, stages=("fused",), resume=report)
  assert again.best.median_ms == full.best.median_ms == 7.0
  assert {t.candidate.label() for t in full.trials} <= {t.candidate.label() for t in again.trials}
  # the one new candidate: the fused point on the best candidate found before
  assert runner.measured == [full.best.candidate.label() + "|f16_b2048"]


def test_raster_variants_are_checked_against_the_row_major_reference():
  """raster_rows only reorders the tiles: every candidate is verified against the
  "pallas" reference of its tiling walked row-major (raster_rows=1), so a tile-order
  bug shows as a mismatch, and the auto default and the bands share one reference."""
  space = _space(raster_rows=(None, 16))
  clock = FakeClock()
  runner = FakeRunner(clock, lambda c: 9.0 if c.kernel.raster_rows == 16 else 10.0)
  res = T.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9, progress=False,
               clock=clock)
  assert [t.candidate.label() for t in res.trials if t.stage == "kernel"] == [
      "m128_n128_k64_s3|c128_x64_t256", "m128_n128_k64_s3_r16|c128_x64_t256"]
  assert runner.referenced == ["m128_n128_k64_s3_r1_w1"]
  assert res.best.candidate.kernel == KernelConfig(raster_rows=16)
  assert T.candidate_from_knobs(res.best.candidate.knobs()) == res.best.candidate
  clock = FakeClock()
  bad = FakeRunner(clock, lambda c: 9.0, bad=("m128_n128_k64_s3_r16|c128_x64_t256",))
  res = T.tune(DEEPSEEK_BWD, bad, device=HOPPER, space=space, budget_s=1e9, progress=False,
               clock=clock)
  assert [t.candidate.label() for t in res.mismatches] == ["m128_n128_k64_s3_r16|c128_x64_t256"]


def test_reports_from_before_raster_rows_are_not_resumed(tmp_path, monkeypatch, capsys):
  """A report whose trials lack raster_rows (or wgrad_raster) timed the row-major order
  (of the row tiles, or of the wgrad tiles); today the same labels mean the auto order:
  the CLI does not resume from it. One with both knobs is resumed."""
  stem = T.report_stem(HOPPER.kind, "64x64x128x4x2", 1, "fwd")
  old = dict(key="x", trials=[dict(label="m128_n128_k64_s3|c128_x64_t256",
                                   knobs=dict(block_m=128))], meta={})
  seen = {}

  def fake_tune(problem, runner, **kw):
    seen["resume"] = kw["resume"]
    raise SystemExit(0)

  monkeypatch.setattr(T, "tune", fake_tune)
  monkeypatch.setattr(T.DeviceFacts, "from_device", classmethod(lambda cls, **_: HOPPER))
  monkeypatch.setattr(T, "LayerRunner", lambda *a, **k: type("R", (), {"close": lambda *_, **__: None})())

  def resumed_from(report):
    (tmp_path / f"{stem}.json").write_text(json.dumps(report))
    seen.clear()
    with pytest.raises(SystemExit):
      T.main(["--shape", "64,64,128,4,2", "--ep", "1", "--direction", "fwd",
              "--resume", str(tmp_path), "--out", str(tmp_path / "out")])
    return seen["resume"]

  assert resumed_from(old) is None
  assert "made before KernelConfig.raster_rows" in capsys.readouterr().out
  old["trials"][0]["knobs"]["raster_rows"] = None
  assert resumed_from(old) is None
  assert "made before KernelConfig.wgrad_raster" in capsys.readouterr().out
  old["trials"][0]["knobs"]["wgrad_raster"] = None
  old["meta"] = dict(xla_flags=os.environ.get("XLA_FLAGS", ""))
  assert resumed_from(old) is not None


def test_parse_fused_points():
  assert T.parse_fused_points("32,2048; 16,2048,0,1;") == ((32, 2048), (16, 2048, False, True))
  # every field of FusedConfig: the point without Kernel A
  assert T.parse_fused_points("16,2048,0,0,16,16,0") == ((16, 2048, False, False, 16, 16, False),)
  # (a 12th field: FusedConfig has 11, the last four Kernel D's)
  for bad in ("32", "32,2048,2,0", "a,2048", "16,2048,0,0,16,16,2",
              "16,2048,0,0,16,16,0,16,32,3,50,1"):
    with pytest.raises(ValueError, match="--fused-points"):
      T.parse_fused_points(bad)


def test_stage3_fused_backward_points_only_when_the_backward_is_timed():
  space = _space(fused=((32, 2048, False, False), (32, 2048, False, True)))
  labels = {}
  for problem in (DEEPSEEK_BWD, dataclasses.replace(DEEPSEEK_BWD, direction="fwd")):
    base = T.DEFAULT_CANDIDATE
    valid, rejected = T.fused_candidates(space, base, problem, HOPPER)
    assert not rejected
    labels[problem.direction] = [c.label() for c in valid]
    # labels and cache knobs round-trip the two new fields
    for c in valid:
      assert T.candidate_from_knobs(c.knobs()) == c
  assert labels["bwd"] == ["m128_n128_k64_s3|c128_x64_t256|f32_b2048_v1ret",
                           "m128_n128_k64_s3|c128_x64_t256|f32_b2048_v1ret_fbwd"]
  assert labels["fwd"] == labels["bwd"][:1]
  # a report from before the two knobs replays with FusedConfig's defaults
  old = dict(T.DEFAULT_CANDIDATE.knobs(), n_comm=32, recv_chunk_rows=2048)
  assert T.candidate_from_knobs(old).fused == uniep_jax.FusedConfig(32, 2048)


def test_stage3_point_without_kernel_a_is_timed_deduplicated_only():
  """A fused point with dispatch_in_kernel=False (the forward's dispatch de-duplicated
  instead of Kernel A) is one candidate, with dedup_tokens, whatever the space's
  dedup_tokens; its label and knobs round-trip; without dedup it is no candidate."""
  point = (16, 2048, False, False, 16, 16, False)
  for dedup in ((True,), ()):
    valid, rejected = T.fused_candidates(_space(fused=(point,), dedup_tokens=dedup),
                                         T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, HOPPER)
    assert not rejected
    fused = [c for c in valid if c.fused is not None]   # (+ the v1 base with dedup)
    assert [c.label() for c in fused] == [
        "m128_n128_k64_s3|c128_x64_t256|f16_b2048_v1ret_dr16_rbw16_noA|dd"]
    assert T.candidate_from_knobs(fused[0].knobs()) == fused[0]
  knobs = dict(T.DEFAULT_CANDIDATE.knobs(), **dict(zip(T.FUSED_KNOBS, point)))
  with pytest.raises(T.InvalidCandidate, match="dispatch_in_kernel=False .* needs dedup_tokens"):
    T.candidate_from_knobs(knobs)
  # Kernel A's checks apply only where Kernel A runs: n_comm (its transfer CTAs) as large
  # as the device's SMs rejects the point with Kernel A, not the one without
  many = (132, 2048, False, False, 16, 16)
  for in_kernel, ok in ((True, False), (False, True)):
    valid, rejected = T.fused_candidates(_space(fused=(many + (in_kernel,),), dedup_tokens=(True,)),
                                         T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, HOPPER)
    assert (not rejected) == ok, rejected
    assert ok or "n_comm=132 must be < num_sms=132" in str(rejected)


def test_stage3_times_each_dedup_candidate_with_the_expansion_in_the_transfer(tmp_path):
  """SearchSpace.expand_in_transfer: every de-duplicated stage-3 candidate (v1 + dedup,
  fused + dedup) is also timed with TransferConfig.expand_in_transfer; label, knobs and
  cache entry round-trip; it is no candidate without dedup or where its CTAs do not fit."""
  point = (16, 2048, False, False, 16, 16, False)
  valid, rejected = T.fused_candidates(
      _space(fused=(point,), dedup_tokens=(True,), expand_in_transfer=(True,)),
      T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, HOPPER)
  assert not rejected
  assert [c.label() for c in valid] == [
      "m128_n128_k64_s3|c128_x64_t256|f16_b2048_v1ret_dr16_rbw16_noA|dd",
      "m128_n128_k64_s3|c128_x64_t256|dd",
      "m128_n128_k64_s3|c128_x64_t256_te|f16_b2048_v1ret_dr16_rbw16_noA|dd",
      "m128_n128_k64_s3|c128_x64_t256_te|dd"]
  for cand in valid:
    assert T.candidate_from_knobs(cand.knobs()) == cand
  te = valid[2]
  assert te.transfer.expand_in_transfer and te.transfer == dataclasses.replace(
      TransferConfig(), expand_in_transfer=True)
  # a cache entry keeps it
  entry = dict(transfer=dataclasses.asdict(te.transfer), kernel=dataclasses.asdict(te.kernel),
               fused=dataclasses.asdict(te.fused), dedup_tokens=True)
  assert T._entry_candidate(entry) == te
  # not without de-duplication
  with pytest.raises(T.InvalidCandidate, match="expand_in_transfer .* needs dedup_tokens"):
    T.candidate_from_knobs(dict(T.DEFAULT_CANDIDATE.knobs(), expand_in_transfer=True))
  # not where the transfer's and the expansion's CTAs cannot all be resident
  small = dataclasses.replace(HOPPER, num_sms=100)
  valid, rejected = T.fused_candidates(_space(dedup_tokens=(True,), expand_in_transfer=(True,)),
                                       T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, small)
  assert [c.label() for c in valid] == ["m128_n128_k64_s3|c128_x64_t256|dd"]
  assert "num_ctas=64 + copy_ctas=64 CTAs must all be resident (at most 100 SMs)" in (
      rejected[0]["reason"])
  # off: no such candidate
  valid, _ = T.fused_candidates(_space(dedup_tokens=(True,)), T.DEFAULT_CANDIDATE,
                                DEEPSEEK_BWD, HOPPER)
  assert not any(c.transfer.expand_in_transfer for c in valid)

def test_stage3_kernel_d_points_carry_their_send_groups(tmp_path, no_shipped_cache):
  """A fused point with Kernel D (overlap_copy_ctas): one de-duplicated candidate whose
  send groups follow OVERLAP_SEND_GROUPS, labelled, round-tripped through knobs and the
  cache, resolved for a fully auto config (dedup_send_groups with it), never paired with
  expand_in_transfer where Kernel D moves every dispatch, pruned where its CTAs leave no
  GEMM CTA; the forward run drops the backward's copy CTAs."""
  point = (16, 2048, False, False, 16, 16, False, 16, 32)
  valid, rejected = T.fused_candidates(
      _space(fused=(point,), dedup_tokens=(True,), expand_in_transfer=(True,)),
      T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, HOPPER)
  assert not rejected
  kd = [c for c in valid if c.fused is not None]
  assert [c.label() for c in kd] == [
      "m128_n128_k64_s3|c128_x64_t256|f16_b2048_v1ret_dr16_rbw16_noA_ov16_ovb32|dd|sg8"]
  assert kd[0].send_groups == 8 == T.overlap_send_groups(DEEPSEEK_BWD.experts // DEEPSEEK_BWD.ep)
  assert T.candidate_from_knobs(kd[0].knobs()) == kd[0]
  assert T.overlap_send_groups(12) == 4 and T.overlap_send_groups(2) == 2
  # (the v1 base with dedup keeps its expand_in_transfer twin)
  assert any(c.fused is None and c.transfer.expand_in_transfer for c in valid)
  fwd = dataclasses.replace(DEEPSEEK_BWD, direction="fwd")
  valid_fwd, _ = T.fused_candidates(_space(fused=(point,), dedup_tokens=(True,)),
                                    T.DEFAULT_CANDIDATE, fwd, HOPPER)
  assert [c.fused.overlap_copy_ctas_bwd for c in valid_fwd if c.fused is not None] == [0]
  # 16 transfer + 120 copy CTAs leave no GEMM CTA on 132 SMs
  _, rejected = T.fused_candidates(_space(fused=((16, 2048, False, False, 16, 16, False, 120),)),
                                   T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, HOPPER)
  assert "must leave GEMM CTAs" in rejected[0]["reason"]
  # cache entry -> fully auto config: the fused point with its send groups
  entry = dict(kernel=dataclasses.asdict(kd[0].kernel), transfer=dataclasses.asdict(kd[0].transfer),
               fused=dataclasses.asdict(kd[0].fused), dedup_tokens=True, dedup_send_groups=8)
  assert T._entry_candidate(json.loads(json.dumps(entry))) == kd[0]
  dev, shape = no_shipped_cache
  user = tmp_path / "user.json"
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD), entry)
  auto = UniEPConfig(backend="uniep", kernel=None, transfer=None)
  r = T.resolve_config(auto, device=dev, cache_path=user, **shape)
  assert (r.fused, r.dedup_tokens, r.dedup_send_groups) == (kd[0].fused, True, 8)
  # a config that names its fused kernels keeps them, and its own send groups
  mine = dataclasses.replace(auto, fused=uniep_jax.FusedConfig(n_comm=8))
  r = T.resolve_config(mine, device=dev, cache_path=user, **shape)
  assert (r.fused, r.dedup_send_groups) == (mine.fused, 1)
  assert T.parse_fused_points("16,2048,0,0,16,16,0,16,32,3,50") == (
      (16, 2048, False, False, 16, 16, False, 16, 32, 3, 50),)

def test_stage3_tries_token_dedup_on_the_v1_winner(tmp_path, no_shipped_cache):
  """SearchSpace.dedup_tokens: stage 3 times the best v1 candidate with token
  de-duplication too, and every fused point without a fused backward with it (its dy
  dispatch de-duplicated); a dedup winner is labelled, cached and resolved for a fully
  auto uniep config; an explicit dedup_tokens=True takes a cached fused winner unless
  that one has a fused backward (which moves the dy dispatch itself): then v1."""
  space = _space(fused=((16, 2048), (16, 2048, False, True)), dedup_tokens=(True,))
  clock = FakeClock()
  times = lambda cand: ((5.0 if cand.fused is None else 5.5) if cand.dedup_tokens  # noqa: E731
                        else _fused_times(cand))
  res = T.tune(DEEPSEEK_BWD, FakeRunner(clock, times), device=HOPPER, space=space,
               budget_s=1e9, progress=False, clock=clock)
  fused = [t.candidate.label() for t in res.trials if t.stage == "fused"]
  assert fused == ["m128_n128_k64_s3|c128_x64_t256|f16_b2048",
                   "m128_n128_k64_s3|c128_x64_t256|f16_b2048|dd",
                   "m128_n128_k64_s3|c128_x64_t256|f16_b2048_v1ret_fbwd",
                   "m128_n128_k64_s3|c128_x64_t256|dd"]
  assert res.best.candidate.dedup_tokens and res.best.candidate.fused is None
  assert T.candidate_from_knobs(res.best.candidate.knobs()) == res.best.candidate
  both = T.candidate_from_knobs(dict(res.best.candidate.knobs(), n_comm=16, recv_chunk_rows=2048))
  assert both.dedup_tokens and both.fused == uniep_jax.FusedConfig(16, 2048)
  with pytest.raises(T.InvalidCandidate, match="fused backward"):
    T.candidate_from_knobs(dict(res.best.candidate.knobs(), n_comm=16, recv_chunk_rows=2048,
                                return_in_kernel=False, backward=True))
  entry = json.loads(json.dumps(T.cache_entry(res)))
  assert entry["dedup_tokens"] is True and T._entry_candidate(entry) == res.best.candidate
  dev, shape = no_shipped_cache
  user = tmp_path / "user.json"
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD), entry)
  auto = UniEPConfig(backend="uniep", kernel=None, transfer=None)
  assert T.resolve_config(auto, device=dev, cache_path=user, **shape).dedup_tokens
  r = T.resolve_config(UniEPConfig(backend="uniep", kernel=KernelConfig(), transfer=None),
                       device=dev, cache_path=user, **shape)
  assert r.dedup_tokens is None   # not fully auto: the tuned point is not taken, auto stays
  r = T.resolve_config(dataclasses.replace(auto, dedup_tokens=False), device=dev,
                       cache_path=user, **shape)
  assert r.dedup_tokens is False   # an explicit False stays
  # an entry from before the knob: no dedup
  del entry["dedup_tokens"]
  assert not T._entry_candidate(entry).dedup_tokens
  # a fused winner and an explicit dedup_tokens=True: both (the dy dispatch de-duplicated)
  entry["fused"] = dict(n_comm=32, recv_chunk_rows=2048)
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD), entry)
  r = T.resolve_config(dataclasses.replace(auto, dedup_tokens=True), device=dev, cache_path=user,
                       **shape)
  assert r.dedup_tokens and r.fused == uniep_jax.FusedConfig(32, 2048)
  # ... but a fused winner with the fused backward: the user's v1 dispatch wins
  entry["fused"] = dict(n_comm=32, recv_chunk_rows=2048, return_in_kernel=False, backward=True)
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD), entry)
  r = T.resolve_config(dataclasses.replace(auto, dedup_tokens=True), device=dev, cache_path=user,
                       **shape)
  assert r.dedup_tokens and r.fused is None


def test_resolve_config_takes_a_fused_winner_only_when_fully_auto(tmp_path, no_shipped_cache):
  dev, shape = no_shipped_cache
  user = tmp_path / "user.json"
  entry = dict(_entry(KernelConfig(), TransferConfig()), fused=dict(n_comm=32, recv_chunk_rows=2048))
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD), entry)
  auto = UniEPConfig(backend="uniep", kernel=None, transfer=None)
  r = T.resolve_config(auto, device=dev, cache_path=user, **shape)
  assert r.fused == uniep_jax.FusedConfig(32, 2048)
  r = T.resolve_config(UniEPConfig(backend="uniep", kernel=KernelConfig(), transfer=None),
                       device=dev, cache_path=user, **shape)
  assert r.fused is None and r.transfer == TransferConfig()
  r = T.resolve_config(UniEPConfig(backend="pallas", kernel=None, transfer=None), device=dev,
                       cache_path=user, **shape)
  assert r.fused is None
  # a winner with the fused backward serves a config that keeps XLA's SwiGLU derivative
  # with the fused forward only (the fused backward needs the derivative in the kernel)
  entry["fused"] = dict(n_comm=32, recv_chunk_rows=2048, return_in_kernel=False, backward=True)
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD), entry)
  r = T.resolve_config(auto, device=dev, cache_path=user, **shape)
  assert r.fused == uniep_jax.FusedConfig(32, 2048, False, True)
  r = T.resolve_config(dataclasses.replace(auto, swiglu_grad_in_kernel=False), device=dev,
                       cache_path=user, **shape)
  assert r.fused == uniep_jax.FusedConfig(32, 2048, False, False)
  # a winner without Kernel A (de-duplicated by construction) serves auto and an explicit
  # dedup_tokens=True; an explicit False keeps v1's kernels instead of failing
  no_a = dict(n_comm=16, recv_chunk_rows=2048, return_in_kernel=False, down_return_ctas=16,
              wgrad_return_ctas=16, dispatch_in_kernel=False)
  T.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD),
                 dict(entry, fused=no_a, dedup_tokens=True))
  for dedup in (None, True):
    r = T.resolve_config(dataclasses.replace(auto, dedup_tokens=dedup), device=dev,
                         cache_path=user, **shape)
    assert r.fused == uniep_jax.FusedConfig(**no_a) and r.use_dedup_tokens
  r = T.resolve_config(dataclasses.replace(auto, dedup_tokens=False), device=dev,
                       cache_path=user, **shape)
  assert r.fused is None and not r.use_dedup_tokens


def test_replay_of_a_saved_report_records_what_that_run_measured(tmp_path):
  """--record-from: a GPU run's report (4x H100, killed before it wrote its cache
  entry) replayed on the CPU gives that run's best and default (the default was 4
  stages then, 3 now), and the entry names the run's commit and date."""
  import json
  import os
  report_path = os.path.join(os.path.dirname(__file__), "..", "bench", "results", "tune",
                             "tune_NVIDIA_H100_80GB_HBM3_mixtral-like_ep4_fwd.json")
  with open(report_path) as f:
    report = json.load(f)
  res = T.replay(report)
  assert res.best.candidate.label() == report["best"]["label"]
  assert res.default.label() == report["default"] == "m128_n128_k64_s4|c128_x64_t256"
  assert res.spread()["default_ms"] == pytest.approx(report["spread"]["default_ms"])
  assert res.counts()["mismatch"] == 0 and res.counts()["ok"] == report["counts"]["ok"]
  cache = tmp_path / "cache.json"
  assert T.main(["--record-from", report_path, "--cache", str(cache)]) == 0
  (entry,) = json.loads(cache.read_text())["entries"].values()
  assert entry["git_commit"] == report["meta"]["git_commit"]
  assert entry["date"] == report["meta"]["date"]
  assert entry["median_ms"] == pytest.approx(report["best"]["median_ms"])
