"""Compiling programs on background threads while the training thread goes on.

XLA's compiler releases the GIL, so a program compiles beside the training thread: the
state's creation beside the first step's program, and the sizes of fused groups a schedule
will ask for while the first groups run. Only compiling happens there: tracing and
lowering (Python running the model) stay on the thread that asked, as do the cache and
the reports of compiled programs.
"""

from __future__ import annotations

import concurrent.futures
import os
import threading
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")

THREAD_NAME = "loopax-compile"  # the workers' name prefix (tests tell the threads apart by it)

_pool: concurrent.futures.ThreadPoolExecutor | None = None
_lock = threading.Lock()


def _workers() -> int:
    # A core for the training thread, the others for compiling: the training thread waits
    # for the programs it needs next, so a worker more than the cores left only competes.
    # More than 4 rarely have work (log2(K) sizes and the state's creation).
    return max(1, min(4, (os.cpu_count() or 2) - 1))


def submit(job: Callable[[], T]) -> concurrent.futures.Future[T]:
    """Runs `job()` on a worker thread (shared by the process's trainers); its future."""
    global _pool
    with _lock:
        if _pool is None:
            _pool = concurrent.futures.ThreadPoolExecutor(_workers(), THREAD_NAME)
        return _pool.submit(job)
