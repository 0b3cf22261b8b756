"""A batch's sequence state: token ids, padding, sealed chunk refs and the tail length.

Index ranges of one row (``T = chunk_tokens``)::

    positions                         what holds them                 mutable
    [0, len(refs) * T)                sealed chunks (refs, any tier)   no
    [len(refs) * T, seq_len)          the tail, on the device          until sealed
    token_ids / valid [0, seq_len)    ids (-1: unknown) / not padding  per completed pass

``seq_len`` counts the tokens of completed passes only: a pass in flight (or one that
failed) has not changed it, so positions computed from it during a pass are right.

Every row of a batch has the same number of sealed chunks and the same tail length (rows
advance together). Owned by one ``SequenceKV``; mutated only through its calls, by the
thread that runs its forwards.
"""

from __future__ import annotations

import os

import torch

from kvtier.kv.chunk import ChunkRef
from kvtier.kv.keys import KeyHasher


class SequenceState:
    """Token ids, padding and sealed chunks of ``rows`` sequences that advance together."""

    def __init__(self) -> None:
        self.rows = 0
        self.seq_len = 0
        self.tail_len = 0
        self.salt = ""  # the tenant salt the chunks are keyed under
        self.refs: list[list[ChunkRef]] = []
        self.token_ids = torch.empty(0, 0, dtype=torch.int64)  # [B, seq_len], -1 = unknown
        self.valid = torch.empty(0, 0, dtype=torch.bool)  # [B, seq_len], False = padding

    @property
    def sealed_chunks(self) -> int:
        """Sealed chunks per row."""
        return len(self.refs[0]) if self.refs else 0

    def start(self, rows: int) -> None:
        """Begin a batch of ``rows`` empty sequences (an empty state only)."""
        self.rows = rows
        self.refs = [[] for _ in range(rows)]

    def adopt(self, refs: list[list[ChunkRef]], ids: torch.Tensor, chunk_tokens: int) -> int:
        """Take reused chunks after the sealed ones: ``refs`` per row and the prompt ids
        ``[B, S]`` (every token held after them); returns the tokens adopted
        (``len(refs[0]) * chunk_tokens``).

        Raises:
            ValueError: the state holds a tail or padding (chunks follow whole chunks only).
        """
        if self.tail_len or (self.seq_len and not bool(self.valid.all())):
            raise ValueError("adopt: reused chunks follow whole, unpadded chunks only")
        held = self.refs if self.refs else [[] for _ in refs]
        self.refs = [old + new for old, new in zip(held, refs, strict=True)]
        held_len = len(self.refs[0]) * chunk_tokens
        self.seq_len = held_len
        self.token_ids = ids[:, :held_len].clone()
        self.valid = torch.ones(ids.shape[0], held_len, dtype=torch.bool)
        return len(refs[0]) * chunk_tokens

    def adopt_tail(self, ids: torch.Tensor, tail_tokens: int) -> None:
        """Take a reused partial chunk's ``tail_tokens`` into the tail: ``ids [1, S]`` are
        every token held after it (the sealed ones and the tail's)."""
        self.token_ids = ids.clone()
        self.valid = torch.ones(ids.shape, dtype=torch.bool)
        self.seq_len = ids.shape[1]
        self.tail_len = tail_tokens

    def extended(
        self, ids: torch.Tensor | None, new_tokens: int, padding: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The token ids and padding of the sequences with a pass's ``new_tokens`` per row
        added: their ids ``[B, N]`` (None: unknown) and the pass's ``[B, kv_length]`` padding
        mask (True = real token; None: no padding). Pure: ``commit`` takes them once the pass
        completed.

        Returns:
            ``token_ids [B, seq_len + N]`` and ``valid [B, seq_len + N]``.
        """
        rows = self.rows
        if ids is None or tuple(ids.shape) != (rows, new_tokens):
            ids = torch.full((rows, new_tokens), -1, dtype=torch.int64)
        token_ids = torch.cat([self.token_ids.reshape(rows, -1), ids.to("cpu", torch.int64)], 1)
        valid = torch.cat(
            [self.valid.reshape(rows, -1), torch.ones(rows, new_tokens, dtype=torch.bool)], 1
        )
        if padding is not None:
            width = min(padding.shape[1], valid.shape[1])
            valid[:, :width] = padding[:, :width].to("cpu", torch.bool)
        return token_ids, valid

    def commit(self, token_ids: torch.Tensor, valid: torch.Tensor) -> None:
        """Take a completed pass's ids and padding (from ``extended``)."""
        self.token_ids = token_ids
        self.valid = valid
        self.seq_len = token_ids.shape[1]

    def next_ref(self, row: int, hasher: KeyHasher, chunk_tokens: int) -> ChunkRef:
        """The ref of row ``row``'s next chunk to seal, keyed by its token ids.

        Unknown tokens (``inputs_embeds``, or a chain already broken) give a private chunk
        that no lookup can match.
        """
        index = len(self.refs[row])
        ids = self.token_ids[row, index * chunk_tokens : (index + 1) * chunk_tokens]
        parent = self.refs[row][-1] if self.refs[row] else None
        if bool((ids < 0).any()) or (parent is not None and not parent.token_ids):
            return ChunkRef(os.urandom(hasher.digest_bytes), ())
        parent_key = parent.key if parent else None
        return ChunkRef.of(hasher.key(parent_key, ids.numpy(), self.salt), ids, parent_key)

    def crop(self, num_tokens: int) -> None:
        """Drop the last ``num_tokens`` tokens, all of them in the tail.

        Raises:
            NotImplementedError: some are sealed already.
        """
        if num_tokens > self.tail_len:
            raise NotImplementedError(
                f"crop: only tokens of the unsealed tail ({self.tail_len}) can be removed, "
                f"not {num_tokens}"
            )
        self.tail_len -= num_tokens
        self.seq_len -= num_tokens
        self.token_ids = self.token_ids[:, : self.seq_len]
        self.valid = self.valid[:, : self.seq_len]

    def reset(self) -> None:
        """Forget the sequences (their sealed chunks stay in the tiers)."""
        self.__init__()  # type: ignore[misc]
