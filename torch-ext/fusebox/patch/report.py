"""What a :func:`fusebox.patch` call did: every module it changed, and every candidate it left
alone with the reason."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from typing import List


@dataclass
class PatchEntry:
    path: str        # module path inside the patched object ("model.layers.3.mlp")
    kind: str        # the module's class name
    what: str        # what was done ("fused_add_rms_norm", ...) or why it was left alone


@dataclass
class PatchReport:
    model: str = ""
    family: str = ""                       # e.g. "qwen3", "ltx-video"; "" when unknown
    patched: List[PatchEntry] = field(default_factory=list)
    skipped: List[PatchEntry] = field(default_factory=list)
    notes: List[str] = field(default_factory=list)

    def add(self, path: str, module, what: str) -> None:
        self.patched.append(PatchEntry(path, type(module).__name__, what))

    def skip(self, path: str, module, why: str) -> None:
        self.skipped.append(PatchEntry(path, type(module).__name__, why))

    def note(self, text: str) -> None:
        self.notes.append(text)

    def merge(self, other: "PatchReport", prefix: str = "") -> None:
        pre = f"{prefix}." if prefix else ""
        self.patched += [PatchEntry(pre + e.path, e.kind, e.what) for e in other.patched]
        self.skipped += [PatchEntry(pre + e.path, e.kind, e.what) for e in other.skipped]
        self.notes += other.notes
        if other.family and not self.family:
            self.family = other.family

    @property
    def num_patched(self) -> int:
        return len(self.patched)

    def __bool__(self) -> bool:
        return bool(self.patched)

    def summary(self) -> dict:
        """Counts per (class, what) for the patched and skipped modules."""
        return {
            "patched": dict(Counter(f"{e.kind}: {e.what}" for e in self.patched)),
            "skipped": dict(Counter(f"{e.kind}: {e.what}" for e in self.skipped)),
        }

    def __str__(self) -> str:
        head = f"fusebox.patch({self.model or 'model'})"
        if self.family:
            head += f" [{self.family}]"
        lines = [f"{head}: {len(self.patched)} modules patched, {len(self.skipped)} left alone"]
        s = self.summary()
        for key, n in sorted(s["patched"].items()):
            lines.append(f"  patched  {n:>4} x {key}")
        for key, n in sorted(s["skipped"].items()):
            lines.append(f"  skipped  {n:>4} x {key}")
        lines += [f"  note: {t}" for t in self.notes]
        return "\n".join(lines)

    __repr__ = __str__
