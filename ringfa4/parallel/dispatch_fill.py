"""The fill candidate of the balanced placement (:mod:`ringfa4.parallel.dispatch`): pieces of any
tile-aligned size, sized to fill ranks one after another: a head and a tail of one document (a
zigzag pair of unequal sizes), or the tail of one document with the head of another, beside whole
documents. A big document's holders then need not all see its whole length: a holder needs the keys
up to the end of its last piece."""

from __future__ import annotations

import bisect

from .doc_placement import DocPlacement, piece_pairs

__all__ = ["fill_placement"]

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

    def far_run(self, start: int, r: int, target: tuple[float, float]) -> int:
        """Portions ``start``, ``start + 1``, ... to rank ``r`` whole, as long as each is under
        ``1 / _FAR`` of the rank's need (tokens and pairs) and the rank still needs some: what the
        loop of :meth:`rank` does one portion at a time (the next one is the longest that fits
        then), in one go. How many it placed (0: the portion at ``start`` is not one of those)."""
        end, tok, fl, half, least = start, self.tok[r], self.fl[r], self.tile / 2, 0.005 * target[1]
        while end < len(self.portions):
            _, a, b = self.portions[end]
            n, c = b - a, _span_pairs(a, b)
            if _FAR * n > target[0] - tok or _FAR * c > target[1] - fl:
                break
            tok, fl, end = tok + n, fl + c, end + 1
            if target[0] - tok < half or target[1] - fl < least:
                break
        for doc, a, b in self.portions[start:end]:
            self.put(r, doc, a, b)
        del self.portions[start:end]
        return end - start

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
            if self.far_run(self.first_within(need[0] + _TOKEN_SLACK * self.T), r, target):
                continue
            idx = self.whole(r, need, target)
            if idx is not None:
                _, a, b = self.portions[idx]
                self.take(idx, r, [(a, b)])
                continue
            rows = int(need[0])
            if rows < 1:  # under one token to give (a tile of 1)
                return
            tri = rows * (rows + 1) // 2
            for idx in range(self.first_within(rows - 1)):  # the portions of at least ``rows`` tokens
                if rows * (self.portions[idx][2] - rows) + tri < need[1]:  # its densest cut (the tail) is short
                    continue  # of pairs: head_tail's own first test, without the call
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


def fill_placement(lengths: list[int], P: int, tile: int, means: tuple[float, float],
                   caps: tuple[float, float] | None = None) -> DocPlacement | None:
    """The fill candidate: ranks filled one after another towards the remaining tokens and pairs
    per rank, each with whole documents (or the unplaced rest of one) while they fit, then the
    piece(s) that meet its need: a head and a tail of one document (a zigzag pair of unequal
    sizes), or the tail of the densest rest and the head of the sparsest; the last rank takes what
    is left. Adjacent pieces on one rank merge; a document all on one rank is whole there.

    ``caps``: (tokens, pairs) a rank may hold. Given, the fill stops and returns None as soon as
    it cannot end within them: a filled rank over a cap, or the rest's mean per unfilled rank over
    one (the most on a rank is at least the mean)."""
    fill = _Filler(lengths, P, tile, means)
    left = [sum(lengths), sum(L * (L + 1) // 2 for L in lengths)]
    for r in range(P - 1):
        fill.rank(r, (left[0] / (P - r), left[1] / (P - r)))
        left[0] -= fill.tok[r]
        left[1] -= fill.fl[r]
        if caps is not None and (fill.tok[r] > caps[0] or fill.fl[r] > caps[1] or
                                 left[0] > caps[0] * (P - r - 1) or left[1] > caps[1] * (P - r - 1)):
            return None
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
