"""A step is a transaction (ftrun.rank.transaction, ftrun.rank.registry): undo copies of updates that may not
be a step's last change, module buffers as rank state rolled back with a retried step, names that
cannot collide, and fingerprints keyed by (step, backward pass). Pure logic: no processes."""

from __future__ import annotations

import copy
from types import SimpleNamespace

import pytest
import torch
import torch.nn as nn

from ftrun.rank.exactlyonce import ExactlyOnceChecks
from ftrun.rank.registry import StateRegistry
from ftrun.rank.transaction import ModuleBuffers
from ftrun.rank.workerstate import Phase, WorkerState


def gan() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    d = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.LeakyReLU(0.2), nn.Linear(8, 1))
    g = nn.Sequential(nn.Linear(2, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 4))
    return d, g


def state_of(*objs: object) -> list[torch.Tensor]:
    """Every tensor of the objects' state dicts (parameters, buffers, optimizer state)."""
    out: list[torch.Tensor] = []

    def walk(x: object) -> None:
        if isinstance(x, torch.Tensor):
            out.append(x.detach().clone())
        elif isinstance(x, dict):
            for k in sorted(x, key=str):
                walk(x[k])
        elif isinstance(x, (list, tuple)):
            for v in x:
                walk(v)
        elif isinstance(x, (int, float)):
            out.append(torch.tensor(float(x), dtype=torch.float64))

    for obj in objs:
        walk(obj.state_dict())  # type: ignore[attr-defined]
    return out


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))


class Gan:
    """A GAN's step on one rank, the updates applied through the registry's transaction as the
    optimizer wrapper does (before_update, the update, after_update)."""

    def __init__(self) -> None:
        self.d, self.g = gan()
        self.opt_d = torch.optim.Adam(self.d.parameters(), lr=0.01, betas=(0.5, 0.999))
        self.opt_g = torch.optim.SGD(self.g.parameters(), lr=0.1, momentum=0.9)
        self.registry = StateRegistry()
        for name, obj in (("netD", self.d), ("netG", self.g), ("optimizerD", self.opt_d), ("optimizerG", self.opt_g)):
            self.registry.register(name, obj, kind="committed")
        self.registry.register("netD.buffers", ModuleBuffers(self.d), kind="rank")
        self.registry.register("netG.buffers", ModuleBuffers(self.g), kind="rank")
        self.commits: list[int] = []

    def update(self, opt: torch.optim.Optimizer, step: int, ok: bool = True) -> None:
        tx = self.registry.transaction
        tx.before_update(opt, closure=False)
        opt.step()
        if tx.after_update(ok):
            self.commits.append(step)

    def step(self, step: int, fail_at_g: bool = False) -> bool:
        """D on real and fake, D's update, G through the updated D, G's update; False when G's
        all-reduce "fails" (its update is not applied)."""
        self.registry.snapshot_step_start(step - 1)
        gen = torch.Generator().manual_seed(step)
        real, noise = torch.randn(6, 4, generator=gen), torch.randn(6, 2, generator=gen)
        self.opt_d.zero_grad()
        fake = self.g(noise)
        (self.d(real).mean() - self.d(fake.detach()).mean()).backward()
        self.update(self.opt_d, step)
        self.opt_g.zero_grad()
        (-self.d(fake).mean()).backward()
        if fail_at_g:
            return False
        self.update(self.opt_g, step)
        self.registry.transaction.end()
        return True

    def everything(self) -> list[torch.Tensor]:
        return state_of(self.d, self.g, self.opt_d, self.opt_g)


def test_a_failed_second_update_undoes_the_first_and_the_retried_step_equals_the_uninterrupted_one() -> None:
    plain, faulted = Gan(), Gan()
    for step in range(3):
        assert plain.step(step)
        assert faulted.step(step)
    before = faulted.everything()
    assert not faulted.step(3, fail_at_g=True)  # D was updated, G's all-reduce failed
    assert not same(faulted.everything(), before)
    assert faulted.registry.undo_updates()
    assert faulted.registry.roll_back(2, ("rank", "replica"))  # BatchNorm's statistics too
    assert same(faulted.everything(), before), "the undo put back D's parameters, Adam's state and the buffers"
    assert faulted.step(3) and plain.step(3)
    assert same(faulted.everything(), plain.everything())


def test_two_optimizers_commit_at_the_second_update_and_copy_only_the_first() -> None:
    run = Gan()
    taken: list[object] = []
    undo_for = run.registry._undo_for

    def spy(optimizer: object) -> object:
        taken.append(optimizer)
        return undo_for(optimizer)

    run.registry.transaction._undo_for = spy
    for step in range(3):
        assert run.step(step)
    assert run.commits == [0, 1, 2], "the second update is the step's last: it commits the step"
    assert taken == [run.opt_d] * 3, "the first update of each step keeps an undo copy, the last none"


def one_optimizer(make: object) -> tuple[nn.Module, torch.optim.Optimizer, StateRegistry]:
    """A linear model and its optimizer (``make(params)``), registered as wrap_model/wrap_optimizer do."""
    model = nn.Linear(3, 1)
    opt = make(model.parameters())  # type: ignore[operator]
    registry = StateRegistry()
    registry.register("model", model, kind="committed")
    registry.register("optimizer", opt, kind="committed")
    return model, opt, registry


def test_one_optimizer_keeps_no_undo_copy_and_commits_at_its_update() -> None:
    model, opt, registry = one_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    tx = registry.transaction
    for step in range(3):
        registry.snapshot_step_start(step - 1)
        model(torch.ones(2, 3)).sum().backward()
        tx.before_update(opt, closure=False)
        opt.step()
        assert tx.after_update(True), "its update commits the step"
        assert tx.undo_bytes() == 0 and not registry._undos, "no undo copy was ever made"
        tx.end()


def test_an_update_with_a_closure_keeps_an_undo_copy_and_a_failure_inside_it_is_undone() -> None:
    torch.manual_seed(1)
    model, opt, registry = one_optimizer(lambda params: torch.optim.LBFGS(params, max_iter=4))
    x, y = torch.randn(8, 3), torch.randn(8, 1)

    def closure() -> torch.Tensor:
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        return loss

    opt.step(closure)  # LBFGS's history (lists of tensors it appends to) is not empty from here on
    before = state_of(model, opt)
    tx = registry.transaction
    for _ in range(2):  # the first try and its retry fail inside the update: each is undone
        registry.snapshot_step_start(-1)
        tx.before_update(opt, closure=True)
        assert tx.undo_bytes() > 0
        opt.step(closure)  # the parameters and the history changed between the closure's backward passes
        assert not tx.after_update(False), "a collective failed inside the closure: the update is not the step's"
        assert registry.undo_updates()
        assert same(state_of(model, opt), before)


def test_an_optimizer_stepped_twice_after_committing_cannot_be_undone() -> None:
    model, opt, registry = one_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    tx = registry.transaction
    registry.snapshot_step_start(-1)
    tx.before_update(opt, closure=False)
    assert tx.after_update(True)
    tx.backward_pass()  # the step goes on after its commit: its shape grew
    assert not registry.undo_updates(), "a partial step is reported, never passed off as committed"
    registry.snapshot_step_start(0)
    for _ in range(2):
        tx.before_update(opt, closure=False)
        tx.after_update(True)
    tx.end()
    registry.snapshot_step_start(1)
    tx.before_update(opt, closure=False)
    assert not tx.after_update(True) and tx.undo_bytes() > 0, "learnt: two updates a step, the first is copied"


def test_work_after_the_update_makes_steps_commit_at_their_end() -> None:
    """An unwrapped model's gradients averaged after the registered optimizer's update (a second
    model the script did not give to ftrun): once seen, updates keep undo copies."""
    model, opt, registry = one_optimizer(lambda params: torch.optim.SGD(params, lr=0.1))
    tx = registry.transaction
    registry.snapshot_step_start(-1)
    tx.before_update(opt, closure=False)
    assert tx.after_update(True)
    tx.backward_pass()
    tx.end()
    before = state_of(model, opt)
    registry.snapshot_step_start(0)
    model(torch.ones(2, 3)).sum().backward()
    tx.before_update(opt, closure=False)
    opt.step()
    assert not tx.after_update(True), "the step commits at its body's end now"
    tx.backward_pass()  # the late all-reduce fails
    assert registry.undo_updates() and same(state_of(model, opt), before)


def test_buffers_are_rank_state_rolled_back_with_a_retried_step() -> None:
    torch.manual_seed(2)
    model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    model.register_buffer("mask", torch.tril(torch.ones(4, 4)))
    buffers = ModuleBuffers(model)
    assert buffers.state_dict() == {} and not buffers.changed()
    buffers.begin_step()
    start = {n: b.clone() for n, b in model.named_buffers()}
    model(torch.randn(5, 4))  # a training forward moves the running statistics
    assert set(buffers.state_dict()) == {"1.running_mean", "1.running_var", "1.num_batches_tracked"}
    assert [n for n, _ in buffers.constant()] == ["mask"]
    buffers.roll_back()
    assert all(torch.equal(b, start[n]) for n, b in model.named_buffers())
    other = copy.deepcopy(model)
    with torch.no_grad():
        for b in other.buffers():
            b.zero_()
    ModuleBuffers(other).load_state_dict({n: b for n, b in model.named_buffers() if n != "mask"})
    assert all(torch.equal(a, b) for (n, a), (_, b) in zip(model.named_buffers(), other.named_buffers()) if n != "mask")


def test_a_taken_name_is_refused_with_both_objects_named() -> None:
    registry = StateRegistry()
    d, g = gan()
    registry.register("model", d, kind="committed")
    registry.register("model", d, kind="committed")  # the same object again: nothing changes
    with pytest.raises(ValueError, match=r"'model'.*taken by Sequential \(65 parameters\).*Sequential \(76 parameters\)"):
        registry.register("model", g, kind="committed")
    assert registry.free_name("model") == "model2"
    registry.register("model", g, kind="committed", replace=True)
    assert registry["model"] is g


def checks_for(progress: SimpleNamespace, on_divergence: str = "warn") -> ExactlyOnceChecks:
    recovery = SimpleNamespace(predecessor_gradient=None)
    checks = ExactlyOnceChecks(progress, StateRegistry(), recovery, None, WorkerState(managed=True), lambda *a, **k: None,
                               lambda timeout: True, 4, None, on_divergence)
    return checks


def test_fingerprints_are_keyed_by_step_and_backward_pass() -> None:
    progress = SimpleNamespace(current_step=5, generation=0, committed=4)
    checks = checks_for(progress)
    for digest in ("a1", "b2", "c3"):  # a fault-free step with three synced backward passes
        assert checks.check_local_gradient(digest)
    assert checks.divergences == [] and checks._gradient_of(5) == "a1,b2,c3"
    progress.generation = 1  # a recovery, then the step's retry: compared pass by pass
    assert checks.expected_gradient() == ("a1", "its previous try")
    assert checks.check_local_gradient("a1") and checks.check_local_gradient("b2")
    checks.check_local_gradient("XX")
    assert [(s, c) for s, c, _ in checks.divergences] == [(5, "gradient")]
    assert "backward pass 3" in checks.divergences[0][2]
    progress.current_step, progress.generation = 6, 1  # the next step starts a new list
    assert checks.expected_gradient() is None and checks.check_local_gradient("d4")
    checks.state.to(Phase.HEALTHY)
    checks.state.to(Phase.FAILED, "gradient all-reduce failed")  # its first pass's all-reduce failed
    assert checks.check_local_gradient("garbage")  # a pass adding to half-averaged gradients: not kept
    assert checks._gradient_of(6) == "d4,"
    checks.state.recover()
    checks.state.recovered()
    progress.generation = 2
    assert checks.check_local_gradient("d4") and checks.check_local_gradient("e5") and checks.divergences[1:] == []


def test_a_respawned_rank_compares_each_pass_with_its_predecessors() -> None:
    progress = SimpleNamespace(current_step=8, generation=2, committed=7)
    checks = checks_for(progress)
    checks.recovery.predecessor_gradient = (8, "p1,p2")
    assert checks.expected_gradient() == ("p1", "its predecessor (the process this one replaced)")
    assert checks.check_local_gradient("p1") and checks.check_local_gradient("p2")
    assert checks.check_local_gradient("p3")  # a pass the predecessor never reached: nothing to compare
    assert checks.divergences == []
