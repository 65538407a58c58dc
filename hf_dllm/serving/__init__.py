"""`hf-dllm serve`: the OpenAI-compatible HTTP server (not exported as remote code).

`server.py` holds the app and its command line, `protocol.py` the request parsing and OpenAI error bodies,
`engine.py` the continuous-batching engine (rows join and leave a running batch at block boundaries, decoded by the
one block loop), `batching.py` the scheduler thread that feeds it requests and turns its block updates into
streamed text and results.
"""
