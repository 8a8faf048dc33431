print("club3090 stand-in: gemma-4-26b-a4b vllm-pr40391-v0.22.0/kv_cache_shape_utils.py applied")
