"""llama.cpp's ``llama-server`` as a peer: the build, the GGUF, the check.

* :func:`build` -- ``llama-server`` and ``llama-quantize``, built once from the
  llama.cpp sources vendored in the ``llama-cpp-python`` sdist
  (``scripts/build_llama_cpp.sh``; cached under ``~/.cache/sluiceway``);
* :func:`gguf_of` -- a GGUF of a Hugging Face Qwen3 directory (ours: the
  benchmark models), written with the ``gguf`` package's ``GGUFWriter`` (the
  copy vendored beside those sources, so the format matches the binary), at
  ``f32`` or quantised by ``llama-quantize`` (``Q8_0``). llama.cpp's own
  converter refuses our home-made tokenizer (it knows pre-tokenizers by a
  hash of known tokenizers' output); ours is byte-level BPE with GPT-2's
  split regex, which is llama.cpp's ``gpt-2`` pre-tokenizer, so it is set here;
* :func:`check` -- that llama-server tokenizes like our tokenizer and its
  greedy tokens from a prompt equal transformers' (float32) for the f32 file.

    .venv/bin/python bench/llama_peer.py [--model DIR | --large] [--check]

prints the binaries' directory and the GGUF paths (and the check's result).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))

#: The llama-cpp-python release whose vendored llama.cpp is built.
VERSION = "0.3.36"
QUANTS = ("f32", "Q8_0")
#: ``tokenizer.ggml.pre``: the split regex of a ByteLevel(use_regex=True) pre-tokenizer.
PRE_TOKENIZER = "gpt-2"
#: gguf's TokenType values (NORMAL, CONTROL, USER_DEFINED, UNUSED).
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5


def cache_root() -> Path:
    base = os.environ.get("SLUICEWAY_CACHE") or (
        Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sluiceway"
    )
    return Path(base)


def build() -> Path:
    """The directory holding ``llama-server`` and ``llama-quantize`` (built on first use)."""
    script = HERE.parent / "scripts" / "build_llama_cpp.sh"
    env = dict(os.environ, SLUICEWAY_CACHE=str(cache_root()), PYTHON=sys.executable)
    out = subprocess.run(
        ["sh", str(script), VERSION], check=True, stdout=subprocess.PIPE, text=True, env=env
    )
    return Path(out.stdout.strip().splitlines()[-1])


def _gguf() -> Any:
    """The ``gguf`` package vendored beside the llama.cpp sources that were built."""
    source = cache_root() / f"llama.cpp-{VERSION}" / f"llama_cpp_python-{VERSION}"
    sys.path.insert(0, str(source / "vendor" / "llama.cpp" / "gguf-py"))
    import gguf

    return gguf


def gguf_of(model: Path, quant: str = "f32") -> Path:
    """The GGUF of ``model`` at ``quant`` (``f32`` or a llama-quantize type), cached."""
    target = cache_root() / "gguf" / f"{model.name}-{quant}.gguf"
    if target.exists() and target.stat().st_mtime >= (model / "model.safetensors").stat().st_mtime:
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    f32 = target if quant == "f32" else gguf_of(model, "f32")
    partial = target.with_suffix(".partial")
    if quant == "f32":
        write_f32(model, partial)
    else:
        subprocess.run(
            [str(build() / "llama-quantize"), str(f32), str(partial), quant],
            check=True,
            capture_output=True,
        )
    partial.replace(target)
    return target


def write_f32(model: Path, target: Path) -> None:
    gguf = _gguf()
    from safetensors.numpy import load_file

    config = json.loads((model / "config.json").read_text())
    weights = load_file(str(model / "model.safetensors"))
    writer = gguf.GGUFWriter(str(target), "qwen3")
    writer.add_name(model.name)
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(config["num_attention_heads"])
    writer.add_head_count_kv(config["num_key_value_heads"])
    writer.add_key_length(config["head_dim"])
    writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config["rope_theta"])
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_file_type(gguf.LlamaFileType.ALL_F32)
    add_tokenizer(writer, model, config)
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN3, config["num_hidden_layers"])
    for name, tensor in weights.items():
        mapped = names.get_name(name, try_suffixes=(".weight", ".bias"))
        if mapped is None:
            raise ValueError(f"no GGUF name for {name}")
        # Qwen3's RoPE is llama.cpp's NEOX kind: q and k need no permutation.
        writer.add_tensor(mapped, np.ascontiguousarray(tensor.astype(np.float32)))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def add_tokenizer(writer: Any, model: Path, config: dict[str, Any]) -> None:
    """GPT-2-style BPE: tokens by id (the embedding's padding rows as unused
    ``[PADn]`` tokens), their kinds, the merges, and the special ids."""
    data = json.loads((model / "tokenizer.json").read_text())
    by_id = {index: token for token, index in data["model"]["vocab"].items()}
    kinds = dict.fromkeys(by_id, NORMAL)
    for added in data["added_tokens"]:
        by_id[added["id"]] = added["content"]
        kinds[added["id"]] = CONTROL if added["special"] else USER_DEFINED
    size = config["vocab_size"]
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(PRE_TOKENIZER)
    writer.add_token_list(tokens)
    writer.add_token_types([kinds.get(i, UNUSED) for i in range(size)])
    merges = data["model"]["merges"]
    writer.add_token_merges([m if isinstance(m, str) else " ".join(m) for m in merges])
    settings = json.loads((model / "tokenizer_config.json").read_text())
    ids = {token: index for index, token in by_id.items()}
    writer.add_bos_token_id(config["bos_token_id"])
    writer.add_eos_token_id(ids.get(settings.get("eos_token"), config["eos_token_id"]))
    if settings.get("pad_token") in ids:
        writer.add_pad_token_id(ids[settings["pad_token"]])
    writer.add_add_bos_token(False)
    template = model / "chat_template.jinja"
    if template.exists():
        writer.add_chat_template(template.read_text())


def server_command(
    binary: Path, gguf: Path, port: int, slots: int, context: int, *, exact: bool = False
) -> list[str]:
    """llama-server on ``gguf`` with ``slots`` parallel sequences of ``context`` tokens each.

    ``--ctx-size`` is the total over the slots in llama-server. Threads:
    every core the process may run on, as our engine takes (llama.cpp's
    default counts physical cores: the same 2 on this host); its defaults
    otherwise, among them a float16 KV cache and flash attention where the
    backend has it (``exact``: a float32 cache and no flash attention, which
    on the CPU computes in reduced precision).
    """
    cores = str(len(os.sched_getaffinity(0)))
    return [
        str(binary / "llama-server"),
        *("--model", str(gguf), "--host", "127.0.0.1", "--port", str(port)),
        *("--parallel", str(slots), "--ctx-size", str(slots * context)),
        *("--threads", cores, "--threads-batch", cores),
        # A quantised GGUF at the defaults died with SIGILL here (exit 132,
        # right after the thread pool's start): the CPU backend repacks such
        # weights for the instructions /proc/cpuinfo lists (AMX among them),
        # which this VM does not let a process run. f32 is never repacked.
        *(() if gguf.name.endswith("-f32.gguf") else ("--no-repack",)),
        *("--log-disable", "--no-webui"),
        *(
            ("--cache-type-k", "f32", "--cache-type-v", "f32", "--flash-attn", "off")
            if exact
            else ()
        ),
    ]


def version(binary: Path) -> str:
    out = subprocess.run(
        [str(binary / "llama-server"), "--version"], capture_output=True, text=True, check=False
    )
    line = next((ln for ln in (out.stdout + out.stderr).splitlines() if "version" in ln), "")
    return f"llama.cpp {line.strip()} (from llama-cpp-python {VERSION})"


def post(url: str, body: dict[str, Any]) -> Any:
    request = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(request, timeout=120) as response:
        return json.load(response)


def wait_up(url: str, process: subprocess.Popen[bytes], seconds: float = 120) -> None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        if process.poll() is not None:
            raise RuntimeError(f"llama-server exited with {process.returncode}")
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=2) as response:
                if response.status == 200:
                    return
        except OSError:
            pass
        time.sleep(0.3)
    raise TimeoutError("llama-server did not come up")


def reference_tokens(model: Path, prompt: list[int], count: int) -> list[int]:
    """transformers' greedy tokens after ``prompt`` (float32, eager)."""
    import torch
    from transformers import AutoModelForCausalLM

    net = AutoModelForCausalLM.from_pretrained(str(model), dtype=torch.float32)
    with torch.inference_mode():
        out = net.generate(
            torch.tensor([prompt]), max_new_tokens=count, min_new_tokens=count, do_sample=False
        )
    return [int(t) for t in out[0, len(prompt) :]]


def check(model: Path, gguf: Path, binary: Path, text: str, count: int = 32) -> list[str]:
    """What llama-server does differently from our tokenizer and transformers'
    greedy decode on ``text`` (empty: nothing). llama-server runs exact here
    (float32 KV cache, no flash attention): at its defaults, a near-tie of
    the 42M model's top two logits (4.1003 and 4.0946) went the other way at
    the 14th token, and with only the float32 cache too; the tiny model's 32
    tokens were equal at its defaults."""
    from tokenizers import Tokenizer

    ours = Tokenizer.from_file(str(model / "tokenizer.json")).encode(text).ids
    port = 18790
    url = f"http://127.0.0.1:{port}"
    process = subprocess.Popen(
        server_command(binary, gguf, port, 1, 1024, exact=True),
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_up(url, process)
        theirs = post(f"{url}/tokenize", {"content": text})["tokens"]
        body = {"prompt": ours, "n_predict": count, "temperature": 0, "ignore_eos": True}
        body |= {"return_tokens": True, "cache_prompt": False}
        generated = post(f"{url}/completion", body)["tokens"]
    finally:
        process.terminate()
        process.wait(30)
    problems = []
    if theirs != ours:
        problems.append(f"tokenization differs: ours {ours[:12]}..., llama.cpp {theirs[:12]}...")
    expected = reference_tokens(model, ours, count)
    if generated != expected:
        same = next(
            (i for i, (a, b) in enumerate(zip(generated, expected, strict=False)) if a != b), count
        )
        problems.append(f"greedy tokens differ from token {same}: {generated} vs {expected}")
    return problems


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=None)
    parser.add_argument("--large", action="store_true", help="the serving benchmark's 42M model")
    parser.add_argument("--check", action="store_true", help="compare with transformers")
    args = parser.parse_args()
    from bench.models import serving_model, shipped_corpus
    from sluiceway.engines.default_model import default_model_dir

    model = args.model or (serving_model() if args.large else default_model_dir())
    binary = build()
    print(f"binaries: {binary}\n{version(binary)}")
    files = {quant: gguf_of(model, quant) for quant in QUANTS}
    for quant, path in files.items():
        print(f"{quant}: {path} ({path.stat().st_size / 1e6:.1f} MB)")
    if args.check:
        text = shipped_corpus()[:400]
        problems = check(model, files["f32"], binary, text)
        print("\n".join(problems) or "llama-server (f32) tokenizes and decodes greedily as we do")
        sys.exit(1 if problems else 0)


if __name__ == "__main__":
    main()
