"""`hf-dllm eval` and `hf-dllm lm-eval` (not exported as remote code).

`evaluate.py` is the dataset evaluation command, `data.py` its dataset reading and answer scoring,
`likelihood.py` LLaDA's Monte-Carlo log-likelihood, `lm_eval_model.py` the lm-evaluation-harness model.
"""
