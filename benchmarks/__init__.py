"""autopar's benchmarks: ``python -m benchmarks --help`` lists them (`benchmarks.__main__`).

Investigation scripts behind past cost-model and runtime work live in
`benchmarks.investigations` (its README.md lists them).
"""
