"""GPU targets a plan can compile for: the target configs shipped in jmoe/plan/targets/ (README.md there says
where each one's numbers come from), or a target-config file of the user's."""

from __future__ import annotations

import dataclasses
import json
import re
from pathlib import Path

from jmoe.errors import InputError

TARGETS_DIR = Path(__file__).resolve().parent / "targets"
SUFFIX = ".textproto"
SPEEDS = TARGETS_DIR / "speeds.json"  # what the protos do not hold: links and bf16 peak (README.md there)


@dataclasses.dataclass(frozen=True)
class Target:
    name: str  # the shipped name ("h100") or the file's path
    config_text: str  # a GpuTargetConfigProto in text format
    device_kind: str  # e.g. "NVIDIA H100 80GB HBM3"
    device_memory_bytes: int  # gpu_device_info.device_memory_size
    memory_bytes_per_s: float  # gpu_device_info.memory_bandwidth
    fp32_flops: float  # 2 x SMs x FP32 units per SM x clock: the FMA peak of the CUDA cores
    bf16_flops: float | None = None  # dense bf16 tensor-core peak (speeds.json; None for a user's file)
    host_link: str | None = None  # e.g. "PCIe 5.0 x16" (speeds.json; None for a user's file)
    host_link_bytes_per_s: float | None = None  # its nominal bandwidth, one direction
    interconnect: str | None = None  # what joins the GPUs of one host, e.g. "NVLink 4 (SXM, NVSwitch)" (speeds.json)
    interconnect_bytes_per_s: float | None = None  # its nominal bandwidth per GPU, one direction


def target_names() -> list[str]:
    return sorted(p.name[:-len(SUFFIX)] for p in TARGETS_DIR.glob("*" + SUFFIX))


def load_target(target: str | Path) -> Target:
    """A shipped target by name (`h100`, `h200`, `a100-80gb`, `l4`, `rtx4090`) or a target-config file."""
    shipped = TARGETS_DIR / f"{target}{SUFFIX}"
    path = shipped if shipped.is_file() else Path(target)
    if not path.is_file():
        raise InputError(f"target {str(target)!r} is neither a shipped target ({', '.join(target_names())}) nor a "
                         f"target-config file; pass one of the names or the path of a GpuTargetConfigProto text file")
    text = path.read_text()
    memory = re.search(r"\bdevice_memory_size:\s*(\d+)", text)
    kind = re.search(r'\bdevice_description_str:\s*"([^"]*)"', text)
    if memory is None or "gpu_device_info" not in text:
        # Without gpu_device_info the XLA:GPU compiler dies of a floating point exception, not an error.
        raise InputError(f"{path}: not a usable GPU target config: expected a GpuTargetConfigProto text with "
                         f"gpu_device_info and its device_memory_size (see {TARGETS_DIR / 'README.md'} for how "
                         f"the shipped ones were made)")
    speeds = json.loads(SPEEDS.read_text()).get(str(target), {}) if path == shipped else {}
    return Target(target if path == shipped else str(path), text, kind.group(1) if kind else path.stem,
                  int(memory.group(1)), _number(text, "memory_bandwidth"),
                  2e9 * _number(text, "core_count") * _number(text, "fpus_per_core") * _number(text, "clock_rate_ghz"),
                  speeds["bf16_tflops"] * 1e12 if speeds else None, speeds.get("host_link"),
                  speeds["host_link_gbs"] * 1e9 if speeds else None, speeds.get("interconnect"),
                  speeds["interconnect_gbs"] * 1e9 if speeds else None)


def _number(config_text: str, field: str) -> float:
    found = re.search(rf"\b{field}:\s*([\d.]+)", config_text)
    if found is None:
        raise InputError(f"the target config has no {field} in gpu_device_info; the speed estimate needs it (see "
                         f"{TARGETS_DIR / 'README.md'})")
    return float(found.group(1))


def compute_capability(config_text: str) -> int:
    """The target's CUDA compute capability as major * 10 + minor (90 for an H100), from its config text."""
    found = re.search(r"cuda_compute_capability\s*\{([^}]*)\}", config_text)
    fields = dict(re.findall(r"(major|minor):\s*(\d+)", found.group(1))) if found else {}
    return int(fields.get("major", 0)) * 10 + int(fields.get("minor", 0))
