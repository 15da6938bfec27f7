"""Configuration, routing and request validation, without a server."""

from __future__ import annotations

import argparse
import dataclasses
import gc
from typing import Any

import pytest

from sluiceway.engines.loader import freeze_heap
from sluiceway.protocol.errors import InvalidRequest, MethodNotAllowed, NotFound
from sluiceway.server.cli import build_parser, config_from_args
from sluiceway.server.config import CHOICES, MAX_STREAM_INTERVAL, ServerConfig
from sluiceway.server.exchange import MAILBOX_LIMIT
from sluiceway.server.routing import Router
from sluiceway.surfaces.openai.chat_wire import ChatRequest
from sluiceway.surfaces.openai.fields import stop_strings
from sluiceway.surfaces.validation import parse_request


def test_config_from_environment() -> None:
    config = ServerConfig.from_env(
        {
            "SLUICEWAY_MODEL": "/models/x",
            "SLUICEWAY_PORT": "9001",
            "SLUICEWAY_RETURN_TOKENS_AS_TOKEN_IDS": "yes",
            "SLUICEWAY_WORKER_CLASS": "trio",
            "UNRELATED": "1",
        }
    )
    assert config.model == "/models/x"
    assert config.port == 9001
    assert config.return_tokens_as_token_ids is True
    assert config.worker_class == "trio"
    assert config.model_name == "/models/x"


def test_device_takes_what_the_engine_takes() -> None:
    """``--device`` accepts every form the transformers engine accepts,
    ``cuda:N`` included (docs/engines.md documents it), and nothing else."""
    for device in ("auto", "cpu", "cuda", "cuda:0", "cuda:12"):
        args = build_parser().parse_args(["serve", "--device", device])
        assert config_from_args(args).device == device
    for device in ("mps", "cuda:", "cuda:x", "gpu", "cuda:1 "):
        with pytest.raises(ValueError, match="--device must be one of"):
            config_from_args(build_parser().parse_args(["serve", "--device", device]))


@pytest.mark.parametrize(
    "environ",
    [
        {"SLUICEWAY_ENGINE": "gpu-magic"},
        {"SLUICEWAY_DEVICE": "cuda:one"},
        {"SLUICEWAY_PORT": "0"},
        {"SLUICEWAY_RETURN_TOKENS_AS_TOKEN_IDS": "maybe"},
    ],
)
def test_bad_environment_is_refused(environ: dict[str, str]) -> None:
    with pytest.raises(ValueError, match=r"."):
        ServerConfig.from_env(environ)


def test_the_stream_interval_is_bounded_by_half_a_mailbox() -> None:
    """The two constants live in different modules; a batch and the steps
    that come while it is written must fit in a request's mailbox."""
    assert 2 * MAX_STREAM_INTERVAL <= MAILBOX_LIMIT
    assert ServerConfig(stream_interval=MAX_STREAM_INTERVAL).stream_interval == MAX_STREAM_INTERVAL
    for refused in (0, MAX_STREAM_INTERVAL + 1):
        with pytest.raises(ValueError, match="stream_interval"):
            ServerConfig(stream_interval=refused)


def _other_value(spec: dataclasses.Field[Any], default: Any) -> tuple[Any, list[str], str]:
    """A value other than the field's default, as flags and as an environment value."""
    flag = "--" + spec.name.replace("_", "-")
    if spec.name == "device":
        return "cuda:1", [flag, "cuda:1"], "cuda:1"
    if spec.name in CHOICES:
        value = next(choice for choice in CHOICES[spec.name] if choice != default)
        return value, [flag, value], value
    if "bool" in str(spec.type):
        value = not default
        return value, [flag if value else "--no-" + flag[2:]], "yes" if value else "no"
    if isinstance(default, float):
        value = default + 1.5
        return value, [flag, str(value)], str(value)
    if isinstance(default, int) or str(spec.type).startswith("int"):
        value = (default or 0) + 3
        return value, [flag, str(value)], str(value)
    text = '{"enable_thinking": false}' if spec.name.endswith("_kwargs") else "some-value"
    return text, [flag, text], text


def test_every_config_field_has_a_flag_and_a_variable() -> None:
    """Each field of the config, set through its flag or its environment
    variable, reaches the config; each flag says what it does."""
    parser = build_parser()
    defaults = ServerConfig()
    assert config_from_args(parser.parse_args(["serve"])) == defaults
    serve = next(
        action for action in parser._actions if isinstance(action, argparse._SubParsersAction)
    ).choices["serve"]
    helps = {action.dest: action.help for action in serve._actions}
    for spec in dataclasses.fields(ServerConfig):
        default = getattr(defaults, spec.name)
        value, flags, raw = _other_value(spec, default)
        assert helps.get(spec.name), f"{spec.name} has no flag with a help text"
        config = config_from_args(parser.parse_args(["serve", *flags]))
        assert getattr(config, spec.name) == value, flags
        assert dataclasses.replace(config, **{spec.name: default}) == defaults, flags
        environ = {"SLUICEWAY_" + spec.name.upper(): raw}
        assert getattr(ServerConfig.from_env(environ), spec.name) == value, environ


@pytest.mark.parametrize(
    ("flags", "environ", "expected"),
    [
        ([], {}, None),
        (["--engine-process"], {}, True),
        (["--no-engine-process"], {}, False),
        ([], {"SLUICEWAY_ENGINE_PROCESS": "off"}, False),
        ([], {"SLUICEWAY_ENGINE_PROCESS": "1"}, True),
    ],
)
def test_engine_process_is_on_off_or_left_to_the_engine(
    flags: list[str], environ: dict[str, str], expected: bool | None
) -> None:
    if flags:
        assert build_parser().parse_args(["serve", *flags]).engine_process is expected
    else:
        assert build_parser().parse_args(["serve"]).engine_process is None
        assert ServerConfig.from_env(environ).engine_process is expected


async def _noop(*_: Any) -> None:
    return None


def test_router_tells_404_from_405() -> None:
    router = Router({"/v1/models": {"GET": _noop}, "/v1/models/{model}": {"GET": _noop}})
    assert router.resolve("GET", "/v1/models/") == (_noop, {})
    assert router.resolve("HEAD", "/v1/models") == (_noop, {})
    assert router.resolve("GET", "/v1/models/some-model") == (_noop, {"model": "some-model"})
    with pytest.raises(MethodNotAllowed) as refused:
        router.resolve("POST", "/v1/models")
    assert refused.value.allowed == ("GET",)
    with pytest.raises(NotFound):
        router.resolve("GET", "/v2/models")
    with pytest.raises(NotFound):
        router.resolve("GET", "/v1/models/a/b")


@pytest.mark.parametrize(
    ("payload", "param"),
    [
        ({"model": "m", "messages": [{"role": "user", "content": 5}]}, "messages[0].content"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "stop": 5}, "stop"),
        ({"model": "m", "messages": "hi"}, "messages"),
        ({"messages": [{"role": "user", "content": "x"}]}, "model"),
        ({"model": "m", "messages": [{"role": "tool", "content": "x"}]}, "messages[0]"),
        ({"model": "m", "messages": [{"role": "user", "content": "x"}], "n": True}, "n"),
    ],
)
def test_validation_names_the_param(payload: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidRequest) as refused:
        parse_request(ChatRequest, payload)
    assert refused.value.param == param


def test_assistant_messages_echoed_back_are_accepted() -> None:
    message = {
        "role": "assistant",
        "content": None,
        "refusal": None,
        "annotations": [],
        "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
        ],
    }
    request = parse_request(ChatRequest, {"model": "m", "messages": [message]})
    assert request.messages[0].tool_calls is not None


def test_stop_strings_are_checked() -> None:
    assert stop_strings("a") == ("a",)
    assert stop_strings(["a", "b", "a"]) == ("a", "b")
    with pytest.raises(InvalidRequest):
        stop_strings([str(i) for i in range(17)])
    with pytest.raises(InvalidRequest):
        stop_strings([""])


def test_freezing_the_heap_takes_what_exists_out_of_collections() -> None:
    """What exists once the model is loaded is frozen: later collections do
    not walk it (the GC tracks only objects made afterwards)."""
    loaded = [[index] for index in range(1000)]  # lists are always tracked
    try:
        freeze_heap()
        assert gc.get_freeze_count() >= len(loaded)
        tracked = {id(item) for item in gc.get_objects()}
        assert not any(id(item) in tracked for item in loaded)
        made_later = [[1]]
        assert id(made_later[0]) in {id(item) for item in gc.get_objects()}
    finally:
        gc.unfreeze()
