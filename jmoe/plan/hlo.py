"""What a compiled program would do on its device, read from the optimized HLO text: the control flow
that makes a GPU return to the host inside a step (a `conditional` copies its predicate to the host; a
`while` loop whose trip count the compiler does not know copies its condition back every iteration), the
Triton kernels the Pallas kernels lowered to, and the arrays it copies whole (a donated buffer that is
read and then updated in place without a data dependence between the two gets copied every step), and the
collectives a program over several devices runs (what crosses between the devices, and how many bytes)."""

from __future__ import annotations

import collections
import dataclasses
import math
import re

_WHILE = re.compile(r"\swhile\(")
_CONDITIONAL = re.compile(r"\sconditional\(")
_KNOWN_TRIP_COUNT = '"known_trip_count":{"n":"'
_HOST_COMPUTATION = '_xla_compute_type="host"'  # computations placed on the host (compute_on), as XLA:CPU marks them
# A computation's closing line and what follows it: XLA:GPU puts a host computation on the host execution thread.
_COMPUTATION_END = re.compile(r"\n}([^\n]*)")
_HOST_THREAD = 'execution_thread="host"'
_TRITON_CALL = 'custom_call_target="__gpu$xla.gpu.triton"'
# A pinned-host (memory space S(5)) parameter, or a bitcast of one (a reshape that moves nothing).
_HOST_ARRAY = re.compile(r"%(\S+) = [^=\n]*:S\(5\)\}[^=\n]* (?:parameter|bitcast)\(")
_GRID = re.compile(r"grid_x = (\d+) : i32, grid_y = (\d+) : i32, grid_z = (\d+) : i32")
_OPERAND = re.compile(r"%([^,)\s]+)")
# An instruction: its name, result type (an array, or a tuple of them), opcode, operands and the rest of its line.
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?%([\w.-]+) = (.*?) ([a-z-]+)\(([^)]*)\)(.*)$", re.M)
_STREAM_ANNOTATION = "_xla_stream_annotation="
_ASYNC_STARTS, _ASYNC_DONES = ("call-start", "async-start"), ("call-done", "async-done")
_COMPUTATION = re.compile(r"\n%(\S+) \(.*?\n(.*?)\n}", re.S)
# The opcodes of instructions that launch a kernel on a GPU.
_KERNEL_OPS = ("fusion", "custom-call", "copy", "copy-start", "sort", "scatter", "dynamic-slice",
               "dynamic-update-slice", "gather", "dot", "convolution")
# The type before the opcode may be a tuple, whose elements past the fifth XLA numbers in comments: /*index=5*/.
_TYPE = r"(?:[^=\n]|/\*index=\d+\*/)*?"
_KERNEL = re.compile(rf"= {_TYPE} (?:{'|'.join(_KERNEL_OPS)})\(")
# What the compute stream runs: kernels, loops, and command buffers (calls of captured kernels).
_WORK = (*_KERNEL_OPS, "while", "call", "conditional")
_ASYNC_CALL = re.compile(r" (?:call|async)-start\([^\n]*?(?:to_apply|calls)=%([\w.-]+)")
_LOOP = re.compile(r" while\([^\n]*?condition=%([\w.-]+), body=%([\w.-]+)([^\n]*)")
_TRIP_COUNT = re.compile(r'"known_trip_count":\{"n":"(\d+)"')
# A copy instruction, or a fusion that materialises a (dynamic) slice: XLA:CPU copies every slice it reads.
_COPY = re.compile(r"%(\S*slice\S*fusion\S*|copy\S*) = \w+\[([\d,]*)\]\S* (?:copy|copy-start|fusion)\(")
# A collective, synchronous or the start of an asynchronous one (its `-done` is the same transfer); the result
# shape (a tuple when XLA combined several) says what crosses.
_COLLECTIVE = re.compile(rf"=\s*(\({_TYPE}\)|\S+)\s+(all-reduce|all-gather|all-to-all|ragged-all-to-all|"
                         r"reduce-scatter|collective-permute|collective-broadcast)(?:-start)?\(")
_ARRAY = re.compile(r"\b([a-z]+\d*[a-z0-9]*)\[([\d,]*)\]")
_BITS = {"pred": 8, "s4": 4, "u4": 4, "s8": 8, "u8": 8, "s16": 16, "u16": 16, "f16": 16, "bf16": 16, "s32": 32,
         "u32": 32, "f32": 32, "s64": 64, "u64": 64, "f64": 64}


@dataclasses.dataclass(frozen=True)
class ControlFlow:
    conditionals: int
    loops_with_known_trip_count: int
    data_dependent_loops: int  # on the device: each iteration waits for the host to read its condition
    host_loops: int  # data-dependent loops that run on the host (host computations), not on the device
    triton_kernels: int  # Pallas kernels lowered to Triton
    # Of those, the ones handed a pinned-host array as it is (or reshaped, a bitcast): they read host memory over
    # the link (the expert copies into slots, the expert kernels of miss mode "direct"), and XLA copied nothing to
    # the device for them.
    triton_kernels_reading_host: int = 0

    def as_dict(self) -> dict:
        return dataclasses.asdict(self)


def control_flow(hlo_text: str) -> ControlFlow:
    """Count the conditionals, loops and Triton kernels of an optimized HLO module's text."""
    known = data_dependent = on_host = 0
    for line, on_host_thread in _lines_with_thread(hlo_text):
        if not _WHILE.search(line):
            continue
        if _KNOWN_TRIP_COUNT in line:
            known += 1
        elif on_host_thread or _HOST_COMPUTATION in line:
            on_host += 1
        else:
            data_dependent += 1
    conditionals = sum(1 for line in hlo_text.splitlines() if _CONDITIONAL.search(line))
    return ControlFlow(conditionals, known, data_dependent, on_host, hlo_text.count(_TRITON_CALL),
                       triton_kernels_reading_host(hlo_text))


def modules(hlo_text: str) -> list[str]:
    """The HLO modules of a text of several, one after another (a chained step's pieces, in the order they run)."""
    return ["HloModule " + text for text in re.split(r"^HloModule ", hlo_text, flags=re.M)[1:]]


def module_count(hlo_text: str) -> int:
    """The HLO modules in a text of several (`modules`)."""
    return len(modules(hlo_text))


def _lines_with_thread(hlo_text: str):
    """Every line of the module's text, with whether the computation it lies in runs on the host thread."""
    parts = _COMPUTATION_END.split(hlo_text)  # text, closing line's rest, text, ...
    for text, end in zip(parts[::2], [*parts[1::2], ""]):
        for line in text.splitlines():
            yield line, _HOST_THREAD in end


def triton_kernels_reading_host(hlo_text: str) -> int:
    """Triton kernels whose operands include a pinned-host (memory space S(5)) parameter, or a bitcast of one, in
    each module of the text (names are a module's own: a chained step's pieces reuse them)."""
    total = 0
    for module in modules(hlo_text) or [hlo_text]:
        host = set(_HOST_ARRAY.findall(module))
        total += sum(bool(host & set(_OPERAND.findall(line.split("custom-call(", 1)[1].split(")", 1)[0])))
                     for line in module.splitlines() if _TRITON_CALL in line)
    return total


def triton_grids(hlo_text: str, name: str) -> list[tuple[int, int, int]]:
    """The launch grid (x, y, z) of every Triton kernel lowered from the Pallas kernel called `name` (its
    `pallas_call(name=...)`, e.g. "copy_experts"), each loop body counted once."""
    return [tuple(int(n) for n in _GRID.search(line).groups()) for line in hlo_text.splitlines()
            if _TRITON_CALL in line and f'/{name}/pallas_call"' in line]


def side_stream_overlaps(hlo_text: str) -> list[int]:
    """For each asynchronous call of the entry computation that XLA:GPU runs on a stream of its own (annotated
    `_xla_stream_annotation`, as `side_stream_copies`' copies are), in the order they start: the work the compute
    stream launches between its start and its done (kernels as kernel_count sees them, loops, and command buffers,
    each counted once), which the call can run beside (0: none, it runs alone). Other asynchronous ops (host
    computations, collectives) are not counted as calls, but as work beside one."""
    running, overlaps = {}, []
    for name, _, op, operands, rest in _INSTRUCTION.findall(entry_computation(hlo_text)):
        if op in _ASYNC_STARTS and _STREAM_ANNOTATION in rest:
            running[name] = len(overlaps)
            overlaps.append(0)
        elif op in _ASYNC_DONES and operands.strip().lstrip("%") in running:
            running.pop(operands.strip().lstrip("%"))
        elif op in _WORK or op in _ASYNC_STARTS:
            for started in running.values():
                overlaps[started] += 1
    return overlaps


def computations(hlo_text: str) -> dict[str, str]:
    """{computation name: its body's text} of an optimized HLO module (fused computations and loop bodies included)."""
    return dict(_COMPUTATION.findall(hlo_text))


def kernel_count(hlo_text: str) -> int:
    """Kernels an optimized XLA:GPU module launches a run, roughly: the entry computation's fusions, custom calls
    (Triton, cuBLAS), copies, sorts, scatters, slices and unfused dots, with the computations its asynchronous calls
    run, and each loop's body and condition as many times as its known trip count (once where it is data). A text of
    several modules (a chained step's): the sum over the modules."""
    return sum(_module_kernels(text) for text in modules(hlo_text))


def _module_kernels(hlo_text: str) -> int:
    bodies = computations(hlo_text)

    def launches(text: str) -> int:
        total = len(_KERNEL.findall(text))
        for called in _ASYNC_CALL.findall(text):
            total += launches(bodies.get(called, ""))
        for condition, body, rest in _LOOP.findall(text):
            trips = _TRIP_COUNT.search(rest)
            total += (int(trips.group(1)) if trips else 1) * (launches(bodies.get(body, "")) +
                                                              launches(bodies.get(condition, "")))
        return total

    return launches(entry_computation(hlo_text))


def outputs_of_readers(hlo_text: str, shape: tuple[int, ...]) -> list[tuple[int, ...]]:
    """The shapes of the arrays written by the entry computations' kernels that read a parameter of `shape` (as it
    is, or reshaped by a bitcast), each array of a kernel's tuple: a weight's product with a vector, written out
    whole before a reduction reads it back, has the weight's shape."""
    def shapes(result: str) -> list[tuple[int, ...]]:
        return [_dims(found) for _, found in _ARRAY.findall(result)]

    outputs = []
    for text in modules(hlo_text):
        readers = set()  # the parameters of `shape`, and their bitcasts
        for name, result, op, operands, _ in _INSTRUCTION.findall(entry_computation(text)):
            read = readers & set(_OPERAND.findall(operands))
            if op == "parameter" and shapes(result) == [tuple(shape)] or op == "bitcast" and read:
                readers.add(name)
            elif read and op in _KERNEL_OPS:
                outputs += shapes(result)
    return outputs


def scatters(hlo_text: str) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """(operand dims, updates dims) of every scatter in the program (each module's, fused or not, a loop body's
    once): a scatter into a buffer of experts copies or rewrites it whole where an in-place write moves one expert."""
    found = []
    for module in modules(hlo_text):
        for body in computations(module).values():
            dims = {name: _dims(shape) for name, shape in re.findall(r"%([\w.\-]+) = \w+\[([\d,]*)\]", body)}
            found += [(dims[operand], dims[updates]) for operand, updates in
                      re.findall(r"scatter\(%([\w.\-]+), %[\w.\-]+, %([\w.\-]+)\)", body)]
    return found


def _dims(text: str) -> tuple[int, ...]:
    """An array's dimensions from their text in its type, "2048,1024" (a scalar's: empty)."""
    return tuple(int(n) for n in text.split(",") if n)


def entry_computation(hlo_text: str) -> str:
    """The text of an optimized HLO module's entry computation."""
    entry = hlo_text[hlo_text.index("\nENTRY"):]
    return entry[:entry.index("\n}")]


def copied_arrays(hlo_text: str) -> list[tuple[int, ...]]:
    """The dimensions of every array a `copy` (or asynchronous `copy-start`) instruction writes, or a slice
    fusion materialises."""
    # a dynamic-update-slice fusion writes in place
    return [_dims(dims) for name, dims in _COPY.findall(hlo_text) if "update" not in name]


@dataclasses.dataclass(frozen=True)
class Collective:
    op: str  # "all-reduce", "all-to-all", ...
    shapes: tuple[str, ...]  # what it carries, e.g. ("f32[1,4096]",)
    bytes: int  # per device, as the result holds them


def collectives(hlo_text: str) -> dict[Collective, int]:
    """The collectives of an optimized HLO module, each with how often it occurs (a loop body's counted once)."""
    found = collections.Counter()
    for shape_text, op in _COLLECTIVE.findall(hlo_text):
        arrays = _ARRAY.findall(shape_text)
        bits = sum(_BITS.get(dtype, 8) * math.prod(_dims(dims)) for dtype, dims in arrays)
        found[Collective(op, tuple(f"{dtype}[{dims}]" for dtype, dims in arrays), bits // 8)] += 1
    return dict(found)
