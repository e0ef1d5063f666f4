"""Muon on the draft head's hidden matrices, AdamW on the rest, as the one optimizer Lightning's automatic
optimization takes (``model.optim.optimizer: muon``).

Muon (Jordan et al. 2024, https://kellerjordan.github.io/posts/muon/) replaces a matrix's momentum update by
its nearest semi-orthogonal matrix (Newton-Schulz iterations); ``torch.optim.Muon`` implements it for 2-D
parameters. As Moonlight (Liu et al., arXiv 2502.16982) and speculators' EAGLE3 trainer (vLLM speculators PR
#746, "shown to fairly consistently outperform adam") do, the hidden matrices (``fc`` and the decoder layer's
projections) take Muon and everything else (norms, ``lm_head``) AdamW; ``adjust_lr_fn="match_rms_adamw"``
scales Muon's update to AdamW's RMS, so both share one learning rate and one schedule.

``torch.optim.Muon`` runs its Newton-Schulz iterations in bfloat16, the right dtype where bf16 matmuls are fast
(CUDA, AVX512-BF16/AMX CPUs). On a device without fast bf16 (an AVX2-only CPU computes a bf16 matmul ~70x slower
than a float32 one: a default-recipe step took ~25 s instead of ~1.5 s) the same iterations run in float32
(:func:`newton_schulz`), chosen by the precision policy (``draftkit.precision``) once per device.
"""

from __future__ import annotations

import contextlib
import unittest.mock

import torch
import torch.optim._muon as _torch_muon

from draftkit.precision import auto_precision

__all__ = ["MuonWithAdamW", "newton_schulz", "split_muon_params"]


def newton_schulz(grad: torch.Tensor, ns_coefficients: tuple[float, float, float], ns_steps: int,
                  eps: float) -> torch.Tensor:
    """Muon's orthogonalisation of a momentum update in float32: the quintic Newton-Schulz iteration
    X <- a X + (b A + c A^2) X with A = X X^T, from X = G / ||G||_F (Jordan et al. 2024, the iteration
    ``torch.optim.Muon`` runs in bfloat16), over the shorter side of G.

    Args:
        grad: (m, n) update, any floating dtype.
        ns_coefficients: (a, b, c); ns_steps: iterations; eps: floor of the Frobenius norm.

    Returns:
        (m, n) float32 approximately semi-orthogonal matrix (singular values near 1).

    Raises:
        ValueError: if ``grad`` is not 2-D.
    """
    if grad.ndim != 2:
        raise ValueError(f"Muon orthogonalises 2-D matrices, got shape {tuple(grad.shape)}")
    a, b, c = ns_coefficients
    x = grad.float()
    tall = grad.size(0) > grad.size(1)
    if tall:
        x = x.T
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = torch.addmm(x, torch.addmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.T if tall else x


def _muon_dtype_context(params) -> contextlib.AbstractContextManager:
    """Where the precision policy chose float32 for the matrices' device (no fast bf16 there), run
    ``torch.optim.Muon``'s step with :func:`newton_schulz`; elsewhere its own bfloat16 iterations."""
    device = next(iter(params)).device.type
    if auto_precision(device).dtype == "bfloat16":
        return contextlib.nullcontext()
    return unittest.mock.patch.object(_torch_muon, "_zeropower_via_newtonschulz", newton_schulz)


def split_muon_params(module: torch.nn.Module, adamw_names: tuple[str, ...] = ("lm_head", "embed_tokens")):
    """The trainable parameters of ``module`` as (Muon's, AdamW's) lists.

    Muon takes the 2-D weights outside ``adamw_names`` (a draft head: ``fc.weight`` and the decoder layer's
    q/k/v/o and MLP matrices); AdamW takes the rest (norm weights, biases, ``lm_head``). Frozen parameters
    are left out of both.
    """
    muon, adamw = [], []
    for name, p in module.named_parameters():
        if not p.requires_grad:
            continue
        hidden = p.ndim == 2 and not any(name == n or name.startswith(n + ".") for n in adamw_names)
        (muon if hidden else adamw).append(p)
    return muon, adamw


class MuonWithAdamW(torch.optim.Optimizer):
    """``torch.optim.Muon`` over ``muon_params`` and ``torch.optim.AdamW`` over ``adamw_params`` in one optimizer.

    ``param_groups`` is [Muon's group, AdamW's group], the same dicts the two inner optimizers step with, and
    both share this optimizer's ``state``: an LR scheduler, ``state_dict``/``load_state_dict`` (checkpoints,
    exact resume) and Lightning's device moves see one ordinary optimizer. A step equals stepping the two
    optimizers one after the other.

    Args:
        muon_params: 2-D tensors (raises ValueError from ``torch.optim.Muon`` otherwise).
        adamw_params: any tensors.
        lr: learning rate of both (Muon's update scaled to AdamW's RMS).
        weight_decay: decoupled weight decay of both.
        betas: AdamW's betas; Muon keeps its momentum 0.95 and Nesterov.

    Raises:
        ValueError: on an empty ``muon_params`` (use AdamW alone) or a parameter that is not 2-D in it.
    """

    def __init__(self, muon_params, adamw_params, lr: float, weight_decay: float = 0.0,
                 betas: tuple[float, float] = (0.9, 0.95)) -> None:
        muon_params, adamw_params = list(muon_params), list(adamw_params)
        if not muon_params:
            raise ValueError("model.optim.optimizer muon: no 2-D trainable matrix to give Muon; use adamw")
        groups = [{"params": muon_params, "muon": True}]
        if adamw_params:
            groups.append({"params": adamw_params, "muon": False})
        super().__init__(groups, {"lr": lr, "weight_decay": weight_decay})
        self._muon = torch.optim.Muon(self.param_groups[:1], lr=lr, weight_decay=weight_decay,
                                      adjust_lr_fn="match_rms_adamw")
        self._adamw = torch.optim.AdamW(self.param_groups[1:], lr=lr, weight_decay=weight_decay, betas=betas) \
            if adamw_params else None
        self._link()

    def add_param_group(self, param_group: dict) -> None:
        """Only the two groups made at construction: a group added later would be stepped by neither optimizer.

        Raises:
            NotImplementedError: after construction (e.g. Lightning's ``BaseFinetuning`` unfreezing layers;
                use ``model.optim.optimizer: adamw`` there).
        """
        if hasattr(self, "_muon"):
            raise NotImplementedError("MuonWithAdamW takes no parameter group after construction; use adamw")
        super().add_param_group(param_group)

    def _link(self) -> None:
        """Point the inner optimizers at this optimizer's groups and state (after init and a load)."""
        self._muon.param_groups = self.param_groups[:1]
        self._muon.state = self.state
        if self._adamw is not None:
            self._adamw.param_groups = self.param_groups[1:]
            self._adamw.state = self.state

    def load_state_dict(self, state_dict) -> None:
        super().load_state_dict(state_dict)  # replaces the group dicts and the state
        self._link()

    @torch.no_grad()
    def step(self, closure=None):
        """One Muon step on the matrices and one AdamW step on the rest; returns ``closure()``'s loss."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        with _muon_dtype_context(self.param_groups[0]["params"]):
            self._muon.step()
        if self._adamw is not None:
            self._adamw.step()
        return loss
