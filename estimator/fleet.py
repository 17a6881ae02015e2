"""Fleets: how many instances of each instance type (the ``type=count,type=count`` contract)."""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from estimator.errors import FleetError

_TYPE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9.\-_]*$")


def nonzero(counts: Mapping[str, int]) -> dict[str, int]:
    """``counts`` without the types it has none of.

    >>> nonzero({"c5.xlarge": 2, "g4dn.xlarge": 0})
    {'c5.xlarge': 2}
    """
    return {name: count for name, count in counts.items() if count}


# The most instances a fleet may have when it is expanded into one entry per instance (as the
# simulator and the capacity search take it). Thousands of times the fleets a plan buys (the
# planner adds at most hundreds), and what a simulation can still hold in memory; a count past
# it is a typo, which would otherwise end in a MemoryError.
MAX_FLEET_INSTANCES = 100_000


@dataclass(frozen=True, slots=True)
class Fleet(Mapping[str, int]):
    """Counts by instance type, in the order given. Counts are >= 0; zero counts are kept.

    >>> Fleet.parse("g4dn.xlarge=1,r5n.large=13").total
    14
    """

    counts: tuple[tuple[str, int], ...] = field(default=())

    def __post_init__(self) -> None:
        seen: set[str] = set()
        for name, count in self.counts:
            if not isinstance(name, str) or not _TYPE_NAME.fullmatch(name):
                raise FleetError(f"bad instance type name {name!r} in the fleet")
            if isinstance(count, bool) or not isinstance(count, int):
                raise FleetError(f"count of {name} must be an integer, got {count!r}")
            if count < 0:
                raise FleetError(f"count of {name} must be >= 0, got {count}")
            if name in seen:
                raise FleetError(f"instance type {name} appears twice in the fleet")
            seen.add(name)

    @classmethod
    def of(cls, counts: Mapping[str, int]) -> Fleet:
        return cls(tuple(counts.items()))

    @classmethod
    def parse(cls, text: str) -> Fleet:
        """Parse ``type=count,type=count`` (spaces allowed around items)."""
        items = [item.strip() for item in text.split(",")]
        if not text.strip() or any(not item for item in items):
            raise FleetError(f"fleet {text!r} must look like type=count,type=count")
        pairs: list[tuple[str, int]] = []
        for item in items:
            name, sep, count_text = item.partition("=")
            name, count_text = name.strip(), count_text.strip()
            if not sep or not name or not count_text:
                raise FleetError(f"fleet item {item!r} must look like type=count")
            try:
                count = int(count_text)
            except ValueError:
                raise FleetError(
                    f"count of {name} must be a whole number, got {count_text!r}"
                ) from None
            pairs.append((name, count))
        return cls(tuple(pairs))

    def __getitem__(self, name: str) -> int:
        for type_name, count in self.counts:
            if type_name == name:
                return count
        raise KeyError(name)

    def __iter__(self) -> Iterator[str]:
        return (name for name, _ in self.counts)

    def __len__(self) -> int:
        return len(self.counts)

    @property
    def total(self) -> int:
        return sum(count for _, count in self.counts)

    def expand(self) -> list[str]:
        """One instance type name per instance, types in fleet order.

        Raises:
            FleetError: more than :data:`MAX_FLEET_INSTANCES` instances in all.
        """
        total = self.total
        if total > MAX_FLEET_INSTANCES:
            raise FleetError(
                f"fleet {self} has {total:,} instances, more than the {MAX_FLEET_INSTANCES:,}"
                " a fleet may have"
            )
        return [name for name, count in self.counts for _ in range(count)]

    def __str__(self) -> str:
        return ",".join(f"{name}={count}" for name, count in self.counts)
