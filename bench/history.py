"""One CSV history of every benchmark measurement: bench/results/history.csv.

Each result JSON the benchmarks write becomes rows of the same columns (COLUMNS):
where and when it ran (date, git_commit, jax_version, device_kind, device_count),
what ran (shape, backend, routing, direction, ep), and one measurement per row
(metric, value, unit) with a free-text `note` (the knob or kernel label a value
belongs to, a checksum, an error message). Booleans are written as 1 / 0 with unit
"bool"; a field a result does not have is an empty string.

The benchmark is the file-name prefix (`moe_layer_NVIDIA_H200_ep4_<tag>.json` ->
moe_layer; `profiles/profile_*.json` -> profile_layer; `tune/tune_*.json` -> tune)
and `source` is the file name. A log with no JSON twin (`X.log` or `X.bench.log`
beside `X.json`) gets one row, metric "log", its first meaningful line as note.

  python -m bench.history add FILE.json [FILE.log ...]   append new files' rows
  python -m bench.history rebuild                        rewrite from bench/results

`add` skips a file whose name is already a source in the history. `rebuild`
re-reads every JSON (and twinless log) under bench/results, recursively, and
keeps the rows of sources that are no longer on disk: results are pruned once
their rows are in the history, so the history is the only copy of those.
"""

from __future__ import annotations

import ast
import csv
import json
import os
import re
import sys
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
HISTORY = RESULTS / "history.csv"

COLUMNS = ("benchmark", "source", "date", "git_commit", "jax_version",
           "device_kind", "device_count", "shape", "backend", "routing",
           "direction", "ep", "metric", "value", "unit", "note")

# The run's header fields: read by `_header`, never flattened into rows.
HEADER_KEYS = {"benchmark", "date", "git_commit", "jax_version", "device_kind",
               "device_count", "device", "host", "platform", "command", "meta"}
# Run settings, model numbers and raw samples, not measurements: reps and trials
# describe the timing; the roofline floors (`*_floor_ms`) and buffer sizes follow
# from the shape (x_over_floor relates a time to its floor); checksums per sweep
# point, group sizes, rank rows and loss curves are summarised by the rows next
# to them.
SKIP_KEYS = {"reps", "trials", "short_batch_reps", "rank_rows", "group_sizes",
             "checksums", "num_received", "live_rows", "schedule", "timeline",
             "losses", "suite_log", "mean_us", "total_us", "compiled_ahead",
             "executable_reused", "receive_buffer_bytes", "unique_receive_bytes"}
SKIP_SUFFIX = "_floor_ms"
# Text a row carries in its note: key -> the row's metric.
TEXT_METRICS = {"error": "error", "error_tail": "error", "why": "skipped",
                "checksum": "checksum", "bitwise_equal_to": "bitwise_equal_to"}
# File-level free text: one row each, metric = the key.
FILE_TEXT_KEYS = {"note", "git_commit_note", "source_note", "partial", "alt",
                  "setup", "settings", "timing", "runs"}
SHAPE_KEYS = ("shape", "model", "config", "case", "shape_name")
BACKEND_KEYS = ("backend", "variant")
ROUTING_KEYS = ("routing", "load", "groups")
# A key names a measurement if it matches; other numbers are problem sizes.
MEASUREMENT = re.compile(
    r"(_ms|_us|^ms|tflops|_per_s|_err|_diff|_ref|bitwise|equal|repeatable|^ok$|"
    r"agree|_fold|rows_differing|unique_rows|bad_rows|close_to|returncode|^rel$|"
    r"ratio|speedup|^mfu|loss|dropped|x_over|_s$|_gib|max_load|param_sum|"
    r"^passed$|^failed$|^partial$|^complete$|same_init|^count_)")


def _skipped(key) -> bool:
  return key in SKIP_KEYS or str(key).endswith(SKIP_SUFFIX)


def benchmark_of(source: str, result: dict | None = None) -> str:
  """The family a result file belongs to: its file-name prefix."""
  name = os.path.basename(source)
  if name.startswith("profile_"):
    return "profile_layer"
  prefix = re.split(r"_NVIDIA|_H100|_H200|\.", name)[0]
  if result and isinstance(result.get("benchmark"), str) and \
      name.startswith(result["benchmark"]):
    return result["benchmark"]
  return prefix


def rows(result: dict, source: str) -> list[dict]:
  """The history rows of one result JSON (`source`: its file name)."""
  source = os.path.basename(source)
  bench = benchmark_of(source, result)
  flatten = FAMILIES.get(bench, _generic)
  try:
    body = list(flatten(result))
  except (KeyError, TypeError, ValueError, AttributeError) as e:
    body = [_row("file", "", note=f"not flattened ({type(e).__name__}: {e}); "
                 f"{_summary(result)}")]
  if not body:
    body = [_row("file", "", note=f"no measurements found; {_summary(result)}")]
  head = {"benchmark": bench, "source": source, **_header(result)}
  out = []
  for r in body:
    row = {c: "" for c in COLUMNS}
    row.update(head)
    row.update({k: v for k, v in r.items() if v not in (None, "")})
    out.append({c: _cell(row[c]) for c in COLUMNS})
  return out


# --- cells, units, headers ---------------------------------------------------

def _cell(v) -> str:
  if v is None:
    return ""
  if isinstance(v, bool):
    return "1" if v else "0"
  if isinstance(v, float):
    return repr(v)
  return str(v)


def _unit(metric: str, value) -> str:
  if isinstance(value, bool):
    return "bool"
  if value == "":
    return ""
  for pattern, unit in ((r"(_ms|^ms|_ms_min)$", "ms"), (r"_us$", "us"),
                        (r"tokens_per_s$", "tokens/s"), (r"gb_per_s$", "GB/s"),
                        (r"tflops", "TFLOP/s"), (r"_gib$", "GiB"),
                        (r"_bytes$", "bytes"), (r"_s$", "s"),
                        (r"speedup|x_over|ratio|_over_", "x"),
                        (r"^mfu$|fraction", "fraction"),
                        (r"^passed$|^failed$|^count_|^swept$|^mismatches$|"
                         r"^skipped_points$|^differing_grads$|^dropped$", "count")):
    if re.search(pattern, metric):
      return unit
  return ""


def _row(metric: str, value, note: str = "", **ids) -> dict:
  if isinstance(value, float) and value != value:
    value, note = "", _join(note, "NaN")
  return {"metric": metric, "value": value, "unit": _unit(metric, value),
          "note": _join(note), **ids}


def _join(*parts) -> str:
  text = "; ".join(str(p) for p in parts if p not in (None, ""))
  return re.sub(r"\s*\n\s*", " | ", text.strip())


def _header(result: dict) -> dict:
  meta = result.get("meta") if isinstance(result.get("meta"), dict) else {}
  device = result.get("device")

  def get(key):
    v = result.get(key, meta.get(key))
    return "" if v is None else v

  kind = get("device_kind")
  if not kind and isinstance(device, dict):
    kind = device.get("kind", "")
  elif not kind and isinstance(device, str):
    kind = device
  return {"date": get("date"), "git_commit": get("git_commit"),
          "jax_version": get("jax_version"), "device_kind": kind,
          "device_count": get("device_count")}


def _ep_of(mesh) -> str:
  m = re.search(r"expert=(\d+)", str(mesh or ""))
  return m.group(1) if m else ""


def _summary(result: dict) -> str:
  parts = []
  for k, v in result.items():
    if k in HEADER_KEYS:
      continue
    size = f"[{len(v)}]" if isinstance(v, (list, dict)) else ""
    parts.append(k + size)
  return "keys: " + ", ".join(parts)


# --- the generic flattener ---------------------------------------------------
# A result is header fields, lists of records (dicts: one measured case each)
# and file-level values. A record's identity (shape, backend, routing,
# direction, ep) comes from its keys; its other strings are the note's context;
# every numeric or boolean leaf whose key (or an enclosing key) names a
# measurement is a row, the remaining path being the label in the note
# (`median_ms: {da_hu0: 3.1}` -> metric median_ms, note da_hu0).

def _leaves(obj, path=()):
  """(path, value) for each scalar leaf; lists of named dicts become path steps."""
  if isinstance(obj, dict):
    for k, v in obj.items():
      if _skipped(k):
        continue
      yield from _leaves(v, path + (str(k),))
  elif isinstance(obj, list):
    if obj and all(isinstance(x, str) for x in obj):
      yield path, " ".join(obj)
    for x in obj:
      if isinstance(x, dict):
        name = next((x[k] for k in ("name", "variant", "case", "label")
                     if isinstance(x.get(k), str)), None)
        if name is not None:
          rest = {k: v for k, v in x.items() if v is not name}
          yield from _leaves(rest, path[:-1] + (name,))
  elif obj is not None:
    yield path, obj


def _split(path):
  """(metric, label): the innermost key naming a measurement, and the rest."""
  for i in range(len(path) - 1, -1, -1):
    if MEASUREMENT.search(path[i]):
      return path[i], "/".join(path[:i] + path[i + 1:])
  return None


def _leaf_rows(path, value, ids, context=""):
  key = path[-1] if path else ""
  if isinstance(value, str):
    if key in TEXT_METRICS and value:
      yield _row(TEXT_METRICS[key], "", _join(context, "/".join(path[:-1]), value),
                 **ids)
    return
  split = _split(path)
  if split is not None:
    metric, label = split
    yield _row(metric, value, _join(context, label), **ids)


def _identity(record: dict, base: dict) -> dict:
  ids = dict(base)
  for column, keys in (("shape", SHAPE_KEYS), ("backend", BACKEND_KEYS),
                       ("routing", ROUTING_KEYS), ("direction", ("direction",))):
    for k in keys:
      v = record.get(k)
      if isinstance(v, dict):
        v = v.get("name")
      if isinstance(v, str) and v:
        ids[column] = v
        break
  if isinstance(record.get("ep"), int):
    ids["ep"] = record["ep"]
  elif _ep_of(record.get("mesh")):
    ids["ep"] = _ep_of(record.get("mesh"))
  return ids


IDENTITY_KEYS = set(SHAPE_KEYS + BACKEND_KEYS + ROUTING_KEYS) | {"direction", "ep"}


def _record_rows(record: dict, base: dict, skipped: bool = False):
  ids = _identity(record, base)
  context = " ".join(f"{k}={v}" for k, v in record.items()
                     if isinstance(v, str) and k not in IDENTITY_KEYS
                     and k not in TEXT_METRICS)
  sizes = {k: v for k, v in record.items() if isinstance(v, int)
           and not isinstance(v, bool) and k not in IDENTITY_KEYS
           and not MEASUREMENT.search(k)}
  if "shape" not in ids and sizes:
    ids["shape"] = ",".join(f"{k}={v}" for k, v in sizes.items())
  if skipped:
    yield _row("skipped", "", _join(context, record.get("why", "")), **ids)
    return
  for k, v in record.items():
    if k in IDENTITY_KEYS or k in sizes or _skipped(k):
      continue
    if isinstance(v, str) and k not in TEXT_METRICS:
      continue
    for path, leaf in _leaves(v, (k,)):
      yield from _leaf_rows(path, leaf, ids, context)


def _is_records(v) -> bool:
  return isinstance(v, list) and bool(v) and all(isinstance(x, dict) for x in v)


def _generic(result: dict):
  base = _identity(result, {})
  for key, value in result.items():
    if key in HEADER_KEYS or key in IDENTITY_KEYS or _skipped(key):
      continue
    if key in FILE_TEXT_KEYS:
      if isinstance(value, dict):
        value = "; ".join(f"{k}: {v}" for k, v in value.items())
      elif isinstance(value, list) and all(isinstance(v, str) for v in value):
        value = " | ".join(value)
      if isinstance(value, str):
        yield _row(key, "", value, **base)
        continue
    if _is_records(value):
      for record in value:
        yield from _record_rows(record, base, skipped=(key == "skipped"))
    else:
      for path, leaf in _leaves(value, (key,)):
        yield from _leaf_rows(path, leaf, base)


# --- families that need more than the generic flattener ----------------------

def _grouped_gemm(result: dict):
  # Its `ms` are medians (the file's "timing" says how they were taken).
  for r in _generic(result):
    yield dict(r, metric="median_ms") if r["metric"] == "ms" else r


def _check(result: dict):
  """check_moe_gpu: pass/fail counts, one `ok` row per check and its relative
  errors (`rel`, or `rel_<tensor>` for the gradients)."""
  yield _row("passed", result.get("passed", ""))
  yield _row("failed", result.get("failed", ""))
  for key in ("complete", "partial"):
    if isinstance(result.get(key), bool):
      yield _row(key, result[key])
    elif isinstance(result.get(key), str):
      yield _row(key, "", result[key])
  for key in ("git_commit_note", "source_note"):
    if result.get(key):
      yield _row(key, "", result[key])
  for check in result.get("checks", []):
    name = check.get("name", "")
    ids = {"ep": _ep_of(name.replace("ep=", "expert="))}
    target = name.split(" ", 1)[1] if " " in name else ""
    if target.count("/") >= 3:
      ids["backend"] = target.split("/", 1)[0]
    yield _row("ok", check.get("ok", ""), name, **ids)
    for k, v in check.items():
      if k not in ("name", "ok") and isinstance(v, (int, float)):
        yield _row("rel" if k == "rel" else f"rel_{k}", v, name, **ids)


def _determinism_sweep(result: dict):
  """One equals_pallas / repeatable row per swept tiling, then the summary."""
  ids = {"shape": (result.get("shape") or {}).get("name", ""),
         "ep": result.get("ep", "")}
  outcome = ("checksums", "equals_pallas", "repeatable")
  for point in result.get("points", []):
    knobs = " ".join(f"{k}={v}" for k, v in point.items()
                     if k not in outcome and v is not None)
    for k in ("equals_pallas", "repeatable"):
      if k in point:
        yield _row(k, point[k], knobs, **ids)
  yield _row("all_tilings_agree", result.get("all_tilings_agree", ""), **ids)
  yield _row("swept", result.get("swept", ""), **ids)
  if isinstance(result.get("partial"), bool):
    yield _row("partial", result["partial"], **ids)
  mism = result.get("mismatches", [])
  yield _row("mismatches", len(mism), " | ".join(
      f"kernel={m.get('kernel')} chunk_rows={m.get('chunk_rows')} "
      f"col_tile={m.get('col_tile')} num_ctas={m.get('num_ctas')}" for m in mism), **ids)
  skipped = result.get("skipped", [])
  whys = sorted({s.get("why", "") for s in skipped})
  yield _row("skipped_points", len(skipped), ", ".join(whys), **ids)


def _diff_rows(diffs: dict, what: str, ids: dict):
  for tensor, d in diffs.items():
    for k in ("max_abs_diff", "max_rel_diff"):
      if k in d:
        yield _row(k, d[k], f"{what} {tensor}", **ids)


def _train_step_diff(result: dict):
  """Per backend: loss, run-to-run repeatability; per pair: the differences."""
  s = result.get("settings", {})
  base = {"shape": s.get("model", ""), "ep": _ep_of(s.get("mesh"))}
  yield _row("settings", "", " ".join(
      f"{k}={s[k]}" for k in ("tag", "grad_reduction", "batch", "seq", "layers",
                              "xla_deterministic", "xla_flags", "nccl_algo")
      if s.get(k) not in (None, "")), **base)
  for backend, r in result.get("backends", {}).items():
    ids = {**base, "backend": backend}
    for k in ("loss", "repeatable", "same_init"):
      if k in r:
        yield _row(k, r[k], **ids)
    yield from _diff_rows(r.get("repeat_scalars", {}), "repeat scalar", ids)
    yield from _diff_rows(r.get("repeat_grads", {}), "repeat grad", ids)
  for pair, r in result.get("pairs", {}).items():
    ids = {**base, "backend": pair}
    if "expert_counts_equal" in r:
      yield _row("expert_counts_equal", r["expert_counts_equal"], **ids)
    differing = r.get("differing_grads", [])
    yield _row("differing_grads", len(differing), " ".join(map(str, differing)), **ids)
    yield from _diff_rows(r.get("scalars", {}), "scalar", ids)
    yield from _diff_rows(r.get("grads", {}), "grad", ids)


def _kernel_rows(table: dict, where: str, ids: dict, kernels: bool = True):
  """A device's span and busy time per call and (with `kernels`) the time per
  call of each kernel that takes at least 1% of the busy time; the smaller
  listed kernels are one row (their sum), the table's unlisted ones only
  counted in its note."""
  for key in ("span_per_call_us", "busy_per_call_us"):
    if key in table:
      yield _row(key, table[key], where, **ids)
  if not kernels:
    return
  busy = table.get("busy_per_call_us") or 0.0
  minor = []
  for k in table.get("kernels", []):
    if k.get("per_call_us", 0.0) < 0.01 * busy:
      minor.append(k)
      continue
    overlap = f" overlap_us={k['overlap_us']!r}" if k.get("overlap_us") else ""
    yield _row("kernel_per_call_us", k.get("per_call_us", ""),
               f"{where} {k.get('name')} count={k.get('count')}{overlap}", **ids)
  if minor or table.get("other_kernels"):
    yield _row("minor_kernels_per_call_us", sum(k["per_call_us"] for k in minor),
               f"{where} sum of {len(minor)} listed kernels under 1% of busy; "
               f"{table.get('other_kernels', 0)} more kernels not listed", **ids)


def _profile_layer(result: dict):
  """Per device: span and busy time per call; the kernel table of the first
  device (GPU 0) only, as the other devices run the same kernels (their tables
  and the per-device timelines are not flattened)."""
  s = result.get("settings", {})
  ids = {"shape": s.get("train_model") or s.get("shape") or "",
         "backend": s.get("backend", ""), "routing": s.get("routing", ""),
         "direction": "train_step" if s.get("train_model") else s.get("direction", ""),
         "ep": _ep_of(s.get("mesh"))}
  for i, (device, table) in enumerate(sorted(result.get("devices", {}).items())):
    yield from _kernel_rows(table, device.rsplit("/", 1)[-1], ids, kernels=(i == 0))


def _tune(result: dict):
  """The tuner's summary (best vs default), its candidate counts and one row per
  timed or failed candidate; rejected and skipped candidates are only counted."""
  p = result.get("problem", {})
  ids = {"shape": result.get("shape_name", ""), "backend": result.get("backend", ""),
         "direction": p.get("direction", ""), "ep": p.get("ep", "")}
  spread = result.get("spread", {})
  best = (result.get("best") or {}).get("label", "")
  yield _row("best_ms", spread.get("best_ms", ""), best, **ids)
  yield _row("default_ms", spread.get("default_ms", ""), result.get("default", ""), **ids)
  for k in ("default_over_best", "saved_ms"):
    if k in spread:
      yield _row(k, spread[k], **ids)
  yield _row("elapsed_s", result.get("elapsed_s", ""), f"key {result.get('key', '')}", **ids)
  for k, v in result.get("counts", {}).items():
    yield _row(f"count_{k}", v, **ids)
  yield _row("transfer_consistent", result.get("transfer_consistent", ""), **ids)
  for t in result.get("trials", []):
    label = _join(t.get("label", ""), t.get("stage", ""))
    if t.get("status") == "ok":
      yield _row("trial_median_ms", t.get("median_ms", ""), _join(
          label, "bitwise_equal_to_reference="
          f"{t.get('bitwise_equal_to_reference')}"), **ids)
    elif t.get("status") != "skipped" and t.get("error"):
      yield _row("trial_error", "", _join(label, t.get("status"), t["error"]), **ids)


FAMILIES = {
    "grouped_gemm": _grouped_gemm,
    "check_moe_gpu": _check,
    "determinism_sweep": _determinism_sweep,
    "train_step_diff": _train_step_diff,
    "profile_layer": _profile_layer,
    "tune": _tune,
}


# --- logs ---------------------------------------------------------------------

def json_twin(log: Path) -> Path | None:
  """`X.json` beside `X.log` or `X.bench.log`, if there is one."""
  stem = log.name[:-len(".log")]
  for name in (stem + ".json", stem.removesuffix(".bench") + ".json"):
    if (log.parent / name).exists():
      return log.parent / name
  return None


def log_rows(path: Path) -> list[dict]:
  """One row for a log: its run header if it printed one, its first meaningful
  line (a leading `# ...` comment, else the first line that is not the
  GPU / jax listing) as note."""
  head, note, verdicts = {}, "", {"PASS": 0, "FAIL": 0}
  with open(path, errors="replace") as f:
    for line in f:
      line = line.strip()
      if line.split(" ", 1)[0] in verdicts:
        verdicts[line.split(" ", 1)[0]] += 1
      if not line:
        continue
      if line.startswith("{'device_kind'") and not head:
        try:
          head = ast.literal_eval(line)
        except (ValueError, SyntaxError):
          pass
        continue
      if not note and not re.match(r"(GPU \d+:|jax \d)", line):
        note = line.lstrip("# ").strip()
  note = note if len(note) <= 300 else note[:297] + "..."
  if any(verdicts.values()):
    note = _join(note, f"{verdicts['PASS']} PASS / {verdicts['FAIL']} FAIL lines")
  row = {c: "" for c in COLUMNS}
  row.update(benchmark=benchmark_of(path.name), source=path.name, **_header(head))
  row.update(_row("log", "", note))
  return [{c: _cell(row[c]) for c in COLUMNS}]


# --- the CSV --------------------------------------------------------------------

def _file_rows(path: Path) -> list[dict]:
  if path.suffix == ".log":
    return log_rows(path)
  with open(path) as f:
    return rows(json.load(f), path.name)


def read_history(path: Path = HISTORY) -> list[dict]:
  if not path.exists():
    return []
  with open(path, newline="") as f:
    return list(csv.DictReader(f))


def write_history(all_rows: list[dict], path: Path = HISTORY) -> None:
  tmp = path.with_suffix(".csv.tmp")
  with open(tmp, "w", newline="") as f:
    w = csv.DictWriter(f, fieldnames=COLUMNS)
    w.writeheader()
    w.writerows(all_rows)
  os.replace(tmp, path)


def add(paths: list[Path], history: Path = HISTORY) -> int:
  """Append the rows of files whose name is not yet a source; returns rows added."""
  seen = {r["source"] for r in read_history(history)}
  new = []
  for p in paths:
    if p.name in seen:
      print(f"skip {p.name}: already in {history.name}")
      continue
    seen.add(p.name)
    new += _file_rows(p)
  fresh = not history.exists()
  with open(history, "a", newline="") as f:
    w = csv.DictWriter(f, fieldnames=COLUMNS)
    if fresh:
      w.writeheader()
    w.writerows(new)
  return len(new)


def result_files(root: Path = RESULTS) -> list[Path]:
  """Every JSON under root, and every log without a JSON twin."""
  jsons = sorted(root.rglob("*.json"))
  logs = sorted(p for p in root.rglob("*.log") if json_twin(p) is None)
  return sorted(jsons + logs, key=lambda p: str(p.relative_to(root)))


def rebuild(root: Path = RESULTS, history: Path = HISTORY) -> int:
  """Rewrite the history from the files under root, keeping the rows of
  sources that are gone from disk; returns the number of rows."""
  files = result_files(root)
  on_disk = {p.name for p in files}
  kept = [r for r in read_history(history) if r["source"] not in on_disk]
  fresh = [r for p in files for r in _file_rows(p)]
  all_rows = sorted(kept + fresh, key=lambda r: r["source"])
  write_history(all_rows, history)
  return len(all_rows)


def main(argv: list[str]) -> int:
  if argv[:1] == ["add"] and len(argv) > 1:
    n = add([Path(a) for a in argv[1:]])
    print(f"added {n} rows to {HISTORY}")
  elif argv == ["rebuild"]:
    n = rebuild()
    print(f"wrote {n} rows to {HISTORY}")
  else:
    print(__doc__)
    return 2
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
