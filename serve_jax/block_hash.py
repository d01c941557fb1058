"""Prefix-cache keys of full KV blocks: a chained hash of (parent key, token ids, extra keys).

`serve_jax.kv_blocks.KVBlockManager` names a block's whole prefix by the key of its last block,
so two requests that share a prefix find the same cached blocks. The engine uses BLAKE2
(`hash_block_tokens`); the simulator, which has no adversary and hashes millions of blocks, uses
Python's ``hash`` (`builtin_block_hash`). Pure Python (no JAX).
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Sequence

__all__ = ["BLOCK_HASHES", "builtin_block_hash", "hash_block_tokens"]


def hash_block_tokens(
    parent: bytes | None, token_ids: Sequence[int], extra: object = None
) -> bytes:
    """The prefix-cache key of one full block: a 128-bit BLAKE2 digest of (parent block's key,
    the block's token ids, extra keys such as a cache salt), so equal keys mean equal prefixes.
    """
    h = hashlib.blake2b(b"\x00" if parent is None else b"\x01" + parent, digest_size=16)
    h.update(struct.pack(f"<{len(token_ids)}q", *token_ids))
    if extra is not None:
        h.update(repr(extra).encode())
    return h.digest()


def builtin_block_hash(parent: object, token_ids: Sequence[int], extra: object = None) -> int:
    """A cheap prefix-cache key: Python's 64-bit ``hash`` of (parent key, token ids, extra).

    About 5x cheaper than `hash_block_tokens`, for the simulator (no adversary; a collision,
    about n^2 / 2^65 for n blocks, would only bend one result); the engine keeps BLAKE2, since
    ints hash predictably and a crafted collision would share KV across requests.
    """
    return hash((parent, tuple(token_ids), extra))


BLOCK_HASHES = {"blake2b": hash_block_tokens, "builtin": builtin_block_hash}
"""The prefix-cache key functions by name (``KVBlockManager(block_hash=...)``)."""
