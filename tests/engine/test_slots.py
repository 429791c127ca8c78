"""The slot table's bookkeeping against a plain model of it: a set of free rows and a free flag per pool token."""
from __future__ import annotations

import random

import torch

from engine.config import load_config
from engine.slots import SlotTable


def first_fit(free_tokens: list[bool], length: int) -> int | None:
    """The first start of `length` consecutive free tokens."""
    run = 0
    for i, free in enumerate(free_tokens):
        run = run + 1 if free else 0
        if run == length:
            return i - length + 1
    return None


def test_allocations_and_releases_one_or_many_at_once_match_a_plain_model(toy_dir):
    rng = random.Random(5)
    table = SlotTable(load_config(toy_dir), 32, 8, 200, torch.float32, torch.device("cpu"))
    free_rows, free_tokens = set(range(32)), [True] * 200
    held: list[tuple[list[int], int, int]] = []
    for _ in range(3000):
        if held and rng.random() < 0.45:
            leaving = [held.pop(rng.randrange(len(held))) for _ in range(min(len(held), rng.choice([1, 1, 3, 8])))]
            table.release([r for rows, _, _ in leaving for r in rows], [(start, n) for _, start, n in leaving])
            for rows, start, length in leaving:
                free_rows.update(rows)
                free_tokens[start:start + length] = [True] * length
        else:
            rows, length = rng.choice([1, 1, 2, 4]), rng.randint(1, 40)
            got = table.allocate(rows, length)
            start = first_fit(free_tokens, length)
            if rows > len(free_rows) or start is None:
                assert got is None
                continue
            assert got == (sorted(free_rows)[:rows], start)  # the lowest free rows, the first fitting range
            free_rows.difference_update(got[0])
            free_tokens[start:start + length] = [False] * length
            held.append((got[0], start, length))
        assert table.rows_used == 32 - len(free_rows)
        ranges = table._free_ranges
        assert all(a + n < b for (a, n), (b, _) in zip(ranges, ranges[1:]))  # sorted, never adjacent
        assert [i for a, n in ranges for i in range(a, a + n)] == [i for i, f in enumerate(free_tokens) if f]
    table.release([r for rows, _, _ in held for r in rows], [(start, n) for _, start, n in held])
    assert table.is_empty
