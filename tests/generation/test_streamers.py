"""Streamers: the prompt, then every block as soon as it is committed, then end(); drafts for diffusion streamers."""

from __future__ import annotations

from threading import Thread

import pytest
import torch
from transformers import TextDiffusionStreamer, TextIteratorStreamer, TextStreamer
from transformers.generation.streamers import BaseStreamer

from hf_dllm import plan_blocks
from tests.conftest import tiny_model

MASK, EOS = 310, 301  # reference fixture


class ForwardCounter:
    def __init__(self, model):
        self.count = 0
        self.handle = model.register_forward_pre_hook(self._hook)

    def _hook(self, module, args):
        self.count += 1

    def remove(self):
        self.handle.remove()


class Recorder(BaseStreamer):
    """Records put()/end() calls with the number of forwards made so far."""

    def __init__(self, counter: ForwardCounter):
        self.counter = counter
        self.events: list[tuple[str, torch.Tensor | None, int]] = []

    def put(self, value):
        self.events.append(("put", value.clone(), self.counter.count))

    def end(self):
        self.events.append(("end", None, self.counter.count))


class DraftRecorder(Recorder):
    def put_draft(self, value, **kwargs):
        self.events.append(("draft", value.clone(), self.counter.count))


@pytest.fixture(scope="module")
def model():
    return tiny_model()


@pytest.mark.parametrize("cache", [dict(use_cache=False), dict(use_cache=True, dual_cache=True)], ids=["none", "dual"])
def test_streamer_gets_prompt_then_each_block_when_committed_then_end(reference_model, cache):
    prompt = torch.randint(0, 300, (1, 6), generator=torch.Generator().manual_seed(0))
    counter = ForwardCounter(reference_model)
    streamer = Recorder(counter)
    try:
        out = reference_model.generate(
            prompt, max_new_tokens=20, block_length=8, steps=10, eos_early_stop=False, streamer=streamer, **cache
        )
    finally:
        counter.remove()
    plan = plan_blocks(20, 8, 10)
    kinds = [kind for kind, _, _ in streamer.events]
    assert kinds == ["put"] * (1 + len(plan)) + ["end"]
    _, first, forwards = streamer.events[0]
    assert forwards == 0 and torch.equal(first, prompt)
    done = 0
    for (offset, length, steps), (_, value, forwards) in zip(plan, streamer.events[1:-1], strict=True):
        done += min(steps, length)
        assert value.shape == (1, length)
        assert torch.equal(value, out[:, 6 + offset : 6 + offset + length])
        assert forwards == done  # sent right after the block's last forward, before the next block starts
    assert streamer.events[-1][2] == done


def test_streamer_with_a_batch_and_stopped_rows(reference_model):
    ids = torch.randint(0, 300, (2, 6), generator=torch.Generator().manual_seed(1))
    free = reference_model.generate(ids, max_new_tokens=16, block_length=8, steps=8, eos_early_stop=False)
    eos = int(free[0, 6])  # row 0 stops after its first block
    counter = ForwardCounter(reference_model)
    streamer = Recorder(counter)
    try:
        out = reference_model.generate(
            ids, max_new_tokens=16, block_length=8, steps=8, eos_token_id=eos, streamer=streamer
        )
    finally:
        counter.remove()
    puts = [value for kind, value, _ in streamer.events if kind == "put"]
    assert torch.equal(puts[0], ids)
    assert torch.equal(puts[1], out[:, 6:14]) and torch.equal(puts[2], out[:, 14:22])
    assert (puts[2][0] == eos).all()  # the stopped row shows EOS
    assert streamer.events[-1][0] == "end"


def test_put_draft_once_per_step_with_the_block_being_denoised(reference_model):
    prompt = torch.randint(0, 300, (1, 5), generator=torch.Generator().manual_seed(2))
    counter = ForwardCounter(reference_model)
    streamer = DraftRecorder(counter)
    try:
        out = reference_model.generate(
            prompt,
            max_new_tokens=12,
            block_length=8,
            threshold=0.8,
            eos_early_stop=False,
            streamer=streamer,
            return_dict_in_generate=True,
        )
    finally:
        counter.remove()
    drafts = [(value, forwards) for kind, value, forwards in streamer.events if kind == "draft"]
    assert len(drafts) == out.nfe
    assert [forwards for _, forwards in drafts] == list(range(1, out.nfe + 1))  # right after each forward
    # Events: prompt, the drafts of block 0, block 0, the drafts of block 1, block 1, end.
    kinds = [kind for kind, _, _ in streamer.events]
    first_block_drafts = kinds.index("put", 1) - 1
    assert kinds == (
        ["put"] + ["draft"] * first_block_drafts + ["put"] + ["draft"] * (out.nfe - first_block_drafts) + ["put", "end"]
    )
    block_of = [8] * first_block_drafts + [4] * (out.nfe - first_block_drafts)
    for (value, _), length in zip(drafts, block_of, strict=True):
        assert value.shape == (1, length)
    # The last draft of each block is the committed block.
    assert torch.equal(drafts[first_block_drafts - 1][0], out.sequences[:, 5:13])
    assert torch.equal(drafts[-1][0], out.sequences[:, 13:17])


def test_text_diffusion_streamer(model, char_tokenizer, capsys):
    counts = {"draft": 0}

    class Counting(TextDiffusionStreamer):
        def put_draft(self, value, **kwargs):
            counts["draft"] += 1
            assert value.shape == (1, 4)
            super().put_draft(value, **kwargs)

    prompt = char_tokenizer("Hello", return_tensors="pt").input_ids
    streamer = Counting(char_tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(
        prompt,
        max_new_tokens=12,
        block_length=4,
        eos_early_stop=False,
        streamer=streamer,
        return_dict_in_generate=True,
    )
    assert counts["draft"] == out.nfe == 12
    printed = capsys.readouterr().out
    assert char_tokenizer.decode(out.sequences[0, 5:], skip_special_tokens=True).split()[-1] in printed


@pytest.mark.parametrize("skip_prompt", [True, False])
def test_text_streamer_prints_the_generated_text(model, char_tokenizer, capsys, skip_prompt):
    prompt = char_tokenizer("Once upon", return_tensors="pt").input_ids
    streamer = TextStreamer(char_tokenizer, skip_prompt=skip_prompt, skip_special_tokens=True)
    out = model.generate(prompt, max_new_tokens=12, block_length=4, eos_early_stop=False, streamer=streamer)
    start = prompt.shape[1] if skip_prompt else 0
    expected = char_tokenizer.decode(out[0, start:], skip_special_tokens=True)
    assert capsys.readouterr().out == expected + "\n"


def test_text_iterator_streamer_in_a_thread(model, char_tokenizer):
    prompt = char_tokenizer("Tell me", return_tensors="pt").input_ids
    streamer = TextIteratorStreamer(char_tokenizer, skip_prompt=True, skip_special_tokens=True, timeout=120)
    result = {}

    def run():
        result["out"] = model.generate(
            prompt, max_new_tokens=16, block_length=4, eos_early_stop=False, streamer=streamer
        )

    thread = Thread(target=run)
    thread.start()
    text = "".join(streamer)
    thread.join(timeout=120)
    assert not thread.is_alive()
    assert text == char_tokenizer.decode(result["out"][0, prompt.shape[1] :], skip_special_tokens=True)
