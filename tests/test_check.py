"""``ftrun check``: on the two deliberately broken ports of examples/word_lm.py each is found not
exactly-once, with the step and tensor where it first differs and the right cause (real runs);
and without processes, the faulted runs it plans from a step's shape, the first difference over
parameters, buffers and unregistered objects, the likely cause in words, and the trace a rank
writes. (More of the check's choices and verdicts: tests/test_exactly_once.py; the examples pass
it, see docs/porting.md.)"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def _check(tmp_path: Path, *args: str) -> tuple[int, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FTRUN_", "TORCHELASTIC_"))}
    proc = subprocess.run([sys.executable, "-m", "ftrun", "check", "--keep", str(tmp_path / "runs"), *args],
                          env=env, capture_output=True, text=True, timeout=900, cwd=tmp_path)
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.integration
@pytest.mark.slow
@pytest.mark.parametrize("scenarios, script, args, cause", [
    # The hidden state carried from batch to batch, unregistered: a retried step starts from what
    # its failed try left, so the step computed again has another gradient (in the first epoch's
    # middle: two epochs show it, and each run is shorter).
    ("allreduce", "word_lm_hidden_unregistered.py", ("--epochs", "2"), "computed step 8 again and got another local gradient"),
    # The module-level learning rate and best loss, unregistered: a rank respawned after the
    # annealing (end of epoch 3) trains epoch 4 with the initial rate: same gradients, other updates.
    ("allreduce,epoch_end", "word_lm_lr_unregistered.py", (),
     "the gradients computed again were the same (no check saw a difference), but the updates are not"),
])
def test_check_finds_a_broken_port_and_says_why(tmp_path: Path, scenarios: str, script: str, args: tuple[str, ...],
                                                cause: str) -> None:
    # Only the faulted runs that show the defect (--scenarios): the others are the same runs as
    # on the sound script, which the examples' checks cover.
    code, out = _check(tmp_path, "--scenarios", scenarios, str(ROOT / "tests" / "scripts" / script), *args)
    assert code == 1, out
    assert "NOT exactly-once" in out
    assert cause in out, out
    assert "first differs after step" in out and "in parameter model." in out
    if script == "word_lm_lr_unregistered.py":
        assert "ok    a kill in the all-reduce of step 8" in out  # a retried step alone is fine there
        assert "module-level variable" in out



# --------------------------------------------------------------------------- without processes

def _doc(steps: dict[int, list[str]], names: list[tuple[str, str, str]], rank: int = 0, incarnation: int = 0,
         epochs: list[tuple[int, int]] = (), points: dict[int, dict[str, int]] | None = None,
         sections: list[tuple[str, int]] = (), unregistered: dict[str, str] | None = None) -> dict:
    """A trace document as ftrun.rank.trace.RunTrace.write writes it; ``names``: (name, kind, owner)."""
    return {"rank": rank, "incarnation": incarnation, "committed": max(steps, default=-1),
            "names": [n for n, _, _ in names], "kinds": [k for _, k, _ in names], "owners": [o for _, _, o in names],
            "steps": {str(s): v for s, v in steps.items()},
            "points": {str(s): v for s, v in (points or {}).items()}, "unregistered": dict(unregistered or {}),
            "epochs": [{"epoch": e, "first_step": s} for e, s in epochs],
            "sections": [{"name": n, "committed": c} for n, c in sections], "divergences": []}


_DCGAN = [("netD.main.0.weight", "parameter", "netD"), ("netD.main.1.running_mean", "buffer", "netD"),
          ("unregistered:netG.main.0.weight", "unregistered module", "netG"),
          ("unregistered:optimizerG.state", "unregistered optimizer", "optimizerG")]


def _run_trace(fingerprints: dict[int, list[str]], world: int = 2, **kw) -> "Trace":
    from ftrun.tools.check import Trace

    return Trace({r: _doc(fingerprints, _DCGAN, rank=r, **kw) for r in range(world)})


def test_a_step_with_several_all_reduces_and_updates_gets_a_kill_at_each() -> None:
    from ftrun.tools.check import StepShape, Trace, choose_scenarios, step_shape

    steps = {s: ["p", "b", "g", "o"] for s in range(40)}
    epochs = [(1, 0), (2, 10), (3, 20), (4, 30)]
    # Three all-reduces (D on real images, D on fakes, G through D) and two updates at every step.
    shape = {s: {"before_forward": 1, "allreduce": 3, "optimizer": 2} for s in range(40)}
    reference = Trace({r: _doc(steps, _DCGAN, rank=r, epochs=epochs, points=shape, sections=[("eval", 19)])
                       for r in range(2)})
    assert step_shape(reference, 4, 1) == StepShape(allreduces=3, updates=2)
    assert [(s.kind, s.fault) for s in choose_scenarios(reference, world=2)] == [
        ("allreduce", "rank=1,step=4,point=allreduce,kind=kill"),
        ("backward", "rank=1,step=4,point=allreduce,nth=2,kind=kill"),
        ("backward", "rank=1,step=4,point=allreduce,nth=3,kind=kill"),
        ("update", "rank=1,step=4,point=optimizer,nth=1,kind=kill"),
        ("update", "rank=1,step=4,point=optimizer,nth=2,kind=kill"),
        ("epoch_end", "rank=1,step=29,point=between_steps,kind=kill"),
        ("epoch_start", "rank=1,step=30,point=before_forward,kind=kill"),
        ("section", "rank=1,step=19,point=section,kind=kill"),
    ]
    names = [s.name for s in choose_scenarios(reference, world=2)]
    assert names[1] == "a kill in all-reduce 2 of 3 of step 4, mid-epoch (the survivors compute it again)"
    assert names[4] == "a kill in optimizer update 2 of 2 of step 4, mid-epoch"
    # One all-reduce and one update: the allreduce scenario covers the step; no duplicate run.
    simple = Trace({0: _doc(steps, _DCGAN, epochs=epochs, points={4: {"allreduce": 1, "optimizer": 1}})})
    assert [s.kind for s in choose_scenarios(simple, world=2)] == ["allreduce", "epoch_end", "epoch_start"]
    # No point counts (a worker that does not record them): no shape, no extra runs.
    assert step_shape(Trace({0: _doc(steps, _DCGAN, epochs=epochs)}), 4, 1) is None
    # ft.steps() without epochs: the extra runs go to the allreduce scenario's step; the killed rank's counts.
    plain = Trace({0: _doc(steps, _DCGAN, points={13: {"allreduce": 1, "optimizer": 1}}),
                   1: _doc(steps, _DCGAN, rank=1, points={13: {"allreduce": 2, "optimizer": 1}})})
    assert [s.fault for s in choose_scenarios(plain, world=2)][:3] == [
        "rank=1,step=13,point=allreduce,kind=kill", "rank=1,step=13,point=allreduce,nth=2,kind=kill",
        "rank=1,step=13,point=optimizer,nth=1,kind=kill"]


def test_a_step_with_many_all_reduces_gets_kills_spread_over_them() -> None:
    from ftrun.tools.check import MAX_PER_POINT, Trace, choose_scenarios, spread

    assert spread(2, 4) == [2, 3, 4] and spread(1, 1) == [1] and spread(2, 1) == []
    assert spread(2, 20, 4) == [2, 8, 14, 20]
    # An LBFGS step: its closure's 20 backward passes, each with its all-reduce, in one update.
    lbfgs = Trace({0: _doc({s: ["p"] for s in range(30)}, _DCGAN, points={9: {"allreduce": 20, "optimizer": 1}})})
    nth = [s.fault.split("nth=")[1].split(",")[0] for s in choose_scenarios(lbfgs, world=2) if s.kind == "backward"]
    assert len(nth) == MAX_PER_POINT and nth[0] == "2" and nth[-1] == "20"


def test_the_new_scenario_kinds_are_options() -> None:
    from ftrun.tools.check import parse_scenarios

    assert parse_scenarios("backward,update") == {"backward", "update"}
    with pytest.raises(ValueError, match="choose from allreduce, epoch_end, epoch_start, section, backward, update"):
        parse_scenarios("forward")


def test_first_difference_names_an_unregistered_object_then_a_buffer_then_a_parameter() -> None:
    from ftrun.tools.check import Difference, first_difference

    good = {s: [f"p{s}", f"b{s}", f"g{s}", f"o{s}"] for s in range(10)}
    reference = _run_trace(good)
    assert first_difference(reference, _run_trace(good)) is None

    def changed(at: dict[int, tuple[int, ...]]) -> dict[int, list[str]]:
        out = {s: list(v) for s, v in good.items()}
        for step, columns in at.items():
            for s in range(step, 10):
                for c in columns:
                    out[s][c] = "other"
        return out

    # A parameter and a buffer differ from step 5: the buffer is named (the statistics come first).
    diff = first_difference(reference, _run_trace(changed({5: (0, 1)})))
    assert diff == Difference(5, 0, "netD.main.1.running_mean", "buffer", "netD")
    assert diff.describe() == "in buffer netD.main.1.running_mean"
    # The unregistered generator differs at the same step as the registered model: it is named.
    diff = first_difference(reference, _run_trace(changed({5: (0, 2)})))
    assert (diff.step, diff.kind, diff.owner) == (5, "unregistered module", "netG")
    assert diff.describe() == "in netG, a module not registered with ftrun (its main.0.weight)"
    # An earlier step wins whatever it is; the unregistered one is found on its own with kinds=.
    run = _run_trace(changed({4: (0,), 7: (3,)}))
    assert first_difference(reference, run).tensor == "netD.main.0.weight"
    later = first_difference(reference, run, kinds=("unregistered module", "unregistered optimizer"))
    assert (later.step, later.owner) == (7, "optimizerG")
    assert later.describe() == "in optimizerG, an optimizer not registered with ftrun (its state)"
    # Only on the respawned rank (rank 1's newest incarnation, from step 6 on), matched by name
    # although its process found one more object.
    from ftrun.tools.check import Trace

    bad = changed({6: (2,)})
    extra = _DCGAN + [("unregistered:best.weight", "unregistered module", "best")]
    run = Trace({0: _doc(good, _DCGAN), 1: _doc({s: bad[s] + ["x"] for s in range(6, 10)}, extra, rank=1, incarnation=1)})
    assert first_difference(reference, run) == Difference(6, 1, "unregistered:netG.main.0.weight", "unregistered module",
                                                          "netG")


def test_the_likely_cause_names_what_ftrun_does_not_know_about() -> None:
    from ftrun.tools.check import Difference, Scenario, Trace, explain

    steps = {s: ["p", "b", "g", "o"] for s in range(12)}
    reference = _run_trace(steps, epochs=[(1, 0), (2, 6)])
    retried = Scenario("a kill in all-reduce 3 of 3 of step 4", "rank=1,step=4,point=allreduce,nth=3,kind=kill", 4,
                       "backward")
    gradient = [{"rank": 0, "step": 4, "check": "gradient", "reason": "..."}]
    netG = Difference(4, 1, "unregistered:netG.main.0.weight", "unregistered module", "netG")
    # A second model not registered: named, with how to register it, even though the registered
    # model's gradient also differed (that follows from it: G's fakes feed D).
    why = explain(netG, gradient, retried, reference)
    assert why.startswith("netG (a module) is not registered with ftrun (ft.wrap_model / ft.wrap_optimizer / "
                          "ft.register): a respawned rank does not get it from a replica, and a retried step does not "
                          "roll it back")
    assert 'netG = ft.wrap_model(netG, name="netG")' in why and "follow from it" in why
    assert "hidden state" not in why
    opt = Difference(4, 1, "unregistered:optimizerG.state", "unregistered optimizer", "optimizerG")
    assert 'optimizerG = ft.wrap_optimizer(optimizerG, name="optimizerG")' in explain(opt, [], retried, reference)
    # A BatchNorm statistic, the same on every rank in the fault-free run: a forward pass ran again.
    running = Difference(4, 0, "netD.main.1.running_mean", "buffer", "netD")
    why = explain(running, [], retried, reference)
    assert "buffer netD.main.1.running_mean (a BatchNorm statistic" in why
    assert "changed outside what ftrun rolls back" in why and "computed step 4 again" in why
    # ... each rank's own in the fault-free run (no broadcast): the replacement took a replica's.
    local = Trace({r: _doc({s: ["p", f"b{r}", "g", "o"] for s in range(12)}, _DCGAN, rank=r) for r in range(2)})
    running = Difference(5, 1, "netD.main.1.running_mean", "buffer", "netD")
    why = explain(running, [], retried, local)
    assert "is each rank's own" in why and "rank 1's replacement did not end with its predecessor's" in why
    assert "ddp=True" in why and "model.eval()" in why
    # ... the same on every rank, changed after a replacement: a forward pass outside a step.
    why = explain(running, [], Scenario("a kill inside ft.section('eval') after step 4", "", 4, "section"), reference)
    assert "changed where ftrun neither rolls it back nor records it" in why and "model.eval()" in why
    # Parameters: equal gradients, other updates (after an epoch boundary), or another gradient.
    weight = Difference(7, 0, "netD.main.0.weight", "parameter", "netD")
    after = Scenario("a kill right after step 5", "rank=1,step=5,point=between_steps,kind=kill", 5, "epoch_end")
    why = explain(weight, [], after, reference)
    assert "module-level variable" in why and "epoch boundary at step 6" in why
    assert "rank 0 computed step 4 again and got another local gradient" in explain(weight, gradient, retried, reference)
    # A registered parameter first, an unregistered object later: both are named.
    later = Difference(9, 1, "unregistered:netG.main.0.weight", "unregistered module", "netG")
    why = explain(weight, [], after, reference, later)
    assert "module-level variable" in why and "Also: netG, not registered with ftrun, differs from step 9 (rank 1)" in why


def test_the_check_and_the_trace_name_kinds_alike() -> None:
    from ftrun.tools import check
    from ftrun.rank import trace

    for name in ("PARAMETER", "BUFFER", "UNREGISTERED_MODULE", "UNREGISTERED_OPTIMIZER"):
        assert getattr(check, name) == getattr(trace, name)


def test_the_trace_fingerprints_buffers_point_counts_and_unregistered_objects(tmp_path: Path,
                                                                              monkeypatch: pytest.MonkeyPatch) -> None:
    import json

    import torch

    from ftrun.rank import trace as trace_module
    from ftrun.tools.check import Trace, layout
    from ftrun.rank.digest import fingerprint
    from ftrun.rank.optim import FTOptimizer
    from ftrun.rank.registry import StateRegistry

    torch.manual_seed(0)
    net_d = torch.nn.Sequential(torch.nn.Linear(3, 4), torch.nn.BatchNorm1d(4))
    net_g = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.BatchNorm1d(3))
    opt_d, opt_g = torch.optim.Adam(net_d.parameters()), torch.optim.Adam(net_g.parameters())
    registry = StateRegistry()
    registry.register("netD", net_d, kind="committed")
    registry.register("optimizerD", opt_d, kind="committed")

    class Holder:  # one level into an object the script holds
        def __init__(self) -> None:
            self.generator = net_g

    wrapper = torch.nn.Module()
    wrapper.module = net_d  # as a DDP wrapper holds the registered module
    namespace = {"netD": wrapper, "optimizerD": FTOptimizer(opt_d, None), "criterion": torch.nn.BCELoss(),
                 "holder": Holder(), "schedule": [0.1, 0.2], "optimizerG": opt_g, "torch": torch}
    monkeypatch.setattr(trace_module, "script_namespaces", lambda: [namespace])
    run = trace_module.RunTrace(str(tmp_path), registry)
    run.committed(1, {"allreduce": 3, "optimizer": 2})
    assert run.unregistered() == [("holder.generator", "module"), ("optimizerG", "optimizer")]
    net_g(torch.randn(4, 2)).sum().backward()
    opt_g.step()
    run.committed(2)
    doc = json.loads(run.write(0, 0, 2, []).read_text())
    entries = layout(doc)
    assert [(e.name, e.kind) for e in entries if e.owner == "netD"] == [
        ("netD.0.weight", "parameter"), ("netD.0.bias", "parameter"), ("netD.1.weight", "parameter"),
        ("netD.1.bias", "parameter"), ("netD.1.running_mean", "buffer"), ("netD.1.running_var", "buffer"),
        ("netD.1.num_batches_tracked", "buffer")]
    assert {e.name for e in entries if e.owner != "netD"} >= {"unregistered:holder.generator.1.running_var",
                                                              "unregistered:optimizerG.state",
                                                              "unregistered:optimizerG.param_groups"}
    assert doc["points"] == {"1": {"allreduce": 3, "optimizer": 2}} and doc["unregistered"] == {
        "holder.generator": "module", "optimizerG": "optimizer"}
    # A fingerprint per tensor is digest's; the generator's update shows between the steps.
    index = doc["names"].index("netD.1.running_var")
    assert doc["steps"]["2"][index] == fingerprint([net_d[1].running_var])
    changed = {e.name for i, e in enumerate(entries) if doc["steps"]["1"][i] != doc["steps"]["2"][i]}
    assert {e.owner for e in entries if e.name in changed} == {"holder.generator", "optimizerG"}
    assert changed >= {"unregistered:holder.generator.0.weight", "unregistered:holder.generator.1.running_mean",
                       "unregistered:optimizerG.state"}
    assert "unregistered:optimizerG.param_groups" not in changed  # the same hyperparameters
    assert Trace({0: doc}).unregistered() == {"holder.generator": "module", "optimizerG": "optimizer"}
