"""Free memory of the device a command runs on, for sizing what it allocates before it allocates it."""

from __future__ import annotations

from typing import Optional

import torch


def available_host_bytes() -> Optional[int]:
    """The host memory available to new allocations (`MemAvailable`), or None where /proc/meminfo is missing."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def free_bytes(device: torch.device) -> Optional[int]:
    """Memory free for new allocations on `device` (a GPU's free memory, the host's available memory), or None
    where it cannot be read."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)  # a query of the driver, not a sync of the stream
        return int(free)
    return available_host_bytes()
