"""Dual precision's per-prompt record: a torn finished row (mid-file or last) is redone on resume and the record
is complete again: exactly one whole line per unit (issue 30 item 5)."""

from __future__ import annotations

import json

import pytest

from draftkit.dual_precision import DualPrecisionConfig, evaluate_dual_precision

from tests.dual_precision.test_dual_precision import StubLM, _without_timing

EVALUATION, CALIBRATION = [[0, 3], [0, 7, 1], [0, 9, 2, 4]], [[0, 1, 1, 1, 1], [0, 2, 2, 2, 2, 2]]
CONFIG = DualPrecisionConfig(budget=0.3, max_new_tokens=8, k=2, bootstrap_samples=0)


@pytest.mark.parametrize("row, tear", [(2, "half"), (3, "not_a_row"), (5, "no_newline")])
def test_a_torn_finished_row_is_redone(tmp_path, row, tear):
    path = tmp_path / "prompts.jsonl"
    full = evaluate_dual_precision(StubLM(disagree_at={5, 11}), EVALUATION, CALIBRATION, CONFIG, record=str(path))
    whole = path.read_text()
    lines = whole.splitlines(keepends=True)
    assert len(lines) == 1 + 2 + 3
    if tear == "half":
        lines[row] = lines[row][: len(lines[row]) // 2] + "\n"
    elif tear == "not_a_row":
        lines[row] = json.dumps({"value": json.loads(lines[row])["value"]}) + "\n"  # its key lost
    else:
        lines[row] = lines[row].rstrip("\n")
    path.write_text("".join(lines))
    lm = StubLM(disagree_at={5, 11})
    resumed = evaluate_dual_precision(lm, EVALUATION, CALIBRATION, CONFIG, record=str(path))
    assert _without_timing(resumed) == _without_timing(full)
    after = path.read_text()
    assert after.endswith("\n") and len(after.splitlines()) == 6
    assert sorted(json.loads(line)["key"] for line in after.splitlines()[1:]) == sorted(
        json.loads(line)["key"] for line in whole.splitlines()[1:])
    if tear == "no_newline":
        assert lm.calls == []  # the last row was whole: nothing to redo
    else:
        assert lm.calls  # the torn row and the rows after it are recomputed
