"""The ZMQ Python client against a real front process, the test playing its peers."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator

import pytest

from radixmux import protocol
from radixmux.runtime.client import AsyncClient, Client, ClientError
from tests.front_harness import RunningFront, fail, running_front, served_model, words

KEY = "k3y"
pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def front() -> Iterator[RunningFront]:
    models = [served_model("m"), served_model("plain", chat_template=False)]
    with running_front(models, api_key=KEY) as f:
        yield f


@pytest.fixture
def client(front: RunningFront) -> Iterator[Client]:
    front.peers.script = words()
    for q in (front.peers.requests, front.peers.aborts):
        while not q.empty():
            q.get_nowait()
    with Client(front.endpoints.client, api_key=KEY, timeout=10) as c:
        yield c


def test_generate(front: RunningFront, client: Client) -> None:
    done = client.generate("m", prompt="a b", max_tokens=3, temperature=0.5, stop="zz", seed=3)
    assert done.text == "w0 w1 w2 " and done.token_ids == [100, 101, 102]
    assert done.finish_reason == "length"
    assert (done.prompt_tokens, done.completion_tokens, done.cached_tokens) == (2, 3, 1)
    req = front.peers.requests.get(timeout=1)
    assert req.prompt == "a b" and req.stop == ["zz"] and req.model == "m"
    assert (req.params.max_new_tokens, req.params.temperature, req.params.seed) == (3, 0.5, 3)


def test_generate_ids_and_messages(front: RunningFront, client: Client) -> None:
    assert client.generate("m", input_ids=[5, 6], max_new_tokens=1).text == "w0 "
    assert front.peers.requests.get(timeout=1).input_ids == [5, 6]
    done = client.generate("m", messages=[{"role": "user", "content": "hi"}], max_new_tokens=2)
    assert done.text == "w0 w1 "
    assert front.peers.requests.get(timeout=1).messages == [protocol.ChatMessage("user", "hi")]


def test_stream_and_stop_string(front: RunningFront, client: Client) -> None:
    deltas = list(client.stream("m", prompt="x", max_new_tokens=3))
    assert [d.text for d in deltas] == ["w0 ", "w1 ", "w2 "]
    assert [d.finish_reason for d in deltas] == [None, None, "length"]
    deltas = list(client.stream("m", prompt="x", max_new_tokens=9, stop=["w1"]))
    assert "".join(d.text for d in deltas) == "w0 " and deltas[-1].finish_reason == "stop"
    assert front.peers.aborts.get(timeout=5).reason == "stop"


def test_closing_a_stream_aborts(front: RunningFront, client: Client) -> None:
    front.peers.script = words(delay=0.1)
    stream = client.stream("m", prompt="x", max_new_tokens=100)
    assert next(stream).text == "w0 "
    stream.close()
    assert front.peers.aborts.get(timeout=5).reason == "client disconnected"
    # The socket stays usable; stale outputs of the closed stream are skipped.
    front.peers.script = words()
    assert client.generate("m", prompt="x", max_new_tokens=1).text == "w0 "


def test_errors(front: RunningFront, client: Client) -> None:
    with pytest.raises(ClientError) as err:
        client.generate("nope", prompt="x")
    assert err.value.status == 404 and "m" in err.value.message
    with pytest.raises(ClientError) as err:
        client.generate("m", prompt="x", temperature=-1)
    assert (err.value.status, err.value.param) == (400, "temperature")
    with pytest.raises(ClientError) as err:
        client.generate("plain", messages=[{"role": "user", "content": "x"}])
    assert err.value.status == 400 and "chat template" in err.value.message
    with pytest.raises(TypeError, match="temprature"):
        client.generate("m", prompt="x", temprature=1.0)
    front.peers.script = fail(429, "queue full")
    with pytest.raises(ClientError) as err:
        list(client.stream("m", prompt="x"))
    assert (err.value.status, err.value.message) == (429, "queue full")


def test_api_key_required(front: RunningFront) -> None:
    with Client(front.endpoints.client, timeout=10) as anon, pytest.raises(ClientError) as err:
        anon.generate("m", prompt="x")
    assert err.value.status == 401


def test_async_client_concurrent(front: RunningFront) -> None:
    front.peers.script = words(delay=0.01)

    async def main() -> list[str]:
        client = AsyncClient(front.endpoints.client, api_key=KEY)
        try:
            done = await asyncio.gather(
                *(client.generate("m", prompt="x", max_new_tokens=n) for n in range(1, 9))
            )
            streamed = [o.text async for o in client.stream("m", prompt="x", max_new_tokens=2)]
            return [d.text for d in done] + ["".join(streamed)]
        finally:
            await client.close()

    texts = asyncio.run(main())
    assert texts[:8] == ["".join(f"w{i} " for i in range(n)) for n in range(1, 9)]
    assert texts[8] == "w0 w1 "


def test_lists_are_bounded_as_over_http(front: RunningFront, client: Client) -> None:
    """The ZMQ path applies the HTTP APIs' bounds: a stop list or a chat past
    them is refused before it reaches a worker, naming the field."""
    with pytest.raises(ClientError) as err:
        client.generate("m", prompt="x", stop=[f"s{i}" for i in range(65)])
    assert (err.value.status, err.value.param) == (400, "stop")
    with pytest.raises(ClientError) as err:
        client.generate("m", prompt="x", stop=["y" * 5000])
    assert (err.value.status, err.value.param) == (400, "stop")
    with pytest.raises(ClientError) as err:
        client.generate("m", messages=[{"role": "user", "content": "x"}] * 5000)
    assert (err.value.status, err.value.param) == (400, "messages")
    assert front.peers.requests.empty()
