"""vLLM's engine (``AsyncLLM``) as an engine that schedules itself.

Theory of operation. Our own engines are model runners that the scheduler
plans step by step; vLLM plans its own steps (paged KV cache, prefix caching,
continuous batching, tensor, pipeline and data parallelism). This module is
the pure part of running it, with no vLLM import at module level (the main
environment has no vLLM; ``make test-vllm`` builds one that does):

- :func:`engine_args`: our flags as vLLM's engine arguments.
- :func:`worker_threads`: the CPU threads each of vLLM's workers computes on
  where vLLM leaves that count to torch.
- :func:`sampling_fields`: one choice of a neutral :class:`GenerationRequest`
  as the fields of vLLM's ``SamplingParams``; a field vLLM cannot honour
  exactly is refused by name (:class:`InvalidRequest`, a 400), never served
  differently.
- :func:`lark_grammar`: a constraint as the same llguidance grammar our
  sampler would compile, in Lark, for vLLM's ``guidance`` backend (the
  reasoning gate becomes part of the grammar).
- :func:`token_samples`, :func:`prompt_scores`: vLLM's outputs back as our
  token events (ids, logprob entries, finish causes).
- :class:`VllmEngine`: the loaded ``AsyncLLM`` with its :class:`EngineInfo`.

Each choice of a request is its own vLLM request (``n`` = 1): a stop string,
which stays ours (our matcher keeps its holdback and the alignment), ends one
choice by aborting its vLLM request, and vLLM's prefix cache shares the
prompt between the choices. A seeded choice ``i`` runs with seed
``seed + i``, so that choices differ and a request with the same seed gives
the same choices again (not the tokens our sampler would draw).

Stop tokens: EOS is handed to vLLM as one more stop token id (with vLLM's
own EOS handling off), so that our tokenizer's EOS ids, not the generation
config's, end a choice, and the finish cause is read off the last token as
the scheduler does (EOS before a stop token before ``max_tokens``).
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from sluiceway.engines.base import EngineInfo
from sluiceway.engines.grammar import lark_json, lark_regex
from sluiceway.engines.loader import ModelSource
from sluiceway.protocol.constraints import Constraint, ConstraintKind, ReasoningGate
from sluiceway.protocol.errors import InvalidRequest
from sluiceway.protocol.messages import (
    FinishCause,
    GenerationRequest,
    PromptScores,
    TokenLogprob,
    TokenSample,
)

logger = logging.getLogger(__name__)

#: Where ``--distributed-executor-backend`` may point (vLLM's names).
EXECUTOR_BACKENDS = ("auto", "mp", "ray", "uni", "external_launcher")

#: Engine arguments the server sets itself; ``--vllm-engine-args`` may not.
OWN_ARGS = frozenset(
    {
        "model",
        "tokenizer",
        "max_num_seqs",
        "max_logprobs",
        "logprobs_mode",
        "enable_prefix_caching",
        "structured_outputs_config",
        "disable_log_stats",
        "skip_tokenizer_init",
    }
)

#: vLLM's largest ``logprob_token_ids`` (``vllm.sampling_params.MAX_LOGPROB_TOKEN_IDS``).
MAX_LOGPROB_TOKEN_IDS = 128

_SEED_SPACE = 2**63


@dataclass(frozen=True, slots=True, kw_only=True)
class VllmOptions:
    """vLLM's engine arguments that the CLI passes through (None: vLLM's default)."""

    tensor_parallel_size: int = 1
    pipeline_parallel_size: int = 1
    data_parallel_size: int = 1
    distributed_executor_backend: str = "auto"
    gpu_memory_utilization: float | None = None
    max_model_len: int | None = None
    enforce_eager: bool = False
    quantization: str | None = None
    #: Any other engine arguments, by vLLM's field names (``--vllm-engine-args``).
    extra: Mapping[str, Any] = field(default_factory=dict)


def parse_extra_args(text: str | None) -> dict[str, Any]:
    """``--vllm-engine-args``: a JSON object of engine arguments (raises ValueError)."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as error:
        raise ValueError(f"vllm_engine_args is not JSON: {error}") from error
    if not isinstance(value, dict):
        raise ValueError("vllm_engine_args must be a JSON object")
    taken = sorted(OWN_ARGS & value.keys())
    if taken:
        raise ValueError(
            f"vllm_engine_args may not set {', '.join(taken)}: sluiceway sets them from its own flags"
        )
    return value


def engine_args(
    model: str,
    options: VllmOptions,
    *,
    dtype: str,
    max_num_seqs: int,
    max_top_logprobs: int,
    logprobs_mode: str,
    prefix_cache: bool,
) -> dict[str, Any]:
    """The keyword arguments of vLLM's ``AsyncEngineArgs``."""
    args: dict[str, Any] = {
        "model": model,
        "dtype": dtype,
        "max_num_seqs": max_num_seqs,
        # Our top_logprobs limit, and logprob_token_ids's, whichever is more.
        "max_logprobs": max(max_top_logprobs, MAX_LOGPROB_TOKEN_IDS),
        "logprobs_mode": "processed_logprobs" if logprobs_mode == "processed" else "raw_logprobs",
        "enable_prefix_caching": prefix_cache,
        # Our grammars are llguidance's; its backend takes them as they are.
        "structured_outputs_config": {"backend": "guidance"},
        # The load figures (/metrics, /v1/loads) come from vLLM's stats.
        "disable_log_stats": False,
        "tensor_parallel_size": options.tensor_parallel_size,
        "pipeline_parallel_size": options.pipeline_parallel_size,
        "data_parallel_size": options.data_parallel_size,
        "enforce_eager": options.enforce_eager,
    }
    if options.distributed_executor_backend != "auto":
        args["distributed_executor_backend"] = options.distributed_executor_backend
    if options.gpu_memory_utilization is not None:
        args["gpu_memory_utilization"] = options.gpu_memory_utilization
    if options.max_model_len is not None:
        args["max_model_len"] = options.max_model_len
    if options.quantization is not None:
        args["quantization"] = options.quantization
    return {**args, **options.extra}


#: vLLM's variable for binding its CPU workers' threads (its default: ``auto``).
BIND_VARIABLE = "VLLM_CPU_OMP_THREADS_BIND"


def worker_threads(
    environ: Mapping[str, str], *, cpus: int, workers: int, requested: int, on_cpu: bool
) -> int | None:
    """The OpenMP threads each of vLLM's CPU workers gets (``OMP_NUM_THREADS``,
    which the workers read as they start), or None where the count is not
    ours to give.

    vLLM binding its threads (``VLLM_CPU_OMP_THREADS_BIND`` ``auto`` or a
    core list) sizes them itself, keeping a core per worker free for its
    engine core process and the API process. With ``nobind`` (what a small
    or shared host needs: the binding fails there) it sets no count, and
    torch spreads each worker over every core. Its idle threads then spin on
    the cores that the engine core, which plans every step, and our event
    loop, which streams every token, need; so the same reservation is kept
    here: ``requested`` (``--engine-threads``) if given, else
    ``OMP_NUM_THREADS`` if set, else the cores left after one per worker.
    A GPU's workers size their own threads."""
    if not on_cpu or environ.get(BIND_VARIABLE, "auto") != "nobind":
        return None
    if requested > 0:
        return requested
    given = environ.get("OMP_NUM_THREADS", "")
    if given:
        return int(given) if given.isdigit() and int(given) > 0 else None
    return max(1, (cpus - workers) // workers)


def engine_prompt(prompt_ids: Sequence[int]) -> dict[str, Any]:
    """Our prompt ids as vLLM's rendered token input (``vllm.inputs.engine.
    TokensInput``). vLLM takes that as it is, on the event loop; a bare
    ``{"prompt_token_ids": ...}`` is a raw prompt to render, which it sends
    through its renderer's thread pool first: a thread hop per request, and
    requests that arrive together wait for one another there."""
    return {"type": "token", "prompt_token_ids": list(prompt_ids)}


# --- requests -----------------------------------------------------------------


def sampling_fields(
    request: GenerationRequest,
    choice: int,
    *,
    eos_ids: Collection[int],
    logprobs_mode: str = "raw",
    grammar: str | None = None,
) -> dict[str, Any]:
    """The ``SamplingParams`` fields of choice ``choice`` of ``request``
    (``grammar``: the constraint's Lark text, :func:`lark_grammar`).

    Raises :class:`InvalidRequest` naming a field vLLM cannot honour."""
    refuse_unhonoured(request, logprobs_mode)
    sampling, limits, logprobs = request.sampling, request.limits, request.logprobs
    stops = set(limits.stop_token_ids)
    if not limits.ignore_eos:
        stops |= set(eos_ids)
    fields: dict[str, Any] = {
        "n": 1,
        "temperature": sampling.temperature,
        "top_p": sampling.top_p,
        "top_k": sampling.top_k,
        "min_p": sampling.min_p,
        "seed": None if sampling.seed is None else (sampling.seed + choice) % _SEED_SPACE,
        "presence_penalty": sampling.presence_penalty,
        "frequency_penalty": sampling.frequency_penalty,
        "repetition_penalty": sampling.repetition_penalty,
        "logit_bias": dict(sampling.logit_bias) or None,
        "max_tokens": limits.max_tokens,
        "min_tokens": limits.min_tokens,
        "stop_token_ids": sorted(stops),
        # EOS is among the stop ids above (or ignored); vLLM's own would
        # add the generation config's EOS ids, which are not ours.
        "ignore_eos": True,
        # Text is ours: the detokenizer, stop strings and parsers run here.
        "detokenize": False,
        "skip_special_tokens": False,
    }
    if logprobs.token_ids:
        fields["logprob_token_ids"] = list(logprobs.token_ids)
    elif logprobs.top is not None:
        fields["logprobs"] = logprobs.top
    if logprobs.prompt_top is not None and choice == 0:
        fields["prompt_logprobs"] = logprobs.prompt_top
    if grammar is not None:
        fields["structured_outputs"] = {"grammar": grammar}
    return fields


def refuse_unhonoured(request: GenerationRequest, logprobs_mode: str) -> None:
    """Refuse, by name, what vLLM would answer differently from our engines."""
    logprobs = request.logprobs
    if logprobs.token_ids and logprobs.top:
        # vLLM returns either the top k or the named ids' logprobs, not both.
        raise InvalidRequest(
            "logprob_token_ids cannot be combined with top_logprobs on --engine vllm",
            param="logprob_token_ids",
        )
    if len(logprobs.token_ids) > MAX_LOGPROB_TOKEN_IDS:
        raise InvalidRequest(
            f"logprob_token_ids takes at most {MAX_LOGPROB_TOKEN_IDS} ids on --engine vllm",
            param="logprob_token_ids",
        )
    if request.constraint is not None and logprobs.per_token and logprobs_mode == "raw":
        # vLLM applies the grammar's mask before it takes logprobs, so its
        # "raw" logprobs of a constrained choice are the masked
        # distribution; ours are the model's own.
        raise InvalidRequest(
            "logprobs of structured output are the masked distribution on --engine vllm; "
            "serve with --logprobs-mode processed to ask for them",
            param="logprobs",
        )


def lark_grammar(constraint: Constraint) -> str:
    """The Lark grammar of ``constraint`` for vLLM's ``guidance`` backend:
    what our grammar engine compiles (JSON on one line, as
    ``grammar.JSON_OPTIONS`` says), with the reasoning gate in front."""
    kind, text = constraint.kind, constraint.text
    if kind is ConstraintKind.GRAMMAR:
        if constraint.reasoning is None:
            return text
        # The grammar's own start rule becomes the body behind the gate.
        return f"start: {_gate(constraint.reasoning)}{_BODY}\n{rename_start(text)}\n"
    if kind is ConstraintKind.JSON_OBJECT:
        body = lark_json({"type": "object"})
    elif kind is ConstraintKind.JSON_SCHEMA:
        schema = json.loads(text)
        if not isinstance(schema, dict):
            raise InvalidRequest("a JSON schema must be an object", param="response_format")
        body = lark_json(schema)
    elif kind is ConstraintKind.REGEX:
        body = lark_regex(text)
    else:
        options = json.loads(text)
        body = " | ".join(json.dumps(option) for option in options)
    return f"start: {_gate(constraint.reasoning)}{_BODY}\n{_BODY}: {body}\n"


#: The rule the constrained text is, behind the reasoning gate.
_BODY = "sluiceway_body"


def rename_start(lark: str) -> str:
    """``lark`` with its rule ``start`` named :data:`_BODY`: every ``start``
    that is a whole identifier outside string literals and regexes."""
    out: list[str] = []
    i, n = 0, len(lark)
    while i < n:
        char = lark[i]
        if lark.startswith("//", i):  # a comment, to the end of its line
            end = lark.find("\n", i)
            end = n if end < 0 else end
            out.append(lark[i:end])
            i = end
        elif char in '"/':
            end = _literal_end(lark, i)
            out.append(lark[i:end])
            i = end
        elif char.isalnum() or char == "_":
            end = i
            while end < n and (lark[end].isalnum() or lark[end] == "_"):
                end += 1
            word = lark[i:end]
            out.append(_BODY if word == "start" else word)
            i = end
        else:
            out.append(char)
            i += 1
    return "".join(out)


def _literal_end(text: str, start: int) -> int:
    """Where the string literal or regex opening at ``start`` ends (its
    closing quote or slash, and a regex's flags, included)."""
    quote, i = text[start], start + 1
    while i < len(text) and text[i] != quote:
        i += 2 if text[i] == "\\" else 1
    i += 1
    while quote == "/" and i < len(text) and text[i].isalpha():
        i += 1
    return min(i, len(text))


def _gate(gate: ReasoningGate | None) -> str:
    """The reasoning section before the constrained text: any token but the
    end marker, then the end marker (``guide.RowGuide``'s states, as grammar)."""
    if gate is None:
        return ""
    free = f"<[^{gate.end_id}]>* <[{gate.end_id}]> "
    if gate.inside:
        return free
    if gate.start_id is None:
        return ""
    return f"(<[{gate.start_id}]> {free})? "


# --- outputs ------------------------------------------------------------------


def finish_cause(
    token: int, reason: str | None, *, eos_ids: Collection[int], request: GenerationRequest
) -> FinishCause | None:
    """Why a choice ended at ``token``, read as the scheduler reads it
    (``reason``: vLLM's ``finish_reason``, None while it runs)."""
    if reason is None:
        return None
    limits = request.limits
    if token in eos_ids and not limits.ignore_eos:
        return FinishCause.EOS
    if token in limits.stop_token_ids:
        return FinishCause.STOP_TOKEN
    if reason == "length":
        return FinishCause.MAX_TOKENS
    if reason == "stop" and request.constraint is not None:
        # vLLM ended it ("stop") on no stop token of ours: under a
        # constraint only the grammar can have. (Seen here: vLLM lets a
        # complete grammar allow EOS alone, and the model picks it, above.)
        return FinishCause.GRAMMAR
    # An abort (ours: a stop string, a cancel) is not a finish here.
    return None


def token_logprob(
    token: int, position: Mapping[int, Any], request: GenerationRequest
) -> TokenLogprob:
    """One generated token's vLLM logprobs (``{id: Logprob}``: the token, and
    the top k or the named ids) as our reduced entry."""
    chosen = position[token].logprob
    asked = request.logprobs
    if asked.token_ids:
        requested = tuple((i, float(position[i].logprob)) for i in asked.token_ids)
        return TokenLogprob(float(chosen), (), requested)
    top_k = asked.top or 0
    ranked = sorted(
        (entry.rank, i, float(entry.logprob))
        for i, entry in position.items()
        if entry.rank is not None and entry.rank <= top_k
    )
    return TokenLogprob(float(chosen), tuple((i, lp) for _, i, lp in ranked[:top_k]))


def token_samples(
    output: Any,
    choice: int,
    request: GenerationRequest,
    *,
    eos_ids: Collection[int],
) -> list[TokenSample]:
    """The new tokens of one vLLM ``CompletionOutput`` delta as our samples;
    the last one carries the finish cause when the choice ended."""
    ids: Sequence[int] = output.token_ids
    entries: Sequence[Mapping[int, Any]] | None = output.logprobs
    want = request.logprobs.per_token
    samples = []
    for k, token in enumerate(ids):
        last = k == len(ids) - 1
        cause = (
            finish_cause(token, output.finish_reason, eos_ids=eos_ids, request=request)
            if last
            else None
        )
        entry = token_logprob(token, entries[k], request) if want and entries else None
        samples.append(TokenSample(choice=choice, token_id=token, logprob=entry, finish=cause))
    return samples


def prompt_scores(
    positions: Sequence[Mapping[int, Any] | None], prompt_ids: Sequence[int], top: int
) -> PromptScores:
    """vLLM's ``prompt_logprobs`` (None for the first token) as our scores."""
    entries: list[TokenLogprob | None] = []
    for token, position in zip(prompt_ids, positions, strict=True):
        if position is None:
            entries.append(None)
            continue
        own = position[token]
        ranked = sorted(
            (entry.rank, i, float(entry.logprob))
            for i, entry in position.items()
            if entry.rank is not None and entry.rank <= top
        )
        entries.append(
            TokenLogprob(
                float(own.logprob), tuple((i, lp) for _, i, lp in ranked[:top]), rank=own.rank
            )
        )
    return PromptScores(entries=tuple(entries))


# --- the engine -----------------------------------------------------------------


class VllmEngine:
    """A loaded ``AsyncLLM`` and what the server reports of it.

    Built on the engine thread (the engine core starts in its own process
    and loads the model: a minute on a small CPU); the request streams run
    on the server's event loop (asyncio only: ``AsyncLLM`` is asyncio code).
    """

    def __init__(
        self, source: ModelSource, args: Mapping[str, Any], device: str, *, threads: int = 0
    ) -> None:
        self.source = source
        self._args = dict(args)
        self._device = device
        #: ``--engine-threads`` (0: see :func:`worker_threads`).
        self._requested_threads = threads
        #: The stats logger's latest figures (``actors.vllm_runner`` reads them).
        self.stats: Any = None
        #: Given every record vLLM's stats logger gets: its scheduler's and its
        #: iteration's figures (either may be None), to sum what comes per step.
        self.on_stats: Callable[[Any, Any], None] | None = None
        self.llm: Any = None
        self.info = self._start()

    def _start(self) -> EngineInfo:
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        started = time.perf_counter()
        threads = self._size_workers()
        self.llm = AsyncLLM.from_engine_args(
            AsyncEngineArgs(**self._args), stat_loggers=[self._stats_logger()]
        )
        config = self.llm.vllm_config
        model = config.model_config
        cache = config.cache_config
        info = EngineInfo(
            name="vllm",
            device=self._device,
            dtype=str(model.dtype).removeprefix("torch."),
            vocab_size=int(model.get_vocab_size()),
            max_context=int(model.max_model_len),
            threads=threads or 0,
        )
        blocks = cache.num_gpu_blocks or 0
        #: The most tokens vLLM's KV cache holds (its blocks of ``block_size``).
        self.kv_capacity_tokens = int(blocks) * int(cache.block_size)
        logger.info(
            "vLLM engine ready in %.1f s: %d KV tokens, %s",
            time.perf_counter() - started,
            self.kv_capacity_tokens,
            info.dtype,
        )
        return info

    def _size_workers(self) -> int | None:
        """Give vLLM's CPU workers their thread count (:func:`worker_threads`)
        through the environment they start with."""
        from vllm.platforms import current_platform

        args = self._args
        workers = 1
        for name in ("tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size"):
            workers *= int(args.get(name) or 1)
        on_cpu = bool(current_platform.is_cpu())
        threads = worker_threads(
            os.environ,
            cpus=len(os.sched_getaffinity(0)),
            workers=workers,
            requested=self._requested_threads,
            on_cpu=on_cpu,
        )
        if threads is None:
            if self._requested_threads:
                why = "vLLM binds its threads" if on_cpu else "vLLM does not run on the CPU"
                logger.warning("--engine-threads is ignored: %s", why)
            return None
        os.environ["OMP_NUM_THREADS"] = str(threads)
        logger.info("vLLM's CPU workers compute on %d thread(s) each", threads)
        return threads

    def _stats_logger(self) -> Any:
        from vllm.v1.metrics.loggers import StatLoggerBase

        engine = self

        class _Latest(StatLoggerBase):  # type: ignore[misc]
            """Keeps vLLM's latest scheduler figures for our gauges."""

            def __init__(self, vllm_config: Any, engine_index: int = 0) -> None:
                pass

            def record(
                self,
                scheduler_stats: Any,
                iteration_stats: Any,
                mm_cache_stats: Any = None,
                engine_idx: int = 0,
            ) -> None:
                if scheduler_stats is not None:
                    engine.stats = scheduler_stats
                if engine.on_stats is not None:
                    engine.on_stats(scheduler_stats, iteration_stats)

            def log_engine_initialized(self) -> None:
                pass

        return _Latest

    @property
    def alive(self) -> bool:
        return self.llm is not None and not self.llm.errored

    def restart(self) -> None:
        """Shut the lost engine down and start a new one (blocking)."""
        self.close()
        self.stats = None
        self.info = self._start()

    def close(self) -> None:
        llm, self.llm = self.llm, None
        if llm is not None:
            llm.shutdown()
