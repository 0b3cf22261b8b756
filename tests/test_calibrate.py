"""``kvtier calibrate`` on a tiny random llama: every rate measured and positive, the fits
monotone, the profile written and found again on this machine only, and the CLI's report."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from kvtier import calibrate as cal
from kvtier import native, profiles
from kvtier.cli import main as cli_main
from tests.engine.tiny import save_folder, tokenizer

__all__ = ["tokenizer"]  # the fixture


@pytest.fixture(scope="module")
def profile_and_path(
    tmp_path_factory: pytest.TempPathFactory, tokenizer: Any
) -> tuple[dict[str, Any], Path]:
    root = tmp_path_factory.mktemp("calibrate")
    folder = save_folder(root / "tiny", tokenizer)
    out = root / "profile.json"
    code = cli_main(
        ["calibrate", "--model", str(folder), "--quick", "--out", str(out), "--disk-dir", str(root)]
    )
    assert code == 0
    return json.loads(out.read_text()), out


def test_every_rate_is_measured(profile_and_path: tuple[dict[str, Any], Path]) -> None:
    profile, _ = profile_and_path
    assert profile["version"] == profiles.PROFILE_VERSION
    assert profile["machine"]["identity"] == profiles.machine_identity()
    link = profile["link"]
    assert link["kind"].startswith("memcpy")  # no accelerator here
    assert min(link["h2d_gbps"], link["d2h_gbps"], link["each_way_both_busy_gbps"]) > 0
    attention = profile["attention"]["host"]
    assert set(attention) == ({"torch", "kvtier"} if native.ops() is not None else {"torch"})
    assert all(set(rates) >= {"1"} and min(rates.values()) > 0 for rates in attention.values())
    device = profile["attention"]["device"]
    assert device["kernel"] == ("kvtier" if native.ops() is not None else "torch")
    assert device["gbps"] > 0
    rates = profiles.placement_rates(profile)  # what placement "auto" reads
    assert rates.link_gbps == link["h2d_gbps"] and not rates.concurrent
    disk = profile["disk"]
    assert disk["write_gbps"] > 0 and disk["read_gbps"] > 0
    assert not list(Path(disk["folder"]).glob("kvtier-calibrate-*"))  # scratch removed
    prefill, decode = profile["compute"]["prefill"], profile["compute"]["decode"]
    assert prefill["prompt_tokens"] == [64, 256] and all(s > 0 for s in prefill["seconds"])
    assert all(m > 0 for m in decode["ms_per_token"])
    fit = prefill["fit"]
    assert fit["s_per_token"] >= 0 and fit["s_per_token_squared"] >= 0
    assert fit["s_per_token"] > 0 or fit["s_per_token_squared"] > 0
    assert profile["model"]["kv_bytes_per_token"] > 0 and "remote" not in profile


def test_a_profile_is_found_on_this_machine_only(
    profile_and_path: tuple[dict[str, Any], Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    profile, _ = profile_and_path
    model_id = profile["model"]["id"]
    assert profiles.load_profile(model_id, tmp_path) is None  # nothing saved there yet
    monkeypatch.setenv("KVTIER_CACHE_DIR", str(tmp_path))
    path = profiles.save_profile(profile)
    assert path == profiles.profile_path(model_id, tmp_path) and path.is_file()
    assert profiles.load_profile(model_id, tmp_path) == profile
    other = {**profile, "machine": {**profile["machine"], "identity": "another"}}
    path.write_text(json.dumps(other))
    assert profiles.load_profile(model_id, tmp_path) is None


def test_the_fits() -> None:
    quad = cal.fit([100, 200, 400], [0.1 + 0.01, 0.2 + 0.04, 0.4 + 0.16], ("a", "b"))
    assert quad["a"] == pytest.approx(1e-3, rel=1e-6) and quad["b"] == pytest.approx(1e-6, rel=1e-6)
    line = cal.fit([0, 10], [5.0, 7.0], ("c", "d"), intercept=True)
    assert line == pytest.approx({"c": 5.0, "d": 0.2})


def test_a_bad_flag_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        cli_main(["calibrate", "--threads", "many"])
    assert "invalid int value" in capsys.readouterr().err


def test_the_decode_batch_is_measured(profile_and_path: tuple[dict[str, Any], Path]) -> None:
    profile, _ = profile_and_path
    batch = profile["decode_batch"]
    assert batch["batch"] == [1, 2] and all(ms > 0 for ms in batch["step_ms"])
    assert batch["fit"]["ms"] >= 0 and batch["fit"]["ms_per_row"] >= 0
