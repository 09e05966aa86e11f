"""`ModelConfig`: shapes of the decoder-only MoE transformer, and the named configs.

`tiny` trains on a CPU in minutes (byte vocabulary). The GPU configs take the target
MoE shapes (`uniep_jax.measure.SHAPES`: H, F, E, K per layer) with a few layers and
attention shaped like the model they imitate (grouped-query; GQA stands in for
DeepSeek's MLA).
"""

from __future__ import annotations

import dataclasses

from uniep_jax.config import RoutingConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig:
  """A decoder-only transformer with MoE FFNs.

  Layer i is an MoE layer when i >= first_dense and (i - first_dense) % moe_every == 0;
  the others use a dense SwiGLU of width d_ff.
  """

  name: str
  vocab_size: int
  d_model: int  # H
  n_layers: int
  n_heads: int
  n_kv_heads: int  # grouped-query attention when < n_heads
  head_dim: int
  d_ff: int  # dense SwiGLU width (non-MoE layers)
  n_experts: int  # E
  top_k: int  # K
  d_expert: int  # F, width of one routed expert
  n_shared: int = 0  # shared expert width in units of d_expert
  moe_every: int = 1
  first_dense: int = 0
  max_seq_len: int = 128
  tie_embeddings: bool = True
  rope_theta: float = 10000.0
  norm_eps: float = 1e-6
  dtype: str = "float32"  # compute dtype; parameters are float32
  routing: RoutingConfig = dataclasses.field(default_factory=RoutingConfig)
  use_expert_bias: bool = False  # auxiliary-loss-free balancing
  # peak AdamW learning rate of `python -m train` unless --lr. 3e-3 suits tiny; it blows
  # the 4096-wide mixtral-like up on its first full update (loss 10.7 -> 28.6 on 4x
  # H200), so the GPU-sized configs take 3e-4, the usual peak at this size (not tuned
  # here).
  learning_rate: float = 3e-3

  def __post_init__(self):
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"n_heads={self.n_heads} must be divisible by n_kv_heads={self.n_kv_heads}")
    if self.head_dim % 2:
      raise ValueError(f"head_dim={self.head_dim} must be even (RoPE)")
    if not 1 <= self.top_k <= self.n_experts:
      raise ValueError(f"top_k={self.top_k} must be in [1, n_experts={self.n_experts}]")
    if self.moe_every < 1 or self.first_dense < 0:
      raise ValueError(f"moe_every={self.moe_every} must be >= 1 and first_dense={self.first_dense} >= 0")
    if not self.learning_rate > 0:
      raise ValueError(f"learning_rate={self.learning_rate} must be > 0")
    if self.dtype not in ("float32", "bfloat16"):
      raise ValueError(f"dtype={self.dtype!r} must be 'float32' or 'bfloat16'")

  def is_moe_layer(self, i: int) -> bool:
    return i >= self.first_dense and (i - self.first_dense) % self.moe_every == 0

  @property
  def moe_layers(self) -> tuple[int, ...]:
    return tuple(i for i in range(self.n_layers) if self.is_moe_layer(i))


_DEEPSEEK_ROUTING = RoutingConfig(score_fn="sigmoid", normalize_topk=True, scale=2.5,
                                  n_groups=8, topk_groups=4)

CONFIGS: dict[str, ModelConfig] = {
    c.name: c
    for c in (
        ModelConfig(name="tiny", vocab_size=256, d_model=128, n_layers=4, n_heads=4, n_kv_heads=2,
                    head_dim=32, d_ff=512, n_experts=8, top_k=2, d_expert=256, max_seq_len=128),
        # tiny with the DeepSeek ingredients: a dense first layer, a shared expert,
        # sigmoid group-limited routing and auxiliary-loss-free balancing.
        ModelConfig(name="tiny-deepseek", vocab_size=256, d_model=128, n_layers=4, n_heads=4,
                    n_kv_heads=2, head_dim=32, d_ff=512, n_experts=8, top_k=2, d_expert=128,
                    n_shared=1, first_dense=1, max_seq_len=128,
                    routing=RoutingConfig(score_fn="sigmoid", n_groups=4, topk_groups=2),
                    use_expert_bias=True),
        ModelConfig(name="mixtral-like", vocab_size=32000, d_model=4096, n_layers=2, n_heads=32,
                    n_kv_heads=8, head_dim=128, d_ff=14336, n_experts=8, top_k=2, d_expert=14336,
                    max_seq_len=4096, tie_embeddings=False, rope_theta=1e6, dtype="bfloat16", learning_rate=3e-4),
        ModelConfig(name="deepseek-like", vocab_size=32000, d_model=7168, n_layers=2, n_heads=56,
                    n_kv_heads=8, head_dim=128, d_ff=18432, n_experts=256, top_k=8, d_expert=2048,
                    n_shared=1, max_seq_len=4096, tie_embeddings=False, dtype="bfloat16", learning_rate=3e-4,
                    routing=_DEEPSEEK_ROUTING, use_expert_bias=True),
        ModelConfig(name="qwen3-like", vocab_size=32000, d_model=2048, n_layers=4, n_heads=32,
                    n_kv_heads=4, head_dim=128, d_ff=6144, n_experts=128, top_k=8, d_expert=768,
                    max_seq_len=4096, tie_embeddings=False, rope_theta=1e6, dtype="bfloat16", learning_rate=3e-4),
        ModelConfig(name="small-experts", vocab_size=32000, d_model=1536, n_layers=4, n_heads=12,
                    n_kv_heads=4, head_dim=128, d_ff=4096, n_experts=64, top_k=8, d_expert=480,
                    max_seq_len=4096, tie_embeddings=False, dtype="bfloat16", learning_rate=3e-4),
    )
}


def get_config(name: str, **overrides) -> ModelConfig:
  """A named config, optionally with fields replaced."""
  if name not in CONFIGS:
    raise ValueError(f"unknown model config {name!r}; expected one of {sorted(CONFIGS)}")
  return dataclasses.replace(CONFIGS[name], **overrides)
