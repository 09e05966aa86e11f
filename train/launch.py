"""Launch a multi-process run on this machine: `python -m train.launch --processes 2 -- <train flags>`.

Starts N copies of `python -m <module>` (default `train`), each with
`--coordinator 127.0.0.1:<free port> --num-processes N --process-id i` appended, so
they meet through jax.distributed on loopback; each gets mesh size / N virtual CPU
devices (the CLI derives it; pass `--local-devices` through to override). Their
stdout and stderr lines are printed with a `[pI]` prefix (and copied to
`--log-dir/process_I.log` if given). On GPUs, `--devices-per-process 1` gives
process i GPU i (JAX_LOCAL_DEVICE_IDS, which `jax.distributed.initialize` reads). Exits with 0 when all exit 0; as soon as one fails
(or `--timeout` passes), the others are killed and the launcher exits with that code.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Optional, Sequence, TextIO


def free_port() -> int:
  """A TCP port that is free on loopback now (the coordinator binds it moments later)."""
  with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
    s.bind(("127.0.0.1", 0))
    return s.getsockname()[1]


def _pump(stream: TextIO, prefix: str, out: TextIO, log: Optional[TextIO], lock: threading.Lock) -> None:
  for line in stream:  # text mode: "\r" (tqdm) also ends a line
    line = line.rstrip("\n")
    with lock:
      out.write(f"{prefix}{line}\n")
      out.flush()
      if log is not None:
        log.write(line + "\n")
        log.flush()
  stream.close()


def _dump_stacks(procs: list[subprocess.Popen], wait_s: float = 3.0) -> None:
  """SIGUSR1 to each live process: `train.distributed.initialize` made that print every
  thread's Python stack (faulthandler) so a timeout's log says where each process was."""
  for p in procs:
    if p.poll() is None:
      try:
        os.kill(p.pid, signal.SIGUSR1)
      except ProcessLookupError:
        pass
  time.sleep(wait_s)


def _kill(procs: list[subprocess.Popen], grace_s: float = 5.0) -> None:
  """SIGTERM the process groups we started that still run, then SIGKILL after `grace_s`
  (a jax process catches SIGTERM: its preemption notifier logs it and runs on)."""
  live = [p for p in procs if p.poll() is None]
  for p in live:
    try:
      os.killpg(p.pid, signal.SIGTERM)
    except ProcessLookupError:
      pass
  deadline = time.monotonic() + grace_s
  for p in live:
    try:
      p.wait(timeout=max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
      try:
        os.killpg(p.pid, signal.SIGKILL)
      except ProcessLookupError:
        pass
      p.wait()


def launch(processes: int, args: Sequence[str], *, module: str = "train", port: Optional[int] = None,
           log_dir: Optional[str] = None, timeout: Optional[float] = None,
           devices_per_process: Optional[int] = None, env: Optional[dict] = None) -> int:
  """Run `processes` copies of `python -m module args...` as one jax.distributed group; returns the exit code."""
  if processes < 1:
    raise ValueError(f"processes={processes} must be >= 1")
  coordinator = f"127.0.0.1:{port or free_port()}"
  env = dict(os.environ if env is None else env)
  # each process sizes its own virtual device pool from the mesh and --num-processes
  env["XLA_FLAGS"] = " ".join(f for f in env.get("XLA_FLAGS", "").split()
                              if not f.startswith("--xla_force_host_platform_device_count"))
  for k in ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"):
    env.pop(k, None)  # the flags below name the group
  env.setdefault("PYTHONUNBUFFERED", "1")
  if log_dir:
    os.makedirs(log_dir, exist_ok=True)
  lock = threading.Lock()
  procs, pumps, logs = [], [], []
  try:
    for i in range(processes):
      cmd = [sys.executable, "-m", module, *args, "--coordinator", coordinator,
             "--num-processes", str(processes), "--process-id", str(i)]
      penv = dict(env)
      if devices_per_process:  # GPUs: process i owns local devices [i*K, (i+1)*K) (read by jax.distributed)
        penv["JAX_LOCAL_DEVICE_IDS"] = ",".join(
            str(d) for d in range(i * devices_per_process, (i + 1) * devices_per_process))
      p = subprocess.Popen(cmd, env=penv, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                           text=True, bufsize=1, start_new_session=True)
      procs.append(p)
      log = open(os.path.join(log_dir, f"process_{i}.log"), "w") if log_dir else None
      logs.append(log)
      for stream, out in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
        t = threading.Thread(target=_pump, args=(stream, f"[p{i}] ", out, log, lock), daemon=True)
        t.start()
        pumps.append(t)
    print(f"[launch] {processes} processes of `python -m {module}`, coordinator {coordinator}",
          file=sys.stderr, flush=True)
    deadline = None if timeout is None else time.monotonic() + timeout
    rc = 0
    while True:
      codes = [p.poll() for p in procs]
      failed = [(i, c) for i, c in enumerate(codes) if c not in (None, 0)]
      if failed:
        i, rc = failed[0]
        print(f"[launch] process {i} exited with {rc}; stopping the others", file=sys.stderr, flush=True)
        break
      if all(c == 0 for c in codes):
        break
      if deadline is not None and time.monotonic() > deadline:
        print(f"[launch] timeout after {timeout} s; their stacks (SIGUSR1), then stopping all processes",
              file=sys.stderr, flush=True)
        _dump_stacks(procs)
        rc = 124
        break
      time.sleep(0.1)
  finally:
    _kill(procs)  # only on failure, timeout or interrupt: otherwise all have exited
    for t in pumps:
      t.join(timeout=5)
    for log in logs:
      if log is not None:
        log.close()
  return rc


def main(argv: Optional[Sequence[str]] = None) -> None:
  argv = list(sys.argv[1:] if argv is None else argv)
  rest: list[str] = []
  if "--" in argv:
    i = argv.index("--")
    argv, rest = argv[:i], argv[i + 1:]
  p = argparse.ArgumentParser(
      prog="python -m train.launch",
      description="Run a training (or any `--module` taking the multi-process flags) as several "
                  "jax.distributed processes on this machine: launch [flags] -- <module flags>")
  p.add_argument("--processes", type=int, required=True, help="number of processes")
  p.add_argument("--module", default="train", help="python -m MODULE to run (default %(default)s)")
  p.add_argument("--port", type=int, default=None, help="coordinator port on 127.0.0.1 (default: a free one)")
  p.add_argument("--log-dir", default=None, help="also write process_I.log files here")
  p.add_argument("--timeout", type=float, default=None, help="kill all after this many seconds (exit 124)")
  p.add_argument("--devices-per-process", type=int, default=None,
                 help="GPUs: give process i the local devices i*K..i*K+K-1 (JAX_LOCAL_DEVICE_IDS); "
                      "default: every process sees all (CPU: each makes mesh size / N virtual devices)")
  ns = p.parse_args(argv)
  if ns.processes < 1:
    p.error(f"--processes={ns.processes} must be >= 1")
  sys.exit(launch(ns.processes, rest, module=ns.module, port=ns.port, log_dir=ns.log_dir,
                  timeout=ns.timeout, devices_per_process=ns.devices_per_process))


if __name__ == "__main__":
  main()
