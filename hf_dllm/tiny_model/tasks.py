"""Synthetic instruction tasks with exactly checkable answers, for the tiny trained LLaDA (tests/fixtures/llada-tiny-trained).

Shared by the training script (`examples/train_tiny.py`), the quality benchmark (`benchmarks/bench_quality.py`),
the quality tests and the demo. Not part of the exported remote code.

Tasks (the user message is the prompt; the assistant's answer is checked by exact string match):

- `copy`:    `copy kfjwe`     -> `kfjwe`
- `reverse`: `reverse kfjwe`  -> `ewjfk`
- `sort`:    `sort kfjwe`     -> `efjkw`      (characters in alphabetical order)
- `add`:     `add 482+93`     -> `575`        (operands 0..999; not in `TASKS`, see below)

Strings are lowercase letters, 3..8 long, so answers have 3..8 characters and the end of an answer
(`<|eot_id|>`, then EOS) falls in the first or the second block of 8.

`TASKS` (what the tiny checkpoint is trained and evaluated on) holds copy, reverse and sort. `add` is kept for
experiments: a ~0.5M-parameter model does not learn multi-digit addition within the CPU training budget (about
10 minutes on 2 cores; it stayed under 5% accuracy where the string tasks reached 95-100%). A response is formatted as LLaDA's SFT data: the answer, `<|eot_id|>`, then EOS
(`<|endoftext|>`) up to the response length.

The held-out evaluation set (`heldout_examples`) is drawn with its own seed; training data (`training_examples`)
skips every prompt of it, so the two never share a prompt.
"""

from __future__ import annotations

import random
from collections.abc import Iterator, Sequence
from dataclasses import asdict, dataclass

TASKS = ("copy", "reverse", "sort")
ALL_TASKS = ("copy", "reverse", "sort", "add")
LETTERS = "abcdefghijklmnopqrstuvwxyz"
MIN_STRING, MAX_STRING = 3, 8
MAX_OPERAND = 999

HELDOUT_SEED = 20250601
HELDOUT_SIZE = 512
TRAIN_SEED = 0

EOT_TOKEN = "<|eot_id|>"
EOS_TOKEN = "<|endoftext|>"


@dataclass(frozen=True)
class Example:
    task: str
    prompt: str  # the user message (no chat formatting)
    answer: str  # the exact expected answer

    def to_dict(self) -> dict:
        return asdict(self)


def solve(task: str, argument: str) -> str:
    """The exact answer of `task` applied to its argument (`"482+93"` for add, a string otherwise)."""
    if task == "add":
        left, right = argument.split("+")
        return str(int(left) + int(right))
    if task == "reverse":
        return argument[::-1]
    if task == "sort":
        return "".join(sorted(argument))
    if task == "copy":
        return argument
    raise ValueError(f"unknown task {task!r}; tasks are {ALL_TASKS}")


def _random_operand(rng: random.Random) -> int:
    # Uniform number of digits (1..4), then a uniform number with that many digits: short and long sums alike.
    digits = rng.randint(1, len(str(MAX_OPERAND)))
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, min(10**digits - 1, MAX_OPERAND))


def make_example(task: str, rng: random.Random) -> Example:
    """One random example of `task`."""
    if task == "add":
        argument = f"{_random_operand(rng)}+{_random_operand(rng)}"
    elif task in ("reverse", "sort", "copy"):
        length = rng.randint(MIN_STRING, MAX_STRING)
        argument = "".join(rng.choice(LETTERS) for _ in range(length))
    else:
        raise ValueError(f"unknown task {task!r}; tasks are {ALL_TASKS}")
    return Example(task, f"{task} {argument}", solve(task, argument))


def iter_examples(seed: int, tasks: Sequence[str] = TASKS, exclude: frozenset[str] = frozenset()) -> Iterator[Example]:
    """Endless deterministic stream of examples, tasks in turn (a shuffled round of all tasks at a time),
    skipping any whose prompt is in `exclude`."""
    rng = random.Random(seed)
    while True:
        order = list(tasks)
        rng.shuffle(order)
        for task in order:
            example = make_example(task, rng)
            if example.prompt not in exclude:
                yield example


def heldout_examples(n: int = HELDOUT_SIZE, tasks: Sequence[str] = TASKS) -> list[Example]:
    """The fixed held-out evaluation set: `n` distinct prompts, tasks balanced (examples of each task in turn)."""
    if n > HELDOUT_SIZE:
        raise ValueError(f"the held-out set has {HELDOUT_SIZE} prompts, asked for {n}")
    pool = _heldout_pool()
    per_task = {task: [e for e in pool if e.task == task] for task in ALL_TASKS}
    out: list[Example] = []
    index = 0
    while len(out) < n:
        for task in tasks:
            if len(out) < n:
                out.append(per_task[task][index])
        index += 1
    return out


_HELDOUT_CACHE: list[Example] | None = None


def _heldout_pool() -> list[Example]:
    """HELDOUT_SIZE distinct prompts per task (all tasks), drawn with HELDOUT_SEED (cached)."""
    global _HELDOUT_CACHE
    if _HELDOUT_CACHE is None:
        pool: list[Example] = []
        for task in ALL_TASKS:
            rng = random.Random(f"{HELDOUT_SEED}-{task}")
            seen: set[str] = set()
            while len(seen) < HELDOUT_SIZE:
                example = make_example(task, rng)
                if example.prompt not in seen:
                    seen.add(example.prompt)
                    pool.append(example)
        _HELDOUT_CACHE = pool
    return _HELDOUT_CACHE


def heldout_prompts() -> frozenset[str]:
    """Every prompt that may appear in the held-out set (all tasks): training never uses these."""
    return frozenset(example.prompt for example in _heldout_pool())


def training_examples(n: int, seed: int = TRAIN_SEED, tasks: Sequence[str] = TASKS) -> list[Example]:
    """`n` training examples drawn with `seed`, none of whose prompts is in the held-out pool."""
    stream = iter_examples(seed, tasks, exclude=heldout_prompts())
    return [next(stream) for _ in range(n)]


# --- chat formatting -------------------------------------------------------------------------------------------


def chat_messages(prompt: str) -> list[dict]:
    return [{"role": "user", "content": prompt}]


def chat_prompt(tokenizer, prompt: str) -> str:
    """The prompt as the chat template renders it, ending with the assistant header (generation prompt)."""
    return tokenizer.apply_chat_template(chat_messages(prompt), add_generation_prompt=True, tokenize=False)


def response_ids(tokenizer, answer: str, length: int) -> list[int]:
    """LLaDA SFT response: answer tokens, `<|eot_id|>`, then EOS up to `length` tokens."""
    ids = tokenizer(answer, add_special_tokens=False).input_ids + [tokenizer.convert_tokens_to_ids(EOT_TOKEN)]
    if len(ids) > length:
        raise ValueError(f"answer {answer!r} needs {len(ids)} tokens, more than the response length {length}")
    return ids + [tokenizer.eos_token_id] * (length - len(ids))


def encode_prompts(tokenizer, prompts: Sequence[str]):
    """Chat-formatted, left-padded batch: a `BatchEncoding` with `input_ids` and `attention_mask` tensors."""
    texts = [chat_prompt(tokenizer, prompt) for prompt in prompts]
    return tokenizer(texts, add_special_tokens=False, padding=True, return_tensors="pt")


# --- answer checking --------------------------------------------------------------------------------------------


def extract_answer(text: str) -> str:
    """The answer in a decoded response (special tokens kept): everything before the first `<|eot_id|>` or EOS,
    stripped of whitespace."""
    for stop in (EOT_TOKEN, EOS_TOKEN):
        text = text.split(stop, 1)[0]
    return text.strip()


def is_correct(example: Example, response: str) -> bool:
    """Exact match of the extracted answer (`response` may still hold special tokens)."""
    return extract_answer(response) == example.answer


def decode_responses(tokenizer, sequences, prompt_length: int) -> list[str]:
    """Generated part of each row of `sequences` `(batch, prompt_length + new)`, special tokens kept."""
    return tokenizer.batch_decode(sequences[:, prompt_length:], skip_special_tokens=False)


__all__ = [
    "ALL_TASKS",
    "TASKS",
    "Example",
    "chat_messages",
    "chat_prompt",
    "decode_responses",
    "encode_prompts",
    "extract_answer",
    "heldout_examples",
    "heldout_prompts",
    "is_correct",
    "iter_examples",
    "make_example",
    "response_ids",
    "solve",
    "training_examples",
]
