"""Bucket k + 1 gathered while bucket k is sent: an iterator run ahead on a thread of its own.

The exporter's gathers (TP, EP, the other pipeline stages' buckets) run on the trainer's process
groups; sending a bucket talks to the engine (HTTP, the weight-update group, shared memory). With
`prefetched(buckets)` rank 0 runs the exporter one bucket ahead on a worker thread while its main
thread sends: the two use different groups, so neither waits for the other. At most `depth`
buckets are held ahead (memory: one more bucket). An exception of the iterator is raised by the
consumer at the bucket where it happened; a consumer that stops early (an error) drains the
iterator to its end, because the other ranks' halves of its collectives must still be met.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator
from typing import TypeVar

import torch

T = TypeVar("T")
_DONE = object()


class _Failure:
    def __init__(self, error: BaseException) -> None:
        self.error = error


def prefetched(
    items: Iterator[T], depth: int = 1, timeout_s: float = 3600.0, device: torch.device | None = None
) -> Iterator[T]:
    """`items`, produced up to `depth` ahead on a worker thread (see the module docstring);
    `timeout_s` bounds the wait for any one item; `device`: the CUDA device the worker runs on."""
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    ready: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def produce() -> None:
        try:
            if device is not None and device.type == "cuda":
                torch.cuda.set_device(device)  # the current device is per thread
            for item in items:
                if stop.is_set():
                    continue  # drain: the collectives still run, nothing is handed over
                ready.put(item)
        except BaseException as err:  # noqa: BLE001 - handed to the consumer
            ready.put(_Failure(err))
            return
        ready.put(_DONE)

    worker = threading.Thread(target=produce, name="weight-sync-prefetch", daemon=True)
    worker.start()
    try:
        while True:
            try:
                item = ready.get(timeout=timeout_s)
            except queue.Empty:
                raise TimeoutError(f"no exported bucket within {timeout_s:.0f} s") from None
            if item is _DONE:
                return
            if isinstance(item, _Failure):
                raise item.error
            yield item
    finally:
        stop.set()
        while worker.is_alive():  # let a draining producer finish its collectives
            try:
                ready.get(timeout=0.1)
            except queue.Empty:
                pass
        worker.join()
