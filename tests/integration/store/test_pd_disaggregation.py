"""Prefill/decode disaggregation on the CPU: a ``kv_producer`` and a ``kv_consumer``
``vllm serve`` sharing one Redis server, behind ``examples/pd_proxy.py``.

SmolLM2-135M in float32 (a reload is token-identical, design notes 3), the default stored-prefix
path at budget 0.25, chunks of 128. Every request the proxy routes is computed by the producer
(one token) and loaded by the consumer from Redis; the consumer's answers equal a ``kv_both``
instance that stored the same prompt and loaded it back (the in-process store path), and the
consumer never saves. A consumer told of chunks that never arrive waits ``remote_wait_s``, then
recomputes, and says so in its counters.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest

from connectors.vllm.disaggregation import stored_params
from lmcompact.bench.serve_instance import ROOT, ServeInstance, connector_transfer, started
from tests.redis_server import RedisProcess, redis_server_fixture

pytestmark = pytest.mark.integration

CHUNK = 128
MAX_TOKENS = 8


def options(redis_url: str | None, **store: Any) -> dict[str, Any]:
    tiers = ["cpu", "redis"] if redis_url else ["cpu"]
    group = {"chunk_size": CHUNK, "tiers": tiers, "redis_url": redis_url, **store}
    return {"budget": 0.25, "store": {k: v for k, v in group.items() if v is not None}}


@pytest.fixture(scope="module")
def prompts(smollm2_path: Path) -> list[list[int]]:
    """Two natural-text contexts (pydoc haystack, 4 needles), two questions each."""
    from transformers import AutoTokenizer

    from lmcompact.eval.tasks import build_needle_prompt
    from lmcompact.eval.text import haystack_text

    tokenizer = AutoTokenizer.from_pretrained(smollm2_path)
    depths = (0.1, 0.4, 0.6, 0.9)
    return [
        build_needle_prompt(
            tokenizer, 700, seed, depths, ask, "pydoc", "chat", haystack_text("pydoc", seed)
        ).input_ids
        for seed in (1, 2)
        for ask in (0, 2)
    ]


redis_module = redis_server_fixture(scope="module")


@pytest.fixture(scope="module")
def redis_url(redis_module: RedisProcess) -> str:
    return redis_module.url


def proxied(proxy_port: int, prompt: list[int]) -> dict[str, Any]:
    body = {"model": "m", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    request = urllib.request.Request(
        f"http://127.0.0.1:{proxy_port}/v1/completions",
        json.dumps(body).encode(),
        {"Content-Type": "application/json"},
    )
    with urllib.request.urlopen(request, timeout=600) as response:
        return dict(json.loads(response.read()))


def proxy_port(proc: subprocess.Popen[bytes], log: Path) -> int:
    """The port the proxy bound (``--port 0``), read from its log line ``proxy on host:port``.

    A port picked before the engines start can be taken by one of their own sockets meanwhile
    (CI saw it once), so the proxy binds a free port itself and says which.
    """
    deadline = time.monotonic() + 60
    while True:
        text = log.read_text(errors="replace") if log.exists() else ""
        found = re.search(r"proxy on [\d.]+:(\d+)", text)
        if found:
            return int(found.group(1))
        assert proc.poll() is None, f"the proxy exited:\n{text[-2000:]}"
        assert time.monotonic() < deadline, f"the proxy never started:\n{text[-2000:]}"
        time.sleep(0.2)


def test_consumer_loads_what_the_producer_stored(
    smollm2_path: Path, prompts: list[list[int]], redis_url: str, tmp_path: Path
) -> None:
    producer = ServeInstance(
        smollm2_path, connector_transfer(options(redis_url), "kv_producer"), tmp_path / "p.log"
    )
    consumer = ServeInstance(
        smollm2_path, connector_transfer(options(redis_url), "kv_consumer"), tmp_path / "d.log"
    )
    reference = ServeInstance(smollm2_path, connector_transfer(options(None)), tmp_path / "ref.log")
    proxy_command = [
        sys.executable, str(ROOT / "examples" / "pd_proxy.py"), "--prefill", producer.base,
        "--decode", consumer.base, "--port", "0",
    ]  # fmt: skip
    proxy_log = tmp_path / "proxy.log"
    with started([producer, consumer, reference]), proxy_log.open("w") as proxy_err:
        proxy = subprocess.Popen(proxy_command, stderr=proxy_err)
        try:
            port = proxy_port(proxy, proxy_log)
            answers = [proxied(port, prompt)["choices"][0]["text"] for prompt in prompts]
        finally:
            proxy.terminate()
            proxy.wait(timeout=10)
        expected = []
        for prompt in prompts:  # the in-process store path: store, then load
            reference.complete({"prompt": prompt, "max_tokens": 1, "temperature": 0})
            body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
            expected.append(reference.complete(body)["choices"][0]["text"])
        made, used, ref = producer.counters(), consumer.counters(), reference.counters()
    print(f"answers {answers}\nproducer {made}\nconsumer {used}\nreference {ref}")
    assert answers == expected
    assert all(text.strip() for text in answers)
    assert ref["store_hits"] >= len(prompts)  # the reference loaded each prompt (and more)
    assert used["store_hits"] == len(prompts) and used.get("store_misses", 0) == 0
    assert used["loaded_chunks"] >= len(prompts) * 5  # 700-token prompts: 5 chunks each
    assert used.get("load_failures", 0) == 0 and used.get("remote_wait_timeouts", 0) == 0
    assert used.get("stored_chunks", 0) == 0  # a consumer never saves
    assert made["stored_chunks"] > 0
    assert 0 < used["loaded_bytes"] <= made["stored_bytes"] * len(prompts)
    assert made["stored_bytes"] < 0.27 * made["stored_full_bytes"]


def test_consumer_recomputes_when_the_producers_chunks_never_arrive(
    smollm2_path: Path, prompts: list[list[int]], redis_url: str, tmp_path: Path
) -> None:
    extra = options(redis_url, remote_wait_s=1.0)
    consumer = ServeInstance(
        smollm2_path, connector_transfer(extra, "kv_consumer"), tmp_path / "d.log"
    )
    plain = ServeInstance(smollm2_path, None, tmp_path / "plain.log")
    prompt = prompts[0][::-1]  # a prompt nobody stored
    body = {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0}
    with started([consumer, plain]):
        namespace = "0" * 32  # the wrong namespace: ignored at once (an error in the log)
        foreign = {"lmcompact": {"stored": {"tokens": 512, "namespace": namespace}}}
        consumer.complete({**body, "kv_transfer_params": foreign})
        after_foreign = consumer.counters()
        own = consumer_namespace(consumer)
        start = time.perf_counter()
        late = consumer.complete({**body, "kv_transfer_params": stored_params(512, own)})
        waited = time.perf_counter() - start
        counted = consumer.counters()
        full = plain.complete(body)
    assert after_foreign.get("remote_waits", 0) == 0
    assert "cannot load those chunks" in consumer.log_tail(20000)
    assert counted["remote_waits"] == 1 and counted["remote_wait_timeouts"] == 1
    assert waited >= 1.0
    assert late["choices"][0]["text"] == full["choices"][0]["text"]  # recomputed, exact


def consumer_namespace(instance: ServeInstance) -> str:
    """The store namespace the consumer's log names (its error line about the foreign one)."""
    for line in instance.log_tail(20000).splitlines():
        if "this consumer reads" in line:
            return line.split("this consumer reads ")[1].split()[0]
    raise AssertionError("no namespace in the consumer's log")
