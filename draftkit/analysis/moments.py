"""Streaming first and second moments of P layers' rows in fp64 (layer-analysis.md §3, §5.2a, §6.1).

Each batch product is formed in fp32 (bf16 states are upcast first) and added into an fp64 accumulator;
nothing is ever accumulated in bf16. Two layouts:

- ``cross=False``: per-layer S_ℓ = Σ z̃ z̃ᵀ, (P, d, d); memory P d² · 8 bytes, compute 2 n P d² flops.
  Enough for H1 and H2 per layer.
- ``cross=True``: every cross moment S_ℓm, one (P d, P d) matrix; memory (P d)² · 8 bytes, compute
  2 n (P d)² flops. Adds exact CKA (§6.1) and exact concatenation entropy (§5.2a).

The centered moment is C_ℓm = S_ℓm - s_ℓ s_mᵀ / n.

Shapes: n rows, d features (H_t), P candidate layers.
"""

from __future__ import annotations

import torch

from draftkit.analysis.cka import cka_from_cross
from draftkit.analysis.entropy import concat_block_matrix, entropy_h1, entropy_h2

__all__ = ["LayerMoments"]


class LayerMoments:
    """Running sums s_ℓ and S_ℓ (or S_ℓm) of the preprocessed rows of P layers.

    Args:
        num_layers: P.
        dim: d.
        cross: keep every cross moment (exact CKA and concatenation entropy) rather than only the diagonal blocks.
        device: where the fp64 accumulators live.
    """

    def __init__(self, num_layers: int, dim: int, cross: bool = False, device: str | torch.device = "cpu") -> None:
        self.num_layers, self.dim, self.cross = num_layers, dim, cross
        self.n = 0
        self.sum = torch.zeros(num_layers, dim, dtype=torch.float64, device=device)  # (P, d)
        shape = (num_layers * dim, num_layers * dim) if cross else (num_layers, dim, dim)
        self.second = torch.zeros(shape, dtype=torch.float64, device=device)
        self._cross_cache: torch.Tensor | None = None

    @staticmethod
    def memory_bytes(num_layers: int, dim: int, cross: bool) -> int:
        """Bytes held by the fp64 second-moment accumulator."""
        return 8 * ((num_layers * dim) ** 2 if cross else num_layers * dim * dim)

    def update(self, z: torch.Tensor) -> None:
        """Add rows.

        Args:
            z: (P, n, d) preprocessed rows (any float dtype; products are formed in fp32, or fp64 for fp64 input).
        """
        p, n, d = z.shape
        if n == 0:
            return
        self._cross_cache = None
        # products in fp32 (bf16/fp16 upcast first); fp64 input stays fp64
        z = z.to(device=self.sum.device, dtype=torch.float64 if z.dtype == torch.float64 else torch.float32)
        self.sum += z.sum(1).to(torch.float64)
        if self.cross:
            flat = z.transpose(0, 1).reshape(n, p * d)  # (n, P d)
            self.second += (flat.T @ flat).to(torch.float64)
        else:
            self.second += torch.bmm(z.transpose(1, 2), z).to(torch.float64)  # (P, d, d)
        self.n += n

    def merge(self, other: LayerMoments) -> None:
        """Add another accumulator's sums (e.g. from another rank or shard)."""
        self._cross_cache = None
        self.sum += other.sum.to(self.sum.device)
        self.second += other.second.to(self.second.device)
        self.n += other.n

    def covariances(self) -> torch.Tensor:
        """(P, d, d) fp64 centered second moments C_ℓℓ.

        Raises:
            ValueError: if no row was added.
        """
        if self.n == 0:
            raise ValueError("no rows were accumulated")
        if self.cross:
            p, d = self.num_layers, self.dim
            diag = self.second.view(p, d, p, d).diagonal(dim1=0, dim2=2).permute(2, 0, 1)  # (P, d, d)
        else:
            diag = self.second
        return diag - self.sum[:, :, None] * self.sum[:, None, :] / self.n

    def cross_covariance(self) -> torch.Tensor:
        """(P, d, P, d) fp64 centered cross moments C_ℓm (``cross=True`` only).

        Raises:
            ValueError: without cross moments or rows.
        """
        if not self.cross:
            raise ValueError("cross moments were not accumulated (cross=False)")
        if self.n == 0:
            raise ValueError("no rows were accumulated")
        if self._cross_cache is None:
            p, d = self.num_layers, self.dim
            flat_sum = self.sum.reshape(p * d)  # (P d,)
            c = self.second - flat_sum[:, None] * flat_sum[None, :] / self.n  # (P d, P d)
            self._cross_cache = c.view(p, d, p, d)
        return self._cross_cache

    def entropies(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-layer (H1, H2), each (P,) fp64 nats."""
        cov = self.covariances()
        return entropy_h1(cov), entropy_h2(cov)

    def cka(self) -> torch.Tensor:
        """(P, P) exact linear CKA (``cross=True`` only)."""
        return cka_from_cross(self.cross_covariance())

    def concat_entropies(self, idx: list[int]) -> tuple[float, float]:
        """Exact (H1, H2) of the equally weighted concatenation of the layers at positions ``idx`` (§5.2a)."""
        a = concat_block_matrix(self.cross_covariance(), idx)  # (k d, k d), trace 1
        return float(entropy_h1(a)), float(entropy_h2(a))
