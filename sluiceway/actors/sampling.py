"""Vectorised sampling over one step's batch of logits (pure NumPy, no I/O).

Each row is a choice with its own parameters and its own random stream, so a
request's samples do not depend on what it is batched with: a row draws one
uniform number per step from a generator seeded by ``(seed, choice)`` and
picks its token by inverting the cumulative distribution. Greedy rows never
touch the generator.

A row with a constraint is masked first (:mod:`sluiceway.actors.guide`):
every token its grammar does not allow gets ``-inf`` before bias, penalties
and the filters, so whatever the row's parameters, the token it picks keeps
the output inside the grammar. Where ``min_tokens`` would suppress the only
tokens the grammar allows (EOS, once the grammar is complete), the grammar
wins.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Sequence
from dataclasses import dataclass, field
from typing import NamedTuple

import numpy as np
import numpy.typing as npt

from sluiceway.actors.cdf import invert
from sluiceway.actors.filters import Filters, filtered, weights
from sluiceway.actors.guide import GuideState, RowGuide
from sluiceway.actors.logprobs import reduce_rows
from sluiceway.engines.grammar import Bitmask, GrammarEngine, GrammarError, without
from sluiceway.protocol.messages import (
    ConstraintReport,
    LogprobParams,
    Row,
    SamplingParams,
    TokenLogprob,
)

FloatArray = npt.NDArray[np.float32]


@dataclass(slots=True)
class RowState:
    """What the sampler remembers about a running choice."""

    rng: np.random.Generator
    counts: dict[int, int] = field(default_factory=dict)
    prompt_ids: npt.NDArray[np.int64] | None = None
    guide: RowGuide | None = None


def row_generator(params: SamplingParams, choice: int) -> np.random.Generator:
    entropy = [params.seed, choice] if params.seed is not None else None
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


class Draw(NamedTuple):
    """How the engine picks an unadjusted row's token itself (``Row.unadjusted``):
    its filters, its one draw from its generator for this step (the generator
    stays with the :class:`Sampler`), and the logprobs to reduce, if any
    (``top``, ``token_ids``), from the raw or (``processed``) the sampled
    distribution.

    Plain values in a named tuple, not the request's ``SamplingParams`` nor
    a dataclass: a plan carries one per drawn row and step across the
    engine's pipe (as a plain tuple, ``StepPlan.__reduce__``), and the child
    builds 16 of these in ~3 µs against ~25 µs for frozen dataclasses.
    """

    temperature: float
    top_p: float
    top_k: int
    min_p: float
    uniform: float
    top: int | None = None
    token_ids: tuple[int, ...] = ()
    processed: bool = False

    @classmethod
    def of(
        cls,
        sampling: SamplingParams,
        uniform: float,
        logprobs: LogprobParams | None = None,
        processed: bool = False,
    ) -> Draw:
        top, ids = (logprobs.top, logprobs.token_ids) if logprobs is not None else (None, ())
        s = sampling
        return cls(s.temperature, s.top_p, s.top_k, s.min_p, uniform, top, ids, processed)

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0

    @property
    def logprobs(self) -> LogprobParams | None:
        """The logprobs to reduce, or None."""
        if self.top is None and not self.token_ids:
            return None
        return LogprobParams(top=self.top, token_ids=self.token_ids)


@dataclass(slots=True)
class SampleResult:
    token_ids: npt.NDArray[np.int64]
    processed: FloatArray | None
    constraints: ConstraintReport | None = None


class Sampler:
    """Per-row state plus the vectorised sampling step."""

    def __init__(self, grammars: GrammarEngine | None = None) -> None:
        self._states: dict[tuple[str, int], RowState] = {}
        self._grammars = grammars

    def __len__(self) -> int:
        return len(self._states)

    def sample(
        self,
        logits: FloatArray,
        rows: Sequence[Row],
        *,
        keep_processed: bool = False,
        live: Collection[tuple[str, int]] = (),
    ) -> SampleResult:
        """Pick one token per row (``live``: the keys of the other running
        choices, whose state stays; see :meth:`_sync_states`)."""
        states = self._sync_states(rows, live)
        plain = all(
            r.sampling.greedy and not _adjusts(r.sampling) and not r.suppress and s.guide is None
            for r, s in zip(rows, states, strict=True)
        )
        if plain:
            token_ids = logits.argmax(axis=-1).astype(np.int64)
            self._record(states, token_ids)
            return SampleResult(token_ids, logits if keep_processed else None)
        self.prepare_masks()
        processed = np.array(logits, dtype=np.float32, copy=True)
        token_ids = np.empty(len(rows), dtype=np.int64)
        together: list[tuple[int, Draw]] = []
        for i, (row, state) in enumerate(zip(rows, states, strict=True)):
            x = processed[i]
            if state.guide is not None:
                state.guide.apply(x)
            _adjust(x, row.sampling, state)
            if row.suppress:
                _suppress(x, row.suppress, guided=state.guide is not None)
            if row.sampling.greedy:
                token_ids[i] = int(x.argmax())
            elif keep_processed:  # ``draw`` leaves the row as the distribution sampled
                token_ids[i] = draw(x, row.sampling, state.rng.random(), keep=True)
            else:
                together.append((i, Draw.of(row.sampling, state.rng.random())))
        if together:  # the engine's groups (the same picks as ``draw`` row by row)
            draw_rows(processed, token_ids, together)
        self._record(states, token_ids)
        return SampleResult(
            token_ids, processed if keep_processed else None, _advance_guides(states, token_ids)
        )

    def uniforms(self, live: Collection[tuple[str, int]], drawn: Sequence[Row]) -> list[float]:
        """This step's draw of each of ``drawn`` from its generator (``live``:
        the keys of every running choice, decoded in this step or not): 0.0
        for a greedy row, which draws nothing. Exactly one number per sampled
        row and step, as :meth:`sample` takes, so a seeded choice gives the
        same tokens whether the engine or this sampler picks them."""
        self._forget(live)
        states = self._states_of(drawn)
        return [
            0.0 if r.sampling.greedy else s.rng.random() for r, s in zip(drawn, states, strict=True)
        ]

    def take(
        self,
        rows: Sequence[Row],
        token_ids: Sequence[int],
        live: Collection[tuple[str, int]] = (),
    ) -> ConstraintReport | None:
        """Take the tokens the engine picked in a greedy step (each guided
        row's among what :meth:`allowed` gave it): advance the guides.

        No counts are recorded: only penalties read them, and a row with
        penalties never takes a greedy step.
        """
        states = self._sync_states(rows, live)
        return _advance_guides(states, np.asarray(token_ids, dtype=np.int64))

    def allowed(self, rows: Sequence[Row]) -> list[Bitmask] | None:
        """What each of ``rows`` (guided, greedy, not first) may pick next,
        as the sampler would mask it (the grammar, then ``suppress`` unless
        that leaves nothing); None when a row has no mask ready (its guide
        failed or ended, or :meth:`prepare_masks` has not run)."""
        if self._grammars is None:
            return None
        masks = []
        for row in rows:
            state = self._states.get(row.key)
            guide = state.guide if state is not None else None
            mask = guide.allowed(self._grammars.vocab_size) if guide is not None else None
            if mask is None:
                return None
            if row.suppress:
                narrowed = without(mask, row.suppress)
                mask = narrowed if narrowed.any() else mask
            masks.append(mask)
        return masks

    def prepare_masks(self) -> None:
        """Compute the mask of every constrained row that needs one for its
        next token (blocking, the GIL released; the sampler actor runs it
        while the engine computes the next step)."""
        if self._grammars is None:
            return
        waiting = [
            (state.guide, matcher)
            for state in self._states.values()
            if state.guide is not None and (matcher := state.guide.wants_mask()) is not None
        ]
        if not waiting:
            return
        masks = self._grammars.new_masks(len(waiting))
        self._grammars.fill_masks([matcher for _, matcher in waiting], masks)
        for (guide, _), mask in zip(waiting, masks, strict=True):
            guide.take_mask(mask)

    def masks_due(self) -> bool:
        """Whether a constrained row waits for its next mask."""
        return any(
            state.guide is not None and state.guide.wants_mask() is not None
            for state in self._states.values()
        )

    def _sync_states(
        self, rows: Sequence[Row], live: Collection[tuple[str, int]]
    ) -> list[RowState]:
        """The rows' states, after forgetting every choice that is neither
        among them nor in ``live``. A running choice can be missing from a
        step (its first token drawn in a step whose outcome is not back
        yet), so the caller names every running one: forgetting such a
        choice would restart its seeded stream."""
        self._forget({row.key for row in rows}.union(live))
        return self._states_of(rows)

    def _forget(self, live: Collection[tuple[str, int]]) -> None:
        # The scheduler names every running choice (those out of this step
        # included: paused, being prefilled back, first token in flight), so
        # any other has finished and its state can go.
        for key in [key for key in self._states if key not in live]:
            del self._states[key]

    def _states_of(self, rows: Sequence[Row]) -> list[RowState]:
        states = []
        for row in rows:
            state = self._states.get(row.key)
            if state is None or row.first:
                state = RowState(rng=row_generator(row.sampling, row.choice))
                if row.sampling.repetition_penalty != 1.0:
                    state.prompt_ids = np.unique(np.asarray(row.prompt_ids, dtype=np.int64))
                if row.constraint is not None:
                    state.guide = self._guide(row)
                self._states[row.key] = state
            states.append(state)
        return states

    def _guide(self, row: Row) -> RowGuide:
        constraint = row.constraint
        assert constraint is not None
        if self._grammars is None:
            return RowGuide.failed("this server runs no grammar engine")
        try:
            grammar = self._grammars.compile(constraint)
        except GrammarError as error:
            return RowGuide.failed(str(error))
        return RowGuide.start(grammar.matcher(), constraint.reasoning, self._grammars.eos_ids)

    @staticmethod
    def _record(states: Sequence[RowState], token_ids: npt.NDArray[np.int64]) -> None:
        for state, token in zip(states, token_ids.tolist(), strict=True):
            state.counts[token] = state.counts.get(token, 0) + 1


def _advance_guides(
    states: Sequence[RowState], token_ids: npt.NDArray[np.int64]
) -> ConstraintReport | None:
    """Feed each constrained row its token; report the rows that completed or failed."""
    complete: set[int] = set()
    failed: list[tuple[int, str]] = []
    guided = False
    for i, (state, token) in enumerate(zip(states, token_ids.tolist(), strict=True)):
        guide = state.guide
        if guide is None:
            continue
        guided = True
        if guide.state is not GuideState.FAILED:
            guide.advance(token)
        if guide.state is GuideState.FAILED:
            failed.append((i, guide.error))
        elif guide.state is GuideState.COMPLETE:
            complete.add(i)
    if not guided:
        return None
    return ConstraintReport(complete=frozenset(complete), failed=tuple(failed))


def _suppress(x: FloatArray, ids: tuple[int, ...], *, guided: bool) -> None:
    """Suppress ``ids`` (before ``min_tokens``), unless a grammar allows nothing else."""
    index = np.asarray(ids, dtype=np.int64)
    if not guided:
        x[index] = -np.inf
        return
    kept = x[index].copy()
    x[index] = -np.inf
    if x.max() == -np.inf:
        x[index] = kept


def _adjusts(params: SamplingParams) -> bool:
    return bool(params.logit_bias) or params.penalised


def _adjust(x: FloatArray, params: SamplingParams, state: RowState) -> None:
    """Logit bias and penalties, in place, on one row."""
    if params.logit_bias:
        ids = np.fromiter((t for t, _ in params.logit_bias), dtype=np.int64)
        x[ids] += np.fromiter((b for _, b in params.logit_bias), dtype=np.float32)
    if not params.penalised or not (state.counts or state.prompt_ids is not None):
        return
    seen = np.fromiter(state.counts.keys(), dtype=np.int64, count=len(state.counts))
    times = np.fromiter(state.counts.values(), dtype=np.float32, count=len(state.counts))
    if params.repetition_penalty != 1.0:
        penalised = seen if state.prompt_ids is None else np.union1d(seen, state.prompt_ids)
        values = x[penalised]
        x[penalised] = np.where(
            values > 0, values / params.repetition_penalty, values * params.repetition_penalty
        )
    if seen.size:
        x[seen] -= params.frequency_penalty * times + params.presence_penalty


def draw(x: FloatArray, params: Filters, uniform: float, *, keep: bool) -> int:
    """Sample one id from one row of adjusted logits by inverting its
    cumulative distribution at ``uniform`` (the row's one draw from its
    generator for this step, in [0, 1)). ``x`` is modified in place; with
    ``keep``, left as the log-distribution sampled from.

    The draw comes in as a number so that the engine can sample a row where
    its logits are (:func:`draw_rows`) while the generator stays here. The
    arithmetic is a group of one (:func:`draw_together`): a row picks the
    same id alone as beside others."""
    x /= np.float32(params.temperature)
    shaped, _ = weights(x[None, :], [params])
    if keep:  # the processed row as a true log-distribution, for --logprobs-mode processed
        probs = shaped[0]
        total = probs.sum(dtype=np.float64)
        with np.errstate(divide="ignore"):
            x[:] = np.log(probs / total)
    return _picks(shaped, np.array([uniform]))[0]


def _picks(shaped: FloatArray, uniforms: npt.NDArray[np.float64]) -> list[int]:
    """Where each row's draw falls in its weights; the argmax of a row whose
    total is not a positive finite number (NaN logits, or every logit -inf)."""
    picked, totals = invert(shaped, uniforms)
    picks: list[int] = picked.tolist()
    for i in np.flatnonzero(~(np.isfinite(totals) & (totals > 0))).tolist():
        picks[i] = int(shaped[i].argmax())
    return picks


def _grouped(spec: Draw) -> bool:
    """A sampled row whose sampled distribution nobody reads (not processed
    logprobs, which :func:`draw` leaves in the row)."""
    return not spec.greedy and not (spec.processed and spec.logprobs is not None)


def draw_together(logits: FloatArray, rows: Sequence[int], draws: Sequence[Draw]) -> list[int]:
    """:func:`draw` of several rows (``_grouped``) at once, each with its own
    filters and draw; ``logits`` is not touched.

    The same arithmetic, element by element, in a handful of NumPy calls for
    the group instead of a handful per row: per row those calls were most
    of a step's picks at batch 16, and a row with ``top_p`` (the setting
    clients send most) sorted alone cost ~120 µs of a default-model step.
    """
    return _Group.drawn(logits, rows, draws).picks


@dataclass(slots=True)
class _Group:
    """Rows drawn together, with what their draw computed."""

    picks: list[int]
    #: Each row's weights (:func:`~sluiceway.actors.filters.weights`).
    weights: FloatArray
    peaks: FloatArray

    @classmethod
    def drawn(cls, logits: FloatArray, rows: Sequence[int], draws: Sequence[Draw]) -> _Group:
        # A copy (the logits stay as they were), in float32 as ``draw`` computes.
        x = logits[list(rows)].astype(np.float32, copy=False)
        x /= np.array([d.temperature for d in draws], dtype=np.float32)[:, None]
        shaped, peaks = weights(x, draws)
        return cls(_picks(shaped, np.array([d.uniform for d in draws])), shaped, peaks)

    def normalisers(self, draws: Sequence[Draw]) -> npt.NDArray[np.float32]:
        """Each row's :func:`~sluiceway.actors.logprobs.log_normaliser`, from
        the weights already taken: the same float32 operations, for a row
        whose temperature is 1 (its tempered logits are its logits), that no
        filter shaped, and whose peak is finite; NaN for the others."""
        with np.errstate(divide="ignore", invalid="ignore"):
            normalisers = np.log(self.weights.sum(axis=1)) + self.peaks
        vocab = self.weights.shape[1]
        plain = [d.temperature == 1.0 and not filtered(d, vocab) for d in draws]
        usable = np.isfinite(self.peaks) & np.array(plain, dtype=bool)
        return np.where(usable, normalisers, np.float32(np.nan))


#: A group of rows drawn together holds at most this many logits (256 KB of
#: float32, their float64 sums twice that: a core's cache). Wider rows are
#: drawn one by one: at 16 rows of a 152k vocabulary a group took twice as
#: long as the rows alone, its sums spilling out of the cache.
GROUP_LOGITS = 1 << 16


def _draw_groups(
    logits: FloatArray, picks: npt.NDArray[np.int64], draws: Sequence[tuple[int, Draw]]
) -> tuple[set[int], dict[int, float]]:
    """Draw the sampled rows that fit in groups (:data:`GROUP_LOGITS`);
    the rows drawn, and the log-normalisers of those that ask for logprobs
    and whose draw computed it (``_Group.normalisers``)."""
    vocab = logits.shape[-1]
    size = GROUP_LOGITS // max(vocab, 1)
    normalisers: dict[int, float] = {}
    if size < 2:
        return set(), normalisers
    together = [(index, spec) for index, spec in draws if _grouped(spec)]
    # Shared only from float32 logits: ``reduce_rows`` computes in the logits' dtype.
    share = logits.dtype == np.float32
    for start in range(0, len(together), size):
        chunk = together[start : start + size]
        rows = [index for index, _ in chunk]
        specs = [spec for _, spec in chunk]
        group = _Group.drawn(logits, rows, specs)
        picks[rows] = group.picks
        if share and any(spec.top is not None or spec.token_ids for spec in specs):
            normalisers.update(zip(rows, group.normalisers(specs).tolist(), strict=True))
    return {index for index, _ in together}, normalisers


def draw_rows(
    logits: FloatArray, picks: npt.NDArray[np.int64], draws: Sequence[tuple[int, Draw]]
) -> list[TokenLogprob | None] | None:
    """Pick the drawn rows of a step where its logits are: ``draws`` are
    (row index, draw) pairs; ``picks`` (every row's argmax) is overwritten at
    the sampled rows. Returns each row's logprobs (None where a row asked for
    none), or None when no row asked. The same arithmetic as
    :meth:`Sampler.sample` and ``reduce_rows``, so the tokens and logprobs
    are the ones the sampler would have made."""
    grouped, normalisers = _draw_groups(logits, picks, draws)
    processed: dict[int, FloatArray] = {}
    scored: list[int] = []
    params: list[LogprobParams] = []
    for index, spec in draws:
        asked = spec.logprobs
        if not spec.greedy and index not in grouped:
            x = np.array(logits[index], dtype=np.float32, copy=True)
            keep = spec.processed and asked is not None
            picks[index] = draw(x, spec, spec.uniform, keep=keep)
            if keep:
                processed[index] = x
        if asked is not None:
            scored.append(index)
            params.append(asked)
    if not scored:
        return None
    # One gather of the rows that asked (a row per call cost ~4 µs at batch 16).
    sources = logits[scored]
    if processed:  # float32 rows among the logits, promoted as ``np.stack`` would
        sources = sources.astype(np.result_type(sources.dtype, np.float32), copy=False)
    for local, index in enumerate(scored):
        if index in processed:
            sources[local] = processed[index]
    known = [normalisers.get(index, math.nan) for index in scored]
    reduced = reduce_rows(
        sources,
        picks[scored].tolist(),
        params,
        normalisers=None if any(math.isnan(n) for n in known) else np.array(known, np.float32),
    )
    result: list[TokenLogprob | None] = [None] * len(picks)
    for index, logprob in zip(scored, reduced, strict=True):
        result[index] = logprob
    return result
