"""docs/benchmarks.md is generated from benchmarks/results/*.json by benchmarks/report.py: it must be up to date, and
every result shape must render its ratio and where it was measured."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "benchmarks" / "report.py"


def _report():
    spec = importlib.util.spec_from_file_location("benchmark_report", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_docs_benchmarks_md_is_up_to_date():
    done = subprocess.run([sys.executable, str(SCRIPT), "--check"], cwd=ROOT, capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stdout + done.stderr


# one minimal result per shape, with the ratio its table must show
SHAPES = {
    "shared_prefix_x.json": ({"rows": [{"G": 8, "P": 289, "C": 32, "prompt_share": 0.9,
                                        "serial": {"ref_s": 1.0, "actor_s": 4.0, "step_s": 9.0},
                                        "shared": {"ref_s": 0.25, "actor_s": 1.0, "step_s": 3.0},
                                        "ratio_ref_plus_actor": 4.0, "ratio_step": 3.0,
                                        "actor_saved_bytes_ratio": 0.25}]}, "4.00×"),
    "vs_trl_x.json": ({"runs": {"trl": [{"step_s": 9.0}], "rollplex": [{"step_s": 4.0}]}, "trl_step_s": 9.0,
                       "rollplex_step_s": 4.0, "ratio": 2.25}, "2.25×"),
    "trl_defaults_x.json": ({"runs": {}, "table": {"kept prefill": {"on_step_s": 2.0, "off_step_s": 2.5,
                                                                     "on_decode_s": 0.5, "off_decode_s": 0.5,
                                                                     "step_ratio": 1.25, "decode_ratio": 1.0}}},
                            "1.25×"),
    "overlap_x.json": ({"modes": {"serial": {"step_s": 6.0}, "shared": {"step_s": 2.0, "decode_s": 1.0,
                                                                         "prefix_s": 0.5, "hidden_s": 0.0,
                                                                         "critical_path_s": 1.5}},
                        "summary": {"step_ratio_serial_over_shared": 3.0}}, "3.00×"),
    "megatron_x.json": ({"rows": [{"run": "hf (shared prefix)", "step_s": 1.0, "vs_hf": 1.0},
                                  {"run": "megatron t=2", "step_s": 1.17, "vs_hf": 1.17, "sync_bytes_copied": 2**20,
                                   "sync_bytes_aliased": 2**21, "plan": {"copied": 2**20, "aliased": 2**21}}]},
                        "1.17×"),
    "shared_decode_x.json": ({"rows": [{"G": 8, "P": 576, "C": 64, "prompt_share": 0.9,
                                        "expanded": {"decode_step_s": 0.05}, "shared": {"decode_step_s": 0.04},
                                        "decode_speedup": 1.25, "kv_ratio": 0.21, "kv_ratio_ideal": 0.2}]},
                             "1.25×"),
    "main_job_x.json": ({"table": {"SFT": {c: {"mean": 0.5, "min": 0.4, "max": 0.6} for c in ("sampled", "greedy",
                                                                                        "format")},
                                   "GRPO": {c: {"mean": 0.875, "min": 0.75, "max": 1.0} for c in ("sampled", "greedy",
                                                                                              "format")}},
                         "runs": {"0": {"heldout": {"GRPO": {"sampled": 0.9, "greedy": 0.95}}, "seconds": 120.0}}},
                        "0.875 [0.750–1.00]"),
    "plan_validation_x.json": ({"rows": [{"benchmark": "vs_trl", "quantity": "TRL step", "kind": "phase",
                                          "predicted": 1.1, "measured": 1.0, "error": 0.1, "within": True}],
                                "summary": {"phases": 1, "phases_within_25pct": 1, "ratios": 0,
                                            "ratios_within_15pct": 0}}, "+10.0%"),
    "memory_x.json": ({"summary": {"off": {"step_s": 2.0, "step_peak_bytes": 3 * 2**20},
                                   "on": {"step_s": 2.2, "step_peak_bytes": 2 * 2**20},
                                   "peak_drop_bytes": 2**20, "step_ratio": 1.1}, "runs": {}}, "1.10×"),
}


@pytest.mark.parametrize("name", sorted(SHAPES))
def test_each_result_shape_renders_its_ratio(tmp_path, name):
    report = _report()
    result, expected = SHAPES[name]
    (tmp_path / name).write_text(json.dumps(result))
    text = report.render(tmp_path)
    section = text.split(f"`{name}`", 1)[1]
    assert expected in section
    assert "commit not recorded" in section  # no run_meta in this result


def test_run_meta_fields_are_shown(tmp_path):
    report = _report()
    meta = {"commit": "abc1234-dirty", "cpu": "Test CPU 9000", "cpus": 2, "date": "2026-12-04T10:00:00+00:00",
            "command": "OMP_NUM_THREADS=2 python benchmarks/bench_vs_trl.py --fp32", "torch": "2.x",
            "precision": "fp32"}
    result = {"meta": meta, **SHAPES["vs_trl_x.json"][0]}
    (tmp_path / "vs_trl_meta.json").write_text(json.dumps(result))
    section = report.render(tmp_path).split("`vs_trl_meta.json`", 1)[1]
    flat = " ".join(section.split())
    for value in ("`abc1234-dirty`", "Test CPU 9000", "2026-12-04T10:00:00+00:00",
                  "`OMP_NUM_THREADS=2 python benchmarks/bench_vs_trl.py --fp32`", "precision fp32"):
        assert value in flat


def test_readme_table_is_rewritten_between_its_markers(tmp_path):
    report = _report()
    (tmp_path / "main_job.json").write_text(json.dumps(SHAPES["main_job_x.json"][0]))
    readme = "intro\n<!-- main-job-table -->\nstale\n<!-- /main-job-table -->\nrest\n"
    written = report.readme_with_table(readme, tmp_path)
    assert written.startswith("intro\n<!-- main-job-table -->\n| model |") and written.endswith("rest\n")
    assert "stale" not in written and "| GRPO | 0.875 [0.750–1.00]" in written
    with pytest.raises(SystemExit, match="main-job-table"):
        report.readme_with_table("no markers", tmp_path)


def test_a_result_without_a_section_is_an_error(tmp_path):
    (tmp_path / "unknown_bench.json").write_text("{}")
    with pytest.raises(SystemExit, match="unknown_bench.json"):
        _report().render(tmp_path)


def test_run_meta_records_where_it_ran():
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        from bench_common import run_meta
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    meta = run_meta()
    assert set(meta) >= {"commit", "cpu", "cpus", "date", "command", "torch"}
    assert meta["date"].endswith("+00:00") and meta["cpus"] >= 1
    assert Path(sys.executable).name in meta["command"]
