"""The PyTorch peer of a paragan_jax training step, and the side-by-side comparison in one run.

Builds, in plain PyTorch, the G and D of paragan_jax's ``dcgan`` family at a preset's shape
(read from the preset YAML; ``digits_cpu``: 16x16x1 images, z 32, 10 classes, widths 16,
batch 64) and times one synchronous training step exactly as ``python -m paragan_jax
bench-step`` times ours: ``n_disc`` D updates (hinge loss on real and fresh fakes, one D forward
on both), one G update against the updated D (D's weights frozen, its spectral-norm vectors not
advanced), then the G EMA; per-step wall time with the step finished, the first steps left out.

The architecture, layer by layer as `paragan_jax.models.DCGANGenerator` / `DCGANDiscriminator`:

- G: class embedding (10 x shared_dim); linear z -> 4x4 x (width * 2^(n_up)); conditional batch
  norm (no affine; per-channel scale ``1 + gain(embed)`` and shift ``shift(embed)``, two bias-free
  linears), ReLU; per up stage nearest 2x upsample, 3x3 conv, conditional BN, ReLU; 3x3 conv to
  the image channels, tanh.
- D: per down stage a spectrally normalised 3x3 stride-2 conv and leaky ReLU (0.2); flatten;
  SN linear to one logit plus the projection ``<SN embed(y), h>``.
- Adam (the preset's lr and betas) on each side; EMA of G's params (``ema_decay``).

Parameter counts are printed for both and must be equal (the script stops otherwise).
Differences that remain: PyTorch's stride-2 convs pad 1 on each side where XLA's SAME pads
(0, 1), the same shapes and FLOPs; G's forward for D's fakes updates BN running averages in
PyTorch, where ours discards them. Needs ``torch`` (not a dependency of this project)::

    python -m venv /tmp/torch && /tmp/torch/bin/pip install torch pyyaml
    /tmp/torch/bin/python scripts/torch_gan_baseline.py --preset digits_cpu --steps 50 \\
        --pairs 3 --paragan-python .venv/bin/python --json runs/torch_peer.json

With ``--paragan-python PY`` it runs ``PY -m paragan_jax bench-step`` (same preset, steps,
warmup; ``--devices`` simulated CPU devices, default 1) in alternating pairs, PyTorch then ours,
and prints both with the ratio (ours steps/s over PyTorch's). ``--threads N`` (default 2) puts
both sides on the same N cores: PyTorch with N intra-op threads, ours with an affinity mask of N
cores (XLA sizes its thread pool from it). On a machine busier than its cores, PyTorch's OpenMP
threads spin at barriers while a peer thread waits to be scheduled, which slows it by an order of
magnitude at 2 threads: compare on a quiet machine, or at ``--threads 1``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def load_preset(name: str) -> dict:
    """The preset's YAML as a dict (paragan_jax/presets/<name>.yaml or a path)."""
    import yaml

    path = Path(name) if name.endswith(".yaml") else ROOT / "paragan_jax/presets" / f"{name}.yaml"
    cfg = yaml.safe_load(path.read_text())
    m = cfg.get("model", {})
    if m.get("arch", "dcgan") != "dcgan":
        raise SystemExit(f"{name}: only model.arch dcgan is mirrored here")
    return cfg


def build(cfg: dict):
    """``(G, D, opt_g, opt_d, ema)`` of the preset in PyTorch (float32, CPU)."""
    import torch
    from torch import nn
    from torch.nn.utils.parametrizations import spectral_norm

    m = cfg["model"]
    res, ch, z_dim = m.get("resolution", 16), m.get("channels", 1), m.get("z_dim", 32)
    classes, shared = m.get("num_classes", 10), m.get("shared_dim", 32)
    gw, dw, use_sn = m.get("g_width", 32), m.get("d_width", 32), m.get("spectral_norm", True)
    momentum = 1.0 - m.get("bn_momentum", 0.9)  # flax keeps `momentum` of the old average

    def sn(module):
        return spectral_norm(module, eps=m.get("sn_eps", 1e-6)) if use_sn else module

    class CBN(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.bn = nn.BatchNorm2d(c, affine=False, eps=1e-5, momentum=momentum)
            self.gain = nn.Linear(shared, c, bias=False)
            self.shift = nn.Linear(shared, c, bias=False)

        def forward(self, x, cond):
            h = self.bn(x)
            return h * (1 + self.gain(cond))[:, :, None, None] + self.shift(cond)[:, :, None, None]

    class G(nn.Module):
        def __init__(self):
            super().__init__()
            n_up = int(math.log2(res)) - 2
            self.chans = [gw * 2 ** (n_up - i) for i in range(n_up + 1)]
            self.shared = nn.Embedding(classes, shared)
            self.linear = nn.Linear(z_dim, 16 * self.chans[0])
            self.bn0 = CBN(self.chans[0])
            self.convs = nn.ModuleList(
                nn.Conv2d(self.chans[i], self.chans[i + 1], 3, padding=1) for i in range(n_up)
            )
            self.bns = nn.ModuleList(CBN(self.chans[i + 1]) for i in range(n_up))
            self.out = nn.Conv2d(self.chans[-1], ch, 3, padding=1)

        def forward(self, z, y):
            cond = self.shared(y)
            h = self.linear(z).view(z.shape[0], 4, 4, self.chans[0]).permute(0, 3, 1, 2)
            h = torch.relu(self.bn0(h, cond))
            for conv, bn in zip(self.convs, self.bns):
                h = torch.relu(bn(conv(nn.functional.interpolate(h, scale_factor=2.0)), cond))
            return torch.tanh(self.out(h))

    class D(nn.Module):
        def __init__(self):
            super().__init__()
            n_down = int(math.log2(res)) - 2
            chans = [ch] + [dw * 2**i for i in range(n_down)]
            self.convs = nn.ModuleList(
                sn(nn.Conv2d(chans[i], chans[i + 1], 3, stride=2, padding=1)) for i in range(n_down)
            )
            feat = chans[-1] * 16
            self.linear = sn(nn.Linear(feat, 1))
            self.embed = sn(nn.Embedding(classes, feat))

        def forward(self, x, y):
            h = x
            for conv in self.convs:
                h = nn.functional.leaky_relu(conv(h), 0.2)
            h = h.flatten(1)
            return self.linear(h)[:, 0] + (self.embed(y) * h).sum(-1)

    torch.manual_seed(0)
    g, d = G(), D()

    def adam(params, o):
        o = o or {}
        betas = (o.get("b1", 0.0), o.get("b2", 0.999))
        return torch.optim.Adam(params, lr=o.get("lr", 2e-4), betas=betas, eps=o.get("eps", 1e-8))

    ema = [p.detach().clone() for p in g.parameters()]
    return (
        g,
        d,
        adam(g.parameters(), cfg.get("optim_g")),
        adam(d.parameters(), cfg.get("optim_d")),
        ema,
    )


def torch_rounds(cfg: dict, steps: int, warmup: int, pool: int = 8) -> dict:
    """Times `steps` training steps after `warmup` untimed ones; returns per-step wall ms."""
    import torch

    g, d, opt_g, opt_d, ema = build(cfg)
    m, b = cfg["model"], cfg["data"].get("batch_size", 64)
    n_disc, decay = cfg.get("n_disc", 1), cfg.get("ema_decay", 0.999)
    res, ch, z_dim, classes = (
        m.get("resolution", 16),
        m.get("channels", 1),
        m.get("z_dim", 32),
        m.get("num_classes", 10),
    )
    gen = torch.Generator().manual_seed(0)
    reals = [
        (
            torch.rand(b, ch, res, res, generator=gen) * 2 - 1,
            torch.randint(0, classes, (b,), generator=gen),
        )
        for _ in range(pool)
    ]
    g.train()
    d_params, g_params = list(d.parameters()), list(g.parameters())

    def step(i: int) -> None:
        d.train()  # spectral-norm vectors advance in D's own step
        for p in d_params:
            p.requires_grad_(True)
        for j in range(n_disc):
            real, real_y = reals[(i * n_disc + j) % pool]
            with torch.no_grad():
                fake_y = torch.randint(0, classes, (b,))
                fake = g(torch.randn(b, z_dim), fake_y)
            logits = d(torch.cat([real, fake]), torch.cat([real_y, fake_y]))
            loss = torch.relu(1 - logits[:b]).mean() + torch.relu(1 + logits[b:]).mean()
            opt_d.zero_grad(set_to_none=True)
            loss.backward()
            opt_d.step()
        d.eval()  # G's step: D's weights frozen, its spectral-norm vectors kept
        for p in d_params:
            p.requires_grad_(False)
        y = torch.randint(0, classes, (b,))
        g_loss = -d(g(torch.randn(b, z_dim), y), y).mean()
        opt_g.zero_grad(set_to_none=True)
        g_loss.backward()
        opt_g.step()
        with torch.no_grad():
            torch._foreach_lerp_(ema, [p.detach() for p in g_params], 1.0 - decay)

    times = []
    for i in range(warmup + steps):
        t = time.perf_counter()
        step(i)
        if i >= warmup:
            times.append(time.perf_counter() - t)
    n_g = sum(p.numel() for p in g.parameters())
    n_d = sum(p.numel() for p in d.parameters())
    median = statistics.median(times)
    return {
        "g_params": n_g,
        "d_params": n_d,
        "threads": torch.get_num_threads(),
        "step_ms": [1e3 * t for t in times],
        "step_ms_median": 1e3 * median,
        "steps_per_sec": 1.0 / median,
    }


def paragan_rounds(python: str, args) -> dict:
    """Our ``bench-step`` at the same preset and step counts (a subprocess of ``python``)."""
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "ours.json"
        cmd = [
            python, "-m", "paragan_jax", "bench-step", "--config", args.preset,
            "--steps", str(args.steps), "--warmup", str(args.warmup), "--json", str(out),
            f"sharding.num_devices={args.devices}",
        ]  # fmt: skip
        env = {**os.environ, "JAXSTACK_CPU_DEVICES": str(args.devices)}
        subprocess.run(cmd, check=True, cwd=ROOT, env=env, stdout=subprocess.DEVNULL)
        return json.loads(out.read_text())


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="digits_cpu", help="paragan_jax preset (dcgan) to mirror")
    ap.add_argument("--steps", type=int, default=50, help="timed steps per round")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument(
        "--threads", type=int, default=2, help="cores for both sides (PyTorch's threads)"
    )
    ap.add_argument("--paragan-python", default=None, help="also run ours, alternating pairs")
    ap.add_argument("--pairs", type=int, default=3)
    ap.add_argument("--devices", type=int, default=1, help="our simulated CPU devices")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    try:
        import torch
    except ImportError as e:
        print(f"torch_gan_baseline: needs torch ({e})", file=sys.stderr)
        return 2
    # Both sides on the same N cores: PyTorch with N intra-op threads, and our subprocess (XLA
    # sizes its CPU thread pool from the affinity mask, which it inherits).
    os.sched_setaffinity(0, sorted(os.sched_getaffinity(0))[: args.threads])
    torch.set_num_threads(args.threads)
    cfg = load_preset(args.preset)
    res = {"peer": "pytorch", "torch": torch.__version__, "preset": args.preset}
    res["batch"] = cfg["data"].get("batch_size", 64)
    if args.paragan_python is None:
        t = torch_rounds(cfg, args.steps, args.warmup)
        res.update(t)
        print(
            f"PyTorch {torch.__version__}, {t['threads']} threads, G {t['g_params']:,} + D "
            f"{t['d_params']:,} params: {t['step_ms_median']:.2f} ms/step "
            f"({t['steps_per_sec']:.1f} steps/s)"
        )
    else:
        pairs = []
        print(
            f"{'pair':<6}{'PyTorch ms/step':<18}{'paragan_jax ms/step':<22}ours/PyTorch (steps/s)"
        )
        for i in range(args.pairs):
            t = torch_rounds(cfg, args.steps, args.warmup)
            ours = paragan_rounds(args.paragan_python, args)
            if (t["g_params"], t["d_params"]) != (ours["g_params"], ours["d_params"]):
                raise SystemExit(
                    f"parameter counts differ: PyTorch G {t['g_params']} D {t['d_params']}, "
                    f"paragan_jax G {ours['g_params']} D {ours['d_params']}"
                )
            row = {
                "torch_step_ms_median": t["step_ms_median"],
                "paragan_step_ms_median": ours["step_ms_median"],
                "ratio": t["step_ms_median"] / ours["step_ms_median"],
                "torch_step_ms": t["step_ms"],
                "paragan_step_ms": ours["step_ms"],
            }
            pairs.append(row)
            print(
                f"{i + 1:<6}{t['step_ms_median']:<18.2f}{ours['step_ms_median']:<22.2f}"
                f"{row['ratio']:.2f}",
                flush=True,
            )
        res.update(
            threads_torch=t["threads"],
            cpu_threads_paragan=ours["cpu_threads"],
            devices_paragan=ours["devices"],
            g_params=t["g_params"],
            d_params=t["d_params"],
            pairs=pairs,
        )
        ratios = [p["ratio"] for p in pairs]
        res["ratio_median"] = statistics.median(ratios)
        print(
            f"G {t['g_params']:,} + D {t['d_params']:,} params in both; threads: PyTorch "
            f"{t['threads']}, paragan_jax {ours['cpu_threads']} ({ours['devices']} device(s))"
        )
        print(
            f"ours / PyTorch: median {res['ratio_median']:.2f} "
            f"({min(ratios):.2f}-{max(ratios):.2f})"
        )
    if args.json:
        Path(args.json).parent.mkdir(parents=True, exist_ok=True)
        Path(args.json).write_text(json.dumps(res, indent=2) + "\n")
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
