"""The training-time-test (TTT) objective of EAGLE3 (arXiv 2503.01840; eagle3-format.md §4): which rows step k
supervises, the teacher distribution over the draft vocab, the soft cross-entropy, and the simulated acceptance
length. ``Eagle3Module.ttt_loss`` runs the head's K steps over these.

- step k, row p: input token x_{p+1+k}, teacher z_{p+1+k}, RoPE position p+k; supervised iff
  p+2+k < L and m_{p+2+k} = 1 and t2d[argmax z_{p+1+k}] (the mask is keyed on the *predicted* token);
- ids and teacher are shifted left by one more position after every step, in :func:`ttt_targets`, padding
  with 0/False, so the mask travels with the labels;
- loss: soft cross-entropy (:func:`soft_ce`) against softmax(z[..., t2d]) in fp32, per step normalised by the
  supervised count (the global count under DDP), total Σ_k decay^k L_k.

Shapes: B batch, T tokens, V target vocab, V_d draft vocab, n rows, K TTT steps.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

__all__ = ["draft_accuracy", "later_rows", "shift", "soft_ce", "tau_sim", "teacher_distribution", "ttt_targets"]


def shift(x: torch.Tensor, n: int) -> torch.Tensor:
    """Shift (B, T) left by n along T, padding the tail with zeros/False."""
    if n == 0:
        return x
    return torch.cat([x[:, n:], torch.zeros_like(x[:, :n])], dim=1)  # (B, T)


def ttt_targets(
    input_ids: torch.Tensor, weights: torch.Tensor, in_draft: torch.Tensor, step: int
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """Row-aligned inputs and supervision of TTT step k (eagle3-format.md §4.1), all in one place.

    Args:
        input_ids: (B, T) int64 x.
        weights: (B, T) float loss weight of each *token* m_t (assistant mask × optional entropy filter,
            0 on padding).
        in_draft: (B, T) bool, t2d[argmax z_t]: the target's top token after position t is in the draft vocab.
        step: k >= 0.

    Returns:
        ids (B, T) = x_{p+1+k}; weight (B, T) = m_{p+2+k} · t2d[argmax z_{p+1+k}] (0 where p+2+k >= T);
        teacher_offset = 1+k: row p's teacher is z at position p+1+k.
    """
    ids = shift(input_ids, 1 + step)  # (B, T)
    weight = shift(weights, 2 + step) * shift(in_draft, 1 + step)  # (B, T)
    return ids, weight, 1 + step


def teacher_distribution(
    logits: torch.Tensor, need: torch.Tensor, t2d: torch.Tensor, shape: tuple[int, int]
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The teacher of the positions the loss reads, computed once per position (every step gathers from it).

    Args:
        logits: (n, V) target logits z of the flat positions ``need``.
        need: (n,) int64 flat positions (row-major over ``shape``) whose z the loss reads.
        t2d: (V,) bool, the target ids that are draft ids.
        shape: (B, T).

    Returns:
        in_draft (B, T) bool t2d[argmax z_t] (False where z_t was not computed); probs (n, V_d) float32
        P = softmax(z[..., t2d]) in draft order; teacher_argmax (n,) int64 argmax of P; teacher_slot (B*T,) int64,
        the row of ``probs`` of each flat position (-1 where none).
    """
    b, t = shape
    device = logits.device
    in_draft = torch.zeros(b * t, dtype=torch.bool, device=device)
    in_draft[need] = t2d[logits.argmax(-1)]
    probs = F.softmax(logits[:, t2d].float(), dim=-1)  # (n, V_d), draft order
    teacher_slot = torch.full((b * t,), -1, dtype=torch.long, device=device)
    teacher_slot[need] = torch.arange(need.numel(), device=device)  # position -> row of probs
    return in_draft.view(b, t), probs, probs.argmax(-1), teacher_slot


def later_rows(supervised: list[torch.Tensor], flat: int) -> list[torch.Tensor | None]:
    """The rows step k >= 1 must compute: those step k or a later step supervises (a row's step-k output feeds
    only its own later steps), nested; None for step 0, which computes all rows (every row attends to its keys).

    Args:
        supervised: per step k, (n_k,) int64 flat rows it supervises.
        flat: B*T.

    Returns:
        per step, (m_k,) int64 sorted flat rows, or None at step 0.
    """
    steps = len(supervised)
    active: list[torch.Tensor | None] = [None] * steps
    later = torch.zeros(flat, dtype=torch.bool, device=supervised[0].device)
    for k in reversed(range(1, steps)):
        later[supervised[k]] = True
        active[k] = later.nonzero().squeeze(-1)
    return active


def soft_ce(logits: torch.Tensor, teacher_probs: torch.Tensor, teacher_argmax: torch.Tensor, weight: torch.Tensor):
    """Weighted soft cross-entropy and accuracy of draft logits against teacher probabilities, fp32.

    Args:
        logits: (n, V_d) draft logits of supervised rows.
        teacher_probs: (n, V_d) P = softmax(z[..., t2d]) of the same rows.
        teacher_argmax: (n,) int64 argmax of P.
        weight: (n,) float row weights.

    Returns:
        (loss_sum, correct_sum, weight_sum) scalars: Σ w·ℓ with ℓ = -Σ_i P_i log Q_i = logsumexp(l) - Σ_i P_i l_i,
        Σ w·1[argmax Q = argmax P], and Σ w.
    """
    logits = logits.float()
    ce = torch.logsumexp(logits, dim=-1) - (teacher_probs * logits).sum(-1)  # (n,)
    correct = (logits.argmax(-1) == teacher_argmax).float()  # (n,)
    return (ce * weight).sum(), (correct * weight).sum(), weight.sum()


def draft_accuracy(correct, scored):
    """Accuracy of a TTT step as decoding sees it: correct drafts over every scored row, the rows whose target
    top token is not a draft id (never supervised, never drafted right) counted as misses.

    Args:
        correct: Σ w·1[draft argmax = target argmax] over the supervised rows (float or 0-d tensor).
        scored: Σ w over every row with a token to predict (> 0), in the draft vocab or not.
    """
    return correct / scored


def tau_sim(accs: list[float]) -> float:
    """Simulated acceptance length 1 + Σ_i Π_{j<=i} acc_j (eagle3-format.md §8.3; counts the bonus token)."""
    total, prod = 1.0, 1.0
    for a in accs:
        prod *= a
        total += prod
    return total
