"""Splitting a global batch into per-worker (or per-device) shares."""

from __future__ import annotations


def split_batch(global_batch: int, speeds: list[float]) -> list[int]:
    """Shares of ``global_batch`` proportional to ``speeds``, each at least 1, summing exactly."""
    total = sum(speeds)
    shares = [max(1, int(global_batch * speed / total)) for speed in speeds]
    # Hand out what rounding left over (or take back the excess) largest-remainder first.
    order = sorted(range(len(speeds)), key=lambda i: global_batch * speeds[i] / total - shares[i], reverse=True)
    while sum(shares) < global_batch:
        shares[order[0]] += 1
        order = order[1:] + order[:1]
    while sum(shares) > global_batch:
        largest = max(range(len(shares)), key=lambda i: shares[i])
        shares[largest] -= 1
    return shares
