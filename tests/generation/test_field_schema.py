"""One description of the generation fields (`generation_fields.GENERATION_FIELDS`), from which every application
derives its settings: `hf-dllm eval`'s and `hf-dllm generate`'s options, the server's request fields, lm-eval's
`model_args`, the exporter's options. Each application's fields are exactly the schema's, and a field a family
registers (`register_generation_fields`) appears in each of them."""

from __future__ import annotations

import argparse
import ast
import re

import pytest

import hf_dllm  # noqa: F401  (registers the families and their fields)
from hf_dllm import DiffusionGenerationConfig
from hf_dllm import generation_fields as schema
from hf_dllm.cli import generate
from hf_dllm.cli.generation_options import (
    coerce_field_values,
    flag,
    generation_arguments,
    option_fields,
    parse_field_value,
)
from hf_dllm.evaluation import evaluate
from hf_dllm.family_dream import DREAM, DREAM_FIELDS
from hf_dllm.family_llada import LLaDAFamily
from hf_dllm.generation_fields import GENERATION_FIELDS, GenerationField, register_generation_fields
from hf_dllm.hub import export, generation_settings
from hf_dllm.serving import protocol
from tests.conftest import tiny_model

# A value of each type that a command line gives as text, and what it parses to.
SAMPLES = {int: ("7", 7), float: ("0.5", 0.5), str: ("x", "x")}


def generation_actions(parser: argparse.ArgumentParser) -> dict[str, list[argparse.Action]]:
    """The parser's actions that set a generation field, by field."""
    found: dict[str, list[argparse.Action]] = {}
    for action in parser._actions:
        if action.dest in GENERATION_FIELDS:
            found.setdefault(action.dest, []).append(action)
    return found


def test_schema_describes_every_field_of_the_config():
    config = DiffusionGenerationConfig()
    assert tuple(GENERATION_FIELDS) == DiffusionGenerationConfig.field_names()
    for name, field in GENERATION_FIELDS.items():
        assert field.name == name
        # A structured value (DiffusionGemma's `sampler_config`) is no command-line option.
        assert field.type in (int, float, str, bool) or (field.type is dict and not field.option)
        default = getattr(config, name)
        assert default == field.default and (default is None or isinstance(default, field.type))
        assert all(isinstance(choice, field.type) for choice in field.choices)
        for choice in field.choices:  # every choice is a valid value of the field
            DiffusionGenerationConfig(
                **{name: choice, **({"threshold": 0.9} if choice == "confidence_threshold" else {})}
            )
        assert field.help and "\n" not in field.help
        assert not (field.special_token and field.option)
    assert schema.SPECIAL_TOKEN_FIELDS == tuple(n for n, f in GENERATION_FIELDS.items() if f.special_token)
    assert {name for name, field in GENERATION_FIELDS.items() if field.owner == "Dream"} == set(DREAM_FIELDS)
    assert DREAM.own_generation_fields == tuple(DREAM_FIELDS)


def test_the_configs_docstring_agrees_with_the_schema():
    """`DiffusionGenerationConfig`'s docstring documents the fields in prose, as `name (`type`, default)`: each type
    and default it states is the schema's."""
    documented = re.findall(r"^\s+(\w+) \(`(\w+)`(?:, ([^)]*?))?\):", DiffusionGenerationConfig.__doc__, re.M)
    assert len(documented) >= 20
    for name, type_name, default in documented:
        field = GENERATION_FIELDS[name]
        assert type_name == field.type.__name__, name
        if default:
            expected = None if default == "*optional*" else ast.literal_eval(default.strip("`"))
            assert expected == field.default, name


def assert_options_are_the_schemas(parser: argparse.ArgumentParser, extra: dict | None = None):
    """Every option field has exactly one option named after it, typed by the schema; no other field has one
    (`extra`: the app's own further flags of a field, e.g. generate's `--no-cache`)."""
    actions = generation_actions(parser)
    assert set(actions) == set(option_fields())
    base = ["MODEL", "--dataset", "d.jsonl"] if parser.prog == "hf-dllm eval" else ["MODEL", "--prompt", "p"]
    assert generation_arguments(parser.parse_args(base)) == {}
    for name, field in option_fields().items():
        own = [action for action in actions[name] if flag(name) in action.option_strings]
        assert len(own) == 1, name
        assert len(actions[name]) == 1 + len((extra or {}).get(name, ())), name
        if field.type is bool:
            assert isinstance(own[0], argparse.BooleanOptionalAction)
            assert generation_arguments(parser.parse_args([*base, "--no-" + flag(name)[2:]])) == {name: False}
            continue
        if field.choices:
            assert set(own[0].choices) == set(field.choices) | ({None} if field.none_option else set())
            value = field.choices[0]
            text = value
        else:
            text, value = SAMPLES[field.type]
        assert generation_arguments(parser.parse_args([*base, flag(name), text])) == {name: value}
        if field.none_option:
            assert generation_arguments(parser.parse_args([*base, flag(name), "none"])) == {name: None}
        else:
            with pytest.raises(SystemExit):
                parser.parse_args([*base, flag(name), "none"])


def test_eval_options_are_the_schemas():
    parser = evaluate.build_parser()
    assert_options_are_the_schemas(parser)
    args = parser.parse_args(["MODEL", "--dataset", "d.jsonl", "--gen-length", "8"])
    assert evaluate.generation_kwargs(args) == {"max_new_tokens": 8}


def test_generate_options_are_the_schemas():
    parser = generate.build_parser()
    assert_options_are_the_schemas(parser, extra={"use_cache": ("--no-cache",)})
    args = parser.parse_args(["MODEL", "--prompt", "p", "--no-cache", "--threshold", "none"])
    assert generation_arguments(args) == {"use_cache": False, "threshold": None}


def test_lm_eval_model_args_are_the_schemas():
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation import lm_eval_model

    assert set(lm_eval_model.generation_fields()) == set(option_fields()) - {"max_new_tokens"}
    # Text (model_args through Python's API) is typed as the command line types it.
    given = {"threshold": "none", "steps": "64", "remasking": "random", "use_cache": "false", "eps": "0.01"}
    assert coerce_field_values(given) == {
        "threshold": None,
        "steps": 64,
        "remasking": "random",
        "use_cache": False,
        "eps": 0.01,
    }
    assert coerce_field_values({"steps": "many"}) == {"steps": "many"}  # left for validate() to name


def test_server_request_fields_are_the_schemas():
    request = {name for name, field in GENERATION_FIELDS.items() if field.option and field.request and not field.owner}
    assert set(protocol.DLLM_FIELDS.values()) == request - {"max_new_tokens"}
    assert protocol.DLLM_FIELDS["use_dual_cache"] == "dual_cache"  # the protocol's own alias
    assert not {name for name in GENERATION_FIELDS if not GENERATION_FIELDS[name].request} & set(protocol.DLLM_FIELDS)
    # Every request field, at its default, is accepted and resolved as named (None too: `null` is None, as in
    # generate(), not "left out").
    model = tiny_model(seed=0)
    body = {name: GENERATION_FIELDS[name].default for name in protocol.DLLM_FIELDS.values()}
    params = protocol.parse_generation_params({"prompt": "a", **body}, model, chat=False)
    assert params.fields == body
    for name, field in GENERATION_FIELDS.items():
        if field.owner is None and not (field.option and field.request) and name != "max_new_tokens":
            with pytest.raises(protocol.APIError, match=f"Unrecognized request argument supplied: {name}"):
                protocol.parse_generation_params({"prompt": "a", name: field.default}, model, chat=False)


def test_exporter_options_are_the_schemas():
    parser = export.build_parser()
    actions = generation_actions(parser)
    assert set(actions) == set(generation_settings.EXPORT_FIELDS) == set(generation_settings.GENERATION_OPTIONS)
    for name, option in generation_settings.GENERATION_OPTIONS.items():
        assert actions[name][0].option_strings == [option] and option == flag(name)
    args = parser.parse_args(["SRC", "DST", "--threshold", "none", "--max-new-tokens", "64"])
    assert (args.threshold, args.max_new_tokens, args.block_length) == (None, 64, generation_settings.UNSET)
    with pytest.raises(SystemExit):
        parser.parse_args(["SRC", "DST", "--block-length", "none"])


def test_parse_field_value_errors_name_what_the_field_takes():
    with pytest.raises(ValueError, match="must be an integer or 'none', got 'x'"):
        parse_field_value(GENERATION_FIELDS["steps"], "x")
    with pytest.raises(ValueError, match="must be true or false"):
        parse_field_value(GENERATION_FIELDS["use_cache"], "maybe")


@pytest.fixture
def toy_field(monkeypatch):
    """A family's sampler field `toy_knob` (int, default 3, choices 3 and 5), registered for the test only."""
    fields = register_generation_fields(
        "Toy", [GenerationField("toy_knob", int, 3, "the toy sampler's knob", choices=(3, 5))], lambda config: None
    )
    yield fields["toy_knob"]
    del GENERATION_FIELDS["toy_knob"]
    del schema.FIELD_VALIDATORS["Toy"]


def test_a_registered_familys_field_appears_in_each_app(toy_field, monkeypatch):
    assert toy_field.owner == "Toy" and GENERATION_FIELDS["toy_knob"] is toy_field
    assert DiffusionGenerationConfig(toy_knob=5).toy_knob == 5
    assert "toy_knob" not in DiffusionGenerationConfig().to_dict()  # at its default: not saved
    for parser, base in [
        (evaluate.build_parser(), ["M", "--dataset", "d"]),
        (generate.build_parser(), ["M", "--prompt", "p"]),
    ]:
        assert generation_arguments(parser.parse_args([*base, "--toy-knob", "5"])) == {"toy_knob": 5}
        with pytest.raises(SystemExit):
            parser.parse_args([*base, "--toy-knob", "4"])  # not a choice
    pytest.importorskip("lm_eval")
    from hf_dllm.evaluation import lm_eval_model

    assert "toy_knob" in lm_eval_model.generation_fields()
    assert coerce_field_values({"toy_knob": "5"}) == {"toy_knob": 5}

    # The server takes it from a model of the family that owns it, and a family that does not refuses it.
    model = tiny_model(seed=0)
    with pytest.raises(protocol.APIError, match="Unrecognized request argument supplied: toy_knob"):
        protocol.parse_generation_params({"toy_knob": 5}, model, chat=False)

    class ToyFamily(LLaDAFamily):
        name = display_name = "Toy"
        own_generation_fields = ("toy_knob",)

    monkeypatch.setattr(type(model), "diffusion_family", property(lambda self: ToyFamily()))
    assert protocol.parse_generation_params({"toy_knob": 5}, model, chat=False).config.toy_knob == 5
    monkeypatch.undo()
    with pytest.raises(ValueError, match=r"\['toy_knob'\] are settings of Toy's sampler"):
        model.resolve_generation_config(toy_knob=5)


def test_registering_a_core_or_anothers_field_is_refused(toy_field):
    with pytest.raises(ValueError, match="DiffusionGenerationConfig's own fields"):
        register_generation_fields("Other", [GenerationField("steps", int, None, "x")], lambda config: None)
    with pytest.raises(ValueError, match="registered by Toy already"):
        register_generation_fields("Other", [GenerationField("toy_knob", int, 3, "x")], lambda config: None)
    # Registering the owner again replaces its fields.
    register_generation_fields("Toy", [GenerationField("toy_knob", int, 5, "x")], lambda config: None)
    assert GENERATION_FIELDS["toy_knob"].default == 5
