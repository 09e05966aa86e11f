"""Token streams and batches.

Default corpus: the Python standard library's own `.py` sources (no download),
read in sorted path order up to a size cap. The byte stream is cut into fixed
chunks; a fixed-seed draw sends `heldout_fraction` of them to the held-out split.
Each split is then tokenised:
  vocab_size 256: as bytes (token id = byte value);
  vocab_size > 256: by a word-level `Tokenizer` with byte fallback, built from the
    training split's bytes alone (the held-out text never shapes the vocabulary).
Why words for the large vocabularies: an MoE layer routes mostly by token id at
initialisation, so the experts the most frequent token picks get that token's share of
all tokens. As bytes that is the space, 29% of the default corpus (max load >= 0.29 *
E / K: 4.7 for 128 experts, top-8); as word-level pieces it is a newline with a
4-space indent, 4.3%.
A training batch is a pure function of (seed, step), so a resumed run sees exactly
the batches of an uninterrupted one.
"""

from __future__ import annotations

import collections
import dataclasses
import functools
import hashlib
import math
import pathlib
import re
import sysconfig
from typing import Optional

import numpy as np

from train.mesh import ConfigError

SPLIT_SEED = 20261126  # fixed: the split does not move with --seed
CHUNK = 2048  # bytes per split unit
BYTE_VOCAB = 256  # token ids 0..255 are the bytes in every tokenizer here
# Word-level pieces: an identifier or a number with its leading space, a run of other
# printable bytes with its leading space, a newline with the next line's indentation, a
# run of spaces, or one other whitespace byte. Every byte falls in exactly one piece,
# so the pieces concatenate back to the text.
PIECE_PATTERN = re.compile(
    rb" ?[A-Za-z_][A-Za-z_0-9]*| ?[0-9]+| ?[^\sA-Za-z_0-9]+|\n *| +|\s")
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


@dataclasses.dataclass(frozen=True)
class Tokenizer:
  """Token ids 0..255 are the bytes, ids 256.. the multi-byte `pieces` in order.

  `encode` cuts text into PIECE_PATTERN pieces; a piece in the vocabulary is one
  token, any other piece is its bytes (byte fallback), so every text encodes and
  decode(encode(text)) == text. With no pieces it is the byte tokenizer:
  encode(text) is the text's bytes as int32, vocab_size 256.
  """

  pieces: tuple[bytes, ...] = ()  # ids 256, 257, ...; each >= 2 bytes, all distinct

  def __post_init__(self):
    if any(len(p) < 2 for p in self.pieces) or len(set(self.pieces)) != len(self.pieces):
      raise ValueError("pieces must be distinct and at least 2 bytes long (single bytes "
                       "have their byte ids)")

  @classmethod
  def build(cls, text: bytes, vocab_size: int) -> "Tokenizer":
    """The (vocab_size - 256) most frequent multi-byte pieces of `text`, most frequent
    first, ties by the pieces' bytes (ascending): a pure function of (text, vocab_size)."""
    if vocab_size < BYTE_VOCAB:
      raise ValueError(f"vocab_size={vocab_size} must be >= {BYTE_VOCAB} (the byte ids)")
    counts = collections.Counter(p for p in PIECE_PATTERN.findall(text) if len(p) > 1)
    ranked = sorted(counts.items(), key=lambda pc: (-pc[1], pc[0]))
    return cls(tuple(p for p, _ in ranked[: vocab_size - BYTE_VOCAB]))

  @property
  def vocab_size(self) -> int:
    return BYTE_VOCAB + len(self.pieces)

  @functools.cached_property
  def _ids(self) -> dict[bytes, int]:
    return {p: BYTE_VOCAB + i for i, p in enumerate(self.pieces)}

  @functools.cached_property
  def token_bytes(self) -> np.ndarray:
    """[vocab_size] int64: the bytes each token id stands for."""
    return np.array([1] * BYTE_VOCAB + [len(p) for p in self.pieces], np.int64)

  @functools.cached_property
  def fingerprint(self) -> str:
    """sha256 of the vocabulary (its first 16 hex digits): two runs' token ids mean the
    same text when their fingerprints agree."""
    h = hashlib.sha256(b"%d;" % len(self.pieces))
    for p in self.pieces:
      h.update(b"%d:" % len(p) + p)
    return h.hexdigest()[:16]

  def encode(self, text: bytes) -> np.ndarray:
    """[n] int32 token ids of `text`."""
    if not self.pieces:
      return np.frombuffer(text, dtype=np.uint8).astype(np.int32)
    ids, out = self._ids, []
    for piece in PIECE_PATTERN.findall(text):
      i = ids.get(piece)
      if i is None:
        out.extend(piece)  # its bytes
      else:
        out.append(i)
    return np.asarray(out, dtype=np.int32)

  def decode(self, ids) -> bytes:
    """The text of token ids (the inverse of `encode`)."""
    table = [bytes([b]) for b in range(BYTE_VOCAB)] + list(self.pieces)
    return b"".join(table[int(i)] for i in np.asarray(ids).reshape(-1))

  def describe(self) -> str:
    if not self.pieces:
      return "bytes (vocab 256)"
    return (f"word-level tokenizer of the training split ({self.vocab_size} ids: 256 bytes + "
            f"{len(self.pieces)} pieces; {self.fingerprint})")


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
  # what the ids stand for; None: ids of unknown text (a .npy, synthetic ids)
  tokenizer: Optional[Tokenizer] = None

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

  def heldout_bytes_per_token(self, n_batches: int, batch: int, seq: int) -> Optional[float]:
    """Bytes of text per target token of the held-out windows (`heldout_batches`, every
    row): nats per token / ln 2 / this = bits per byte, a loss that compares across
    tokenizers. None when the ids' text is unknown."""
    if self.tokenizer is None:
      return None
    targets = np.concatenate([y.reshape(-1) for _, y in self.heldout_batches(n_batches, batch, seq)])
    return float(self.tokenizer.token_bytes[targets].sum() / targets.size)


def heldout_chunks(n: int, heldout_fraction: float) -> np.ndarray:
  """[ceil(n / CHUNK)] bool: which CHUNK-sized pieces of a stream of n ids are held out
  (a fixed draw of SPLIT_SEED)."""
  n_chunks = math.ceil(n / CHUNK)
  rng = np.random.default_rng(SPLIT_SEED)
  n_held = max(1, round(heldout_fraction * n_chunks))
  held = np.zeros(n_chunks, dtype=bool)
  held[rng.permutation(n_chunks)[:n_held]] = True
  return held


def make_dataset(path: Optional[str], *, max_bytes: int, heldout_fraction: float, seq: int,
                 vocab_size: int = BYTE_VOCAB) -> Dataset:
  """Load the corpus, split it by CHUNK-sized pieces with the fixed SPLIT_SEED, and
  tokenise each split: text as bytes when vocab_size is 256, else with a `Tokenizer`
  of up to vocab_size ids built from the training split. A .npy holds token ids
  already: split as they are."""
  toks, desc = load_tokens(path, max_bytes=max_bytes)
  held = heldout_chunks(len(toks), heldout_fraction)
  chunk_of = np.arange(len(toks)) // CHUNK
  train, heldout = toks[~held[chunk_of]], toks[held[chunk_of]]
  tokenizer = None
  if path is None or pathlib.Path(path).suffix != ".npy":   # text: ids are its bytes
    tokenizer = Tokenizer()
    if vocab_size > BYTE_VOCAB:
      train_text = train.astype(np.uint8).tobytes()
      tokenizer = Tokenizer.build(train_text, vocab_size)
      train = tokenizer.encode(train_text)
      heldout = tokenizer.encode(heldout.astype(np.uint8).tobytes())
      desc += (f"; {tokenizer.describe()}, {len(train_text) / len(train):.3f} bytes per "
               f"training token")
  for name, arr in (("train", train), ("held-out", heldout)):
    if len(arr) < seq + 2:
      raise ConfigError(f"the {name} split has {len(arr)} tokens, fewer than seq+2={seq + 2}; "
                       f"use more data or a shorter --seq")
  return Dataset(train=train, heldout=heldout, description=desc, tokenizer=tokenizer)
