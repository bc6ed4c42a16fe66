"""`ChainPins` against the plain definition: a key is held while some live run holds it."""

from __future__ import annotations

import random

import pytest

from proxy.chain_pins import ChainPins, leading_run


def chain(group: int, n: int) -> tuple[str, ...]:
    """The first `n` keys of group `group`'s chain, with branches: group g's chain
    shares its first g % 4 * 3 keys with group 0's (a common system prompt)."""
    shared = min(n, group % 4 * 3)
    return (tuple(f"{0:08x}{i:08x}" for i in range(shared))
            + tuple(f"{group:08x}{i:08x}" for i in range(shared, n)))


def test_a_joined_run_pins_its_last_key_and_a_new_branch_its_parent() -> None:
    pins = ChainPins()
    a, b = chain(0, 5), chain(0, 3)
    assert pins.add(a) == 5
    assert pins.pins == {k: 1 for k in a}
    assert pins.add(b) == 0  # held: its last key gains a pin
    assert pins.pins[b[-1]] == 2
    branch = chain(1, 6)  # shares chain 0's first 3 keys, then its own 3
    assert pins.add(branch) == 3
    assert pins.pins[branch[2]] == 3  # chain 0's key 4, b's run and the new branch
    assert pins.remove(a) == a[3:]  # keys 4 and 5 were a's alone
    assert pins.remove(branch) == branch[3:]
    assert pins.remove(b) == b
    assert len(pins) == 0


@pytest.mark.parametrize("seed", range(8))
def test_pins_hold_exactly_the_union_of_the_live_runs(seed: int) -> None:
    rng = random.Random(seed)
    pins = ChainPins()
    live: list[tuple[str, ...]] = []
    for _ in range(800):
        if live and rng.random() < 0.45:
            run = live.pop(rng.randrange(len(live)))
            before = {k for r in live for k in r} | set(run)
            gone = pins.remove(run)
            after = {k for r in live for k in r}
            assert set(gone) == before - after
            assert len(gone) == len(set(gone))
        else:
            run = chain(rng.randrange(6), rng.randrange(0, 12))
            before = {k for r in live for k in r}
            assert pins.add(run) == len(set(run) - before)
            live.append(run)
        held = {k for r in live for k in r}
        assert set(pins.pins) == held
        for _ in live:  # and the search reads the same leading runs as a scan
            other = chain(rng.randrange(6), 12)
            scan = next((i for i, k in enumerate(other) if k not in held), len(other))
            assert leading_run(other, pins) == scan
    for run in live:
        pins.remove(run)
    assert len(pins) == 0
