"""Linear CKA and HSIC1 (layer-analysis.md §6, §10)."""

import pytest
import torch

from draftkit.analysis.cka import (
    MinibatchCKA,
    cka_from_cross,
    hsic1_features,
    hsic1_gram,
    hsic1_matrix_features,
    hsic1_matrix_gram,
    linear_cka,
)
from draftkit.analysis.moments import LayerMoments


def _x(n=64, d=10, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, d, generator=g, dtype=torch.float64) @ torch.randn(d, d, generator=g, dtype=torch.float64)


def test_cka_of_x_with_itself_is_one():
    x = _x()
    assert float(linear_cka(x, x)) == pytest.approx(1.0, abs=1e-12)


def test_cka_invariant_to_orthogonal_transform_and_isotropic_scale():
    x, y = _x(seed=0), _x(seed=1)
    q, _ = torch.linalg.qr(torch.randn(10, 10, dtype=torch.float64, generator=torch.Generator().manual_seed(3)))
    ref = float(linear_cka(x, y))
    assert 0.0 < ref < 1.0
    assert float(linear_cka(x @ q, y)) == pytest.approx(ref, abs=1e-12)
    assert float(linear_cka(x, 3.7 * y)) == pytest.approx(ref, abs=1e-12)
    assert float(linear_cka(x @ q * 0.01, y @ q.T)) == pytest.approx(ref, abs=1e-12)
    # ... but not to a general invertible map
    a = torch.diag(torch.tensor([10.0] + [1.0] * 9, dtype=torch.float64))
    assert abs(float(linear_cka(x @ a, y)) - ref) > 1e-3


def test_cka_from_cross_moments_equals_plain_cka():
    zs = torch.stack([_x(seed=s) for s in range(3)])  # (P, n, d)
    mom = LayerMoments(3, 10, cross=True)
    for chunk in zs.split(7, dim=1):
        mom.update(chunk)
    cka = mom.cka()
    for i in range(3):
        for j in range(3):
            assert float(cka[i, j]) == pytest.approx(float(linear_cka(zs[i], zs[j])), abs=1e-10)
    assert torch.equal(cka, cka.T)
    assert torch.all(torch.diagonal(cka) == 1.0)
    assert torch.allclose(cka_from_cross(mom.cross_covariance()), cka)


@pytest.mark.parametrize("n,d1,d2", [(6, 20, 15), (50, 4, 7)])
def test_hsic1_gram_equals_feature_form(n, d1, d2):
    g = torch.Generator().manual_seed(4)
    x = torch.randn(n, d1, generator=g, dtype=torch.float64) + 1.0
    y = x[:, :1] * torch.randn(1, d2, generator=g, dtype=torch.float64) + torch.randn(n, d2, generator=g, dtype=torch.float64)
    a = float(hsic1_gram(x @ x.T, y @ y.T))
    b = float(hsic1_features(x, y))
    assert a == pytest.approx(b, rel=1e-9)
    z = torch.stack([x[:, :4], y[:, :4], x[:, :4] * 2 + 1])
    assert torch.allclose(hsic1_matrix_gram(z), hsic1_matrix_features(z), rtol=1e-9, atol=1e-12)
    assert float(hsic1_matrix_gram(z)[0, 1]) == pytest.approx(float(hsic1_gram(z[0] @ z[0].T, z[1] @ z[1].T)), rel=1e-9)


def test_hsic1_is_unbiased_for_the_population_hsic():
    # linear kernel: HSIC = ||Cov(x, y)||_F^2; x ~ N(0, I_2), y = A x + noise -> Cov(x, y) = A^T
    g = torch.Generator().manual_seed(5)
    a = torch.tensor([[1.0, 0.5], [-0.3, 0.8]], dtype=torch.float64)
    truth = float(a.pow(2).sum())
    n, reps = 6, 10_000
    x = torch.randn(reps, n, 2, generator=g, dtype=torch.float64) + 5.0  # offsets must not matter
    y = x @ a.T + torch.randn(reps, n, 2, generator=g, dtype=torch.float64)
    k, l = x @ x.transpose(1, 2), y @ y.transpose(1, 2)
    est = torch.stack([hsic1_gram(k[i], l[i]) for i in range(reps)])
    se = float(est.std()) / reps ** 0.5
    assert abs(float(est.mean()) - truth) < 4 * se
    # the biased plug-in estimator tr(KHLH)/(n-1)^2 is visibly off at n = 6
    h = torch.eye(n, dtype=torch.float64) - 1.0 / n
    biased = torch.stack([torch.trace(k[i] @ h @ l[i] @ h) / (n - 1) ** 2 for i in range(2000)])
    assert abs(float(biased.mean()) - truth) > 0.1 * truth


def test_minibatch_cka_close_to_exact_on_correlated_data():
    g = torch.Generator().manual_seed(6)
    n, d = 8192, 32
    base = torch.randn(n, d, generator=g)
    layers = [base @ torch.randn(d, d, generator=g) * s + torch.randn(n, d, generator=g) * w
              for s, w in ((1.0, 0.1), (1.0, 1.0), (0.5, 2.0), (0.1, 1.0))]
    z = torch.stack(layers)  # (P, n, d)
    z = z / z.norm(dim=-1, keepdim=True)
    mom = LayerMoments(4, d, cross=True)
    mom.update(z)
    exact = mom.cka()
    mb = MinibatchCKA(4)
    for chunk in z.split(256, dim=1):
        mb.update(chunk)
    approx = mb.compute()
    assert exact.min() < 0.5  # a spread of similarities, not all near 1
    assert float((approx - exact).abs().max()) < 0.01
    assert torch.equal(approx, approx.T) and torch.all(torch.diagonal(approx) == 1.0)


def test_minibatch_needs_four_rows_and_a_batch():
    with pytest.raises(ValueError, match="at least 4 rows"):
        hsic1_gram(torch.eye(3), torch.eye(3))
    with pytest.raises(ValueError, match="no minibatch"):
        MinibatchCKA(2).compute()
