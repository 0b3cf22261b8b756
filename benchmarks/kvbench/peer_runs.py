"""vLLM's server and serving client for ``kvtier bench peers`` (kvtier's server is
``kvbench.server_process.kvtier_server``; vLLM's offline ``LLM`` is
``kvbench.vllm_offline.OfflineWorker``).

Contract: the server is a ``kvbench.server_process.HttpServer`` process.
``run_serve_client`` runs vLLM's client once and returns its parsed result file;
``serve_figures`` is pure.
"""

from __future__ import annotations

import json
import subprocess
import tempfile
from pathlib import Path
from typing import Any

from kvbench.serve_client import MODEL_NAME
from kvbench.server_process import HttpServer, free_port
from kvbench.vllm_env import MAX_MODEL_LEN, venv_python
from kvbench.vllm_offline import MAX_BATCHED_TOKENS, MAX_NUM_SEQS, vllm_env


def vllm_server(
    venv: Path, folder: Path, threads: int, kv_gib: int, workdir: Path, dtype: str = "float32"
) -> HttpServer:
    """``vllm serve`` as the facts file starts it (the console script is broken), its
    weights, activations and KV in ``dtype``."""
    port = free_port()
    command = [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(folder), "--served-model-name", MODEL_NAME, "--dtype", dtype]
    command += ["--enable-prefix-caching", "--max-model-len", str(MAX_MODEL_LEN)]
    command += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    command += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    log = workdir / f"vllm-serve-t{threads}.log"
    return HttpServer("vllm serve", command, vllm_env(threads, kv_gib), port, log)


# ---- vLLM's serving client -------------------------------------------------------------------

_CLIENT = (
    "import sys\n"
    "from vllm.benchmarks.serve import add_cli_args, main\n"
    "from vllm.utils.argparse_utils import FlexibleArgumentParser\n"
    "parser = FlexibleArgumentParser()\n"
    "add_cli_args(parser)\n"
    "main(parser.parse_args(sys.argv[1:]))\n"
)


def serve_client_args(
    port: int, folder: Path, prompts: int, input_len: int, output_len: int, concurrency: int
) -> list[str]:
    """vLLM client flags: random prompts of ``input_len`` → ``output_len`` tokens."""
    return [
        *("--backend", "openai", "--base-url", f"http://127.0.0.1:{port}"),
        *("--endpoint", "/v1/completions", "--model", MODEL_NAME, "--tokenizer", str(folder)),
        *("--dataset-name", "random", "--random-input-len", str(input_len)),
        *("--random-output-len", str(output_len), "--num-prompts", str(prompts)),
        *("--max-concurrency", str(concurrency), "--ignore-eos"),
    ]


def run_serve_client(
    venv: Path, args: list[str], seed: int, workdir: Path, timeout_s: float
) -> dict[str, Any]:
    """Run ``vllm.benchmarks.serve`` once (``--save-result``); its parsed result file."""
    result_dir = Path(tempfile.mkdtemp(prefix="client-", dir=workdir))
    command = [str(venv_python(venv)), "-c", _CLIENT, *args, "--seed", str(seed)]
    command += ["--save-result", "--result-dir", str(result_dir), "--result-filename", "r.json"]
    log = workdir / "vllm-client.log"
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=out, timeout=timeout_s, check=False)
    path = result_dir / "r.json"
    if done.returncode != 0 or not path.is_file():
        raise RuntimeError(f"vllm.benchmarks.serve failed (exit {done.returncode}); see {log}")
    return dict(json.loads(path.read_text()))


def serve_figures(result: dict[str, Any]) -> dict[str, Any]:
    """The figures of one client result file that the table and summary use. A run where a
    request failed has no ``output_tps`` (the client divides the completed ones' tokens by a
    shorter wall, which would read as a speed-up); ``errors`` keeps its distinct messages."""

    def number(key: str) -> float | None:
        value = result.get(key)
        return float(value) if isinstance(value, int | float) else None

    failed = int(result.get("failed") or 0)
    errors = sorted({str(e)[-300:] for e in result.get("errors") or [] if e})
    return {
        "wall_s": number("duration"),
        "completed": int(result.get("completed") or 0),
        "failed": failed,
        "errors": errors[:3],
        "output_tokens": int(result.get("total_output_tokens") or 0),
        "output_tps": number("output_throughput") if failed == 0 else None,
        "median_tpot_ms": number("median_tpot_ms"),
        "median_ttft_ms": number("median_ttft_ms"),
    }
