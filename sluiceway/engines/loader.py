"""Finding a model: a local directory, or a Hugging Face id in the local cache."""

from __future__ import annotations

import gc
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

logger = logging.getLogger(__name__)


class ModelNotFound(Exception):
    """The model named on the command line cannot be found locally."""


@dataclass(frozen=True, slots=True)
class ModelSource:
    """A resolved model directory and its ``config.json``."""

    path: Path
    config: dict[str, Any]
    name: str

    @property
    def vocab_size(self) -> int:
        value = self.config.get("vocab_size")
        if value is None and isinstance(self.config.get("text_config"), dict):
            value = self.config["text_config"].get("vocab_size")
        return int(value or 0)


def resolve_model(spec: str) -> ModelSource:
    """Resolve ``spec`` to a directory with ``config.json``.

    A path that exists is used as is; anything else is treated as a Hugging
    Face id and looked up in the local Hub cache only (no download).
    """
    path = Path(spec).expanduser()
    if not path.exists():
        path = _from_hub_cache(spec)
    config_file = path / "config.json"
    if not config_file.is_file():
        raise ModelNotFound(f"{path} has no config.json")
    config = json.loads(config_file.read_text())
    return ModelSource(path=path, config=config, name=spec)


def _from_hub_cache(repo_id: str) -> Path:
    from huggingface_hub import snapshot_download

    try:
        return Path(snapshot_download(repo_id, local_files_only=True))
    except Exception as error:  # the hub raises several unrelated types here
        raise ModelNotFound(
            f"{repo_id!r} is neither a local directory nor in the local Hugging Face cache "
            f"(sluiceway never downloads at run time): {error}"
        ) from error


def freeze_heap() -> None:
    """Take what exists after loading (the model, torch, transformers: some
    380k objects with the transformers engine) out of the garbage
    collector's reach. Collections that reached them held the GIL, and so
    stalled every stream, for up to 35 ms (middle generation) and 155 ms
    (full) on the benchmark host; now they walk only what serving allocates."""
    gc.collect()
    gc.freeze()
