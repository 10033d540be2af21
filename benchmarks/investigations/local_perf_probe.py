"""Where a local plan's CPU goes, by XLA kernel: `perf` samples attributed to the fusions
of XLA:CPU's compiled programs (issue 14).

Each plan runs in a child process pinned to one core (``taskset -c 0``: no core idles, so
CPU is the work), with XLA's dumps on (``--xla_dump_to``: one object file per compiled
kernel). Once it is warm, ``perf record`` samples it; the samples that fall in code XLA
compiled at run time (`perf` names it ``[JIT]`` or a ``perf-PID.map``, without symbols)
are attributed to a kernel by matching the machine code at the sampled address, read from
the live process (``/proc/PID/mem``), against the dumped object files. Printed per plan:
its CPU per step, the shares by library, and the run-time compiled kernels by kind and
the largest ones, each in % of the samples and ms per step.

Session 23 (2026-11-28): Megatron dp4 tp2 spent 41% of its samples in XLA-compiled loops
against 20% for dp8, the difference in ``copy_bitcast_fusion`` (22.6% against 4.3%): the
copies of each layer's residual gradient for its weight gradient, which recompute the
gradient from every later layer's dot results (XLA:CPU's `layout_copies`,
`autopar.cost.backends`). The 4-stage pipeline's extra went to the Python runtime
(10.8% of its samples), Eigen's thread pool looking for work (8.7% against 1.9%) and
``malloc`` (`task_device_overhead`).

Needs ``perf`` (Linux perf_events, ``kernel.perf_event_paranoid`` <= 2 for one's own
processes) and ``taskset``. Usage:
``python benchmarks/investigations/local_perf_probe.py [--plan NAME ...] [--seconds S]``
(about 1 minute per plan).
"""

from __future__ import annotations

import argparse
import collections
import glob
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))
PLANS = ("megatron dp8 tp1 pp1", "megatron dp4 tp2 pp1", "auto 4 stages")


def child(name: str, folder: str) -> None:
    """Plan `name`, warm it up, say so (``ready``), then step until killed, appending each
    step's CPU seconds to ``steps``."""
    os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=8")
    sys.path.insert(0, os.path.dirname(os.path.dirname(HERE)))
    sys.path.insert(0, os.path.dirname(HERE))  # benchmarks/
    from bench_local import _cluster, _gpt_arrays, _Timer, local_plans

    step, state, batch = _gpt_arrays("small-test", 16)
    plan = local_plans(step, (state, batch), _cluster("cpu-local-measured"))[name]()
    timer = _Timer(step, state, batch, plan)
    for _ in range(3):
        timer._step()
    with open(os.path.join(folder, "ready"), "w") as handle:
        handle.write("1")
    with open(os.path.join(folder, "steps"), "a") as handle:
        while True:
            start = time.process_time()
            timer._step()
            handle.write(f"{time.process_time() - start}\n")
            handle.flush()


def probe(name: str, seconds: float) -> None:
    with tempfile.TemporaryDirectory() as folder:
        dump = os.path.join(folder, "dump")
        env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8 "
                   f"--xla_dump_to={dump}")
        proc = subprocess.Popen(["taskset", "-c", "0", sys.executable, __file__, "--child",
                                 name, folder], env=env, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL)
        try:
            while not os.path.exists(os.path.join(folder, "ready")):
                if proc.poll() is not None:
                    raise SystemExit(f"{name}: the child process ended (rc {proc.returncode})")
                time.sleep(0.5)
            data = os.path.join(folder, "perf.data")
            subprocess.run(["perf", "record", "-q", "-F", "1999", "-p", str(proc.pid), "-o",
                            data, "--", "sleep", str(seconds)], check=True,
                           stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            script = subprocess.run(["perf", "script", "-i", data, "-F", "ip,sym,dso"],
                                    check=True, capture_output=True, text=True).stdout
            samples = [_sample(line) for line in script.splitlines() if line.strip()]
            kernels = _attribute(proc.pid, samples, dump)
        finally:
            proc.kill()
            proc.wait()
        with open(os.path.join(folder, "steps")) as handle:
            steps = [float(x) for x in handle.read().split()]
    _report(name, samples, kernels, statistics.median(steps) * 1e3)


def _sample(line: str) -> tuple[str, str, str]:
    """(address, symbol, library) of a ``perf script -F ip,sym,dso`` line."""
    ip, _, rest = line.strip().partition(" ")
    symbol, _, dso = rest.rpartition(" (")
    return ip, symbol.strip(), dso.rstrip(")")


def _attribute(pid: int, samples, dump: str) -> collections.Counter:
    """Samples per XLA kernel, for the samples in run-time compiled code: the 32 bytes at
    each sampled address matched (12-16 byte windows) against the dumped object files."""
    objects = {_kernel_name(f): open(f, "rb").read()
               for f in glob.glob(os.path.join(dump, "*.o"))}
    jit = collections.Counter(ip for ip, _, dso in samples if _is_jit(dso))
    found: collections.Counter = collections.Counter()
    with open(f"/proc/{pid}/mem", "rb") as memory:
        for ip, count in jit.items():
            try:
                memory.seek(int(ip, 16))
                code = memory.read(32)
            except (OSError, ValueError):
                found["(unreadable)"] += count
                continue
            names = _match(code, objects)
            for kernel in names or ["(unmatched)"]:
                found[kernel] += count / max(1, len(names))
    return found


def _kernel_name(path: str) -> str:
    """A dumped kernel's fusion name, from its object file's name
    (``...obj-file.copy_bitcast_fusion.32_kernel_module.o`` or
    ``...obj-file.__compute_module_copy_add_fusion.3.o``)."""
    name = re.sub(r".*obj-file\.", "", os.path.basename(path))
    name = re.sub(r"^__compute_module_", "", name)
    return re.sub(r"(_kernel_module)?\.o$", "", name)


def _match(code: bytes, objects: dict[str, bytes]) -> list[str]:
    for width in (16, 12):
        for offset in range(0, len(code) - width + 1, 2):
            hits = [k for k, text in objects.items() if code[offset:offset + width] in text]
            if 1 <= len(hits) <= 4:
                return hits
    return []


def _is_jit(dso: str) -> bool:
    return "JIT" in dso or "perf-" in dso or "unknown" in dso


def _report(name: str, samples, kernels: collections.Counter, step_ms: float) -> None:
    total = len(samples)

    def line(count: float, what: str) -> str:
        return f"{100 * count / total:5.1f}%  {count / total * step_ms:6.1f} ms  {what}"

    libraries = collections.Counter(
        "run-time compiled (XLA kernels)" if _is_jit(dso) else os.path.basename(dso)
        for _, _, dso in samples)
    print(f"{name}: {step_ms:.1f} ms of CPU per step on one core, {total} samples")
    for library, count in libraries.most_common(6):
        print("  " + line(count, library))
    symbols = collections.Counter(symbol[:60] for _, symbol, dso in samples if not _is_jit(dso))
    print("  largest symbols outside XLA's kernels:")
    for symbol, count in symbols.most_common(8):
        print("    " + line(count, symbol))
    kinds: collections.Counter = collections.Counter()
    for kernel, count in kernels.items():
        kinds[re.sub(r"[._]\d+$", "", kernel)] += count
    print("  XLA kernels by kind:")
    for kind, count in kinds.most_common(8):
        print("    " + line(count, kind))
    print("  largest kernels:")
    for kernel, count in kernels.most_common(6):
        print("    " + line(count, kernel))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--plan", action="append", default=None,
                        help=f"a local plan (repeatable; default: {', '.join(PLANS)})")
    parser.add_argument("--seconds", type=float, default=8.0, help="perf record time")
    parser.add_argument("--child", nargs=2, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(*args.child)
        return
    missing = [tool for tool in ("perf", "taskset") if shutil.which(tool) is None]
    if missing:
        raise SystemExit(f"local_perf_probe needs {' and '.join(missing)} on PATH "
                         "(Linux perf_events; util-linux's taskset)")
    for name in args.plan or PLANS:
        probe(name, args.seconds)


if __name__ == "__main__":
    main()
