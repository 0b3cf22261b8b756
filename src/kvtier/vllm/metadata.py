"""What the scheduler side tells the worker side each step: ``StepPlan`` of loads and saves.

Plain, picklable data (vLLM may send it to a worker process). Block ids are vLLM's, of the
request's one KV cache group; a chunk is ``blocks_per_chunk`` consecutive blocks of the
request's block table.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from kvtier.kv.chunk import ChunkRef


@dataclass(frozen=True)
class ChunkLoad:
    """One chunk to scatter into a request's blocks.

    Attributes:
        ref: the chunk (found in some tier when the step was planned).
        block_ids: the blocks that receive the chunk's blocks ``first_block, first_block +
            1, …`` (those before ``first_block`` vLLM computed or cached itself).
        first_block: the chunk's first block that is loaded.
    """

    ref: ChunkRef
    block_ids: tuple[int, ...]
    first_block: int = 0


@dataclass(frozen=True)
class RequestLoad:
    """A request's chunks to load before this step's forward, in sequence order."""

    request_id: str
    chunks: tuple[ChunkLoad, ...]


@dataclass(frozen=True)
class RequestSave:
    """A request's chunks that this step's forward completed, to store.

    Attributes:
        request_id: vLLM's request id.
        token_ids: the request's tokens from its start through the last chunk saved (the
            chain of chunk keys runs from token 0).
        salt: the request's ``cache_salt`` ("" for none).
        first_chunk: the first chunk to save (those before are held already).
        block_ids: the blocks of chunks ``first_chunk …``, in token order.
    """

    request_id: str
    token_ids: tuple[int, ...]
    salt: str
    first_chunk: int
    block_ids: tuple[int, ...]


@dataclass
class StepPlan:
    """The connector metadata of one step (what the worker side loads and saves)."""

    loads: list[RequestLoad] = field(default_factory=list)
    saves: list[RequestSave] = field(default_factory=list)
