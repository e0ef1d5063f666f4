"""Strategies that train and refusals that explain, before any model is loaded (draftkit/strategy.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from draftkit.cli import load_recipe
from draftkit.commands import main
from draftkit.strategy import check_strategy

ROOT = Path(__file__).resolve().parents[1]
TINY = "recipes/tiny-debug.yaml"
FSDP = r"^trainer.strategy {}: refused before loading the target: Lightning's FSDP \(FSDP1\) wraps the whole module .*Must flatten tensors with uniform dtype.*use trainer.strategy ddp \(the frozen target replicated in bf16.*or, for a target larger than one GPU, trainer.strategy fsdp_target \(the frozen target sharded per decoder layer with FSDP2"
MUON = r"model.optim.optimizer muon also needs each hidden matrix whole .*Muon only supports 2D parameters.*which both strategies above give it"

REFUSED = [
    (["--trainer.strategy", "fsdp"], FSDP.format("fsdp")),
    (["--trainer.strategy", "fsdp_cpu_offload"], FSDP.format("fsdp_cpu_offload")),
    (["--trainer.strategy", "lightning.pytorch.strategies.FSDPStrategy",
      "--trainer.strategy.sharding_strategy", "SHARD_GRAD_OP"], FSDP.format("lightning.pytorch.strategies.FSDPStrategy")),
    (["--trainer.strategy", "deepspeed_stage_2"], r"^trainer.strategy deepspeed_stage_2: refused .*DeepSpeed has never been run with draftkit.*use trainer.strategy ddp"),
    (["--trainer.strategy", "xla"], r"^trainer.strategy xla: refused .*XLA devices have never been run"),
    (["--trainer.strategy", "lightning.pytorch.strategies.ModelParallelStrategy"],
     r"^trainer.strategy lightning.pytorch.strategies.ModelParallelStrategy: refused .*needs a configure_model plan "
     r"for the head .*would gather the whole target into every full-state checkpoint.*trainer.strategy fsdp_target"),
]


@pytest.mark.parametrize("overrides, message", REFUSED)
@pytest.mark.parametrize("optimizer", ["adamw", "muon"])
def test_refused_strategies_name_the_reason_and_ddp(overrides, message, optimizer):
    """Reading the recipe (what fit, validate, bench train and cache-hidden-states do first) refuses it."""
    with pytest.raises(ValueError, match=message) as info:
        load_recipe([TINY], overrides + ["--model.optim.optimizer", optimizer])
    sharded = "xla" not in overrides
    assert (MUON.split(" .*")[0] in str(info.value)) == (optimizer == "muon" and sharded)


@pytest.mark.parametrize("strategy", ["auto", "ddp", "ddp_spawn", "ddp_fork", "ddp_find_unused_parameters_true",
                                      "single_device", "lightning.pytorch.strategies.DDPStrategy", "fsdp_target",
                                      "draftkit.strategy.ShardedTargetStrategy"])
def test_ddp_and_single_device_pass_with_muon(strategy):
    check_strategy(load_recipe([TINY], ["--trainer.strategy", strategy, "--model.optim.optimizer", "muon"]))


def test_the_8gpu_recipe_is_ddp_and_passes():
    config = load_recipe(["recipes/llama3.1-8b-eagle3-8gpu.yaml"])
    assert config.trainer.strategy == "ddp"
    check_strategy(config)
    with pytest.raises(ValueError, match=MUON):
        load_recipe(["recipes/llama3.1-8b-eagle3-8gpu.yaml"], ["--trainer.strategy", "fsdp", "--model.optim.optimizer", "muon"])


def test_the_70b_recipe_shards_the_target_and_passes_with_muon():
    """The sharded form is one line in a recipe; the head stays replicated, so Muon's matrices stay whole."""
    from draftkit.strategy import ShardedTargetStrategy

    config = load_recipe(["recipes/llama3.3-70b-eagle3-8gpu.yaml"], ["--model.optim.optimizer", "muon"])
    assert config.trainer.strategy == "fsdp_target"
    check_strategy(config)
    check_strategy({"trainer": {"strategy": ShardedTargetStrategy()}, "model": {"optim": {"optimizer": "muon"}}})


def test_fsdp_target_refuses_layer_selection_with_the_fix():
    """LayerSelection runs the target on rank 0 alone: under a sharded target the other ranks would never join."""
    callbacks = [{"class_path": "draftkit.callbacks.layer_selection.LayerSelection"}]
    with pytest.raises(ValueError, match=r"^trainer.strategy fsdp_target: refused before loading the target: the "
                                         r"LayerSelection callback runs the target on rank 0 alone.*set "
                                         r"model.aux_layer_ids, or drop the callback"):
        check_strategy({"trainer": {"strategy": "fsdp_target", "callbacks": callbacks}})
    check_strategy({"trainer": {"strategy": "ddp", "callbacks": callbacks}})


def test_check_strategy_reads_plain_mappings_and_instances():
    from lightning.pytorch.strategies import DDPStrategy, FSDPStrategy

    check_strategy({"trainer": {"strategy": DDPStrategy()}, "model": {"optim": {"optimizer": "muon"}}})
    check_strategy({"trainer": {}, "model": {}})  # unset = auto
    with pytest.raises(ValueError, match=MUON):
        check_strategy({"trainer": {"strategy": FSDPStrategy()}, "model": {"optim": {"optimizer": "muon"}}})
    with pytest.raises(ValueError, match=r"^trainer.strategy lightning.pytorch.strategies.ParallelStrategy: refused "
                                         r".*ParallelStrategy is not a DDP or single-device strategy"):
        check_strategy({"trainer": {"strategy": {"class_path": "lightning.pytorch.strategies.ParallelStrategy"}}})


@pytest.mark.parametrize("verb", ["fit", "validate"])
def test_the_cli_refuses_before_loading_the_target(verb, tmp_path, monkeypatch, capsys):
    """A recipe whose target is a directory that does not exist: with FSDP the strategy message comes first and
    nothing is written; with DDP the same recipe gets as far as the target and fails there."""
    monkeypatch.chdir(ROOT)
    monkeypatch.delenv("DRAFTKIT_DEBUG", raising=False)
    recipe = tmp_path / "missing-target.yaml"
    recipe.write_text(f"model: {{target: {tmp_path / 'no-such-target'}}}\n"
                      f"trainer: {{default_root_dir: {tmp_path / 'run'}, logger: false}}\n")
    args = [verb, "--recipe", TINY, "--recipe", str(recipe), "--model.optim.optimizer", "muon"]
    assert main(args + ["--trainer.strategy", "fsdp"]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"draftkit {verb}: error: trainer.strategy fsdp: refused before loading the target: Lightning's FSDP")
    assert "Muon only supports 2D parameters" in err and "no-such-target" not in err
    assert not (tmp_path / "run").exists()
    assert main(args + ["--trainer.strategy", "ddp"]) == 2
    assert "no-such-target" in capsys.readouterr().err
