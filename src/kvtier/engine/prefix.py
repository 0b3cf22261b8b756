"""One prefix match per wait: the disk → host prefetch hint and the admission's adoption
share a single ``KVManager.lookup``, kept on the sequence (``Sequence.prefix``).

``PrefixMatcher`` mutates the sequence's ``prefix``, ``prefix_step`` and ``prefetched``,
the manager's lookup counters (through ``lookup``) and, for the hint, starts promotions on
the manager's links. Worker thread only.
"""

from __future__ import annotations

import logging

from kvtier.engine.metrics import EngineMetrics
from kvtier.engine.sequence import Sequence
from kvtier.manager import KVManager, LookupResult
from kvtier.runtime import SequenceKV

log = logging.getLogger(__name__)


class PrefixMatcher:
    """Looks a waiting sequence's prefix up once and reuses the match while it is fresh.

    Args:
        manager: the shared tiers.
        metrics: counts ``prefetched_chunks``.
    """

    def __init__(self, manager: KVManager, metrics: EngineMetrics) -> None:
        self.manager = manager
        self.metrics = metrics

    def prefetch(self, seq: Sequence, step: int) -> None:
        """Once per wait, with a tier below host: look the prefix up (the match stays on
        ``seq``) and start moving its chunks held below host up into host, last first: an
        admission that loads them all waits as long either way, and one that computes the
        front while the back loads (``kvtier.engine.overlap``) needs the back first.

        Only a hint: a failure here is logged and admission looks the prefix up again."""
        if seq.prefetched:
            return
        seq.prefetched = True
        manager = self.manager
        if manager.disk is None:
            return  # nothing to move up: admission makes the one lookup
        try:
            match = self._lookup(seq, self.manager.layout.prefix_limit(len(seq.ids)), step)
            host = manager.host.name
            todo = [r for r, tier in zip(match.refs, match.tiers, strict=True) if tier != host]
            # Never blocks the worker: what the link has no room for loads at admission.
            started = manager.prefetch_to_host(todo[::-1], wait_for_room=False)
            if started:
                self.metrics.add("prefetched_chunks", len(started))
        except Exception:
            log.exception(
                "prefetch for request %s failed; it loads on admission", seq.handle.request_id
            )

    def match(self, seq: Sequence, cache: SequenceKV, step: int) -> LookupResult:
        """The prefix match to admit ``seq`` into ``cache`` with: the one kept on ``seq``
        when it was made in this ``step`` (no forward has sealed chunks since), else a new
        lookup (kept on ``seq``)."""
        limit = cache.prefix_limit(len(seq.ids))
        kept = seq.prefix
        if kept is not None and seq.prefix_step == step and kept.hit_tokens <= limit:
            return kept
        return self._lookup(seq, limit, step)

    def _lookup(self, seq: Sequence, limit: int, step: int) -> LookupResult:
        seq.prefix = self.manager.lookup(seq.ids[:limit], seq.handle.request.cache_salt)
        seq.prefix_step = step
        return seq.prefix
