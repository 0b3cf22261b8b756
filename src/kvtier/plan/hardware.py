"""The machines the planner predicts for: ``Hardware``, its presets and ``from_profile``.

A machine is a set of rates and capacities, one per stave of the barrel: the device's
compute and memory bandwidth, the device⇄host link, the host's attention rate over its
DRAM, disk, network, and optionally a CXL memory tier. ``from_profile`` builds the machine
``kvtier calibrate`` measured (this one: ``measured`` True); the presets are vendor
figures times an efficiency (``measured`` False: on paper until a GPU run validates them).
Pure data; thread-safe.
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvtier.profiles import machine_identity, placement_rates

GB = 1e9

# Fractions of a spec sheet's peak a serving step reaches (on paper).
HBM_EFFICIENCY = 0.8
TFLOPS_EFFICIENCY = 0.5
LINK_EFFICIENCY = 0.8


@dataclass(frozen=True)
class Hardware:
    """One accelerator and its share of the host (rates in GB/s of 1e9 bytes).

    Attributes:
        name: the preset or profile name.
        description: one line for reports.
        device_memory_gb: accelerator memory (the CPU's RAM on a CPU-only machine).
        device_memory_gbps: the rate decode reads weights and resident KV at.
        device_tflops: dense matmul TFLOP/s reached in prefill.
        link_gbps: device⇄host, one direction.
        host_memory_gb: host DRAM per accelerator for the host tier.
        host_attention_gbps: KV bytes per second the host's cores attend over.
        disk_gbps: the disk tier's read rate.
        network_gbps: the shared tier's rate (a Redis cluster over the network).
        cxl_memory_gb: a CXL memory tier's capacity (0: none).
        cxl_gbps: its rate (host attention over it runs at the smaller of the two).
        concurrent: host attention runs beside the device (its own cores).
        measured: from ``kvtier calibrate`` on this machine; False: on paper.
        decode_ms: measured decode step with no context at batch 1 (None: from the
            weights and the memory rate).
        decode_ms_per_row: measured extra per sequence in a decode batch.
        prefill_s_per_token: measured prefill seconds per token (None: from FLOPs).
    """

    name: str
    description: str
    device_memory_gb: float
    device_memory_gbps: float
    device_tflops: float
    link_gbps: float
    host_memory_gb: float
    host_attention_gbps: float
    disk_gbps: float
    network_gbps: float
    cxl_memory_gb: float = 0.0
    cxl_gbps: float = 0.0
    concurrent: bool = True
    measured: bool = False
    decode_ms: float | None = None
    decode_ms_per_row: float | None = None
    prefill_s_per_token: float | None = None

    def with_cxl(self, memory_gb: float = 512.0, gbps: float = 64.0 * LINK_EFFICIENCY) -> Hardware:
        """This machine with a CXL memory tier (default: 512 GB behind a x16 CXL 2.0 link)."""
        return dataclasses.replace(
            self,
            name=f"{self.name}+cxl",
            description=f"{self.description}, + {memory_gb:.0f} GB CXL at {gbps:.0f} GB/s",
            cxl_memory_gb=memory_gb,
            cxl_gbps=gbps,
        )


def _gpu(
    name: str, what: str, memory_gb: float, hbm_gbps: float, tflops: float, link: float, host: float
) -> Hardware:
    return Hardware(
        name=name,
        description=f"{what} (on paper: spec figures x efficiency)",
        device_memory_gb=memory_gb,
        device_memory_gbps=hbm_gbps * HBM_EFFICIENCY,
        device_tflops=tflops * TFLOPS_EFFICIENCY,
        link_gbps=link * LINK_EFFICIENCY,
        host_memory_gb=host,
        host_attention_gbps=100.0,  # 16 cores of a DDR5 socket reading KV
        disk_gbps=6.0,  # one PCIe 4 NVMe drive
        network_gbps=12.5,  # 100 Gb/s Ethernet to the Redis cluster
    )


PRESETS: dict[str, Hardware] = {
    "h100-pcie5": _gpu("h100-pcie5", "H100 SXM 80 GB, PCIe 5 x16", 80, 3350, 989, 64, 256),
    "h200-pcie5": _gpu("h200-pcie5", "H200 141 GB, PCIe 5 x16", 141, 4800, 989, 64, 512),
    "a10g-pcie4": _gpu("a10g-pcie4", "A10G 24 GB, PCIe 4 x16", 24, 600, 125, 32, 64),
    "gh200-c2c": dataclasses.replace(
        _gpu("gh200-c2c", "GH200 96 GB, NVLink-C2C 450 GB/s", 96, 4000, 989, 450, 480),
        host_attention_gbps=300.0,  # 72 Grace cores over LPDDR5X
    ),
}
"""GPU servers on paper; each also as ``<name>+cxl``."""


def from_profile(profile: dict[str, Any], name: str = "this") -> Hardware:
    """The machine a ``kvtier calibrate`` profile measured (at the thread count it measured
    compute with)."""
    machine = profile["machine"]
    rates = placement_rates(profile, int(machine.get("torch_threads") or 1))
    batch = profile.get("decode_batch", {}).get("fit")
    prefill = profile["compute"]["prefill"]["fit"]
    memory_gb = float(machine.get("memory_gb") or 0.0)
    if not memory_gb and machine.get("identity") == machine_identity():  # this machine
        memory_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / GB
    return Hardware(
        name=name,
        description=f"{machine['cpu']}, {machine['cores']} cores, {machine['device']} "
        f"(measured by kvtier calibrate, {profile.get('measured_at', '?')})",
        device_memory_gb=memory_gb,
        device_memory_gbps=rates.device_attention_gbps,
        device_tflops=0.0,
        link_gbps=rates.link_gbps,
        host_memory_gb=memory_gb,
        host_attention_gbps=rates.host_attention_gbps,
        disk_gbps=float(profile["disk"]["read_gbps"]),
        network_gbps=0.0,
        concurrent=rates.concurrent,
        measured=True,
        decode_ms=float(batch["ms"]) if batch else rates.compute_s * 1e3,
        decode_ms_per_row=float(batch["ms_per_row"]) if batch else 0.0,
        prefill_s_per_token=float(prefill["s_per_token"]),
    )


def hardware(spec: str, profile: dict[str, Any] | None) -> Hardware:
    """``spec``: ``this`` (``profile``, this machine's), a preset name (``+cxl`` adds a CXL
    tier), or a profile JSON path.

    Raises:
        ValueError: an unknown name, or ``this`` without a profile.
    """
    if spec == "this":
        if profile is None:
            raise ValueError(
                "--hardware this: no calibration profile of the model here; run `kvtier "
                "calibrate` first"
            )
        return from_profile(profile)
    base, _, extra = spec.partition("+")
    if base in PRESETS and extra in ("", "cxl"):
        return PRESETS[base].with_cxl() if extra else PRESETS[base]
    if Path(spec).is_file():
        return from_profile(json.loads(Path(spec).read_text()), Path(spec).stem)
    names = ", ".join(["this", *PRESETS, *(f"{p}+cxl" for p in PRESETS)])
    raise ValueError(f"--hardware: unknown {spec!r}; accepted: {names}, or a profile path")
