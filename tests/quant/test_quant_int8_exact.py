"""draftkit.quant.int8.quantize_int8 of a weight that requires grad (a module's parameter) (issue 36)."""

import torch

from draftkit.quant.int8 import quantize_int8


def test_quantize_a_parameter_detaches_it():
    w = torch.nn.Parameter(torch.tensor([[0.5, -1.0, 0.25, 1.0]]))
    q = quantize_int8(w, "symmetric")
    tensors = [v for v in vars(q).values() if isinstance(v, torch.Tensor)]
    assert tensors and not any(t.requires_grad for t in tensors)
    plain = quantize_int8(w.detach().clone(), "symmetric")
    assert all(torch.equal(a, b) for a, b in zip(tensors, [v for v in vars(plain).values() if isinstance(v, torch.Tensor)]))
