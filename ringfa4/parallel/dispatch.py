"""Cost-balanced placement of packed documents on CP ranks (``cp.pack(cu_seqlens)``'s default).

A document is either kept **whole** on one rank (it needs no communication at all: its attention
is one varlen call against the rank's own K/V) or **split** over ``m`` ranks (2 <= m <= P): cut
into ``2m`` pieces by :func:`piece_bounds` (multiples of the backend's ``tile``, only the last
non-empty piece shorter), two a rank, paired so that every holder's pair costs about the same
(zigzag, pieces ``j`` and ``2m-1-j``, for equal pieces): a long document costs each of its holders
about the same (the dense path's causal balance). Only split documents' K/V travel (ring hops or
the all-gather); a pack whose documents all stay whole moves nothing. Fewer holders mean bigger
pieces and less spread: each holder needs its document's K/V up to its pieces and sends back
gradients for them, ``m x L`` rows a document in all (the solver's tie-breaker, below).

Cost model (per rank, the quantities the solver balances):

- tokens: the rank's rows (activation memory; capped at ``token_bound x T`` below);
- FLOPs: visible (query, key) pairs of causal attention, ``sum over its pieces of n (p + (n+1)/2)``
  for a piece of ``n`` tokens starting at position ``p`` of its document (a whole document of
  ``L`` tokens: ``L (L+1) / 2``); bidirectional attention doubles every rank's count alike, windows
  are not modelled.

With ``S`` tokens, ``T = S / P`` and ``F`` = the pack's pairs / P (the means), the solver:

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
4. keeps, of the candidates within the bounds, the one with the least spread ``sum m x L`` (ties:
   fewer split documents); if none is within them (tiny packs, tile rounding) the evaluated
   placement with the smallest ``max(tokens / T, pairs / F)``.

Pure integer work (and a float spread), the same on every rank given the same cu_seqlens (the
cross-rank check compares those); 1.4 ms for 1,000 documents at P = 8 (``benchmarks/varlen_sim.py``
times it).
"""

from __future__ import annotations

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
    gives (the balance reached); split_pieces: per document, per rank, the two pieces it holds of
    the document's ``2m`` (``(j, 2m-1-j)`` for equal pieces; empty where the rank holds none, and
    for whole documents); n_pieces: per document its ``2m`` (0 for whole ones).
    """

    owner: tuple[int, ...]
    world_size: int
    tile: int
    tokens: tuple[int, ...]
    pairs: tuple[int, ...]
    split_pieces: tuple[tuple[tuple[int, ...], ...], ...] = ()
    n_pieces: tuple[int, ...] = ()

    def pieces(self, doc: int, rank: int) -> tuple[int, ...]:
        """The two pieces (indices into ``piece_bounds(L, n_pieces[doc], tile)``) that ``rank``
        holds of split document ``doc``, in position order; ``()`` where it holds none."""
        return self.split_pieces[doc][rank]

    def bounds(self, doc: int, length: int) -> list[tuple[int, int]]:
        """``(start, size)`` of split document ``doc``'s pieces (``length``: its tokens)."""
        return piece_bounds(length, self.n_pieces[doc], self.tile)

    def holders(self, doc: int) -> int:
        """How many ranks hold pieces of ``doc`` (its ``m``; 1 for a whole document)."""
        return self.n_pieces[doc] // 2 if self.owner[doc] < 0 else 1

    @property
    def split(self) -> tuple[int, ...]:
        """Indices of the split documents."""
        return tuple(i for i, o in enumerate(self.owner) if o < 0)

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
    ranks, split pieces multiples of ``tile``."""
    P, lengths = world_size, list(doc_lengths)
    S = sum(lengths)
    if P == 1 or S == 0:
        pairs = sum(L * (L + 1) // 2 for L in lengths)
        return DocPlacement((0,) * len(lengths), P, tile, (S,) + (0,) * (P - 1), (pairs,) + (0,) * (P - 1),
                            ((),) * len(lengths), (0,) * len(lengths))
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
    pairs = tuple(pieces_of.get(i, ()) for i in range(len(lengths)))
    n_pieces = tuple(2 * holders.get(i, 0) for i in range(len(lengths)))
    return DocPlacement(tuple(owner), P, tile, tuple(tok), tuple(fl), pairs, n_pieces)
