"""Matrix entropy of layer representations (layer-analysis.md §4-§5).

Per layer, from the centered second moment C (d, d) accumulated in fp64:

1. Σ = C / tr(C) (PSD, trace 1);
2. λ = eigvalsh(Σ) in fp64, clamped at 0 and renormalised;
3. H1 = -Σ λ log λ (von Neumann entropy, nats; the α -> 1 matrix Rényi entropy of Giraldo, Rao & Principe,
   arXiv 1211.2459) and H2 = -log Σ λ² = -log ‖Σ‖_F² (no eigendecomposition).

For a set S of layers the head sees the concatenation; draftkit weights the layers equally,
A_S = (1/|S|) Σ_{ℓ∈S} K_ℓ / tr K_ℓ (K_ℓ the centered Gram), whose nonzero spectrum equals that of the
(|S| d, |S| d) block matrix with blocks C_ℓm / (|S| sqrt(tr C_ℓℓ tr C_mm)) (§5.2a). H2(S) has a closed form in
the per-layer H2 and the pairwise linear CKA (§5.1), used to screen every k-subset.

Shapes: n rows (token positions), d features (H_t), P candidate layers, M subsets, k layers per subset.
"""

from __future__ import annotations

import torch

__all__ = [
    "centered_second_moment",
    "concat_block_matrix",
    "concat_entropies_from_rows",
    "entropy_h1",
    "entropy_h1_from_spectrum",
    "entropy_h2",
    "h2_concat_closed_form",
    "h2_concat_direct",
    "row_entropies",
    "spectrum",
]


def _trace_normalize(cov: torch.Tensor) -> torch.Tensor:
    """(..., d, d) fp64 PSD matrices divided by their trace.

    Raises:
        ValueError: if a trace is not positive (all rows identical after preprocessing).
    """
    cov = cov.to(torch.float64)
    tr = torch.diagonal(cov, dim1=-2, dim2=-1).sum(-1)  # (...)
    if bool((tr <= 0).any()):
        raise ValueError(
            "a covariance has zero trace: every analysed row is identical at that layer (too few or constant "
            "positions); analyse more tokens"
        )
    return cov / tr[..., None, None]


def spectrum(cov: torch.Tensor) -> torch.Tensor:
    """Normalised eigenvalues of a trace-normalised covariance (§4 steps 1-2).

    Args:
        cov: (..., d, d) symmetric PSD (any float dtype; computed in fp64).

    Returns:
        (..., d) fp64, non-negative, summing to 1.
    """
    lam = torch.linalg.eigvalsh(_trace_normalize(cov)).clamp_min(0.0)  # (..., d)
    return lam / lam.sum(-1, keepdim=True)


def entropy_h1_from_spectrum(lam: torch.Tensor) -> torch.Tensor:
    """H1 = -Σ λ log λ in nats with 0·log 0 = 0.

    Args:
        lam: (..., d) non-negative eigenvalues summing to 1.

    Returns:
        (...) fp64.
    """
    lam = lam.to(torch.float64)
    return -torch.special.xlogy(lam, lam).sum(-1)


def entropy_h1(cov: torch.Tensor) -> torch.Tensor:
    """Von Neumann entropy of C / tr C (nats); a special case, not the Rényi formula at α = 1.

    Args:
        cov: (..., d, d) centered second moment(s).

    Returns:
        (...) fp64.
    """
    return entropy_h1_from_spectrum(spectrum(cov))


def entropy_h2(cov: torch.Tensor) -> torch.Tensor:
    """Collision entropy H2 = -log ‖C / tr C‖_F² (nats).

    Args:
        cov: (..., d, d) centered second moment(s).

    Returns:
        (...) fp64.
    """
    sigma = _trace_normalize(cov)
    return -torch.log(sigma.pow(2).sum((-2, -1)))


def centered_second_moment(z: torch.Tensor) -> torch.Tensor:
    """C = Zcᵀ Zc for column-centered rows, in fp64 (a plain one-shot reference for the streaming path).

    Args:
        z: (n, d) rows.

    Returns:
        (d, d) fp64.
    """
    z = z.to(torch.float64)
    zc = z - z.mean(0, keepdim=True)  # (n, d)
    return zc.T @ zc


def row_entropies(z: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(H1, H2) of the column-centered rows z, computed on the smaller side (Gram n×n or covariance d×d).

    The nonzero eigenvalues of Zc Zcᵀ and Zcᵀ Zc are identical, so both sides give the same entropies.

    Args:
        z: (n, d) rows (already weighted / concatenated as wanted).

    Returns:
        (h1, h2) 0-d fp64 tensors.
    """
    z = z.to(torch.float64)
    zc = z - z.mean(0, keepdim=True)  # (n, d)
    m = zc @ zc.T if zc.shape[0] < zc.shape[1] else zc.T @ zc  # (min(n, d), min(n, d))
    return entropy_h1(m), entropy_h2(m)


def concat_block_matrix(cross: torch.Tensor, idx: list[int] | torch.Tensor) -> torch.Tensor:
    """The (|S| d, |S| d) trace-1 matrix whose spectrum is that of A_S (§5.2a).

    Args:
        cross: (P, d, P, d) fp64 centered cross moments C_ℓm (C_ℓm = Σ z̃_ℓ z̃_mᵀ - s_ℓ s_mᵀ / n).
        idx: the |S| candidate positions (rows of ``cross``), not layer ids.

    Returns:
        (|S| d, |S| d) fp64.
    """
    idx = torch.as_tensor(idx, dtype=torch.long)
    k = idx.numel()
    d = cross.shape[1]
    sub = cross[idx][:, :, idx]  # (k, d, k, d)
    tr = torch.stack([torch.diagonal(sub[i, :, i, :]).sum() for i in range(k)])  # (k,)
    scale = 1.0 / (k * torch.sqrt(tr[:, None] * tr[None, :]))  # (k, k)
    sub = sub * scale[:, None, :, None]  # (k, d, k, d)
    return sub.reshape(k * d, k * d)  # (k d, k d)


def h2_concat_closed_form(h2: torch.Tensor, cka: torch.Tensor, subsets: torch.Tensor) -> torch.Tensor:
    """H2 of the equally weighted concatenation of each subset, in closed form (§5.1).

    H2(S) = -log[(1/|S|²) Σ_{ℓ,m∈S} CKA(ℓ, m) exp(-(H2(ℓ) + H2(m)) / 2)], since ‖A_ℓ‖_F² = exp(-H2(ℓ)) and
    ⟨A_ℓ, A_m⟩_F = CKA(ℓ, m) ‖A_ℓ‖_F ‖A_m‖_F. Exact when H2 and CKA are plug-in estimates over the same rows.

    Args:
        h2: (P,) per-layer H2 (nats).
        cka: (P, P) linear CKA, unit diagonal.
        subsets: (M, k) int64 candidate positions (rows of ``cka``), or (k,) for one subset.

    Returns:
        (M,) fp64 (or 0-d for one subset).
    """
    h2 = h2.to(torch.float64)
    cka = cka.to(torch.float64)
    one = subsets.dim() == 1
    subsets = subsets.view(1, -1) if one else subsets
    k = subsets.shape[1]
    w = torch.exp(-h2 / 2)[subsets]  # (M, k) = ‖A_ℓ‖_F
    c = cka[subsets[:, :, None], subsets[:, None, :]]  # (M, k, k)
    inner = (c * w[:, :, None] * w[:, None, :]).sum((1, 2)) / (k * k)  # (M,) = ‖A_S‖_F²
    out = -torch.log(inner)
    return out[0] if one else out


def h2_concat_direct(zs: list[torch.Tensor]) -> torch.Tensor:
    """Direct H2(S) = -log ‖A_S‖_F² from the rows of each layer (plain reference for tests).

    Args:
        zs: |S| tensors (n, d_ℓ) with the same rows.

    Returns:
        0-d fp64.
    """
    grams = []
    for z in zs:
        z = z.to(torch.float64)
        zc = z - z.mean(0, keepdim=True)  # (n, d)
        g = zc @ zc.T  # (n, n)
        grams.append(g / torch.trace(g))
    a = torch.stack(grams).mean(0)  # (n, n), trace 1
    return -torch.log(a.pow(2).sum())


def concat_entropies_from_rows(rows: torch.Tensor, idx: list[int] | torch.Tensor) -> tuple[float, float]:
    """(H1, H2) of A_S from a row subsample (§5.2b), on the covariance side when n > |S| d.

    Each layer's rows are centered over the subsample and scaled by 1 / sqrt(|S| · ‖Zc_ℓ‖_F²), so that the
    concatenation's second moment has trace 1 and the nonzero spectrum of A_S.

    Args:
        rows: (P, n, d) preprocessed rows of every candidate layer (same rows).
        idx: the |S| candidate positions.

    Returns:
        (h1, h2) in nats.
    """
    idx = torch.as_tensor(idx, dtype=torch.long)
    z = rows[idx].to(torch.float64)  # (k, n, d)
    z = z - z.mean(1, keepdim=True)
    z = z / torch.sqrt(idx.numel() * z.pow(2).sum((1, 2), keepdim=True))
    k, n, d = z.shape
    flat = z.transpose(0, 1).reshape(n, k * d)  # (n, k d)
    m = flat @ flat.T if n < k * d else flat.T @ flat  # trace 1
    return float(entropy_h1(m)), float(entropy_h2(m))
