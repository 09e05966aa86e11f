"""The tuning space and cache (uniep_jax/tuning.py) and the autotuner
(uniep_jax/autotune.py) on the CPU: enumeration and pruning, the overlap points, the
cache and "auto" resolution, the never-pick-a-mismatch rule, budget and skip
accounting (injected runners and clocks), replay of a saved report, and one end-to-end
run of the CLI on backend "pallas" in the Mosaic GPU interpret mode."""

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import pytest

import uniep_jax
from uniep_jax import KernelConfig, OverlapConfig, TransferConfig, UniEPConfig
from uniep_jax import autotune as AT
from uniep_jax import tuning as T
from uniep_jax.measure import tree_checksum
from conftest import make_mesh
from moe_testlib import make_params, make_x

HOPPER = T.DeviceFacts(kind="NVIDIA H200", smem_bytes=227 * 1024, num_sms=132)
DEEPSEEK_BWD = T.TuneProblem(8192, 7168, 2048, 256, 8, 4, "bfloat16", "bwd")
DEEPSEEK_FWD = dataclasses.replace(DEEPSEEK_BWD, direction="fwd")


def _space(**kw):
  base = dict(block_m=(128,), block_n=(128,), block_k=(64,), max_concurrent_steps=(3,),
              raster_rows=(None,), wgrad_raster=(None,), chunk_rows=(128,), num_ctas=(64,),
              col_tile=(256,), overlap=())
  base.update(kw)
  return T.SearchSpace(**base)


def _reasons(enum):
  return [r["reason"] for r in enum.rejected]


# ---------------------------------------------------------------------------
# Enumeration and pruning
# ---------------------------------------------------------------------------
def test_default_tiling_stages_match_the_kernel_docstring():
  # grouped_gemm.py: a 128/128/64 stage is 48 KiB, epilogue 2 x 16 KiB (bf16),
  # 227 KiB per block: 4 stages fit; the da launch ("dswiglu": 2 x 2 x 16 KiB of h/u
  # buffers) clamps to 3.
  s4 = KernelConfig(max_concurrent_steps=4)
  stages = T.kernel_launch_stages(s4, DEEPSEEK_BWD, HOPPER.smem_bytes)
  # swiglu, down, da (dswiglu), dx (plain, K = 2F), wgrad
  assert stages == (4, 4, 3, 4, 4)
  assert T.kernel_launch_stages(s4, DEEPSEEK_FWD, HOPPER.smem_bytes) == (4, 4)
  # the default (3 stages, measured faster) fits every launch unclamped
  assert T.kernel_launch_stages(KernelConfig(), DEEPSEEK_BWD, HOPPER.smem_bytes) == (3,) * 5
  # a tiling whose forward fits and whose da does not: rejected for "bwd" only, naming it
  big = KernelConfig(256, 128, 128, 1)
  assert T.kernel_launch_stages(big, DEEPSEEK_FWD, HOPPER.smem_bytes) == (1, 1)
  with pytest.raises(T.InvalidCandidate, match="bwd da \\(dswiglu\\) with block_m=256"):
    T.kernel_launch_stages(big, DEEPSEEK_BWD, HOPPER.smem_bytes)


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
    assert c.overlap is None                             # overlap points are stage 3's


def test_check_candidate_raises_clear_errors():
  too_big = T.Candidate(KernelConfig(256, 256, 128), TransferConfig())
  with pytest.raises(T.InvalidCandidate, match="shared memory.*over the device's 232448 B"):
    T.check_candidate(too_big, DEEPSEEK_BWD, HOPPER)
  tiny = T.TuneProblem(64, 64, 128, 4, 2, 1)
  with pytest.raises(T.InvalidCandidate, match="not divisible by col_tile=256"):
    T.check_candidate(T.DEFAULT_CANDIDATE, tiny, HOPPER)
  # without the NVLink transport the transfer knobs are not checked
  T.check_candidate(T.DEFAULT_CANDIDATE, tiny, HOPPER, uses_transfer=False)
  # the NVLink transport zeroes ZERO_WINDOW_ROWS rows after the live ones: no longer step
  deep = T.Candidate(KernelConfig(block_k=512, max_concurrent_steps=1), TransferConfig())
  roomy = dataclasses.replace(HOPPER, smem_bytes=1 << 24)
  T.check_candidate(deep, DEEPSEEK_BWD, roomy, uses_transfer=False)
  with pytest.raises(T.InvalidCandidate, match="block_k=512 exceeds the 256 zeroed rows"):
    T.check_candidate(deep, DEEPSEEK_BWD, roomy)
  with pytest.raises(ValueError, match="direction"):
    T.TuneProblem(64, 64, 128, 4, 2, 1, direction="sideways")
  with pytest.raises(ValueError, match="divisible by ep"):
    T.TuneProblem(64, 64, 128, 6, 2, 4)


def test_knobs_round_trip_and_unknown_knobs_are_rejected():
  """Candidate.knobs() (the reports' form) and candidate_from_knobs are inverse, the
  overlap's chunk rows under their own name; a knob this space does not have (a removed
  one, as in an old report) is an InvalidCandidate, not silently dropped."""
  cand = T.Candidate(KernelConfig(64, 256, 128, 2, raster_rows=16, wgrad_raster=4),
                     TransferConfig(64, 128, 32), OverlapConfig(8, 4, 1024))
  knobs = cand.knobs()
  assert set(knobs) == set(T.KERNEL_KNOBS + T.TRANSFER_KNOBS + T.OVERLAP_KNOBS)
  assert (knobs["chunk_rows"], knobs["overlap_chunk_rows"]) == (64, 1024)
  assert T.candidate_from_knobs(knobs) == cand
  assert cand.label() == "m64_n256_k128_s2_r16_w4|c64_x32_t128|ov8_4_b1024"
  assert T.candidate_from_knobs(T.DEFAULT_CANDIDATE.knobs()) == T.DEFAULT_CANDIDATE
  for removed in ("epilogue_slots", "mma_in_flight", "n_comm", "dedup_tokens",
                  "expand_in_transfer"):
    with pytest.raises(T.InvalidCandidate, match=f"{removed}.*not in the parameter space"):
      T.candidate_from_knobs(dict(T.DEFAULT_CANDIDATE.knobs(), **{removed: 1}))
  with pytest.raises(T.InvalidCandidate, match="OverlapConfig"):
    T.candidate_from_knobs(dict(knobs, overlap_chunk_rows=0))
  # apply(): the overlap only for "uniep"
  assert cand.apply(UniEPConfig(backend="uniep")).overlap == cand.overlap
  applied = cand.apply(UniEPConfig(backend="pallas"))
  assert (applied.kernel, applied.transfer, applied.overlap) == (cand.kernel, cand.transfer, None)


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
    return AT.Measurement(median_ms=self.times(cand), compile_s=0.5, checksum=checksum)


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
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
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
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
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
  first = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=SPACE,
                 budget_s=1e9, progress=False, clock=clock).to_json()
  first["trials"][1]["status"] = "running"        # as a kill during that candidate leaves it
  runner = PrefetchingRunner(clock, _time_table)
  AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
         clock=clock, resume=first)
  assert not [e for e in runner.events if e[0] in ("prefetch", "discard")]
  assert "compiling one candidate at a time" in capsys.readouterr().err


def test_layer_runner_rejects_bad_compile_workers():
  with pytest.raises(ValueError, match="compile_workers=0"):
    AT.LayerRunner(T.TuneProblem(64, 64, 128, 4, 2, 1), backend="pallas", compile_workers=0)


def test_never_picks_a_mismatching_candidate(tmp_path, capsys):
  fastest = "m64_n128_k64_s3|c128_x32_t256"
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table, bad={fastest})
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
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
  assert AT.record(res, cache) == "mismatch"
  assert not cache.exists()


def test_budget_failures_and_skips_are_counted():
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table, fail={"m64_n128_k64_s3|c128_x64_t256"}, cost_s=10.0)
  space = _space(block_m=(64, 128, 256), chunk_rows=(64, 128), num_ctas=(32, 64))
  # Stage 1 ends at 0.6 * 45 = 27 s: the default (reference + measure: t = 20 s),
  # then m64 (started at 20 < 27: reference + failed measure: t = 40 s); m256 is
  # skipped. Stage 2 (the default tiling's 3 other transfers) ends at 45 s: one
  # runs (t = 50 s), two are skipped.
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=45.0, progress=False,
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
  res2 = AT.tune(DEEPSEEK_BWD, runner2, device=HOPPER, space=SPACE, budget_s=1e9,
                progress=False, clock=clock2)
  assert res2.counts()["reference_failed"] == 1
  assert all(t.candidate.kernel.block_m == 128 for t in res2.trials if t.status == "ok")


def test_resume_reuses_timed_trials():
  clock = FakeClock()
  first = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=SPACE,
                 budget_s=2.0, progress=False, clock=clock)   # the default only
  assert first.counts()["ok"] == 1
  report = json.loads(json.dumps(first.to_json()))
  clock2 = FakeClock()
  runner = FakeRunner(clock2, _time_table)
  second = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9,
                  progress=False, clock=clock2, resume=report)
  assert T.DEFAULT_CANDIDATE.label() not in runner.measured
  assert "m128_n128_k64_s3_r1_w1" not in runner.referenced
  assert second.counts()["ok"] == len(second.trials) == 5
  with pytest.raises(ValueError, match="resume report key"):
    AT.tune(dataclasses.replace(DEEPSEEK_BWD, direction="fwd"), runner, device=HOPPER,
           space=SPACE, progress=False, resume=report)


def test_a_candidate_that_never_finished_is_not_retried():
  clock = FakeClock()
  checkpoints = []
  AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=SPACE, budget_s=1e9,
         progress=False, clock=clock, on_trial=lambda r: checkpoints.append(r.to_json()))
  # the checkpoint written just before the second candidate ran: as if the process died there
  killed = json.loads(json.dumps(checkpoints[2]))
  assert [t["status"] for t in killed["trials"]] == ["ok", "running"]
  runner = FakeRunner(FakeClock(), _time_table)
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=SPACE, budget_s=1e9, progress=False,
               clock=runner.clock, resume=killed)
  label = killed["trials"][1]["label"]
  assert label not in runner.measured
  t = [t for t in res.trials if t.candidate.label() == label][0]
  assert t.status == "failed" and "did not finish" in t.error


def test_tree_checksum_is_bit_and_position_sensitive():
  a = jnp.arange(12, dtype=jnp.float32).reshape(3, 4).astype(jnp.bfloat16)
  base = tree_checksum({"a": a, "b": jnp.ones((5,), jnp.float32)})
  assert base == tree_checksum({"a": a, "b": jnp.ones((5,), jnp.float32)})
  assert base != tree_checksum({"a": a.at[1, 2].set(-a[1, 2]), "b": jnp.ones((5,))})
  assert base != tree_checksum({"a": a[::-1], "b": jnp.ones((5,), jnp.float32)})
  zero, neg_zero = jnp.zeros((2,), jnp.float32), -jnp.zeros((2,), jnp.float32)
  assert tree_checksum(zero) != tree_checksum(neg_zero)   # bits, not values


# ---------------------------------------------------------------------------
# Stage 3: the overlap points
# ---------------------------------------------------------------------------
def _overlap_times(cand):
  # no overlap 10 ms; 16 CTAs each: 6 ms; other points 9 ms
  if cand.overlap is None:
    return 10.0
  return 6.0 if cand.overlap == OverlapConfig(16, 16, 1024) else 9.0


def test_stage3_tries_the_overlap_points_verified_and_pruned():
  space = _space(overlap=((16, 16, 2048), (16, 16, 1024), (200, 16, 2048), (16, 132, 2048),
                          (16, 16, 1000), (0, 0, 2048)))
  clock = FakeClock()
  res = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _overlap_times), device=HOPPER, space=space,
                budget_s=1e9, progress=False, clock=clock)
  stage3 = [t for t in res.trials if t.stage == "overlap"]
  assert [t.candidate.label() for t in stage3] == [
      "m128_n128_k64_s3|c128_x64_t256|ov16_16_b2048", "m128_n128_k64_s3|c128_x64_t256|ov16_16_b1024"]
  reasons = _reasons(res.enumeration)
  assert any("down_return_ctas=200 must be < num_sms=132" in r for r in reasons)
  assert any("wgrad_return_ctas=132 must be < num_sms=132" in r for r in reasons)
  assert any("chunk_rows=1000 must be a multiple of block_m=128" in r for r in reasons)
  assert any("OverlapConfig:" in r and "overlaps nothing" in r for r in reasons)
  assert res.best.candidate.overlap == OverlapConfig(16, 16, 1024)
  assert res.to_json()["overlap_points"] == [list(p) for p in space.overlap]
  entry = AT.cache_entry(res, commit="abc", date="now")
  # every field of the winner's OverlapConfig; kernel: the 6 knobs; transfer: the 3
  assert entry["overlap"] == dict(down_return_ctas=16, wgrad_return_ctas=16, chunk_rows=1024)
  assert set(entry["kernel"]) == set(T.KERNEL_KNOBS)
  assert set(entry["transfer"]) == set(T.TRANSFER_KNOBS)
  assert T.entry_candidate(json.loads(json.dumps(entry))) == res.best.candidate
  # an overlap candidate that does not give pallas's bits is never picked
  clock = FakeClock()
  bad = "m128_n128_k64_s3|c128_x64_t256|ov16_16_b1024"
  res = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _overlap_times, bad=(bad,)), device=HOPPER,
                space=space, budget_s=1e9, progress=False, clock=clock)
  assert [t.candidate.label() for t in res.mismatches] == [bad]
  assert res.best.candidate.label() == "m128_n128_k64_s3|c128_x64_t256|ov16_16_b2048"


def test_check_overlap_mirrors_the_overlapped_kernels_checks():
  problem = T.TuneProblem(8, 320, 128, 4, 2, 2)    # 2 * 8 * 2 = 32 receive rows
  cand = T.Candidate(KernelConfig(), TransferConfig(chunk_rows=128, col_tile=64),
                     OverlapConfig(16, 16, 2048))
  with pytest.raises(T.InvalidCandidate, match="hidden=320 must be divisible by the CTA tile "
                     "width 2 \\* block_n = 256"):
    T.check_overlap(cand, problem, HOPPER)
  wide = dataclasses.replace(problem, hidden=512)
  T.check_overlap(cand, wide, HOPPER)
  short = dataclasses.replace(cand, transfer=TransferConfig(chunk_rows=256, col_tile=64))
  with pytest.raises(T.InvalidCandidate, match="shorter than one transfer item"):
    T.check_overlap(short, wide, HOPPER)
  # the down GEMM's checks only where it runs: the return beside the wgrad alone passes
  T.check_overlap(dataclasses.replace(short, overlap=OverlapConfig(0, 16)), problem, HOPPER)


def test_forward_overlap_points_keep_the_down_return_only():
  """A forward-only run has no wgrad: its points drop wgrad_return_ctas, so the cache
  entry names only what was timed; a point that then overlaps nothing, or duplicates
  another, is rejected with the reason."""
  space = _space(overlap=((16, 16, 2048), (16, 0, 2048), (0, 16, 2048), (8, 8, 2048)))
  valid, rejected = T.overlap_candidates(space, T.DEFAULT_CANDIDATE, DEEPSEEK_FWD, HOPPER)
  assert [c.overlap for c in valid] == [OverlapConfig(16, 0, 2048), OverlapConfig(8, 0, 2048)]
  assert ["duplicate of m128_n128_k64_s3|c128_x64_t256|ov16_0_b2048" in r["reason"]
          for r in rejected] == [True, False]
  assert "down_return_ctas=0 overlaps nothing" in rejected[1]["reason"]
  valid, rejected = T.overlap_candidates(space, T.DEFAULT_CANDIDATE, DEEPSEEK_BWD, HOPPER)
  assert [c.overlap for c in valid] == [OverlapConfig(*p) for p in space.overlap]
  assert not rejected


def test_stages_overlap_only_times_the_default_then_the_overlap_points():
  space = _space(block_m=(64, 128), num_ctas=(32, 64), overlap=((16, 16, 2048), (16, 16, 1024)))
  clock = FakeClock()
  res = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _overlap_times), device=HOPPER, space=space,
                budget_s=1e9, progress=False, clock=clock, stages=("overlap",))
  timed = [(t.stage, t.candidate.label()) for t in res.trials]
  assert timed == [("kernel", T.DEFAULT_CANDIDATE.label()),
                   ("overlap", "m128_n128_k64_s3|c128_x64_t256|ov16_16_b2048"),
                   ("overlap", "m128_n128_k64_s3|c128_x64_t256|ov16_16_b1024")]
  assert res.spread()["default_over_best"] == 10.0 / 6.0
  report = json.loads(json.dumps(res.to_json()))
  assert report["stages"] == ["overlap"] and report["format"] == T.CACHE_FORMAT
  # the saved report replays to the same trials (no stage 1/2 candidates appear skipped),
  # with its own stage-3 points (not SearchSpace()'s)
  again = AT.replay(report)
  assert [(t.stage, t.candidate.label(), t.status) for t in again.trials] == [
      (t.stage, t.candidate.label(), t.status) for t in res.trials]
  # a later full run resumes from it: only what it lacks is timed
  clock = FakeClock()
  runner = FakeRunner(clock, _overlap_times)
  AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9, progress=False,
          clock=clock, resume=report)
  assert T.DEFAULT_CANDIDATE.label() not in runner.measured
  assert sorted(runner.measured) == ["m128_n128_k64_s3|c128_x32_t256",
                                     "m64_n128_k64_s3|c128_x64_t256"]
  with pytest.raises(ValueError, match="stages"):
    AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9, progress=False,
            clock=clock, stages=("fused",))
  # "grid" has no stage 3
  clock = FakeClock()
  grid = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _overlap_times), device=HOPPER, space=space,
                 budget_s=1e9, progress=False, clock=clock, strategy="grid")
  assert {t.stage for t in grid.trials} == {"grid"} and len(grid.trials) == 4


def test_resuming_with_fewer_stages_keeps_the_earlier_trials_and_best():
  """A `--stages overlap` run resuming a full search keeps that search's trials in its
  report, builds stage 3 on its best candidate, and so never records a worse best."""
  space = dataclasses.replace(SPACE, overlap=((16, 16, 2048),))
  clock = FakeClock()
  full = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, _time_table), device=HOPPER, space=space,
                 budget_s=1e9, progress=False, clock=clock, stages=("kernel", "transfer"))
  report = json.loads(json.dumps(full.to_json()))
  clock = FakeClock()
  runner = FakeRunner(clock, _time_table)
  again = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9,
                  progress=False, clock=clock, stages=("overlap",), resume=report)
  assert again.best.median_ms == full.best.median_ms == 7.0
  assert {t.candidate.label() for t in full.trials} <= {t.candidate.label() for t in again.trials}
  # the one new candidate: the overlap point on the best candidate found before
  assert runner.measured == [full.best.candidate.label() + "|ov16_16_b2048"]


def test_parse_overlap_points():
  assert AT.parse_overlap_points("16,16,2048; 4,4,2048;") == ((16, 16, 2048), (4, 4, 2048))
  assert AT.parse_overlap_points("") == ()
  for bad in ("16,16", "16,16,2048,1", "a,16,2048", "16,-1,2048"):
    with pytest.raises(ValueError, match="--overlap-points"):
      AT.parse_overlap_points(bad)


def test_raster_variants_are_checked_against_the_row_major_reference():
  """raster_rows only reorders the tiles: every candidate is verified against the
  "pallas" reference of its tiling walked row-major (raster_rows=1), so a tile-order
  bug shows as a mismatch, and the auto default and the bands share one reference."""
  space = _space(raster_rows=(None, 16))
  clock = FakeClock()
  runner = FakeRunner(clock, lambda c: 9.0 if c.kernel.raster_rows == 16 else 10.0)
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9, progress=False,
                clock=clock)
  assert [t.candidate.label() for t in res.trials if t.stage == "kernel"] == [
      "m128_n128_k64_s3|c128_x64_t256", "m128_n128_k64_s3_r16|c128_x64_t256"]
  assert runner.referenced == ["m128_n128_k64_s3_r1_w1"]
  assert res.best.candidate.kernel == KernelConfig(raster_rows=16)
  assert T.candidate_from_knobs(res.best.candidate.knobs()) == res.best.candidate
  clock = FakeClock()
  bad = FakeRunner(clock, lambda c: 9.0, bad=("m128_n128_k64_s3_r16|c128_x64_t256",))
  res = AT.tune(DEEPSEEK_BWD, bad, device=HOPPER, space=space, budget_s=1e9, progress=False,
                clock=clock)
  assert [t.candidate.label() for t in res.mismatches] == ["m128_n128_k64_s3_r16|c128_x64_t256"]


def test_reports_of_another_format_or_other_xla_flags_are_not_resumed(tmp_path, monkeypatch,
                                                                      capsys):
  """The CLI resumes only from a report of this format (another format's knobs are
  another space) made with the same XLA_FLAGS (other flags: other kernels and times);
  tune() itself refuses another format."""
  problem = T.TuneProblem(64, 64, 128, 4, 2, 1, "bfloat16", "fwd")
  stem = AT.report_stem(HOPPER.kind, "64x64x128x4x2", 1, "fwd")
  clock = FakeClock()
  good = AT.tune(problem, FakeRunner(clock, lambda c: 1.0), device=HOPPER,
                 space=_space(col_tile=(64,)), budget_s=1e9, progress=False, clock=clock)
  good = dict(json.loads(json.dumps(good.to_json())),
              meta=dict(xla_flags=os.environ.get("XLA_FLAGS", "")))
  with pytest.raises(ValueError, match="format 1, this version reads"):
    AT.tune(problem, FakeRunner(clock, lambda c: 1.0), device=HOPPER,
            space=_space(col_tile=(64,)), progress=False, clock=clock,
            resume=dict(good, format=1))
  seen = {}

  def fake_tune(problem, runner, **kw):
    seen["resume"] = kw["resume"]
    raise SystemExit(0)

  monkeypatch.setattr(AT, "tune", fake_tune)
  monkeypatch.setattr(T.DeviceFacts, "from_device", classmethod(lambda cls, **_: HOPPER))
  monkeypatch.setattr(AT, "LayerRunner",
                      lambda *a, **k: type("R", (), {"close": lambda *_, **__: None})())

  def resumed_from(report):
    (tmp_path / f"{stem}.json").write_text(json.dumps(report))
    seen.clear()
    with pytest.raises(SystemExit):
      AT.main(["--shape", "64,64,128,4,2", "--ep", "1", "--direction", "fwd",
               "--resume", str(tmp_path), "--out", str(tmp_path / "out")])
    return seen["resume"]

  assert resumed_from(dict(good, format=1)) is None
  assert f"report format 1, this version reads {T.CACHE_FORMAT}" in capsys.readouterr().out
  assert resumed_from(dict(good, meta=dict(xla_flags="--other"))) is None
  assert "it ran with XLA_FLAGS='--other'" in capsys.readouterr().out
  assert resumed_from(good) == good


# ---------------------------------------------------------------------------
# Cache, lookup, heuristic, "auto" in moe_ffn
# ---------------------------------------------------------------------------
def _entry(kernel, transfer, overlap=None):
  """A format-2 cache entry as `autotune.cache_entry` writes it (the measured fields
  the lookup does not read: only median_ms)."""
  k = dataclasses.asdict(kernel)
  k.pop("num_sms")
  return dict(kernel=k, transfer=dataclasses.asdict(transfer),
              overlap=dataclasses.asdict(overlap) if overlap else None, median_ms=1.0)


def _problem_of_key(key):
  kind, *fields, dtype, ep, direction = key.split("|")
  t, h, f, e, k = (int(x.split("=")[1]) for x in fields)
  return kind, T.TuneProblem(t, h, f, e, k, int(ep.split("=")[1]), dtype, direction)


def test_shipped_cache_is_valid_and_has_no_unmeasured_entries():
  """Every shipped entry: format-2 fields only, measured (a float time, the commit and
  date that measured it), and a point of today's space that can run its problem on a
  Hopper GPU (132 SMs, 227 KiB of shared memory)."""
  data = json.load(open(T.SHIPPED_CACHE))
  assert data["format"] == T.CACHE_FORMAT == 2
  measured = {"median_ms", "default_ms", "backend", "strategy", "counts", "device_count",
              "git_commit", "date"}
  overlap_fields = {f.name for f in dataclasses.fields(OverlapConfig)}
  assert data["entries"]
  for key, e in data["entries"].items():
    assert set(e) - {"note", "replaced"} == {"kernel", "transfer", "overlap"} | measured, key
    assert set(e["kernel"]) == set(T.KERNEL_KNOBS), key
    assert set(e["transfer"]) == set(T.TRANSFER_KNOBS), key
    assert e["overlap"] is None or set(e["overlap"]) == overlap_fields, key
    for f in ("note", "replaced"):   # where a timing differs from today's code: why
      assert f not in e or (isinstance(e[f], str) and e[f]), key
    assert isinstance(e["median_ms"], float) and e["git_commit"] and e["date"]
    assert e["backend"] == "uniep"
    kind, problem = _problem_of_key(key)
    assert T.cache_key(kind, problem) == key and e["device_count"] == problem.ep
    cand = T.entry_candidate(e)
    T.check_candidate(cand, problem, dataclasses.replace(HOPPER, kind=kind))


def test_cache_key_lookup_user_overrides_shipped(tmp_path, monkeypatch):
  shipped, user = tmp_path / "shipped.json", tmp_path / "user.json"
  monkeypatch.setattr(T, "SHIPPED_CACHE", shipped)
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  p = DEEPSEEK_BWD
  key = T.cache_key("NVIDIA H200", p)
  assert key == "NVIDIA H200|T=8192|H=7168|F=2048|E=256|K=8|bfloat16|ep=4|bwd"
  assert T.lookup(p, "NVIDIA H200") is None
  a = T.Candidate(KernelConfig(64, 128, 64, 3), TransferConfig(64, 256, 32))
  b = T.Candidate(KernelConfig(128, 256, 64, 2), TransferConfig(128, 128, 96),
                  OverlapConfig(8, 8, 1024))
  AT.update_cache(shipped, key, _entry(a.kernel, a.transfer))
  assert json.loads(shipped.read_text())["format"] == T.CACHE_FORMAT
  assert T.lookup(p, "NVIDIA H200") == (a, os.fspath(shipped))
  assert T.lookup(p, "NVIDIA H100 80GB HBM3") is None               # other device kind
  assert T.lookup(dataclasses.replace(p, ep=2, experts=256), "NVIDIA H200") is None
  AT.update_cache(user, key, _entry(b.kernel, b.transfer, b.overlap))
  monkeypatch.setenv(T.CACHE_ENV, os.fspath(user))
  assert T.lookup(p, "NVIDIA H200") == (b, os.fspath(user))        # user file wins
  assert T.lookup(p, "NVIDIA H200", cache_path=tmp_path / "none.json")[0] == a
  # a rewritten file is read again (mtime/size-keyed reader)
  AT.update_cache(user, key, _entry(a.kernel, b.transfer))
  assert T.lookup(p, "NVIDIA H200")[0] == T.Candidate(a.kernel, b.transfer)


def test_a_cache_of_another_format_or_with_unknown_fields_is_refused(tmp_path, monkeypatch):
  monkeypatch.setattr(T, "SHIPPED_CACHE", tmp_path / "shipped.json")
  key = T.cache_key("NVIDIA H200", DEEPSEEK_BWD)
  old = tmp_path / "old.json"
  entry = _entry(KernelConfig(), TransferConfig())
  old.write_text(json.dumps(dict(format=1, entries={key: entry})))
  with pytest.raises(ValueError, match="tune cache format 1, this version reads 2"):
    T.lookup(DEEPSEEK_BWD, "NVIDIA H200", cache_path=old)
  with pytest.raises(ValueError, match="format 1, this version writes 2"):
    AT.update_cache(old, key, entry)
  nameless = tmp_path / "nameless.json"
  nameless.write_text(json.dumps(dict(entries={key: entry})))
  with pytest.raises(ValueError, match="tune cache format None"):
    T.lookup(DEEPSEEK_BWD, "NVIDIA H200", cache_path=nameless)
  # a removed knob in an entry: refused with the file and key, not a TypeError
  stale = tmp_path / "stale.json"
  AT.update_cache(stale, key, dict(entry, kernel=dict(entry["kernel"], epilogue_slots=1)))
  with pytest.raises(ValueError, match="stale.json, entry .*ep=4\\|bwd.*epilogue_slots"):
    T.lookup(DEEPSEEK_BWD, "NVIDIA H200", cache_path=stale)


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
  assert (r.kernel, r.transfer, r.overlap) == (KernelConfig(), TransferConfig(128, 256, 64), None)
  fwd_key = T.cache_key(dev.device_kind, DEEPSEEK_FWD)
  bwd_key = T.cache_key(dev.device_kind, DEEPSEEK_BWD)
  fwd_c = T.Candidate(KernelConfig(64, 128, 64, 2), TransferConfig(32, 128, 16))
  bwd_c = T.Candidate(KernelConfig(128, 256, 64, 2), TransferConfig(64, 256, 96))
  user = tmp_path / "user.json"
  AT.update_cache(user, fwd_key, _entry(fwd_c.kernel, fwd_c.transfer))
  r = T.resolve_config(auto, device=dev, cache_path=user, **shape)
  assert (r.kernel, r.transfer) == (fwd_c.kernel, fwd_c.transfer)
  AT.update_cache(user, bwd_key, _entry(bwd_c.kernel, bwd_c.transfer))
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


def test_resolve_config_takes_an_overlap_winner_only_when_fully_auto(tmp_path, no_shipped_cache):
  """A cached winner's overlap point serves a config whose kernel and transfer are both
  auto, that names no overlap of its own, with backend "uniep"; otherwise the config's
  own overlap (None or explicit) stays."""
  dev, shape = no_shipped_cache
  user = tmp_path / "user.json"
  won = OverlapConfig(16, 16, 2048)
  AT.update_cache(user, T.cache_key(dev.device_kind, DEEPSEEK_BWD),
                  _entry(KernelConfig(), TransferConfig(), won))
  resolve = lambda cfg: T.resolve_config(cfg, device=dev, cache_path=user, **shape)  # noqa: E731
  auto = UniEPConfig(backend="uniep", kernel=None, transfer=None)
  r = resolve(auto)
  assert (r.kernel, r.transfer, r.overlap) == (KernelConfig(), TransferConfig(), won)
  r = resolve(dataclasses.replace(auto, kernel=KernelConfig()))
  assert r.overlap is None and r.transfer == TransferConfig()
  r = resolve(dataclasses.replace(auto, transfer=TransferConfig(64)))
  assert r.overlap is None and r.kernel == KernelConfig()
  r = resolve(UniEPConfig(backend="pallas", kernel=None, transfer=None))
  assert r.overlap is None and r.kernel == KernelConfig()
  mine = OverlapConfig(4, 4, 1024)
  assert resolve(dataclasses.replace(auto, overlap=mine)).overlap == mine
  # the overlapped launches run bf16 only: an fp8 config keeps its tuned tiling, no overlap
  r = resolve(dataclasses.replace(auto, precision="fp8"))
  assert (r.kernel, r.overlap, r.precision) == (KernelConfig(), None, "fp8")


def test_heuristic_rules():
  tiny = T.TuneProblem(64, 64, 128, 4, 2, 1)
  h = T.heuristic_config(tiny, HOPPER)
  assert h.transfer == TransferConfig(chunk_rows=32, col_tile=64, num_ctas=64)
  assert h.overlap is None
  assert T.heuristic_config(tiny, dataclasses.replace(HOPPER, num_sms=16)).transfer.num_ctas == 8
  # a device with too little shared memory for the default tiling gets a tiling that fits
  small = dataclasses.replace(HOPPER, smem_bytes=100 * 1024)   # da (dswiglu) needs 113 KiB
  with pytest.raises(T.InvalidCandidate, match="bwd da \\(dswiglu\\)"):
    T.kernel_launch_stages(KernelConfig(), DEEPSEEK_BWD, small.smem_bytes)
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
  AT.update_cache(user, T.cache_key(jax.devices()[0].device_kind, problem),
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
# Replay of a saved report; the CLI end to end
# ---------------------------------------------------------------------------
def test_replay_of_a_saved_report_records_what_that_run_measured(tmp_path, monkeypatch):
  """--record-from: a saved report (a run killed before it wrote its cache entry)
  replayed without a GPU gives that run's trials, best and default (its own default,
  even where today's dataclass default differs), and the entry names the run's commit
  and date; a report of another format or without them is refused."""
  space = dataclasses.replace(SPACE, max_concurrent_steps=(3, 4), overlap=((16, 16, 2048),))
  clock = FakeClock()
  times = lambda c: _time_table(c) - (0.5 if c.kernel.max_concurrent_steps == 4 else 0.0) - (  # noqa: E731
      2.0 if c.overlap is not None else 0.0)
  run = AT.tune(DEEPSEEK_BWD, FakeRunner(clock, times), device=HOPPER, space=space,
                budget_s=10.0, progress=False, clock=clock)   # cut short by the budget
  report = json.loads(json.dumps(run.to_json()))
  assert report["counts"]["skipped"] > 0 and report["best"]["stage"] == "overlap"
  # as if the run's default had been the 4-stage tiling (the dataclass default then)
  report["default"] = "m128_n128_k64_s4|c128_x64_t256"
  default_ms = [t for t in report["trials"] if t["label"] == report["default"]][0]["median_ms"]
  report["meta"] = dict(git_commit="0123abc", date="2026-01-02T03:04:05Z")
  path = tmp_path / "report.json"
  path.write_text(json.dumps(report))
  res = AT.replay(report, space)
  assert [(t.stage, t.candidate.label(), t.status, t.median_ms) for t in res.trials] == [
      (t.stage, t.candidate.label(), t.status, t.median_ms) for t in run.trials]
  assert res.best.candidate.label() == report["best"]["label"]
  assert res.default.label() == report["default"] != T.DEFAULT_CANDIDATE.label()
  assert res.spread()["default_ms"] == default_ms == 9.5
  assert res.counts() == report["counts"]
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  cache = tmp_path / "cache.json"
  assert AT.main(["--record-from", str(path), "--cache", str(cache)]) == 0
  (entry,) = json.loads(cache.read_text())["entries"].values()
  assert entry["git_commit"] == "0123abc" and entry["date"] == "2026-01-02T03:04:05Z"
  assert entry["median_ms"] == report["best"]["median_ms"] and entry["default_ms"] == 9.5
  assert T.entry_candidate(entry).label() == report["best"]["label"]
  # refused: another format; no commit or date (a measurement of unknown code)
  with pytest.raises(ValueError, match="format 1"):
    AT.replay(dict(report, format=1))
  path.write_text(json.dumps(dict(report, meta={})))
  with pytest.raises(SystemExit, match="no meta.git_commit"):
    AT.main(["--record-from", str(path), "--cache", str(cache)])


def test_cli_end_to_end_interpret(tmp_path, monkeypatch):
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  out, cache = tmp_path / "out", tmp_path / "cache.json"
  rc = AT.main(["--shape", "64,64,128,4,2", "--ep", "1", "--direction", "fwd",
                "--backend", "pallas", "--num-sms", "2", "--trials", "1", "--max-candidates", "1",
                "--budget-s", "300", "--out", os.fspath(out), "--cache", os.fspath(cache),
                "--no-progress", "--compile-workers", "2"])   # the threaded compile path
  assert rc == 0
  kind = jax.devices()[0].device_kind
  stem = out / (AT.report_stem(kind, "64x64x128x4x2", 1, "fwd"))
  report = json.load(open(f"{stem}.json"))
  assert os.path.getsize(f"{stem}.png") > 0
  assert report["tuner"] == "uniep_jax.autotune" and report["format"] == T.CACHE_FORMAT
  assert report["counts"]["ok"] == 1 and report["counts"]["mismatch"] == 0
  best = report["best"]
  assert best["bitwise_equal_to_reference"] is True and best["median_ms"] > 0
  assert best["label"] == T.DEFAULT_CANDIDATE.label()
  assert report["counts"]["skipped"] == 0
  problem = T.TuneProblem(64, 64, 128, 4, 2, 1, "bfloat16", "fwd")
  found = T.lookup(problem, kind, cache_path=cache)
  assert found is not None and found[0] == T.DEFAULT_CANDIDATE
  entry = json.load(open(cache))["entries"][T.cache_key(kind, problem)]
  assert entry["median_ms"] == best["median_ms"] and entry["overlap"] is None
  # the report replays to the same best without a device run
  assert AT.replay(report).best.candidate.label() == best["label"]


# ---------------------------------------------------------------------------
# Replica slots (stage 4) and skewed routings
# ---------------------------------------------------------------------------
class SlotRunner(FakeRunner):
  """A skewed routing: replica slots make the layer faster, and change the weight
  gradients' bits (their reference is "pallas" with the same slots)."""

  routing = "zipf"

  def reference(self, kernel, replica_slots=0):
    ref = super().reference(kernel)
    return ref + ((f"rs{replica_slots}",) if replica_slots else ())

  def measure(self, cand):
    m = super().measure(cand)
    if cand.replica_slots:
      m = dataclasses.replace(m, checksum=m.checksum + (f"rs{cand.replica_slots}",))
    return m


def _slot_times(cand):
  return {0: 10.0, 1: 7.0, 2: 6.0, 3: 6.5}[cand.replica_slots]


def test_stage4_times_replica_slots_verified_against_pallas_with_the_same_slots(tmp_path):
  space = _space(replica_slots=(0, 1, 2, 3, 65))
  clock = FakeClock()
  runner = SlotRunner(clock, _slot_times)
  res = AT.tune(DEEPSEEK_BWD, runner, device=HOPPER, space=space, budget_s=1e9, progress=False,
                clock=clock)
  stage4 = [t for t in res.trials if t.stage == "slots"]
  assert [t.candidate.replica_slots for t in stage4] == [1, 2, 3]
  assert all(t.status == "ok" for t in stage4)       # each against its own reference
  assert res.best.candidate.replica_slots == 2 and res.best.candidate.label().endswith("|rs2")
  reasons = _reasons(res.enumeration)
  assert any("replica_slots=0" in r for r in reasons)
  assert any("replica_slots=65 exceeds the 64 experts per rank" in r for r in reasons)
  assert res.to_json()["transfer_consistent"]          # slots are their own bit groups
  js = res.to_json()
  assert js["routing"] == "zipf" and js["replica_slot_points"] == [0, 1, 2, 3, 65]
  # a skewed run caches nothing; its report keeps the winner
  cache = tmp_path / "cache.json"
  assert AT.record(res, cache) == "nothing" and not cache.exists()
  # the same trials under balanced routing cache the best point without slots
  res.routing = "balanced"
  assert AT.record(res, cache, commit="abc", date="now") == "written"
  entry = json.loads(cache.read_text())["entries"][T.cache_key(HOPPER.kind, DEEPSEEK_BWD)]
  assert entry["median_ms"] == 10.0 and "replica_slots" not in entry
  # a mismatching slot candidate is never picked
  clock = FakeClock()
  bad = res.best.candidate.label()
  res2 = AT.tune(DEEPSEEK_BWD, SlotRunner(clock, _slot_times, bad=(bad,)), device=HOPPER,
                 space=space, budget_s=1e9, progress=False, clock=clock)
  assert [t.candidate.label() for t in res2.mismatches] == [bad]
  assert res2.best.candidate.replica_slots == 3
  # replay rebuilds the same result from the report
  again = AT.replay(json.loads(json.dumps(dict(js, meta={}))), space)
  assert again.best.candidate == res.best.candidate and again.routing == "zipf"


def test_slot_candidates_and_knobs():
  base = T.Candidate(KernelConfig(), TransferConfig(), OverlapConfig())
  valid, rejected = T.slot_candidates(_space(replica_slots=(1, 2, 3)), base,
                                      dataclasses.replace(DEEPSEEK_BWD, experts=8))
  assert [c.replica_slots for c in valid] == [1, 2] and all(c.overlap is None for c in valid)
  assert "exceeds the 2 experts per rank" in rejected[0]["reason"]
  one_rank = dataclasses.replace(DEEPSEEK_BWD, ep=1)
  assert T.slot_candidates(_space(replica_slots=(1,)), base, one_rank)[0] == []
  c = valid[1]
  assert T.candidate_from_knobs(c.knobs()) == c and c.knobs()["replica_slots"] == 2
  assert c.apply(UniEPConfig(backend="uniep")).replica_slots == 2
  with pytest.raises(T.InvalidCandidate, match="replica_slots"):
    T.candidate_from_knobs(dict(base.knobs(), replica_slots=1))   # with an overlap point
  with pytest.raises(T.InvalidCandidate, match="replica_slots"):
    T.candidate_from_knobs(dict(replica_slots=-1))


def test_layer_runner_routings_skew_the_routing():
  """The runner's selection bias: "all_to_one" puts expert 0 in every top-k; "zipf" skews
  the expert loads like drawing experts from a Zipf(1.2) popularity."""
  import numpy as np
  from uniep_jax.routing import route
  from uniep_jax import RoutingConfig
  e, k, h, t = 128, 8, 256, 4096
  x = jax.random.normal(jax.random.key(0), (t, h))
  router = jax.random.normal(jax.random.key(1), (h, e)) * h ** -0.5
  assert AT.routing_bias("balanced", e) is None
  loads = {}
  for routing in ("zipf", "all_to_one"):
    out = route(x, router, k, RoutingConfig(), AT.routing_bias(routing, e))
    counts = np.bincount(np.asarray(out.topk_experts).ravel(), minlength=e)
    loads[routing] = counts.max() / counts.mean()
    if routing == "all_to_one":
      assert (np.asarray(out.topk_experts) == 0).any(axis=1).all()
  assert loads["zipf"] > 8 and loads["all_to_one"] == pytest.approx(e / k)
  with pytest.raises(ValueError, match="routing"):
    AT.LayerRunner(T.TuneProblem(64, 64, 128, 4, 2, 1), backend="pallas", routing="hot")


def test_cli_times_replica_slots_under_a_skewed_routing_interpret(tmp_path, monkeypatch):
  """The CLI at EP 2 on backend "pallas" (interpret mode), all-to-one routing, the slot
  stage only: the default point, then one replica slot, each bit for bit its own
  "pallas" reference; the report (named by the routing) has both, the cache nothing."""
  monkeypatch.delenv(T.CACHE_ENV, raising=False)
  out, cache = tmp_path / "out", tmp_path / "cache.json"
  rc = AT.main(["--shape", "64,64,128,4,2", "--ep", "2", "--direction", "bwd",
                "--backend", "pallas", "--num-sms", "2", "--trials", "1", "--stages", "slots",
                "--routing", "all_to_one", "--replica-slots", "1", "--budget-s", "600",
                "--out", os.fspath(out), "--cache", os.fspath(cache), "--no-progress"])
  assert rc == 0
  kind = jax.devices()[0].device_kind
  report = json.load(open(out / (AT.report_stem(kind, "64x64x128x4x2", 2, "bwd", "all_to_one")
                                 + ".json")))
  trials = {t["label"]: t for t in report["trials"]}
  slot = T.DEFAULT_CANDIDATE.label() + "|rs1"
  assert set(trials) == {T.DEFAULT_CANDIDATE.label(), slot}
  assert all(t["status"] == "ok" and t["bitwise_equal_to_reference"] for t in trials.values())
  assert report["routing"] == "all_to_one" and not cache.exists()
