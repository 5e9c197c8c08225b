"""Issue #54's decode bound, prepared for a lent GPU: every way jmoe can serve an offloaded decode step, side by
side in one run, against the bounds the hardware sets, measured in the same run.

  python -m bench.gpu_decode_bound --commit SHA --out $OUT   # on the GPU, 8 minutes -> gpu_decode_bound.json, .md
  python -m bench.gpu_decode_bound --small                   # tiny shapes, the same code paths (runs on CPU)
  python -m bench.gpu_decode_bound --smoke                   # --small with fewer settings, in a temporary directory

XLA_FLAGS take effect when a backend starts, so each variant runs in a child process of its own, one after
another (VARIANTS, in order: XLA's defaults; the big shape; the latency-hiding scheduler; command buffers that hold
loops and conditionals on the device), each with its share of the budget (SHARES, scaled over the variants run;
cumulative deadlines, so time a variant leaves goes to the next). The default variant measures bench.gpu_check's
decode models (Mixtral- and DeepSeek-shaped bf16, a few GB): first, for each model, resident, then its smallest cache
with the misses copied (fetch), read in place (direct), and with router prefetch of top-k experts (issue #54 item 4:
copies that could run beside the layer before), direct again with side_stream_copies (its planned admissions on a
second stream); then the larger cache, router prefetch with side_stream_copies, and host mode last (it has aborted
XLA:GPU before). The flag variants: the first model's first settings, what the flags could change most. The big shape,
issue #54 item 7: a GPT-OSS-120B-shaped model with MXFP4 experts (about 61 GB), built in memory with random weights
(bench.gpu.in_memory: the lent machine's disk could not hold its checkpoint), resident on the device, then with what a
24 GB card holds there (device_budget_gb) in each miss mode; jmoe.plan's estimate for it is made afterwards on a CPU
from the hit rate recorded here (bench.plan_calibration's way), so no GPU time goes to compiling for a target.

Per setting (batch 1, greedy, --tokens new tokens), after a warm-up generation: decode tokens/s (steps dispatched
ahead, generate's default) with that generation's hit rate and link traffic per decode step (bytes copied to the
device and, in miss mode "direct", the missed experts' bytes the kernel reads over the link); for fetch settings the
same with each step read back first (item 3); the device step (dispatch until its outputs are ready), of it the
host's dispatch (the call's return), and the host's work after it (finish_step), medians: dispatch plus finish_step
past the step says the host sets the pace of steps run ahead; the compiled decode step's loops, conditionals and
Triton kernels, as the real device's compiler made them. Per variant the link's GB/s (a plain pinned-host copy) and
the resident step, in the same process; the default variant's child first measures whether a jax.device_put issued
outside a step runs beside it (bench.gpu.transfer_overlap: the primitive of item 4's first design, copies the manager
would issue before dispatch, not built yet), times a one-row step's expert FFN in its two kernel forms against
the HBM bound (bench.gpu.kernel_forms, item 5), a decode step's attention in XLA's form and the kernel's at a few
part sizes against the same bound (bench.gpu.attention_forms, item 5) and its products with large dense weights in
both forms (bench.gpu.projection_forms, item 5). Bounds of an offloaded setting: no overlap = resident step + link
bytes / link GB/s; overlap = the larger of the two; its share = bound / measured time per token. The default
variant's first fetch setting and its prefetch settings are traced (jax.profiler): how much of the copies' time
overlaps kernels.

A child that dies (an XLA check failure) loses only the setting it was running, recorded as such; the parent starts
it again for the rest while its share lasts; a child does not start a setting it would not finish (the longest so
far as the guess). The report and JSON are rewritten after every variant, in --out too: a lent machine brings back
only what its command wrote there, even when the command is stopped at its limit.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from bench.gpu import attention_forms, kernel_forms, projection_forms, transfer_overlap
from bench.helpers.common import add_smoke_argument, error_text, smoke_run, write_result

BIG = "gpt-oss-120b shape"  # issue #54 item 7: built in memory (bench.gpu.in_memory), experts past a 24 GB budget
BIG_BUDGET_GB = 24.0  # what a 24 GB card holds on the device (the small run: a third of the experts cached instead)
BUDGET_SECONDS = 480  # of the lent machine's 10 minutes a command: imports, the report and a margin fit in the rest
SMOKE_BUDGET_SECONDS = 240  # a bound: a quiet machine's smoke run ends sooner
KILL_GRACE_SECONDS = 30  # a child still running this long past its deadline is killed (within the whole budget)
VARIANTS = {  # name -> XLA_FLAGS added to the environment's, in the order they run
    "default": "",
    BIG: "",
    "latency-hiding scheduler": "--xla_gpu_enable_latency_hiding_scheduler=true",
    "command buffers with loops": "--xla_gpu_enable_command_buffer=+WHILE,+CONDITIONAL",
}
SHARES = {"default": 0.4, BIG: 0.35, "latency-hiding scheduler": 0.125, "command buffers with loops": 0.125}
MISS_MODES = ("fetch", "direct", "host")  # host last: its decode has aborted XLA:GPU before
# Measured once, in the default variant's child before its settings: name -> (measure(small) -> dict, its Markdown).
PROBES = {"device_put_overlap": (transfer_overlap.device_put_overlap, transfer_overlap.markdown),  # item 4
          "one_row_forms": (kernel_forms.one_row_forms, kernel_forms.markdown),  # item 5
          "attention_forms": (attention_forms.attention_forms, attention_forms.markdown),  # item 5
          "projection_forms": (projection_forms.projection_forms, projection_forms.markdown)}  # item 5
ROW_KEYS = ("model", "experts", "cache", "step_ms", "resident_step_ms", "mb_moved_per_token", "link_gbs",
            "tokens_per_s", "host_ms")  # the fields of a setting, in its order


def settings_of(variant: str, small: bool, smoke: bool) -> list[dict]:
    """The (model, cache, miss mode) settings a variant measures, each model resident first (its step is the
    bound's)."""
    from bench.gpu.models import speed_models
    from bench.gpu.speed import caches_for

    if variant == BIG:
        experts = big_config(small)["num_local_experts"]
        offloaded = {"cache": experts // 3} if small else {"cache": None, "device_budget_gb": BIG_BUDGET_GB}
        resident = [] if smoke else [dict(model=BIG, experts=experts, cache=None, miss_mode="resident")]
        return resident + [dict(model=BIG, experts=experts, miss_mode=mode, **offloaded)
                           for mode in (MISS_MODES[:1] if smoke else MISS_MODES)]
    first, later = [], []
    models = list(speed_models(small).items())
    for name, spec in models[:1] if smoke or variant != "default" else models:
        experts, top_k = spec.get("num_local_experts", spec.get("n_routed_experts")), spec["num_experts_per_tok"]
        smallest, *larger = caches_for(experts, top_k, small)[::-1]
        one = dict(model=name, experts=experts)
        if smoke and variant != "default":  # its child starts with the flags and runs a step (the default's code)
            first.append(dict(one, cache=None, miss_mode="resident"))
            continue
        # What the choices turn on first, every model: resident (the bound's step), the smallest cache's misses
        # copied and read in place, and router prefetch (item 4: copies that could run beside the layer before).
        first += [dict(one, cache=None, miss_mode="resident"), dict(one, cache=smallest, miss_mode="fetch"),
                  dict(one, cache=smallest, miss_mode="direct")]
        if not smoke:
            first.append(dict(one, cache=smallest, miss_mode="fetch", prefetch=top_k))
        # The copies made ahead of need on a second stream (item 4): direct's planned admissions (every variant, the
        # smoke run too), then router prefetch's.
        first.append(dict(one, cache=smallest, miss_mode="direct", side_stream_copies=True))
        if variant == "default" and not smoke:  # then the other caches, and host mode (it has aborted XLA:GPU: last)
            later += [dict(one, cache=cache, miss_mode="fetch") for cache in larger if cache is not None]
            later.append(dict(one, cache=smallest, miss_mode="fetch", prefetch=top_k, side_stream_copies=True))
            later.append(dict(one, cache=smallest, miss_mode="host"))
    return first + later


def big_config(small: bool) -> dict:
    """GPT-OSS-120B's config (bench.plan's, its published shape), or a toy GPT-OSS whose widths MXFP4 can block, deep
    enough that its steps run as chains of layer blocks as the real shape's 36 layers do (jmoe.decode.chain)."""
    from bench.gpu.models import FAMILY_CASES, model_config
    from bench.plan import MODELS
    from jmoe.decode.chain import LAYERS_PER_PROGRAM

    if not small:
        return MODELS["gpt-oss-120b"]
    return model_config("gpt_oss", True, **{**FAMILY_CASES["gpt_oss"], "vocab_size": 256,  # bench.decode's prompt ids
                                            "num_hidden_layers": 2 * LAYERS_PER_PROGRAM})


def label_of(setting: dict) -> str:
    if setting["miss_mode"] == "resident":
        return f"{setting['model']}, resident"
    where = (f"device budget {setting['device_budget_gb']:g} GB" if setting.get("device_budget_gb")
             else f"cache {setting['cache']}")
    ahead = f", prefetch {setting['prefetch']}" if setting.get("prefetch") else ""
    beside = ", side stream" if setting.get("side_stream_copies") else ""
    return f"{setting['model']}, {where}, {setting['miss_mode']}{ahead}{beside}"


def placing_of(setting: dict) -> dict:
    """A setting's placement arguments, as jmoe.load and OffloadOptions take them (none where it is resident)."""
    if setting["miss_mode"] == "resident":
        return {}
    return {key: setting[key] for key in ("cache", "device_budget_gb", "prefetch", "side_stream_copies")
            if setting.get(key)}


def bounds(row: dict) -> dict:
    """No-overlap and overlap bounds of a setting, ms per token, and the measured time's share of each."""
    if row["miss_mode"] == "resident" or not row.get("link_gbs") or row.get("resident_step_ms") is None:
        return {}
    link_ms = row["mb_over_link_per_token"] / row["link_gbs"]  # MB / (GB/s) = ms
    measured_ms = 1e3 / row["tokens_per_s"]
    no_overlap, overlap = row["resident_step_ms"] + link_ms, max(row["resident_step_ms"], link_ms)
    return {"link_ms": link_ms, "no_overlap_bound_ms": no_overlap, "overlap_bound_ms": overlap,
            "share_of_no_overlap_bound": no_overlap / measured_ms, "share_of_overlap_bound": overlap / measured_ms}


# ---- the child: one variant's settings, in the process its XLA_FLAGS started ----

class Models:
    """A child's models: gpu_check's checkpoints loaded afresh for each setting; the big shape built in memory once
    per placement (the miss modes share its parameters, each with an engine of its own)."""

    def __init__(self, args):
        self.args = args
        self.built, self.built_for = None, None

    def load(self, setting: dict):
        resident = setting["miss_mode"] == "resident"
        placing = placing_of(setting)
        if setting["model"] != BIG:
            import jmoe
            from bench.gpu.speed import speed_checkpoint

            directory = speed_checkpoint(self.args.workdir, setting["model"], self.args.small)
            return jmoe.load(directory, progress=False, check_finite=False, **placing,
                             **({} if resident else {"miss_mode": setting["miss_mode"]}))
        if self.built_for != placing:
            import gc

            from bench.gpu.in_memory import InMemoryModel

            self.built = None
            gc.collect()  # the last placement's arrays go before the next are made
            self.built = InMemoryModel(big_config(self.args.small), expert_dtype="mxfp4", **placing)
            self.built_for = placing
        return self.built.model(None if resident else setting["miss_mode"])


def measure(setting: dict, model, tokens: int, trace_dir: Path | None) -> dict:
    """One setting: decode tokens/s and, from the same generation, its decode steps' hit rate and link traffic; the
    same with each step read back first (fetch); the step / host split; what the compiled decode step does (the real
    device's program); with `trace_dir` a profile of one more generation."""
    from bench.gpu.profile import step_split, step_timer, traced_steps
    from bench.gpu.speed import decode_step_counts, generate
    from jmoe.plan.hlo import control_flow, kernel_count, module_count, side_stream_overlaps

    offloaded = setting["miss_mode"] != "resident"
    generate(model, tokens)  # compiles, and warms the cache as a second generation of a conversation would find it
    counts = decode_step_counts(model, tokens)
    row = dict(setting, tokens_per_s=counts["tokens_per_s"], mb_moved_per_token=counts["bytes_moved"] / 1e6)
    if offloaded:
        caches = list(model.placement_plan.caches)
        row.update(cache=max(set(caches), key=caches.count), caches=model.placement_plan.describe_caches(),
                   hit_rate=counts["hits"] / max(counts["hits"] + counts["misses"], 1e-9))
        if model.engine.runs_ahead and setting["miss_mode"] == "fetch" and not setting.get("prefetch"):  # item 3
            row["tokens_per_s_read_back_first"] = decode_step_counts(model, tokens, run_ahead=False)["tokens_per_s"]
    read_in_place = counts["misses"] * model.placement_plan.expert_bytes if setting["miss_mode"] == "direct" else 0
    row["mb_read_in_place_per_token"] = read_in_place / 1e6
    row["mb_over_link_per_token"] = row["mb_moved_per_token"] + row["mb_read_in_place_per_token"]
    with step_timer(model) as times:
        generate(model, tokens)
    split = step_split(times)
    row.update(step_ms=split["step ms"], dispatch_ms=split["dispatch ms"], host_ms=split["host ms"])
    decode = [step["hlo"] for step in model.compiled_steps() if step["tokens"][1] == 1]
    if decode:
        # a chained step's pieces in the order they run (jmoe.decode.chain): how many programs a step dispatches
        # and the kernels it launches, against which the step's ms say what a launch costs (#54 item 5)
        row["decode_program"] = dict(control_flow(decode[0]).as_dict(), programs_a_step=module_count(decode[0]),
                                     kernels_a_step=kernel_count(decode[0]),
                                     side_stream_overlaps=side_stream_overlaps(decode[0]))
    if trace_dir is not None:
        summary = traced_steps(lambda: generate(model, tokens), trace_dir, tokens)
        row["profile"] = {key: value for key, value in summary.items() if key != "top device events"}
        row["profile_top_events"] = summary.get("top device events", [])
    model.close()
    return row


def run_variant(args) -> None:
    """Measure args.child's settings not yet in its results file, rewriting the file after each (the parent reads
    it; a setting named as running when the process died is the one that killed it). A setting that raises is
    recorded with its error, and the next one runs."""
    import traceback

    if args.child == BIG:  # before JAX's GPU client starts
        raise_pinned_pool_for_big(args)
    import jax

    from bench.gpu.speed import plain_copy_gbs

    path = results_path(args.workdir, args.child)
    state = json.loads(path.read_text()) if path.exists() else {
        "device": jax.devices()[0].device_kind, "platform": jax.default_backend(), "jax": jax.__version__,
        "xla_flags": os.environ.get("XLA_FLAGS", ""), "rows": [], "died_in": [], "failed": {}}
    if state.get("running"):  # the last process died in it
        state["died_in"].append(state.pop("running"))
    if "link_gbs" not in state:
        state["link_gbs"] = plain_copy_gbs(args.small)
    for probe, (measure_probe, _) in PROBES.items() if args.child == "default" else ():
        if probe not in state:
            try:
                state[probe] = measure_probe(args.small)
            except Exception as error:  # recorded: the settings still run
                traceback.print_exc()
                state[probe] = {"failed": error_text(error)}
    path.write_text(json.dumps(state, indent=1))
    done = {label_of(row) for row in state["rows"]} | set(state["died_in"]) | set(state["failed"])
    resident = {row["model"]: row["step_ms"] for row in state["rows"] if row["miss_mode"] == "resident"}
    models, traced, longest = Models(args), False, 0.0
    for setting in settings_of(args.child, args.small, args.smoke):
        label = label_of(setting)
        if label in done:
            continue
        if time.time() + longest > args.deadline:  # one more like the longest so far would outrun the share
            break
        began = time.time()
        state["running"] = label
        path.write_text(json.dumps(state, indent=1))
        print(f"  running: {args.child}: {label}", file=sys.stderr, flush=True)
        trace = args.child == "default" and setting["miss_mode"] == "fetch" and (not traced or setting.get("prefetch"))
        try:
            row = measure(setting, models.load(setting), args.tokens,
                          args.workdir / "trace" / label.replace(", ", "_") if trace else None)
        except Exception as error:  # recorded: one broken setting must not cost the others a lent GPU's time
            traceback.print_exc()
            state["failed"][label] = error_text(error)
        else:
            traced = traced or trace
            row.update(link_gbs=state["link_gbs"], resident_step_ms=resident.get(setting["model"]))
            if setting["miss_mode"] == "resident":
                resident[setting["model"]] = row["step_ms"]
            state["rows"].append({**row, **bounds(row)})
        state.pop("running")
        path.write_text(json.dumps(state, indent=1))
        longest = max(longest, time.time() - began)


def raise_pinned_pool_for_big(args) -> None:
    """The big shape's pinned experts need more than XLA's default pool (61 GB): raised as the command lines raise it
    (jmoe.plan.planner.raise_pinned_pool_for, from a header-only copy of its config), a limit the user set standing."""
    from bench.plan import write_header_only_checkpoint
    from jmoe.offload.options import OffloadOptions
    from jmoe.plan.planner import raise_pinned_pool_for

    offloaded = next(s for s in settings_of(BIG, args.small, args.smoke) if s["miss_mode"] != "resident")
    placing = {key: offloaded[key] for key in ("cache", "device_budget_gb") if offloaded.get(key)}
    headers = write_header_only_checkpoint(args.workdir / "big_headers", big_config(args.small))
    setting = raise_pinned_pool_for(headers, OffloadOptions(**placing, expert_dtype="mxfp4"))
    if setting:
        print(f"  {BIG}: set {setting}", file=sys.stderr, flush=True)


def results_path(workdir: Path, variant: str) -> Path:
    return workdir / f"decode_bound_{variant.replace(' ', '_')}.json"


# ---- the parent: the variants one after another, then the report ----

def run_all(args, after_variant=lambda results: None) -> dict[str, dict]:
    """Each variant's results, its child started again after a death while its share lasts; the shares of the
    variants run are scaled to the whole budget, each deadline cumulative (a variant that ends early leaves its time
    to the next), and no child outlives the budget. `after_variant(results)` after each."""
    began, allotted, results = time.time(), 0.0, {}
    total_share = sum(SHARES[variant] for variant in args.variants)
    for variant in args.variants:
        allotted += SHARES[variant] / total_share
        deadline = began + allotted * args.budget_s
        kill_at = min(deadline + KILL_GRACE_SECONDS, began + args.budget_s)
        path = results_path(args.workdir, variant)
        path.unlink(missing_ok=True)
        env = {**os.environ, "XLA_FLAGS": f"{os.environ.get('XLA_FLAGS', '')} {VARIANTS[variant]}".strip()}
        command = [sys.executable, "-m", "bench.gpu_decode_bound", "--child", variant, "--workdir", str(args.workdir),
                   "--tokens", str(args.tokens), "--deadline", str(deadline)] + ["--small"] * args.small + [
                   "--smoke"] * args.smoke
        exits = []
        while time.time() < deadline:
            try:
                exits.append(subprocess.run(command, env=env, timeout=max(kill_at - time.time(), 1)).returncode)
            except subprocess.TimeoutExpired:
                exits.append("killed at its deadline")
            state = json.loads(path.read_text()) if path.exists() else {}
            if exits[-1] == 0 or not state.get("running"):  # finished, out of time, or died before a setting
                break
        results[variant] = {**(json.loads(path.read_text()) if path.exists() else {"rows": []}), "exits": exits}
        after_variant(results)
    return results


def report(args, results: dict[str, dict]) -> tuple[dict, str]:
    """The issue's JSON (the shipped variant's settings: XLA's default flags, fetch, run-ahead) and the Markdown of
    every variant."""
    default = results.get("default", {})
    shipped = [{key: row.get(key) for key in ROW_KEYS} for variant in ("default", BIG)
               for row in results.get(variant, {}).get("rows", [])
               if row["miss_mode"] in ("resident", "fetch") and not row.get("prefetch")]
    ran = default if default.get("device") else next((r for r in results.values() if r.get("device")), {})
    payload = {"date": datetime.date.today().isoformat(), "commit": args.commit, "device": ran.get("device"),
               "jax": ran.get("jax"), "settings": shipped, "variants": results}
    lines = [f"Device `{ran.get('device')}` (jax {ran.get('jax')}), commit {args.commit}, {args.tokens} decode "
             f"tokens a setting, budget {args.budget_s:.0f} s" + (" (small: tiny shapes, the logic only)"
                                                                   if args.small else ""), ""]
    for variant, result in results.items():
        lines += [f"## {variant}", "", f"XLA_FLAGS `{result.get('xla_flags', '')}`; link {fmt(result.get('link_gbs'))} "
                  f"GB/s (plain pinned-host copy); child exits {result['exits']}"
                  + (f"; **died in** {', '.join(result['died_in'])}" if result.get("died_in") else ""), "",
                  *[f"- **failed**: {label}: {error}" for label, error in result.get("failed", {}).items()],
                  *[f"- not run (out of time): {label}" for label in not_reached(args, variant, result)],
                  *([""] if result.get("failed") or not_reached(args, variant, result) else []),
                  "| setting | caches | hit rate | tokens/s | read back first | step ms | dispatch ms | host ms "
                  "| MB copied / token | MB read in place | bound, no overlap ms | share | bound, overlap ms | share |",
                  "|---" * 14 + "|"]
        for row in result.get("rows", []):
            lines.append(f"| {label_of(row)} | " + " | ".join(fmt(row.get(key)) for key in (
                "caches", "hit_rate", "tokens_per_s", "tokens_per_s_read_back_first", "step_ms", "dispatch_ms",
                "host_ms", "mb_moved_per_token", "mb_read_in_place_per_token", "no_overlap_bound_ms",
                "share_of_no_overlap_bound", "overlap_bound_ms", "share_of_overlap_bound")) + " |")
        lines += ["", "Decode programs as the device's compiler made them (a chained step's pieces summed):", *[
            f"- {label_of(row)}: " + ", ".join(f"{key.replace('_', ' ')} {value}" for key, value in
                                               row["decode_program"].items() if key != "side_stream_overlaps")
            for row in result.get("rows", []) if "decode_program" in row]]
        for row in result.get("rows", []):
            if "profile" in row:
                lines += ["", f"Profile of {label_of(row)}: " + ", ".join(
                    f"{key} {fmt(value)}" for key, value in row["profile"].items())]
                lines += [f"- {event}" for event in row["profile_top_events"]]
            beside = row.get("decode_program", {}).get("side_stream_overlaps")
            if beside:
                lines += ["", f"Copies on a second stream in the decode program of {label_of(row)}: the compute "
                          f"stream's kernels scheduled beside each, {beside}"]
        for probe, (_, probe_markdown) in PROBES.items():
            if probe in result:
                found = result[probe]
                lines += ["", *([f"{probe}: **failed**: {found['failed']}"] if "failed" in found
                                else probe_markdown(found))]
        lines.append("")
    lines += ["Bounds: no overlap = resident step + link bytes / link GB/s; overlap = the larger of the two; share = "
              "bound / measured ms per token (1000 / tokens/s, steps dispatched ahead). Link bytes per decode token: "
              "the copies to the device plus, in miss mode direct, the missed experts the kernel reads in host memory. "
              "Host mode computes its misses on the host: its bound counts only its admissions' copies."]
    return payload, "\n".join(lines) + "\n"


def not_reached(args, variant: str, result: dict) -> list[str]:
    """The variant's settings its child did not get to (its share of the budget ran out, or it died before them)."""
    seen = {label_of(row) for row in result.get("rows", [])} | set(result.get("died_in", [])) | set(
        result.get("failed", {}))
    return [label for label in map(label_of, settings_of(variant, args.small, args.smoke)) if label not in seen]


def write_report(args, results: dict[str, dict]) -> dict:
    """The report and JSON under bench/results (a smoke run's directory), and in --out too (a lent machine brings
    back only what its command wrote there, even when the command is stopped at its limit); returns the JSON."""
    payload, text = report(args, results)
    name = "gpu_decode_bound_small" if args.small else "gpu_decode_bound"
    path = write_result(f"{name}.md", "Offloaded decode against its bound, every variant", text)
    path.with_suffix(".json").write_text(json.dumps(payload, indent=1))
    if args.out is not None:
        args.out.mkdir(parents=True, exist_ok=True)
        for written in (path, path.with_suffix(".json")):
            (args.out / written.name).write_text(written.read_text())
    return payload


def fmt(value) -> str:
    return "-" if value is None else f"{value:.4g}" if isinstance(value, float) else str(value)


def head_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=Path(__file__).parent, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown (not a git checkout: pass --commit)"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m bench.gpu_decode_bound", description=__doc__.splitlines()[0])
    p.add_argument("--small", action="store_true", help="tiny shapes: the same code paths, runs on CPU")
    p.add_argument("--budget-s", type=float, default=None,
                   help=f"wall-clock budget (default {BUDGET_SECONDS} s; {SMOKE_BUDGET_SECONDS} s with --smoke)")
    p.add_argument("--tokens", type=int, default=None, help="decode tokens per measurement (default 32; small 4)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/jmoe_gpu_check"),
                   help="where the random checkpoints are written (bench.gpu_check's, reused)")
    p.add_argument("--variants", default=None,
                   help=f"comma-separated subset of: {', '.join(VARIANTS)} (default all; a smoke run: default, command "
                        f"buffers with loops, {BIG})")
    p.add_argument("--out", type=Path, default=None,
                   help="also write the report and JSON here, after every variant (on a lent GPU: $OUT)")
    p.add_argument("--commit", default=None, help="the commit measured, 40 hex (default: git rev-parse HEAD)")
    p.add_argument("--child", default=None, help=argparse.SUPPRESS)  # a variant's process
    p.add_argument("--deadline", type=float, default=None, help=argparse.SUPPRESS)
    add_smoke_argument(p)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.small = args.small or args.smoke
    args.tokens = args.tokens or (4 if args.small else 32)
    if args.child is not None:
        run_variant(args)
        return 0
    args.budget_s = args.budget_s or (SMOKE_BUDGET_SECONDS if args.smoke else BUDGET_SECONDS)
    args.commit = args.commit or head_commit()
    if not args.small and not re.fullmatch(r"[0-9a-f]{40}", args.commit):
        raise SystemExit(f"error: --commit must be the 40-hex commit measured (the GPU machine's copy has no git "
                         f"history to read it from), found {args.commit!r}")
    args.variants = (args.variants.split(",") if args.variants else
                     ["default", "command buffers with loops", BIG] if args.smoke else list(VARIANTS))
    if unknown := sorted(set(args.variants) - set(VARIANTS)):
        raise SystemExit(f"error: unknown variants {unknown}; expected a subset of: {', '.join(VARIANTS)}")
    with smoke_run(args):
        args.workdir.mkdir(parents=True, exist_ok=True)
        payload = write_report(args, run_all(args, after_variant=lambda partial: write_report(args, partial)))
        print(json.dumps(payload, indent=1) if args.smoke else "written: gpu_decode_bound report and JSON")
    broken = [variant for variant, result in payload["variants"].items()
              if result.get("died_in") or result.get("failed") or not result.get("rows")]
    return 1 if broken and args.small else 0  # on a CPU every setting must run; on a GPU a failure is a result


if __name__ == "__main__":
    sys.exit(main())
