"""Run by tests/test_expert_parallel.py in a process of its own with several CPU devices (JAX_NUM_CPU_DEVICES):
loads each checkpoint on one device and over an expert mesh in every case given, generates and computes logits
with both, and prints one JSON report.
Usage: python tests/expert_parallel_child.py ARGUMENTS_JSON"""

from __future__ import annotations

import json
import re
import sys

import jax
import numpy as np

import jmoe
import jmoe.api
from jmoe.collector import freeze_loaded
from jmoe.decode import chain

PROMPTS = [[3, 5, 7, 9, 11, 2], [4, 1, 8]]  # two rows of different lengths: a padded prompt, then decode
LOGIT_TOKENS = [[3, 5, 7, 9, 11, 2, 6], [1, 1, 4, 9, 2, 3, 8]]
NEW_TOKENS = 5
# Tokens each MoE layer routes in `run`: the prompts' real tokens, one per row at each later step, the logits' rows
ROUTED_TOKENS = sum(map(len, PROMPTS)) + (NEW_TOKENS - 1) * len(PROMPTS) + sum(map(len, LOGIT_TOKENS))
LAYERS_PER_PROGRAM = chain.LAYERS_PER_PROGRAM


def accesses(model) -> dict[int, int]:
    """Expert accesses per MoE layer, added up over the devices."""
    out: dict[int, int] = {}
    for row in model.stats():
        out[row["layer"]] = out.get(row["layer"], 0) + row["hits"] + row["misses"]
    return out


def run(model):
    tokens = model.generate(PROMPTS, max_new_tokens=NEW_TOKENS)
    return tokens, np.asarray(model.logits(LOGIT_TOKENS))


def expert_shards(model) -> list[dict]:
    """Per MoE layer, how its w_down is laid out: experts per addressable shard, devices, memory kind."""
    out = []
    for block in model.module().moe_blocks():
        array = block.experts.w_down.get_value()
        out.append({"experts_per_shard": [s.data.shape[0] for s in array.addressable_shards],
                    "devices": len(array.sharding.device_set), "memory_kind": array.sharding.memory_kind})
    return out


COLLECTIVES = ("all-reduce", "all-gather", "all-to-all", "ragged-all-to-all", "collective-permute", "reduce-scatter")


def collectives(model) -> list[dict]:
    """Per compiled generation step: its tokens shape and every collective in its HLO as [op, result shape]."""
    pattern = re.compile(r"= (.+?) (" + "|".join(COLLECTIVES) + r")(?:-start)?\(")
    out = []
    for step in model.compiled_steps():
        ops = [[m.group(2), re.sub(r"\{[^}]*\}", "", m.group(1))]
               for m in map(pattern.search, step["hlo"].splitlines()) if m]
        out.append({"tokens": list(step["tokens"]), "ops": ops})
    return out


def main(cases: list[dict]) -> None:
    freeze_loaded()  # JAX and jmoe, out of the garbage collector's walks while the cases compile
    runs = []
    for case in cases:
        references = {}  # expert storage -> the one-device model's (every expert resident) tokens and logits
        for options in case["options"]:
            chain.LAYERS_PER_PROGRAM, jmoe.api.chains = LAYERS_PER_PROGRAM, chain.chains  # the reference: as shipped
            storage = options.get("expert_dtype")
            if storage not in references:
                references[storage] = run(jmoe.load(case["path"], expert_dtype=storage, progress=False))
            ref_tokens, ref_logits = references[storage]
            scale = float(np.abs(ref_logits).max())
            kwargs = dict(options)
            if "mesh_devices" in kwargs:
                kwargs["mesh"] = jax.make_mesh((kwargs.pop("mesh_devices"),), ("expert",))
            if kwargs.pop("chained", False):  # in blocks of one layer, however few the model's (jmoe.decode.chain)
                chain.LAYERS_PER_PROGRAM, jmoe.api.chains = 1, lambda config, engine: True
            model = jmoe.load(case["path"], progress=False, **kwargs)
            tokens, logits = run(model)
            runs.append({"case": case["name"], "options": options, "tokens_equal": tokens == ref_tokens,
                         "chained": model.step_chain is not None,
                         "logits_error": float(np.abs(logits - ref_logits).max()) / scale,
                         "accesses": accesses(model),
                         "routed_accesses": ROUTED_TOKENS * model.config.num_experts_per_tok,
                         "stats_devices": sorted({row["device"] for row in model.stats()}),
                         "shards": expert_shards(model), "collectives": collectives(model)})
    print(json.dumps(runs))


if __name__ == "__main__":
    main(json.loads(sys.argv[1]))
