"""Token-length distributions for `--prompt-len` / `--output-len` and friends.

`256` is a fixed length, `128-512` a uniform range (both ends included), and
`normal:256,64` a normal distribution (rounded, at least 1 token). Workloads draw one
length per request from a seeded `random.Random`, so a run is reproducible.
"""

from __future__ import annotations

import random
from dataclasses import dataclass


@dataclass(frozen=True)
class LengthSpec:
    kind: str
    """'fixed', 'uniform' or 'normal'."""
    a: float
    b: float = 0.0

    def __post_init__(self) -> None:
        if self.kind not in ("fixed", "uniform", "normal"):
            raise ValueError(f"unknown length kind {self.kind!r}")
        if self.kind != "normal" and (self.a < 1 or (self.kind == "uniform" and self.b < self.a)):
            raise ValueError(f"lengths must be >= 1 and ranges low-high, got {self.text}")
        if self.kind == "normal" and (self.a < 1 or self.b < 0):
            raise ValueError(f"normal lengths need mean >= 1 and std >= 0, got {self.text}")

    @classmethod
    def parse(cls, text: str | int) -> LengthSpec:
        text = str(text).strip()
        try:
            if text.startswith("normal:"):
                mean, std = text[len("normal:") :].split(",")
                return cls("normal", float(mean), float(std))
            if "-" in text:
                low, high = text.split("-")
                return cls("uniform", int(low), int(high))
            return cls("fixed", int(text))
        except ValueError as exc:
            if "lengths" in str(exc) or "normal" in str(exc):
                raise
            raise ValueError(
                f"cannot read a length from {text!r}: use N, LOW-HIGH or normal:MEAN,STD"
            ) from None

    @property
    def text(self) -> str:
        if self.kind == "fixed":
            return str(int(self.a))
        if self.kind == "uniform":
            return f"{int(self.a)}-{int(self.b)}"
        return f"normal:{self.a:g},{self.b:g}"

    @property
    def mean(self) -> float:
        return (self.a + self.b) / 2 if self.kind == "uniform" else self.a

    def sample(self, rng: random.Random) -> int:
        if self.kind == "fixed":
            return int(self.a)
        if self.kind == "uniform":
            return rng.randint(int(self.a), int(self.b))
        return max(1, round(rng.gauss(self.a, self.b)))
