"""The autotuner of the Pallas backends: times the points of the parameter space
(`uniep_jax.tuning`) on the device and writes the winner into a tune cache.

Run it on the GPUs the layer will run on (`--ep R` on an R-GPU machine):

  XLA_FLAGS=--xla_gpu_deterministic_ops=true python -m uniep_jax.autotune \
      --moe-config deepseek-like --ep 4 --direction bwd --compile-workers 8 \
      --budget-s 450 --cache uniep_jax/tuned_configs.json --out tune_reports

Problem = the per-rank MoE shape and run (`tuning.TuneProblem`), direction "fwd"
(forward only) or "bwd" (forward + backward: `value_and_grad` of the layer).

Verification. Every timed candidate's output ("fwd": y; "bwd": the loss and all
gradients) is reduced to a position-sensitive bit checksum on the device and compared
with the checksum of backend "pallas" (XLA collectives, the sequential path) with the
SAME KernelConfig but for the tile orders (the reference walks its tiles row-major:
the tile order must change no bit); a different block_k changes the accumulation
order, so each tiling has its own reference. Transfer and overlap knobs only move rows,
so all candidates sharing a tiling must also agree with each other
(`transfer_consistency` in the report). A mismatch is a bug: it is printed to stderr,
listed under "mismatches" in the JSON, never picked, and a run with any mismatch writes
no cache entry.

Search. "staged" (default): stage 1 times every valid KernelConfig with the default
TransferConfig; stage 2 every valid TransferConfig with the best verified KernelConfig
of stage 1; stage 3 the best verified candidate so far with each overlap point
(`SearchSpace.overlap`, "uniep" only; `tuning.overlap_candidates`); stage 4 its kernel
and transfer with each replica slot count (`SearchSpace.replica_slots`, `--replica-slots`;
`tuning.slot_candidates`), each verified against "pallas" with the same slots. "grid": the whole
kernel x transfer product, no stage 3. `--stages` runs a subset: without "kernel",
stage 1 is the default alone, so `--stages overlap` times the overlap points against
the default in one short call.
Within a stage the default comes first, then candidates by the number of knobs that
differ from the default (one-knob neighbours first). Compile failures are recorded and
counted, not fatal. A wall-clock budget (stage 1 gets `stage1_fraction` of it when a
stage 2 follows) skips what is left when it is spent; skipped candidates are listed.
`--resume DIR` reloads a previous report of the same problem and device and re-times
only what it lacks, so a long search can run as several shorter calls (a report of
another format, or made with other XLA_FLAGS, is not resumed). `--record-from REPORT`
rebuilds a saved report's result without a GPU (`replay`) and records its best.

Routing (`--routing`): the layer's tokens are routed "balanced" (random router, the
default), "zipf" (a selection bias ln(p_e) / E over a Zipf(1.2) popularity p on a fixed
permutation of the experts: on these random inputs about the skew of drawing experts from
p, e.g. max expert load 16x the mean and the top rank 2.3x at E = 128, K = 8) or
"all_to_one" (expert 0 in every top-k). Only a skewed routing can make replica slots win.
The cache holds balanced-routing winners: a skewed run writes its report, and its cache
entry only from a balanced run (the cache's key holds no routing, and which slot count
pays depends on the routing a model has when it runs: the report says which did here).

Cost: each timed candidate is one compile of the layer (tens of seconds at the target
shapes, overlap points the longest) and each new tiling one more for its "pallas"
reference (shared by the tile orders). `--compile-workers N` compiles the next 2N
candidates in N threads while one is timed.

The report (`--out`): tune_<device>_<shape>_ep<R>_<direction>.json (format
`tuning.CACHE_FORMAT`: every trial with its knobs, rejections with reasons, references,
top 5, best vs default spread, mismatches, the stages and overlap points searched, run
metadata) and a PNG of time against the kernel and transfer knobs.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import json
import os
import sys
import threading
import time
from typing import Callable, Optional, Protocol, Sequence

from uniep_jax import tuning
from uniep_jax.config import KernelConfig, TransferConfig, UniEPConfig
from uniep_jax.measure import (SHAPES, SMOKE_SHAPES, block, git_commit, run_metadata, time_ms,
                               tree_checksum, zipf_popularity)
from uniep_jax.tuning import (CACHE_ENV, CACHE_FORMAT, DEFAULT_CANDIDATE, DIRECTIONS,
                              KERNEL_KNOBS, TRANSFER_KNOBS, Candidate, DeviceFacts,
                              Enumeration, SearchSpace, TuneProblem, cache_key,
                              candidate_from_knobs, enumerate_candidates, heuristic_config,
                              kernel_label, overlap_candidates, reference_kernel,
                              slot_candidates, user_cache_path)

STAGES = ("kernel", "transfer", "overlap", "slots")   # the "staged" search's stages, in order
ROUTINGS = ("balanced", "zipf", "all_to_one")           # LayerRunner's routings


# ---------------------------------------------------------------------------
# Measuring: the Runner interface and the real layer runner
# ---------------------------------------------------------------------------
@dataclasses.dataclass(frozen=True)
class Measurement:
  median_ms: float
  compile_s: float
  checksum: tuple           # hex strings, one per output leaf
  timing: dict = dataclasses.field(default_factory=dict)


class Runner(Protocol):
  """What the search loop needs; tests inject fakes.

  reference(kernel[, replica_slots]) -> checksum of backend "pallas" with this
    KernelConfig (and these replica slots: called with them only when non-zero)
  measure(candidate) -> Measurement of the tuned backend; both raise on failure.
  Optional: prefetch_window (int) and prefetch(cands, kernels): start compiling
  the next candidates and the references of `kernels` in the background (the
  search calls it before each candidate; results and errors surface in
  measure / reference)."""

  backend: str
  uses_transfer: bool

  def reference(self, kernel: KernelConfig) -> tuple: ...

  def measure(self, cand: Candidate) -> Measurement: ...


def routing_bias(routing: str, experts: int):
  """The LayerRunner's selection bias [E] float32 for `routing` (module docstring), None
  for "balanced"."""
  import jax.numpy as jnp
  import numpy as np
  if routing == "balanced":
    return None
  if routing == "all_to_one":
    return jnp.zeros((experts,), jnp.float32).at[0].set(100.0)
  p = zipf_popularity(experts)
  return jnp.asarray(np.log(p / p.max()) / experts, jnp.float32)


class LayerRunner:
  """Times `moe_ffn` on a data=1, expert=R mesh, routed as `routing` (`ROUTINGS`).

  backend: the tuned backend ("uniep" on GPUs; "pallas" runs in the CPU
  interpret mode, where it checks the machinery). num_sms overrides
  KernelConfig.num_sms (small in the interpret mode). The reference is backend
  "pallas" with transport "padded" and the candidate's KernelConfig.

  compile_workers > 1: the next 2 x compile_workers candidates (and the references
  they need) are compiled ahead in that many threads while the current one is
  timed; timing stays one candidate at a time, and no Python lowering runs during
  it (the lowering lock). A compile is most of a candidate's
  cost (~16-38 s at the target shapes, against ~2 s of timing). XLA:GPU's own GEMM
  autotuning would then time kernels while other compiles run: run it with
  XLA_FLAGS=--xla_gpu_deterministic_ops=true (no autotuning; the training CLI's
  default)."""

  def __init__(self, problem: TuneProblem, *, backend: str = "uniep", mesh=None,
               num_sms: Optional[int] = None, seed: int = 0, trials: int = 5,
               min_batch_s: float = 0.1, max_reps: int = 10, compile_workers: int = 1,
               routing: str = "balanced"):
    import jax
    if backend not in ("uniep", "pallas"):
      raise ValueError(f"backend={backend!r}: the tuner times 'uniep' (or 'pallas')")
    if routing not in ROUTINGS:
      raise ValueError(f"routing={routing!r} is unknown; expected one of {ROUTINGS}")
    self.routing = routing
    if compile_workers < 1:
      raise ValueError(f"compile_workers={compile_workers} must be >= 1")
    self.prefetch_window = 2 * compile_workers if compile_workers > 1 else 0
    self._pool = (concurrent.futures.ThreadPoolExecutor(compile_workers, "uniep-tune-compile")
                  if compile_workers > 1 else None)
    self._pending: dict = {}   # UniEPConfig -> Future of (compiled, compile_s)
    # Mosaic GPU's Python lowering keeps module-global state (its single-thread
    # emission scope): lowerings run one at a time, XLA's compiles in parallel
    self._lower_lock = threading.Lock()
    self.problem, self.backend, self.num_sms = problem, backend, num_sms
    self.uses_transfer = backend == "uniep"
    self.timing = dict(trials=trials, min_batch_s=min_batch_s, max_reps=max_reps)
    r = problem.ep
    if mesh is None:
      devs = jax.devices()
      if len(devs) < r:
        raise ValueError(f"ep={r} needs {r} devices, found {len(devs)}")
      mesh = jax.make_mesh((1, r), ("data", "expert"), devices=devs[:r])
    self.mesh = mesh
    self.inputs = self._make_inputs(seed)

  def _make_inputs(self, seed: int):
    import jax
    import jax.numpy as jnp
    from jax.sharding import NamedSharding, PartitionSpec as P
    from uniep_jax.params import MoEParams, join_gate_up
    p, mesh = self.problem, self.mesh
    e, h, f, dt = p.experts, p.hidden, p.ffn, jnp.dtype(p.dtype)
    n = p.tokens * mesh.size
    bias = routing_bias(self.routing, e)
    specs = MoEParams(router=P(), w_gate_up=P("expert"), w_down=P("expert"),
                      expert_bias=None if bias is None else P())
    tok = P(tuple(mesh.axis_names), None)

    def init(key):
      k = jax.random.split(key, 6)
      params = MoEParams(
          router=jax.random.normal(k[0], (h, e), jnp.float32) * h ** -0.5,
          w_gate_up=join_gate_up(
              (jax.random.normal(k[1], (e, h, f), jnp.float32) * h ** -0.5).astype(dt),
              (jax.random.normal(k[2], (e, h, f), jnp.float32) * h ** -0.5).astype(dt)),
          w_down=(jax.random.normal(k[3], (e, f, h), jnp.float32) * f ** -0.5).astype(dt),
          expert_bias=bias)
      x = jax.random.normal(k[4], (n, h), jnp.float32).astype(dt)
      ct = jax.random.normal(k[5], (n, h), jnp.float32).astype(dt)  # cotangent of y
      return x, params, ct

    shard = lambda s: NamedSharding(mesh, s)  # noqa: E731
    out = (shard(tok), jax.tree.map(shard, specs), shard(tok))
    return jax.jit(init, out_shardings=out)(jax.random.key(seed))

  def _config(self, backend: str, kernel: KernelConfig, transfer: TransferConfig,
              overlap=None, replica_slots: int = 0) -> UniEPConfig:
    if self.num_sms is not None:
      kernel = dataclasses.replace(kernel, num_sms=self.num_sms)
    transport = "padded" if backend == "pallas" else None
    return UniEPConfig(backend=backend, kernel=kernel, transfer=transfer, transport=transport,
                       overlap=overlap if backend == "uniep" else None,
                       replica_slots=replica_slots)

  def _jitted(self, cfg: UniEPConfig):
    """The jitted layer for `cfg`: forward, or loss value and gradients for "bwd"."""
    import jax
    import jax.numpy as jnp
    from uniep_jax.moe import moe_ffn
    mesh, k = self.mesh, self.problem.top_k

    def fwd(x, p, ct):
      del ct
      return moe_ffn(x, p, mesh=mesh, top_k=k, config=cfg)[0]

    def loss(x, p, ct):
      y, aux = moe_ffn(x, p, mesh=mesh, top_k=k, config=cfg)
      return (jnp.sum(y.astype(jnp.float32) * ct.astype(jnp.float32))
              + 1e-2 * aux["load_balance_loss"])

    return jax.jit(fwd if self.problem.direction == "fwd"
                   else jax.value_and_grad(loss, argnums=(0, 1)))

  def _candidate_config(self, cand: Candidate) -> UniEPConfig:
    return self._config(self.backend, cand.kernel, cand.transfer, cand.overlap,
                        cand.replica_slots)

  def _compile(self, cfg: UniEPConfig):
    t0 = time.perf_counter()
    with self._lower_lock:
      lowered = self._jitted(cfg).lower(*self.inputs)
    return lowered.compile(), time.perf_counter() - t0

  def _compiled(self, cfg: UniEPConfig):
    """(executable, compile seconds): the prefetched one if any (its compile error,
    if it failed, is raised here), else compiled now."""
    future = self._pending.pop(cfg, None)
    return future.result() if future is not None else self._compile(cfg)

  def prefetch(self, cands: Sequence[Candidate], kernels: Sequence[KernelConfig]) -> None:
    if self._pool is None:
      return
    cfgs = ([self._config("pallas", kn, TransferConfig()) for kn in kernels]
            + [self._candidate_config(c) for c in cands])
    for cfg in cfgs:
      if cfg not in self._pending:
        self._pending[cfg] = self._pool.submit(self._compile, cfg)

  def discard(self, cands: Sequence[Candidate]) -> None:
    """Forgets prefetched compiles of `cands` (not run: past a stage's deadline, or
    their reference failed); queued ones are cancelled."""
    for c in cands:
      future = self._pending.pop(self._candidate_config(c), None)
      if future is not None:
        future.cancel()

  def close(self, wait: bool = True) -> None:
    """Drops what was prefetched and not used (queued compiles are cancelled; with
    wait=False, compiles already running are not waited for)."""
    if self._pool is not None:
      self._pool.shutdown(wait=wait, cancel_futures=True)
      self._pending.clear()

  def reference(self, kernel: KernelConfig, replica_slots: int = 0) -> tuple:
    compiled, _ = self._compiled(self._config("pallas", kernel, TransferConfig(),
                                              replica_slots=replica_slots))
    return tree_checksum(compiled(*self.inputs))

  def measure(self, cand: Candidate) -> Measurement:
    """compile_s: the compile alone (in a worker thread when prefetched)."""
    compiled, compile_s = self._compiled(self._candidate_config(cand))
    # holding the lowering lock keeps the workers' Python lowering (which holds the
    # GIL) out of the timed loop; their XLA compiles (C++, no GIL) go on
    with self._lower_lock:
      out = block(compiled(*self.inputs))
      checksum = tree_checksum(out)
      del out
      t = time_ms(compiled, *self.inputs, **self.timing)
    return Measurement(median_ms=t["median_ms"], compile_s=compile_s, checksum=checksum,
                       timing=t)


# ---------------------------------------------------------------------------
# The search loop
# ---------------------------------------------------------------------------
@dataclasses.dataclass
class Trial:
  candidate: Candidate
  stage: str
  status: str    # ok | mismatch | failed | reference_failed | skipped (| running: checkpoints)
  median_ms: Optional[float] = None
  compile_s: Optional[float] = None
  checksum: Optional[tuple] = None
  reference_checksum: Optional[tuple] = None
  error: Optional[str] = None
  timing: Optional[dict] = None

  def to_json(self) -> dict:
    d = dict(label=self.candidate.label(), knobs=self.candidate.knobs(), stage=self.stage,
             status=self.status, median_ms=self.median_ms, compile_s=self.compile_s,
             checksum=list(self.checksum) if self.checksum else None,
             reference_checksum=list(self.reference_checksum) if self.reference_checksum else None,
             bitwise_equal_to_reference=(None if self.checksum is None
                                         or self.reference_checksum is None
                                         else self.checksum == self.reference_checksum),
             error=self.error, timing=self.timing)
    return d

  @classmethod
  def from_json(cls, d: dict) -> "Trial":
    return cls(candidate=candidate_from_knobs(d["knobs"]), stage=d["stage"], status=d["status"],
               median_ms=d.get("median_ms"), compile_s=d.get("compile_s"),
               checksum=tuple(d["checksum"]) if d.get("checksum") else None,
               reference_checksum=(tuple(d["reference_checksum"])
                                   if d.get("reference_checksum") else None),
               error=d.get("error"), timing=d.get("timing"))


def _loud(msg: str) -> None:
  bar = "!" * 78
  print(f"{bar}\n{msg}\n{bar}", file=sys.stderr, flush=True)


class _Search:
  """Runs candidates against the budget, verifying each against its reference."""

  def __init__(self, runner: Runner, deadline: float, clock, progress: bool,
               references: dict, previous: dict, on_trial: Optional[Callable] = None):
    self.runner, self.deadline, self.clock, self.progress = runner, deadline, clock, progress
    self.on_trial = on_trial
    self.references = references    # kernel label -> ("ok", checksum) | ("failed", error)
    self.previous = previous        # candidate label -> Trial (resume)
    self.trials: list[Trial] = []
    # A run killed while a candidate was "running" may have died in another one's
    # background compile: after such a run, compile one at a time to find out.
    self.prefetch = not any(t.status == "running" for t in previous.values())
    if not self.prefetch and getattr(runner, "prefetch_window", 0):
      _loud("tune: the resumed report ends in a killed candidate; compiling one candidate "
            "at a time in this run (a background compile may have been the culprit)")

  def _reference(self, kernel: KernelConfig, replica_slots: int = 0):
    """The "pallas" reference of a tiling (with replica slots: the same slots, whose
    weight gradients are summed differently from the unreplicated ones)."""
    kernel = reference_kernel(kernel)
    label = kernel_label(kernel) + (f"|rs{replica_slots}" if replica_slots else "")
    if label not in self.references:
      try:
        args = (kernel, replica_slots) if replica_slots else (kernel,)
        self.references[label] = ("ok", tuple(self.runner.reference(*args)))
      except Exception as e:  # noqa: BLE001 - recorded, the candidate is not verified
        self.references[label] = ("failed", repr(e)[:500])
    return self.references[label]

  def run(self, cands: Sequence[Candidate], stage: str, deadline: Optional[float] = None):
    from tqdm import tqdm
    deadline = self.deadline if deadline is None else min(deadline, self.deadline)
    bar = tqdm(cands, desc=f"tune {stage}", disable=not self.progress, file=sys.stderr,
               dynamic_ncols=True)
    window = getattr(self.runner, "prefetch_window", 0) if self.prefetch else 0
    for i, cand in enumerate(bar):
      if window and self.clock() < deadline:
        self._prefetch(cands[i:i + window])
      prev = self.previous.get(cand.label())
      if prev is not None and prev.status == "running":
        # The checkpoint was written before this candidate ran and never updated.
        prev = Trial(cand, stage, "failed", error="did not finish in an earlier run (killed at "
                     "the time limit or hung); not retried")
      if prev is not None and prev.status != "skipped":
        prev.stage = stage
        self.trials.append(prev)
        continue
      if self.clock() >= deadline:
        self.trials.append(Trial(cand, stage, "skipped", error="time budget"))
        continue
      if self.on_trial is not None:   # checkpoint "running": a kill or hang is not retried
        self.trials.append(Trial(cand, stage, "running"))
        self.on_trial(self)
        self.trials.pop()
      self.trials.append(self._one(cand, stage))
      if self.on_trial is not None:
        self.on_trial(self)
      best = best_trial(self.trials)
      if best is not None:
        bar.set_postfix_str(f"best {best.median_ms:.3f} ms {best.candidate.label()}")
    bar.close()
    if window:   # compiled ahead and not run (deadline, failed reference): drop them
      measured = {t.candidate.label() for t in self.trials if t.median_ms is not None}
      self.runner.discard([c for c in cands if c.label() not in measured])

  def _prefetch(self, cands: Sequence[Candidate]) -> None:
    """Asks the runner to compile ahead what these candidates will run: the ones not
    reused from a resumed report, and the references not yet computed."""
    todo = [c for c in cands
            if self.previous.get(c.label()) is None or self.previous[c.label()].status == "skipped"]
    refs = [reference_kernel(c.kernel) for c in todo]
    kernels = {kernel_label(k): k for k in refs if kernel_label(k) not in self.references}
    self.runner.prefetch(todo, list(kernels.values()))

  def _one(self, cand: Candidate, stage: str) -> Trial:
    ref_status, ref = self._reference(cand.kernel, cand.replica_slots)
    if ref_status != "ok":
      return Trial(cand, stage, "reference_failed", error=f"reference (pallas) failed: {ref}")
    try:
      m = self.runner.measure(cand)
    except Exception as e:  # noqa: BLE001 - compile/run failures are counted, not fatal
      return Trial(cand, stage, "failed", reference_checksum=ref, error=repr(e)[:500])
    checksum = tuple(m.checksum)
    status = "ok" if checksum == ref else "mismatch"
    if status == "mismatch":
      _loud(f"BITWISE MISMATCH (a bug; never picked): {cand.label()} backend "
            f"{self.runner.backend} vs pallas with the same tiling, walked row-major:\n"
            f"  candidate {checksum}\n  reference {ref}")
    return Trial(cand, stage, status, median_ms=m.median_ms, compile_s=m.compile_s,
                 checksum=checksum, reference_checksum=ref, timing=m.timing)


def best_trial(trials: Sequence[Trial]) -> Optional[Trial]:
  """The fastest verified trial: status "ok" only (mismatches are never picked)."""
  ok = [t for t in trials if t.status == "ok" and t.median_ms is not None]
  return min(ok, key=lambda t: t.median_ms) if ok else None


@dataclasses.dataclass
class TuneResult:
  problem: TuneProblem
  device: DeviceFacts
  backend: str
  strategy: str
  budget_s: float
  elapsed_s: float
  enumeration: Enumeration
  trials: list
  references: dict
  default: Candidate
  stages: tuple = STAGES   # the staged search's stages this run searched
  overlap_points: tuple = ()  # the space's stage-3 points (SearchSpace.overlap) this run had
  routing: str = "balanced"   # the runner's routing (ROUTINGS)
  slot_points: tuple = ()     # the space's stage-4 slot counts (SearchSpace.replica_slots)

  @property
  def best(self) -> Optional[Trial]:
    return best_trial(self.trials)

  @property
  def mismatches(self) -> list:
    return [t for t in self.trials if t.status == "mismatch"]

  def top(self, n: int = 5) -> list:
    ok = sorted((t for t in self.trials if t.status == "ok"), key=lambda t: t.median_ms)
    return ok[:n]

  def default_trial(self) -> Optional[Trial]:
    for t in self.trials:
      if t.candidate == self.default and t.median_ms is not None:
        return t
    return None

  def counts(self) -> dict:
    c = dict(enumerated=self.enumeration.enumerated, rejected=len(self.enumeration.rejected),
             valid=len(self.enumeration.candidates))
    for s in ("ok", "mismatch", "failed", "reference_failed", "skipped"):
      c[s] = sum(t.status == s for t in self.trials)
    c["timed"] = c["ok"] + c["mismatch"]
    return c

  def transfer_consistency(self) -> list:
    """Per KernelConfig: do all its timed candidates (any TransferConfig) agree bitwise?"""
    groups: dict = {}   # by tiling: neither the transfer nor the tile order may change a bit
    for t in self.trials:   # (replica slots sum weight gradients differently: own groups)
      if t.checksum is not None:
        slots = t.candidate.replica_slots
        groups.setdefault(kernel_label(reference_kernel(t.candidate.kernel))
                          + (f"|rs{slots}" if slots else ""), []).append(t)
    return [dict(kernel=k, candidates=len(ts), transfers=sorted({t.candidate.label() for t in ts}),
                 distinct_checksums=len({t.checksum for t in ts}),
                 consistent=len({t.checksum for t in ts}) == 1)
            for k, ts in groups.items()]

  def spread(self) -> Optional[dict]:
    best, dflt = self.best, self.default_trial()
    if best is None or dflt is None or dflt.status != "ok":
      return None
    return dict(default_ms=dflt.median_ms, best_ms=best.median_ms,
                default_over_best=dflt.median_ms / best.median_ms,
                saved_ms=dflt.median_ms - best.median_ms)

  def to_json(self) -> dict:
    best = self.best
    consistency = self.transfer_consistency()
    return dict(
        tuner="uniep_jax.autotune", format=CACHE_FORMAT, key=cache_key(self.device.kind, self.problem),
        problem=dataclasses.asdict(self.problem), device=dataclasses.asdict(self.device),
        backend=self.backend, strategy=self.strategy, stages=list(self.stages),
        overlap_points=[list(p) for p in self.overlap_points],
        routing=self.routing, replica_slot_points=list(self.slot_points),
        budget_s=self.budget_s,
        elapsed_s=self.elapsed_s, counts=self.counts(),
        default=self.default.label(),
        best=None if best is None else best.to_json(),
        top5=[t.to_json() for t in self.top(5)], spread=self.spread(),
        mismatches=[t.to_json() for t in self.mismatches],
        transfer_consistency=consistency,
        transfer_consistent=all(g["consistent"] for g in consistency),
        references={k: dict(status=s, value=list(v) if s == "ok" else v)
                    for k, (s, v) in self.references.items()},
        trials=[t.to_json() for t in self.trials],
        rejected=self.enumeration.rejected)


def _default_candidate(enum: Enumeration, problem: TuneProblem, device: DeviceFacts) -> Candidate:
  """What an untuned user gets: the dataclass defaults if they can run here,
  else the heuristic, else the first valid candidate."""
  if DEFAULT_CANDIDATE in enum.candidates:
    return DEFAULT_CANDIDATE
  try:
    h = heuristic_config(problem, device)
  except ValueError:
    h = None
  for c in enum.candidates:
    if h is not None and (c == h or (c.kernel == h.kernel and c.transfer == DEFAULT_CANDIDATE.transfer)):
      return c
  return enum.candidates[0] if enum.candidates else DEFAULT_CANDIDATE


def tune(problem: TuneProblem, runner: Runner, *, device: Optional[DeviceFacts] = None,
         space: SearchSpace = SearchSpace(), budget_s: float = 480.0, strategy: str = "staged",
         stage1_fraction: float = 0.6, max_candidates: Optional[int] = None,
         stages: Sequence[str] = STAGES,
         resume: Optional[dict] = None, progress: bool = True,
         on_trial: Optional[Callable[[TuneResult], None]] = None,
         clock: Callable[[], float] = time.monotonic) -> TuneResult:
  """Enumerates, prunes, then times and verifies candidates within `budget_s`.

  runner: a `Runner` (`LayerRunner` on GPUs; tests inject fakes). resume: a
  previous report (`TuneResult.to_json()`) of the same key; its timed trials and
  references are reused. max_candidates caps the candidates of each stage.
  stages ("staged" only): which of "kernel", "transfer", "overlap", "slots" to search; without
  "kernel", stage 1 times the default alone (the baseline every report has), so
  `stages=("overlap",)` compares the overlap points with the default candidate in one
  short call (a later `resume` can add the other stages).
  on_trial(partial result): called after every timed candidate (checkpoints).
  The budget is checked before each candidate: one started just before the
  deadline runs to its end (a compile and a timing: up to ~1 min at full size)."""
  if strategy not in ("staged", "grid"):
    raise ValueError(f"strategy={strategy!r} must be 'staged' or 'grid'")
  unknown = [st for st in stages if st not in STAGES]
  if unknown or not stages:
    raise ValueError(f"stages={tuple(stages)!r}: each must be one of {STAGES}, at least one")
  device = device or DeviceFacts.from_device()
  start = clock()
  enum = enumerate_candidates(space, problem, device, runner.uses_transfer)
  previous, references = {}, {}
  if resume:
    check_report_format(resume)
    if resume.get("key") != cache_key(device.kind, problem):
      raise ValueError(f"resume report key {resume.get('key')!r} differs from "
                       f"{cache_key(device.kind, problem)!r}")
    routing = getattr(runner, "routing", "balanced")
    if resume.get("routing", "balanced") != routing:
      raise ValueError(f"resume report routing {resume.get('routing', 'balanced')!r} differs "
                       f"from this run's {routing!r}")
    previous = {d["label"]: Trial.from_json(d) for d in resume.get("trials", [])}
    references = {k: (v["status"], tuple(v["value"]) if v["status"] == "ok" else v["value"])
                  for k, v in resume.get("references", {}).items()}
  default = _default_candidate(enum, problem, device)
  deadline = start + budget_s

  def carried(search):
    """Resumed trials this run has not visited (e.g. a `--stages overlap` run resuming a
    full search): kept in the report and in the choice of the best, never dropped."""
    seen = {t.candidate.label() for t in search.trials}
    return [t for label, t in previous.items()
            if label not in seen and t.status not in ("running", "skipped")]

  def result_now(search):
    return TuneResult(problem, device, runner.backend, strategy, budget_s, clock() - start,
                      enum, list(search.trials) + carried(search), search.references, default,
                      tuple(stages), tuple(tuple(p) for p in space.overlap),
                      getattr(runner, "routing", "balanced"), tuple(space.replica_slots))

  search = _Search(runner, deadline, clock, progress, references, previous,
                   on_trial=None if on_trial is None else (lambda s: on_trial(result_now(s))))
  cap = (lambda cs: cs[:max_candidates]) if max_candidates else (lambda cs: cs)
  if strategy == "grid":
    search.run(cap(enum.candidates), "grid")
  else:
    dt = default.transfer
    stage1 = ([c for c in enum.candidates if c.transfer == dt] if "kernel" in stages
              else [default])
    later = runner.uses_transfer and ("transfer" in stages or "overlap" in stages)
    search.run(cap(stage1), "kernel",
               deadline=start + budget_s * (stage1_fraction if later else 1.0))
    best = best_trial(search.trials + carried(search))

    def run_overlap(base: Candidate):   # stage 3: the overlap points on `base`
      stage3, rejected = overlap_candidates(space, base, problem, device)
      enum.rejected.extend(rejected)
      search.run(cap(stage3), "overlap")

    if not later:
      pass
    elif "transfer" not in stages:
      if space.overlap and best is not None:
        run_overlap(best.candidate)
    else:
      if best is None:
        _loud("tune: no verified KernelConfig in stage 1; stages 2 and 3 skipped")
      else:
        bk = best.candidate.kernel
        stage2 = [c for c in enum.candidates
                  if c.kernel == bk and c.transfer != dt]
        # stage 3 (overlap points) gets half of what is left after stage 1
        overlap_next = bool(space.overlap) and "overlap" in stages
        search.run(cap(stage2), "transfer", deadline=(
            None if not overlap_next else start + budget_s * (1 + stage1_fraction) / 2))
        best = best_trial(search.trials + carried(search))
        if overlap_next and best is not None:
          run_overlap(best.candidate)
    best = best_trial(search.trials + carried(search))
    if "slots" in stages and space.replica_slots and best is not None:
      # stage 4: the best point's kernel and transfer with each slot count
      stage4, rejected = slot_candidates(space, best.candidate, problem)
      enum.rejected.extend(rejected)
      search.run(cap(stage4), "slots")
  result = result_now(search)
  for g in result.transfer_consistency():
    if not g["consistent"]:
      _loud(f"TRANSFER INCONSISTENCY (a bug): KernelConfig {g['kernel']} gives "
            f"{g['distinct_checksums']} different checksums over transfers {g['transfers']}")
  return result


def cacheable_best(result: TuneResult) -> Optional[Trial]:
  """The trial a cache entry takes: the fastest verified one without replica slots (the
  cache's entries resolve kernel, transfer and overlap; the slot count is the user's,
  by the routing their model has: the report says which won here)."""
  return best_trial([t for t in result.trials if not t.candidate.replica_slots])


def cache_entry(result: TuneResult, commit: Optional[str] = None,
                date: Optional[str] = None) -> dict:
  """The cache entry of a result's best verified candidate without replica slots
  (measured numbers only); commit / date: the commit that ran them and when (default:
  this checkout's, now)."""
  if commit is None:
    commit = git_commit()
  best = cacheable_best(result)
  if best is None:
    raise ValueError("no verified candidate: nothing to cache")
  k = dataclasses.asdict(best.candidate.kernel)
  k.pop("num_sms")
  spread = result.spread()
  overlap = best.candidate.overlap
  return dict(kernel=k, transfer=dataclasses.asdict(best.candidate.transfer),
              overlap=dataclasses.asdict(overlap) if overlap is not None else None,
              median_ms=best.median_ms, default_ms=spread["default_ms"] if spread else None,
              backend=result.backend, strategy=result.strategy, counts=result.counts(),
              device_count=result.problem.ep, git_commit=commit,
              date=date or time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()))


def update_cache(path, key: str, entry: dict) -> None:
  """Adds/replaces one entry of a cache file (atomic rewrite). A file of another
  `CACHE_FORMAT` raises ValueError (its other entries would be unreadable with this one)."""
  path = os.fspath(path)
  data = dict(format=CACHE_FORMAT, entries={})
  if os.path.exists(path):
    with open(path) as f:
      data = json.load(f)
    if data.get("format") != CACHE_FORMAT:
      raise ValueError(f"{path}: tune cache format {data.get('format')}, this version writes "
                       f"{CACHE_FORMAT}: not adding {key!r} to it")
  data.setdefault("entries", {})[key] = entry
  os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
  tmp = f"{path}.tmp{os.getpid()}"
  with open(tmp, "w") as f:
    json.dump(data, f, indent=1, sort_keys=True)
    f.write("\n")
  os.replace(tmp, path)


def record(result: TuneResult, cache_path, commit: Optional[str] = None,
           date: Optional[str] = None) -> str:
  """Writes the best verified candidate without replica slots into the cache file, unless
  the run saw any bitwise mismatch or was routed other than "balanced" (then nothing is
  written). Returns what happened: "written", "mismatch" or "nothing" (no verified
  candidate, or a skewed routing)."""
  key = cache_key(result.device.kind, result.problem)
  if result.mismatches:
    _loud(f"{len(result.mismatches)} bitwise mismatch(es) for {key}: no cache entry written")
    return "mismatch"
  if result.routing != "balanced":
    print(f"routing {result.routing!r}: the cache holds balanced-routing winners; no cache "
          f"entry written for {key} (the report has this run's)", file=sys.stderr)
    return "nothing"
  if cacheable_best(result) is None:
    print(f"no verified candidate for {key}: no cache entry written", file=sys.stderr)
    return "nothing"
  update_cache(cache_path, key, cache_entry(result, commit, date))
  print(f"cache {cache_path}: wrote {key}", flush=True)
  return "written"


def check_report_format(report: dict) -> None:
  """Raises ValueError unless `report` (`TuneResult.to_json()`) is of this version's
  format: the knobs of another format's trials are another parameter space."""
  if report.get("format") != CACHE_FORMAT:
    raise ValueError(f"tune report {report.get('key')!r}: format {report.get('format')}, this "
                     f"version reads {CACHE_FORMAT} (its knobs are another parameter space)")


class _ReplayRunner:
  """A Runner for `replay`: every trial and reference comes from the report."""
  prefetch_window = 0

  def __init__(self, backend: str, routing: str = "balanced"):
    self.backend, self.uses_transfer, self.routing = backend, backend == "uniep", routing

  def reference(self, kernel, replica_slots=0):
    raise RuntimeError(f"replay: the report has no reference for {kernel_label(kernel)}")

  def measure(self, cand):
    raise RuntimeError(f"replay: the report has no trial of {cand.label()}")


def replay(report: dict, space: SearchSpace = SearchSpace()) -> TuneResult:
  """The TuneResult of a saved report (`TuneResult.to_json()`), rebuilt without a GPU:
  the tuner's own search (over `space`: pass the run's; its overlap points are the
  report's own when it names them) on the report's device facts,
  every timed trial taken from the report, nothing measured (what the budget did not
  reach stays skipped), and the report's own default candidate (the dataclass
  defaults may have changed since). For a run killed after its last checkpoint,
  before it recorded its cache entry. A report of another format raises ValueError."""
  check_report_format(report)
  problem = TuneProblem(**report["problem"])
  device = DeviceFacts(**report["device"])
  if "overlap_points" in report and space.overlap:
    space = dataclasses.replace(space, overlap=tuple(tuple(p) for p in report["overlap_points"]))
  if report.get("replica_slot_points"):
    space = dataclasses.replace(space, replica_slots=tuple(report["replica_slot_points"]))
  clock = iter(range(10 ** 9)).__next__   # the budget is spent at once: nothing new runs
  runner = _ReplayRunner(report["backend"], report.get("routing", "balanced"))
  result = tune(problem, runner, device=device, space=space,
                budget_s=0.0, strategy=report["strategy"], resume=report, progress=False,
                stages=tuple(report.get("stages", STAGES)),
                clock=lambda: float(clock()))
  result.budget_s, result.elapsed_s = report["budget_s"], report["elapsed_s"]
  ran = {t["label"]: t for t in report.get("trials", [])}
  if report.get("default") in ran:
    result.default = candidate_from_knobs(ran[report["default"]]["knobs"])
  elif report.get("default") != result.default.label():
    raise ValueError(f"the report's default {report.get('default')!r} is not among its trials "
                     f"and differs from today's {result.default.label()!r}")
  return result


# ---------------------------------------------------------------------------
# Report
# ---------------------------------------------------------------------------
def report_stem(device_kind: str, shape_name: str, ep: int, direction: str,
                routing: str = "balanced") -> str:
  kind = "".join(c if c.isalnum() else "_" for c in device_kind).strip("_")
  return (f"tune_{kind}_{shape_name}_ep{ep}_{direction}"
          + ("" if routing == "balanced" else f"_{routing}"))


def plot(result: TuneResult, path: str) -> None:
  """Median ms against each knob (ok: dots; mismatch: red x; default: ring; best: star)."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  knobs = KERNEL_KNOBS + TRANSFER_KNOBS
  rows = -(-len(knobs) // 3)
  fig, grid = plt.subplots(rows, 3, figsize=(11, 2.8 * rows), sharey=True)
  axes = list(grid.flat)
  auto_x = 0.5   # where a knob's None ("auto": raster_rows, wgrad_raster) is drawn on the log axis

  def at(t, knob):
    v = t.candidate.knobs()[knob]
    return auto_x if v is None else v

  ok = [t for t in result.trials if t.status == "ok"]
  bad = [t for t in result.trials if t.status == "mismatch"]
  best, dflt = result.best, result.default_trial()
  for ax, knob in zip(axes, knobs):
    ax.scatter([at(t, knob) for t in ok], [t.median_ms for t in ok], s=14,
               alpha=0.7, label="verified")
    if bad:
      ax.scatter([at(t, knob) for t in bad], [t.median_ms for t in bad],
                 marker="x", color="red", label="MISMATCH")
    if dflt is not None and dflt.median_ms is not None:
      ax.scatter([at(dflt, knob)], [dflt.median_ms], s=80, facecolors="none",
                 edgecolors="black", label="default")
    if best is not None:
      ax.scatter([at(best, knob)], [best.median_ms], marker="*", s=120,
                 color="gold", edgecolors="black", label="best")
    ax.set_xscale("log", base=2)
    ax.set_xlabel(knob + (f" ({auto_x} = auto)" if knob in ("raster_rows", "wgrad_raster")
                          else ""))
  for ax in axes[len(knobs):]:
    ax.set_visible(False)
  axes[0].set_ylabel("median ms per call")
  axes[0].legend(fontsize=7)
  p = result.problem
  fig.suptitle(f"{result.device.kind}, EP={p.ep}, T={p.tokens} H={p.hidden} F={p.ffn} "
               f"E={p.experts} K={p.top_k} {p.dtype}, {p.direction}, backend {result.backend}",
               fontsize=9)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)


def summary(result: TuneResult) -> str:
  lines = [f"key {cache_key(result.device.kind, result.problem)}",
           f"counts {result.counts()}  elapsed {result.elapsed_s:.1f} s"]
  for i, t in enumerate(result.top(5)):
    lines.append(f"  top{i + 1}: {t.median_ms:9.3f} ms  {t.candidate.label()}")
  s = result.spread()
  if s:
    lines.append(f"  default {s['default_ms']:.3f} ms, best {s['best_ms']:.3f} ms: "
                 f"default/best = {s['default_over_best']:.3f}x")
  if result.mismatches:
    lines.append(f"  MISMATCHES: {[t.candidate.label() for t in result.mismatches]}")
  return "\n".join(lines)


def write_report(result: TuneResult, out_dir: str, shape_name: str, with_plot: bool = True) -> dict:
  """Writes <stem>.json (and <stem>.png) under out_dir; returns the paths."""
  os.makedirs(out_dir, exist_ok=True)
  p = result.problem
  stem = os.path.join(out_dir, report_stem(result.device.kind, shape_name, p.ep, p.direction,
                                           result.routing))
  payload = dict(result.to_json(), shape_name=shape_name)
  try:
    payload["meta"] = run_metadata()
  except Exception as e:  # noqa: BLE001 - metadata only
    payload["meta"] = dict(error=repr(e)[:200])
  payload["meta"]["xla_flags"] = os.environ.get("XLA_FLAGS", "")
  with open(stem + ".json", "w") as f:
    json.dump(payload, f, indent=1, sort_keys=True)
  paths = dict(json=stem + ".json")
  if not with_plot:
    return paths
  try:
    plot(result, stem + ".png")
    paths["png"] = stem + ".png"
  except Exception as e:  # noqa: BLE001 - the JSON is the record
    print(f"plot failed: {e!r}", file=sys.stderr)
  return paths


# ---------------------------------------------------------------------------
# CLI
# ---------------------------------------------------------------------------
def _problem_shape(args):
  if args.shape:
    t, h, f, e, k = (int(v) for v in args.shape.split(","))
    return args.shape.replace(",", "x"), (t, h, f, e, k)
  shapes = {**SHAPES, **SMOKE_SHAPES}
  if args.moe_config not in shapes:
    raise SystemExit(f"--moe-config {args.moe_config!r} unknown; one of {sorted(shapes)}")
  s = shapes[args.moe_config]
  return s.name, (s.tokens, s.hidden, s.ffn, s.experts, s.top_k)


def parse_overlap_points(text: str) -> tuple:
  """'16,16,2048;4,4,2048' -> ((16, 16, 2048), (4, 4, 2048)): SearchSpace.overlap, each
  point down_return_ctas,wgrad_return_ctas,chunk_rows."""
  points = []
  for item in (t.strip() for t in text.split(";")):
    if not item:
      continue
    fields = [f.strip() for f in item.split(",")]
    if len(fields) != 3 or not all(f.isdigit() for f in fields):
      raise ValueError(f"--overlap-points: {item!r} must be "
                       f"down_return_ctas,wgrad_return_ctas,chunk_rows")
    points.append(tuple(int(f) for f in fields))
  return tuple(points)


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(
      prog="uniep-tune", description="Autotune the Pallas backends' KernelConfig, "
      "TransferConfig and OverlapConfig for one MoE shape on these devices.",
      epilog=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--moe-config", default="deepseek-like",
                  help=f"a target shape: one of {sorted({**SHAPES, **SMOKE_SHAPES})}")
  ap.add_argument("--shape", default=None, help="T,H,F,E,K per rank (overrides --moe-config)")
  ap.add_argument("--ep", type=int, default=0, help="EP degree (default: all local devices)")
  ap.add_argument("--direction", default="fwd,bwd", help="comma list of fwd, bwd")
  ap.add_argument("--dtype", default="bfloat16")
  ap.add_argument("--backend", default="uniep", choices=("uniep", "pallas"))
  ap.add_argument("--budget-s", type=float, default=450.0, help="total, split over directions")
  ap.add_argument("--strategy", default="staged", choices=("staged", "grid"))
  ap.add_argument("--max-candidates", type=int, default=None, help="cap per stage")
  ap.add_argument("--num-sms", type=int, default=None, help="override (CPU interpret mode)")
  ap.add_argument("--trials", type=int, default=5, help="timing trials per candidate")
  ap.add_argument("--cache", default=None,
                  help=f"cache file to update (default ${CACHE_ENV}, else <out>/tuned_configs.json;"
                       " uniep_jax/tuned_configs.json to ship)")
  ap.add_argument("--out", default=None, help="report dir (default $OUT/tune, else ./tune_reports)")
  ap.add_argument("--resume", default=None, metavar="DIR",
                  help="continue from the reports of the same problems in DIR")
  ap.add_argument("--stages", default=",".join(STAGES),
                  help="comma list of the staged search's stages to run (kernel, transfer, "
                       "overlap, slots); without kernel, stage 1 is the default alone: "
                       "--stages overlap times the overlap points against the default")
  ap.add_argument("--no-progress", action="store_true")
  ap.add_argument("--record-from", default=None, metavar="REPORT",
                  help="no tuning, no GPU: rebuild the result of a saved report (a run killed "
                       "before it wrote its cache entry) and record its best in --cache "
                       "(default: $UNIEP_TUNE_CACHE, else the shipped uniep_jax/tuned_configs.json)")
  ap.add_argument("--compile-workers", type=int, default=1,
                  help="compile the next candidates in this many threads while one is timed "
                       "(see LayerRunner; use with XLA_FLAGS=--xla_gpu_deterministic_ops=true)")
  ap.add_argument("--routing", default="balanced", choices=ROUTINGS,
                  help="how the timed layer's tokens are routed (module docstring); a run not "
                       "balanced writes its report but no cache entry")
  ap.add_argument("--replica-slots", default="", metavar="S,S,...",
                  help="stage 4: UniEPConfig.replica_slots values to time on the best point "
                       "(EP > 1; with --routing zipf or all_to_one, where they can win)")
  ap.add_argument("--overlap-points", default=None, metavar="DOWN,WGRAD,CHUNK;...",
                  help="stage 3's points instead of SearchSpace().overlap: OverlapConfig's "
                       "down_return_ctas, wgrad_return_ctas, chunk_rows, ';' between points "
                       "(empty: no stage 3)")
  args = ap.parse_args(argv)
  space = SearchSpace()
  if args.overlap_points is not None:
    space = dataclasses.replace(space, overlap=parse_overlap_points(args.overlap_points))
  try:
    slots = tuple(int(v) for v in args.replica_slots.split(",") if v.strip())
  except ValueError:
    ap.error(f"--replica-slots {args.replica_slots!r}: comma-separated integers")
  if any(v < 1 for v in slots):
    ap.error(f"--replica-slots {args.replica_slots!r}: each must be >= 1 (0 is every other stage)")
  space = dataclasses.replace(space, replica_slots=slots)
  if args.record_from:
    with open(args.record_from) as fh:
      report = json.load(fh)
    meta = report.get("meta", {})
    if not meta.get("git_commit") or not meta.get("date"):
      raise SystemExit(f"{args.record_from}: no meta.git_commit / meta.date: not recording a "
                       f"measurement whose commit is unknown")
    result = replay(report, space)
    print(summary(result), flush=True)
    cache = user_cache_path(args.cache) or os.fspath(tuning.SHIPPED_CACHE)
    return 2 if record(result, cache, meta["git_commit"], meta["date"]) == "mismatch" else 0

  import jax
  directions = [d for d in args.direction.split(",") if d]
  for d in directions:
    if d not in DIRECTIONS:
      raise SystemExit(f"--direction {d!r} must be in {DIRECTIONS}")
  shape_name, (t, h, f, e, k) = _problem_shape(args)
  ep = args.ep or len(jax.devices())
  out = args.out or (os.path.join(os.environ["OUT"], "tune") if os.environ.get("OUT")
                     else "tune_reports")
  cache = user_cache_path(args.cache) or os.path.join(out, "tuned_configs.json")
  device = DeviceFacts.from_device(num_sms=args.num_sms)
  rc = 0
  per_direction = args.budget_s / len(directions)
  for direction in directions:
    problem = TuneProblem(t, h, f, e, k, ep, args.dtype, direction)
    resume = None
    if args.resume:
      prev = os.path.join(args.resume, report_stem(device.kind, shape_name, ep, direction,
                                                   args.routing) + ".json")
      if os.path.exists(prev):
        with open(prev) as fh:
          resume = json.load(fh)
        flags = os.environ.get("XLA_FLAGS", "")
        if resume.get("format") != CACHE_FORMAT:
          print(f"NOT resuming from {prev}: report format {resume.get('format')}, this version "
                f"reads {CACHE_FORMAT}", flush=True)
          resume = None
        elif resume.get("meta", {}).get("xla_flags", "") != flags:
          # other XLA flags: other glue kernels, other times (and maybe other bits)
          print(f"NOT resuming from {prev}: it ran with XLA_FLAGS="
                f"{resume.get('meta', {}).get('xla_flags', '')!r}, this run has {flags!r}",
                flush=True)
          resume = None
        else:
          print(f"resuming from {prev}", flush=True)
    runner = LayerRunner(problem, backend=args.backend, num_sms=args.num_sms, trials=args.trials,
                         compile_workers=args.compile_workers, routing=args.routing)
    print(f"tuning {cache_key(device.kind, problem)} (budget {per_direction:.0f} s)", flush=True)
    checkpoint = lambda r: write_report(r, out, shape_name, with_plot=False)  # noqa: E731
    try:
      result = tune(problem, runner, device=device, budget_s=per_direction,
                    space=space,
                    strategy=args.strategy, max_candidates=args.max_candidates,
                    stages=tuple(st.strip() for st in args.stages.split(",") if st.strip()),
                    resume=resume,
                    progress=not args.no_progress, on_trial=checkpoint)
    except BaseException:
      runner.close()   # queued compiles cancelled
      raise
    # report and cache entry before waiting for background compiles still running (up
    # to a minute each: a run killed at a time limit while it waited would lose its
    # entry); after the last direction, not waited for at all
    runner.close(wait=False)
    paths = write_report(result, out, shape_name)
    print(summary(result), flush=True)
    print(f"wrote {paths}", flush=True)
    if record(result, cache) == "mismatch":
      rc = 2
    if direction != directions[-1]:
      runner.close(wait=True)   # no compile of this direction runs beside the next one's timing
    del runner
  return rc


if __name__ == "__main__":
  sys.exit(main())
