"""Where a decode step's time goes, for bench.gpu_check's decode section: the compiled step (dispatch until its
outputs are ready) against the host's work between steps (Model.finish_step: routing back to the host, the cache
manager), and a jax.profiler trace of a few steps summarised per device stream, with how much of the time spent
copying overlaps kernels. On a CPU backend the trace has no device streams; the summary says so."""

from __future__ import annotations

import collections
import contextlib
import glob
import gzip
import json
import statistics
import time
from pathlib import Path

TOP_EVENTS = 12  # device events listed by total time per step


@contextlib.contextmanager
def step_timer(model):
    """Yields {"step": [s], "dispatch": [s], "host": [s]} filled by every step the model runs meanwhile: the compiled
    program from dispatch until its outputs are ready, of it the host's work until the call returns (on a GPU the
    enqueueing, every piece of a chained step; a CPU may run part of the program in the call), then finish_step.
    Dispatch plus finish_step is the host's time a token when steps run ahead: past the device's step, the host sets
    the pace."""
    import jax

    times = {"step": [], "dispatch": [], "host": []}
    program, finish = model._program, model.finish_step

    def timed_program(greedy, args):
        compiled = program(greedy, args)

        def run(*inputs):
            start = time.perf_counter()
            outputs = compiled(*inputs)
            times["dispatch"].append(time.perf_counter() - start)
            outputs = jax.block_until_ready(outputs)
            times["step"].append(time.perf_counter() - start)
            return outputs
        return run

    def timed_finish(*inputs):
        start = time.perf_counter()
        outputs = finish(*inputs)
        times["host"].append(time.perf_counter() - start)
        return outputs

    model._program, model.finish_step = timed_program, timed_finish
    try:
        yield times
    finally:
        del model._program, model.finish_step  # the instance attributes go; the class's methods show again


def step_split(times: dict) -> dict:
    """Median ms of a decode step's device program and of the host work after it (the prompt step left out)."""
    return {f"{part} ms": statistics.median(values[1:]) * 1e3 for part, values in times.items() if len(values) > 1}


def traced_steps(run, directory: Path, steps: int) -> dict:
    """Run `run()` (a generation already compiled at this length) under jax.profiler; its device summary."""
    import jax

    options = jax.profiler.ProfileOptions()
    options.python_tracer_level = 0  # device streams are the point; Python frames would multiply the trace's size
    jax.profiler.start_trace(str(directory), create_perfetto_trace=True, profiler_options=options)
    try:
        run()
    finally:
        jax.profiler.stop_trace()
    files = glob.glob(str(directory / "**" / "*.json.gz"), recursive=True)
    return device_summary(json.load(gzip.open(max(files, key=lambda f: Path(f).stat().st_mtime)))["traceEvents"],
                          steps)


def device_summary(events: list[dict], steps: int) -> dict:
    """Per step: each device stream's busy microseconds, copies' and kernels' busy time and their overlap, and the
    device events that took longest. Device streams: threads of a process named like /device:GPU:0."""
    process, thread = {}, {}
    for e in events:
        if e.get("ph") == "M" and e.get("name") == "process_name":
            process[e["pid"]] = e["args"]["name"]
        elif e.get("ph") == "M" and e.get("name") == "thread_name":
            thread[(e["pid"], e["tid"])] = e["args"]["name"]
    device = [e for e in events if e.get("ph") == "X" and "/device:" in process.get(e["pid"], "")]
    if not device:
        return {"device events": 0, "note": "no device streams in the trace (a CPU backend runs on host threads)"}
    streams = collections.defaultdict(list)
    copies, kernels = [], []
    totals, counts = collections.Counter(), collections.Counter()
    for e in device:
        span = (e["ts"], e["ts"] + e["dur"])
        streams[thread.get((e["pid"], e["tid"]), str(e["tid"]))].append(span)
        (copies if "memcpy" in e["name"].lower() or "memset" in e["name"].lower() else kernels).append(span)
        totals[e["name"][:80]] += e["dur"]
        counts[e["name"][:80]] += 1
    copy_busy, kernel_busy = _union(copies), _union(kernels)
    summary = {"device events": len(device),
               "copy busy us/step": _length(copy_busy) / steps, "kernel busy us/step": _length(kernel_busy) / steps,
               "copy time overlapping kernels": (_length(_intersection(copy_busy, kernel_busy)) / _length(copy_busy)
                                                 if copy_busy else None)}
    for name, spans in sorted(streams.items()):
        summary[f"stream {name[:48]} busy us/step"] = _length(_union(spans)) / steps
    summary["top device events"] = [f"{us / steps:.1f} us/step x{counts[name] / steps:.1f} {name}"
                                    for name, us in totals.most_common(TOP_EVENTS)]
    return summary


def _union(spans):
    merged = []
    for start, end in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    return merged


def _intersection(a, b):
    out, i, j = [], 0, 0
    while i < len(a) and j < len(b):
        start, end = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
        if start < end:
            out.append([start, end])
        if a[i][1] < b[j][1]:
            i += 1
        else:
            j += 1
    return out


def _length(spans) -> float:
    return sum(end - start for start, end in spans)
