"""Routing balance of the reference transformer at initialisation.

For each model config (models/config.py), at its own width or narrowed (--d-model), it
builds the model as `python -m train` does (Transformer, nnx.Rngs(--seed)), runs the
forward pass of training step 1's batch (train.data: the config's tokenizer and split,
`Dataset.batch(seed, 0, ...)`) and records, per MoE layer, the expert counts and the max
load (the most loaded expert's count over the mean count: the training metric
`max_load`, per layer; E/K when every token picks the same K experts, 1 when balanced).

A collapsed routing at initialisation has three usual causes, which the ablations here
separate: the token stream (a byte vocabulary puts every space in one token, and a
layer that routes by token id sends that token's share of all tokens to its experts:
--data bytes), the scale of the embedding against the first attention's output
(--embed-scale 1: the table's rows of std 1/sqrt(H) enter the residual stream unscaled),
and the component every attention output shares (the causal mean of the value vectors),
which piles up with depth (the model initialises the attention output projections at
1/sqrt(2 * n_layers) of their std, GPT-2's scaled residual init; --attn-out-scale
unscaled multiplies them back by sqrt(2 * n_layers)). Each
row also gives `token_id_max_load`: the max load of a routing that sends every token of
one id to the same K experts, chosen at random per id (mean over 16 draws): what routing
by token id alone gives on this batch.

  python -m bench.init_routing [--configs tiny,qwen3-like] [--d-model 256] [--batch 8]
      [--seq 512] [--data tokenizer|bytes] [--embed-scale S] [--attn-out-scale unscaled|S]
      [--mesh data=1,expert=1]
      [--tag NAME] [--out DIR]

--d-model 0 keeps each config's widths (GPU sizes, in their bfloat16: XLA's float32
ragged_dot expands to a dense product on the GPU; deepseek-like's float32 parameters and
their bf16 copies need more than one H200: --mesh data=1,expert=N spreads the experts);
a narrowed config keeps its vocabulary, experts, top-k, layers and routing, and takes
heads of 64, 2 heads per KV head, d_ff = 2 * d_model and experts of d_model / 4. One
JSON, init_routing_<device>[_<tag>].json, under --out ($OUT or bench/results).
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import time

import numpy as np

ALL_CONFIGS = ("tiny", "tiny-deepseek", "mixtral-like", "deepseek-like", "qwen3-like",
               "small-experts")


def narrowed(c, d_model: int, seq: int, dtype: str | None):
  """Config `c` at width d_model (0: its own) with max_seq_len = seq and `dtype` (None:
  its own); the MoE shape (E, K, layers, routing) and the vocabulary stay."""
  fields = dict(max_seq_len=seq)
  if d_model:
    if d_model % 64 or d_model < 128:
      raise ValueError(f"--d-model {d_model} must be a multiple of 64, >= 128 (heads of 64)")
    heads = d_model // 64
    fields.update(d_model=d_model, n_heads=heads, n_kv_heads=max(1, heads // 2), head_dim=64,
                  d_ff=2 * d_model, d_expert=d_model // 4)
  if dtype:
    fields["dtype"] = dtype
  return dataclasses.replace(c, **fields)


def token_id_max_load(tokens: np.ndarray, experts: int, top_k: int, draws: int = 16,
                      seed: int = 0) -> float:
  """Mean over `draws` of the max load when every token of one id goes to the same
  top_k experts, drawn at random per id: the routing-by-token-id reference."""
  ids, count = np.unique(tokens.reshape(-1), return_counts=True)
  rng = np.random.default_rng(seed)
  out = []
  for _ in range(draws):
    chosen = np.argsort(rng.random((len(ids), experts)), axis=1)[:, :top_k]  # [ids, K]
    load = np.bincount(chosen.reshape(-1), weights=np.repeat(count, top_k), minlength=experts)
    out.append(load.max() / load.mean())
  return float(np.mean(out))


def probe(name: str, *, d_model: int, batch: int, seq: int, seed: int, data_kind: str,
          embed_scale: float | None, attn_out_scale: str | None, dtype: str | None,
          mesh_spec: str, data_bytes: int) -> dict:
  """One config's routing statistics at initialisation on step 1's batch."""
  import jax
  from flax import nnx
  from jax.sharding import NamedSharding, PartitionSpec as P

  from models.config import get_config
  from models.transformer import Transformer
  from train.data import BYTE_VOCAB, make_dataset
  from train.mesh import MESH_AXES, make_mesh, parse_mesh

  c = narrowed(get_config(name), d_model, seq, dtype)
  vocab = BYTE_VOCAB if data_kind == "bytes" else c.vocab_size
  t0 = time.time()
  data = make_dataset(None, max_bytes=data_bytes, heldout_fraction=0.05, seq=seq, vocab_size=vocab)
  data_s = time.time() - t0
  tokens, _ = data.batch(seed, 0, batch, seq)            # [batch, seq]: step 1's inputs
  mesh = make_mesh(parse_mesh(mesh_spec))
  model = Transformer(c, mesh=mesh, backend="xla_dropless", rngs=nnx.Rngs(seed))
  if embed_scale is not None:
    model.embed_scale = float(embed_scale)
  wo_scale = 1.0
  if attn_out_scale is not None:
    wo_scale = (2 * c.n_layers) ** 0.5 if attn_out_scale == "unscaled" else float(attn_out_scale)
    for blk in model.layers:
      blk.attn.wo[...] = blk.attn.wo[...] * wo_scale
  tok = jax.device_put(tokens, NamedSharding(mesh, P(MESH_AXES)))
  with jax.set_mesh(mesh):
    _, aux = nnx.jit(lambda m, t: m(t))(model, tok)
  counts = np.asarray(jax.device_get(aux["expert_counts"])).astype(np.int64)  # [L_moe, E]
  load = counts / counts.mean(axis=1, keepdims=True)
  share = np.bincount(tokens.reshape(-1)).max() / tokens.size
  return dict(config=name, d_model=c.d_model, n_experts=c.n_experts, top_k=c.top_k,
              moe_layers=list(c.moe_layers), vocab_size=c.vocab_size, data=data_kind,
              tokenizer=data.tokenizer.describe(), embed_scale=model.embed_scale,
              attn_out_scale=wo_scale,
              dtype=c.dtype, tokens=int(tokens.size), top_token_share=float(share),
              max_load_per_layer=[round(float(v), 4) for v in load.max(axis=1)],
              min_load_per_layer=[round(float(v), 4) for v in load.min(axis=1)],
              max_load=round(float(load.max()), 4),
              token_id_max_load=round(token_id_max_load(tokens, c.n_experts, c.top_k), 4),
              expert_counts=counts.tolist(),
              data_s=round(data_s, 2))


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__,
                               formatter_class=argparse.RawDescriptionHelpFormatter)
  ap.add_argument("--configs", default=",".join(ALL_CONFIGS),
                  help="comma list of model configs (models/config.py)")
  ap.add_argument("--d-model", type=int, default=256,
                  help="narrow every config to this width (0: the config's own widths)")
  ap.add_argument("--batch", type=int, default=8, help="sequences of step 1's batch")
  ap.add_argument("--seq", type=int, default=512, help="tokens per sequence")
  ap.add_argument("--seed", type=int, default=0, help="the parameters' and the batch's seed")
  ap.add_argument("--data", default="tokenizer", choices=("tokenizer", "bytes"),
                  help="tokenizer: the config's (word-level for vocabularies > 256, as "
                       "`python -m train`); bytes: the byte stream whatever the vocabulary")
  ap.add_argument("--data-bytes", type=int, default=4 << 20,
                  help="cap of the default corpus (`python -m train --data-bytes`)")
  ap.add_argument("--embed-scale", type=float, default=None,
                  help="override the factor the embedding rows are multiplied by (default: "
                       "the model's sqrt(d_model); 1: the rows enter at std 1/sqrt(d_model))")
  ap.add_argument("--attn-out-scale", default=None,
                  help="multiply the attention output projections' initial weights by this "
                       "('unscaled': sqrt(2 * n_layers), undoing the model's depth scaling); "
                       "default: as initialised")
  ap.add_argument("--dtype", default=None, choices=("float32", "bfloat16"),
                  help="compute dtype (default: float32 when narrowed, else the config's)")
  ap.add_argument("--mesh", default="data=1,expert=1",
                  help="mesh of the forward pass, e.g. data=1,expert=4 on 4 GPUs")
  ap.add_argument("--tag", default="", help="names the JSON: init_routing_<device>_<tag>.json")
  ap.add_argument("--out", default=None, help="folder of the JSON (default $OUT or bench/results)")
  args = ap.parse_args(argv)
  names = [n for n in args.configs.split(",") if n]
  from models.config import CONFIGS
  unknown = sorted(set(names) - set(CONFIGS))
  if unknown:
    ap.error(f"--configs: unknown {unknown}; expected names of {sorted(CONFIGS)}")
  if not names:
    ap.error("--configs: no config named")
  if args.d_model:
    narrowed(CONFIGS[names[0]], args.d_model, args.seq, None)   # a bad width fails first
  if args.attn_out_scale not in (None, "unscaled"):
    try:
      float(args.attn_out_scale)
    except ValueError:
      ap.error(f"--attn-out-scale {args.attn_out_scale!r}: a number or 'unscaled'")
  dtype = args.dtype or ("float32" if args.d_model else None)

  from bench import common
  meta = common.run_metadata()
  results = []
  for name in names:
    t0 = time.time()
    row = probe(name, d_model=args.d_model, batch=args.batch, seq=args.seq, seed=args.seed,
                data_kind=args.data, embed_scale=args.embed_scale,
                attn_out_scale=args.attn_out_scale, dtype=dtype,
                mesh_spec=args.mesh, data_bytes=args.data_bytes)
    row["seconds"] = round(time.time() - t0, 1)
    results.append(row)
    print(f"{name:14s} E={row['n_experts']:3d} K={row['top_k']} E/K={row['n_experts'] / row['top_k']:5.1f}"
          f"  top token {row['top_token_share']:.3f}  by token id {row['token_id_max_load']:.2f}"
          f"  max_load per layer {row['max_load_per_layer']}", flush=True)
  settings = {k: v for k, v in vars(args).items() if k != "out"}
  payload = dict(meta, benchmark="init_routing", settings=dict(settings, dtype=dtype),
                 results=results)
  tag = f"_{args.tag}" if args.tag else ""
  common.write_json(os.path.join(common.out_dir(args.out),
                                 f"init_routing_{common.device_tag(meta)}{tag}.json"), payload)
  return 0


if __name__ == "__main__":
  sys.exit(main())
