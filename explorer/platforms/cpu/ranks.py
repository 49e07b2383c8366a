"""How a CPU rank process is set up: pinned to cores of its own, freed memory held for reuse.

Both settings change how fast ranks run, so measurements of the host are kept apart per setting
(:func:`rank_settings_tag`). Each can be turned off with an environment variable
(``EXPLORER_PIN=0``, ``EXPLORER_MALLOC=0``).
"""

from __future__ import annotations

import ctypes
import os
import platform


def pinning() -> bool:
    """Whether CPU ranks are pinned to cores: on hosts that can (Linux), unless the
    environment variable ``EXPLORER_PIN`` is ``0``."""
    return os.environ.get("EXPLORER_PIN", "1") != "0" and hasattr(os, "sched_setaffinity")


def pin_cpu_rank(local_rank: int, threads: int = 1) -> tuple[int, ...] | None:
    """Pin the calling thread, and the threads it starts later (gloo's and torch's among
    them), to cores of their own among those this process may use: ``threads`` of them
    (one per compute thread), the ``local_rank``-th such block, round robin. Returns the
    cores, or None where ranks are not pinned (:func:`pinning`) or the host refused.

    Unpinned, two CPU ranks and their communication threads move between the cores and
    evict each other's caches, and a message sent before its receive was posted
    (``Link.late_receive_s``) waits longer for the receiving communication thread to be
    scheduled; micro-batched pipelines gain most (``python benchmarks/rank_settings.py``
    measures it; see docs/accuracy.md).
    """
    if not pinning():
        return None
    try:
        cores = sorted(os.sched_getaffinity(0))
        k = max(1, min(threads, len(cores)))
        mine = sorted({cores[(local_rank * k + i) % len(cores)] for i in range(k)})
        os.sched_setaffinity(0, mine)
    except (OSError, IndexError):
        return None
    return tuple(mine)


#: glibc's ``mallopt`` parameters (``malloc.h``)
M_TRIM_THRESHOLD = -1
M_MMAP_THRESHOLD = -3
#: the largest mmap threshold glibc accepts on 64-bit hosts (4 MiB x ``sizeof(long)``)
MMAP_THRESHOLD_BYTES = 32 * 2**20
#: free memory at the top of the heap kept rather than given back (``mallopt`` takes an int)
TRIM_THRESHOLD_BYTES = 2**31 - 1


def holding_memory() -> bool:
    """Whether rank processes keep the memory they free for their next step
    (:func:`hold_freed_memory`): on glibc hosts, unless ``EXPLORER_MALLOC`` is ``0``."""
    return os.environ.get("EXPLORER_MALLOC", "1") != "0" and platform.libc_ver()[0] == "glibc"


def hold_freed_memory() -> bool:
    """Make glibc's allocator keep the memory this process frees, for the next step to reuse,
    instead of handing it back to the kernel and faulting it in again page by page. Returns
    whether it did (False where :func:`holding_memory` is off or the allocator refused).

    A training step on CPU allocates and frees the same large tensors every step
    (activations, gradients, the optimizer's temporaries). By default glibc serves blocks
    from a few hundred KiB up with ``mmap`` (a threshold it raises as it sees them freed)
    and trims the heap's free top beyond twice that threshold, so which of a step's tensors
    come back as fresh pages depends on the order of the process's earlier allocations, and
    the same optimizer step can take half as long again in one process as in another. Blocks
    up to 32 MiB (:data:`MMAP_THRESHOLD_BYTES`, glibc's limit) now come from the heap, and the
    heap keeps up to 2 GiB of free top: what a rank holds is its peak, as on a GPU with
    PyTorch's caching allocator. ``python benchmarks/rank_settings.py --setting malloc``
    measures the effect (see docs/accuracy.md).
    """
    if not holding_memory():
        return False
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    mallopt.restype = ctypes.c_int
    return bool(mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES)
                and mallopt(M_TRIM_THRESHOLD, TRIM_THRESHOLD_BYTES))


def rank_settings_tag() -> str:
    """What the CPU ranks' process settings are (pinned, freed memory held), as a cache key
    suffix: ranks set up differently run at different speeds, so they are measured apart."""
    return ("-pinned" if pinning() else "") + ("-held" if holding_memory() else "")
