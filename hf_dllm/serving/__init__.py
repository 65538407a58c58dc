"""`hf-dllm serve`: the OpenAI-compatible HTTP server (not exported as remote code).

`server.py` holds the app and its command, `options.py` the command's options and the defaults they print
(torch-free, for `--help`), `protocol.py` the request parsing and OpenAI error bodies,
`engine.py` the continuous-batching engine (rows join and leave a running batch at block boundaries), which
composes `admission.py` (the waiting rows and the order they join in: requests in turns), `scheduler.py` (the
grouping of running rows into layouts) and `runner.py` (each settings group's layout run and the shared K/V cache);
`layout.py` the decoding of one layout of its rows by the one block loop, `rows.py` a request as a row,
`row_cache.py` block-causal rows' K/V between blocks, `batching.py` the scheduler thread that feeds the engine
requests and turns its block updates into streamed text and results.
"""
