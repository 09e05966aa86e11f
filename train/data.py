"""Token streams and batches.

Default corpus: the Python standard library's own `.py` sources (no download),
read in sorted path order up to a size cap and tokenised as bytes (vocab 256).
The stream is cut into fixed chunks; a fixed-seed draw sends `heldout_fraction`
of them to the held-out split. A training batch is a pure function of
(seed, step), so a resumed run sees exactly the batches of an uninterrupted one.
"""

from __future__ import annotations

import dataclasses
import math
import pathlib
import sysconfig
from typing import Optional

import numpy as np

from train.mesh import ConfigError

SPLIT_SEED = 20261126  # fixed: the split does not move with --seed
CHUNK = 2048  # bytes per split unit
_SKIP_DIRS = {"site-packages", "dist-packages", "__pycache__", "test", "tests", "idle_test"}


def stdlib_files() -> list[pathlib.Path]:
  """The standard library's .py files in sorted relative-path order (tests and site-packages excluded)."""
  root = pathlib.Path(sysconfig.get_paths()["stdlib"])
  files = [p for p in root.rglob("*.py")
           if not _SKIP_DIRS.intersection(p.relative_to(root).parts[:-1])]
  return sorted(files, key=lambda p: p.relative_to(root).as_posix())


def _read_files(files: list[pathlib.Path], cap: Optional[int]) -> np.ndarray:
  parts, total = [], 0
  for f in files:
    b = f.read_bytes() + b"\n"
    if cap is not None and total + len(b) > cap:
      b = b[: cap - total]
    parts.append(b)
    total += len(b)
    if cap is not None and total >= cap:
      break
  return np.frombuffer(b"".join(parts), dtype=np.uint8).astype(np.int32)


def load_tokens(path: Optional[str], *, max_bytes: int) -> tuple[np.ndarray, str]:
  """Token ids (int32) and a description. path: None (stdlib), a text file, a folder, or a .npy."""
  if path is None:
    files = stdlib_files()
    toks = _read_files(files, max_bytes)
    return toks, f"Python {sysconfig.get_python_version()} stdlib sources ({len(files)} files, first {len(toks)} bytes)"
  p = pathlib.Path(path)
  if not p.exists():
    raise FileNotFoundError(f"--data {path}: no such file or folder")
  if p.suffix == ".npy":
    toks = np.load(p)
    if toks.ndim != 1 or not np.issubdtype(toks.dtype, np.integer):
      raise ConfigError(f"--data {path}: expected a 1-D integer array of token ids, got {toks.dtype}{list(toks.shape)}")
    if toks.size and toks.min() < 0:
      raise ConfigError(f"--data {path}: token ids must be >= 0")
    return toks.astype(np.int32), f"{path} ({toks.size} token ids)"
  files = sorted(f for f in p.rglob("*") if f.is_file()) if p.is_dir() else [p]
  toks = _read_files(files, None)
  return toks, f"{path} ({len(files)} files, {len(toks)} bytes)"


def unigram_entropy(tokens: np.ndarray) -> float:
  """Entropy of the token frequency distribution, in nats per token."""
  counts = np.bincount(tokens).astype(np.float64)
  p = counts[counts > 0] / counts.sum()
  return float(-(p * np.log(p)).sum())


@dataclasses.dataclass(frozen=True)
class Dataset:
  train: np.ndarray  # [n_train] int32
  heldout: np.ndarray  # [n_heldout] int32
  description: str

  @property
  def vocab_needed(self) -> int:
    return int(max(self.train.max(), self.heldout.max())) + 1

  def batch(self, seed: int, step: int, batch: int, seq: int,
            rows: slice = slice(None)) -> tuple[np.ndarray, np.ndarray]:
    """Training batch of `step`: (inputs, targets), each [batch, seq] int32; pure in (seed, step).

    rows: only these rows of the global batch (a process's slice in multi-process runs);
    the window starts of all rows are drawn either way, so a slice equals the full batch's rows.
    """
    rng = np.random.default_rng([seed, step])
    starts = rng.integers(0, len(self.train) - seq - 1, size=batch)[rows]  # [rows]
    win = self.train[starts[:, None] + np.arange(seq + 1)]  # [rows, seq+1]
    return win[:, :-1], win[:, 1:]

  def heldout_batches(self, n_batches: int, batch: int, seq: int,
                      rows: slice = slice(None)) -> list[tuple[np.ndarray, np.ndarray]]:
    """Fixed held-out windows, evenly spaced over the held-out stream (`rows` of each batch)."""
    starts = np.linspace(0, len(self.heldout) - seq - 1, n_batches * batch).astype(np.int64)
    starts = starts.reshape(n_batches, batch)[:, rows]  # [n_batches, rows]
    win = self.heldout[starts[..., None] + np.arange(seq + 1)]  # [n_batches, rows, seq+1]
    return [(w[:, :-1], w[:, 1:]) for w in win]


def make_dataset(path: Optional[str], *, max_bytes: int, heldout_fraction: float, seq: int) -> Dataset:
  """Load tokens and split them by CHUNK-sized pieces with the fixed SPLIT_SEED."""
  toks, desc = load_tokens(path, max_bytes=max_bytes)
  n_chunks = math.ceil(len(toks) / CHUNK)
  rng = np.random.default_rng(SPLIT_SEED)
  n_held = max(1, round(heldout_fraction * n_chunks))
  held = np.zeros(n_chunks, dtype=bool)
  held[rng.permutation(n_chunks)[:n_held]] = True
  chunk_of = np.arange(len(toks)) // CHUNK
  train, heldout = toks[~held[chunk_of]], toks[held[chunk_of]]
  for name, arr in (("train", train), ("held-out", heldout)):
    if len(arr) < seq + 2:
      raise ConfigError(f"the {name} split has {len(arr)} tokens, fewer than seq+2={seq + 2}; "
                       f"use more data or a shorter --seq")
  return Dataset(train=train, heldout=heldout, description=desc)
