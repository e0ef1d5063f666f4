"""A head that learns nothing is named at validation: past the warmup, a step-0 validation loss no better than a
uniform guess over the draft vocab (ln V_d nats), or ten times worse, warns with the learning rate to lower (a learning rate of 1e6
trained the tiny recipe's head to exactly uniform, silently)."""

import logging
import math
from pathlib import Path

import pytest

from draftkit.cli import DraftkitCLI
from draftkit.models.guards import BLOWN_UP, UNIFORM_MARGIN, warn_uniform_head

REPO = Path(__file__).resolve().parents[2]


def test_the_bound_is_a_uniform_guess_over_the_draft_vocab(caplog):
    with caplog.at_level(logging.WARNING):
        assert not warn_uniform_head(math.log(64) - 2 * UNIFORM_MARGIN, 0.1, 64, 9, 1e-3)
        assert not warn_uniform_head(4.188, 0.273, 64, 4, 1e-3)  # a learning head above ln V_d early (tiny recipe)
        assert not warn_uniform_head(BLOWN_UP * math.log(64), 0.0, 64, 9, 1e-3)
        assert not caplog.text
        assert warn_uniform_head(math.log(64), 0.0, 64, 9, 1e6)
    assert ("validation at step 9: the head's step-0 loss 4.159 nats is a uniform guess's over the 64 draft ids "
            "(ln 64 = 4.1589), val/acc_0 0.000: the head is not learning") in caplog.text
    assert "model.optim.lr is 1e+06" in caplog.text
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        assert warn_uniform_head(5.9e6, 0.0, 64, 9, 1e2)  # blown up
    assert "loss 5.9e+06 nats is over 10 times a uniform guess's" in caplog.text and "lr is 100 " in caplog.text


@pytest.mark.parametrize("lr, warned", [(1e6, True), (1e2, True), (1e-3, False)])
def test_fit_warns_once_when_the_learning_rate_flattens_or_blows_up_the_head(tmp_path, monkeypatch, caplog, lr, warned):
    monkeypatch.chdir(REPO)
    with caplog.at_level(logging.WARNING):
        cli = DraftkitCLI(args=["fit", "--recipe", "recipes/tiny-debug.yaml", "--model.optim.lr", str(lr),
                                "--trainer.default_root_dir", str(tmp_path), "--trainer.enable_progress_bar", "false"])
    loss_0 = float(cli.trainer.callback_metrics["val/loss_0"])  # two validations: steps 4 and 8
    assert (abs(loss_0 - math.log(64)) < 1e-4 or loss_0 > BLOWN_UP * math.log(64)) == warned
    assert caplog.text.count("the head is not learning") == int(warned)
