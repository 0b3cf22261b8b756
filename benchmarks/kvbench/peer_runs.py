"""The processes of ``kvtier bench peers``: both servers, vLLM's serving client, and vLLM's
offline ``LLM`` in a worker of its venv.

Contract: both servers are ``kvbench.server_process.HttpServer`` processes.
``run_serve_client`` runs vLLM's client once and returns its parsed result file;
``serve_figures`` is pure.
``OfflineWorker`` keeps one vLLM ``LLM`` alive and runs one batch per ``run`` call, so
vLLM's and kvtier's offline batches can alternate without restarting vLLM.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

from kvbench.serve_client import MODEL_NAME
from kvbench.server_process import HttpServer, free_port
from kvbench.vllm_env import MAX_MODEL_LEN, venv_python

MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 8192
_RESULT = "PEERS_RESULT "  # the offline worker's answer lines start with this


def cpu_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` cores (``0``, ``0-1``, …)."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def vllm_env(threads: int, kv_gib: int) -> dict[str, str]:
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(threads),
    }


def vllm_server(venv: Path, folder: Path, threads: int, kv_gib: int, workdir: Path) -> HttpServer:
    """``vllm serve`` as the facts file starts it (the console script is broken)."""
    port = free_port()
    command = [str(venv_python(venv)), "-m", "vllm.entrypoints.openai.api_server"]
    command += ["--model", str(folder), "--served-model-name", MODEL_NAME, "--dtype", "float32"]
    command += ["--enable-prefix-caching", "--max-model-len", str(MAX_MODEL_LEN)]
    command += ["--max-num-seqs", str(MAX_NUM_SEQS)]
    command += ["--max-num-batched-tokens", str(MAX_BATCHED_TOKENS)]
    command += ["--host", "127.0.0.1", "--port", str(port)]
    log = workdir / f"vllm-serve-t{threads}.log"
    return HttpServer("vllm serve", command, vllm_env(threads, kv_gib), port, log)


def kvtier_server(flags: list[str], threads: int, workdir: Path) -> HttpServer:
    """``kvtier serve`` (embedded model) with ``flags`` and ``threads`` torch threads."""
    port = free_port()
    command = [sys.executable, "-m", "kvtier.cli", "serve", "--port", str(port)]
    command += ["--served-model-name", MODEL_NAME, "--log-level", "warning"]
    command += ["--threads", str(threads), *flags]
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    log = workdir / f"kvtier-serve-t{threads}.log"
    return HttpServer("kvtier serve", command, env, port, log)


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


def serve_figures(result: dict[str, Any]) -> dict[str, float | int | None]:
    """The figures of one client result file that the table and summary use."""

    def number(key: str) -> float | None:
        value = result.get(key)
        return float(value) if isinstance(value, int | float) else None

    return {
        "wall_s": number("duration"),
        "completed": int(result.get("completed") or 0),
        "output_tokens": int(result.get("total_output_tokens") or 0),
        "output_tps": number("output_throughput"),
        "median_tpot_ms": number("median_tpot_ms"),
        "median_ttft_ms": number("median_ttft_ms"),
    }


# ---- vLLM's offline LLM ----------------------------------------------------------------------

_WORKER = """
import json, sys, time

def main():
    config = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    llm = LLM(model=config["folder"], dtype="float32", enable_prefix_caching=True,
              max_model_len=config["max_model_len"], max_num_seqs=config["max_num_seqs"],
              max_num_batched_tokens=config["max_batched_tokens"], seed=0)
    print("PEERS_RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            break
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
        prompts = [{"prompt_token_ids": ids} for ids in job["prompts"]]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        tokens = [list(o.outputs[0].token_ids) for o in outs]
        print("PEERS_RESULT " + json.dumps({"wall_s": wall_s, "tokens": tokens}), flush=True)

if __name__ == "__main__":
    main()
"""


class OfflineWorker:
    """vLLM's offline ``LLM`` in a process of its venv, one batch per ``run``."""

    def __init__(self, venv: Path, folder: Path, threads: int, kv_gib: int, workdir: Path):
        script = workdir / "vllm_offline_worker.py"
        script.write_text(_WORKER)
        config = {
            "folder": str(folder),
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_batched_tokens": MAX_BATCHED_TOKENS,
        }
        self.log_path = workdir / f"vllm-offline-t{threads}.log"
        self._log = self.log_path.open("wb")
        print(f"vllm offline LLM: starting (log {self.log_path})", flush=True)
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [str(venv_python(venv)), str(script), json.dumps(config)],
            env=vllm_env(threads, kv_gib),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._read()
        self.start_s = time.perf_counter() - started
        print(f"vllm offline LLM: ready after {self.start_s:.0f} s", flush=True)

    def _read(self) -> dict[str, Any]:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith(_RESULT):
                return dict(json.loads(line[len(_RESULT) :]))
            self._log.write(line.encode())
        raise RuntimeError(
            f"vllm offline LLM exited (code {self.process.wait()}); see {self.log_path}"
        )

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """Greedy ``max_tokens`` for each prompt (EOS ignored): (generate's seconds, tokens)."""
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps({"prompts": prompts, "max_tokens": max_tokens}) + "\n")
        stdin.flush()
        answer = self._read()
        return float(answer["wall_s"]), [list(t) for t in answer["tokens"]]

    def close(self) -> None:
        if self.process.poll() is None and self.process.stdin is not None:
            try:
                self.process.stdin.write(json.dumps({"quit": True}) + "\n")
                self.process.stdin.close()
                self.process.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self.process.kill()
                self.process.wait()
        self._log.close()
