"""A step's metrics with each one's reduction over processes declared where the value is made:
the mean unless the maker says "sum" (counts that add up over processes: samples, tokens,
groups) or "max" (a longest length, an oldest sample). runtime.reduce_metrics applies them."""
from __future__ import annotations

SUM, MEAN, MAX = "sum", "mean", "max"


class Metrics(dict):
    """{name: value}, plus `reductions` {name: "sum" | "max"} of the ones not averaged."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.reductions: dict[str, str] = {}

    def put(self, name: str, value, reduce: str = MEAN) -> None:
        """Sets `name` to `value`, reduced over processes by `reduce`."""
        self[name] = value
        if reduce != MEAN:
            self.reductions[name] = reduce
        else:
            self.reductions.pop(name, None)

    def update(self, other=(), **kwargs) -> None:
        """As dict.update; another Metrics brings its reductions along."""
        super().update(other, **kwargs)
        if isinstance(other, Metrics):
            self.reductions.update(other.reductions)

    def reduced_by(self, reduce: str) -> tuple[str, ...]:
        """The names reduced by `reduce` ("sum" or "max")."""
        return tuple(k for k, r in self.reductions.items() if r == reduce)
