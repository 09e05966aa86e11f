"""The layer's compiled kernels stay what they are: the Mosaic GPU kernels of the default
"uniep" configuration, its overlapped point and "pallas", lowered for CUDA at EP 4 on the
CPU (forward and forward+backward), equal the golden inventory kernel for kernel
(name, launch parameters, operand types, MLIR digest). A change that means to change a
kernel rewrites the golden file (`python tests/kernel_inventory.py`) in the same commit."""

import json

import pytest

from kernel_inventory import GOLDEN, layer_configs, layer_kernels


@pytest.fixture(scope="module")
def golden():
  with open(GOLDEN) as f:
    return json.load(f)


@pytest.mark.parametrize("name", sorted(layer_configs()))
def test_layer_kernels_match_the_golden_inventory(golden, name):
  cfg = layer_configs()[name]
  for direction, grad in (("fwd", False), ("fwdbwd", True)):
    got, want = layer_kernels(cfg, grad), golden[f"{name}/{direction}"]
    brief = lambda ks: [(k["name"], k["launch_operands"], k["digest"]) for k in ks]  # noqa: E731
    assert brief(got) == brief(want), f"{name}/{direction}"
    assert got == want, f"{name}/{direction}"
