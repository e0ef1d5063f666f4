"""``val/acc_k`` and ``val/tau_sim`` count rows whose target top token is not a draft id as misses, as decoding
does (issue 55, case y04): on ``tiny:qwen3_moe`` the 64-id draft vocab, picked from the data's tokens, holds the
target's top token at ~1 % of the assistant positions, so τ_sim must sit near 1, not at its maximum K + 1."""

import logging
from pathlib import Path

from draftkit.cli import DraftkitCLI

REPO = Path(__file__).resolve().parents[2]


def test_tau_sim_counts_top_tokens_outside_the_draft_vocab_as_misses(tmp_path, monkeypatch, caplog):
    monkeypatch.chdir(REPO)
    with caplog.at_level(logging.WARNING):
        cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--model.target", "tiny:qwen3_moe",
                                "--trainer.max_steps", "4", "--trainer.default_root_dir", str(tmp_path),
                                "--trainer.enable_progress_bar", "false"])
    m = {k: float(v) for k, v in cli.trainer.callback_metrics.items()}
    coverage = m["val/draft_coverage"]
    assert 0 < coverage < 0.05  # the target's top token is a draft id at 1-5 % of the scored rows
    assert m["val/acc_0"] <= coverage  # no step can beat the coverage
    assert 1.0 <= m["val/tau_sim"] < 1.1  # was 4.0 (every step's accuracy 1.0 on the few in-vocab rows)
    assert "the target's top token is a draft id at only" in caplog.text and "model.draft_vocab_size (now 64)" in caplog.text
