"""Placement of rollout ranks on devices: a maximum-weight assignment (Hungarian algorithm, no SciPy needed).

Device ``d`` hosts training rank ``d % t``. A rollout slot (replica, rank j) gains, on device d, the bytes of its
shard that training rank ``d % t`` holds. With t = 8 and r = 4 the best placement puts replica A's rank j on GPU 2j
and replica B's on GPU 2j+1, so every rollout rank lives beside one of its two source shards; the naive one
(replica A on GPUs 0-3) leaves most shards fully remote.
"""

from __future__ import annotations

import numpy as np


def max_weight_assignment(weight: np.ndarray) -> list[int]:
    """For a square matrix, the column assigned to each row so that the total weight is maximal."""
    cost = (weight.max() - weight).astype(np.float64)
    n = cost.shape[0]
    # Classic O(n^3) potentials formulation (1-based, column 0 is a sentinel).
    u, v = np.zeros(n + 1), np.zeros(n + 1)
    match = np.zeros(n + 1, dtype=np.int64)  # match[col] = row
    for i in range(1, n + 1):
        match[0], j0 = i, 0
        minv = np.full(n + 1, np.inf)
        used = np.zeros(n + 1, dtype=bool)
        way = np.zeros(n + 1, dtype=np.int64)
        while True:
            used[j0] = True
            i0 = match[j0]
            cur = cost[i0 - 1] - u[i0] - v[1:]
            free = ~used[1:]
            better = free & (cur < minv[1:])
            minv[1:][better] = cur[better]
            way[1:][better] = j0
            cand = np.where(free, minv[1:], np.inf)
            j1 = int(np.argmin(cand)) + 1
            delta = cand[j1 - 1]
            u[match[used]] += delta
            v[used] -= delta
            minv[1:][free] -= delta
            j0 = j1
            if match[j0] == 0:
                break
        while j0:
            j1 = way[j0]
            match[j0] = match[j1]
            j0 = j1
    assignment = [0] * n
    for col in range(1, n + 1):
        assignment[match[col] - 1] = col - 1
    return assignment


def place(local_bytes: np.ndarray, world: int, train_tp: int, rollout_tp: int, optimal: bool = True) -> list[tuple]:
    """(replica, rollout rank) hosted by each device.

    ``local_bytes[j, k]``: bytes of rollout rank j's shard that training rank k holds.
    """
    slots = [(rep, j) for rep in range(world // rollout_tp) for j in range(rollout_tp)]
    if not optimal:
        return slots
    weight = np.array([[local_bytes[j, dev % train_tp] for (_, j) in slots] for dev in range(world)], dtype=float)
    return [slots[c] for c in max_weight_assignment(weight)]
