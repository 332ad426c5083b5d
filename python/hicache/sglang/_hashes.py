"""Token ids and SGLang's page hashes: get_hash_str (the chain SGLang's storage module hashes
L3 pages with, byte for byte) and the checks on token ids and page hashes the controller's L3
paths share."""

import hashlib
import re
import struct

_HEX_DIGEST = re.compile(r"[0-9a-fA-F]{64}\Z")


def _digest_hex(value, what):
    """A page hash (SGLang's get_hash_str), lower case; ValueError naming anything else."""
    if not isinstance(value, str) or not _HEX_DIGEST.match(value):
        raise ValueError(f"hicache: {what} {value!r} is not a page hash (64 hex digits, as "
                         "get_hash_str returns)")
    return value.lower()


def _u32(token):
    try:
        value = int(token)
    except (TypeError, ValueError):
        value = None
    if value is None or value != token or not 0 <= value < 1 << 32:
        raise ValueError(f"hicache: token id {token!r} is not an integer in [0, 2^32)")
    return value


def get_hash_str(token_ids, prior_hash=None):
    """SGLang's page hash (its hicache_storage.get_hash_str): the lowercase hex SHA-256 of the
    prior page's digest bytes (none when prior_hash is None or empty) followed by each token
    id as 4-byte little-endian unsigned (both ids of an EAGLE bigram tuple). ValueError names a
    token outside [0, 2^32) or a prior that is not a page hash."""
    hasher = hashlib.sha256()
    if prior_hash:
        hasher.update(bytes.fromhex(_digest_hex(prior_hash, "prior_hash")))
    ids = list(token_ids)
    try:
        hasher.update(struct.pack(f"<{len(ids)}I", *ids))
    except (struct.error, TypeError):  # a tuple, a bad id: one by one, naming the bad one
        for token in ids:
            for one in (token if isinstance(token, tuple) else (token,)):
                hasher.update(_u32(one).to_bytes(4, "little"))
    return hasher.hexdigest()


def _token_ids(tokens, what):
    """A list of int token ids (SGLang passes lists, or a RadixKey with .token_ids)."""
    tokens = getattr(tokens, "token_ids", tokens)
    ids = _as_list(tokens)
    for token in ids:
        if isinstance(token, tuple):
            raise ValueError(f"hicache: {what}: EAGLE bigram token {token!r}; the drop-in's L3 "
                             "paths take plain token ids")
    return ids


def _as_list(indices):
    if hasattr(indices, "tolist"):
        return indices.tolist()
    return list(indices)
