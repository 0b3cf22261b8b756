"""``kvtier run`` (``make run``), the main job, end to end on the embedded model at a short
context: both turns' tokens equal transformers', the second turn reuses the first's KV, and
the tables of what moved where are printed; with a lossy host codec the run says so."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from kvtier.run import main

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("host_codec", ["raw", "int8"])
def test_kvtier_run_reuses_the_first_turn_and_reports_what_moved(
    host_codec: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "run.json"
    argv = ["--context", "512", "--budget", "0.25", "--max-new-tokens", "6"]
    threads = torch.get_num_threads()
    try:  # kvtier run sets one compute thread on a CPU-only machine
        assert main([*argv, "--host-codec", host_codec, "--json", str(out)]) == 0
    finally:
        torch.set_num_threads(threads)
    summary = json.loads(out.read_text())["summary"]
    assert summary["codecs"] == {"host": host_codec, "disk": "raw"}
    assert summary["second_turn_reused_tokens"] >= 512
    printed = capsys.readouterr().out
    assert "turn 1, what moved where:" in printed and "link host->device" in printed
    if host_codec == "raw":
        assert summary["tokens_identical"] is True
        assert "tokens identical to transformers DynamicCache in both turns" in printed
    else:
        assert f"chunks stored as {host_codec}, a lossy codec" in printed
