"""`hf-dllm serve MODEL`: an OpenAI-compatible HTTP server for masked-diffusion LMs, batched and streaming.

    pip install "hf-dllm[serve]"
    hf-dllm serve path/to/checkpoint --port 8000 --max-batch-size 16

Endpoints: `GET /v1/models`, `POST /v1/completions`, `POST /v1/chat/completions` (the tokenizer's chat
template), `GET /health` (status and batching counters).

Request fields: OpenAI's `model`, `prompt` / `messages`, `max_tokens` (chat: also `max_completion_tokens`),
`temperature`, `stream`, `stream_options.include_usage`, `stop` (strings; the text is cut before the first one
and the row stops decoding), `n` (1 only), `user` (ignored). dLLM fields, e.g. through the openai client's
`extra_body`: `steps`, `block_length`, `threshold`, `factor`, `use_cache`, `dual_cache` (alias
`use_dual_cache`), `remasking`, `cfg_scale`, `eos_early_stop`, for LLaDA2.x (block-causal) models
`minimal_topk`, `editing_threshold`, `max_post_steps`, `num_to_transfer`, and for models with a sampler of their own
its fields (its family's `own_generation_fields`; Dream: `alg`, `alg_temp`, `top_p`, `top_k`, `eps`).

Defaults: the server has none of its own. A request's settings are `model.resolve_generation_config(**the fields
it named)`: what it leaves out comes from the checkpoint's `generation_config.json`, then from
`DiffusionGenerationConfig`'s defaults, exactly as for `model.generate()` without that keyword (`temperature` sets
`do_sample`; naming `steps`, `threshold` or `factor` replaces the checkpoint's decoding rule). The resolver
validates them for the served model (LLaDA2 combines `steps` with `threshold`, LLaDA refuses it); an invalid value
is an HTTP 400 naming the request's field. Without `max_tokens` a prompt decodes the resolved `max_new_tokens`, so
a request with no dLLM field gets the tokens and NFE of `model.generate(prompt)`. With `max_tokens`, a LLaDA model
decodes it rounded up to whole blocks and cuts the completion back to it; a LLaDA2.x model decodes it as it is (its
blocks are aligned to absolute positions, the last one decoded whole), with the stop tokens (EOS and EOT) as its
EOS. The completion is the decoded text cut at the first EOS/EOT token, at a stop string, or after max_tokens
tokens, whichever comes first; the row then stops decoding (after its block).
`usage.completion_tokens` counts the returned tokens; `usage.nfe` (and `choices[i].nfe`) counts the model
forwards each prompt took part in: the run's `nfe_per_row` for the row when it ended, which is what
`generate(...).nfe_per_row` gives for the prompt alone (for a row stopped early by a stop string: up to that stop).

Batching (`batching.py`, `engine.py`): continuous. Up to `--max-batch-size` rows decode at once; a request joins
the running batch at the next block boundary (no waiting for a batch to finish) and each row leaves as soon as it
ends (EOS, stop string, `max_tokens`, disconnect), its place taken at the next boundary. Rows whose settings differ
only in `max_new_tokens` share a layout; other settings groups decode in turn at each boundary. A bidirectional
model's layout holding more than `--max-refresh-positions` positions (off by default) decodes in slices, and a
request that arrives meanwhile joins the slices still to decode (its wait is one slice, not the whole batch's
refresh). A layout is at most
`--max-batch-width` columns (each row's prompt and output, aligned at its current block; the K/V cache holds
`max-batch-size x max-batch-width` positions, twice for block-causal models (LLaDA2.x), whose rows keep their exact
K/V between blocks: `row_cache.py`). On a small CPU, `--threads 1` keeps OpenMP threads from spinning
against each other.
Model loading takes the flags every command shares (`--dtype`, `--device`, `--device-map`,
`--attn-implementation`, `--revision`, `--trust-remote-code`, `--tokenizer`, `--threads`).

Streaming sends one Server-Sent Event per committed block, then a chunk with `finish_reason`, then `data: [DONE]`.
Usage comes once: in the last `finish_reason` chunk, or, with `stream_options.include_usage`, only in a final chunk
with no choices (OpenAI's format). A client that disconnects stops its row at the next block boundary; its
batch partners decode on.

Hostile input (issue #15): `--api-key KEY` (or `$HF_DLLM_API_KEY`) makes every route but /health need
`Authorization: Bearer KEY` (401). JSON endpoints need `Content-Type: application/json` (415), so that a web page
cannot post to a local server without a CORS preflight; CORS is off unless `--allowed-origins` names origins.
Bodies over `--max-body-bytes` (default 64 bytes per context token, at least 4 MiB) get 413 unread. Parsing,
validation and tokenizing run in a small worker pool, never on the event loop; `max_tokens`, `block_length` and
`steps` are checked against the context before anything is planned, and a prompt longer in characters than the
context's tokens can cover is refused before it is tokenized. Every malformed request gets an OpenAI-style 4xx on
a connection that stays open; only a fault of the server is a 5xx. Limits under hostile use (issue #66,
docs/limits.md): a request's head must arrive within `--header-timeout` seconds and its body within
`--body-timeout` seconds after it, else 408 and the connection is closed (`deadlines.py`); a client that leaves
mid-body is logged at INFO; a request holds at most `--max-prompts-per-request` prompts, admitted in turns with
other requests' rows; chat roles are those the template renders and a message `name` is OpenAI's pattern; stop
strings are at most 16, of at most 512 characters.

Tensor parallelism: `torchrun --nproc-per-node N -m hf_dllm serve MODEL --tp-plan auto` shards the model over N
GPUs; rank 0 serves HTTP and the other ranks decode the same layouts in lockstep (`serving/tensor_parallel.py`).

fastapi and uvicorn are imported only here (the `serve` extra), so `import hf_dllm` never needs them.
"""

import asyncio
import gc
import hmac
import json
import logging
import os
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from contextlib import asynccontextmanager, contextmanager

from ..cli.completion_text import stop_token_ids
from ..cli.loading import load_model, model_arguments
from .batching import Batcher, RowRequest
from .deadlines import deadline_protocol
from .engine import ContinuousBatcher
from .options import API_KEY_ENV, BODY_BYTES_PER_CONTEXT_TOKEN, MAX_PROMPTS, MIN_MAX_BODY_BYTES, build_parser
from .protocol import (
    APIError,
    chat_roles,
    check_plan,
    check_prompt_chars,
    convert_messages,
    encode_prompts,
    longest_token_chars,
    parse_generation_params,
    parse_json_body,
    render_chat,
    split_prompts,
)

logger = logging.getLogger("hf_dllm.serve")

# Paths served without the API key (load balancers' health checks).
OPEN_PATHS = frozenset({"/health"})


def default_max_body_bytes(max_length: int | None) -> int:
    return max(MIN_MAX_BODY_BYTES, BODY_BYTES_PER_CONTEXT_TOKEN * (max_length or 0))


class Server:
    """The model, its tokenizer and batcher, and the request handling behind the routes."""

    def __init__(
        self,
        model,
        tokenizer,
        model_name: str,
        max_batch_size: int | None = None,
        max_batch_width: int | None = None,
        max_body_bytes: int | None = None,
        engine=None,
        max_prompts: int = MAX_PROMPTS,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.model_name = model_name
        self.created = int(time.time())
        self.base_config = model.generation_config
        # Each prompt is planned as generate() plans it (`check_plan`: block-causal models split `steps` over the
        # blocks of each prompt, which depend on its length).
        self.family = model.diffusion_family
        self.vocab_size = model.get_input_embeddings().weight.shape[0]
        self.max_length = self.family.context_length(model.config)
        self.max_body_bytes = max_body_bytes or default_max_body_bytes(self.max_length)
        self.max_chars_per_token = longest_token_chars(tokenizer)
        self.max_prompts = max_prompts
        self.chat_roles = chat_roles(tokenizer)
        # JSON parsing, chat templates and tokenization run here, off the event loop: a large request then delays
        # only itself, never /health or the other clients' streams.
        self.pool = ThreadPoolExecutor(max_workers=2, thread_name_prefix="hf-dllm-tokenize")
        self.batcher = Batcher(
            model,
            tokenizer,
            stop_token_ids=stop_token_ids(model.generation_config, tokenizer),
            max_batch_size=max_batch_size,
            max_batch_width=max_batch_width,
            engine=engine,
        )

    # -- request handling -------------------------------------------------------------------------------------
    def _check_model(self, body: dict) -> None:
        model = body.get("model")
        if model is not None and model != self.model_name:
            raise APIError(
                404,
                f"The model `{model}` does not exist. This server serves `{self.model_name}`.",
                param="model",
                code="model_not_found",
            )

    def _rows(self, prompts: list[list[int]], params, sink, param: str) -> list[RowRequest]:
        bos = self.base_config.bos_token_id
        mask = self.base_config.mask_token_id
        rows, request_id = [], uuid.uuid4().hex  # one id for the request's rows: they are admitted in turns
        for index, ids in enumerate(prompts):
            if not ids:
                if bos is None:
                    raise APIError(400, "The prompt is empty.", param=param)
                ids = [bos]
            if mask is not None and mask in ids:
                # generate() would refuse it, failing every other request batched with this one.
                raise APIError(
                    400,
                    f"The prompt holds the model's mask token (id {mask}, {self.tokenizer.convert_ids_to_tokens(mask)!r}), "
                    "which only the server may place.",
                    param=param,
                )
            check_plan(self.family, len(ids), params)
            total = len(ids) + params.config.max_new_tokens
            if self.max_length is not None and total > self.max_length:
                raise APIError(
                    400,
                    f"This model's maximum context length is {self.max_length} tokens. The prompt has {len(ids)} "
                    f"tokens and decoding max_tokens={params.max_tokens} takes "
                    f"{params.config.max_new_tokens} positions: {total} in all.",
                    param=param,
                    code="context_length_exceeded",
                )
            rows.append(
                RowRequest(
                    ids,
                    params.config,
                    params.max_tokens,
                    sink,
                    stop=params.stop,
                    stream=params.stream,
                    index=index,
                    request_id=request_id,
                )
            )
        return rows

    async def off_loop(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self.pool, function, *args)

    async def prepare(self, raw: bytes, chat: bool, sink) -> tuple[list[RowRequest], object]:
        """Parse, validate and tokenize a request body, in `pool`: nothing proportional to the body's size runs on
        the event loop, so a large request delays only itself (and the requests queued behind it in the pool)."""
        return await self.off_loop(self.prepare_now, raw, chat, sink)

    def prepare_now(self, raw: bytes, chat: bool, sink) -> tuple[list[RowRequest], object]:
        """`prepare` in the calling thread. Every check that needs no tokens (fields, lengths against the context,
        the prompt's characters) runs before anything is tokenized."""
        body = parse_json_body(raw)
        self._check_model(body)
        params = parse_generation_params(body, self.model, chat, self.max_length)
        budget = None if self.max_length is None else self.max_length - params.config.max_new_tokens
        if chat:
            param = "messages"
            messages = convert_messages(body.get("messages"), self.chat_roles)
            # The template only adds text: the messages alone must already fit (checked again once rendered).
            chars = sum(len(message["role"]) + len(message["content"]) for message in messages)
            check_prompt_chars(chars, budget, self.max_chars_per_token, param, self.max_length)
            text = render_chat(messages, self.tokenizer)
            check_prompt_chars(len(text), budget, self.max_chars_per_token, param, self.max_length)
            prompts = [list(self.tokenizer(text, add_special_tokens=False)["input_ids"])]
        else:
            param = "prompt"
            if body.get("prompt") is None:
                raise APIError(400, "`prompt` is required.", param="prompt")
            items = split_prompts(body["prompt"], self.vocab_size, self.max_prompts)
            for item in items:
                if isinstance(item, str):
                    check_prompt_chars(len(item), budget, self.max_chars_per_token, param, self.max_length)
            prompts = encode_prompts(items, self.tokenizer)
        return self._rows(prompts, params, sink, param), params

    async def collect(self, rows: list[RowRequest], queue: asyncio.Queue, request) -> dict | None:
        """Wait for every row's result; None if the client went away (its rows are cancelled)."""
        results = {}
        self.batcher.submit(rows)
        try:
            while len(results) < len(rows):
                try:
                    event = await asyncio.wait_for(queue.get(), timeout=1.0)
                except asyncio.TimeoutError:
                    if await request.is_disconnected():
                        return None
                    continue
                if event[0] == "done":
                    results[event[1]] = event[2]
                elif event[0] == "error":
                    raise APIError(event[2], event[3])
            return results
        finally:
            if len(results) < len(rows):
                self._cancel(rows)

    def _cancel(self, rows: list[RowRequest]) -> None:
        for row in rows:
            row.cancelled.set()
        self.batcher.notify()

    @staticmethod
    def usage(results) -> dict:
        prompt = sum(r.prompt_tokens for r in results)
        completion = sum(r.completion_tokens for r in results)
        return {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
            "nfe": sum(r.nfe for r in results),
        }

    def response(self, results: dict, chat: bool, response_id: str) -> dict:
        ordered = [results[i] for i in sorted(results)]
        if chat:
            choices = [
                {
                    "index": i,
                    "message": {"role": "assistant", "content": r.text},
                    "logprobs": None,
                    "finish_reason": r.finish_reason,
                    "nfe": r.nfe,
                }
                for i, r in enumerate(ordered)
            ]
        else:
            choices = [
                {"index": i, "text": r.text, "logprobs": None, "finish_reason": r.finish_reason, "nfe": r.nfe}
                for i, r in enumerate(ordered)
            ]
        return {
            "id": response_id,
            "object": "chat.completion" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": None,
            "choices": choices,
            "usage": self.usage(ordered),
        }

    async def stream(
        self, rows: list[RowRequest], queue: asyncio.Queue, chat: bool, response_id: str, include_usage: bool
    ):
        """Server-Sent Events: one chunk per committed block per prompt, a finish chunk per prompt, [DONE]. Usage is
        sent once: in the last finish chunk, or with `include_usage` (OpenAI's) in a chunk of its own with no
        choices, after every finish chunk."""
        created = int(time.time())
        kind = "chat.completion.chunk" if chat else "text_completion"

        def chunk(index: int, text: str | None, finish_reason: str | None, first: bool, usage=None) -> str:
            if chat:
                delta = {} if text is None else {"content": text}
                if first:
                    delta = {"role": "assistant", **delta}
                choice = {"index": index, "delta": delta, "logprobs": None, "finish_reason": finish_reason}
            else:
                choice = {"index": index, "text": text or "", "logprobs": None, "finish_reason": finish_reason}
            body = {
                "id": response_id,
                "object": kind,
                "created": created,
                "model": self.model_name,
                "system_fingerprint": None,
                "choices": [choice],
            }
            if usage is not None:
                body["usage"] = usage
            return f"data: {json.dumps(body)}\n\n"

        results = {}
        started: set[int] = set()
        completed = False
        try:
            self.batcher.submit(rows)
            while len(results) < len(rows):
                event = await queue.get()
                index = event[1]
                if event[0] == "delta":
                    yield chunk(index, event[2], None, index not in started)
                    started.add(index)
                elif event[0] == "done":
                    results[index] = event[2]
                    last = len(results) == len(rows)
                    usage = self.usage(results.values()) if last and not include_usage else None
                    if index not in started:  # chat: the role comes first
                        yield chunk(index, "", None, True)
                        started.add(index)
                    yield chunk(index, None, event[2].finish_reason, False, usage)
                else:
                    error = APIError(event[2], event[3])
                    yield f"data: {json.dumps(error.body())}\n\n"
                    break
            if include_usage and len(results) == len(rows):
                body = {
                    "id": response_id,
                    "object": kind,
                    "created": created,
                    "model": self.model_name,
                    "choices": [],
                    "usage": self.usage(results.values()),
                }
                yield f"data: {json.dumps(body)}\n\n"
            yield "data: [DONE]\n\n"
            completed = len(results) == len(rows)
        finally:
            if not completed:
                self._cancel(rows)


class AccessGuard:
    """ASGI middleware: with an API key, every route but `OPEN_PATHS` needs `Authorization: Bearer KEY` (401
    otherwise), checked before anything of the request is read."""

    def __init__(self, app, api_key: str):
        self.app = app
        self.api_key = api_key.encode()

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and scope["path"] not in OPEN_PATHS and not self._authorized(scope):
            given = any(name == b"authorization" for name, _ in scope["headers"])
            error = APIError(
                401,
                "Incorrect API key provided."
                if given
                else "You didn't provide an API key: send it in an "
                "Authorization header using Bearer auth (Authorization: Bearer YOUR_KEY).",
                code="invalid_api_key",
            )
            await send_json(send, error.status, error.body(), [(b"www-authenticate", b"Bearer")])
            return
        await self.app(scope, receive, send)

    def _authorized(self, scope) -> bool:
        for name, value in scope["headers"]:
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                # compare_digest: the time taken does not tell an attacker how much of the key was right.
                return scheme.lower() == b"bearer" and hmac.compare_digest(token.strip(), self.api_key)
        return False


async def send_json(send, status: int, body: dict, headers: list[tuple[bytes, bytes]] = ()) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                *headers,
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})


_serving_apps = 0  # apps inside `frozen_heap`
_serving_apps_lock = threading.Lock()


@contextmanager
def frozen_heap():
    """While any app serves: Python's objects of that time (the model, torch, transformers, the app) frozen
    (`gc.freeze`), so that a full garbage collection no longer walks them. A collection holds the GIL and so stops
    the scheduler thread mid-boundary: 0.41 s once on an H100 under load (LLaDA2.0-mini shape,
    `benchmarks/bench_load.py`). vLLM freezes its heap after start-up for the same reason. Unfrozen when the
    last app stops (tests start several in one process)."""
    global _serving_apps
    with _serving_apps_lock:
        if _serving_apps == 0:
            gc.collect()
            gc.freeze()
        _serving_apps += 1
    try:
        yield
    finally:
        with _serving_apps_lock:
            _serving_apps -= 1
            if _serving_apps == 0:
                gc.unfreeze()


def create_app(
    model,
    tokenizer,
    model_name: str = "model",
    max_batch_size: int | None = None,
    max_batch_width: int | None = None,
    api_key: str | None = None,
    allowed_origins: list[str] | None = None,
    max_body_bytes: int | None = None,
    engine=None,
    max_prompts: int = MAX_PROMPTS,
):
    """The FastAPI app serving `model`; its batcher starts and stops with the app (lifespan).

    `api_key`: every route but /health needs `Authorization: Bearer API_KEY`. `allowed_origins`: the browser
    origins CORS lets call the API (`["*"]` for any); none by default, so a web page cannot read the answers.
    `max_body_bytes`: larger request bodies get 413 unread (default `default_max_body_bytes`). `engine`: the
    batching engine, when the caller makes it (`engine.ContinuousBatcher` with other options, e.g.
    `join_layout_min_rows`; tensor parallelism: `serving.tensor_parallel.MirroredEngine`); it then has its own
    limits, and `max_batch_size` / `max_batch_width` are not used. `max_prompts`: prompts one /v1/completions
    request may hold (400 past it). Read deadlines are the HTTP protocol's (`deadlines.deadline_protocol`).
    """
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, Response, StreamingResponse
    from starlette.exceptions import HTTPException
    from starlette.middleware.cors import CORSMiddleware
    from starlette.requests import ClientDisconnect

    if not isinstance(max_prompts, int) or isinstance(max_prompts, bool) or max_prompts < 1:
        raise ValueError(f"`max_prompts` must be an integer >= 1, got {max_prompts!r}.")
    server = Server(
        model, tokenizer, model_name, max_batch_size, max_batch_width, max_body_bytes, engine, max_prompts=max_prompts
    )

    @asynccontextmanager
    async def lifespan(app):
        with frozen_heap():
            server.batcher.start()
            try:
                yield
            finally:
                server.batcher.stop()
                server.pool.shutdown(wait=False, cancel_futures=True)

    app = FastAPI(title="hf-dllm", lifespan=lifespan)
    app.state.server = server
    # Added last = outermost: CORS answers browsers' preflights, then the key is checked.
    if api_key:
        app.add_middleware(AccessGuard, api_key=api_key)
    if allowed_origins:
        app.add_middleware(
            CORSMiddleware,
            allow_origins=list(allowed_origins),
            allow_methods=["GET", "POST"],
            allow_headers=["Authorization", "Content-Type"],
        )

    @app.exception_handler(APIError)
    async def api_error(request, error: APIError):
        return JSONResponse(error.body(), status_code=error.status)

    @app.exception_handler(HTTPException)
    async def http_error(request, error: HTTPException):
        return JSONResponse(APIError(error.status_code, str(error.detail)).body(), status_code=error.status_code)

    @app.exception_handler(RequestValidationError)
    async def validation_error(request, error: RequestValidationError):
        return JSONResponse(APIError(400, str(error)).body(), status_code=400)

    @app.exception_handler(Exception)
    async def server_error(request, error: Exception):
        logger.exception("request failed")
        return JSONResponse(APIError(500, f"Internal server error: {error}").body(), status_code=500)

    async def read_body(request: Request) -> bytes:
        """The raw body of a JSON request: 415 unless it says it is JSON (a browser sends `text/plain` or no type
        cross-origin without asking first), 413 past `max_body_bytes` (before reading it, when Content-Length
        says so; else as soon as the bytes read pass it). `Server.prepare` parses it."""
        content_type = request.headers.get("content-type", "")
        if content_type.split(";")[0].strip().lower() != "application/json":
            raise APIError(
                415,
                f"Content-Type must be application/json, got {content_type or 'none'}.",
                code="unsupported_media_type",
            )
        limit = server.max_body_bytes
        too_large = APIError(
            413, f"The request body is larger than this server's limit of {limit} bytes.", code="request_too_large"
        )
        length = request.headers.get("content-length")
        if length is not None and length.isdigit() and int(length) > limit:
            raise too_large
        chunks, size = [], 0
        try:
            async for chunk in request.stream():
                size += len(chunk)
                if size > limit:
                    raise too_large
                chunks.append(chunk)
        except ClientDisconnect:
            # The client left, or missed the body deadline (answered 408 by the protocol): nothing to answer, and
            # nothing went wrong here (no traceback).
            logger.info("the client of %s went away while sending its body (%d bytes read)", request.url.path, size)
            raise APIError(400, "The client disconnected while sending the request body.") from None
        return b"".join(chunks)

    async def generate(request: Request, chat: bool):
        try:
            return await handle_generate(request, chat)
        except APIError:
            raise
        except Exception as error:
            # Answered here rather than by the last-resort handler, which closes the client's connection.
            logger.exception("request failed")
            raise APIError(500, f"Internal server error: {type(error).__name__}.") from error

    async def handle_generate(request: Request, chat: bool):
        raw = await read_body(request)
        queue: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()

        def sink(event):
            try:
                loop.call_soon_threadsafe(queue.put_nowait, event)
            except RuntimeError:  # the event loop is closed (shutdown)
                pass

        rows, params = await server.prepare(raw, chat, sink)
        response_id = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        if params.stream:
            return StreamingResponse(
                server.stream(rows, queue, chat, response_id, params.include_usage),
                media_type="text/event-stream",
                headers={"Cache-Control": "no-cache"},
            )
        results = await server.collect(rows, queue, request)
        if results is None:
            return Response(status_code=499)
        return server.response(results, chat, response_id)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, chat=False)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, chat=True)

    def model_card() -> dict:
        return {"id": server.model_name, "object": "model", "created": server.created, "owned_by": "hf-dllm"}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{model_id:path}")
    async def model(model_id: str):
        server._check_model({"model": model_id})
        return model_card()

    @app.get("/health")
    async def health():
        return {
            "status": "ok",
            "model": server.model_name,
            "max_batch_size": server.batcher.max_batch_size,
            "max_batch_width": server.batcher.max_batch_width,
            "max_batch_positions": server.batcher.max_batch_positions,
            "batching": server.batcher.stats.snapshot(),
        }

    return app


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        import uvicorn
    except ImportError:
        print("hf-dllm serve needs fastapi and uvicorn: pip install 'hf-dllm[serve]'", file=sys.stderr)
        return 2
    limits = (args.max_batch_size, args.max_batch_width, args.max_batch_positions)
    if any(value is not None and value < 1 for value in limits):
        print(
            "hf-dllm serve: --max-batch-size, --max-batch-width and --max-batch-positions must be >= 1.",
            file=sys.stderr,
        )
        return 2
    if args.max_body_bytes is not None and args.max_body_bytes < 1:
        print("hf-dllm serve: --max-body-bytes must be >= 1.", file=sys.stderr)
        return 2
    if args.max_prompts_per_request < 1:
        print("hf-dllm serve: --max-prompts-per-request must be >= 1.", file=sys.stderr)
        return 2
    try:
        protocol = deadline_protocol(args.header_timeout, args.body_timeout)
    except ValueError as error:
        flag = "--header-timeout" if "header_timeout" in str(error) else "--body-timeout"
        print(f"hf-dllm serve: {flag} must be a number of seconds > 0.", file=sys.stderr)
        return 2
    origins = [origin.strip() for origin in (args.allowed_origins or "").split(",") if origin.strip()]
    api_key = args.api_key or os.environ.get(API_KEY_ENV) or None
    logging.basicConfig(level=args.log_level.upper(), format="%(levelname)s %(name)s: %(message)s")
    try:
        model, tokenizer = load_model(args.model, **model_arguments(args))
    except (FileNotFoundError, OSError, ValueError) as error:
        print(f"hf-dllm serve: cannot load {args.model!r}: {error}", file=sys.stderr)
        return 2
    engine_options = dict(
        max_batch_size=args.max_batch_size,
        max_batch_width=args.max_batch_width,
        max_batch_positions=args.max_batch_positions,
        join_layout_min_rows=args.join_layout_min_rows,
        max_refresh_positions=args.max_refresh_positions,
    )
    try:
        if args.tp_plan is not None:
            # Tensor parallel: rank 0 serves HTTP; the other ranks decode the same layouts (tensor_parallel.py).
            from .tensor_parallel import MirroredEngine, control_group

            engine = MirroredEngine(model, control_group(), **engine_options)
        else:
            engine = ContinuousBatcher(model, **engine_options)
    except ValueError as error:  # an engine option this model does not take
        print(f"hf-dllm serve: {error}", file=sys.stderr)
        return 2
    if args.tp_plan is not None and not engine.leader:
        engine.follow()
        return 0
    name = args.served_model_name or os.path.basename(os.path.normpath(args.model))
    app = create_app(
        model,
        tokenizer,
        model_name=name,
        api_key=api_key,
        allowed_origins=origins,
        max_body_bytes=args.max_body_bytes,
        engine=engine,
        max_prompts=args.max_prompts_per_request,
    )
    if not api_key and args.host not in ("127.0.0.1", "localhost", "::1"):
        logger.warning(
            "Serving on %s without an API key: anyone who reaches this port can use the model. Pass --api-key "
            "(or set %s), and put a TLS proxy in front.",
            args.host,
            API_KEY_ENV,
        )
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level, http=protocol)
    return 0
