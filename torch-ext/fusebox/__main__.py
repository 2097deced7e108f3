"""``python -m fusebox <command>`` (the ``fusebox`` console script points at :func:`main`).

Commands are looked up lazily, so ``fusebox bench`` never needs more than the bench itself."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

COMMANDS = {
    "bench": ("fusebox.bench.cli", "time every op against eager, torch, torch.compile, Liger"),
}

USAGE = "usage: fusebox <command> [options]\n\ncommands:\n" + "\n".join(
    f"  {name:<10} {doc}" for name, (_mod, doc) in COMMANDS.items()
) + "\n\n`fusebox <command> --help` for a command's options."


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help", "help"):
        print(USAGE)
        return 0 if argv else 2
    if argv[0] == "--version":
        mod = sys.modules.get("fusebox")
        print(getattr(mod, "__version__", "unknown"))
        return 0
    name, rest = argv[0], argv[1:]
    if name not in COMMANDS:
        print(f"fusebox: unknown command {name!r}\n\n{USAGE}", file=sys.stderr)
        return 2
    import importlib

    module = importlib.import_module(COMMANDS[name][0])
    return int(module.main(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
