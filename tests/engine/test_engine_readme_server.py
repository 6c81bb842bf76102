"""The README's CPU launch lines, run as written, give a server that answers through LMCache.

Stack D. The lines between ``<!-- cpu-launch-start -->`` and ``<!-- cpu-launch-end -->``
in the README run in bash, in an empty folder, with the stack's ``python`` first on
PATH, vLLM's and LMCache's default log levels, the test's model for ``<hybrid model>``
and a free port for ``8000``; nothing else is changed. The model is the engine tests'
Gemma-style hybrid (two KV-cache groups) with a word-level tokenizer, so the server
takes text as a user's does. One prompt of three chunks and more is asked twice: both
answers are the same eight tokens; LMCache was asked (vLLM's
``external_prefix_cache_queries``) and stored every whole chunk of the prompt; and the
log says what the README says it does: each engine process's state line, the worker's
start line with both groups moved, and the model name its chunk keys carry.
"""

from __future__ import annotations

import json
import os
import re
import sys
import urllib.request
from pathlib import Path

import pytest

from tests.engine.harness import REPO_ROOT, free_loopback_port, server_on_loopback
from tests.engine.models import MODELS, add_word_tokenizer, build

README = REPO_ROOT / "README.md"
CHUNK_SIZE = 256  # the README's lmcache.yaml
SERVER_START_TIMEOUT_S = 600


def readme_cpu_launch() -> str:
    text = README.read_text()
    block = text.split("<!-- cpu-launch-start -->\n", 1)[1].split("<!-- cpu-launch-end -->", 1)[0]
    lines = block.splitlines()
    assert lines and all(line.startswith("    ") or not line for line in lines), block
    return "\n".join(line[4:] for line in lines) + "\n"


def _request(port: int, path: str, body: dict | None = None) -> bytes:
    request = urllib.request.Request(
        f"http://127.0.0.1:{port}{path}",
        data=None if body is None else json.dumps(body).encode(),
        headers={"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=300) as response:
        return response.read()


def _counter(metrics: str, name: str) -> float:
    values = [float(line.rsplit(" ", 1)[1]) for line in metrics.splitlines() if line.startswith(name + "{")]
    assert values, f"{name} not in vLLM's metrics"
    return sum(values)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The README's lines serving the test model: (answers, metrics text, log text, prompt tokens)."""
    model = add_word_tokenizer(build(MODELS["gemma3-sliding128"], tmp_path_factory.mktemp("readme-model")))
    folder = tmp_path_factory.mktemp("readme-launch")
    port = free_loopback_port()
    script = readme_cpu_launch()
    assert "<hybrid model>" in script and "--port 8000" in script, script
    script = script.replace("<hybrid model>", str(model)).replace("--port 8000", f"--port {port}")
    log_path = folder / "server.log"
    env = {
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
        "VLLM_LOGGING_LEVEL": "INFO",  # the defaults of both, which the other engine tests lower
        "LMCACHE_LOG_LEVEL": "INFO",
    }
    prompt = " ".join(f"w{3 + (index * 7) % 500}" for index in range(3 * CHUNK_SIZE + 100))
    with server_on_loopback("the README's CPU server", ["bash", "-c", script], port, cwd=folder, env=env,
                            log_path=log_path, timeout_s=SERVER_START_TIMEOUT_S):
        answers = [json.loads(_request(port, "/v1/completions", {
            "model": str(model), "prompt": prompt, "max_tokens": 8, "temperature": 0,
        })) for _ in range(2)]
        metrics = _request(port, "/metrics").decode()
    return answers, metrics, log_path.read_text(errors="replace")


def test_the_server_answers_the_same_tokens_twice(served):
    answers, _, _ = served
    texts = [answer["choices"][0]["text"] for answer in answers]
    assert all(answer["usage"]["completion_tokens"] == 8 for answer in answers), answers
    assert texts[0] == texts[1], texts


def test_lmcache_was_asked_and_stored_every_whole_chunk(served):
    answers, metrics, log = served
    assert _counter(metrics, "vllm:external_prefix_cache_queries_total") > 0
    prompt_tokens = answers[0]["usage"]["prompt_tokens"]
    whole_chunks = prompt_tokens // CHUNK_SIZE * CHUNK_SIZE
    assert whole_chunks >= 3 * CHUNK_SIZE
    assert re.search(rf"Stored {whole_chunks} out of total {whole_chunks} tokens", log), log[-4000:]


def test_the_log_says_the_overlay_is_active_in_each_engine_process(served):
    import lmcache_ascend

    _, _, log = served
    head = f"lmcache-ascend {lmcache_ascend.__version__}"
    states = re.findall(rf"\((\w+)[- ]?\d* pid=\d+\) INFO .*{re.escape(head)} active in this process: \d+ of \d+ patches armed", log)
    assert {"EngineCore", "VllmWorker"} <= set(states), (states, log[-6000:])
    assert len(states) == len(set(states)), states  # once per process
    assert re.search(rf"{re.escape(head)} active: chunk keys by lmcache-stable-token-hash .*KV-cache groups moved: "
                     r"0 SlidingWindowSpec \(block 128, window 128\), 1 FullAttentionSpec \(block 128\); skipped: none", log)
    assert re.search(r"lmcache-ascend: chunk keys name model '.*' as '.*\+ascend-[0-9a-f]{16}'", log), log[-6000:]


def test_the_readme_block_is_what_a_user_copies():
    """The lines the test runs are the README's, with two placeholders and nothing test-only."""
    script = readme_cpu_launch()
    assert script.startswith("cat > lmcache.yaml <<'EOF'\n")
    assert "python -m vllm.entrypoints.openai.api_server" in script
    assert not re.search(r"pytest|tests/|LMCACHE_ASCEND_", script), script
