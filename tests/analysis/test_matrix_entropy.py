"""Matrix entropy identities (layer-analysis.md §4, §5, §10)."""

import math

import pytest
import torch

from draftkit.analysis.cka import linear_cka
from draftkit.analysis.entropy import (
    centered_second_moment,
    concat_entropies_from_rows,
    entropy_h1,
    entropy_h2,
    h2_concat_closed_form,
    h2_concat_direct,
    row_entropies,
)
from draftkit.analysis.moments import LayerMoments


def _correlated_layers(n=60, d=12, p=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    base = torch.randn(n, d, generator=g, dtype=torch.float64)
    out = []
    for i in range(p):
        mix = torch.randn(d, d, generator=g, dtype=torch.float64)
        out.append(base @ mix * (i + 1) + 0.5 * torch.randn(n, d, generator=g, dtype=torch.float64) + 3.0)
    return out


def test_h1_h2_of_rank_r_flat_spectrum_is_log_r():
    cov = torch.diag(torch.tensor([2.0, 2.0, 2.0, 0.0, 0.0], dtype=torch.float64))
    assert float(entropy_h1(cov)) == pytest.approx(math.log(3), abs=1e-12)
    assert float(entropy_h2(cov)) == pytest.approx(math.log(3), abs=1e-12)


def test_h1_of_isotropic_gaussian_is_log_d():
    torch.manual_seed(0)
    d, n = 16, 40_000
    z = torch.randn(n, d, dtype=torch.float64)
    h1 = float(entropy_h1(centered_second_moment(z)))
    # finite-sample deficit is about d / (2n) = 2e-4
    assert h1 == pytest.approx(math.log(d), abs=2e-3)
    assert h1 < math.log(d)
    # row normalisation keeps the isotropic law isotropic
    zn = z / z.norm(dim=1, keepdim=True)
    assert float(entropy_h1(centered_second_moment(zn))) == pytest.approx(math.log(d), abs=2e-3)


@pytest.mark.parametrize("n,d", [(7, 20), (50, 9)])
def test_gram_side_equals_covariance_side(n, d):
    torch.manual_seed(1)
    z = torch.randn(n, d, dtype=torch.float64) @ torch.randn(d, d, dtype=torch.float64)
    zc = z - z.mean(0)
    for fn in (entropy_h1, entropy_h2):
        assert float(fn(zc @ zc.T)) == pytest.approx(float(fn(zc.T @ zc)), abs=1e-10)
    h1, _ = row_entropies(z)
    assert float(h1) == pytest.approx(float(entropy_h1(zc.T @ zc)), abs=1e-10)


def test_h2_closed_form_equals_direct():
    zs = _correlated_layers()
    h2 = torch.stack([entropy_h2(centered_second_moment(z)) for z in zs])
    cka = torch.tensor([[float(linear_cka(a, b)) for b in zs] for a in zs], dtype=torch.float64)
    for subset in ([0, 1], [0, 2], [0, 1, 2]):
        closed = float(h2_concat_closed_form(h2, cka, torch.tensor(subset)))
        direct = float(h2_concat_direct([zs[i] for i in subset]))
        assert closed == pytest.approx(direct, abs=1e-12)


def test_h2_sanity_cases():
    # two identical layers leave H2 unchanged
    (z,) = _correlated_layers(p=1)
    h2 = float(entropy_h2(centered_second_moment(z)))
    assert float(h2_concat_direct([z, z])) == pytest.approx(h2, abs=1e-12)
    # two layers with CKA = 0 and equal H2 give H2 + log 2: orthonormal, centered columns split in halves
    torch.manual_seed(2)
    n, d = 40, 6
    a = torch.randn(n, 2 * d, dtype=torch.float64)
    q, _ = torch.linalg.qr(a - a.mean(0))  # columns orthonormal and centered
    x, y = q[:, :d], q[:, d:]
    assert float(linear_cka(x, y)) == pytest.approx(0.0, abs=1e-12)
    hx = float(entropy_h2(centered_second_moment(x)))
    assert hx == pytest.approx(math.log(d), abs=1e-12)
    assert float(h2_concat_direct([x, y])) == pytest.approx(hx + math.log(2), abs=1e-12)
    closed = h2_concat_closed_form(torch.tensor([hx, hx], dtype=torch.float64), torch.eye(2, dtype=torch.float64), torch.tensor([0, 1]))
    assert float(closed) == pytest.approx(hx + math.log(2), abs=1e-12)


def test_exact_concat_entropy_from_cross_moments_equals_rows():
    zs = _correlated_layers(n=80, d=8, p=4)
    z = torch.stack(zs)  # (P, n, d)
    mom = LayerMoments(4, 8, cross=True)
    mom.update(z)
    for idx in ([0, 1, 3], [1, 2]):
        h1_cross, h2_cross = mom.concat_entropies(idx)
        h1_rows, h2_rows = concat_entropies_from_rows(z, idx)
        assert h1_cross == pytest.approx(h1_rows, abs=1e-10)
        assert h2_cross == pytest.approx(h2_rows, abs=1e-10)
        assert h2_cross == pytest.approx(float(h2_concat_direct([zs[i] for i in idx])), abs=1e-10)
    # the covariance route of §5.2b agrees with the Gram route on a subsample smaller than k*d
    h1_small, _ = concat_entropies_from_rows(z[:, :10], [0, 1, 3])
    zc = [zi[:10] - zi[:10].mean(0) for zi in zs]
    a = sum(g / torch.trace(g) for g in (zc[i] @ zc[i].T for i in (0, 1, 3))) / 3
    assert h1_small == pytest.approx(float(entropy_h1(a)), abs=1e-10)


def test_zero_trace_is_an_error():
    with pytest.raises(ValueError, match="zero trace"):
        entropy_h1(torch.zeros(3, 3))
