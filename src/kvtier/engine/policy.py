"""Who is admitted next and who is preempted to make room: pure functions of the
scheduler's lines. They read the sequences and mutate nothing; worker thread only.

Preemption is turn-taking, not thrashing: a waiting sequence may take the place of a
running one only once it has waited ``preempt_after_s``, only a sequence that has run that
long since its admission is preempted (the youngest such), and only once no admitted
sequence is still prefilling (one preemption at a time).
"""

from __future__ import annotations

import time
from collections.abc import Sequence as Seq

from kvtier.engine.sequence import Sequence


def next_in_line(waiting: Seq[Sequence], preempted: Seq[Sequence]) -> Sequence | None:
    """The sequence to admit next: of the two lines' heads (new requests; preempted or
    retried sequences), the one waiting longest. A suspect sequence (retrying alone after
    a failed packed forward) goes first. None when both lines are empty."""
    fresh = waiting[0] if waiting else None
    resumed = preempted[0] if preempted else None
    if fresh is None or resumed is None or resumed.suspect:
        return resumed or fresh
    return resumed if resumed.waiting_since_s <= fresh.waiting_since_s else fresh


def choose_victim(
    seq: Sequence, running: Seq[Sequence], preempt_after_s: float | None
) -> Sequence | None:
    """The running sequence to preempt so that ``seq`` can run, or None when none is due
    (see the module docstring)."""
    now = time.perf_counter()
    if preempt_after_s is None or now - seq.waiting_since_s < preempt_after_s:
        return None
    if any(not s.decoding for s in running):
        return None  # one at a time: the last one admitted is still prefilling
    victims = [s for s in running if s.decoding and now - s.admitted_s >= preempt_after_s]
    return max(victims, key=lambda s: s.admitted) if victims else None
