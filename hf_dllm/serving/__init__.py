"""`hf-dllm serve`: the OpenAI-compatible HTTP server (not exported as remote code).

`server.py` holds the app and its command line, `protocol.py` the request parsing and OpenAI error bodies,
`batching.py` the scheduler that turns concurrent requests into batched `generate_blocks()` runs and consumes
their block events.
"""
