"""UniEP-JAX: expert-parallel Mixture-of-Experts for JAX.

    y, aux = uniep_jax.moe_ffn(x, params, mesh=mesh, top_k=2,
                               config=uniep_jax.UniEPConfig(backend="xla_dropless"))
"""

from uniep_jax.config import (BACKENDS, FusedConfig, KernelConfig, RoutingConfig, TransferConfig,
                              UniEPConfig)
from uniep_jax.dedup import unique_receive_bytes
from uniep_jax.layout import DispatchPlan, make_plan, sort_assignments
from uniep_jax.moe import (moe_ffn, moe_ffn_shard, param_specs, receive_buffer_bytes,
                           validate_inputs)
from uniep_jax.params import MoEParams, join_gate_up, split_gate_up
from uniep_jax.module import UniEPMoE
from uniep_jax.reference import dense_reference_moe
from uniep_jax.routing import RouterOutput, route
from uniep_jax.tune import TuneProblem, resolve_config

__all__ = [
    "BACKENDS", "DispatchPlan", "FusedConfig", "KernelConfig", "MoEParams", "RouterOutput", "RoutingConfig",
    "TransferConfig", "UniEPMoE",
    "UniEPConfig", "dense_reference_moe", "make_plan", "moe_ffn", "moe_ffn_shard",
    "param_specs", "receive_buffer_bytes", "route", "sort_assignments", "validate_inputs",
    "TuneProblem", "resolve_config", "join_gate_up", "split_gate_up", "unique_receive_bytes",
]
