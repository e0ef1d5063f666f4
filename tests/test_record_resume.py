"""``ResumableRecord`` (dual precision's per-prompt record) redoes torn units on resume."""


import pytest

from draftkit.jsonio import ResumableRecord


def _finished(path):
    rec = ResumableRecord(path, {"run": 1})
    for i in range(4):
        rec.add(f"p{i}", {"tau": i + 0.5})
    return path.read_bytes()


@pytest.mark.parametrize("cut, kept", [
    (lambda b: b[: b.rindex(b"\n", 0, len(b) - 1) + 8], 3),  # last row cut mid-line
    (lambda b: b[:-1], 4),  # last row whole but without its newline: kept, the newline restored (else an add joins it)
    (lambda b: b.replace(b'{"key": "p1", "value": {"tau": 1.5}}', b'{"kez": "p1"}'), 1),  # damaged middle row
])
def test_a_torn_row_is_redone_and_the_record_is_complete_again(tmp_path, cut, kept):
    path = tmp_path / "rec.jsonl"
    data = _finished(path)
    path.write_bytes(cut(data))
    rec = ResumableRecord(path, {"run": 1})
    assert sorted(rec.done) == [f"p{i}" for i in range(kept)]
    for i in range(4):
        if rec.get(f"p{i}") is None:
            rec.add(f"p{i}", {"tau": i + 0.5})
    assert path.read_bytes() == data  # every row once, each line whole
    again = ResumableRecord(path, {"run": 1})
    assert again.done == {f"p{i}": {"tau": i + 0.5} for i in range(4)}
    assert len(path.read_text().splitlines()) == 5
