"""The pure parts of ``kvtier bench peers``: vLLM's folder from a saved model folder, the
parsing of a vLLM client result file, and the summary arithmetic. vLLM itself is never
installed or run here."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvbench import peers
from kvbench.peer_runs import serve_figures
from kvbench.serve_client import Reply
from kvbench.vllm_env import MAX_MODEL_LEN, convert_folder
from kvbench.vllm_offline import cpu_bind
from tests.engine.tiny import embedded_tokenizer, save_folder


def test_convert_folder_writes_what_vllm_reads(tmp_path: Path) -> None:
    source = save_folder(tmp_path / "src", embedded_tokenizer())
    config = json.loads((source / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "gguf"}  # as kvtier's GGUF load marks it
    config["rope_parameters"] = {"rope_theta": 12345.0, "rope_type": "default"}
    config.pop("rope_theta", None)
    (source / "config.json").write_text(json.dumps(config))
    (source / "chat_template.jinja").write_text("{{ messages }}")
    dest = convert_folder(source, tmp_path / "vllm")
    out = json.loads((dest / "config.json").read_text())
    assert "quantization_config" not in out
    assert out["rope_theta"] == 12345.0
    assert out["torch_dtype"] == "float32"
    tok = json.loads((dest / "tokenizer_config.json").read_text())
    assert tok["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert tok["model_max_length"] == MAX_MODEL_LEN
    assert tok["chat_template"] == "{{ messages }}"
    assert (dest / "model.safetensors").read_bytes() == (source / "model.safetensors").read_bytes()
    assert (dest / "tokenizer.json").is_file()
    assert not (tmp_path / "vllm.tmp").exists()
    weights = peers.safetensors_nbytes(dest / "model.safetensors")
    assert 0 < weights <= (dest / "model.safetensors").stat().st_size


def test_serve_figures_reads_a_client_result_file() -> None:
    raw = {
        "duration": 55.6,
        "completed": 32,
        "failed": 0,
        "total_output_tokens": 2048,
        "output_throughput": 36.8,
        "median_tpot_ms": 141.0,
        "median_ttft_ms": 900,
        "ttfts": [0.1] * 32,
    }
    figures = serve_figures(raw)
    assert figures == {
        "wall_s": 55.6,
        "completed": 32,
        "failed": 0,
        "errors": [],
        "output_tokens": 2048,
        "output_tps": 36.8,
        "median_tpot_ms": 141.0,
        "median_ttft_ms": 900.0,
    }
    assert serve_figures({})["output_tps"] is None


def test_a_serving_run_with_failed_requests_counts_no_speed() -> None:
    """13 of 32 completed in 15.8 s reads as 52.7 tok/s; it is no serving speed."""
    raw = {
        "duration": 15.8,
        "completed": 13,
        "failed": 19,
        "total_output_tokens": 832,
        "output_throughput": 52.7,
        "errors": ["", "Bad Request", "Bad Request", "Traceback ... ClientPayloadError"],
    }
    figures = serve_figures(raw)
    assert figures["output_tps"] is None and figures["failed"] == 19
    assert figures["errors"] == ["Bad Request", "Traceback ... ClientPayloadError"]


def test_summary_arithmetic() -> None:
    vllm = {
        "serve_output_tps": 40.0,
        "offline_wall_s": 20.0,
        "decode_long_ms": 50.0,
        "decode_short_ms": 45.0,
        "ttft_cold_s": 20.0,
        "ttft_warm_s": 0.5,
    }
    kvtier = {
        "serve_output_tps": 20.0,
        "offline_wall_s": 40.0,
        "decode_long_ms": 100.0,
        "decode_short_ms": 30.0,
        "ttft_cold_s": 10.0,
        "ttft_warm_s": 1.0,
    }
    summary = peers.summarize(vllm, kvtier, bound_ms=24.0, start_warm_s=12.5)
    assert summary == {
        "serve_output_tps_vs_vllm": 0.5,
        "offline_16x512_speed_vs_vllm": 0.5,
        "decode_4k_ms_vs_vllm": 2.0,
        "ttft_warm_4k_vs_vllm": 2.0,
        "ttft_cold_4k_vs_vllm": 0.5,
        "decode_short_vs_bound": 0.8,
        "start_warm_s": 12.5,
    }
    assert set(summary) == set(peers.GOALS)
    assert peers.meets(0.5, ">= 1.2") is False and peers.meets(0.5, "<= 0.8") is True
    assert peers.meets(None, "<= 1.0") is None
    missing = peers.summarize({**vllm, "serve_output_tps": None}, kvtier, None, 1.0)
    assert missing["serve_output_tps_vs_vllm"] is None and missing["decode_short_vs_bound"] is None


def test_decode_ms_and_headline_medians() -> None:
    reply = Reply(index=0, sent_s=1.0, prompt_tokens=16, ttft_s=0.5, completion_tokens=11)
    reply.done_s = 2.5  # 1 s of decode after the first token, over 10 more tokens
    assert peers.decode_ms(reply) == pytest.approx(100.0)
    reply.completion_tokens = 1
    assert peers.decode_ms(reply) is None
    cases = {
        "long": {
            "kvtier": [
                {"decode_ms": 3.0, "ttft_cold_s": 1.0, "ttft_warm_s": None},
                {"decode_ms": 1.0, "ttft_cold_s": 3.0, "ttft_warm_s": 0.2},
            ]
        }
    }
    head = peers.headline(cases, "kvtier")
    assert head["decode_long_ms"] == 2.0 and head["ttft_warm_s"] == 0.2
    assert head["serve_output_tps"] is None


def test_cpu_bind_and_the_kv_split() -> None:
    assert cpu_bind(1) == "0" and cpu_bind(2) == "0-1"
    assert peers.device_mb(4) * 16 + peers.host_mb(4) == 4 * 1024
    assert peers.random_ids(8, 0, 1) == peers.random_ids(8, 0, 1) != peers.random_ids(8, 0, 2)


def test_build_native_before_the_timed_start(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """The bench builds (or loads) kvtier's kernels before it times ``kvtier serve``'s start,
    and says so when they are off."""
    from kvtier import native

    status = native.status()
    seconds = peers.build_native()
    if status.available:
        assert seconds == status.seconds and seconds >= 0.0
    else:
        assert seconds is None
    monkeypatch.setenv(native.ENV_SWITCH, "0")
    assert peers.build_native() is None
    assert "kvtier's CPU kernels: unavailable (KVTIER_NATIVE=0)" in capsys.readouterr().out
