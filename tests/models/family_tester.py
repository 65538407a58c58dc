"""What every model family's tests share (as transformers' `ModelTesterMixin`): a family's test module subclasses
`FamilyTester` in a class named `Test...` and sets the class attributes below; its own module keeps only what is
the family's own (its reference cases' arguments, its sampler, its kernels).

Each family is checked for:
- its reference fixture (a Hub-format checkpoint with `expected.safetensors`) loading through the Auto classes as
  the family's model, and float32 logits within 1e-4 of the recorded reference logits on every attention backend
  named in `attn_implementations`;
- on a tiny random model sized for the character tokenizer (`tiny_model`): the forward's shape and dtype, a
  save/load round trip through the Auto classes, rows of a left-padded batch equal to each prompt alone,
  `pipeline("text-generation")` batches equal to single calls, `TextIteratorStreamer`, and bad `generate()`
  arguments refused with a ValueError naming the argument before any forward;
- `hf-dllm export`: the remote-code file list is closed under relative imports (a missing or an unreached file is
  refused), the exported repo holds exactly the family's files verbatim with the source's weights and tokenizer,
  config.json is the source's with the family's `auto_map`, and another family's model card is refused.
"""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path
from typing import ClassVar

import pytest
import torch
from safetensors.torch import load_file
from transformers import AutoConfig, AutoModel, AutoModelForCausalLM, TextIteratorStreamer, pipeline

import hf_dllm
from hf_dllm.family import family_for_config
from hf_dllm.hub.export import check_remote_code, export_checkpoint
from hf_dllm.hub.families import MODEL_FAMILIES, SHARED_REMOTE_CODE_FILES, ExportError
from hf_dllm.tiny_model.char_tokenizer import build_char_tokenizer
from tests.conftest import export_to, with_remote_code_files

PACKAGE_DIR = Path(hf_dllm.__file__).parent
TOKENIZER_SAVED = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")
# generate() arguments every family refuses, and the name each error must give.
BAD_GENERATE_ARGUMENTS = [
    ({"no_such_setting": 1}, "no_such_setting"),
    ({"max_new_tokens": 0}, "max_new_tokens"),
    ({"block_length": 0}, "block_length"),
    ({"steps": -1}, "steps"),
    ({"threshold": 1.5}, "threshold"),
]


class FamilyTester:
    """Mixin of the tests every family passes. Subclasses set:

    - `family`: the family's name in `hf_dllm.family.FAMILIES` (and `hf_dllm.hub.families.MODEL_FAMILIES`);
    - `model_class`, `config_class`: what the Auto classes must give;
    - `fixture`: the reference fixture folder (config.json, model.safetensors, expected.safetensors);
    - `remote_code_head`: the family's own files, which the exported file list starts with (the shared ones follow);
    - `unreached_file`: a package file no module of the family imports (exporting it must be refused);
    - `other_card`, `other_card_family`: a model card preset of another family and that family's display name;
    - `generate_settings`: `generate()` arguments valid for the family (blocks of 4, a few tokens);
    - `tiny_model(seed)`: a random model of the family sized for the character tokenizer (vocabulary 103, mask 3,
      EOS/pad 0, BOS 1), in eval mode.
    """

    family: ClassVar[str]
    model_class: ClassVar[type]
    config_class: ClassVar[type]
    fixture: ClassVar[Path]
    remote_code_head: ClassVar[tuple[str, ...]]
    unreached_file: ClassVar[str] = "configuration_dream.py"
    other_card: ClassVar[str] = "dream-v0-instruct-7b"
    other_card_family: ClassVar[str] = "Dream"
    attn_implementations: ClassVar[tuple[str, ...]] = ("sdpa", "eager")
    generate_settings: ClassVar[dict] = dict(max_new_tokens=12, block_length=4, threshold=0.6)
    # Fields a fixture's config.json needs set before it can be exported (export refuses a token id outside the
    # vocabulary: a Hub LLaDA2 config names no mask token, so the class default, the full model's, applies).
    export_config_fields: ClassVar[dict] = {}

    @staticmethod
    def tiny_model(seed: int = 0):
        raise NotImplementedError

    def reference_inputs(self, expected: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
        """The forward's arguments for the fixture's recorded logits (`logits.input_ids` unless overridden)."""
        return {"input_ids": expected["logits.input_ids"]}

    # --- fixtures (one per class: the families' tests share nothing mutable) -------------------------------------

    @pytest.fixture(scope="class")
    def fixture_model(self):
        return self.model_class.from_pretrained(self.fixture).eval()

    @pytest.fixture(scope="class")
    def expected(self) -> dict[str, torch.Tensor]:
        return load_file(self.fixture / "expected.safetensors")

    @pytest.fixture(scope="class")
    def tiny(self):
        return self.tiny_model(seed=0)

    @pytest.fixture(scope="class")
    def checkpoint(self, tmp_path_factory, tiny) -> Path:
        """`tiny` saved as a Hub checkpoint would be: config.json, weights and the character tokenizer."""
        path = tmp_path_factory.mktemp(f"{self.family}-src") / f"{self.family}-chat"
        tiny.save_pretrained(path)
        build_char_tokenizer().save_pretrained(path)
        (path / "generation_config.json").unlink(missing_ok=True)
        return path

    @pytest.fixture(scope="class")
    def exported(self, tmp_path_factory, checkpoint) -> Path:
        return export_to(tmp_path_factory, f"{self.family}-exported", checkpoint)

    # --- the reference fixture -----------------------------------------------------------------------------------

    def test_fixture_loads_through_the_auto_classes(self):
        config = AutoConfig.from_pretrained(self.fixture)
        assert type(config) is self.config_class
        assert family_for_config(json.loads((self.fixture / "config.json").read_text())).name == self.family
        for auto in (AutoModel, AutoModelForCausalLM):
            model = auto.from_pretrained(self.fixture)
            assert type(model) is self.model_class and model.diffusion_family.name == self.family
        state = model.state_dict()
        stored = load_file(self.fixture / "model.safetensors")
        assert set(stored) <= set(state) and all(torch.equal(state[key], value) for key, value in stored.items())

    def test_logits_match_the_reference(self, fixture_model, expected):
        for attn_implementation in self.attn_implementations:
            fixture_model.set_attn_implementation(attn_implementation)
            try:
                with torch.no_grad():
                    logits = fixture_model(**self.reference_inputs(expected)).logits
            finally:
                fixture_model.set_attn_implementation("sdpa")
            assert logits.dtype == torch.float32, attn_implementation
            torch.testing.assert_close(logits, expected["logits.expected"], atol=1e-4, rtol=0, msg=attn_implementation)

    # --- a tiny random model ---------------------------------------------------------------------------------------

    def test_forward_shape_and_dtype(self, tiny):
        ids = torch.randint(4, 100, (2, 7), generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            logits = tiny(input_ids=ids, attention_mask=torch.ones_like(ids)).logits
        assert logits.shape == (2, 7, tiny.config.vocab_size) and logits.dtype == torch.float32
        assert torch.isfinite(logits).all()

    def test_save_and_load_round_trip(self, tiny, tmp_path):
        tiny.save_pretrained(tmp_path)
        loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
        assert type(loaded) is self.model_class
        assert loaded.generation_config.to_dict() == tiny.generation_config.to_dict()
        state = tiny.state_dict()
        assert all(torch.equal(value, state[key]) for key, value in loaded.state_dict().items())
        prompt = torch.tensor([[1, 40, 41, 42, 43]])
        assert torch.equal(
            loaded.generate(prompt, **self.generate_settings), tiny.generate(prompt, **self.generate_settings)
        )

    def test_left_padded_rows_equal_each_prompt_alone(self, tiny):
        prompts = [[1, 30, 31], [1, 50, 51, 52, 53, 54]]  # different offsets inside a block of 4
        width = max(map(len, prompts))
        ids = torch.tensor([[0] * (width - len(p)) + p for p in prompts])
        mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        batch = tiny.generate(ids, attention_mask=mask, **self.generate_settings)
        for row, prompt in enumerate(prompts):
            alone = tiny.generate(torch.tensor([prompt]), **self.generate_settings)
            assert batch[row, width:].tolist() == alone[0, len(prompt) :].tolist(), row

    def test_pipeline_batches_equal_single_calls(self, tiny, char_tokenizer):
        pipe = pipeline("text-generation", model=tiny, tokenizer=char_tokenizer)
        prompts = ["Hi", "Good morning, world", "abc"]
        batched = pipe(prompts, batch_size=3, **self.generate_settings)
        singles = [pipe(prompt, **self.generate_settings) for prompt in prompts]
        assert [b[0]["generated_text"] for b in batched] == [s[0]["generated_text"] for s in singles]
        encoded = char_tokenizer("abc", return_tensors="pt")
        out = tiny.generate(**encoded, **self.generate_settings)
        expected = "abc" + char_tokenizer.decode(out[0, encoded.input_ids.shape[1] :], skip_special_tokens=True)
        assert singles[2][0]["generated_text"] == expected

    def test_text_iterator_streamer(self, tiny, char_tokenizer):
        encoded = char_tokenizer("Hello", return_tensors="pt")
        streamer = TextIteratorStreamer(char_tokenizer, skip_prompt=True, skip_special_tokens=True)
        out = tiny.generate(**encoded, streamer=streamer, **self.generate_settings)
        text = char_tokenizer.decode(out[0, encoded.input_ids.shape[1] :], skip_special_tokens=True)
        assert "".join(streamer) == text

    def test_bad_generate_arguments_are_refused_before_any_forward(self, tiny):
        def no_forward(*_):
            raise AssertionError("a forward ran before the arguments were checked")

        hook = tiny.get_input_embeddings().register_forward_pre_hook(no_forward)
        try:
            prompt = torch.tensor([[1, 40, 41]])
            for kwargs, name in BAD_GENERATE_ARGUMENTS:
                with pytest.raises(ValueError, match=name):
                    tiny.generate(prompt, **kwargs)
            with pytest.raises(ValueError, match="input_ids"):
                tiny.generate(prompt.float(), max_new_tokens=4)
        finally:
            hook.remove()

    # --- hf-dllm export ------------------------------------------------------------------------------------------

    def test_remote_code_is_closed(self):
        files = MODEL_FAMILIES[self.family].remote_code_files
        head = self.remote_code_head
        assert files[: len(head)] == head and files[len(head) :] == SHARED_REMOTE_CODE_FILES
        assert check_remote_code(family=self.family) == [PACKAGE_DIR / name for name in files]
        assert {entry.split(".")[0] + ".py" for entry in MODEL_FAMILIES[self.family].auto_map.values()} <= set(files)

    @pytest.mark.parametrize("change", ["missing", "unreached"])
    def test_remote_code_list_must_be_closed(self, monkeypatch, change):
        files = MODEL_FAMILIES[self.family].remote_code_files
        if change == "missing":  # a file the model's imports reach is left out
            files, message = tuple(name for name in files if name != "graphs.py"), r"relative imports of \['graphs'\]"
        else:  # a file no auto_map module reaches is put in
            files, message = (*files, self.unreached_file), f"{self.unreached_file} not reached by relative imports"
        with_remote_code_files(monkeypatch, self.family, files)
        with pytest.raises(ExportError, match=message):
            check_remote_code(family=self.family)

    def test_export_contents(self, exported, checkpoint):
        files = MODEL_FAMILIES[self.family].remote_code_files
        names = {path.name for path in exported.iterdir()}
        assert names == {"model.safetensors", "config.json", "generation_config.json", "README.md"} | {
            *TOKENIZER_SAVED,
            *files,
        }
        for name in files:  # verbatim copies, never edited
            assert (exported / name).read_bytes() == (PACKAGE_DIR / name).read_bytes(), name
        for name in ("model.safetensors", *TOKENIZER_SAVED):  # copies, not links (without --link)
            assert (exported / name).read_bytes() == (checkpoint / name).read_bytes(), name
            assert (exported / name).stat().st_ino != (checkpoint / name).stat().st_ino, name

    def test_exported_config_is_the_source_config_with_the_family_auto_map(self, tmp_path):
        src = tmp_path / "src"
        shutil.copytree(self.fixture, src)
        source = {**json.loads((self.fixture / "config.json").read_text()), **self.export_config_fields}
        (src / "config.json").write_text(json.dumps(source))
        export_checkpoint(src, tmp_path / "out", tokenizer=False)  # a reference fixture has no tokenizer
        config = json.loads((tmp_path / "out" / "config.json").read_text())
        assert config["auto_map"] == MODEL_FAMILIES[self.family].auto_map
        assert config["auto_map"]["AutoModelForCausalLM"].endswith(f".{self.model_class.__name__}")
        assert config["architectures"] == [self.model_class.__name__]
        others = ("auto_map", "architectures")
        assert {k: v for k, v in config.items() if k not in others} == {
            k: v for k, v in source.items() if k not in others
        }
        assert (tmp_path / "out" / "config.json").read_text() == json.dumps(config, indent=2, sort_keys=True) + "\n"

    def test_card_of_another_family_is_refused(self, checkpoint, tmp_path):
        display = MODEL_FAMILIES[self.family].display_name
        with pytest.raises(
            ExportError, match=rf"describes a {self.other_card_family} model .* SRC is a {re.escape(display)}"
        ):
            export_checkpoint(checkpoint, tmp_path / "out", card=self.other_card)
        assert not (tmp_path / "out").exists()
