"""Issue 32 item 3: no tensor made on the default device inside the training step (forward and backward).

See ``tests/decoding/test_device_factories.py`` for the check itself.
"""

from draftkit.testing import DeviceFactoryCheck


def test_training_step_makes_every_tensor_on_the_batch_device(tiny_module_and_batch):
    model, batch = tiny_module_and_batch
    with DeviceFactoryCheck() as check:
        loss, _ = model.ttt_loss(batch)
        loss.backward()
    assert check.violations == []
