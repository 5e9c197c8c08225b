"""What a compiled program would do on its device, read from the optimized HLO text: the control flow
that makes a GPU return to the host inside a step (a `conditional` copies its predicate to the host; a
`while` loop whose trip count the compiler does not know copies its condition back every iteration), the
Triton kernels the Pallas kernels lowered to, and the arrays it copies whole (a donated buffer that is
read and then updated in place without a data dependence between the two gets copied every step)."""

from __future__ import annotations

import dataclasses
import re

_WHILE = re.compile(r"\swhile\(")
_CONDITIONAL = re.compile(r"\sconditional\(")
_KNOWN_TRIP_COUNT = '"known_trip_count":{"n":"'
_HOST_COMPUTATION = '_xla_compute_type="host"'  # computations placed on the host (compute_on)
_TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
# A copy instruction, or a fusion that materialises a (dynamic) slice: XLA:CPU copies every slice it reads.
_KERNEL = re.compile(r"=\s*\S+\s+(?:fusion|custom-call|dynamic-slice|copy-start|dot|convolution)\(")
_COPY = re.compile(r"%(\S*slice\S*fusion\S*|copy\S*) = \w+\[([\d,]*)\]\S* (?:copy|copy-start|fusion)\(")


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    conditionals: int
    loops_with_known_trip_count: int
    data_dependent_loops: int  # on the device: each iteration waits for the host to read its condition
    host_loops: int  # data-dependent loops that run on the host (host computations), not on the device
    triton_kernels: int  # Pallas kernels lowered to Triton

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def control_flow(hlo_text: str) -> ControlFlow:
    """Count the conditionals, loops and Triton kernels of an optimized HLO module's text."""
    known = data_dependent = on_host = 0
    for line in hlo_text.splitlines():
        if not _WHILE.search(line):
            continue
        if _KNOWN_TRIP_COUNT in line:
            known += 1
        elif _HOST_COMPUTATION in line:
            on_host += 1
        else:
            data_dependent += 1
    conditionals = sum(1 for line in hlo_text.splitlines() if _CONDITIONAL.search(line))
    return ControlFlow(conditionals, known, data_dependent, on_host, hlo_text.count(_TRITON_CALL))


def kernel_count(hlo_text: str) -> int:
    """Kernels an optimized XLA:GPU module launches, roughly: its fusions, custom calls (Triton, cuBLAS), slices,
    asynchronous copies and unfused dots (each loop body counted once)."""
    return len(_KERNEL.findall(hlo_text))


def copied_arrays(hlo_text: str) -> list[tuple[int, ...]]:
    """The dimensions of every array a `copy` (or asynchronous `copy-start`) instruction writes, or a slice
    fusion materialises."""
    return [tuple(int(n) for n in dims.split(",") if n) for name, dims in _COPY.findall(hlo_text)
            if "update" not in name]  # a dynamic-update-slice fusion writes in place
