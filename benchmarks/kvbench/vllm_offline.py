"""vLLM's offline ``LLM`` in a worker process of its own venv: ``OfflineWorker``.

One ``LLM`` stays alive; each ``run`` sends one batch of token-id prompts and reads back
the greedy tokens, generate's seconds and each prompt's cached tokens (vLLM's own prefix
cache plus what a KV connector loaded). ``reset_prefix_cache`` empties vLLM's own prefix
cache, so a later batch finds its prefixes only where a connector keeps them. With a
``transfer`` config, vLLM loads that KV connector (kvtier's from this checkout's ``src``).

Contract: one owner; ``close`` ends the process. Raises ``RuntimeError`` naming the log
when the worker dies. ``vllm_env`` is the environment of every vLLM process the benchmarks
start (``vllm serve`` too), and ``MAX_*`` the engine limits both take.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from pathlib import Path
from typing import IO, Any

from kvbench.vllm_env import MAX_MODEL_LEN, venv_python

MAX_NUM_SEQS = 16
MAX_BATCHED_TOKENS = 8192
SRC = Path(__file__).resolve().parents[2] / "src"  # kvtier, for the connector
_RESULT = "VLLM_RESULT "  # the worker's answer lines start with this

_WORKER = """
import json, sys, time

def main():
    config = json.loads(sys.argv[1])
    from vllm import LLM, SamplingParams
    extra = {}
    if config["transfer"] is not None:
        from vllm.config import KVTransferConfig
        extra["kv_transfer_config"] = KVTransferConfig(**config["transfer"])
    llm = LLM(model=config["folder"], dtype=config["dtype"], enable_prefix_caching=True,
              max_model_len=config["max_model_len"], max_num_seqs=config["max_num_seqs"],
              max_num_batched_tokens=config["max_batched_tokens"], seed=0,
              enforce_eager=config["eager"], **extra)
    print("VLLM_RESULT " + json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        job = json.loads(line)
        if job.get("quit"):
            break
        if job.get("reset"):
            print("VLLM_RESULT " + json.dumps({"reset": llm.reset_prefix_cache()}), flush=True)
            continue
        params = SamplingParams(temperature=0, max_tokens=job["max_tokens"], ignore_eos=True)
        salts = job.get("salts") or [None] * len(job["prompts"])
        prompts = [
            {"prompt_token_ids": ids, **({"cache_salt": salt} if salt else {})}
            for ids, salt in zip(job["prompts"], salts)
        ]
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        wall_s = time.perf_counter() - start
        print("VLLM_RESULT " + json.dumps({
            "wall_s": wall_s,
            "tokens": [list(o.outputs[0].token_ids) for o in outs],
            "cached": [int(o.num_cached_tokens or 0) for o in outs],
        }), flush=True)

if __name__ == "__main__":
    main()
"""


def kvtier_transfer(extra: dict[str, Any]) -> dict[str, Any]:
    """vLLM's ``kv_transfer_config`` for kvtier's connector with ``extra`` as its
    ``kv_connector_extra_config``."""
    return {
        "kv_connector": "KvtierConnector",
        "kv_connector_module_path": "kvtier.vllm.connector",
        "kv_role": "kv_both",
        "kv_connector_extra_config": extra,
    }


def lmcache_transfer(host_mb: int, disk: Path) -> tuple[dict[str, Any], dict[str, str]]:
    """vLLM's ``kv_transfer_config`` for LMCache's connector, and the environment that
    gives LMCache ``host_mb`` of CPU memory and a disk folder (256-token chunks, as
    kvtier's)."""
    disk.mkdir(parents=True, exist_ok=True)
    env = {
        "LMCACHE_CHUNK_SIZE": "256",
        "LMCACHE_LOCAL_CPU": "True",
        "LMCACHE_MAX_LOCAL_CPU_SIZE": f"{host_mb / 1024:.3f}",
        "LMCACHE_LOCAL_DISK": f"file://{disk}/",
        "LMCACHE_MAX_LOCAL_DISK_SIZE": "32",
    }
    return {"kv_connector": "LMCacheConnectorV1", "kv_role": "kv_both"}, env


def cpu_bind(threads: int) -> str:
    """``VLLM_CPU_OMP_THREADS_BIND`` for ``threads`` cores (``0``, ``0-1``, …)."""
    return "0" if threads == 1 else f"0-{threads - 1}"


def vllm_env(threads: int, kv_gib: int) -> dict[str, str]:
    """vLLM's environment: its KV space, its OpenMP cores, and kvtier's ``src``."""
    path = os.pathsep.join(p for p in (str(SRC), os.environ.get("PYTHONPATH", "")) if p)
    return {
        **os.environ,
        "VLLM_CPU_KVCACHE_SPACE": str(kv_gib),
        "VLLM_CPU_OMP_THREADS_BIND": cpu_bind(threads),
        "PYTHONPATH": path,
    }


class OfflineWorker:
    """See the module docstring.

    Args:
        venv: vllm-cpu's venv.
        folder: the model folder vLLM loads.
        threads: cores vLLM's OpenMP binds.
        kv_gib: vLLM's own KV space.
        workdir: where the worker script and its log go.
        transfer: vLLM's ``kv_transfer_config`` (``kvtier_transfer``, ``lmcache_transfer``;
            None: no KV connector).
        env: more environment (a connector's own settings).
        eager: skip vLLM's compilation (a faster start; both arms of a comparison alike).
        label: names the worker in progress lines and its log file.
        dtype: vLLM's ``dtype`` (weights, activations and KV).
    """

    def __init__(
        self,
        venv: Path,
        folder: Path,
        threads: int,
        kv_gib: int,
        workdir: Path,
        transfer: dict[str, Any] | None = None,
        env: dict[str, str] | None = None,
        eager: bool = False,
        label: str = "offline",
        dtype: str = "float32",
    ) -> None:
        script = workdir / "vllm_offline_worker.py"
        script.write_text(_WORKER)
        config = {
            "folder": str(folder),
            "max_model_len": MAX_MODEL_LEN,
            "max_num_seqs": MAX_NUM_SEQS,
            "max_batched_tokens": MAX_BATCHED_TOKENS,
            "transfer": transfer,
            "eager": eager,
            "dtype": dtype,
        }
        self.log_path = workdir / f"vllm-{label}-t{threads}.log"
        self._log = self.log_path.open("wb")
        print(f"vllm {label}: starting (log {self.log_path})", flush=True)
        started = time.perf_counter()
        self.process = subprocess.Popen(
            [str(venv_python(venv)), str(script), json.dumps(config)],
            env={**vllm_env(threads, kv_gib), **(env or {})},
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._log,
            text=True,
        )
        self._read()
        self.start_s = time.perf_counter() - started
        print(f"vllm {label}: ready after {self.start_s:.0f} s", flush=True)

    def _read(self) -> dict[str, Any]:
        stdout: IO[str] | None = self.process.stdout
        assert stdout is not None
        for line in stdout:
            if line.startswith(_RESULT):
                return dict(json.loads(line[len(_RESULT) :]))
            self._log.write(line.encode())
        raise RuntimeError(f"vllm worker exited (code {self.process.wait()}); see {self.log_path}")

    def _ask(self, job: dict[str, Any]) -> dict[str, Any]:
        stdin = self.process.stdin
        assert stdin is not None
        stdin.write(json.dumps(job) + "\n")
        stdin.flush()
        return self._read()

    def run(self, prompts: list[list[int]], max_tokens: int) -> tuple[float, list[list[int]]]:
        """Greedy ``max_tokens`` for each prompt (EOS ignored): (generate's seconds, tokens)."""
        answer = self.generate(prompts, max_tokens)
        return float(answer["wall_s"]), [list(t) for t in answer["tokens"]]

    def generate(
        self, prompts: list[list[int]], max_tokens: int, salts: list[str] | None = None
    ) -> dict[str, Any]:
        """``run``'s answer whole: ``wall_s``, ``tokens`` and ``cached`` (per prompt);
        ``salts``: each prompt's ``cache_salt`` (vLLM's tenant isolation)."""
        return self._ask({"prompts": prompts, "max_tokens": max_tokens, "salts": salts})

    def reset_prefix_cache(self) -> bool:
        """Empty vLLM's own prefix cache (a connector's tiers keep theirs)."""
        return bool(self._ask({"reset": True})["reset"])

    def log_lines(self) -> list[str]:
        """What the worker wrote to its log so far (vLLM's and its connector's lines)."""
        self._log.flush()
        return self.log_path.read_text(errors="replace").splitlines()

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
