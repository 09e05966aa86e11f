"""Multi-process runs on jax.distributed, on one machine: 2 processes x 4 virtual CPU
devices (gloo collectives) against 1 process x 8 devices, mesh data=2,expert=4.

Every run is a subprocess (each sizes its own device pool before importing jax); the
multi-process ones go through `python -m train.launch`.

What is bitwise and what is not, and why:
  * Bitwise: y, dx, every parameter gradient (the router's included), expert counts,
    dropped, the load-balance and z losses. Each token's output is computed on one
    device by the same ops in both modes; the all_to_all dispatch/combine is a pure
    permutation; integer psums are exact; and `moe_ffn` leaves no float sum over
    devices to the collective library: the router statistics go through
    `ordered_allsum` and the replicated parameters' gradients through `stack_replicas`
    + `ordered_psum` (a fixed tree in rank order, uniep_jax/ordered_reduce.py). Left to
    the collective library, the router gradient differs here in 151 of 256 elements.
  * Float tolerance: only this script's own scalar loss sum(y * c), a jnp.sum over the
    8 devices: in one process the CPU client reduces the 8 partial values in its own
    order, across processes gloo reduces each process's partial sums and then across
    processes, so the association differs and the last bits can too.
  * Training: the default --grad-reduction ordered sums the gradients, the clip norm and
    the losses in rank order itself, so losses, metrics and every parameter bit are the
    same in one process or two.
"""

import json
import os
import re
import subprocess
import sys

import numpy as np
import pytest

from conftest import subprocess_env

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BITWISE = ("y", "grad_x", "grad_w_gate_up", "grad_w_down", "aux_expert_counts", "aux_dropped",
           "aux_nonfinite_tokens", "aux_rank_rows", "aux_replica_weight_bytes", "grad_router",
           "aux_load_balance_loss", "aux_router_z_loss")
REDUCED = ("loss",)


def _env():
  return subprocess_env(JAX_PLATFORMS="cpu")   # the scripts size their pools


def _run(*args, timeout=240, env=None):
  r = subprocess.run([sys.executable, *args], cwd=REPO, env={**_env(), **(env or {})},
                     capture_output=True, text=True, timeout=timeout)
  return r


def _launch(processes, module, *args, timeout=240, env=None):
  return _run("-m", "train.launch", "--processes", str(processes), "--module", module,
              "--timeout", str(timeout - 20), "--", *args, timeout=timeout, env=env)


def _compilation_cache_env(path):
  """JAX's persistent compilation cache in `path`, every program however quick to compile
  (read from the environment by each process of a run): a later run with the same env
  loads the programs an earlier one compiled instead of compiling them again. The cache
  key is the program (HLO, compile options, devices), so a program that differs in any
  way is compiled."""
  return {"JAX_COMPILATION_CACHE_DIR": str(path), "JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS": "0",
          "JAX_PERSISTENT_CACHE_MIN_ENTRY_SIZE_BYTES": "0"}


def test_moe_ffn_two_processes_match_one(tmp_path):
  single, multi = tmp_path / "single", tmp_path / "multi"
  r = _run("-m", "train.multiprocess_check", "--out", str(single))
  assert r.returncode == 0, r.stdout + r.stderr
  r = _launch(2, "train.multiprocess_check", "--out", str(multi))
  assert r.returncode == 0, r.stdout + r.stderr
  assert '"processes": 2' in r.stdout and '"devices": 8' in r.stdout
  assert "[p1] {" not in r.stdout  # process 0 alone reports
  for backend in ("xla_dropless", "xla_capacity"):
    s, m = np.load(single / f"{backend}.npz"), np.load(multi / f"{backend}.npz")
    assert sorted(s.files) == sorted(m.files) == sorted(BITWISE + REDUCED)
    for k in BITWISE:
      np.testing.assert_array_equal(m[k], s[k], err_msg=f"{backend} {k}")
    for k in REDUCED:
      np.testing.assert_allclose(m[k], s[k], rtol=1e-5, atol=1e-5, err_msg=f"{backend} {k}")
    assert np.abs(s["y"]).max() > 0.1 and np.abs(s["grad_router"]).max() > 0.1  # not vacuous


def test_uniep_backend_refused_across_processes(tmp_path):
  r = _launch(2, "train.multiprocess_check", "--backends", "uniep", "--out", str(tmp_path), timeout=120)
  assert r.returncode == 2, r.stdout + r.stderr
  assert "unsupported in multi-process runs (2 processes)" in r.stderr
  assert "no NVSHMEM mode" in r.stderr and "use backend 'pallas'" in r.stderr


def _metrics(out):
  return [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]


def test_training_two_processes_match_one_with_resume(tmp_path):
  """1 x 8 devices for 3 steps == 2 x 4 devices for 2 steps, checkpoint, resume, 1 more."""
  text = tmp_path / "corpus.txt"
  text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(3000)))
  common = ["--n-layers", "1", "--steps", "3", "--warmup", "1", "--batch", "8", "--seq", "32", "--eval-every", "2",
            "--eval-batches", "1", "--data", str(text), "--no-progress", "--no-plot"]
  r = _run("-m", "train", *common, "--out", str(tmp_path / "single"))
  assert r.returncode == 0, r.stdout + r.stderr
  ckpt = str(tmp_path / "ckpt")
  multi = tmp_path / "multi"
  # The resumed half loads the first half's compiled programs (the same HLO: --stop-after,
  # --resume and the checkpoint flags stay outside them; it writes no new cache entry)
  # instead of compiling them in both processes again (~20 CPU-s): what is checked is
  # the state a resumed run restores and the batches it continues with. Only process 0
  # writes the cache. The single-process run compiles its own (another device topology:
  # no program is shared with it), so the bitwise comparisons below still hold between
  # programs compiled separately. (With jax 0.11.2 only process 0 loads them. Process 1's
  # programs have cache keys of their own, e.g. jit_train_step's differs between the two
  # processes, and jax writes entries from process 0 only, so process 1 compiles its
  # programs again in the resumed half.)
  cache = _compilation_cache_env(tmp_path / "programs")
  r = _launch(2, "train", *common, "--out", str(multi), "--ckpt-dir", ckpt, "--ckpt-every", "2",
              "--stop-after", "2", env=cache)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "on 8 cpu devices of 2 processes" in r.stdout
  assert "[p1] param checksum" not in r.stdout and "[p0] param checksum" in r.stdout
  assert sorted(os.listdir(ckpt)) == ["2"]
  r = _launch(2, "train", *common, "--out", str(multi), "--ckpt-dir", ckpt, "--resume", env=cache)
  assert r.returncode == 0, r.stdout + r.stderr
  assert "[p0] resumed from" in r.stdout and "at step 2" in r.stdout

  s, m = _metrics(tmp_path / "single"), _metrics(multi)
  assert [x["step"] for x in m] == [x["step"] for x in s] == [0, 1, 2, 3]
  # the default --grad-reduction ordered sums gradients, the clip norm and the losses
  # over the 8 devices in rank order itself: the same bits in one process or two
  for a, b in zip(m, s):
    for k in ("heldout_loss", "loss", "ce", "grad_norm", "dropped", "max_load"):
      assert a.get(k) == b.get(k), (a["step"], k, a.get(k), b.get(k))
    # the aux-loss metrics: their router statistics are summed by ordered_allsum
    for k in ("load_balance_loss", "router_z_loss"):
      if k in b:
        assert a[k] == b[k], (a["step"], k, a[k], b[k])
  assert m[-1]["dropped"] == 0
  ss = json.loads((tmp_path / "single" / "summary.json").read_text())
  ms = json.loads((multi / "summary.json").read_text())
  assert ms["sha256"] == ss["sha256"]  # every parameter bit for bit


def test_launcher_stops_all_when_one_fails(tmp_path):
  """A process that fails makes the launcher stop the rest and return its exit code."""
  r = _launch(2, "train", "--mesh", "data=2,expert=3", "--batch", "6", "--out", str(tmp_path), timeout=120)
  assert r.returncode == 2, r.stdout + r.stderr
  assert "exited with 2" in r.stderr


def test_distributed_spec_from_flags_and_env():
  from train.distributed import resolve
  from train.mesh import ConfigError

  assert resolve(coordinator=None, num_processes=None, process_id=None, local_devices=None,
                 mesh_devices=8, env={}) is None
  spec = resolve(coordinator=None, num_processes=None, process_id=None, local_devices=None, mesh_devices=8,
                 env={"JAX_COORDINATOR_ADDRESS": "10.0.0.1:1234", "JAX_NUM_PROCESSES": "2",
                      "JAX_PROCESS_ID": "1"})
  assert (spec.coordinator, spec.num_processes, spec.process_id, spec.local_devices) == ("10.0.0.1:1234", 2, 1, 4)
  spec = resolve(coordinator="h:1", num_processes=4, process_id=3, local_devices=None, mesh_devices=8,
                 env={"JAX_NUM_PROCESSES": "2"})  # flags win
  assert (spec.num_processes, spec.process_id, spec.local_devices) == (4, 3, 2)
  with pytest.raises(ConfigError, match="not divisible by num_processes=3"):
    resolve(coordinator="h:1", num_processes=3, process_id=0, local_devices=None, mesh_devices=8, env={})
  with pytest.raises(ConfigError, match="must be HOST:PORT"):
    resolve(coordinator="nohost", num_processes=2, process_id=0, local_devices=None, mesh_devices=8, env={})
  with pytest.raises(ConfigError, match=r"must be in \[0, num_processes=2\)"):
    resolve(coordinator="h:1", num_processes=2, process_id=2, local_devices=None, mesh_devices=8, env={})


def test_launcher_timeout_kills_all(tmp_path, monkeypatch, capsys):
  """Past --timeout the launcher has every process print its stacks, kills them all and
  returns 124.

  `train.launch.launch` in this process (the CLI flags reach it as in the other tests'
  `_launch`), so that the test can see the processes it started and check that each is
  dead when it returns, and shorten the launcher's two waits, which would otherwise be
  most of this test's time while the two processes compile and train on the CPU the
  other pytest worker needs:
    * the timeout, 4 s: each process registers the SIGUSR1 stack dump in its first
      ~0.1 s (train.cli -> train.distributed.initialize, before jax is imported), so
      4 s leaves it 40x that on a loaded machine; the 100000 steps outlast any timeout
    * the stack dump's wait, 1 s (the launcher's default is 3; faulthandler writes from
      the signal handler) and the SIGTERM grace, 1 s (default 5): a jax process catches
      SIGTERM (its preemption notifier logs it and runs on), so every process here is
      still alive after the grace and the SIGKILL path runs; the dump still has 2 s
      before that
  """
  import functools

  import train.launch as L
  monkeypatch.chdir(REPO)          # `python -m train` from the repository's root
  started = []

  class Popen(subprocess.Popen):
    def __init__(self, *a, **kw):
      super().__init__(*a, **kw)
      started.append(self)

  monkeypatch.setattr(L.subprocess, "Popen", Popen)
  monkeypatch.setattr(L, "_dump_stacks", functools.partial(L._dump_stacks, wait_s=1.0))
  monkeypatch.setattr(L, "_kill", functools.partial(L._kill, grace_s=1.0))
  rc = L.launch(2, ["--steps", "100000", "--out", str(tmp_path / "out"), "--no-progress"],
                log_dir=str(tmp_path / "logs"), timeout=4.0, env=_env())
  out, err = capsys.readouterr()
  assert rc == 124, out + err
  assert len(started) == 2 and all(p.poll() is not None for p in started), [p.poll() for p in started]
  assert "timeout after 4.0 s; their stacks (SIGUSR1), then stopping all processes" in err
  for i in range(2):  # faulthandler's dump, from inside the training program
    assert re.search(rf"\[p{i}\] .*most recent call first", err), err[-3000:]
  assert sorted(os.listdir(tmp_path / "logs")) == ["process_0.log", "process_1.log"]
