"""What the project's tiny trained model is made of (not exported as remote code): the synthetic tasks it learns
(`tasks.py`) and its character tokenizer (`char_tokenizer.py`). `examples/train_tiny.py` trains it; the demo,
tests and benchmarks use it as a small model that answers correctly."""
