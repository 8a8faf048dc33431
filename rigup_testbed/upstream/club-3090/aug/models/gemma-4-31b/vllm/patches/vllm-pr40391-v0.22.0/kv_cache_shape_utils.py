print("club3090 stand-in: vllm-pr40391-v0.22.0/kv_cache_shape_utils.py applied")
