"""One seed derivation for the whole library: stable across processes, machines and Python versions."""
from __future__ import annotations

import hashlib


def derive_seed(*parts: object, bits: int = 31) -> int:
    """A non-negative ``bits``-bit integer from blake2b("p0/p1/..."): the same parts give the same seed.

    blake2b, not hash(): Python salts str hashes per process, which would break regeneration.
    31 bits fits every engine's int32 seed; 63 bits is a valid non-negative int64 (torch generators).
    """
    if not 1 <= bits <= 63:
        raise ValueError(f"bits must be in 1..63, got {bits}")
    digest = hashlib.blake2b("/".join(map(str, parts)).encode("utf-8"), digest_size=(bits + 8) // 8).digest()
    return int.from_bytes(digest, "little") & ((1 << bits) - 1)
