"""The layout stays what the data flow needs, checked on the source (no imports run):

- the kernels sit at the bottom: nothing in pallas_kernels/ imports uniep_jax (or
  anything above it), at module level or inside a function;
- the installed packages never import the benchmarks (bench/ is not installed);
- no import cycle between the product's modules;
- the public configuration stays small (what a user should set or the tuner picks);
- no dates or run numbers in Python files (history lives in docs/decisions.md and in
  bench/results);
- the README stays short and bench/results small.
"""

import ast
import dataclasses
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("pallas_kernels", "uniep_jax", "models", "train")


def _modules(packages=PRODUCT):
  """{dotted module name: path} of every .py file of `packages`."""
  out = {}
  for pkg in packages:
    for dirpath, _, files in os.walk(os.path.join(ROOT, pkg)):
      for f in files:
        if f.endswith(".py"):
          rel = os.path.relpath(os.path.join(dirpath, f), ROOT)[:-3].replace(os.sep, ".")
          out[rel.removesuffix(".__init__")] = os.path.join(dirpath, f)
  return out


def _imports(path):
  """Every module name an import statement of the file names (anywhere in it)."""
  names = set()
  for node in ast.walk(ast.parse(open(path).read(), path)):
    if isinstance(node, ast.Import):
      names.update(a.name for a in node.names)
    elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
      names.add(node.module)
      names.update(f"{node.module}.{a.name}" for a in node.names)
  return names


def test_kernels_import_nothing_above_them():
  bad = {m: sorted(i for i in _imports(p) if i.split(".")[0] in ("uniep_jax", "models", "train",
                                                                   "bench"))
         for m, p in _modules(("pallas_kernels",)).items()}
  assert not {m: v for m, v in bad.items() if v}


def test_installed_packages_never_import_bench():
  bad = {m: sorted(i for i in _imports(p) if i.split(".")[0] == "bench")
         for m, p in _modules().items()}
  assert not {m: v for m, v in bad.items() if v}
  pyproject = open(os.path.join(ROOT, "pyproject.toml")).read()
  assert "bench" not in re.search(r"include = \[(.*)\]", pyproject).group(1)


def test_no_import_cycle():
  mods = _modules()
  graph = {m: {i for i in _imports(p) if i in mods and i != m} for m, p in mods.items()}
  # a package's __init__ re-exporting its modules is not an edge back into them
  graph = {m: {d for d in deps if not (m in PRODUCT and d.startswith(m + "."))}
           for m, deps in graph.items()}
  state, stack, cycles = {}, [], []

  def visit(m):
    state[m] = "open"
    stack.append(m)
    for d in sorted(graph[m]):
      if state.get(d) == "open":
        cycles.append(stack[stack.index(d):] + [d])
      elif d not in state:
        visit(d)
    stack.pop()
    state[m] = "done"

  for m in sorted(graph):
    if m not in state:
      visit(m)
  assert not cycles, cycles


def test_public_configuration_is_small():
  """Every public field is something a user sets or the tuner picks among winners; a new
  one replaces another or is argued for here (26 after the consolidation, +1 for
  UniEPConfig.replica_slots: exact-load balancing, +1 for UniEPConfig.precision: the
  FP8 expert GEMMs)."""
  import uniep_jax
  configs = (uniep_jax.UniEPConfig, uniep_jax.RoutingConfig, uniep_jax.KernelConfig,
             uniep_jax.TransferConfig, uniep_jax.OverlapConfig)
  counts = {c.__name__: len(dataclasses.fields(c)) for c in configs}
  assert counts["UniEPConfig"] <= 10, counts
  assert sum(counts.values()) <= 28, counts


# a date, a run number (the word "run" and a number, then punctuation), a session number
_HISTORY = re.compile(r"\b20\d\d-\d\d-\d\d\b|\bruns? \d+(?:[-–]\d+)?(?:[,:.)]|$| and| on| of| in)"
                      r"|\b\d+(st|nd|rd|th) session\b")


@pytest.mark.parametrize("top", PRODUCT + ("tests", "bench", "scripts"))
def test_no_dates_or_run_numbers_in_python_files(top):
  hits = []
  for dirpath, _, files in os.walk(os.path.join(ROOT, top)):
    for f in files:
      if f.endswith(".py"):
        path = os.path.join(dirpath, f)
        for i, line in enumerate(open(path), 1):
          if _HISTORY.search(line):
            hits.append(f"{os.path.relpath(path, ROOT)}:{i}: {line.strip()[:100]}")
  assert not hits, "\n".join(hits)


def test_readme_is_short_and_results_are_small():
  assert sum(1 for _ in open(os.path.join(ROOT, "README.md"))) <= 250
  total = sum(os.path.getsize(os.path.join(d, f))
              for d, _, files in os.walk(os.path.join(ROOT, "bench", "results")) for f in files)
  assert total <= 5 * 2**20, total
