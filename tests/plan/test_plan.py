"""``kvtier plan``: the shapes, the step model's binding resource, the capacity search, the
reuse overlap, and the command's report and figures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvtier.cli import main as cli_main
from kvtier.plan import PRESETS, decode_step, hardware, max_sessions, model_shape, reuse_ttft
from kvtier.plan.workload import workload
from kvtier.random_weights import model_config

TRACE = Path(__file__).parents[2] / "benchmarks" / "traces" / "conversation_trace.jsonl.xz"


def test_the_embedded_model_shape_matches_its_weights() -> None:
    shape = model_shape(None, dtype_bytes=4)
    assert shape.params == pytest.approx(134.5e6, rel=0.01)  # SmolLM2-135M
    assert shape.kv_bytes_per_token == 2 * 30 * 3 * 64 * 4  # 46 KB, DESIGN.md
    llama = model_shape("llama3-8b")
    assert llama.params == pytest.approx(8.03e9, rel=0.01)
    assert llama.kv_bytes_per_token == 2 * 32 * 8 * 128 * 2  # 128 KiB in bf16


def test_a_folder_config_and_a_bad_name(tmp_path: Path) -> None:
    model_config("llama", "smollm2-135m").save_pretrained(tmp_path)
    assert model_shape(str(tmp_path), 4).params == model_shape(None, 4).params
    with pytest.raises(ValueError, match="neither a preset"):
        model_shape("no-such-model")
    with pytest.raises(ValueError, match="unknown 'tpu'"):
        hardware("tpu", None)


def test_the_binding_resource_follows_the_short_stave() -> None:
    model = model_shape("llama3-8b")
    h100 = PRESETS["h100-pcie5"]
    short = decode_step(model, h100, 1, 1024, 1.0, "resident")
    assert short.binding == "compute"  # one sequence: the weights' read
    many = decode_step(model, h100, 64, 32768, 0.2, "stream")
    assert many.binding == "link" and many.seconds == pytest.approx(many.busy_s["link"])
    auto = decode_step(model, h100, 64, 32768, 0.2, "auto")
    host = decode_step(model, h100, 64, 32768, 0.2, "host")
    assert auto.seconds <= min(many.seconds, host.seconds) * (1 + 1e-9)
    assert 0 < auto.hosted_fraction < 1  # both lanes busy: the split balances them


def test_the_capacity_search_finds_the_largest_batch_within_the_slo() -> None:
    model, h100 = model_shape("llama3-8b"), PRESETS["h100-pcie5"]
    cap = max_sessions(model, h100, 8192, 0.05)
    assert cap is not None and cap.step_s <= 0.05
    looser = max_sessions(model, h100, 8192, 0.2)
    assert looser is not None and looser.sessions > cap.sessions
    more = max_sessions(model, h100.with_cxl(), 8192, 0.05)
    assert more is not None and more.sessions >= cap.sessions  # CXL only adds capacity
    assert max_sessions(model, h100, 8192, 1e-6) is None


def test_reuse_overlaps_recompute_and_load_where_they_meet() -> None:
    model, a10g = model_shape("llama3-8b"), PRESETS["a10g-pcie4"]
    t = reuse_ttft(model, a10g, 16384, 6.0)
    assert t["overlap_s"] < min(t["load_s"], t["recompute_s"])
    assert 0 < t["front_tokens"] < 16384


def test_a_trace_workload() -> None:
    load = workload(str(TRACE))
    assert load.context_p90 >= load.context > 1000 and load.rate_per_s > 1
    assert workload("context=2048,sessions=8").sessions == 8
    with pytest.raises(ValueError, match="unknown key 'ctx'"):
        workload("ctx=10")


def test_the_command_reports_and_draws(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "plan.json"
    code = cli_main(
        [
            "plan",
            "--model",
            "llama3-8b",
            "--hardware",
            "gh200-c2c+cxl",
            "--workload",
            "context=32768,sessions=64",
            "--tpot-ms",
            "50",
            "--plots",
            str(tmp_path),
            "--json",
            str(out),
        ]
    )
    assert code == 0
    text = capsys.readouterr().out
    assert "binding:" in text and "on paper" in text and "sessions within 50 ms" in text
    figures = sorted(p.name for p in tmp_path.glob("*.png"))
    assert figures == [
        "plan-llama3-8b-gh200-c2c+cxl-barrel.png",
        "plan-llama3-8b-gh200-c2c+cxl-steps.png",
    ]
    result = json.loads(out.read_text())
    assert result["on_paper"] and result["capacity"]["sessions"] >= 1
    assert cli_main(["plan", "--hardware", "tpu"]) == 2
