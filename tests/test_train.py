"""Training: the loss falls, runs are bitwise reproducible, resume is exact,
expert parallelism does not change the maths, and bad meshes fail clearly.

In-process tests use the 8 virtual CPU devices of conftest.py; the CLI tests run
`python -m train` in a subprocess (it sizes its own device pool before importing jax).
"""

import collections
import contextlib
import hashlib
import json
import os
import subprocess
import sys

import jax
import numpy as np
import pytest

from conftest import subprocess_env

from train import loop
from train.config import DEFAULT_GRAD_BUCKETS, TrainConfig, parse_args
from train.data import CHUNK, PIECE_PATTERN, Tokenizer, heldout_chunks, make_dataset
from train.mesh import parse_mesh, validate_mesh

# 2 of tiny's 4 blocks (--n-layers): every check here holds for any depth >= 2, and the
# compile and step times, the suite's largest share, halve
SMALL = dict(config="tiny", n_layers=2, batch=8, seq=32, steps=12, warmup=2, lr=3e-3,
             eval_every=6, eval_batches=1, progress=False, plot=False)
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def data():
  return make_dataset(None, max_bytes=256 << 10, heldout_fraction=0.05, seq=32)


def _train(path, data, **kw):
  return loop.train(TrainConfig(**{**SMALL, "out": str(path), **kw}), data=data)


@contextlib.contextmanager
def _compilation_cache(path):
  """JAX's persistent compilation cache in `path` (every program, however quick to
  compile) while the block runs: a later block on the same path loads the programs an
  earlier one compiled instead of compiling them again. The cache key is the program
  (HLO, compile options, devices), so a program that differs in any way is compiled."""
  from jax.experimental.compilation_cache import compilation_cache
  names = ("jax_compilation_cache_dir", "jax_persistent_cache_min_compile_time_secs",
           "jax_persistent_cache_min_entry_size_bytes")
  old = {n: getattr(jax.config, n) for n in names}
  for n, v in zip(names, (str(path), 0.0, 0)):
    jax.config.update(n, v)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    for n, v in old.items():
      jax.config.update(n, v)
    compilation_cache.reset_cache()


@pytest.fixture(scope="module")
def reference_programs(tmp_path_factory):
  """A compilation cache holding the reference run's programs (see test_resume_...)."""
  return tmp_path_factory.mktemp("reference_programs")


@pytest.fixture(scope="module")
def reference(tmp_path_factory, data, reference_programs):
  """An uninterrupted 12-step run on mesh data=2,expert=4 (its programs are also written
  to the reference_programs cache; the run itself compiles every one of them)."""
  with _compilation_cache(reference_programs):
    return _train(tmp_path_factory.mktemp("ref"), data)


def test_loss_decreases(reference):
  losses = reference["losses"]
  assert sorted(losses) == list(range(1, 13))
  assert np.mean([losses[s] for s in (10, 11, 12)]) < losses[1] - 1.0, losses
  held = reference["heldout"]
  assert held[12] < held[0] - 1.0, held
  assert all(np.isfinite(v) for v in losses.values())


def test_summary_records_the_environment(reference):
  """summary.json names what the bits may depend on beyond the code: CPU and packages."""
  env = reference["summary"]["environment"]
  assert env["packages"]["jax"] == jax.__version__
  assert env["cpu_vector_isa"] in ("avx512", "avx2", "below avx2", "unknown") and env["cpu"]


def test_identical_runs_are_bitwise_equal(tmp_path, data, reference):
  again = _train(tmp_path, data)
  assert again["losses"] == reference["losses"]
  assert again["heldout"] == reference["heldout"]
  assert again["summary"]["sha256"] == reference["summary"]["sha256"]
  assert again["summary"]["param_sum"] == reference["summary"]["param_sum"]


def test_resume_is_bitwise_equal(tmp_path, data, reference, reference_programs):
  # Both halves load the reference run's compiled programs (init, train and eval steps:
  # the same HLO, stop_after and the checkpoint flags stay outside them) instead of
  # compiling them twice more: what is checked is the state a resumed run restores and
  # the batches it continues with. Compiling the same program twice to the same bits is
  # test_identical_runs_are_bitwise_equal's check, which compiles its own.
  ckpt = str(tmp_path / "ckpt")
  with _compilation_cache(reference_programs):
    first = _train(tmp_path / "a", data, ckpt_dir=ckpt, ckpt_every=3, stop_after=6)
    assert sorted(first["losses"]) == list(range(1, 7))
    second = _train(tmp_path / "b", data, ckpt_dir=ckpt, ckpt_every=3, resume=True)
  assert second["summary"]["start_step"] == 6
  assert sorted(second["losses"]) == list(range(7, 13))
  merged = {**first["losses"], **second["losses"]}
  assert merged == reference["losses"]  # bitwise: float(f32) compared exactly
  assert second["heldout"][12] == reference["heldout"][12]
  assert second["summary"]["sha256"] == reference["summary"]["sha256"]


def _loss_and_grads(mesh: str):
  cfg = TrainConfig(**{**SMALL, "n_layers": 1, "mesh": mesh, "out": "unused"})
  s = loop.make_setup(cfg)
  params, rest, _ = loop.init_state(s)
  data = make_dataset(None, max_bytes=64 << 10, heldout_fraction=0.05, seq=32)
  x, y = (jax.device_put(a, s.batch_sh) for a in data.batch(0, 0, cfg.batch, cfg.seq))
  fn = jax.jit(jax.value_and_grad(lambda p: loop.loss_fn(s, p, rest, x, y), has_aux=True))
  (loss, (ce, lb, z, aux)), grads = fn(params)
  host = lambda t: jax.tree.map(np.asarray, jax.device_get(t))
  return host(params), float(loss), host(aux), host(grads)


def test_expert_parallel_matches_expert_1():
  p1, loss1, aux1, g1 = _loss_and_grads("data=8,expert=1")
  p4, loss4, aux4, g4 = _loss_and_grads("data=2,expert=4")
  for k in p1:  # the initialisation does not depend on the layout
    np.testing.assert_array_equal(p1[k], p4[k], err_msg=k)
  np.testing.assert_array_equal(aux1["expert_counts"], aux4["expert_counts"])
  np.testing.assert_allclose(loss1, loss4, rtol=1e-6)
  for k in g1:
    np.testing.assert_allclose(g1[k], g4[k], rtol=1e-4, atol=1e-6, err_msg=k)


def test_aux_free_bias_updates(tmp_path, data):
  rate = 1e-2
  res = _train(tmp_path, data, config="tiny-deepseek", n_layers=3, steps=3, warmup=1,
               eval_every=3, aux_free_bias_rate=rate)
  biases = {k: np.asarray(v) for k, v in res["rest"].items() if k.endswith("expert_bias")}
  assert len(biases) == 2  # layers 1 and 2 are MoE layers, layer 0 is dense
  for k, b in biases.items():
    steps = b / rate  # each update moves every bias by -rate, 0 or +rate
    np.testing.assert_allclose(steps, np.round(steps), atol=1e-3, err_msg=k)
    assert np.abs(steps).max() <= 3 + 1e-3 and np.any(b != 0), (k, b)


@pytest.mark.parametrize("spec,match", [
    ("", "empty"),
    ("data=2,expert", "cannot parse"),
    ("data=2;expert=4", "cannot parse"),
    ("pipe=2,expert=4", "unknown axis"),
    ("data=2,data=4", "twice"),
    ("data=0,expert=8", ">= 1"),
])
def test_bad_mesh_strings(spec, match):
  with pytest.raises(ValueError, match=match):
    parse_mesh(spec)


def test_impossible_meshes():
  assert parse_mesh("expert=8") == {"data": 1, "expert": 8}
  with pytest.raises(ValueError, match="has 6 devices but 8 are available"):
    validate_mesh(parse_mesh("data=2,expert=3"), num_devices=8, num_experts=8, batch=8)
  with pytest.raises(ValueError, match="expert=3 must divide the number of experts 8"):
    validate_mesh(parse_mesh("data=2,expert=3"), num_devices=6, num_experts=8, batch=6)
  with pytest.raises(ValueError, match="batch=12 must be divisible by the mesh size 8"):
    validate_mesh(parse_mesh("data=2,expert=4"), num_devices=8, num_experts=8, batch=12)
  with pytest.raises(ValueError, match="has 4 devices but 8 are available"):
    loop.make_setup(TrainConfig(**{**SMALL, "mesh": "data=1,expert=4", "out": "unused"}))


def test_parse_args_errors(capsys):
  with pytest.raises(SystemExit) as e:
    parse_args(["--mesh", "data=2,model=4"])
  assert e.value.code == 2
  assert "unknown axis 'model'" in capsys.readouterr().err
  with pytest.raises(SystemExit):
    parse_args(["--resume"])
  assert "--resume needs --ckpt-dir" in capsys.readouterr().err
  cfg = parse_args([])
  assert (cfg.config, cfg.mesh, cfg.backend) == ("tiny", "data=2,expert=4", "xla_dropless")


def _cli(*args, timeout=240):
  return subprocess.run([sys.executable, "-m", "train", *args], cwd=REPO, env=subprocess_env(),
                        capture_output=True, text=True, timeout=timeout)


def test_cli_rejects_impossible_mesh(tmp_path):
  # its own --out: the default folder may hold a finished run, refused before the mesh
  r = _cli("--mesh", "data=2,expert=3", "--batch", "6", "--out", str(tmp_path / "run"))
  assert r.returncode == 2, r.stderr
  assert "expert=3 must divide the number of experts 8" in r.stderr


def test_cli_end_to_end(tmp_path):
  """The CLI's plumbing: flags (a mesh other than the default), the text corpus, the
  metrics' steps, the held-out evaluations, loss.png, summary.json, the printed lines.
  One block: nothing here depends on the depth, which the in-process tests above cover,
  and the compile, most of the test's time, shrinks with it."""
  text = tmp_path / "corpus.txt"
  text.write_text("".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(4000)))
  out = tmp_path / "out"
  r = _cli("--mesh", "data=4,expert=2", "--n-layers", "1", "--steps", "4", "--warmup", "1",
           "--batch", "8", "--seq", "32", "--eval-every", "2", "--eval-batches", "1", "--data", str(text),
           "--out", str(out), "--no-progress")
  assert r.returncode == 0, r.stdout + r.stderr
  assert "param checksum: sum=" in r.stdout and "unigram entropy" in r.stdout
  assert (out / "loss.png").stat().st_size > 0 and (out / "expert_load.png").stat().st_size > 0
  assert "bits per byte" in r.stdout
  recs = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
  assert [r_["step"] for r_ in recs if "ce" in r_] == [1, 2, 3, 4]
  assert [r_["step"] for r_ in recs if "heldout_loss" in r_] == [0, 2, 4]
  summary = json.loads((out / "summary.json").read_text())
  assert summary["mesh"] == {"data": 4, "expert": 2}


def test_data_is_pure_and_split_is_fixed(tmp_path, data):
  from train.data import load_tokens, unigram_entropy
  x1, y1 = data.batch(3, 17, 8, 32)
  x2, y2 = data.batch(3, 17, 8, 32)
  np.testing.assert_array_equal(x1, x2)
  np.testing.assert_array_equal(x1[:, 1:], y1[:, :-1])  # targets are the inputs shifted by one
  assert not np.array_equal(data.batch(3, 18, 8, 32)[0], x1)
  again = make_dataset(None, max_bytes=256 << 10, heldout_fraction=0.05, seq=32)
  np.testing.assert_array_equal(again.heldout, data.heldout)
  assert 0 < len(data.heldout) < 0.1 * len(data.train)
  np.testing.assert_allclose(unigram_entropy(np.arange(256).repeat(3)), np.log(256), rtol=1e-12)
  ids = np.arange(1000, dtype=np.int64) % 50
  np.save(tmp_path / "ids.npy", ids)
  toks, _ = load_tokens(str(tmp_path / "ids.npy"), max_bytes=0)
  np.testing.assert_array_equal(toks, ids)
  with pytest.raises(FileNotFoundError):
    load_tokens(str(tmp_path / "missing.txt"), max_bytes=0)


# a text whose bytes the byte path must split exactly as it always has (golden below)
CORPUS = "".join(f"def f{i}(x):\n    return x * {i} + {i % 7}\n" for i in range(4000))


def test_byte_path_is_unchanged(tmp_path):
  """vocab_size 256 (the default): the ids are the text's bytes, split as the byte-only
  code split them (the golden digest of this corpus's arrays is that code's), and the
  tokenizer is the byte one (1 byte per token: bits per byte = bits per token)."""
  text = tmp_path / "corpus.txt"
  text.write_text(CORPUS)
  d = make_dataset(str(text), max_bytes=0, heldout_fraction=0.05, seq=32)
  assert (len(d.train), len(d.heldout)) == (141589, 8192)
  assert hashlib.sha256(d.train.tobytes() + d.heldout.tobytes()).hexdigest() == (
      "8813ab10d33799cba37e370457ad8caec36e1cbb6684c97c6769b8032f895bd5")
  assert d.train.dtype == np.int32 and d.tokenizer == Tokenizer()
  assert d.heldout_bytes_per_token(2, 4, 32) == 1.0
  np.testing.assert_array_equal(Tokenizer().encode(b"a \xff"), [97, 32, 255])
  same = make_dataset(str(text), max_bytes=0, heldout_fraction=0.05, seq=32, vocab_size=256)
  np.testing.assert_array_equal(same.train, d.train)
  # ids of a .npy are taken as they are, whatever the vocabulary: no text behind them
  np.save(tmp_path / "ids.npy", np.arange(5000) % 300)
  ids = make_dataset(str(tmp_path / "ids.npy"), max_bytes=0, heldout_fraction=0.05, seq=32,
                     vocab_size=32000)
  assert ids.tokenizer is None and ids.heldout_bytes_per_token(1, 2, 32) is None
  assert ids.vocab_needed == 300


def test_word_tokenizer_round_trips_deterministically_within_its_vocabulary():
  text = (CORPUS + "# héllo wörld\r\n\tx = {'a': 1}  # ¿?\n").encode() + bytes(range(256))
  tok = Tokenizer.build(text, 300)
  assert tok.vocab_size == 300 and Tokenizer.build(text, 300) == tok   # a pure function
  assert tok.fingerprint == Tokenizer.build(text, 300).fingerprint
  # the most frequent multi-byte pieces, ties by their bytes
  counts = collections.Counter(p for p in PIECE_PATTERN.findall(text) if len(p) > 1)
  assert list(tok.pieces) == sorted(counts, key=lambda p: (-counts[p], p))[:44]
  for sample in (text, b"", "héllo wörld\t\r\n  x=1 \n\n".encode(), bytes(range(256)),
                 b"never seen words, 12345"):
    ids = tok.encode(sample)
    assert ids.dtype == np.int32 and (ids.size == 0 or 0 <= ids.min() <= ids.max() < 300)
    assert tok.decode(ids) == sample
  assert tok.token_bytes[tok.encode(text)].sum() == len(text)
  assert len(tok.encode(text)) < 0.6 * len(text)          # fewer tokens than bytes
  # fewer distinct pieces than room: the vocabulary holds what there is, ties by bytes
  assert Tokenizer.build(b"aa bb aa", 1000).pieces == (b" aa", b" bb", b"aa")
  assert Tokenizer.build(b"aa bb aa", 256) == Tokenizer()
  with pytest.raises(ValueError, match="vocab_size=255"):
    Tokenizer.build(text, 255)
  with pytest.raises(ValueError, match="distinct and at least 2 bytes"):
    Tokenizer((b"a",))


def test_word_level_vocabulary_comes_from_the_training_split_alone(tmp_path):
  """Each CHUNK of the corpus holds a word of its own: the held-out chunks' words never
  enter the vocabulary (their tokens fall back to bytes), the training chunks' do; the
  vocabulary is bounded by vocab_size; both splits decode to their text; the batches
  stay a pure function of (seed, step)."""
  n = 60
  blocks = [(f" q{i:04d}" * 341 + "\n\n").encode() for i in range(n)]   # CHUNK bytes each
  assert {len(b) for b in blocks} == {CHUNK}
  text = tmp_path / "corpus.txt"
  text.write_bytes(b"".join(blocks))
  stream = b"".join(blocks) + b"\n"               # the reader ends every file with a newline
  held = heldout_chunks(len(stream), 0.05)
  assert 0 < held[:n].sum() < n
  d = make_dataset(str(text), max_bytes=0, heldout_fraction=0.05, seq=32, vocab_size=1000)
  words = {b" q%04d" % i: bool(held[i]) for i in range(n)}
  assert all((w in d.tokenizer.pieces) != is_held for w, is_held in words.items())
  assert not any(b"q%04d" % i in d.tokenizer.pieces for i in range(n) if held[i])
  # the one multi-byte piece of the held-out text that the training text has too: a
  # newline and the next block's leading space; every held-out word falls back to bytes
  shared = {d.tokenizer.decode([i]) for i in np.unique(d.heldout[d.heldout >= 256])}
  assert shared == {b"\n "}
  assert d.tokenizer.vocab_size <= 1000 and d.vocab_needed <= d.tokenizer.vocab_size
  train_text = b"".join(c for i, c in enumerate(blocks) if not held[i]) + b"\n" * (not held[n])
  held_text = b"".join(c for i, c in enumerate(blocks) if held[i]) + b"\n" * bool(held[n])
  assert d.tokenizer.decode(d.train) == train_text and d.tokenizer.decode(d.heldout) == held_text
  assert "word-level tokenizer" in d.description
  # a vocabulary smaller than the training words: the tied counts go by the words' bytes
  small = make_dataset(str(text), max_bytes=0, heldout_fraction=0.05, seq=32, vocab_size=266)
  train_words = sorted(w for w, is_held in words.items() if not is_held)
  assert list(small.tokenizer.pieces) == train_words[:10]
  assert small.vocab_needed <= 266
  again = make_dataset(str(text), max_bytes=0, heldout_fraction=0.05, seq=32, vocab_size=266)
  assert again.tokenizer == small.tokenizer
  np.testing.assert_array_equal(again.batch(3, 17, 4, 32)[0], small.batch(3, 17, 4, 32)[0])
  np.testing.assert_array_equal(again.heldout, small.heldout)


def test_routing_metrics_per_layer_and_per_rank():
  """max load per layer, and the ranks' row imbalance from the layer's rank_rows or,
  without them, from the counts of the experts each rank owns."""
  import jax.numpy as jnp
  counts = jnp.array([[4, 0, 2, 2], [1, 1, 1, 5]], jnp.int32)        # [L_moe=2, E=4]
  m = jax.device_get(loop.routing_metrics({"expert_counts": counts}, expert_ranks=2))
  np.testing.assert_allclose(m["max_load_per_layer"], [2.0, 2.5])
  assert float(m["max_load"]) == 2.5
  np.testing.assert_allclose(m["rank_imbalance_per_layer"], [1.0, 1.5])   # rows [4 4], [2 6]
  np.testing.assert_array_equal(m["expert_counts"], counts)
  given = {"expert_counts": counts, "rank_rows": jnp.array([[8, 0], [4, 4]], jnp.int32)}
  np.testing.assert_allclose(loop.routing_metrics(given, 2)["rank_imbalance_per_layer"], [2.0, 1.0])


def test_run_folder_has_routing_metrics_and_heat_map(tmp_path, data, reference, reference_programs):
  """metrics.jsonl: per-layer max load and rank imbalance (short lines), the held-out
  loss in bits per byte; expert_counts.jsonl: each step's counts; expert_load.png and
  loss.png. Drawing them changes no bit of the run."""
  with _compilation_cache(reference_programs):
    run = _train(tmp_path, data, plot=True, stop_after=3)
  assert all(run["losses"][k] == reference["losses"][k] for k in run["losses"])
  assert (tmp_path / "expert_load.png").stat().st_size > 0 and (tmp_path / "loss.png").exists()
  recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  counts = [json.loads(l) for l in (tmp_path / "expert_counts.jsonl").read_text().splitlines()]
  assert [c["step"] for c in counts] == [r["step"] for r in recs if "ce" in r] == [1, 2, 3]
  for rec, c in zip([r for r in recs if "ce" in r], counts):
    per_expert = np.asarray(c["counts"], np.float64)                # [L_moe=2, E=8]
    assert per_expert.shape == (2, 8) and np.all(per_expert.sum(axis=1) == 8 * 32 * 2)
    load = per_expert / per_expert.mean(axis=1, keepdims=True)
    np.testing.assert_allclose(rec["max_load_per_layer"], load.max(axis=1), atol=1e-4)
    assert rec["max_load"] == pytest.approx(load.max(), rel=1e-6)
    rows = per_expert.reshape(2, 4, 2).sum(axis=2)                   # 4 ranks of 2 experts
    np.testing.assert_allclose(rec["rank_imbalance_per_layer"],
                               rows.max(axis=1) / rows.mean(axis=1), atol=1e-4)
    assert len(json.dumps(rec)) < 600
  held = [r for r in recs if "heldout_loss" in r]
  assert [r["step"] for r in held] == [0, 3]
  assert all(r["heldout_bpb"] == pytest.approx(r["heldout_loss"] / np.log(2)) for r in held)
  summary = json.loads((tmp_path / "summary.json").read_text())
  assert summary["heldout_bytes_per_token"] == 1.0 and summary["tokenizer"] == "bytes (vocab 256)"
  assert summary["final_heldout_loss_bits_per_byte"] == pytest.approx(
      summary["final_heldout_loss_bits"])


def test_a_run_without_matplotlib_draws_nothing_and_says_so(tmp_path, data, reference_programs,
                                                            monkeypatch, capsys):
  monkeypatch.setitem(sys.modules, "matplotlib", None)     # `import matplotlib` fails
  with _compilation_cache(reference_programs):
    _train(tmp_path, data, plot=True, stop_after=2, ckpt_dir=str(tmp_path / "ckpt"), ckpt_every=1)
  assert capsys.readouterr().out.count("matplotlib is not installed") == 1
  assert not list(tmp_path.glob("*.png")) and (tmp_path / "summary.json").exists()


def test_transformer_on_explicit_and_auto_meshes(mesh_factory):
  """The model runs on Explicit-axis meshes (conftest's) as on the trainer's Auto ones."""
  from flax import nnx
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from models import Transformer, get_config

  c = get_config("tiny", n_layers=2, max_seq_len=32)
  tokens = (np.arange(8 * 32, dtype=np.int32).reshape(8, 32) * 7) % 256
  outs = []
  for mesh in (mesh_factory(2, 4),
               jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)):
    model = Transformer(c, mesh=mesh, rngs=nnx.Rngs(0))
    tok = jax.device_put(tokens, NamedSharding(mesh, P(("data", "expert"))))
    with jax.set_mesh(mesh):
      logits, aux = nnx.jit(lambda m, t: m(t))(model, tok)
    assert logits.shape == (8, 32, 256) and aux["expert_counts"].shape == (2, 8)
    outs.append(np.asarray(logits))
  np.testing.assert_allclose(outs[0], outs[1], rtol=1e-6, atol=1e-6)


def test_train_step_has_no_float_scatter_add():
  """No float scatter-add anywhere in a training step's forward and backward pass:
  XLA runs them with atomics on the GPU, in an order that changes between runs when
  indices collide (XLA's transpose of the embedding lookup is one, with every repeated
  token)."""
  from moe_testlib import float_scatter_adds

  cfg = TrainConfig(**{**SMALL, "mesh": "data=2,expert=4", "out": "unused"})
  s = loop.make_setup(cfg)
  params, rest, _ = loop.init_state(s)
  x = y = np.zeros((cfg.batch, cfg.seq), np.int32)
  jaxpr = jax.make_jaxpr(jax.grad(lambda p: loop.loss_fn(s, p, rest, x, y)[0]))(params)
  assert float_scatter_adds(jaxpr) == []


# The optimizer state's sharding and the train step's missing all-gathers (this config and
# mesh, both --grad-reduction modes): test_ordered_reduce's
# test_optimizer_state_follows_the_params_and_the_step_gathers_nothing, on the steps that
# file compiles anyway


@pytest.mark.parametrize("explicit,grad_dtype", [(False, None), (True, None), (False, "bfloat16")])
def test_embedding_backward_is_the_scatter_sum(mesh_factory, explicit, grad_dtype):
  """embed_lookup's one-hot-matmul backward equals XLA's scatter-add transpose (with
  grad_dtype: the lookup cast to it right away, as the model does)."""
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from models.transformer import embed_lookup

  mesh = (mesh_factory(2, 4) if explicit else
          jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2))
  table = jax.random.normal(jax.random.key(0), (50, 16))
  tokens = jax.device_put(np.random.default_rng(1).integers(0, 12, (8, 6)).astype(np.int32),
                          NamedSharding(mesh, P(("data", "expert"))))
  ct = jax.random.normal(jax.random.key(2), (8, 6, 16))
  dt = jnp.float32 if grad_dtype is None else jnp.dtype(grad_dtype)
  with jax.set_mesh(mesh):
    ours = jax.jit(jax.grad(lambda t: jnp.sum(
        embed_lookup(t, tokens, mesh, grad_dtype and dt).astype(dt) * ct.astype(dt))))(table)
  ref = jax.grad(lambda t: jnp.sum(
      jnp.take(t, np.asarray(tokens), axis=0).astype(dt) * ct.astype(dt)))(table)
  np.testing.assert_allclose(np.asarray(ours), np.asarray(ref), rtol=1e-6, atol=1e-6)
  assert np.all(np.asarray(ours)[12:] == 0)    # rows no token uses


@pytest.mark.parametrize("tied", [False, True])
def test_lm_head_backward_runs_on_the_compute_dtype(tied):
  """The bf16 model's output layer: the float32 logit cotangent is cast to bf16 before
  the backward GEMMs (which autodiff would promote to float32 operands), and the
  gradients are autodiff's of the same computation with that cotangent."""
  import jax.numpy as jnp
  from models.transformer import lm_head_logits

  k = jax.random.split(jax.random.key(0), 3)
  x = jax.random.normal(k[0], (2, 5, 16)).astype(jnp.bfloat16)
  w = jax.random.normal(k[1], (40, 16) if tied else (16, 40))
  ct = jax.random.normal(k[2], (2, 5, 40))
  head = (lambda w: w.T) if tied else (lambda w: w)  # noqa: E731
  loss = lambda x, w: jnp.sum(lm_head_logits(x, head(w)) * ct)  # noqa: E731
  dx, dw = jax.jit(jax.grad(loss, argnums=(0, 1)))(x, w)
  assert dx.dtype == jnp.bfloat16 and dw.dtype == jnp.float32
  # float32 references from the cotangent rounded to bf16 (what the backward feeds its
  # GEMMs): dw is accumulated and returned in float32, dx accumulated in float32 and
  # rounded to bf16 once
  ct16 = ct.astype(jnp.bfloat16).astype(jnp.float32)
  w16 = head(w).astype(jnp.bfloat16).astype(jnp.float32)               # [H, V]
  hp = jax.lax.Precision.HIGHEST
  rdx = jnp.einsum("bsv,hv->bsh", ct16, w16, precision=hp)
  rdw = jnp.einsum("bsh,bsv->hv", x.astype(jnp.float32), ct16, precision=hp)
  rdw = rdw.T if tied else rdw
  np.testing.assert_allclose(np.asarray(dw), np.asarray(rdw), rtol=1e-5, atol=1e-5)
  np.testing.assert_array_equal(np.asarray(dx), np.asarray(rdx.astype(jnp.bfloat16)))
  # no GEMM of the backward takes a float32 operand (lowered for the GPU's rules; the
  # CPU's own lowering upcasts, see _lm_head_bwd)
  from unittest import mock
  with mock.patch.object(jax, "default_backend", lambda: "gpu"):
    hlo = jax.jit(jax.grad(loss, argnums=(0, 1))).lower(x, w).as_text()
  operands = [line.rsplit(": (", 1)[1].split(") ->")[0] for line in hlo.splitlines()
              if "dot_general" in line]
  assert len(operands) == 2, operands          # dx and dw (the loss is linear in the logits)
  assert all(o.count("xbf16>") == 2 for o in operands), operands


@pytest.mark.parametrize("explicit", [False, True])
def test_lm_head_backward_on_a_sharded_batch(mesh_factory, explicit):
  """The bf16 head's custom backward with the batch sharded over the mesh (Explicit
  axes: dw's contraction over the sharded batch needs its out_sharding): the same
  gradients as on one device (dx exactly; dw up to the order of the cross-device sum)."""
  import jax.numpy as jnp
  from jax.sharding import AxisType, NamedSharding, PartitionSpec as P
  from models.transformer import lm_head_logits

  mesh = (mesh_factory(2, 4) if explicit else
          jax.make_mesh((2, 4), ("data", "expert"), axis_types=(AxisType.Auto,) * 2))
  k = jax.random.split(jax.random.key(5), 3)
  x = jax.random.normal(k[0], (8, 3, 16)).astype(jnp.bfloat16)
  w = jax.random.normal(k[1], (16, 24))
  ct = jax.random.normal(k[2], (8, 3, 24))
  grad = lambda m: jax.grad(lambda x, w: jnp.sum(lm_head_logits(x, w, m) * ct),  # noqa: E731
                            argnums=(0, 1))
  ref_dx, ref_dw = jax.jit(grad(None))(x, w)
  batch = NamedSharding(mesh, P(("data", "expert")))
  with jax.set_mesh(mesh):
    dx, dw = jax.jit(grad(mesh))(jax.device_put(x, batch),
                                 jax.device_put(w, NamedSharding(mesh, P())))
  np.testing.assert_array_equal(np.asarray(dx, np.float32), np.asarray(ref_dx, np.float32))
  np.testing.assert_allclose(np.asarray(dw), np.asarray(ref_dw), rtol=1e-5, atol=1e-5)
  assert dw.sharding.is_fully_replicated


def test_nccl_group_launch_is_the_default_and_an_explicit_setting_wins(monkeypatch):
  from train.mesh import request_nccl_group_launch
  monkeypatch.delenv("NCCL_LAUNCH_MODE", raising=False)
  request_nccl_group_launch()
  assert os.environ["NCCL_LAUNCH_MODE"] == "GROUP"
  monkeypatch.setenv("NCCL_LAUNCH_MODE", "PARALLEL")
  request_nccl_group_launch()
  assert os.environ["NCCL_LAUNCH_MODE"] == "PARALLEL"


def test_peak_learning_rate_is_the_model_configs_unless_given():
  from models.config import get_config
  assert get_config("tiny").learning_rate == 3e-3
  assert all(get_config(n).learning_rate == 3e-4
             for n in ("mixtral-like", "deepseek-like", "qwen3-like", "small-experts"))
  for lr, peak in ((None, 3e-3), (1e-3, 1e-3)):
    s = loop.make_setup(TrainConfig(config="tiny", steps=20, warmup=4, lr=lr, progress=False, plot=False))
    assert abs(float(s.schedule(4)) - peak) < 1e-6 * peak, (lr, float(s.schedule(4)))  # float32
  with pytest.raises(ValueError, match="lr=0"):
    TrainConfig(lr=0.0)
  assert parse_args(["--lr", "2e-4"]).lr == 2e-4 and parse_args([]).lr is None


def test_bucketed_gradient_sums_give_the_same_bits(tmp_path, data, reference, reference_programs):
  """--grad-buckets: one sum after the whole backward pass gives the same training, bit
  for bit, as the default ordered sums in chained buckets in backward order (the
  losses of steps 2-3 depend on every earlier update)."""
  assert TrainConfig(**SMALL).num_grad_buckets == DEFAULT_GRAD_BUCKETS > 1  # the reference's
  assert TrainConfig(**SMALL, grad_reduction="xla").num_grad_buckets == 1
  # The init and eval programs (grad_buckets is not in them) come from the reference run's
  # cache instead of being compiled again; the train step, the program this test is about,
  # differs from the reference's and is compiled (had grad_buckets no effect, its HLO and
  # so its bits would be the reference's with or without the cache)
  with _compilation_cache(reference_programs):
    run = _train(tmp_path, data, grad_buckets=1, stop_after=3)
  assert sorted(run["losses"]) == [1, 2, 3]
  assert all(run["losses"][k] == reference["losses"][k] for k in run["losses"])


def test_backward_order_and_buckets():
  from uniep_jax.ordered_reduce import ordered_psum_buckets
  names = ["embed", "final_norm.scale", "head", "layers.0.attn.wq", "layers.1.attn.wq",
           "layers.10.ffn.router"]
  assert loop.backward_order(names) == ["final_norm.scale", "head", "layers.10.ffn.router",
                                        "layers.1.attn.wq", "layers.0.attn.wq", "embed"]
  with pytest.raises(ValueError, match="num_buckets=0"):
    ordered_psum_buckets([], 0)
  with pytest.raises(ValueError, match="grad_buckets=2 is for --grad-reduction ordered"):
    TrainConfig(grad_reduction="xla", grad_buckets=2)


def test_kernel_stages_reach_the_moe_layers():
  from train.config import TrainConfig, parse_args
  with pytest.raises(ValueError, match="kernel_stages is only for --backend pallas"):
    TrainConfig(backend="xla_capacity", kernel_stages=3)
  with pytest.raises(ValueError, match="kernel_stages=0 must be >= 1"):
    TrainConfig(backend="uniep", kernel_stages=0)
  cfg = parse_args(["--backend", "pallas", "--kernel-stages", "2", "--mesh", "data=2,expert=4"])
  s = loop.make_setup(cfg)
  model = loop.build_model(cfg, s.model_cfg, s.mesh)
  configs = [m.config for m in model.moe_modules()]
  assert configs and all(c.kernel.max_concurrent_steps == 2 for c in configs)
  assert loop.moe_options(cfg) == dict(kernel_stages=2, overlap=False, dedup_tokens=False)
  assert loop.moe_options(TrainConfig(backend="uniep")) == dict(
      kernel_stages=3, overlap=False, dedup_tokens=True)
  assert loop.moe_options(TrainConfig(backend="xla_dropless")) == {}
  # one rank on the expert axis: the one-rank form (no de-duplication, no overlap)
  one = loop.moe_options(TrainConfig(backend="uniep", overlap=True), expert_ranks=1)
  assert (one["dedup_tokens"], one["overlap"], one["one_rank"]) == (False, False, True)


def test_overlap_reaches_the_moe_layers():
  from train.config import TrainConfig, parse_args
  from uniep_jax import OverlapConfig
  with pytest.raises(ValueError, match="--overlap .* is only for --backend uniep"):
    TrainConfig(backend="pallas", overlap=True)
  cfg = parse_args(["--backend", "uniep", "--overlap", "--mesh", "data=2,expert=4"])
  s = loop.make_setup(cfg)
  configs = [m.config for m in loop.build_model(cfg, s.model_cfg, s.mesh).moe_modules()]
  assert configs and all(c.overlap == OverlapConfig() for c in configs)
  assert loop.moe_options(cfg)["overlap"] is True
  # the gradient sums wait for the whole backward pass (no collective beside an
  # overlapped launch) unless buckets are asked for
  assert cfg.num_grad_buckets == 1 and TrainConfig(backend="uniep").num_grad_buckets == 3
  assert TrainConfig(backend="uniep", overlap=True, grad_buckets=2).num_grad_buckets == 2


def test_checkpoint_from_before_the_gate_up_array_restores_bitwise(tmp_path):
  """A checkpoint with the experts' w_gate and w_up apart (the split layout) restores
  into the current template: each w_gate_up leaf, in the params and in the
  optimizer state's copy, is [w_gate | w_up] bit for bit, on the template's sharding."""
  import chex
  import jax.numpy as jnp
  import optax
  from jax.sharding import NamedSharding, PartitionSpec as P
  from train.checkpoint import Checkpointer
  mesh = jax.make_mesh((2, 4), ("data", "expert"))
  ep = NamedSharding(mesh, P("expert", None, None))
  rep = NamedSharding(mesh, P())
  k = jax.random.split(jax.random.key(0), 3)
  wg, wu = (jax.device_put(jax.random.normal(key, (8, 16, 24)), ep) for key in k[:2])
  embed = jax.device_put(jax.random.normal(k[2], (32, 16)), rep)
  # a dense SwiGLU (a shared expert) keeps its w_gate / w_up: not converted
  shared = {"layers.0.ffn.shared.w_gate": embed[:16] * 2, "layers.0.ffn.shared.w_up": embed[:16]}
  old_params = {"embed": embed, "layers.0.ffn.w_gate": wg, "layers.0.ffn.w_up": wu, **shared}
  tx = optax.adam(1e-3)
  old_opt = tx.init(old_params)
  old_opt = jax.tree.map(lambda a: a + 1.5, old_opt)   # moments not all zero
  ckpt = Checkpointer(str(tmp_path / "ckpt"))
  ckpt.save(3, dict(params=old_params, rest={}, opt_state=old_opt))
  ckpt.close()

  new_params = {"embed": jnp.zeros_like(embed),
                "layers.0.ffn.w_gate_up": jax.device_put(jnp.zeros((8, 16, 48)), ep),
                **jax.tree.map(jnp.zeros_like, shared)}
  template = dict(params=new_params, rest={}, opt_state=tx.init(new_params))
  got = Checkpointer(str(tmp_path / "ckpt")).restore(3, template)
  join = lambda d: {"embed": d["embed"], "layers.0.ffn.w_gate_up": jnp.concatenate(  # noqa: E731
      [d["layers.0.ffn.w_gate"], d["layers.0.ffn.w_up"]], axis=-1),
      **{k: d[k] for k in shared}}
  chex.assert_trees_all_equal(got["params"], join(old_params))
  chex.assert_trees_all_equal(got["opt_state"][0].mu, join(old_opt[0].mu))
  chex.assert_trees_all_equal(got["opt_state"][0].nu, join(old_opt[0].nu))
  assert got["params"]["layers.0.ffn.w_gate_up"].sharding.is_equivalent_to(ep, 3)
  # and a checkpoint in the current layout restores as it is
  ckpt = Checkpointer(str(tmp_path / "new"))
  ckpt.save(1, got)
  ckpt.close()
  chex.assert_trees_all_equal(Checkpointer(str(tmp_path / "new")).restore(1, template), got)


def test_replica_slots_reach_the_moe_layers_and_balance_the_ranks(tmp_path, data, reference):
  """--replica-slots: every MoE layer's config carries it, bad values are refused before
  anything compiles, and a run with replicas (mesh data=2, expert=4) has its expert
  ranks' rows within one 128-row GEMM tile of each other at every step where the
  routing alone leaves them further apart, with losses within float32 reassociation of
  the reference's."""
  with pytest.raises(ValueError, match="--replica-slots"):
    TrainConfig(backend="xla_capacity", replica_slots=1)
  with pytest.raises(ValueError, match="--replica-slots"):
    TrainConfig(backend="uniep", overlap=True, replica_slots=1)
  with pytest.raises(ValueError, match="--replica-slots"):
    TrainConfig(replica_slots=-1)
  cfg = parse_args(["--replica-slots", "2", "--mesh", "data=2,expert=4"])
  s = loop.make_setup(cfg)
  configs = [m.config for m in loop.build_model(cfg, s.model_cfg, s.mesh).moe_modules()]
  assert configs and all(c.replica_slots == 2 for c in configs)
  run = _train(tmp_path, data, replica_slots=2, stop_after=3)
  for k in run["losses"]:
    assert run["losses"][k] == pytest.approx(reference["losses"][k], rel=1e-5)
  recs = [json.loads(l) for l in (tmp_path / "metrics.jsonl").read_text().splitlines()]
  imbalance = np.asarray([r["rank_imbalance_per_layer"] for r in recs if "ce" in r])
  counts = [json.loads(l)["counts"] for l in (tmp_path / "expert_counts.jsonl").read_text().splitlines()]
  rows = np.asarray(counts, np.float64).reshape(3, 2, 4, 2).sum(axis=3)   # [step, layer, rank]
  routed = rows.max(axis=2) / rows.mean(axis=2)                          # without replicas
  mean_rows = rows.mean(axis=2)
  assert imbalance.shape == (3, 2) and routed.max() > 1.2
  assert np.all((imbalance - 1) * mean_rows <= 128) and np.all(imbalance <= routed)
  assert np.mean(imbalance) < 1.02 < np.mean(routed)
