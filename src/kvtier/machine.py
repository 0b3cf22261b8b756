"""The machine a run happened on: CPU, cores, torch and its threads, the device, the links.

``kvtier run`` and every benchmark print it at the top and write it into their JSON, so a
figure always travels with the hardware it came from. Reads ``/proc/cpuinfo`` and torch;
mutates nothing.
"""

from __future__ import annotations

import os
import platform
from typing import Any

import torch


def machine_info(links: dict[str, str] | None = None) -> dict[str, Any]:
    """The machine a run happened on, for the report header and the JSON."""
    cpu = platform.processor() or "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu (no GPU)"
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "device": device,
        "python": platform.python_version(),
        "links": links or {},
    }


def print_machine(info: dict[str, Any]) -> None:
    print(
        f"machine: {info['cpu']}, {info['cores']} cores, torch {info['torch']} "
        f"({info['torch_threads']} threads), device {info['device']}"
    )
    for name, desc in info["links"].items():
        print(f"  link {name}: {desc}")
