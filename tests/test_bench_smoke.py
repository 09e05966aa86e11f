"""The GPU scripts of bench/ on tiny CPU shapes: a script that breaks here would
waste a device call (one did: train_throughput --det-only on 2026-11-26)."""

import json

import numpy as np
import pytest

from bench import moe_layer, train_step_diff, train_throughput


def test_moe_layer_records_times_and_checksums(tmp_path):
  moe_layer.main(["--shapes", "tiny", "--backends", "xla_capacity,xla_dropless_padded",
                  "--directions", "fwd", "--routings", "balanced", "--out", str(tmp_path)])
  (path,) = [p for p in tmp_path.glob("moe_layer_*_ep*.json") if ".partial" not in p.name]
  rows = json.loads(path.read_text())["results"]
  assert {r["backend"] for r in rows} == {"xla_capacity", "xla_dropless_padded"}
  for r in rows:
    assert r["median_ms"] > 0 and len(r["checksum"]) == 2 and "error" not in r
  cap, free = sorted(rows, key=lambda r: r["backend"] != "xla_capacity")
  assert free["dropped"] == 0 and cap["dropped"] > 0     # 8 ranks of 256 tokens overflow
  assert cap["checksum"] != free["checksum"] and cap["bitwise_equal_to"] == []


@pytest.mark.parametrize("grad_reduction", ["xla", "ordered"])
def test_train_step_diff_compares_every_leaf(tmp_path, grad_reduction):
  train_step_diff.main(["--model", "tiny", "--layers", "0", "--mesh", "data=2,expert=4",
                        "--backends", "xla_dropless,xla_capacity", "--batch", "8", "--seq", "32",
                        "--grad-reduction", grad_reduction, "--tag", "smoke", "--out", str(tmp_path)])
  report = json.loads(next(tmp_path.glob("train_step_diff_*_smoke.json")).read_text())
  for backend in ("xla_dropless", "xla_capacity"):
    assert report["backends"][backend]["repeatable"] and report["backends"][backend]["same_init"]
  pair = report["pairs"]["xla_dropless_vs_xla_capacity"]
  assert set(pair["grads"]) >= {"embed", "layers.0.ffn.w_gate"}


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


def test_train_throughput_times_a_case(tmp_path):
  train_throughput.main(["--models", "tiny", "--layers", "0", "--meshes", "data=2,expert=4",
                         "--backends", "xla_dropless", "--batch", "8", "--seq", "32",
                         "--steps", "2", "--warmup", "1", "--det-steps", "0",
                         "--grad-reduction", "ordered", "--out", str(tmp_path)])
  payload = json.loads(next(tmp_path.glob("train_throughput_*_x8.json")).read_text())
  (row,) = payload["results"]
  assert row["tokens_per_s"] > 0 and row["dropped"] == 0 and "error" not in row
  assert row["grad_reduction"] == "ordered"
  assert payload["settings"]["tokens"] == "uniform"
