"""What a placement of packed documents on CP ranks is (:class:`DocPlacement`) and the cost model its
solvers count with (:mod:`ringfa4.parallel.dispatch`): a piece of ``n`` query tokens starting at
position ``p`` of its document sees ``n p + n (n + 1) / 2`` causal (query, key) pairs
(:func:`piece_pairs`), and a tiled kernel computes the whole ``tile x tile`` blocks those touch
(:func:`tile_pairs`: the diagonal's blocks, a short last query tile's row of blocks), what the
solvers balance."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["DocPlacement", "piece_bounds", "piece_pairs", "tile_pairs"]


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


def tile_pairs(pos: int, n: int, tile: int) -> int:
    """The causal pairs a tiled kernel computes for ``n`` query tokens starting at position ``pos``
    of a document: whole ``tile x tile`` blocks, query tiles counted from the piece's first row
    and key tiles from the document's first key; every block the mask touches is computed whole
    (the diagonal's; the whole row of blocks of a short last query tile). For query tile ``i`` of
    ``q = ceil(n / tile)``: ``ceil(pos / tile) + i + 1`` key tiles, the last one ``ceil((pos + n) /
    tile)``. Additive over pieces cut on tile multiples; with a tile of 1, :func:`piece_pairs`."""
    if n <= 0:
        return 0
    q, c = -(-n // tile), -(-pos // tile)
    return tile * tile * ((q - 1) * c + (q - 1) * q // 2 - (-(pos + n) // tile))


@dataclass(frozen=True)
class DocPlacement:
    """Where each document of a pack lives.

    owner: per document, the rank holding it whole, or -1 when it is split; world_size: P; tile:
    the split pieces' alignment; tokens / pairs: per rank, the rows and the exact causal
    pairs (:func:`piece_pairs`; the kernels compute :func:`tile_pairs` at ``tile``, a little more)
    this placement gives (the balance reached); piece_table: per document the ``(start, size)`` of its pieces in
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
