"""The model's tokenizer: chat template rendering, encoding, and the exact
bytes of every token id (the ``TokenTable`` the detokenizer and the logprob
entries use)."""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from sluiceway.protocol.tokens import TokenTable

_BYTE_FALLBACK = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@cache
def _byte_level_alphabet() -> dict[str, int]:
    """The byte-level BPE alphabet: printable bytes stand for themselves, the
    rest are shifted past 255 so that every byte is a visible character."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars: dict[str, int] = {chr(b): b for b in printable}
    shift = 0
    for byte in range(256):
        if byte not in printable:
            chars[chr(256 + shift)] = byte
            shift += 1
    return chars


def _decoder_kinds(decoder: Mapping[str, Any] | None) -> set[str]:
    if not decoder:
        return set()
    kinds = {str(decoder.get("type"))}
    for inner in decoder.get("decoders") or ():
        kinds |= _decoder_kinds(inner)
    return kinds


def _strips_first_space(decoder: Mapping[str, Any] | None) -> bool:
    if not decoder:
        return False
    if decoder.get("type") == "Strip":
        return int(decoder.get("start", 0)) > 0
    if decoder.get("type") == "Metaspace":
        return bool(
            decoder.get("prepend_scheme", "always") != "never"
            and decoder.get("add_prefix_space", True)
        )
    return any(_strips_first_space(inner) for inner in decoder.get("decoders") or ())


def _piece_bytes(piece: str, kinds: set[str]) -> bytes:
    if "ByteLevel" in kinds:
        alphabet = _byte_level_alphabet()
        if all(char in alphabet for char in piece):
            return bytes(alphabet[char] for char in piece)
        return piece.encode("utf-8")
    if "ByteFallback" in kinds and (found := _BYTE_FALLBACK.match(piece)):
        return bytes([int(found.group(1), 16)])
    if kinds & {"Metaspace", "Replace"}:
        return piece.replace("\u2581", " ").encode("utf-8")
    if "WordPiece" in kinds and piece.startswith("##"):
        return piece[2:].encode("utf-8")
    return piece.encode("utf-8")


def build_token_table(tokenizer_json: Mapping[str, Any], vocab_size: int) -> TokenTable:
    """Build the id -> bytes table from a ``tokenizer.json`` document.

    Added tokens are literal text; regular vocabulary pieces are decoded the
    way the tokenizer's decoder would (byte-level alphabet, byte fallback,
    metaspace). Ids past the vocabulary (padding rows of the embedding) are
    empty.
    """
    decoder = tokenizer_json.get("decoder")
    kinds = _decoder_kinds(decoder)
    model = tokenizer_json.get("model") or {}
    vocab: Mapping[str, int] = model.get("vocab") or {}
    if isinstance(vocab, list):  # Unigram: [[piece, score], ...]
        vocab = {entry[0]: index for index, entry in enumerate(vocab)}
    size = max([vocab_size, *(i + 1 for i in vocab.values())])
    raw: list[bytes] = [b""] * size
    for piece, index in vocab.items():
        raw[index] = _piece_bytes(piece, kinds)
    hidden: set[int] = set()
    for added in tokenizer_json.get("added_tokens") or ():
        index = int(added["id"])
        if index >= len(raw):
            raw.extend([b""] * (index + 1 - len(raw)))
        raw[index] = str(added["content"]).encode("utf-8")
        if added.get("special"):
            hidden.add(index)
    return TokenTable(tuple(raw), frozenset(hidden), _strips_first_space(decoder))


@dataclass(frozen=True, slots=True)
class ChatRender:
    """A rendered chat prompt and the assistant prefix the template added."""

    text: str
    assistant_prefix: str


#: The conversation the generation prefix is measured on.
_PROBE = ({"role": "user", "content": "hi"},)


class ChatTemplate:
    """The model's chat template, rendered the one way the server renders
    it: transformers' ``apply_chat_template`` on the model's tokenizer
    (special tokens such as ``bos_token`` are in scope, as the template's
    authors expect). Prompts and parser detection both render through it."""

    def __init__(self, hf: Any, template: str | None = None) -> None:
        """``template`` overrides the tokenizer's own (None: use its own)."""
        self._hf = hf
        self._override = template
        self.source: str | None = template or getattr(hf, "chat_template", None)

    def render(
        self,
        messages: Sequence[Mapping[str, Any]],
        *,
        tools: Sequence[Mapping[str, Any]] | None = None,
        template_kwargs: Mapping[str, Any] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
    ) -> ChatRender:
        """Render a conversation with the generation prompt appended.

        The assistant prefix is what rendering with the generation prompt adds
        over rendering without it; parsers are primed with it (it tells, for
        instance, whether the template already opened ``<think>``). Without
        the generation prompt, or when the final message is left open for the
        model to continue (``continue_final_message``), there is none.
        """
        if not self.source:
            raise ValueError("this model has no chat template; use /v1/completions")
        kwargs = dict(template_kwargs or {})
        if continue_final_message or not add_generation_prompt:
            return ChatRender(
                self._apply(messages, tools, False, kwargs, continue_final_message), ""
            )
        text = self._apply(messages, tools, True, kwargs)
        bare = self._apply(messages, tools, False, kwargs)
        prefix = text[len(bare) :] if text.startswith(bare) else ""
        return ChatRender(text, prefix)

    def generation_prefix(self, template_kwargs: Mapping[str, Any] | None = None) -> str | None:
        """What the template adds for the generation prompt after one user
        message (None when it cannot render, or the addition is not a suffix)."""
        if not self.source:
            return None
        kwargs = dict(template_kwargs or {})
        try:
            text = self._apply(_PROBE, None, True, kwargs)
            bare = self._apply(_PROBE, None, False, kwargs)
        except Exception:  # a template that cannot render tells nothing
            return None
        return text[len(bare) :] if text.startswith(bare) else None

    def generation_prefixes(self) -> tuple[str, ...]:
        """The generation prefix with the thinking switch unset, on and off
        (those that render): what parser detection reads."""
        settings: tuple[dict[str, bool], ...] = (
            {},
            {"enable_thinking": True},
            {"enable_thinking": False},
        )
        prefixes = (self.generation_prefix(kwargs) for kwargs in settings)
        return tuple(prefix for prefix in prefixes if prefix is not None)

    def _apply(
        self,
        messages: Sequence[Mapping[str, Any]],
        tools: Sequence[Mapping[str, Any]] | None,
        generation_prompt: bool,
        kwargs: dict[str, Any],
        continue_final: bool = False,
    ) -> str:
        rendered = self._hf.apply_chat_template(
            [dict(message) for message in messages],
            tools=list(tools) if tools else None,
            chat_template=self._override,
            add_generation_prompt=generation_prompt,
            continue_final_message=continue_final,
            tokenize=False,
            **kwargs,
        )
        return str(rendered)


class ModelTokenizer:
    """A Hugging Face tokenizer plus what streaming needs of it."""

    def __init__(self, model_dir: Path, vocab_size: int) -> None:
        from transformers import AutoTokenizer

        self.hf: Any = AutoTokenizer.from_pretrained(str(model_dir))
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is None:
            raise ValueError(f"{model_dir}: only fast (tokenizer.json) tokenizers are supported")
        self.table = build_token_table(json.loads(backend.to_str()), vocab_size)
        self.eos_ids = frozenset(_eos_ids(model_dir, self.hf))
        self.chat_template: str | None = getattr(self.hf, "chat_template", None)
        self.chat = ChatTemplate(self.hf)

    def encode(self, text: str) -> list[int]:
        ids: list[int] = self.hf.encode(text, add_special_tokens=False)
        return ids

    def encode_prompt(self, text: str) -> list[int]:
        """Encode a raw prompt as the model expects (BOS where it wants one)."""
        ids: list[int] = self.hf.encode(text, add_special_tokens=True)
        return ids

    def single_token(self, text: str) -> int | None:
        """The id of ``text`` when it encodes to exactly one token."""
        ids = self.encode(text)
        return ids[0] if len(ids) == 1 else None

    def decode(self, ids: Sequence[int]) -> str:
        return self.table.decode(ids)

    def token_strings(self, ids: Sequence[int]) -> list[str]:
        """Each id's vocabulary entry as the tokenizer spells it (``Ġhello``)."""
        strings: list[str] = self.hf.convert_ids_to_tokens(list(ids))
        return strings

    def config(self) -> dict[str, Any]:
        """What a client needs to rebuild this tokenizer: its configuration as
        ``tokenizer_config.json`` holds it (special tokens, ``model_max_length``,
        the added tokens), its class and the chat template the server renders
        with. Where the files were loaded from is left out."""
        config = {
            key: _json_safe(value, flags=key == "added_tokens_decoder")
            for key, value in self.hf.init_kwargs.items()
            if key not in _LOCAL_KEYS and value is not None
        }
        config["tokenizer_class"] = type(self.hf).__name__
        if self.chat.source:
            config["chat_template"] = self.chat.source
        return config

    def vocabulary(self) -> frozenset[str]:
        """Every token's string form (added tokens included)."""
        return frozenset(self.hf.get_vocab())


#: ``init_kwargs`` that say where and how the files were loaded, not what they are.
_LOCAL_KEYS = frozenset({"name_or_path", "is_local", "local_files_only", "vocab_file", "cache_dir"})


def _json_safe(value: Any, *, flags: bool = False) -> Any:
    """A tokenizer setting as ``tokenizer_config.json`` writes it: a special
    token as its text, an entry of ``added_tokens_decoder`` (``flags``) as
    its text and flags; containers element by element."""
    if isinstance(value, Mapping):
        return {str(key): _json_safe(item, flags=flags) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_json_safe(item, flags=flags) for item in value]
    if isinstance(value, str | int | float | bool) or value is None:
        return value
    if hasattr(value, "content"):  # tokenizers.AddedToken
        if not flags:
            return value.content
        names = ("lstrip", "rstrip", "single_word", "normalized", "special")
        return {"content": value.content, **{name: getattr(value, name, None) for name in names}}
    return str(value)


def _eos_ids(model_dir: Path, hf: Any) -> set[int]:
    ids: set[int] = set()
    if getattr(hf, "eos_token_id", None) is not None:
        ids.add(int(hf.eos_token_id))
    generation_config = model_dir / "generation_config.json"
    if generation_config.is_file():
        value = json.loads(generation_config.read_text()).get("eos_token_id")
        if isinstance(value, int):
            ids.add(value)
        elif isinstance(value, list):
            ids.update(int(v) for v in value)
    return ids | _harmony_ends(hf)


#: harmony's markers that end an assistant's turn: a tool call, a final answer.
HARMONY_ENDS = ("<|call|>", "<|return|>")


def _harmony_ends(hf: Any) -> set[int]:
    """A vocabulary with harmony's markers as special tokens speaks harmony,
    where ``<|call|>`` and ``<|return|>`` end the reply whatever the
    checkpoint's ``generation_config.json`` lists (a converted or trimmed
    gpt-oss checkpoint may list only ``<|return|>``, and would then run past
    a call); vLLM adds both as stop ids for harmony too."""
    decoder = getattr(hf, "added_tokens_decoder", {})
    special = {token.content: int(index) for index, token in decoder.items() if token.special}
    if not all(marker in special for marker in HARMONY_ENDS):
        return set()
    return {special[marker] for marker in HARMONY_ENDS}
