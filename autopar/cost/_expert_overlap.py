"""An expert-parallel grouped GEMM in token chunks: all-to-all beside compute.

In: plain seconds of one chunk's dispatch all-to-all, grouped GEMM and combine
all-to-all, the number of chunks, and the share of a collective's time the backend runs
beside compute (`collective_concurrency`, the cluster's backend). Out: seconds of the
whole exchange.

Split the routed rows a device holds into `num_chunks` chunks and each chunk is its own
dispatch → grouped GEMM → combine. With one link stream and one compute stream, chunk 2
is dispatched while chunk 1 computes and chunk 1's results return while chunk 2
computes: DeepSeek-V3's dual micro-batch overlap (DeepSeek-AI 2024, arXiv 2412.19437,
sec. 3.2.1: two micro-batches, one's all-to-all under the other's compute) and
Megatron-Core's "Combined 1F1B" (``--overlap-moe-expert-parallel-comm``: one
micro-batch's dispatch/combine all-to-all under an adjacent micro-batch's forward or
backward; docs.nvidia.com/megatron-core, user guide, "Combined 1F1B: Expert-Parallel
All-to-All Overlap"), applied inside one grouped GEMM. The price of the split is in the
chunk times: each chunk pays its own collective latency and kernel launch.

What the backend hides (`autopar.cost.backends.Backend.collective_concurrency`): XLA:GPU
runs NCCL on its own stream (the profile's `overlap` share of its time hidden);
XLA:CPU runs a collective on the device's own thread, so the chunks run one after the
other and the split only adds latency.
"""

from __future__ import annotations

# The chunks an overlapped grouped GEMM splits its rows into: two, DeepSeek-V3's two
# micro-batches (sec. 3.2.1); more chunks hide more of the first dispatch and the last
# combine but pay a collective latency each.
OVERLAP_CHUNKS = 2


def pipelined_exchange_time(dispatch: float, compute: float, combine: float,
                            num_chunks: int) -> float:
    """Seconds of `num_chunks` chunks of (dispatch, compute, combine) seconds each when
    every collective runs beside compute: one link issuing the dispatches in chunk order,
    then each combine once its chunk's compute is done; one compute stream running each
    chunk once its dispatch arrived.

    **Example:** 2 chunks of 1 ms dispatch, 3 ms compute, 1 ms combine: the link sends
    both dispatches by 2 ms, chunk 1 computes 1–4 ms, chunk 2 4–7 ms, chunk 1's combine
    4–5 ms, chunk 2's 7–8 ms: 8 ms against 10 ms in series.
    """
    _check_seconds(dispatch=dispatch, compute=compute, combine=combine)
    if not isinstance(num_chunks, int) or num_chunks < 1:
        raise ValueError(f"num_chunks must be a positive int, got {num_chunks!r}")
    link = 0.0
    arrived = []
    for _ in range(num_chunks):
        link += dispatch
        arrived.append(link)
    stream = 0.0
    for ready in arrived:
        stream = max(stream, ready) + compute
        link = max(link, stream) + combine  # each combine after its chunk's compute
    return max(link, stream)


def chunked_exchange_time(dispatch: float, compute: float, combine: float,
                          num_chunks: int, concurrency: float) -> float:
    """Seconds of an expert-parallel grouped GEMM run in `num_chunks` chunks of
    (dispatch, compute, combine) seconds each (module docstring).

    ``S − concurrency · (S − P)``: S the chunks in series, P `pipelined_exchange_time`,
    `concurrency` the share of a collective's time the backend runs beside compute
    (`Backend.collective_concurrency`, in [0, 1]).

    **Example:** the chunks of `pipelined_exchange_time`'s example on a backend that
    hides 80%: ``10 − 0.8 · (10 − 8)`` = 8.4 ms; on XLA:CPU (0): 10 ms, the chunks in
    series.
    """
    if not 0 <= concurrency <= 1:
        raise ValueError(f"concurrency must be in [0, 1], got {concurrency}")
    serial = num_chunks * (dispatch + compute + combine)
    pipelined = pipelined_exchange_time(dispatch, compute, combine, num_chunks)
    return serial - concurrency * (serial - pipelined)


def _check_seconds(**seconds: float) -> None:
    bad = {k: v for k, v in seconds.items() if not v >= 0}
    if bad:
        raise ValueError(f"seconds must be >= 0, got {bad}")
