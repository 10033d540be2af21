"""What does `autopar.plan`'s microbatch-math check cost on the demo, proven statically
against checked numerically? And does the proof agree with the numeric check on the
example models?

The demo's step (``autopar demo``'s GPT, AdamW, batch 16, 2 microbatches) is checked as
`autopar.plan` checks it, with the search's microbatch graph passed in:
`microbatch_change` (the static proof, `autopar.search._batch_linearity`, which traces the
step once more at the full batch) against `numeric_change` (the step compiled at both sizes
and run). Each run is a fresh child process (nothing cached by JAX or XLA), the two paths
alternated round by round; CPU is the child's own CPU seconds. Timing on shared cores is
noisy: the load average is printed beside each round.

``--agreement`` also traces every example model's tiny config at 8 rows and checks that
where the proof holds the numeric check is silent (it compiles each model: about a
minute). The numeric check also warns on some steps whose math does not change, where a
value is near zero and float32 rounding moves it past its 1e-5 relative tolerance (a
key bias's gradient, zero in exact arithmetic; a mean of tanh near 0); those rows print
the proof's verdict beside it.

Run: ``python -m benchmarks.investigations.microbatch_check_cost [--rounds 2] [--agreement]``
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import sys, time
import optax
from autopar.app._demo import DEMO_BATCH_SIZE, DEMO_GPT, DEMO_MICROBATCHES
from autopar.app._examples import LEARNING_RATE, load_example
from autopar.graph import trace
from autopar.search._microbatch import microbatch_args
from autopar.search import _microbatch_math as mm

gpt = load_example("gpt")
cfg = gpt.GPTConfig(**DEMO_GPT)
optimizer = optax.adamw(LEARNING_RATE)
args = (gpt.abstract_state(cfg, optimizer), gpt.abstract_batch(cfg, DEMO_BATCH_SIZE))
step = gpt.make_train_step(cfg, optimizer)
micro = trace(step, *microbatch_args(args, (1,), DEMO_MICROBATCHES), batch_argnums=(1,))
check = mm.microbatch_change if sys.argv[1] == "static" else mm.numeric_change
wall, cpu = time.perf_counter(), time.process_time()
change = check(step, args, (1,), DEMO_MICROBATCHES, (micro,))
print(f"{time.perf_counter() - wall:.3f} {time.process_time() - cpu:.3f} {change is None}")
"""

EXAMPLES = (("mlp", {}), ("gpt", {}), ("gpt", {"scan_layers": True, "remat_layers": True}),
            ("llama", {}), ("llama", {"scan_layers": True, "remat_layers": True}),
            ("moe", {}), ("moe_dropless", {}), ("wide_resnet", {}))


def _load() -> str:
    return os.getloadavg().__repr__() if hasattr(os, "getloadavg") else "?"


def cost(rounds: int) -> None:
    env = {**os.environ, "PYTHONPATH": os.getcwd()}
    print("| round | load (1, 5, 15 min) | path | wall s | CPU s | silent |")
    print("|---|---|---|---|---|---|")
    for r in range(1, rounds + 1):
        for path in ("numeric", "static"):
            load = _load()
            out = subprocess.run([sys.executable, "-c", CHILD, path], env=env,
                                 capture_output=True, text=True, check=True).stdout.split()
            wall, cpu, silent = out[-3:]
            print(f"| {r} | {load} | {path} | {wall} | {cpu} | {silent} |", flush=True)


def agreement() -> None:
    import dataclasses
    import importlib

    import optax

    from autopar.graph import trace
    from autopar.search._batch_linearity import prove_microbatch_mean
    from autopar.search._microbatch import microbatch_args
    from autopar.search._microbatch_math import numeric_change

    for name, fields in EXAMPLES:
        module = importlib.import_module(f"examples.{name}")
        cfg = dataclasses.replace(module.CONFIGS["tiny"], **fields)
        optimizer = optax.adamw(1e-3)
        args = (module.abstract_state(cfg, optimizer), module.abstract_batch(cfg, 8))
        step = module.make_train_step(cfg, optimizer)
        for m in (2, 4):
            full = trace(step, *args, batch_argnums=(1,))
            micro = trace(step, *microbatch_args(args, (1,), m), batch_argnums=(1,))
            proof = prove_microbatch_mean(full, micro, m)
            change = numeric_change(step, args, (1,), m, (full, micro))
            print(f"{name} {fields or ''} m={m}: proven={proof.proven} "
                  f"numeric={'warns' if change else 'silent'}"
                  + ("" if proof.proven else f" ({proof.reason[:120]})")
                  + (f"\n    numeric: {change[:160]}" if change and proof.proven else ""),
                  flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--agreement", action="store_true")
    args = parser.parse_args()
    cost(args.rounds)
    if args.agreement:
        agreement()


if __name__ == "__main__":
    main()
