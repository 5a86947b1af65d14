"""The culprit subset search on plain predicates (no model, no replay): delta debugging, the row search with
its replay budget, and how subsets are named."""

from __future__ import annotations

import math
import random

import pytest

from stabletrain.debug.diagnose.search import (
    MAX_CULPRIT_SETS,
    ReplayBudget,
    ddmin,
    keys_text,
    samples_text,
    search_rows,
    split,
)


class Counted:
    """A predicate that records every subset it is asked about."""

    def __init__(self, fails):
        self.fails, self.calls = fails, []

    def __call__(self, subset):
        self.calls.append(list(subset))
        return self.fails(set(subset))


@pytest.mark.parametrize("n", [2, 3, 7, 8, 16, 33, 64])
def test_one_culprit_is_found_by_bisection_wherever_it_is(n):
    for culprit in range(n):
        check = Counted(lambda s, c=culprit: c in s)
        assert ddmin(list(range(n)), check) == [culprit]
        assert len(check.calls) <= 2 * math.ceil(math.log2(n)), f"{len(check.calls)} checks for {n} items"


def test_a_set_needed_together_is_found_whole_and_nothing_else():
    rng = random.Random(0)
    for _ in range(200):
        n = rng.randint(2, 40)
        needed = set(rng.sample(range(n), rng.randint(1, min(4, n))))
        found = ddmin(list(range(n)), Counted(lambda s, k=needed: k <= s))
        assert set(found) == needed, (n, needed, found)


def test_the_result_fails_and_is_1_minimal_for_any_of_several_culprits():
    """With several culprits, any one alone is a 1-minimal answer: nothing can be taken away from it."""
    rng = random.Random(1)
    for _ in range(200):
        n = rng.randint(2, 40)
        bad = set(rng.sample(range(n), rng.randint(1, min(5, n))))
        fails = Counted(lambda s, b=bad: bool(b & s))
        found = ddmin(list(range(n)), fails)
        assert len(found) == 1 and found[0] in bad


def test_order_and_duplicates_of_items_are_kept():
    items = ["b", "a", "d", "c"]
    assert ddmin(items, lambda s: "d" in s and "b" in s) == ["b", "d"], "the culprits in their input order"
    assert ddmin(["x"], lambda s: True) == ["x"], "one item is already minimal: no check"


@pytest.mark.parametrize("n_items, n", [(10, 2), (10, 3), (10, 4), (3, 8), (0, 2), (7, 7)])
def test_split_gives_near_equal_consecutive_chunks(n_items, n):
    items = list(range(n_items))
    chunks = split(items, n)
    assert [x for c in chunks for x in c] == items
    assert all(chunks) and len(chunks) == min(n, n_items)
    sizes = [len(c) for c in chunks]
    assert sizes == sorted(sizes, reverse=True) and (not sizes or max(sizes) - min(sizes) <= 1)


def test_the_budget_refuses_past_its_limit():
    budget = ReplayBudget(2)
    assert [budget.take() for _ in range(4)] == [True, True, False, False]
    assert budget.used == 2 and budget.refused


def _search(n, fails, limit=64):
    """search_rows with a check that spends the budget as a replay would."""
    budget = ReplayBudget(limit)
    calls = []

    def check(rows):
        if not budget.take():
            return False
        calls.append(list(rows))
        return fails(set(rows))

    return search_rows(n, check, budget), budget, calls


def test_one_bad_row_is_one_culprit_set_and_the_rest_is_checked_once():
    found, budget, calls = _search(8, lambda s: 5 in s)
    assert (found.sets, found.rest_fails, found.probes) == ([[5]], False, [])
    assert found.remaining == [0, 1, 2, 3, 4, 6, 7]
    assert calls[-1] == found.remaining, "the complement is replayed to tell a bad sample from any data"
    assert budget.used <= 2 * 3 + 1 and not budget.refused


def test_two_bad_rows_give_two_disjoint_sets():
    found, _, _ = _search(16, lambda s: bool({3, 12} & s))
    assert found.sets == [[3], [12]] and not found.rest_fails


def test_a_pair_that_fails_only_together_is_one_set():
    found, _, _ = _search(8, lambda s: {1, 6} <= s)
    assert found.sets == [[1, 6]] and not found.rest_fails


def test_when_any_row_fails_three_probes_say_so_without_more_searches():
    found, budget, calls = _search(8, lambda s: bool(s))
    assert found.sets == [[0]] and found.rest_fails
    assert found.probes == [1, 4, 7], "first, middle and last of the remaining rows"
    assert calls[-3:] == [[1], [4], [7]]
    assert len(found.sets) < MAX_CULPRIT_SETS


def test_when_the_rest_keeps_failing_the_search_stops_after_its_sets():
    """Rows 0, 1 and 2 fail alone but probes of the rest do not: a bounded number of sets is searched."""
    found, _, _ = _search(12, lambda s: bool({0, 1, 2, 3, 4} & s))
    assert found.sets == [[0], [1], [2]] and len(found.sets) == MAX_CULPRIT_SETS and found.rest_fails


def test_what_the_budget_cut_short_is_discarded():
    found, budget, _ = _search(32, lambda s: 20 in s, limit=3)
    assert budget.refused and budget.used == 3
    assert found.sets == [] and found.remaining == list(range(32)), "a half-decided answer is not kept"


def test_a_microbatch_of_one_needs_no_replay():
    found, budget, calls = _search(1, lambda s: True)
    assert found.sets == [[0]] and found.remaining == [] and calls == [] and budget.used == 0


@pytest.mark.parametrize("sets, index_sets, text", [
    ([[3]], None, "row 3"),
    ([[3], [5]], None, "rows 3, 5"),
    ([[3]], [[77]], "the sample at dataset index 77"),
    ([[1, 2]], [[10, 20]], "the samples at dataset indices 10, 20"),
])
def test_samples_are_named_by_dataset_index_when_known(sets, index_sets, text):
    assert samples_text(sets, index_sets) == text


def test_microbatches_are_named_with_their_rank_only_across_ranks():
    assert keys_text([(0, 0), (0, 2)]) == "0, 2"
    assert keys_text([(0, 1), (1, 1)]) == "1 (rank 0), 1 (rank 1)"
