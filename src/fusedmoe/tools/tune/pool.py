"""The warm pool: spawned processes compile the candidates into Triton's on-disk cache, most
urgent first, while the main process times earlier steps (``run``)."""

from __future__ import annotations

import heapq
import multiprocessing
import signal
import threading
import time

import torch

from .probe import Warmed, warm


def _worker_init() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C (or the suite's timeout) is the main process's to handle
    torch.set_num_threads(1)


class WarmPool:
    """Compile jobs keyed by specialisation, lowest priority tuple first, in spawned processes.

    ``sync`` sets the whole queue (jobs started or done stay); at most ``workers`` jobs are
    handed to the pool and the next is picked when one finishes (in the pool's result thread),
    so later, more urgent jobs overtake and withdrawn ones never start. ``workers=0`` runs a
    job in the calling process when it is waited for (no compile under the interpreter; the
    specialisation is still checked).
    """

    def __init__(self, workers: int) -> None:
        self.workers = workers
        self._cv = threading.Condition()
        self._queued: dict = {}  # key -> (priority, job)
        self._heap: list = []
        self._state: dict = {}  # key -> "running" | Warmed
        self._running = 0
        self._closing = False
        ctx = multiprocessing.get_context("spawn")
        self._pool = ctx.Pool(workers, initializer=_worker_init) if workers > 0 else None

    def sync(self, want: dict) -> None:
        """Queue exactly ``want`` ({key: (priority, job)}) besides what started already."""
        with self._cv:
            self._queued = {k: pj for k, pj in want.items() if k not in self._state}
            self._heap = [(p, i, k) for i, (k, (p, _)) in enumerate(self._queued.items())]
            heapq.heapify(self._heap)
            self._dispatch()

    def _dispatch(self) -> None:
        while self._pool is not None and not self._closing and self._heap and self._running < self.workers:
            _, _, key = heapq.heappop(self._heap)
            if key in self._queued:
                self._state[key] = "running"
                self._running += 1
                job = self._queued.pop(key)[1]
                self._pool.apply_async(
                    warm, (job, key), callback=self._done, error_callback=lambda e, k=key: self._lost(k, e)
                )

    def _done(self, res: Warmed) -> None:
        with self._cv:
            self._state[res.key] = res
            self._running -= 1
            self._dispatch()
            self._cv.notify_all()

    def _lost(self, key, exc) -> None:
        self._done(Warmed(key, None, 0.0, f"worker: {type(exc).__name__}: {exc}"[:400], lost=True))

    def result(self, key) -> Warmed | None:
        r = self._state.get(key)
        return r if isinstance(r, Warmed) else None

    def wait_any(self, keys: list, timeout: float):
        """The first of ``keys`` (in order) that is warm, waiting up to ``timeout`` s; None if none."""
        if self._pool is None:
            for k in keys[:1]:
                if self.result(k) is None:
                    job = self._queued.pop(k, (None, None))[1]
                    self._state[k] = warm(job, k) if job else Warmed(k, None, 0.0, "not queued", lost=True)
                return k
            return None
        end = time.monotonic() + max(0.0, timeout)
        with self._cv:
            while True:
                for k in keys:
                    if self.result(k) is not None:
                        return k
                if time.monotonic() >= end:
                    return None
                self._cv.wait(min(end - time.monotonic(), 30.0))  # Condition.wait overflows on inf

    def stats(self) -> tuple[int, float]:
        """(jobs finished, their total worker seconds)."""
        done = [r for r in list(self._state.values()) if isinstance(r, Warmed)]
        return len(done), sum(r.seconds for r in done)

    def close(self) -> None:
        with self._cv:
            self._closing = True
        if self._pool is not None:
            self._pool.terminate()
            self._pool.join()
