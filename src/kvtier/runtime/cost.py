"""The cost model of a pass's non-resident chunks: stream them, or attend them on the host.

A pass reads, per layer group, ``n`` sealed chunks that are not in the device pool. Each
can be streamed over the device⇄host link into the staging ring and attended on the
device (``Decision.STREAM``), or attended where it lies in the host pool
(``Decision.HOST``: the query goes to the host, the output and its log-sum-exp come back).
For ``k`` of them on the host, ``predict_s`` predicts the pass's time from
measured rates (``kvtier.config.PlacementRates``; ``kvtier calibrate`` measures them):

- streamed bytes ``S = (n - k) b`` take ``S / link`` on the link, overlapped with the
  device's work ``compute + S / device attention`` (prefetch runs ahead of the layers);
  where the device is the host's own CPU (not ``concurrent``) the copy is traffic on the
  one memory the compute reads, ``S / measured link`` more, however the link is throttled;
- hosted bytes ``H = k b`` take ``H / host attention``, beside the device's work where the
  host has cores of its own (``concurrent``: a GPU server), after it where the device is
  the host's own cores (a CPU-only machine).

``choose_hosted`` returns the ``k`` of least predicted time (ties: more on the host, fewer
bytes moved). Pure functions of their arguments; thread-safe.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

from kvtier.codec import CODECS, Codec
from kvtier.config import PlacementRates, TieredCacheConfig
from kvtier.kv.layout import KVLayout
from kvtier.runtime.groups import LayerGroup


def predict_s(
    rates: PlacementRates,
    streamed_nbytes: int,
    hosted_nbytes: int,
    throttle_gbps: float | None = None,
) -> float:
    """Predicted seconds of a pass that streams and host-attends these many bytes, over a
    link throttled to ``throttle_gbps`` (None: its measured rate)."""
    link_gbps = rates.link_gbps if throttle_gbps is None else min(rates.link_gbps, throttle_gbps)
    link_s = streamed_nbytes / (link_gbps * 1e9)
    device_s = rates.compute_s + streamed_nbytes / (rates.device_attention_gbps * 1e9)
    host_s = hosted_nbytes / (rates.host_attention_gbps * 1e9)
    if rates.concurrent:
        return max(link_s, device_s, host_s)
    # One memory for "device" and host: the copy itself (at the memory's own rate, however
    # the link is throttled) is traffic the compute waits behind.
    copy_s = streamed_nbytes / (rates.link_gbps * 1e9)
    return max(link_s, device_s + copy_s + host_s)


def choose_hosted(
    chunks: int, chunk_nbytes: int, rates: PlacementRates, throttle_gbps: float | None = None
) -> int:
    """How many of ``chunks`` non-resident chunks (``chunk_nbytes`` each, all the layers a
    pass reads of them) to attend on the host; the rest stream (see ``predict_s``)."""
    if chunks < 0 or chunk_nbytes < 0:
        raise ValueError(f"chunks and chunk_nbytes must be >= 0, got {chunks}, {chunk_nbytes}")
    best_k, best_s = 0, float("inf")
    for k in range(chunks + 1):
        predicted = predict_s(rates, (chunks - k) * chunk_nbytes, k * chunk_nbytes, throttle_gbps)
        if predicted <= best_s * (1 + 1e-9):
            best_k, best_s = k, predicted
    return best_k


def hosted_counter(
    config: TieredCacheConfig,
    layout: KVLayout,
    groups: Sequence[LayerGroup],
    host_codec: Codec = CODECS["raw"],
) -> Callable[[int, int], int] | None:
    """``(group, chunks) -> how many to attend on the host`` for ``config.placement``; None
    for ``stream`` (all stream). The ``auto`` answer depends only on its arguments, so it
    is computed once per (group, chunks) and kept; a ``config.link`` throttle caps the
    link rate it assumes (``predict_s``'s ``throttle_gbps``). A host pool stored in a
    lossy ``host_codec`` cannot be attended in place: ``auto`` then streams everything.

    Raises:
        ValueError: ``auto`` without ``config.rates`` (``kvtier.calibrate.resolve_rates``
            fills them from a profile first); ``host`` over a host pool in a lossy codec.
    """
    if config.placement == "host" and not host_codec.exact:
        raise ValueError(
            f"placement 'host' attends the host pool in place, which needs host codec 'raw' "
            f"(got {host_codec.name!r}); use placement 'stream' or 'auto'"
        )
    if config.placement == "stream" or not host_codec.exact:
        return None
    if config.placement == "host":
        return lambda group, chunks: chunks
    rates = config.rates
    if rates is None:
        raise ValueError("placement 'auto' needs rates: run `kvtier calibrate`, or pass rates")
    throttle = config.link.gbps
    chunk_nbytes = [group.layout(layout).chunk_nbytes for group in groups]  # all its layers

    @functools.cache
    def count(group: int, chunks: int) -> int:
        return choose_hosted(chunks, chunk_nbytes[group], rates, throttle)

    return count
