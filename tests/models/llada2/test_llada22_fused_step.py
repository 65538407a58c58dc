"""LLaDA2.2's fused Levenshtein step (`triton_levenshtein.levenshtein_step`) on the CPU under Triton's interpreter:
bit-identical to the PyTorch step it replaces, and the fixture's tokens with it.

Two scripts side by side in one background job (the interpreter must be on before Triton compiles anything):
- `states`: random block states (`levenshtein_states.py`) at 1 and 3 rows, blocks of 8 and 32, the three
  `max_post_steps` regimes, thresholds whose float32 rounding differs from the float64 value; the block, flags,
  `edited`, every state buffer and the totals equal the PyTorch step's after each of three steps in a row, over
  states where rows delete, split, fire the anti-loop, finish (at the final cleanup too), and were finished before; and two hand-made rows
  whose anti-loop re-samples MASK at a non-original position, and the first of two tied tokens in different
  chunks of the vocabulary.
- `fixtures`: whole generations of the tiny LLaDA2.2 checkpoint with the step kernel forced on: two left-padded
  batches of four prompts without a cache (`max_post_steps` 2 and 0, DELETE / SPLIT and the anti-loop in most rows)
  with SGLang's tokens, forwards and counts per row, the candidates from PyTorch (the step is what is under test; the
  interpreted `edit_candidates` would take ten times as long); and one case alone with the exact cache with both
  kernels (`edit_candidates` too), as on CUDA.
"""

from __future__ import annotations

import importlib.util
import textwrap

import pytest

from tests.conftest import interpreter_job

STATES_SCRIPT = textwrap.dedent(
    """
    from collections import Counter
    from tests.models.llada2.levenshtein_states import compare_anti_loop_choices, compare_steps

    compare_anti_loop_choices()
    taken = Counter()
    for seed in range(2):
        for rows, length in ((1, 8), (3, 8), (1, 32), (3, 32)):
            for max_post_steps, threshold, editing_threshold in ((0, 0.7, 0.0), (2, 0.1, 0.5), (16, 0.9, 0.9)):
                taken.update(compare_steps(rows, length, max_post_steps, threshold, editing_threshold, seed))
    names = ("delete", "split", "anti_loop", "newly_finished", "final_cleanup", "finished")
    assert all(taken[name] > 5 for name in names), taken
    print("ok", dict(taken))
    """
)

FIXTURES_SCRIPT = textwrap.dedent(
    """
    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from hf_dllm import levenshtein_editing
    from hf_dllm.levenshtein_editing import LevenshteinEditing
    from tests.models.llada2.test_llada22 import CASES, GROUPS, LLADA22, assert_case, generate_kwargs, run_group

    model = AutoModelForCausalLM.from_pretrained(LLADA22, dtype=torch.float32).eval()
    expected = load_file(LLADA22 / "expected.safetensors")
    fused = {"on": True, "steps": 0}

    def forced(tensor):
        fused["steps"] += fused["on"]
        return fused["on"]

    levenshtein_editing.use_fused_kernels = forced  # the models' own kernels stay PyTorch's
    case = next(c for c in CASES if c["name"] == "p5.g32.b8.t0.5.e0.0.p2")
    prompt = expected[f"prompt.{case['prompt']}"]
    out = model.generate(prompt, **generate_kwargs(case))
    assert_case(out.sequences[0, prompt.shape[1]:], out.nfe, case, expected)
    assert fused["steps"] >= 2 * out.nfe  # every step's candidates and step

    reference_candidates = LevenshteinEditing.candidates

    def pytorch_candidates(self, logits):
        fused["on"] = False
        try:
            return reference_candidates(self, logits)
        finally:
            fused["on"] = True

    LevenshteinEditing.candidates = pytorch_candidates
    for group in ("g32.b16.t0.5.e0.0.p2", "g32.b16.t0.7.e0.0.p0"):
        fused["steps"] = 0
        run = run_group(model, expected, GROUPS[group], use_cache=False)
        totals = run.unmasking.totals()
        for name in ("deletes", "splits", "anti_loop"):
            assert totals[name] == sum(c[name] for c in GROUPS[group]) > 0, (group, name, totals)
        assert fused["steps"] >= max(int(nfe) for nfe in run.nfe_per_row), (group, fused["steps"])  # every step
    print("ok")
    """
)

INTERPRETER_RUN = interpreter_job(
    {"states": STATES_SCRIPT, "fixtures": FIXTURES_SCRIPT},
    timeout=600,
    when=lambda: importlib.util.find_spec("triton") is not None,
)


@INTERPRETER_RUN.used_by
@pytest.mark.parametrize("script", ["states", "fixtures"])
def test_fused_levenshtein_step_matches_pytorch_in_the_interpreter(script):
    pytest.importorskip("triton", reason="the `triton` extra is not installed")
    done = INTERPRETER_RUN.results()[script]
    assert done.returncode == 0 and done.stdout.startswith("ok"), done.stdout[-2000:] + done.stderr[-4000:]
