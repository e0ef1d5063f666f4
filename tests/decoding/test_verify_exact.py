"""draftkit.decoding.verify's prompt check: each of its conditions alone (issue 36)."""

import pytest
import torch

from draftkit.decoding.verify import _check_prompt
from draftkit.sampling import DecodeConfig


@pytest.mark.parametrize("prompt", [torch.zeros(0, dtype=torch.long), torch.zeros(1, 3, dtype=torch.long)])
def test_empty_or_2d_prompt_is_refused(prompt):
    with pytest.raises(ValueError, match="non-empty 1-D tensor"):
        _check_prompt(prompt, DecodeConfig(max_new_tokens=2), 1, 64)
