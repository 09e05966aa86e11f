"""Faults a training run survives without losing a good model: non-finite steps are not
applied and a diverging run stops; damaged checkpoints are detected and routed around;
run folders are not shared; bad flags are refused before anything compiles."""

import json
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from conftest import subprocess_env
from test_train import REPO, SMALL, _compilation_cache, _train
from train import loop
from train.checkpoint import Checkpointer, all_finite
from train.config import TrainConfig, parse_args
from train.data import make_dataset
from train.mesh import ConfigError


@pytest.fixture(scope="module")
def data():
  return make_dataset(None, max_bytes=256 << 10, heldout_fraction=0.05, seq=32)


@pytest.fixture(scope="module")
def programs(tmp_path_factory):
  """One compilation cache for the module's runs (they share their programs)."""
  return tmp_path_factory.mktemp("faults_programs")


class Batches:
  """`data` with batch `poison` made of token ids past the vocabulary (their embeddings
  are NaN: the step's loss is not finite) and the batches from `drop` on shifted by one
  (batch `drop` never used): the same data stream with one step taken out."""

  def __init__(self, data, poison=None, drop=None):
    self.data, self.poison, self.drop = data, poison, drop

  def __getattr__(self, name):
    return getattr(self.data, name)

  def batch(self, seed, step, batch, seq, rows=slice(None)):
    if self.drop is not None and step >= self.drop:
      step += 1
    x, y = self.data.batch(seed, step, batch, seq, rows)
    if step == self.poison:
      x = np.full_like(x, 10 ** 6)
    return x, y


def _records(out):
  return [json.loads(line) for line in pathlib.Path(out, "metrics.jsonl").read_text().splitlines()]


def test_a_nonfinite_step_is_skipped_and_the_run_matches_one_without_it(tmp_path, data, programs):
  """Step 4's batch makes the loss NaN: that update is not applied (parameters, optimizer
  state and its step count unchanged), the step is recorded as skipped, and the run ends
  bit for bit where a run that never took that batch ends, one step shorter."""
  with _compilation_cache(programs):
    skipped = _train(tmp_path / "a", Batches(data, poison=3), steps=8)
    without = _train(tmp_path / "b", Batches(data, drop=3), steps=8, stop_after=7)
  recs = [r for r in _records(tmp_path / "a") if "skipped" in r]
  assert [r["step"] for r in recs if r["skipped"]] == [4]
  assert not np.isfinite(recs[3]["loss"]) and all(np.isfinite(r["loss"]) for r in recs if r["step"] != 4)
  assert skipped["summary"]["skipped_steps"] == 1 and without["summary"]["skipped_steps"] == 0
  assert skipped["summary"]["sha256"] == without["summary"]["sha256"]
  assert np.isfinite(skipped["summary"]["final_train_loss_nats"])


def test_a_diverging_run_stops_and_keeps_its_good_checkpoints(tmp_path, data, programs):
  """A huge learning rate: the loss goes non-finite; after --max-skipped-steps steps in a
  row the run stops with the step named, no checkpoint holds a non-finite value, and
  the newest one loads and verifies."""
  ckpt = str(tmp_path / "ckpt")
  with _compilation_cache(programs), pytest.raises(loop.Diverged, match=r"step \d+: 3 steps in a row"):
    _train(tmp_path / "out", data, lr=1e6, steps=40, ckpt_dir=ckpt, ckpt_every=1)
  recs = [r for r in _records(tmp_path / "out") if "skipped" in r]
  assert [r["skipped"] for r in recs[-3:]] == [1, 1, 1]
  applied = sum(1 for r in recs if not r["skipped"])
  s = loop.make_setup(TrainConfig(**{**SMALL, "out": "unused"}))
  params, rest, opt = loop.init_state(s)
  found = Checkpointer(ckpt).restore_latest(dict(params=params, rest=rest, opt_state=opt))
  # the newest checkpoint: written at the last step before the stop, holding the state
  # of the last applied step (the optimizer counted only the applied ones)
  assert found is not None and found[0] == recs[-2]["step"] and all_finite(found[1])
  assert int(found[1]["opt_state"][1][0].count) == applied


def _damage(step_dir: pathlib.Path, how: str) -> None:
  files = [p for p in step_dir.rglob("*") if p.is_file()]
  if how == "metadata":
    (step_dir / "default" / "_METADATA").unlink()
    return
  data_file = max((p for p in files if "/d/" in str(p)), key=lambda p: p.stat().st_size)
  if how == "deleted":
    data_file.unlink()
  elif how == "truncated":
    with open(data_file, "r+b") as f:
      f.truncate(data_file.stat().st_size // 2)
  elif how == "flipped":
    raw = bytearray(data_file.read_bytes())
    mid = len(raw) // 2
    raw[mid:mid + 4096] = bytes(b ^ 0xFF for b in raw[mid:mid + 4096])
    data_file.write_bytes(bytes(raw))


@pytest.fixture(scope="module")
def checkpointed(tmp_path_factory, data, programs):
  """A 9-step run with checkpoints at steps 6 and 9 (and its result)."""
  base = tmp_path_factory.mktemp("checkpointed")
  with _compilation_cache(programs):
    result = _train(base / "out", data, steps=9, ckpt_dir=str(base / "ckpt"), ckpt_every=3)
  return base, result


@pytest.mark.parametrize("how", ["deleted", "truncated", "flipped", "metadata"])
def test_a_damaged_checkpoint_falls_back_to_the_one_before(tmp_path, data, programs, checkpointed,
                                                          how, capsys):
  """The newest checkpoint damaged (its data file deleted, truncated or with 4 KiB of
  flipped bytes; its _METADATA deleted): --resume reports it in one line, moves it aside,
  continues from the step before, and ends with the uninterrupted run's bits; the run's
  metrics.jsonl holds each step once."""
  base, full = checkpointed
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  shutil.copytree(base / "ckpt", ckpt)
  shutil.copytree(base / "out", out)
  _damage(ckpt / "9", how)
  with _compilation_cache(programs):
    resumed = _train(out, data, steps=9, ckpt_dir=str(ckpt), ckpt_every=3, resume=True)
  said = capsys.readouterr().out
  assert said.count("is unusable") == 1 and f"{ckpt / '9'} is unusable" in said
  assert resumed["summary"]["start_step"] == 6
  assert resumed["summary"]["sha256"] == full["summary"]["sha256"]
  assert (ckpt / "damaged-9").is_dir() and (ckpt / "9").is_dir()   # aside; 9 written again
  steps = [r["step"] for r in _records(out)]
  assert steps == list(range(10)) and len({r["run"] for r in _records(out)}) == 2


def test_no_usable_checkpoint_is_an_error_unless_asked_to_start(tmp_path, data, programs,
                                                                checkpointed):
  base, _ = checkpointed
  ckpt = tmp_path / "ckpt"
  shutil.copytree(base / "ckpt", ckpt)
  for step in ("6", "9"):
    _damage(ckpt / step, "metadata")
  with pytest.raises(ConfigError, match="--resume: no usable checkpoint in .* --resume-or-start"):
    _train(tmp_path / "a", data, steps=9, ckpt_dir=str(ckpt), resume=True)
  with pytest.raises(ConfigError, match="--resume: no usable checkpoint"):   # an empty or
    _train(tmp_path / "b", data, steps=9, ckpt_dir=str(tmp_path / "typo"), resume=True)
  with _compilation_cache(programs):   # starts from step 0
    fresh = _train(tmp_path / "c", data, steps=3, ckpt_dir=str(tmp_path / "typo"),
                   resume_or_start=True)
  assert fresh["summary"]["start_step"] == 0


def test_run_folders_are_not_shared(tmp_path, data):
  """A second live run into one --out is refused (the first holds OUT/.lock), and a new
  run into an --out holding another run's metrics is refused unless --overwrite."""
  out = tmp_path / "out"
  out.mkdir()
  lock = loop.RunLock(out)
  try:
    with pytest.raises(ConfigError, match=r"is in use by a live run \(pid \d+"):
      _train(out, data)
  finally:
    lock.release()
  (out / "metrics.jsonl").write_text('{"step": 0}\n')
  with pytest.raises(ConfigError, match="holds the metrics of an earlier run; pass --overwrite"):
    _train(out, data)


def test_a_killed_run_resumes(tmp_path, data):
  """SIGKILL while the run checkpoints every step (often inside a save): --resume picks
  the newest complete checkpoint and finishes."""
  ckpt, out = tmp_path / "ckpt", tmp_path / "out"
  args = [sys.executable, "-m", "train", "--n-layers", "1", "--seq", "32", "--steps", "60",
          "--batch", "8", "--ckpt-every", "1", "--ckpt-dir", str(ckpt), "--out", str(out),
          "--no-progress", "--no-plot", "--data-bytes", str(256 << 10)]
  proc = subprocess.Popen(args, cwd=REPO, env=subprocess_env(), stdout=subprocess.DEVNULL,
                          stderr=subprocess.DEVNULL)
  try:
    deadline = time.time() + 240
    while time.time() < deadline and len([p for p in ckpt.glob("[0-9]*")]) < 3:
      time.sleep(0.2)
    assert proc.poll() is None, "the run ended before it was killed"
  finally:
    proc.send_signal(signal.SIGKILL)
    proc.wait()
  done = subprocess.run(args + ["--resume"], cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=300)
  assert done.returncode == 0, done.stderr[-2000:]
  assert "resumed from" in done.stdout and json.loads((out / "summary.json").read_text())["steps"] == 60


@pytest.mark.parametrize("argv,match", [
    (["--clip", "-1"], r"--clip=-1.0 must be > 0"),
    (["--capacity-factor", "0"], r"--capacity-factor=0.0 must be > 0"),
    (["--max-skipped-steps", "0"], r"--max-skipped-steps=0 must be >= 1"),
    (["--resume", "--resume-or-start", "--ckpt-dir", "x"], "exclude each other"),
    (["--resume-or-start"], "--resume-or-start needs --ckpt-dir"),
    (["--config", "nope"], "invalid choice: 'nope'")])
def test_bad_flags_are_refused_by_name(argv, match, capsys):
  with pytest.raises(SystemExit):
    parse_args(argv)
  assert __import__("re").search(match, capsys.readouterr().err)


def test_checks_before_anything_compiles(tmp_path, data, capsys):
  """--seq past the model's max_seq_len or the held-out split, and --backend uniep on
  CPU devices, are refused before the first compile; --backend pallas on the CPU says
  its kernels run in the interpret mode."""
  with pytest.raises(ConfigError, match="--seq 100000 exceeds model 'tiny''s max_seq_len 128"):
    _train(tmp_path / "a", data, seq=100000)
  from train.data import Dataset
  small = Dataset(train=data.train, heldout=data.heldout[:100], description="short held-out")
  with pytest.raises(ConfigError, match="--seq 128 needs windows of 129 tokens; the held-out"):
    _train(tmp_path / "b", small, seq=128)
  with pytest.raises(ConfigError, match="--backend uniep moves rows between GPUs"):
    _train(tmp_path / "c", data, backend="uniep")
  loop.check_backend_platform(TrainConfig(backend="pallas"))
  assert "runs the Pallas kernels in JAX's interpret mode" in capsys.readouterr().out


def test_help_lists_the_configs_and_the_defaults():
  out = subprocess.run([sys.executable, "-m", "train", "--help"], cwd=REPO, env=subprocess_env(),
                       capture_output=True, text=True, timeout=120).stdout
  assert "tiny-deepseek" in out and "qwen3-like" in out and "(default: 300)" in out
