"""Reading one JSON file with errors that name the file, and writing one text file atomically.

Reading is shared by checkpoint.py (config.json, the weight index) and tokenizer.py (tokenizer_config.json,
vocab.json, generation_config.json, ...): the error class differs (CheckpointError / ValueError), the checks do
not. `write_text_atomic` is the one whole-file writer of the run and results files (train's summary and run
config, the metrics log's rewrite on resume, a run's `latest`, eval's results JSON).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


class DuplicateKeyError(ValueError):
    """A key given twice in one mapping of a JSON (or YAML) file: a reader would silently keep one of the values."""

    def __init__(self, key: Any, where: str = "") -> None:
        super().__init__(f"key {key!r} is given twice{where}")
        self.key = key


def unique_keys(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    """`json.loads(..., object_pairs_hook=unique_keys)`: an object as a dict, DuplicateKeyError for a key given twice."""
    out: dict[str, Any] = {}
    for k, v in pairs:
        if k in out:
            raise DuplicateKeyError(k)
        out[k] = v
    return out


def read_json_file(path: Path, expect: type | None = dict, error: type[Exception] = ValueError) -> Any:
    """The JSON document in `path` (a JSON object unless `expect` says otherwise); `error` naming the file when
    it is not UTF-8 text, not JSON (including integers past Python's digit limit, nesting too deep and a key
    repeated within one object) or not of the expected type."""
    try:
        doc = json.loads(path.read_text(encoding="utf-8"), object_pairs_hook=unique_keys)
    except UnicodeDecodeError as e:
        raise error(f"{path} is not UTF-8 text ({e.reason} at byte {e.start})") from None
    except DuplicateKeyError as e:
        raise error(f"{path} is not valid JSON: duplicate key {e.key!r} (a reader would silently take one of the "
                    "two values)") from None
    except (ValueError, RecursionError) as e:  # JSONDecodeError, and the int-digits limit / nesting depth
        raise error(f"{path} is not valid JSON: {e}") from None
    if expect is not None and not isinstance(doc, expect):
        raise error(f"{path} must hold a JSON {'object' if expect is dict else expect.__name__}, "
                    f"got {type(doc).__name__}")
    return doc


def fsync_path(path: Path) -> None:
    """Flush a file or folder (`path`) to the disk; a file system that cannot (some refuse it for folders) is not
    an error."""
    fd = os.open(str(path), os.O_RDONLY)
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def temp_sibling(path: Path) -> Path:
    """A hidden temporary name next to `path` (same folder, so the rename is atomic), unique to this process and
    call: two writers of one file never share a temporary."""
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def write_text_atomic(path: str | Path, text: str, sync_dir: bool = False) -> None:
    """Write `text` (UTF-8) to `path` through a temporary sibling that is flushed to the disk and then renamed
    into place: an interrupted or failed write leaves the earlier file (or none), never part of one, and the
    temporary is removed on any exit. `sync_dir` also syncs the folder, so the rename itself survives a crash."""
    path = Path(path)
    tmp = temp_sibling(path)
    try:
        with open(tmp, "w", encoding="utf-8") as f:
            f.write(text)
            f.flush()
            try:
                os.fsync(f.fileno())
            except OSError:  # a file system without fsync (EINVAL) is not an error
                pass
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    if sync_dir:
        fsync_path(path.parent)
