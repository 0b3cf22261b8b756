"""Layer groups: layers that keep their KV on the device by the same rule.

Full-attention layers need a sequence's whole history; a sliding-window layer needs only
the last ``window`` tokens. The device arena keeps one pool per group, so a sliding group
holds at most its window (in whole chunks) per sequence while a full group holds what its
budget allows; the lower tiers keep every layer of every chunk, so a prefix can be reused
at any cut point. Pure values; nothing here mutates.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from kvtier.kv.layout import KVLayout


@dataclass(frozen=True)
class LayerGroup:
    """Layers that attend the same way.

    Attributes:
        window: the sliding window in tokens; None for full attention.
        layers: the model's layer indices in the group, ascending.
    """

    window: int | None
    layers: tuple[int, ...]

    @property
    def name(self) -> str:
        return "full" if self.window is None else f"sliding {self.window}"

    def layout(self, model: KVLayout) -> KVLayout:
        """The chunk layout of this group's layers alone (for its device pool)."""
        return replace(model, num_layers=len(self.layers))

    def window_chunks(self, chunk_tokens: int) -> int | None:
        """Sealed chunks one sequence's next query can reach (None: all of them).

        The next query at position ``p`` sees keys ``p - window < k <= p``; sealed chunks
        end at or before ``p``, so at most ``window - 1`` of their tokens are in reach.
        """
        if self.window is None:
            return None
        return -(-(self.window - 1) // chunk_tokens)

    def first_chunk(self, seq_len: int, chunk_tokens: int) -> int:
        """The first chunk a query at position ``seq_len`` (the next token) can reach."""
        if self.window is None:
            return 0
        return max(0, (seq_len - self.window + 1) // chunk_tokens)


def layer_groups(windows: Sequence[int | None]) -> list[LayerGroup]:
    """Group layers by window (per layer; None = full), full attention first."""
    by_window: dict[int | None, list[int]] = {}
    for layer, window in enumerate(windows):
        by_window.setdefault(window, []).append(layer)
    order = sorted(by_window, key=lambda w: -1 if w is None else w)
    return [LayerGroup(w, tuple(by_window[w])) for w in order]
