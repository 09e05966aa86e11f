"""FP8 against bf16 training on one GPU: `python -m train` with and without --fp8.

For one model configuration it runs, one after another, fp8, bf16 and fp8 again (the
same seed and data), each `python -m train --config C --n-layers L --mesh
data=1,expert=1 --backend pallas --batch B --seq S --steps N [--fp8]`, and reports per
run: tokens/s, final train and held-out loss, skipped steps and the sha256 of the
final parameters (the two fp8 runs must be equal bit for bit), plus the held-out loss
curves and the relative gap of the final held-out loss (the issue's band: 1%).

  python -m bench.train_fp8 --config qwen3-like [--steps 300] [--out DIR] [--runs fp8,bf16,fp8]

A run named KIND@N (e.g. bf16@1) trains with --seed N (other parameters and batches):
with two seeds of each precision the JSON also holds bf16's seed-to-seed gap of the
held-out loss (`seed_gap_rel`), the spread the fp8 gap is to be read against, and the
fp8 gap at each seed (`heldout_gap_rel_by_seed`).

Writes train_fp8_<device>_x1_<config>.json into --out (default $OUT or bench/results).
GPU only: the pallas backend in the CPU interpret mode takes far too long.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

from bench import common
from pallas_kernels import device as device_lib
from uniep_jax.measure import git_commit


def _curve(path):
  rows = [json.loads(line) for line in open(path)] if os.path.exists(path) else []
  return [[r["step"], round(r["heldout_loss"], 4)] for r in rows if "heldout_loss" in r]


def main(argv=None):
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--config", default="qwen3-like")
  p.add_argument("--n-layers", type=int, default=2)
  p.add_argument("--batch", type=int, default=8)
  p.add_argument("--seq", type=int, default=2048)
  p.add_argument("--steps", type=int, default=300)
  p.add_argument("--data-bytes", type=int, default=None,
                 help="python -m train's cap on the default corpus (its default: 4 MiB, "
                      "about 5 epochs in 300 steps of 8 x 2048; 40 MiB: the whole stdlib, "
                      "about 2: 2.5 M training tokens)")
  p.add_argument("--runs", default="fp8,bf16,fp8")
  p.add_argument("--timeout-s", type=float, default=400.0, help="per run")
  p.add_argument("--out", default=None, help="default: $OUT, else bench/results")
  args = p.parse_args(argv)
  import jax
  dev = jax.devices()[0]
  args.out = common.out_dir(args.out)
  path = os.path.join(args.out,
                      f"train_fp8_{device_lib.device_name(dev)}_x1_{args.config}.json")
  base = [sys.executable, "-m", "train", "--config", args.config, "--n-layers",
          str(args.n_layers), "--mesh", "data=1,expert=1", "--backend", "pallas",
          "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps),
          "--eval-every", "100", "--eval-batches", "4", "--no-progress", "--no-plot",
          "--overwrite"] + ([] if args.data_bytes is None else
                            ["--data-bytes", str(args.data_bytes)])
  report = {"benchmark": "python -m train, FP8 against bf16", "device": dev.device_kind,
            "jax_version": jax.__version__, "git_commit": git_commit(),
            "command": " ".join(base[1:]) + " [--fp8] --out <run dir>", "runs": {}}
  for i, name in enumerate(args.runs.split(",")):
    kind, _, seed = name.partition("@")
    if kind not in ("fp8", "bf16") or not (seed or "0").isdigit():
      p.error(f"--runs: {name!r} is not fp8 or bf16, with an optional @SEED")
    key = name if name not in report["runs"] else f"{name}_again"
    run_dir = os.path.join(args.out, f"train_{args.config}_{i}_{kind}{seed}")
    cmd = (base + (["--fp8"] if kind == "fp8" else []) + (["--seed", seed] if seed else [])
           + ["--out", run_dir])
    t0 = time.perf_counter()
    try:
      rc = subprocess.run(cmd, timeout=args.timeout_s).returncode
    except subprocess.TimeoutExpired:
      rc = "timeout"
    summary_path = os.path.join(run_dir, "summary.json")
    s = json.load(open(summary_path)) if os.path.exists(summary_path) else {}
    report["runs"][key] = {
        "rc": rc, "wall_s": time.perf_counter() - t0,
        **{k: s.get(k) for k in ("tokens_per_s", "loop_s", "final_train_loss_nats",
                                 "final_heldout_loss_nats", "skipped_steps", "sha256",
                                 "param_sum")},
        "heldout_curve": _curve(os.path.join(run_dir, "metrics.jsonl"))}
    r = report["runs"][key]
    print(f"{key:10s} rc={rc} tokens/s={r['tokens_per_s']} heldout={r['final_heldout_loss_nats']} "
          f"train={r['final_train_loss_nats']} skipped={r['skipped_steps']} sha256={r['sha256']}",
          flush=True)
    common.write_json(path, report)   # after every run: a later one may time out
  runs = report["runs"]
  final = lambda key: runs.get(key, {}).get("final_heldout_loss_nats")  # noqa: E731
  f, b = final("fp8"), final("bf16")
  if f and b:
    report["heldout_gap_rel"] = (f - b) / b
    report["speedup"] = runs["fp8"]["tokens_per_s"] / runs["bf16"]["tokens_per_s"]
    print(f"fp8 vs bf16: held-out {f:.4f} vs {b:.4f} ({100 * (f - b) / b:+.2f}%), "
          f"tokens/s x{report['speedup']:.3f}", flush=True)
  seeds = sorted({k.partition("@")[2] for k in runs if "@" in k})
  if b and seeds:
    by_seed = {"0": (f, b)}
    by_seed.update({n: (final(f"fp8@{n}"), final(f"bf16@{n}")) for n in seeds})
    report["heldout_gap_rel_by_seed"] = {n: (f - b) / b for n, (f, b) in by_seed.items()
                                         if f and b}
    report["seed_gap_rel"] = {n: (bn - b) / b for n, (_, bn) in by_seed.items()
                              if bn and n != "0"}
    print(f"fp8 gap by seed {report['heldout_gap_rel_by_seed']}; bf16 seed-to-seed "
          f"{report['seed_gap_rel']}", flush=True)
  if "fp8_again" in runs:
    both = [runs["fp8"], runs["fp8_again"]]
    report["fp8_runs_bitwise_equal"] = (all(r["rc"] == 0 and r["sha256"] for r in both)
                                        and both[0]["sha256"] == both[1]["sha256"])
    print(f"two fp8 runs bit for bit equal: {report['fp8_runs_bitwise_equal']}", flush=True)
  common.write_json(path, report)
  return 0


if __name__ == "__main__":
  sys.exit(main())
