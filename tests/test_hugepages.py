"""Huge pages for torch's CPU buffers (kvtier.hugepages), checked against torch's allocator
and the kernel in fresh processes (torch reads the variable once per process)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvtier.hugepages import VARIABLE, request_huge_pages

THP_MODE = Path("/sys/kernel/mm/transparent_hugepage/enabled")

# Prints the kB of huge pages backing a fresh, touched 64 MiB torch buffer (its mapping in
# /proc/self/smaps), after SETUP has run.
PROBE = """
import os, torch
{setup}
x = torch.ones(16 << 20)
address = x.data_ptr()
huge_kb, inside = 0, False
for line in open("/proc/self/smaps"):
    head = line.split()[0]
    if "-" in head and not head.endswith(":"):
        low, high = (int(part, 16) for part in head.split("-"))
        inside = low <= address < high
    elif inside and head == "AnonHugePages:":
        huge_kb = int(line.split()[1])
print(huge_kb, os.environ.get({variable!r}))
"""


def probe(setup: str, env_value: str | None) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if k != VARIABLE}
    if env_value is not None:
        env[VARIABLE] = env_value
    code = PROBE.format(setup=setup, variable=VARIABLE)
    done = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr
    huge_kb, value = done.stdout.splitlines()[-1].split()  # the probe prints last
    return int(huge_kb), value


needs_thp = pytest.mark.skipif(
    not THP_MODE.is_file() or "[never]" in THP_MODE.read_text(),
    reason="the kernel offers no transparent huge pages",
)


def test_the_variable_is_set_unless_the_user_set_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(VARIABLE, raising=False)
    request_huge_pages()
    assert os.environ[VARIABLE] == "1"
    monkeypatch.setenv(VARIABLE, "0")
    request_huge_pages()
    assert os.environ[VARIABLE] == "0"


@needs_thp
def test_buffers_allocated_after_the_request_sit_on_huge_pages() -> None:
    setup = "from kvtier.hugepages import request_huge_pages; request_huge_pages()"
    huge_kb, value = probe(setup, None)
    assert value == "1"
    assert huge_kb >= 32 << 10  # most of the 64 MiB (its unaligned ends stay small pages)


@needs_thp
def test_the_users_zero_opts_out() -> None:
    setup = "from kvtier.hugepages import request_huge_pages; request_huge_pages()"
    assert probe(setup, "0") == (0, "0")


@needs_thp
def test_the_command_line_requests_them_before_its_command_runs() -> None:
    # `kvtier plan --help` exits through argparse after main() has begun.
    setup = (
        "from kvtier.cli import main\n"
        "try:\n    main(['plan', '--help'])\nexcept SystemExit:\n    pass"
    )
    huge_kb, value = probe(setup, None)
    assert value == "1" and huge_kb >= 32 << 10
