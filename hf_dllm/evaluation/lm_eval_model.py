"""lm-evaluation-harness model `hf_dllm`: masked-diffusion LMs through hf_dllm's `generate()`.

    hf-dllm lm-eval --model hf_dllm --model_args pretrained=DIR,threshold=0.9,block_length=32,gen_length=256 \
        --tasks gsm8k

- `generate_until`: batched runs (prompts sorted by length, left-padded) consumed block by block: each row's
  committed tokens feed the shared `CompletionText` (`hf_dllm.cli.completion_text`), which cuts the text at the
  first stop token or `until` string; a row whose completion is over is stopped (no more forwards).
- Settings: a request's generation_kwargs > `model_args` > the checkpoint's generation_config.json > the library's
  defaults, each layer resolved by `model.resolve_generation_config` (a request's decoding rule replaces the
  model_args' one; `do_sample: false` means temperature 0). `max_gen_toks` becomes `max_new_tokens` unless
  `gen_length` / `max_new_tokens` is given in `model_args` (the canvas, as in LLaDA's evaluation); with neither,
  the checkpoint's `max_new_tokens` holds.
- `loglikelihood`: LLaDA's Monte-Carlo estimate (`hf_dllm.evaluation.likelihood`), `mc_num` samples per request,
  `mc_batch_size` (default `batch_size`) rows per forward; `is_check_greedy=True` also runs LLaDA's greedy check.
- `loglikelihood_rolling`: the same estimate over disjoint windows of `max_length` tokens (a lower bound).
- Data parallel: `accelerate launch -m hf_dllm.evaluation.lm_eval_model --model hf_dllm ...` (one model replica
  per process; lm-eval shards the requests by rank). `device_map=auto` instead splits one model over the visible GPUs.

`model_args`: `pretrained` (or LLaDA's `model_path`), `tokenizer`, `dtype` (`auto`, `bfloat16`, ...), `device`,
`device_map`, `trust_remote_code`, `revision`, `attn_implementation`, `threads`, `quantization` (the loading flags
of `hf-dllm eval`, through the same `hf_dllm.cli.loading.load_model`), `batch_size`, `mc_num` (128),
`mc_batch_size`, `is_check_greedy` (False), `cfg` / `cfg_scale`, `add_bos_token` (True), `max_length` (the
model's context: its family's `context_length`, e.g. LLaDA's `max_sequence_length`, LLaDA-MoE's and Dream's
`max_position_embeddings`; 4096 when the config names none), `seed`, `gen_length` / `max_new_tokens`, and every
other field of `DiffusionGenerationConfig` (`threshold`, `factor`, `block_length`, `steps`, `use_cache`,
`dual_cache`, `temperature`, `remasking`, ...; for LLaDA2.x also
`minimal_topk`, `editing_threshold`, `max_post_steps`, `num_to_transfer`, and `steps` with `threshold`; for Dream
its sampler's `alg`, `alg_temp`, `top_p`, `top_k`, `eps`, also in a task's generation_kwargs).
LLaDA2.x (block-causal) models run `generate_until` tasks; the log-likelihood estimator is LLaDA's, for
bidirectional models only (a block-causal model raises `NotImplementedError` naming the alternative).

Registration, through lm-eval's own registry (`lm_eval.api.registry.register_model`, its documented way for models
defined outside lm-eval): importing this module registers `hf_dllm`. lm-eval discovers no plugins (0.4.13: no entry
points are read; EleutherAI/lm-evaluation-harness#3282), so lm-eval's bare `lm_eval` command does not know the name;
`hf-dllm lm-eval ARGS` and `python -m hf_dllm.evaluation.lm_eval_model ARGS` are lm-eval's command line with it
registered (exactly `lm_eval`'s arguments; `accelerate launch -m hf_dllm.evaluation.lm_eval_model ARGS` for several
processes), and `import hf_dllm.evaluation.lm_eval_model` before `lm_eval.simple_evaluate(model="hf_dllm", ...)` in
Python. lm-eval records the `git describe` of the working directory in its results; outside a git checkout git
printed `fatal: not a git repository` on every run: the registration also silences that git's stderr
(`quiet_git_hash`; the recorded value is unchanged).

The tiny trained model's tasks ship with the package (`hf_dllm/tiny_model/lm_eval_tasks`: `tiny_synthetic_gen`,
`tiny_synthetic_mc`, built offline from its held-out examples): `docs/evaluation.md` has a command that runs them.
"""

from __future__ import annotations

import functools
import logging
import os
import sys

import torch
from lm_eval.api.model import LM
from lm_eval.api.registry import register_model
from tqdm import tqdm

from ..cli.completion_text import CompletionText, stop_token_ids
from ..cli.generation_options import coerce_field_values, option_fields
from ..cli.loading import DEFAULT_THREADS, load_model, parse_dtype
from ..generation_utils import DiffusionGenerationConfig, left_pad
from .data import process_state
from .likelihood import greedy_matches, mc_loglikelihood

MODEL_NAME = "hf_dllm"
logger = logging.getLogger(__name__)


def generation_fields() -> tuple[str, ...]:
    """The generation fields a user may set in model_args or in a task's generation_kwargs: the settings of
    `hf-dllm eval`'s options (`option_fields()`, those of registered families included), but `max_new_tokens`, which
    is `DiffusionEvalLM`'s own argument (with its name in LLaDA's evaluation, `gen_length`)."""
    return tuple(name for name in option_fields() if name != "max_new_tokens")


# Autoregressive sampling options lm-eval tasks may carry; meaningless for block diffusion, ignored with a warning.
_IGNORED_REQUEST_KWARGS = ("top_p", "top_k", "min_p", "num_beams", "repetition_penalty", "typical_p", "seed")


def _positive_int(name: str, value, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, str) and value.startswith("auto"):
        logger.warning("%s=%s: automatic batch sizes are not supported by hf_dllm; using %d.", name, value, default)
        return default
    value = int(value)
    if value < 1:
        raise ValueError(f"{name} must be >= 1, got {value}.")
    return value


class DiffusionEvalLM(LM):
    """lm-eval `LM` for hf_dllm masked-diffusion models (LLaDA, ...). See the module docstring for `model_args`."""

    def __init__(
        self,
        pretrained=None,
        model_path=None,
        tokenizer=None,
        dtype="auto",
        device=None,
        device_map=None,
        trust_remote_code: bool = False,
        revision: str | None = None,
        attn_implementation: str | None = None,
        threads: int | None = DEFAULT_THREADS,
        quantization: str = "none",
        batch_size=1,
        max_batch_size=None,
        mc_num: int = 128,
        mc_batch_size=None,
        is_check_greedy: bool = False,
        cfg=None,
        add_bos_token: bool = True,
        max_length: int | None = None,
        seed: int = 1234,
        gen_length: int | None = None,
        max_new_tokens: int | None = None,
        **generation_kwargs,
    ):
        super().__init__()
        from transformers import PreTrainedModel

        accepted = generation_fields()
        unknown = sorted(set(generation_kwargs) - set(accepted))
        if unknown:
            raise ValueError(
                f"hf_dllm: unknown model_args {unknown}. Accepted: pretrained, model_path, tokenizer, dtype, device, "
                "device_map, trust_remote_code, revision, attn_implementation, threads, quantization, batch_size, "
                "mc_num, "
                "mc_batch_size, is_check_greedy, cfg, add_bos_token, max_length, seed, gen_length, max_new_tokens "
                f"and the generation fields {sorted(accepted)}."
            )
        # Typed as the command line's options (text given through Python's API: `threshold="none"`, `steps="64"`).
        generation_kwargs = coerce_field_values(generation_kwargs)
        if gen_length is not None and max_new_tokens is not None and int(gen_length) != int(max_new_tokens):
            raise ValueError(
                f"hf_dllm: gen_length ({gen_length}) and max_new_tokens ({max_new_tokens}) are the same setting; "
                "give one."
            )
        pretrained = pretrained if pretrained is not None else model_path
        if pretrained is None:
            raise ValueError("hf_dllm needs `pretrained=PATH_OR_HUB_ID` in model_args.")

        state = process_state(device)
        self._state = state
        self._rank, self._world_size = state.process_index, state.num_processes
        if state.num_processes > 1:
            device = str(state.device)  # one replica per process, on the device accelerate assigned
        elif device is not None and str(device).startswith("cuda") and not torch.cuda.is_available():
            # lm-eval passes its own default (`cuda:0`) when the user names no device.
            logger.warning("device=%s requested but CUDA is not available: using the CPU.", device)
            device = "cpu"

        # The loading model_args are `hf-dllm eval`'s loading flags, under the same names, with the same errors.
        if isinstance(pretrained, PreTrainedModel):
            from transformers import AutoTokenizer

            from ..cli.loading import resolve_device, set_threads

            set_threads(threads)
            parse_dtype(dtype, flag="dtype")
            self.model = pretrained.eval()
            if device_map is None:
                self.model.to(resolve_device(device))
            if tokenizer is None or isinstance(tokenizer, str):
                tokenizer = AutoTokenizer.from_pretrained(
                    tokenizer or pretrained.name_or_path, trust_remote_code=trust_remote_code, revision=revision
                )
        else:
            self.model, tokenizer = load_model(
                pretrained,
                tokenizer=tokenizer,
                dtype=parse_dtype(dtype, flag="dtype"),
                device=device,
                device_map=device_map,
                attn_implementation=attn_implementation,
                revision=revision,
                trust_remote_code=trust_remote_code,
                threads=threads,
                num_processes=state.num_processes,
                quantization=quantization,
            )
        self.tokenizer = tokenizer
        self._device = self.model.get_input_embeddings().weight.device

        # Settings: a request's generation_kwargs > model_args > the checkpoint's generation_config.json > the
        # library's defaults, each layer resolved by the model's one resolver (validated before any request).
        if cfg is not None:
            generation_kwargs.setdefault("cfg_scale", float(cfg))
        length = gen_length if gen_length is not None else max_new_tokens
        self.gen_length = int(length) if length is not None else None
        if self.gen_length is not None:
            generation_kwargs["max_new_tokens"] = self.gen_length
        self.base_config = self.model.resolve_generation_config(**generation_kwargs)

        self.batch_size = _positive_int("batch_size", batch_size, 1)
        self.mc_num = _positive_int("mc_num", mc_num, 128)
        self.mc_batch_size = _positive_int("mc_batch_size", mc_batch_size, self.batch_size)
        self.is_check_greedy = bool(is_check_greedy)
        self.cfg_scale = float(self.base_config.cfg_scale)
        self.add_bos_token = bool(add_bos_token)
        self.seed = int(seed)
        # The family names its config's context field (dense LLaDA's `max_sequence_length`, the others'
        # `max_position_embeddings`), as generate() and the server read it: prompts are cut to fit what generate()
        # accepts, and log-likelihood windows span the whole context (lm-eval's HFLM reads the config the same way).
        context = self.model.diffusion_family.context_length(self.model.config)
        self.max_length = int(max_length or context or 4096)
        self._warned: set[str] = set()

    # ------------------------------------------------------------------ lm-eval plumbing

    @property
    def device(self):
        return self._device

    def all_gather(self, tensor):
        if self.world_size <= 1:
            return tensor
        from accelerate.utils import gather

        return gather(tensor)

    def gather_object(self, obj, dst=0):
        if self.world_size <= 1:
            return [obj]
        result = [None] * self.world_size if self.rank == dst else None
        torch.distributed.gather_object(obj=obj, object_gather_list=result, dst=dst)
        return result

    def barrier(self) -> None:
        if self.world_size > 1:
            self._state.wait_for_everyone()

    @property
    def tokenizer_name(self) -> str:
        return str(self.tokenizer.name_or_path).replace("/", "__")

    def chat_template(self, chat_template: bool | str = False) -> str | None:
        if chat_template is False or chat_template is None:
            return None
        if isinstance(chat_template, str):
            return chat_template
        return self.tokenizer.chat_template

    def apply_chat_template(self, chat_history: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        return self.tokenizer.apply_chat_template(
            chat_history,
            tokenize=False,
            add_generation_prompt=add_generation_prompt,
            continue_final_message=not add_generation_prompt,
        )

    # ------------------------------------------------------------------ tokens

    @property
    def _bos(self) -> int | None:
        bos = self.tokenizer.bos_token_id
        return bos if bos is not None else self.base_config.bos_token_id

    def tok_encode(self, text: str, add_bos: bool | None = None) -> list[int]:
        """Token ids of `text`, with the BOS token in front (once) when `add_bos_token`."""
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        add_bos = self.add_bos_token if add_bos is None else add_bos
        if add_bos and self._bos is not None and (not ids or ids[0] != self._bos):
            ids = [self._bos] + ids
        return ids

    def _encode_pair(self, context: str, continuation: str) -> tuple[list[int], list[int]]:
        # Trailing spaces of the context belong to the continuation (lm-eval's convention).
        spaces = len(context) - len(context.rstrip())
        if spaces:
            context, continuation = context[:-spaces], context[-spaces:] + continuation
        whole = self.tok_encode(context + continuation)
        context_ids = self.tok_encode(context)
        return context_ids, whole[len(context_ids) :]

    def _stop_ids(self) -> set[int]:
        return stop_token_ids(self.base_config, self.tokenizer)

    def _warn_once(self, message: str) -> None:
        if message not in self._warned:
            self._warned.add(message)
            logger.warning(message)

    # ------------------------------------------------------------------ generate_until

    def _request_settings(self, gen_kwargs: dict) -> tuple[list[str], dict]:
        """A request's stop sequences and the generation fields it names (laid over `base_config`)."""
        gen_kwargs = dict(gen_kwargs or {})
        until = gen_kwargs.pop("until", None) or []
        until = [until] if isinstance(until, str) else list(until)
        if not all(isinstance(stop, str) for stop in until):
            raise ValueError(f"hf_dllm: `until` must be a string or a list of strings, got {until!r}.")
        fields = {}
        max_gen_toks = gen_kwargs.pop("max_gen_toks", None)
        # gen_length / max_new_tokens in model_args (the user's choice of the canvas, as in LLaDA's evaluation) >
        # the task's max_gen_toks > the checkpoint's max_new_tokens.
        if max_gen_toks is not None and self.gen_length is None:
            fields["max_new_tokens"] = max_gen_toks
        # lm-eval's `do_sample: false` means greedy decoding whatever the temperature (transformers' rule), i.e.
        # temperature 0 here; the resolver derives do_sample from a temperature.
        if gen_kwargs.get("do_sample") is False:
            gen_kwargs["temperature"] = 0.0
        accepted = generation_fields()
        for key in list(gen_kwargs):
            if key in accepted or key == "do_sample":
                fields[key] = gen_kwargs.pop(key)
            elif key in _IGNORED_REQUEST_KWARGS:
                gen_kwargs.pop(key)
                self._warn_once(f"hf_dllm: generation option {key!r} has no meaning for block diffusion; ignored.")
        if gen_kwargs:
            raise ValueError(
                f"hf_dllm: unknown generation_kwargs {sorted(gen_kwargs)}; accepted: until, max_gen_toks, do_sample, "
                f"temperature and {sorted(accepted)}."
            )
        return until, coerce_field_values(fields)

    def request_config(self, fields: dict) -> DiffusionGenerationConfig:
        """The settings of a request naming `fields`: the model's resolver over `base_config` (model_args >
        checkpoint > defaults), so a request's decoding rule replaces the model_args' one; validated."""
        return self.model.resolve_generation_config(self.base_config, **fields)

    def generate_until(self, requests, disable_tqdm: bool = False) -> list[str]:
        if not requests:
            return []
        jobs = []  # (index, prompt ids, until, fields key)
        configs: dict[tuple, DiffusionGenerationConfig] = {}
        for index, request in enumerate(requests):
            context, gen_kwargs = request.args
            until, fields = self._request_settings(gen_kwargs)
            key = tuple(sorted(fields.items()))
            if key not in configs:  # every request's settings are checked before the first forward
                config = configs[key] = self.request_config(fields)
                if self.max_length - config.max_new_tokens < 1:
                    raise ValueError(
                        f"max_new_tokens ({config.max_new_tokens}) leaves no room for the prompt within "
                        f"max_length ({self.max_length})."
                    )
            jobs.append((index, self.tok_encode(context), until, key))
        groups: dict[tuple, list] = {}
        for job in jobs:
            groups.setdefault(job[3], []).append(job)

        results: list[str | None] = [None] * len(requests)
        progress = tqdm(total=len(requests), desc="hf_dllm generate_until", disable=disable_tqdm or self.rank != 0)
        for key, group in groups.items():
            config = configs[key]
            room = self.max_length - config.max_new_tokens
            group.sort(key=lambda job: (-len(job[1]), job[0]))
            for start in range(0, len(group), self.batch_size):
                batch = group[start : start + self.batch_size]
                prompts = [job[1][-room:] for job in batch]
                texts = self._generate_batch(prompts, [job[2] for job in batch], config)
                for job, text in zip(batch, texts, strict=True):
                    results[job[0]] = text
                    self.cache_hook.add_partial("generate_until", requests[job[0]].args, text)
                progress.update(len(batch))
        progress.close()
        return results

    def _generate_batch(self, prompts: list[list[int]], untils: list[list[str]], config) -> list[str]:
        """The texts of one batch: the run's committed blocks feed each row's `CompletionText` (cut at the first
        stop token or `until` string); rows whose completion is over are stopped (no more forwards)."""
        from .evaluate import generate_completions

        input_ids, attention_mask = left_pad(prompts, config.prompt_pad_token_id)
        stop_ids = self._stop_ids()
        completions = [CompletionText(self.tokenizer, stop_ids, until) for until in untils]
        generate_completions(self.model, input_ids.to(self.device), attention_mask.to(self.device), config, completions)
        return [completion.text for completion in completions]

    # ------------------------------------------------------------------ loglikelihood

    def _loglikelihood_pairs(self, pairs: list[tuple[list[int], list[int]]], disable_tqdm: bool) -> list[float]:
        scored = [i for i, (_, continuation) in enumerate(pairs) if continuation]
        trimmed = []
        for i in scored:
            context, continuation = pairs[i]
            continuation = continuation[-self.max_length :]
            context = context[-(self.max_length - len(continuation)) :] if len(continuation) < self.max_length else []
            trimmed.append((context, continuation))
        progress = tqdm(
            total=len(trimmed) * self.mc_num, desc="hf_dllm loglikelihood", disable=disable_tqdm or self.rank != 0
        )
        estimates = mc_loglikelihood(
            self.model,
            trimmed,
            num_samples=self.mc_num,
            batch_size=self.mc_batch_size,
            mask_token_id=self.base_config.mask_token_id,
            pad_token_id=self.base_config.pad_token_id,
            cfg_scale=self.cfg_scale,
            seed=self.seed,
            progress=progress.update,
        )
        progress.close()
        values = [0.0] * len(pairs)
        for i, estimate in zip(scored, estimates, strict=True):
            values[i] = estimate
        return values

    def loglikelihood(self, requests, disable_tqdm: bool = False) -> list[tuple[float, bool]]:
        if not requests:
            return []
        pairs = [self._encode_pair(*request.args) for request in requests]
        values = self._loglikelihood_pairs(pairs, disable_tqdm)
        if self.is_check_greedy:
            scored = [i for i, (_, c) in enumerate(pairs) if c]
            matches = greedy_matches(
                self.model, [pairs[i] for i in scored], batch_size=self.batch_size, cfg_scale=self.cfg_scale
            )
            greedy = [True] * len(pairs)
            for i, match in zip(scored, matches, strict=True):
                greedy[i] = match
        else:
            greedy = [False] * len(pairs)
        results = []
        for request, value, is_greedy in zip(requests, values, greedy, strict=True):
            results.append((value, bool(is_greedy)))
            self.cache_hook.add_partial("loglikelihood", request.args, (value, bool(is_greedy)))
        return results

    def loglikelihood_rolling(self, requests, disable_tqdm: bool = False) -> list[float]:
        """Sum of Monte-Carlo estimates over disjoint windows of at most `max_length` tokens, each conditioned on
        the tokens before it (a lower bound of the document's log-likelihood, as every estimate here is)."""
        from lm_eval.utils import get_rolling_token_windows, make_disjoint_window

        prefix = self._bos if self._bos is not None else (self.base_config.eos_token_ids or [0])[0]
        windows, owners = [], []
        for index, request in enumerate(requests):
            (text,) = request.args[:1]
            tokens = self.tok_encode(text, add_bos=False)
            for window in get_rolling_token_windows(tokens, prefix, self.max_length, 1):
                windows.append(make_disjoint_window(window))
                owners.append(index)
        values = self._loglikelihood_pairs(windows, disable_tqdm)
        totals = [0.0] * len(requests)
        for owner, value in zip(owners, values, strict=True):
            totals[owner] += value
        for request, total in zip(requests, totals, strict=True):
            self.cache_hook.add_partial("loglikelihood_rolling", request.args, total)
        return totals


def main(argv: list[str] | None = None) -> int:
    """lm-eval's command line with the `hf_dllm` model registered: takes exactly `lm_eval`'s arguments."""
    import importlib

    importlib.import_module(
        "hf_dllm.evaluation.lm_eval_model"
    )  # registers the model even when this file runs as __main__
    from lm_eval.__main__ import cli_evaluate

    sys.argv = ["lm_eval", *(sys.argv[1:] if argv is None else argv)]
    cli_evaluate()
    return 0


def quiet_git_hash(get_git_commit_hash):
    """lm-eval's `get_git_commit_hash` (`git describe --always` in the working directory, else a hash read from
    `.git`) with git's stderr discarded: outside a checkout git prints `fatal: not a git repository`, which lm-eval
    leaves on the terminal though it handles the failure. Same return value."""

    @functools.wraps(get_git_commit_hash)
    def quiet():
        sys.stderr.flush()
        saved = os.dup(2)
        try:
            with open(os.devnull, "w") as devnull:
                os.dup2(devnull.fileno(), 2)
                return get_git_commit_hash()
        finally:
            os.dup2(saved, 2)
            os.close(saved)

    quiet.quiet_git = True
    return quiet


def register() -> None:
    """Register `hf_dllm` with lm-eval's model registry (idempotent) and quiet its git call."""
    import lm_eval.evaluator

    try:
        register_model(MODEL_NAME)(DiffusionEvalLM)
    # Already registered with another class object (a reloaded module); a placeholder is upgraded, not an error.
    except (ValueError, AttributeError) as error:
        logger.debug("hf_dllm: lm-eval registration skipped: %s", error)
    if not getattr(lm_eval.evaluator.get_git_commit_hash, "quiet_git", False):
        lm_eval.evaluator.get_git_commit_hash = quiet_git_hash(lm_eval.evaluator.get_git_commit_hash)


if __name__ != "__main__":
    register()


if __name__ == "__main__":
    sys.exit(main())
