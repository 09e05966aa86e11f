"""Parameter counts and FLOPs per token of a `ModelConfig` (closed form, no arrays)."""

from __future__ import annotations

from models.config import ModelConfig


def _attn_params(c: ModelConfig) -> int:
  q = c.d_model * c.n_heads * c.head_dim
  kv = 2 * c.d_model * c.n_kv_heads * c.head_dim
  o = c.n_heads * c.head_dim * c.d_model
  return q + kv + o


def model_report(c: ModelConfig, seq_len: int | None = None) -> dict:
  """Total and active (per token) parameters, forward and training FLOPs per token.

  FLOPs count matmuls as 2*m*n*k: the weight matmuls of the active parameters
  (router, K routed experts, shared expert, attention projections, head) plus
  attention scores and values over the average causal context (S+1)/2.
  Training FLOPs = 3x forward.
  """
  S = seq_len or c.max_seq_len
  H, E, K, F = c.d_model, c.n_experts, c.top_k, c.d_expert
  n_moe = len(c.moe_layers)
  n_dense = c.n_layers - n_moe
  attn = _attn_params(c)
  norms = (2 * c.n_layers + 1) * H
  embed = c.vocab_size * H
  head = 0 if c.tie_embeddings else c.vocab_size * H
  expert = 3 * H * F
  shared = 3 * H * c.n_shared * F
  router = H * E
  dense_ffn = 3 * H * c.d_ff

  total = (embed + head + norms + c.n_layers * attn + n_dense * dense_ffn
           + n_moe * (router + E * expert + shared))
  active = (embed + head + norms + c.n_layers * attn + n_dense * dense_ffn
            + n_moe * (router + K * expert + shared))
  matmul_active = (c.n_layers * attn + n_dense * dense_ffn
                   + n_moe * (router + K * expert + shared) + c.vocab_size * H)  # + LM head
  attn_ctx = 2 * 2 * c.n_layers * c.n_heads * c.head_dim * (S + 1) / 2
  fwd = 2 * matmul_active + attn_ctx
  return dict(
      name=c.name, total_params=int(total), active_params=int(active),
      moe_layers=n_moe, dense_layers=n_dense, seq_len=S,
      fwd_flops_per_token=float(fwd), train_flops_per_token=float(3 * fwd),
  )


def format_report(r: dict) -> str:
  return (f"model {r['name']}: {r['total_params'] / 1e6:.2f}M params total, "
          f"{r['active_params'] / 1e6:.2f}M active/token; {r['moe_layers']} MoE + {r['dense_layers']} dense layers; "
          f"{r['fwd_flops_per_token'] / 1e6:.2f} MFLOP/token fwd, "
          f"{r['train_flops_per_token'] / 1e6:.2f} MFLOP/token train (seq {r['seq_len']})")


def main() -> None:
  """`python -m models.report`: the report of every named config."""
  from models.config import CONFIGS

  for c in CONFIGS.values():
    print(format_report(model_report(c)))


if __name__ == "__main__":
  main()
