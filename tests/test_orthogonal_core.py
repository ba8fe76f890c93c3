"""The orthogonal core against dense float64 references (tests/helpers/reference.py)."""

import pytest
import torch
from reference import block_rotation_dense, cayley_inverse, neumann_series, skew_dense, subset_rotation_dense
from tolerances import gamma

from poet_hf.orthogonal import (
    CayleyNeumann,
    block_matmul_left,
    block_matmul_right,
    cayley,
    cayley_neumann,
    neumann_error_bound,
    num_skew_params,
    orthogonal_from_vector,
    sample_permutation,
    sample_subset,
    skew_from_vector,
    spo_generator,
    subset_matmul_left,
    subset_matmul_right,
)

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math


def random_skew(b: int, op_norm: float, batch: int = 3) -> torch.Tensor:
    vec = torch.randn(batch, num_skew_params(b), dtype=torch.float64)
    q = skew_from_vector(vec, b)
    return q * (op_norm / torch.linalg.matrix_norm(q, ord=2))[:, None, None]


def test_skew_matches_loop_construction():
    vec = torch.randn(2, num_skew_params(5), dtype=torch.float64)
    q = skew_from_vector(vec, 5)
    for i in range(2):
        torch.testing.assert_close(q[i], skew_dense(vec[i], 5), rtol=0, atol=0)


def test_exact_cayley_is_orthogonal_with_det_one_and_matches_inverse_form():
    q = random_skew(6, 0.8)
    r = cayley(q)
    eye = torch.eye(6, dtype=torch.float64)
    assert (r @ r.mT - eye).abs().max() < 1e-13
    torch.testing.assert_close(torch.linalg.det(r), torch.ones(3, dtype=torch.float64))
    for i in range(3):
        torch.testing.assert_close(r[i], cayley_inverse(q[i]), rtol=0, atol=1e-13)


@pytest.mark.parametrize("terms", [2, 3, 4, 5, 8])
def test_cayley_neumann_equals_truncated_series(terms):
    q = random_skew(6, 0.5)
    r = cayley_neumann(q, terms)
    # Either evaluation is at most `terms` products of 6 × 6 matrices, each off by γ_6 of the product of magnitudes:
    # entrywise ≤ terms·γ_6·Σ_i c_i ρ^i, with ρ the largest row sum of |Q| and c = (1, 2, …, 2, 1).
    for i in range(3):
        rho = float(q[i].abs().sum(-1).max())
        magnitude = sum(c * rho**power for power, c in enumerate([1] + [2] * (terms - 2) + [1]))
        torch.testing.assert_close(
            r[i], neumann_series(q[i], terms), rtol=0, atol=2 * terms * gamma(6, torch.float64) * magnitude
        )


@pytest.mark.parametrize("terms", [2, 3, 5, 8])
def test_cayley_neumann_error_vanishes_as_q_norm_to_zero_at_order_k_minus_1(terms):
    # ||R_k - R_exact||_2 = ||Q||_2^(k-1) exactly (R_k = R_exact (I - Q^(k-1))). Rounding: the series is off entrywise
    # by terms·γ_8·Σ c_i ρ^i (as above), the reference (I + Q)(I − Q)⁻¹ by about 2·γ_8·κ(I − Q) entrywise (an inverse
    # and a product, ‖·‖ ≤ 1 + ρ), and ‖E‖_2 ≤ 8·max|E_ij| for an 8 × 8 matrix.
    for op_norm in (0.3, 0.1, 0.03):
        q = random_skew(8, op_norm)
        err = torch.linalg.matrix_norm(cayley_neumann(q, terms) - torch.stack([cayley_inverse(x) for x in q]), ord=2)
        rho = float(q.abs().sum(-1).max())
        magnitude = sum(c * rho**power for power, c in enumerate([1] + [2] * (terms - 2) + [1]))
        condition = float(torch.linalg.cond(torch.eye(8, dtype=torch.float64) - q).max())
        rounding = 8 * gamma(8, torch.float64) * (terms * magnitude + 2 * condition * (1 + rho))
        torch.testing.assert_close(err, torch.full_like(err, op_norm ** (terms - 1)), rtol=1e-9, atol=rounding)


def test_neumann_singular_values_follow_the_closed_form():
    q = random_skew(6, 0.4, batch=1)[0]
    terms = 4
    theta = torch.linalg.eigvals(q).imag  # eigenvalues of a real skew matrix are ±iθ
    expected = (1 - (1j * theta.to(torch.complex128)) ** (terms - 1)).abs().sort().values
    got = torch.linalg.svdvals(cayley_neumann(q, terms)).sort().values
    torch.testing.assert_close(got, expected, rtol=0, atol=1e-12)
    assert abs(float(neumann_error_bound(q, terms)) - float((expected - 1).abs().max())) < 1e-12


@pytest.mark.parametrize("terms", [1, -1, 2.5])
def test_bad_neumann_terms_rejected(terms):
    with pytest.raises(ValueError, match="`terms` must be 0"):
        cayley_neumann(torch.zeros(1, 3, 3), terms)
    with pytest.raises(ValueError, match="`neumann_terms` must be 0"):  # the map names the config's field
        CayleyNeumann(terms)


@pytest.mark.parametrize("permuted", [True, False])
def test_block_primitive_matches_dense_reference(permuted):
    d, b = 12, 4
    perm = torch.randperm(d) if permuted else None
    blocks = orthogonal_from_vector(torch.randn(d // b, num_skew_params(b), dtype=torch.float64) * 0.3, b, 0)
    dense = block_rotation_dense(perm, blocks)
    x = torch.randn(5, 7, d, dtype=torch.float64)
    m = torch.randn(d, 9, dtype=torch.float64)
    torch.testing.assert_close(block_matmul_right(x, perm, blocks), x @ dense, rtol=0, atol=1e-13)
    torch.testing.assert_close(block_matmul_left(m, perm, blocks), dense @ m, rtol=0, atol=1e-13)
    assert (dense @ dense.T - torch.eye(d, dtype=torch.float64)).abs().max() < 1e-13


@pytest.mark.parametrize("layout", ["row-major", "column-major", "3-d", "strided"])
def test_select_last_gathers_the_columns_a_permutation_matrix_picks(layout):
    from poet_hf.orthogonal.spo import select_last

    base = torch.randn(6, 8, dtype=torch.float64)
    x = {"row-major": base, "column-major": base.T.contiguous().T, "3-d": base.reshape(2, 3, 8), "strided": base[::2]}[
        layout
    ]
    index = torch.randperm(8)
    picks = torch.eye(8, dtype=torch.float64)[:, index]  # column j of x @ picks is column index[j] of x
    assert torch.equal(select_last(x, index), x @ picks)


def test_subset_primitive_matches_dense_reference():
    d, s = 10, 4
    index = torch.randperm(d)[:s].sort().values
    block = orthogonal_from_vector(torch.randn(1, num_skew_params(s), dtype=torch.float64) * 0.3, s, 0)[0]
    dense = subset_rotation_dense(index, block, d)
    x = torch.randn(3, d, dtype=torch.float64)
    m = torch.randn(d, 6, dtype=torch.float64)
    torch.testing.assert_close(subset_matmul_right(x, index, block), x @ dense, rtol=0, atol=1e-13)
    torch.testing.assert_close(subset_matmul_left(m, index, block), dense @ m, rtol=0, atol=1e-13)


def test_generators_are_keyed_by_seed_merge_count_layer_and_side():
    def draw(*key):
        return sample_permutation(64, spo_generator(*key))

    base = draw(0, 3, "model.layers.0.q_proj", "input")
    torch.testing.assert_close(base, draw(0, 3, "model.layers.0.q_proj", "input"), rtol=0, atol=0)
    for other in [
        (1, 3, "model.layers.0.q_proj", "input"),
        (0, 4, "model.layers.0.q_proj", "input"),
        (0, 3, "model.layers.1.q_proj", "input"),
        (0, 3, "model.layers.0.q_proj", "output"),
    ]:
        assert not torch.equal(base, draw(*other))
    subset = sample_subset(64, 20, spo_generator(0, 0, "x", "input"))
    assert subset.numel() == 20 and subset.unique().numel() == 20 and torch.equal(subset, subset.sort().values)
