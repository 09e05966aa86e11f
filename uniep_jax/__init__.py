"""UniEP-JAX: expert-parallel Mixture-of-Experts for JAX.

    y, aux = uniep_jax.moe_ffn(x, params, mesh=mesh, top_k=2,
                               config=uniep_jax.UniEPConfig(backend="uniep"))

The data flow, one module per step: routing (1) -> layout, the plan (2) -> dispatch (3)
-> experts (4) -> combine (5); transport moves rows between ranks, moe wires the steps.
"""

from uniep_jax.config import (BACKENDS, KernelConfig, OverlapConfig, RoutingConfig,
                              TransferConfig, UniEPConfig)
from uniep_jax.determinism import enable_xla_determinism
from uniep_jax.layout import (DedupPlan, DispatchPlan, make_plan, receive_buffer_bytes,
                              sort_assignments, unique_receive_bytes)
from uniep_jax.module import UniEPMoE
from uniep_jax.moe import moe_ffn, moe_ffn_shard, param_specs
from uniep_jax.params import MoEParams, join_gate_up, split_gate_up
from uniep_jax.reference import dense_reference_moe
from uniep_jax.routing import RouterOutput, route
from uniep_jax.tuning import TuneProblem, resolve_config
from uniep_jax.validate import validate_inputs

__all__ = [
    "BACKENDS", "DedupPlan", "DispatchPlan", "KernelConfig", "MoEParams", "OverlapConfig",
    "RouterOutput", "RoutingConfig", "TransferConfig", "TuneProblem", "UniEPConfig", "UniEPMoE",
    "dense_reference_moe", "enable_xla_determinism", "join_gate_up", "make_plan", "moe_ffn", "moe_ffn_shard",
    "param_specs", "receive_buffer_bytes", "resolve_config", "route", "sort_assignments",
    "split_gate_up", "unique_receive_bytes", "validate_inputs",
]
