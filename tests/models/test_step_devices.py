"""Issue 32 item 3: no tensor made on the default device inside the training step (forward and backward).

See ``tests/decoding/test_device_factories.py`` for the check itself.
"""

from pathlib import Path

from draftkit.testing import DeviceFactoryCheck

REPO = Path(__file__).resolve().parents[2]


def test_training_step_makes_every_tensor_on_the_batch_device(monkeypatch):
    from draftkit.cli import DraftkitCLI

    monkeypatch.chdir(REPO)
    cli = DraftkitCLI(args=["--recipe", "recipes/tiny-debug.yaml", "--model.target_dtype", "float32",
                            "--data.hidden_states_cache", "null"], run=False)
    cli.datamodule.setup("fit")
    cli.model.build(cli.datamodule)
    batch = next(iter(cli.datamodule.train_dataloader()))
    with DeviceFactoryCheck() as check:
        loss, _ = cli.model.ttt_loss(batch)
        loss.backward()
    assert check.violations == []
