"""How many bytes the KV pool gets when the operator does not say (``kv_cache_bytes`` = 0).

The pool is where running sequences keep their K/V and where the prefix cache keeps finished
ones, so too small a pool costs twice: requests queue for blocks, and cached prompts are
evicted before they are asked for again. At the old fixed 256 MiB a 2-core worker held fifteen
384-token float32 sequences, so 32 clients queued; at vLLM-CPU's 4 GiB the same build served
1.6x the tokens per second with an 8x lower median time to first token.

As vLLM does, the default is a share of the memory there is once the weights are loaded:
``CPU_SHARE`` of the memory the kernel reports available (and the cgroup allows), at most
``CPU_CAP``, on CPU; ``CUDA_SHARE`` of the device's free memory on CUDA. The start-up line says
what was chosen and why. CPU pools are mapped lazily (``KVCache``), so a large pool costs
resident memory only as its blocks are first used.
"""

from __future__ import annotations

from pathlib import Path

import torch

CPU_SHARE = 0.4
CPU_CAP = 4 * 1024**3
"""vLLM-CPU's KV space; more would rarely be used by one CPU worker's batch and cache."""
CPU_FLOOR = 64 * 1024**2
CUDA_SHARE = 0.8
MiB = 1024**2


def _meminfo_available() -> int:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return 0


def _cgroup_room() -> int | None:
    """Bytes this process's cgroup (v2) may still take, or ``None`` without a limit."""
    base = Path("/sys/fs/cgroup")
    try:
        limit = (base / "memory.max").read_text().strip()
        if limit == "max":
            return None
        return max(0, int(limit) - int((base / "memory.current").read_text()))
    except (OSError, ValueError):
        return None


def available_memory() -> int:
    """Host memory this process could still use: the kernel's estimate, within the cgroup's limit."""
    avail = _meminfo_available()
    room = _cgroup_room()
    return min(avail, room) if room is not None and avail else (room or avail)


def resolve_kv_cache_bytes(setting: int, device: torch.device) -> tuple[int, str]:
    """``(bytes, why)``: the setting when positive, else this machine's default."""
    if setting > 0:
        return setting, "kv_cache_bytes set"
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        n = int(free * CUDA_SHARE)
        return n, f"auto: {CUDA_SHARE:.0%} of the {free // MiB} MiB free on {device} after the weights"
    avail = available_memory()
    if not avail:
        return 256 * MiB, "auto: the available memory is unknown here, 256 MiB"
    n = max(CPU_FLOOR, min(CPU_CAP, int(avail * CPU_SHARE)))
    capped = " (capped)" if n == CPU_CAP else ""
    return n, f"auto: {CPU_SHARE:.0%} of the {avail // MiB} MiB available after the weights{capped}"
