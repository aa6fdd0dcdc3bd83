"""One OpenMP team per process: the engine thread's.

PyTorch's CPU ops, oneDNN and the native kernels (``engine.native``) run their parallel regions
on libgomp. Each thread that starts a parallel region gets a team of its own (pool threads that
live as long as that thread), and between regions those pool threads spin briefly so the next
region starts without a wake-up through the kernel. libgomp spins only while the process's
OpenMP threads do not outnumber its CPUs: a second team anywhere in the process (the thread that
loaded the model, an executor thread that ran a tensor op, an adapter loader) and it cuts the spin
to about a hundred iterations, so every one of a step's ~300 regions pays a futex wake. On 2
CPUs a 32-row bfloat16 decode step took 55 ms on the engine thread with the loading thread's team
alive, 38 ms without it.

So: the thread that loads a model gives its team back when it is done (:func:`release_team`),
the thread that starts the engine does too, and helper threads that may touch tensors run their
ops on themselves alone (:func:`single_threaded`, a thread-pool initializer), never forming a
team. The engine thread keeps the process's thread count (``torch.set_num_threads``).

Where libgomp is not the runtime (another OS, a torch built with another OpenMP), these are
no-ops.
"""

from __future__ import annotations

import ctypes
import logging
from functools import lru_cache
from pathlib import Path

import torch

log = logging.getLogger("loraplex.engine.threads")

_OMP_PAUSE_SOFT = 1


@lru_cache(maxsize=1)
def _gomp() -> ctypes.CDLL | None:
    """The libgomp this process already runs (torch's copy), never a second one."""
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        return None
    path = next((ln.split()[-1] for ln in maps.splitlines() if "/libgomp" in ln), None)
    if path is None:
        return None
    try:
        lib = ctypes.CDLL(path)
        lib.omp_pause_resource_all.argtypes = [ctypes.c_int]
        lib.omp_pause_resource_all.restype = ctypes.c_int
        lib.omp_set_num_threads.argtypes = [ctypes.c_int]
        lib.omp_set_num_threads.restype = None
        lib.omp_get_max_threads.argtypes = []
        lib.omp_get_max_threads.restype = ctypes.c_int
    except (OSError, AttributeError) as e:
        log.debug("libgomp at %s not usable: %s", path, e)
        return None
    return lib


def release_team() -> bool:
    """Let the calling thread's OpenMP pool threads exit (a later parallel op on this thread
    forms a new team). True when there was a libgomp to ask."""
    lib = _gomp()
    if lib is None:
        return False
    return lib.omp_pause_resource_all(_OMP_PAUSE_SOFT) == 0


def single_threaded() -> None:
    """Tensor ops on the calling thread run on it alone from now on: no team is formed (and one
    it had is given back). For helper threads (``ThreadPoolExecutor(initializer=...)``); the
    process-wide default other threads start with is left alone."""
    torch.get_num_threads()  # torch sets this thread's count from the process default first
    lib = _gomp()
    if lib is None:
        return
    lib.omp_set_num_threads(1)
    release_team()

