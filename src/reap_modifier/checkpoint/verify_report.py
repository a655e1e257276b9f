"""What ``reap verify`` found: :class:`VerifyReport` (failures, warnings, facts) and
:class:`VerifyError`, raised with it."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["VerifyError", "VerifyReport"]


class VerifyError(RuntimeError):
    """A checkpoint failed verification; ``.report`` holds every failure."""

    def __init__(self, report: VerifyReport):
        self.report = report
        super().__init__(report.summary())


@dataclass
class VerifyReport:
    path: str
    source: str | None = None
    failures: list[str] = field(default_factory=list)
    warnings: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not self.failures

    def fail(self, msg: str) -> None:
        self.failures.append(msg)

    def warn(self, msg: str) -> None:
        self.warnings.append(msg)

    def raise_if_failed(self) -> VerifyReport:
        if self.failures:
            raise VerifyError(self)
        return self

    def summary(self, limit: int = 50) -> str:
        head = f"{self.path}: " + ("OK" if self.ok else f"{len(self.failures)} failure(s)")
        lines = [head]
        lines += [f"  FAIL {m}" for m in self.failures[:limit]]
        if len(self.failures) > limit:
            lines.append(f"  ... {len(self.failures) - limit} more failure(s)")
        lines += [f"  warn {m}" for m in self.warnings[:limit]]
        return "\n".join(lines)
