"""The front's ROUTER socket: serves the Python ZMQ client without HTTP.

Requests go through the same checks and the same :class:`RequestHub` as HTTP
ones; replies carry the client's rid (the front uses its own internally).
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import time

import msgspec
import zmq
import zmq.asyncio

from radixmux import protocol
from radixmux.common.ipc import socket
from radixmux.runtime.api_error import APIError
from radixmux.runtime.client.messages import (
    ClientAbort,
    ClientGenerate,
    ClientInbox,
    ClientModelChange,
    ClientModelChanged,
    LoadModelBody,
    ReloadModelBody,
)
from radixmux.runtime.front.api.common import (
    check_chat_messages,
    check_input_ids,
    check_sampling,
    stop_list,
)
from radixmux.runtime.front.hub import InFlight, new_rid
from radixmux.runtime.front.state import Front

log = logging.getLogger("radixmux.front")


class ClientServer:
    """Reads the ROUTER socket and runs one task per client request."""

    def __init__(self, zctx: zmq.Context, front: Front) -> None:
        endpoint = front.ctx.endpoints.client
        self.router = socket(zmq.asyncio.Context.shadow(zctx), zmq.ROUTER, endpoint, bind=True)
        self.front = front
        self.hub = front.hub
        self.models = front.model_manager
        self.tasks: dict[tuple[bytes, str], asyncio.Task] = {}
        self._decoder = msgspec.msgpack.Decoder(ClientInbox)

    async def run(self) -> None:
        while True:
            frames = await self.router.recv_multipart()
            if len(frames) != 2:
                log.warning("zmq client sent %d frames; expected 1 message per frame", len(frames))
                continue
            ident, data = frames
            try:
                msg = self._decoder.decode(data)
            except msgspec.DecodeError as exc:
                await self._send(
                    ident, protocol.RequestError("", 400, f"undecodable message: {exc}")
                )
                continue
            key = (ident, msg.rid)
            if isinstance(msg, ClientAbort):
                task = self.tasks.get(key)
                if task is not None:
                    task.cancel()  # leaving the generation aborts it downstream
            elif key in self.tasks:
                await self._send(
                    ident, protocol.RequestError(msg.rid, 400, f"rid {msg.rid} in use")
                )
            else:
                work = self._change if isinstance(msg, ClientModelChange) else self._serve
                task = asyncio.create_task(work(ident, msg))
                self.tasks[key] = task
                task.add_done_callback(lambda _t, k=key: self.tasks.pop(k, None))

    async def _send(self, ident: bytes, msg: msgspec.Struct) -> None:
        await self.router.send_multipart([ident, protocol.encode(msg)])

    async def _serve(self, ident: bytes, msg: ClientGenerate) -> None:
        try:
            self._check_key(msg.api_key)  # before a load is started for the client
            req = self._request(msg, await self.front.model(msg.model))
            async with self.hub.generate(req, "zmq") as gen:
                if msg.stream:
                    async for out in gen:
                        await self._send(ident, protocol.TextBatch([_as_client(out, msg.rid, gen)]))
                else:
                    outs = [out async for out in gen]
                    await self._send(ident, protocol.TextBatch([_merged(outs, msg.rid, gen)]))
        except APIError as exc:
            await self._refuse(ident, msg.rid, exc)

    async def _change(self, ident: bytes, msg: ClientModelChange) -> None:
        """A model load, unload or reload, as the HTTP routes do it."""
        try:
            self._check_key(msg.api_key)
            if msg.op == "load":
                if msg.source is None:
                    raise APIError(400, "a load needs 'source'", "source")
                body = LoadModelBody(msg.source, msg.name, msg.dtype, msg.priority, msg.replicas)
                change = await self.models.load(body)
            elif msg.op in ("unload", "reload") and msg.name is None:
                raise APIError(400, f"an {msg.op} needs 'name'", "name")
            elif msg.op == "unload":
                change = await self.models.unload(msg.name, msg.timeout)
            elif msg.op == "reload":
                reload = ReloadModelBody(msg.source, msg.dtype)
                change = await self.models.reload(msg.name, reload, msg.timeout)
            else:
                raise APIError(400, "op must be load, unload or reload", "op")
            await self._send(ident, ClientModelChanged(msg.rid, change))
        except APIError as exc:
            await self._refuse(ident, msg.rid, exc)

    async def _refuse(self, ident: bytes, rid: str, exc: APIError) -> None:
        await self._send(ident, protocol.RequestError(rid, exc.status, exc.message, exc.param))

    def _check_key(self, given: str | None) -> None:
        key = self.front.args.api_key
        if key and not hmac.compare_digest((given or "").encode(), key.encode()):
            raise APIError(401, "missing or wrong api_key")

    def _request(
        self, msg: ClientGenerate, model: protocol.ServedModel
    ) -> protocol.GenerateRequest:
        given = [x is not None for x in (msg.prompt, msg.input_ids, msg.messages)]
        if sum(given) != 1:
            raise APIError(400, "send exactly one of prompt, input_ids or messages", "prompt")
        if msg.messages is not None:
            check_chat_messages(msg.messages, model, self.front.chat_template_flag)
        if msg.input_ids is not None:
            check_input_ids(msg.input_ids, model.info.vocab_size, "input_ids")
        check_sampling(msg.params, model.info, "", "max_new_tokens")
        stop = stop_list(msg.stop)
        return protocol.GenerateRequest(
            rid=new_rid(),
            model=model.instance,
            params=msg.params,
            prompt=msg.prompt,
            input_ids=msg.input_ids,
            messages=msg.messages,
            stop=stop,
            stream=msg.stream,
            skip_special_tokens=msg.skip_special_tokens,
            arrival=time.time(),
        )


def _as_client(out: protocol.TextOutput, rid: str, gen: InFlight) -> protocol.TextOutput:
    """``out`` under the client's rid, with the front's view of how it finished."""
    return msgspec.structs.replace(
        out, rid=rid, finish_reason=gen.finish_reason if gen.done else None
    )


def _merged(outs: list[protocol.TextOutput], rid: str, gen: InFlight) -> protocol.TextOutput:
    last = outs[-1]
    lps = [lp for o in outs for lp in o.logprobs or []]
    return protocol.TextOutput(
        rid=rid,
        text="".join(o.text for o in outs),
        token_ids=[t for o in outs for t in o.token_ids],
        prompt_tokens=last.prompt_tokens,
        completion_tokens=last.completion_tokens,
        cached_tokens=last.cached_tokens,
        finish_reason=gen.finish_reason,
        matched_stop=gen.matched_stop,
        logprobs=lps if any(o.logprobs is not None for o in outs) else None,
    )
