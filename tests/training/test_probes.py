"""The probe heads (``training/probes.py``): the weighted and distillation
losses against hand values and the paper's identities, the head as the
kernel's MLP, and the exported heads file reproducing the trained logits
through the kernel reference."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from vllm_pamer.core.heads import ModelFingerprint
from vllm_pamer.kernels.five_head_vote import five_head_vote_reference
from vllm_pamer.training.probes import (
    FittedHead,
    ProbeHead,
    Standardizer,
    distillation_loss,
    export_head,
    stack_heads,
    weighted_bce,
)


def softplus(x: float) -> float:
    return math.log1p(math.exp(x))


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x))


def test_weighted_bce_hand_values():
    z = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    y = torch.tensor([1, 0, 1])
    rho = 3.0
    # y=1: rho * -log sigmoid(z) = rho * softplus(-z); y=0: -log(1 - sigmoid(z)) = softplus(z)
    expected = (3.0 * math.log(2.0) + softplus(2.0) + 3.0 * softplus(1.0)) / 3.0
    assert float(weighted_bce(z, y, rho)) == pytest.approx(expected, rel=1e-12)
    assert expected == pytest.approx(2.715385, abs=1e-6)


def test_weighted_bce_is_pos_weighted_bce():
    gen = torch.Generator().manual_seed(0)
    z = torch.randn(64, generator=gen, dtype=torch.float64) * 4
    y = (torch.rand(64, generator=gen) > 0.7).long()
    for rho in (0.5, 1.0, 2.5):
        p = torch.sigmoid(z)
        definition = -(rho * y * torch.log(p) + (1 - y) * torch.log(1 - p)).mean()
        assert float(weighted_bce(z, y, rho)) == pytest.approx(float(definition), rel=1e-9)
        ours = weighted_bce(z, y, rho)
        torch_pos_weight = F.binary_cross_entropy_with_logits(
            z, y.double(), pos_weight=torch.tensor(rho, dtype=torch.float64)
        )
        assert float(ours) == pytest.approx(float(torch_pos_weight), rel=1e-9)
    assert float(weighted_bce(torch.tensor([60.0, -60.0]), torch.tensor([1, 0]), 2.0)) < 1e-20  # stable


def test_distillation_hand_values():
    z = torch.tensor([0.0, 2.0, -1.0], dtype=torch.float64)
    y = torch.tensor([1, 0, 1])
    q = torch.tensor([0.9, 0.2, 0.5], dtype=torch.float64)
    rho, lam = 3.0, 0.5
    wbce = (3.0 * math.log(2.0) + softplus(2.0) + 3.0 * softplus(1.0)) / 3.0
    # BCE with a soft target: -(q log p + (1-q) log(1-p)) = softplus(z) - q z
    soft = ((softplus(0.0) - 0.9 * 0.0) + (softplus(2.0) - 0.2 * 2.0) + (softplus(-1.0) + 0.5 * 1.0)) / 3.0
    assert float(distillation_loss(z, y, q, rho, lam)) == pytest.approx(wbce + lam * soft, rel=1e-12)
    assert float(distillation_loss(z, y, q, rho, 0.0)) == pytest.approx(wbce, rel=1e-12)


def test_distillation_matches_paper_identities():
    """Prop. B.1 (l_KD = a * BCE(sigmoid(z), y~)) and the gradient of eq. (26)."""
    gen = torch.Generator().manual_seed(1)
    n = 40
    z = (torch.randn(n, generator=gen, dtype=torch.float64) * 3).requires_grad_(True)
    y = (torch.rand(n, generator=gen) > 0.6).double()
    q = torch.rand(n, generator=gen, dtype=torch.float64)
    rho, lam = 2.7, 0.5
    loss = distillation_loss(z, y, q, rho, lam)
    loss.backward()
    a = rho * y + 1 - y + lam
    y_soft = (rho * y + lam * q) / a
    per_example = a * F.binary_cross_entropy_with_logits(z.detach(), y_soft, reduction="none")
    assert float(loss.detach()) == pytest.approx(float(per_example.mean()), rel=1e-10)
    expected_grad = (a * torch.sigmoid(z.detach()) - rho * y - lam * q) / n
    torch.testing.assert_close(z.grad, expected_grad, rtol=1e-10, atol=1e-12)


def _random_fitted(kind: str, d: int, seed: int) -> FittedHead:
    torch.manual_seed(seed)
    head = ProbeHead(d, kind)
    with torch.no_grad():
        for p in head.parameters():
            p.mul_(3.0)  # larger than init, so GELU is far from linear
    rng = np.random.default_rng(seed)
    std = Standardizer(mean=rng.standard_normal(d) * 2, scale=rng.uniform(0.5, 3.0, d))
    return FittedHead(head.eval(), std, best_epoch=1, best_val_loss=0.0)


@pytest.mark.parametrize("kind", ["mlp", "linear"])
def test_exported_heads_reproduce_trained_logits(kind):
    d = 24
    fitted = [_random_fitted(kind, d, seed) for seed in range(5)]
    exported = [export_head(f) for f in fitted]
    fingerprint = ModelFingerprint("LlamaForCausalLM", d, 2, 100, "tiny")
    thresholds = [0.3, -0.2, 0.0, 1.0, -1.0]
    heads = stack_heads(exported, thresholds, fingerprint, min_votes=3)
    x = np.random.default_rng(9).standard_normal((50, d)).astype(np.float32) * 2 + 1
    expected = np.stack([f.logits(x) for f in fitted], axis=1)
    tensors = [torch.from_numpy(getattr(heads, n)) for n in ("w1", "b1", "w2", "b2", "thresholds")]
    logits, votes, decision = five_head_vote_reference(torch.from_numpy(x), *tensors, min_votes=3)
    assert logits.dtype == torch.float32
    np.testing.assert_allclose(logits.numpy(), expected, rtol=1e-4, atol=1e-4)
    assert np.abs(expected).max() > 1.0  # a meaningful scale
    np.testing.assert_array_equal(votes.numpy(), (logits.numpy() > np.asarray(thresholds, dtype=np.float32)).sum(1))
    assert torch.equal(decision, votes >= 3)
    # float64 through the same reference: the exported (float32) weights are the only rounding
    logits64, _, _ = five_head_vote_reference(torch.from_numpy(x).double(), *[t.double() for t in tensors])
    np.testing.assert_allclose(logits64.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_probe_head_matches_reference_formula():
    """The training module is the kernel's MLP: same GELU (exact erf), same layout."""
    torch.manual_seed(0)
    head = ProbeHead(8, "mlp").double()
    x = torch.randn(5, 8, dtype=torch.float64)
    w1, b1, w2, b2 = head.w1, head.b1, head.w2, head.b2
    stack = lambda t: t.detach()[None].expand(5, *t.shape).contiguous()
    logits, _, _ = five_head_vote_reference(
        x, stack(w1), stack(b1), stack(w2), stack(b2), torch.zeros(5, dtype=torch.float64)
    )
    expected = head(x).detach()
    torch.testing.assert_close(logits, expected[:, None].expand(5, 5), rtol=1e-12, atol=1e-12)
    erf_gelu = 0.5 * (x @ w1 + b1) * (1 + torch.erf((x @ w1 + b1) / math.sqrt(2)))
    torch.testing.assert_close(expected, (erf_gelu @ w2 + b2).detach(), rtol=1e-12, atol=1e-12)
