"""The persist agreement as a few integers: whether every rank is idle and sound, and which steps every rank holds.

Before a persist, every rank must know (1) whether any rank's persist is still running (then every rank defers),
(2) whether a persist failed on any rank (then every rank raises), and (3) per tier, the newest step every rank has
committed (retention never deletes it). Gathering every rank's listing to every rank would grow with the number of
ranks; instead each rank encodes its view in ``1 + len(tiers)`` integers reduced by bitwise AND:

* the flags word: bit 0 "my persist is idle", bit 1 "I hold no persist failure";
* per tier, a bit set over the tier's *candidates*: the steps whose persist every rank attempted (a persist is
  agreed, so the list is the same on every rank), newest last, at most :data:`WINDOW`; bit ``i`` says "I hold
  candidate ``i``". The AND over the ranks is the set of candidates every rank holds.

The candidates start from the steps every rank held when the engine was set up (one agreement, off the step path).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from lightning_resilience.collective import SideGroup
from lightning_resilience.policy import Verdict
from lightning_resilience.step.agreement import Op
from lightning_resilience.step.driver import Field

__all__ = ["WINDOW", "PersistAgreement", "PersistHistory", "PersistView"]

WINDOW = 62
"""Candidates per tier (the bits of an int64 that stay non-negative)."""
_IDLE, _SOUND = 1, 2


@dataclass(frozen=True)
class PersistView:
    """What every rank agreed before a persist."""

    idle: bool
    """No rank's persist is running."""
    sound: bool
    """No rank holds a persist failure."""
    common: Mapping[str, frozenset[int]] = field(default_factory=dict)
    """Per tier, the candidate steps every rank holds."""

    def protect(self, names: Sequence[str]) -> dict[str, int | None]:
        """Per tier, the newest step every rank holds (retention keeps it), None when there is none."""
        return {name: max(self.common.get(name, ()), default=None) for name in names}

    def missing_anywhere(self, name: str, step: int) -> bool:
        """True when some rank lacks ``step`` in tier ``name``."""
        return step not in self.common.get(name, ())


class PersistHistory:
    """The candidate steps of each tier on this rank (the same lists on every rank), and the view's encoding."""

    def __init__(self, names: Sequence[str]) -> None:
        self.names = list(names)
        self._steps: dict[str, list[int]] = {name: [] for name in self.names}

    def seed(self, common: Mapping[str, Sequence[int]]) -> None:
        """The steps every rank holds per tier (agreed at set-up): the first candidates."""
        for name in self.names:
            self._steps[name] = sorted(set(common.get(name, ())))[-WINDOW:]

    def attempted(self, names: Sequence[str], step: int) -> None:
        """Every rank starts persisting ``step`` to the tiers ``names``."""
        for name in names:
            steps = self._steps[name]
            if step not in steps:
                steps.append(step)
                steps.sort()
                del steps[:-WINDOW]

    def encode(self, *, idle: bool, sound: bool, held: Mapping[str, Sequence[int]]) -> list[int]:
        """This rank's view: the flags word, then one bit set per tier."""
        out = [(_IDLE if idle else 0) | (_SOUND if sound else 0)]
        for name in self.names:
            mine = set(held.get(name, ()))
            out.append(sum(1 << i for i, step in enumerate(self._steps[name]) if step in mine))
        return out

    def decode(self, agreed: Sequence[int]) -> PersistView:
        """The view every rank agreed, from the AND of every rank's :meth:`encode`."""
        if len(agreed) != 1 + len(self.names):
            raise ValueError(f"persist view: {len(agreed)} values for {len(self.names)} tiers")
        common = {
            name: frozenset(step for i, step in enumerate(self._steps[name]) if bits >> i & 1)
            for name, bits in zip(self.names, agreed[1:])
        }
        return PersistView(bool(agreed[0] & _IDLE), bool(agreed[0] & _SOUND), common)


class PersistAgreement:
    """The checkpoint engine's part of each step's agreement (a step driver's contributor).

    Args:
        names: the persistent tiers, in order.
        local: this rank's ``(idle, sound)`` now: no persist running, no persist failure held (no wait, no I/O).
        fail: raises the failure every rank stops with (called on every rank when a rank reported one).
        group: the side group of the agreements off the step path (or later, :meth:`bind`).
    """

    def __init__(
        self,
        names: Sequence[str],
        local: Callable[[], tuple[bool, bool]],
        fail: Callable[[str], None],
        group: SideGroup | None = None,
    ) -> None:
        self.history = PersistHistory(names)
        self.held: dict[str, set[int]] = {name: set() for name in names}
        """Per tier, the steps this rank holds (kept from its own writes and deletions: no listing)."""
        self._local, self._fail = local, fail
        self._view: PersistView | None = None
        self._group = group
        self.driven = False
        """A step driver carries the view in each step's agreement."""

    def bind(self, group: SideGroup) -> None:
        """The side group of the agreements off the step path (:meth:`resync`, :meth:`agree_now`)."""
        self._group = group

    def resync(self, listing: Mapping[str, Sequence[int]]) -> None:
        """Collective, off the step path: the steps every rank holds per tier (from each rank's ``listing``) become
        the first candidates."""
        assert self._group is not None, "PersistAgreement.bind() first"
        views = self._group.all_gather_object(dict(listing), op="checkpoint.resync")
        common = {name: sorted(set.intersection(*(set(v.get(name, ())) for v in views))) for name in listing}
        self.history.seed(common)
        self.held = {name: set(listing.get(name, ())) for name in self.history.names}

    def agree_now(self, step: int) -> PersistView:
        """Without a step driver: the view agreed now, in one all-reduce (bitwise AND) of a few integers."""
        assert self._group is not None, "PersistAgreement.bind() first"
        agreed = self._group.reduce_and_each(self.encode(), op="checkpoint.agree", step=step)
        return self.decode(agreed, f"the persist agreement of step {step}")

    def failed_ranks(self, failed_here: bool) -> str:
        """Collective, once a view said some persist failed: the lowest and highest rank that failed."""
        if self._group is None:
            return "this rank"
        mine = self._group.rank if failed_here else None
        values = [-mine if mine is not None else -(2**62), mine if mine is not None else -1]
        low, high = self._group.reduce_max_each(values, op="checkpoint.failed")
        return f"{-low}" if -low == high else f"{-low} to {high}"

    def committed(self, name: str, step: int, deleted: Sequence[int]) -> None:
        """This rank committed ``step`` to tier ``name`` and retention deleted ``deleted``."""
        held = self.held.setdefault(name, set())
        held.add(step)
        held.difference_update(deleted)

    def encode(self) -> list[int]:
        idle, sound = self._local()
        return self.history.encode(idle=idle, sound=sound, held={n: sorted(s) for n, s in self.held.items()})

    def decode(self, values: Sequence[int], where: str) -> PersistView:
        view = self.history.decode(values)
        if not view.sound:
            self._fail(where)
        return view

    def take(self) -> PersistView | None:
        """The view agreed at this step's boundary (None: none arrived for it), once."""
        view, self._view = self._view, None
        return view

    # ------------------------------------------------------------------ the step driver's contributor
    def step_fields(self) -> list[Field]:
        """Flags, then one bit set per tier (all reduced by bitwise AND)."""
        if not self.history.names:
            return []
        return [Field("checkpoint.flags", Op.AND)] + [Field(f"checkpoint.{n}.held", Op.AND) for n in self.history.names]

    def contribute(self, step: int) -> list[int]:
        self.driven = True
        return self.encode() if self.history.names else []

    def agreed(self, step: int, values: Sequence[int]) -> list[Verdict]:
        """A persist starts only at a step boundary, so a rank idle at the start of the step is idle at its end."""
        if self.history.names:
            self._view = self.decode(values, f"the agreement of step {step}")
        return []
