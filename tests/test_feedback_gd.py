"""FeedbackGD against known optima (PCA / Brockett, Procrustes via SVD), the paper's equations and torch SGD."""

from __future__ import annotations

import copy
import itertools

import pytest
import torch
from tolerances import gamma, unit_roundoff
from torch import nn

from poet_hf.orthogonal import FeedbackGD, stiefel_deviation

pytestmark = pytest.mark.numerics  # float64 / dense references at tolerances from the math

F64 = torch.float64


def rounding_floor(n: int, p: int, storage: torch.dtype, compute: torch.dtype, feedback: float = 0.4) -> float:
    """Where the deviation settles once the iterates have converged: each step rounds θ (n × p) to ``storage`` and
    computes its Gram matrix in ``compute``, moving ``||θᵀθ − I||_F`` by at most ``2(u + γ_n)·√p``, while the
    feedback term contracts it by ``1 − 2β`` per step. The fixed point of the two is ``(u + γ_n)·√p / β``."""
    return (unit_roundoff(storage) + gamma(n, compute)) * p**0.5 / feedback


def pca_problem(n: int, p: int, dtype: torch.dtype, seed: int = 0):
    """seed-001 §7 toy: minimise -1/2 tr(theta^T C theta), eig(C) = linspace(1, 0, n); optimum -1/2 (top-p sum)."""
    gen = torch.Generator().manual_seed(seed)
    q, _ = torch.linalg.qr(torch.randn(n, n, generator=gen, dtype=F64))
    eigs = torch.linspace(1, 0, n, dtype=F64)
    c = (q @ torch.diag(eigs) @ q.T).to(dtype)
    start, _ = torch.linalg.qr(torch.randn(n, p, generator=gen, dtype=F64))
    return c, start.to(dtype), float(-0.5 * eigs[:p].sum())


def run_pca(lr: float, feedback: float, steps: int, dtype=F64, **kwargs):
    c, start, optimum = pca_problem(64, 16, dtype)
    w = nn.Parameter(start.T.clone())  # stored wide (16 x 64), like a Linear weight with orthonormal rows
    opt = FeedbackGD([w], lr=lr, feedback=feedback, **kwargs)
    worst = 0.0
    for _ in range(steps):
        opt.zero_grad()
        loss = -0.5 * torch.trace(w @ c @ w.T)
        loss.backward()
        opt.step()
        worst = max(worst, stiefel_deviation(w))
        if not worst < 1e6:
            break
    return w, worst, float(-0.5 * torch.trace(w.detach() @ c @ w.detach().T)) - optimum


def test_pca_converges_inside_digest_band():
    # seed-001 §7 measured max ||theta^T theta - I||_F = 0.23 at lr 0.2, beta 0.4, and 7e-16 at convergence.
    w, worst, gap = run_pca(0.2, 0.4, 1500)
    assert 0.05 < worst <= 0.25
    assert stiefel_deviation(w) <= 1e-6
    assert stiefel_deviation(w) <= 1e-12
    assert abs(gap) <= 1e-10


def test_band_shrinks_with_lr():
    worst = [run_pca(lr, 0.4, 60)[1] for lr in (0.2, 0.1, 0.05)]  # the transient peaks within ~10 steps
    assert worst[0] > worst[1] > worst[2]
    assert worst[2] <= 0.04  # digest: 0.032 at lr 0.05


def test_feedback_is_necessary():
    _, with_feedback, _ = run_pca(0.2, 0.4, 60)
    _, without, _ = run_pca(0.2, 0.0, 60)
    assert not without <= 10 * with_feedback  # diverges (or is non-finite) without the feedback term


def test_float32_converges_to_its_rounding_floor():
    w, _, gap = run_pca(0.2, 0.4, 1500, dtype=torch.float32)
    assert stiefel_deviation(w) <= rounding_floor(64, 16, torch.float32, torch.float32)  # 3.9e-5
    assert abs(gap) <= 1e-5


@pytest.mark.parametrize("shape", [(8, 4, 3, 3), (24, 10)])
def test_procrustes_reaches_polar_factor(shape):
    """min 1/2 ||P - M||^2 over P with orthonormal rows (or columns): the optimum is U V^T from the SVD of M."""
    gen = torch.Generator().manual_seed(3)
    target = torch.randn(*shape, generator=gen, dtype=F64)
    m = target.reshape(shape[0], -1)
    target /= torch.linalg.matrix_norm(m, ord=2)  # unit spectral norm: bounded phi, as Theorem 4.9 assumes
    u, _, vh = torch.linalg.svd(m, full_matrices=False)
    optimum = (u @ vh).reshape(shape)
    start, _ = torch.linalg.qr(torch.randn(max(m.shape), min(m.shape), generator=gen, dtype=F64))
    start = start.T if m.shape[0] <= m.shape[1] else start
    w = nn.Parameter(start.reshape(shape).clone())
    # ||grad|| ~ 3 at the start: lr 0.2 lets ||phi|| outgrow Theorem 4.9's bound, lr 0.1 does not.
    opt = FeedbackGD([w], lr=0.1, momentum=0.9, feedback=0.4)
    for _ in range(700):
        opt.zero_grad()
        (0.5 * (w - target).pow(2).sum()).backward()
        opt.step()
    assert opt.state[w]["momentum_buffer"].shape == w.shape
    assert (w.detach() - optimum).abs().max() <= 1e-8
    assert stiefel_deviation(w) <= 1e-10


def paper_step(theta, phi, grad, lr, mu, beta, exact_inverse=True):
    """Eqs. (24)-(25) of seed-001, phi first then theta with the new phi (§4.2), with the exact inverse of
    ``A = thetaᵀ theta`` or its first-order Neumann approximation ``2I − A`` (§4.3)."""
    gram = theta.T @ theta
    ainv = torch.linalg.inv(gram) if exact_inverse else 2 * torch.eye(gram.shape[0], dtype=gram.dtype) - gram
    sym = lambda x: (x + x.T) / 2  # noqa: E731
    alpha = 4 * beta / lr
    d = -(1 - mu) * phi - grad
    x_phi = (
        theta @ ainv @ (ainv @ theta.T @ phi @ sym(theta.T @ phi) - phi.T @ phi)
        + (d - theta @ ainv @ sym(theta.T @ d)) / lr
    )
    phi_new = phi + lr * (x_phi - alpha / 4 * theta @ ainv @ (phi.T @ theta @ ainv + theta.T @ phi))
    eye = torch.eye(theta.shape[1], dtype=theta.dtype)
    return theta + lr * phi_new - beta * theta @ (eye - ainv), phi_new


@pytest.mark.parametrize("wide", [False, True])
def test_one_step_matches_paper_equations(wide):
    gen = torch.Generator().manual_seed(4)
    q, _ = torch.linalg.qr(torch.randn(12, 5, generator=gen, dtype=F64))
    theta = q + 0.05 * torch.randn(12, 5, generator=gen, dtype=F64)  # near, not on, the manifold
    phi = torch.randn(12, 5, generator=gen, dtype=F64)
    grad = torch.randn(12, 5, generator=gen, dtype=F64)
    lr, mu, beta = 0.1, 0.9, 0.4
    ref_theta, ref_phi = paper_step(theta, phi, grad, lr, mu, beta)

    def layout(x):
        return x.T.clone() if wide else x.clone()

    w = nn.Parameter(layout(theta))
    opt = FeedbackGD([w], lr=lr, momentum=mu, feedback=beta, exact_inverse=True)
    opt.state[w]["momentum_buffer"] = layout(lr * phi)
    opt.state[w]["lr"] = lr
    w.grad = layout(grad)
    opt.step()
    assert (w.detach() - layout(ref_theta)).abs().max() <= 1e-12
    assert (opt.state[w]["momentum_buffer"] - layout(lr * ref_phi)).abs().max() <= 1e-12


def test_momentum_free_branch_contracts_non_square():
    gen = torch.Generator().manual_seed(5)
    q, _ = torch.linalg.qr(torch.randn(9, 4, generator=gen, dtype=F64))
    w = nn.Parameter((q + 0.01 * torch.randn(9, 4, generator=gen, dtype=F64)).T.clone())  # 4 x 9
    opt = FeedbackGD([w], lr=0.1, momentum=0.0, feedback=0.4)
    devs = [stiefel_deviation(w)]
    for _ in range(6):
        w.grad = torch.zeros_like(w)
        opt.step()
        devs.append(stiefel_deviation(w))
    ratios = [b / a for a, b in itertools.pairwise(devs)]
    assert abs(ratios[-1] - (1 - 2 * 0.4)) <= 0.01


def test_default_path_follows_the_paper_with_the_neumann_inverse_and_no_factorisation(monkeypatch):
    gen = torch.Generator().manual_seed(6)
    q, _ = torch.linalg.qr(torch.randn(10, 6, generator=gen, dtype=F64))
    theta = q + 0.02 * torch.randn(10, 6, generator=gen, dtype=F64)
    phi = torch.randn(10, 6, generator=gen, dtype=F64)
    grads = [torch.randn(10, 6, generator=gen, dtype=F64) for _ in range(3)]
    lr, mu, beta = 0.1, 0.9, 0.4
    ref_theta, ref_phi = theta, phi
    for grad in grads:
        ref_theta, ref_phi = paper_step(ref_theta, ref_phi, grad, lr, mu, beta, exact_inverse=False)

    for name in ("inv", "solve", "svd", "qr", "eigh", "cholesky"):
        monkeypatch.setattr(torch.linalg, name, lambda *a, **k: (_ for _ in ()).throw(AssertionError("called")))
    w = nn.Parameter(theta.T.clone())  # a wide 6 x 10 weight; its tall view is theta
    opt = FeedbackGD([w], lr=lr, momentum=mu, feedback=beta)
    opt.state[w]["momentum_buffer"] = (lr * phi).T.clone()
    opt.state[w]["lr"] = lr
    for grad in grads:
        w.grad = grad.T.clone()
        opt.step()
    assert (w.detach().T - ref_theta).abs().max() <= 1e-12
    assert (opt.state[w]["momentum_buffer"].T - lr * ref_phi).abs().max() <= 1e-12


def _mixed_model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.Flatten(), nn.Linear(4 * 4 * 4, 10), nn.Linear(10, 2)).double()
    with torch.no_grad():
        for m in (model[0], model[2]):
            mat = m.weight.reshape(m.weight.shape[0], -1)
            u, _, vh = torch.linalg.svd(mat, full_matrices=False)
            m.weight.copy_((u @ vh).reshape(m.weight.shape))
    return model


def _train(model, opt, steps, seed):
    gen = torch.Generator().manual_seed(seed)
    for _ in range(steps):
        x = torch.randn(8, 3, 6, 6, generator=gen, dtype=F64)
        y = torch.randn(8, 2, generator=gen, dtype=F64)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()


def _optimizer(model):
    stiefel = [model[0].weight, model[2].weight]
    return FeedbackGD(model.parameters(), lr=0.05, stiefel_params=stiefel, weight_decay=1e-3)


def test_state_dict_round_trip_continues_identically():
    model = _mixed_model(0)
    opt = _optimizer(model)
    _train(model, opt, 10, seed=1)
    saved_model = copy.deepcopy(model.state_dict())
    saved_opt = copy.deepcopy(opt.state_dict())
    _train(model, opt, 10, seed=2)

    clone = _mixed_model(99)
    clone.load_state_dict(saved_model)
    clone_opt = _optimizer(clone)
    clone_opt.load_state_dict(saved_opt)
    _train(clone, clone_opt, 10, seed=2)
    for a, b in zip(model.parameters(), clone.parameters(), strict=True):
        assert torch.equal(a, b)
    assert [g["stiefel"] for g in opt.param_groups] == [True, False]


def test_unconstrained_group_is_bitwise_sgd():
    torch.manual_seed(0)
    a = nn.Linear(5, 3)
    b = copy.deepcopy(a)
    opt_a = FeedbackGD(a.parameters(), lr=0.1, momentum=0.9, stiefel=False, weight_decay=0.01, nesterov=True)
    opt_b = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9, weight_decay=0.01, nesterov=True)
    for _ in range(10):
        x = torch.randn(4, 5)
        for model, opt in ((a, opt_a), (b, opt_b)):
            opt.zero_grad()
            model(x).pow(2).sum().backward()
            opt.step()
    assert torch.equal(a.weight, b.weight) and torch.equal(a.bias, b.bias)


def _stiefel_setup():
    gen = torch.Generator().manual_seed(6)
    q, _ = torch.linalg.qr(torch.randn(10, 4, generator=gen, dtype=F64))
    target = torch.randn(4, 10, generator=gen, dtype=F64)
    return q.T.clone(), target / torch.linalg.matrix_norm(target, ord=2)


def _grad_step(w, opt, target):
    opt.zero_grad()
    (0.5 * (w - target).pow(2).sum()).backward()
    opt.step()


def test_lr_change_reset_equals_fresh_optimizer():
    start, target = _stiefel_setup()
    w = nn.Parameter(start.clone())
    opt = FeedbackGD([w], lr=0.1, lr_change="reset")
    for _ in range(5):
        _grad_step(w, opt, target)
    fresh_w = nn.Parameter(w.detach().clone())
    fresh = FeedbackGD([fresh_w], lr=0.02)
    opt.param_groups[0]["lr"] = 0.02
    _grad_step(w, opt, target)
    _grad_step(fresh_w, fresh, target)
    assert torch.isfinite(w).all()
    assert torch.equal(w, fresh_w)


def test_lr_change_rescales_momentum_buffer_from_scheduler():
    start, target = _stiefel_setup()
    w = nn.Parameter(start.clone())
    opt = FeedbackGD([w], lr=0.1)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=5, gamma=0.2)
    for _ in range(5):
        _grad_step(w, opt, target)
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(0.02)
    # Reference: the same state with b = lr * phi rebuilt at the new lr by hand, and no lr change pending.
    ref_w = nn.Parameter(w.detach().clone())
    ref = FeedbackGD([ref_w], lr=opt.param_groups[0]["lr"])
    ref.state[ref_w]["momentum_buffer"] = opt.state[w]["momentum_buffer"].clone() * (opt.param_groups[0]["lr"] / 0.1)
    ref.state[ref_w]["lr"] = opt.param_groups[0]["lr"]
    _grad_step(w, opt, target)
    _grad_step(ref_w, ref, target)
    assert torch.isfinite(w).all()
    assert torch.equal(w, ref_w)


def test_clipping_keeps_noisy_run_finite():
    """seed-001 §7: gradient noise of std 0.1 diverges without clipping; ||b|| <= 0.3 keeps it bounded."""
    results = {}
    for clip in (None, 0.3):
        gen = torch.Generator().manual_seed(7)
        w = nn.Parameter(
            torch.linalg.qr(torch.randn(72, 16, generator=gen, dtype=F64))[0].T.reshape(16, 8, 3, 3).clone()
        )
        opt = FeedbackGD([w], lr=0.2, momentum_clip=clip)
        worst = 0.0
        for _ in range(400):
            w.grad = 0.1 * torch.randn(w.shape, generator=gen, dtype=F64)
            opt.step()
            worst = max(worst, stiefel_deviation(w))
            if not worst < 1e6:
                break
        results[clip] = worst
    assert not results[None] < 1.0
    assert results[0.3] <= 0.05


def test_validation_errors():
    w = nn.Parameter(torch.eye(3))
    b = nn.Parameter(torch.zeros(3))
    with pytest.raises(ValueError, match="at least 2 dimensions"):
        FeedbackGD([w, b], lr=0.1)
    with pytest.raises(ValueError, match="nesterov"):
        FeedbackGD([w], lr=0.1, nesterov=True)
    with pytest.raises(ValueError, match="feedback"):
        FeedbackGD([w], lr=0.1, feedback=1.0)
    with pytest.raises(ValueError, match="lr_change"):
        FeedbackGD([w], lr=0.1, lr_change="keep")
    with pytest.raises(ValueError, match="momentum"):
        FeedbackGD([w], lr=0.1, momentum=1.0)
    FeedbackGD([w, b], lr=0.1, stiefel_params=[w])  # the bias goes to an unconstrained group


class _TinyRegressor(nn.Module):
    def __init__(self):
        super().__init__()
        self.hidden = nn.Linear(8, 6)
        self.head = nn.Linear(6, 1)
        with torch.no_grad():
            u, _, vh = torch.linalg.svd(self.hidden.weight, full_matrices=False)
            self.hidden.weight.copy_(u @ vh)

    def forward(self, x, labels=None):
        pred = self.head(torch.tanh(self.hidden(x))).squeeze(-1)
        return {"loss": nn.functional.mse_loss(pred, labels), "logits": pred}


@pytest.mark.parametrize("route", ["optimizer_cls_and_kwargs", "optimizers"])
def test_works_with_trainer(tmp_path, route):
    from datasets import Dataset
    from transformers import Trainer, TrainingArguments

    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(64, 8, generator=gen)
    data = Dataset.from_dict({"x": x.tolist(), "labels": x[:, 0].tolist()}).with_format("torch")
    model = _TinyRegressor()
    args = TrainingArguments(
        output_dir=str(tmp_path),
        max_steps=8,
        per_device_train_batch_size=16,
        learning_rate=0.05,
        lr_scheduler_type="linear",
        report_to=[],
        save_strategy="no",
        use_cpu=True,
        logging_steps=100,
        weight_decay=0.01,
        dataloader_num_workers=0,
    )
    kwargs = {"lr": 0.05, "stiefel_params": [model.hidden.weight]}
    extra = (
        {"optimizer_cls_and_kwargs": (FeedbackGD, kwargs)}
        if route == "optimizer_cls_and_kwargs"
        else {"optimizers": (FeedbackGD(model.parameters(), **kwargs), None)}
    )
    start = model.hidden.weight.detach().clone()
    trainer = Trainer(model=model, args=args, train_dataset=data, **extra)
    trainer.train()
    assert isinstance(
        trainer.optimizer.optimizer if hasattr(trainer.optimizer, "optimizer") else trainer.optimizer, FeedbackGD
    )
    assert not torch.equal(start, model.hidden.weight)
    assert stiefel_deviation(model.hidden.weight) <= 1e-2


def test_bfloat16_weight_keeps_float32_momentum():
    start, target = _stiefel_setup()
    deviations = {}
    for dtype in (torch.float32, torch.bfloat16):
        w = nn.Parameter(start.to(dtype))
        opt = FeedbackGD([w], lr=0.1)
        trace = []
        for _ in range(300):
            w.grad = (w.detach().double() - target).to(dtype)
            opt.step()
            trace.append(stiefel_deviation(w))
        deviations[dtype] = trace
        assert opt.state[w]["momentum_buffer"].dtype == torch.float32 and w.dtype == dtype
    # Same transient as float32; at the end bfloat16 sits at its rounding floor (2^-8 relative per entry).
    assert abs(deviations[torch.bfloat16][19] - deviations[torch.float32][19]) <= 0.01
    assert deviations[torch.float32][-1] <= rounding_floor(10, 4, torch.float32, torch.float32)  # 3.3e-6
    assert deviations[torch.bfloat16][-1] <= rounding_floor(10, 4, torch.bfloat16, torch.float32)  # 2.0e-2


def test_a_groups_lr_multiplier_scales_its_step_and_survives_state_dict_and_schedulers():
    gen = torch.Generator().manual_seed(21)
    weight = torch.linalg.qr(torch.randn(8, 5, generator=gen, dtype=torch.float64))[0].T.contiguous()
    bias = torch.randn(5, generator=gen, dtype=torch.float64)
    grads = [
        (torch.randn(5, 8, generator=gen, dtype=torch.float64), torch.randn(5, generator=gen, dtype=torch.float64))
        for _ in range(4)
    ]

    def run(lr, multiplier, stiefel_lr):
        w, b = torch.nn.Parameter(weight.clone()), torch.nn.Parameter(bias.clone())
        optimizer = FeedbackGD(
            [{"params": [w], "lr": stiefel_lr}, {"params": [b], "stiefel": False}],
            lr=lr,
            stiefel_lr_multiplier=multiplier,
        )
        for gw, gb in grads:
            w.grad, b.grad = gw.clone(), gb.clone()
            optimizer.step()
        return w.detach(), b.detach(), optimizer

    # Multiplier 3 on the Stiefel group is the same optimizer with a 3× rate there, and leaves the SGD group alone.
    w_mult, b_mult, optimizer = run(0.05, 3.0, 0.05)
    w_plain, b_plain, _ = run(0.05, 1.0, 0.15)
    torch.testing.assert_close(w_mult, w_plain, rtol=0, atol=1e-14)
    torch.testing.assert_close(b_mult, b_plain, rtol=0, atol=0)
    assert [g["lr_multiplier"] for g in optimizer.param_groups] == [3.0, 1.0]
    restored = FeedbackGD([torch.nn.Parameter(weight.clone())], lr=0.05)
    restored.load_state_dict(optimizer.state_dict() | {"param_groups": optimizer.state_dict()["param_groups"][:1]})
    assert restored.param_groups[0]["lr_multiplier"] == 3.0
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: 0.5)
    assert optimizer.param_groups[0]["lr"] == pytest.approx(0.025) and optimizer.param_groups[0]["lr_multiplier"] == 3.0
    del scheduler
    with pytest.raises(ValueError, match="`lr_multiplier`"):
        FeedbackGD([{"params": [torch.nn.Parameter(weight.clone())], "lr_multiplier": -1.0}], lr=0.1)
