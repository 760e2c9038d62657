"""Cost-balanced placement of packed documents on CP ranks (``cp.pack(cu_seqlens)``'s default).

A document is either kept **whole** on one rank (it needs no communication at all: its attention
is one varlen call against the rank's own K/V) or **split** over ``m`` ranks (2 <= m <= P), cut
into pieces on multiples of the backend's ``tile`` (only a document's last piece may be shorter).
Only split documents' K/V travel (ring hops or the all-gather); a pack whose documents all stay
whole moves nothing. Two kinds of candidates:

- **zigzag**: ``2m`` equal pieces (:func:`piece_bounds`), two a holder, paired so that every
  holder's pair costs about the same (pieces ``j`` and ``2m-1-j``): every holder of a document
  gets the document's own mix of cheap and dear rows (the dense path's causal balance);
- **fill** (:func:`fill_placement`): pieces of any tile-aligned size, sized to fill ranks: a
  head and a tail of one document (a zigzag pair of unequal sizes), or the tail of one document
  with the head of another, beside whole documents. A big document's holders then need not all
  see its whole length: a holder needs the keys up to the end of its last piece.

Cost model (per rank, the quantities the solver balances):

- tokens: the rank's rows (activation memory; capped at ``token_bound x T`` below);
- FLOPs: visible (query, key) pairs of causal attention, ``sum over its pieces of n (p + (n+1)/2)``
  for a piece of ``n`` tokens starting at position ``p`` of its document (a whole document of
  ``L`` tokens: ``L (L+1) / 2``); bidirectional attention doubles every rank's count alike, windows
  are not modelled;
- spread (what it minimizes within the bounds; :meth:`DocPlacement.key_rows`): over the split
  documents' holders, the key rows each needs (causal: up to the end of its last piece). The K/V a
  holder gathers, the fp32 dK/dV it accumulates (one varlen backward's accumulator a call) and
  sends back grow with it.

With ``S`` tokens, ``T = S / P`` and ``F`` = the pack's pairs / P (the means), the zigzag solver:

1. sorts documents by length, longest first (ties: lower index first);
2. places a candidate split: the split documents first, longest first, each one's pairs of
   pieces (cheapest paired with dearest) going dearest first to the rank, among those holding none
   of it yet, whose ``max(tokens / T, pairs / F)`` they raise least; then the others whole,
   greedily in that order, on the rank that minimizes ``max(tokens / T, pairs / F)`` after adding
   it (ties: the lowest rank): the longest-processing-time rule, whose result on FLOPs is at most
   ``F`` plus the largest whole document's pairs (the last document placed on the busiest rank
   started below the mean), plus what the split documents leave uneven;
3. candidates: the ``k`` longest documents split over all P ranks, the smallest ``k`` (from the
   documents that cannot be whole: longer than the token cap) whose placement is within
   ``max_tokens <= token_bound x T`` and ``max_pairs <= flop_bound x F`` (defaults 1.08 and
   1.04: under the 1.10 / 1.05 the benchmarks report), searched by doubling then bisection; and,
   where that splits anything, every document over ``m = ceil(c x max(L / T, pairs / F))`` ranks
   (at most P; whole where m = 1) for the first spread ``c`` of :data:`SPREADS` within the bounds;
4. keeps, of the candidates within the bounds, the one with the least ``sum m x L`` (ties: fewer
   split documents); if none is within them (tiny packs, tile rounding) the evaluated placement
   with the smallest ``max(tokens / T, pairs / F)``.

Where that splits a document and the pack has two documents or more, the fill candidate is built
too and kept if it is within the same bounds and spreads fewer key rows (ties: fewer pieces), or
if no zigzag candidate is within them. A lone document keeps the zigzag cut (the dense layout's,
so it runs the dense ring).

5. Then (two documents or more, something split) :func:`refine_boundaries` moves the boundaries
   between neighbouring pieces of a split document held by different ranks, whole tiles at a
   time, from the holder with more pairs to the one with fewer, while that lowers the sum of the
   squared per-rank pairs and the receiver stays within the token bound. Holders, pieces and
   their order stay; only their sizes change. The candidates above balance ``max(tokens / T,
   pairs / F)`` in steps of whole pieces; this evens out what those steps leave (the benchmarks'
   7-document 64k pack at P = 8: max / mean pairs 1.027 -> 1.007, tokens 1.013 -> 1.031).

Pure integer work (and float ratios), the same on every rank given the same cu_seqlens (the
cross-rank check compares those); on the 2-CPU build machine 1.2 ms for 1,000 short documents at
P = 8 (all whole: the fill is not built) and 4.2 ms for 999 of them beside one of 2M tokens, which
must be split (``benchmarks/varlen_sim.py`` times both). The fill scores its last few choices of a
rank only: a rank still needing ``_FAR`` (8) times a whole portion's tokens and pairs takes the
longest that fits.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

__all__ = ["DocPlacement", "balance_documents", "piece_bounds", "piece_pairs"]

TOKEN_BOUND = 1.08
FLOP_BOUND = 1.04


def piece_bounds(length: int, n: int, tile: int) -> list[tuple[int, int]]:
    """``(start, size)`` of the ``n`` pieces of a split document: every piece ``c`` tokens, ``c`` =
    ``ceil(length / n)`` rounded up to ``tile``, but the last non-empty one shorter (and, for a
    short document, empty ones after it)."""
    c = -(-length // n)
    c = -(-c // tile) * tile
    return [(min(i * c, length), max(0, min(c, length - i * c))) for i in range(n)]


def piece_pairs(pos: int, n: int) -> int:
    """Causal (query, key) pairs of ``n`` query tokens starting at position ``pos`` of a document."""
    return n * pos + n * (n + 1) // 2


@dataclass(frozen=True)
class DocPlacement:
    """Where each document of a pack lives.

    owner: per document, the rank holding it whole, or -1 when it is split; world_size: P; tile:
    the split pieces' alignment; tokens / pairs: per rank, the rows and causal pairs this placement
    gives (the balance reached); piece_table: per document the ``(start, size)`` of its pieces in
    position order (empty for whole documents); split_pieces: per document, per rank, the indices
    into ``piece_table[doc]`` of the pieces it holds, in position order (empty where it holds none,
    and for whole documents). Zigzag candidates give every holder two pieces ``(j, 2m-1-j)`` of
    ``2m`` equal ones; the fill candidate one or more pieces of any tile-aligned size.
    """

    owner: tuple[int, ...]
    world_size: int
    tile: int
    tokens: tuple[int, ...]
    pairs: tuple[int, ...]
    split_pieces: tuple[tuple[tuple[int, ...], ...], ...] = ()
    piece_table: tuple[tuple[tuple[int, int], ...], ...] = ()

    def pieces(self, doc: int, rank: int) -> tuple[int, ...]:
        """The pieces (indices into :meth:`bounds`) that ``rank`` holds of split document ``doc``,
        in position order; ``()`` where it holds none."""
        return self.split_pieces[doc][rank]

    def bounds(self, doc: int) -> tuple[tuple[int, int], ...]:
        """``(start, size)`` of split document ``doc``'s pieces, in position order."""
        return self.piece_table[doc]

    @property
    def n_pieces(self) -> tuple[int, ...]:
        """Per document, how many pieces it is cut into (0 for whole ones)."""
        return tuple(len(t) for t in self.piece_table)

    def holders(self, doc: int) -> int:
        """How many ranks hold pieces of ``doc`` (its ``m``; 1 for a whole document)."""
        return sum(1 for held in self.split_pieces[doc] if held) if self.owner[doc] < 0 else 1

    @property
    def split(self) -> tuple[int, ...]:
        """Indices of the split documents."""
        return tuple(i for i, o in enumerate(self.owner) if o < 0)

    def key_rows(self) -> int:
        """The spread the solver minimizes: over split documents and their holders, the key rows a
        holder needs (causal: its document's keys up to the end of its last piece). The K/V a
        holder gathers and the fp32 dK/dV it accumulates and sends back scale with it."""
        total = 0
        for doc in self.split:
            table = self.piece_table[doc]
            for held in self.split_pieces[doc]:
                if held:
                    total += table[held[-1]][0] + table[held[-1]][1]
        return total

    def token_balance(self) -> float:
        """max / mean tokens per rank (1.0 for an empty pack)."""
        return _ratio(self.tokens)

    def flop_balance(self) -> float:
        """max / mean causal pairs per rank (1.0 for an empty pack)."""
        return _ratio(self.pairs)


def _ratio(xs: tuple[int, ...]) -> float:
    total = sum(xs)
    return max(xs) * len(xs) / total if total else 1.0


def _piece_pairs_of(L: int, m: int, tile: int) -> list[tuple[int, int]]:
    """The 2m pieces of a document split over ``m`` ranks paired two by two, cheapest with dearest
    (by causal pairs): with equal pieces exactly the zigzag pairs (j, 2m-1-j); the shorter last
    piece moves to where its cost puts it."""
    bounds = piece_bounds(L, 2 * m, tile)
    by_cost = sorted(range(2 * m), key=lambda j: (piece_pairs(*bounds[j]), j))
    return [tuple(sorted((by_cost[j], by_cost[2 * m - 1 - j]))) for j in range(m)]


def _split_loads(split: list[tuple[int, int, int]], P: int, tile: int, means: tuple[float, float]):
    """Documents ``split`` = [(doc, length, m)], longest first, each cut into 2m pieces: per rank
    (tokens, pairs) and per document the two pieces each rank holds. A document's pairs of pieces,
    dearest first, each go to the rank (without one of this document yet) whose load it raises
    least."""
    tok, fl = [0] * P, [0] * P
    pieces_of: dict[int, tuple[tuple[int, ...], ...]] = {}
    it, iff = 1.0 / means[0], 1.0 / means[1]
    for doc, L, m in split:
        bounds = piece_bounds(L, 2 * m, tile)
        pairs = _piece_pairs_of(L, m, tile)
        cost = [(bounds[a][1] + bounds[b][1], piece_pairs(*bounds[a]) + piece_pairs(*bounds[b])) for a, b in pairs]
        held: list = [()] * P
        for j in sorted(range(m), key=lambda j: (-max(cost[j][0] * it, cost[j][1] * iff), j)):
            dt, df = cost[j]
            r = min((r for r in range(P) if not held[r]),
                    key=lambda r: (max((tok[r] + dt) * it, (fl[r] + df) * iff), r))
            held[r] = pairs[j]
            tok[r] += dt
            fl[r] += df
        pieces_of[doc] = tuple(held)
    return tok, fl, pieces_of


def _place(order, lengths, holders: dict[int, int], P: int, tile: int, means: tuple[float, float]):
    """Owners (-1 split), per-rank loads and split pairs with the documents of ``holders`` (doc ->
    m >= 2, in ``order``) split over m ranks each, the rest whole."""
    owner = [0] * len(lengths)
    for i in holders:
        owner[i] = -1
    tok, fl, pieces_of = _split_loads([(i, lengths[i], holders[i]) for i in order if i in holders], P, tile, means)
    it, iff = 1.0 / means[0], 1.0 / means[1]
    ranks = range(P)
    for i in order:
        if i in holders:
            continue
        L = lengths[i]
        c = L * (L + 1) // 2
        best, best_cost = 0, float("inf")
        for r in ranks:
            a, b = (tok[r] + L) * it, (fl[r] + c) * iff
            cost = a if a > b else b
            if cost < best_cost:
                best, best_cost = r, cost
        owner[i] = best
        tok[best] += L
        fl[best] += c
    return owner, tok, fl, pieces_of


def _subset_holders(lengths, P: int, means: tuple[float, float], c: float, token_bound: float) -> dict[int, int]:
    """Per document the ranks it needs at spread ``c``: ``m = ceil(c x max(L / T, pairs / F))``
    (at most P; at least 2 above the token cap); documents with m = 1 stay whole."""
    out = {}
    for i, L in enumerate(lengths):
        if L <= 0:
            continue
        m = min(P, -(-c * max(L / means[0], L * (L + 1) / 2 / means[1]) // 1))
        if L > token_bound * means[0]:
            m = max(m, 2)
        if m >= 2:
            out[i] = int(m)
    return out


SPREADS = (1.0, 1.5, 2.0, 3.0, 4.0, 6.0)


def balance_documents(doc_lengths: tuple[int, ...], world_size: int, tile: int = 1,
                      token_bound: float = TOKEN_BOUND, flop_bound: float = FLOP_BOUND) -> DocPlacement:
    """The placement of the module docstring for documents of ``doc_lengths`` tokens (zero
    allowed: a zero-length document is whole on rank 0 and holds nothing) over ``world_size``
    ranks, split pieces multiples of ``tile``: the zigzag candidates' best, or the fill
    candidate where that is within the bounds and spreads fewer key rows."""
    P, lengths = world_size, list(doc_lengths)
    best, feasible = zigzag_placement(lengths, P, tile, token_bound, flop_bound)
    if best.split and sum(1 for L in lengths if L > 0) >= 2:  # unequal pieces, where they spread less
        means = (sum(lengths) / P, sum(L * (L + 1) // 2 for L in lengths) / P)
        filled = fill_placement(lengths, P, tile, means)
        if max(filled.tokens) <= token_bound * means[0] and max(filled.pairs) <= flop_bound * means[1] and (
                not feasible or (filled.key_rows(), sum(filled.n_pieces)) < (best.key_rows(), sum(best.n_pieces))):
            best = filled
        return refine_boundaries(best, means, token_bound)
    return best


def refine_boundaries(placement: DocPlacement, means: tuple[float, float], token_bound: float = TOKEN_BOUND,
                      budget: int = 2048) -> DocPlacement:
    """``placement`` after step 5 of the module docstring. A move of ``g`` pairs across a boundary
    from ``f_a`` to ``f_b`` lowers the sum of squares by ``2 g (f_a - f_b - g)`` (so the larger of
    the two never grows); each move is the one that lowers it most, of about the rows that even the
    two out (:func:`_even_rows`; ties: the lower document, then the lower boundary). Pieces never
    become empty. Every move weighs all boundaries, ``budget`` of them in all (at most about 4 ms of
    host time on the build machine): hundreds of pieces (every document split, evened by its zigzag
    already) get a few moves, tens of pieces all they need."""
    t, cap = placement.tile, token_bound * means[0]
    tok, fl = list(placement.tokens), list(placement.pairs)
    tables = {d: [list(b) for b in placement.piece_table[d]] for d in placement.split}
    bounds = [(d, i, a, b) for d in tables for i in range(len(tables[d]) - 1)
              for a, b in [(_holder(placement, d, i), _holder(placement, d, i + 1))] if a != b and a >= 0 and b >= 0]
    for _ in range(budget // max(1, len(bounds))):
        move = None
        for d, i, a, b in bounds:
            left, right = tables[d][i], tables[d][i + 1]
            if not (left[1] and right[1]):  # an empty piece stays empty (and its neighbour the last)
                continue
            x = right[0]
            if fl[b] > fl[a] and right[1] > t:  # rows [x, x + n) from b to a
                src, dst, most, down = b, a, (right[1] - 1) // t * t, False
            elif fl[a] > fl[b] and left[1] > t:  # rows [x - n, x) from a to b
                src, dst, most, down = a, b, left[1] - t, True
            else:
                continue
            most = min(most, int((cap - tok[dst]) // t) * t)
            for n in _even_rows(x, fl[src] - fl[dst], t, most, down):
                gain = piece_pairs(x - n, n) if down else piece_pairs(x, n)
                drop = gain * (fl[src] - fl[dst] - gain)
                if drop > 0 and (move is None or drop > move[0]):
                    move = (drop, d, i, src, dst, gain, -n if down else n)
        if move is None:
            break
        _, d, i, src, dst, gain, shift = move
        tables[d][i][1] += shift
        tables[d][i + 1][0] += shift
        tables[d][i + 1][1] -= shift
        n = abs(shift)
        tok[src], fl[src], tok[dst], fl[dst] = tok[src] - n, fl[src] - gain, tok[dst] + n, fl[dst] + gain
    table = tuple(tuple(tuple(b) for b in tables[d]) if d in tables else placement.piece_table[d]
                  for d in range(len(placement.owner)))
    return DocPlacement(placement.owner, placement.world_size, t, tuple(tok), tuple(fl), placement.split_pieces, table)


def _even_rows(x: int, diff: int, tile: int, most: int, down: bool) -> tuple[int, ...]:
    """Row counts (multiples of ``tile``, from ``tile`` to ``most``) to move across a boundary at
    position ``x``, around the count whose pairs are half ``diff``: rows ``[x, x + n)``
    (``n x + n^2 / 2`` pairs), or with ``down`` rows ``[x - n, x)`` (``n x - n^2 / 2``)."""
    if most < tile:
        return ()
    half = diff / 2
    n = (x * x - 2 * half) ** 0.5 if down and x * x >= 2 * half else None
    n = x - n if n is not None else x if down else ((x * x + 2 * half) ** 0.5 - x)
    lo = max(tile, min(most, int(n // tile) * tile))
    return tuple(sorted({lo, min(most, lo + tile)}))


def _holder(placement: DocPlacement, doc: int, piece: int) -> int:
    """The rank holding piece ``piece`` of split document ``doc`` (-1: none)."""
    return next((r for r, held in enumerate(placement.split_pieces[doc]) if piece in held), -1)


def zigzag_placement(lengths: list[int], P: int, tile: int, token_bound: float = TOKEN_BOUND,
                     flop_bound: float = FLOP_BOUND) -> tuple[DocPlacement, bool]:
    """Steps 1-4 of the module docstring: the best zigzag candidate (equal pieces, two a holder)
    and whether it is within the bounds."""
    S = sum(lengths)
    if P == 1 or S == 0:
        pairs = sum(L * (L + 1) // 2 for L in lengths)
        return DocPlacement((0,) * len(lengths), P, tile, (S,) + (0,) * (P - 1), (pairs,) + (0,) * (P - 1),
                            ((),) * len(lengths), ((),) * len(lengths)), True
    means = (S / P, sum(L * (L + 1) // 2 for L in lengths) / P)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    order = [i for i in order if lengths[i] > 0] + [i for i in order if lengths[i] == 0]
    nonzero = sum(1 for L in lengths if L > 0)
    k_min = sum(1 for L in lengths if L > token_bound * means[0])
    seen: dict[tuple, tuple] = {}

    def evaluate(holders: dict[int, int]) -> tuple:
        key = tuple(sorted(holders.items()))
        if key not in seen:
            owner, tok, fl, pieces_of = _place(order, lengths, holders, P, tile, means)
            score = max(max(tok) / means[0] / token_bound, max(fl) / means[1] / flop_bound)
            spread = sum(m * lengths[i] for i, m in holders.items())
            seen[key] = (owner, tok, fl, pieces_of, score, spread, holders)
        return seen[key]

    k_split = lambda k: {i: P for i in order[:k]}  # noqa: E731
    ok = lambda k: evaluate(k_split(k))[4] <= 1.0  # noqa: E731
    if not ok(k_min):
        lo, step, hi = k_min, 1, None  # lo fails
        while lo + step <= nonzero:
            if ok(lo + step):
                hi = lo + step
                break
            lo, step = lo + step, step * 2
        if hi is None and ok(nonzero):
            hi = nonzero
        if hi is not None:
            while hi - lo > 1:
                mid = (lo + hi) // 2
                lo, hi = (lo, mid) if ok(mid) else (mid, hi)
    if any(v[6] for v in seen.values() if v[4] <= 1.0) or all(v[4] > 1.0 for v in seen.values()):
        for c in SPREADS:  # split documents over fewer ranks: the first spread within the bounds
            if evaluate(_subset_holders(lengths, P, means, c, token_bound))[4] <= 1.0:
                break
    feasible = [v for v in seen.values() if v[4] <= 1.0]
    owner, tok, fl, pieces_of, _, _, holders = (min(feasible, key=lambda v: (v[5], len(v[6]))) if feasible else
                                                min(seen.values(), key=lambda v: (v[4], v[5])))
    table = tuple(tuple(piece_bounds(lengths[i], 2 * holders[i], tile)) if i in holders else ()
                  for i in range(len(lengths)))
    return DocPlacement(tuple(owner), P, tile, tuple(tok), tuple(fl),
                        tuple(pieces_of.get(i, ()) for i in range(len(lengths))), table), bool(feasible)


# -- the fill candidate: unequal pieces --------------------------------------------------------

_TOKEN_SLACK, _PAIR_SLACK = 0.02, 0.01  # how far a whole piece of work may overshoot a rank's target (x T, x F)
_SCAN = 8  # whole portions that fit, scored per choice (the longest ones)
_FAR = 8  # a rank still needing this many times a portion's tokens and pairs takes it unscored


def _longest_first(portion: list[int]) -> tuple[int, int, int]:
    return portion[1] - portion[2], portion[0], portion[1]


def _span_pairs(a: int, b: int) -> int:
    """Causal pairs of the query rows ``[a, b)`` of a document."""
    return piece_pairs(a, b - a)


def _up(x: int, tile: int) -> int:
    return -(-x // tile) * tile


def _down(x: int, tile: int) -> int:
    return x // tile * tile


class _Filler:
    """State of :func:`fill_placement`: the unplaced *portions* ``[doc, a, b]`` (position ranges of
    documents; longest first), per rank tokens / pairs, and the pieces placed ``(doc, rank, a, b)``.
    Cuts sit on tile multiples of the document's positions, so every piece starts on one and only
    pieces ending at their document's end may be shorter than a tile multiple."""

    def __init__(self, lengths: list[int], P: int, tile: int, means: tuple[float, float]) -> None:
        self.lengths, self.P, self.tile, self.T, self.F = lengths, P, tile, means[0], means[1]
        self.portions = [[i, 0, L] for i, L in enumerate(lengths) if L > 0]
        self._sort()
        self.tok, self.fl = [0] * P, [0] * P
        self.placed: list[tuple[int, int, int, int]] = []

    def _sort(self) -> None:
        self.portions.sort(key=_longest_first)

    def _add(self, portion: list[int]) -> None:
        bisect.insort(self.portions, portion, key=_longest_first)

    def first_within(self, rows: float) -> int:
        """Index of the first (longest) portion of at most ``rows`` tokens."""
        lo, hi = 0, len(self.portions)
        while lo < hi:
            mid = (lo + hi) // 2
            _, a, b = self.portions[mid]
            if b - a > rows:
                lo = mid + 1
            else:
                hi = mid
        return lo

    def put(self, r: int, doc: int, a: int, b: int) -> None:
        if b > a:
            self.placed.append((doc, r, a, b))
            self.tok[r] += b - a
            self.fl[r] += _span_pairs(a, b)

    def take(self, idx: int, r: int, cuts: list[tuple[int, int]]) -> None:
        """Pieces ``cuts`` (ascending, inside portion ``idx``) to rank ``r``; the rest stays unplaced."""
        doc, a, b = self.portions.pop(idx)
        at = a
        for x, y in cuts:
            if x > at:
                self._add([doc, at, x])
            self.put(r, doc, x, y)
            at = max(at, y)
        if at < b:
            self._add([doc, at, b])

    def densest(self, rows: int, skip: int = -1) -> int:
        """The most pairs ``rows`` query rows of one of the four longest portions give (its tail)."""
        best = 0
        for j, (_, a, b) in enumerate(self.portions[:4]):
            if j != skip:
                best = max(best, _span_pairs(max(a, b - rows), b))
        return best

    def whole(self, r: int, need: tuple[float, float], target: tuple[float, float]) -> int | None:
        """The portion to place whole on rank ``r``: of the longest few that fit the need (with a
        little slack), the one that keeps the rank's token and pair fractions closest among those
        that leave a need the rest can still meet; None if none."""
        dt, df = need
        start, fits = self.first_within(dt + _TOKEN_SLACK * self.T), []
        if start < len(self.portions):  # far from full: the longest that fits, unscored (the last few balance)
            _, a, b = self.portions[start]
            if _FAR * (b - a) <= dt and _FAR * _span_pairs(a, b) <= df:
                return start
        for idx in range(start, len(self.portions)):
            _, a, b = self.portions[idx]
            n, c = b - a, _span_pairs(a, b)
            if c <= df + _PAIR_SLACK * self.F:
                fits.append((abs((self.fl[r] + c) / target[1] - (self.tok[r] + n) / target[0]), idx, n, c))
                if len(fits) >= _SCAN:
                    break
        for _, idx, n, c in sorted(fits):
            rt, rf = dt - n, df - c
            if rf < _PAIR_SLACK * self.F or (rt >= self.tile / 2 and rf <= self.densest(int(rt), idx)):
                return idx
            # else the rank would be left short of pairs nothing can give
        return None

    def head_tail(self, idx: int, rows: int, pairs: float) -> list[tuple[int, int]] | None:
        """A head ``[a, a+n1)`` and a tail ``[b-n2, b)`` of portion ``idx`` with ``n1 + n2 = rows``
        and about ``pairs`` causal pairs (the zigzag pair, sized to the need); None where the
        portion is shorter or the pairs are out of its range."""
        _, a, b = self.portions[idx]
        if b - a < rows:
            return None
        f = lambda n2: _span_pairs(a, a + rows - n2) + _span_pairs(b - n2, b)  # noqa: E731 (rises with n2)
        if not f(0) <= pairs <= f(rows):
            return None
        n2 = _bisect(f, 0, rows, pairs)
        tail = min(b, max(a, _up(b - n2, self.tile)))
        head = max(a, min(tail, _down(a + rows - (b - tail), self.tile)))
        return [(a, b)] if head == tail else [(x, y) for x, y in ((a, head), (tail, b)) if y > x]

    def two(self, rows: int, pairs: float) -> list[tuple[int, tuple[int, int]]] | None:
        """The densest portion's tail and the sparsest portion's head filling ``(rows, pairs)``
        together (where no single portion can): ``[(portion index, (x, y))]``, or None."""
        n = len(self.portions)
        if n < 2:
            return None
        few = sorted(set(range(min(n, _SCAN))) | set(range(max(0, n - _SCAN), n)))  # the longest and the shortest
        dense = max(few, key=lambda i: (self.portions[i][2], -i))

        def head_density(i: int) -> float:
            _, a, b = self.portions[i]
            n = min(b - a, rows)
            return _span_pairs(a, a + n) / max(n, 1)

        sparse = min((i for i in few if i != dense), key=lambda i: (head_density(i), i))
        _, a_d, b_d = self.portions[dense]
        _, a_s, b_s = self.portions[sparse]
        lo, hi = max(0, rows - (b_s - a_s)), min(rows, b_d - a_d)
        f = lambda n: _span_pairs(b_d - n, b_d) + _span_pairs(a_s, a_s + rows - n)  # noqa: E731 (rises with n)
        if lo > hi or not f(lo) <= pairs <= f(hi):
            return None
        n = _bisect(f, lo, hi, pairs)
        tail = min(b_d, max(a_d, _up(b_d - n, self.tile)))
        head = a_s + rows - (b_d - tail)
        head = b_s if head >= b_s else max(a_s, _down(head, self.tile))
        return [(i, piece) for i, piece in ((dense, (tail, b_d)), (sparse, (a_s, head))) if piece[1] > piece[0]]

    def one_end(self, need: tuple[float, float]) -> list[tuple[int, int]]:
        """Of the longest portion, the end whose pairs come closest to the need: its head with at
        most the pairs needed (the need is sparser) or its tail of the rows needed (denser)."""
        _, a, b = self.portions[0]
        rows = int(min(need[0], b - a))
        if need[1] <= _span_pairs(a, a + rows):
            n = _bisect(lambda x: _span_pairs(a, a + x), 0, rows, need[1] + 1) - 1
            return [(a, min(b, max(a + self.tile, _down(a + n, self.tile))))]
        start = _up(b - rows, self.tile)
        return [(max(a, start if start < b else _down(b - 1, self.tile)), b)]

    def rank(self, r: int, target: tuple[float, float]) -> None:
        """Fill rank ``r`` towards ``target`` (tokens, pairs): whole portions while they fit, then
        one cut that meets the need exactly where one can."""
        while self.portions:
            need = (target[0] - self.tok[r], target[1] - self.fl[r])
            if need[0] < self.tile / 2 or need[1] < 0.005 * target[1]:
                return
            idx = self.whole(r, need, target)
            if idx is not None:
                _, a, b = self.portions[idx]
                self.take(idx, r, [(a, b)])
                continue
            rows = int(need[0])
            if rows < 1:  # under one token to give (a tile of 1)
                return
            for idx in range(self.first_within(rows - 1)):  # the portions of at least ``rows`` tokens
                cuts = self.head_tail(idx, rows, need[1])
                if cuts is not None:
                    self.take(idx, r, cuts)
                    return
            pair = self.two(rows, need[1])
            if pair is not None:
                for idx, piece in sorted(pair, reverse=True):  # the later index first: pops keep the other
                    self.take(idx, r, [piece])
                return
            self.take(0, r, self.one_end(need))


def _bisect(f, lo: int, hi: int, value: float) -> int:
    """The least ``n`` in ``[lo, hi]`` with ``f(n) >= value`` for ``f`` non-decreasing (``hi`` if none)."""
    while lo < hi:
        mid = (lo + hi) // 2
        if f(mid) < value:
            lo = mid + 1
        else:
            hi = mid
    return lo


def fill_placement(lengths: list[int], P: int, tile: int, means: tuple[float, float]) -> DocPlacement:
    """The fill candidate: ranks filled one after another towards the remaining tokens and pairs
    per rank, each with whole documents (or the unplaced rest of one) while they fit, then the
    piece(s) that meet its need: a head and a tail of one document (a zigzag pair of unequal
    sizes), or the tail of the densest rest and the head of the sparsest; the last rank takes what
    is left. Adjacent pieces on one rank merge; a document all on one rank is whole there."""
    fill = _Filler(lengths, P, tile, means)
    left = [sum(lengths), sum(L * (L + 1) // 2 for L in lengths)]
    for r in range(P - 1):
        fill.rank(r, (left[0] / (P - r), left[1] / (P - r)))
        left[0] -= fill.tok[r]
        left[1] -= fill.fl[r]
    for doc, a, b in list(fill.portions):
        fill.put(P - 1, doc, a, b)
    by_doc: dict[int, list[tuple[int, int, int]]] = {}
    for doc, r, a, b in fill.placed:
        by_doc.setdefault(doc, []).append((a, b, r))
    owner = [0] * len(lengths)
    table: list[tuple[tuple[int, int], ...]] = [()] * len(lengths)
    held: list[tuple[tuple[int, ...], ...]] = [()] * len(lengths)
    for doc, pieces in by_doc.items():
        merged: list[list[int]] = []
        for a, b, r in sorted(pieces):
            if merged and merged[-1][1] == a and merged[-1][2] == r:
                merged[-1][1] = b
            else:
                merged.append([a, b, r])
        if len({r for _, _, r in merged}) == 1:
            owner[doc] = merged[0][2]
            continue
        owner[doc] = -1
        table[doc] = tuple((a, b - a) for a, b, _ in merged)
        held[doc] = tuple(tuple(j for j, (_, _, r) in enumerate(merged) if r == rank) for rank in range(P))
    return DocPlacement(tuple(owner), P, tile, tuple(fill.tok), tuple(fill.fl), tuple(held), tuple(table))
