"""Linear CKA between layers (Kornblith et al., arXiv 1905.00414; layer-analysis.md §6).

CKA(X, Y) = ‖XᵀY‖_F² / (‖XᵀX‖_F ‖YᵀY‖_F) for column-centered X, Y. Two estimators:

- exact plug-in from streamed fp64 cross moments C_ℓm (§6.1): :func:`cka_from_cross`;
- minibatch CKA with the unbiased HSIC1 estimator (Song et al., JMLR 2012; Nguyen, Raghu & Kornblith,
  arXiv 2010.15327; GPU reference ``numpee/CKA.pytorch`` ``cka.py``) (§6.2): :class:`MinibatchCKA`, which
  averages HSIC1 over minibatches of rows shuffled across sequences. HSIC1 has a Gram form
  (:func:`hsic1_gram`, O(n² d) per layer) and a feature form (:func:`hsic1_features`, O(n d₁ d₂) per pair);
  they agree to rounding.

Products are formed in fp32 and cast to fp64 before the three heavily cancelling HSIC1 terms are combined.

Shapes: n rows, d features, P candidate layers.
"""

from __future__ import annotations

import torch

__all__ = [
    "MinibatchCKA",
    "cka_from_cross",
    "hsic1_features",
    "hsic1_gram",
    "hsic1_matrix_features",
    "hsic1_matrix_gram",
    "linear_cka",
]


def linear_cka(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Plain linear CKA of two row-aligned matrices (fp64 reference).

    Args:
        x: (n, d1) rows.
        y: (n, d2) the same rows in another representation.

    Returns:
        0-d fp64 in [0, 1].
    """
    x = x.to(torch.float64)
    y = y.to(torch.float64)
    x = x - x.mean(0, keepdim=True)  # (n, d1)
    y = y - y.mean(0, keepdim=True)  # (n, d2)
    xy = (x.T @ y).pow(2).sum()
    return xy / ((x.T @ x).norm() * (y.T @ y).norm())


def cka_from_cross(cross: torch.Tensor) -> torch.Tensor:
    """Exact CKA matrix from centered cross moments (§6.1).

    Args:
        cross: (P, d, P, d) fp64, C_ℓm = Σ z̃_ℓ z̃_mᵀ - s_ℓ s_mᵀ / n.

    Returns:
        (P, P) fp64, symmetric, unit diagonal.
    """
    sq = cross.pow(2).sum((1, 3))  # (P, P) = ‖C_ℓm‖_F²
    norms = torch.sqrt(torch.diagonal(sq))  # (P,) = ‖C_ℓℓ‖_F
    cka = sq / (norms[:, None] * norms[None, :])
    cka = (cka + cka.T) / 2
    cka.fill_diagonal_(1.0)
    return cka


def _check_rows(n: int) -> None:
    if n < 4:
        raise ValueError(f"HSIC1 needs at least 4 rows per minibatch, got {n}")


def _hsic1_combine(tr_kl, sum_k, sum_l, sum_kl, n: int):
    """Combine the HSIC1 terms in fp64 (they cancel heavily)."""
    tr_kl, sum_k, sum_l, sum_kl = (t.to(torch.float64) for t in (tr_kl, sum_k, sum_l, sum_kl))
    return (tr_kl + sum_k * sum_l / ((n - 1) * (n - 2)) - 2.0 / (n - 2) * sum_kl) / (n * (n - 3))


def hsic1_gram(k: torch.Tensor, l: torch.Tensor) -> torch.Tensor:
    """Unbiased HSIC1 of two Gram matrices (Song et al., JMLR 2012).

    HSIC1 = [tr(K̃L̃) + (1ᵀK̃1)(1ᵀL̃1) / ((n-1)(n-2)) - 2/(n-2) · 1ᵀK̃L̃1] / (n(n-3)), K̃, L̃ with zeroed
    diagonals.

    Args:
        k: (n, n) Gram matrix K = XXᵀ.
        l: (n, n) Gram matrix L = YYᵀ.

    Returns:
        0-d fp64.

    Raises:
        ValueError: if n < 4.
    """
    n = k.shape[0]
    _check_rows(n)
    kt = k.clone()
    lt = l.clone()
    kt.fill_diagonal_(0)
    lt.fill_diagonal_(0)
    return _hsic1_combine((kt * lt).sum(), kt.sum(), lt.sum(), kt.sum(0) @ lt.sum(0), n)


def hsic1_features(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """HSIC1 from features, with no n×n matrix (§6.2 feature-side form).

    With kd, ld the row squared norms, sx, sy the column sums and P = XᵀY:
    tr(K̃L̃) = ‖P‖_F² - kd·ld, 1ᵀK̃1 = sx·sx - Σkd, 1ᵀL̃1 = sy·sy - Σld,
    1ᵀK̃L̃1 = sxᵀ P sy - (X sx)·ld - kd·(Y sy) + kd·ld.

    Args:
        x: (n, d1) rows.
        y: (n, d2) the same rows in another representation.

    Returns:
        0-d fp64.

    Raises:
        ValueError: if n < 4.
    """
    n = x.shape[0]
    _check_rows(n)
    kd = x.pow(2).sum(1)  # (n,)
    ld = y.pow(2).sum(1)  # (n,)
    sx = x.sum(0)  # (d1,)
    sy = y.sum(0)  # (d2,)
    p = x.T @ y  # (d1, d2)
    kdld = (kd.to(torch.float64) * ld.to(torch.float64)).sum()
    tr_kl = p.to(torch.float64).pow(2).sum() - kdld
    sum_k = sx.to(torch.float64).pow(2).sum() - kd.to(torch.float64).sum()
    sum_l = sy.to(torch.float64).pow(2).sum() - ld.to(torch.float64).sum()
    sum_kl = (
        sx.to(torch.float64) @ p.to(torch.float64) @ sy.to(torch.float64)
        - (x @ sx).to(torch.float64) @ ld.to(torch.float64)
        - kd.to(torch.float64) @ (y @ sy).to(torch.float64)
        + kdld
    )
    return _hsic1_combine(tr_kl, sum_k, sum_l, sum_kl, n)


def hsic1_matrix_gram(z: torch.Tensor) -> torch.Tensor:
    """HSIC1 for every pair of layers, Gram form: O(P n² d) for the Grams plus O(P² n²) for the pairs.

    Args:
        z: (P, n, d) rows of each layer (same rows).

    Returns:
        (P, P) fp64, symmetric.

    Raises:
        ValueError: if n < 4.
    """
    p, n, _ = z.shape
    _check_rows(n)
    grams = torch.bmm(z, z.transpose(1, 2))  # (P, n, n), fp32 products
    grams.diagonal(dim1=1, dim2=2).zero_()
    flat = grams.reshape(p, n * n).to(torch.float64)  # (P, n²)
    del grams
    tr_kl = flat @ flat.T  # (P, P) = tr(K̃_ℓ K̃_m)
    rows = flat.view(p, n, n).sum(2)  # (P, n) = K̃_ℓ 1
    sums = rows.sum(1)  # (P,) = 1ᵀ K̃_ℓ 1
    sum_kl = rows @ rows.T  # (P, P) = 1ᵀ K̃_ℓ K̃_m 1 (K̃ symmetric)
    return _hsic1_combine(tr_kl, sums[:, None], sums[None, :], sum_kl, n)


def hsic1_matrix_features(z: torch.Tensor) -> torch.Tensor:
    """HSIC1 for every pair of layers, feature form: O(P² n d²) and no n×n matrix.

    Args:
        z: (P, n, d) rows of each layer.

    Returns:
        (P, P) fp64, symmetric.
    """
    p = z.shape[0]
    out = torch.empty(p, p, dtype=torch.float64)
    for i in range(p):
        for j in range(i, p):
            out[i, j] = out[j, i] = hsic1_features(z[i], z[j])
    return out


class MinibatchCKA:
    """Running minibatch CKA over P layers: three fp64 sums per pair (§6.2).

    CKA_mb(ℓ, m) = mean_b HSIC1(K_ℓ, K_m) / sqrt(mean_b HSIC1(K_ℓ, K_ℓ) · mean_b HSIC1(K_m, K_m)).
    Each minibatch should hold rows drawn from many sequences (HSIC1 assumes independent rows);
    :class:`draftkit.analysis.collect.LayerStatsCollector` shuffles a pool before cutting minibatches.

    Args:
        num_layers: P.
        form: ``"gram"``, ``"features"`` or ``"auto"`` (the cheaper for the minibatch shape).
    """

    def __init__(self, num_layers: int, form: str = "auto") -> None:
        if form not in ("gram", "features", "auto"):
            raise ValueError(f"form must be gram, features or auto, got {form!r}")
        self.num_layers = num_layers
        self.form = form
        self.hsic = torch.zeros(num_layers, num_layers, dtype=torch.float64)
        self.num_batches = 0
        self.num_rows = 0

    def _pick_form(self, n: int, d: int) -> str:
        if self.form != "auto":
            return self.form
        p = self.num_layers
        gram_cost = p * n * n * d + p * p * n * n  # Grams, then pair terms
        feature_cost = p * (p + 1) // 2 * n * d * d
        return "gram" if gram_cost <= feature_cost else "features"

    def update(self, z: torch.Tensor) -> None:
        """Add one minibatch.

        Args:
            z: (P, n, d) fp32 rows, n >= 4.
        """
        form = self._pick_form(z.shape[1], z.shape[2])
        h = hsic1_matrix_gram(z) if form == "gram" else hsic1_matrix_features(z)
        self.hsic += h.cpu()
        self.num_batches += 1
        self.num_rows += z.shape[1]

    def compute(self) -> torch.Tensor:
        """(P, P) fp64 CKA, symmetric with unit diagonal; entries clamped to [0, 1].

        Raises:
            ValueError: if no minibatch was added, or a layer's HSIC1 self-term is not positive.
        """
        if self.num_batches == 0:
            raise ValueError("minibatch CKA has no minibatch: too few rows were analysed")
        diag = torch.diagonal(self.hsic)
        if bool((diag <= 0).any()):
            bad = torch.nonzero(diag <= 0).flatten().tolist()
            raise ValueError(f"HSIC1 self-term is not positive for candidate positions {bad}; analyse more tokens")
        cka = self.hsic / torch.sqrt(diag[:, None] * diag[None, :])
        cka = ((cka + cka.T) / 2).clamp(0.0, 1.0)
        cka.fill_diagonal_(1.0)
        return cka
