"""Cost-balanced placement of packed documents on CP ranks (``cp.pack(cu_seqlens)``'s default).

A document is either kept **whole** on one rank (it needs no communication at all: its attention
is one varlen call against the rank's own K/V) or **split**: cut into ``2P`` pieces by
:func:`piece_bounds` (multiples of the backend's ``tile``, only the last non-empty piece shorter),
two a rank, paired so that every rank's pair costs about the same (zigzag, pieces ``r`` and
``2P-1-r``, for equal pieces): a long document costs every rank about the same (the dense path's
causal balance). Only split documents' K/V travel (ring hops or the all-gather); a pack whose
documents all stay whole moves nothing.

Cost model (per rank, the quantities the solver balances):

- tokens: the rank's rows (activation memory; capped at ``token_bound x T`` below);
- FLOPs: visible (query, key) pairs of causal attention, ``sum over its pieces of n (p + (n+1)/2)``
  for a piece of ``n`` tokens starting at position ``p`` of its document (a whole document of
  ``L`` tokens: ``L (L+1) / 2``); bidirectional attention doubles every rank's count alike, windows
  are not modelled.

With ``S`` tokens, ``T = S / P`` and ``F`` = the pack's pairs / P (the means; split documents
contribute to every rank), the solver:

1. sorts documents by length, longest first (ties: lower index first);
2. for ``k`` documents split (the ``k`` longest; each document's pieces paired cheapest with
   dearest, which is zigzag for equal pieces and evens out the shorter last piece, the pairs going
   dearest first to the rank whose ``max(tokens / T, pairs / F)`` they raise least), places the
   others greedily in that order on the rank that minimizes ``max(tokens / T, pairs / F)`` after
   adding it (ties: the lowest rank): the longest-processing-time rule, whose result on FLOPs is
   at most ``F`` plus the largest whole document's pairs (the last document placed on the busiest
   rank started below the mean), plus what the split documents leave uneven;
3. takes the smallest ``k`` (from the documents that cannot be whole: longer than the token cap)
   whose placement is within ``max_tokens <= token_bound x T`` and ``max_pairs <= flop_bound x F``
   (defaults 1.08 and 1.04: under the 1.10 / 1.05 the benchmarks report), searched by doubling
   then bisection; if no ``k`` meets them (tiny packs, tile rounding) the evaluated placement with
   the smallest ``max(tokens / T, pairs / F)``.

Pure integer work, the same on every rank given the same cu_seqlens (the cross-rank check compares
those); 1.4 ms for 1,000 documents at P = 8 (``benchmarks/varlen_sim.py`` times it).
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

    owner: per document, the rank holding it whole, or -1 when it is split over all ranks;
    world_size: P; tile: the split pieces' alignment; tokens / pairs: per rank, the rows and causal
    pairs this placement gives (the balance reached); split_pieces: per split document, per rank,
    the two pieces it holds (``(j, 2P-1-j)`` for equal pieces; empty for whole documents).
    """

    owner: tuple[int, ...]
    world_size: int
    tile: int
    tokens: tuple[int, ...]
    pairs: tuple[int, ...]
    split_pieces: tuple[tuple[tuple[int, int], ...], ...] = ()

    def pieces(self, doc: int, rank: int) -> tuple[int, int]:
        """The two of the 2P pieces (indices into ``piece_bounds(L, 2P, tile)``) that ``rank``
        holds of split document ``doc``, in position order."""
        return self.split_pieces[doc][rank]

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


def _piece_pairs_of(L: int, P: int, tile: int) -> list[tuple[int, int]]:
    """The 2P pieces of a split document paired two by two, cheapest with dearest (by causal
    pairs): with equal pieces exactly the zigzag pairs (j, 2P-1-j); the shorter last piece moves
    to where its cost puts it."""
    bounds = piece_bounds(L, 2 * P, tile)
    by_cost = sorted(range(2 * P), key=lambda j: (piece_pairs(*bounds[j]), j))
    return [tuple(sorted((by_cost[j], by_cost[2 * P - 1 - j]))) for j in range(P)]


def _split_loads(split: list[tuple[int, int]], P: int, tile: int, means: tuple[float, float]):
    """Documents ``split`` = [(doc, length)], longest first, cut into 2P pieces: per rank
    (tokens, pairs) and per document the two pieces each rank holds. A document's pairs of pieces,
    dearest first, each go to the rank (without one yet) whose load it raises least."""
    tok, fl = [0] * P, [0] * P
    pieces_of: dict[int, tuple[tuple[int, int], ...]] = {}
    it, iff = 1.0 / means[0], 1.0 / means[1]
    for doc, L in split:
        bounds = piece_bounds(L, 2 * P, tile)
        pairs = _piece_pairs_of(L, P, tile)
        cost = [(bounds[a][1] + bounds[b][1], piece_pairs(*bounds[a]) + piece_pairs(*bounds[b])) for a, b in pairs]
        held: list = [None] * P
        for j in sorted(range(P), key=lambda j: (-max(cost[j][0] * it, cost[j][1] * iff), j)):
            dt, df = cost[j]
            r = min((r for r in range(P) if held[r] is None),
                    key=lambda r: (max((tok[r] + dt) * it, (fl[r] + df) * iff), r))
            held[r] = pairs[j]
            tok[r] += dt
            fl[r] += df
        pieces_of[doc] = tuple(held)
    return tok, fl, pieces_of


def _place(order, lengths, k: int, P: int, tile: int, means: tuple[float, float]):
    """Owners (-1 split), per-rank loads and split pairs with the first ``k`` of ``order`` split."""
    owner = [0] * len(lengths)
    for i in order[:k]:
        owner[i] = -1
    tok, fl, pieces_of = _split_loads([(i, lengths[i]) for i in order[:k]], P, tile, means)
    it, iff = 1.0 / means[0], 1.0 / means[1]
    ranks = range(P)
    for i in order[k:]:
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
                            ((),) * len(lengths))
    means = (S / P, sum(L * (L + 1) // 2 for L in lengths) / P)
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    order = [i for i in order if lengths[i] > 0] + [i for i in order if lengths[i] == 0]
    nonzero = sum(1 for L in lengths if L > 0)
    k_min = sum(1 for L in lengths if L > token_bound * means[0])
    seen: dict[int, tuple] = {}

    def score(k: int) -> float:
        if k not in seen:
            owner, tok, fl, pieces_of = _place(order, lengths, k, P, tile, means)
            seen[k] = (owner, tok, fl, pieces_of,
                       max(max(tok) / means[0] / token_bound, max(fl) / means[1] / flop_bound))
        return seen[k][4]

    ok = lambda k: score(k) <= 1.0  # noqa: E731
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
    best = min(seen, key=lambda k: (seen[k][4] > 1.0, k if seen[k][4] <= 1.0 else seen[k][4]))
    owner, tok, fl, pieces_of, _ = seen[best]
    pairs = tuple(pieces_of.get(i, ()) for i in range(len(lengths)))
    return DocPlacement(tuple(owner), P, tile, tuple(tok), tuple(fl), pairs)
