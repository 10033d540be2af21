"""A sharding ILP worker of `autopar.intra._pool.SolverPool`: `serve` solves each problem
read from stdin and writes the outcome to stdout. The pool starts it with only the
solver's modules imported (`autopar.intra._pool._BOOTSTRAP`); ``python -m
autopar.intra._pool_worker`` runs one with the whole package."""

from __future__ import annotations

import os
import pickle
import signal
import sys

from autopar.intra._pool import _read_frame, _write_frame


def serve() -> None:
    """A worker: solve each problem read from stdin, write the outcome to stdout."""
    from autopar.intra._ilp import solve

    # Ctrl-C reaches the whole process group: the caller stops, and closing its end of
    # the channel ends this loop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    channel_in = os.fdopen(os.dup(0), "rb")
    channel_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)  # anything a solver prints goes to stderr, not into the channel
    sys.stdout = sys.stderr
    while True:
        payload = _read_frame(channel_in)
        if payload is None:
            return
        problem, solve_args = pickle.loads(payload)
        try:
            outcome = ("return", solve(problem, **solve_args))
        except Exception as err:  # handed back to the caller, raised there
            outcome = ("raise", err)
        try:
            answer = pickle.dumps(outcome, protocol=pickle.HIGHEST_PROTOCOL)
        except Exception:  # an exception that does not pickle: its text
            err = outcome[1]
            answer = pickle.dumps(("raise", RuntimeError(f"{type(err).__name__}: {err}")))
        _write_frame(channel_out, answer)


if __name__ == "__main__":
    serve()
