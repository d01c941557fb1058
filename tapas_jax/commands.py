"""Command dispatch for ``python -m <package> <command> ...``.

Each package's ``__main__`` lists its commands as ``name -> (module, one-line help)``; the module
is imported only when its command runs (so ``python -m serve_jax simulate`` never pays for the
HTTP server's imports) and must define ``main(argv: list[str]) -> int``, where ``argv[0]`` is the
command name (one module may serve several commands).

On a machine without accelerators, commands see ``JAXSTACK_CPU_DEVICES`` (default 8) simulated CPU
devices, as the tests do, so ``--mesh data=2,model=4`` works on a laptop. The flag only affects
the host platform; it must be set before jax is imported, which is why this module imports no jax.
"""

from __future__ import annotations

import importlib
import os
import sys
from collections.abc import Mapping, Sequence

__all__ = ["dispatch", "simulate_cpu_devices"]


def simulate_cpu_devices(default: int = 8) -> None:
    """Asks XLA for several host (CPU) devices, unless jax is already imported or flags say."""
    if "jax" in sys.modules:
        return
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        n = int(os.environ.get("JAXSTACK_CPU_DEVICES", default))
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={n}".strip()


def dispatch(prog: str, commands: Mapping[str, tuple[str, str]], argv: Sequence[str]) -> int:
    """Runs ``commands[argv[0]]`` with the remaining arguments; prints usage otherwise."""
    argv = list(argv)
    width = max(map(len, commands))
    usage = f"usage: python -m {prog} <command> [options]\n\ncommands:\n" + "\n".join(
        f"  {name:<{width}}  {help_}" for name, (_, help_) in commands.items()
    )
    if not argv or argv[0] in ("-h", "--help"):
        print(usage)
        return 0 if argv else 2
    name = argv[0]
    if name not in commands:
        print(f"{prog}: unknown command {name!r}\n\n{usage}", file=sys.stderr)
        return 2
    simulate_cpu_devices()
    module = importlib.import_module(commands[name][0])
    return int(module.main(argv) or 0)
