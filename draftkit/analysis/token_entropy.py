"""Token prediction entropy and the low-entropy filter (layer-analysis.md §7).

H_t = -Σ_v softmax(z_t)_v log_softmax(z_t)_v over the full target vocabulary, in fp32, temperature 1, nats,
computed in chunks of positions so that no (n, V) fp32 copy of a long batch is ever made.

Alignment. Keys are shifted copies of H: key[t] = H[t + key_offset].

- Draft rows (the analysis, eagle3-format.md §4.1): row t carries F_t and is trained against z_{t+1}, so the
  default key of row t is H_{t+1} (``key_offset=+1``, the difficulty of the draft's own target); ``0`` keys a
  row on the uncertainty of its own state.
- Loss weights keyed on the *predicted* token (``Eagle3Module``: m_t with token t predicted from z_{t-1}):
  ``key_offset=-1``, the default of :func:`entropy_filter_weights`. Both describe the same pairing.

Rows whose key position falls outside the sequence have no key and get weight 0.

Motivation: most tokens are low-entropy; a minority of about 20 % high-entropy tokens are the decision points
(Wang et al., arXiv 2506.01939).

Shapes: B batch, T tokens, V target vocab.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

__all__ = ["entropy_filter_weights", "quantile_threshold", "shift_keys", "token_entropy"]

FILTER_MODES = ("off", "drop", "downweight")


def token_entropy(logits: torch.Tensor, chunk_size: int = 1024) -> torch.Tensor:
    """Next-token entropy of each position, in nats.

    Args:
        logits: (..., V) target logits, any float dtype (upcast to fp32 chunk by chunk).
        chunk_size: positions per chunk (bounds the fp32 temporary at chunk_size × V).

    Returns:
        (...) fp32.
    """
    flat = logits.reshape(-1, logits.shape[-1])  # (n, V)
    out = torch.empty(flat.shape[0], dtype=torch.float32, device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        logp = F.log_softmax(flat[start:start + chunk_size].float(), dim=-1)  # (c, V)
        out[start:start + chunk_size] = -(logp.exp() * logp).sum(-1)
    return out.view(logits.shape[:-1])


def shift_keys(entropies: torch.Tensor, key_offset: int, valid: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """key[t] = H[t + key_offset] along T, with a mask of positions that have a key.

    Args:
        entropies: (B, T) fp32.
        key_offset: shift along T (+1: next position, -1: previous position).
        valid: (B, T) bool positions whose entropy is defined (e.g. the attention mask), or None for all.

    Returns:
        keys (B, T) fp32 (0 where undefined) and has_key (B, T) bool.
    """
    t = entropies.shape[1]
    valid = torch.ones_like(entropies, dtype=torch.bool) if valid is None else valid.bool()
    keys = torch.zeros_like(entropies)
    has = torch.zeros_like(valid)
    if key_offset >= 0:
        keys[:, : t - key_offset] = entropies[:, key_offset:]
        has[:, : t - key_offset] = valid[:, key_offset:]
    else:
        keys[:, -key_offset:] = entropies[:, : t + key_offset]
        has[:, -key_offset:] = valid[:, : t + key_offset]
    return keys, has


def quantile_threshold(keys: torch.Tensor, quantile: float) -> float:
    """The ``quantile`` of a 1-D set of keys: rows with key >= it keep a fraction of about 1 - quantile.

    Args:
        keys: (n,) entropies in nats.
        quantile: in [0, 1).

    Returns:
        The threshold in nats (-inf when ``keys`` is empty, i.e. keep everything).
    """
    if keys.numel() == 0:
        return -math.inf
    return float(torch.quantile(keys.float(), quantile))


def _check_filter_args(mode: str, threshold: float | None, quantile: float | None) -> None:
    if mode not in FILTER_MODES:
        raise ValueError(f"entropy filter mode must be one of {FILTER_MODES}, got {mode!r}")
    if mode == "off":
        return
    if (threshold is None) == (quantile is None):
        raise ValueError(
            f"entropy filter mode={mode!r}: give exactly one of threshold (nats) or quantile, got "
            f"threshold={threshold}, quantile={quantile}"
        )
    if quantile is not None and not 0.0 <= quantile < 1.0:
        raise ValueError(f"entropy filter quantile must be in [0, 1), got {quantile}")
    if threshold is not None and not math.isfinite(threshold):
        raise ValueError(f"entropy filter threshold must be finite, got {threshold}")


def entropy_filter_weights(
    target_logits_or_entropies: torch.Tensor,
    mask: torch.Tensor,
    mode: str = "drop",
    threshold: float | None = None,
    quantile: float | None = None,
    *,
    key_offset: int = -1,
    downweight: float = 0.1,
    chunk_size: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Loss weights that drop or down-weight positions whose target prediction entropy is low (§7).

    Apply after the assistant mask: ``mask`` is the (B, T) loss mask, the result replaces it as loss weights.
    Entropies are computed only at the key positions of masked rows.

    Args:
        target_logits_or_entropies: (B, T, V) target logits, or (B, T) precomputed entropies in nats.
        mask: (B, T) 0/1 or bool loss mask (positions that are supervised before filtering).
        mode: ``"drop"`` (weight 0 below the threshold), ``"downweight"`` (weight ``downweight`` below it) or
            ``"off"`` (weights = mask).
        threshold: absolute threshold in nats; rows with key >= threshold keep weight 1.
        quantile: or: the threshold is this quantile of the keys of the masked rows of this call (0.8 keeps
            the top 20 %).
        key_offset: key[t] = H[t + key_offset]; -1 (default) for weights on predicted-token positions
            (token t is predicted from z_{t-1}), +1 for draft rows (row t is trained against z_{t+1}).
        downweight: weight of low-entropy rows in ``downweight`` mode, in [0, 1].
        chunk_size: positions per entropy chunk.

    Returns:
        weights (B, T) fp32, and kept_fraction: 0-d fp32 tensor, the fraction of masked rows at or above the
        threshold (1.0 when nothing is masked). In ``downweight`` mode the other rows still carry weight.

    Raises:
        ValueError: on an unknown mode, not exactly one of threshold/quantile, a quantile outside [0, 1),
            ``downweight`` outside [0, 1], or shapes that do not match.
    """
    _check_filter_args(mode, threshold, quantile)
    if not 0.0 <= downweight <= 1.0:
        raise ValueError(f"entropy filter downweight must be in [0, 1], got {downweight}")
    x = target_logits_or_entropies
    if x.dim() not in (2, 3) or tuple(x.shape[:2]) != tuple(mask.shape):
        raise ValueError(
            f"entropy filter: expected logits (B, T, V) or entropies (B, T) matching mask {tuple(mask.shape)}, "
            f"got {tuple(x.shape)}"
        )
    m = mask.bool()
    if mode == "off":
        return m.float(), torch.ones((), dtype=torch.float32, device=m.device)
    b, t = m.shape
    # positions whose entropy is needed: the key positions of masked rows
    need = torch.zeros_like(m)
    if key_offset >= 0:
        need[:, key_offset:] = m[:, : t - key_offset]
    else:
        need[:, : t + key_offset] = m[:, -key_offset:]
    if x.dim() == 3:
        ent = torch.zeros(b, t, dtype=torch.float32, device=x.device)
        ent[need] = token_entropy(x[need], chunk_size)  # (n_need,)
    else:
        ent = x.float()
    keys, has = shift_keys(ent, key_offset)
    has &= m
    tau = quantile_threshold(keys[has], quantile) if quantile is not None else float(threshold)
    high = has & (keys >= tau)  # (B, T)
    weights = high.float()
    if mode == "downweight":
        weights = torch.where(has & ~high, torch.full_like(weights, downweight), weights)
    n_mask = m.sum()
    kept = torch.where(n_mask > 0, high.sum().float() / n_mask.clamp_min(1).float(), 1.0)
    return weights, kept.to(torch.float32)
