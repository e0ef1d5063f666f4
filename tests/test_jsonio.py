"""write_json_atomic: content, ordinary permissions, nothing left behind on failure."""

import json
import math
import os

import pytest

from draftkit.jsonio import write_json_atomic


def test_writes_content_with_umask_permissions(tmp_path):
    path = tmp_path / "sub" / "report.json"
    write_json_atomic(path, {"tau": 1.5, "alpha": [0.5, 0.25]}, indent=1)
    assert json.loads(path.read_text()) == {"tau": 1.5, "alpha": [0.5, 0.25]}
    umask = os.umask(0)
    os.umask(umask)
    assert path.stat().st_mode & 0o777 == 0o666 & ~umask


def test_failure_keeps_the_old_file_and_leaves_no_temporary(tmp_path):
    path = tmp_path / "report.json"
    write_json_atomic(path, {"tau": 1.0})
    with pytest.raises(ValueError):
        write_json_atomic(path, {"tau": math.nan}, allow_nan=False)
    assert json.loads(path.read_text()) == {"tau": 1.0}
    assert sorted(p.name for p in tmp_path.iterdir()) == ["report.json"]
