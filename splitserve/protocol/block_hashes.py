"""Chained block hashes and a prompt's digest: the one definition the engine (prefix cache,
leases, the GEN's check of a relayed prompt), the worker's front-end (a request's salted
root) and the orchestrator (KV-aware routing, from the prompt it counted) all compute, so
their hashes agree byte for byte. A hash is HASH_BYTES bytes of blake2b.

A block's hash chains its tokens (little-endian int32) onto its parent's: equal hashes mean
equal prefixes. A prompt's digest is one constant-size hash of all its tokens, for the KV a
context worker leases: it chains the tokens of the last, partial block (and the prompt's
length) onto the chained hash of the last full block, which prefix caching computes anyway.
A generation worker given the prompt's tokens recomputes it before it allocates a block or
pulls a byte (engine/admission.check_relayed_prompt): KV computed for one prompt must never
be filed in its prefix cache under another prompt's tokens, where later requests would
reuse it.

A request's cache_salt enters here once: its chain starts from salted_root(salt) instead
of b"", so every block hash and the digest depend on it, and two requests share cached
blocks only if they share the salt. Without a salt the root is b"": the hashes of a request
without one are what they were before salts existed."""

from __future__ import annotations

import hashlib

import numpy as np

# Their own personalisations: a digest never equals any block's chain hash, and a salt's
# root is no hash of tokens (so no salt's chain meets the unsalted one, nor another's).
_PERSON = b"splitserve-pdig"
_SALT_PERSON = b"splitserve-salt"
HASH_BYTES = 16   # a chained block hash, a salted root, a digest (before hex)


def salted_root(salt: str | None) -> bytes:
    """Where the chained hashes of a request with this cache_salt start: b"" for none, else
    HASH_BYTES bytes."""
    if not salt:
        return b""
    return hashlib.blake2b(salt.encode("utf-8", "surrogatepass"), digest_size=HASH_BYTES,
                           person=_SALT_PERSON).digest()


def prompt_digest(tokens: np.ndarray, block_size: int, full_hashes: list[bytes],
                  root: bytes = b"") -> str:
    """Hex digest of tokens, given the chained hashes of its full blocks (all of them),
    chained from root (salted_root): a prompt shorter than a block binds its salt too."""
    n_full = len(tokens) // block_size
    assert len(full_hashes) == n_full, "one chained hash per full block"
    h = hashlib.blake2b(full_hashes[-1] if n_full else root, digest_size=HASH_BYTES,
                         person=_PERSON)
    h.update(tokens[n_full * block_size:].astype("<i4", copy=False).tobytes())
    h.update(len(tokens).to_bytes(8, "little"))
    return h.hexdigest()


def chain_hash(parent: bytes, tokens: np.ndarray) -> bytes:
    """Stable across processes (unlike hash()), so another worker can compute the same keys."""
    return hashlib.blake2b(parent + tokens.astype("<i4", copy=False).tobytes(),
                           digest_size=HASH_BYTES).digest()


def chain_hashes(parent: bytes, tokens: np.ndarray, block_size: int) -> list[bytes]:
    """chain_hash of each full block of tokens in turn, the first chained onto parent. One
    bytes copy of the tokens, not one numpy conversion per block: a 32k-token prompt's
    2,048 blocks hash in about a millisecond."""
    raw, step, out = tokens.astype("<i4", copy=False).tobytes(), 4 * block_size, []
    blake2b, size = hashlib.blake2b, HASH_BYTES     # locals: looked up once, not per block
    for start in range(0, len(raw) - step + 1, step):
        parent = blake2b(parent + raw[start:start + step], digest_size=size).digest()
        out.append(parent)
    return out


def digest_of_tokens(tokens: np.ndarray, block_size: int, root: bytes = b"") -> str:
    """prompt_digest of a prompt whose block hashes are not at hand (a client building a
    generation_only request, a GEN checking relayed tokens)."""
    return prompt_digest(tokens, block_size, chain_hashes(root, tokens, block_size), root)


def split_hashes(raw: bytes) -> list[bytes]:
    """Hashes sent back to back (a KV handle's block_hashes, a worker's /internal/kv_blocks
    report), one bytes each; ValueError if raw is not whole hashes."""
    if len(raw) % HASH_BYTES:
        raise ValueError(f"{len(raw)} bytes are not whole {HASH_BYTES}-byte hashes")
    return [raw[i:i + HASH_BYTES] for i in range(0, len(raw), HASH_BYTES)]
