"""The balanced solver's shortcuts (ringfa4/parallel/dispatch.py, dispatch_fill.py) against the plain
rules they stand for: each shortcut here either places every document where the plain rule does or,
for the search's dominance cut, can only keep a candidate that spreads less. The plain rules are
written out below, one scoring loop each, as the module docstring states them."""

from __future__ import annotations

import random

import pytest

from ringfa4.parallel import dispatch, dispatch_fill
from ringfa4.parallel.dispatch import FLOP_BOUND, TOKEN_BOUND, piece_pairs, tile_pairs


def _random_pack(rnd: random.Random, trial: int, P: int) -> list[int]:
    if trial % 4 == 0:
        return [rnd.choice([64, 256]) for _ in range(rnd.randint(P, 5 * P))]  # many ties
    if trial % 4 == 1:  # short documents (zero-length ones too) beside a few long ones (solver_time.py's kind)
        return [rnd.choice([0, rnd.randint(1, 600)]) for _ in range(rnd.randint(P, 80))] + [
            rnd.randint(2000, 40000) for _ in range(rnd.randint(1, 5))]
    return [int(2 ** rnd.uniform(0, 16)) for _ in range(rnd.randint(2, 120))]


def _means(lengths: list[int], P: int) -> tuple[float, float]:
    return sum(lengths) / P, sum(L * (L + 1) // 2 for L in lengths) / P


def _plain_split_loads(split, P: int, tile: int, means):
    """Per rank (tokens, pairs) after ``split`` [(doc, L, m)]: every free rank scored in rank order."""
    tok, fl = [0] * P, [0] * P
    it, iff = 1.0 / means[0], 1.0 / means[1]
    for _, L, m in split:
        bounds = dispatch.piece_bounds(L, 2 * m, tile)
        pairs = dispatch._piece_pairs_of(L, m, tile)
        cost = [(bounds[a][1] + bounds[b][1], piece_pairs(*bounds[a]) + piece_pairs(*bounds[b])) for a, b in pairs]
        free = list(range(P))
        for j in sorted(range(m), key=lambda j: (-max(cost[j][0] * it, cost[j][1] * iff), j)):
            raised = [max((tok[r] + cost[j][0]) * it, (fl[r] + cost[j][1]) * iff) for r in free]
            r = free.pop(raised.index(min(raised)))
            tok[r], fl[r] = tok[r] + cost[j][0], fl[r] + cost[j][1]
    return tok, fl


def test_split_loads_and_whole_documents_go_where_the_plain_rules_send_them():
    """Split loads resumed from a memo shared by candidates (prefixes asked in any order) equal those
    worked out afresh, within the bounds or not, and those of the plain rule (every free rank scored
    in rank order); whole documents scanned in load order go where scoring every rank in rank order
    sends them (the least raise of max(tokens / T, pairs / F), the lowest rank among equal ones), ties
    included (documents of equal lengths on equal loads, empty ranks)."""
    rnd = random.Random(11)
    for trial in range(60):
        P = rnd.choice([2, 3, 8, 16, 64])
        tile = rnd.choice([1, 8, 128])
        lengths = _random_pack(rnd, trial, P)
        means = _means(lengths, P)
        order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
        split = [(i, lengths[i], rnd.randint(2, P)) for i in order[:rnd.randint(1, min(12, len(order)))]]
        for limits in ((TOKEN_BOUND, FLOP_BOUND), (1.5, 1.5), None):
            memo = dispatch._SplitMemo()
            for n in rnd.sample(range(len(split) + 1), len(split) + 1):
                assert (dispatch._split_loads(split[:n], P, tile, means, limits, memo)
                        == dispatch._split_loads(split[:n], P, tile, means, limits)), (trial, n, limits)
        assert dispatch._split_loads(split, P, tile, means, None)[:2] == _plain_split_loads(split, P, tile, means)
        holders = {i: m for i, _, m in split[:rnd.randint(0, len(split))]}
        placed = dispatch._place(order, lengths, holders, P, tile, means)
        tok, fl = _plain_split_loads([(i, lengths[i], holders[i]) for i in order if i in holders], P, tile, means)
        owners = [-1 if i in holders else 0 for i in range(len(lengths))]
        for i in order:  # the plain rule: every rank scored, in rank order
            if i in holders:
                continue
            L, c = lengths[i], lengths[i] * (lengths[i] + 1) // 2
            costs = [max((tok[r] + L) * (1.0 / means[0]), (fl[r] + c) * (1.0 / means[1])) for r in range(P)]
            owners[i] = costs.index(min(costs))
            tok[owners[i]] += L
            fl[owners[i]] += c
        assert placed[0] == owners and placed[1] == tok and placed[2] == fl, trial


def _plain_search(lengths: list[int], P: int, tile: int) -> tuple[int, int] | None:
    """The least (sum m x L, split documents) within the bounds that the search finds placing every
    candidate it asks about (the k search first, then the spreads): what the dominance cut replaces."""
    means = _means(lengths, P)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    order = [i for i in order if lengths[i] > 0] + [i for i in order if lengths[i] == 0]
    nonzero, k_min = sum(1 for L in lengths if L > 0), sum(1 for L in lengths if L > TOKEN_BOUND * means[0])
    seen: dict = {}

    def ok(holders: dict) -> bool:
        key = tuple(sorted(holders.items()))
        if key not in seen:
            within = dispatch._place(order, lengths, holders, P, tile, means, (TOKEN_BOUND, FLOP_BOUND)) is not None
            seen[key] = (within, (sum(m * lengths[i] for i, m in holders.items()), len(holders)))
        return seen[key][0]

    dispatch._search_k(lambda k: ok({i: P for i in order[:k]}), k_min, nonzero)
    if k_min > 0 or not ok({}):
        needs = dispatch._split_needs(lengths, means, TOKEN_BOUND)
        for c in dispatch.SPREADS:
            if ok(dispatch._subset_holders(needs, P, c)):
                break
    return min((key for within, key in seen.values() if within), default=None)


def test_search_dominance_cut_keeps_a_spread_no_larger():
    """The search answers "within" for a candidate that spreads more than one already within the
    bounds, without placing it: the zigzag candidate it keeps spreads at most what placing every
    asked candidate finds (sum m x L, then split documents), never more, and it is within the bounds
    exactly when that search finds one."""
    rnd = random.Random(23)
    less = 0
    for trial in range(160):
        P = rnd.choice([2, 3, 4, 8, 16])
        tile = rnd.choice([1, 8, 128])
        lengths = _random_pack(rnd, trial, P)
        placed, within = dispatch.zigzag_placement(lengths, P, tile)
        plain = _plain_search(lengths, P, tile)
        assert within == (plain is not None), trial
        if within:
            got = (sum(placed.holders(d) * lengths[d] for d in placed.split), len(placed.split))
            assert got <= plain, (trial, got, plain)
            less += got < plain
    assert less <= 40, less  # a cut that found less on most packs would not be the same search


def _plain_refine(placement, lengths, means, budget: int = 2048, even: float = dispatch.EVEN_PAIRS):
    """Step 5 weighing every boundary for every move (the rule :func:`refine_boundaries` states)."""
    t, P = placement.tile, placement.world_size
    cap, pair_cap = TOKEN_BOUND * means[0], FLOP_BOUND * means[1]
    tok, fl, work = list(placement.tokens), list(placement.pairs), [0] * P
    for d, L in enumerate(lengths):
        if placement.owner[d] >= 0:
            work[placement.owner[d]] += tile_pairs(0, L, t)
        else:
            for r, held in enumerate(placement.split_pieces[d]):
                work[r] += sum(tile_pairs(*placement.piece_table[d][j], t) for j in held)
    holder = lambda d, i: next((r for r, h in enumerate(placement.split_pieces[d]) if i in h), -1)  # noqa: E731
    tables = {d: [list(b) for b in placement.piece_table[d]] for d in placement.split}
    bounds = [(d, i, a, b) for d in tables for i in range(len(tables[d]) - 1)
              for a, b in [(holder(d, i), holder(d, i + 1))] if a != b and a >= 0 and b >= 0]
    for _ in range(budget // max(1, len(bounds))):
        if max(work) <= (1.0 + even) * sum(work) / P:
            break
        move = None
        for d, i, a, b in bounds:
            left, right = tables[d][i], tables[d][i + 1]
            if not (left[1] and right[1]):
                continue
            x = right[0]
            if work[b] > work[a] and right[1] > t:
                src, dst, most, down = b, a, (right[1] - 1) // t * t, False
            elif work[a] > work[b] and left[1] > t:
                src, dst, most, down = a, b, left[1] - t, True
            else:
                continue
            for n in dispatch._even_rows(x, work[src] - work[dst], t, min(most, int((cap - tok[dst]) // t) * t), down):
                at = x - n if down else x
                gain, exact = tile_pairs(at, n, t), piece_pairs(at, n)
                drop = gain * (work[src] - work[dst] - gain)
                if drop > 0 and fl[dst] + exact <= pair_cap and (move is None or drop > move[0]):
                    move = (drop, d, i, src, dst, gain, exact, -n if down else n)
        if move is None:
            break
        _, d, i, src, dst, gain, exact, shift = move
        tables[d][i][1] += shift
        tables[d][i + 1][0] += shift
        tables[d][i + 1][1] -= shift
        tok[src], fl[src], work[src] = tok[src] - abs(shift), fl[src] - exact, work[src] - gain
        tok[dst], fl[dst], work[dst] = tok[dst] + abs(shift), fl[dst] + exact, work[dst] + gain
    return tuple(tok), tuple(fl), {d: tuple(tuple(b) for b in tables[d]) for d in tables}


@pytest.mark.parametrize("budget", [2048, 64])
def test_refinement_in_bound_order_makes_the_plain_moves(budget):
    """Step 5 weighs boundaries in the order of the most a move there can gain ((f_src - f_dst)^2 / 4)
    and stops once that is under the best drop found: the same moves, ties included, as weighing every
    boundary for every move, on zigzag and fill placements, with the budget binding or not."""
    rnd = random.Random(31 + budget)
    moved = 0
    for trial in range(60):
        P = rnd.choice([2, 4, 8, 16, 64])
        tile = rnd.choice([1, 8, 128])
        lengths = _random_pack(rnd, trial, P)
        means = _means(lengths, P)
        for start in (dispatch.zigzag_placement(lengths, P, tile)[0],
                      dispatch_fill.fill_placement(lengths, P, tile, means)):
            if start is None or not start.split:
                continue
            got = dispatch.refine_boundaries(start, lengths, means, budget=budget)
            tok, fl, tables = _plain_refine(start, lengths, means, budget=budget)
            assert (got.tokens, got.pairs) == (tok, fl), trial
            assert all(got.piece_table[d] == tables[d] for d in tables), trial
            moved += got != start
    assert moved >= 20, moved


def test_fill_gives_far_smaller_documents_in_one_go(monkeypatch):
    """The fill's batch of whole portions far smaller than a rank's need (``_Filler.far_run``) places
    what taking them one at a time does (the longest that fits, re-asked after each)."""
    def one_at_a_time(self, start: int, r: int, target) -> int:
        if start >= len(self.portions):
            return 0
        _, a, b = self.portions[start]
        if (dispatch_fill._FAR * (b - a) > target[0] - self.tok[r]
                or dispatch_fill._FAR * piece_pairs(a, b - a) > target[1] - self.fl[r]):
            return 0
        self.put(r, *self.portions.pop(start))
        return 1

    rnd = random.Random(41)
    packs = [(_random_pack(rnd, trial, P), P, rnd.choice([1, 8, 128])) for trial in range(80)
             for P in [rnd.choice([2, 4, 8, 16, 64])]]
    big = [rnd.randint(512, 4096) for _ in range(990)] + [rnd.randint(200_000, 2_000_000) for _ in range(10)]
    packs.append((big, 8, 128))
    batched = [dispatch_fill.fill_placement(L, P, tile, _means(L, P)) for L, P, tile in packs]
    monkeypatch.setattr(dispatch_fill._Filler, "far_run", one_at_a_time)
    plain = [dispatch_fill.fill_placement(L, P, tile, _means(L, P)) for L, P, tile in packs]
    assert batched == plain
    assert sum(1 for pl in plain if pl is not None and pl.split) >= 20


def test_split_needs_prefilter_keeps_every_document_a_spread_splits():
    """``_split_needs`` skips documents under a length bound without working out their need: the same
    list as testing every document (over the token cap, or over T / c or F / c pairs at the largest
    spread c), documents right at the bounds included."""
    rnd = random.Random(53)
    for trial in range(200):
        P = rnd.choice([2, 4, 8, 64])
        lengths = _random_pack(rnd, trial, P)
        means = _means(lengths, P)
        c = dispatch.SPREADS[-1]
        lengths += [int(means[0] / c), int(means[0] / c) + 1, int((2 * means[1] / c) ** 0.5), 0]
        means = _means(lengths, P)
        plain = [(i, max(L / means[0], L * (L + 1) / 2 / means[1]), L > TOKEN_BOUND * means[0])
                 for i, L in enumerate(lengths) if L > 0]
        plain = [x for x in plain if x[2] or c * x[1] > 1]
        assert dispatch._split_needs(lengths, means, TOKEN_BOUND) == plain, trial
