"""Atomic JSON files: reports, indexes and manifests are either complete or absent."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

__all__ = ["write_json_atomic"]


def write_json_atomic(path: str | Path, obj, indent: int = 2, allow_nan: bool = True) -> None:
    """Write ``obj`` as JSON to ``path`` through a temporary file in the same folder and ``os.replace``.

    The parent folder is created; the file gets the usual permissions (0666 minus the umask, not mkstemp's 0600).

    Raises:
        TypeError / ValueError: from ``json.dump`` (a non-serialisable value, or NaN with ``allow_nan=False``);
            nothing is left behind at ``path`` or beside it.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", dir=path.parent)
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o666 & ~umask)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, indent=indent, allow_nan=allow_nan)
            f.write("\n")
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
