"""benchmarks/learning_curve.py: validation points placed at the tokens trained by their step, from real event files."""

import json

import pytest


def test_curve_reads_event_files_and_maps_steps_to_tokens(tmp_path, benchmark_module):
    from torch.utils.tensorboard import SummaryWriter

    mod = benchmark_module("learning_curve")
    with SummaryWriter(str(tmp_path / "version_0")) as w:
        for step in range(0, 10, 2):  # logged every 2 steps: 1000 tokens per step
            w.add_scalar("train/tokens_trained", 1000.0 * (step + 1), step)
        w.add_scalar("val/accept_len", 1.25, 3)
        w.add_scalar("val/accept_len", 1.5, 9)
        w.add_scalar("val/tau_sim", 1.4, 9)
    rows = mod.curve(mod.read_run(tmp_path), "val/accept_len")
    assert rows == [(3, 3000.0, 1.25), (9, 9000.0, 1.5)]  # step 3 -> tokens logged at step 2
    assert mod.curve(mod.read_run(tmp_path), "val/tau_sim") == [(9, 9000.0, pytest.approx(1.4))]
    out = tmp_path / "curve.png"
    assert mod.main([f"run={tmp_path}", "--output", str(out)]) == 0
    assert out.stat().st_size > 1000 and out.with_suffix(".json").exists()
    # an earlier output's curve draws again beside a run, equal to what was read from the logs
    again = tmp_path / "again.png"
    assert mod.main([f"old={out.with_suffix('.json')}:run", f"new={tmp_path}", "--output", str(again)]) == 0
    table = json.loads(again.with_suffix(".json").read_text())
    assert table["old"] == table["new"] and table["old"]["val/accept_len"] == [[3, 3000.0, 1.25], [9, 9000.0, 1.5]]
    with pytest.raises(KeyError, match="has no curve 'nope'; it has run"):
        mod.read_table(f"{out.with_suffix('.json')}:nope")


def test_a_directory_without_event_files_is_named(tmp_path, benchmark_module):
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}: no TensorBoard event file"):
        benchmark_module("learning_curve").read_run(tmp_path)


def test_only_logged_metrics_get_a_panel(tmp_path, benchmark_module, monkeypatch):
    """A run without the AcceptanceLengthMonitor (the default recipe) gets one panel, not an empty one."""
    from torch.utils.tensorboard import SummaryWriter

    mod = benchmark_module("learning_curve")
    with SummaryWriter(str(tmp_path / "a" / "version_0")) as w:
        w.add_scalar("train/tokens_trained", 100.0, 0)
        w.add_scalar("val/tau_sim", 1.3, 0)
    import matplotlib.pyplot as plt

    made = []
    real = plt.subplots
    monkeypatch.setattr(plt, "subplots", lambda *a, **k: made.append(a) or real(*a, **k))
    assert mod.main([f"a={tmp_path / 'a'}", "--output", str(tmp_path / "c.png")]) == 0
    assert made == [(1, 1)]
    with SummaryWriter(str(tmp_path / "b" / "version_0")) as w:
        w.add_scalar("train/tokens_trained", 100.0, 0)
    with pytest.raises(SystemExit):
        mod.main([f"b={tmp_path / 'b'}", "--output", str(tmp_path / "d.png")])
