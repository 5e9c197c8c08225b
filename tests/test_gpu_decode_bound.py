"""bench.gpu_decode_bound's arithmetic and choices, without running a model (its smoke run is in
tests/test_bench_smoke.py): the bounds of issue #54, which settings each variant measures, and the JSON's fields."""

import argparse

import pytest

from bench.gpu_decode_bound import ROW_KEYS, bounds, report, settings_of


@pytest.mark.quick
def test_bounds_add_or_overlap_the_resident_step_and_the_link_time():
    row = dict(miss_mode="fetch", link_gbs=50.0, resident_step_ms=2.0, mb_over_link_per_token=150.0, tokens_per_s=100.0)
    out = bounds(row)
    assert out["link_ms"] == pytest.approx(3.0)  # 150 MB at 50 GB/s
    assert out["no_overlap_bound_ms"] == pytest.approx(5.0) and out["overlap_bound_ms"] == pytest.approx(3.0)
    assert out["share_of_no_overlap_bound"] == pytest.approx(0.5)  # 5 ms of the 10 ms a token took
    assert out["share_of_overlap_bound"] == pytest.approx(0.3)
    assert bounds({**row, "miss_mode": "resident"}) == {} and bounds({**row, "resident_step_ms": None}) == {}


def test_the_default_variant_measures_every_cache_and_miss_mode_resident_first():
    default = settings_of("default", small=True, smoke=False)
    flags = settings_of("latency-hiding scheduler", small=True, smoke=False)
    for settings in (default, flags):
        for model in {s["model"] for s in settings}:
            mine = [s for s in settings if s["model"] == model]
            assert mine[0]["cache"] is None and all(s["cache"] is not None for s in mine[1:])
    assert {s["miss_mode"] for s in default if s["cache"] is not None} == {"fetch", "host", "direct"}
    assert {s["miss_mode"] for s in flags if s["cache"] is not None} == {"fetch", "direct"}  # host aborted XLA before
    for settings in (default, flags):  # item 4: each model's smallest cache with router prefetch too
        assert {s["model"] for s in settings if s.get("prefetch")} == {s["model"] for s in settings}
    modes = [s["miss_mode"] for s in default if s["cache"] is not None and not s.get("prefetch")]
    assert modes.index("host") > modes.index("direct")  # after the others: a death there costs the least


def test_the_json_carries_the_issues_fields_for_the_shipped_variant_only():
    rows = [dict(model="m", experts=8, cache=None, miss_mode="resident", step_ms=1.0, tokens_per_s=900.0, host_ms=0.1,
                 mb_moved_per_token=0.0, link_gbs=50.0, resident_step_ms=None),
            *[dict(model="m", experts=8, cache=2, miss_mode=mode, step_ms=3.0, tokens_per_s=300.0, host_ms=0.5,
                   mb_moved_per_token=40.0, link_gbs=50.0, resident_step_ms=1.0) for mode in ("fetch", "direct")]]
    args = argparse.Namespace(commit="a" * 40, tokens=4, budget_s=60.0, small=True, smoke=False)
    payload, text = report(args, {"default": {"device": "cpu", "jax": "0", "rows": rows, "exits": [0]}})
    assert payload["commit"] == "a" * 40 and {"date", "device", "jax", "settings"} <= set(payload)
    assert [s["cache"] for s in payload["settings"]] == [None, 2]  # resident and fetch: what ships today
    assert all(list(s) == list(ROW_KEYS) for s in payload["settings"])
    assert "m, cache 2, direct" in text
    assert "not run (out of time): mixtral, resident" in text  # the default variant's settings it did not reach


def test_the_big_shape_built_in_memory_is_placed_as_load_places_its_checkpoint(tmp_path):
    """Issue #54 item 7's model is built in memory (no disk could hold it): its placement must be the one jmoe.load
    (and jmoe.plan) give the same config, its experts MXFP4 in pinned host memory with sane block scales."""
    import numpy as np

    import jmoe
    from bench.gpu.in_memory import MXFP4_SCALE_BYTE, InMemoryModel
    from bench.gpu_decode_bound import big_config
    from bench.plan import write_header_only_checkpoint
    from jmoe.memory import PINNED_HOST

    config = big_config(small=True)
    built = InMemoryModel(config, cache=2, expert_dtype="mxfp4")
    planned = jmoe.plan(write_header_only_checkpoint(tmp_path / "headers", config), cache=2, expert_dtype="mxfp4",
                        compile=False)
    assert built.placement == planned.placement and set(built.placement.caches) == {2}
    experts = built.module.moe_blocks()[0].experts
    codes, scales = experts.w_gate_up[...], experts.w_gate_up_scale[...]
    assert codes.dtype == np.uint8 and codes.sharding.memory_kind == PINNED_HOST
    assert np.all(np.asarray(scales) == MXFP4_SCALE_BYTE) and len(np.unique(np.asarray(codes))) > 200  # random bytes
    assert np.all(np.asarray(built.module.layers[0].input_norm.scale[...]) == 1)


@pytest.mark.quick
def test_a_copy_issued_outside_the_step_is_scored_between_serial_and_hidden():
    from bench.gpu.transfer_overlap import overlap_share

    # a 4 ms copy beside 5 ms of compute: 9 ms serial, 5 ms hidden entirely
    assert overlap_share("copy, then compute", 4.0, 5.0, 9.0) == pytest.approx(0.0)
    assert overlap_share("copy, then compute", 4.0, 5.0, 5.0) == pytest.approx(1.0)
    assert overlap_share("compute, then copy", 4.0, 5.0, 7.0) == pytest.approx(0.5)
    # between two steps it can hide behind the second only: 14 ms serial, 10 ms at best
    assert overlap_share("between two steps", 4.0, 5.0, 14.0) == pytest.approx(0.0)
    assert overlap_share("between two steps", 4.0, 5.0, 10.0) == pytest.approx(1.0)
    assert overlap_share("between two steps", 6.0, 5.0, 11.0) == pytest.approx(1.0)  # the copy the longer: 5 + 6


def test_the_report_shows_copies_issued_outside_the_step_or_why_they_were_not_measured():
    orders = {order: {"ms": 6.0, "overlap_share": 0.75} for order in
              ("copy, then compute", "compute, then copy", "between two steps")}
    overlap = {"copy_mb": 1073.7, "matmul_width": 4096, "pinned_numpy_view": "np.from_dlpack: a copy",
               "sources": {"own pinned-host array": dict(copy_ms=20.0, gbs=53.7, call_returns_ms=0.05, compute_ms=21.0,
                                                         orders=orders),
                           "one of a stacked pinned-host array": {"failed": "ValueError: memory kinds"}}}
    args = argparse.Namespace(commit="a" * 40, tokens=4, budget_s=60.0, small=True, smoke=False)
    _, text = report(args, {"default": {"device": "gpu", "jax": "0", "rows": [], "exits": [0],
                                        "device_put_overlap": overlap}})
    assert "| own pinned-host array | 20 | 53.7 | 0.05 | 21 | 6 (0.75) | 6 (0.75) | 6 (0.75) |" in text
    assert "A NumPy view of pinned-host memory: np.from_dlpack: a copy." in text
    assert "| one of a stacked pinned-host array | **failed**: ValueError: memory kinds |" in text  # the others run
    _, text = report(args, {"default": {"device": "gpu", "jax": "0", "rows": [], "exits": [0],
                                        "device_put_overlap": {"failed": "XlaRuntimeError: out of memory"}}})
    assert "device_put_overlap: **failed**: XlaRuntimeError: out of memory" in text


def test_the_kernel_forms_report_names_each_forms_speed_and_a_failed_shape():
    from bench.gpu.kernel_forms import markdown

    form = {"us": 20.0, "gbs": 2900.0, "share_of_hbm": 0.9}
    results = {"read_gbs": 3200.0, "calls": 50, "shapes": {
        "mixtral-shaped, bf16": {"mb_read": 58.7, "matrix-vector": form, "row tiles": {**form, "us": 40.0},
                                 "relative_difference": 1e-3},
        "gpt-oss-120b-shaped, mxfp4": {"failed": "CompilationError: too many registers"}}}
    text = "\n".join(markdown(results))
    assert "| mixtral-shaped, bf16 | 58.7 | 20 | 2900 | 0.90 | 40 | 2900 | 0.90 | 1.00e-03 |" in text
    assert "| gpt-oss-120b-shaped, mxfp4 | **failed**: CompilationError: too many registers |" in text


def test_the_attention_forms_report_names_each_forms_speed_and_a_failed_shape():
    from bench.gpu.attention_forms import markdown

    form = {"us": 20.0, "gbs": 2900.0, "share_of_hbm": 0.9}
    results = {"read_gbs": 3200.0, "calls": 50, "shapes": {
        "mixtral-shaped, 1 row, 1k of 4k": {"mb_read": 4.19, "xla": {**form, "us": 60.0, "share_of_hbm": 0.02},
                                            "kernel, parts of 256": {**form, "difference": 2e-3},
                                            "kernel, parts of 1024": {**form, "us": 30.0, "difference": 1e-3}},
        "gpt-oss-shaped, 8 rows, 8k": {"failed": "CompilationError: out of shared memory"}}}
    text = "\n".join(markdown(results))
    assert "| shape | MB visible | xla us (share of HBM) | kernel, parts of 256 us (share of HBM) |" in text
    assert "| mixtral-shaped, 1 row, 1k of 4k | 4.19 | 60 (0.02) | 20 (0.90) | 30 (0.90) | 2.00e-03 |" in text
    assert "| gpt-oss-shaped, 8 rows, 8k | **failed**: CompilationError: out of shared memory | | | |" in text


def test_the_projection_forms_report_names_each_forms_speed_and_a_failed_shape():
    from bench.gpu.projection_forms import markdown

    form = {"us": 10.0, "gbs": 2400.0, "share_of_hbm": 0.75}
    results = {"read_gbs": 3200.0, "calls": 50, "shapes": {
        "gpt-oss-120b attention output, 1 row": {"mb_read": 23.6, "xla": {**form, "us": 14.0, "share_of_hbm": 0.53},
                                                 "kernel, 16 x 256": {**form, "difference": 4e-3},
                                                 "kernel, 32 x 256": {**form, "us": 12.0, "difference": 2e-3}},
        "deepseek-v3 q_a, 1 row": {"failed": "CompilationError: out of registers"}}}
    text = "\n".join(markdown(results))
    assert "| shape | MB read | xla us (share of HBM) | kernel, 16 x 256 us (share of HBM) |" in text
    assert "| gpt-oss-120b attention output, 1 row | 23.6 | 14 (0.53) | 10 (0.75) | 12 (0.75) | 4.00e-03 |" in text
    assert "| deepseek-v3 q_a, 1 row | **failed**: CompilationError: out of registers | | | |" in text
