"""draftkit.models.eagle3.OptimConfig: the documented defaults that change a run's result (issue 36)."""

from draftkit.models.eagle3 import OptimConfig


def test_optim_defaults():
    cfg = OptimConfig()
    assert (cfg.warmup_steps, cfg.weight_decay, cfg.betas, cfg.min_lr_ratio) == (50, 0.0, (0.9, 0.95), 0.1)
