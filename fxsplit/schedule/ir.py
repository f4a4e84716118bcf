"""Schedule IR: pipeline actions and per-rank action lists, with a round-trip string form.

Terms (see DESIGN.md):
    p       pipeline ranks; v virtual stages per rank; the graph is cut into p*v stages.
    stage   stage s lives on rank ``s % p`` (rank r holds stages r, r+p, r+2p, ...).
    action  ``Action(stage, kind, microbatch)``, written ``<stage><kind><microbatch>``:
            ``2F0`` forward of microbatch 0 on stage 2, ``2B0`` its full backward,
            ``2I0`` / ``2W0`` the input-gradient / weight-gradient halves of a split backward.
    schedule  ``Schedule = list[list[Action | None]]``: one list per pipeline rank, executed in
            order; ``None`` is an idle step (it only aligns the picture, it does not wait).

Representative use::

    Action.parse("2F0")                      # Action(stage=2, kind=FORWARD, microbatch=0)
    s = parse_schedule('''0F0 0F1 0B0 0B1
                          -   1F0 1B0 1F1 1B1''')
    assert parse_schedule(format_schedule(s)) == s

The string form has one rank per line, actions separated by whitespace, ``-`` or ``.`` for an
idle step. A rank with no actions at all is an empty line (only between other ranks: leading and
trailing blank lines of the text are ignored).
"""

from __future__ import annotations

import enum
import re
import textwrap
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from fxsplit.errors import ScheduleError

__all__ = [
    "ActionKind",
    "Action",
    "Schedule",
    "parse_schedule",
    "format_schedule",
    "stage_to_rank",
]


class ActionKind(str, enum.Enum):
    """What an action computes for one (stage, microbatch)."""

    FORWARD = "F"
    BACKWARD = "B"  # full backward: input gradient and weight gradient together
    BACKWARD_INPUT = "I"  # input gradient only (sent to the previous stage)
    BACKWARD_WEIGHT = "W"  # weight gradient only (needs I of the same stage and microbatch first)

    def __str__(self) -> str:
        return self.value

    @property
    def is_backward(self) -> bool:
        """True for B, I and W."""
        return self is not ActionKind.FORWARD


_KIND_INDEX = {kind: i for i, kind in enumerate(ActionKind)}
_ACTION_RE = re.compile(r"^\s*(\d+)\s*([FBIW])\s*(\d+)\s*$")
_IDLE_TOKENS = frozenset({"-", ".", "None", "none", ""})


@dataclass(frozen=True, order=True, repr=False)
class Action:
    """One unit of pipeline work: ``kind`` of ``microbatch`` on ``stage``; prints as ``2F0``."""

    stage: int
    kind: ActionKind
    microbatch: int

    def __post_init__(self) -> None:
        if type(self.kind) is not ActionKind:
            try:
                object.__setattr__(self, "kind", ActionKind(self.kind))
            except ValueError:
                valid = ", ".join(f"{k.value!r} ({k.name})" for k in ActionKind)
                raise ScheduleError(
                    f"Action kind {self.kind!r} is not one of {valid}"
                ) from None
        stage, microbatch = self.stage, self.microbatch
        if not (type(stage) is int and type(microbatch) is int and stage >= 0 <= microbatch):
            self._reject_fields()
        # Actions are dict keys everywhere (validation, simulation): hash once. Only ints go in,
        # so the hash is the same in every process (str hashes are salted per process).
        object.__setattr__(self, "_hash", hash((self.stage, _KIND_INDEX[self.kind], self.microbatch)))

    def __hash__(self) -> int:
        return self._hash

    def _reject_fields(self) -> None:
        for field in ("stage", "microbatch"):
            value = getattr(self, field)
            if isinstance(value, bool) or not isinstance(value, int) or value < 0:
                raise ScheduleError(
                    f"Action {field} must be a non-negative int, got {value!r} "
                    f"(in Action(stage={self.stage!r}, kind={self.kind.value!r}, "
                    f"microbatch={self.microbatch!r}))"
                )

    def __str__(self) -> str:
        return f"{self.stage}{self.kind.value}{self.microbatch}"

    def __repr__(self) -> str:
        return f"Action({self.stage}, {self.kind.value!r}, {self.microbatch})"

    @classmethod
    def parse(cls, text: str) -> Action:
        """Parse ``"2F0"`` into ``Action(2, FORWARD, 0)``; raise ``ScheduleError`` (a ValueError) on bad text."""
        if not isinstance(text, str):
            raise ScheduleError(f"Action.parse expects a string like '2F0', got {type(text).__name__} {text!r}")
        match = _ACTION_RE.match(text)
        if match is None:
            raise ScheduleError(
                f"cannot parse action {text!r}: expected <stage><kind><microbatch> with kind one of "
                "F (forward), B (backward), I (input grad), W (weight grad), e.g. '2F0' or '11B3'"
            )
        return cls(int(match.group(1)), ActionKind(match.group(2)), int(match.group(3)))


Schedule = list[list["Action | None"]]
"""One list of actions per pipeline rank, in execution order; ``None`` is an idle step."""


def _parse_item(item: object, rank: int, step: int) -> Action | None:
    if item is None or isinstance(item, Action):
        return item
    if isinstance(item, str):
        if item.strip() in _IDLE_TOKENS:
            return None
        try:
            return Action.parse(item)
        except ValueError as exc:
            raise ScheduleError(f"rank {rank}, step {step}: {exc}") from None
    raise ScheduleError(
        f"rank {rank}, step {step}: expected an Action, an action string like '2F0', or None "
        f"for idle, got {type(item).__name__} {item!r}"
    )


def parse_schedule(text_or_lists: str | Iterable[Iterable[Action | str | None]]) -> Schedule:
    """Return a ``Schedule`` from its string form or from per-rank lists.

    Accepts a multi-line string (one rank per line, whitespace-separated actions, ``-`` or ``.``
    for idle) or an iterable of per-rank iterables holding ``Action``, action strings or ``None``.
    A fresh list of fresh lists is always returned, so the input is never aliased.
    """
    if isinstance(text_or_lists, str):
        text = textwrap.dedent(text_or_lists).strip("\n")
        if not text.strip():
            return []
        rows: list[Sequence[object]] = [line.split() for line in text.split("\n")]
    else:
        rows = []
        for rank, row in enumerate(text_or_lists):
            if isinstance(row, (str, bytes)) or not isinstance(row, Iterable):
                raise ScheduleError(
                    f"rank {rank}: expected a list of actions, got {type(row).__name__} {row!r}; "
                    "pass either one string for the whole schedule or a list of lists"
                )
            rows.append(list(row))
    return [
        [_parse_item(item, rank, step) for step, item in enumerate(row)]
        for rank, row in enumerate(rows)
    ]


def format_schedule(schedule: Iterable[Iterable[Action | str | None]]) -> str:
    """Return the string form of ``schedule`` (inverse of ``parse_schedule``), columns aligned."""
    rows = parse_schedule(schedule)
    cells = [["-" if a is None else str(a) for a in row] for row in rows]
    width = max((len(c) for row in cells for c in row), default=1)
    return "\n".join(" ".join(c.ljust(width) for c in row).rstrip() for row in cells)


def stage_to_rank(stage: int, num_ranks: int) -> int:
    """Rank that holds ``stage``: ``stage % num_ranks`` (rank r holds r, r+p, r+2p, ...)."""
    if num_ranks < 1:
        raise ScheduleError(f"num_ranks must be >= 1, got {num_ranks}")
    if stage < 0:
        raise ScheduleError(f"stage must be >= 0, got {stage}")
    return stage % num_ranks


def format_marked_grid(schedule, marks: Iterable[tuple[int, int]] = ()) -> str:
    """Rank x step grid of ``schedule`` as given; cells at (rank, step) in ``marks`` show ``[2F0]``."""
    rows = parse_schedule(schedule)
    marked = set(marks)
    width = max((len(str(a)) for row in rows for a in row if a is not None), default=3) + 2
    steps = max((len(row) for row in rows), default=0)
    label = max(len(f"rank {len(rows) - 1}"), 4)
    header = "step".ljust(label) + " | " + " ".join(str(t).center(width) for t in range(steps))
    lines = [header.rstrip(), "-" * len(header)]
    for r, row in enumerate(rows):
        cells = []
        for t, a in enumerate(row):
            text = "-" if a is None else str(a)
            cells.append((f"[{text}]" if (r, t) in marked else text).center(width))
        lines.append((f"rank {r}".ljust(label) + " | " + " ".join(cells)).rstrip())
    return "\n".join(lines)
