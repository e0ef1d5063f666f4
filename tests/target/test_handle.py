"""TargetHandle: a training run's frozen target, loaded once, released, resolved for the device, and what the
loss reads of it online (the full model) or offline (the LM head, checked against the cache)."""

import pytest
import torch

from draftkit.precision import auto_precision, default_device
from draftkit.target.frozen import FrozenTarget, config_fingerprint
from draftkit.target.handle import TargetHandle
from draftkit.target.lm_head import TargetLMHead


def test_the_target_is_loaded_once_until_released(tiny_target_dir):
    handle = TargetHandle(str(tiny_target_dir), "float32")
    assert not handle.loaded
    model, tokenizer = handle.load()
    assert handle.loaded and handle.load()[0] is model and tokenizer is not None
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    handle.release()
    assert not handle.loaded
    again, _ = handle.load()
    assert again is not model and handle.loaded


def test_dtype_is_checked_and_auto_resolved_for_the_device():
    with pytest.raises(ValueError, match=r"model.target_dtype must be one of .*got 'int8'"):
        TargetHandle("unused", "int8")
    handle = TargetHandle("unused", "auto")
    assert handle.resolve_dtype() == auto_precision(default_device()).dtype == handle.dtype != "auto"
    assert TargetHandle("unused", "float16").resolve_dtype() == "float16"
    assert not handle.sharded()  # no trainer: nothing shards the target


class _Cache:
    """A hidden-state cache stub that records the fingerprint it is checked against."""

    def __init__(self):
        self.checked = None

    def check(self, fingerprint: dict) -> None:
        self.checked = fingerprint


def test_training_target_online_and_offline(tiny_target_dir):
    handle = TargetHandle(str(tiny_target_dir), "float32")
    cache = _Cache()
    offline = handle.training_target([1, 3, 6], cache)
    assert isinstance(offline, TargetLMHead) and not handle.loaded  # only the LM head, not the full model
    assert cache.checked == {"target": str(tiny_target_dir), "target_config": config_fingerprint(offline.config),
                             "target_dtype": "float32", "aux_layer_ids": [1, 3, 6]}
    online = handle.training_target(None, None)
    assert isinstance(online, FrozenTarget) and handle.loaded
    assert online.aux_layer_ids == [2, 4, 5] and online.model is handle.load()[0]
