"""`hf-dllm export`: turn a local checkpoint into a Hub repo that runs hf_dllm's flat files as remote code, with a
model card (not exported itself)."""
