"""Investigation scripts: probes and experiments behind the cost model and the runtime
(README.md lists them). Run one with ``python -m benchmarks.investigations.NAME``."""
