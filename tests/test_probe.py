"""TLIF probe: size, threshold schedule, distillation from attention mass."""

import pytest
import torch

from hi_sparse.probe import ImportanceProbe, fit_iterations, fit_params, fit_probes, probe_threshold, small_ops_on_cpu
from hi_sparse.recalibration import attention_mass, distillation_target


@pytest.mark.parametrize("D", [16, 64, 128, 256])
def test_two_linear_layers_and_gelu_under_15k_parameters(D):
    p = ImportanceProbe(D)
    assert p.num_parameters() < 15_000
    assert [type(m).__name__ for m in p.children()] == ["Linear", "Linear", "GELU"]


def test_threshold_follows_context_to_the_quarter_power_and_clamps():
    assert probe_threshold(131072, 0.5, 0.05, 0.95) == pytest.approx(0.5)
    assert probe_threshold(131072 * 16, 0.5, 0.05, 0.95) == pytest.approx(0.95)  # 1.0 clamped
    assert probe_threshold(8192, 0.5, 0.05, 0.95) == pytest.approx(0.25)
    assert probe_threshold(1, 0.5, 0.05, 0.95) == 0.05


def test_unfit_probe_pins_nothing_and_fit_distils_attention_mass():
    g = torch.Generator().manual_seed(0)
    D, n = 32, 2000
    u = torch.randn(D, generator=g)
    u /= u.norm()
    keys = torch.randn(n, D, generator=g)
    heavy = torch.randperm(n, generator=g)[:20]
    keys[heavy] += 8 * u
    probe = ImportanceProbe(D)
    assert (probe.predict(keys) == 0).all()
    queries = 8 * u + 0.5 * torch.randn(16, D, generator=g)
    mass = attention_mass(queries, keys, torch.ones(n, dtype=torch.bool), D ** -0.5)
    target = distillation_target(mass, n)
    light = torch.ones(n, dtype=torch.bool)
    light[heavy] = False
    assert target[heavy].mean() > 0.3 and target[light].max() == 0  # mass, not labels by fiat
    probe.fit(keys, target)
    fresh = torch.randn(500, D, generator=g)
    fresh[:50] += 8 * u                       # unseen tokens of the same kind
    p = probe.predict(fresh)
    thr = probe_threshold(n, 0.5, 0.05, 0.95)
    assert (p[:50] > thr).float().mean() >= 0.75, p[:50]  # some have noise against u: lighter
    assert p[:50].mean() > 10 * p[50:].mean()
    assert (p[50:] > thr).float().mean() <= 0.02


def test_probes_fitted_together_equal_each_fitted_alone():
    """A recalibration fits every layer's probe in one batched loop (different training set sizes,
    padded): each ends where fitting it alone ends."""
    g = torch.Generator().manual_seed(4)
    D = 24
    data = [(torch.randn(n, D, generator=g), torch.rand(n, generator=g) ** 6) for n in (40, 300, 129)]
    together = [ImportanceProbe(D, seed=i) for i in range(3)]
    alone = [ImportanceProbe(D, seed=i) for i in range(3)]
    losses = fit_probes(together, data, steps=60)
    fresh = torch.randn(200, D, generator=g)
    for p, q, (x, y), loss in zip(together, alone, data, losses):
        assert p.fitted and abs(q.fit(x, y, steps=60) - loss) < 1e-5
        torch.testing.assert_close(p.predict(fresh), q.predict(fresh), atol=1e-4, rtol=0)


def test_a_commit_writes_every_probes_parameters_in_a_few_host_ops():
    """write_params (a recalibration's commit, in a decode step) of 32 probes: each probe's
    parameters land where the probe reads them, in a handful of host ops whatever the number of
    probes (on a GPU each op is a launch's host time: ~170 ops had taken ~1.5 ms of a commit)."""
    from torch.profiler import ProfilerActivity, profile

    from hi_sparse.probe import write_params

    P, D = 32, 16
    probes = [ImportanceProbe(D, seed=i) for i in range(P)]
    hidden = probes[0].fc1.out_features
    g = torch.Generator().manual_seed(0)
    w1, c1, w2, c2 = (torch.randn(*shape, generator=g) for shape in ((P, D, hidden), (P, hidden), (P, hidden), (P,)))
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        write_params(probes, [w1, c1, w2, c2])
    ops = [e.name for e in prof.events() if e.cpu_parent is None]
    assert len(ops) <= 10, ops
    for i, p in enumerate(probes):
        assert p.fitted
        assert torch.equal(p.fc1.weight, w1[i].t()) and torch.equal(p.fc1.bias, c1[i])
        assert torch.equal(p.fc2.weight[0], w2[i]) and p.fc2.bias.item() == c2[i].item()


def test_the_kernels_gate_is_shut_until_the_fit_opens_it_in_place():
    """The decode kernel's threshold constants are the probe's own: above any probability (2)
    until it is fitted, then the true ones, written into the same tensor (a captured step reads
    them there), so a step's graph need not change when the probe becomes fitted."""
    from hi_sparse.probe import threshold_constants

    probe, cpu = ImportanceProbe(16), torch.device("cpu")
    gate = probe.gate(cpu, 0.5, 0.05, 0.95)
    assert gate.tolist()[1:] == [2.0, 2.0] and not probe.fitted
    keys = torch.randn(64, 16)
    probe.fit(keys, torch.rand(64), steps=3)
    assert probe.gate(cpu, 0.5, 0.05, 0.95) is gate
    assert torch.equal(gate, threshold_constants(cpu, 0.5, 0.05, 0.95))
    assert probe.gate(cpu, 0.4, 0.05, 0.95).tolist() == threshold_constants(cpu, 0.4, 0.05, 0.95).tolist()


def test_the_fit_in_iterations_is_the_fit_and_yields_between_them():
    """fit_iterations: one training iteration per next (a background recalibration on a CPU runs a
    few between steps), and what it returns is fit_params' result, bit for bit."""
    g = torch.Generator().manual_seed(3)
    data = [(torch.randn(40, 16, generator=g), torch.rand(40, generator=g)) for _ in range(3)]
    probes = [ImportanceProbe(16, seed=i) for i in range(3)]
    whole, losses = fit_params(probes, data, steps=7)
    training = fit_iterations(probes, data, steps=7)
    yields = 0
    while True:
        try:
            next(training)
            yields += 1
        except StopIteration as end:
            params, sliced_losses = end.value
            break
    assert yields == 6                              # 7 iterations, the last one returns
    assert all(torch.equal(a, b) for a, b in zip(whole, params)) and torch.equal(losses, sliced_losses)


def test_small_ops_on_cpu_flush_denormals_on_one_thread_and_restore_both():
    """Inside: one thread, and a product below float32's normal range reads 0 (x86 takes ~100
    cycles per denormal: SmolLM2's fit took 4x longer with them); after: as before."""
    tiny = torch.tensor([1e-30])
    threads = torch.get_num_threads()
    assert float(tiny * 1e-10) != 0.0                # denormals kept outside (torch's default)
    with small_ops_on_cpu(torch.device("cpu")):
        assert torch.get_num_threads() == 1
        assert float(tiny * 1e-10) == 0.0
    assert torch.get_num_threads() == threads and float(tiny * 1e-10) != 0.0
    torch.set_flush_denormal(True)                   # a user's own setting is left as it was
    try:
        with small_ops_on_cpu(torch.device("cpu")):
            pass
        assert float(tiny * 1e-10) == 0.0
    finally:
        torch.set_flush_denormal(False)
