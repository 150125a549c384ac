"""Short stress run (the long one: ``python benchmarks/stress.py``): random sizes,
densities, selections, partitions, ops and dtypes, invariant checked at every call."""

from tests.stress import SHORT_SIZES, run


def test_short_stress_keeps_the_invariant_and_identical_results():
    summary = run(steps=20, seed=1, sizes=SHORT_SIZES)
    print(summary)
    assert summary["calls"] >= 25
