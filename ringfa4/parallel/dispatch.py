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
3. candidates (when not every document can stay whole within the bounds): every document over
   ``m = ceil(c x max(L / T, pairs / F))`` ranks (at most P; whole where m = 1) for the first spread
   ``c`` of :data:`SPREADS` within the bounds; then the ``k`` longest documents split over all P
   ranks, the smallest ``k`` (from the documents that cannot be whole: longer than the token cap)
   whose placement is within ``max_tokens <= token_bound x T`` and ``max_pairs <= flop_bound x F``
   (defaults 1.08 and 1.04: under the 1.10 / 1.05 the benchmarks report), searched by doubling then
   bisection. A candidate that spreads more than one already within the bounds (step 4's order)
   cannot be kept, so the search takes it as within the bounds without placing it: the search then
   looks at fewer split documents, never at more;
4. keeps, of the candidates within the bounds, the one with the least ``sum m x L`` (ties: fewer
   split documents, then the lesser ``(doc, m)`` list); if none is within them (tiny packs, tile
   rounding) the evaluated placement with the smallest ``max(tokens / T, pairs / F)`` (ties: the
   same order).

Where that splits a document and the pack has two documents or more, the fill candidate is built
too and kept if it is within the same bounds and spreads fewer key rows (ties: fewer pieces), or
if no zigzag candidate is within them. A lone document keeps the zigzag cut (the dense layout's,
so it runs the dense ring).

5. Then (two documents or more, something split) :func:`refine_boundaries` moves the boundaries
   between neighbouring pieces of a split document held by different ranks, whole tiles at a
   time, from the holder whose kernels compute more to the one computing less, while that lowers
   the sum of the squared per-rank work and the receiver stays within the token and FLOP bounds.
   Its work is counted in whole tiles (:func:`~ringfa4.parallel.doc_placement.tile_pairs`: the
   diagonal's tiles and a short last query tile's row are computed whole, so short documents and
   pieces cost more than their pairs), and it stops within :data:`EVEN_PAIRS` of the mean.
   Holders, pieces and their order stay; only their sizes change. The candidates above balance
   ``max(tokens / T, pairs / F)`` in steps of whole pieces; this evens out what those steps leave
   (the benchmarks' 7-document 64k pack at P = 8: max / mean tile work 1.027 -> 1.006, exact pairs
   1.027 -> 1.013, tokens 1.013 -> 1.033, the same 19 pieces).

Pure integer work (and float ratios), the same on every rank given the same cu_seqlens (the
cross-rank check compares those). Its time goes into placing every whole document per candidate,
so a candidate stops as soon as a rank goes over a bound (loads only grow: its score would be over
1, the very test the search applies), and the fill stops once it cannot end within the bounds.
Shortcuts that change no placement: the candidates that split the same first documents the same
way (the k longest over P ranks, for each k the search tries) share the split documents' loads by
prefix (:class:`_SplitMemo`); a whole document's rank, and a split document's pair's, is found
scanning the ranks by load, stopping once no rank left can raise less; step 5 weighs boundaries in
the order of the most a move there can gain; the fill gives a rank the whole documents far smaller
than its need in one go. On the 2-CPU build machine (``benchmarks/solver_time.py``, 1,000
documents, P = 8): 0.9 ms all short and whole (2.0 ms at P = 64), 1.9 ms beside one of 2M tokens,
which must be split (6 ms at P = 64), 3.8 ms beside ten of 0.2M-2M (16 ms at P = 64), 1.1 ms for
a log-uniform 128-2M tail (10 ms at P = 64). The fill scores its last few choices of a rank only:
a rank still needing ``_FAR`` (8) times a whole portion's tokens and pairs takes the longest that
fits."""

from __future__ import annotations

import bisect

from .dispatch_fill import fill_placement
from .doc_placement import DocPlacement, piece_bounds, piece_pairs, tile_pairs

__all__ = ["DocPlacement", "balance_documents", "fill_placement", "piece_bounds", "piece_pairs",
           "refine_boundaries", "tile_pairs", "zigzag_placement"]

TOKEN_BOUND = 1.08
FLOP_BOUND = 1.04
EVEN_PAIRS = 0.005  # step 5 stops once the most (whole-tile) work on a rank is within this of the mean


def _piece_pairs_of(L: int, m: int, tile: int) -> list[tuple[int, int]]:
    """The 2m pieces of a document split over ``m`` ranks paired two by two, cheapest with dearest
    (by causal pairs): with equal pieces exactly the zigzag pairs (j, 2m-1-j); the shorter last
    piece moves to where its cost puts it."""
    bounds = piece_bounds(L, 2 * m, tile)
    by_cost = sorted(range(2 * m), key=lambda j: (piece_pairs(*bounds[j]), j))
    return [tuple(sorted((by_cost[j], by_cost[2 * m - 1 - j]))) for j in range(m)]


class _SplitMemo:
    """The states :func:`_split_loads` reached after each prefix of a split list, within one solve
    (the same means and limits): candidates that split the same first documents the same way (the
    k longest over P ranks each, for every k the search tries) resume from the longest prefix done
    instead of placing it again. A prefix is a chain of ids: ``ids[(parent, (doc, L, m))]``; its state
    ``(tok, fl, parent, doc, held)``, or None where a rank went over the limits within it."""

    def __init__(self) -> None:
        self.ids: dict[tuple, int] = {}
        self.states: list = [None]  # id 0: the empty prefix (zero loads, no pieces)

    def longest(self, split: list[tuple[int, int, int]]) -> tuple[int, int]:
        """``(id, n)``: the longest prefix of ``split`` already placed (n documents; id 0, n 0: none)."""
        at = n = 0
        for item in split:
            nxt = self.ids.get((at, item))
            if nxt is None:
                break
            at, n = nxt, n + 1
        return at, n

    def add(self, parent: int, item: tuple[int, int, int], state) -> int:
        self.states.append(state)
        self.ids[(parent, item)] = len(self.states) - 1
        return len(self.states) - 1

    def pieces(self, at: int) -> dict[int, tuple[tuple[int, ...], ...]]:
        """The pieces each document of prefix ``at`` gave each rank."""
        out = {}
        while at:
            _, _, parent, doc, held = self.states[at]
            out[doc] = held
            at = parent
        return out


def _split_loads(split: list[tuple[int, int, int]], P: int, tile: int, means: tuple[float, float],
                 limits: tuple[float, float] | None, memo: _SplitMemo | None = None):
    """Documents ``split`` = [(doc, length, m)], longest first, each cut into 2m pieces: per rank
    (tokens, pairs) and per document the two pieces each rank holds. A document's pairs of pieces,
    dearest first, each go to the rank (without one of this document yet; ties: the lowest) whose
    load it raises least. None as soon as a rank goes over ``limits`` (token, FLOP bound: :func:`_over`).
    ``memo``: the states of prefixes placed before in this solve (:class:`_SplitMemo`)."""
    memo = memo if memo is not None else _SplitMemo()
    at, done = memo.longest(split)
    if at and memo.states[at] is None:  # a prefix already went over the limits
        return None
    tok, fl = (list(memo.states[at][0]), list(memo.states[at][1])) if at else ([0] * P, [0] * P)
    it, iff = 1.0 / means[0], 1.0 / means[1]
    for doc, L, m in split[done:]:
        bounds = piece_bounds(L, 2 * m, tile)
        pairs = _piece_pairs_of(L, m, tile)
        cost = [(bounds[a][1] + bounds[b][1], piece_pairs(*bounds[a]) + piece_pairs(*bounds[b])) for a, b in pairs]
        held: list = [()] * P
        # The ranks without a piece of this document, by load: scanned as in _place (a pair's raise is
        # at least a rank's load plus min(dt / T, df / F)), the least raise, the lowest rank among equal ones.
        # Ranks of equal loads sit together (empty ones, say): of those only the first (lowest) is scored.
        free = sorted((max(tok[r] * it, fl[r] * iff), tok[r], fl[r], r) for r in range(P))
        over = False
        for j in sorted(range(m), key=lambda j: (-max(cost[j][0] * it, cost[j][1] * iff), j)):
            dt, df = cost[j]
            lo = min(dt * it, df * iff)
            at_r, r, least, last = 0, 0, float("inf"), None
            for idx, (x, t, f, q) in enumerate(free):
                if x + lo > least * (1.0 + 1e-9):
                    break
                if (t, f) == last:
                    continue
                last = t, f
                a, b = (t + dt) * it, (f + df) * iff
                raised = a if a > b else b
                if raised < least or (raised == least and q < r):
                    at_r, r, least = idx, q, raised
            del free[at_r]
            held[r] = pairs[j]
            tok[r] += dt
            fl[r] += df
            if _over(tok[r], fl[r], means, limits):
                over = True
                break
        at = memo.add(at, (doc, L, m), None if over else (tuple(tok), tuple(fl), at, doc, tuple(held)))
        if over:
            return None
    return tok, fl, memo.pieces(at)


def _over(tok: int, fl: int, means: tuple[float, float], bounds: tuple[float, float] | None) -> bool:
    """Whether a rank of ``tok`` tokens and ``fl`` pairs is over ``bounds`` (token, FLOP: x the
    means), in the very form a candidate's score takes (so a candidate stops exactly when its score
    would be over 1); never with ``bounds`` None."""
    return bounds is not None and (tok / means[0] / bounds[0] > 1.0 or fl / means[1] / bounds[1] > 1.0)


def _place(order, lengths, holders: dict[int, int], P: int, tile: int, means: tuple[float, float],
           bounds: tuple[float, float] | None = None, memo: _SplitMemo | None = None):
    """Owners (-1 split), per-rank loads and split pairs with the documents of ``holders`` (doc ->
    m >= 2, in ``order``) split over m ranks each, the rest whole. With ``bounds`` (token, FLOP),
    None as soon as a rank goes over them: the candidate is out of the bounds (loads only grow),
    and the rest of its placement is not worked out. ``memo``: :func:`_split_loads`' (same bounds)."""
    owner = [0] * len(lengths)
    for i in holders:
        owner[i] = -1
    split = [(i, lengths[i], holders[i]) for i in order if i in holders]
    loads = _split_loads(split, P, tile, means, bounds, memo)
    if loads is None:
        return None
    tok, fl, pieces_of = loads
    it, iff = 1.0 / means[0], 1.0 / means[1]
    # The ranks by load max(tok / T, pairs / F): a document's raise max((tok + L) / T, (fl + c) / F) is at
    # least a rank's load plus min(L / T, c / F), so the scan stops at the first rank (by load) whose load
    # plus that passes the best raise found (a margin of 1e-9 for rounding): the same rank as scoring all
    # P in rank order (the least raise, the lowest rank among equal ones), a few scored instead of P.
    load = [max(t * it, f * iff) for t, f in zip(tok, fl)]
    by_load = sorted((x, r) for r, x in enumerate(load))
    inf, margin = float("inf"), 1.0 + 1e-9
    (m0, m1), (b0, b1) = means, bounds if bounds is not None else (inf, inf)
    left, insort = bisect.bisect_left, bisect.insort
    for i in order:
        if i in holders:
            continue
        L = lengths[i]
        c = L * (L + 1) // 2
        lo = L * it if L * it < c * iff else c * iff
        best, best_cost = 0, inf
        for x, r in by_load:
            if x + lo > best_cost * margin:
                break
            a, b = (tok[r] + L) * it, (fl[r] + c) * iff
            cost = a if a > b else b
            if cost < best_cost or (cost == best_cost and r < best):
                best, best_cost = r, cost
        owner[i] = best
        t, f = tok[best] + L, fl[best] + c
        tok[best], fl[best] = t, f
        if t / m0 / b0 > 1.0 or f / m1 / b1 > 1.0:  # _over, inlined (the same float operations)
            return None
        del by_load[left(by_load, (load[best], best))]
        load[best] = a = t * it if t * it > f * iff else f * iff
        insort(by_load, (a, best))
    return owner, tok, fl, pieces_of


def _subset_holders(needs: list[tuple[int, float, bool]], P: int, c: float) -> dict[int, int]:
    """Per document the ranks it needs at spread ``c``: ``m = ceil(c x max(L / T, pairs / F))``
    (at most P; at least 2 above the token cap); documents with m = 1 stay whole. ``needs``:
    ``(doc, max(L / T, pairs / F), over the token cap)`` of the documents some spread may split
    (:func:`_split_needs`)."""
    out = {}
    for i, need, over_cap in needs:
        m = min(P, -(-c * need // 1))
        if over_cap:
            m = max(m, 2)
        if m >= 2:
            out[i] = int(m)
    return out


def _split_needs(lengths, means: tuple[float, float], token_bound: float) -> list[tuple[int, float, bool]]:
    """:func:`_subset_holders`' input: the documents that the largest of :data:`SPREADS` splits."""
    out = []
    c = SPREADS[-1]  # up to ``small`` tokens a document is under T / c, F / c pairs and the cap (a token of margin)
    small = min(token_bound * means[0], means[0] / c, ((1.0 + 8.0 * means[1] / c) ** 0.5 - 1.0) / 2.0) - 1.0
    for i, L in enumerate(lengths):
        if L > 0 and L > small:
            need, over_cap = max(L / means[0], L * (L + 1) / 2 / means[1]), L > token_bound * means[0]
            if over_cap or SPREADS[-1] * need > 1:
                out.append((i, need, over_cap))
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
        caps = (token_bound * means[0], flop_bound * means[1])
        filled = fill_placement(lengths, P, tile, means, caps)
        if filled is not None and max(filled.tokens) <= caps[0] and max(filled.pairs) <= caps[1] and (
                not feasible or (filled.key_rows(), sum(filled.n_pieces)) < (best.key_rows(), sum(best.n_pieces))):
            best = filled
        return refine_boundaries(best, lengths, means, token_bound, flop_bound)
    return best


def refine_boundaries(placement: DocPlacement, lengths: list[int], means: tuple[float, float],
                      token_bound: float = TOKEN_BOUND, flop_bound: float = FLOP_BOUND, budget: int = 2048,
                      even: float = EVEN_PAIRS) -> DocPlacement:
    """``placement`` of documents of ``lengths`` after step 5 of the module docstring, in the pairs
    the kernels compute (:func:`tile_pairs` at the placement's tile: the whole tiles the causal mask
    touches, where the candidates count exact pairs; a short document's diagonal and last query
    tile make its tiles up to ~20% more than its pairs). A move of ``g`` across a boundary from
    ``f_a`` to ``f_b`` lowers the sum of squares by ``2 g (f_a - f_b - g)`` (so the larger of the two
    never grows); each move is the one that lowers it most, of about the rows that even the two
    out (:func:`_even_rows`; ties: the lower document, then the lower boundary), with the receiver
    within the token bound and, in exact pairs, the FLOP bound. Pieces never become empty. It stops
    once the most on a rank is within ``even`` (x the mean) of the mean: a move trades tokens for
    pairs, and past that the tokens (activation memory, every other layer's time) are worth more.
    Each move is chosen among all boundaries (weighed in the order of the most a move there can
    gain, ``(f_a - f_b)^2 / 4``, until that is under the best found), with at most ``budget /
    boundaries`` moves: hundreds of pieces (every document split, evened by its zigzag already) get
    a few moves, tens of pieces all they need."""
    t, P = placement.tile, placement.world_size
    cap, pair_cap = token_bound * means[0], flop_bound * means[1]
    tok, fl, work = list(placement.tokens), list(placement.pairs), [0] * P
    for d, L in enumerate(lengths):
        if placement.owner[d] >= 0:  # tile_pairs(0, L, t): q (q + 1) / 2 blocks of q = ceil(L / t) query tiles
            q = -(-L // t)
            work[placement.owner[d]] += t * t * (q * (q + 1) // 2)
        else:
            for r, held in enumerate(placement.split_pieces[d]):
                work[r] += sum(tile_pairs(*placement.piece_table[d][j], t) for j in held)
    enough = (1.0 + even) * sum(work) / P
    tables = {d: [list(b) for b in placement.piece_table[d]] for d in placement.split}
    bounds = []
    for d in tables:
        holder = [-1] * len(tables[d])  # per piece, the rank holding it
        for r, held in enumerate(placement.split_pieces[d]):
            for j in held:
                holder[j] = r
        bounds += [(d, i, holder[i], holder[i + 1]) for i in range(len(holder) - 1)
                   if holder[i] != holder[i + 1] and holder[i] >= 0 and holder[i + 1] >= 0]

    def best_move(d: int, i: int, a: int, b: int) -> tuple | None:
        """The move across boundary i of document d that lowers the sum of squares most (None: none)."""
        left, right = tables[d][i], tables[d][i + 1]
        if not (left[1] and right[1]):  # an empty piece stays empty (and its neighbour the last)
            return None
        x = right[0]
        if work[b] > work[a] and right[1] > t:  # rows [x, x + n) from b to a
            src, dst, most, down = b, a, (right[1] - 1) // t * t, False
        elif work[a] > work[b] and left[1] > t:  # rows [x - n, x) from a to b
            src, dst, most, down = a, b, left[1] - t, True
        else:
            return None
        most = min(most, int((cap - tok[dst]) // t) * t)
        move = None
        for n in _even_rows(x, work[src] - work[dst], t, most, down):
            at = x - n if down else x
            gain, exact = tile_pairs(at, n, t), piece_pairs(at, n)
            drop = gain * (work[src] - work[dst] - gain)
            if drop > 0 and fl[dst] + exact <= pair_cap and (move is None or drop > move[0]):
                move = (drop, d, i, src, dst, gain, exact, -n if down else n)
        return move

    # A move lowers the sum of squares by g (f_src - f_dst - g) <= (f_src - f_dst)^2 / 4: boundaries are
    # weighed in the order of that bound (ties: the first), until the bound is under the best drop found.
    for _ in range(budget // max(1, len(bounds))):
        if max(work) <= enough:
            break
        bound = [(work[a] - work[b]) ** 2 for _, _, a, b in bounds]
        move = None  # the largest drop; ties: the first boundary
        for k in sorted(range(len(bounds)), key=lambda k: -bound[k]):
            if move is not None and bound[k] < 4 * move[0]:
                break
            m = best_move(*bounds[k])
            if m is not None and (move is None or m[0] > move[0] or (m[0] == move[0] and k < move[-1])):
                move = m + (k,)
        if move is None:
            break
        _, d, i, src, dst, gain, exact, shift, _ = move
        tables[d][i][1] += shift
        tables[d][i + 1][0] += shift
        tables[d][i + 1][1] -= shift
        n = abs(shift)
        tok[src], fl[src], work[src] = tok[src] - n, fl[src] - exact, work[src] - gain
        tok[dst], fl[dst], work[dst] = tok[dst] + n, fl[dst] + exact, work[dst] + gain
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


def _search_k(fits, k_min: int, k_max: int) -> None:
    """Step 3's k search: ``fits(k)`` (the k longest documents split over all P ranks within the
    bounds?) asked at ``k_min``, then doubling steps up to ``k_max``, then bisection of the bracket
    found (what the caller keeps is in the answers it recorded)."""
    if fits(k_min):
        return
    lo, step, hi = k_min, 1, None  # lo fails
    while lo + step <= k_max:
        if fits(lo + step):
            hi = lo + step
            break
        lo, step = lo + step, step * 2
    if hi is None and fits(k_max):
        hi = k_max
    if hi is not None:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            lo, hi = (lo, mid) if fits(mid) else (mid, hi)


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
    bounds = (token_bound, flop_bound)
    order = sorted(range(len(lengths)), key=lengths.__getitem__, reverse=True)  # stable: ties by index
    nonzero = len(lengths) - lengths.count(0)
    k_min = sum(1 for L in lengths if L > token_bound * means[0])
    seen: dict[tuple, tuple] = {}  # holders -> (placement, or None: out of the bounds; (spread, split count); holders)
    memo = _SplitMemo()  # the split documents' loads by prefix, shared by the candidates
    least: list = []  # the least (spread, split count) of a candidate within the bounds so far

    def ok(holders: dict[int, int]) -> bool:
        key = tuple(sorted(holders.items()))
        if key not in seen:
            rank_key = (sum(m * lengths[i] for i, m in holders.items()), len(holders))
            if least and rank_key > least[0]:  # cannot win: answered "within" without placing it
                return True
            seen[key] = (_place(order, lengths, holders, P, tile, means, bounds, memo), rank_key, holders)
            if seen[key][0] is not None and (not least or rank_key < least[0]):
                least[:] = [rank_key]
        return seen[key][0] is not None

    if k_min == 0 and ok({}):  # everything whole within the bounds: nothing can spread less
        placed, holders = seen[()][0], {}
    else:
        needs = _split_needs(lengths, means, token_bound)
        for c in SPREADS:  # split documents over fewer ranks: the first spread within the bounds
            if ok(_subset_holders(needs, P, c)):
                break
        _search_k(lambda k: ok({i: P for i in order[:k]}), k_min, nonzero)
        feasible = [v for v in seen.values() if v[0] is not None]
        placed = holders = None
        if feasible:
            placed, _, holders = min(feasible, key=lambda v: (v[1], tuple(sorted(v[2].items()))))
    if placed is None:  # none within the bounds (tiny packs, tile rounding): the one closest to them, placed whole
        def score(v: tuple) -> tuple:
            _, tok, fl, _ = _place(order, lengths, v[2], P, tile, means)
            return (max(max(tok) / means[0] / token_bound, max(fl) / means[1] / flop_bound), v[1],
                    tuple(sorted(v[2].items())))
        holders = min(seen.values(), key=score)[2]
        placed = _place(order, lengths, holders, P, tile, means)
    owner, tok, fl, pieces_of = placed
    table = tuple(tuple(piece_bounds(lengths[i], 2 * holders[i], tile)) if i in holders else ()
                  for i in range(len(lengths)))
    return DocPlacement(tuple(owner), P, tile, tuple(tok), tuple(fl),
                        tuple(pieces_of.get(i, ()) for i in range(len(lengths))), table), bool(least)
