"""The optimizer wrapper is a torch.optim.Optimizer: schedulers, GradScaler and clip_grad_norm_ take
it unchanged, and it trains exactly like the optimizer it wraps (one process, no launcher)."""

from __future__ import annotations

import subprocess
import sys
import textwrap


def test_schedulers_grad_scaler_and_clipping_take_the_wrapper() -> None:
    code = textwrap.dedent("""
        import os, torch, ftrun
        for k in list(os.environ):
            if k.startswith(("FTRUN_", "TORCHELASTIC_")) or k in ("RANK", "WORLD_SIZE", "MASTER_PORT"):
                del os.environ[k]
        from ftrun.rank.optim import FTOptimizer

        def train(wrap):
            torch.manual_seed(0)
            model = torch.nn.Linear(4, 2)
            inner = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
            ft = ftrun.init(seed=None) if wrap else None
            if wrap:
                model = ft.wrap_model(model)
            opt = ft.wrap_optimizer(inner) if wrap else inner
            assert isinstance(opt, torch.optim.Optimizer)
            scheds = [torch.optim.lr_scheduler.StepLR(opt, 2, 0.5),
                      torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))]
            onecycle_opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
            torch.optim.lr_scheduler.OneCycleLR(ft.wrap_optimizer(onecycle_opt, name="o2") if wrap else onecycle_opt, 1.0, total_steps=10)
            scaler = torch.amp.GradScaler("cpu")
            for step in (ft.steps(6) if wrap else range(6)):
                x = torch.randn(8, 4, generator=torch.Generator().manual_seed(step))
                opt.zero_grad()
                scaler.scale(model(x).pow(2).mean()).backward()
                scaler.unscale_(opt)
                torch.nn.utils.clip_grad_norm_(model.parameters(), 0.25)
                scaler.step(opt)
                scaler.update()
                for s in scheds:
                    s.step()
            if wrap:
                ft.finish()
            return [p.detach().clone() for p in model.parameters()], opt.param_groups[0]["lr"]

        plain, lr_plain = train(False)
        import ftrun.rank.worker as w
        w._worker = None
        wrapped, lr_wrapped = train(True)
        assert lr_plain == lr_wrapped, (lr_plain, lr_wrapped)
        assert all(torch.equal(a, b) for a, b in zip(plain, wrapped))
        print("ok")
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-3000:]
