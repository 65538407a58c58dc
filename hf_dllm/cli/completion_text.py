"""The text of a completion, cut where it ends: one implementation of stop tokens, `max_tokens` and stop strings
for every entry point that returns text (`hf-dllm serve`, `hf-dllm eval`, `hf-dllm lm-eval`).

A row's committed blocks arrive in order (`BlockEvent`s of the generation loop); `CompletionText.extend` appends
them and says whether the completion is over, so the caller can stop the row (no more forwards). A stop found in a
committed block is final: later blocks only append text.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

EOT_TOKEN = "<|eot_id|>"


def stop_token_ids(generation_config, tokenizer=None) -> set[int]:
    """Ids that end a completion: the generation config's EOS ids and EOT id, and the tokenizer's EOS and LLaDA's
    `<|eot_id|>` when the tokenizer has them."""
    ids = set(generation_config.eos_token_ids)
    if generation_config.eot_token_id is not None:
        ids.add(generation_config.eot_token_id)
    if tokenizer is not None:
        if tokenizer.eos_token_id is not None:
            ids.add(tokenizer.eos_token_id)
        eot = tokenizer.get_vocab().get(EOT_TOKEN)
        if eot is not None:
            ids.add(eot)
    return ids


def held_back(text: str, stops: Sequence[str]) -> int:
    """Characters at the end of `text` that a stream must hold back: a possible start of a stop string, or a
    partial multi-byte character (decoded as U+FFFD)."""
    hold = 0
    for stop in stops:
        for n in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:n]):
                hold = n
                break
    while hold < len(text) and text[len(text) - hold - 1] == "\ufffd":
        hold += 1
    return hold


class CompletionText:
    """One row's completion as its tokens arrive: cut at the first stop token, at `max_tokens` tokens and at the
    first stop string.

    Attributes after each `extend`: `text` (special tokens removed), `completion_tokens` (tokens before the cut),
    `finish_reason` (`None` while open, `"stop"` for a stop token or stop string, `"length"` for `max_tokens`),
    `stop_string_found` (the cut is a stop string's).
    """

    def __init__(self, tokenizer, stop_ids: Iterable[int], stops: Sequence[str] = (), max_tokens: int | None = None):
        self.tokenizer = tokenizer
        self.stop_ids = set(stop_ids)
        self.stops = tuple(stop for stop in stops if stop)
        self.max_tokens = max_tokens
        self.tokens: list[int] = []
        self.text = ""
        self.completion_tokens = 0
        self.finish_reason: str | None = None
        self.stop_string_found = False

    def _decode(self, tokens: list[int]) -> str:
        return self.tokenizer.decode(tokens, skip_special_tokens=True)

    def extend(self, tokens: Iterable[int]) -> bool:
        """Append committed tokens (ignored once the completion is over); returns whether it is over."""
        if self.finish_reason is not None:
            return True
        for token in tokens:
            if self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
                self.finish_reason = "length"
                break
            if token in self.stop_ids:
                self.finish_reason = "stop"
                break
            self.tokens.append(int(token))
        if self.finish_reason is None and self.max_tokens is not None and len(self.tokens) >= self.max_tokens:
            self.finish_reason = "length"
        text = self._decode(self.tokens)
        self.completion_tokens = len(self.tokens)
        cut = min((i for i in (text.find(stop) for stop in self.stops) if i >= 0), default=-1)
        if cut >= 0:
            text = text[:cut]
            self.finish_reason = "stop"
            self.stop_string_found = True
            self.completion_tokens = self._count_tokens_of(text)
        self.text = text
        return self.finish_reason is not None

    def streamable(self) -> int:
        """Characters of `text` that are final and may be sent now."""
        return len(self.text) if self.finish_reason is not None else len(self.text) - held_back(self.text, self.stops)

    def _count_tokens_of(self, text: str) -> int:
        """Largest k such that the first k tokens decode to no more than `text` (the tokens before a stop string)."""
        low, high = 0, len(self.tokens)
        while low < high:
            mid = (low + high + 1) // 2
            if len(self._decode(self.tokens[:mid])) <= len(text):
                low = mid
            else:
                high = mid - 1
        return low


def completion_text(tokenizer, tokens: Sequence[int], stop_ids: Iterable[int], stops: Sequence[str] = ()) -> str:
    """The text of a finished row's generated tokens (the whole `CompletionText` at once)."""
    completion = CompletionText(tokenizer, stop_ids, stops)
    completion.extend(tokens)
    return completion.text
