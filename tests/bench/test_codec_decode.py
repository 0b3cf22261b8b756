"""The codec bench's link-bound decode on a tiny random-weight model: the int8 host streams
its encoded bytes (about a third of raw's at this chunk size), the throttles are derived
from raw's own calibration run, and every factor reports both codecs' steps."""

from __future__ import annotations

import pytest

from kvbench.codec_decode import FACTORS, KEY_FACTOR, link_bound_decode
from kvbench.setup import load_bench, model_parser
from kvtier.codec import get_codec


def test_link_bound_decode_streams_fewer_bytes_from_an_int8_host() -> None:
    args = model_parser("codec", None).parse(["--random-shape", "tiny"])
    bench = load_bench(args, 2048)
    result = link_bound_decode(bench, context=1024, new_tokens=4, repeats=1, seed=0)
    raw, int8 = result["calibration"]["raw"], result["calibration"]["int8"]
    layout = bench.layout
    assert raw["bytes_per_step"] > 0
    assert int8["bytes_per_step"] / raw["bytes_per_step"] == pytest.approx(
        get_codec("int8").encoded_nbytes(layout) / layout.chunk_nbytes
    )
    assert set(result["by_factor"]) == {f"{f:g}" for f in FACTORS}
    for factor in FACTORS:
        at = result["by_factor"][f"{factor:g}"]
        # raw's bytes take `factor` unthrottled raw steps (3 significant digits of GB/s)
        link_s = raw["bytes_per_step"] / (at["link_gbps"] * 1e9)
        assert link_s == pytest.approx(factor * raw["step_s"], rel=0.01)
        assert at["bytes_per_step"]["int8"] < at["bytes_per_step"]["raw"]
    key = result["by_factor"][f"{KEY_FACTOR:g}"]
    assert result["speedup_int8"] == key["step_s"]["raw"] / key["step_s"]["int8"]
