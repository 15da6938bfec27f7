"""The prefix cache's index: which token prefixes the engine holds keys and values for.

Theory of operation. The index is a radix tree over token ids, kept by the
scheduler on the event loop; the keys and values themselves are entries in
the engine (``Engine.restore`` and ``Engine.cache_op``), one per tree node:
node ``n`` holds the KV of its ``tokens`` at positions ``depth ..
depth + len(tokens)`` of every prompt that starts with the tokens on the path
from the root to it. A cached token's KV depends only on the tokens before it
(one model per server), so the token ids are the whole key, and a prompt that
differs from a cached one only after some point reuses everything before it.

- **Lookup** (a request is admitted): walk the tree along the prompt, at most
  ``limit`` tokens (the last prompt token is always prefilled, for its
  logits); the entries on the path, the last one perhaps in part, are copied
  into the request's slot, and the request prefills only the rest. The
  request holds its path (a pin on every node of it) until it finishes, so
  nothing it reused, or will extend, is evicted under it.
- **Keep** (a prompt chunk was prefilled, or a row finished): the scheduler
  reserves room for the new tokens first (evicting if needed) and gets an
  entry id; the engine copies the slot's positions into that entry in the
  same step; once the step is back, :meth:`PrefixIndex.kept` links the entry
  into the tree. Linking walks the tree again from the root: another request
  may have kept the same tokens meanwhile, so the new entry is trimmed to
  what is really new (or dropped), and a node it diverges from in the middle
  is split. A prefix shared by many requests is therefore stored once.
- **Evict**: least recently used leaves that no request pins go first, until
  the new tokens fit in the budget. Reserving never evicts a pinned node; when
  everything is pinned the keep is skipped (the request runs as it would
  without the cache).

Structural edits (splits, drops) are queued as :data:`CacheOp` values and go
to the engine at the start of the next step, before any restore planned
against the edited tree. Everything here is synchronous and engine-free.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluiceway.engines.base import CacheOp, DropKV, EngineInfo, KeepKV, SplitKV

#: With no --prefix-cache-bytes: at most this share of the memory free after loading...
FREE_MEMORY_SHARE = 4
#: ... and at most this many tokens' worth.
MAX_DEFAULT_TOKENS = 2**20
#: When the engine cannot tell how much memory is free.
FALLBACK_BYTES = 2**30


def default_budget(info: EngineInfo) -> int:
    """``min(free memory / 4, 2**20 tokens x KV bytes per token)``, where free
    memory is what the engine's device had left once the model was loaded
    (1 GiB in its place when unknown); 0 when the engine keeps no prefixes."""
    if info.kv_bytes_per_token <= 0:
        return 0
    free = info.free_memory_bytes or FALLBACK_BYTES * FREE_MEMORY_SHARE
    return min(free // FREE_MEMORY_SHARE, MAX_DEFAULT_TOKENS * info.kv_bytes_per_token)


@dataclass(slots=True)
class PrefixCacheStats:
    """Counters for the metrics endpoint (issue F) to export."""

    #: Requests looked up (that could reuse a token), and those that reused at least one.
    lookups: int = 0
    hits: int = 0
    #: Prompt tokens looked up, and those reused instead of prefilled.
    looked_up_tokens: int = 0
    hit_tokens: int = 0
    #: Nodes evicted, and their tokens.
    evictions: int = 0
    evicted_tokens: int = 0
    #: Tokens held now (linked nodes; reservations in flight not counted).
    tokens: int = 0
    bytes_per_token: int = 0
    capacity_bytes: int = 0

    @property
    def misses(self) -> int:
        return self.lookups - self.hits

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


@dataclass(eq=False, slots=True)
class _Node:
    entry: int
    tokens: tuple[int, ...]
    #: Position of the first of ``tokens`` in every prompt through this node.
    depth: int
    parent: _Node | None
    children: dict[int, _Node] = field(default_factory=dict)
    #: Holds (requests, reservations) whose path runs through this node.
    pins: int = 0
    #: The index's clock when a path through this node was last used.
    used: int = 0

    @property
    def end(self) -> int:
        return self.depth + len(self.tokens)


@dataclass(frozen=True, slots=True)
class Hold:
    """A pinned path: the tree holds the first ``length`` tokens of a
    prompt, ending in ``node`` (perhaps part-way through it). ``entries`` are
    the engine entries of that path, in order, as of the lookup."""

    node: _Node
    length: int
    entries: tuple[int, ...] = ()
    #: The index's generation (see :meth:`PrefixIndex.reset`).
    generation: int = 0


@dataclass(frozen=True, slots=True)
class _Reservation:
    parent: Hold
    tokens: tuple[int, ...]
    start: int
    generation: int


class PrefixIndex:
    """The radix tree, its LRU and byte accounting, and the queue of engine edits."""

    def __init__(self, *, budget_bytes: int, bytes_per_token: int) -> None:
        if budget_bytes <= 0 or bytes_per_token <= 0:
            raise ValueError("a prefix cache needs a positive budget and KV size")
        self._capacity = budget_bytes // bytes_per_token
        self._ids = itertools.count(1)
        self._root = _Node(entry=0, tokens=(), depth=0, parent=None)
        self._clock = 0
        self._held = 0
        self._reserved = 0
        self._reservations: dict[int, _Reservation] = {}
        self._ops: list[CacheOp] = []
        #: Bumped by :meth:`reset`; reservations from before it are void.
        self._generation = 0
        self.stats = PrefixCacheStats(
            bytes_per_token=bytes_per_token, capacity_bytes=self._capacity * bytes_per_token
        )

    # --- requests ---------------------------------------------------------------

    def lookup(self, tokens: Sequence[int], limit: int, *, least: int = 1) -> Hold:
        """Pin the longest cached prefix of ``tokens``, at most ``limit`` long.
        One shorter than ``least`` is counted as a miss: the caller prefills
        it again."""
        node, length = self._root, 0
        entries = []
        while length < limit:
            child = node.children.get(tokens[length])
            if child is None:
                break
            same = _common(child.tokens, tokens, length, limit)
            entries.append(child.entry)
            node, length = child, length + same
            if same < len(child.tokens):
                break
        hold = Hold(node, length, tuple(entries), self._generation)
        self._pin(hold, 1)
        self._touch(node)
        if limit > 0:  # a request that may reuse nothing is no miss
            self.stats.lookups += 1
            used = length if length >= least else 0
            self.stats.hits += used > 0
            self.stats.looked_up_tokens += len(tokens)
            self.stats.hit_tokens += used
        return hold

    def peek(self, tokens: Sequence[int]) -> int:
        """How many leading ``tokens`` the tree holds (no pin, no use, no counting)."""
        return self._walk(tuple(tokens))[1]

    def release(self, hold: Hold) -> None:
        if hold.generation == self._generation:
            self._pin(hold, -1)

    # --- keeping new tokens ---------------------------------------------------------

    def reserve(self, parent: Hold, tokens: Sequence[int]) -> int | None:
        """Room for ``tokens[parent.length:]``, whose KV a slot is about to
        hold; ``tokens`` is the whole path from the first token. Returns the
        entry id to keep them under, or None when they do not fit."""
        start = parent.length
        count = len(tokens) - start
        if parent.generation != self._generation or count <= 0 or not self._make_room(count):
            return None
        entry = next(self._ids)
        self._reserved += count
        self._pin(parent, 1)
        self._reservations[entry] = _Reservation(parent, tuple(tokens), start, self._generation)
        return entry

    def keep_row(self, parent: Hold, tokens: Sequence[int], slot: int) -> None:
        """Queue a copy of a running row's positions beyond ``parent`` (its
        generated tokens), made before the slot is freed."""
        entry = self.reserve(parent, tokens)
        if entry is not None:
            self._ops.append(KeepKV(entry=entry, slot=slot, start=parent.length, end=len(tokens)))

    def kept(self, entry: int, *, ok: bool) -> Hold | None:
        """The engine kept ``entry`` (or failed to): link it into the tree.
        Returns a hold on the tokens' whole path, for whoever goes on using
        it (the caller releases it), or None."""
        reservation = self._reservations.pop(entry)
        if reservation.generation != self._generation:
            self._ops.append(DropKV(entry=entry))
            return None
        self._reserved -= len(reservation.tokens) - reservation.start
        try:
            if ok:
                return self._link(entry, reservation)
            self._ops.append(DropKV(entry=entry))  # whatever part of it the engine made
            return None
        finally:
            self.release(reservation.parent)

    # --- the engine side ----------------------------------------------------------

    def take_ops(self) -> tuple[CacheOp, ...]:
        """The edits the engine must apply before the next step's restores."""
        ops, self._ops = tuple(self._ops), []
        return ops

    @property
    def has_ops(self) -> bool:
        return bool(self._ops)

    def reset(self) -> None:
        """The engine lost track of its entries (an edit failed): forget the
        whole tree, and have the engine drop everything it may still hold."""
        stack = list(self._root.children.values())
        while stack:
            node = stack.pop()
            self._ops.append(DropKV(entry=node.entry))
            stack += node.children.values()
        self._root = _Node(entry=0, tokens=(), depth=0, parent=None)
        self._generation += 1
        self._held = self._reserved = 0
        self.stats.tokens = 0

    # --- the tree -------------------------------------------------------------------

    def _link(self, entry: int, reservation: _Reservation) -> Hold:
        tokens, start = reservation.tokens, reservation.start
        node, length = self._walk(tokens)
        # length < start cannot happen (the reservation pinned tokens[:start]);
        # were it to, the entry would only be dropped.
        if length == len(tokens) or length < start:
            self._ops.append(DropKV(entry=entry))
        else:
            if length > start:  # someone kept the same tokens meanwhile
                self._ops.append(SplitKV(entry=entry, at=length - start, head=None))
            if length < node.end:
                node = self._split(node, length - node.depth)
            child = _Node(entry=entry, tokens=tokens[length:], depth=length, parent=node)
            node.children[tokens[length]] = child
            self._held += len(child.tokens)
            self.stats.tokens = self._held
            node, length = child, len(tokens)
        hold = Hold(node, length, generation=self._generation)
        self._pin(hold, 1)
        self._touch(node)
        return hold

    def _walk(self, tokens: tuple[int, ...]) -> tuple[_Node, int]:
        """The deepest node that shares a prefix with ``tokens``, and how long that prefix is."""
        node, length = self._root, 0
        while length < len(tokens):
            child = node.children.get(tokens[length])
            if child is None:
                break
            same = _common(child.tokens, tokens, length, len(tokens))
            node, length = child, length + same
            if same < len(child.tokens):
                break
        return node, length

    def _split(self, node: _Node, at: int) -> _Node:
        """Cut ``node`` after ``at`` tokens; return the new upper node. The
        lower part keeps the node's identity (and entry id), so holds ending
        in it stay valid: their path now runs through the new node."""
        parent = node.parent
        assert parent is not None
        assert 0 < at < len(node.tokens)
        head = _Node(
            entry=next(self._ids),
            tokens=node.tokens[:at],
            depth=node.depth,
            parent=parent,
            pins=node.pins,
            used=node.used,
        )
        self._ops.append(SplitKV(entry=node.entry, at=at, head=head.entry))
        parent.children[head.tokens[0]] = head
        node.tokens = node.tokens[at:]
        node.depth += at
        node.parent = head
        head.children[node.tokens[0]] = node
        return head

    def _make_room(self, count: int) -> bool:
        """Evict least recently used, unpinned leaves until ``count`` more tokens fit."""
        excess = self._held + self._reserved + count - self._capacity
        if excess <= 0:
            return True
        if count > self._capacity:
            return False
        leaves = [(n.used, id(n), n) for n in self._nodes() if _evictable(n)]
        heapq.heapify(leaves)
        while excess > 0 and leaves:
            _, _, node = heapq.heappop(leaves)
            parent = node.parent
            assert parent is not None
            del parent.children[node.tokens[0]]
            self._ops.append(DropKV(entry=node.entry))
            self._held -= len(node.tokens)
            excess -= len(node.tokens)
            self.stats.evictions += 1
            self.stats.evicted_tokens += len(node.tokens)
            if parent is not self._root and _evictable(parent):
                heapq.heappush(leaves, (parent.used, id(parent), parent))
        self.stats.tokens = self._held
        return excess <= 0

    def pins(self) -> int:
        """Holds and reservations on the tree's nodes, summed (0 when no
        request holds a path: what a leak would show)."""
        return sum(node.pins for node in self._nodes())

    def _nodes(self) -> list[_Node]:
        found, stack = [], list(self._root.children.values())
        while stack:
            node = stack.pop()
            found.append(node)
            stack += node.children.values()
        return found

    def _pin(self, hold: Hold, delta: int) -> None:
        node: _Node | None = hold.node
        while node is not None and node is not self._root:
            node.pins += delta
            node = node.parent

    def _touch(self, node: _Node) -> None:
        self._clock += 1
        current: _Node | None = node
        while current is not None:
            current.used = self._clock
            current = current.parent


def _evictable(node: _Node) -> bool:
    return not node.children and node.pins == 0


def _common(mine: tuple[int, ...], tokens: Sequence[int], offset: int, limit: int) -> int:
    """How many of ``mine`` equal ``tokens[offset:]``, looking no further than ``limit``."""
    span = min(len(mine), limit - offset)
    if tuple(tokens[offset : offset + span]) == mine[:span]:
        return span
    for index in range(span):
        if mine[index] != tokens[offset + index]:
            return index
    return span
