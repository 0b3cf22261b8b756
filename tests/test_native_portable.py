"""kvtier's CPU kernels built for a CPU without AVX-512 (x86-64-v3: AVX2 and FMA), as a
user's older machine builds them with ``-march=native``: they compile, and the projection
kernel (float32 and bf16 pairs, whose bf16 path then takes two FMAs a pair; float32 and
bf16 code panels, widened without AVX-512's unpacks) and the prefill attention give the
reference results. The build runs in a subprocess with its own flags
and library folder (about 30 s on 2 cores)."""

from __future__ import annotations

import os
import platform
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(platform.machine() != "x86_64", reason="x86-64-v3 is an x86-64 level"),
]

CHECKS = textwrap.dedent(
    """
    import sys
    import torch
    import torch.nn.functional as F
    import kvtier.native as native

    native.CFLAGS = ("-O3", "-march=x86-64-v3", "-fopenmp")
    status = native.status()
    assert status.how == "compiled", status
    ops = native.ops()
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 9, 17):
        x = torch.randn(rows, 150, generator=gen)
        w = torch.randn(40, 150, generator=gen)
        got = ops.linear_panels(x, ops.pack_panels(w), None, 40)
        torch.testing.assert_close(got, F.linear(x, w))
        low = w.bfloat16()
        got = ops.linear_panels(x, ops.pack_panels(low), None, 40)
        want = F.linear(x.bfloat16().double(), low.double()).float()
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    from kvtier.engine.weight_codes import find_codes, pack_code_panels
    d = (torch.rand(40, 5, 1, generator=gen) / 50).half().float()  # Q4_1's form
    m = (-8 * d + torch.randn(40, 5, 1, generator=gen) / 100).half().float()
    u = torch.randint(0, 16, (40, 5, 32), generator=gen).float()
    u[..., 0], u[..., 1] = 0, 15  # each block spans its codes
    w4 = (d * u + m).reshape(40, 160)[:, :150].contiguous()
    q = torch.randint(-127, 128, (40, 5, 32), generator=gen).float()
    q[..., 0] = 127  # Q8_0's form: each block's largest code 127
    w8 = (d * q).reshape(40, 160)[:, :150].contiguous()
    for w, bits in ((w4, 4), (w8, 8)):
        codes = find_codes(w)
        assert codes is not None and codes.bits == bits
        for bf16 in (False, True):
            panels = pack_code_panels(codes, bf16=bf16)
            for rows in (1, 5, 9):
                x = torch.randn(rows, 150, generator=gen)
                got = ops.linear_panels(x, panels, None, 40)
                xin = x.bfloat16().double() if bf16 else x.double()
                want = (xin @ w.double().T).float()
                torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    q = torch.randn(9, 70, 64, generator=gen)
    k_old, v_old, k_new, v_new = torch.randn(4, 3, 70, 64, generator=gen)
    out = torch.empty(70, 9, 64)
    ops.attend_prefill(q, k_old, v_old, k_new, v_new, out, 0.125)
    mask = torch.ones(70, 140, dtype=torch.bool)
    mask[:, 70:] = torch.ones(70, 70, dtype=torch.bool).tril()
    want = F.scaled_dot_product_attention(
        q[None], torch.cat([k_old, k_new], 1)[None], torch.cat([v_old, v_new], 1)[None],
        attn_mask=mask, scale=0.125, enable_gqa=True,
    )[0].transpose(0, 1)
    torch.testing.assert_close(out, want, atol=2e-6, rtol=1e-5)
    print("portable kernels ok")
    """
)


def test_the_kernels_build_and_agree_without_avx512(tmp_path: Path) -> None:
    env = {**os.environ, "KVTIER_NATIVE_DIR": str(tmp_path)}  # a build of its own
    done = subprocess.run(
        [sys.executable, "-c", CHECKS], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-3000:]
    assert "portable kernels ok" in done.stdout
