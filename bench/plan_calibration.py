"""jmoe.plan's speed estimate against what a lent GPU measured: plan the models a GPU run decoded (the same configs,
as header-only checkpoints) for that GPU at the same placement and batch, with the hit rate the run measured, and
record each estimate's [low, high] next to the measured tokens/s. Reads either run's JSON: bench.gpu_check's (its
decode section; the hit rate from its bytes moved per token) or bench.gpu_decode_bound's (the default variant's and
the GPT-OSS-120B shape's resident and fetch settings, the kind jmoe.plan estimates, with their measured hit rate).

  python -m bench.plan_calibration [--results bench/results/gpu_check_nvidia_h100_80gb_hbm3.json] [--target h100]
  python -m bench.plan_calibration --results bench/results/gpu_decode_bound.json --target h200
  python -m bench.plan_calibration --smoke   # one offloaded setting, its model at smoke size, one layer, no result

Needs the gpu-compile extra (the estimate comes from the programs compiled for the target; a model of 16 layers or
more is compiled at two shallow depths and extrapolated). Writes bench/results/plan_calibration_<target>.md.
"""

from __future__ import annotations

import argparse
import json
import re
import tempfile
from pathlib import Path

from bench.gpu.models import SPEED_MODELS, model_config
from bench.helpers.common import add_smoke_argument, smoke_run, smoke_spec, write_result
from bench.plan import write_header_only_checkpoint

CONTEXT = 128  # gpu_check's decode: a 32-token prompt and 64 new tokens, in a KV cache of 128 columns
SMOKE_LAYERS = 1  # a smoke run's model: XLA:GPU compiles every layer on its own, and each adds seconds of CPU
LABEL = re.compile(r"^(\w+), (resident|cache (\d+)): decode tokens/s$")


def measured_settings(results: dict) -> list[dict]:
    """[{model, cache, tokens_per_s, mb_per_token}] from a full gpu_check run's decode section."""
    if results.get("mode") != "full":
        raise SystemExit(f"error: expected a full gpu_check run's JSON, found mode {results.get('mode')!r}")
    measurements = results["sections"]["decode"]["measurements"]
    settings = []
    for key, value in measurements.items():
        match = LABEL.match(key)
        if match:
            model, cache = match.group(1), None if match.group(3) is None else int(match.group(3))
            label = key.removesuffix(": decode tokens/s")
            settings.append({"model": model, "cache": cache, "tokens_per_s": value,
                             "mb_per_token": measurements.get(f"{label}: MB moved per token", 0.0)})
    return settings


def decode_bound_settings(results: dict) -> list[dict]:
    """[{model, cache, tokens_per_s, hit_rate, device_budget_gb}] from bench.gpu_decode_bound's JSON: the resident
    and fetch settings without prefetch of its default variant and of the GPT-OSS-120B shape (whose offloaded
    placement is a device budget, `cache` None)."""
    from bench.gpu_decode_bound import BIG

    if "variants" not in results:
        raise SystemExit("error: expected bench.gpu_decode_bound's JSON (a 'variants' object), found keys "
                         f"{sorted(results)}")
    settings = []
    for variant in ("default", BIG):
        for row in results["variants"].get(variant, {}).get("rows", []):
            if row["miss_mode"] not in ("resident", "fetch") or row.get("prefetch"):
                continue
            budget = row.get("device_budget_gb")
            settings.append({"model": row["model"], "tokens_per_s": row["tokens_per_s"],
                             "cache": None if row["miss_mode"] == "resident" or budget else row["cache"],
                             "device_budget_gb": None if row["miss_mode"] == "resident" else budget,
                             "hit_rate": row.get("hit_rate")})
    return settings


def settings_of(results: dict) -> list[dict]:
    """The measured settings of either run's JSON (bench.gpu_decode_bound's has 'variants')."""
    return decode_bound_settings(results) if "variants" in results else measured_settings(results)


def config_of(model: str, smoke: bool) -> tuple[dict, str | None]:
    """(the config a measured model had, the expert dtype it was loaded with): gpu_check's speed models in bf16, or
    the GPT-OSS-120B shape with MXFP4 experts."""
    from bench.gpu_decode_bound import BIG, big_config

    if model == BIG:
        return big_config(smoke), "mxfp4"
    spec = dict(smoke_spec(SPEED_MODELS[model], num_hidden_layers=SMOKE_LAYERS) if smoke else SPEED_MODELS[model])
    # smoke: the config without transformers' defaults (model_config), so no PyTorch to import
    return model_config(spec.pop("model_type"), smoke, **spec), None


def hit_rate(setting: dict, plan) -> float:
    """The offloaded layers' hit rate that moves the measured bytes: 1 - misses / accesses."""
    accesses = len(plan.placement.offloaded_layers) * plan.config.num_experts_per_tok
    misses = setting["mb_per_token"] * 1e6 / plan.placement.expert_bytes
    return max(0.0, 1.0 - misses / accesses) if accesses else 1.0


def calibrate(results_path: Path, target: str, workdir: Path, smoke: bool = False) -> list[dict]:
    import jmoe

    rows = []
    settings = settings_of(json.loads(results_path.read_text()))
    for setting in settings[1:2] if smoke else settings:  # smoke: one offloaded setting
        config, expert_dtype = config_of(setting["model"], smoke)
        directory = write_header_only_checkpoint(workdir / re.sub(r"\W+", "_", setting["model"]),
                                                 {**config, "dtype": "bfloat16", "torch_dtype": "bfloat16"})
        placing = dict(cache=setting["cache"], target=target, context=CONTEXT, expert_dtype=expert_dtype,
                       device_budget_gb=setting.get("device_budget_gb"), extrapolate_layers=True)
        offloaded = setting["cache"] is not None or setting.get("device_budget_gb") is not None
        measured_hits = setting.get("hit_rate")
        if offloaded and measured_hits is None:  # the placement (no compile) gives the bytes one missed expert moves
            measured_hits = hit_rate(setting, jmoe.plan(directory, compile=False, **placing))
        plan = jmoe.plan(directory, hit_rate=measured_hits if offloaded else None, **placing)
        low, high = plan.estimate.decode_tokens_per_s_batch1
        measured = setting["tokens_per_s"]
        rows.append({**setting, "hit_rate": plan.estimate.hit_rate, "low": low, "high": high,
                     "within": low <= measured <= high, "measured / low": measured / low})
    return rows


def markdown(rows: list[dict], results_path: Path, target: str) -> str:
    lines = [f"jmoe.plan's batch-1 decode estimate for `{target}` (compiled programs, header-only checkpoints of "
             f"the models the run decoded, context {CONTEXT}, the hit rate each setting measured) against the "
             f"tokens/s measured in `{results_path}`.", "",
             "| model | cache | hit rate | estimate low | estimate high | measured | in range | measured / low |",
             "|---|---|---|---|---|---|---|---|"]
    for r in rows:
        where = (f"device budget {r['device_budget_gb']:g} GB" if r.get("device_budget_gb")
                 else "resident" if r["cache"] is None else r["cache"])
        lines.append(f"| {r['model']} | {where} | {r['hit_rate']:.3f} | "
                     f"{r['low']:.1f} | {r['high']:.1f} | {r['tokens_per_s']:.1f} | {'yes' if r['within'] else 'NO'} "
                     f"| {r['measured / low']:.2f} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(prog="python -m bench.plan_calibration", description=__doc__.splitlines()[0])
    p.add_argument("--results", type=Path, default=Path("bench/results/gpu_check_nvidia_h100_80gb_hbm3.json"))
    p.add_argument("--target", default="h100")
    add_smoke_argument(p)
    args = p.parse_args(argv)
    with smoke_run(args), tempfile.TemporaryDirectory() as workdir:
        rows = calibrate(args.results, args.target, Path(workdir), args.smoke)
        text = markdown(rows, args.results, args.target)
        print(text)
        print(write_result(f"plan_calibration_{args.target}.md", "Plan speed estimate against a GPU's measurements",
                           text))


if __name__ == "__main__":
    main()
